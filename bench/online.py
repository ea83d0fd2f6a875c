"""Online training: records/s trained from a Redis stream against the same records read
from Parquet, and the time of a job with one 10x straggler, speculation on against off.

A benchmark, not a test: it prints figures and ratios against baselines measured in the
same run and asserts nothing about speed (it exits 1 only when a job did not train every
record exactly once, or did not run).

What runs
---------
Every job is ``pdps.simulate``: the library's master, pservers and trainers in this
process, on a ``memory://`` store, over inproc. Each measurement is repeated
``--repeats`` times (3; 1 with ``--quick``), a job with its baseline each time, and the
medians are reported.

* **Stream throughput**: ``--records`` records (200,000; 20,000 with ``--quick``) of a
  ``float32[64]`` feature vector and a ``float32`` label, appended once with
  ``pdps.streams.append`` to a Redis stream (``redis-stream://127.0.0.1:PORT/0/...`` on
  a throwaway redis-server of ``tests/servers.py``, on a free loopback port), and
  written once to a Parquet file with row groups of ``TASK_RECORDS`` rows. Each repeat
  trains one job on each: the same MLP (64-256-256-1, ReLU, MSE, SGD), 2 trainers,
  1 pserver, async, batch 256; tasks of ``TASK_RECORDS`` records both ways (a row group
  is a task; the stream is cut into tasks of ``task_records``). The stream job is one
  window of every record (``window_records``, ``windows = 1``), started after the
  records are in the stream, so it reads as fast as it trains. records/s = records /
  the job's training time (``SimulationResult.seconds``: from the trainers' start to
  their end). Both jobs' audits must show every record trained exactly once.
* **Speculation**: a Parquet file of ``SPEC_TASKS`` row groups of ``--steps`` batches of
  ``SPEC_BATCH`` records (8 tasks of 100 steps; 20 with ``--quick``); 3 trainers,
  1 pserver, async; a linear model whose step sleeps ``STEP_S`` (standing in for a
  step's compute: a sleep does not compete for the 2 cores, so the figure is the
  scheduling, not the machine's load). Trainer 0 is slowed 10x (``slow={0: 10}``: each
  of its steps takes 10 times as long). Each repeat runs the job with speculation off,
  then on (``speculation_min_finished = 2``, ``speculation_multiplier`` the default
  1.5). Without speculation the job waits for the straggler's task to end; with it,
  an idle trainer races the straggler's task from the record it had reached, and the
  first to commit a range of records wins. The job time is the training time as above;
  the records trained exactly once come from the pass audit (``pdps status --pass 0``).
  Sync mode is not measured: every sync round waits for every trainer, so the
  straggler slows every round of the job, not only its last task, and a backup attempt
  cannot gain anything.

Ratios
------
* ``stream_vs_parquet``: records/s from the Redis stream over records/s from Parquet
  (medians); no target.
* ``speculation_on_vs_off``: job time with speculation over job time without
  (medians); the target of ``pdps bench --suite online`` is at most 0.6.

Run
---
    .venv/bin/python bench/online.py               # ~1.5 min on 2 cores
    .venv/bin/python bench/online.py --quick       # 1 repeat, 20,000 records, 20 steps per task: ~10 s
    .venv/bin/python bench/online.py --records 400000 --steps 150 --repeats 5

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway redis-server)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import pdps  # noqa: E402
from bench.machine import finish  # noqa: E402
from pdps import streams  # noqa: E402
from pdps.adapters.memory_store import MemoryStore  # noqa: E402
from pdps.adapters.parquet import write_parquet_shards  # noqa: E402
from pdps.shell.status import pass_audit, window_audit  # noqa: E402

FULL = {"records": 200_000, "steps": 100, "repeats": 3}
QUICK = {"records": 20_000, "steps": 20, "repeats": 1}
JOB_TIMEOUT_S = 300.0

# stream throughput
WIDTH, HIDDEN = 64, 256
BATCH = 256
TASK_RECORDS = 2_000  # a task both ways: a Parquet row group, a cut of the stream
THROUGHPUT = {"trainers": 2, "pservers": 1, "mode": "async"}

# speculation
SPEC_TASKS, SPEC_BATCH = 8, 8
STEP_S = 0.01  # a step's stand-in compute
SLOW = 10.0  # trainer 0's steps take this many times as long
SPECULATION = {"trainers": 3, "pservers": 1, "mode": "async"}
MIN_FINISHED = 2  # finished tasks before the median time per record counts


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1))


def train_mlp(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(mlp())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))


def train_sleepy(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(torch.nn.Linear(3, 1))
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
        time.sleep(STEP_S)


def columns(records: int, width: int, seed: int) -> dict[str, np.ndarray]:
    x = np.random.default_rng(seed).standard_normal((records, width)).astype(np.float32)
    return {"x": x, "y": x.sum(axis=1)}


def job(train: Callable[[pdps.TrainerContext], None], dataset: str, audit: Callable[..., dict[str, Any]], records: int, **settings: Any) -> dict[str, Any]:
    """One job on a fresh memory store: its training time and its audit's counts (attempts,
    and those ``beaten``: a backup or the primary that lost its race); a RuntimeError when
    a record was not trained exactly once."""
    store = MemoryStore()
    result = pdps.simulate(train, dataset=dataset, store=store, timeout=JOB_TIMEOUT_S, **settings)
    got = audit(store, result.config.name, 0)
    summary = got["summary"]
    once = summary["records_trained_exactly_once"]
    if summary["failed"] or once != records or summary["records_trained"] != records:
        raise RuntimeError(f"job {result.config.name} on {dataset}: {once} of {records} records trained exactly once ({summary})")
    beaten = sum(a["outcome"] == "beaten" for e in got["entries"] for a in e["attempts"])
    return {"seconds": result.seconds, "records_exactly_once": once, "attempts": summary["attempts_total"], "beaten": beaten}


def throughput(records: int, repeats: int, folder: Path, redis_url: str) -> list[dict[str, Any]]:
    """records/s of the same records from Parquet and from a Redis stream, ``repeats`` times each, interleaved."""
    data = columns(records, WIDTH, 0)
    parquet = (folder / "throughput").as_uri()
    write_parquet_shards(data, parquet, shards=1, row_group_size=TASK_RECORDS)
    stream = redis_url.replace("redis://", "redis-stream://", 1) + f"/bench-online-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()
    streams.append(stream, data)
    say(f"stream throughput: {records:,} records appended to the stream in {time.monotonic() - began:.1f} s")
    rows: dict[str, list[dict[str, Any]]] = {"parquet": [], "redis-stream": []}
    common = dict(THROUGHPUT, batch_size=BATCH)
    for i in range(repeats):
        got = job(train_mlp, parquet, pass_audit, records, **common)
        rows["parquet"].append(got)
        say(f"  repeat {i + 1}/{repeats}: parquet {records / got['seconds']:,.0f} records/s ({got['seconds']:.2f} s)")
        got = job(train_mlp, stream, window_audit, records, **common, window_records=records, windows=1, task_records=TASK_RECORDS, stream_linger=0.0)
        rows["redis-stream"].append(got)
        say(f"  repeat {i + 1}/{repeats}: redis stream {records / got['seconds']:,.0f} records/s ({got['seconds']:.2f} s)")
    out = []
    for source, runs in rows.items():
        each = [records / r["seconds"] for r in runs]
        out.append({"source": source, "records": records, "records_per_s": statistics.median(each), "records_per_s_each": each,
                    "records_exactly_once": min(r["records_exactly_once"] for r in runs)})  # fmt: skip
    return out


def speculation(steps: int, repeats: int, folder: Path) -> list[dict[str, Any]]:
    """Job time with trainer 0 slowed ``SLOW`` times, speculation off and on, ``repeats`` times each, interleaved."""
    records = SPEC_TASKS * steps * SPEC_BATCH
    parquet = (folder / "speculation").as_uri()
    write_parquet_shards(columns(records, 3, 1), parquet, shards=1, row_group_size=steps * SPEC_BATCH)
    rows = {on: {"speculation": on, "records": records, "runs": []} for on in (False, True)}
    for i in range(repeats):
        for on in (False, True):
            got = job(train_sleepy, parquet, pass_audit, records, **SPECULATION, batch_size=SPEC_BATCH, slow={0: SLOW}, speculation=on,
                      speculation_min_finished=MIN_FINISHED)  # fmt: skip
            rows[on]["runs"].append(got)
            say(f"  repeat {i + 1}/{repeats}: speculation {'on ' if on else 'off'} {got['seconds']:.2f} s, "
                f"{got['records_exactly_once']:,} of {records:,} records trained exactly once, {got['attempts']} attempts, {got['beaten']} beaten")  # fmt: skip
    out = []
    for row in rows.values():
        runs = row.pop("runs")
        each = [r["seconds"] for r in runs]
        out.append({**row, "seconds": statistics.median(each), "seconds_each": each,
                    "records_exactly_once": min(r["records_exactly_once"] for r in runs),
                    "attempts_each": [r["attempts"] for r in runs], "beaten_each": [r["beaten"] for r in runs]})  # fmt: skip
    return out


def run(*, records: int, steps: int, repeats: int, tmp: Path) -> dict[str, Any]:
    from tests.servers import RedisServer

    folder = Path(tempfile.mkdtemp(prefix="pdps-online-", dir=tmp))
    try:
        say(f"stream throughput: MLP {WIDTH}-{HIDDEN}-{HIDDEN}-1, batch {BATCH}, {THROUGHPUT['trainers']} trainers x "
            f"{THROUGHPUT['pservers']} pserver, {THROUGHPUT['mode']}, tasks of {TASK_RECORDS:,} records, {repeats} repeat(s)")  # fmt: skip
        with RedisServer() as redis:
            rows = throughput(records, repeats, folder, redis.url)
        say(f"speculation: {SPEC_TASKS} tasks of {steps} steps of {SPEC_BATCH} records, {STEP_S * 1000:g} ms a step, trainer 0 slowed "
            f"{SLOW:g}x, {SPECULATION['trainers']} trainers x {SPECULATION['pservers']} pserver, {SPECULATION['mode']}, {repeats} repeat(s)")  # fmt: skip
        spec = speculation(steps, repeats, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    parquet, stream = (next(r for r in rows if r["source"] == s) for s in ("parquet", "redis-stream"))
    off, on = (next(r for r in spec if r["speculation"] is s) for s in (False, True))
    ratios = {
        "stream_vs_parquet": {"value": stream["records_per_s"] / parquet["records_per_s"],
                              "stream_records_per_s": stream["records_per_s"], "parquet_records_per_s": parquet["records_per_s"]},
        "speculation_on_vs_off": {"value": on["seconds"] / off["seconds"], "on_s": on["seconds"], "off_s": off["seconds"]},
    }  # fmt: skip
    return {"throughput": rows, "speculation": spec, "ratios": ratios}


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    say("")
    say(f"stream throughput: {c['throughput_model']}, batch {c['throughput_batch']}, {c['throughput_trainers']} trainers x "
        f"{c['throughput_pservers']} pserver, async, {c['records']:,} records, median of {c['repeats']}")  # fmt: skip
    say(f"{'source':<13} {'records/s':>10} {'each':>28} {'exactly once':>13}")
    for r in report["throughput"]:
        say(f"{r['source']:<13} {r['records_per_s']:>10,.0f} {', '.join(f'{v:,.0f}' for v in r['records_per_s_each']):>28} {r['records_exactly_once']:>13,}")
    say("")
    say(f"one {c['slow']:g}x straggler: {c['spec_tasks']} tasks of {c['spec_steps']} steps, {c['speculation_trainers']} trainers, async, "
        f"median of {c['repeats']}")  # fmt: skip
    say(f"{'speculation':<11} {'job s':>7} {'each s':>22} {'exactly once':>13} {'records':>8} {'beaten attempts':>15}")
    for r in report["speculation"]:
        say(f"{'on' if r['speculation'] else 'off':<11} {r['seconds']:>7.2f} {', '.join(f'{v:.2f}' for v in r['seconds_each']):>22} "
            f"{r['records_exactly_once']:>13,} {r['records']:>8,} {', '.join(map(str, r['beaten_each'])):>15}")  # fmt: skip
    say("")
    for name, r in report["ratios"].items():
        say(f"{name}: {r['value']:.3f}x")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--records", type=int, help=f"records of the throughput jobs (default {FULL['records']:,}, --quick {QUICK['records']:,})")
    p.add_argument("--steps", type=int, help=f"steps per task of the speculation jobs (default {FULL['steps']}, --quick {QUICK['steps']})")
    p.add_argument("--repeats", type=int, help=f"jobs of each kind, medians reported (default {FULL['repeats']}, --quick {QUICK['repeats']})")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the Parquet files go")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['repeats']} repeat, {QUICK['records']:,} records, {QUICK['steps']} steps per task")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    records, steps, repeats = (getattr(args, k) or preset[k] for k in ("records", "steps", "repeats"))
    if records < TASK_RECORDS or steps < 1 or repeats < 1:
        p.error(f"--records must be at least {TASK_RECORDS}, --steps and --repeats positive")
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)  # the warnings of beaten attempts are the point: counted, not logged
    began = time.monotonic()
    try:
        report = run(records=records, steps=steps, repeats=repeats, tmp=args.tmp)
    except (RuntimeError, pdps.PdpsError) as exc:
        say(f"bench/online.py: {exc}")
        return 1
    finish("bench/online.py", argv, began,
           {"records": records, "repeats": repeats, "throughput_model": f"MLP {WIDTH}-{HIDDEN}-{HIDDEN}-1",
            "throughput_batch": BATCH, "task_records": TASK_RECORDS, "throughput_trainers": THROUGHPUT["trainers"],
            "throughput_pservers": THROUGHPUT["pservers"], "spec_tasks": SPEC_TASKS, "spec_steps": steps, "spec_batch": SPEC_BATCH,
            "step_s": STEP_S, "slow": SLOW, "speculation_trainers": SPECULATION["trainers"], "speculation_min_finished": MIN_FINISHED,
            "mode": "async"},
           report, packages=("torch", "redis"), table=print_table, as_json=args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
