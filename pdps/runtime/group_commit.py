"""Group commit as a store: concurrent callers' writes share transactions.

:class:`GroupCommitStore` wraps a :class:`~pdps.ports.coordination.CoordinationStore`.
A caller *stages* its writes (in the order its own lock gives them) and *waits* for
them; one transaction is in flight at a time, and the writes staged meanwhile go
together in the next one, in the order they were staged, up to ``max_txn_ops``
operations (etcd's ``--max-txn-ops``, less the fence's compares). So the store's
round trip is shared by every caller waiting for it, and the store sees the writes in
the order they were staged. A plain ``commit`` without compares is a stage and a wait.

Leader/follower: a caller that waits while nothing is in flight leads: it commits
what is staged (its own writes and everything before them), batch after batch until
its own writes are settled, then wakes the owner of the oldest staged writes to lead
the next. The others park until their writes are settled or they are woken to lead.

If a transaction fails, every write staged with it or after it fails too (they were
made on top of it), and writes staged later fail at once, until the owner, having
reloaded its state from the store, calls :meth:`GroupCommitStore.resume`. The states
and the decisions (which writes make a batch, what it writes) are
:mod:`pdps.core.group_commit`'s.

Reads, leases, watches, locks, ``put``/``delete`` and conditional commits go straight
to the wrapped store: their outcome depends on the store at that moment.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

from pdps.core import group_commit
from pdps.core.errors import ConfigError
from pdps.core.group_commit import CommitEvent, CommitState
from pdps.ports.coordination import Compare, CoordinationStore, Fence, KeyValue, TxnOp, TxnResult, WatchEvent

log = logging.getLogger(__name__)

#: The most operations one transaction may hold: etcd's ``--max-txn-ops`` default. A
#: group commit stays within it, the fence's compares included (etcd counts those
#: against the same limit: a fenced transaction carries at most 126 writes).
MAX_TXN_OPS = 128

#: Called with the error of a failed transaction (the engine's lock held) before any
#: caller hears of it; may return what to do about it once the lock is released.
OnFailure = Callable[[BaseException], "Callable[[], None] | None"]


class Staged:
    """Writes waiting for the group commit that makes them durable.

    ``after``: what to do once they are; ``error``: why they were not written, once
    ``settled``. The thread that staged them parks on ``wake`` (held from the start;
    released once per park, by whoever sets ``parked`` back); any other thread waiting
    for them waits on the engine's condition.
    """

    __slots__ = ("ops", "fence", "after", "settled", "error", "revision", "parked", "wake", "owner")

    def __init__(self, ops: Sequence[TxnOp], fence: Fence | None = None, after: Sequence[Callable[[], None]] = ()) -> None:
        self.ops = list(ops)
        self.fence = fence
        self.after = after
        self.settled = False
        self.error: BaseException | None = None
        self.revision = 0
        self.parked = False
        self.wake = threading.Lock()
        self.wake.acquire()
        self.owner = threading.get_ident()

    def unpark(self) -> None:
        """Wake the thread parked on these writes, if one is (engine's lock held)."""
        if self.parked:
            self.parked = False
            self.wake.release()


class GroupCommitStore:
    """A :class:`CoordinationStore` whose unconditional commits share transactions."""

    def __init__(self, inner: CoordinationStore, *, max_txn_ops: int = MAX_TXN_OPS, on_failure: OnFailure | None = None) -> None:
        if max_txn_ops < 8:
            raise ConfigError(f"max_txn_ops must be >= 8 (a transaction holds a transition and the fence), got {max_txn_ops}")
        self.inner = inner
        self.max_txn_ops = max_txn_ops
        self._on_failure = on_failure
        # guards everything below; never held with a store call in flight
        self._commits = threading.Condition(threading.Lock())
        self.state = CommitState.IDLE  # moved only through pdps.core.group_commit.TRANSITIONS
        self._error: BaseException | None = None  # why, while broken
        self._staged: list[Staged] = []  # staged and not yet sent, in staging order
        self._latest: Staged | None = None  # what a caller that staged nothing waits for
        self._watchers = 0  # threads waiting on _commits for writes they did not stage
        #: transactions and batches of writes committed (for tests and benchmarks)
        self.stats = {"transactions": 0, "transitions": 0, "ops": 0}

    # --- group commit -----------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """How many callers' writes are staged and not yet sent."""
        with self._commits:
            return len(self._staged)

    def stage(self, ops: Sequence[TxnOp], *, fence: Fence | None = None, after: Sequence[Callable[[], None]] = ()) -> Staged | None:
        """Stage ``ops`` behind every write staged before (the caller holds the lock that
        orders its changes). The caller must :meth:`wait` for the result before it tells
        anyone about them. Staging nothing returns the latest staged writes (or None):
        what the caller answers may rest on them. While broken, the writes come back
        failed."""
        if not ops:
            if after:
                raise ValueError("actions to run after a commit need writes to follow")
            return self._latest
        entry = Staged(ops, fence, after)
        with self._commits:
            if self.state is CommitState.BROKEN:
                entry.settled, entry.error = True, self._error
            else:
                self._staged.append(entry)
            self._latest = entry
        return entry

    def wait(self, entry: Staged | None) -> None:
        """Return once ``entry`` is durable; raise why, if it is not. Must not be called
        from an ``after`` action or ``on_failure``."""
        if entry is None:
            return
        cv = self._commits
        own = entry.owner == threading.get_ident()
        while True:
            with cv:
                if entry.settled:
                    break
                lead = self.state is CommitState.IDLE
                if lead:
                    self.state = group_commit.next_state(self.state, CommitEvent.LEAD)
                elif own:
                    entry.parked = True
                else:
                    self._watchers += 1
                    cv.wait()
                    self._watchers -= 1
                    continue
            if lead:
                self._lead(entry)
            else:
                entry.wake.acquire()  # until settled, or woken to lead
        if entry.error is not None:
            raise copy_error(entry.error)

    def flush(self) -> None:
        """Wait until every write staged so far is durable; raise if one failed."""
        self.wait(self._latest)

    def resume(self) -> None:
        """Stage again after a failed transaction: the owner's state was reloaded from the store."""
        with self._commits:
            self.state = group_commit.next_state(self.state, CommitEvent.RESUME)
            self._error, self._latest = None, None

    def _lead(self, entry: Staged) -> None:
        cv = self._commits
        while True:
            with cv:
                batch = self._take_batch()  # entry is staged and nothing is in flight: never empty
            error: BaseException | None = None
            try:
                self._commit_batch(batch)
            except BaseException as exc:  # every write of the batch, and all staged after it, fail
                error = exc
            with cv:
                react = self._settle(batch, error)
                if error is None:
                    self.state = group_commit.next_state(
                        self.state, CommitEvent.COMMITTED, CommitState.IDLE if entry.settled else CommitState.COMMITTING
                    )
                    if entry.settled:
                        for e in self._staged:  # the next leader
                            if e.parked:
                                e.unpark()
                                break
                if self._watchers:
                    cv.notify_all()
            if react is not None:  # not while holding _commits
                react()
            if entry.settled:
                return

    def _take_batch(self) -> list[Staged]:
        """The oldest staged writes that fit one transaction and carry the same fence."""
        fence = self._staged[0].fence
        sizes = []
        for e in self._staged:
            if e.fence != fence:
                break
            sizes.append(len(e.ops))
        n = group_commit.batch_size(sizes, self.max_txn_ops - (len(fence.compares()) if fence is not None else 0))
        batch = self._staged[:n]
        del self._staged[:n]
        return batch

    def _commit_batch(self, batch: list[Staged]) -> None:
        """One transaction holding the batch's writes (no ``_commits`` held)."""
        ops = group_commit.merge([e.ops for e in batch])
        result = self.inner.commit((), ops, fence=batch[0].fence)
        for e in batch:
            e.revision = result.revision
        stats = self.stats
        stats["transactions"] += 1
        stats["transitions"] += len(batch)
        stats["ops"] += len(ops)

    def _settle(self, batch: list[Staged], error: BaseException | None) -> Callable[[], None] | None:
        """Mark the batch written, or failed with every write staged after it
        (``_commits`` held); returns what the owner must do about a failure."""
        if error is None:
            for e in batch:
                for act in e.after:
                    act()
                e.settled = True
                e.unpark()
            return None
        failed = batch + self._staged
        self._staged.clear()
        self.state = group_commit.next_state(self.state, CommitEvent.FAILED)
        self._error = error
        for e in failed:
            e.settled, e.error = True, error
            e.unpark()
        log.error("a transaction of %d staged writes failed (%d staged after it fail with it): %s", len(batch), len(failed) - len(batch), error)
        return None if self._on_failure is None else self._on_failure(error)

    # --- the port ---------------------------------------------------------------------

    @property
    def url(self) -> str:
        return self.inner.url

    def commit(self, compares: Sequence[Compare], success: Sequence[TxnOp], failure: Sequence[TxnOp] = (), *, fence: Fence | None = None) -> TxnResult:
        """Without compares (and failure ops), the writes are staged and waited for:
        they share a transaction with the others'. A conditional commit is its own."""
        if compares or failure or not success:
            return self.inner.commit(compares, success, failure, fence=fence)
        entry = self.stage(success, fence=fence)
        self.wait(entry)
        assert entry is not None
        return TxnResult(succeeded=True, revision=entry.revision)

    def get(self, key: str) -> KeyValue | None:
        return self.inner.get(key)

    def range(self, prefix: str) -> list[KeyValue]:
        return self.inner.range(prefix)

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        return self.inner.put(key, value, lease=lease)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def grant_lease(self, ttl: float) -> int:
        return self.inner.grant_lease(ttl)

    def keep_alive(self, lease: int) -> None:
        self.inner.keep_alive(lease)

    def revoke_lease(self, lease: int) -> None:
        self.inner.revoke_lease(lease)

    def watch(self, prefix: str, callback: Callable[[WatchEvent], None]) -> Any:
        return self.inner.watch(prefix, callback)

    def acquire_lock(self, name: str, lease: int, owner: bytes) -> Fence | None:
        return self.inner.acquire_lock(name, lease, owner)

    def close(self) -> None:
        self.inner.close()


def copy_error(exc: BaseException) -> BaseException:
    """The error of a failed group commit, for one of the threads it failed (each raises its own copy)."""
    try:
        dup = copy.copy(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be copied is raised as it is
        return exc
    dup.__cause__ = exc.__cause__
    return dup
