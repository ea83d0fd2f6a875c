"""Exactly once per record: a task re-queued after its trainer died resumes at the first
record not yet applied, and the audit (``pdps status --pass N --json``) counts exactly
what the pservers applied. And a sync job replayed in one process from the public API
alone (``SimulationResult.history``) gives the job's parameters.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import write_parquet_shards
from pdps.ports.data import read_whole
from pdps.shell.status import pass_audit

# 12 tasks of 40 records, batches of 8: a kill after k steps lands inside a task
ROWS, ROW_GROUP, BATCH = 480, 40, 8


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


@pytest.fixture
def dataset(tmp_path) -> str:
    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    url = f"{tmp_path.as_uri()}/d"
    write_parquet_shards({"x": x, "y": y}, url, shards=2, row_group_size=ROW_GROUP)
    return url


def train(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))


def counts_from_pservers(applied: dict[int, list[list[int]]], attempts_of_pass: set[tuple[int, int]]) -> dict[int, dict[int, Counter]]:
    """pserver -> task -> record -> how many times that pserver applied it, in one pass."""
    out: dict[int, dict[int, Counter]] = {}
    for ps, rows in applied.items():
        tasks: dict[int, Counter] = defaultdict(Counter)
        for task, attempt, start, end in rows:
            if (task, attempt) in attempts_of_pass:
                tasks[task].update(range(start, end))
        out[ps] = tasks
    return out


def counts_from_audit(audit: dict) -> dict[int, Counter]:
    out: dict[int, Counter] = {}
    for e in audit["entries"]:
        c: Counter = Counter()
        i = 0
        for count, length in e["record_counts"]:
            c.update({r: count for r in range(i, i + length)})
            i += length
        out[e["task"]] = +c  # records trained 0 times drop out, as in the pservers' counts
    return out


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("seed", [1, 2])
def test_trainers_killed_mid_task_leave_every_record_applied_exactly_as_the_audit_says(dataset, mode, seed):
    rng = random.Random(seed)
    # two of three trainers die at seeded points, each in the middle of one of its tasks
    kill = {0: rng.randrange(2, 9), 2: rng.randrange(2, 9)}
    store = MemoryStore()
    result = pdps.simulate(
        train, dataset=dataset, store=store, trainers=3, pservers=2, mode=mode, batch_size=BATCH, passes=1,
        optimizer="SGD", optimizer_args={"lr": 0.05}, kill=kill, lease_ttl=0.5,
    )  # fmt: skip
    assert set(result.killed) == {"trainer-0", "trainer-2"}
    audit = pass_audit(store, result.config.name, 0)
    assert audit["summary"]["done"] == ROWS // ROW_GROUP
    # the killed trainers' tasks were resumed, not started again: some attempt ended with
    # records applied and the next began there
    resumed = [a for e in audit["entries"] for a in e["attempts"] if a.get("offset")]
    assert resumed, audit["entries"]
    for e in audit["entries"]:
        ended = [a for a in e["attempts"] if a["outcome"] == "trainer_lost"]
        for a, b in zip(e["attempts"], e["attempts"][1:]):
            if a in ended:
                assert b.get("offset", 0) == a["applied"]  # the next attempt starts where it ended

    attempts = {(e["task"], a["attempt"]) for e in audit["entries"] for a in e["attempts"]}
    by_pserver = counts_from_pservers(result.applied, attempts)
    from_audit = counts_from_audit(audit)
    for ps, tasks in by_pserver.items():
        assert {t: +c for t, c in tasks.items()} == {t: c for t, c in from_audit.items() if c}, f"pserver {ps}"
    # every record exactly once (async too: the pservers never apply a task's records twice)
    assert all(e["record_counts"] == [[1, ROW_GROUP]] for e in audit["entries"]), audit["entries"]
    assert audit["summary"]["records_trained"] == ROWS
    assert audit["summary"]["records_trained_more_than_once"] == 0


def test_a_sync_job_replays_in_one_process_from_its_history(dataset):
    """The recipe of docs/user-guide.md ("Replaying a sync job"): each round applies the
    sample-weighted mean of its contributions, summed in trainer-id order."""
    result = pdps.simulate(
        train, dataset=dataset, trainers=3, pservers=2, mode="sync", batch_size=BATCH, passes=2,
        optimizer="SGD", optimizer_args={"lr": 0.05},
    )  # fmt: skip
    source = pdps.open_data_source(dataset)
    tasks = {t.id: t for t in source.tasks()}
    rounds: dict[int, list[tuple[str, pdps.StepRecord]]] = defaultdict(list)
    for trainer, steps in result.history.items():
        for s in steps:
            rounds[s.round].append((trainer, s))
    assert sum(len(v) for v in rounds.values()) == sum(len(h) for h in result.history.values()) > 0

    model = make_model()
    params = list(model.parameters())
    for r in sorted(rounds):
        contributions = sorted(rounds[r], key=lambda ts: ts[0])  # trainer-id order
        total = sum(s.samples for _, s in contributions)
        update = [torch.zeros_like(p) for p in params]
        for _, s in contributions:
            cols = read_whole(source, tasks[s.task])
            x, y = (torch.from_numpy(cols[k][s.start : s.end]) for k in ("x", "y"))
            model.zero_grad()
            F.mse_loss(model(x), y).backward()
            for u, p in zip(update, params):
                u += p.grad * (s.samples / total)
        with torch.no_grad():
            for u, p in zip(update, params):
                p -= 0.05 * u
    for (name, got), want in zip(result.params.items(), params):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=1e-12, msg=name)


# --- the same over processes: gRPC, etcd, a trainer SIGKILLed mid-task ---------------


@pytest.mark.integration
@pytest.mark.parametrize("mode,seed", [("sync", 4), ("async", 5)])
def test_a_sigkilled_trainer_process_leaves_every_record_applied_once(etcd_server, tmp_path, mode, seed):
    """``pdps launch`` over gRPC and etcd; trainer 0 is SIGKILLed at a seeded point of pass
    1 (``--restart on-failure`` starts another). The audit of every pass counts each
    record exactly once, and so does every pserver's own account of what it applied
    (written by each surviving trainer once the job is done)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    import uuid
    from pathlib import Path

    from pdps.registry import open_store
    from pdps.shell.status import job_status
    from tests.integration.test_faults import role_pid

    name, out = f"x-{uuid.uuid4().hex[:8]}", tmp_path / "applied"
    out.mkdir()
    target = Path(__file__).parent / "targets" / "slow.py"
    args = [
        sys.executable, "-m", "pdps", "launch", "--store", etcd_server.url, "--job", name, "--trainers", "2",
        "--pservers", "2", "--mode", mode, "--passes", "3", "--batch-size", "32", "--lease-ttl", "1",
        "--task-timeout", "60", "--restart", "on-failure", "--timeout", "200", "--json", f"{target}:audited",
    ]  # fmt: skip
    log = (tmp_path / "launch.log").open("w")
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env={**os.environ, "AUDIT_OUT": str(out)})
    store = open_store(etcd_server.url)
    try:
        fraction = random.Random(seed).uniform(0.2, 0.7)
        deadline = time.monotonic() + 180
        while True:  # the seeded point: pass 1, that fraction of its tasks done
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "launch.log").read_text()[-3000:]
            try:
                st = job_status(store, name)
            except Exception:  # the job is not there yet
                st = None
            if st and st.get("tasks") and (st["pass"] > 1 or (st["pass"] == 1 and st["done"] >= fraction * st["tasks"])):
                break
            time.sleep(0.02)
        pid = role_pid(proc, "trainer-0")
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        stdout, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, (tmp_path / "launch.log").read_text()[-4000:]
        assert "trainer-0 exited with signal SIGKILL; restarting it" in (tmp_path / "launch.log").read_text()

        views = [json.loads(p.read_text()) for p in out.glob("*.json")]
        assert views, "no trainer wrote what the pservers applied"
        applied = {int(k): v for k, v in views[-1].items()}
        assert all({int(k): v for k, v in view.items()} == applied for view in views)  # the job was done: one account
        for p in range(3):
            audit = pass_audit(store, name, p)
            attempts = {(e["task"], a["attempt"]) for e in audit["entries"] for a in e["attempts"]}
            from_audit = counts_from_audit(audit)
            for ps, tasks in counts_from_pservers(applied, attempts).items():
                assert {t: +c for t, c in tasks.items()} == {t: c for t, c in from_audit.items() if c}, (p, ps)
            assert all(e["record_counts"] == [[1, e["records"]]] for e in audit["entries"]), (p, audit["entries"])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
        store.close()


def test_a_pserver_applies_the_same_records_of_a_task_once(dataset):
    """The push of an attempt that died before recording its progress may have reached a
    pserver; the next attempt sends the same records again. The pserver applies them
    once (and a push of other records, or the same records in the next pass, as usual)."""
    job, push = _pusher(dataset)
    try:
        push([0, 3, 1, 0, 8])
        assert job.ps.version == 1
        before = pdps.fetch_parameters(job.store, job.transport, job.config)
        reply = push([0, 3, 2, 0, 8], "u")  # attempt 2 of task 3 sends records 0..7 again
        assert reply.meta.get("duplicate") is True and job.ps.version == 1
        after = pdps.fetch_parameters(job.store, job.transport, job.config)
        assert all(torch.equal(before[k], after[k]) for k in before)
        push([0, 3, 2, 8, 16], "u")  # the next records
        push([1, 3, 5, 0, 8])  # the same records in the next pass
        assert job.ps.version == 3
        assert sorted(map(tuple, job.ps.applied())) == [(3, 1, 0, 8), (3, 2, 8, 16), (3, 5, 0, 8)]
    finally:
        job.close()


def _pusher(dataset):
    """A one-pserver async job and ``push(records, trainer)``: a push of ones for every
    block, carrying ``records`` [pass, task, attempt, start, end]."""
    from pdps.adapters.parquet import ParquetSource
    from pdps.ports.transport import Message
    from tests.integration.jobkit import start_job

    job = start_job(ParquetSource(dataset), mode="async", pservers=1)
    ctx = job.trainer("t")
    ctx.attach(make_model())
    part = ctx._group.parts[0]
    grads = [torch.ones_like(t) for t in ctx._replica.grads(part.blocks)]

    def push(records: list[int], trainer: str = "t") -> Message:
        meta = {"trainer": trainer, "updates": job.ps.version, "blocks": part.keys, "records": records}
        return ctx._group.call(part, "push", Message(meta, grads))

    return job, push


def test_a_late_push_of_an_earlier_range_of_a_task_is_applied_nowhere(dataset):
    """Attempt 1 of task 7 timed out but still runs: its push of records [0, 8) arrives
    after the resumed attempt 2 pushed [0, 8) and [8, 16). The pserver applies it no more."""
    job, push = _pusher(dataset)
    try:
        push([0, 7, 2, 0, 8], "u")
        push([0, 7, 2, 8, 16], "u")
        before = pdps.fetch_parameters(job.store, job.transport, job.config)
        reply = push([0, 7, 1, 0, 8])  # the late one
        assert reply.meta.get("duplicate") is True and job.ps.version == 2
        after = pdps.fetch_parameters(job.store, job.transport, job.config)
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert sorted(map(tuple, job.ps.applied())) == [(7, 2, 0, 16)]
        push([0, 7, 2, 16, 24], "u")  # the records after the mark, as usual
        push([1, 7, 3, 0, 8], "u")  # the next pass starts the task again
        assert job.ps.version == 4
    finally:
        job.close()


def test_a_push_overlapping_the_records_a_task_applied_is_refused_whole(dataset):
    """A push of [8, 24) after [0, 16) was applied holds records applied already and
    others not: its gradient is one sum, so it is refused (StalePush, naming both)."""
    from pdps.core.errors import StalePush

    job, push = _pusher(dataset)
    try:
        push([0, 7, 1, 0, 16])
        with pytest.raises(StalePush, match=r"records \[8, 24\) of task 7.*\[0, 16\)"):
            push([0, 7, 2, 8, 24], "u")
        assert job.ps.version == 1 and sorted(map(tuple, job.ps.applied())) == [(7, 1, 0, 16)]
        push([0, 7, 2, 16, 24], "u")
        assert job.ps.version == 2
    finally:
        job.close()


def test_a_pserver_remembers_the_records_of_its_newest_tasks_only(dataset, monkeypatch):
    """The marks are bounded (an endless stream has endless task ids): the oldest task's
    is forgotten first, and a push of its records is then taken for a new one."""
    from pdps.roles import pserver

    monkeypatch.setattr(pserver, "MARKED_TASKS", 2)
    job, push = _pusher(dataset)
    try:
        for task in (1, 2, 3):
            push([0, task, 1, 0, 8])
        assert push([0, 3, 1, 0, 8]).meta.get("duplicate") is True  # still known
        assert push([0, 2, 1, 0, 8]).meta.get("duplicate") is True
        assert job.ps.version == 3
        assert not push([0, 1, 1, 0, 8]).meta.get("duplicate")  # forgotten
        assert job.ps.version == 4
    finally:
        job.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_whose_attempt_lost_its_race_drops_the_task_and_gives_it_back(dataset, mode):
    """Speculation (issue 18): a backup attempt of the trainer's task committed the
    records after the trainer's first step. The trainer's next step of its attempt is
    refused (in sync it applies nothing), and the trainer gives the task back at once:
    no finish, no wait for the task to time out, no third batch read; then it trains on."""
    from pdps.adapters.parquet import ParquetSource
    from pdps.core.job import Keys
    from pdps.core.progress import TaskProgress
    from tests.integration.jobkit import start_job

    job = start_job(ParquetSource(dataset), mode=mode, pservers=1, batch_size=BATCH, task_timeout=5.0)
    try:
        ctx = job.trainer("t")
        model = ctx.attach(make_model())
        raced = None  # (task, attempt) that lost
        read: Counter = Counter()  # batches read per (task, attempt)
        for batch in ctx.batches():
            read[batch.task.id, batch.attempt] += 1
            ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
            if raced is None:
                raced = (batch.task.id, batch.attempt)
                key = Keys(job.config.name).task_progress(batch.task.id)
                progress = TaskProgress.decode(job.store.get(key).value, key)
                end = batch.start + batch.size
                won = progress.open_race(batch.attempt, batch.attempt + 1).advance(batch.attempt + 1, end, end + BATCH)
                job.store.put(key, won.encode())
        assert read[raced] == 2  # the step after the race was refused; nothing more was read
        assert [(s.start, s.end) for s in ctx.history if (s.task, s.attempt) == raced] == [(0, BATCH)]
        audit = pass_audit(job.store, job.config.name, 0)
        attempts = next(e["attempts"] for e in audit["entries"] if e["task"] == raced[0])
        assert [a["outcome"] for a in attempts if a["attempt"] == raced[1]] == ["given_back"]
        assert audit["summary"]["done"] == ROWS // ROW_GROUP
    finally:
        job.close()
