"""The pserver's lifecycle: every state a pserver is in, and the moves between them.

Rules, in a few lines:

* A pserver is built ``new`` and ``starting`` once it claims its index. A pserver of
  a fresh job then serves; one that restarts in a running job first *loads* (rolls
  the job back and loads its part of the checkpoint, or reloads only its own slots).
* ``serving``: it answers ``init``, ``push`` and ``pull`` for its epoch. A new epoch
  (the job rolled back) sends it back to ``loading``; a closed round it cannot apply
  (it lacks a committed gradient: it lost its state) makes it ``rolling_back``: it
  asks for a rollback and waits for the new epoch.
* Outside ``serving`` (and the halted states, which finish the calls in flight)
  requests are refused as not ready: the shard may not hold the epoch's values.
* ``stop`` and ``crash`` end it from any state; a halted pserver stays as it ended.

Checkpoint parts are written in the background while the pserver serves: they are
not a lifecycle state. The role (:mod:`pdps.roles.pserver`) keeps one ``state``
attribute and changes it only through :func:`next_state`.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from pdps.core.machine import move


class PserverState(str, enum.Enum):
    NEW = "new"
    STARTING = "starting"  # index claimed, epoch read, not yet serving
    LOADING = "loading"  # entering an epoch: loading its part of a checkpoint
    SERVING = "serving"
    ROLLING_BACK = "rolling_back"  # asked for a rollback; waits for the new epoch
    STOPPED = "stopped"
    CRASHED = "crashed"

    def __str__(self) -> str:
        return self.value


class PserverEvent(str, enum.Enum):
    START = "start"
    SERVE = "serve"  # the shard holds the epoch's values (or a trainer will init them)
    LOAD = "load"  # enter an epoch: restore from its checkpoint
    ROLL_BACK = "roll_back"  # a closed round lacks a gradient this pserver lost
    STOP = "stop"
    CRASH = "crash"

    def __str__(self) -> str:
        return self.value


S, E = PserverState, PserverEvent

#: The states a pserver halts in; a second stop or crash leaves it as it ended.
HALTED = frozenset({S.STOPPED, S.CRASHED})
#: The states in which requests are refused as not ready.
UNSETTLED = frozenset({S.NEW, S.STARTING, S.LOADING, S.ROLLING_BACK})

TRANSITIONS: Mapping[tuple[PserverState, PserverEvent], frozenset[PserverState]] = {
    (S.NEW, E.START): frozenset({S.STARTING}),
    (S.STARTING, E.SERVE): frozenset({S.SERVING}),  # a fresh job
    (S.STARTING, E.LOAD): frozenset({S.LOADING}),  # a restart, or an epoch that began while it started
    (S.LOADING, E.SERVE): frozenset({S.SERVING}),
    (S.LOADING, E.LOAD): frozenset({S.LOADING}),  # a newer epoch after a load that failed
    (S.SERVING, E.LOAD): frozenset({S.LOADING}),  # the job rolled back
    (S.SERVING, E.ROLL_BACK): frozenset({S.ROLLING_BACK}),
    (S.ROLLING_BACK, E.ROLL_BACK): frozenset({S.ROLLING_BACK}),  # another waiting pull found the same gap
    (S.ROLLING_BACK, E.LOAD): frozenset({S.LOADING}),
    **{(s, E.STOP): frozenset({s if s in HALTED else S.STOPPED}) for s in S},
    **{(s, E.CRASH): frozenset({s if s in HALTED else S.CRASHED}) for s in S},
}


def next_state(subject: str, state: PserverState, event: PserverEvent) -> PserverState:
    """Where ``event`` takes a pserver in ``state``; raises
    :class:`~pdps.core.errors.InvalidTransition` naming ``subject`` if the table does not allow it."""
    return move(TRANSITIONS, subject, state, event)
