"""CountingStore: a store like any other (the contract), and what it counts, exactly."""

from __future__ import annotations

import pytest

from pdps.adapters.memory_store import MemoryStore
from pdps.core.job import Keys
from pdps.ports.coordination import Compare, Delete, Put
from pdps.runtime.counting import OUTSIDE, CountingStore
from tests.unit.contract_store import StoreContract, wait_until
from tests.unit.test_memory_store import FakeClock


class TestCountingStore(StoreContract):
    @pytest.fixture
    def clock(self):
        return FakeClock()

    @pytest.fixture
    def inner(self, clock):
        s = MemoryStore(clock=clock)
        yield s
        s.close()

    @pytest.fixture
    def store(self, inner):
        return CountingStore(inner)

    @pytest.fixture
    def advance(self, clock, inner):
        def advance(seconds: float) -> None:
            clock.now += seconds
            inner.tick()

        return advance


ROOT = Keys("j").root


@pytest.fixture
def counting():
    s = CountingStore(MemoryStore(), root=ROOT)
    yield s
    s.close()


def test_counts_calls_reads_writes_and_bytes_by_key_family(counting):
    rounds, progress = ROOT + "rounds/0/1", ROOT + "progress/7"
    counting.put(rounds, b"abc")
    counting.commit([Compare.absent(progress)], [Put(progress, b"12345"), Delete(ROOT + "tasks/3")])
    assert counting.get(rounds).value == b"abc"
    assert counting.get(ROOT + "rounds/0/2") is None
    assert len(counting.range(ROOT + "progress/")) == 1
    counting.get("/elsewhere")

    c = counting.counts()
    assert c.calls == {"put": 1, "commit": 1, "get": 3, "range": 1}
    assert c.ops == 6
    assert c.reads == {"rounds": 2, "progress": 1, OUTSIDE: 1}
    assert c.writes == {"rounds": 1, "progress": 1, "tasks": 1}
    assert c.bytes_written == {"rounds": len(rounds) + 3, "progress": len(progress) + 5, "tasks": len(ROOT + "tasks/3")}
    assert c.bytes_read == {"rounds": len(rounds) + 3, "progress": len(progress) + 5}
    assert c.conflicts == {} and c.events == {}
    assert c.total("writes") == 3


def test_a_failed_compare_is_a_conflict_of_the_guarded_family_and_writes_only_its_failure_ops(counting):
    key = ROOT + "rounds/0/0"
    counting.put(key, b"x")
    stale = Compare.absent(key)
    result = counting.commit([stale, Compare.absent(ROOT + "progress/1")], [Put(key, b"yyyy")], [Put(ROOT + "audit/0/1", b"z")])
    assert not result.succeeded
    c = counting.counts()
    assert c.conflicts == {"rounds": 1}
    assert c.writes == {"rounds": 1, "audit": 1}  # the put before, and the failure op
    assert c.bytes_written["rounds"] == len(key) + 1


def test_watch_events_delivered_are_counted_as_reads_of_their_family(counting):
    seen = []
    w = counting.watch(ROOT + "trainers/", seen.append)
    try:
        before = counting.counts()
        counting.put(ROOT + "trainers/t1", b"{}")
        counting.delete(ROOT + "trainers/t1")
        assert wait_until(lambda: len(seen) == 2)
        since = counting.counts().minus(before)
        assert since.events == {"trainers": 2}
        assert since.calls == {"put": 1, "delete": 1}
        key_bytes = len(ROOT + "trainers/t1")
        assert since.bytes_read == {"trainers": 2 * key_bytes + 2}
    finally:
        w.cancel()


def test_reset_starts_the_counts_again(counting):
    counting.put(ROOT + "a", b"1")
    counting.reset()
    assert counting.counts().ops == 0
    assert counting.counts().to_json()["calls"] == {}
