"""Resizing a running job: live slot migration against stopping, checkpointing and restarting.

A benchmark, not a test: it prints figures and ratios against a baseline measured in
the same run and asserts nothing about speed (it exits 1 only when a resize or a
restore did not happen at all, or a role process died).

What runs
---------
For each model size (``--mib``, default 64 and 1024: float32 matrices of 1,024
columns, 16 of them, ``min_block`` 256 Ki elements, so 1 MiB blocks on 256 slots), one
sync job of the library's master, pservers and trainers (``--trainers``, default 1),
SGD without momentum, ``overlap`` off (a step returns once its round is applied and
pulled). A step's loss is the sum of every parameter (times 1e-6): forward and backward
read and write the whole model, the push and the pull move all of it, and no time goes
to anything else (the model and the step: ``bench/elastic_trainer.py``). The roles run
one of two ways:

* **processes** (``--processes``; the default of the full run): each role its own
  process, as a user runs a job. A throwaway etcd on a free 127.0.0.1 port
  (``tests/servers.py``); the job published in it as ``pdps launch`` publishes it, then
  ``python -m pdps master``, ``python -m pdps pserver --index I`` and ``python -m pdps
  trainer --trainer-id trainer-N bench.elastic_trainer:train`` started as ``pdps launch``
  starts them (its environment: the torch threads it gives each role, the die-with-the-
  launcher variable, no metrics), over gRPC on 127.0.0.1; the dataset a Parquet file of
  ones under ``--tmp``, a step per record. Each trainer appends each step's
  ``time.monotonic()`` (one clock for every process of the machine) and round to a
  JSON-lines file the bench reads.
* **in-process** (``--in-process``; the default of ``--quick``): every role a thread of
  this process, on a ``memory://`` store, over gRPC on 127.0.0.1 (``--transport
  inproc`` for the in-process transport). Cheaper to start, but the roles share one
  interpreter: its lock slows every role near a resize (a 340 MiB shard built in
  0.2 s alone took 5.5 s here), which a job of processes never sees.

Each way, with the same model and steps:

* **Live** (``--modes``, default sync): 2 pservers train ``--steps`` steps, then the
  job is resized to 3, 4 and back to 2 pservers (``--resizes``), ``--steps`` steps
  between resizes, as ``pdps scale`` asks (:func:`pdps.runtime.resizing.request_resize`):
  the new pservers are started as ``pdps launch`` starts them when ``ps_desired`` grows
  (the lowest free indexes); the departing ones leave by themselves (processes: they
  must exit 0, having said ``{"left": true}``; in-process: stopped once the resize is
  done).
* **Baseline**, for each resize, what a user has without live resizing: a job with
  the first count and ``checkpoint_url`` (``file://`` under ``--tmp``) trains until a
  checkpoint is committed (``checkpoint_every`` = ``--steps`` rounds), is stopped
  (processes: SIGTERM to the trainers, then to the pservers and the master, as an
  operator stops ``pdps launch``), and a new job of the same name with the new count
  starts (processes: the old job's keys deleted from etcd first, as ``etcdctl del
  --prefix`` would; new processes), its trainer attaches, and ``pdps checkpoint restore
  ID --force`` rolls it back to that checkpoint, as docs/operations.md says a checkpoint
  restores onto any pserver count (processes: the command line, run as a user types
  it; in-process: :func:`pdps.shell.checkpoint_cli.restore`). With processes the
  baseline holds everything a user's restart costs: starting every process (importing
  torch: about 2 s each here), the new trainer training from scratch until the restore
  reaches it. In-process, the roles restart without a process start, so that baseline
  is shorter than a real one.

Figures, per resize
-------------------
* ``wall``: from the request to the resize record's ``done``; ``states_s``: when the
  record first showed each state (requested, growing, migrating), seconds after the request.
* ``pause``: the longest a trainer waited beyond a usual step: over the gaps between
  consecutive completed steps of each trainer, from its last step completed before the
  request to its first one completed after ``done``, the longest, minus the median
  gap of the ``--steps`` steps before the request (``step``). The longest gap is
  printed too (``gap``).
* ``moved``: the bytes of slot state that moved between pservers, against ``minimum``,
  :func:`pdps.core.elastic.minimum_bytes` of the two maps (SGD: one tensor per element).
  In-process: the sum of ``Pserver.sent_bytes`` deltas (``received_bytes``, its
  twin, must agree). Processes: the sum of what each receiving pserver logs, ``pserver
  N received its slots of slot map version V (B bytes) in Xs``, over the receivers of
  the resize's map (the senders log no byte count: ``bytes_received`` = ``bytes_moved``).
* ``restart``: the baseline's pause, its whole time: from the completion of the last
  step the checkpoint holds to the first step completed after the restore, with its
  parts (checkpoint committed, job stopped, new job attached, restored: every pserver
  loaded the checkpoint (processes: when the last one's log line says it did), first step).

Ratios (the targets of ``pdps bench --suite elastic``), for the largest model:
``pause_vs_restart``, the baseline's pause over the live pause (the worst resize;
a live pause shorter than ``PAUSE_FLOOR_S`` counts as that), and ``bytes_vs_minimum``,
moved over minimum (the worst resize of any model). ``config.roles`` in the JSON says
which way the roles ran (``processes`` or ``in-process``).

Run
---
    .venv/bin/python bench/elastic.py                    # processes, 64 MiB and 1 GiB: minutes on 2 cores
    .venv/bin/python bench/elastic.py --quick            # in-process, 8 MiB, 3 steps: ~15 s
    .venv/bin/python bench/elastic.py --quick --processes
    .venv/bin/python bench/elastic.py --in-process --mib 64 --modes sync async --transport inproc

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
``--logs DIR`` (processes): each job's role logs, every line after its arrival time
(``time.monotonic``), and its trainers' steps, to see where a resize's time went.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import IO, Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway etcd)

import numpy as np  # noqa: E402

import pdps  # noqa: E402
from bench.elastic_trainer import MIB, STEPS_FILE, Matrices  # noqa: E402
from bench.machine import finish  # noqa: E402
from pdps.adapters.memory_store import MemoryStore  # noqa: E402
from pdps.adapters.parquet import write_parquet_shards  # noqa: E402
from pdps.adapters.torch_compute import TorchCompute  # noqa: E402
from pdps.core.elastic import Resize, ResizeState, minimum_bytes  # noqa: E402
from pdps.core.errors import Timeout  # noqa: E402
from pdps.core.headcount import free_indexes  # noqa: E402
from pdps.core.job import Keys, decode_json  # noqa: E402
from pdps.core.slots import DEFAULT_NUM_SLOTS, Layout, ParamSpec, SlotMap  # noqa: E402
from pdps.ports.coordination import CoordinationStore  # noqa: E402
from pdps.registry import connect_store, open_checkpoint_files, open_storage, open_transport  # noqa: E402
from pdps.roles.master import Master, publish_job  # noqa: E402
from pdps.roles.pserver import Pserver  # noqa: E402
from pdps.runtime.resizing import read_map, request_resize, wait_resized  # noqa: E402
from pdps.shell.checkpoint_cli import restore  # noqa: E402
from pdps.shell.control_plane import Records  # noqa: E402
from pdps.shell.launch import LAUNCHER_PID  # noqa: E402

FULL = {"mib": (64, 1024), "steps": 5, "modes": ("sync",), "resizes": (2, 3, 4, 2), "roles": "processes"}
QUICK = {"mib": (8,), "steps": 3, "modes": ("sync",), "resizes": (2, 3, 4, 2), "roles": "in-process"}
MIN_BLOCK = 256 * 1024  # 1 MiB blocks of the 1,024-column matrices
SGD = {"optimizer": "SGD", "optimizer_args": {"lr": 0.1}}
STATE_COPIES = 1  # SGD without momentum: the values alone
PAUSE_FLOOR_S = 0.001  # a live pause shorter than this counts as this in the ratio
JOB = "elastic-bench"
TASKS_PER_TRAINER, RECORDS_PER_TASK = 64, 10_000  # a step per record: more than any run takes
# A task lasts RECORDS_PER_TASK steps, hours at 1 GiB: the default task_timeout (60 s)
# would re-queue it mid-run and the trainer drop a step, so it is set past any run, as a
# user sets it past their tasks' length.
TASK_TIMEOUT_S = 3600.0
WAIT_S = 600.0  # any one wait: steps, a resize, a checkpoint, a restore, a process's exit
POLL_S = 0.005
GRACE_S = 20.0  # the role processes' --grace: a trainer finishes its step (seconds at 1 GiB) and leaves
RECEIVED = re.compile(r"pserver (\d+) received its slots of slot map version (\d+) \((\d+) bytes\)")
# logged before the pserver serves the restored epoch (its "entered epoch" line comes after a store write: a small step can beat it)
LOADED = re.compile(r"pserver (\d+) loaded checkpoint (\S+) ")
LOGGED_AT = "%Y-%m-%d %H:%M:%S,%f"  # how a role's log line begins (pdps's %(asctime)s: local time, milliseconds)


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def wait_for(what: str, check: Callable[[], Any], failed: Callable[[], None] = lambda: None) -> Any:
    """``check()``'s first truthy value, polled every ``POLL_S`` for at most ``WAIT_S``;
    ``failed()`` raises when what is waited for can no longer come (a role died)."""
    deadline = time.monotonic() + WAIT_S
    while not (got := check()):
        failed()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} in {WAIT_S:.0f} s")
        time.sleep(POLL_S)
    return got


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


def job_config(pservers: int, *, mode: str, trainers: int, dataset: str, checkpoint_url: str = "", checkpoint_every: int = 0) -> pdps.JobConfig:
    return pdps.JobConfig(
        name=JOB, dataset=dataset, pservers=pservers, trainers=trainers, mode=mode, batch_size=1, passes=1, task_timeout=TASK_TIMEOUT_S,
        min_block=MIN_BLOCK, overlap="off", checkpoint_url=checkpoint_url, checkpoint_every=checkpoint_every, **SGD,
    )  # fmt: skip


@attrs.frozen
class Resized:
    """What one live resize showed, however the roles ran."""

    before: SlotMap
    finished: Resize
    asked: float
    done: float
    states: dict[str, float]
    times: list[list[tuple[float, int | None]]]  # each trainer's completed steps
    moved: int
    received: int
    rollbacks: int


def resize_row(store: CoordinationStore, config: pdps.JobConfig, r: Resized, steps: int) -> dict[str, Any]:
    """The figures of one resize (see the module's docstring)."""
    assert r.finished.from_map is not None and r.finished.to_map is not None
    longest, usual = max(pause_of(t, r.asked, r.done, steps) for t in r.times)
    keys = Keys(config.name)
    kv = store.get(keys.model)
    specs = [ParamSpec.from_json(d) for d in decode_json(kv.value, kv.key)]  # type: ignore[union-attr]
    minimum = minimum_bytes(Layout.build(specs, r.finished.from_map, config.min_block), r.finished.to_map, STATE_COPIES)
    return {
        "from": r.before.num_pservers, "to": r.finished.pservers, "wall_s": r.done - r.asked, "longest_gap_s": longest, "step_s": usual,
        "pause_s": max(0.0, longest - usual), "slots_moved": len(r.finished.moves()), "states_s": {**r.states, "done": r.done - r.asked},
        "bytes_moved": r.moved, "bytes_received": r.received, "bytes_minimum": minimum,
        "bytes_vs_minimum": r.moved / minimum if minimum else float(r.moved == 0),
        # a resize should never cost a rollback; one that did shows here, its pause in the figures
        "rollbacks": r.rollbacks,
    }  # fmt: skip


def resize(store: CoordinationStore, keys: Keys, to: int, *, started: Callable[[], None], failed: Callable[[], None]) -> tuple[float, float, Resize, dict[str, float]]:
    """Ask for ``to`` pservers as ``pdps scale`` does, ``started()`` the pservers it adds,
    wait for ``done``: (asked, done, the finished record, when it showed each state)."""
    asked = time.monotonic()
    record = request_resize(store, keys, pservers=to, by="bench/elastic.py")
    started()
    states: dict[str, float] = {}  # when the record first showed each state, seconds after the request
    note = lambda r: states.setdefault(r.state.value, time.monotonic() - asked)  # noqa: E731
    deadline = asked + WAIT_S
    while True:
        try:  # a second at a time, to notice a role that died meanwhile
            finished = wait_resized(store, keys, record.id, deadline=min(deadline, time.monotonic() + 1.0), progress=note)
            break
        except Timeout:
            failed()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the resize to {to} pservers did not finish in {WAIT_S:.0f} s") from None
    done = time.monotonic()
    if finished is None or finished.state is not ResizeState.DONE or finished.from_map is None or finished.to_map is None:
        raise RuntimeError(f"resize to {to} pservers did not finish: {finished}")
    return asked, done, finished, states


def say_live(mib: int, mode: str, row: dict[str, Any]) -> None:
    say(f"  {mib} MiB {mode}: live {row['from']}->{row['to']}: {row['wall_s']:.2f} s, pause {row['pause_s']:.3f} s "
        f"(gap {row['longest_gap_s']:.3f} s, step {row['step_s']:.3f} s), moved {row['bytes_moved'] / 2**20:.1f} MiB "
        f"(minimum {row['bytes_minimum'] / 2**20:.1f})" + (f"; ROLLED BACK {row['rollbacks']}x" if row["rollbacks"] else ""))  # fmt: skip


def restart_row(before: int, after: int, ckpt: dict[str, Any], last_held: float, parts: dict[str, float]) -> dict[str, Any]:
    """The baseline's figures: ``parts`` are the monotonic times of its stages, the last the first step.
    Each stage counts as ended no earlier than the one before it and the last step the
    checkpoint holds: the bench may see the checkpoint's pointer before a trainer has
    logged the step the checkpoint holds (the commit does not wait for the trainer)."""
    ended, at = {}, last_held
    for stage, t in parts.items():
        at = max(at, t)
        ended[stage] = at - last_held
    return {
        "from": before, "to": after, "checkpoint": ckpt["id"], "checkpoint_round": int(ckpt["round"]),
        "pause_s": ended["first step"], "parts_s": ended,
    }  # fmt: skip


# --- in-process: every role a thread of this process -------------------------------------


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

    def failed(self) -> None:
        if self.errors:
            raise self.errors[0]

    def wait_steps(self, n: int, what: str) -> None:
        """Until every trainer has completed ``n`` more steps."""
        want = self.count() + n
        wait_for(f"{n} steps of every trainer {what}", lambda: self.count() >= want, self.failed)


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
        self.stepping.failed()

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
    source = Records(tasks=max(trainers, 1) * TASKS_PER_TRAINER, records=RECORDS_PER_TASK)
    config = job_config(pservers, mode=mode, trainers=trainers, dataset=source.url, checkpoint_url=checkpoint_url, checkpoint_every=checkpoint_every)
    address = "inproc://" if transport == "inproc" else "grpc://127.0.0.1:0"
    tr = open_transport(transport)
    master = Master(store, tr, source, config, address=address, checkpoints=open_checkpoint_files(checkpoint_url))
    master.start()
    job = Job(store, tr, compute, config, source, master, address)
    for _ in range(pservers):
        job.add_pserver()
    return job


def sent(job: Job) -> tuple[int, int]:
    return sum(p.sent_bytes for p in job.pservers), sum(p.received_bytes for p in job.pservers)


def resize_live(job: Job, to: int, steps: int) -> dict[str, Any]:
    before = read_map(job.store, job.keys)
    sent0, received0 = sent(job)
    rollbacks = sum(ctx.rollbacks for ctx in job.trainers)

    def started() -> None:
        while len(job.live_pservers()) < to:
            job.add_pserver()  # as pdps launch does when ps_desired grows

    asked, done, finished, states = resize(job.store, job.keys, to, started=started, failed=job.stepping.failed)
    sent1, received1 = sent(job)
    for ps in [p for p in job.pservers if p.departed.is_set() and p.state.value != "stopped"]:
        ps.stop()  # as its process does: exit 0
    job.stepping.wait_steps(steps, f"after the resize to {to}")
    times = [job.stepping.of(ctx.trainer_id) for ctx in job.trainers]
    rolled = sum(ctx.rollbacks for ctx in job.trainers) - rollbacks
    return resize_row(job.store, job.config, Resized(before, finished, asked, done, states, times, sent1 - sent0, received1 - received0, rolled), steps)


def live(mib: int, resizes: Sequence[int], steps: int, *, transport: str, mode: str, trainers: int) -> list[dict[str, Any]]:
    job = start_job(mib, resizes[0], transport=transport, mode=mode, trainers=trainers)
    try:
        job.train(job.attach(mib))
        job.stepping.wait_steps(steps + 1, "before the first resize")  # the first step includes the first pull
        rows = []
        for to in resizes[1:]:
            row = resize_live(job, to, steps)
            say_live(mib, mode, row)
            rows.append(row)
        job.stop_training()
        return rows
    finally:
        job.close()


def restart(mib: int, before: int, after: int, steps: int, *, transport: str, mode: str, trainers: int, tmp: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="pdps-elastic-", dir=tmp) as folder:
        url = f"{Path(folder).as_uri()}/checkpoints"
        job = start_job(mib, before, transport=transport, mode=mode, trainers=trainers, checkpoint_url=url, checkpoint_every=steps)
        try:
            job.train(job.attach(mib))
            pointer = wait_for("committed checkpoint", lambda: job.store.get(job.keys.checkpoint), job.stepping.failed)
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
    parts = {"checkpoint committed": committed, "job stopped": stopped, "new job attached": attached, "restored": restored, "first step": first}
    return restart_row(before, after, ckpt, last_held, parts)


# --- processes: every role its own process, as pdps launch starts them ---------------------


class RoleProcess:
    """One role process; its stderr lines kept with their arrival times, its stdout's JSON objects."""

    def __init__(self, name: str, kind: str, argv: list[str], env: dict[str, str], index: int | None = None) -> None:
        self.name, self.kind, self.index = name, kind, index
        self.leaves = False  # a resize removes it: its exit 0 is expected
        self.lines: list[tuple[float, str]] = []
        self.said: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1,
            start_new_session=True,  # as pdps launch: a terminal's Ctrl-C reaches the bench, which stops the roles in order
        )  # fmt: skip
        self._threads = [threading.Thread(target=self._drain, args=(s, out), daemon=True, name=f"{name}-{what}")
                         for s, out, what in ((self.proc.stderr, False, "stderr"), (self.proc.stdout, True, "stdout"))]  # fmt: skip
        for t in self._threads:
            t.start()

    def _drain(self, stream: IO[str], stdout: bool) -> None:
        for line in stream:
            now, line = time.monotonic(), line.rstrip("\n")
            with self._lock:
                if not stdout:
                    self.lines.append((now, line))
                elif line.startswith("{"):
                    with contextlib.suppress(ValueError):
                        self.said.append(json.loads(line))

    def matches(self, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        with self._lock:
            return [(at, m) for at, line in self.lines if (m := pattern.search(line))]

    def last_lines(self, n: int = 15) -> str:
        for t in self._threads:
            t.join(timeout=2)  # what it wrote before it exited
        with self._lock:
            return "\n".join(f"    {line}" for _, line in self.lines[-n:])

    def exited(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        """Its exit code; SIGKILL when it has not exited ``timeout`` seconds from now."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            say(f"  {self.name} did not exit {timeout:.0f} s after SIGTERM; killing it")
            self.proc.kill()
            return self.proc.wait(10)

    def close(self) -> None:
        for t in self._threads:
            t.join(timeout=5)


class StepLog:
    """The JSON lines the trainers of one job append (``bench/elastic_trainer.py``), read as they come."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: dict[str, list[dict[str, Any]]] = {}
        self.attached: dict[str, float] = {}
        self._offset = 0

    def read(self) -> StepLog:
        with contextlib.suppress(FileNotFoundError), open(self.path, "rb") as f:
            f.seek(self._offset)
            got = f.read()
            whole = got[: got.rfind(b"\n") + 1]  # a line still being written waits for the next read
            self._offset += len(whole)
            for line in whole.decode().splitlines():
                record = json.loads(line)
                if "attached" in record:
                    self.attached[record["trainer"]] = record["attached"]
                else:
                    self.steps.setdefault(record["trainer"], []).append(record)
        return self

    def count(self, trainers: Sequence[str]) -> int:
        self.read()
        return min(len(self.steps.get(t, ())) for t in trainers)

    def of(self, trainer: str) -> list[tuple[float, int | None]]:
        return [(s["t"], s["round"]) for s in self.read().steps.get(trainer, ())]

    def rollbacks(self) -> int:
        return sum(s[-1]["rollbacks"] for s in self.read().steps.values() if s)


@attrs.frozen
class Place:
    """Where the processes' jobs run: the run's etcd, the folder for their files, and
    where their logs are kept (``--logs``; None: nowhere)."""

    store_url: str
    tmp: Path
    logs: Path | None = None


class ProcessJob:
    """One job whose roles are processes, on the run's etcd."""

    def __init__(self, place: Place, config: pdps.JobConfig, mib: int, folder: Path) -> None:
        self.store_url, self.config = place.store_url, config
        self.keys = Keys(config.name)
        self.store = connect_store(self.store_url)
        self.roles: list[RoleProcess] = []
        self.steps = StepLog(folder / f"steps-{time.monotonic_ns()}.jsonl")
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PDPS_")}
        self.env.update({
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),  # this checkout's pdps and bench/
            LAUNCHER_PID: str(os.getpid()),  # the roles stop if the bench dies
            STEPS_FILE: str(self.steps.path), MIB: str(mib),
        })  # fmt: skip
        # the torch threads pdps launch gives each role: the cores shared among the trainers, one for the others
        cores = os.cpu_count() or 1
        self._threads = {} if "OMP_NUM_THREADS" in os.environ else {"trainer": str(max(1, cores // config.trainers)), "pserver": "1", "master": "1"}

    @classmethod
    @contextlib.contextmanager
    def running(cls, place: Place, config: pdps.JobConfig, mib: int, folder: Path, label: str) -> Iterator[ProcessJob]:
        """The job published (as ``pdps launch`` publishes it) and its roles started; every
        role stopped and the store closed on the way out, whatever happened (and its logs
        kept under ``place.logs/label``)."""
        job = cls(place, config, mib, folder)
        try:
            # One job of this name at a time on the run's etcd: the previous one's keys go
            # first, as an operator clears them (etcdctl del --prefix /pdps/<job>/).
            job.store.delete_prefix(job.keys.root)
            publish_job(job.store, config)
            job.start("master", "master")
            for i in range(config.pservers):
                job.add_pserver(i)
            for i in range(config.trainers):
                job.start("trainer", f"trainer-{i}", "--trainer-id", f"trainer-{i}", "bench.elastic_trainer:train")
            yield job
        finally:
            try:
                job.stop()
            finally:
                job.store.close()
                if place.logs is not None:
                    job.keep_logs(place.logs / label)

    @property
    def trainer_ids(self) -> list[str]:
        return [r.name for r in self.roles if r.kind == "trainer"]

    def start(self, kind: str, name: str, *extra: str, index: int | None = None) -> RoleProcess:
        """``python -m pdps KIND``, with the settings pdps launch hands its roles."""
        argv = [sys.executable, "-m", "pdps", kind, "--store", self.store_url, "--job", self.config.name, "--grace", f"{GRACE_S:g}", "--metrics-port", "none", *extra]
        env = {**self.env, **({"OMP_NUM_THREADS": self._threads[kind]} if kind in self._threads else {})}
        role = RoleProcess(name, kind, argv, env, index)
        self.roles.append(role)
        return role

    def add_pserver(self, index: int) -> RoleProcess:
        return self.start("pserver", f"pserver-{index}", "--index", str(index), index=index)

    def pservers(self) -> list[RoleProcess]:
        """The pservers taking part: started, and not removed by a resize."""
        return [r for r in self.roles if r.kind == "pserver" and not r.leaves]

    def failed(self) -> None:
        """Raise if a role exited that should not have (a pserver a resize removes may exit 0)."""
        for r in self.roles:
            code = r.exited()
            if code is not None and not (r.leaves and code == 0):
                raise RuntimeError(f"{r.name} exited with {code}; its last lines:\n{r.last_lines()}")

    def wait_steps(self, n: int, what: str) -> None:
        """Until every trainer has completed ``n`` more steps."""
        ids = self.trainer_ids
        want = self.steps.count(ids) + n
        wait_for(f"{n} steps of every trainer {what}", lambda: self.steps.count(ids) >= want, self.failed)

    def stop(self) -> None:
        """As ``pdps launch`` stops its roles: SIGTERM to the trainers, then to the pservers
        and the master; SIGKILL to what is still running ``GRACE_S`` + 5 s later."""
        for kinds in (("trainer",), ("pserver", "master")):
            live = [r for r in self.roles if r.kind in kinds and r.exited() is None]
            for r in live:
                r.terminate()
            for r in live:
                r.wait(GRACE_S + 5)
        for r in self.roles:
            r.close()

    def keep_logs(self, folder: Path) -> None:
        """Each role's stderr, every line after its arrival time (``time.monotonic``), and the steps file."""
        folder.mkdir(parents=True, exist_ok=True)
        for r in self.roles:
            (folder / f"{r.name}.log").write_text("".join(f"{at:.3f} {line}\n" for at, line in r.lines))
        with contextlib.suppress(FileNotFoundError):
            (folder / "steps.jsonl").write_bytes(self.steps.path.read_bytes())


def logged_at(line: str) -> float:
    """The ``time.monotonic()`` at which a role wrote a log line, from the line's own time:
    its arrival in the bench may come after a step the line's event allowed."""
    return datetime.strptime(line[:23], LOGGED_AT).timestamp() - (time.time() - time.monotonic())


def write_dataset(folder: Path, trainers: int) -> str:
    """Parquet of ``RECORDS_PER_TASK`` ones per task (a row group each), ``TASKS_PER_TRAINER`` tasks a trainer."""
    rows = trainers * TASKS_PER_TRAINER * RECORDS_PER_TASK
    write_parquet_shards({"x": np.ones(rows, dtype=np.float32)}, (folder / "data").as_uri(), shards=1, row_group_size=RECORDS_PER_TASK)
    return (folder / "data").as_uri()


def received(job: ProcessJob, version: int) -> dict[int, int]:
    """Bytes each pserver logged it received for slot map ``version``."""
    out: dict[int, int] = {}
    for r in job.roles:
        for _, m in r.matches(RECEIVED):
            if int(m.group(2)) == version:
                out[int(m.group(1))] = out.get(int(m.group(1)), 0) + int(m.group(3))
    return out


def resize_processes(job: ProcessJob, to: int, steps: int) -> dict[str, Any]:
    before = read_map(job.store, job.keys)
    rollbacks = job.steps.rollbacks()
    leaving = [r for r in job.pservers() if r.index is not None and r.index >= to]
    for r in leaving:
        r.leaves = True  # the map of `to` pservers holds indexes 0 .. to-1

    def started() -> None:  # as pdps launch does when ps_desired grows: the lowest free indexes
        for index in free_indexes((r.index for r in job.pservers() if r.index is not None), to - len(job.pservers())):
            job.add_pserver(index)

    asked, done, finished, states = resize(job.store, job.keys, to, started=started, failed=job.failed)
    assert finished.to_map is not None
    receivers, version = finished.receivers(), finished.to_map.version

    def logged() -> dict[int, int] | None:
        got = received(job, version)
        return got if set(receivers) <= set(got) else None

    got = wait_for(f"log lines of pservers {receivers} receiving their slots of map {version}", logged, job.failed)
    for r in leaving:
        code = r.wait(WAIT_S)
        if code != 0 or not any(said.get("left") is True for said in r.said):
            raise RuntimeError(f"{r.name}, removed by the resize to {to}, exited with {code} (said {r.said}), not 0 after saying it left; its last lines:\n{r.last_lines()}")
    job.wait_steps(steps, f"after the resize to {to}")
    times = [job.steps.of(t) for t in job.trainer_ids]
    moved = sum(got.values())
    return resize_row(job.store, job.config, Resized(before, finished, asked, done, states, times, moved, moved, job.steps.rollbacks() - rollbacks), steps)


def live_processes(mib: int, resizes: Sequence[int], steps: int, *, mode: str, trainers: int, place: Place) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="pdps-elastic-", dir=place.tmp) as folder:
        config = job_config(resizes[0], mode=mode, trainers=trainers, dataset=write_dataset(Path(folder), trainers))
        with ProcessJob.running(place, config, mib, Path(folder), f"{mib}MiB-{mode}-live") as job:
            job.wait_steps(steps + 1, "before the first resize")  # the first step includes the first pull
            rows = []
            for to in resizes[1:]:
                row = resize_processes(job, to, steps)
                say_live(mib, mode, row)
                rows.append(row)
            return rows


def restart_processes(mib: int, before: int, after: int, steps: int, *, mode: str, trainers: int, place: Place) -> dict[str, Any]:
    label = f"{mib}MiB-{mode}-restart-{before}to{after}"
    with tempfile.TemporaryDirectory(prefix="pdps-elastic-", dir=place.tmp) as folder:
        url, dataset = f"{Path(folder).as_uri()}/checkpoints", write_dataset(Path(folder), trainers)
        config = job_config(before, mode=mode, trainers=trainers, dataset=dataset, checkpoint_url=url, checkpoint_every=steps)
        with ProcessJob.running(place, config, mib, Path(folder), f"{label}-old") as job:
            pointer = wait_for("committed checkpoint", lambda: job.store.get(job.keys.checkpoint), job.failed)
            committed = time.monotonic()
            ckpt = decode_json(pointer.value, pointer.key)
            job.stop()  # what the trainers did after the checkpoint is lost: counted from the checkpoint's last step
            stopped = time.monotonic()
            held = [t for trainer in job.trainer_ids for t, r in job.steps.of(trainer) if r is not None and r < int(ckpt["round"])]
            last_held = max(held)
        config = job_config(after, mode=mode, trainers=trainers, dataset=dataset, checkpoint_url=url)
        with ProcessJob.running(place, config, mib, Path(folder), f"{label}-new") as job:
            ids = job.trainer_ids
            wait_for("every trainer attached", lambda: len(job.steps.read().attached) == len(ids), job.failed)
            attached = max(job.steps.attached.values())
            command = [sys.executable, "-m", "pdps", "checkpoint", "restore", ckpt["id"], "--force", "--store", place.store_url, "--job", JOB, "--json"]
            # --force: the new job's keys never knew the checkpoint (the old job committed it)
            done = subprocess.run(command, cwd=ROOT, env=dict(os.environ, PYTHONPATH=job.env["PYTHONPATH"]), capture_output=True, text=True, timeout=WAIT_S)
            if done.returncode != 0:
                raise RuntimeError(f"{shlex.join(command)} exited with {done.returncode}: {done.stderr[-2000:]}")

            def loaded() -> float | None:
                at = {int(m.group(1)): logged_at(m.string) for r in job.pservers() for _, m in r.matches(LOADED) if m.group(2) == ckpt["id"]}
                return max(at.values()) if len(at) == after else None

            restored = wait_for(f"every pserver loading checkpoint {ckpt['id']}", loaded, job.failed)

            def first_step() -> float | None:
                stamps = [s["t"] for steps_of in job.steps.read().steps.values() for s in steps_of if s["epoch"] >= 1]
                return min(stamps) if stamps else None

            first = wait_for("a step after the restore", first_step, job.failed)
    parts = {"checkpoint committed": committed, "job stopped": stopped, "new job attached": attached, "restored": restored, "first step": first}
    return restart_row(before, after, ckpt, last_held, parts)


# --- the run --------------------------------------------------------------------------


def run(
    mibs: Sequence[int], resizes: Sequence[int], steps: int, *, roles: str, modes: Sequence[str], transport: str, trainers: int, tmp: Path, logs: Path | None = None
) -> dict[str, Any]:
    runs = []
    with contextlib.ExitStack() as stack:
        if roles == "processes":
            from tests.servers import EtcdServer

            etcd = stack.enter_context(EtcdServer())  # stopped on the way out, whatever happened
            place = Place(etcd.url, tmp, logs)
            live_run: Callable[..., list[dict[str, Any]]] = partial(live_processes, place=place)
            restart_run: Callable[..., dict[str, Any]] = partial(restart_processes, place=place)
        else:
            live_run, restart_run = partial(live, transport=transport), partial(restart, transport=transport, tmp=tmp)
        for mib in mibs:
            for mode in modes:
                say(f"{mib} MiB, {mode}, {roles}: live resizes {' -> '.join(map(str, resizes))}")
                rows = live_run(mib, resizes, steps, mode=mode, trainers=trainers)
                gc.collect()
                for row in rows:
                    base = restart_run(mib, row["from"], row["to"], steps, mode=mode, trainers=trainers)
                    gc.collect()
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
    say(f"roles: {report['config']['roles']}")
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
    roles = p.add_mutually_exclusive_group()
    roles.add_argument("--processes", dest="roles", action="store_const", const="processes", help="each role its own process, on a throwaway etcd (default, but for --quick)")
    roles.add_argument("--in-process", dest="roles", action="store_const", const="in-process", help="every role a thread of this process, on memory:// (default of --quick)")
    p.add_argument("--transport", choices=("grpc", "inproc"), default="grpc", help="inproc: --in-process only")
    p.add_argument("--trainers", type=int, default=1)
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the baseline's checkpoints (and the processes' dataset) go")
    p.add_argument("--logs", type=Path, help="--processes: keep each role's log (lines after their arrival times) and the steps under this folder")
    p.add_argument("--quick", action="store_true", help=f"{QUICK['mib'][0]} MiB, {QUICK['steps']} steps, {QUICK['roles']}")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    mibs, resizes = args.mib or preset["mib"], args.resizes or preset["resizes"]
    steps, modes, roles_way = args.steps or preset["steps"], args.modes or preset["modes"], args.roles or preset["roles"]
    if len(resizes) < 2 or min(resizes) < 1 or steps < 2 or args.trainers < 1:
        p.error("--resizes needs two counts or more, each at least 1; --steps at least 2; --trainers at least 1")
    if roles_way == "processes" and args.transport == "inproc":
        p.error("--transport inproc runs in one process: add --in-process")
    began = time.monotonic()
    try:
        report = run(mibs, resizes, steps, roles=roles_way, modes=modes, transport=args.transport, trainers=args.trainers, tmp=args.tmp, logs=args.logs)
    except (RuntimeError, TimeoutError, pdps.PdpsError) as exc:
        say(f"bench/elastic.py: {exc}")
        return 1
    finish("bench/elastic.py", argv, began,
           {"roles": roles_way, "mib": list(mibs), "resizes": list(resizes), "steps": steps, "modes": list(modes), "transport": args.transport,
            "trainers": args.trainers, "optimizer": "SGD", "min_block": MIN_BLOCK, "num_slots": DEFAULT_NUM_SLOTS},
           report, packages=("torch", "grpcio"), table=print_table, as_json=args.json)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
