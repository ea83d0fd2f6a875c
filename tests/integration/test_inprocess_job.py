"""Whole jobs through ``pdps.simulate``: the sync-SGD equivalence, sharding, a crashed
trainer, a training function that raises, and bad input rejected before it changes anything."""

from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
import traceback

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import ConfigError, DatasetError, GradientRejected, UnknownSchemeError
from pdps.core.job import Keys
from pdps.core.sgd import Contribution
from pdps.ports.data import read_whole
from pdps.shell.status import format_status, job_status

K = 20  # steps
B = 8  # batch per trainer
N = 3  # trainers


def make_model(dtype: torch.dtype) -> nn.Module:
    g = torch.Generator().manual_seed(1234)  # not the global RNG: trainers build models on threads
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


def regression_dataset(root, dtype: np.dtype, *, short: int = 0) -> ParquetSource:
    """N tasks (one row group each) of K*B rows; the last task is ``short`` rows shorter."""
    rng = np.random.default_rng(7)
    sizes = [K * B] * (N - 1) + [K * B - short]
    parts = []
    for i, n in enumerate(sizes):
        x = rng.normal(size=(n, 5)).astype(dtype)
        y = np.stack([x[:, 0] * 2 - x[:, 1], np.sin(x[:, 2]), x[:, 3] * x[:, 4]], axis=1).astype(dtype)
        url = f"{root}/t{i}"
        write_parquet_shards({"x": x, "y": y}, url, shards=1, row_group_size=n)
        parts.append(url)
    # one directory per task keeps the row groups whole; gather them into one dataset dir
    import fsspec

    fs, base = fsspec.core.url_to_fs(f"{root}/all")
    fs.makedirs(base, exist_ok=True)
    for i, url in enumerate(parts):
        src_fs, src = fsspec.core.url_to_fs(f"{url}/part-00000.parquet")
        fs.pipe_file(f"{base}/part-{i:05d}.parquet", src_fs.cat_file(src))
    return ParquetSource(f"{root}/all")


def train_mse(dtype: torch.dtype):
    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(make_model(dtype))
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))

    return train


def reference(source: ParquetSource, dtype: torch.dtype, optimizer: str | type[torch.optim.Optimizer], kwargs: dict) -> dict[str, torch.Tensor]:
    """Single-process torch on the concatenated N*B batch of step k, for k < K; ``optimizer``
    names a ``torch.optim`` class or is an optimizer class itself."""
    model = make_model(dtype)
    opt = (getattr(torch.optim, optimizer) if isinstance(optimizer, str) else optimizer)(model.parameters(), **kwargs)
    tasks = [read_whole(source, t) for t in source.tasks()]
    for k in range(K):
        xs = torch.cat([torch.from_numpy(t["x"][k * B : (k + 1) * B]) for t in tasks])
        ys = torch.cat([torch.from_numpy(t["y"][k * B : (k + 1) * B]) for t in tasks])
        opt.zero_grad()
        F.mse_loss(model(xs), ys).backward()
        opt.step()
    return {name: p.detach() for name, p in model.named_parameters()}


def run_sync(source, dtype, optimizer, kwargs, *, pservers=2, min_block=8, transport="inproc://"):
    return pdps.simulate(
        train_mse(dtype),
        transport=transport,
        dataset=source,
        trainers=N,
        pservers=pservers,
        mode="sync",
        batch_size=B,
        optimizer=optimizer,
        optimizer_args=kwargs,
        min_block=min_block,
        num_slots=64,
    )


OPTIMIZERS = [
    ("SGD", {"lr": 0.1}),
    ("SGD", {"lr": 0.05, "momentum": 0.9}),
    ("Adam", {"lr": 0.01}),
]


@pytest.mark.parametrize("optimizer,kwargs", OPTIMIZERS, ids=["sgd", "momentum", "adam"])
@pytest.mark.parametrize(
    "dtype,np_dtype,tol",
    [(torch.float64, np.float64, {"rtol": 1e-9, "atol": 1e-10}), (torch.float32, np.float32, {"rtol": 1e-4, "atol": 1e-5})],
    ids=["float64", "float32"],
)
@pytest.mark.parametrize("short", [0, 3], ids=["even", "ragged"])
def test_sync_sgd_equals_single_process_training(tmp_path, optimizer, kwargs, dtype, np_dtype, tol, short):
    source = regression_dataset(tmp_path.as_uri(), np_dtype, short=short)
    result = run_sync(source, dtype, optimizer, kwargs)
    want = reference(source, dtype, optimizer, kwargs)
    assert result.steps == K
    assert set(result.params) == set(want)
    moved = False
    for name, w in want.items():
        got = result.params[name]
        assert got.dtype == dtype
        torch.testing.assert_close(got, w, **tol, msg=lambda m, n=name: f"{n}: {m}")
        moved |= not torch.equal(w, make_model(dtype).state_dict()[name])
    assert moved  # training changed the parameters: the comparison is not between two initial states


def test_simulate_over_grpc_serves_the_roles_on_loopback_and_trains_the_same(tmp_path, caplog):
    """transport="grpc://" runs the master and the pservers as gRPC servers on 127.0.0.1
    (free ports) in this process; the result equals single-process torch as in process."""
    source = regression_dataset(tmp_path.as_uri(), np.float64)
    with caplog.at_level(logging.INFO, logger="pdps.roles"):
        result = run_sync(source, torch.float64, "Adam", {"lr": 0.01}, transport="grpc://")
    serving = [r.getMessage() for r in caplog.records if " serving at " in r.getMessage()]
    assert len(serving) == 3 and all(" serving at grpc://127.0.0.1:" in m for m in serving), serving
    assert result.steps == K
    want = reference(source, torch.float64, "Adam", {"lr": 0.01})
    for name, w in want.items():
        torch.testing.assert_close(result.params[name], w, rtol=1e-9, atol=1e-10)


def test_simulate_refuses_one_fixed_port_for_its_roles(tmp_path):
    with pytest.raises(ConfigError, match="names port 5000, but 3 roles serve"):
        pdps.simulate(train_mse(torch.float64), dataset=regression_dataset(tmp_path.as_uri(), np.float64), pservers=2, transport="grpc://127.0.0.1:5000")


def test_sharding_changes_nothing(tmp_path):
    source = regression_dataset(tmp_path.as_uri(), np.float64, short=3)
    one = run_sync(source, torch.float64, "Adam", {"lr": 0.01}, pservers=1)
    three = run_sync(source, torch.float64, "Adam", {"lr": 0.01}, pservers=3)
    for name in one.params:
        torch.testing.assert_close(one.params[name], three.params[name], rtol=0, atol=1e-10)


def test_three_pservers_really_split_the_model(tmp_path):
    from pdps.core.slots import Layout, ParamSpec, SlotMap

    specs = [ParamSpec(n, tuple(p.shape), "float64") for n, p in make_model(torch.float64).named_parameters()]
    layout = Layout.build(specs, SlotMap.initial(3, 64), 8)
    assert all(layout.blocks_of(i) for i in range(3))  # else the sharding test would prove little


# --- every pserver holds a share of the model ----------------------------------------


def wide_dataset(root, width: int, classes: int) -> ParquetSource:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(120, width)).astype(np.float32)
    y = np.abs(x[:, :classes]).argmax(axis=1).astype(np.int64)
    write_parquet_shards({"x": x, "y": y}, f"{root}/w{width}", shards=2, row_group_size=30)
    return ParquetSource(f"{root}/w{width}")


def fit(make):
    def train(ctx: pdps.TrainerContext) -> None:
        torch.manual_seed(0)
        model = ctx.attach(make())
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))

    return train


def initialized(caplog) -> dict[int, int]:
    """Pserver index -> how many blocks it was initialized with, from its own log line."""
    return {r.args[0]: r.args[1] for r in caplog.records if r.name == "pdps.roles.pserver" and r.msg.startswith("pserver %s initialized")}


@pytest.mark.parametrize(
    "make,width,classes,pservers",
    [(lambda: nn.Linear(20, 2), 20, 2, 2), (lambda: nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10)), 64, 10, 3)],
    ids=["logistic-2", "mlp-3"],
)
def test_every_pserver_holds_a_share_of_a_small_model(tmp_path, caplog, make, width, classes, pservers):
    store = pdps.open_store(f"memory://share-{pservers}")
    with caplog.at_level(logging.INFO, logger="pdps.roles.pserver"):
        pdps.simulate(fit(make), dataset=wide_dataset(tmp_path.as_uri(), width, classes), trainers=2, pservers=pservers,
                      mode="sync", batch_size=10, store=store, name="share")  # fmt: skip
    blocks = initialized(caplog)
    assert sorted(blocks) == list(range(pservers)) and all(n > 0 for n in blocks.values())
    layout = job_status(store, "share")["layout"]
    assert layout["pservers"] == layout["pservers_holding"] == pservers
    assert layout["idle"] == [] and layout["warning"] is None and layout["blocks"] >= pservers


class Offset(nn.Module):
    """A model of one element: a learned offset of the logits."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :2] + self.bias


def test_a_model_too_small_to_spread_is_warned_about_and_shown_in_status(tmp_path, caplog):
    store = pdps.open_store("memory://too-small")
    with caplog.at_level(logging.INFO):
        result = pdps.simulate(fit(Offset), dataset=digits_like(tmp_path.as_uri()), trainers=1, pservers=3,
                               mode="sync", batch_size=50, optimizer_args={"lr": 0.1}, store=store, name="small")  # fmt: skip
    assert result.params["bias"].item() != 0.0  # it trained, on the one pserver that holds it
    assert len(initialized(caplog)) == 1
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "hold no part of the model" in r.getMessage()]
    assert len(warned) == 1 and "2 of 3 pservers" in warned[0] and "at most 1 pserver" in warned[0]
    status = job_status(store, "small")
    layout = status["layout"]
    assert layout["blocks"] == 1 and layout["pservers"] == 3 and layout["pservers_holding"] == 1
    assert len(layout["idle"]) == 2 and layout["idle"][0] not in initialized(caplog)
    assert layout["warning"] == warned[0].split(": ", 1)[1]
    text = format_status(status, store.url)
    assert "layout      1 block on 1 of 3 pservers" in text and "WARNING: 2 of 3 pservers hold no part of the model" in text


def digits_like(root, rows=600, parts=12):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 4)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)
    write_parquet_shards({"x": x, "y": y}, f"{root}/d", shards=3, row_group_size=rows // parts)
    return ParquetSource(f"{root}/d")


def classify(ctx: pdps.TrainerContext) -> int:
    torch.manual_seed(0)
    model = ctx.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
    return ctx.tasks_done


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_crashed_trainer_loses_no_task(tmp_path, mode):
    source = digits_like(tmp_path.as_uri())
    n_tasks = len(source.tasks())
    result = pdps.simulate(
        classify, dataset=source, trainers=3, pservers=2, mode=mode, batch_size=10, passes=2,
        optimizer="SGD", optimizer_args={"lr": 0.1}, lease_ttl=1.0, task_timeout=60.0, kill={1: 3},
    )
    assert result.killed == ("trainer-1",)
    assert list(result.trainers) == ["trainer-0", "trainer-1", "trainer-2"] and result.trainers["trainer-1"] is None  # killed: None
    assert result.passes == 2
    assert result.tasks_done == 2 * n_tasks and result.tasks_failed == 0
    assert sum(v for v in result.trainers.values() if v is not None) == result.tasks_done - 0  # survivors did all
    # the crashed trainer's task came back through its lease (1 s), long before the 60 s timeout
    assert result.seconds < 30


class Boom(Exception):
    pass


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_training_function_that_raises_stops_the_job_with_its_error(tmp_path, mode):
    """Trainer 1 raises at its 3rd step of a 100-pass job: the other trainers stop at once
    (not after the job's 1,200 batches) and simulate raises that very exception."""
    source = digits_like(tmp_path.as_uri(), rows=120)  # 12 tasks of 10 rows: 12 batches a pass
    passes, steps = 100, []

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            steps.append(ctx.trainer_id)
            if ctx.trainer_id == "trainer-1" and ctx.steps == 3:
                raise Boom("trainer-1 trips at its 3rd step")

    before = threading.active_count()
    with pytest.raises(Boom, match="3rd step") as info:
        pdps.simulate(train, dataset=source, trainers=3, pservers=2, mode=mode, batch_size=10, passes=passes, name=f"boom-{mode}")
    assert len(steps) < passes * 12 // 10, f"{len(steps)} batches: the others trained on after trainer-1 failed"
    raising = traceback.extract_tb(info.value.__traceback__)[-1]
    assert (raising.name, raising.line) == ("train", 'raise Boom("trainer-1 trips at its 3rd step")')
    if sys.version_info >= (3, 11):
        assert any("trainer-1" in n and f"boom-{mode}" in n for n in info.value.__notes__), info.value.__notes__
    assert not [t.name for t in threading.enumerate() if t.name.startswith("trainer-")]
    deadline = time.monotonic() + 5  # the pservers' and the master's threads wind down
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before, [t.name for t in threading.enumerate()]


def test_graceful_stop_gives_tasks_back_without_failures(tmp_path):
    source = digits_like(tmp_path.as_uri())
    n_tasks = len(source.tasks())

    def quits_early(ctx: pdps.TrainerContext) -> str:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for i, batch in enumerate(ctx.batches()):
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            if ctx.trainer_id == "trainer-0" and i == 2:
                break  # mid-task: the task goes back, not counted as a failure
        return ctx.trainer_id

    store = pdps.open_store("memory://graceful-stop")
    result = pdps.simulate(quits_early, dataset=source, trainers=2, pservers=1, mode="async", batch_size=10, store=store, name="g")
    assert result.tasks_done == n_tasks and result.tasks_failed == 0
    records = [json.loads(kv.value) for kv in store.range(Keys("g").tasks)]
    assert all(r["failures"] == 0 for r in records)
    assert max(r["attempt"] for r in records) == 2  # the given-back task was dispatched again


# --- bad input ------------------------------------------------------------------------


@pytest.fixture(params=["async", "sync"])
def live_job(tmp_path, request):
    """A master and one pserver with a trainer attached, for sending bad pushes."""
    from tests.integration.jobkit import start_job

    job = start_job(digits_like(tmp_path.as_uri()), name="bad-input", mode=request.param)
    ctx = job.trainer("t-bad")
    ctx.attach(nn.Sequential(nn.Linear(4, 2)))
    yield job.store, job.transport, job.config, ctx, job.ps
    job.close()


def _push(ctx, tensors, keys=None):
    part = ctx._group.parts[0]
    from pdps.ports.transport import Message

    meta = {"trainer": "t-bad", "updates": part.version, "round": part.round_no, "samples": 4, "blocks": keys or part.keys, "epoch": ctx.epoch}
    return ctx._group.call(part, "push", Message(meta, tensors))


@pytest.mark.parametrize(
    "mutate,expect",
    [
        (lambda g: [torch.zeros(3)] + g[1:], r"0\.weight.*t-bad.*shape"),
        (lambda g: [g[0].double()] + g[1:], r"0\.weight.*t-bad.*dtype"),
        (lambda g: [torch.full_like(g[0], float("nan"))] + g[1:], r"0\.weight.*t-bad"),
        (lambda g: g[:-1] + [torch.full_like(g[-1], float("inf"))], r"0\.bias.*t-bad"),
    ],
    ids=["shape", "dtype", "nan", "inf"],
)
def test_bad_gradient_is_rejected_and_changes_nothing(live_job, mutate, expect):
    store, transport, config, ctx, ps = live_job
    before = pdps.fetch_parameters(store, transport, config)
    round_before = ps.round_no
    good = [torch.ones_like(t) for t in ctx._replica.grads(ctx._group.parts[0].blocks)]
    with pytest.raises(GradientRejected, match=expect):
        _push(ctx, mutate(good))
    after = pdps.fetch_parameters(store, transport, config)
    for name in before:
        assert torch.equal(before[name], after[name])
    assert ps.round_no == round_before and "t-bad" not in ps._shard.staged()  # sync: no trace
    _push(ctx, good)  # the pserver still serves and applies a good push
    if config.mode.value == "sync":  # a staged push applies once the round's record says so
        assert ctx._commit(round_before, Contribution(4))
        ctx._pull_round(round_before)
    assert not torch.equal(pdps.fetch_parameters(store, transport, config)["0.weight"], before["0.weight"])


def test_gradient_for_unknown_parameter_is_rejected(live_job):
    store, transport, config, ctx, ps = live_job
    before = pdps.fetch_parameters(store, transport, config)
    grads = [torch.ones_like(t) for t in ctx._replica.grads(ctx._group.parts[0].blocks)]
    keys = list(ctx._group.parts[0].keys)
    keys[0] = "decoder.weight@0"
    with pytest.raises(GradientRejected, match=r"t-bad.*'decoder\.weight'"):
        _push(ctx, grads, keys)
    after = pdps.fetch_parameters(store, transport, config)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("make", ["missing", "not_parquet"])
def test_bad_dataset_fails_before_any_task_exists(tmp_path, make):
    if make == "missing":
        url = (tmp_path / "nope").as_uri()
    else:
        (tmp_path / "data").mkdir()
        (tmp_path / "data" / "part-0.parquet").write_bytes(b"this is not parquet")
        url = (tmp_path / "data").as_uri()
    store = pdps.open_store("memory://bad-dataset-" + make)
    with pytest.raises(DatasetError):
        pdps.simulate(classify, dataset=url, store=store, name="bd")
    assert store.range("/pdps/bd/") == []


def test_unknown_scheme_names_known_schemes_and_extras():
    with pytest.raises(UnknownSchemeError) as info:
        pdps.open_store("zookeeper://127.0.0.1:2181")
    msg = str(info.value)
    assert "zookeeper" in msg and "memory://" in msg
    with pytest.raises(UnknownSchemeError, match=r"pdps\[s3\]"):
        pdps.open_storage("gopher://x")


@pytest.mark.parametrize("optimizer", ["LBFGS", "NoSuchRule", "pdps.core.tasks:TaskQueue"])
def test_non_elementwise_optimizer_is_refused_at_configuration(tmp_path, optimizer):
    source = digits_like(tmp_path.as_uri())
    store = pdps.open_store("memory://refused-" + optimizer.replace(":", "-"))
    with pytest.raises(ConfigError):
        pdps.simulate(classify, dataset=source, optimizer=optimizer, optimizer_args={"lr": 1.0}, store=store, name="r")
    assert store.range("/pdps/r/") == []


def test_initial_values_come_from_one_trainer(tmp_path):
    """Trainers that initialize differently still start the job from one consistent model."""
    source = digits_like(tmp_path.as_uri())

    def differs(ctx: pdps.TrainerContext) -> None:
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float(ctx.trainer_id.rsplit("-", 1)[1]) + 1.0)
        ctx.attach(model)
        for _ in ctx.batches():
            pass  # no step: the parameters stay the initial ones

    result = pdps.simulate(differs, dataset=source, trainers=3, pservers=3, min_block=2, num_slots=16, mode="async")
    values = torch.cat([p.reshape(-1) for p in result.params.values()]).unique()
    assert values.numel() == 1 and values.item() in (1.0, 2.0, 3.0)


@pytest.mark.parametrize("late", [0.0, 0.3])
def test_a_trainer_with_another_model_is_the_one_refused_whatever_the_timing(tmp_path, late):
    """simulate takes trainer-0's model: trainer-1's differs and it is refused, with the
    difference named, even when trainer-0 attaches last; the job then stops."""
    source = digits_like(tmp_path.as_uri())

    def train(ctx: pdps.TrainerContext) -> None:
        hidden = 16 if ctx.trainer_id == "trainer-1" else 8
        if ctx.trainer_id == "trainer-0":
            time.sleep(late)  # trainer-0 comes last: it still decides the job's model
        model = ctx.attach(nn.Sequential(nn.Linear(4, hidden), nn.ReLU(), nn.Linear(hidden, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))

    with pytest.raises(pdps.ConfigError) as info:
        pdps.simulate(train, dataset=source, trainers=2, pservers=2, mode="sync", passes=50)
    message = str(info.value)
    assert "trainer 'trainer-1'" in message and "does not match the job's" in message
    assert "[8, 4]" in message and "[16, 4]" in message  # the shapes that differ


def test_tasks_that_keep_failing_are_failed_and_the_pass_still_ends(tmp_path):
    """The last tasks of a pass failing must not stall it; failed tasks are retried next pass."""
    inner = digits_like(tmp_path.as_uri())
    bad = {0, 5}

    class Flaky:
        url = inner.url

        def tasks(self):
            return inner.tasks()

        def read(self, task, *, start=0, batch_size):
            if task.id in bad:
                raise OSError(f"disk error reading task {task.id}")
            return inner.read(task, start=start, batch_size=batch_size)

    result = pdps.simulate(classify, dataset=Flaky(), trainers=2, pservers=1, mode="sync", batch_size=10,
                           passes=2, failure_max=1, optimizer="SGD", optimizer_args={"lr": 0.1})
    n = len(inner.tasks())
    assert result.passes == 2
    assert result.tasks_failed == 2 * len(bad)
    assert result.tasks_done == 2 * (n - len(bad))


def test_trainers_read_each_task_a_batch_at_a_time(tmp_path):
    inner = digits_like(tmp_path.as_uri())
    asked = []

    class Recording:
        url = inner.url

        def tasks(self):
            return inner.tasks()

        def read(self, task, *, start=0, batch_size):
            asked.append((task.id, start, batch_size))
            return inner.read(task, start=start, batch_size=batch_size)

    result = pdps.simulate(classify, dataset=Recording(), trainers=2, pservers=1, mode="async", batch_size=10)
    assert result.tasks_done == len(inner.tasks())
    assert sorted(asked) == [(t.id, 0, 10) for t in inner.tasks()]


def test_a_task_whose_batches_end_early_or_break_mid_task_fails(tmp_path):
    """A source that stops short, or raises after some batches, fails the task like an unreadable one."""
    inner = digits_like(tmp_path.as_uri())

    class Short:
        url = inner.url

        def tasks(self):
            return inner.tasks()

        def read(self, task, *, start=0, batch_size):
            batches = inner.read(task, start=start, batch_size=batch_size)
            if task.id == 1:
                yield next(batches)
                raise OSError("connection reset")
            yield from itertools.islice(batches, 2) if task.id == 2 else batches

    result = pdps.simulate(classify, dataset=Short(), trainers=2, pservers=1, mode="async", batch_size=10, failure_max=0)
    assert result.tasks_failed == 2
    assert result.tasks_done == len(inner.tasks()) - 2


def test_simulate_refuses_a_job_that_already_exists(tmp_path):
    source = digits_like(tmp_path.as_uri())
    store = pdps.open_store("memory://rerun")
    pdps.simulate(classify, dataset=source, store=store, name="again", mode="async")
    with pytest.raises(ConfigError, match="'again' already exists"):
        pdps.simulate(classify, dataset=source, store=store, name="again", mode="async", timeout=20)
