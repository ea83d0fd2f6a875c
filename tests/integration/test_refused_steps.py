"""A step refused for a non-finite gradient: one rule in every mode, overlap setting and
transport. It changes no parameter on any pserver, leaves nothing behind (the next step
starts from a clean gradient), and the trainer goes on as if that batch was skipped."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from tests.integration.jobkit import start_job


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(11)
    x = rng.normal(size=(160, 6))
    y = np.stack([x[:, 0] - x[:, 1], np.tanh(x[:, 2] * x[:, 3])], axis=1)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=1, row_group_size=40)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(7)
    model = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 24), nn.Tanh(), nn.Linear(24, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.4, 0.4, generator=g)
    return model


def poison(param: torch.Tensor):
    """Make ``param``'s gradient, and no other, NaN in the next backward."""
    return param.register_hook(lambda g: torch.full_like(g, float("nan")))


def trainer(nan_at: int | None, skip: tuple[int, ...] = ()):
    """A training function that poisons the last layer's bias at batch ``nan_at``
    and catches the refusal, or (the reference) does not train the batches ``skip``."""

    def train(ctx: pdps.TrainerContext) -> dict:
        model = ctx.attach(make_model())
        accepted, refused = [], []
        for i, batch in enumerate(ctx.batches()):
            if i in skip:
                continue
            hook = poison(model[4].bias) if i == nan_at else None
            try:
                ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
                accepted.append(i)
            except pdps.GradientRejected as exc:
                assert "4.bias" in str(exc)
                refused.append(i)
            finally:
                if hook is not None:
                    hook.remove()
        return {"accepted": accepted, "refused": refused, "pushes": ctx.pushes}

    return train


CASES = [
    ("sync", "off", 1),
    ("sync", "on", 1),
    ("async", "off", 1),
    ("async", "on", 1),
    ("async", "off", 2),  # the refused push carries the sum of batches 2 and 3: both are dropped
    ("async", "on", 2),
]


@pytest.mark.parametrize("mode,overlap,push_every", CASES)
def test_after_a_refused_step_training_goes_on_as_if_the_batch_was_skipped(source, mode, overlap, push_every):
    """One trainer (deterministic), 2 pservers, Adam (a step with a zero gradient would
    still move it): the run whose batch 4 (or, summed with it, 5) has a NaN gradient in
    one parameter, held by one pserver (the last layer's bias is one block), ends with exactly the parameters of a run that skips that batch, and
    every step after the refused one is accepted."""
    settings = dict(trainers=1, pservers=2, mode=mode, batch_size=8, passes=1, optimizer="Adam",
                    optimizer_args={"lr": 0.01}, min_block=16, num_slots=16, overlap=overlap,
                    push_every=push_every, pull_every=push_every)
    # 5 batches a task; async counts push_every within a task (and pushes after its last
    # batch), so with push_every=2 the batches 2 and 3 of the first task go in one push
    nan_at = 4 if push_every == 1 else 3
    dropped = (nan_at,) if push_every == 1 else (2, 3)
    run = pdps.simulate(trainer(nan_at=nan_at), dataset=source, **settings)
    reference = pdps.simulate(trainer(nan_at=None, skip=dropped), dataset=source, **settings)
    out = run.trainers["trainer-0"]
    assert out["refused"] == [dropped[-1]]  # the push that carried the NaN
    assert out["accepted"] == [i for i in range(20) if i != dropped[-1]]
    assert out["pushes"] == reference.trainers["trainer-0"]["pushes"]  # a refused step is no push
    for name, value in reference.params.items():
        torch.testing.assert_close(run.params[name], value, rtol=1e-12, atol=1e-12, msg=name)


def _pserver_values(job) -> list[torch.Tensor]:
    return [ps._shard.values.clone() for ps in job.pservers]


@pytest.mark.parametrize(
    "mode,overlap,transport",
    [("sync", "off", "inproc"), ("sync", "on", "inproc"), ("async", "off", "inproc"), ("async", "on", "inproc"), ("async", "on", "grpc"), ("sync", "on", "grpc")],
)
def test_a_refused_step_changes_no_parameter_on_any_pserver(source, mode, overlap, transport):
    """2 pservers; the last layer's bias (one block) lives on one of them and gets a
    NaN gradient: neither pserver changes, in values or version; a sync round still
    closes (the trainer took part with no samples, so no one waits for it); and the
    next step is accepted and changes both."""
    extra = {}
    if transport == "grpc":
        from pdps.adapters.grpc_transport import GrpcTransport

        extra = {"transport": GrpcTransport(), "address": "grpc://127.0.0.1:0"}
    job = start_job(source, name=f"refused-{mode}-{overlap}-{transport}", mode=mode, overlap=overlap, pservers=2,
                    min_block=16, num_slots=16, optimizer="Adam", optimizer_args={"lr": 0.01}, **extra)
    batches = None
    try:
        ctx = job.trainer("t0")
        model = ctx.attach(make_model())
        assert ctx.overlapping == (overlap == "on")
        holders = [i for i, ps in enumerate(job.pservers) if any(b.param == "4.bias" for b in ps._shard.blocks)]
        assert len(holders) == 1 and all(ps._shard.blocks for ps in job.pservers)
        batches = ctx.batches()

        def step(batch) -> None:
            ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))

        step(next(batches))
        ctx.pull()  # (async, overlap: the pull sent ahead has landed)
        before = _pserver_values(job)
        versions = [ps.version for ps in job.pservers]
        rounds = [ps.round_no for ps in job.pservers]
        hook = poison(model[4].bias)
        with pytest.raises(pdps.GradientRejected, match="4.bias"):
            step(next(batches))
        hook.remove()
        ctx.pull()
        for i, (b, a) in enumerate(zip(before, _pserver_values(job))):
            assert torch.equal(a, b), f"pserver {i} changed"
        assert [ps.version for ps in job.pservers] == versions
        if mode == "sync":
            assert [ps.round_no for ps in job.pservers] == [r + 1 for r in rounds]
        step(next(batches))
        ctx.pull()
        assert [ps.version for ps in job.pservers] == [v + 1 for v in versions]
        assert all(not torch.equal(a, b) for a, b in zip(before, _pserver_values(job)))
    finally:
        if batches is not None:
            batches.close()  # (gives the task back while the master still serves)
        job.close()
