"""Async-SGD at the role level: Downpour cadence and the staleness bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import StalePush
from pdps.ports.transport import Message


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(120, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=1, row_group_size=120)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_downpour_cadence_push_every_n_pull_every_m(source, overlap):
    """One trainer, n=2, m=3: the local model changes only at pulls, pushes carry sums.
    The model is read where it is used, at each forward (with overlap a pull lands
    while the next forward runs, before each layer needs its parameters)."""
    log, seen = [], []

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        model[0].register_forward_pre_hook(lambda m, _: seen.append(m.weight.detach().clone()))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            log.append((ctx.steps, ctx.pushes))
        model(torch.zeros(1, 4))  # one more forward: what the last step left

    result = pdps.simulate(train, dataset=source, trainers=1, pservers=1, mode="async", batch_size=10,
                           push_every=2, pull_every=3, optimizer="SGD", optimizer_args={"lr": 0.5}, overlap=overlap)
    assert len(log) == 12
    for steps, pushes in log:
        assert pushes == steps // 2  # a push every second batch
    for steps in range(1, 13):
        # the local copy moves only when a pull follows an applied push
        changed = not torch.equal(seen[steps - 1], seen[steps])
        assert changed == (steps % 3 == 0), (steps, changed)
    assert len(seen) == 13
    assert result.steps == 6  # pushes applied by the pserver


def test_async_pushes_sum_gradients_over_n_batches(source):
    """With SGD lr=1 and n=2, one update equals minus the sum of two batch gradients."""
    seen = {}

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2, bias=False)).double())
        start = model[0].weight.detach().clone()
        grads = []
        for i, batch in enumerate(ctx.batches()):
            if i >= 2:
                continue  # the rest of the task is read but not trained
            loss = F.cross_entropy(model(batch["x"].double()), batch["y"])
            grads.append(torch.autograd.grad(loss, model[0].weight, retain_graph=True)[0])
            ctx.step(loss)
        seen["start"], seen["grads"] = start, grads

    result = pdps.simulate(train, dataset=source, trainers=1, pservers=1, mode="async", batch_size=10,
                           push_every=2, pull_every=2, optimizer="SGD", optimizer_args={"lr": 1.0})
    want = seen["start"] - (seen["grads"][0] + seen["grads"][1])
    torch.testing.assert_close(result.params["0.weight"], want, rtol=1e-12, atol=1e-12)


def test_staleness_bound_drops_old_pushes_and_changes_nothing(source):
    from tests.integration.jobkit import start_job

    job = start_job(source, name="stale", mode="async", staleness=1)
    store, transport, config, ps = job.store, job.transport, job.config, job.ps
    ctx = job.trainer("t0")
    try:
        ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        part = ctx._group.parts[0]
        grads = [torch.ones_like(g) for g in ctx._replica.grads(part.blocks)]

        def push(version: int) -> Message:
            return ctx._group.call(part, "push", Message({"trainer": "t0", "updates": version, "blocks": part.keys}, grads))

        assert push(0).meta["updates"] == 1  # 0 behind: applied
        assert push(0).meta["updates"] == 2  # 1 behind: within the bound
        before = pdps.fetch_parameters(store, transport, config)
        with pytest.raises(StalePush, match="2 versions behind"):
            push(0)  # 2 behind: dropped
        after = pdps.fetch_parameters(store, transport, config)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert ps.version == 2
        # the trainer's own push path answers a stale push by pulling
        part.version = 0
        assert ctx._async_push() is True and ctx.stale_pushes == 1
    finally:
        job.close()
