"""Exactly-once per record: how far an attempt at a task has trained, and the fence that
ends it.

Rules, in a few lines:

* Each task has one progress record (key ``progress/<task>``): the attempt that last
  advanced it, ``applied`` (the records ``[0, applied)`` of the task whose gradients are
  in the parameters, or are bound to be: committed to a sync round, or acknowledged by
  every pserver in async mode) and whether it is ``fenced``.
* The trainer of an attempt advances the record with every step that trains records,
  by compare-and-set on the value it last read or wrote: in sync mode in the very
  transaction that commits its contribution to the round, in async mode once every
  pserver has acknowledged the push.
* The master ends an attempt it gives up on (timeout, lost trainer, failure report,
  give-back) by *fencing* the record, again by compare-and-set, before it re-queues
  the task: from then on no step of that attempt can advance it, so nothing more of
  it is applied, and the next attempt resumes at exactly ``applied``.
* An attempt may advance the record only if the record names no later attempt and
  does not fence its own: a record of an earlier attempt (or of a task's earlier
  pass: attempts never repeat) is simply taken over.
* Speculation: the master may open a *race* between the running attempt and a backup
  attempt that starts reading at ``applied``. In a race a step must start exactly at
  ``applied``, and the first step to commit wins: the same write ends the race and
  refuses the loser for good (``beaten`` is the highest backup attempt ever beaten;
  an attempt above ``attempt`` and at most ``beaten`` lost its race). Fencing one
  racer ends the race; the other goes on alone.

Everything here is pure; the roles do the reads and the compare-and-set writes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from pdps.core.errors import CorruptRecord, StalePush


@attrs.frozen
class TaskProgress:
    """The progress record of one task (see the module docstring)."""

    attempt: int
    applied: int
    fenced: bool = False
    #: (primary, backup) while two attempts race for the records from ``applied`` on
    race: tuple[int, int] | None = None
    #: the highest backup attempt that lost a race; attempts in (attempt, beaten] are over
    beaten: int = 0

    def advance(self, attempt: int, start: int, end: int) -> TaskProgress:
        """The record after ``attempt`` has trained records ``[start, end)``.

        Raises :class:`StalePush` when ``attempt`` has been fenced, superseded or beaten,
        or, in a race, when another attempt committed record ``start`` first: its step
        must not be applied, and its trainer drops the task.
        """
        self.check(attempt)
        if self.race is not None:
            if start != self.applied:
                raise StalePush(
                    f"attempt {attempt} lost its race for this task: records [{start}, {end}) start at record {start}, "
                    f"but the task's records up to {self.applied} were committed by attempt {self.attempt}"
                )
            # the first commit of a range wins, and the same write fences the other racer
            return TaskProgress(attempt, end, beaten=max(self.beaten, self.race[1]))
        if attempt == self.attempt and end < self.applied:
            raise ValueError(f"attempt {attempt} went back from record {self.applied} to {end}")
        return TaskProgress(attempt, end, beaten=self.beaten)

    def allows(self, attempt: int) -> bool:
        """Whether ``attempt`` may still train the task."""
        if attempt < self.attempt or (attempt == self.attempt and self.fenced):
            return False
        return not self.attempt < attempt <= self.beaten

    def check(self, attempt: int) -> None:
        """Raise :class:`StalePush` unless ``attempt`` may still train the task."""
        if self.allows(attempt):
            return
        if self.attempt < attempt <= self.beaten:
            raise StalePush(f"attempt {attempt} at this task is over: it lost its race, the task's records up to {self.applied} were committed by attempt {self.attempt}")
        held = "fenced" if self.fenced else "advanced"
        raise StalePush(f"attempt {attempt} at this task is over: the record is {held} by attempt {self.attempt}")

    def fence(self, attempt: int, started_at: int) -> TaskProgress:
        """The record that ends ``attempt`` (which started reading at ``started_at``):
        what it applied stays, nothing more of it will be. An attempt already over
        (superseded or beaten) leaves the record as it is; fencing one racer ends the
        race and the other goes on from ``applied``."""
        if attempt < self.attempt or self.attempt < attempt <= self.beaten:
            return self
        if self.race is not None and attempt == self.race[1]:
            return TaskProgress(self.attempt, self.applied, self.fenced, beaten=max(self.beaten, attempt))
        # a racer committed nothing since the race opened: the other starts at applied
        applied = self.applied if self.attempt == attempt or self.race is not None else started_at
        return TaskProgress(attempt, applied, fenced=True, beaten=self.beaten)

    def open_race(self, primary: int, backup: int) -> TaskProgress:
        """The record once backup attempt ``backup`` races ``primary`` for the records
        from ``applied`` on (the backup starts reading there). The same race again is
        the record as it is (a master retrying). Raises :class:`StalePush` when
        ``primary`` may no longer train the task (no race to open), ValueError for a
        backup that is not a fresh attempt or a second race."""
        if self.race == (primary, backup):
            return self
        if self.race is not None:
            raise ValueError(f"attempts {self.race[0]} and {self.race[1]} race for this task already; one backup at a time")
        self.check(primary)
        if backup <= max(self.attempt, self.beaten, primary):
            raise ValueError(f"backup attempt {backup} is not newer than every attempt this task has seen (attempt {self.attempt}, beaten {self.beaten}, primary {primary})")
        return attrs.evolve(self, race=(primary, backup))

    def encode(self) -> bytes:
        d: dict[str, Any] = {"attempt": self.attempt, "applied": self.applied, "fenced": self.fenced}
        if self.race is not None:  # records without a race read as records before speculation did
            d["race"] = list(self.race)
        if self.beaten:
            d["beaten"] = self.beaten
        return json.dumps(d).encode()

    @classmethod
    def decode(cls, raw: bytes | None, key: str) -> TaskProgress:
        """The record stored at ``key`` (``raw`` None: no attempt advanced it yet)."""
        if raw is None:
            return NO_PROGRESS
        try:
            d: Mapping[str, Any] = json.loads(raw)
            attempt, applied, fenced = d["attempt"], d["applied"], d.get("fenced", False)
            race, beaten = d.get("race"), d.get("beaten", 0)
            if type(attempt) is not int or type(applied) is not int or applied < 0 or not isinstance(fenced, bool):
                raise ValueError(f"attempt and applied must be whole numbers, fenced a boolean: {d!r}")
            if type(beaten) is not int or beaten < 0:
                raise ValueError(f"beaten must be a whole number: {beaten!r}")
            if race is not None:
                if not (isinstance(race, list) and len(race) == 2 and all(type(x) is int for x in race) and race[0] < race[1]):
                    raise ValueError(f"race must be [primary, backup] attempts, primary first: {race!r}")
                race = (race[0], race[1])
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptRecord(f"{key} is not a task progress record ({exc!r}): {raw[:200]!r}", key) from exc
        return cls(attempt, applied, fenced, race, beaten)


#: The record of a task no attempt has advanced yet.
NO_PROGRESS = TaskProgress(attempt=0, applied=0)


def count_records(ranges: list[tuple[int, int]], records: int) -> list[list[int]]:
    """Per-record counts of a task of ``records`` records, trained over the half-open
    ``ranges``, as runs ``[count, length]`` in record order: ``[[1, records]]`` when
    every record was trained exactly once."""
    edges = sorted({0, records, *(min(max(x, 0), records) for r in ranges for x in r)})
    runs: list[list[int]] = []
    for lo, hi in zip(edges, edges[1:]):
        if hi <= lo:
            continue
        n = sum(1 for a, b in ranges if a <= lo and hi <= b)
        if runs and runs[-1][0] == n:
            runs[-1][1] += hi - lo
        else:
            runs.append([n, hi - lo])
    return runs
