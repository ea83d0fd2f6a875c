"""Data source port: a dataset seen as tasks, each read on its own by a trainer.

Contract:

* ``tasks()`` describes the dataset without reading its records (for Parquet: the
  file footers only), so the master never loads the data. A missing dataset, an
  empty one, or one in the wrong format raises :class:`~pdps.core.errors.DatasetError`
  here, before any task exists. Task ids are ``0..n-1`` in a stable order.
* ``read(task)`` returns that task's records as named numpy columns of equal length
  (a fixed-size list column becomes a 2-D array).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from pdps.core.tasks import TaskSpec


@runtime_checkable
class DataSource(Protocol):
    url: str

    def tasks(self) -> list[TaskSpec]: ...

    def read(self, task: TaskSpec) -> dict[str, np.ndarray]: ...
