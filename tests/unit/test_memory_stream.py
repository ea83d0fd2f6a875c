"""``memory-stream://``, the fake of ``redis-stream://``: the same streaming contract."""

from __future__ import annotations

import uuid

import pytest

from pdps.adapters import memory_stream
from pdps.adapters.memory_stream import MemoryStreamSource
from pdps.core.errors import ConfigError
from pdps.registry import open_data_source
from tests.unit.contract_stream import EntryHarness, EntryStreamContract


class MemoryHarness(EntryHarness):
    def __init__(self) -> None:
        self.url = f"memory-stream://test-{uuid.uuid4().hex[:12]}"
        self.source = open_data_source(self.url)

    def open(self, url):
        return MemoryStreamSource(url)

    def remove(self, cut):
        first = cut.location.rpartition("#")[2].partition("..")[0]
        assert memory_stream.delete(self.url, [first]) == 1


class TestMemoryStream(EntryStreamContract):
    @pytest.fixture
    def harness(self):
        return MemoryHarness()


def test_sources_of_one_name_share_the_stream():
    url = f"memory-stream://shared-{uuid.uuid4().hex[:12]}"
    from pdps import streams

    streams.append(url, {"y": [1, 2, 3]})
    got = MemoryStreamSource(url).poll("0", task_records=3, max_tasks=1, flush=False)
    assert [c.records for c in got.cuts] == [3]


@pytest.mark.parametrize("url", ["memory-stream://", "memory-stream://a?from=now", "memory-stream://a#1..2"])
def test_a_bad_url_is_refused(url):
    with pytest.raises(ConfigError):
        MemoryStreamSource(url)


def test_a_bad_cursor_is_refused():
    with pytest.raises(ConfigError, match="'1-0'"):
        MemoryStreamSource("memory-stream://cursor").poll("1-0", task_records=1, max_tasks=1, flush=True)


def test_a_url_schema_reads_like_numpy_shapes():
    from pdps.adapters.entry_stream import parse_schema

    schema = parse_schema("x:float32[4,4], y:int64,ok:bool[2]", where="u")
    assert {n: (c.dtype.name, c.shape, c.nbytes) for n, c in schema.items()} == {
        "x": ("float32", (4, 4), 64),
        "y": ("int64", (), 8),
        "ok": ("bool", (2,), 2),
    }


@pytest.mark.parametrize("text", ["", "x", "x:float32[0]", "x:complex64", "x:int64,x:int64", "x:int64;y:int64"])
def test_a_bad_url_schema_is_refused_naming_it(text):
    with pytest.raises(ConfigError):
        MemoryStreamSource(f"memory-stream://s?schema={text}")


def test_append_refuses_a_source_that_is_not_a_stream(tmp_path):
    from pdps import streams

    with pytest.raises(ConfigError, match="not a stream"):
        streams.append(f"file://{tmp_path}", {"y": [1]})
