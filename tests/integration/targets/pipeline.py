"""Training functions for the pipeline acceptance test (loaded by file path,
``.../pipeline.py:train``): 4 stages of a small float64 MLP, one of whose layers
SIGKILLs its process mid-step once (the first process to get there, a marker file
remembers), and the launcher's hook saving the final parameters as raw float64 files."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdps.runtime.hybrid import ranks

#: the stages start at these children: Linear+Tanh | Linear+Tanh | KillSwitch+Linear+Tanh | Linear
POINTS = [2, 4, 7]
#: the KillSwitch's forward call that kills: step 1's second microbatch (2 a step)
KILL_AT = 4


class KillSwitch(nn.Module):
    """The identity; in the first process whose forward is called ``KILL_AT`` times while
    the file ``$PIPELINE_KILL_MARKER`` is absent, SIGKILL of its own process: a stage dies
    in the middle of a step, with microbatches in flight on both sides of it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        marker = os.environ.get("PIPELINE_KILL_MARKER")
        if marker and self.calls == KILL_AT:
            try:
                fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one process only
            except FileExistsError:
                return x
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)
        return x


def make_model() -> nn.Sequential:
    g = torch.Generator().manual_seed(5)
    model = nn.Sequential(
        nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), KillSwitch(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)
    ).double()
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.5, 0.5, generator=g)
    return model


def train(ctx):
    """Once a stage was killed, stage 0 waits (up to a minute) before each batch until
    every rank is claimed again: the job cannot end before the broken pipeline formed
    again with its restarted stages, which then train too."""
    pipe = ctx.pipeline(make_model(), F.mse_loss, points=POINTS)
    marker = os.environ.get("PIPELINE_KILL_MARKER")

    def prepare(batch):
        if marker and os.path.exists(marker):
            deadline = time.monotonic() + 60
            while len(ranks(ctx._store, ctx._keys)) < ctx.config.trainers and time.monotonic() < deadline:
                time.sleep(0.1)
        return batch["x"], batch["y"]

    pipe.train(prepare)
    return {"stage": pipe.stage, "rank": pipe.group.rank, "steps": pipe.steps}


def evaluate(params):
    """The launcher's hook: each final parameter to ``$PIPELINE_PARAMS_OUT/<name>.f64``."""
    out = Path(os.environ["PIPELINE_PARAMS_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    for name, value in params.items():
        np.ascontiguousarray(value.detach().numpy(), dtype=np.float64).tofile(out / f"{name}.f64")
    return {"saved": float(len(params))}
