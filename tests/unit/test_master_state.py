"""The master's persisted state on the memory store: what it writes, how it restores.

The same behaviour on etcd and Redis, with real processes, is in
``tests/integration/test_master_durable.py``.
"""

from __future__ import annotations

import json

import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import CorruptRecord
from pdps.core.job import JobConfig, Keys
from pdps.core.tasks import TaskSpec
from pdps.ports.coordination import Put
from pdps.ports.transport import Message
from pdps.roles.master import Master
from pdps.shell.status import job_status


class Tasks:
    """A data source that only describes ``n`` tasks (the master never reads records)."""

    def __init__(self, n: int) -> None:
        self.url = f"memory://tasks-{n}"
        self.n = n

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location=f"part-{i // 1000}", part=i % 1000, records=10) for i in range(self.n)]

    def read(self, task, *, start=0, batch_size):  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class CountingStore:
    """Delegates to a store and counts the bytes of every key and value it writes."""

    def __init__(self, inner: MemoryStore) -> None:
        self.inner = inner
        self.writes: list[int] = []

    def commit(self, compares, success, failure=(), *, fence=None):
        self.writes.append(sum(len(op.key) + (len(op.value) if isinstance(op, Put) else 0) for op in success))
        return self.inner.commit(compares, success, failure, fence=fence)

    def put(self, key, value, *, lease=None):
        self.writes.append(len(key) + len(value))
        return self.inner.put(key, value, lease=lease)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def start(store, n: int = 20, clock=None, **settings) -> Master:
    config = JobConfig(name="job", dataset=f"memory://tasks-{n}", lease_ttl=30.0, **settings)
    master = Master(store, InprocTransport(), Tasks(n), config, clock=clock or Clock(1000.0))
    master.start()
    return master


def register(store, trainer: str) -> None:
    store.put(Keys("job").trainer(trainer), b"{}", lease=store.grant_lease(30))


def call(master: Master, method: str, **meta) -> dict:
    return master._transport.connect(master.address).call(method, Message(meta)).meta


def test_bytes_written_per_transition_do_not_grow_with_the_queue():
    per_transition = {}
    for n in (1_000, 100_000):
        store = CountingStore(MemoryStore())
        register(store.inner, "t")
        master = start(store, n)
        store.writes.clear()
        for _ in range(50):  # dispatch, finish: two transitions per task
            task = call(master, "get_task", trainer="t")
            call(master, "finish_task", trainer="t", task=task["task"]["id"], attempt=task["attempt"])
        master.stop()
        assert len(store.writes) == 100  # one transaction per transition
        per_transition[n] = max(store.writes)
    assert per_transition[100_000] == per_transition[1_000], per_transition
    assert per_transition[1_000] < 300  # one task record and its key, nothing queue-sized


def test_a_restarted_master_rearms_pending_deadlines_on_its_own_clock():
    store = MemoryStore()
    register(store, "t")
    first = start(store, clock=Clock(1_000_000.0), task_timeout=60.0)
    task = call(first, "get_task", trainer="t")["task"]["id"]
    first.stop()
    stored = json.loads(store.get(Keys("job").task(task)).value)
    assert stored["deadline"] == 1_000_060.0
    second = start(store, clock=Clock(5.0), task_timeout=60.0)  # another process: another clock
    try:
        restored = {r.id: r for r in second.restored}
        assert restored[task].state.value == "pending" and restored[task].deadline == 65.0
        assert second._queue.next_deadline() == 65.0
    finally:
        second.stop()


def test_a_corrupt_task_record_is_quarantined_and_the_rest_continue():
    store = MemoryStore()
    register(store, "t")
    first = start(store)
    for _ in range(3):
        task = call(first, "get_task", trainer="t")
        call(first, "finish_task", trainer="t", task=task["task"]["id"], attempt=task["attempt"])
    first.stop()
    keys = Keys("job")
    store.put(keys.task(1), b"\xff not json")
    store.put(keys.task(2), json.dumps({"id": 7, "pass_no": 0, "state": "done", "attempt": 1, "failures": 0}).encode())
    assert job_status(store, "job")["corrupt"] == [keys.task(1), keys.task(2)]

    second = start(store)
    try:
        assert store.get(keys.task(1)) is None and store.get(keys.task(2)) is None
        status = job_status(store, "job")
        assert status["quarantined"] == 2 and status["corrupt"] == []
        assert {q["key"] for q in status["quarantine"]} == {keys.task(1), keys.task(2)}
        assert "cannot decode" in status["quarantine"][0]["error"]
        note = json.loads(store.get(keys.quarantined(1)).value)
        assert note["key"] == keys.task(1)  # the original bytes are kept, base64-encoded
        # tasks 1 and 2 start over from todo; task 0 stays done
        assert (second.counts().done, second.counts().todo) == (1, 19)
        while "task" in (task := call(second, "get_task", trainer="t")):
            call(second, "finish_task", trainer="t", task=task["task"]["id"], attempt=task["attempt"])
        assert second.done.is_set()
    finally:
        second.stop()


@pytest.mark.parametrize(
    "key, value",
    [("pass", b"two"), ("state", b"{not json"), ("state", b'{"state": "sleeping"}'), ("config", b"\x00\x01"), ("queue", b"["), ("queue", b"[1]")],
)
def test_corrupt_job_state_stops_the_master_with_an_error_naming_the_key(key, value):
    store = MemoryStore()
    start(store).stop()
    full = Keys("job").root + key
    store.put(full, value)
    before = {kv.key: kv.value for kv in store.range("/")}
    master = Master(store, InprocTransport(), Tasks(20), JobConfig(name="job", dataset="memory://tasks-20", lease_ttl=30.0), clock=Clock(0))
    with pytest.raises(CorruptRecord, match=full) as info:
        master.start()
    assert info.value.key == full
    assert {kv.key: kv.value for kv in store.range("/")} == before  # nothing written
    assert store.get(Keys("job").master_lock) is None  # the lock is given back


def test_status_read_while_the_master_starts_the_next_pass_counts_that_pass():
    """The master moves to pass 1 and leases a task of it between status's read of the pass
    and its read of the task records: a record of pass 1 next to pass 0 looked corrupt
    ("a master will quarantine it"); status reads both again instead."""
    store = MemoryStore()
    register(store, "t")
    master = start(store, n=2, passes=2)
    keys = Keys("job")
    try:
        first = call(master, "get_task", trainer="t")
        call(master, "finish_task", trainer="t", task=first["task"]["id"], attempt=first["attempt"])
        last = call(master, "get_task", trainer="t")

        def next_pass() -> None:
            call(master, "finish_task", trainer="t", task=last["task"]["id"], attempt=last["attempt"])
            assert call(master, "get_task", trainer="t")["pass"] == 1

        racing = RacingStore(store, keys.tasks, next_pass)
        status = job_status(racing, "job")
        assert racing.raced
        assert {k: status[k] for k in ("pass", "todo", "pending", "done", "corrupt")} == {"pass": 1, "todo": 1, "pending": 1, "done": 0, "corrupt": []}
    finally:
        master.stop()


class RacingStore:
    """Delegates to a store; runs ``race`` just before the first range read of ``prefix``."""

    def __init__(self, inner: MemoryStore, prefix: str, race) -> None:
        self.inner, self._prefix, self._race = inner, prefix, race
        self.raced = False

    def range(self, prefix):
        if prefix == self._prefix and not self.raced:
            self.raced = True
            self._race()
        return self.inner.range(prefix)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_corrupt_model_or_slot_map_is_reported_with_its_key():
    from pdps.adapters.torch_compute import TorchCompute
    from pdps.roles.pserver import Pserver

    store = MemoryStore()
    master = start(store)
    ps = Pserver(store, InprocTransport(), TorchCompute("cpu"), master.config)
    ps.start()
    try:
        keys = Keys("job")
        store.put(keys.model, b'[{"name": "w"}]')  # JSON, but not parameter specs
        with pytest.raises(CorruptRecord, match=keys.model) as info:
            ps._ensure_shard()
        assert info.value.key == keys.model
    finally:
        ps.stop()
        master.stop()
