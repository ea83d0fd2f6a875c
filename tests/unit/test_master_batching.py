"""The master's group commit: transitions made while a transaction is in flight share the next.

On the memory store here; ``tests/integration/test_master_batching.py`` runs the same
checks on a real etcd (and Redis). A store wrapper slows or holds commits, so that
batches form deterministically.
"""

from __future__ import annotations

import json
import threading
import time

import attrs
import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.core.audit import Outcome, decode_attempts
from pdps.core.errors import FencingError, StoreError, TransportError
from pdps.core.job import JobConfig, Keys
from pdps.core.speculation import Racer
from pdps.core.tasks import State, TaskRecord, TaskSpec
from pdps.ports.coordination import Put
from pdps.ports.transport import Message
from pdps.roles.master import Master
from pdps.runtime.group_commit import MAX_TXN_OPS, GroupCommitStore, Staged

JOB = "batch"


class Tasks:
    def __init__(self, n: int) -> None:
        self.url = f"memory://tasks-{n}"
        self.n = n

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location=f"part-{i // 100}", part=i % 100, records=10) for i in range(self.n)]

    def read(self, task, *, start=0, batch_size):  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


class Gate:
    """Delegates to a store. Every commit sleeps ``delay`` first (so that concurrent
    transitions pile up behind it) and records its number of ops; ``hold()`` makes the
    next commit wait until ``release()`` (``entered`` is set once it waits), and
    ``fail_with`` makes that commit raise instead of writing."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.sizes: list[int] = []
        self.committed: list[list] = []
        self._hold: threading.Event | None = None
        self._armed = False
        self.entered = threading.Event()
        self.fail_with: BaseException | None = None

    def hold(self) -> None:
        self._hold, self._armed = threading.Event(), True

    def release(self) -> None:
        assert self._hold is not None
        self._hold.set()

    def commit(self, compares, success, failure=(), *, fence=None):
        hold = self._hold if self._armed else None
        self._armed = False
        if hold is not None:
            self.entered.set()
            hold.wait(30)
            if self.fail_with is not None:
                exc, self.fail_with = self.fail_with, None
                raise exc
        if self.delay:
            time.sleep(self.delay)
        self.sizes.append(len(success))
        result = self.inner.commit(compares, success, failure, fence=fence)
        self.committed.append(list(success))
        return result

    def __getattr__(self, name):
        return getattr(self.inner, name)


def start(store, n: int = 400, **kwargs) -> Master:
    config = JobConfig(name=JOB, dataset=f"memory://tasks-{n}", lease_ttl=30.0, task_timeout=1e6, passes=100)
    master = Master(store, InprocTransport(), Tasks(n), config, **kwargs)
    master.start()
    return master


def register(store, trainers) -> None:
    lease = store.grant_lease(30)
    for t in trainers:
        store.put(Keys(JOB).trainer(t), b"{}", lease=lease)


def call(master: Master, method: str, **meta) -> dict:
    return master._transport.connect(master.address).call(method, Message(meta)).meta


def run_clients(master: Master, trainers: list[str], pairs: int) -> dict[str, list[tuple[str, int, int]]]:
    """Each trainer (a thread) gets and finishes ``pairs`` tasks, then gets one more and
    keeps it; returns what each was told: ("dispatch" | "finish", task, attempt)."""
    acks: dict[str, list[tuple[str, int, int]]] = {t: [] for t in trainers}
    errors: list[BaseException] = []
    go = threading.Barrier(len(trainers))

    def client(trainer: str) -> None:
        try:
            go.wait()
            for i in range(pairs + 1):
                reply = call(master, "get_task", trainer=trainer)
                assert "task" in reply, reply
                acks[trainer].append(("dispatch", reply["task"]["id"], reply["attempt"]))
                if i == pairs:
                    return
                done = call(master, "finish_task", trainer=trainer, task=reply["task"]["id"], attempt=reply["attempt"])
                assert done["accepted"], done
                acks[trainer].append(("finish", reply["task"]["id"], reply["attempt"]))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,)) for t in trainers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return acks


def check_restored_state_is_what_was_acknowledged(store, acks, n: int) -> None:
    """A new master restored from the store sees exactly the acknowledged transitions."""
    dispatched = [(task, attempt) for xs in acks.values() for kind, task, attempt in xs if kind == "dispatch"]
    assert len({task for task, _ in dispatched}) == len(dispatched), "a task was handed to two clients"
    second = start(store, n)
    try:
        restored = {r.id: r for r in second.restored}
        audit = {int(kv.key.rsplit("/", 1)[1]): decode_attempts(kv.value, kv.key) for kv in store.range(Keys(JOB).audit_pass(0))}
    finally:
        second.stop()
    expected = {}
    for trainer, xs in acks.items():
        for kind, task, attempt in xs:
            if kind == "dispatch":
                expected[task] = (State.PENDING, attempt, trainer)
            else:
                expected[task] = (State.DONE, attempt, None)
    for tid in range(n):
        rec = restored.get(tid, TaskRecord(id=tid, pass_no=0, state=State.TODO))
        assert (rec.state, rec.attempt, rec.trainer) == expected.get(tid, (State.TODO, 0, None)), tid
    assert set(audit) == set(expected)  # every acknowledged transition wrote its audit with it
    for tid, (state, attempt, trainer) in expected.items():
        last = audit[tid][-1]
        assert last.attempt == attempt and last.outcome is (Outcome.PENDING if state is State.PENDING else Outcome.DONE)


# --- the tests ------------------------------------------------------------------------------


def concurrent_clients_get_distinct_tasks_and_every_transition_is_durable(inner, *, clients: int = 16, pairs: int = 5, delay: float = 0.003):
    store = Gate(inner, delay=delay)
    trainers = [f"t{i}" for i in range(clients)]
    register(inner, trainers)
    master = start(store)
    try:
        before = dict(master.commit_stats)
        acks = run_clients(master, trainers, pairs)
        stats = {k: master.commit_stats[k] - before[k] for k in before}
    finally:
        master.stop()
    transitions = clients * (2 * pairs + 1)
    assert stats["transitions"] == transitions
    assert stats["transactions"] < transitions / 2, stats  # they were committed together
    check_restored_state_is_what_was_acknowledged(inner, acks, 400)
    return stats


def test_concurrent_clients_get_distinct_tasks_and_every_transition_is_durable():
    concurrent_clients_get_distinct_tasks_and_every_transition_is_durable(MemoryStore())


def stage_behind_a_held_commit(inner, clients: int = 8):
    """A master whose first transaction is held while ``clients - 1`` other get_task
    calls stage behind it; returns (store, master, outcomes, threads, trainers)."""
    store = Gate(inner)
    trainers = [f"t{i}" for i in range(clients)]
    register(inner, trainers)
    master = start(store)
    outcomes: dict[str, object] = {}

    def client(trainer: str) -> None:
        try:
            outcomes[trainer] = call(master, "get_task", trainer=trainer)
        except BaseException as exc:  # noqa: BLE001 - checked by the test
            outcomes[trainer] = exc

    store.hold()
    first = threading.Thread(target=client, args=(trainers[0],))
    first.start()
    assert store.entered.wait(10)
    threads = [threading.Thread(target=client, args=(t,)) for t in trainers[1:]]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while master._store.backlog < clients - 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert master._store.backlog == clients - 1  # they wait behind the held transaction
    assert not outcomes  # and nobody was answered
    return store, master, outcomes, [first, *threads], trainers


def a_batch_that_lost_its_fence_fails_every_transition_in_it(inner):
    store, master, outcomes, threads, trainers = stage_behind_a_held_commit(inner)
    keys = Keys(JOB)
    try:
        # another master takes the lock while the transaction is held
        inner.delete(keys.master_lock)
        assert inner.acquire_lock(keys.master_lock, inner.grant_lease(30), b"the-other-master") is not None
        store.release()
        for t in threads:
            t.join(30)
        assert set(outcomes) == set(trainers)
        assert all(isinstance(o, FencingError) for o in outcomes.values()), outcomes  # none acknowledged
        assert master.stopped and not master.leading.is_set()
        assert inner.range(keys.tasks) == [] and inner.range(keys.audit_pass(0)) == []  # nothing written
        with pytest.raises((FencingError, TransportError)):  # it stepped down (and closed its endpoint)
            call(master, "get_task", trainer=trainers[0])
    finally:
        master.stop()


def test_a_batch_that_lost_its_fence_fails_every_transition_in_it():
    a_batch_that_lost_its_fence_fails_every_transition_in_it(MemoryStore())


def a_failed_batch_fails_its_transitions_and_the_queue_is_rebuilt_from_the_store(inner):
    store, master, outcomes, threads, trainers = stage_behind_a_held_commit(inner)
    keys = Keys(JOB)
    try:
        store.fail_with = StoreError("the store refused the transaction")
        store.release()
        for t in threads:
            t.join(30)
        assert all(isinstance(o, StoreError) for o in outcomes.values()), outcomes  # none acknowledged
        assert master.leading.is_set()  # not a fencing error: the master carries on
        assert inner.range(keys.tasks) == []
        # memory is not left ahead of the store: the next transition starts from the store's queue
        reply = call(master, "get_task", trainer=trainers[0])
        assert reply["task"]["id"] == 0 and reply["attempt"] == 1
        assert master.counts().pending == 1
        stored = {json.loads(kv.value)["id"]: json.loads(kv.value) for kv in inner.range(keys.tasks)}
        assert list(stored) == [0] and stored[0]["trainer"] == trainers[0]
    finally:
        master.stop()


def test_a_failed_batch_fails_its_transitions_and_the_queue_is_rebuilt_from_the_store():
    a_failed_batch_fails_its_transitions_and_the_queue_is_rebuilt_from_the_store(MemoryStore())


def batches_respect_the_op_cap(inner, *, max_txn_ops: int, clients: int, pairs: int = 3, delay: float = 0.003):
    store = Gate(inner, delay=delay)
    trainers = [f"t{i}" for i in range(clients)]
    register(inner, trainers)
    master = start(store, max_txn_ops=max_txn_ops)
    try:
        store.sizes.clear()
        acks = run_clients(master, trainers, pairs)
    finally:
        master.stop()
    room = max_txn_ops - 2  # the fence's two compares count against the limit
    assert max(store.sizes) <= room, store.sizes
    assert max(store.sizes) > room - 2, store.sizes  # batches filled up to the cap (each transition writes 2)
    check_restored_state_is_what_was_acknowledged(inner, acks, 400)
    return store.sizes


def test_batches_respect_the_op_cap():
    batches_respect_the_op_cap(MemoryStore(), max_txn_ops=10, clients=12)


def test_a_key_written_twice_in_one_batch_is_written_once_with_its_last_value():
    inner = MemoryStore()
    store = Gate(inner)
    GroupCommitStore(store)._commit_batch([Staged([Put("/x/a", b"1"), Put("/x/b", b"b")]), Staged([Put("/x/a", b"2")])])
    assert store.committed == [[Put("/x/b", b"b"), Put("/x/a", b"2")]]
    assert inner.get("/x/a").value == b"2"


def test_a_reply_that_changed_nothing_waits_for_the_transitions_before_it():
    inner = MemoryStore()
    store, master, outcomes, threads, trainers = stage_behind_a_held_commit(inner, clients=2)
    try:
        # the second trainer's dispatch is staged; asking again (holding it) changes nothing,
        # yet the answer (that task again) rests on the staged dispatch: it waits for it
        again: dict = {}
        t = threading.Thread(target=lambda: again.update(call(master, "get_task", trainer=trainers[1], holding=[])))
        t.start()
        time.sleep(0.1)
        assert not again
        store.release()
        for th in [*threads, t]:
            th.join(30)
        assert again["task"]["id"] == outcomes[trainers[1]]["task"]["id"]
    finally:
        master.stop()


def test_the_default_cap_is_etcds():
    assert MAX_TXN_OPS == 128


def test_record_encoding_spells_out_every_field():
    # TaskRecord/TaskSpec.to_json are written out by hand for speed: a new field must be added there
    assert [f.name for f in attrs.fields(TaskRecord)] == ["id", "pass_no", "state", "attempt", "failures", "trainer", "deadline", "offset", "backup", "issued", "raced"]
    assert [f.name for f in attrs.fields(TaskSpec)] == ["id", "location", "part", "records"]
    rec = TaskRecord(id=3, pass_no=1, state=State.PENDING, attempt=2, failures=1, trainer="t", deadline=9.5, offset=4, backup=Racer(3, "u", 10.0, 6), issued=3, raced=2)
    expected = attrs.asdict(rec)
    expected["state"] = "pending"
    assert rec.to_json() == expected and list(rec.to_json()) == list(expected)
    assert TaskRecord.from_json(rec.to_json()) == rec
