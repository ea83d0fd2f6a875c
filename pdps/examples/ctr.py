"""The CTR example: click prediction from categorical ids, the case sparse tables are for.

* Data: :func:`make_clicks`, a seeded synthetic click log documented below so that
  anyone can regenerate it from this text. :func:`split` draws 25,000 samples: the
  first 20,000 train (written as Parquet by :func:`prepare`, one task per row group),
  the last 5,000 are held out.
* Model: :func:`build_model`: one embedding table of width 16 over the 8 ids of a
  sample (8 bags of one id, ``mode="sum"``), the 8 vectors concatenated with the 4
  dense features into an MLP 132 -> 64 -> 1 giving the click's logit.
* The launcher's hooks, as in :mod:`pdps.examples.digits`: :data:`JOB_DEFAULTS`,
  :func:`dataset` (writes the training split) and :func:`evaluate` (held-out AUC).
* :func:`bayes_auc`: the AUC of the true click probability, the ceiling any model
  approaches (about 0.82 on the held-out split; a trained model reaches about 0.76).

The generator
-------------
Hashes use splitmix64 (Steele et al.'s finalizer, arithmetic modulo 2^64)::

    splitmix64(x):
        z = x + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        return z ^ (z >> 31)

of the key ``stream * 2**40 + feature * 2**32 + rank``, with ``unit(stream, f, r) =
(splitmix64(key) >> 11) * 2**-53`` in [0, 1) (exact on every machine). Each step of
splitmix64 is invertible, so distinct keys never collide.

``make_clicks(n, seed)`` draws, in this order, from ``numpy.random.default_rng(seed)``:

1. ``z = rng.zipf(1.2, size=(n, 8))``; ``rank = minimum(z, 100_000) - 1``: feature f
   of sample i has rank ``rank[i, f]`` in [0, 100,000), rank 0 the most frequent
   (1/zeta(1.2) = 17.9% of samples), the last rank collecting the tail past the
   vocabulary (8.9%, as an out-of-vocabulary bucket does);
2. ``dense = rng.standard_normal((n, 4)).astype(float32)``;
3. ``click = (rng.random(n) < p).astype(float32)``, with, in float64,
   ``p = 1 / (1 + exp(-logit))`` and::

       logit = BIAS + sum_f w(f, rank_f) + sum_j U[j] * dense_j + PAIR * v(0, rank_0) * v(1, rank_1)
       w(f, r) = W_SCALE * (2 * unit(1, f, r) - 1)
       v(f, r) = 2 * unit(2, f, r) - 1

   with ``BIAS = -1.93``, ``W_SCALE = 0.75``, ``U = (0.5, -0.5, 0.25, -0.25)``,
   ``PAIR = 1.0``, each sum taken left to right (f = 0..7, j = 0..3) and the four
   terms added left to right, so the logit is the same double everywhere (``exp``
   may differ in the last ulp between numpy builds).

The columns: ``"cat"`` int64 ``[n, 8]``, ``splitmix64(key(0, f, rank))`` read as a
signed int64 (ids spread over all of int64, negative too: what a
``pdps.nn.HashEmbedding`` takes); ``"cat_index"`` int64 ``[n, 8]``, ``f * 100_000 +
rank`` (bounded, in [0, 800,000): what a torch ``nn.EmbeddingBag(800_000, 16)``
takes); ``"dense"`` float32 ``[n, 4]``; ``"click"`` float32 ``[n]`` (0 or 1). The
signal is the same function for every seed: the seed draws the samples, not the
weights.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pdps.core.errors import ConfigError

FEATURES = 8
VOCAB = 100_000
DENSE = 4
DIM = 16
ZIPF_A = 1.2

#: The click model's constants: BIAS for 25% clicks (24.99% over 2M samples); W_SCALE
#: for a Bayes AUC of about 0.82 (0.818 over 2M samples) with a signal that a model
#: trained on 20,000 samples mostly learns: two passes reach about 0.76 (the rest is
#: in ranks seen too rarely to learn).
BIAS = -1.93
W_SCALE = 0.75
U = (0.5, -0.5, 0.25, -0.25)
PAIR = 1.0

TRAIN = 20_000
HELD_OUT = 5_000
SHARDS = 4
ROW_GROUP = 1_250  # 16 tasks of 1,250 rows
DATA_SEED = 0
MODEL_SEED = 0

# hash streams: the id of (f, r), its weight w, its pairwise factor v
ID_STREAM, W_STREAM, V_STREAM = 0, 1, 2

#: The settings the example trains with: 2 passes of batches of 256, Adagrad (the
#: table's row rule follows the dense one: Adagrad -> Adagrad).
JOB_DEFAULTS = {"passes": 2, "batch_size": 256, "optimizer": "Adagrad", "lr": 0.02}

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over a uint64 array (wrapping arithmetic, no Python loop)."""
    z = np.asarray(x, dtype=np.uint64) + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MIX1
    z = (z ^ (z >> np.uint64(27))) * _MIX2
    return z ^ (z >> np.uint64(31))


def _hash(stream: int, feature: Any, rank: Any) -> np.ndarray:
    key = (np.uint64(stream) << np.uint64(40)) | (np.asarray(feature, dtype=np.uint64) << np.uint64(32)) | np.asarray(rank, dtype=np.uint64)
    return splitmix64(key)


def _unit(stream: int, feature: Any, rank: Any) -> np.ndarray:
    """Uniform in [0, 1) from the top 53 bits of the hash: exact on every machine."""
    return (_hash(stream, feature, rank) >> np.uint64(11)).astype(np.float64) * 2.0**-53


def feature_ids(feature: Any, rank: Any) -> np.ndarray:
    """The int64 id of each (feature, rank): ``splitmix64(key(0, f, r))`` as signed."""
    return _hash(ID_STREAM, feature, rank).view(np.int64)


def make_clicks(n: int, seed: int) -> dict[str, np.ndarray]:
    """``n`` samples of the click log the module docstring defines, drawn with ``seed``."""
    if n < 1:
        raise ConfigError(f"make_clicks needs n >= 1 samples, got {n}")
    rng = np.random.default_rng(seed)
    rank = np.minimum(rng.zipf(ZIPF_A, size=(n, FEATURES)), VOCAB) - 1
    dense = rng.standard_normal((n, DENSE)).astype(np.float32)
    feature = np.arange(FEATURES, dtype=np.int64)
    cat_index = feature * VOCAB + rank
    p = click_probability({"cat_index": cat_index, "dense": dense})
    click = (rng.random(n) < p).astype(np.float32)
    return {"cat": feature_ids(feature, rank), "cat_index": cat_index, "dense": dense, "click": click}


def click_logit(data: dict[str, np.ndarray]) -> np.ndarray:
    """The true logit of each sample (float64), recomputed from its ``cat_index`` and ``dense``."""
    cat_index = np.asarray(data["cat_index"])
    feature, rank = np.divmod(cat_index, VOCAB)
    w = W_SCALE * (2.0 * _unit(W_STREAM, feature, rank) - 1.0)
    v0 = 2.0 * _unit(V_STREAM, 0, rank[:, 0]) - 1.0
    v1 = 2.0 * _unit(V_STREAM, 1, rank[:, 1]) - 1.0
    dense = np.asarray(data["dense"], dtype=np.float64)
    w_sum = w[:, 0].copy()
    for f in range(1, FEATURES):  # left to right, as documented (numpy's sum is pairwise)
        w_sum += w[:, f]
    u_sum = U[0] * dense[:, 0]
    for j in range(1, DENSE):
        u_sum += U[j] * dense[:, j]
    return BIAS + w_sum + u_sum + PAIR * v0 * v1


def click_probability(data: dict[str, np.ndarray]) -> np.ndarray:
    """The true click probability of each sample: ``sigmoid(click_logit(data))``."""
    return 1.0 / (1.0 + np.exp(-click_logit(data)))


def bayes_auc(data: dict[str, np.ndarray]) -> float:
    """The AUC of the true click probability on ``data``: the best any model can expect."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(data["click"], click_probability(data)))


def split(seed: int = DATA_SEED) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(train, held out): the first 20,000 and the last 5,000 of ``make_clicks(25_000, seed)``."""
    data = make_clicks(TRAIN + HELD_OUT, seed)
    return {k: v[:TRAIN] for k, v in data.items()}, {k: v[TRAIN:] for k, v in data.items()}


def held_out(seed: int = DATA_SEED) -> dict[str, np.ndarray]:
    """The 5,000 samples :func:`prepare` holds out for ``seed``."""
    return split(seed)[1]


def prepare(root_url: str, seed: int = DATA_SEED) -> tuple[str, dict[str, np.ndarray]]:
    """Write the training split as Parquet under ``root_url``; return (dataset URL, held-out columns)."""
    from pdps.adapters.parquet import write_parquet_shards

    train_part, held = split(seed)
    url = root_url.rstrip("/") + "/train"
    write_parquet_shards(train_part, url, shards=SHARDS, row_group_size=ROW_GROUP)
    return url, held


def dataset(root_url: str) -> str:
    """Launcher hook: write the training split under ``root_url``; its URL."""
    return prepare(root_url, seed=DATA_SEED)[0]


@functools.cache
def _model_class() -> type:
    """The model's class, made on first use so that importing this module loads no torch."""
    import torch
    from torch import nn

    class ClickModel(nn.Module):
        """Embeddings of the 8 ids of a sample, beside its dense features, into an MLP."""

        def __init__(self, embedding: nn.Module, ids: str) -> None:
            super().__init__()
            self.ids = ids
            self.embedding = embedding
            self.mlp = nn.Sequential(nn.Linear(FEATURES * DIM + DENSE, 64), nn.ReLU(), nn.Linear(64, 1))

        def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
            """The click logit of each sample of ``batch`` (a dict of the dataset's columns)."""
            ids = batch[self.ids]
            vectors = self.embedding(ids.reshape(-1, 1)).reshape(ids.shape[0], FEATURES * DIM)  # 8 bags of one id
            return self.mlp(torch.cat([vectors, batch["dense"]], dim=1)).squeeze(1)

    return ClickModel


def build_model(embedding: Any = None, *, seed: int = MODEL_SEED) -> Any:
    """The click model over ``embedding``, a table of width 16 in ``mode="sum"``.

    The table reads ``"cat_index"`` if it is bounded (has ``num_embeddings``, as torch's
    tables do) and ``"cat"`` if not (a ``pdps.nn.HashEmbedding``). ``None`` gives torch's
    ``nn.EmbeddingBag(800_000, 16, mode="sum", sparse=True)``, the single-process
    reference, its rows drawn uniform in +-1/sqrt(16) (HashEmbedding's default init).
    The MLP's initial weights depend on ``seed`` only, so every trainer starts alike.
    """
    import torch
    from torch import nn

    if embedding is None:
        embedding = nn.EmbeddingBag(FEATURES * VOCAB, DIM, mode="sum", sparse=True)
        with torch.no_grad():
            bound = 1.0 / np.sqrt(DIM)
            embedding.weight.uniform_(-bound, bound, generator=torch.Generator().manual_seed(seed))
    dim = getattr(embedding, "embedding_dim", getattr(embedding, "dim", DIM))
    if dim != DIM:
        raise ConfigError(f"the click model's table has width {dim}; the MLP takes 8 vectors of width {DIM}: build the table with dim {DIM}")
    rows = getattr(embedding, "num_embeddings", None)
    if rows is not None and rows < FEATURES * VOCAB:
        raise ConfigError(
            f"a bounded table of {rows} rows cannot hold the ids of 'cat_index', which reach {FEATURES * VOCAB - 1}: "
            f"give it {FEATURES * VOCAB} rows, or use an unbounded pdps.nn.HashEmbedding (it reads 'cat')"
        )
    model = _model_class()(embedding, "cat" if rows is None else "cat_index")
    g = torch.Generator().manual_seed(seed)  # the MLP's own: the same weights whatever the table
    with torch.no_grad():  # torch's default bounds (uniform in +-1/sqrt(fan_in)), seeded: every trainer alike
        for layer in model.mlp:
            if isinstance(layer, nn.Linear):
                bound = 1.0 / np.sqrt(layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=g)
                layer.bias.uniform_(-bound, bound, generator=g)
    return model


def as_tensors(data: dict[str, np.ndarray]) -> dict[str, Any]:
    """The columns as torch tensors (sharing memory), the batch a trainer would get."""
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in data.items()}


def loss(model: Any, batch: dict[str, Any]) -> Any:
    """Binary cross-entropy of the model's logits against the batch's clicks."""
    import torch.nn.functional as F

    return F.binary_cross_entropy_with_logits(model(batch), batch["click"])


def auc(model_or_params: Any, data: dict[str, np.ndarray]) -> float:
    """The AUC of the model's scores on ``data`` (a model, or parameters to load into one)."""
    import torch
    from sklearn.metrics import roc_auc_score

    model = model_or_params if isinstance(model_or_params, torch.nn.Module) else _load(model_or_params)
    with torch.no_grad():
        scores = model(as_tensors(data))
    return float(roc_auc_score(data["click"], scores.double().numpy()))


def evaluate(model_or_params: Any, data: dict[str, np.ndarray] | None = None) -> dict[str, float]:
    """Launcher hook: the held-out AUC of the final parameters (or of a model)."""
    return {"auc": auc(model_or_params, held_out() if data is None else data)}


def _load(params: dict[str, Any]) -> Any:
    """A model holding ``params``: a pdps job's (the table as fetched rows,
    :class:`pdps.nn.TableRows`: the model's table is bound to them), or a state dict of
    the torch reference model."""
    import torch

    import pdps.nn

    if any(isinstance(v, pdps.nn.TableRows) for v in params.values()):
        return pdps.nn.bind(build_model(pdps.nn.HashEmbedding(DIM, mode="sum", seed=MODEL_SEED)), params)
    model = build_model()
    model.load_state_dict({k: torch.as_tensor(v).to(torch.float32) for k, v in params.items()})
    return model


def train(ctx) -> dict[str, float]:
    """The example's training function: binary cross-entropy on the batches the job hands out."""
    from pdps.nn import HashEmbedding

    model = ctx.attach(build_model(HashEmbedding(DIM, mode="sum", seed=MODEL_SEED)))
    last = float("nan")
    for batch in ctx.batches():
        value = loss(model, batch)
        ctx.step(value)
        last = float(value.detach())
        ctx.metrics["loss"] = last
    return {"loss": last, "steps": ctx.steps}
