"""A sync training function whose job can be replayed in one process, loaded by file path
(``.../replayable.py:recorded``; the repository root must be on ``PYTHONPATH``).

Each applied step's gradient goes to ``$GRADS_OUT/<epoch>-<round>-<trainer id>.f64``
(raw float64 bytes, written whole or not at all); ``acknowledged`` (async) saves an
empty one per step instead and, at the end, ``$GRADS_OUT/<trainer id>.acked.json``: the
pushes each slot's pserver said it applied. After each step the trainer sleeps
as many seconds as ``$STEP_PACE`` (a file) says: a test slows the job down while it
waits for a resize, so that the job outlasts the resize however slowly processes start.
"""

import json
import os
import time
from pathlib import Path

import numpy as np
import torch.nn.functional as F

from tests.integration.test_transactional_sync import flat_grad, make_model


def save(name: str, values: np.ndarray) -> None:
    out = Path(os.environ["GRADS_OUT"])
    part = out / f".{name}.part"
    values.astype(np.float64).tofile(part)
    os.replace(part, out / f"{name}.f64")  # a reader counting files never sees half of one


def recorded(ctx):
    """A plain loop; before each step, the gradient it will push is kept aside, and saved
    under the round the step was applied in (:attr:`TrainerContext.history`)."""
    pace = Path(os.environ["STEP_PACE"])
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        loss = F.mse_loss(model(batch["x"]), batch["y"])
        loss.backward(retain_graph=True)
        grad = flat_grad(model).numpy()
        model.zero_grad(set_to_none=False)
        applied = len(ctx.history)
        ctx.step(loss)
        if len(ctx.history) > applied:
            s = ctx.history[-1]
            save(f"{s.epoch}-{s.round}-{ctx.trainer_id}", grad)
        time.sleep(float(pace.read_text()))
    return {"steps": ctx.steps}



def acknowledged(ctx):
    """Async: a plain loop, paced as :func:`recorded`; one (empty) step file per step,
    and at the end the pushes each slot was acknowledged (:attr:`TrainerContext.acknowledged`)."""
    pace = Path(os.environ["STEP_PACE"])
    model = ctx.attach(make_model())
    for n, batch in enumerate(ctx.batches()):
        ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
        save(f"0-{n}-{ctx.trainer_id}", np.zeros(0))
        time.sleep(float(pace.read_text()))
    out = Path(os.environ["GRADS_OUT"]) / f"{ctx.trainer_id}.acked.json"
    out.write_text(json.dumps({str(slot): n for slot, n in ctx.acknowledged.items()}))
    return {"steps": ctx.steps}
