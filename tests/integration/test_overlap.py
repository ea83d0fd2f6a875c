"""Communication beside computation (``JobConfig.overlap``): the same results as
without it, slots pushed while backward still runs, the pserver's side of pushes of
some slots, and the per-step breakdown a trainer keeps."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import GradientRejected, StalePush
from pdps.ports.transport import Message
from pdps.roles.trainer import TIMINGS
from tests.integration.jobkit import start_job


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(160, 6))
    y = np.stack([x[:, 0] - x[:, 1], np.tanh(x[:, 2] * x[:, 3])], axis=1)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=1, row_group_size=40)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(99)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.4, 0.4, generator=g)
    return model


def train(ctx: pdps.TrainerContext) -> dict:
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
    return {"timings": ctx.timings, "steps": ctx.steps}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_overlap_changes_nothing_in_the_result(source, mode):
    """Adam (per-slot state), 2 pservers, small blocks so every parameter is cut in
    several slots: the final parameters are the same bits with and without overlap.
    (One trainer, so both runs see the same batches in the same order; sync-SGD with
    several trainers against single-process torch is test_inprocess_job's.)"""
    runs = {}
    for overlap in ("off", "on"):
        result = pdps.simulate(train, dataset=source, trainers=1, pservers=2, mode=mode, batch_size=8,
                               passes=2, optimizer="Adam", optimizer_args={"lr": 0.01}, min_block=16, num_slots=16,
                               overlap=overlap)
        runs[overlap] = result
    assert runs["on"].steps == runs["off"].steps > 0
    for name, value in runs["off"].params.items():
        assert torch.equal(runs["on"].params[name], value), name
    assert any(not torch.equal(runs["on"].params[n], p.detach()) for n, p in make_model().named_parameters())


class _Probe(torch.autograd.Function):
    """Identity whose backward, which runs after the layers above it, calls ``check``."""

    @staticmethod
    def forward(ctx, x, check):
        ctx.check = check
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.check()
        return grad, None


@pytest.mark.parametrize("overlap", ["on", "off"])
def test_the_last_layers_slots_reach_the_pserver_while_backward_still_runs(source, overlap, monkeypatch):
    """Async, one pserver: when backward reaches the first layer, the last layer's
    slots have (overlap) or have not (no overlap) reached the pserver already; either
    way the pserver applies nothing before the step is whole (it stages the pieces).
    (Buckets of one element: each parameter's slots go as soon as they are ready.)"""
    monkeypatch.setattr("pdps.roles.trainer.overlap.BUCKET_NUMEL", 1)
    job = start_job(source, name=f"probe-{overlap}", mode="async", overlap=overlap, min_block=1024)
    try:
        ctx = job.trainer("t0")
        model = ctx.attach(make_model())
        shard = job.ps._shard
        stats = ctx._group.parts[0].channel.stats
        last = [i for i, b in enumerate(shard.blocks) if b.param.startswith("4.")]
        before = [shard.views()[i].clone() for i in last]
        sent = stats["bytes_sent"]
        seen = []

        def check():
            deadline = time.monotonic() + (5.0 if overlap == "on" else 0.5)  # bounded: no overlap never gets there
            while time.monotonic() < deadline and stats["bytes_sent"] == sent:
                time.sleep(0.005)
            applied = any(not torch.equal(shard.views()[i], b) for i, b in zip(last, before))
            seen.append((stats["bytes_sent"] > sent, applied))

        batches = ctx.batches()
        batch = next(batches)
        hidden = model[1](model[0](batch["x"]))
        out = model[4](model[3](model[2](_Probe.apply(hidden, check))))
        ctx.step(F.mse_loss(out, batch["y"]))
        assert ctx.overlapping == (overlap == "on")
        assert seen == [(overlap == "on", False)]
        assert job.ps.version == 1  # one update, however many pieces it came in
        assert all(not torch.equal(shard.views()[i], b) for i, b in zip(last, before))
        batches.close()
    finally:
        job.close()


def _push(job, ctx, keys, tensors, **meta):
    channel = job.transport.connect(job.ps.address)
    base = {"trainer": ctx.trainer_id, "version": job.ps.version, "epoch": 0, "part": True}
    return channel.call("push", Message({**base, **meta, "blocks": keys}, tensors))


def test_pserver_takes_pushes_of_some_slots_in_order_only(source):
    job = start_job(source, name="pieces", mode="async", min_block=16)
    try:
        ctx = job.trainer("t0")
        ctx.attach(make_model())
        blocks = job.ps._shard.blocks
        zeros = [torch.zeros(b.shape, dtype=torch.float64) for b in blocks]
        _push(job, ctx, [blocks[0].key, blocks[2].key], [zeros[0], zeros[2]], final=False)
        assert job.ps.version == 0  # not the step's last piece
        _push(job, ctx, [], [], final=True)
        assert job.ps.version == 1
        with pytest.raises(GradientRejected, match="out of order"):
            _push(job, ctx, [blocks[2].key, blocks[0].key], [zeros[2], zeros[0]], final=False)
        with pytest.raises(GradientRejected, match="lacks gradients"):  # a whole push must be whole
            _push(job, ctx, [blocks[0].key], [zeros[0]], part=False)
        with pytest.raises(GradientRejected, match="2 tensors for 1 blocks"):
            _push(job, ctx, [blocks[0].key], [zeros[0], zeros[1]], final=False)
        assert job.ps.version == 1
    finally:
        job.close()


def test_async_pserver_applies_a_step_of_pieces_at_its_final_only(source):
    """Pieces are staged; the final message applies them; a refused piece voids the
    step (its final finds nothing); a step's first piece drops an unfinished one."""
    job = start_job(source, name="staged-pieces", mode="async", min_block=16)
    try:
        ctx = job.trainer("t0")
        ctx.attach(make_model())
        shard = job.ps._shard
        ones = [torch.ones(b.shape, dtype=torch.float64) for b in shard.blocks]
        keys = [b.key for b in shard.blocks]

        def moved() -> list[int]:
            return [i for i, (v, b) in enumerate(zip(shard.views(), before)) if not torch.equal(v, b)]

        before = [v.clone() for v in shard.views()]
        _push(job, ctx, keys[:1], ones[:1], first=True)
        assert moved() == []  # staged, not applied
        bad = ones[1].clone()
        bad.view(-1)[0] = float("nan")
        with pytest.raises(GradientRejected, match="not finite"):
            _push(job, ctx, keys[1:2], [bad])
        with pytest.raises(StalePush, match="holds no piece"):
            _push(job, ctx, [], [], final=True)
        assert moved() == [] and job.ps.version == 0
        _push(job, ctx, keys[:1], ones[:1], first=True)  # a step never ended...
        _push(job, ctx, keys[1:2], ones[1:2], first=True)  # ...is dropped when the next opens
        _push(job, ctx, [], [], final=True)
        assert moved() == [1] and job.ps.version == 1
    finally:
        job.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_says_where_its_time_went(source, mode):
    result = pdps.simulate(train, dataset=source, trainers=2, pservers=2, mode=mode, batch_size=8,
                           optimizer="SGD", optimizer_args={"lr": 0.01}, min_block=16)
    for out in result.trainers.values():
        t = out["timings"]
        assert set(t) == set(TIMINGS)
        assert all(v >= 0 for v in t.values())
        assert t["compute"] > 0 and t["data"] > 0 and t["wait"] > 0 and t["update"] > 0
        assert t["serialize"] == 0  # inproc passes tensors by reference
        assert (t["barrier"] > 0) == (mode == "sync")


class _Transport:
    """A stand-in transport for the "auto" rule: only whether it runs calls concurrently."""

    def __init__(self, concurrent: bool) -> None:
        self.concurrent = concurrent


class _Compute:
    def __init__(self, device: str, threads: int) -> None:
        self.device, self.threads = device, threads


@pytest.mark.parametrize(
    "setting,device,concurrent,threads,cores,expected",
    [
        ("on", "cpu", True, 2, 2, True),
        ("off", "cuda", False, 1, 16, False),
        ("auto", "cuda", True, 2, 2, True),  # a GPU computes: the CPU is free to communicate
        ("auto", "cpu", False, 2, 2, True),  # in-process pservers (inproc)
        ("auto", "cpu", True, 2, 2, False),  # gRPC with every core busy computing
        ("auto", "cpu", True, 2, 8, True),  # gRPC with cores to spare
    ],
)
def test_overlap_auto_is_on_where_something_idle_can_communicate(monkeypatch, setting, device, concurrent, threads, cores, expected):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    config = pdps.JobConfig(overlap=setting)
    ctx = pdps.TrainerContext(None, _Transport(concurrent), _Compute(device, threads), None, config, trainer_id="t")
    assert ctx._overlaps() is expected


def test_overlap_setting_is_checked():
    with pytest.raises(pdps.ConfigError, match="overlap must be 'auto', 'on' or 'off'"):
        pdps.JobConfig(overlap="yes")


@pytest.mark.parametrize("bucket,calls", [(1 << 20, 4), (1, 14)])
def test_slots_go_in_buckets(source, monkeypatch, bucket, calls):
    """A small model's slots gather into one push, then the step's (empty) final one,
    and one pull per pserver and step; with one-element buckets each of its 6
    parameters goes on its own: 6 pushes, the final, 6 pulls. Then one plain pull
    (ctx.pull())."""
    monkeypatch.setattr("pdps.roles.trainer.overlap.BUCKET_NUMEL", bucket)
    job = start_job(source, name=f"buckets-{bucket}", mode="async", overlap="on")
    try:
        ctx = job.trainer("t0")
        model = ctx.attach(make_model())
        stats = ctx._group.parts[0].channel.stats
        batches = ctx.batches()
        batch = next(batches)
        before = stats["calls"]
        ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
        ctx.pull()  # waits for the pulls sent ahead, then pulls once more
        assert stats["calls"] - before == calls
        assert job.ps.version == 1  # one update, however many pushes it came in
        batches.close()
    finally:
        job.close()
