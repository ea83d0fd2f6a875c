"""Streaming sources on real servers: ``redis-stream://`` on the session's Redis, and
Parquet directories in follow mode on ``file://`` and on moto's S3, each through the
StreamingSource contract, then what only it has to get right."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis

from pdps import streams
from pdps.adapters.redis_stream import RedisStreamSource
from pdps.core.errors import DatasetError
from pdps.registry import open_data_source
from tests.unit.contract_stream import EntryHarness, EntryStreamContract, records, task_of


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
