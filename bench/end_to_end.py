"""End-to-end pdps training throughput, in process and over gRPC, against plain torch in the same run.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed
(it exits 1 only when a configuration failed to run at all, after showing why).

What runs
---------
* Data: synthetic (x ~ N(0, 1) float32 of width 784, y uniform in 0..9), written once
  as Parquet to a temporary directory, cut into row groups of ``--rows-per-task`` rows
  (default 256 = 4 batches; one pdps task each). A configuration trains one pass over
  2,816 rows per trainer (44 steps each; ``--quick``: 1,536 = 24 steps), shared by its
  trainers through the master's task queue; ``--samples N`` gives every configuration N.
* Model: MLP 784-2048-2048-2048-10 (10,020,874 float32 parameters), batch 64, plain SGD
  lr 0.01, cross-entropy; async mode pushes and pulls every batch (push_every =
  pull_every = 1). ``min_block`` 262144 elements (``--min-block``), 256 slots.
* Configurations: trainers {1, 2, 3} x pservers {1, 2} x mode {sync, async} x transport
  {inproc, grpc} (``--quick``: 1 trainer x {1, 2} pservers, fewer samples).
  - ``inproc``: ``pdps.simulate(store="memory://", transport="inproc://")`` in this
    process (trainers are threads; torch keeps its default intra-op threads).
  - ``grpc``: ``python -m pdps launch --transport grpc`` as a subprocess against a
    throwaway etcd on 127.0.0.1 (``tests/servers.py``): master, pservers and trainers
    are processes; the launcher gives each ``OMP_NUM_THREADS`` = cores / (trainers +
    pservers) (1 here) unless the environment sets it. Its stderr goes to a log whose
    tail is shown if it fails.
  Both run the same training function, ``bench/e2e_train.py`` (the launch target is
  ``bench/e2e_train.py:train``), which announces each trainer with a file and waits for
  all of them, and for the bench's go-ahead, before attaching: trainers that started
  early do not train alone. Launches are pipelined: the next one starts (processes
  import torch, register) once the previous one's timed loops are over, while it shuts
  down; its trainers get the go-ahead only when the previous launcher has exited.
* Baseline: a plain torch loop (same model, batch, optimizer) over the samples of a
  1-trainer configuration (after 5 untimed steps), on the main thread with torch's
  default intra-op threads, from tensors already in memory (no Parquet reads), run
  before the pdps configurations (after ``os.sync()`` and 3 s of quiet, so what an
  earlier program wrote is not flushed meanwhile), between the inproc and the gRPC
  ones, and after them; the ratio uses the median of these looks at the machine. All
  are printed: their spread is the drift of the machine (other processes) over the run.
* Bounds: every job has a timeout (``--job-timeout``, default 120 s + samples / 20), a
  job whose count of finished tasks stops growing for 60 s is stopped and reported
  failed (e.g. one that keeps rolling back), and a launcher that outlives its time gets
  SIGTERM, then SIGKILL.

What is timed
-------------
* Each trainer times its own loop on the wall clock (``time.time()``, comparable across
  processes). Its first ``--warmup`` steps (default 4) are not counted; the window opens
  after them and closes when ``ctx.batches()`` ends (the last async flush and the last
  task's report included). Process start-up, importing torch, ``attach`` (publishing the
  model, initializing the pservers, the first pull) are outside it.
* ``samples/s`` = timed samples of all trainers / (last trainer's loop end - first
  trainer's loop start). ``ratio`` = that / the torch baseline's samples/s.
* ``sim samples/s`` (inproc only) = every sample, warm-up included / ``result.seconds``
  of ``pdps.simulate`` (trainer threads start..end: attach and warm-up included).
  ``launch s`` (grpc only) = the launcher's whole wall time (processes starting,
  importing torch, attach, training, stopping; the wait for the go-ahead included):
  outside the figures, inside the benchmark's run time. The JSON splits it into
  ``startup_s`` (to the first timed loop) and ``shutdown_s`` (after the last).
* Per-step breakdown, ms per trainer step within the window: the keys of ``ctx.timings``
  when the trainer context exposes it (cumulative seconds by phase: compute, data,
  serialize, network, update, barrier, wait; differenced over the window), and always the
  loop's own: ``loop_data`` (``next(batches)``: leasing, Parquet reads, task reports),
  ``loop_forward`` (forward + loss), ``loop_step`` (``ctx.step``: backward, push, pull,
  barrier), ``loop_total``. The ``ctx.timings`` keys do not add up to a step: calls to
  several pservers run in parallel, and with ``overlap`` beside backward and forward, so
  ``network``, ``serialize`` and ``update`` may exceed the step; ``wait`` is the time the
  trainer thread was blocked on them. The torch baseline's: forward (+ loss), backward,
  optimizer (``opt.step`` + ``zero_grad``).

Run
---
    .venv/bin/python bench/end_to_end.py --quick            # ~1.5 min on 2 cores
    .venv/bin/python bench/end_to_end.py                    # all 24 configurations, ~6-8 min on 2 cores
    .venv/bin/python bench/end_to_end.py --transports inproc --modes async --trainers 1 2
    .venv/bin/python bench/end_to_end.py --json             # progress on stderr, one JSON line on stdout

Without ``--json`` the table and breakdowns go to stdout and the progress to stderr.
About half of the full run is the gRPC launches' start-up (5-7 processes importing
torch), which the pipelining above partly hides.

How to read it
--------------
A ratio of 1.0 would be pdps training as fast as one torch process on the same machine.
On one machine pdps shares the cores with itself: trainers, pservers (which apply the
update) and, over gRPC, (de)serialization and the loopback; more trainers do not add
cores. Compare rows within one run (the same machine, the same load); compare runs
through their ratios, and only when the before/after baselines agree. The gRPC trainers
compute with one intra-op thread each (the launcher's share of 2 cores; column
``threads``), the baseline and in-process trainers with torch's default. Other
processes on the machine hurt the baseline's multi-threaded loop more than pdps's
(measured on a busy 2-core machine: the same loop 1.5-5x slower than with 1 thread or
on a fresh thread), which shows as ratios above 1: distrust a run whose load average
(printed at start and end) exceeds the core count.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import resource
import shlex
import shutil
import statistics
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway etcd)

import pdps  # noqa: E402
from bench import e2e_train  # noqa: E402
from bench.machine import describe  # noqa: E402
from pdps.adapters.parquet import write_parquet_shards  # noqa: E402

BATCH = 64
LR = 0.01
WIDTH_IN = 784
CLASSES = 10
NUM_SLOTS = 256
TARGET = f"{ROOT / 'bench' / 'e2e_train.py'}:train"
ROWS_PER_TASK = 256  # 4 batches per task
WARMUP = 4  # steps per trainer not timed
SAMPLES_PER_TRAINER = 2816  # 44 steps = 11 tasks per trainer: 40 timed after the warm-up
QUICK_SAMPLES_PER_TRAINER = 1536  # 24 steps = 6 tasks: 20 timed
LAUNCH_GRACE_S = 5.0  # the roles' --grace
LAUNCH_STOP_S = 30.0  # a launcher past its time gets SIGTERM, then SIGKILL this long after
SETTLE_S = 3.0  # seconds of quiet after os.sync() before the first baseline
STALL_S = 60.0  # a job whose count of finished tasks has not grown for this long is stopped
PROGRESS = re.compile(r"^pass \d+/\d+\s+tasks (\d+)/")  # the launcher's progress line
BREAKDOWN_KEYS = ("compute", "data", "serialize", "network", "update", "barrier", "wait")


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


class RunFailed(RuntimeError):
    pass


# --- data and the torch baseline --------------------------------------------------------


def write_dataset(root: Path, samples: int, rows_per_task: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, WIDTH_IN), dtype=np.float32)
    y = rng.integers(0, CLASSES, size=samples, dtype=np.int64)
    write_parquet_shards({"x": x, "y": y}, str(root), shards=1, row_group_size=rows_per_task)
    return torch.from_numpy(x), torch.from_numpy(y)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def torch_baseline(x: torch.Tensor, y: torch.Tensor, samples: int, warmup: int, seed: int) -> dict[str, Any]:
    """Plain single-process torch training of the same model, batch and optimizer."""
    model = e2e_train.make_model(seed)
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

    for i in range(warmup):
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
        "steps": steps,
        "seconds": seconds,
        "samples_per_s": n / seconds,
        "ms_per_step": ms(seconds),
        "cpu_cores_used": cpu / seconds,
        "torch_threads": torch.get_num_threads(),
        "breakdown_ms": {"forward": ms(fwd), "backward": ms(bwd), "optimizer": ms(upd)},
    }


# --- one configuration ------------------------------------------------------------------


def records_in(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("trainer-*.json"))]


def summarize(records: list[dict[str, Any]], trainers: int) -> dict[str, Any]:
    """The configuration's figures from its trainers' records."""
    if len(records) != trainers:
        raise RunFailed(f"{len(records)} trainer records, expected {trainers}")
    timed = [r for r in records if r["loop_start"] is not None and r["steps"]]
    if not timed:
        raise RunFailed(f"no trainer stepped past its warm-up ({[r['total_steps'] for r in records]} steps): give more --samples")
    samples = sum(r["samples"] for r in timed)
    steps = sum(r["steps"] for r in timed)
    start = min(r["loop_start"] for r in timed)
    end = max(r["loop_end"] for r in timed)
    seconds = end - start
    ms = lambda v: 1000.0 * v / steps  # noqa: E731
    breakdown: dict[str, float] = {}
    deltas = [r["timings"] for r in timed]
    has_timings = all(d is not None for d in deltas)
    if has_timings:
        keys = sorted({k for d in deltas for k in d}, key=lambda k: (BREAKDOWN_KEYS.index(k) if k in BREAKDOWN_KEYS else 99, k))
        for k in keys:
            breakdown[k] = ms(sum(d.get(k, 0.0) for d in deltas))
    breakdown["loop_data"] = ms(sum(r["data_s"] for r in timed))
    breakdown["loop_forward"] = ms(sum(r["forward_s"] for r in timed))
    breakdown["loop_step"] = ms(sum(r["step_s"] for r in timed))
    breakdown["loop_total"] = ms(sum(r["loop_seconds"] for r in timed))
    return {
        "samples": samples,
        "seconds": seconds,
        "samples_per_s": samples / seconds,
        "trainer_steps": steps,
        "steps_per_trainer": [r["steps"] for r in records],
        "warmup_steps": sum(r["warmup_steps"] for r in records),
        "total_samples": sum(r["total_samples"] for r in records),
        "loop_start": start,
        "loop_end": end,
        "loop_start_spread_s": max(r["loop_start"] for r in timed) - start,
        "loop_end_spread_s": end - min(r["loop_end"] for r in timed),
        "stale_pushes": sum(r["stale_pushes"] for r in records),
        "tasks_done": sum(r["tasks_done"] for r in records),
        "trainer_torch_threads": sorted({r["torch_threads"] for r in records}),
        "overlap": records[0].get("overlap"),
        "attach_s_max": max(r["attach_s"] for r in records),
        "has_ctx_timings": has_timings,
        "breakdown_ms": breakdown,
    }


def job_settings(args: argparse.Namespace, mode: str, trainers: int, pservers: int, replicas: int = 1) -> dict[str, Any]:
    return {
        "mode": mode,
        "trainers": trainers,
        "pservers": pservers,
        "replicas": replicas,
        "batch_size": BATCH,
        "optimizer": "SGD",
        "optimizer_args": {"lr": LR},
        "push_every": 1,
        "pull_every": 1,
        "min_block": args.min_block,
        "num_slots": NUM_SLOTS,
        "passes": 1,
        "overlap": args.overlap,
    }


class Stall:
    """Raises once the most tasks seen finished has not grown for ``STALL_S`` (e.g. a job
    that keeps rolling back): a stuck configuration costs minutes, not its whole timeout."""

    def __init__(self) -> None:
        self.best, self.since = -1, time.monotonic()

    def saw(self, done: int) -> None:
        if done > self.best:
            self.best, self.since = done, time.monotonic()
        elif time.monotonic() - self.since > STALL_S:
            raise RunFailed(f"no progress for {STALL_S:.0f}s: at most {max(self.best, 0)} tasks finished")


def run_inproc(args: argparse.Namespace, data: Path, out: Path, mode: str, trainers: int, pservers: int, replicas: int = 1) -> dict[str, Any]:
    fn = functools.partial(e2e_train.run, out_dir=str(out), warmup=args.warmup, seed=args.seed)
    (out / "go").touch()
    stall = Stall()
    cpu0, wall0 = cpu_seconds(), time.perf_counter()
    result = pdps.simulate(
        fn,
        dataset=str(data),
        store="memory://",
        transport="inproc://",
        timeout=args.job_timeout,
        progress=lambda p: stall.saw(int(p["done"])),  # called about once a second; raising ends the job
        **job_settings(args, mode, trainers, pservers, replicas),
    )
    cores = (cpu_seconds() - cpu0) / (time.perf_counter() - wall0)
    row = summarize(records_in(out), trainers)
    row.update(
        sim_seconds=result.seconds,
        sim_samples_per_s=row["total_samples"] / result.seconds,
        pserver_updates=result.steps,
        cpu_cores_used=cores,
    )
    return row


class Launch:
    """One ``pdps launch`` subprocess: stdout (its JSON summary) and stderr (the roles' logs) to files."""

    def __init__(self, args: argparse.Namespace, store_url: str, data: Path, out: Path, mode: str, trainers: int, pservers: int, replicas: int = 1) -> None:
        self.out, self.trainers = out, trainers
        self.job = f"e2e-{uuid.uuid4().hex[:10]}"
        self.log_path, self.stdout_path = out.with_suffix(".log"), out.with_suffix(".stdout")
        s = job_settings(args, mode, trainers, pservers, replicas)
        self.argv = [
            sys.executable, "-m", "pdps", "launch",
            "--store", store_url,
            "--job", self.job,
            "--transport", "grpc",
            "--dataset", str(data),
            "--trainers", str(trainers),
            "--pservers", str(pservers),
            "--replicas", str(replicas),
            "--mode", mode,
            "--batch-size", str(BATCH),
            "--optimizer", "SGD",
            "--lr", str(LR),
            "--push-every", "1",
            "--pull-every", "1",
            "--min-block", str(s["min_block"]),
            "--num-slots", str(NUM_SLOTS),
            "--passes", "1",
            "--overlap", s["overlap"],
            "--restart", "never",
            "--grace", f"{LAUNCH_GRACE_S:g}",
            "--log-level", "WARNING",
            "--timeout", f"{args.job_timeout:g}",
            "--json",
            TARGET,
        ]  # fmt: skip
        env = dict(os.environ)
        env[e2e_train.ENV_DIR] = str(out)
        env[e2e_train.ENV_WARMUP] = str(args.warmup)
        if args.threads is not None:
            env["OMP_NUM_THREADS"] = str(args.threads)  # the launcher keeps a value it is given
        self.timeout = args.job_timeout + 60  # the launcher's own --timeout, plus its start and stop
        self.started = time.time()
        with open(self.log_path, "w") as log, open(self.stdout_path, "w") as stdout:
            log.write("$ " + shlex.join(self.argv) + "\n")
            log.flush()
            self.proc = subprocess.Popen(self.argv, stdout=stdout, stderr=log, text=True, env=env, cwd=ROOT)

    def stop(self) -> None:
        """SIGTERM (the launcher stops its roles in order), SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=LAUNCH_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # its roles get SIGTERM from the kernel (PR_SET_PDEATHSIG)
                self.proc.wait(timeout=10)

    def go(self) -> None:
        (self.out / "go").touch()

    def wait_window(self) -> None:
        """Until every trainer has written its record (its timed loop is over), or the launcher
        exited; a job that makes no progress (``STALL_S``) is stopped."""
        stall, pos, rest = Stall(), 0, b""
        while len(list(self.out.glob("trainer-*.json"))) < self.trainers and self.proc.poll() is None:
            if time.time() - self.started > self.timeout:
                return
            with open(self.log_path, "rb") as f:
                f.seek(pos)
                chunk = f.read()
            pos += len(chunk)
            *lines, rest = (rest + chunk).split(b"\n")
            for line in lines:
                if m := PROGRESS.match(line.decode(errors="replace")):
                    stall.saw(int(m.group(1)))
            try:
                stall.saw(-1)
            except RunFailed:
                self.stop()
                raise
            time.sleep(0.2)

    def finish(self) -> dict[str, Any]:
        """Wait for the launcher to exit (stopping it past its time); the configuration's figures."""
        try:
            self.proc.wait(timeout=max(1.0, self.started + self.timeout - time.time()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise RunFailed(f"pdps launch did not end within {self.timeout:.0f}s") from None
        wall = time.time() - self.started
        summary: dict[str, Any] = {}
        for line in reversed(self.stdout_path.read_text(errors="replace").strip().splitlines()):
            if line.startswith("{"):
                try:
                    summary = json.loads(line)
                except ValueError:
                    pass
                break
        if self.proc.returncode != 0:
            raise RunFailed(f"pdps launch exited with {self.proc.returncode}: {summary.get('error', '(no summary)')}")
        row = summarize(records_in(self.out), self.trainers)
        row.update(
            launch_wall_s=wall,
            launch_seconds=summary.get("seconds"),
            startup_s=row["loop_start"] - self.started,
            shutdown_s=self.started + wall - row["loop_end"],
            pserver_updates=summary.get("steps"),
            job=self.job,
        )
        return row

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(lines[-n:])


# --- main -------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"1 trainer x {{1,2}} pservers, {QUICK_SAMPLES_PER_TRAINER} samples per trainer: ~1.5-2 min on 2 cores")
    p.add_argument("--transports", nargs="+", choices=("inproc", "grpc"), default=None, help="default: inproc grpc")
    p.add_argument("--modes", nargs="+", choices=("sync", "async"), default=None, help="default: sync async")
    p.add_argument("--trainers", nargs="+", type=int, default=None, help="default: 1 2 3 (--quick: 1)")
    p.add_argument("--pservers", nargs="+", type=int, default=None, help="default: 1 2")
    p.add_argument("--samples", type=int, default=None,
                   help=f"samples per configuration, shared by its trainers (default: {SAMPLES_PER_TRAINER} per trainer, "
                        f"--quick {QUICK_SAMPLES_PER_TRAINER}); also the torch baseline's")  # fmt: skip
    p.add_argument("--warmup", type=int, default=WARMUP, help=f"steps per trainer not timed (default {WARMUP})")
    p.add_argument("--rows-per-task", type=int, default=ROWS_PER_TASK, help=f"rows per Parquet row group = per task (default {ROWS_PER_TASK})")
    p.add_argument("--min-block", type=int, default=1 << 18, help="pdps min_block in elements (default 262144)")
    p.add_argument("--job-timeout", type=float, default=None, help="seconds one configuration may take (default: 120 + samples / 20)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads(N) here (baseline, inproc) and OMP_NUM_THREADS=N for the launched roles "
                        "(default: torch's choice here, the launcher's cores / (trainers + pservers) there)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="progress on stderr, one JSON line on stdout")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap", choices=("auto", "on", "off"), default="auto",
                   help="the jobs' overlap setting: push slots during backward, pull during the next forward (default auto: the library's choice)")
    args = p.parse_args(argv)
    args.transports = [t for t in ("inproc", "grpc") if t in (args.transports or ["inproc", "grpc"])]  # in-process first
    args.modes = list(dict.fromkeys(args.modes or ["sync", "async"]))
    args.trainers = list(dict.fromkeys(args.trainers or ([1] if args.quick else [1, 2, 3])))
    args.pservers = list(dict.fromkeys(args.pservers or [1, 2]))
    if min(args.trainers) < 1 or min(args.pservers) < 1 or (args.samples is not None and args.samples < BATCH) or args.warmup < 0:
        p.error("--trainers and --pservers must be >= 1, --samples >= the batch (64), --warmup >= 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be >= 1")
    args.rows_per_task = max(BATCH, (args.rows_per_task // BATCH) * BATCH)  # whole batches per task
    return args


def samples_for(args: argparse.Namespace, trainers: int) -> int:
    """Samples of a configuration with ``trainers`` trainers, in whole tasks."""
    want = args.samples if args.samples is not None else trainers * (QUICK_SAMPLES_PER_TRAINER if args.quick else SAMPLES_PER_TRAINER)
    return max(args.rows_per_task, (want // args.rows_per_task) * args.rows_per_task)


def fmt(v: Any, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    out_fn = say if args.json else (lambda *a: print(*a, flush=True))
    command = shlex.join([sys.executable, *(sys.argv if argv is None else [__file__, *argv])])
    configs = [(tr, m, t, ps) for tr in args.transports for m in args.modes for t in args.trainers for ps in args.pservers]
    samples = {t: samples_for(args, t) for t in args.trainers}
    base_samples = samples_for(args, 1)
    args.job_timeout = args.job_timeout or 120.0 + max(samples.values()) / 20.0  # 20 samples/s: far below anything seen
    load_start = os.getloadavg()
    t_total = time.perf_counter()
    n_params = sum(p.numel() for p in e2e_train.make_model(args.seed).parameters())
    out_fn(f"model {'-'.join(map(str, e2e_train.SIZES))}: {n_params:,} float32 parameters ({n_params * 4 / 2**20:.1f} MiB); "
           f"batch {BATCH}, SGD lr {LR}, async push_every = pull_every = 1, min_block {args.min_block}, {NUM_SLOTS} slots")
    out_fn("data: " + ", ".join(f"{t} trainer(s): {n} samples = {n // args.rows_per_task} tasks" for t, n in samples.items())
           + f" of {args.rows_per_task} rows; {args.warmup} warm-up steps per trainer not timed; {len(configs)} configurations")
    out_fn(f"torch {torch.__version__}, {torch.get_num_threads()} intra-op threads here, os.cpu_count() = {os.cpu_count()}; "
           f"load average at start {load_start[0]:.2f} {load_start[1]:.2f} {load_start[2]:.2f}")

    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    etcd = None
    etcd_version = None
    launches: list[Launch] = []
    tmp = Path(tempfile.mkdtemp(prefix="pdps-e2e-"))

    def done(i: int, cfg: tuple[str, str, int, int], row: dict[str, Any] | None, exc: BaseException | None, seconds: float, launch: Launch | None = None) -> None:
        transport, mode, trainers, pservers = cfg
        name = f"[{i + 1}/{len(configs)}] {transport} {mode} {trainers}x{pservers}"
        if row is None:
            entry = {"transport": transport, "mode": mode, "trainers": trainers, "pservers": pservers, "error": f"{type(exc).__name__}: {exc}"}
            say(f"  {name}: FAILED: {entry['error']}")
            if launch is not None:
                entry["log_tail"] = launch.log_tail()
                say(f"  --- launcher log tail ({launch.log_path}, removed at the end) ---\n{entry['log_tail']}\n  ---")
            failed.append(entry)
            return
        rows.append({"transport": transport, "mode": mode, "trainers": trainers, "pservers": pservers, **row})
        if transport == "inproc":
            extra = f"sim {row['sim_samples_per_s']:.0f} samples/s; {seconds:.1f}s in all"
        else:
            extra = f"launch {row['launch_wall_s']:.1f}s: {row['startup_s']:.1f}s before the timed loop, {row['shutdown_s']:.1f}s after it"
        say(f"  {name}: {row['samples_per_s']:.0f} samples/s over {row['seconds']:.1f}s ({extra})")

    try:
        data: dict[int, Path] = {}
        for t, n in sorted(samples.items()):
            data[t] = tmp / f"data-{n}"
            if not data[t].exists():
                write_dataset(data[t], n, args.rows_per_task, args.seed)
        bx, by = write_dataset(tmp / "baseline", base_samples, args.rows_per_task, args.seed)
        os.sync()  # what an earlier program wrote (a checkpoint suite: GiBs) is not flushed during the baseline
        time.sleep(SETTLE_S)
        base_before = torch_baseline(bx, by, base_samples, warmup=5, seed=args.seed)
        say(f"torch baseline (before): {base_before['samples_per_s']:.0f} samples/s, {base_before['ms_per_step']:.1f} ms/step")

        for i, cfg in enumerate(configs):
            transport, mode, trainers, pservers = cfg
            if transport != "inproc":
                continue
            out = tmp / f"run-{i}"
            out.mkdir()
            t0 = time.perf_counter()
            try:
                done(i, cfg, run_inproc(args, data[trainers], out, mode, trainers, pservers), None, time.perf_counter() - t0)
            except Exception as exc:  # noqa: BLE001 -- reported; the other configurations go on
                done(i, cfg, None, exc, time.perf_counter() - t0)

        grpc = [(i, cfg) for i, cfg in enumerate(configs) if cfg[0] == "grpc"]
        base_middle = None
        if grpc and len(grpc) < len(configs):  # between the transports: a third look at the machine
            base_middle = torch_baseline(bx, by, base_samples, warmup=2, seed=args.seed)
            say(f"torch baseline (between): {base_middle['samples_per_s']:.0f} samples/s, {base_middle['ms_per_step']:.1f} ms/step")
        if grpc:
            from tests.servers import EtcdServer

            etcd = EtcdServer().start(timeout=30.0)
            etcd_version = _etcd_version()
            say(f"etcd at {etcd.url}")
            # Pipelined: the next launch starts (its processes import torch, register) as soon
            # as the previous one's timed loops are over, while it still shuts down; its
            # trainers attach only once the previous launcher has exited ("go").
            prev: tuple[int, tuple[str, str, int, int], Launch] | None = None
            for i, cfg in grpc:
                _, mode, trainers, pservers = cfg
                out = tmp / f"run-{i}"
                out.mkdir()
                launch = Launch(args, etcd.url, data[trainers], out, mode, trainers, pservers)
                launches.append(launch)
                if prev is not None:
                    finish(prev, done)
                launch.go()
                try:
                    launch.wait_window()
                except RunFailed as exc:
                    done(i, cfg, None, exc, time.time() - launch.started, launch)
                    prev = None
                    continue
                prev = (i, cfg, launch)
            if prev is not None:
                finish(prev, done)

        base_after = torch_baseline(bx, by, base_samples, warmup=2, seed=args.seed)
        say(f"torch baseline (after): {base_after['samples_per_s']:.0f} samples/s, {base_after['ms_per_step']:.1f} ms/step")
    finally:
        for launch in launches:
            launch.stop()  # only one still running after an error (or Ctrl-C) midway
        if etcd is not None:
            etcd.stop()
        shutil.rmtree(tmp, ignore_errors=True)

    order = {cfg: k for k, cfg in enumerate(configs)}
    rows.sort(key=lambda r: order[(r["transport"], r["mode"], r["trainers"], r["pservers"])])
    # The median of the looks at the machine (before, between the transports, after): one
    # disturbed by something else running sways the ratios less than in a mean.
    looks = [b for b in (base_before, base_middle, base_after) if b is not None]
    base = statistics.median(b["samples_per_s"] for b in looks)
    for r in rows:
        r["ratio_vs_torch"] = r["samples_per_s"] / base
        if "sim_samples_per_s" in r:
            r["sim_ratio_vs_torch"] = r["sim_samples_per_s"] / base
    torch_breakdown = {k: (base_before["breakdown_ms"][k] + base_after["breakdown_ms"][k]) / 2 for k in base_before["breakdown_ms"]}
    load_end = os.getloadavg()
    total_s = time.perf_counter() - t_total

    # --- human output ---
    out_fn("")
    header = (f"{'transport':<9} {'mode':<5} {'trainers':>8} {'pservers':>8} {'samples':>7} {'seconds':>7} {'samples/s':>9} "
              f"{'ratio':>6}  {'sim samples/s':>13} {'launch s':>8} {'threads':>7}")
    out_fn(header)
    out_fn("-" * len(header))
    out_fn(f"{'torch':<9} {'-':<5} {1:>8} {'-':>8} {base_before['samples']:>7} {'':>7} {base:>9.0f} {1.0:>6.3f}  {'':>13} {'':>8} "
           f"{base_before['torch_threads']:>7}")
    for r in rows:
        threads = ",".join(map(str, r["trainer_torch_threads"]))
        out_fn(f"{r['transport']:<9} {r['mode']:<5} {r['trainers']:>8} {r['pservers']:>8} {r['samples']:>7} {r['seconds']:>7.2f} "
               f"{r['samples_per_s']:>9.0f} {r['ratio_vs_torch']:>6.3f}  {fmt(r.get('sim_samples_per_s'), '>13.0f')} "
               f"{fmt(r.get('launch_wall_s'), '>8.1f')} {threads:>7}")
    for f_ in failed:
        out_fn(f"{f_['transport']:<9} {f_['mode']:<5} {f_['trainers']:>8} {f_['pservers']:>8}  FAILED: {f_['error']}")
    seen = ", ".join(f"{b['samples_per_s']:.0f}" for b in looks)
    out_fn(f"(ratio = samples/s / the median of torch's {seen} samples/s (before, [between the transports,] after); "
           "samples, seconds: the timed window, warm-up excluded; sim samples/s: every sample / simulate's result.seconds; "
           "launch s: the launcher's wall time, start-up and shutdown included; threads: each trainer's torch intra-op threads)")

    out_fn("")
    out_fn("per-step breakdown, ms (torch baseline, mean of before and after):")  # (the breakdown's own figures)
    for k, v in torch_breakdown.items():
        out_fn(f"  {k:<14} {v:8.2f}")
    shown = [r for r in rows if r["mode"] == "async" and r["trainers"] == 1 and r["pservers"] == 2]
    for r in shown:
        note = "" if r["has_ctx_timings"] else "  (no ctx.timings in this pdps: the loop's own figures only)"
        ov = "" if r.get("overlap") is None else f", overlap {'on' if r['overlap'] else 'off'}"
        out_fn(f"per-step breakdown, ms ({r['transport']} async {r['trainers']}x{r['pservers']}, {r['trainer_steps']} steps{ov}):{note}")
        for k, v in r["breakdown_ms"].items():
            out_fn(f"  {k:<14} {v:8.2f}")
    out_fn(f"\ntotal run time {total_s:.0f}s; load average at end {load_end[0]:.2f} {load_end[1]:.2f} {load_end[2]:.2f}")

    if args.json:
        report = {
            "bench": "end_to_end",
            "config": {
                "model": "-".join(map(str, e2e_train.SIZES)),
                "params": n_params,
                "batch_size": BATCH,
                "optimizer": "SGD",
                "lr": LR,
                "samples": base_samples,  # of a 1-trainer configuration, and the torch baseline's
                "samples_by_trainers": {str(t): n for t, n in samples.items()},  # each configuration's dataset
                "push_every": 1,
                "overlap": args.overlap,
                "pull_every": 1,
                "rows_per_task": args.rows_per_task,
                "warmup_steps": args.warmup,
                "min_block": args.min_block,
                "num_slots": NUM_SLOTS,
                "transports": args.transports,
                "modes": args.modes,
                "trainers": args.trainers,
                "pservers": args.pservers,
                "quick": args.quick,
                "seed": args.seed,
                "job_timeout_s": args.job_timeout,
                "threads": args.threads,
            },
            "machine": describe(
                "grpcio", "pyarrow", "pdps",
                torch=torch.__version__,
                numpy=np.__version__,
                etcd=etcd_version,
                torch_threads=torch.get_num_threads(),
                loadavg_start=list(load_start),
                loadavg_end=list(load_end),
            ),  # fmt: skip
            "command": command,
            "torch": {"samples_per_s": base, "before": base_before, "between": base_middle, "after": base_after, "breakdown_ms": torch_breakdown},
            "runs": rows,
            "failed": failed,
            "total_s": total_s,
        }
        print(json.dumps(report), flush=True)
    return 1 if failed else 0


def finish(item: tuple[int, tuple[str, str, int, int], Launch], done: Any) -> None:
    i, cfg, launch = item
    try:
        row = launch.finish()
    except Exception as exc:  # noqa: BLE001 -- reported with the launcher's log; the others go on
        done(i, cfg, None, exc, time.time() - launch.started, launch)
    else:
        done(i, cfg, row, None, time.time() - launch.started, launch)


def _etcd_version() -> str | None:
    try:
        out = subprocess.run(["etcd", "--version"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.splitlines()[0].split(":", 1)[-1].strip() if out else None


if __name__ == "__main__":
    sys.exit(main())
