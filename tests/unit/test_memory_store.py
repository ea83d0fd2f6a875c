from __future__ import annotations

import pytest

from pdps.adapters.memory_store import MemoryStore, open_memory_store
from pdps.core.errors import StoreError
from tests.unit.contract_store import StoreContract


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class TestMemoryStore(StoreContract):
    @pytest.fixture
    def clock(self):
        return FakeClock()

    @pytest.fixture
    def store(self, clock):
        s = MemoryStore(clock=clock)
        yield s
        s.close()

    @pytest.fixture
    def advance(self, clock, store):
        def advance(seconds: float) -> None:
            clock.now += seconds
            store.tick()

        return advance


def test_lease_expiry_follows_the_injected_clock_only():
    clock = FakeClock()
    store = MemoryStore(clock=clock)
    lease = store.grant_lease(10)
    store.put("/a", b"1", lease=lease)
    clock.now += 9.9
    assert store.get("/a") is not None
    clock.now += 0.2
    assert store.get("/a") is None
    assert store.lease_ttl_left(lease) is None


def test_named_memory_stores_are_shared_and_anonymous_ones_are_not():
    a, b = open_memory_store("memory://shared-test"), open_memory_store("memory://shared-test")
    assert a is b
    assert open_memory_store("memory://") is not open_memory_store("memory://")
    a.close()
    assert open_memory_store("memory://shared-test") is not a  # a closed store is replaced


def test_closed_store_refuses_work():
    s = MemoryStore()
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.get("/a")


def test_non_bytes_value_is_refused():
    s = MemoryStore()
    with pytest.raises(StoreError):
        s.put("/a", "text")  # type: ignore[arg-type]
    assert s.get("/a") is None
