"""Training functions for the tests of following the desired counts, loaded by file path."""

import os
import time

import torch.nn.functional as F

from pdps.core.job import Keys
from pdps.examples.digits import make_model
from pdps.registry import connect_store


def leave_when_fewer(ctx):
    """The digits loop, slowed down; trainer-<n> stops after a batch once the job's
    ``trainers_desired`` is n or less (mid-task: the task goes back), as a trainer a
    resize removes leaves, and exits 0."""
    number = int(ctx.trainer_id.split("-")[1])  # trainer-<n>, or its restart trainer-<n>-r<k>
    delay = float(os.environ.get("SLOW_TRAIN_DELAY", "0.1"))
    store = connect_store(os.environ["PDPS_STORE"])
    keys = Keys(os.environ["PDPS_JOB"])
    try:
        model = ctx.attach(make_model())
        for batch in ctx.batches():
            time.sleep(delay)
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
            kv = store.get(keys.trainers_desired)
            if kv is not None and number >= int(kv.value):
                break
    finally:
        store.close()
    return {"steps": ctx.steps}


JOB_DEFAULTS = {"passes": 2, "batch_size": 32, "optimizer": "Adam", "lr": 0.001}


def dataset(root_url):
    from pdps.examples.digits import dataset as digits_dataset

    return digits_dataset(root_url)
