"""Data source port: a dataset seen as tasks, each read on its own by a trainer.

Contract:

* ``tasks()`` describes the dataset without reading its records (for Parquet: the
  file footers only), so the master never loads the data. A missing dataset, an
  empty one, or one in the wrong format raises :class:`~pdps.core.errors.DatasetError`
  here, before any task exists. Task ids are ``0..n-1`` in a stable order.
* ``read(task, start=, batch_size=)`` yields the task's records ``[start, task.records)``
  as named numpy columns of equal length (a fixed-size list column becomes a 2-D
  array), in batches of ``batch_size`` rows, the last one fewer: batch ``k`` covers
  ``[start + k * batch_size, ...)``. The same records in the same order on every call,
  in any process (a trainer that resumes a task at an offset relies on it), so a
  trainer holds one batch, never a whole task. A task whose data does not match it
  (fewer or more rows than ``task.records``, a part that is gone) raises
  :class:`~pdps.core.errors.DatasetError` before the first batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import attrs
import numpy as np

from pdps.core.tasks import TaskSpec

Columns = dict[str, np.ndarray]


@runtime_checkable
class DataSource(Protocol):
    url: str

    def tasks(self) -> list[TaskSpec]: ...

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Iterator[Columns]: ...


def read_whole(source: DataSource, task: TaskSpec) -> Columns:
    """All of a task's records as one set of columns, for checks and replays of small
    tasks (a trainer reads batches): the one batch of ``batch_size=task.records``."""
    (columns,) = source.read(task, batch_size=task.records)
    return columns


@attrs.frozen
class Cut:
    """A piece of newly arrived data that becomes one task (its id is the master's to give)."""

    location: str
    part: int
    records: int


@attrs.frozen
class Arrivals:
    """What one :meth:`StreamingSource.poll` found after its cursor."""

    cuts: tuple[Cut, ...]
    cursor: str  # the position after the last cut: the next poll starts there
    backlog: int | None = None  # records after ``cursor`` not cut yet (None: unknown)
    stalled: str | None = None  # why data that exists is not cut yet ("part-7.parquet is still being written")


@runtime_checkable
class StreamingSource(DataSource, Protocol):
    """An unbounded dataset: tasks are cut from data as it arrives.

    * ``start_cursor()`` is where a new job starts reading; cursors are opaque,
      JSON-safe strings the master persists with the tasks it cut.
    * ``poll(cursor, task_records=K, max_tasks=M, flush=F)`` cuts up to ``M`` tasks
      from the data after ``cursor``, in order, never any data at or before it: each
      cut holds at most ``K`` records where the source can split its data (a stream
      entry range), or one indivisible part (a Parquet row group). With ``flush``
      False only full cuts are made (``K`` records); with ``flush`` True the partial
      tail is cut too. The cuts partition exactly the data between ``cursor`` and
      the returned cursor. Polling the same cursor again may cut differently (nothing
      was persisted), but data once cut never changes, so ``read`` of a cut gives the
      same records on every call, in any process.
    * ``backlog`` is a count the source can give without reading the backlog itself
      (None where it cannot); ``stalled`` says why data that exists is held back
      (a file still being written), None when nothing is.
    * ``tasks()`` is not used for a streaming source (the shipped ones raise
      DatasetError: a stream has no fixed task list); ``read`` is as for any source.

    Shipped: ``redis-stream://`` (:mod:`pdps.adapters.redis_stream`), Parquet
    directories with ``?follow=1`` (:class:`pdps.adapters.parquet.ParquetFollowSource`),
    and the in-process fake ``memory-stream://``; all pass tests/unit/contract_stream.py.
    """

    def start_cursor(self) -> str: ...

    def poll(self, cursor: str, *, task_records: int, max_tasks: int, flush: bool) -> Arrivals: ...
