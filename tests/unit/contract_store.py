"""The coordination-store contract. Every adapter's test class inherits it.

A subclass supplies two fixtures: ``store`` (a fresh, empty store) and ``advance``
(a callable that lets ``seconds`` of lease time pass: a fake clock for the memory
store, real sleeping for a real server).
"""

from __future__ import annotations

import threading
import time

import pytest

from pdps.core.errors import FencingError, LeaseExpired
from pdps.ports.coordination import Compare, Delete, EventType, Op, Put


def wait_until(predicate, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


class StoreContract:
    # --- get / put / delete / range ---------------------------------------------------

    def test_get_missing_is_none(self, store):
        assert store.get("/a") is None

    def test_put_then_get(self, store):
        rev = store.put("/a", b"1")
        kv = store.get("/a")
        assert kv.value == b"1" and kv.key == "/a" and kv.mod_revision == rev

    def test_revision_increases_on_every_write(self, store):
        r1 = store.put("/a", b"1")
        r2 = store.put("/a", b"2")
        r3 = store.put("/b", b"3")
        assert r1 < r2 < r3
        assert store.get("/a").mod_revision == r2

    def test_delete(self, store):
        store.put("/a", b"1")
        assert store.delete("/a") is True
        assert store.get("/a") is None
        assert store.delete("/a") is False

    def test_range_is_sorted_and_prefix_bounded(self, store):
        for k in ["/j/b", "/j/a", "/j/c/d", "/k/a", "/j"]:
            store.put(k, k.encode())
        assert [kv.key for kv in store.range("/j/")] == ["/j/a", "/j/b", "/j/c/d"]
        assert store.range("/none/") == []

    def test_delete_prefix(self, store):
        for k in ["/j/a", "/j/b", "/k/a"]:
            store.put(k, b"x")
        assert store.delete_prefix("/j/") == 2
        assert [kv.key for kv in store.range("/")] == ["/k/a"]

    def test_binary_values_roundtrip(self, store):
        blob = bytes(range(256)) * 4
        store.put("/bin", blob)
        assert store.get("/bin").value == blob

    # --- transactions -----------------------------------------------------------------

    def test_put_if_absent(self, store):
        assert store.commit((Compare.absent("/a"),), (Put("/a", b"1"),)).succeeded
        assert not store.commit((Compare.absent("/a"),), (Put("/a", b"2"),)).succeeded
        assert store.get("/a").value == b"1"

    def test_compare_and_set_on_revision(self, store):
        rev = store.put("/a", b"1")
        assert not store.commit((Compare.revision("/a", Op.EQ, rev - 1),), (Put("/a", b"x"),)).succeeded
        assert store.get("/a").value == b"1"
        assert store.commit((Compare.revision("/a", Op.EQ, rev),), (Put("/a", b"2"),)).succeeded
        assert store.get("/a").value == b"2"

    def test_recreated_key_has_new_revision(self, store):
        rev = store.put("/a", b"1")
        store.delete("/a")
        store.put("/a", b"1")
        assert not store.commit((Compare.revision("/a", Op.EQ, rev),), (Put("/a", b"x"),)).succeeded

    def test_compare_value(self, store):
        store.put("/a", b"v1")
        assert store.commit((Compare.value("/a", Op.EQ, b"v1"),), (Put("/b", b"ok"),)).succeeded
        assert not store.commit((Compare.value("/a", Op.EQ, b"v2"),), (Put("/c", b"no"),)).succeeded
        assert store.get("/c") is None
        assert not store.commit((Compare.value("/missing", Op.EQ, b""),), (Put("/c", b"no"),)).succeeded

    def test_failure_branch_runs_instead(self, store):
        store.put("/a", b"1")
        res = store.commit((Compare.absent("/a"),), (Put("/s", b"1"),), (Put("/f", b"1"),))
        assert not res.succeeded
        assert store.get("/s") is None and store.get("/f").value == b"1"

    def test_transaction_is_atomic_across_keys(self, store):
        res = store.commit((), (Put("/x", b"1"), Put("/y", b"2"), Delete("/nothing")))
        assert res.succeeded
        assert store.get("/x").mod_revision == store.get("/y").mod_revision == res.revision

    # --- leases -----------------------------------------------------------------------

    def test_lease_expiry_deletes_keys(self, store, advance):
        lease = store.grant_lease(1)
        store.put("/l/a", b"1", lease=lease)
        store.put("/l/b", b"1", lease=lease)
        store.put("/keep", b"1")
        advance(2.5)
        assert store.get("/l/a") is None and store.get("/l/b") is None
        assert store.get("/keep") is not None
        with pytest.raises(LeaseExpired):
            store.keep_alive(lease)

    def test_keep_alive_extends(self, store, advance):
        lease = store.grant_lease(2)
        store.put("/l", b"1", lease=lease)
        for _ in range(3):
            advance(1)
            store.keep_alive(lease)
        assert store.get("/l") is not None

    def test_revoke_deletes_keys_now(self, store):
        lease = store.grant_lease(30)
        store.put("/l", b"1", lease=lease)
        store.revoke_lease(lease)
        assert store.get("/l") is None
        store.revoke_lease(lease)  # unknown lease: no-op

    def test_put_with_dead_lease_fails(self, store):
        lease = store.grant_lease(30)
        store.revoke_lease(lease)
        with pytest.raises(LeaseExpired):
            store.put("/l", b"1", lease=lease)
        assert store.get("/l") is None

    def test_overwrite_without_lease_detaches_key(self, store):
        lease = store.grant_lease(30)
        store.put("/l", b"1", lease=lease)
        store.put("/l", b"2")
        store.revoke_lease(lease)
        assert store.get("/l").value == b"2"

    # --- watches ----------------------------------------------------------------------

    def test_watch_delivers_puts_and_deletes_in_order(self, store):
        events = []
        w = store.watch("/w/", events.append)
        store.put("/w/a", b"1")
        store.put("/other", b"x")
        store.put("/w/a", b"2")
        store.delete("/w/a")
        assert wait_until(lambda: len(events) >= 3)
        assert [(e.type, e.key, e.value) for e in events] == [
            (EventType.PUT, "/w/a", b"1"),
            (EventType.PUT, "/w/a", b"2"),
            (EventType.DELETE, "/w/a", None),
        ]
        assert events[0].revision < events[1].revision < events[2].revision
        w.cancel()

    def test_watch_sees_lease_expiry(self, store, advance):
        events = []
        store.watch("/t/", events.append)
        lease = store.grant_lease(1)
        store.put("/t/x", b"1", lease=lease)
        advance(2.5)
        store.get("/t/x")  # let a lazily-reaping store notice
        assert wait_until(lambda: any(e.type is EventType.DELETE for e in events))

    def test_cancelled_watch_stops(self, store):
        events = []
        w = store.watch("/w/", events.append)
        store.put("/w/a", b"1")
        assert wait_until(lambda: len(events) == 1)
        w.cancel()
        store.put("/w/b", b"1")
        time.sleep(0.2)
        assert len(events) == 1

    # --- fenced lock ------------------------------------------------------------------

    def test_lock_is_exclusive(self, store):
        l1, l2 = store.grant_lease(30), store.grant_lease(30)
        fence = store.acquire_lock("/lock", l1, b"one")
        assert fence is not None and fence.owner == b"one"
        assert store.acquire_lock("/lock", l2, b"two") is None

    def test_fenced_write_succeeds_while_held(self, store):
        lease = store.grant_lease(30)
        fence = store.acquire_lock("/lock", lease, b"one")
        assert store.commit((), (Put("/state", b"1"),), fence=fence).succeeded
        assert store.get("/state").value == b"1"

    def test_fenced_write_refused_after_lock_lost(self, store, advance):
        lease = store.grant_lease(1)
        fence = store.acquire_lock("/lock", lease, b"one")
        advance(2.5)
        other = store.grant_lease(30)
        assert store.acquire_lock("/lock", other, b"two") is not None
        with pytest.raises(FencingError):
            store.commit((), (Put("/state", b"stale"),), (Put("/state", b"failure-branch"),), fence=fence)
        assert store.get("/state") is None

    def test_fence_detects_reacquire_by_same_owner(self, store):
        l1 = store.grant_lease(30)
        fence = store.acquire_lock("/lock", l1, b"same")
        store.revoke_lease(l1)
        l2 = store.grant_lease(30)
        assert store.acquire_lock("/lock", l2, b"same") is not None
        with pytest.raises(FencingError):
            store.commit((), (Put("/state", b"x"),), fence=fence)

    def test_concurrent_put_if_absent_has_one_winner(self, store):
        winners = []

        def claim(i: int) -> None:
            if store.commit((Compare.absent("/claim"),), (Put("/claim", str(i).encode()),)).succeeded:
                winners.append(i)

        threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1
        assert store.get("/claim").value == str(winners[0]).encode()

    def test_watch_sees_nothing_from_before_it_was_made(self, store):
        gate, first = threading.Event(), []

        def slow(event):  # holds up delivery, so later events wait in the queue
            gate.wait(5)
            first.append(event)

        store.watch("/a/", slow)
        store.put("/a/1", b"1")
        store.put("/a/2", b"2")
        late = []
        store.watch("/a/", late.append)  # while /a/1 and /a/2 are still undelivered
        store.put("/a/3", b"3")
        gate.set()
        assert wait_until(lambda: len(first) == 3)
        assert wait_until(lambda: len(late) >= 1)
        time.sleep(0.1)
        assert [e.key for e in late] == ["/a/3"]
