"""Resizing a running job: live slot migration against stopping, checkpointing and restarting.

A benchmark, not a test: it prints figures and ratios against a baseline measured in
the same run and asserts nothing about speed (it exits 1 only when a resize or a
restore did not happen at all).

What runs
---------
For each model size (``--mib``, default 64 and 1024: float32 matrices of 1,024
columns, 16 of them, ``min_block`` 256 Ki elements, so 1 MiB blocks on 256 slots), one
job in this process: the library's master, pservers and trainers (``--trainers``,
default 1) on a ``memory://`` store, over the gRPC transport on 127.0.0.1 (``--transport
inproc`` for the in-process one), SGD without momentum, ``overlap`` off (a step
returns once its round is applied and pulled). A step's loss is the sum of every
parameter (times 1e-6): forward and backward read and write the whole model, the
push and the pull move all of it, and no time goes to anything else.

* **Live** (``--modes``, default sync): 2 pservers train ``--steps`` steps, then the
  job is resized to 3, 4 and back to 2 pservers (``--resizes``), ``--steps`` steps
  between resizes, as ``pdps scale`` asks (:func:`pdps.runtime.resizing.request_resize`):
  the new pservers are started as ``pdps launch`` starts them, the departed ones
  stopped once the resize is done (they exit by themselves in a launched job).
* **Baseline**, for each resize, what a user has without live resizing: a job with
  the first count and ``checkpoint_url`` (``file://`` under ``--tmp``) trains until a
  checkpoint is committed (``checkpoint_every`` = ``--steps`` rounds), is stopped
  (trainers, pservers, master), and a new job of the same name with the new count
  starts, its trainer attaches, and ``pdps checkpoint restore``
  (:func:`pdps.shell.checkpoint_cli.restore`) rolls it back to that checkpoint, as
  docs/operations.md says a checkpoint restores onto any pserver count. The roles
  restart in this process: the seconds a real restart spends starting processes
  (importing torch: about 2 s each here) are not in the baseline.

Figures, per resize
-------------------
* ``wall``: from the request to the resize record's ``done``; ``states_s``: when the
  record first showed each state (requested, growing, migrating), seconds after the request.
* ``pause``: the longest a trainer waited beyond a usual step: over the gaps between
  consecutive completed steps of each trainer, from its last step completed before the
  request to its first one completed after ``done``, the longest, minus the median
  gap of the ``--steps`` steps before the request (``step``). The longest gap is
  printed too (``gap``).
* ``moved``: the bytes of slot state the pservers sent each other (the sum of
  ``Pserver.sent_bytes`` deltas; ``received_bytes`` must agree), against ``minimum``,
  :func:`pdps.core.elastic.minimum_bytes` of the two maps (SGD: one tensor per element).
* ``restart``: the baseline's pause, its whole time: from the completion of the last
  step the checkpoint holds to the first step completed after the restore, with its
  parts (checkpoint committed, job stopped, new job attached, restored, first step).

Ratios (the targets of ``pdps bench --suite elastic``), for the largest model:
``pause_vs_restart``, the baseline's pause over the live pause (the worst resize;
a live pause shorter than ``PAUSE_FLOOR_S`` counts as that), and ``bytes_vs_minimum``,
moved over minimum (the worst resize of any model).

Run
---
    .venv/bin/python bench/elastic.py                    # ~2.5 min on 2 cores: 64 MiB and 1 GiB
    .venv/bin/python bench/elastic.py --quick            # ~15 s: 8 MiB, 3 steps
    .venv/bin/python bench/elastic.py --mib 64 --modes sync async --transport inproc

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pdps  # noqa: E402
from bench.machine import describe  # noqa: E402
from pdps.adapters.memory_store import MemoryStore  # noqa: E402
from pdps.adapters.torch_compute import TorchCompute  # noqa: E402
from pdps.core.elastic import ResizeState, minimum_bytes  # noqa: E402
from pdps.core.job import Keys, decode_json  # noqa: E402
from pdps.core.slots import DEFAULT_NUM_SLOTS, Layout, ParamSpec  # noqa: E402
from pdps.registry import open_checkpoint_files, open_storage, open_transport  # noqa: E402
from pdps.roles.master import Master  # noqa: E402
from pdps.roles.pserver import Pserver  # noqa: E402
from pdps.runtime.resizing import read_map, request_resize, wait_resized  # noqa: E402
from pdps.shell.checkpoint_cli import restore  # noqa: E402
from pdps.shell.control_plane import Records  # noqa: E402

FULL = {"mib": (64, 1024), "steps": 5, "modes": ("sync",), "resizes": (2, 3, 4, 2)}
QUICK = {"mib": (8,), "steps": 3, "modes": ("sync",), "resizes": (2, 3, 4, 2)}
COLUMNS = 1024
MATRICES = 16
MIN_BLOCK = 256 * COLUMNS  # 1 MiB blocks
GRAD_SCALE = 1e-6
SGD = {"optimizer": "SGD", "optimizer_args": {"lr": 0.1}}
STATE_COPIES = 1  # SGD without momentum: the values alone
PAUSE_FLOOR_S = 0.001  # a live pause shorter than this counts as this in the ratio
JOB = "elastic-bench"
WAIT_S = 600.0  # any one wait: steps, a resize, a checkpoint, a restore


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


class Matrices(torch.nn.Module):
    """``mib`` MiB of float32 parameters: ``MATRICES`` matrices of ``COLUMNS`` columns."""

    def __init__(self, mib: int) -> None:
        super().__init__()
        rows = mib * 2**20 // (4 * COLUMNS * MATRICES)
        if rows < 1:
            raise SystemExit(f"--mib {mib} is too small: at least {4 * COLUMNS * MATRICES / 2**20:g} MiB")
        self.weights = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(rows, COLUMNS)) for _ in range(MATRICES))

    def loss(self) -> torch.Tensor:
        return sum(w.sum() for w in self.weights) * GRAD_SCALE  # type: ignore[return-value]


@attrs.define
class Stepping:
    """When each trainer's applied steps completed (``time.monotonic``), with their round."""

    times: dict[str, list[tuple[float, int | None]]] = attrs.Factory(dict)
    stop: threading.Event = attrs.Factory(threading.Event)
    errors: list[BaseException] = attrs.Factory(list)
    _lock: threading.Lock = attrs.Factory(threading.Lock)

    def loop(self, ctx: pdps.TrainerContext, model: Matrices) -> None:
        try:
            for _ in ctx.batches():
                applied = len(ctx.history)
                ctx.step(model.loss())
                if len(ctx.history) > applied:  # a step a rollback dropped is no step
                    with self._lock:
                        self.times.setdefault(ctx.trainer_id, []).append((time.monotonic(), ctx.history[-1].round))
                if self.stop.is_set():
                    ctx.request_stop()
        except BaseException as exc:  # noqa: BLE001 - reported by wait_steps and at the end
            self.errors.append(exc)

    def count(self) -> int:
        with self._lock:
            return min((len(t) for t in self.times.values()), default=0)

    def of(self, trainer: str) -> list[tuple[float, int | None]]:
        with self._lock:
            return list(self.times.get(trainer, ()))

    def wait_steps(self, n: int, what: str) -> None:
        """Until every trainer has completed ``n`` more steps."""
        want, deadline = self.count() + n, time.monotonic() + WAIT_S
        while self.count() < want:
            if self.errors:
                raise self.errors[0]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: trainers did not complete {n} steps in {WAIT_S:.0f} s")
            time.sleep(0.005)


@attrs.define
class Job:
    """One job's roles, assembled in this process (as ``pdps.simulate`` does, by hand, so
    pservers can be added and their byte counters read)."""

    store: MemoryStore
    transport: Any
    compute: TorchCompute
    config: pdps.JobConfig
    source: Records
    master: Master
    address: str
    pservers: list[Pserver] = attrs.Factory(list)  # every pserver ever started, departed included
    trainers: list[pdps.TrainerContext] = attrs.Factory(list)
    threads: list[threading.Thread] = attrs.Factory(list)
    stepping: Stepping = attrs.Factory(Stepping)

    @property
    def keys(self) -> Keys:
        return Keys(self.config.name)

    def add_pserver(self) -> Pserver:
        ps = Pserver(self.store, self.transport, self.compute, self.config, address=self.address, checkpoints=open_checkpoint_files(self.config.checkpoint_url))
        ps.start()
        self.pservers.append(ps)
        return ps

    def live_pservers(self) -> list[Pserver]:
        return [p for p in self.pservers if not p.departed.is_set() and p.state.value == "serving"]

    def attach(self, mib: int) -> list[Matrices]:
        models = []
        for i in range(self.config.trainers):
            ctx = pdps.TrainerContext(self.store, self.transport, self.compute, self.source, self.config, trainer_id=f"t{i}", publisher="t0")
            ctx.register()
            self.trainers.append(ctx)
        for ctx in self.trainers:  # trainer t0 publishes the model and initializes the pservers
            models.append(ctx.attach(Matrices(mib)))
        return models

    def train(self, models: Sequence[Matrices]) -> None:
        for ctx, model in zip(self.trainers, models):
            t = threading.Thread(target=self.stepping.loop, args=(ctx, model), name=ctx.trainer_id, daemon=True)
            self.threads.append(t)
            t.start()

    def stop_training(self) -> None:
        self.stepping.stop.set()
        for t in self.threads:
            t.join(WAIT_S)
        if any(t.is_alive() for t in self.threads):
            raise TimeoutError("a trainer did not stop")
        if self.stepping.errors:
            raise self.stepping.errors[0]

    def close(self) -> None:
        self.stepping.stop.set()
        for ctx in self.trainers:
            ctx.leave()
        for t in self.threads:
            t.join(WAIT_S)
        for ps in self.pservers:
            ps.stop()
        self.master.stop()
        self.store.close()


def start_job(mib: int, pservers: int, *, transport: str, mode: str, trainers: int, checkpoint_url: str = "", checkpoint_every: int = 0) -> Job:
    store, compute = MemoryStore(), TorchCompute("cpu")
    source = Records(tasks=max(trainers, 1) * 64, records=10_000)
    config = pdps.JobConfig(
        name=JOB, dataset=source.url, pservers=pservers, trainers=trainers, mode=mode, batch_size=1, passes=1,
        min_block=MIN_BLOCK, overlap="off", checkpoint_url=checkpoint_url, checkpoint_every=checkpoint_every, **SGD,
    )  # fmt: skip
    address = "inproc://" if transport == "inproc" else "grpc://127.0.0.1:0"
    tr = open_transport(transport)
    master = Master(store, tr, source, config, address=address, checkpoints=open_checkpoint_files(checkpoint_url))
    master.start()
    job = Job(store, tr, compute, config, source, master, address)
    for _ in range(pservers):
        job.add_pserver()
    return job


# --- live -----------------------------------------------------------------------------


def pause_of(times: Sequence[tuple[float, Any]], asked: float, done: float, steps: int) -> tuple[float, float]:
    """(the longest gap between consecutive completed steps from the last one before
    ``asked`` to the first one after ``done``, the median gap of the ``steps`` before)."""
    stamps = [t for t, _ in times]
    before = [t for t in stamps if t <= asked]
    after = [t for t in stamps if t > done]
    if len(before) < 2 or not after:
        raise RuntimeError(f"too few steps around the resize: {len(before)} before, {len(after)} after")
    window = [before[-1], *(t for t in stamps if before[-1] < t <= after[0])]
    longest = max(b - a for a, b in zip(window, window[1:]))
    usual = before[-(steps + 1):]
    return longest, statistics.median(b - a for a, b in zip(usual, usual[1:]))


def sent(job: Job) -> tuple[int, int]:
    return sum(p.sent_bytes for p in job.pservers), sum(p.received_bytes for p in job.pservers)


def resize_live(job: Job, to: int, steps: int) -> dict[str, Any]:
    keys = job.keys
    before = read_map(job.store, keys)
    sent0, received0 = sent(job)
    rollbacks = sum(ctx.rollbacks for ctx in job.trainers)
    asked = time.monotonic()
    record = request_resize(job.store, keys, pservers=to, by="bench/elastic.py")
    while len(job.live_pservers()) < to:
        job.add_pserver()  # as pdps launch does when ps_desired grows
    states: dict[str, float] = {}  # when the record first showed each state, seconds after the request
    note = lambda r: states.setdefault(r.state.value, time.monotonic() - asked)  # noqa: E731
    finished = wait_resized(job.store, keys, record.id, deadline=time.monotonic() + WAIT_S, progress=note)
    done = time.monotonic()
    if finished is None or finished.state is not ResizeState.DONE or finished.from_map is None or finished.to_map is None:
        raise RuntimeError(f"resize to {to} pservers did not finish: {finished}")
    sent1, received1 = sent(job)
    for ps in [p for p in job.pservers if p.departed.is_set() and p.state.value != "stopped"]:
        ps.stop()  # as its process does: exit 0
    job.stepping.wait_steps(steps, f"after the resize to {to}")
    gaps = [pause_of(job.stepping.of(ctx.trainer_id), asked, done, steps) for ctx in job.trainers]
    longest, usual = max(gaps)
    kv = job.store.get(keys.model)
    specs = [ParamSpec.from_json(d) for d in decode_json(kv.value, kv.key)]  # type: ignore[union-attr]
    layout = Layout.build(specs, finished.from_map, job.config.min_block)
    minimum = minimum_bytes(layout, finished.to_map, STATE_COPIES)
    moved = sent1 - sent0
    return {
        "from": before.num_pservers, "to": to, "wall_s": done - asked, "longest_gap_s": longest, "step_s": usual,
        "pause_s": max(0.0, longest - usual), "slots_moved": len(finished.moves()), "states_s": {**states, "done": done - asked},
        "bytes_moved": moved, "bytes_received": received1 - received0, "bytes_minimum": minimum,
        "bytes_vs_minimum": moved / minimum if minimum else float(moved == 0),
        # a resize should never cost a rollback; one that did shows here, its pause in the figures
        "rollbacks": sum(ctx.rollbacks for ctx in job.trainers) - rollbacks,
    }  # fmt: skip


def live(mib: int, resizes: Sequence[int], steps: int, *, transport: str, mode: str, trainers: int) -> list[dict[str, Any]]:
    job = start_job(mib, resizes[0], transport=transport, mode=mode, trainers=trainers)
    try:
        job.train(job.attach(mib))
        job.stepping.wait_steps(steps + 1, "before the first resize")  # the first step includes the first pull
        rows = []
        for to in resizes[1:]:
            row = resize_live(job, to, steps)
            say(f"  {mib} MiB {mode}: live {row['from']}->{to}: {row['wall_s']:.2f} s, pause {row['pause_s']:.3f} s "
                f"(gap {row['longest_gap_s']:.3f} s, step {row['step_s']:.3f} s), moved {row['bytes_moved'] / 2**20:.1f} MiB "
                f"(minimum {row['bytes_minimum'] / 2**20:.1f})" + (f"; ROLLED BACK {row['rollbacks']}x" if row["rollbacks"] else ""))  # fmt: skip
            rows.append(row)
        job.stop_training()
        return rows
    finally:
        job.close()


# --- baseline: stop, checkpoint, restart with the new count, restore ---------------------


def wait_for(what: str, check: Callable[[], Any], errors: Sequence[BaseException] = ()) -> Any:
    deadline = time.monotonic() + WAIT_S
    while not (got := check()):
        if errors:
            raise errors[0]
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {WAIT_S:.0f} s")
        time.sleep(0.005)
    return got


def restart(mib: int, before: int, after: int, steps: int, *, transport: str, mode: str, trainers: int, tmp: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdps-elastic-", dir=tmp) as folder:
        url = f"{Path(folder).as_uri()}/checkpoints"
        job = start_job(mib, before, transport=transport, mode=mode, trainers=trainers, checkpoint_url=url, checkpoint_every=steps)
        try:
            job.train(job.attach(mib))
            pointer = wait_for("committed checkpoint", lambda: job.store.get(job.keys.checkpoint), job.stepping.errors)
            committed = time.monotonic()
            job.stop_training()  # what the trainers did after the checkpoint is lost: counted from the checkpoint's last step
            ckpt = decode_json(pointer.value, pointer.key)
            held = [t for ctx in job.trainers for t, r in job.stepping.of(ctx.trainer_id) if r is not None and r < int(ckpt["round"])]
            last_held = max(held)
        finally:
            job.close()
        stopped = time.monotonic()
        del job
        gc.collect()
        job = start_job(mib, after, transport=transport, mode=mode, trainers=trainers, checkpoint_url=url)
        try:
            models = job.attach(mib)
            attached = time.monotonic()
            restore(job.store, open_storage(url), JOB, ckpt["id"], force=True)  # the new store never knew it
            wait_for("restore", lambda: all(p.epoch == 1 and p.state.value == "serving" for p in job.pservers))
            restored = time.monotonic()
            job.train(models)
            job.stepping.wait_steps(1, "after the restore")
            first = min(t for ctx in job.trainers for t, _ in job.stepping.of(ctx.trainer_id))
            job.stop_training()
        finally:
            job.close()
    gc.collect()
    return {
        "from": before, "to": after, "checkpoint": ckpt["id"], "checkpoint_round": int(ckpt["round"]),
        "pause_s": first - last_held,
        "parts_s": {"checkpoint committed": committed - last_held, "job stopped": stopped - last_held,
                    "new job attached": attached - last_held, "restored": restored - last_held, "first step": first - last_held},
    }  # fmt: skip


# --- the run --------------------------------------------------------------------------


def run(mibs: Sequence[int], resizes: Sequence[int], steps: int, *, modes: Sequence[str], transport: str, trainers: int, tmp: Path) -> dict[str, Any]:
    runs = []
    for mib in mibs:
        for mode in modes:
            say(f"{mib} MiB, {mode}: live resizes {' -> '.join(map(str, resizes))}")
            rows = live(mib, resizes, steps, transport=transport, mode=mode, trainers=trainers)
            gc.collect()
            for row in rows:
                base = restart(mib, row["from"], row["to"], steps, transport=transport, mode=mode, trainers=trainers, tmp=tmp)
                say(f"  {mib} MiB {mode}: stop, checkpoint, restart {row['from']}->{row['to']}: {base['pause_s']:.2f} s")
                row["restart"] = base
                row["pause_vs_restart"] = base["pause_s"] / max(row["pause_s"], PAUSE_FLOOR_S)
            runs.append({"mib": mib, "mode": mode, "resizes": rows})
    largest = [r for r in runs if r["mib"] == max(mibs)]
    worst_pause = min(((r, x) for r in largest for x in r["resizes"]), key=lambda p: p[1]["pause_vs_restart"])
    worst_bytes = max(((r, x) for r in runs for x in r["resizes"]), key=lambda p: p[1]["bytes_vs_minimum"])
    where = lambda p: {"mib": p[0]["mib"], "mode": p[0]["mode"], "resize": f"{p[1]['from']}->{p[1]['to']}"}  # noqa: E731
    return {
        "runs": runs,
        "ratios": {
            "pause_vs_restart": {"value": worst_pause[1]["pause_vs_restart"], **where(worst_pause)},
            "bytes_vs_minimum": {"value": worst_bytes[1]["bytes_vs_minimum"], **where(worst_bytes)},
        },
    }


def print_table(report: dict[str, Any]) -> None:
    say("")
    say("pause: longest gap between a trainer's consecutive steps from the request to the first step after done, minus "
        "the median step before; restart: from the checkpoint's last step to the first step after the restore")  # fmt: skip
    header = f"{'model':>8} {'mode':<5} {'resize':<6} {'wall s':>7} {'step s':>7} {'gap s':>7} {'pause s':>8} {'restart s':>9} {'restart/pause':>13} {'moved MiB':>10} {'min MiB':>8} {'moved/min':>9} {'rollbacks':>9}"
    say(header)
    for r in report["runs"]:
        for x in r["resizes"]:
            say(f"{r['mib']:>5} MiB {r['mode']:<5} {x['from']}->{x['to']:<3} {x['wall_s']:>7.2f} {x['step_s']:>7.3f} {x['longest_gap_s']:>7.3f} "
                f"{x['pause_s']:>8.3f} {x['restart']['pause_s']:>9.2f} {x['pause_vs_restart']:>13.1f} "
                f"{x['bytes_moved'] / 2**20:>10.1f} {x['bytes_minimum'] / 2**20:>8.1f} {x['bytes_vs_minimum']:>9.3f} {x['rollbacks']:>9}")  # fmt: skip
    say("")
    say("restart, its parts (seconds after the checkpoint's last step):")
    for r in report["runs"]:
        for x in r["resizes"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in x["restart"]["parts_s"].items())
            say(f"  {r['mib']} MiB {r['mode']} {x['from']}->{x['to']}: {parts}")
    say("resize record states (seconds after the request):")
    for r in report["runs"]:
        for x in r["resizes"]:
            say(f"  {r['mib']} MiB {r['mode']} {x['from']}->{x['to']}: " + ", ".join(f"{k} {v:.2f}" for k, v in x["states_s"].items()))
    for name, r in report["ratios"].items():
        say(f"{name}: {r['value']:.3f}x ({r['mib']} MiB, {r['mode']}, {r['resize']})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--mib", type=int, nargs="+", help=f"model sizes in MiB (default {' '.join(map(str, FULL['mib']))})")
    p.add_argument("--resizes", type=int, nargs="+", help="the pserver counts, first the one the job starts with (default 2 3 4 2)")
    p.add_argument("--steps", type=int, help="steps before, between and after resizes; checkpoint_every of the baseline (default 5)")
    p.add_argument("--modes", nargs="+", choices=("sync", "async"), help="default sync")
    p.add_argument("--transport", choices=("grpc", "inproc"), default="grpc")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the baseline's checkpoints go")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['mib'][0]} MiB, {QUICK['steps']} steps")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    mibs, resizes = args.mib or preset["mib"], args.resizes or preset["resizes"]
    steps, modes = args.steps or preset["steps"], args.modes or preset["modes"]
    if len(resizes) < 2 or min(resizes) < 1 or steps < 2 or args.trainers < 1:
        p.error("--resizes needs two counts or more, each at least 1; --steps at least 2; --trainers at least 1")
    began = time.monotonic()
    try:
        report = run(mibs, resizes, steps, modes=modes, transport=args.transport, trainers=args.trainers, tmp=args.tmp)
    except (RuntimeError, TimeoutError, pdps.PdpsError) as exc:
        say(f"bench/elastic.py: {exc}")
        return 1
    report = {
        "config": {"mib": list(mibs), "resizes": list(resizes), "steps": steps, "modes": list(modes), "transport": args.transport,
                   "trainers": args.trainers, "optimizer": "SGD", "min_block": MIN_BLOCK, "num_slots": DEFAULT_NUM_SLOTS},
        **report,
        "machine": describe("torch", "grpcio"),
        "command": shlex.join(["python", "bench/elastic.py", *(argv if argv is not None else sys.argv[1:])]),
        "total_s": time.monotonic() - began,
    }  # fmt: skip
    print_table(report)
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
