"""Group commit's decisions: its states, which staged writes go in the next
transaction, and what that transaction writes.

The writes of many callers are staged in order and sent a batch at a time, one
transaction in flight (the effectful loop is :mod:`pdps.runtime.group_commit`):

* ``idle``: nothing is in flight; the next caller to wait *leads*: it sends a batch.
* ``committing``: one transaction is in flight. When it succeeds the leader goes on
  with the next batch while its own writes are not yet sent, else the engine is idle
  again (and the leader hands the lead to the oldest waiting caller).
* ``broken``: a transaction failed. Every write staged with it or after it failed
  with it, and every write staged from now on fails at once, until the owner, having
  reloaded its state from the store, *resumes*.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from pdps.core.machine import move


class CommitState(str, enum.Enum):
    IDLE = "idle"
    COMMITTING = "committing"
    BROKEN = "broken"

    def __str__(self) -> str:
        return self.value


class CommitEvent(str, enum.Enum):
    LEAD = "lead"  # a caller sends the next batch
    COMMITTED = "committed"  # the batch is durable
    FAILED = "failed"  # the batch's transaction failed
    RESUME = "resume"  # the owner reloaded its state from the store

    def __str__(self) -> str:
        return self.value


S, E = CommitState, CommitEvent

TRANSITIONS: Mapping[tuple[CommitState, CommitEvent], frozenset[CommitState]] = {
    (S.IDLE, E.LEAD): frozenset({S.COMMITTING}),
    (S.COMMITTING, E.COMMITTED): frozenset({S.COMMITTING, S.IDLE}),  # the leader goes on, or hands off
    (S.COMMITTING, E.FAILED): frozenset({S.BROKEN}),
    (S.BROKEN, E.RESUME): frozenset({S.IDLE}),
    (S.IDLE, E.RESUME): frozenset({S.IDLE}),  # a reload retried after it failed on a read: nothing broke
}


def next_state(state: CommitState, event: CommitEvent, target: CommitState | None = None) -> CommitState:
    """Where ``event`` takes group commit in ``state`` (``target``: the engine's pick
    where the table allows several); raises :class:`~pdps.core.errors.InvalidTransition`."""
    return move(TRANSITIONS, "group commit", state, event, target)


def batch_size(sizes: Sequence[int], room: int) -> int:
    """How many of the oldest staged writes (``sizes``: operations each, oldest first)
    go in one transaction of at most ``room`` operations: as many as fit, and at least
    one (a larger one goes alone, and may be refused, as it would alone)."""
    n, ops = 1, sizes[0]
    while n < len(sizes) and ops + sizes[n] <= room:
        ops += sizes[n]
        n += 1
    return n


class _Keyed(Protocol):
    @property
    def key(self) -> str: ...


W = TypeVar("W", bound=_Keyed)


def merge(batches: Sequence[Sequence[W]]) -> list[W]:
    """The writes of several batches as one transaction: a key written more than once
    is written once, with its last value, at the place of its last write (etcd refuses
    a key twice in one transaction; the outcome is the same)."""
    if len(batches) == 1:
        return list(batches[0])
    last: dict[str, W] = {}
    for ops in batches:
        for op in ops:
            last.pop(op.key, None)  # keep the position of the last write
            last[op.key] = op
    return list(last.values())
