"""Role behaviour at the edges: zombies, shutdown, cleanup."""

from __future__ import annotations

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
from pdps.core.errors import LeaseExpired, TransportError
from pdps.core.job import Keys
from pdps.ports.transport import Message
from pdps.roles.master import Master
from pdps.roles.pserver import Pserver


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=2, row_group_size=20)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


@pytest.fixture
def job(source):
    store, transport, compute = MemoryStore(), InprocTransport(), TorchCompute("cpu")
    config = pdps.JobConfig(name="edges", dataset=source.url, mode="sync", trainers=2, optimizer="SGD", optimizer_args={"lr": 0.1})
    master = Master(store, transport, source, config)
    master.start()
    ps = Pserver(store, transport, compute, config)
    ps.start()
    yield store, transport, compute, config, master, ps
    ps.stop()
    master.stop()
    store.close()


def test_a_trainer_whose_lease_expired_gets_no_task(job, source):
    store, transport, compute, config, master, ps = job
    ctx = pdps.TrainerContext(store, transport, compute, source, config, trainer_id="zombie")
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


def test_stopping_a_pserver_wakes_a_trainer_waiting_at_the_barrier(job, source):
    store, transport, compute, config, master, ps = job
    a = pdps.TrainerContext(store, transport, compute, source, config, trainer_id="a")
    b = pdps.TrainerContext(store, transport, compute, source, config, trainer_id="b")
    b.register()  # a member that never pushes: round 0 cannot close
    model = a.attach(nn.Sequential(nn.Linear(4, 2)))
    errors = []

    def step() -> None:
        try:
            a.step(F.cross_entropy(model(torch.zeros(3, 4)), torch.zeros(3, dtype=torch.int64)), samples=3)
        except TransportError as exc:
            errors.append(exc)

    t = threading.Thread(target=step, daemon=True)
    t.start()
    time.sleep(0.3)
    assert t.is_alive()  # waiting for b
    ps.stop()
    t.join(timeout=5)
    assert not t.is_alive() and errors and "stopped" in str(errors[0])
    a.leave()
    b.leave()


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
