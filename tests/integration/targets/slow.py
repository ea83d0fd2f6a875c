"""Training functions for role-process tests, loaded by file path (``.../slow.py:train``)."""

import os
import time

import torch.nn.functional as F

from pdps.examples import digits
from pdps.examples.digits import make_model

#: The launcher's hook: the held-out accuracy of the final parameters, in the summary.
evaluate = digits.evaluate


def train(ctx):
    """The digits loop, slowed down so a test can catch a trainer holding its tasks."""
    model = ctx.attach(make_model())
    delay = float(os.environ.get("SLOW_TRAIN_DELAY", "0.5"))
    for batch in ctx.batches():
        time.sleep(delay)
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
    return {"steps": ctx.steps}


def crash_once(ctx):
    """Crash the first trainer process that gets here (a marker file remembers), after a
    few steps; every later run trains normally."""
    marker = os.environ["CRASH_MARKER"]
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        if ctx.steps == 3 and not os.path.exists(marker):
            with open(marker, "w") as f:
                f.write(ctx.trainer_id)
            os._exit(17)
    return {"steps": ctx.steps}


JOB_DEFAULTS = {"passes": 2, "batch_size": 32, "optimizer": "Adam", "lr": 0.001}


def dataset(root_url):
    from pdps.examples.digits import dataset as digits_dataset

    return digits_dataset(root_url)


def fail_at_step_3(ctx):
    """Raise at the 3rd step in the trainer named by FAILING_TRAINER and in each of its
    restarts (``trainer-1-r1``, ...); every other trainer trains normally."""
    failing = os.environ["FAILING_TRAINER"]
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        if ctx.steps == 3 and ctx.trainer_id.split("-r")[0] == failing:
            raise RuntimeError(f"{ctx.trainer_id} trips at its 3rd step")
    return {"steps": ctx.steps}


def audited(ctx):
    """The digits loop; after it, write what every pserver applied to
    ``$AUDIT_OUT/<trainer id>.json`` (the job is done: every step is in it)."""
    import json

    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
    with open(os.path.join(os.environ["AUDIT_OUT"], f"{ctx.trainer_id}.json"), "w") as f:
        json.dump({str(k): v for k, v in ctx.applied().items()}, f)
    return {"steps": ctx.steps}


def wrong_input(ctx):
    """Feed the model batches of the wrong width: torch raises deep inside the model's
    forward, many frames below this function."""
    model = ctx.attach(make_model())
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"][:, :10]), batch["y"]))
    return {"steps": ctx.steps}
