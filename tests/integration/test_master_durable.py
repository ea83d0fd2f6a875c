"""The master on real stores: restarts, fenced leadership, membership, claims.

Every test runs against a real etcd and a real Redis (the session's throwaway
servers). Trainers here speak the master's protocol directly: these tests are
about the master and the store, not about training.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import ConfigError, FencingError, TransportError
from pdps.core.job import JobConfig, Keys
from pdps.ports.transport import Message
from pdps.runtime.lease import LeaseKeeper
from pdps.roles.master import Master, publish_job
from pdps.shell.status import job_status

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TASKS = 40


@pytest.fixture(params=["etcd", "redis"])
def real_store(request):
    return request.getfixturevalue(f"{request.param}_store")


@pytest.fixture
def dataset(tmp_path) -> str:
    """40 tasks: 4 files of 10 row groups of 2 rows."""
    x = np.arange(TASKS * 2 * 3, dtype=np.float32).reshape(TASKS * 2, 3)
    url = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": x, "y": np.zeros(TASKS * 2, dtype=np.int64)}, url, shards=4, row_group_size=2)
    assert len(ParquetSource(url).tasks()) == TASKS
    return url


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def register(store, config: JobConfig, trainer: str) -> LeaseKeeper:
    keeper = LeaseKeeper(store, config.lease_ttl, name=trainer)
    store.put(Keys(config.name).trainer(trainer), b"{}", lease=keeper.lease)
    return keeper


def drain(channel, trainer: str, limit: int = 10 * TASKS) -> int:
    """Lease and finish tasks until the master says the job is done; returns how many."""
    finished = 0
    for _ in range(limit):
        reply = channel.call("get_task", Message({"trainer": trainer}))
        if reply.meta.get("done"):
            return finished
        if "wait" in reply.meta:
            time.sleep(0.02)
            continue
        ack = channel.call("finish_task", Message({"trainer": trainer, "task": reply.meta["task"]["id"], "attempt": reply.meta["attempt"]}))
        finished += bool(ack.meta["accepted"])
    raise AssertionError(f"job not done after {limit} requests")


class StallableStore:
    """Delegates to a store; while ``stalled``, keep-alives hang (a master frozen in a GC
    pause or cut off from the store, whose lease then runs out)."""

    def __init__(self, inner) -> None:
        self._inner = inner
        self.released = threading.Event()
        self.released.set()

    def stall(self) -> None:
        self.released.clear()

    def keep_alive(self, lease: int) -> None:
        self.released.wait(60)
        self._inner.keep_alive(lease)

    def __getattr__(self, name):
        return getattr(self._inner, name)


# --- restart in another OS process ---------------------------------------------------


def worker(url: str, job: str, dataset: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.master_worker", url, job, dataset, *extra],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_master_killed_mid_pass_is_recovered_by_a_new_process(real_store, dataset, tmp_path):
    job = "killed"
    keys = Keys(job)
    first = worker(real_store.url, job, dataset, "--task-seconds", "0.1")
    try:
        wait_for(lambda: job_status(real_store, job)["done"] >= 8 if real_store.get(keys.config) else False, 60, "8 tasks done")
    finally:
        first.kill()
        first.wait(10)
    # What the store held when the master died: the state a successor must recover.
    before = job_status(real_store, job)
    stored = {json.loads(kv.value)["id"]: json.loads(kv.value) for kv in real_store.range(keys.tasks)}
    assert 8 <= before["done"] < TASKS and before["pending"] >= 1, before

    dump = tmp_path / "restored.json"
    second = worker(real_store.url, job, dataset, "--dump", str(dump), "--task-seconds", "0.01")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 0 and "DONE" in out, err[-3000:]

    restored = json.loads(dump.read_text())
    assert restored["pass"] == before["pass"]
    by_id = {r["id"]: r for r in restored["records"]}
    assert sorted(by_id) == list(range(TASKS))
    for tid, rec in by_id.items():
        if tid in stored and stored[tid]["pass_no"] == before["pass"]:
            mine, theirs = dict(rec), dict(stored[tid])
            if theirs["state"] == "pending":  # the deadline is re-armed on the new master's clock
                assert mine.pop("deadline") is not None
                theirs.pop("deadline")
            assert mine == theirs, tid
        else:
            assert rec["state"] == "todo", rec
    counts = {s: sum(r["state"] == s for r in restored["records"]) for s in ("todo", "pending", "done", "failed")}
    assert counts == {s: before[s] for s in counts}

    after = job_status(real_store, job)
    assert (after["state"], after["done"], after["todo"], after["pending"], after["failed"]) == ("done", TASKS, 0, 0, 0), after
    summary = json.loads(real_store.get(keys.pass_summary(0)).value)
    assert summary == {"pass": 0, "done": TASKS, "failed": []}
    # the tasks the dead trainers held were re-queued as failures, then trained
    requeued = {tid for tid, rec in stored.items() if rec["state"] == "pending"}
    final = {json.loads(kv.value)["id"]: json.loads(kv.value) for kv in real_store.range(keys.tasks)}
    assert all(final[tid]["failures"] == 1 and final[tid]["state"] == "done" for tid in requeued)


# --- fenced leadership ----------------------------------------------------------------


def test_a_master_whose_lease_expired_cannot_write_and_a_standby_finishes(real_store, dataset):
    config = JobConfig(name="fenced", dataset=dataset, lease_ttl=2.0, task_timeout=60.0)
    keys = Keys(config.name)
    source, transport = ParquetSource(dataset), InprocTransport()
    stallable = StallableStore(real_store)
    old = Master(stallable, transport, source, config)
    old.start()
    new = Master(real_store, transport, source, config)
    standby = threading.Thread(target=new.start, kwargs={"standby": True}, daemon=True)
    standby.start()
    trainer, other = register(real_store, config, "t"), register(real_store, config, "u")
    to_old = transport.connect(old.address)
    first = to_old.call("get_task", Message({"trainer": "t"})).meta
    assert not new.leading.is_set()  # the lock is held: the standby waits

    stallable.stall()  # the old master freezes; its lease runs out
    try:
        assert new.leading.wait(30), "the standby never took over"
        frozen = {kv.key: (kv.value, kv.mod_revision) for kv in real_store.range(keys.root)}
        with pytest.raises(FencingError):  # dispatching would write u's task record
            to_old.call("get_task", Message({"trainer": "u"}))
        with pytest.raises((FencingError, TransportError)):  # it stepped down: refused, or no longer served
            to_old.call("finish_task", Message({"trainer": "t", "task": first["task"]["id"], "attempt": first["attempt"]}))
        assert old.stopped
        assert {kv.key: (kv.value, kv.mod_revision) for kv in real_store.range(keys.root)} == frozen
    finally:
        stallable.released.set()

    standby.join(5)
    to_new = transport.connect(new.address)
    ack = to_new.call("finish_task", Message({"trainer": "t", "task": first["task"]["id"], "attempt": first["attempt"]}))
    assert ack.meta["accepted"]  # the new master restored the task as pending for t
    assert drain(to_new, "t") == TASKS - 1
    assert new.done.is_set()
    assert job_status(real_store, config.name)["done"] == TASKS
    trainer.stop()
    other.stop()
    new.stop()
    old.stop()


def test_a_second_master_is_refused_while_the_first_holds_the_lock(real_store, dataset):
    config = JobConfig(name="twice", dataset=dataset)
    source, transport = ParquetSource(dataset), InprocTransport()
    first = Master(real_store, transport, source, config)
    first.start()
    try:
        with pytest.raises(ConfigError, match="already has a master"):
            Master(real_store, transport, source, config).start()
    finally:
        first.stop()


# --- membership -----------------------------------------------------------------------


def test_trainer_lease_expiry_requeues_its_task_long_before_the_task_timeout(real_store, dataset):
    config = JobConfig(name="lapsed", dataset=dataset, lease_ttl=2.0, task_timeout=60.0)
    keys = Keys(config.name)
    master = Master(real_store, InprocTransport(), ParquetSource(dataset), config)
    master.start()
    try:
        lease = real_store.grant_lease(config.lease_ttl)  # never kept alive: the trainer has died
        real_store.put(keys.trainer("doomed"), b"{}", lease=lease)
        channel = master._transport.connect(master.address)
        task = channel.call("get_task", Message({"trainer": "doomed"})).meta["task"]["id"]
        leased_at = time.monotonic()

        def requeued():
            rec = json.loads(real_store.get(keys.task(task)).value)
            return rec if rec["state"] == "todo" else None

        rec = wait_for(requeued, config.task_timeout, "the dead trainer's task back in todo")
        elapsed = time.monotonic() - leased_at
        assert rec["failures"] == 1 and rec["trainer"] is None  # counted as a failure
        assert elapsed < config.task_timeout / 4, f"re-queued after {elapsed:.1f} s: that was the timeout, not the lease"
    finally:
        master.stop()


def _claim(url: str, job: str, barrier, results) -> None:
    from pdps.core.errors import ConfigError
    from pdps.roles.pserver import claim_index
    from pdps.registry import connect_store

    store = connect_store(url)
    lease = store.grant_lease(30)
    value = json.dumps({"addr": f"proc-{multiprocessing.current_process().pid}"}).encode()
    barrier.wait(30)
    try:
        results.put(claim_index(store, Keys(job), lease, value))
    except ConfigError:
        results.put(None)
    store.close()


def test_eight_pservers_claim_distinct_indexes_below_the_desired_count(real_store):
    config = JobConfig(name="claims", pservers=5)
    publish_job(real_store, config)
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(8), ctx.Queue()
    procs = [ctx.Process(target=_claim, args=(real_store.url, config.name, barrier, results)) for _ in range(8)]
    for p in procs:
        p.start()
    claims = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    taken = sorted(c for c in claims if c is not None)
    assert taken == [0, 1, 2, 3, 4]  # distinct, all below the desired count
    assert claims.count(None) == 3
    assert [kv.key for kv in real_store.range(Keys(config.name).pservers)] == [Keys(config.name).pserver(i) for i in range(5)]
