"""Speculative execution: when a task's attempt runs much longer than attempts usually
take, a backup attempt of its untrained records races it (issue 18).

Rules, in a few lines:

* A pending task holds at most one backup (:class:`Racer`) beside its primary attempt;
  the backup takes the next attempt number (``TaskRecord.issued + 1``) and starts
  reading at the record the task's progress record had reached when the master opened
  the race (:meth:`~pdps.core.progress.TaskProgress.open_race`).
* A task is a *straggler* once its attempt has run longer than ``multiplier`` x the
  median seconds per record of recent unraced finishes x its records, counted only
  after ``min_finished`` finishes (Spark's defaults: 1.5 and a quantile's worth).
* The first finish of either racer makes the task done and the other attempt
  *beaten* (:class:`AttemptEnded`); a racer that fails, times out, is lost or gives
  back leaves the task pending with the other (a primary that ends promotes its
  backup).

The queue's transitions live in :mod:`pdps.core.tasks`; this module holds the values
and the policy they use. Pure: no clock, ``now`` is an argument.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.errors import ConfigError

if TYPE_CHECKING:
    from pdps.core.tasks import Event

#: Unraced finishes the median is taken over (soft state: a restarted master starts empty).
RING = 64
#: Backups a task may be raced by per dispatch, whichever attempt wins each race.
MAX_BACKUPS = 3


@attrs.frozen
class Racer:
    """One attempt at a pending task, as its trainer holds it."""

    attempt: int
    trainer: str
    deadline: float
    offset: int  # the record it started reading at

    def to_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "trainer": self.trainer, "deadline": self.deadline, "offset": self.offset}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Racer:
        return cls(attempt=int(d["attempt"]), trainer=str(d["trainer"]), deadline=float(d["deadline"]), offset=int(d["offset"]))


@attrs.frozen
class AttemptEnded:
    """An attempt of a raced task ended in a transition whose record names another
    attempt: it lost the race (``event`` BEATEN: its trainer should stop) or ended with
    its task's other attempt. It trained records ``[its offset, applied)``. A notice:
    the task's record is persisted by the :class:`~pdps.core.tasks.TaskChanged` beside
    it, the attempt's outcome by the audit."""

    task_id: int
    attempt: int
    trainer: str
    event: Event
    applied: int


@attrs.define
class Speculation:
    """When to start a backup attempt: off by default."""

    enabled: bool = False
    multiplier: float = 1.5
    min_finished: int = 8
    #: seconds per record of the last :data:`RING` unraced finishes
    _ring: deque[float] = attrs.field(factory=lambda: deque(maxlen=RING))

    def __attrs_post_init__(self) -> None:
        if not self.multiplier > 0:
            raise ConfigError(f"speculation_multiplier must be > 0, got {self.multiplier}")
        if not 1 <= self.min_finished <= RING:
            raise ConfigError(f"speculation_min_finished must be between 1 and {RING}, got {self.min_finished}")

    def finished(self, seconds: float, records: int) -> None:
        """An attempt that nobody raced trained ``records`` records in ``seconds``."""
        if records > 0 and seconds >= 0:
            self._ring.append(seconds / records)

    def overdue(self, seconds: float, records: int) -> float | None:
        """How many times its expected time an attempt that has run ``seconds`` on
        ``records`` records has taken, if that is past ``multiplier`` (None: not a
        straggler, or too few finishes yet to tell)."""
        if not self.enabled or records <= 0 or len(self._ring) < self.min_finished:
            return None
        expected = statistics.median(self._ring) * records
        if seconds <= self.multiplier * expected:
            return None
        return seconds / expected if expected > 0 else float("inf")
