"""A tiny training function for streaming role-process tests (``.../stream.py:train``):
a linear regression on 3 features, each step slowed by ``STREAM_STEP_DELAY`` seconds so
that a task of a few batches lasts long enough for a test to kill its trainer mid-way."""

import os
import time

import torch
import torch.nn.functional as F


def train(ctx):
    model = ctx.attach(torch.nn.Linear(3, 1).double())
    delay = float(os.environ.get("STREAM_STEP_DELAY", "0"))
    for batch in ctx.batches():
        time.sleep(delay)
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
    return {"steps": ctx.steps}
