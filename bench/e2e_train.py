"""The training function of ``bench/end_to_end.py``: one loop, timed from inside, for both transports.

``bench/end_to_end.py`` runs :func:`run` in ``pdps.simulate``'s trainer threads
(``inproc``) and, through :func:`train`, as the target of ``pdps launch``'s trainer
processes (``bench/e2e_train.py:train``). Each trainer:

1. announces itself with a file ``ready-<trainer id>`` in the output directory and waits
   (up to ``BARRIER_S``, then fails) until every trainer of the job has one and the bench
   has written ``go`` there, before it attaches: processes that finished importing torch
   early do not train alone while the others still start (a sync job's first rounds
   would otherwise run with fewer trainers), and the bench can start a launch while the
   previous one still shuts down, yet keep the two apart;
2. attaches the model (784-2048-2048-2048-10, built here from a private generator);
3. runs the canonical loop (``for batch in ctx.batches(): ctx.step(cross_entropy(...))``)
   and times it with ``time.perf_counter`` around ``next(batches)`` ("data"), the forward
   pass and loss ("forward") and ``ctx.step`` ("step": backward, push, pull, barrier).
   The first ``warmup`` steps are not counted: the timed window opens right after the
   last warm-up step (``loop_start``, ``time.time()``, comparable across processes) and
   closes when ``ctx.batches()`` ends (``loop_end``; the final async flush included);
4. writes ``trainer-<trainer id>.json`` to the output directory: its timed samples and
   steps, the window, its own sums, and ``ctx.timings`` (cumulative seconds by phase,
   when the library exposes it) at the window's start and end.

The output directory and warm-up come from the environment (``E2E_BENCH_DIR``,
``E2E_BENCH_WARMUP``) in trainer processes: ``pdps launch`` passes every variable but
``PDPS_*`` on to its roles.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ENV_DIR = "E2E_BENCH_DIR"
ENV_WARMUP = "E2E_BENCH_WARMUP"
SIZES = (784, 2048, 2048, 2048, 10)
BARRIER_S = 300.0  # how long a trainer waits for the others and for the go file before it fails


def make_model(seed: int = 0) -> nn.Module:
    """MLP 784-2048-2048-2048-10, initialized like ``nn.Linear`` but from a private generator
    (trainers run on threads in ``simulate``; the global RNG would make them race)."""
    g = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(SIZES, SIZES[1:])):
        lin = nn.Linear(a, b)
        bound = 1.0 / math.sqrt(a)
        with torch.no_grad():
            lin.weight.uniform_(-bound, bound, generator=g)
            lin.bias.uniform_(-bound, bound, generator=g)
        layers.append(lin)
        if i < len(SIZES) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def _timings(ctx: Any) -> dict[str, float] | None:
    t = getattr(ctx, "timings", None)
    if t is None:
        return None
    try:
        return {str(k): float(v) for k, v in dict(t).items()}
    except (TypeError, ValueError):
        return None


def _barrier(out: Path, ctx: Any) -> float:
    """Wait until every trainer of the job has written its ready file and the bench its
    ``go`` file; seconds waited."""
    t0 = time.perf_counter()
    (out / f"ready-{ctx.trainer_id}").touch()
    want = int(ctx.config.trainers)
    while len(list(out.glob("ready-*"))) < want or not (out / "go").exists():
        if time.perf_counter() - t0 > BARRIER_S:
            have = len(list(out.glob("ready-*")))
            raise RuntimeError(f"{ctx.trainer_id}: {have} of {want} trainers ready, go={int((out / 'go').exists())} after {BARRIER_S:.0f}s")
        time.sleep(0.01)
    return time.perf_counter() - t0


def run(ctx: Any, out_dir: str, warmup: int, seed: int = 0) -> dict[str, Any]:
    """The timed loop; writes and returns this trainer's record."""
    out = Path(out_dir)
    entered = time.time()
    barrier_s = _barrier(out, ctx)
    model = make_model(seed)
    t_attach = time.time()
    ctx.attach(model)
    attached = time.time()

    data = fwd = step = 0.0
    samples = steps = 0
    total_samples = total_steps = 0
    loop_start = None
    timings_start = None
    if warmup <= 0:
        loop_start, timings_start = time.time(), _timings(ctx)
    it = iter(ctx.batches())
    while True:
        t0 = time.perf_counter()
        batch = next(it, None)
        t1 = time.perf_counter()
        if batch is None:
            if loop_start is not None:
                data += t1 - t0  # the final next(): the async flush, reporting the last task, done
            break
        loss = F.cross_entropy(model(batch["x"]), batch["y"])
        t2 = time.perf_counter()
        ctx.step(loss)
        t3 = time.perf_counter()
        total_samples += batch.size
        total_steps += 1
        if loop_start is not None:
            data, fwd, step = data + (t1 - t0), fwd + (t2 - t1), step + (t3 - t2)
            samples += batch.size
            steps += 1
        elif total_steps >= warmup:
            loop_start, timings_start = time.time(), _timings(ctx)
    loop_end = time.time()
    timings_end = _timings(ctx)
    delta = None
    if timings_start is not None and timings_end is not None:
        delta = {k: v - timings_start.get(k, 0.0) for k, v in timings_end.items()}
    record = {
        "trainer": ctx.trainer_id,
        "pid": os.getpid(),
        "torch_threads": torch.get_num_threads(),
        "overlap": getattr(ctx, "overlapping", None),  # whether this trainer overlapped (the job's setting decided)
        "warmup_steps": min(warmup, total_steps),
        "samples": samples,
        "steps": steps,
        "total_samples": total_samples,
        "total_steps": total_steps,
        "entered": entered,
        "barrier_s": barrier_s,
        "attach_s": attached - t_attach,
        "loop_start": loop_start,
        "loop_end": loop_end,
        "loop_seconds": None if loop_start is None else loop_end - loop_start,
        "data_s": data,
        "forward_s": fwd,
        "step_s": step,
        "ctx_steps": int(getattr(ctx, "steps", total_steps)),
        "pushes": int(getattr(ctx, "pushes", 0)),
        "stale_pushes": int(getattr(ctx, "stale_pushes", 0)),
        "tasks_done": int(getattr(ctx, "tasks_done", 0)),
        "timings": delta,  # seconds by phase within the timed window; None without ctx.timings
        "timings_total": timings_end,  # cumulative since attach, warm-up included
    }
    tmp = out / f".trainer-{ctx.trainer_id}.json.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(out / f"trainer-{ctx.trainer_id}.json")
    return record


def train(ctx: Any) -> dict[str, Any]:
    """``pdps launch`` target: :func:`run` with the directory and warm-up from the environment."""
    record = run(ctx, os.environ[ENV_DIR], int(os.environ.get(ENV_WARMUP, "5")))
    return {"samples": record["samples"], "steps": record["steps"], "loop_seconds": record["loop_seconds"]}
