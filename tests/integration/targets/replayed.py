"""A sync job small enough to replay in the test process, loaded by file path
(``.../replayed.py:train``): a float64 regression on data the test writes
(:func:`write_dataset`), plain SGD, its final parameters written to ``$PARAMS_OUT``
(safetensors) by the launcher's ``evaluate`` hook."""

import os
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

# 12 tasks of 40 records; batches of 8: 30 sync rounds a pass with 2 trainers
ROWS, ROW_GROUP, BATCH, LR = 480, 40, 8, 0.05

JOB_DEFAULTS = {"passes": 2, "batch_size": BATCH, "optimizer": "SGD", "lr": LR, "num_slots": 16, "min_block": 1}


def make_model() -> nn.Module:
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(model(x), y)


def train(ctx):
    """The regression loop, each step ``$STEP_DELAY`` seconds slower. Steps pause while
    a resize is requested or growing (a new pserver process may take many seconds to
    start on a busy machine), and ``$HOLD_AFTER_GROWING`` seconds more, so the job is
    still training when the map flips."""
    from pdps.core.elastic import ResizeState
    from pdps.core.job import Keys
    from pdps.registry import connect_store
    from pdps.runtime.resizing import read_resize

    delay = float(os.environ.get("STEP_DELAY", "0"))
    store = connect_store(os.environ["PDPS_STORE"])
    keys = Keys(os.environ["PDPS_JOB"])
    try:
        model = ctx.attach(make_model())
        held = False
        for batch in ctx.batches():
            time.sleep(delay)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and (r := read_resize(store, keys)[0]) is not None and r.state in (ResizeState.REQUESTED, ResizeState.GROWING):
                time.sleep(0.05)
                held = True
            if held:
                # a pserver the grow adds that is still starting when the map flips misses the
                # flip (a race in Pserver.start, reported): give it time to settle first
                time.sleep(float(os.environ.get("HOLD_AFTER_GROWING", "0")))
                held = False
            ctx.step(loss_of(model, batch["x"], batch["y"]))
    finally:
        store.close()
    return {"steps": ctx.steps}


def write_dataset(url: str) -> str:
    """The job's data at ``url`` (the test keeps it, to replay the job)."""
    from pdps.adapters.parquet import write_parquet_shards

    rng = np.random.default_rng(11)
    x = rng.normal(size=(ROWS, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    write_parquet_shards({"x": x, "y": y}, url, shards=2, row_group_size=ROW_GROUP)
    return url


def evaluate(params):
    from safetensors.torch import save_file

    save_file({name: t.contiguous() for name, t in params.items()}, os.environ["PARAMS_OUT"])
    return {}
