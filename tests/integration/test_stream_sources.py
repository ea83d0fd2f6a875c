"""Streaming sources on real servers: ``redis-stream://`` on the session's Redis, and
Parquet directories in follow mode on ``file://`` and on moto's S3, each through the
StreamingSource contract, then what only it has to get right."""

from __future__ import annotations

import time
import uuid

import numpy as np
import pytest
import redis

from pdps import streams
from pdps.adapters.redis_stream import RedisStreamSource
from pdps.core.errors import DatasetError
from pdps.ports.data import Arrivals
from pdps.registry import open_data_source
from tests.unit.contract_stream import EntryHarness, EntryStreamContract, Harness, StreamContract, read_cuts, records, task_of


class RedisHarness(EntryHarness):
    def __init__(self, server) -> None:
        self.name = f"events-{uuid.uuid4().hex[:12]}"
        self.url = f"redis-stream://127.0.0.1:{server.port}/0/{self.name}"
        self.client = redis.Redis(host="127.0.0.1", port=server.port)
        self.source = open_data_source(self.url)

    def open(self, url):
        return RedisStreamSource(url)

    def remove(self, cut):
        first = cut.location.rpartition("#")[2].partition("..")[0]
        assert self.client.xdel(self.name, first) == 1


@pytest.fixture
def redis_stream(redis_server):
    h = RedisHarness(redis_server)
    yield h
    h.source.close()
    h.client.close()


class TestRedisStream(EntryStreamContract):
    @pytest.fixture
    def harness(self, redis_stream):
        return redis_stream


def test_ten_thousand_records_append_in_order_and_read_back(redis_stream):
    columns = {"x": np.random.default_rng(1).standard_normal((10_000, 64)).astype(np.float32), "y": np.arange(10_000)}
    ids = streams.append(redis_stream.url, columns)
    assert len(ids) == 10_000 and redis_stream.client.xlen(redis_stream.name) == 10_000
    got = redis_stream.source.poll("0-0", task_records=4_000, max_tasks=10, flush=True)
    assert [c.records for c in got.cuts] == [4_000, 4_000, 2_000] and got.cursor == ids[-1]
    batches = list(redis_stream.source.read(task_of(got.cuts[1]), start=100, batch_size=1_000))
    assert [len(b["y"]) for b in batches] == [1_000] * 3 + [900]
    np.testing.assert_array_equal(np.concatenate([b["x"] for b in batches]), columns["x"][4_100:8_000])


def test_entries_written_without_a_schema_need_one_in_the_url(redis_stream):
    client, name = redis_stream.client, redis_stream.name
    for y in range(3):
        client.xadd(name, {"y": np.int64(y).tobytes(), "w": np.float32(y / 2).tobytes()})
    (cut,) = redis_stream.source.poll("0-0", task_records=3, max_tasks=1, flush=False).cuts
    with pytest.raises(DatasetError, match="no schema"):
        next(iter(redis_stream.source.read(task_of(cut), batch_size=3)))
    typed = RedisStreamSource(redis_stream.url + "?schema=y:int64,w:float32")
    got = next(iter(typed.read(task_of(cut), batch_size=3)))
    np.testing.assert_array_equal(got["y"], [0, 1, 2])
    np.testing.assert_array_equal(got["w"], np.float32([0, 0.5, 1]))
    short = RedisStreamSource(redis_stream.url + "?schema=y:int32,w:float32")
    with pytest.raises(DatasetError, match="entry .* has fields"):
        next(iter(short.read(task_of(cut), batch_size=3)))


def test_an_unreachable_server_is_a_dataset_error_naming_the_stream():
    from tests.servers import free_port

    source = RedisStreamSource(f"redis-stream://127.0.0.1:{free_port()}/0/gone?timeout=0.5")
    with pytest.raises(DatasetError, match="gone is unreachable"):
        source.poll("0-0", task_records=1, max_tasks=1, flush=True)


def test_the_password_never_shows(redis_stream):
    source = RedisStreamSource(redis_stream.url.replace("127.0.0.1", ":hunter2@127.0.0.1"))
    assert "hunter2" not in source.url and "hunter2" not in repr(source)


# --- a growing Parquet directory (?follow=1) -------------------------------------------

POLL = 0.05  # poll_seconds of the followed directories


def parquet_bytes(columns, row_group_size: int = 6) -> bytes:
    import pyarrow as pa
    import pyarrow.parquet as pq

    x = columns["x"]
    table = pa.table({"x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1]), "y": pa.array(columns["y"])})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, row_group_size=row_group_size)
    return sink.getvalue().to_pybytes()


class DirectoryHarness(Harness):
    splits = False

    def __init__(self, url: str) -> None:
        from pdps.adapters.fsspec_storage import filesystem_for

        self.fs, self.root = filesystem_for(url)
        self.source = open_data_source(f"{url}?follow=1&poll_seconds={POLL}")
        self.files = 0

    def put(self, name: str, data: bytes) -> None:
        path = f"{self.root}/{name}"
        self.fs.makedirs(path.rpartition("/")[0], exist_ok=True)
        self.fs.pipe_file(path, data)

    def append(self, columns) -> None:
        self.put(f"part-{self.files:05d}.parquet", parquet_bytes(columns))
        self.files += 1

    def poll(self, cursor, **kw):
        self.source.poll(cursor, **kw)  # sees the new files' sizes and mtimes
        time.sleep(POLL * 1.5)
        return self.source.poll(cursor, **kw)  # ... unchanged since: complete

    def remove(self, cut):
        self.fs.rm_file(cut.location)


@pytest.fixture(params=["file", "s3"])
def directory(request, tmp_path):
    if request.param == "s3":
        bucket = request.getfixturevalue("s3_env").create_bucket()
        return DirectoryHarness(f"s3://{bucket}/landing")
    (tmp_path / "landing").mkdir()
    return DirectoryHarness(f"file://{tmp_path}/landing")


class TestFollowedDirectory(StreamContract):
    @pytest.fixture
    def harness(self, directory):
        return directory


def ys(h: Harness, arrivals) -> list[int]:
    return read_cuts(h, arrivals.cuts).tolist()


def test_a_file_written_under_a_temporary_name_is_cut_once_renamed(directory):
    h = directory
    h.put("_tmp-part-00000.parquet", parquet_bytes(records(0, 3)))
    h.put(".part-00000.parquet.crc", b"not parquet")
    assert h.poll("", task_records=4, max_tasks=8, flush=True) == Arrivals((), "", 0)
    h.fs.mv(f"{h.root}/_tmp-part-00000.parquet", f"{h.root}/part-00000.parquet")
    got = h.poll("", task_records=4, max_tasks=8, flush=True)
    assert ys(h, got) == [0, 1, 2] and got.cursor == "part-00000.parquet"


def test_a_truncated_file_holds_back_the_files_after_it_until_it_is_whole(directory):
    h = directory
    whole = parquet_bytes(records(0, 5))
    h.put("part-00000.parquet", whole[: len(whole) // 2])
    h.put("part-00001.parquet", parquet_bytes(records(5, 2)))
    for _ in range(2):
        got = h.poll("", task_records=4, max_tasks=8, flush=True)
        assert got.cuts == () and got.cursor == "" and "part-00000.parquet has no readable Parquet footer" in got.stalled
    h.put("part-00000.parquet", whole)
    got = h.poll("", task_records=4, max_tasks=8, flush=True)
    assert ys(h, got) == list(range(7)) and got.cursor == "part-00001.parquet" and got.stalled is None


def test_a_file_still_growing_waits_until_its_bytes_stay_unchanged(directory):
    h = directory
    whole = parquet_bytes(records(0, 3))
    path = f"{h.root}/part-00000.parquet"
    h.put("part-00000.parquet", whole[:100])  # a writer's first bytes
    h.source.poll("", task_records=4, max_tasks=8, flush=True)
    time.sleep(POLL * 1.5)
    if h.fs.protocol[0] == "file":
        with open(path, "ab") as f:  # the same file grows to its end, footer last
            f.write(whole[100:])
    else:
        h.put("part-00000.parquet", whole)  # an object store replaces objects whole
    got = h.source.poll("", task_records=4, max_tasks=8, flush=True)
    assert got.cuts == () and "still changing" in got.stalled  # whole now, but only just
    time.sleep(POLL * 1.5)
    got = h.source.poll("", task_records=4, max_tasks=8, flush=True)
    assert ys(h, got) == [0, 1, 2]


def test_a_late_file_is_counted_and_never_cut(directory, caplog):
    h = directory
    h.put("part-00000.parquet", parquet_bytes(records(0, 2)))
    h.put("part-00002.parquet", parquet_bytes(records(2, 2)))
    got = h.poll("", task_records=4, max_tasks=8, flush=True)
    assert ys(h, got) == [0, 1, 2, 3] and got.cursor == "part-00002.parquet"
    h.put("part-00001.parquet", parquet_bytes(records(100, 2)))
    h.put("part-00003.parquet", parquet_bytes(records(4, 1)))
    later = h.poll(got.cursor, task_records=4, max_tasks=8, flush=True)
    assert ys(h, later) == [4] and later.cursor == "part-00003.parquet"
    assert h.source.late_files == 1 and h.source.late_names == ["part-00001.parquet"]
    assert sum("part-00001.parquet appeared" in r.getMessage() for r in caplog.records if r.levelname == "ERROR") == 1


def test_max_tasks_can_stop_inside_a_file_and_a_new_source_goes_on_from_there(directory):
    h = directory
    h.put("part-00000.parquet", parquet_bytes(records(0, 10), row_group_size=4))
    got = h.poll("", task_records=1, max_tasks=2, flush=False)
    assert [c.part for c in got.cuts] == [0, 1] and got.cursor == "part-00000.parquet#1" and got.backlog == 2
    other = open_data_source(h.source.url)
    rest = other.poll(got.cursor, task_records=1, max_tasks=2, flush=False)
    assert [c.part for c in rest.cuts] == [2] and rest.cursor == "part-00000.parquet" and rest.backlog == 0


def test_partitions_in_folders_are_taken_in_path_order(directory):
    h = directory
    h.put("dt=2024-05-02/part-0.parquet", parquet_bytes(records(3, 2)))
    h.put("dt=2024-05-01/part-0.parquet", parquet_bytes(records(0, 3)))
    h.put("_temporary/0/part-0.parquet", parquet_bytes(records(50, 1)))
    got = h.poll("", task_records=4, max_tasks=8, flush=True)
    assert ys(h, got) == [0, 1, 2, 3, 4] and got.cursor == "dt=2024-05-02/part-0.parquet"


def test_follow_is_chosen_by_the_url(tmp_path):
    from pdps.adapters.parquet import ParquetFollowSource, ParquetSource
    from pdps.core.errors import ConfigError
    from pdps.ports.data import StreamingSource

    url = f"file://{tmp_path}"
    assert type(open_data_source(url)) is ParquetSource
    follow = open_data_source(f"{url}?follow=1")
    assert isinstance(follow, ParquetFollowSource) and isinstance(follow, StreamingSource) and follow.poll_seconds == 1.0
    for bad in ("?follow=0", "?follow=1&poll_seconds=-1", "?follow=1&every=2"):
        with pytest.raises(ConfigError):
            open_data_source(url + bad)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("redis-stream://127.0.0.1:6390/0", "names no stream"),
        ("redis-stream://127.0.0.1:6390/0/s?from=now", r"unknown option\(s\) \['from'\]"),
        ("redis-stream://127.0.0.1:6390/x/s", "database number"),
        ("redis-stream://127.0.0.1:6390/0/s?schema=x:str", "dtype 'str'"),
    ],
)
def test_a_bad_stream_url_is_refused_before_connecting(url, match):
    from pdps.core.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        RedisStreamSource(url)
