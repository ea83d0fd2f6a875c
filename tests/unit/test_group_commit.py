"""Group commit as a store wrapper (:mod:`pdps.runtime.group_commit`), on the memory store.

The master's use of it (batches under concurrent trainers, failures, the op cap) is
``tests/unit/test_master_batching.py``; here the wrapper alone, driven by random
stage / wait / fail / resume sequences against a shadow of what must be durable.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import ConfigError, InvalidTransition, StoreError
from pdps.core.group_commit import CommitState
from pdps.ports.coordination import Compare, Put
from pdps.runtime.group_commit import GroupCommitStore


class Flaky:
    """Delegates to a store; ``armed`` makes the next commit raise instead of writing."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.armed = False
        self.commits = 0

    def commit(self, compares, success, failure=(), *, fence=None):
        self.commits += 1
        if self.armed:
            self.armed = False
            raise StoreError("the store refused the transaction")
        return self.inner.commit(compares, success, failure, fence=fence)

    def __getattr__(self, name):
        return getattr(self.inner, name)


class GroupCommitMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.inner = MemoryStore()
        self.flaky = Flaky(self.inner)
        self.failures: list[BaseException] = []
        self.store = GroupCommitStore(self.flaky, max_txn_ops=8, on_failure=self.failures.append)
        self.entries: list = []  # (entry, ops) in staging order
        self.broken = False
        self.failed = 0
        self.value = 0

    @rule(keys=st.lists(st.integers(0, 4), min_size=1, max_size=4))
    def stage(self, keys):
        ops = []
        for k in keys:
            self.value += 1
            ops.append(Put(f"/g/k{k}", str(self.value).encode()))
        entry = self.store.stage(ops)
        assert entry is not None and entry.settled == self.broken  # a broken engine refuses at once
        self.entries.append((entry, ops))

    @rule(data=st.data())
    def wait(self, data):
        waiting = [e for e, _ in self.entries if not e.settled]
        if not waiting:  # flush returns at once, or raises what the latest writes failed with
            latest = self.entries[-1][0] if self.entries else None
            if latest is not None and latest.error is not None and self.broken:
                with pytest.raises(StoreError):
                    self.store.flush()
            else:
                self.store.flush()
            return
        entry = data.draw(st.sampled_from(waiting))
        before = [e for e, _ in self.entries[: [e for e, _ in self.entries].index(entry) + 1]]
        armed = self.flaky.armed
        try:
            self.store.wait(entry)
        except StoreError:
            assert armed and self.store.state is CommitState.BROKEN  # only a refused transaction fails writes
            assert len(self.failures) == self.failed + 1  # and the owner was told, once
            self.failed += 1
            self.broken = True
            assert all(e.settled and e.error is not None for e in waiting)  # everything staged failed with it
            return
        assert all(e.settled for e in before)  # what was staged before it is durable too
        assert entry.error is None

    @rule()
    def fail_next_commit(self):
        self.flaky.armed = True

    @precondition(lambda self: self.broken)
    @rule()
    def resume(self):
        self.store.resume()
        self.broken = False

    @invariant()
    def the_state_says_whether_it_is_broken(self):
        assert (self.store.state is CommitState.BROKEN) == self.broken
        assert self.store.state is not CommitState.COMMITTING  # single-threaded: no leader outlives its wait

    @invariant()
    def the_backlog_is_what_is_unsettled_in_staging_order(self):
        settled = [e.settled for e, _ in self.entries]
        assert self.store.backlog == settled.count(False)
        if False in settled:  # nothing staged after an unsent write was sent before it
            assert not any(settled[settled.index(False):])

    @invariant()
    def the_store_holds_exactly_the_writes_that_succeeded_in_order(self):
        shadow: dict[str, bytes] = {}
        for e, ops in self.entries:
            if e.settled and e.error is None:
                shadow.update({op.key: op.value for op in ops})
        assert {kv.key: kv.value for kv in self.inner.range("/g/")} == shadow
        assert self.store.stats["transitions"] == sum(1 for e, _ in self.entries if e.settled and e.error is None)


TestGroupCommit = GroupCommitMachine.TestCase
TestGroupCommit.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


def test_a_conditional_commit_is_its_own_transaction():
    inner = Flaky(MemoryStore())
    store = GroupCommitStore(inner)
    assert store.commit((Compare.absent("/c/a"),), (Put("/c/a", b"1"),)).succeeded
    assert not store.commit((Compare.absent("/c/a"),), (Put("/c/a", b"2"),)).succeeded  # decided by the store now
    assert inner.get("/c/a").value == b"1" and store.stats["transactions"] == 0


def test_a_plain_commit_is_staged_and_waited_for():
    inner = MemoryStore()
    store = GroupCommitStore(inner)
    result = store.commit((), (Put("/c/a", b"1"),))
    assert result.succeeded and result.revision == inner.get("/c/a").mod_revision
    assert store.stats == {"transactions": 1, "transitions": 1, "ops": 1}


def test_after_a_failure_nothing_is_written_until_resumed_and_the_owner_is_told_first():
    flaky = Flaky(MemoryStore())
    told: list[BaseException] = []
    store = GroupCommitStore(flaky, on_failure=lambda exc: told.append(exc) or (lambda: told.append("after")))
    flaky.armed = True
    with pytest.raises(StoreError):
        store.commit((), (Put("/c/a", b"1"),))
    assert store.state is CommitState.BROKEN and told[0].args == ("the store refused the transaction",) and told[1] == "after"
    commits = flaky.commits
    with pytest.raises(StoreError):  # refused at once: the owner's state may be ahead of the store
        store.commit((), (Put("/c/b", b"1"),))
    assert flaky.commits == commits and flaky.get("/c/b") is None
    store.resume()
    assert store.state is CommitState.IDLE
    store.commit((), (Put("/c/b", b"2"),))
    assert flaky.get("/c/b").value == b"2"


def test_staging_nothing_waits_for_the_latest_writes():
    store = GroupCommitStore(MemoryStore())
    assert store.stage([]) is None
    entry = store.stage([Put("/c/a", b"1")])
    assert store.stage([]) is entry


def test_the_op_cap_is_checked():
    with pytest.raises(ConfigError, match="max_txn_ops must be >= 8"):
        GroupCommitStore(MemoryStore(), max_txn_ops=7)


def test_resuming_while_a_transaction_is_in_flight_is_refused():
    store = GroupCommitStore(MemoryStore())
    store.state = CommitState.COMMITTING  # as a leader would leave it
    with pytest.raises(InvalidTransition) as err:
        store.resume()
    assert (err.value.subject, err.value.state, err.value.event) == ("group commit", CommitState.COMMITTING, "resume")
