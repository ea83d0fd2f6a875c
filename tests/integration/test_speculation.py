"""Speculative execution (docs/online.md): a backup attempt races a straggler's task from
the record its progress had reached; the first to commit a range of records wins, so
each record is still trained exactly once, in sync and async, on a stream too."""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pdps
from pdps import streams
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.speculation import MAX_BACKUPS
from pdps.shell.status import pass_audit, window_audit

pytestmark = pytest.mark.integration


def train(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(torch.nn.Linear(3, 1).double())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
        time.sleep(0.002)  # a step worth slowing down: the straggler's sleeps are 9 of these


def columns(rows: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(rows, 3)), "y": rng.normal(size=rows)}


def exactly_once(summary: dict, records: int) -> None:
    assert summary["failed"] == 0 and summary["records_trained_exactly_once"] == records == summary["records_trained"], summary


def outcomes(audit: dict) -> list[tuple[str, str]]:
    return [(a["trainer"], a["outcome"]) for e in audit["entries"] for a in e["attempts"]]


def test_an_async_job_with_a_10x_straggler_finishes_sooner_with_speculation_and_trains_each_record_once(tmp_path):
    url = (tmp_path / "d").as_uri()
    write_parquet_shards(columns(960, 1), url, shards=1, row_group_size=120)  # 8 tasks of 15 steps
    seconds, audits = {}, {}
    for on in (False, True):
        store = MemoryStore()
        began = time.monotonic()
        result = pdps.simulate(
            train, dataset=url, store=store, trainers=3, pservers=1, mode="async", batch_size=8, slow={0: 10},
            speculation=on, speculation_min_finished=2, timeout=120,
        )  # fmt: skip
        seconds[on] = time.monotonic() - began
        audits[on] = pass_audit(store, result.config.name, 0)
        exactly_once(audits[on]["summary"], 960)
    assert ("trainer-0", "beaten") in outcomes(audits[True])  # the straggler lost its task to a backup ...
    assert not any(o == "beaten" for _, o in outcomes(audits[False]))
    assert seconds[True] < seconds[False], seconds  # ... and the job ended sooner for it


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_backup_that_loses_its_race_trains_nothing_and_the_task_is_not_raced_again(tmp_path, mode):
    """One task 16 times as long as the others, and a multiplier so low that it counts as
    a straggler: idle trainers race it from where the primary stood. Neither is slow, so
    either may win each race; a primary that keeps winning is raced MAX_BACKUPS times at
    most, and the records are trained once whoever wins."""
    root = tmp_path / "d"
    root.mkdir()
    for name, rows, group in (("part-0", 320, 320), ("part-1", 320, 20)):
        write_parquet_shards(columns(rows, len(name)), (tmp_path / name).as_uri(), shards=1, row_group_size=group)
        os.rename(tmp_path / name / "part-00000.parquet", root / f"{name}.parquet")
    store = MemoryStore()
    result = pdps.simulate(
        train, dataset=root.as_uri(), store=store, trainers=3, pservers=1, mode=mode, batch_size=8, speculation=True,
        speculation_min_finished=2, speculation_multiplier=0.3, timeout=120,
    )  # fmt: skip
    audit = pass_audit(store, result.config.name, 0)
    exactly_once(audit["summary"], 640)
    attempts = audit["entries"][0]["attempts"]
    assert 2 <= len(attempts) <= 1 + MAX_BACKUPS and [a["outcome"] for a in attempts].count("done") == 1, attempts
    for a in attempts[1:]:
        assert a["offset"] > 0  # each backup began where the task stood
    assert {a["outcome"] for a in attempts[:-1]} <= {"beaten", "done"}, attempts


def test_speculation_on_a_stream_keeps_every_window_exactly_once():
    url = f"memory-stream://spec-{uuid.uuid4().hex[:8]}"
    streams.append(url, columns(720, 4))
    store = MemoryStore()
    result = pdps.simulate(
        train, dataset=url, store=store, trainers=3, pservers=1, mode="async", batch_size=8, slow={1: 10},
        window_records=240, windows=3, task_records=40, speculation=True, speculation_min_finished=3, timeout=120,
    )  # fmt: skip
    for w in range(3):
        a = window_audit(store, result.config.name, w)
        assert a["state"] == "closed"
        exactly_once(a["summary"], 240)
