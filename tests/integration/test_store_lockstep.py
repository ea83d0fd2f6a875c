"""The memory store and a real store, driven in lockstep, agree after every step.

A hypothesis state machine applies the same random operations (puts, deletes,
prefix deletes, transactions with compares and both branches, leases, the fenced
lock) to a fresh :class:`MemoryStore` and to a real store, and checks after every
step that the two are indistinguishable to a caller:

* the same keys with the same values under ``/`` (and under the prefix a step
  ranged over), and ``get`` of every key a step touched agrees;
* the same outcomes: ``TxnResult.succeeded``, ``delete``'s and ``delete_prefix``'s
  return values, whether ``acquire_lock`` got the lock, and the same exception class
  (``LeaseExpired`` for a dead lease, ``FencingError`` for a stale fence);
* the same revision *structure*. Absolute revisions differ (a real server's counter
  does not start at 0, and stores may count no-op writes differently), so the machine
  records, for every write that created a ``mod_revision``, the pair (memory revision,
  real revision) it returned. New pairs must be larger than every earlier one in both
  stores, and every live key's ``mod_revision`` must be the recorded partner of its
  memory ``mod_revision``: so the two stores order (and tie) the keys' last writes the
  same way, and a ``put`` returns the revision the key then carries.

Revision compares are built from each store's own numbers (a key's current
``mod_revision``, one below or above it, another key's, an earlier write's, 0), so
they hold in one store exactly when they hold in the other; value compares (all four
ops, byte-wise order) use literal bytes or what a key holds now. Lease ids and fences
differ between the stores as well; the bundles hold (memory, real) pairs.

Lease expiry and watches are left out (every lease lives 60 s; the contract suite
covers both). One branch of a transaction never writes the same key twice (etcd
refuses a transaction that does).

The third run pits the memory store against a second memory store, which checks the
machine itself without any server.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from pdps.adapters.memory_store import MemoryStore
from pdps.ports.coordination import Compare, Delete, Op, Put

pytestmark = pytest.mark.integration

KEYS = ("/k/a", "/k/ab", "/k/b", "/k/c", "/k/sub", "/k/sub/x", "/k/sub/y", "/k/sub/lock")
LOCKS = ("/k/sub/lock", "/lock")  # the first is also an ordinary key the machine writes
PREFIXES = ("/", "/k/", "/k/a", "/k/sub", "/k/sub/", "/lock", "/nothing/")
OWNERS = (b"o1", b"o2", b"\xff")
# empty, NUL, non-UTF-8, a prefix of another, short-but-high vs long-but-low (byte order, not length)
VALUES = (b"", b"\x00", b"\xff", b"\xff\xfe\x80", b"v", b"v1", b"v1\x00", b"v2", b"x" * 40, *OWNERS)
TTL = 60.0  # long enough that nothing expires during a run

keys = st.sampled_from(KEYS)
values = st.sampled_from(VALUES) | st.binary(max_size=6)
compare_ops = st.sampled_from(list(Op))

# A revision operand, described so each store can compute its own number for it.
rev_operands = st.one_of(
    st.sampled_from(["current", "below", "above", "zero"]).map(lambda k: (k,)),
    keys.map(lambda k: ("of_key", k)),
    st.integers(0, 63).map(lambda i: ("past_write", i)),
)
# A value operand: literal bytes, or what a key (None: the compared one) holds now, as is,
# with a NUL appended or its last byte cut (to probe byte-wise ordering at the edges).
value_operands = st.one_of(
    values.map(lambda v: ("lit", v)),
    st.tuples(st.just("of_key"), st.none() | keys, st.sampled_from(["same", "longer", "shorter"])),
)
compares = st.one_of(
    st.tuples(st.just("revision"), keys, compare_ops, rev_operands),
    st.tuples(st.just("value"), keys, compare_ops, value_operands),
)


def branch(lease_strategy):
    """0-3 abstract ops, each on a different key: ("put", key, value, lease pair | None) or ("del", key)."""
    op = st.one_of(
        st.tuples(st.just("put"), keys, values, st.none() | lease_strategy),
        st.tuples(st.just("del"), keys),
    )
    return st.lists(op, max_size=3, unique_by=lambda o: o[1])


class LockstepMachine(RuleBasedStateMachine):
    leases = Bundle("leases")  # (memory lease id, real lease id)
    fences = Bundle("fences")  # (memory fence, real fence, lease pair the lock is held with)

    def __init__(self, real) -> None:
        super().__init__()
        self.real = real
        real.delete_prefix("/")
        assert real.range("/") == []
        self.mem = MemoryStore()
        self.stores = (self.mem, self.real)
        self.rev_pairs: list[tuple[int, int]] = []  # (memory, real) revision of every write that put a key
        self.rev_map: dict[int, int] = {}
        self.lease_map: dict[int, int] = {}  # memory lease id -> real lease id
        self.real_leases: list[int] = []

    def teardown(self) -> None:
        for lease in self.real_leases:
            try:
                self.real.revoke_lease(lease)
            except Exception:  # best effort; the next machine wipes the keys anyway
                pass
        self.mem.close()

    # --- helpers ----------------------------------------------------------------------

    def both(self, call):
        """Run ``call(store, side)`` on both stores (side 0 = memory, 1 = real); same outcome class."""
        outcomes = []
        for side, store in enumerate(self.stores):
            try:
                outcomes.append((True, call(store, side)))
            except Exception as exc:  # compared below
                outcomes.append((False, exc))
        (mem_ok, mem_out), (real_ok, real_out) = outcomes
        if not mem_ok or not real_ok:
            assert type(mem_out) is type(real_out), f"memory: {mem_out!r}, real: {real_out!r}"
            return None
        return mem_out, real_out

    def wrote(self, mem_rev: int, real_rev: int) -> None:
        if self.rev_pairs:
            last_mem, last_real = self.rev_pairs[-1]
            assert mem_rev > last_mem, (mem_rev, last_mem)
            assert real_rev > last_real, f"real store's revision went from {last_real} to {real_rev}"
        self.rev_pairs.append((mem_rev, real_rev))
        self.rev_map[mem_rev] = real_rev

    def check_get(self, *ks: str) -> None:
        for k in ks:
            m, r = self.mem.get(k), self.real.get(k)
            assert (m is None) == (r is None), f"get({k!r}): memory {m!r}, real {r!r}"
            if m is not None:
                assert (r.key, r.value) == (m.key, m.value), f"get({k!r}): memory {m!r}, real {r!r}"
                assert r.mod_revision == self.rev_map[m.mod_revision], f"get({k!r}): memory {m!r}, real {r!r}"

    def rev_operand(self, store, key: str, operand: tuple, side: int) -> int:
        kind = operand[0]
        kv = store.get(key)
        current = kv.mod_revision if kv else 0
        if kind == "current":
            return current
        if kind == "below":
            return max(current - 1, 0)  # no negative operands: no caller writes them
        if kind == "above":
            return current + 1
        if kind == "zero":
            return 0
        if kind == "of_key":
            other = store.get(operand[1])
            return other.mod_revision if other else 0
        if not self.rev_pairs:  # past_write, but nothing written yet
            return 0
        return self.rev_pairs[operand[1] % len(self.rev_pairs)][side]

    def compare(self, store, abstract: tuple, side: int) -> Compare:
        target, key, op, operand = abstract
        if target == "revision":
            return Compare.revision(key, op, self.rev_operand(store, key, operand, side))
        if operand[0] == "lit":
            return Compare.value(key, op, operand[1])
        other = store.get(key if operand[1] is None else operand[1])
        value = other.value if other else b""
        value = {"same": value, "longer": value + b"\x00", "shorter": value[:-1]}[operand[2]]
        return Compare.value(key, op, value)

    @staticmethod
    def concrete_ops(abstract: list, side: int) -> tuple:
        out = []
        for op in abstract:
            if op[0] == "put":
                _, key, value, lease = op
                out.append(Put(key, value, None if lease is None else lease[side]))
            else:
                out.append(Delete(op[1]))
        return tuple(out)

    def transact(self, cmps: list, success: list, failure: list, fence: tuple | None) -> None:
        def call(store, side):
            return store.commit(
                tuple(self.compare(store, c, side) for c in cmps),
                self.concrete_ops(success, side),
                self.concrete_ops(failure, side),
                fence=None if fence is None else fence[side],
            )

        out = self.both(call)
        if out is not None:
            m, r = out
            assert m.succeeded == r.succeeded, f"memory {m!r}, real {r!r}"
            taken = success if m.succeeded else failure
            if any(op[0] == "put" for op in taken):
                self.wrote(m.revision, r.revision)
        self.check_get(*{op[1] for op in success + failure}, *{c[1] for c in cmps})

    # --- rules: keys ------------------------------------------------------------------

    @rule(key=keys, value=values, lease=st.none() | leases)
    def put(self, key, value, lease):
        out = self.both(lambda s, side: s.put(key, value, lease=None if lease is None else lease[side]))
        if out is not None:
            self.wrote(*out)
        self.check_get(key)

    @rule(key=keys)
    def delete(self, key):
        out = self.both(lambda s, side: s.delete(key))
        assert out is not None and out[0] == out[1], out
        self.check_get(key)

    @rule(prefix=st.sampled_from(PREFIXES))
    def delete_prefix(self, prefix):
        out = self.both(lambda s, side: s.delete_prefix(prefix))
        assert out is not None and out[0] == out[1], out
        self.check_get(*KEYS, *LOCKS)

    @rule(prefix=st.sampled_from(PREFIXES))
    def range_prefix(self, prefix):
        m, r = self.mem.range(prefix), self.real.range(prefix)
        assert [(kv.key, kv.value) for kv in r] == [(kv.key, kv.value) for kv in m]

    @rule(key=keys)
    def get(self, key):
        self.check_get(key)

    # --- rules: transactions ----------------------------------------------------------

    @rule(
        cmps=st.lists(compares, max_size=3),
        success=branch(leases),
        failure=branch(leases),
    )
    def commit(self, cmps, success, failure):
        self.transact(cmps, success, failure, None)

    @rule(
        fence=fences,
        cmps=st.lists(compares, max_size=2),
        success=branch(leases),
        failure=branch(leases),
    )
    def fenced_commit(self, fence, cmps, success, failure):
        self.transact(cmps, success, failure, fence)

    # --- rules: leases ----------------------------------------------------------------

    @rule(target=leases)
    def grant(self):
        out = self.both(lambda s, side: s.grant_lease(TTL))
        assert out is not None
        m, r = out
        assert m not in self.lease_map and r not in self.lease_map.values(), "lease id reused"
        self.lease_map[m] = r
        self.real_leases.append(r)
        return out

    @rule(lease=leases)
    def keep_alive(self, lease):
        self.both(lambda s, side: s.keep_alive(lease[side]))

    @rule(lease=leases)
    def revoke(self, lease):
        self.both(lambda s, side: s.revoke_lease(lease[side]))
        self.check_get(*KEYS, *LOCKS)

    # --- rules: the fenced lock -------------------------------------------------------

    @rule(target=fences, name=st.sampled_from(LOCKS), lease=leases, owner=st.sampled_from(OWNERS))
    def acquire(self, name, lease, owner):
        out = self.both(lambda s, side: s.acquire_lock(name, lease[side], owner))
        m, r = out if out is not None else (None, None)
        assert (m is None) == (r is None), f"acquire_lock: memory {m!r}, real {r!r}"
        if m is not None:
            assert (r.key, r.owner) == (m.key, m.owner), (m, r)
            self.wrote(m.revision, r.revision)
        self.check_get(name)
        return multiple() if m is None else (m, r, lease)

    @rule(target=fences, fence=fences, lease=leases, success=branch(leases), failure=branch(leases))
    def retake_lock(self, fence, lease, success, failure):
        """The holder's lease dies, the same owner takes the lock again (if ``lease`` lives),
        and then writes with the old fence, which must be refused either way."""
        self.revoke(fence[2])
        new = self.acquire(fence[0].key, lease, fence[0].owner)
        self.transact([], success, failure, fence)
        return new

    @rule(fence=fences)
    def lose_lock(self, fence):
        """Revoke the lease a lock was taken with: its fence goes stale."""
        self.revoke(fence[2])

    # --- after every step -------------------------------------------------------------

    @invariant()
    def same_contents(self):
        m, r = self.mem.range("/"), self.real.range("/")
        assert [(kv.key, kv.value) for kv in r] == [(kv.key, kv.value) for kv in m]
        for mkv, rkv in zip(m, r):
            # the same order (and ties) of last writes: each real mod_revision is the partner
            # of the memory one (and wrote() saw the pairs increase on both sides)
            assert rkv.mod_revision == self.rev_map.get(mkv.mod_revision), (
                f"{mkv.key!r}: memory mod_revision {mkv.mod_revision} was written as real "
                f"{self.rev_map.get(mkv.mod_revision)}, real store says {rkv.mod_revision}"
            )
            # the same lease (or none) holds each key
            assert rkv.lease == (None if mkv.lease is None else self.lease_map[mkv.lease]), (mkv, rkv)


def run_lockstep(real, examples: int, steps: int) -> None:
    run_state_machine_as_test(
        lambda: LockstepMachine(real),
        settings=settings(
            max_examples=examples,
            stateful_step_count=steps,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )


def test_lockstep_memory_vs_memory():
    """The machine itself, against a second memory store (whose revisions and lease ids run ahead)."""
    other = MemoryStore()
    other.put("/offset", b"")  # start the 'real' store's counters elsewhere
    other.delete("/offset")
    other.revoke_lease(other.grant_lease(TTL))
    run_lockstep(other, examples=150, steps=50)


def test_lockstep_etcd(etcd_store):
    run_lockstep(etcd_store, examples=80, steps=50)  # ~2.5-4 ms a step: ~10-16 s (the memory run above checks the machine at 150)


def test_lockstep_redis(redis_store):
    run_lockstep(redis_store, examples=120, steps=50)  # ~1-2 ms a step: ~7-12 s
