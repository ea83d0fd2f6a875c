"""Sparse tables with shard replicas: every pserver holds the rows of each slot it
holds a copy of, a primary forwards each backup the rows of its slots, and a
pserver's death promotes backups holding every row and its optimizer state, with no
rollback (design/sparse-embeddings.md §5).

In process (memory store, inproc transport), 3 pservers, 2 copies of each slot, a
5,000-row float64 table: what is proven is that the copies stay equal and that a
crash changes nothing trained, not speed.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
import pdps.nn
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.errors import TransportError
from pdps.core.job import Keys
from pdps.core.tables import parse_row_entry
from pdps.registry import open_checkpoint_files
from pdps.runtime import recovery
from pdps.runtime.resizing import read_map
from tests.integration.jobkit import start_job
from tests.integration.test_replicas import replace_and_replenish
from tests.integration.test_transactional_sync import closed_rounds

ROWS = 5000
DIM = 8
BAG = 4
B = 8  # batch per trainer
STEPS = 40  # steps per trainer: one task of STEPS * B samples each
TABLE = "emb.weight"


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, dtype=torch.float64, device="meta")
        g = torch.Generator().manual_seed(7)  # not the global RNG: trainers build models on threads
        self.mlp = nn.Sequential(nn.Linear(DIM, 4), nn.Tanh(), nn.Linear(4, 1)).to(torch.float64)
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.uniform_(-0.5, 0.5, generator=g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(-1)


@pytest.fixture
def clicks(tmp_path) -> ParquetSource:
    """Two tasks (row groups) of STEPS * B samples: BAG Zipf-drawn ids in [0, ROWS), so
    the trainers' batches share ids and every pserver's slots get rows."""
    rng = np.random.default_rng(11)
    n = 2 * STEPS * B
    ids = (rng.zipf(1.3, size=(n, BAG)) - 1) % ROWS
    write_parquet_shards({"ids": ids.astype(np.int64), "y": rng.normal(size=n)}, f"{tmp_path.as_uri()}/clicks", shards=1, row_group_size=STEPS * B)
    return ParquetSource(f"{tmp_path.as_uri()}/clicks")


def die_after_forwarding(ps) -> None:
    """Make ``ps`` die (as a killed process) in the middle of its next sync push: once
    its backups have staged the push's rows, before the trainer is answered, which then
    pushes again by the map without it (the rows its backups staged from the forward
    must not count twice)."""
    forward = ps._forward

    def forward_then_die(forwards) -> None:
        forward(forwards)
        ps.crash()
        raise TransportError(f"pserver {ps.index} was killed before it answered")

    ps._forward = forward_then_die


def train(job, *, crash: int | None = None, after: int = 0, delay: float = 0.0, mid_push: bool = False) -> None:
    """Two trainers on threads through the whole job (``delay`` seconds between steps);
    with ``crash``, that pserver dies (as a killed process) once ``after`` steps are
    done (``mid_push``: in its next push, once forwarded); the test waits for the master
    to fail it over, then starts a replacement at its index and waits for every slot to
    have its two copies again, while training goes on."""
    lock = threading.Lock()
    steps = [0]
    errors: list[BaseException] = []
    contexts = [job.trainer(f"t{i}") for i in range(2)]
    for ctx in contexts:
        ctx.patience = 15.0
        ctx.register()

    def run(ctx) -> None:
        try:
            model = ctx.attach(Model())
            for batch in ctx.batches():
                ctx.step(F.mse_loss(model(batch["ids"]), batch["y"]))
                with lock:
                    steps[0] += 1
                time.sleep(delay)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(ctx,), daemon=True) for ctx in contexts]
    for th in threads:
        th.start()
    if crash is not None:
        deadline = time.monotonic() + 30
        while steps[0] < after:
            assert not errors, errors
            assert time.monotonic() < deadline, f"no {after} steps in 30s"
            time.sleep(0.005)
        if mid_push:
            die_after_forwarding(job.pservers[crash])
        else:
            job.pservers[crash].crash()
        keys = Keys(job.config.name)
        while read_map(job.store, keys).held_by(crash):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.01)
        replace_and_replenish(job, crash, deadline)
        assert read_map(job.store, keys).held_by(crash)  # the replacement holds copies again, their rows copied to it
        assert steps[0] < 2 * STEPS - 4, "the job ended before its copies were made again: nothing was trained after"
    for th in threads:
        th.join(timeout=60)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    assert steps[0] == 2 * STEPS


def copies(job) -> dict[int, dict[int, dict[str, torch.Tensor]]]:
    """slot -> pserver -> the entries of that pserver's copy of the slot's rows, for every
    copy the live map names (each pserver's export, read under its lock)."""
    live = read_map(job.store, Keys(job.config.name))
    out: dict[int, dict[int, dict[str, torch.Tensor]]] = {}
    for ps in job.pservers:
        if ps.state.name == "CRASHED":
            continue
        with ps._cond:
            rows = ps._tables[TABLE]
            for slot in live.held_by(ps.index):
                entries, more = rows.export_slots([slot])
                assert not more
                out.setdefault(slot, {})[ps.index] = {k: v for k, v in entries.items() if parse_row_entry(k) is not None}
    return out


def assert_copies_agree(job) -> dict[int, dict[str, torch.Tensor]]:
    """Every copy of every slot holds the same rows and optimizer state, bit for bit;
    the primaries' copies, by slot."""
    live = read_map(job.store, Keys(job.config.name))
    held = copies(job)
    assert sorted(held) == list(range(live.num_slots))
    primaries = {}
    for slot, by_ps in held.items():
        assert sorted(by_ps) == sorted(live.holders(slot)), (slot, sorted(by_ps), live.holders(slot))
        first = by_ps[live.owners[slot]]
        for ps, entries in by_ps.items():
            assert entries.keys() == first.keys(), (slot, ps)
            for k, v in entries.items():
                assert torch.equal(v, first[k]), f"slot {slot}: {k} on pserver {ps} differs from its primary's"
        primaries[slot] = first
    return primaries


def trained_rounds(job) -> int:
    """The rounds closed up to the last that applied samples (the round after it): a
    trainer that asks for a task while the other still trains its last batch contributes
    zero samples to one more round, or not, by timing (an empty round applies nothing)."""
    rounds = closed_rounds(job.store, job.config.name)
    trained = [r.round_no for _, r in rounds if any(c.samples for c in r.contributions.values())]
    assert trained == list(range(trained[0], trained[-1] + 1)), f"an empty round between trained ones: {trained}"
    return trained[-1] + 1


def last_checkpoint_rows(job, rounds: int) -> dict[str, torch.Tensor]:
    """The row entries of the job's checkpoint after its last round (``rounds`` closed),
    from every part, each entry found in one part only (a slot's rows are written by its
    primary alone)."""
    keys = Keys(job.config.name)
    deadline = time.monotonic() + 10
    while (pointer := recovery.read_pointer(job.store, keys)[0]) is None or pointer.round < rounds:
        assert time.monotonic() < deadline, f"no checkpoint after round {rounds - 1} committed"
        time.sleep(0.02)
    files = open_checkpoint_files(job.config.checkpoint_url)
    out: dict[str, torch.Tensor] = {}
    for name, part in files.read_manifest(pointer.id).parts.items():
        if not name.startswith("ps-"):
            continue  # the master's part: progress, no tensors
        for k, v in files.read_part(part).items():
            if parse_row_entry(k) is not None:
                assert k not in out, f"{k} is in two parts of checkpoint {pointer.id}"
                out[k] = v
    return out


def settings(mode: str, name: str) -> dict:
    return dict(
        name=name, mode=mode, pservers=3, replicas=2, num_slots=12, lease_ttl=1.0, batch_size=B, passes=1, task_timeout=60.0,
        optimizer="Adam", optimizer_args={"lr": 0.01},  # SparseAdam on the rows: its bias correction reads the table step
    )


def test_sync_a_crashed_pserver_costs_nothing_every_row_and_its_state_as_an_uncrashed_twin(clicks, tmp_path):
    """Sync: pserver 1 dies mid-job, in the middle of a push (its backups staged the
    push's rows, the trainer was not answered and pushes again by the new map); its
    backups take its slots over with every row and its SparseAdam state, nothing rolls
    back, a replacement gets copies again (rows paged to it) while training goes on, and
    the job ends with the rows, their state and the dense parameters of a twin run
    nobody crashed (float64, 1e-10); every copy of each slot equals its primary's, bit
    for bit, in both runs; the checkpoint of the last round holds each slot's rows once
    (its primary's part), as the copies hold them."""
    twin = start_job(clicks, **settings("sync", "sparse-replicas-twin"))
    try:
        train(twin)
        want_rows = assert_copies_agree(twin)
        rounds = trained_rounds(twin)  # the rounds up to the last that trained
        want = pdps.fetch_parameters(twin.store, twin.transport, twin.config)
    finally:
        twin.close()
    # one checkpoint, after the last round: it holds every slot's rows once, as the copies end
    job = start_job(clicks, **settings("sync", "sparse-replicas-crash"), checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=rounds)
    try:
        train(job, crash=1, after=8, delay=0.03, mid_push=True)
        assert all(ps.epoch == 0 and ps.rollbacks == 0 for ps in job.pservers)  # no rollback
        assert all(ctx.rollbacks == 0 for ctx in job.trainers)
        got_rows = assert_copies_agree(job)
        got = pdps.fetch_parameters(job.store, job.transport, job.config)
        assert trained_rounds(job) == rounds  # as many trained rounds as the twin: none trained again
        saved = last_checkpoint_rows(job, rounds)
    finally:
        job.close()
    assert saved.keys() == {k for entries in got_rows.values() for k in entries}
    assert all(torch.equal(saved[k], v) for entries in got_rows.values() for k, v in entries.items())
    assert sorted(got_rows) == sorted(want_rows)
    compared = 0
    for slot, entries in got_rows.items():
        assert entries.keys() == want_rows[slot].keys(), slot
        for k, v in entries.items():
            torch.testing.assert_close(v, want_rows[slot][k], rtol=0, atol=1e-10, msg=lambda m, k=k: f"{k}: {m}")
            compared += "state." in k
    assert compared >= 12  # exp_avg and exp_avg_sq of every slot with rows
    rows, want_table = got[TABLE], want[TABLE]
    assert torch.equal(rows.ids, want_table.ids) and len(rows.ids) > 100
    every = torch.arange(ROWS)
    torch.testing.assert_close(rows.lookup(every), want_table.lookup(every), rtol=0, atol=1e-10)
    assert not torch.equal(rows.values, pdps.nn.init_rows(rows.spec, rows.ids))  # it trained
    for name in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"):
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


def test_async_a_crashed_pserver_costs_no_rollback_and_the_copies_stay_equal(clicks):
    """Async: a primary applies each push's rows at once and forwards each backup its
    share, with the table step it applied them at, in its order; pserver 1 dies
    mid-job, its backups take over (no rollback), and the job ends with every copy of
    each slot equal to its primary's, SparseAdam state included."""
    job = start_job(clicks, **settings("async", "sparse-replicas-async"))
    try:
        train(job, crash=1, after=8, delay=0.03)
        assert all(ps.epoch == 0 and ps.rollbacks == 0 for ps in job.pservers)
        assert all(ctx.rollbacks == 0 for ctx in job.trainers)
        primaries = assert_copies_agree(job)
        assert sum(len(e) for e in primaries.values()) > 0
        rows = pdps.fetch_parameters(job.store, job.transport, job.config)[TABLE]
        assert len(rows.ids) > 100 and not torch.equal(rows.values, pdps.nn.init_rows(rows.spec, rows.ids))
    finally:
        job.close()


def test_a_small_model_killed_pserver_under_simulate_changes_nothing(tmp_path):
    """The docs' promise as a user checks it: ``pdps.simulate`` with ``Faults(pservers=1)``
    against the same job without, a ``HashEmbedding`` and a Linear of 2 blocks on 3
    pservers, Adagrad (its state must be promoted too): equal results, bit for bit. With
    fewer blocks than pservers, a failover map that placed blocks by its own primaries
    moved one to a pserver that had no copy of it (tests/unit/test_slot_replicas.py)."""
    rng = np.random.default_rng(0)
    write_parquet_shards(
        {"ids": rng.integers(0, 200, size=(256, 3)), "y": rng.normal(size=256).astype(np.float32)}, f"{tmp_path.as_uri()}/d", shards=1, row_group_size=32
    )

    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = pdps.nn.HashEmbedding(4, mode="sum")
            self.out = nn.Linear(4, 1)
            with torch.no_grad():
                for p in self.out.parameters():
                    p.uniform_(-0.3, 0.3, generator=torch.Generator().manual_seed(0))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.emb(ids)).squeeze(-1)

    def fit(ctx) -> None:
        model = ctx.attach(Small())
        for b in ctx.batches():
            ctx.step(F.mse_loss(model(b["ids"]), b["y"]))

    job = dict(dataset=f"{tmp_path.as_uri()}/d", trainers=1, pservers=3, replicas=2, batch_size=16, optimizer="Adagrad", optimizer_args={"lr": 0.1})
    clean = pdps.simulate(fit, **job)
    faulty = pdps.simulate(fit, faults=pdps.Faults(pservers=1, seed=1), timeout=120, **job)
    (fault,) = faulty.faults
    assert 0 < fault.done < 8  # killed mid-pass (its seeded moment: 20-80% of the 8 tasks done)
    assert (faulty.steps, faulty.tasks_done) == (clean.steps, clean.tasks_done)
    want, got = clean.params["emb.weight"], faulty.params["emb.weight"]
    assert torch.equal(got.ids, want.ids) and len(got.ids) > 100 and torch.equal(got.values, want.values)
    for name in ("out.weight", "out.bias"):
        assert torch.equal(faulty.params[name], clean.params[name]), name
