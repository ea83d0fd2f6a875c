"""Admission and eviction through a job, counted: what the table's settings say, what
``pdps status`` shows (``tables``), and bad input refused with nothing changed."""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import pdps
import pdps.nn
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core import rowpolicy
from pdps.shell.status import format_status, job_status

B = 6  # ids per batch (one bag of one id each)
STEPS = 30


def scripted(root: str) -> tuple[ParquetSource, list[np.ndarray]]:
    """One task of STEPS batches: a few hot ids in most batches, many cold ones once or twice."""
    rng = np.random.default_rng(2)
    hot = np.array([10, 11, 12])
    batches = []
    for s in range(STEPS):
        cold = rng.integers(100, 140, size=B - 2)
        batches.append(np.concatenate([rng.choice(hot, size=2), cold]))
    ids = np.concatenate(batches).astype(np.int64)[:, None]
    write_parquet_shards({"ids": ids, "y": np.ones(len(ids), dtype=np.float32)}, f"{root}/s", shards=1, row_group_size=len(ids))
    return ParquetSource(f"{root}/s"), batches


def job(source: ParquetSource, store, **options):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = pdps.nn.HashEmbedding(4, mode="sum", **options)
            self.out = nn.Linear(4, 1)

        def forward(self, ids):
            return self.out(self.emb(ids)).squeeze(-1)

    def train(ctx: pdps.TrainerContext) -> None:
        torch.manual_seed(0)
        model = ctx.attach(M())
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["ids"]), batch["y"]))

    return pdps.simulate(train, dataset=source, store=store, name="pol", trainers=1, pservers=1, mode="sync", batch_size=B,
                         optimizer="SGD", optimizer_args={"lr": 0.1}, num_slots=8)  # fmt: skip


def reference(batches, *, admit_after=1, ttl_steps=0, capacity=0, floor=0):
    """The table's rows after the scripted steps, by the policy's definitions: a touch
    is a step whose batch holds the id; the c-th touch creates the row; a sweep each
    step evicts rows not updated for ttl_steps; past capacity the least updated go."""
    rows: dict[int, list[int]] = {}  # id -> [updates, last step]
    pending: dict[int, int] = {}
    counts = dict.fromkeys(("created", "evicted_ttl", "evicted_lfu"), 0)
    for step, batch in enumerate(batches, 1):
        for i in map(int, np.unique(batch)):
            if i in rows:
                rows[i][0] += 1
                rows[i][1] = step
                continue
            pending[i] = pending.get(i, 0) + 1
            if pending[i] >= admit_after:
                del pending[i]
                rows[i] = [1, step]
                counts["created"] += 1
        if ttl_steps and step % max(1, ttl_steps // 8) == 0:
            for i in [i for i, (_, last) in rows.items() if step - last >= ttl_steps]:
                del rows[i]
                counts["evicted_ttl"] += 1
        if capacity and len(rows) > capacity:
            ids = np.array(sorted(rows), dtype=np.int64)
            gone = rowpolicy.lfu_victims(np.array([rows[i][0] for i in ids]), ids, capacity, floor,
                                         protect=np.array([rows[i][1] == step for i in ids]))  # fmt: skip
            for i in ids[gone]:
                del rows[int(i)]
            counts["evicted_lfu"] += len(gone)
    return sorted(rows), len(pending), counts


def test_admission_and_ttl_do_what_their_settings_say(tmp_path):
    source, batches = scripted(tmp_path.as_uri())
    store = pdps.open_store("memory://policies-ttl")
    result = job(source, store, admit_after=3, ttl_steps=4)
    want_rows, want_pending, counts = reference(batches, admit_after=3, ttl_steps=4)
    rows = result.params["emb.weight"]
    assert rows.ids.tolist() == want_rows
    assert 0 < counts["evicted_ttl"] and 0 < want_pending  # the script exercises both
    table = job_status(store, "pol")["tables"][0]
    assert table["name"] == "emb.weight" and table["rows_bound"] is None and table["dim"] == 4
    assert (table["rows"], table["created"], table["admitted"], table["pending"], table["evicted_ttl"], table["evicted_lfu"]) == (
        len(want_rows), counts["created"], counts["created"], want_pending, counts["evicted_ttl"], 0,
    )
    assert table["bytes"] > 0 and list(table["per_pserver"]) == ["0"]
    text = format_status(job_status(store, "pol"), "memory://policies-ttl")
    assert f"table       emb.weight (dim 4 float32): {len(want_rows)} rows" in text
    json.dumps(job_status(store, "pol"))  # the --json form


def test_lfu_capacity_keeps_the_most_updated_rows_down_to_the_floor(tmp_path):
    source, batches = scripted(tmp_path.as_uri())
    store = pdps.open_store("memory://policies-lfu")
    result = job(source, store, capacity=16, floor=8)
    want_rows, _, counts = reference(batches, capacity=16, floor=8)
    rows = result.params["emb.weight"]
    assert rows.ids.tolist() == want_rows and len(want_rows) <= 16
    assert {10, 11, 12} <= set(want_rows)  # the hot ids stay
    table = job_status(store, "pol")["tables"][0]
    assert (table["created"], table["evicted_lfu"], table["evicted_ttl"]) == (counts["created"], counts["evicted_lfu"], 0)
    assert counts["evicted_lfu"] > 0
