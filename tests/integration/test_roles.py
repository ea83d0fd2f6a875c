"""Role behaviour at the edges: zombies, shutdown, cleanup."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.adapters.torch_compute import TorchCompute
from pdps.core.errors import InvalidTransition, LeaseExpired, TransportError
from pdps.core.job import Keys
from pdps.core.lifecycle import PserverEvent, PserverState
from pdps.core.sgd import Contribution
from pdps.runtime.rounds import read_round
from pdps.ports.transport import Message
from pdps.roles.master import Master
from pdps.roles.pserver import Pserver
from tests.integration.jobkit import start_job


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=2, row_group_size=20)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


@pytest.fixture
def job(source):
    job = start_job(source, name="edges", mode="sync", trainers=2)
    yield job
    job.close()


def test_a_trainer_whose_lease_expired_gets_no_task(job):
    store, transport, config, master = job.store, job.transport, job.config, job.master
    ctx = job.trainer("zombie")
    ctx.register()
    channel = transport.connect(master.address)
    assert "task" in channel.call("get_task", Message({"trainer": "zombie"})).meta
    ctx.leave(crashed=True)
    store.revoke_lease(ctx_lease(store, config, "zombie"))  # as if its lease ran out
    with pytest.raises(LeaseExpired, match="zombie"):
        channel.call("get_task", Message({"trainer": "zombie"}))
    deadline = time.monotonic() + 5
    while master.counts().pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert master.counts().pending == 0  # its task went back to todo when its key went


def ctx_lease(store, config, trainer):
    kv = store.get(Keys(config.name).trainer(trainer))
    assert kv is not None and kv.lease is not None
    return kv.lease


def test_stopping_a_pserver_wakes_a_trainer_waiting_at_the_barrier(job):
    ps = job.ps
    a, b = job.trainer("a"), job.trainer("b")
    b.register()  # a participant that never commits: round 0 cannot close
    a.patience = 1.0  # a lost pserver is waited for this long, then it is an error
    errors = []

    def attach_and_step() -> None:
        try:
            model = a.attach(nn.Sequential(nn.Linear(4, 2)))  # joins round 0: waits for b
            a.step(F.cross_entropy(model(torch.zeros(3, 4)), torch.zeros(3, dtype=torch.int64)), samples=3)
        except TransportError as exc:
            errors.append(exc)

    t = threading.Thread(target=attach_and_step, daemon=True)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # waiting for b
    ps.stop()
    t.join(timeout=10)
    assert not t.is_alive() and errors, "the trainer gives up once its patience runs out"


def test_a_pserver_moves_only_as_its_lifecycle_table_allows(job):
    ps = job.ps
    assert ps.state is PserverState.SERVING
    with pytest.raises(InvalidTransition) as err:
        ps.start()  # it serves already
    assert (err.value.subject, err.value.state, err.value.event) == ("pserver 0", PserverState.SERVING, PserverEvent.START)
    assert ps.state is PserverState.SERVING and ps.lease_lost is False  # the refusal changed nothing
    ps.stop()
    assert ps.state is PserverState.STOPPED
    ps.crash()
    assert ps.state is PserverState.STOPPED  # a halted pserver stays as it ended


def test_simulate_leaves_no_threads_behind(source):
    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))

    pdps.simulate(train, dataset=source, trainers=2, mode="async")  # warm: torch's own pools
    before = threading.active_count()
    for _ in range(3):
        pdps.simulate(train, dataset=source, trainers=2, mode="async")
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_leaving_right_after_a_tasks_last_stepped_batch_finishes_it(source):
    job = start_job(source, mode="async", batch_size=10)
    master, ctx = job.master, job.trainer("t0")
    try:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            if batch.last:
                task = batch.task.id
                break  # the task was trained whole: it must count as done, not go back
        assert master._queue.record(task).state.value == "done"
        assert ctx.tasks_done == 1
    finally:
        job.close()


def test_leaving_mid_task_gives_it_back_and_async_pushes_what_it_summed(source):
    job = start_job(source, mode="async", batch_size=5, push_every=3, pull_every=3)
    master, ps, ctx = job.master, job.ps, job.trainer("t0")
    try:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for i, batch in enumerate(ctx.batches()):
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            if i == 1:
                task = batch.task.id
                break  # 2 batches summed, no push due yet
        assert ctx.pushes == 1 and ps.version == 1  # flushed on the way out
        rec = master._queue.record(task)
        assert rec.state.value == "todo" and rec.failures == 0
    finally:
        job.close()


def test_a_late_finish_is_not_counted_by_the_trainer(source):
    job = start_job(source, mode="async", batch_size=20, task_timeout=0.3)
    master, ctx = job.master, job.trainer("t0")
    try:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        slow = True
        for batch in ctx.batches():
            if slow:
                slow = False
                first = batch.task.id
                time.sleep(0.8)  # past the task timeout: the master re-queues it meanwhile
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        # the first finish named a timed-out attempt: ignored by the master, not counted here
        assert master.done.is_set()
        assert ctx.tasks_done == len(source.tasks())
        assert master._queue.record(first).attempt == 2
    finally:
        job.close()


def test_a_restarted_master_finishes_a_pass_that_completed_before(source):
    store = MemoryStore()
    transport = InprocTransport()
    config = pdps.JobConfig(name="restart", dataset=source.url, mode="async", passes=1)
    m1 = Master(store, transport, source, config)
    m1.start()
    channel = transport.connect(m1.address)
    ctx = pdps.TrainerContext(store, transport, TorchCompute("cpu"), source, config, trainer_id="t0")
    ctx.register()
    # finish every task, then "crash" the master before it wrote the job's end
    for _ in source.tasks():
        meta = channel.call("get_task", Message({"trainer": "t0"})).meta
        with m1._lock:
            m1._queue.finish(int(meta["task"]["id"]), int(meta["attempt"]))  # persisted below by hand
            for rec in m1._queue.records():
                store.put(Keys("restart").task(rec.id), json.dumps(rec.to_json()).encode())
    m1.stop()
    assert not m1.done.is_set()
    m2 = Master(store, transport, source, config)
    m2.start()
    try:
        assert m2.done.is_set() and m2.passes_completed == 1
        assert b'"done"' in store.get(Keys("restart").state).value
    finally:
        ctx.leave()
        m2.stop()


def test_a_pserver_refuses_a_non_elementwise_rule_before_claiming_an_index(source):
    from pdps.roles.master import publish_job

    store = MemoryStore()
    config = pdps.JobConfig(name="lbfgs", dataset=source.url, optimizer="LBFGS", optimizer_args={"lr": 1.0})
    publish_job(store, config)
    with pytest.raises(pdps.ConfigError, match="LBFGS"):
        Pserver(store, InprocTransport(), TorchCompute("cpu"), config).start()
    assert store.range(Keys("lbfgs").pservers) == []


def test_a_failed_simulate_leaves_no_threads(tmp_path):
    def train(ctx):
        pass

    before = threading.active_count()
    with pytest.raises(pdps.DatasetError):
        pdps.simulate(train, dataset=(tmp_path / "missing").as_uri())
    time.sleep(0.2)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_a_nan_loss_reaches_no_pserver(tmp_path, overlap):
    """Sync, 2 pservers: the trainer refuses to push a non-finite gradient anywhere.
    With overlap, slots go out during backward, so the pserver holding only finite
    slots may have staged them; but the trainer never commits, so nothing is applied."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 4)).astype(np.float32)
    write_parquet_shards({"x": x, "y": (x[:, 0] > 0).astype(np.int64)}, f"{tmp_path.as_uri()}/d", shards=1, row_group_size=20)
    source = ParquetSource(f"{tmp_path.as_uri()}/d")
    job = start_job(source, name="nan", mode="sync", pservers=2, min_block=1, num_slots=8, overlap=overlap)
    servers, ctx = job.pservers, job.trainer("t0")
    try:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        first, second = ctx._group.parts
        # a parameter held only by the pserver pushed to second: the first would accept
        only_second = {b.param for b in second.blocks} - {b.param for b in first.blocks}
        assert only_second, "the layout must put one parameter on the second pserver alone"
        name = sorted(only_second)[0]
        out = model(torch.zeros(3, 4))
        loss = out.sum() + dict(model.named_parameters())[name].sum() * float("nan")
        with pytest.raises(pdps.GradientRejected, match=rf"{name}.*t0"):
            ctx.step(loss, samples=3)
        assert all(ps.version == 0 for ps in servers)
        by_index = {ps.index: ps for ps in servers}
        assert "t0" not in by_index[second.index]._shard.staged()  # the non-finite slot went nowhere
        if overlap == "off":
            assert "t0" not in by_index[first.index]._shard.staged()
        record = read_round(job.store, Keys(job.config.name), 0, second.round_no)  # the round the bad step was for: t0 never committed to it
        assert record is None or record.contributions.get("t0", Contribution(0)).samples == 0
    finally:
        job.close()


def test_a_trainer_whose_lease_ran_out_mid_job_registers_again_and_finishes(source):
    job = start_job(source, name="rejoin", mode="async", trainers=1, lease_ttl=30.0)
    try:
        ctx = job.trainer("t")
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        batches = ctx.batches()
        batch = next(batches)
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        job.store.revoke_lease(ctx_lease(job.store, job.config, "t"))  # as if it expired in an outage
        for batch in batches:
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        assert job.master.done.is_set()
        assert job.store.get(Keys(job.config.name).trainer("t")) is not None  # registered again
        summary = json.loads(job.store.get(Keys(job.config.name).pass_summary(0)).value)
        assert summary["failed"] == []  # its re-queued task was trained again
    finally:
        job.close()


def test_a_get_task_whose_reply_was_lost_gets_the_same_task_again(job):
    """The master persisted the dispatch but the trainer never heard: asking again,
    holding nothing, returns the same attempt instead of waiting for a 60 s timeout."""
    ctx = job.trainer("lossy")
    ctx.register()
    channel = job.transport.connect(job.master.address)
    first = channel.call("get_task", Message({"trainer": "lossy", "holding": []})).meta
    again = channel.call("get_task", Message({"trainer": "lossy", "holding": []})).meta
    assert (again["task"], again["attempt"]) == (first["task"], first["attempt"])
    assert job.master.counts().pending == 1
    # a client that does not say what it holds is held to the cap, as before
    assert "wait" in channel.call("get_task", Message({"trainer": "lossy"})).meta
