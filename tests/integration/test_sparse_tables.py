"""Sparse tables through whole jobs (``pdps.simulate``): the sync equivalence with
single-process torch ``sparse=True``, HashEmbedding over a 2^62 id space, async.

Sizes are small (a 100k-row table, dim 16, 20 steps): what is proven is exact
arithmetic and that no trainer ever holds a table-sized tensor, not speed.
"""

from __future__ import annotations

import gc
import sys
import weakref

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils._python_dispatch import TorchDispatchMode

import pdps
import pdps.nn
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.ports.data import read_whole

K = 20  # steps
B = 8  # batch per trainer
N = 3  # trainers
ROWS = 100_000
DIM = 16
BAG = 4


class Model(nn.Module):
    """An embedding bag over BAG ids per sample, then an MLP."""

    def __init__(self, table: nn.Module, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        self.emb = table
        g = torch.Generator().manual_seed(7)  # not the global RNG: trainers build models on threads
        self.mlp = nn.Sequential(nn.Linear(DIM, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.uniform_(-0.5, 0.5, generator=g)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.emb(ids)).squeeze(-1)


def bag(device: str = "meta") -> nn.Module:
    return nn.EmbeddingBag(ROWS, DIM, mode="sum", sparse=True, dtype=torch.float64, device=device)


def clicks(root: str) -> ParquetSource:
    """N tasks (one file each) of K*B samples: BAG Zipf-drawn ids in [0, ROWS), so the
    trainers' batches share ids (their gradients must be summed per id)."""
    import fsspec

    rng = np.random.default_rng(11)
    fs, base = fsspec.core.url_to_fs(f"{root}/all")
    fs.makedirs(base, exist_ok=True)
    for i in range(N):
        n = K * B
        ids = (rng.zipf(1.3, size=(n, BAG)) - 1) % ROWS
        y = rng.normal(size=n)
        write_parquet_shards({"ids": ids.astype(np.int64), "y": y}, f"{root}/t{i}", shards=1, row_group_size=n)
        src_fs, src = fsspec.core.url_to_fs(f"{root}/t{i}/part-00000.parquet")
        fs.pipe_file(f"{base}/part-{i:05d}.parquet", src_fs.cat_file(src))
    return ParquetSource(f"{root}/all")


SEEN: dict[str, object] = {}


PSERVER_CODE = "pdps/roles/pserver.py"


def in_a_pserver() -> bool:
    """Whether a pserver's handler is on this thread's stack: inproc calls run the pserver
    on the caller's thread, and the pserver's row chunks are not the trainer's."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.replace("\\", "/").endswith(PSERVER_CODE):
            return True
        frame = frame.f_back
    return False


class Largest(TorchDispatchMode):
    """The most elements of any tensor a torch op made on this thread while it is on
    (factories, results, the autograd graph's), on a device that allocates, outside the
    pservers' handlers."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > self.numel and not in_a_pserver():
                self.numel = t.numel()
        return out


def train(ctx: pdps.TrainerContext) -> None:
    with Largest() as made:  # the trainer's thread: attach, forwards, backwards, steps
        table = bag()
        dropped = weakref.ref(table)
        model = ctx.attach(Model(table))
        del table
        gc.collect()
        SEEN.setdefault("user_table_freed", []).append(dropped() is None)  # type: ignore[union-attr]
        SEEN.setdefault("flat", []).append(ctx._replica.numel)  # type: ignore[union-attr]
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["ids"]), batch["y"]))
        SEEN.setdefault("largest_rows", []).append(ctx._tables.largest_rows)  # type: ignore[union-attr]
    SEEN.setdefault("largest_tensor", []).append(made.numel)  # type: ignore[union-attr]


ROW_RULE = {"SGD": torch.optim.SGD, "Adagrad": torch.optim.Adagrad, "Adam": torch.optim.SparseAdam}


def reference(source: ParquetSource, optimizer: str, kwargs: dict) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Single-process torch with ``sparse=True`` on the concatenated N*B batch of step k."""
    table = bag("cpu")
    spec = pdps.nn.tables_of(Model(bag()))[0][2]
    with torch.no_grad():
        table.weight.copy_(pdps.nn.init_rows(spec, torch.arange(ROWS)))
    model = Model(table)
    dense = getattr(torch.optim, optimizer)(model.mlp.parameters(), **kwargs)
    rows = ROW_RULE[optimizer]([table.weight], **kwargs)
    tasks = [read_whole(source, t) for t in source.tasks()]
    for k in range(K):
        ids = torch.cat([torch.from_numpy(t["ids"][k * B : (k + 1) * B]) for t in tasks])
        y = torch.cat([torch.from_numpy(t["y"][k * B : (k + 1) * B]) for t in tasks])
        dense.zero_grad()
        rows.zero_grad()
        F.mse_loss(model(ids), y).backward()
        dense.step()
        rows.step()
    touched = torch.unique(torch.cat([torch.from_numpy(t["ids"][: K * B].reshape(-1)) for t in tasks]))
    return {n: p.detach() for n, p in model.named_parameters()}, touched


@pytest.mark.parametrize(
    "optimizer,kwargs",
    [("SGD", {"lr": 0.05}), ("Adagrad", {"lr": 0.05, "lr_decay": 0.01}), ("Adam", {"lr": 0.01})],
    ids=["sgd", "adagrad", "sparseadam"],
)
def test_sync_rows_and_dense_equal_single_process_torch(tmp_path, optimizer, kwargs):
    SEEN.clear()
    source = clicks(tmp_path.as_uri())
    result = pdps.simulate(
        train, dataset=source, trainers=N, pservers=2, mode="sync", batch_size=B,
        optimizer=optimizer, optimizer_args=kwargs, num_slots=64,
    )
    want, touched = reference(source, optimizer, kwargs)
    assert result.steps == K
    rows = result.params["emb.weight"]
    assert isinstance(rows, pdps.nn.TableRows)
    # a row exists for exactly the ids trained (SGD, Adagrad and SparseAdam create on first touch)
    assert torch.equal(rows.ids, touched)
    got = rows.lookup(torch.arange(ROWS))
    torch.testing.assert_close(got, want["emb.weight"], rtol=0, atol=1e-10)
    assert not torch.equal(want["emb.weight"][touched], pdps.nn.init_rows(rows.spec, touched))  # it trained
    for name in ("mlp.0.weight", "mlp.0.bias", "mlp.2.weight", "mlp.2.bias"):
        torch.testing.assert_close(result.params[name], want[name], rtol=0, atol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    # no trainer held the table: its flat buffer is the MLP's, its biggest row buffer one batch's ids
    mlp = sum(p.numel() for p in Model(bag()).mlp.parameters())
    assert SEEN["flat"] == [mlp] * N
    assert SEEN["user_table_freed"] == [True] * N
    assert 0 < max(SEEN["largest_rows"]) <= B * BAG  # type: ignore[type-var]
    # ... and no torch op on a trainer's thread made a tensor of a table's size (ROWS x DIM),
    # nor of a column of it: the biggest is a batch's rows, B * BAG x DIM
    assert len(SEEN["largest_tensor"]) == N and 0 < max(SEEN["largest_tensor"]) <= B * BAG * DIM  # type: ignore[arg-type, type-var]


# --- an unbounded id space, async ------------------------------------------------------


class Hashed(nn.Module):
    def __init__(self, **options) -> None:
        super().__init__()
        self.emb = pdps.nn.HashEmbedding(8, mode="sum", **options)
        g = torch.Generator().manual_seed(3)
        self.out = nn.Linear(8, 1)
        with torch.no_grad():
            self.out.weight.uniform_(-0.5, 0.5, generator=g)
            self.out.bias.zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids)).squeeze(-1)


def huge_ids(root: str, n: int = 240, bag: int = 3, distinct: int = 150) -> tuple[ParquetSource, np.ndarray]:
    """Bags of ids drawn from ``distinct`` ids spread over [0, 2^62)."""
    rng = np.random.default_rng(5)
    vocab = rng.integers(0, 1 << 62, size=distinct, dtype=np.int64)
    ids = vocab[rng.integers(0, distinct, size=(n, bag))]
    y = (ids % 7 < 3).sum(axis=1).astype(np.float32) - 1.0
    write_parquet_shards({"ids": ids, "y": y}, f"{root}/huge", shards=2, row_group_size=60)
    return ParquetSource(f"{root}/huge"), np.unique(ids)


def fit_hashed(ctx: pdps.TrainerContext, **options) -> None:
    model = ctx.attach(Hashed(**options))
    for batch in ctx.batches():
        loss = F.mse_loss(model(batch["ids"]), batch["y"])
        ctx.step(loss)
        ctx.metrics["loss"] = float(loss.detach())


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_hash_embedding_over_a_2_62_id_space_creates_a_row_per_id_touched(tmp_path, mode):
    source, touched = huge_ids(tmp_path.as_uri())
    result = pdps.simulate(
        fit_hashed, dataset=source, trainers=2, pservers=2, mode=mode, batch_size=20, passes=3,
        optimizer="Adagrad", optimizer_args={"lr": 0.1}, num_slots=32,
    )
    rows = result.params["emb.weight"]
    assert rows.spec.num_rows is None and rows.ids.min() >= 0
    assert torch.equal(rows.ids, torch.from_numpy(touched))  # rows created = distinct ids touched
    ids, y = (torch.from_numpy(c) for c in (lambda d: (d["ids"], d["y"]))(read_whole(source, source.tasks()[0])))
    trained = pdps.nn.bind(Hashed(), result.params)
    untrained = pdps.nn.bind(Hashed(), {"emb.weight": pdps.nn.TableRows(rows.spec, rows.ids[:0], rows.values[:0])})
    with torch.no_grad():
        assert float(F.mse_loss(trained(ids), y)) < 0.5 * float(F.mse_loss(untrained(ids), y))


@pytest.mark.parametrize(
    "settings,says",
    [
        ({"optimizer": "RMSprop"}, "optimizer 'RMSprop' has no row rule: set sparse_optimizer"),
        ({"optimizer": "SGD", "sparse_optimizer": "Adagard"}, "Adagrad"),
        ({"replicas": 2, "options": {"admit_after": 2}}, "table 'emb.weight': admit_after=2 cannot run with replicas=2"),
        ({"replicas": 2, "mode": "async", "options": {"ttl_steps": 8}}, "ttl_steps=8 cannot run in an async job with replicas=2"),
    ],
    ids=["no-row-rule", "typo", "replicas-admission", "replicas-async-ttl"],
)
def test_a_job_its_tables_cannot_run_in_is_refused_at_attach(tmp_path, settings, says):
    source, _ = huge_ids(tmp_path.as_uri())
    options = settings.pop("options", {})
    with pytest.raises(pdps.ConfigError, match=says):
        pdps.simulate(lambda ctx: fit_hashed(ctx, **options), dataset=source, trainers=1, pservers=2, batch_size=20, **settings)


def test_a_model_of_tables_only_is_refused_at_attach(tmp_path):
    source, _ = huge_ids(tmp_path.as_uri())

    def tables_only(ctx: pdps.TrainerContext) -> None:
        ctx.attach(nn.Sequential(pdps.nn.HashEmbedding(4, mode="sum")))

    with pytest.raises(pdps.ConfigError, match="sparse tables and no dense parameter"):
        pdps.simulate(tables_only, dataset=source, trainers=1, pservers=1, batch_size=20)
