"""The one backoff policy, the one retry loop and the one compare-and-set loop."""

from __future__ import annotations

import threading
import time

import pytest

from pdps.adapters.memory_store import MemoryStore
from pdps.core.backoff import Backoff
from pdps.core.errors import Contended, StoreUnavailable
from pdps.core.txn import Compare, Done, Put, Write
from pdps.runtime.cas import read_modify_write
from pdps.runtime.retry import Retry, retry


def test_backoff_grows_to_its_longest_after_the_immediate_tries():
    b = Backoff(first=0.1, longest=0.5, factor=2.0, immediate=2)
    assert [b.pause(n) for n in range(1, 8)] == [0.0, 0.0, 0.1, 0.2, 0.4, 0.5, 0.5]
    assert b.pause(10**6) == 0.5  # no overflow, however long the run


def test_backoff_jitter_shortens_a_pause_by_at_most_its_fraction():
    b = Backoff(first=1.0, longest=1.0, jitter=0.25)
    assert b.pause(1, 0.0) == 1.0 and b.pause(1, 0.999) == pytest.approx(0.75025)


@pytest.mark.parametrize("bad", [{"first": 0}, {"longest": -1.0}, {"jitter": 1.5}])
def test_backoff_refuses_settings_that_cannot_work(bad):
    with pytest.raises(ValueError):
        Backoff(**bad)


def test_retry_returns_once_the_call_succeeds_and_reports_the_recovery():
    calls, seen = [], []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise StoreUnavailable("down")
        return "up"

    result = retry(flaky, on=StoreUnavailable, policy=Backoff(first=0.001, longest=0.002),
                   waiting=lambda exc, st: seen.append(st.failures), recovered=lambda st: seen.append("back"))
    assert result == "up" and len(calls) == 3 and seen == [1, 2, "back"]


def test_retry_gives_up_at_the_attempt_bound_with_the_callers_error():
    def down() -> None:
        raise StoreUnavailable("down")

    with pytest.raises(RuntimeError, match="after 4") as info:
        retry(down, on=StoreUnavailable, policy=Backoff(first=0.001, longest=0.001), attempts=4,
              giving_up=lambda exc, st: RuntimeError(f"after {st.failures}"))
    assert isinstance(info.value.__cause__, StoreUnavailable)


def test_retry_lets_other_errors_through_at_once():
    calls = []

    def broken() -> None:
        calls.append(1)
        raise KeyError("x")

    with pytest.raises(KeyError):
        retry(broken, on=StoreUnavailable, policy=Backoff())
    assert calls == [1]


def test_the_deadline_counts_from_the_first_failure_and_cuts_the_last_pause():
    clock = [0.0]
    state = Retry(Backoff(first=10.0, longest=10.0), deadline=1.0, clock=lambda: clock[0])
    assert state.note() and state.elapsed == 0.0
    clock[0] = 1.0
    assert not state.note()  # spent: no pause taken
    state.succeeded()
    assert state.failures == 0 and state.elapsed == 0.0 and not state.spent


def test_stop_wakes_a_pause_and_ends_the_loop():
    stop = threading.Event()
    state = Retry(Backoff(first=30.0, longest=30.0), stop=stop)
    threading.Timer(0.05, stop.set).start()
    began = time.monotonic()
    assert state.failed() is False
    assert time.monotonic() - began < 10.0


def test_read_modify_write_reads_again_after_losing_the_race():
    store = MemoryStore("memory://")
    store.put("k", b"1")
    rival_wrote = []
    conflicts = []

    def add_one(kv):
        if not rival_wrote:  # another writer slips in between our read and our commit
            rival_wrote.append(store.put("k", b"10"))
        n = int(kv.value) + 1
        return Write((Compare.unchanged("k", kv),), (Put("k", str(n).encode()),), result=n)

    result = read_modify_write(store, "k", add_one, what="add one", on_conflict=lambda: conflicts.append(1))
    assert result == 11 and store.get("k").value == b"11" and conflicts == [1]


def test_read_modify_write_returns_done_without_writing():
    store = MemoryStore("memory://")
    before = store.put("k", b"x")
    assert read_modify_write(store, "k", lambda kv: Done(kv.value), what="look") == b"x"
    assert store.get("k").mod_revision == before


def test_read_modify_write_gives_up_with_contended_naming_what():
    store = MemoryStore("memory://")

    def always_stale(kv):
        return Write((Compare.value("k", Compare.absent("k").op, b"never"),), (Put("k", b"x"),))

    with pytest.raises(Contended, match="bump the counter: lost the compare-and-set race 5 times"):
        read_modify_write(store, "k", always_stale, what="bump the counter", attempts=5, policy=Backoff(first=0.001, longest=0.001))
    assert store.get("k") is None


def test_wait_for_key_wakes_at_the_write_not_at_a_poll():
    from pdps.runtime import watching

    store = MemoryStore("memory://")
    threading.Timer(0.1, lambda: store.put("k", b"here")).start()
    began = time.monotonic()
    assert watching.wait_for_key(store, "k", "a key", timeout=30.0) == b"here"
    assert time.monotonic() - began < watching.REREAD + 5.0


def test_wait_for_key_gives_up_naming_what_it_waited_for_or_returns_none_when_told():
    from pdps.core.errors import Timeout
    from pdps.runtime import watching

    store = MemoryStore("memory://")
    with pytest.raises(Timeout, match=r"waiting for the master \(k\)"):
        watching.wait_for_key(store, "k", "the master", timeout=0.05)
    assert watching.wait_for_key(store, "k", "the master", timeout=30.0, unless=lambda: True) is None
