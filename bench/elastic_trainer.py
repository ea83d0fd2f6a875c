"""The model and the training function of ``bench/elastic.py``.

:class:`Matrices` is the model both ways of running the bench train; :func:`train` is
the target of its trainer processes (``python -m pdps trainer bench.elastic_trainer:train``,
run from the checkout's root). It attaches a model of ``$ELASTIC_BENCH_MIB`` MiB and
steps on every batch; after attaching, and after each step the job kept, it appends a
JSON line to the file ``$ELASTIC_BENCH_STEPS`` names: ``{"trainer", "attached", "epoch"}``
once, then ``{"trainer", "t", "round", "epoch", "rollbacks"}`` per step, ``t`` and
``attached`` being ``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of
the machine, so the bench compares them with its own).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

COLUMNS = 1024
MATRICES = 16
GRAD_SCALE = 1e-6
STEPS_FILE = "ELASTIC_BENCH_STEPS"  # not PDPS_*: the roles warn about PDPS_ variables they do not know
MIB = "ELASTIC_BENCH_MIB"


class Matrices(torch.nn.Module):
    """``mib`` MiB of float32 parameters: ``MATRICES`` matrices of ``COLUMNS`` columns."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        rows = mib * 2**20 // (4 * COLUMNS * MATRICES)
        if rows < 1:
            raise SystemExit(f"--mib {mib} is too small: at least {4 * COLUMNS * MATRICES / 2**20:g} MiB")
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(rows, COLUMNS)) for _ in range(MATRICES))

    def loss(self) -> torch.Tensor:
        """The sum of every parameter (times ``GRAD_SCALE``): forward and backward read and
        write the whole model, and no time goes to anything else."""
        return sum(w.sum() for w in self.weights) * GRAD_SCALE  # type: ignore[return-value]


def train(ctx: Any) -> dict[str, int]:
    model = ctx.attach(Matrices(int(os.environ[MIB])))
    with open(os.environ[STEPS_FILE], "a", encoding="utf-8", buffering=1) as out:  # a line per write: the bench reads as it goes
        out.write(json.dumps({"trainer": ctx.trainer_id, "attached": time.monotonic(), "epoch": ctx.epoch}) + "\n")
        for _ in ctx.batches():
            applied = len(ctx.history)
            ctx.step(model.loss())
            if len(ctx.history) > applied:  # a step a rollback dropped is no step
                step = {"trainer": ctx.trainer_id, "t": time.monotonic(), "round": ctx.history[-1].round, "epoch": ctx.epoch, "rollbacks": ctx.rollbacks}
                out.write(json.dumps(step) + "\n")
    return {"steps": ctx.steps}
