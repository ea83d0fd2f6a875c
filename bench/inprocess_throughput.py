"""In-process pdps training throughput against plain torch, measured in the same run.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed.

What runs
---------
* Data: synthetic (x ~ N(0, 1) float32 of width 784, y uniform in 0..9), written once
  as Parquet to a temporary directory, cut into row groups of ``--rows-per-task`` rows
  (one pdps task each).
* Model: MLP 784-2048-2048-2048-10 (10,020,874 float32 parameters), or with
  ``--small`` 784-256-10; batch 64; plain SGD lr 0.01; cross-entropy.
* pdps: ``pdps.simulate`` with the ``memory://`` store and ``inproc://`` transport, in
  sync and async mode (async: push_every = pull_every = 1), trainers x pservers in
  {1, 2} x {1, 2} (``--quick``: 1 trainer x {1, 2} pservers).
* Baseline: a plain torch loop (same model, batch, optimizer) over the same number of
  samples, in this process, from tensors already in memory (no Parquet reads). It runs
  before and after the pdps jobs; the ratio uses the mean of the two. The same loop
  also runs on a fresh thread ("torch*"), because pdps runs each trainer on a thread
  and torch on a non-main thread was measured slower here (fewer cores kept busy).
* ``cores`` = this process's CPU time / wall time while a configuration ran; other
  processes on the machine show up as baselines that differ before and after.

What is timed
-------------
* ``samples/s`` (end to end) = samples / ``result.seconds``, the wall time from the
  start of the trainer threads to the end of the last one: attach (publish the model,
  initialize the pservers, first pull), leasing tasks, reading Parquet row groups,
  training, the final flush and leaving. Model construction is not in it (the models
  are built before the job starts).
* ``loop samples/s`` = samples / (last trainer's loop end - first trainer's loop start),
  the ``for batch in ctx.batches()`` loop only: attach excluded, Parquet reads and task
  leasing included.
* One untimed warm-up pdps job and a few untimed torch steps run first.
* The per-step breakdown of the async 1-trainer jobs wraps ``ctx._async_push`` and
  ``ctx._pull`` on the trainer's context with ``time.perf_counter`` (a private hook of
  the library, used read-only; the library is unchanged). ``inproc://`` runs the
  pserver's handler in the caller's thread, so "push" includes the pserver's check of
  the gradients and its SGD update, and "pull" includes copying the values into the
  model. "backward" is ``ctx.step`` time minus push and pull.

Run
---
    .venv/bin/python bench/inprocess_throughput.py --quick --small   # ~10-15 s on 2 cores
    .venv/bin/python bench/inprocess_throughput.py --quick           # ~30 s on 2 cores
    .venv/bin/python bench/inprocess_throughput.py                   # ~2 min on 2 cores
    .venv/bin/python bench/inprocess_throughput.py --json            # only the JSON line
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import platform
import resource
import sys
import tempfile
import threading
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.slots import Layout, ParamSpec, SlotMap

BATCH = 64
LR = 0.01
WIDTH_IN = 784
CLASSES = 10
NUM_SLOTS = 256


# --- model and data ---------------------------------------------------------------------


def layer_sizes(small: bool) -> list[int]:
    return [WIDTH_IN, 256, CLASSES] if small else [WIDTH_IN, 2048, 2048, 2048, CLASSES]


def make_model(sizes: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def write_dataset(root: str, samples: int, rows_per_task: int, seed: int) -> ParquetSource:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, WIDTH_IN), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=samples, dtype=np.int64)
    write_parquet_shards({"x": x, "y": y}, root, shards=1, row_group_size=rows_per_task)
    return ParquetSource(root)


def load_all(source: ParquetSource) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Every row of the dataset in memory (for the baseline), and how long reading took."""
    t0 = time.perf_counter()
    parts = [source.read(t) for t in source.tasks()]
    seconds = time.perf_counter() - t0
    x = torch.from_numpy(np.concatenate([p["x"] for p in parts]))
    y = torch.from_numpy(np.concatenate([p["y"] for p in parts]))
    return x, y, seconds


def layout_summary(template: nn.Module, pservers: int, min_block: int) -> list[dict[str, int]]:
    """Blocks and elements each pserver holds under the job's layout."""
    specs = [ParamSpec(n, tuple(p.shape), str(p.dtype).removeprefix("torch.")) for n, p in template.named_parameters()]
    layout = Layout.build(specs, SlotMap.initial(pservers, NUM_SLOTS), min_block)
    out = []
    for i in range(pservers):
        blocks = layout.blocks_of(i)
        out.append({"blocks": len(blocks), "params": sum(b.numel for b in blocks)})
    return out


def cpu_seconds() -> float:
    """CPU time of this process so far (all threads, user + system)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# --- plain torch ------------------------------------------------------------------------


def torch_baseline(template: nn.Module, x: torch.Tensor, y: torch.Tensor, samples: int, warmup_steps: int) -> dict[str, Any]:
    model = copy.deepcopy(template)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    n = min(samples, len(x))

    def one(start: int) -> tuple[float, float, float]:
        xb, yb = x[start : start + BATCH], y[start : start + BATCH]
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(xb), yb)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=False)
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    for i in range(warmup_steps):
        one((i * BATCH) % max(1, n - BATCH))
    fwd = bwd = upd = 0.0
    steps = 0
    cpu0 = cpu_seconds()
    start = time.perf_counter()
    for s in range(0, n, BATCH):
        a, b, c = one(s)
        fwd, bwd, upd = fwd + a, bwd + b, upd + c
        steps += 1
    seconds = time.perf_counter() - start
    cpu = cpu_seconds() - cpu0
    ms = lambda v: 1000.0 * v / steps  # noqa: E731
    return {
        "samples": n,
        "cpu_cores_used": cpu / seconds,
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": n / seconds,
        "ms_per_step": ms(seconds),
        "breakdown_ms": {"forward": ms(fwd), "backward": ms(bwd), "sgd_step+zero_grad": ms(upd)},
    }


def torch_baseline_on_thread(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The same loop on a fresh thread, as pdps runs each trainer: separates "pdps" from "not the main thread"."""
    out: dict[str, Any] = {}
    th = threading.Thread(target=lambda: out.update(torch_baseline(*args, **kwargs)), name="torch-baseline")
    th.start()
    th.join()
    return out


# --- pdps -------------------------------------------------------------------------------


def make_train(models: list[nn.Module]):
    """The training function every trainer runs: the canonical loop, with timestamps."""

    def train(ctx: pdps.TrainerContext) -> dict[str, Any]:
        model = models[int(ctx.trainer_id.rsplit("-", 1)[1])]
        t_attach = time.perf_counter()
        ctx.attach(model)
        attach_s = time.perf_counter() - t_attach
        acc = {"push": 0.0, "pull": 0.0}
        counts = {"push": 0, "pull": 0}

        def timed(name: str, fn):
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    acc[name] += time.perf_counter() - t0
                    counts[name] += 1

            return wrapper

        # Hook the async push/pull after attach, so attach's first pull is not counted.
        hooked = ctx.config.mode is pdps.Mode.ASYNC and hasattr(ctx, "_async_push") and hasattr(ctx, "_pull")
        if hooked:
            ctx._async_push = timed("push", ctx._async_push)  # type: ignore[method-assign]
            ctx._pull = timed("pull", ctx._pull)  # type: ignore[method-assign]

        data = fwd = step = 0.0
        samples = steps = 0
        it = iter(ctx.batches())
        loop_start = time.perf_counter()
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            t1 = time.perf_counter()
            data += t1 - t0
            if batch is None:
                break
            loss = F.cross_entropy(model(batch["x"]), batch["y"])
            t2 = time.perf_counter()
            ctx.step(loss)
            t3 = time.perf_counter()
            fwd += t2 - t1
            step += t3 - t2
            samples += batch.size
            steps += 1
        loop_end = time.perf_counter()
        return {
            "attach_s": attach_s,
            "loop_start": loop_start,
            "loop_end": loop_end,
            "samples": samples,
            "steps": steps,
            "data_s": data,
            "forward_s": fwd,
            "step_s": step,
            "hooked": hooked,
            "push_s": acc["push"],
            "pull_s": acc["pull"],
            "pushes": counts["push"],
            "pulls": counts["pull"],
        }

    return train


def run_pdps(template: nn.Module, source: ParquetSource, *, mode: str, trainers: int, pservers: int, min_block: int) -> dict[str, Any]:
    models = [copy.deepcopy(template) for _ in range(trainers)]
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    result = pdps.simulate(
        make_train(models),
        dataset=source,
        mode=mode,
        trainers=trainers,
        pservers=pservers,
        batch_size=BATCH,
        optimizer="SGD",
        optimizer_args={"lr": LR},
        push_every=1,
        pull_every=1,
        min_block=min_block,
        num_slots=NUM_SLOTS,
    )
    cpu = (cpu_seconds() - cpu0) / (time.perf_counter() - wall0)
    per = [v for v in result.trainers.values() if v is not None]
    samples = sum(v["samples"] for v in per)
    loop_s = max(v["loop_end"] for v in per) - min(v["loop_start"] for v in per)
    row: dict[str, Any] = {
        "mode": mode,
        "trainers": trainers,
        "pservers": pservers,
        "samples": samples,
        "seconds": result.seconds,
        "samples_per_s": samples / result.seconds,
        "loop_seconds": loop_s,
        "loop_samples_per_s": samples / loop_s,
        "trainer_steps": sum(v["steps"] for v in per),
        "pserver_updates": result.steps,
        "tasks_done": result.tasks_done,
        "attach_s_max": max(v["attach_s"] for v in per),
        "cpu_cores_used": cpu,
        "layout": layout_summary(template, pservers, min_block),
    }
    if trainers == 1 and mode == "async" and per[0]["hooked"]:
        v = per[0]
        n = max(1, v["steps"])
        ms = lambda s: 1000.0 * s / n  # noqa: E731
        row["breakdown_ms"] = {
            "data (next batch)": ms(v["data_s"]),
            "forward": ms(v["forward_s"]),
            "backward (step - push - pull)": ms(v["step_s"] - v["push_s"] - v["pull_s"]),
            "push (incl. pserver check+SGD)": ms(v["push_s"]),
            "pull (incl. copy into model)": ms(v["pull_s"]),
            "loop total": ms(v["loop_end"] - v["loop_start"]),
        }
        row["pushes"], row["pulls"] = v["pushes"], v["pulls"]
    return row


# --- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a short run (~30 s on 2 cores): 1 trainer x {1,2} pservers")
    p.add_argument("--small", action="store_true", help="MLP 784-256-10 instead of 784-2048x3-10")
    p.add_argument("--json", action="store_true", help="print only the final JSON line")
    p.add_argument("--samples", type=int, default=None, help="samples per configuration (default depends on --quick/--small)")
    p.add_argument("--rows-per-task", type=int, default=640, help="rows per Parquet row group = per pdps task (default 640 = 10 batches)")
    p.add_argument("--min-block", type=int, default=1 << 18, help="pdps min_block in elements (default 262144)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads() before anything runs (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    say = (lambda *a, **k: None) if args.json else print
    if args.samples is None:
        per = {(False, False): 10240, (False, True): 51200, (True, False): 3840, (True, True): 25600}
        args.samples = per[(args.quick, args.small)]
    rows_per_task = max(BATCH, (args.rows_per_task // BATCH) * BATCH)  # whole batches per task
    samples = max(rows_per_task, (args.samples // rows_per_task) * rows_per_task)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    torch.manual_seed(args.seed)
    sizes = layer_sizes(args.small)
    template = make_model(sizes)
    n_params = sum(p.numel() for p in template.parameters())
    if args.quick:
        configs = [(m, 1, ps) for m in ("sync", "async") for ps in (1, 2)]
    else:
        configs = [(m, t, ps) for m in ("sync", "async") for t in (1, 2) for ps in (1, 2)]

    t_total = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="pdps-bench-") as tmp:
        t0 = time.perf_counter()
        source = write_dataset(os.path.join(tmp, "data"), samples, rows_per_task, args.seed)
        warm = write_dataset(os.path.join(tmp, "warm"), 2 * rows_per_task, rows_per_task, args.seed + 1)
        write_s = time.perf_counter() - t0
        tasks = len(source.tasks())
        x, y, read_s = load_all(source)
        threads = torch.get_num_threads()

        say(f"model {'-'.join(map(str, sizes))}: {n_params:,} float32 parameters ({n_params * 4 / 2**20:.1f} MiB)")
        say(f"data: {samples} samples, {tasks} tasks of {rows_per_task} rows (Parquet written in {write_s:.1f}s; "
            f"reading every row group once takes {read_s:.2f}s = {1000 * read_s / tasks:.1f} ms/task)")
        say(f"batch {BATCH}, SGD lr {LR}, min_block {args.min_block} elements, num_slots {NUM_SLOTS}; "
            f"torch {torch.__version__}, torch.get_num_threads() = {threads}, os.cpu_count() = {os.cpu_count()}")
        for ps in (1, 2):
            lay = layout_summary(template, ps, args.min_block)
            say(f"layout with {ps} pserver(s): " + ", ".join(f"ps{i}: {d['blocks']} blocks / {d['params']:,} params" for i, d in enumerate(lay)))
        say(f"load average at start (1/5/15 min): {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f} "
            "(other processes on this machine skew every figure; compare the before/after baselines)")
        say("timed: samples/s = samples / result.seconds (trainer threads start..end: attach, task leasing, "
            "Parquet reads, training, flush); loop = the ctx.batches() loop only (attach excluded)")
        say()

        # Warm-up: torch kernels, allocator, pdps code paths; nothing here is reported.
        run_pdps(template, warm, mode="async", trainers=1, pservers=1, min_block=args.min_block)
        base_before = torch_baseline(template, x, y, samples, warmup_steps=5)
        thread_before = torch_baseline_on_thread(template, x, y, samples, warmup_steps=5)
        say(f"torch baseline (before): {base_before['samples_per_s']:.0f} samples/s, {base_before['ms_per_step']:.2f} ms/step, "
            f"{base_before['cpu_cores_used']:.2f} cores busy")
        say(f"torch baseline on a thread (before): {thread_before['samples_per_s']:.0f} samples/s, "
            f"{thread_before['ms_per_step']:.2f} ms/step, {thread_before['cpu_cores_used']:.2f} cores busy")

        rows = []
        for mode, trainers, pservers in configs:
            row = run_pdps(template, source, mode=mode, trainers=trainers, pservers=pservers, min_block=args.min_block)
            rows.append(row)
            say(f"  ran {mode} {trainers}x{pservers}: {row['samples_per_s']:.0f} samples/s ({row['seconds']:.1f}s, "
                f"{row['cpu_cores_used']:.2f} cores busy)")
        thread_after = torch_baseline_on_thread(template, x, y, samples, warmup_steps=5)
        say(f"torch baseline on a thread (after): {thread_after['samples_per_s']:.0f} samples/s, "
            f"{thread_after['ms_per_step']:.2f} ms/step, {thread_after['cpu_cores_used']:.2f} cores busy")
        base_after = torch_baseline(template, x, y, samples, warmup_steps=0)
        say(f"torch baseline (after): {base_after['samples_per_s']:.0f} samples/s, {base_after['ms_per_step']:.2f} ms/step, "
            f"{base_after['cpu_cores_used']:.2f} cores busy")

    load_end = os.getloadavg()
    base = (base_before["samples_per_s"] + base_after["samples_per_s"]) / 2
    thread_base = (thread_before["samples_per_s"] + thread_after["samples_per_s"]) / 2
    for row in rows:
        row["ratio_vs_torch"] = row["samples_per_s"] / base
        row["loop_ratio_vs_torch"] = row["loop_samples_per_s"] / base
        row["ratio_vs_torch_on_thread"] = row["samples_per_s"] / thread_base

    say()
    header = f"{'mode':<6} {'trainers':>8} {'pservers':>8} {'samples/s':>10} {'ratio vs torch':>15} {'loop samples/s':>15} {'loop ratio':>11} {'updates':>8} {'cores':>6}"
    say(header)
    say("-" * len(header))
    say(f"{'torch':<6} {1:>8} {'-':>8} {base:>10.0f} {1.0:>15.3f} {'':>15} {'':>11} {base_before['steps']:>8} {(base_before['cpu_cores_used'] + base_after['cpu_cores_used']) / 2:>6.2f}")
    say(f"{'torch*':<6} {1:>8} {'-':>8} {thread_base:>10.0f} {thread_base / base:>15.3f} {'':>15} {'':>11} "
        f"{thread_before['steps']:>8} {(thread_before['cpu_cores_used'] + thread_after['cpu_cores_used']) / 2:>6.2f}")
    for r in rows:
        say(f"{r['mode']:<6} {r['trainers']:>8} {r['pservers']:>8} {r['samples_per_s']:>10.0f} {r['ratio_vs_torch']:>15.3f} "
            f"{r['loop_samples_per_s']:>15.0f} {r['loop_ratio_vs_torch']:>11.3f} {r['pserver_updates']:>8} {r['cpu_cores_used']:>6.2f}")
    say("(torch* = the same torch loop on a fresh thread, as pdps runs each trainer; pdps ratios against it are in the JSON)")
    say(f"(torch = mean of before {base_before['samples_per_s']:.0f} and after {base_after['samples_per_s']:.0f} samples/s; "
        f"updates = pserver updates applied on the busiest pserver; cores = this process's CPU time / wall time)")

    say()
    say("per-step breakdown, ms (torch baseline, before):")
    for k, v in base_before["breakdown_ms"].items():
        say(f"  {k:<34} {v:8.2f}")
    for r in rows:
        if "breakdown_ms" in r:
            say(f"per-step breakdown, ms (pdps async, 1 trainer, {r['pservers']} pserver(s), {r['trainer_steps']} steps):")
            for k, v in r["breakdown_ms"].items():
                say(f"  {k:<34} {v:8.2f}")

    total_s = time.perf_counter() - t_total
    say(f"\ntotal run time {total_s:.1f}s; load average at end (1/5/15 min): {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")
    report = {
        "bench": "inprocess_throughput",
        "quick": args.quick,
        "small": args.small,
        "model": sizes,
        "params": n_params,
        "batch_size": BATCH,
        "optimizer": {"name": "SGD", "lr": LR},
        "min_block": args.min_block,
        "num_slots": NUM_SLOTS,
        "samples": samples,
        "rows_per_task": rows_per_task,
        "tasks": tasks,
        "parquet_read_all_s": read_s,
        "torch_version": torch.__version__,
        "torch_num_threads": threads,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch_baseline": {"before": base_before, "after": base_after, "samples_per_s_mean": base},
        "torch_baseline_on_thread": {"before": thread_before, "after": thread_after, "samples_per_s_mean": thread_base},
        "pdps": rows,
        "total_s": total_s,
        "loadavg_start": list(load_start),
        "loadavg_end": list(load_end),
    }
    print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
