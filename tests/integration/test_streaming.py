"""Streaming jobs (docs/online.md): tasks cut from a Redis stream or a growing Parquet
directory as records arrive, windows whose audit shows every record trained exactly
once, the lag back to 0, exports after windows, and rollbacks and master failovers in
the middle of a stream."""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid

import numpy as np
import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

import pdps
from pdps import exports, streams
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.tasks import TaskSpec
from pdps.examples import digits
from pdps.shell.status import job_status, window_audit

pytestmark = pytest.mark.integration


def stream_url(scheme_root: str) -> str:
    return f"{scheme_root}/s-{uuid.uuid4().hex[:8]}"


def check_windows(store, job: str, windows: int, records: int | None = None) -> list[dict]:
    """Every window closed, each record of each trained exactly once; the audits."""
    audits = [window_audit(store, job, w) for w in range(windows)]
    for a in audits:
        s = a["summary"]
        assert a["state"] == "closed", a
        assert s["failed"] == 0 and s["records_trained_exactly_once"] == a["records"] == s["records_trained"], (a["window"], s)
        assert s["records_trained_more_than_once"] == 0
    first = [a["first_task"] for a in audits]
    assert first == sorted(first) and all(a["last_task"] + 1 == b["first_task"] for a, b in zip(audits, audits[1:]))
    if records is not None:
        assert sum(a["records"] for a in audits) == records
    return audits


def test_a_redis_stream_job_trains_every_record_once_reaches_095_and_its_lag_returns_to_0(redis_server, tmp_path):
    """The must-show: a producer appends the digits training records (10 times over) at a
    steady rate while the job trains; every window's audit shows each record once, the
    held-out accuracy reaches 0.95, the lag is 0 at the end, and every export loads with
    the reference safetensors loader, the last one equal to the final parameters."""
    x, _, y, _ = digits._split(digits.SPLIT_SEED)
    reps, per_append = 10, 500
    xs, ys = np.concatenate([x] * reps), np.concatenate([y] * reps)
    url = stream_url(redis_server.url.replace("redis://", "redis-stream://"))  # redis-stream://127.0.0.1:PORT/0/s-...
    streams.append(url, {"x": xs[:1], "y": ys[:1]})

    def produce() -> None:
        for i in range(1, len(xs), per_append):
            streams.append(url, {"x": xs[i : i + per_append], "y": ys[i : i + per_append]})
            time.sleep(0.05)

    producer = threading.Thread(target=produce, daemon=True)
    producer.start()
    store = MemoryStore()
    export_url = (tmp_path / "models").as_uri()
    result = pdps.simulate(
        digits.train, dataset=url, store=store, trainers=2, pservers=2, batch_size=16, optimizer="Adam",
        optimizer_args={"lr": 0.003}, window_records=len(x), windows=reps, task_records=100, stream_linger=0.2,
        export_url=export_url, export_every=3, evaluate=digits.evaluate, timeout=240,
    )  # fmt: skip
    producer.join(timeout=30)
    accuracy = digits.accuracy(result.params, *digits.held_out())
    assert accuracy >= 0.95, accuracy
    check_windows(store, result.config.name, reps, records=len(xs))

    stream = job_status(store, result.config.name)["stream"]
    assert stream["ended"] and stream["windows_closed"] == reps and stream["records"] == len(xs)
    assert (stream["records_untasked"], stream["tasks_untrained"], stream["records_untrained"]) == (0, 0, 0), stream
    assert stream["evaluation"]["window"] == reps - 1 and stream["evaluation"]["metrics"]["accuracy"] == pytest.approx(accuracy)

    made = exports.list_exports(export_url)
    assert [e.meta["window"] for e in made] == [2, 5, 8]  # after every third window
    assert [e.meta["updates"] for e in made] == sorted(e.meta["updates"] for e in made)
    for e in made:
        tensors = safetensors.torch.load_file(e.path.removeprefix("file://"))  # the reference loader
        assert sorted(tensors) == sorted(result.params) and all(tensors[k].shape == result.params[k].shape for k in tensors)


def test_the_last_export_is_the_model_at_the_jobs_end(tmp_path):
    """An export after the last window holds exactly the parameters the job ends with."""
    x, _, y, _ = digits._split(digits.SPLIT_SEED)
    url = stream_url("memory-stream:/")
    streams.append(url, {"x": x[:400], "y": y[:400]})
    export_url = (tmp_path / "m").as_uri()
    result = pdps.simulate(
        digits.train, dataset=url, trainers=2, pservers=2, batch_size=32, window_records=100, windows=4, task_records=50,
        export_url=export_url, export_keep=2, timeout=120,
    )  # fmt: skip
    kept = [e.meta["window"] for e in exports.list_exports(export_url)]
    assert len(kept) <= 2 and kept[-1] == 3, kept  # keep=2 (windows closing faster than exports are passed over)
    last = exports.load(export_url)
    assert all(torch.equal(last[k], result.params[k]) for k in result.params)


def follow_train(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(torch.nn.Linear(3, 1).double())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))


def test_a_growing_parquet_directory_trains_every_file_once_and_none_half_written(tmp_path):
    """Files land while the job trains, one written in place, one under a temporary name
    then renamed, one with its footer missing for a while: every row group of every file
    is trained exactly once, and no task was cut from a file before it was whole."""
    root = tmp_path / "landing"
    root.mkdir()
    rng = np.random.default_rng(3)
    parts = [{"x": rng.normal(size=(40, 3)), "y": rng.normal(size=40)} for _ in range(4)]
    write_parquet_shards(parts[0], (root / "p0").as_uri(), shards=1, row_group_size=20)

    def land() -> None:
        time.sleep(0.3)
        write_parquet_shards(parts[1], (root / "p1").as_uri(), shards=1, row_group_size=20)  # in place
        time.sleep(0.3)
        staging = tmp_path / "staging"
        write_parquet_shards(parts[2], staging.as_uri(), shards=1, row_group_size=20)
        (root / "p2").mkdir()
        (root / "p2" / "_part-00000.parquet").write_bytes((staging / "part-00000.parquet").read_bytes())  # a temp name ...
        time.sleep(0.3)
        (root / "p2" / "_part-00000.parquet").rename(root / "p2" / "part-00000.parquet")  # ... renamed when whole
        write_parquet_shards(parts[3], staging.as_uri(), shards=1, row_group_size=20, overwrite=True)
        whole = (staging / "part-00000.parquet").read_bytes()
        (root / "p3").mkdir()
        (root / "p3" / "part-00000.parquet").write_bytes(whole[: len(whole) // 2])  # half written: no footer
        time.sleep(0.5)
        (root / "p3" / "part-00000.parquet").write_bytes(whole)

    lander = threading.Thread(target=land, daemon=True)
    lander.start()
    store = MemoryStore()
    result = pdps.simulate(
        follow_train, dataset=root.as_uri() + "?follow=1&poll_seconds=0.1", store=store, trainers=2, pservers=1,
        batch_size=8, window_records=40, windows=4, timeout=120,
    )  # fmt: skip
    lander.join(timeout=30)
    audits = check_windows(store, result.config.name, 4, records=160)
    locations = []
    for kv in store.range(f"/pdps/{result.config.name}/specs/"):
        spec = TaskSpec.from_json(json.loads(kv.value))
        locations.append((spec.location.rsplit("landing/", 1)[1], spec.part, spec.records))
    assert sorted(locations) == [(f"p{i}/part-00000.parquet", g, 20) for i in range(4) for g in (0, 1)]
    assert sum(a["tasks"] for a in audits) == 8


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_trainers_killed_mid_task_on_a_stream_leave_every_record_once(mode):
    """Two of three trainers die in the middle of a task: the windows' audits still show
    every record exactly once (the next attempt resumed where the dead one stopped)."""
    rng = np.random.default_rng(7)
    url = stream_url("memory-stream:/")
    streams.append(url, {"x": rng.normal(size=(480, 3)), "y": rng.normal(size=480)})
    store = MemoryStore()
    result = pdps.simulate(
        follow_train, dataset=url, store=store, trainers=3, pservers=2, mode=mode, batch_size=8, window_records=120,
        windows=4, task_records=40, kill={0: 3, 2: 6}, lease_ttl=0.5, timeout=120,
    )  # fmt: skip
    assert set(result.killed) == {"trainer-0", "trainer-2"}
    audits = check_windows(store, result.config.name, 4, records=480)
    resumed = [a for w in audits for e in w["entries"] for a in e["attempts"] if a.get("offset")]
    assert resumed, "no task was resumed mid-way"


def test_a_stream_job_rolls_back_across_a_window_close_and_survives_a_master_failover(tmp_path, caplog):
    """A pserver dies (the job rolls back to its latest checkpoint, re-opening windows closed
    since) and the master dies (a standby restores the stream from the store): the job
    still trains each record once, by the windows' audits, and the windows closed after
    the checkpoint were trained again."""
    caplog.set_level(logging.WARNING, logger="pdps.roles.master")
    rng = np.random.default_rng(5)
    url = stream_url("memory-stream:/")
    streams.append(url, {"x": rng.normal(size=(640, 3)), "y": rng.normal(size=640)})
    store = MemoryStore()
    result = pdps.simulate(
        follow_train, dataset=url, store=store, trainers=2, pservers=2, batch_size=8, window_records=80, windows=8,
        task_records=40, checkpoint_url=(tmp_path / "ck").as_uri(), checkpoint_every=12, lease_ttl=0.5,
        faults=pdps.Faults(seed=3, pservers=1, master=True, window=(0.3, 0.7)), timeout=180,
    )  # fmt: skip
    assert {f.fault.role for f in result.faults} == {"pserver", "master"}
    epoch = job_status(store, result.config.name)["epoch"]
    assert epoch is not None and epoch["epoch"] >= 1 and epoch["checkpoint"]  # it rolled back to a checkpoint
    audits = check_windows(store, result.config.name, 8, records=640)
    said = re.search(r"closed windows re-opened: \[([\d, ]*)\]", caplog.text)
    reopened = [int(w) for w in said.group(1).split(",") if w.strip()]
    assert reopened, "the fault struck before a window closed after the checkpoint: pick another seed"
    # their tasks not done at the checkpoint were trained, rolled back and trained again
    # (one done then keeps its attempt, so a re-opened window may hold some of each)
    again = [e["task"] for w in reopened for e in audits[w]["entries"] if "rolled_back" in [a["outcome"] for a in e["attempts"]]]
    assert again, [audits[w]["entries"] for w in reopened]
    assert all(e["attempts"][-1]["outcome"] == "done" for w in reopened for e in audits[w]["entries"])


def test_window_settings_on_a_finite_dataset_and_an_endless_simulated_stream_are_refused(tmp_path):
    url = (tmp_path / "d").as_uri()
    write_parquet_shards({"x": np.zeros((8, 3)), "y": np.zeros(8)}, url, shards=1, row_group_size=8)
    checkpoints = {"checkpoint_url": (tmp_path / "ck").as_uri(), "checkpoint_windows": 1}  # would never be taken
    for settings in ({"window_records": 10, "windows": 2}, {"export_url": (tmp_path / "m").as_uri()}, checkpoints):
        with pytest.raises(pdps.ConfigError, match="are for a streaming dataset .* is a finite one"):
            pdps.simulate(follow_train, dataset=url, timeout=60, **settings)
    with pytest.raises(pdps.ConfigError, match="evaluate runs after each window of a streaming job"):
        pdps.simulate(follow_train, dataset=url, evaluate=lambda params: 1.0, timeout=60)
    stream = stream_url("memory-stream:/")
    streams.append(stream, {"x": np.zeros((8, 3)), "y": np.zeros(8)})
    with pytest.raises(pdps.ConfigError, match="give windows=N"):
        pdps.simulate(follow_train, dataset=stream, window_records=4, timeout=60)
    with pytest.raises(pdps.ConfigError, match="is a stream: give the job windows"):
        pdps.simulate(follow_train, dataset=stream, windows=2, timeout=60)
    with pytest.raises(pdps.ConfigError, match="^evaluate 'no_such_module:fn': cannot import"):
        pdps.simulate(follow_train, dataset=stream, windows=2, window_records=4, evaluate="no_such_module:fn", timeout=60)


def test_a_finished_jobs_records_untasked_are_those_after_its_last_window():
    """docs/online.md: records that arrived after the last window stay in the source,
    shown as `records_untasked`. The master measures the lag about once a second; a job
    that ends sooner showed the first poll's backlog (80 here) for good."""
    stream = stream_url("memory-stream:/")
    streams.append(stream, {"x": np.zeros((130, 3)), "y": np.zeros(130)})
    store = MemoryStore()
    result = pdps.simulate(follow_train, dataset=stream, store=store, windows=2, window_records=50, task_records=25, batch_size=25, timeout=60)
    st = job_status(store, result.config.name)["stream"]
    assert st["ended"] and st["records"] == 100 and st["windows_closed"] == 2
    assert (st["records_untasked"], st["tasks_untrained"], st["records_untrained"], st["backpressure"]) == (30, 0, 0, False)


def test_an_evaluation_that_is_not_json_is_logged_and_not_recorded(caplog):
    """docs/online.md: evaluate returns a number or a dict of JSON values; anything else is
    logged and nothing is recorded. NaN and infinities are no JSON: recorded, they made
    `pdps status --json` print `NaN`, which JSON readers refuse. A number is any real
    number, numpy's scalars included (np.float32 was refused as no number)."""
    stream = stream_url("memory-stream:/")
    streams.append(stream, {"x": np.zeros((12, 3)), "y": np.zeros(12)})
    # a number numpy computed (recorded as a float), then no JSON twice, then numbers again
    answers = [np.float32(0.5), float("nan"), {"loss": float("inf")}]
    calls = []

    def evaluate(params: dict) -> object:
        calls.append(len(calls))
        return answers[len(calls) - 1] if len(calls) <= len(answers) else np.float64(0.5)

    store = MemoryStore()
    with caplog.at_level(logging.ERROR, logger="pdps"):
        result = pdps.simulate(
            follow_train, dataset=stream, store=store, windows=3, window_records=4, task_records=4, evaluate=evaluate, timeout=60
        )
    # windows closing faster than their work are passed over: which windows ran is not fixed
    evals = [json.loads(kv.value) for kv in store.range(f"/pdps/{result.config.name}/evals/")]
    assert calls and [e["metrics"] for e in evals] == [{"metric": 0.5}] * (1 + max(0, len(calls) - 3))
    failed = [r for r in caplog.records if "post-window work" in r.getMessage() and r.exc_info and "not JSON values" in str(r.exc_info[1])]
    assert len(failed) == min(len(calls) - 1, 2)
    json.loads(json.dumps(job_status(store, result.config.name)), parse_constant=lambda c: pytest.fail(f"{c} in the status"))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_checkpoint_windows_takes_a_checkpoint_after_every_kth_window(tmp_path, mode):
    """checkpoint_windows=2 and no other trigger: the job's checkpoints are taken after
    windows 1, 3, ... close (the master's part of each says how many had closed)."""
    from pdps.registry import open_checkpoint_files

    url = stream_url("memory-stream:/")
    streams.append(url, {"x": np.random.default_rng(2).normal(size=(480, 3)), "y": np.zeros(480)})
    ck = (tmp_path / "ck").as_uri()
    store = MemoryStore()
    result = pdps.simulate(
        follow_train, dataset=url, store=store, trainers=2, pservers=2, mode=mode, batch_size=8, window_records=80,
        windows=6, task_records=40, checkpoint_url=ck, checkpoint_windows=2, checkpoint_keep=10, timeout=120,
    )  # fmt: skip
    pointer = job_status(store, result.config.name)["checkpoint"]
    assert pointer is not None, "no checkpoint was taken"
    files = open_checkpoint_files(ck)
    closed = []
    for ckpt in pointer["history"]:
        manifest = files.read_manifest(ckpt)
        closed.append(files.read_json_part(manifest.parts["master"])["windows_closed"])
    assert closed and all(n >= 2 for n in closed), closed  # none before window 1 closed
    assert len(closed) <= 3  # one per two windows at most


def test_export_seconds_exports_by_time_as_well(tmp_path):
    """export_every=0 and export_seconds: exports are made while the job trains, by time
    alone, each marked timed and whole."""
    url = stream_url("memory-stream:/")
    streams.append(url, {"x": np.random.default_rng(3).normal(size=(600, 3)), "y": np.zeros(600)})
    export_url = (tmp_path / "m").as_uri()

    def slow(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(torch.nn.Linear(3, 1).double())
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
            time.sleep(0.02)

    pdps.simulate(
        slow, dataset=url, trainers=1, pservers=1, batch_size=10, window_records=600, windows=1, task_records=100,
        export_url=export_url, export_every=0, export_seconds=0.3, timeout=120,
    )  # fmt: skip
    made = exports.list_exports(export_url)
    assert len(made) >= 2, made  # the job trains ~1.2 s
    assert all(e.meta["timed"] is True for e in made) and sorted(e.meta["updates"] for e in made) == [e.meta["updates"] for e in made]
    for e in made:
        assert sorted(exports.load(export_url, e.seq)) == ["bias", "weight"]
