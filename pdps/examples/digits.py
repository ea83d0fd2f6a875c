"""The demo: an MLP on scikit-learn's bundled digits, trained by pdps.

* Data: the 1,797 8x8 digit images (64 features scaled to [0, 1], 10 classes),
  split 80/20 stratified by the seed. The 80% is written as Parquet shards of
  several row groups each (one task per row group); the 20% is held out.
* Model: 64 -> 128 -> 10 with ReLU, the same initial weights in every trainer.
* :func:`train` is an ordinary pdps training function: it runs unchanged in one
  process (``pdps demo``) or as a trainer process
  (``pdps launch --store etcd://... pdps.examples.digits:train``).
* The launcher's hooks: :data:`JOB_DEFAULTS`, :func:`dataset` (writes the training
  split when no dataset is configured) and :func:`evaluate` (held-out accuracy).
"""

from __future__ import annotations

from typing import Any

import numpy as np

SHARDS = 4
ROW_GROUP = 40
MODEL_SEED = 0
SPLIT_SEED = 0

#: The settings the demo trains with (Adam, 30 passes); flags and files override them.
JOB_DEFAULTS = {"passes": 30, "batch_size": 32, "optimizer": "Adam", "lr": 0.001}


def make_model(seed: int = MODEL_SEED, dtype: Any = None):
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    with torch.no_grad():
        for p in model.parameters():  # seeded init so every trainer starts from the same weights
            bound = 1.0 / np.sqrt(p.shape[-1] if p.dim() > 1 else 64)
            p.uniform_(-bound, bound, generator=g)
    return model.to(dtype) if dtype is not None else model


def prepare(root_url: str, seed: int = 0) -> tuple[str, np.ndarray, np.ndarray]:
    """Write the training split as Parquet under ``root_url``; return (dataset URL, X_test, y_test)."""
    from pdps.adapters.parquet import write_parquet_shards

    x_train, x_test, y_train, y_test = _split(seed)
    url = root_url.rstrip("/") + "/train"
    write_parquet_shards({"x": x_train, "y": y_train}, url, shards=SHARDS, row_group_size=ROW_GROUP)
    return url, x_test, y_test


def dataset(root_url: str) -> str:
    """Launcher hook: write the training split under ``root_url``; its URL."""
    return prepare(root_url, seed=SPLIT_SEED)[0]


def _split(seed: int) -> list[np.ndarray]:
    """x_train, x_test, y_train, y_test: 80/20, stratified, features scaled to [0, 1]."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=seed)


def held_out(seed: int = SPLIT_SEED) -> tuple[np.ndarray, np.ndarray]:
    """The 20% of the digits :func:`prepare` holds out for ``seed``."""
    _, x_test, _, y_test = _split(seed)
    return x_test, y_test


def evaluate(params: dict[str, Any]) -> dict[str, float]:
    """Launcher hook: the held-out accuracy of the final parameters."""
    return {"accuracy": accuracy(params, *held_out())}


def train(ctx) -> dict[str, float]:
    """The demo's training function: cross-entropy on mini-batches the job hands out."""
    import torch.nn.functional as F

    model = ctx.attach(make_model())
    last = float("nan")
    for batch in ctx.batches():
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        ctx.step(loss)
        last = float(loss.detach())
        ctx.metrics["loss"] = last
    return {"loss": last, "steps": ctx.steps}


def accuracy(params: dict[str, Any], x: np.ndarray, y: np.ndarray) -> float:
    """Held-out accuracy of the given parameters (e.g. pulled from the pservers)."""
    import torch

    model = make_model()
    model.load_state_dict({k: v.to(torch.float32) for k, v in params.items()})
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(dim=1).numpy()
    return float((pred == y).mean())
