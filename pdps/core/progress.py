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

    def advance(self, attempt: int, applied: int) -> TaskProgress:
        """The record after ``attempt`` has trained through record ``applied``.

        Raises :class:`StalePush` when ``attempt`` has been fenced or superseded: its
        step must not be applied, and its trainer drops the task.
        """
        self.check(attempt)
        if attempt == self.attempt and applied < self.applied:
            raise ValueError(f"attempt {attempt} went back from record {self.applied} to {applied}")
        return TaskProgress(attempt, applied)

    def check(self, attempt: int) -> None:
        """Raise :class:`StalePush` unless ``attempt`` may still train the task."""
        if attempt < self.attempt or (attempt == self.attempt and self.fenced):
            held = "fenced" if self.fenced else "advanced"
            raise StalePush(f"attempt {attempt} at this task is over: the record is {held} by attempt {self.attempt}")

    def fence(self, attempt: int, started_at: int) -> TaskProgress:
        """The record that ends ``attempt`` (which started reading at ``started_at``):
        what it applied stays, nothing more of it will be."""
        applied = self.applied if self.attempt == attempt else started_at
        return TaskProgress(attempt, applied, fenced=True)

    def encode(self) -> bytes:
        return json.dumps({"attempt": self.attempt, "applied": self.applied, "fenced": self.fenced}).encode()

    @classmethod
    def decode(cls, raw: bytes | None, key: str) -> TaskProgress:
        """The record stored at ``key`` (``raw`` None: no attempt advanced it yet)."""
        if raw is None:
            return NO_PROGRESS
        try:
            d: Mapping[str, Any] = json.loads(raw)
            attempt, applied, fenced = d["attempt"], d["applied"], d.get("fenced", False)
            if type(attempt) is not int or type(applied) is not int or applied < 0 or not isinstance(fenced, bool):
                raise ValueError(f"attempt and applied must be whole numbers, fenced a boolean: {d!r}")
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise CorruptRecord(f"{key} is not a task progress record ({exc!r}): {raw[:200]!r}", key) from exc
        return cls(attempt, applied, fenced)


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
