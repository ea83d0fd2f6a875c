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


def test_a_range_finds_every_key_under_its_prefix_whatever_directory_it_ends_in():
    """range reads the directories under its prefix (not every key): nested ones, a
    prefix that ends inside a name, keys deleted and written again, and leases' deletes."""
    store = MemoryStore()
    keys = ["/j/tasks/00000001", "/j/tasks/00000002", "/j/audit/000000/00000001", "/j/audit/000001/00000001", "/j/task", "/j/trainers/t-1", "/k/x"]
    for k in keys:
        store.put(k, b"v")
    lease = store.grant_lease(10.0)
    store.put("/j/trainers/t-2", b"v", lease=lease)

    def found(prefix):
        return [kv.key for kv in store.range(prefix)]

    assert found("/j/audit/") == ["/j/audit/000000/00000001", "/j/audit/000001/00000001"]
    assert found("/j/task") == ["/j/task", "/j/tasks/00000001", "/j/tasks/00000002"]
    assert found("/j/tasks/0000000") == ["/j/tasks/00000001", "/j/tasks/00000002"]
    assert found("/j/trainers/") == ["/j/trainers/t-1", "/j/trainers/t-2"]
    assert found("") == sorted([*keys, "/j/trainers/t-2"])
    store.revoke_lease(lease)
    store.delete("/j/tasks/00000001")
    store.delete_prefix("/j/audit/000000/")
    assert found("/j/") == ["/j/audit/000001/00000001", "/j/task", "/j/tasks/00000002", "/j/trainers/t-1"]
    store.put("/j/audit/000000/00000009", b"again")
    assert found("/j/audit/000000") == ["/j/audit/000000/00000009"]
    assert store._dirs.keys() == {"/j/", "/j/tasks/", "/j/audit/000000/", "/j/audit/000001/", "/j/trainers/", "/k/"}  # emptied ones go
