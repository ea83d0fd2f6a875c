"""ParquetSource: tasks from footers only, one row group read per task, errors before any task."""

from __future__ import annotations

import importlib
import sys
import uuid

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import ConfigError, DatasetError, MissingExtraError
from pdps.core.tasks import TaskSpec
from pdps.ports.data import DataSource, read_whole

ROWS = 10


@pytest.fixture
def columns():
    rng = np.random.default_rng(7)
    return {
        "x": rng.standard_normal((ROWS, 3)).astype(np.float32),
        "y": np.arange(ROWS, dtype=np.int64),
        "w": rng.random(ROWS),
    }


@pytest.fixture
def one_file(tmp_path, columns):
    """10 rows in one file, row groups of 4, 4 and 2 rows."""
    [url] = write_parquet_shards(columns, str(tmp_path / "ds"), shards=1, row_group_size=4)
    return url


def test_is_a_data_source(one_file):
    assert isinstance(ParquetSource(one_file), DataSource)


def test_one_task_per_row_group(one_file):
    tasks = ParquetSource(one_file).tasks()
    assert tasks == [
        TaskSpec(id=0, location=one_file, part=0, records=4),
        TaskSpec(id=1, location=one_file, part=1, records=4),
        TaskSpec(id=2, location=one_file, part=2, records=2),
    ]


def test_read_returns_the_rows_of_its_row_group(one_file, columns):
    source = ParquetSource(one_file)
    got = read_whole(source, source.tasks()[1])
    assert sorted(got) == ["w", "x", "y"]
    assert got["x"].shape == (4, 3) and got["x"].dtype == np.float32
    np.testing.assert_array_equal(got["x"], columns["x"][4:8])
    np.testing.assert_array_equal(got["y"], columns["y"][4:8])
    assert got["y"].ndim == 1 and got["y"].dtype == np.int64
    np.testing.assert_array_equal(got["w"], columns["w"][4:8])
    got["x"][0, 0] = 1.0  # trainers may normalise in place
    got["y"][0] = 1


def test_directory_of_shards_in_name_order(tmp_path, columns):
    files = write_parquet_shards(columns, f"file://{tmp_path}/ds", shards=3, row_group_size=2)
    source = ParquetSource(f"file://{tmp_path}/ds")
    tasks = source.tasks()
    assert [t.id for t in tasks] == list(range(len(tasks)))
    assert [t.location for t in tasks] == sorted(t.location for t in tasks)
    assert {t.location for t in tasks} == set(files)
    assert sum(t.records for t in tasks) == ROWS
    assert max(t.records for t in tasks) == 2
    parts = [read_whole(source, t) for t in tasks]
    for name, want in columns.items():
        np.testing.assert_array_equal(np.concatenate([p[name] for p in parts]), want)


def test_files_are_ordered_by_name_not_by_creation(tmp_path):
    for name, value in [("c", 3.0), ("a", 1.0), ("b", 2.0)]:
        pq.write_table(pa.table({"v": [value]}), tmp_path / f"{name}.parquet")
    source = ParquetSource(str(tmp_path))
    tasks = source.tasks()
    assert [t.location.rsplit("/", 1)[1] for t in tasks] == ["a.parquet", "b.parquet", "c.parquet"]
    assert [float(read_whole(source, t)["v"][0]) for t in tasks] == [1.0, 2.0, 3.0]


def test_other_and_hidden_files_are_ignored(tmp_path):
    pq.write_table(pa.table({"v": [1.0]}), tmp_path / "part-0.parquet")
    (tmp_path / "_SUCCESS").write_bytes(b"")
    (tmp_path / "README.txt").write_text("not data")
    (tmp_path / ".part-0.parquet.crc").write_bytes(b"crc")
    (tmp_path / "_tmp.parquet").write_bytes(b"half a file")
    assert [t.location.rsplit("/", 1)[1] for t in ParquetSource(str(tmp_path)).tasks()] == ["part-0.parquet"]


def test_tasks_reads_footers_only(one_file, monkeypatch):
    def no_data(*args, **kwargs):
        raise AssertionError("the master must not read data pages")

    for method in ["read", "read_row_group", "read_row_groups", "iter_batches"]:
        monkeypatch.setattr(pq.ParquetFile, method, no_data)
    monkeypatch.setattr(pq, "read_table", no_data)
    source = ParquetSource(one_file)
    assert [t.records for t in source.tasks()] == [4, 4, 2]
    with pytest.raises(AssertionError):  # the trap is armed: reading data would trip it
        read_whole(source, TaskSpec(id=0, location=one_file, part=0, records=4))


def test_empty_row_groups_are_skipped(tmp_path):
    schema = pa.schema([("v", pa.float64())])
    with pq.ParquetWriter(tmp_path / "a.parquet", schema) as writer:
        writer.write_table(pa.table({"v": [1.0, 2.0]}, schema=schema))
        writer.write_table(pa.table({"v": pa.array([], pa.float64())}))
        writer.write_table(pa.table({"v": [3.0]}, schema=schema))
    pq.write_table(pa.table({"v": pa.array([], pa.float64())}), tmp_path / "b.parquet")
    pq.write_table(pa.table({"v": [4.0]}), tmp_path / "c.parquet")
    tasks = ParquetSource(str(tmp_path)).tasks()
    assert [(t.id, t.location.rsplit("/", 1)[1], t.part, t.records) for t in tasks] == [
        (0, "a.parquet", 0, 2),
        (1, "a.parquet", 2, 1),
        (2, "c.parquet", 0, 1),
    ]


def test_missing_path_names_the_url(tmp_path):
    url = f"file://{tmp_path}/nope"
    with pytest.raises(DatasetError, match="nope"):
        ParquetSource(url).tasks()


def test_file_that_is_not_parquet_is_named(tmp_path):
    pq.write_table(pa.table({"v": [1.0]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_text("id,label\n1,0\n")
    with pytest.raises(DatasetError, match=r"b\.parquet is not a Parquet file"):
        ParquetSource(str(tmp_path)).tasks()


def test_single_file_that_is_not_parquet(tmp_path):
    (tmp_path / "data.csv").write_text("id,label\n1,0\n")
    with pytest.raises(DatasetError, match=r"data\.csv is not a Parquet file"):
        ParquetSource(str(tmp_path / "data.csv")).tasks()


def test_directory_without_parquet_files(tmp_path):
    (tmp_path / "data.csv").write_text("1,2\n")
    with pytest.raises(DatasetError, match="no \\*.parquet files"):
        ParquetSource(str(tmp_path)).tasks()


def test_zero_row_dataset(tmp_path):
    pq.write_table(pa.table({"v": pa.array([], pa.float32())}), tmp_path / "empty.parquet")
    with pytest.raises(DatasetError, match="no rows"):
        ParquetSource(str(tmp_path)).tasks()


def test_non_numeric_column_is_refused_before_any_task(tmp_path):
    pq.write_table(pa.table({"v": [1.0], "name": ["a"]}), tmp_path / "a.parquet")
    with pytest.raises(DatasetError, match="'name'.*string"):
        ParquetSource(str(tmp_path)).tasks()


def test_files_with_different_columns_are_refused(tmp_path):
    pq.write_table(pa.table({"v": [1.0]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"v": [1]}), tmp_path / "b.parquet")
    with pytest.raises(DatasetError, match=r"b\.parquet.*same columns"):
        ParquetSource(str(tmp_path)).tasks()


def test_list_column_of_equal_lengths_becomes_2d(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int32()))}), path)
    source = ParquetSource(str(path))
    [task] = source.tasks()
    got = read_whole(source, task)["v"]
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, [[1, 2], [3, 4], [5, 6]])


def test_ragged_list_column_is_a_dataset_error(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": pa.array([[1.0, 2.0], [3.0]])}), path)
    source = ParquetSource(str(path))
    [task] = source.tasks()
    with pytest.raises(DatasetError, match="'v'.*lengths 1..2"):
        read_whole(source, task)


def test_missing_values_are_a_dataset_error(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": pa.array([1.0, None])}), path)
    source = ParquetSource(str(path))
    with pytest.raises(DatasetError, match="'v'.*1 missing"):
        read_whole(source, source.tasks()[0])


def test_read_notices_a_dataset_rewritten_after_its_tasks(tmp_path, columns):
    url = str(tmp_path / "ds")
    write_parquet_shards(columns, url, shards=1, row_group_size=4)
    source = ParquetSource(url)
    tasks = source.tasks()
    write_parquet_shards(columns, url, shards=1, row_group_size=5, overwrite=True)
    with pytest.raises(DatasetError, match="changed"):
        read_whole(source, tasks[1])
    with pytest.raises(DatasetError, match="changed"):
        read_whole(source, tasks[2])  # row group 2 no longer exists


def test_a_task_with_fewer_rows_than_its_spec_is_a_dataset_error_naming_it(one_file):
    source = ParquetSource(one_file)
    task = TaskSpec(id=7, location=one_file, part=2, records=3)  # row group 2 holds 2 rows
    with pytest.raises(DatasetError, match=r"row group 2 has 2 rows, its task says 3.*changed") as info:
        next(source.read(task, start=1, batch_size=1))
    assert one_file in str(info.value)


def test_read_asks_pyarrow_for_batches_and_holds_one_at_a_time(tmp_path, monkeypatch):
    rows, batch_size = 1000, 64
    cols = {"x": np.arange(rows * 4, dtype=np.float32).reshape(rows, 4), "y": np.arange(rows)}
    [url] = write_parquet_shards(cols, str(tmp_path / "ds"), shards=1, row_group_size=rows)
    asked = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        asked.append(kwargs)
        return iter_batches(self, *args, **kwargs)

    def whole(*args, **kwargs):
        raise AssertionError("a trainer must not decode a whole row group at once")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    for method in ["read", "read_row_group", "read_row_groups"]:
        monkeypatch.setattr(pq.ParquetFile, method, whole)
    source = ParquetSource(url)
    [task] = source.tasks()
    start = 100
    sizes = []
    for batch in source.read(task, start=start, batch_size=batch_size):
        assert batch["x"].shape[1:] == (4,) and batch["y"].ndim == 1
        np.testing.assert_array_equal(batch["y"], cols["y"][start : start + len(batch["y"])])
        start += len(batch["y"])
        sizes.append(len(batch["y"]))
    assert start == rows
    assert sizes == [batch_size] * 14 + [4]
    assert [(a["row_groups"], a["batch_size"]) for a in asked] == [([0], batch_size)]


def test_a_list_column_keeps_its_width_across_the_batches_of_a_task(tmp_path):
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"v": pa.array([[1.0, 2.0], [3.0, 4.0], [5.0]])}), path)
    source = ParquetSource(str(path))
    [task] = source.tasks()
    batches = source.read(task, batch_size=2)
    np.testing.assert_array_equal(next(batches)["v"], [[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(DatasetError, match="'v'.*lengths 1..2"):
        next(batches)


def test_memory_url(columns):
    url = f"memory://pdps-test-{uuid.uuid4().hex}/ds"
    try:
        files = write_parquet_shards(columns, url, shards=2, row_group_size=3)
        source = ParquetSource(url)
        tasks = source.tasks()
        assert [t.records for t in tasks] == [3, 2, 3, 2]
        assert {t.location for t in tasks} == set(files)
        assert all(loc.startswith("memory://") for loc in files)
        np.testing.assert_array_equal(read_whole(source, tasks[2])["x"], columns["x"][5:8])
    finally:
        fs = fsspec.filesystem("memory")
        fs.rm(url.removeprefix("memory://").split("/")[0], recursive=True)


def test_writer_refuses_to_mix_with_existing_files(tmp_path, columns):
    url = str(tmp_path / "ds")
    write_parquet_shards(columns, url, shards=3, row_group_size=4)
    with pytest.raises(DatasetError, match="already holds 3"):
        write_parquet_shards(columns, url, shards=1, row_group_size=4)
    write_parquet_shards(columns, url, shards=1, row_group_size=4, overwrite=True)
    assert len(ParquetSource(url).tasks()) == 3  # one file of 4+4+2 rows, no stale shards


@pytest.mark.parametrize(
    "cols, shards, size, match",
    [
        ({}, 1, 1, "at least one column"),
        ({"a": np.zeros(3), "b": np.zeros(4)}, 1, 1, "different lengths"),
        ({"a": np.zeros(3)}, 4, 1, "shards=4"),
        ({"a": np.zeros(3)}, 1, 0, "row_group_size=0"),
        ({"a": np.array(["x", "y"])}, 1, 1, "numbers only"),
        ({"a": np.zeros((2, 2, 2))}, 1, 1, "1-D or 2-D"),
    ],
)
def test_writer_rejects_bad_input(tmp_path, cols, shards, size, match):
    with pytest.raises(ConfigError, match=match):
        write_parquet_shards(cols, str(tmp_path / "ds"), shards=shards, row_group_size=size)
    assert not (tmp_path / "ds").exists()


def test_import_without_pyarrow_names_the_extra(monkeypatch):
    for name in list(sys.modules):
        if name == "pyarrow" or name.startswith("pyarrow."):
            monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.delitem(sys.modules, "pdps.adapters.parquet")
    with pytest.raises(MissingExtraError, match=r"pip install 'pdps\[parquet\]'"):
        importlib.import_module("pdps.adapters.parquet")
