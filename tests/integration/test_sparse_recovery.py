"""Sparse tables survive checkpoints, rollbacks and resizes (issue 19): every row keeps
its values and its row rule's state.

* A checkpoint of 2 pservers restores onto 3 through :func:`pdps.runtime.recovery.load_shard`,
  each pserver reading only the row entries of its own slots.
* A sync job with a table and Adagrad, a pserver crashed mid-job: the job rolls back to
  its checkpoint, finishes, and every row and its Adagrad state equal single-process
  torch over the rounds the job kept (its history); so do the checkpoints it wrote.
* A sync job resized 2 -> 3 -> 2 while it trains: the same, rows migrating pserver to
  pserver in pages; and an async one of one trainer, against torch over its steps.

Small sizes (a 2,000-row table, dim 8, float64): what is proven is exact arithmetic.
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
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.adapters.torch_compute import TorchShard
from pdps.adapters.torch_rows import TorchRows
from pdps.core.checkpoints import Manifest
from pdps.core.job import Keys
from pdps.core.slots import Layout, ParamSpec, SlotMap
from pdps.core.tables import TableSpec, parse_row_entry, row_slots
from pdps.ports.data import read_whole
from pdps.registry import open_checkpoint_files
from pdps.roles import pserver as pserver_module
from pdps.roles.pserver import Pserver
from pdps.runtime import recovery
from pdps.runtime.recovery import new_checkpoint_id
from pdps.runtime.resizing import read_map
from tests.integration.jobkit import start_job
from tests.integration.test_elastic import resize
from tests.integration.test_recovery import wait_until
from tests.integration.test_transactional_sync import closed_rounds

SLOTS = 16


# --- a checkpoint of 2 pservers restored onto 3 ------------------------------------------


def rows_of(stores: list[TorchRows]) -> dict[str, np.ndarray]:
    """Every entry of every slot the stores hold, as numpy (the steps left out)."""
    out: dict[str, np.ndarray] = {}
    for r in stores:
        out.update((k, v.numpy().copy()) for k, v in r.export_slots(r.slots)[0].items() if parse_row_entry(k) is not None)
    return out


def test_a_checkpoint_of_two_pservers_restores_onto_three_each_reading_its_own_slots(tmp_path):
    spec = TableSpec(name="emb", dim=4, dtype="float64", num_rows=5000, admit_after=2, capacity=1500, ttl_steps=50)
    dense = [ParamSpec("w", (8, 4), "float64")]
    adagrad = {"lr": 0.1, "lr_decay": 0.01}
    rng = np.random.default_rng(3)

    def stores(pservers: int) -> list[tuple[TorchShard, TorchRows]]:
        smap = SlotMap.initial(pservers, SLOTS)
        layout = Layout.build(dense, smap, 1)
        return [
            (TorchShard(layout.blocks_of(i), "Adagrad", adagrad), TorchRows(spec, "Adagrad", adagrad, smap.held_by(i), SLOTS, chunk_rows=64))
            for i in range(pservers)
        ]

    # two pservers train: every section to each, split by the slots they hold (so both tables step alike)
    two = stores(2)
    for shard, _ in two:
        shard.initialize([torch.from_numpy(rng.standard_normal(b.shape)) for b in shard.blocks], "t")
    for _ in range(12):
        ids = np.unique(rng.integers(0, spec.num_rows, 400))
        grads = torch.from_numpy(rng.standard_normal((len(ids), spec.dim)))
        owner = row_slots("emb", ids, SLOTS) % 2
        for i, (shard, rows) in enumerate(two):
            shard.apply([torch.from_numpy(rng.standard_normal(b.shape)) for b in shard.blocks])
            rows.apply(torch.from_numpy(ids[owner == i]), grads[owner == i])
    want = rows_of([r for _, r in two])
    assert {parse_row_entry(k)[2] for k in want} >= {"ids", "values", "state.sum", "count", "last_age", "pending_ids", "pending_counts"}

    files = open_checkpoint_files(f"{tmp_path.as_uri()}/ckpt")
    ckpt = new_checkpoint_id(0, 12)
    parts = {}
    for i, (shard, rows) in enumerate(two):
        state = shard.snapshot({recovery.VERSION: 12 + i}) | rows.snapshot(rows.slots)
        part = recovery.write_shard_part(files, ckpt, i, state)
        parts[part.name] = part
    files.write_manifest(Manifest(id=ckpt, job="j", round=12, epoch=0, created=time.time(), parts=parts))
    config = pdps.JobConfig(name="j", dataset="file:///d", pservers=3, num_slots=SLOTS, min_block=1, optimizer="Adagrad", optimizer_args=adagrad)

    three = stores(3)
    for i, (shard, rows) in enumerate(three):
        assert recovery.load_shard(MemoryStore(), files, config, ckpt, shard, {"emb": rows}) == 13
        # only its own slots were taken (a row entry of another slot would have made the store hold that slot)
        assert rows.slots == frozenset(SlotMap.initial(3, SLOTS).held_by(i))
        assert rows.step == 12
    got = rows_of([r for _, r in three])
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        assert got[key].dtype == t.dtype and np.array_equal(got[key], t), key
    assert sum(r.stats()["rows"] for _, r in three) == sum(r.stats()["rows"] for _, r in two)
    assert sum(r.stats()["pending"] for _, r in three) == sum(r.stats()["pending"] for _, r in two)
    whole = {k: v for shard, _ in two for k, v in shard.export_blocks().items()}
    for shard, _ in three:
        for key, t in shard.export_blocks().items():
            assert torch.equal(t, whole[key]), key
    # a checkpoint with no rows (or rows of no table here) leaves the tables empty
    fresh = stores(3)[0]
    bare = new_checkpoint_id(0, 13)
    parts = {p.name: p for p in (recovery.write_shard_part(files, bare, i, shard.snapshot({recovery.VERSION: 1})) for i, (shard, _) in enumerate(two))}
    files.write_manifest(Manifest(id=bare, job="j", round=13, epoch=0, created=time.time(), parts=parts))
    one = pdps.JobConfig(name="j", dataset="file:///d", pservers=1, num_slots=SLOTS, min_block=1, optimizer="Adagrad", optimizer_args=adagrad)
    shard = TorchShard(Layout.build(dense, SlotMap.initial(1, SLOTS), 1).blocks_of(0), "Adagrad", adagrad)
    rows = fresh[1]
    recovery.load_shard(MemoryStore(), files, one, bare, shard, {"emb": rows})
    assert rows.stats()["rows"] == 0 and rows.step == 0 and shard.initialized


def test_the_rows_a_resize_moves_are_paged_within_the_budget_and_arrive_whole():
    """A slot's rows leave in pages of at most the budget (one row at least), across
    the tables of the slot in name order, the pending ids with the first page and every
    table's step with each; imported page by page they are the slot's rows."""
    rng = np.random.default_rng(5)
    specs = [TableSpec(name="a", dim=4, dtype="float64", admit_after=2), TableSpec(name="b", dim=2, dtype="float32")]
    tables = {spec.name: TorchRows(spec, "Adagrad", {"lr": 0.1}, range(SLOTS), SLOTS, chunk_rows=64) for spec in specs}
    for _ in range(4):
        for spec in specs:
            ids = np.unique(rng.integers(0, 3000, 300))
            tables[spec.name].apply(torch.from_numpy(ids), torch.from_numpy(rng.standard_normal((len(ids), spec.dim))).to(getattr(torch, spec.dtype)))
    leaving = pserver_module._LeavingRows.of(tables, [3, 9])
    budget = 500  # a: 8 + 32 + 32 bytes a row, b: 8 + 8 + 8
    for slot in (3, 9):
        fresh = {spec.name: TorchRows(spec, "Adagrad", {"lr": 0.1}, [], SLOTS, chunk_rows=64) for spec in specs}
        offset, more, pages = 0, True, 0
        while more:
            names, tensors, more = leaving.page(slot, offset, budget)
            page = dict(zip(names, tensors))
            assert {"a/scalar.step", "b/scalar.step"} <= set(page)
            pending = [k for k in page if "/pending_" in k]
            assert bool(pending) == (offset == 0)
            rows = sum(len(t) for k, t in page.items() if k.endswith("/ids") and "pending" not in k)
            assert 1 <= rows and (rows == 1 or sum(t.nbytes for k, t in page.items() if k not in pending and "scalar" not in k) <= budget - sum(page[k].nbytes for k in pending))
            for r in fresh.values():
                r.import_slots(page)
            offset += rows
            pages += 1
        assert pages > 3
        for name, r in fresh.items():
            assert r.step == tables[name].step and r.slots == {slot}
            got, want = r.export_slots([slot])[0], tables[name].export_slots([slot])[0]
            assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want), name


# --- jobs: a table and Adagrad, against single-process torch over the rounds kept ------------

ROWS, DIM, BAG = 2000, 8, 3
B = 8  # batch per trainer
ADAGRAD = {"lr": 0.05, "lr_decay": 0.01}
TABLE = "emb.weight"


class Model(nn.Module):
    """An embedding bag over BAG ids per sample, then an MLP."""

    def __init__(self, table: nn.Module) -> None:
        super().__init__()
        self.emb = table
        g = torch.Generator().manual_seed(7)  # not the global RNG: trainers build models on threads
        self.mlp = nn.Sequential(nn.Linear(DIM, 4), nn.Tanh(), nn.Linear(4, 1)).double()
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.uniform_(-0.5, 0.5, generator=g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(-1)


def bag(device: str = "meta") -> nn.Module:
    return nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, dtype=torch.float64, device=device)


def clicks(root: str, tasks: int, rows: int) -> ParquetSource:
    """``tasks`` tasks (one file each) of ``rows`` samples of BAG Zipf-drawn ids, so
    the trainers' batches share ids (their gradients must be summed per id)."""
    import fsspec

    rng = np.random.default_rng(11)
    fs, base = fsspec.core.url_to_fs(f"{root}/all")
    fs.makedirs(base, exist_ok=True)
    for i in range(tasks):
        ids = (rng.zipf(1.3, size=(rows, BAG)) - 1) % ROWS
        write_parquet_shards({"ids": ids.astype(np.int64), "y": rng.normal(size=rows)}, f"{root}/t{i}", shards=1, row_group_size=rows)
        src_fs, src = fsspec.core.url_to_fs(f"{root}/t{i}/part-00000.parquet")
        fs.pipe_file(f"{base}/part-{i:05d}.parquet", src_fs.cat_file(src))
    return ParquetSource(f"{root}/all")


def train_on_threads(job, trainers: int, *, during=None, pause: float = 0.0) -> None:
    """Train ``trainers`` trainers of ``job`` on threads to the job's end; ``during(steps)``
    runs on this thread meanwhile (``steps()``: the steps done so far). Until it returns,
    each step sleeps ``pause`` seconds (so the job outlasts what it does). Raises what a
    trainer raised."""
    errors: list[BaseException] = []
    hurry = threading.Event()
    steps = [0]
    lock = threading.Lock()
    ctxs = [job.trainer(f"t{i}") for i in range(trainers)]
    for c in ctxs:
        c.register()

    def train(ctx) -> None:
        try:
            model = ctx.attach(Model(bag()))
            for batch in ctx.batches():
                ctx.step(F.mse_loss(model(batch["ids"]), batch["y"]))
                with lock:
                    steps[0] += 1
                if not hurry.is_set():
                    time.sleep(pause)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            ctx.leave()

    threads = [threading.Thread(target=train, args=(c,), daemon=True) for c in ctxs]
    for t in threads:
        t.start()
    try:
        if during is not None:
            during(lambda: steps[0])
    finally:
        hurry.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def kept_rounds(trainers, starts: dict[int, int]) -> list[list[tuple[str, object]]]:
    """The rounds whose gradients are in the parameters, in order, each its contributions
    ``(trainer, StepRecord)`` sorted by trainer: the rounds of each epoch before the
    round the next epoch started from (``starts``: epoch -> its first round)."""
    rounds: dict[tuple[int, int], list[tuple[str, object]]] = {}
    for ctx in trainers:
        for s in ctx.history:
            nxt = starts.get(s.epoch + 1)
            if nxt is None or s.round < nxt:
                rounds.setdefault((s.epoch, s.round), []).append((ctx.trainer_id, s))
    return [sorted(rounds[k], key=lambda ts: ts[0]) for k in sorted(rounds)]


class Replay:
    """Single-process torch, ``sparse=True`` and Adagrad, stepped once per kept round by
    the sample-weighted sum of its contributions' losses (what a sync round applies)."""

    def __init__(self, source: ParquetSource, dense: tuple[str, dict]) -> None:
        self.source = source
        self.tasks = {t.id: t for t in source.tasks()}
        self.table = bag("cpu")
        self.spec = pdps.nn.tables_of(Model(bag()))[0][2]
        with torch.no_grad():
            self.table.weight.copy_(pdps.nn.init_rows(self.spec, torch.arange(ROWS)))
        self.model = Model(self.table)
        self.dense = getattr(torch.optim, dense[0])(self.model.mlp.parameters(), **dense[1])
        self.rows = torch.optim.Adagrad([self.table.weight], **ADAGRAD)
        self.touched = torch.zeros(ROWS, dtype=torch.bool)
        self.round = -1  # the last round applied

    def apply(self, contributions) -> None:
        total = sum(s.samples for _, s in contributions)
        self.dense.zero_grad()
        self.rows.zero_grad()
        loss = 0
        for _, s in contributions:
            cols = read_whole(self.source, self.tasks[s.task])
            ids = torch.from_numpy(cols["ids"][s.start : s.end])
            y = torch.from_numpy(cols["y"][s.start : s.end])
            loss = loss + (s.samples / total) * F.mse_loss(self.model(ids), y)
            self.touched[ids.reshape(-1)] = True
        loss.backward()
        self.dense.step()
        self.rows.step()
        self.round = contributions[0][1].round

    def rows_now(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """ids touched so far, their rows and their Adagrad sums."""
        ids = torch.nonzero(self.touched).flatten()
        return ids, self.table.weight.detach()[ids].clone(), self.rows.state[self.table.weight]["sum"][ids].clone()


def table_in(entries: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A table's rows in entries (of checkpoint parts or stores): ids ascending, values, Adagrad sums."""
    got: dict[str, list[torch.Tensor]] = {"ids": [], "values": [], "state.sum": []}
    for key in sorted(entries):
        row = parse_row_entry(key)
        if row is not None and row[0] == TABLE and row[2] in got:
            got[row[2]].append(entries[key])
    ids = torch.cat(got["ids"]) if got["ids"] else torch.empty(0, dtype=torch.int64)
    order = torch.argsort(ids)
    # each slot's entries line up (sorted keys: the same slot order for every kind)
    return ids[order], torch.cat(got["values"])[order], torch.cat(got["state.sum"])[order]


def assert_rows_equal(got: tuple, want: tuple, what: str) -> None:
    ids, values, sums = got
    assert torch.equal(ids, want[0]), f"{what}: {len(ids)} rows, want {len(want[0])}"
    torch.testing.assert_close(values, want[1], rtol=0, atol=1e-10, msg=lambda m: f"{what}, rows: {m}")
    torch.testing.assert_close(sums, want[2], rtol=0, atol=1e-10, msg=lambda m: f"{what}, Adagrad sums: {m}")


def on_pservers(pservers) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    entries: dict[str, torch.Tensor] = {}
    for ps in pservers:
        rows = ps._tables[TABLE]
        assert rows.slots == frozenset(s for s, owner in enumerate(ps._slot_map.owners) if owner == ps.index)
        entries.update(rows.export_slots(rows.slots)[0])
    return table_in(entries)


def check_against_replay(job, source, starts: dict[int, int]) -> Replay:
    """Replay the kept rounds; every committed checkpoint (if the job takes them), and
    the pservers now, hold exactly the rows (and Adagrad sums) torch has after the
    rounds before them."""
    files = open_checkpoint_files(job.config.checkpoint_url)
    history = ()
    if files is not None:
        pointer = recovery.read_pointer(job.store, Keys(job.config.name))[0]
        assert pointer is not None
        history = pointer.history
    at_round: dict[int, list[str]] = {}
    for ckpt in history:
        at_round.setdefault(files.read_manifest(ckpt).round, []).append(ckpt)
    replay = Replay(source, (job.config.optimizer, job.config.optimizer_args))
    rounds = kept_rounds(job.trainers, starts)
    checked = 0

    def check_checkpoints(before: int | None) -> None:
        nonlocal checked
        for r in sorted(at_round):
            if r > replay.round and (before is None or r <= before):
                for ckpt in at_round.pop(r):
                    manifest = files.read_manifest(ckpt)
                    entries: dict[str, torch.Tensor] = {}
                    for name, part in manifest.parts.items():
                        if name.startswith("ps-"):
                            entries.update({k: v.clone() for k, v in files.read_part(part).items()})
                    assert int(entries[f"{TABLE}/scalar.step"]) == sum(1 for c in rounds if c[0][1].round < r)
                    assert_rows_equal(table_in(entries), replay.rows_now(), f"checkpoint {ckpt} (round {r})")
                    checked += 1

    for contributions in rounds:
        check_checkpoints(contributions[0][1].round)
        replay.apply(contributions)
    check_checkpoints(None)
    assert checked == len(history) >= (files is not None)
    assert_rows_equal(on_pservers(job.pservers), replay.rows_now(), "the pservers after the job")
    assert all(ps._tables[TABLE].step == len(rounds) for ps in job.pservers)
    fetched = pdps.fetch_parameters(job.store, job.transport, job.config)
    for name, p in replay.model.mlp.named_parameters():
        torch.testing.assert_close(fetched[f"mlp.{name}"], p.detach(), rtol=0, atol=1e-10, msg=lambda m, n=name: f"mlp.{n}: {m}")
    return replay


@pytest.mark.parametrize("checkpoints", [True, False], ids=["to-a-checkpoint", "from-scratch"])
def test_a_pserver_crashed_mid_job_rolls_back_and_every_row_keeps_its_adagrad_state(tmp_path, checkpoints):
    """Rolled back to a checkpoint, the rows and their Adagrad sums are the checkpoint's.
    From scratch (no checkpoint), the tables start empty again; the dense values start
    from a trainer's, whatever it holds then, so there the MLP is frozen (SGD, lr 0)
    for the replay to know them."""
    source = clicks(tmp_path.as_uri(), tasks=8, rows=4 * B)
    settings = {"checkpoint_url": f"{tmp_path.as_uri()}/ckpt", "checkpoint_every": 3, "optimizer": "Adagrad", "optimizer_args": ADAGRAD}
    if not checkpoints:
        settings = {"optimizer": "SGD", "optimizer_args": {"lr": 0.0}, "sparse_optimizer": "Adagrad", "sparse_optimizer_args": ADAGRAD}
    job = start_job(
        source, name="rows-rollback", mode="sync", trainers=2, pservers=2, num_slots=SLOTS, min_block=1, lease_ttl=1.0,
        batch_size=B, keep_rounds=100_000, **settings,
    )  # fmt: skip
    keys = Keys(job.config.name)

    def crash(steps) -> None:
        after = 0
        if checkpoints:
            wait_until(lambda: recovery.read_pointer(job.store, keys)[0] is not None, 60, "a committed checkpoint")
            after = recovery.read_pointer(job.store, keys)[0].round
        wait_until(lambda: job.pservers[1].round_no > after + 1, 60, "rounds after the checkpoint")
        job.pservers[1].crash()
        replacement = Pserver(job.store, job.transport, job.compute, job.config, index=1, claim_wait=10.0,
                              checkpoints=open_checkpoint_files(job.config.checkpoint_url))  # fmt: skip
        replacement.start()  # finds the job initialized: rolls everyone back
        job.pservers[1] = replacement

    try:
        train_on_threads(job, 2, during=crash, pause=0.05)
        assert job.master.done.is_set()
        epoch, _ = recovery.read_epoch(job.store, keys)
        assert epoch.epoch == 1 and (epoch.checkpoint is not None) == checkpoints and all(ps.epoch == 1 for ps in job.pservers)
        assert any(s.epoch == 0 and s.round >= epoch.round for c in job.trainers for s in c.history), "rounds were rolled back"
        check_against_replay(job, source, {0: 0, 1: epoch.round})
    finally:
        job.close()


def test_a_sync_job_resized_two_three_two_keeps_every_row_and_its_adagrad_state(tmp_path, monkeypatch):
    monkeypatch.setattr(pserver_module, "MIGRATE_CALL_BYTES", 1024)  # a slot's rows come in several pages
    pages: list[tuple[int, int, bool]] = []  # (slot, rows, more) of each page sent
    paged = pserver_module._LeavingRows.page

    def page(self, slot: int, offset: int, budget: int):
        names, tensors, more = paged(self, slot, offset, budget)
        pages.append((slot, sum(len(t) for n, t in zip(names, tensors) if n.endswith("/ids") and "pending" not in n), more))
        return names, tensors, more

    monkeypatch.setattr(pserver_module._LeavingRows, "page", page)
    source = clicks(tmp_path.as_uri(), tasks=8, rows=6 * B)
    job = start_job(
        source, name="rows-resize", mode="sync", trainers=2, pservers=2, num_slots=SLOTS, min_block=1, lease_ttl=2.0,
        batch_size=B, optimizer="Adagrad", optimizer_args=ADAGRAD, keep_rounds=100_000, passes=2,
        checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=4, checkpoint_keep=100,
    )  # fmt: skip
    keys = Keys(job.config.name)
    moved = []

    def resizes(steps) -> None:
        for target in (3, 2):
            before = steps()
            wait_until(lambda: steps() >= before + 8, 60, "steps before the resize")
            resize(job, target)
            assert read_map(job.store, keys).num_pservers == target
            moved.append(sum(ps.received_bytes for ps in job.pservers))

    try:
        train_on_threads(job, 2, during=resizes, pause=0.05)
        assert job.master.done.is_set() and len(job.pservers) == 2
        assert recovery.read_epoch(job.store, keys)[0].epoch == 0  # no rollback: the rows moved
        maps = [r.map_version for _, r in closed_rounds(job.store, job.config.name) if r.map_version is not None]
        assert len(maps) == 2, maps
        assert moved[0] > 0 and moved[1] > 0
        # rows moved, one slot at a time, in pages of at most 1 KiB (7 rows of 8 + 64 + 64 bytes)
        assert any(more for _, _, more in pages) and 0 < max(n for _, n, _ in pages) <= 7
        assert sum(n for _, n, _ in pages) > 50
        replay_checked = check_against_replay(job, source, {0: 0})
        assert replay_checked is not None
        # checkpoints commit whatever the slot map's pserver count (one part per pserver of
        # the map it was taken in): one taken while the job had 3 pservers is among them
        files = open_checkpoint_files(job.config.checkpoint_url)
        counts = {sum(n.startswith("ps-") for n in files.read_manifest(c).parts) for c in recovery.read_pointer(job.store, keys)[0].history}
        assert counts == {2, 3}, counts
    finally:
        job.close()


def test_an_async_job_resized_two_three_two_keeps_every_row_and_its_adagrad_state(tmp_path):
    """Async pservers switch maps at once: a trainer's lookup computed for the old map
    is answered SlotMapChanged and routed again by the new one. One trainer pulling
    and pushing every step is sequential SGD: torch over its steps in order."""
    source = clicks(tmp_path.as_uri(), tasks=6, rows=6 * B)
    job = start_job(
        source, name="rows-async-resize", mode="async", trainers=1, pservers=2, num_slots=SLOTS, min_block=1, lease_ttl=2.0,
        batch_size=B, optimizer="Adagrad", optimizer_args=ADAGRAD,
    )  # fmt: skip

    def resizes(steps) -> None:
        for target in (3, 2):
            before = steps()
            wait_until(lambda: steps() >= before + 6, 60, "steps before the resize")
            resize(job, target)

    try:
        train_on_threads(job, 1, during=resizes, pause=0.05)
        assert job.trainers[0].map_changes == 2 and len(job.pservers) == 2
        replay = Replay(source, (job.config.optimizer, job.config.optimizer_args))
        for step in job.trainers[0].history:
            replay.apply([(job.trainers[0].trainer_id, step)])
        assert_rows_equal(on_pservers(job.pservers), replay.rows_now(), "the pservers after the job")
        assert all(ps._tables[TABLE].step == len(job.trainers[0].history) for ps in job.pservers)
    finally:
        job.close()


def test_an_async_pserver_restored_alone_reloads_its_own_rows(tmp_path):
    """Async, ``restore="lost"``: a restarted pserver reloads its own slots from the
    newest checkpoint, rows and their Adagrad sums included; the others keep theirs."""
    source = clicks(tmp_path.as_uri(), tasks=4, rows=4 * B)
    job = start_job(
        source, name="rows-lost", mode="async", restore="lost", trainers=1, pservers=2, num_slots=SLOTS, min_block=1,
        lease_ttl=1.0, batch_size=B, optimizer="Adagrad", optimizer_args=ADAGRAD,
        checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=4,
    )  # fmt: skip
    try:
        train_on_threads(job, 1)
        keys = Keys(job.config.name)
        # the newest checkpoint, committed (so the restarted pserver chooses it too)
        wait_until(lambda: all(c["state"] != "writing" for c in recovery.describe(job.store, keys)), 30, "the last checkpoint's commit")
        files = open_checkpoint_files(job.config.checkpoint_url)
        manifest = recovery.choose(job.store, files, keys)
        assert manifest is not None and manifest.round > 0
        parts = {name: files.read_part(part) for name, part in manifest.parts.items() if name.startswith("ps-")}
        kept = on_pservers(job.pservers[:1])
        job.pservers[1].crash()
        replacement = Pserver(job.store, job.transport, job.compute, job.config, index=1, claim_wait=10.0, checkpoints=files)
        replacement.start()
        job.pservers[1] = replacement
        assert recovery.read_epoch(job.store, keys)[0].epoch == 0  # no rollback
        assert replacement.version == int(parts["ps-1"][recovery.VERSION])
        rows = replacement._tables[TABLE]
        assert rows.step == max(int(p[f"{TABLE}/scalar.step"]) for p in parts.values()) > 0
        want = table_in(parts["ps-1"])
        assert len(want[0]) > 0 and rows.stats()["rows"] == len(want[0])
        assert_rows_equal(on_pservers([replacement]), want, "the restored pserver")
        assert_rows_equal(on_pservers(job.pservers[:1]), kept, "the pserver that went on")
    finally:
        job.close()
