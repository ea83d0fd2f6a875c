"""A pipeline job in process (``pdps.simulate``, inproc, memory store): 4 stages x 2
data-parallel pipelines, float64, sync SGD, train exactly as one process trains the
whole model on the same batches (GPipe with the batch cut by rows, 1F1B with
microbatches of different sequence lengths), each stage keeping to its own parameters;
the guide's example runs."""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import write_parquet_shards
from pdps.ports.data import read_whole

P, D = 4, 2  # stages, pipelines
K, B, T = 3, 8, 4  # steps per task, batch, time steps of a sequence
M = 3  # microbatches
POINTS = [2, 4, 6]  # each stage one Linear (and what follows it)
SGD = {"lr": 0.1, "momentum": 0.9}


class MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def make_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(99)
    model = nn.Sequential(
        nn.Linear(5, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12), MeanOverTime(), nn.Linear(12, 3)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


def dataset(root: str) -> str:
    """D tasks (a row group each) of K*B sequences of T steps of 5 features, flat."""
    rng = np.random.default_rng(3)
    n = K * B * D
    x = rng.normal(size=(n, T * 5))
    seq = x.reshape(n, T, 5)
    y = np.stack([seq[:, :, 0].mean(1) - seq[:, 0, 1], np.sin(seq[:, :, 2].sum(1)), seq[:, -1, 3] * seq[:, 0, 4]], axis=1)
    write_parquet_shards({"x": x, "y": y}, root, shards=1, row_group_size=K * B)
    return root


def as_tensor(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole batch: sequences of T steps (the stage runner cuts it by rows)."""
    return batch["x"].view(-1, T, 5), batch["y"]


def ragged(batch) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """M microbatches whose sequences are cut to T, T-1, T-2 ... steps: shapes differ."""
    x, y = batch["x"].view(-1, T, 5), batch["y"]
    xs = [part[:, : T - m % T] for m, part in enumerate(torch.tensor_split(x, M))]
    return xs, list(torch.tensor_split(y, M))


def train(prepare):
    def fn(ctx: pdps.TrainerContext):
        pipe = ctx.pipeline(make_model(), F.mse_loss, points=POINTS)
        losses = pipe.train(prepare)
        reached = sorted({b.param for part in ctx._group.parts for b in part.blocks})  # what its pushes and pulls name
        return {"stage": pipe.stage, "rank": pipe.group.rank, "losses": losses, "peak": pipe.peak_activations, "reached": reached}

    return fn


def reference(source, history, prepare) -> dict[str, torch.Tensor]:
    """Single-process torch: per sync round, one step on the pipelines' batches of that
    round together (each microbatch's mean loss weighted by its share of the rows)."""
    data = {t.id: read_whole(source, t) for t in source.tasks()}
    rounds = defaultdict(list)
    for trainer, steps in history.items():
        for s in steps:
            rounds[s.round].append((trainer, s))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), **SGD)
    for r in sorted(rounds):
        batches = [s for _, s in sorted(rounds[r], key=lambda ts: ts[0])]
        total = sum(s.samples for s in batches)
        opt.zero_grad()
        loss = 0
        for s in batches:
            cols = {k: torch.from_numpy(v[s.start : s.end]) for k, v in data[s.task].items()}
            inputs, targets = prepare(cols)
            if isinstance(inputs, torch.Tensor):
                loss = loss + F.mse_loss(model(inputs), targets) * (s.samples / total)
            else:
                for xi, yi in zip(inputs, targets):
                    loss = loss + F.mse_loss(model(xi), yi) * (len(yi) / total)
        loss.backward()
        opt.step()
    return {n: p.detach() for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule,prepare", [("gpipe", as_tensor), ("1f1b", ragged)], ids=["gpipe-rows", "1f1b-ragged"])
def test_pipelines_train_as_one_process(tmp_path, schedule, prepare):
    source = dataset(tmp_path.as_uri())
    result = pdps.simulate(
        train(prepare),
        dataset=source,
        trainers=P * D,
        pservers=2,
        mode="sync",
        batch_size=B,
        optimizer="SGD",
        optimizer_args=SGD,
        min_block=4,
        num_slots=16,
        pipeline_stages=P,
        pipeline_microbatches=M,
        pipeline_schedule=schedule,
        pipeline_timeout=20.0,
        timeout=120.0,
    )
    runs = list(result.trainers.values())
    assert sorted(r["rank"] for r in runs) == list(range(P * D))
    assert result.tasks_done == D
    leads = {t for t, steps in result.history.items() if steps}
    assert len(leads) == D and all(result.trainers[t]["stage"] == 0 for t in leads)  # stage 0 holds the task
    assert sum(len(result.history[t]) for t in leads) == K * D
    from pdps.adapters.parquet import ParquetSource

    want = reference(ParquetSource(source), result.history, prepare)
    assert set(result.params) == set(want)
    for name, w in want.items():
        torch.testing.assert_close(result.params[name], w, rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
        assert not torch.equal(w, make_model().state_dict()[name])  # training moved it
    stages = [[n for n, _ in s.named_parameters()] for s in [make_model()[a:b] for a, b in zip([0, *POINTS], [*POINTS, None])]]
    for r in runs:
        assert r["reached"] == sorted(stages[r["stage"]])  # each stage pushes and pulls its own parameters only
        if r["stage"] == P - 1:
            assert len(r["losses"]) == K and all(np.isfinite(r["losses"]))
        # GPipe holds every microbatch's activations; 1F1B at most P - stage
        assert r["peak"] == (M if schedule == "gpipe" else min(M, P - r["stage"]))


@pytest.mark.parametrize("pipelines", [1, 2])
def test_async_pipelines_apply_every_record_once(tmp_path, pipelines):
    """Async: each step applied on arrival, every stage's blocks in one step per pserver
    (stage 0's final, with the step's records). One pipeline is sequential training: it
    equals one process exactly; two apply every record of every task exactly once."""
    source = dataset(tmp_path.as_uri())
    result = pdps.simulate(
        train(as_tensor),
        dataset=source,
        trainers=P * pipelines,
        pservers=2,
        mode="async",
        batch_size=B,
        optimizer="SGD",
        optimizer_args={"lr": 0.1},
        min_block=4,
        num_slots=16,
        pipeline_stages=P,
        pipeline_microbatches=M,
        pipeline_timeout=20.0,
        timeout=120.0,
    )
    assert result.tasks_done == D and result.tasks_failed == 0
    from pdps.adapters.parquet import ParquetSource

    tasks = ParquetSource(source).tasks()
    for rows in result.applied.values():  # each pserver: each task's records once, in order
        by_task = defaultdict(list)
        for task, _, start, end in rows:
            by_task[task].append((start, end))
        assert sorted(by_task) == sorted(t.id for t in tasks)
        for spans in by_task.values():
            assert [a for a, _ in spans] == [b for _, b in [(0, 0), *spans[:-1]]] and spans[-1][1] == K * B
    if pipelines == 1:
        data = {t.id: read_whole(ParquetSource(source), t) for t in tasks}
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        (lead,) = [t for t, steps in result.history.items() if steps]
        for s in result.history[lead]:  # its steps in the order they were applied
            cols = {k: torch.from_numpy(v[s.start : s.end]) for k, v in data[s.task].items()}
            opt.zero_grad()
            F.mse_loss(model(cols["x"].view(-1, T, 5)), cols["y"]).backward()
            opt.step()
        for name, p in model.named_parameters():
            torch.testing.assert_close(result.params[name], p.detach(), rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_the_guide_example_runs(capsys):
    text = (Path(__file__).resolve().parents[2] / "docs" / "pipeline.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, "docs/pipeline.md has no runnable example"
    namespace: dict = {"__name__": "pipeline_guide"}
    exec(compile("\n".join(blocks), "docs/pipeline.md", "exec"), namespace)  # the example asserts its own outcome
    assert "8 tasks; last stages' final losses" in capsys.readouterr().out


def test_a_stage_without_parameters_is_refused_by_every_trainer_before_a_rank_is_claimed(tmp_path, monkeypatch):
    """Every trainer cuts the model alike, so each refuses it at once: the trainer of the
    stage that has parameters does not wait for the other's rank (it would until the
    discovery deadline, shortened here so that the old behaviour fails quickly)."""
    import pdps.roles.trainer.pipeline as pipeline_role

    monkeypatch.setattr(pipeline_role, "DISCOVERY_TIMEOUT", 3.0)
    write_parquet_shards({"x": np.zeros((8, 6)), "y": np.zeros((8, 2))}, str(tmp_path / "train"), shards=1, row_group_size=8)
    refused: dict[str, str] = {}

    def train(ctx: pdps.TrainerContext) -> None:
        model = nn.Sequential(nn.Linear(6, 8), nn.Linear(8, 2), nn.Tanh()).double()  # stage 1: the Tanh alone
        try:
            ctx.pipeline(model, F.mse_loss, points=[2])
        except pdps.ConfigError as exc:
            refused[ctx.trainer_id] = str(exc)
            raise

    with pytest.raises(pdps.ConfigError, match="stage 1 holds no trainable parameter"):
        pdps.simulate(train, dataset=str(tmp_path / "train"), trainers=2, pipeline_stages=2, pservers=1, batch_size=4)
    assert sorted(refused) == ["trainer-0", "trainer-1"]
    assert all("stage 1 holds no trainable parameter" in why for why in refused.values())
