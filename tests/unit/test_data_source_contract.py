"""The DataSource contract, run on every data source pdps ships: ``read`` yields a
task's records ``[start, records)`` in batches whose bounds depend only on
``(start, batch_size)``, the same on every call."""

from __future__ import annotations

import numpy as np
import pytest

from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.tasks import TaskSpec
from pdps.ports.data import DataSource, read_whole
from pdps.shell.control_plane import Records

ROWS = 10


@pytest.fixture(params=["parquet", "records"])
def source(request, tmp_path) -> DataSource:
    """A source whose first task has ``ROWS`` records."""
    if request.param == "records":
        return Records(2, ROWS)
    rng = np.random.default_rng(3)
    columns = {"x": rng.standard_normal((2 * ROWS, 2)).astype(np.float32), "y": np.arange(2 * ROWS)}
    write_parquet_shards(columns, str(tmp_path / "ds"), shards=1, row_group_size=ROWS)
    return ParquetSource(str(tmp_path / "ds"))


def test_is_a_data_source(source):
    assert isinstance(source, DataSource)


@pytest.mark.parametrize("batch_size", [1, 3, 4, ROWS, ROWS + 5])
@pytest.mark.parametrize("start", [0, 2, 3, ROWS - 1, ROWS])
def test_batches_cover_start_to_the_end_in_steps_of_batch_size(source, start, batch_size):
    check_batches(source, source.tasks()[0], start, batch_size)


def check_batches(source: DataSource, task: TaskSpec, start: int, batch_size: int) -> None:
    """``read(task, start=, batch_size=)`` yields ``[start, records)`` in batches whose
    bounds depend only on ``(start, batch_size)``, the same on a second call (the
    streaming contract runs it on cuts too)."""
    whole = read_whole(source, task)
    assert {len(v) for v in whole.values()} == {task.records}
    got = list(source.read(task, start=start, batch_size=batch_size))
    bounds = [(lo, min(lo + batch_size, task.records)) for lo in range(start, task.records, batch_size)]
    assert [len(b["x"]) for b in got] == [hi - lo for lo, hi in bounds]
    for batch, (lo, hi) in zip(got, bounds):
        assert sorted(batch) == sorted(whole)
        for name, column in batch.items():
            np.testing.assert_array_equal(column, whole[name][lo:hi])
    again = list(source.read(task, start=start, batch_size=batch_size))
    for one, other in zip(got, again, strict=True):
        for name in one:
            np.testing.assert_array_equal(one[name], other[name])


def test_a_start_at_the_end_yields_nothing(source):
    task = source.tasks()[1]
    assert list(source.read(task, start=task.records, batch_size=4)) == []
