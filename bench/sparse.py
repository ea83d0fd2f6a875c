"""Sparse tables on the pservers: pull + push of unique rows per step through the real
pserver path, against the same work done locally and the same bytes over raw TCP; the
pservers' memory per row; the CTR example against single-process torch.

A benchmark, not a test: it prints figures and ratios against baselines measured in the
same run and asserts nothing about speed (it exits 1 only when a job could not run, or
the rows pulled back are not what the fill and the steps left in them).

What runs
---------
A job (async, SGD lr 0.01, 2 pservers) whose model is one table,
``nn.Embedding(--rows, 64, sparse=True, device="meta")`` (float32, rows starting from
``zeros``: the trainer never allocates it), beside a single dense scalar (pdps refuses a
model without a dense parameter). The bench process is the trainer: a real
``TrainerContext`` attaches the model (publishes ``model`` and ``model_tables``,
initializes the pservers), then talks to the pservers through the trainer's
``PserverGroup`` with the requests a trainer sends: per step, one ``PullRequest`` per
pserver with its ids (ascending, those of the slots it owns) and one ``PushRequest`` per
pserver with the same ids and their gradient rows (after the dense scalar's gradient).
The group calls the pservers concurrently where the transport allows (gRPC). The table
is first filled by pushing every id once, in a random order (pushes of at most 2^18
ids, each ascending): a row is created when its first gradient is applied, so where a
row sits in a pserver's store has nothing to do with its id, as in a job. The ids of a
step are ``--ids`` distinct ids drawn uniformly from the table (before the timing), the
gradient 0.5 everywhere.

* ``inproc``: the 2 pservers are ``Pserver`` objects in this process on a ``memory://``
  store, over inproc (called one after the other). Baseline, in the same process and
  the same rounds (interleaved, the order alternating): ``index_select`` of the step's
  ids from a local ``[rows, 64]`` float32 tensor, then ``index_add_`` of their
  gradients times -lr into it: the pull and the SGD step of a single process.
* ``grpc``: the 2 pservers are processes (``python -m pdps pserver``, as ``pdps launch``
  starts them: one torch thread each) on a throwaway etcd (``tests/servers.py``), over
  gRPC on 127.0.0.1. Baseline, interleaved likewise: the raw TCP echo of
  ``bench/transport.py`` (2 server processes, ``recv_into`` a preallocated buffer and
  send it back), each sent, concurrently, the bytes of one pserver's share of a step's
  ids and rows (ids 8 B + row 256 B per id), and receiving them back: what the
  pserver route moves, ids and rows out and back, with no work on either side.

This process runs torch with one intra-op thread, as ``pdps launch`` gives a pserver
process: the in-process pservers, the local baseline and both CTR runs alike.

rows/s = ids per step / the median step time (pull + push, after ``--warmup`` untimed
steps). After the timed steps, the last step's rows are pulled again and compared with
what they must hold (the fill's update, then one update per step that drew them).

* **Memory** (the ``grpc`` pservers, and a second job of 2 pserver processes with
  ``sparse_optimizer = Adagrad``, filled the same way): each pserver process's RSS
  (``/proc/<pid>/status``) after the attach, right after the fill, and 3 x ``trim_every``
  later (6 s; ``--quick``: ``trim_every`` 0.5, 1.5 s): what the pserver holds once its
  pushes settle (its allocator trimmer gives back what the pushes freed at its first look,
  every ``trim_every`` seconds, that finds them paused; ``--trim-every 0`` turns it off to
  compare, read 6 s after the fill as well). The settled growth over the
  raw bytes of the rows it holds and their optimizer state (SGD: the row, 256 B;
  Adagrad: the row and its ``state_sum``, 512 B). The rows a pserver holds are counted
  here from the ids' slots and the slot map, and checked against what its row store
  said as it stopped (``table_stats/<i>``), whose ``bytes`` are reported beside.
* **CTR** (reported, no target): ``pdps.examples.ctr`` trained by ``pdps.simulate``
  (2 trainers x 2 pservers, in process, inproc, the example's settings: sync, Adagrad
  lr 0.02, batch 256, HashEmbedding(16)) on the first ``--ctr-samples`` samples of its
  training split, ``--ctr-passes`` passes; against single-process torch on the same
  samples and batches: ``ctr.build_model()`` (``nn.EmbeddingBag(800_000, 16,
  sparse=True)``) with ``torch.optim.Adagrad`` (which steps the sparse gradient's rows
  only). samples/s = samples trained / training time; the held-out AUC of both is
  printed.

Ratios (the targets of ``pdps bench --suite sparse``)
-----------------------------------------------------
* ``grpc_vs_tcp``: grpc rows/s / raw TCP rows/s (target >= 0.5);
* ``inproc_vs_local``: inproc rows/s / local rows/s (target >= 0.5);
* ``memory``: the largest RSS growth / raw bytes of every pserver of both jobs (target
  <= 1.5);
* ``ctr_vs_torch``: pdps samples/s / torch samples/s (no target).

Run
---
    .venv/bin/python bench/sparse.py               # 10M rows, 64k ids a step: ~3 min, ~8 GB at most
    .venv/bin/python bench/sparse.py --quick       # 1M rows, 8k ids a step, 3 steps: ~20 s
    .venv/bin/python bench/sparse.py --rows 2000000 --ids 16384 --repeats 5 --skip ctr

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway etcd)

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pdps  # noqa: E402
from bench.machine import finish  # noqa: E402
from bench.transport import ServerProcess, TcpRoute, start_servers  # noqa: E402
from pdps.core.tables import row_slots  # noqa: E402
from pdps.core.wire import PullRequest, PushRequest  # noqa: E402
from pdps.nn import TableOptions  # noqa: E402

FULL = {"rows": 10_000_000, "ids": 65_536, "repeats": 7, "warmup": 2, "ctr_samples": 20_000, "ctr_passes": 2, "trim_every": 2.0}
QUICK = {"rows": 1_000_000, "ids": 8_192, "repeats": 3, "warmup": 1, "ctr_samples": 2_500, "ctr_passes": 1, "trim_every": 0.5}
DIM = 64
PSERVERS = 2
TABLE = "emb.weight"
LR = 0.01
FILL_GRAD = 1.0  # the fill's gradient: SGD leaves each row at -LR * FILL_GRAD (init zeros)
STEP_GRAD = 0.5
FILL_CHUNK = 1 << 18  # ids per push of the fill, at most (both pservers)
FILL_PIECES = 16  # ... and at least this many pushes, so that no message is a large share of a pserver's rows
ROW_BYTES = {"SGD": DIM * 4, "Adagrad": 2 * DIM * 4}  # a row and its optimizer state, float32
TCP_BUFFER = 4 << 20  # the socket buffers of bench/transport.py's tcp route
SERVER_START_S = 120.0
PSERVER_STOP_S = 20.0
#: a pserver process's grace after SIGTERM: it writes its table_stats as it stops, which the
#: memory rows are checked against; stopping took 4.5-8.5 s on the loaded 2-core VM, past a
#: grace of 5 s (the process then exits hard, leaving the periodic record of mid-fill)
PSERVER_GRACE_S = 15.0
#: after the fill, the memory is read again this many ``trim_every`` later: the pservers'
#: allocator trimmer trims at the first look that finds the pushes paused, two periods after
#: the fill at most: what a pserver holds once its pushes settle
SETTLE_PERIODS = 3
TRIM_EVERY = 2.0  # the pservers' default trim_every
CALL_PATIENCE_S = 120.0
TARGETS = {"grpc_vs_tcp": 0.5, "inproc_vs_local": 0.5, "memory": 1.5}
CTR = {"trainers": 2, "pservers": 2}
SECTIONS = ("inproc", "grpc", "memory", "ctr")
#: torch's intra-op threads in this process: one, as pdps launch gives a pserver process (its
#: update is one memory-bound pass). Two threads per op on 2 busy cores spin-wait for each
#: other (an in-process pserver's push measured 36x slower under load than in its own process).
THREADS = 1


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


class Model(torch.nn.Module):
    """One table on the meta device (never allocated here) and one dense scalar."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(rows, DIM, sparse=True, device="meta")
        self.scale = torch.nn.Parameter(torch.ones(1))


def job_config(name: str, rule: str) -> pdps.JobConfig:
    return pdps.JobConfig(
        name=name, mode="async", pservers=PSERVERS, optimizer="SGD", optimizer_args={"lr": LR}, sparse_optimizer=rule,
        sparse_optimizer_args={"lr": LR}, lease_ttl=30.0,
    )  # fmt: skip


def rss(pid: int) -> int:
    """Resident bytes of a process (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmRSS line")


def draw_steps(rows: int, ids: int, steps: int, seed: int = 0) -> list[np.ndarray]:
    """``steps`` sets of ``ids`` distinct ids in ``[0, rows)``, each ascending."""
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(rows, ids, replace=False)).astype(np.int64) for _ in range(steps)]


# --- the trainer's side -------------------------------------------------------------------


class Tables:
    """A trainer attached to a job of :class:`Model`, pulling and pushing rows of its table
    through the trainer's ``PserverGroup`` with the requests a trainer sends."""

    def __init__(self, ctx: pdps.TrainerContext, rows: int) -> None:
        self.ctx = ctx
        self.rows = rows
        t0 = time.perf_counter()
        ctx.attach(Model(rows), tables={TABLE: TableOptions(init=("zeros",))})
        self.attach_s = time.perf_counter() - t0
        group = ctx._group  # the trainer's own pserver group: its parts, channels and concurrent calls
        assert group is not None
        self.group = group
        self.parts = list(group.parts)
        self.owners = np.asarray(group.layout.slot_map.owners, dtype=np.int64)
        self.version = group.layout.slot_map.version
        self.dense = {p.index: [torch.zeros(b.shape, dtype=torch.float32) for b in p.blocks] for p in self.parts}
        self.updates = {p.index: 0 for p in self.parts}

    def owner_of(self, ids: np.ndarray) -> np.ndarray:
        return self.owners[row_slots(TABLE, ids, len(self.owners))]

    def split(self, ids: np.ndarray) -> dict[int, torch.Tensor]:
        """Each pserver's share of ascending ``ids`` (still ascending), as the trainer routes them."""
        owner = self.owner_of(ids)
        return {p.index: torch.from_numpy(np.ascontiguousarray(ids[owner == p.index])) for p in self.parts}

    def pull(self, sections: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        requests = [
            (p, PullRequest(self.ctx.trainer_id, epoch=self.ctx.epoch, version=self.version, blocks=(), tables=((TABLE, int(sections[p.index].numel())),),
                            tensors=(sections[p.index],)))
            for p in self.parts
        ]  # fmt: skip
        replies = self.group.call_each(requests)
        out = {}
        for p, reply in zip(self.parts, replies):
            if isinstance(reply, Exception):
                raise reply
            self.updates[p.index] = reply.updates
            out[p.index] = reply.tensors[-1]
        return out

    def push(self, sections: Mapping[int, torch.Tensor], grads: Mapping[int, torch.Tensor]) -> list[float]:
        """Push each pserver its ids' gradient rows; the seconds each pserver took (``update_s``)."""
        requests = [
            (p, PushRequest(self.ctx.trainer_id, epoch=self.ctx.epoch, version=self.version, updates=self.updates[p.index], blocks=tuple(p.keys),
                            tables=((TABLE, int(sections[p.index].numel())),), tensors=(*self.dense[p.index], sections[p.index], grads[p.index])))
            for p in self.parts
        ]  # fmt: skip
        replies = self.group.call_each(requests)
        for reply in replies:
            if isinstance(reply, Exception):
                raise reply
        return [float(r.update_s or 0.0) for r in replies]

    def fill(self) -> float:
        """Push every id once with gradient FILL_GRAD, in a random order (as a job's first
        touches come: a row's position in the store is not its id's rank); seconds."""
        chunk = max(1, min(FILL_CHUNK, -(-self.rows // FILL_PIECES)))
        grads = torch.full((chunk, DIM), FILL_GRAD)
        order = np.random.default_rng(1).permutation(self.rows)
        t0 = time.perf_counter()
        for start in range(0, self.rows, chunk):
            sections = self.split(np.sort(order[start : start + chunk]))
            self.pull({i: s[:1] for i, s in sections.items()})  # the pservers' update counts, as a trainer's pull brings them
            self.push(sections, {i: grads[: len(s)] for i, s in sections.items()})
        return time.perf_counter() - t0

    def held(self) -> dict[int, int]:
        """Rows each pserver holds once every id was pushed: by the ids' slots."""
        owner = np.bincount(self.owner_of(np.arange(self.rows, dtype=np.int64)), minlength=len(self.owners))
        return {p.index: int(owner[p.index]) for p in self.parts}


class PdpsRoute:
    """Pull + push of one step's ids through :class:`Tables`."""

    def __init__(self, label: str, tables: Tables, steps: Sequence[np.ndarray]) -> None:
        self.label, self.tables = label, tables
        self.sections = [tables.split(ids) for ids in steps]
        n = max(len(s) for secs in self.sections for s in secs.values())
        self._grads = torch.full((n, DIM), STEP_GRAD)
        self.last: dict[int, torch.Tensor] = {}

    def step(self, k: int) -> dict[str, float]:
        sections = self.sections[k]
        grads = {i: self._grads[: len(s)] for i, s in sections.items()}
        t0 = time.perf_counter()
        self.last = self.tables.pull(sections)
        t1 = time.perf_counter()
        update = self.tables.push(sections, grads)
        t2 = time.perf_counter()
        return {"pull_s": t1 - t0, "push_s": t2 - t1, "update_s": max(update)}

    def verify(self, steps: Sequence[np.ndarray], last: int) -> None:
        """The rows of step ``last`` pulled again hold the fill's update and one per step that drew them."""
        ids = steps[last]
        times = np.zeros(len(ids), dtype=np.int64)
        for k in range(last + 1):
            times += np.isin(ids, steps[k], assume_unique=True)
        want = -LR * FILL_GRAD - LR * STEP_GRAD * times
        got = self.tables.pull(self.sections[last])
        owner = self.tables.owner_of(ids)
        for i, rows in got.items():
            expect = torch.from_numpy(np.repeat(want[owner == i].astype(np.float32)[:, None], DIM, axis=1))
            if rows.shape != expect.shape or not torch.allclose(rows, expect, atol=1e-5):
                worst = float((rows - expect).abs().max()) if rows.shape == expect.shape else float("nan")
                raise RuntimeError(f"{self.label}: the rows pulled back from pserver {i} are not what the fill and the steps left (worst difference {worst:g})")


class LocalRoute:
    """A single process's pull and SGD step on a local table: ``index_select`` + ``index_add_``."""

    label = "local index_select + index_add_"

    def __init__(self, rows: int, steps: Sequence[np.ndarray]) -> None:
        self.table = torch.zeros((rows, DIM))  # written: every page resident before the timing
        self.ids = [torch.from_numpy(ids) for ids in steps]
        self._grads = torch.full((max(len(i) for i in steps), DIM), STEP_GRAD)

    def step(self, k: int) -> dict[str, float]:
        ids = self.ids[k]
        t0 = time.perf_counter()
        out = self.table.index_select(0, ids)
        t1 = time.perf_counter()
        self.table.index_add_(0, ids, self._grads[: len(ids)], alpha=-LR)
        t2 = time.perf_counter()
        del out
        return {"pull_s": t1 - t0, "push_s": t2 - t1}


class EchoRoute:
    """The raw TCP echo of a step's bytes (ids + rows), half to each of 2 server
    processes on 2 threads: ``bench/transport.py``'s ``tcp x2`` route."""

    label = "raw TCP echo"

    def __init__(self, servers: Sequence[ServerProcess], ids: int, pool: ThreadPoolExecutor) -> None:
        self.route = TcpRoute(servers, torch.zeros(ids * (8 + 4 * DIM) // 4), pool, TCP_BUFFER)

    def step(self, k: int) -> dict[str, float]:
        send, receive = self.route.round()
        return {"pull_s": receive, "push_s": send}

    def close(self) -> None:
        self.route.close()


def measure(routes: Sequence[Any], warmup: int, repeats: int) -> dict[str, list[dict[str, float]]]:
    """``warmup`` + ``repeats`` steps of every route, interleaved, the order alternating;
    the timed steps' figures per route label."""
    out: dict[str, list[dict[str, float]]] = {r.label: [] for r in routes}
    for k in range(warmup + repeats):
        for r in routes if k % 2 == 0 else reversed(routes):
            got = r.step(k)
            if k >= warmup:
                out[r.label].append(got)
        say(f"  step {k + 1}/{warmup + repeats}{' (warm-up)' if k < warmup else ''} done")
    return out


def summarize(route: str, label: str, ids: int, steps: list[dict[str, float]], nbytes: int) -> dict[str, Any]:
    each = [s["pull_s"] + s["push_s"] for s in steps]
    med = statistics.median(each)
    row = {
        "route": route, "label": label, "ids_per_step": ids, "steps": len(each), "step_s": med, "steps_s": each,
        "rows_per_s": ids / med, "rows_per_s_min": ids / max(each), "rows_per_s_max": ids / min(each),
        "pull_s": statistics.median(s["pull_s"] for s in steps), "push_s": statistics.median(s["push_s"] for s in steps),
        "bytes_per_step": nbytes, "gbps": nbytes / med / 1e9,
    }  # fmt: skip
    if steps and "update_s" in steps[0]:
        row["update_s"] = statistics.median(s["update_s"] for s in steps)
    return row


def step_bytes(ids: int) -> int:
    """The bytes a step moves each way, summed over the pservers: ids and rows out (push), ids out and rows back (pull)."""
    return 2 * ids * (8 + 4 * DIM)


# --- in process ---------------------------------------------------------------------------


def run_inproc(rows: int, steps: list[np.ndarray], warmup: int, repeats: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    from pdps.adapters.inproc import InprocTransport
    from pdps.adapters.memory_store import MemoryStore
    from pdps.adapters.torch_compute import TorchCompute
    from pdps.roles.master import publish_job
    from pdps.roles.pserver import Pserver

    store, transport, compute = MemoryStore(), InprocTransport(), TorchCompute("cpu")
    config = job_config("bench-sparse-inproc", "SGD")
    publish_job(store, config)
    servers = [Pserver(store, transport, compute, config) for _ in range(PSERVERS)]
    ctx = None
    try:
        for ps in servers:
            ps.start()
        ctx = pdps.TrainerContext(store, transport, compute, None, config, trainer_id="bench")  # type: ignore[arg-type]
        tables = Tables(ctx, rows)
        say(f"inproc: filling {rows:,} rows (every id pushed once)")
        fill_s = tables.fill()
        say(f"  filled in {fill_s:.1f} s ({rows / fill_s:,.0f} rows/s)")
        pdps_route = PdpsRoute("inproc", tables, steps)
        local = LocalRoute(rows, steps)
        say(f"inproc against local: {warmup} + {repeats} steps of {len(steps[0]):,} ids")
        got = measure([pdps_route, local], warmup, repeats)
        pdps_route.verify(steps, len(steps) - 1)
        del local
        ids = len(steps[0])
        out = [summarize("inproc", "inproc (pdps, 2 pservers in process)", ids, got["inproc"], step_bytes(ids)),
               summarize("local", LocalRoute.label, ids, got[LocalRoute.label], step_bytes(ids))]  # fmt: skip
        return out, {"fill_s": fill_s, "attach_s": tables.attach_s}
    finally:
        if ctx is not None:
            ctx.leave()
        for ps in servers:
            ps.stop()
        store.close()


# --- processes ----------------------------------------------------------------------------


class PserverProcess:
    """``python -m pdps pserver`` of one job, as ``pdps launch`` starts it (one torch thread)."""

    def __init__(self, store_url: str, job: str, index: int, trim_every: float = TRIM_EVERY) -> None:
        from pdps.shell.launch import LAUNCHER_PID

        env = {k: v for k, v in os.environ.items() if not k.startswith("PDPS_")}
        env.update({"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", LAUNCHER_PID: str(os.getpid()),
                    "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])})  # fmt: skip
        argv = [sys.executable, "-m", "pdps", "pserver", "--store", store_url, "--job", job, "--index", str(index), "--metrics-port", "none",
                "--grace", str(PSERVER_GRACE_S), "--log-level", "WARNING", "--trim-every", str(trim_every)]  # fmt: skip
        self.name = f"{job} pserver {index}"
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def wait_ready(self, deadline: float) -> None:
        """Until it printed its address (it has claimed its index and serves)."""
        assert self.proc.stdout is not None
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before serving: {self._stderr()}")
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} did not serve within {SERVER_START_S:g} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready and '"address"' in self.proc.stdout.readline():
                return

    def _stderr(self) -> str:
        assert self.proc.stderr is not None
        with contextlib.suppress(OSError, ValueError):
            return self.proc.stderr.read()[-2000:]
        return ""

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(PSERVER_STOP_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(PSERVER_STOP_S)


def stop_all(servers: Sequence[PserverProcess]) -> None:
    """SIGTERM to every one, then wait for each (they stop at the same time)."""
    for s in servers:
        s.terminate()
    for s in servers:
        s.stop()


@contextlib.contextmanager
def attached(store: Any, config: pdps.JobConfig, rows: int) -> Iterator[Tables]:
    """This process as the trainer of ``config``'s job, over gRPC."""
    from pdps.registry import open_compute, open_transport

    ctx = pdps.TrainerContext(store, open_transport("grpc"), open_compute("torch"), None, config, trainer_id="bench")  # type: ignore[arg-type]
    ctx.patience = CALL_PATIENCE_S
    try:
        yield Tables(ctx, rows)
    finally:
        ctx.leave()


def fill_measured(tables: Tables, servers: Sequence[PserverProcess], rule: str, settle_s: float) -> tuple[float, list[dict[str, Any]]]:
    """Fill the table; each pserver's RSS before, right after and ``settle_s`` after
    the fill against its rows' raw bytes (the target's figure: the settled one)."""
    by_index = dict(zip(range(PSERVERS), servers))
    before = {i: rss(s.pid) for i, s in by_index.items()}
    say(f"grpc, {rule}: filling {tables.rows:,} rows (every id pushed once)")
    fill_s = tables.fill()
    at_once = {i: rss(s.pid) for i, s in by_index.items()}
    time.sleep(settle_s)
    after = {i: rss(s.pid) for i, s in by_index.items()}
    say(f"  filled in {fill_s:.1f} s ({tables.rows / fill_s:,.0f} rows/s)")
    rows = []
    for i, held in tables.held().items():
        raw = held * ROW_BYTES[rule]
        growth = after[i] - before[i]
        rows.append({"rule": rule, "pserver": i, "rows": held, "row_bytes": ROW_BYTES[rule], "raw_bytes": raw, "rss_before": before[i],
                     "rss_at_once": at_once[i], "ratio_at_once": (at_once[i] - before[i]) / raw,
                     "rss_after": after[i], "growth": growth, "ratio": growth / raw, "bytes_per_row": growth / held})  # fmt: skip
        say(f"  pserver {i}: {held:,} rows, RSS {before[i] / 2**20:,.0f} -> {at_once[i] / 2**20:,.0f} MiB at once, {after[i] / 2**20:,.0f} "
            f"after {settle_s:g} s: {growth / held:.0f} B a row against {ROW_BYTES[rule]} raw ({growth / raw:.3f}x)")  # fmt: skip
    return fill_s, rows


def run_processes(rows: int, steps: list[np.ndarray], warmup: int, repeats: int, sections: set[str], trim_every: float = TRIM_EVERY) -> tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]:
    """The jobs of pserver processes on a throwaway etcd: SGD (throughput against raw TCP, and
    memory), then Adagrad (memory). Every process is started at once, before anything is
    timed (their imports overlap); a job's pservers stop before the next job's fill."""
    from pdps.registry import connect_store
    from pdps.roles.master import publish_job
    from tests.servers import EtcdServer

    throughput: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    fills: dict[str, float] = {}
    jobs = [("bench-sparse-sgd", "SGD")] + ([("bench-sparse-adagrad", "Adagrad")] if "memory" in sections else [])
    with EtcdServer() as etcd, contextlib.ExitStack() as stack, ThreadPoolExecutor(max_workers=PSERVERS, thread_name_prefix="bench-echo") as pool:
        store = connect_store(etcd.url)
        stack.callback(store.close)
        configs, servers = {}, {}
        for name, rule in jobs:
            configs[name] = job_config(name, rule)
            publish_job(store, configs[name])
            servers[name] = [PserverProcess(etcd.url, name, i, trim_every) for i in range(PSERVERS)]
        stack.callback(stop_all, [s for group in servers.values() for s in group])
        share = len(steps[0]) * (8 + 4 * DIM) // PSERVERS
        echo_servers = start_servers(stack, [("tcp://127.0.0.1:0", share, i, None, "default") for i in range(PSERVERS)]) if "grpc" in sections else []
        deadline = time.monotonic() + SERVER_START_S
        for group in servers.values():
            for s in group:
                s.wait_ready(deadline)
        for name, rule in jobs:
            with attached(store, configs[name], rows) as tables:
                fills[rule], mem = fill_measured(tables, servers[name], rule, settle_s(trim_every))
                memory += mem
                await_table_stats(store, name, mem)
                if rule == "SGD" and "grpc" in sections:
                    grpc = PdpsRoute("grpc", tables, steps)
                    tcp = EchoRoute(echo_servers, len(steps[0]), pool)
                    stack.callback(tcp.close)
                    say(f"grpc against raw TCP: {warmup} + {repeats} steps of {len(steps[0]):,} ids")
                    got = measure([grpc, tcp], warmup, repeats)
                    grpc.verify(steps, len(steps) - 1)
                    ids = len(steps[0])
                    throughput += [summarize("grpc", "grpc (pdps, 2 pserver processes)", ids, got["grpc"], step_bytes(ids)),
                                   summarize("tcp", "raw TCP echo (2 server processes)", ids, got[EchoRoute.label], step_bytes(ids))]  # fmt: skip
            for s in servers[name]:  # they stop while the next job fills
                s.terminate()
        stop_all([s for group in servers.values() for s in group])
        for name, rule in jobs:  # what each row store said it held, as it stopped
            store_bytes(store, name, [m for m in memory if m["rule"] == rule])
    return throughput, memory, {"fill_s": fills}


def settle_s(trim_every: float) -> float:
    """How long after a fill its settled memory is read."""
    return SETTLE_PERIODS * (trim_every if trim_every > 0 else TRIM_EVERY)


def await_table_stats(store: Any, job: str, rows: list[dict[str, Any]]) -> None:
    """Wait until each pserver's periodic ``table_stats/<i>`` record counts the rows its
    slots own (it is put every ``TABLE_STATS_EVERY`` seconds while the counts change), so
    the record is whole even if a pserver's stop runs past its grace and it exits before
    writing its last one; past the wait, :func:`store_bytes` names the pserver."""
    from pdps.core.job import Keys
    from pdps.roles.pserver import TABLE_STATS_EVERY

    deadline = time.monotonic() + 2 * TABLE_STATS_EVERY + 5
    for m in rows:
        while time.monotonic() < deadline:
            kv = store.get(Keys(job).table_stats(m["pserver"]))
            if kv is not None and json.loads(kv.value)["tables"].get(TABLE, {}).get("rows") == m["rows"]:
                break
            time.sleep(0.1)


def store_bytes(store: Any, job: str, rows: list[dict[str, Any]]) -> None:
    """Add to each pserver's memory row what its row store said it held (``table_stats/<i>``,
    which a pserver writes as it stops): ``store_bytes``, per row and over the raw bytes."""
    from pdps.core.job import Keys

    for m in rows:
        kv = store.get(Keys(job).table_stats(m["pserver"]))
        if kv is None:
            raise RuntimeError(f"job {job!r}: pserver {m['pserver']} left no table_stats record")
        stats = json.loads(kv.value)["tables"][TABLE]
        if stats["rows"] != m["rows"]:
            raise RuntimeError(f"job {job!r}: pserver {m['pserver']} holds {stats['rows']:,} rows, not the {m['rows']:,} its slots own")
        m.update(store_bytes=stats["bytes"], store_bytes_per_row=stats["bytes"] / m["rows"], store_ratio=stats["bytes"] / m["raw_bytes"])


# --- CTR ----------------------------------------------------------------------------------


def run_ctr(samples: int, passes: int, tmp: Path) -> dict[str, Any]:
    from pdps.adapters.parquet import write_parquet_shards
    from pdps.examples import ctr

    train, held = ctr.split(ctr.DATA_SEED)
    if samples > len(train["click"]):
        raise ValueError(f"--ctr-samples is at most {len(train['click']):,} (the example's training split)")
    train = {k: v[:samples] for k, v in train.items()}
    folder = Path(tempfile.mkdtemp(prefix="pdps-sparse-ctr-", dir=tmp))
    try:
        url = (folder / "train").as_uri()
        write_parquet_shards(train, url, shards=ctr.SHARDS, row_group_size=ctr.ROW_GROUP)
        settings = dict(ctr.JOB_DEFAULTS)
        lr = settings.pop("lr")
        settings["passes"] = passes
        say(f"ctr: pdps.simulate, {CTR['trainers']} trainers x {CTR['pservers']} pservers, {samples:,} samples, {passes} pass(es)")
        result = pdps.simulate(ctr.train, dataset=url, trainers=CTR["trainers"], pservers=CTR["pservers"], optimizer_args={"lr": lr}, timeout=600.0,
                               **settings)  # fmt: skip
        trained = samples * result.passes
        job = {"samples": trained, "seconds": result.seconds, "samples_per_s": trained / result.seconds, "auc": ctr.evaluate(result.params, held)["auc"],
               "steps": result.steps, "mode": result.config.mode.value, **CTR}  # fmt: skip
        say(f"  pdps: {job['samples_per_s']:,.0f} samples/s ({result.seconds:.2f} s), held-out AUC {job['auc']:.3f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    model = ctr.build_model()
    opt = torch.optim.Adagrad(model.parameters(), lr=lr)
    data = ctr.as_tensors(train)
    batch = settings["batch_size"]
    t0 = time.perf_counter()
    for _ in range(passes):
        for start in range(0, samples, batch):
            opt.zero_grad(set_to_none=True)
            ctr.loss(model, {k: v[start : start + batch] for k, v in data.items()}).backward()
            opt.step()
    seconds = time.perf_counter() - t0
    single = {"samples": samples * passes, "seconds": seconds, "samples_per_s": samples * passes / seconds, "auc": ctr.evaluate(model, held)["auc"]}
    say(f"  torch: {single['samples_per_s']:,.0f} samples/s ({seconds:.2f} s), held-out AUC {single['auc']:.3f}")
    return {"samples": samples, "passes": passes, "batch_size": batch, "optimizer": "Adagrad", "lr": lr, "pdps": job, "torch": single}


# --- the run ------------------------------------------------------------------------------


def ratios(throughput: list[dict[str, Any]], memory: list[dict[str, Any]], ctr_row: dict[str, Any] | None) -> dict[str, Any]:
    rows = {r["route"]: r for r in throughput}
    out: dict[str, Any] = {}
    for name, mine, base in (("grpc_vs_tcp", "grpc", "tcp"), ("inproc_vs_local", "inproc", "local")):
        if mine in rows and base in rows:
            a, b = rows[mine]["rows_per_s"], rows[base]["rows_per_s"]
            out[name] = {"value": a / b, "target": TARGETS[name], "met": a / b >= TARGETS[name], "rows_per_s": a, "baseline_rows_per_s": b,
                         "row": rows[mine]["label"], "baseline": rows[base]["label"]}  # fmt: skip
    if memory:
        worst = max(memory, key=lambda r: r["ratio"])
        out["memory"] = {"value": worst["ratio"], "target": TARGETS["memory"], "met": worst["ratio"] <= TARGETS["memory"], "rule": worst["rule"],
                         "pserver": worst["pserver"], "bytes_per_row": worst["bytes_per_row"], "row_bytes": worst["row_bytes"]}  # fmt: skip
    if ctr_row is not None:
        a, b = ctr_row["pdps"]["samples_per_s"], ctr_row["torch"]["samples_per_s"]
        out["ctr_vs_torch"] = {"value": a / b, "pdps_samples_per_s": a, "torch_samples_per_s": b}
    return out


def run(*, rows: int, ids: int, repeats: int, warmup: int, ctr_samples: int, ctr_passes: int, sections: set[str], tmp: Path,
        trim_every: float = TRIM_EVERY) -> dict[str, Any]:
    say(f"drawing {warmup + repeats} steps of {ids:,} distinct ids of {rows:,}")
    steps = draw_steps(rows, ids, warmup + repeats)
    throughput: list[dict[str, Any]] = []
    memory: list[dict[str, Any]] = []
    fills: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    t0 = time.monotonic()
    if "inproc" in sections:
        got, info = run_inproc(rows, steps, warmup, repeats)
        throughput += got
        fills["inproc"] = info["fill_s"]
        seconds["inproc"] = time.monotonic() - t0
    if sections & {"grpc", "memory"}:
        t0 = time.monotonic()
        got, memory, info = run_processes(rows, steps, warmup, repeats, sections, trim_every)
        throughput += got
        fills["grpc"] = info["fill_s"]
        seconds["processes"] = time.monotonic() - t0
    ctr_row = None
    if "ctr" in sections:
        t0 = time.monotonic()
        ctr_row = run_ctr(ctr_samples, ctr_passes, tmp)
        seconds["ctr"] = time.monotonic() - t0
    return {"throughput": throughput, "memory": memory, "fill_s": fills, "ctr": ctr_row, "ratios": ratios(throughput, memory, ctr_row),
            "section_s": seconds}  # fmt: skip


def print_table(report: dict[str, Any]) -> None:
    c = report["config"]
    ls, le = report["loadavg_start"], report["loadavg_end"]
    say("")
    say(f"load average (1/5/15 min) at start {ls[0]:.2f} {ls[1]:.2f} {ls[2]:.2f}, at end {le[0]:.2f} {le[1]:.2f} {le[2]:.2f}")
    if max(ls[0], le[0]) > report["machine"]["cpu_count"]:
        say(f"CAUTION: the load average exceeds the CPU count ({report['machine']['cpu_count']}): other processes compete for the cores, "
            "the figures are low and noisy")  # fmt: skip
    if report["throughput"]:
        say(f"pull + push of {c['ids']:,} distinct rows x {c['dim']} float32 per step, a {c['rows']:,}-row table on {c['pservers']} pservers, SGD; "
            f"median of {c['repeats']} steps after {c['warmup']} warm-up")  # fmt: skip
        say(f"{'route':<40} {'rows/s':>12} {'min':>12} {'max':>12} {'ms/step':>8} {'pull ms':>8} {'push ms':>8} {'pserver ms':>10} {'GB/s':>6}")
        for r in report["throughput"]:
            update = f"{1000 * r['update_s']:.2f}" if "update_s" in r else "-"
            say(f"{r['label']:<40} {r['rows_per_s']:>12,.0f} {r['rows_per_s_min']:>12,.0f} {r['rows_per_s_max']:>12,.0f} {1000 * r['step_s']:>8.2f} "
                f"{1000 * r['pull_s']:>8.2f} {1000 * r['push_s']:>8.2f} {update:>10} {r['gbps']:>6.2f}")  # fmt: skip
        say("(pserver ms: the slower pserver's own time taking the push, median; raw TCP: push = sending, pull = receiving the echo; "
            "GB/s: ids and rows both ways / step time)")  # fmt: skip
    if report["memory"]:
        say("")
        trim = f"trim_every {c['trim_every']:g}" if c["trim_every"] > 0 else "trim_every 0: no malloc_trim"
        say(f"pserver memory: RSS growth over the fill of {c['rows']:,} rows against the raw bytes of the rows and their optimizer state ({trim})")
        say(f"{'rule':<8} {'pserver':>7} {'rows':>11} {'RSS before MiB':>14} {'at once MiB':>11} {'ratio':>7} {'settled MiB':>11} {'B/row':>7} {'raw B/row':>9} "
            f"{'ratio':>7} {'store B/row':>11} {'store ratio':>11}")  # fmt: skip
        for r in report["memory"]:
            say(f"{r['rule']:<8} {r['pserver']:>7} {r['rows']:>11,} {r['rss_before'] / 2**20:>14,.0f} {r['rss_at_once'] / 2**20:>11,.0f} "
                f"{r['ratio_at_once']:>7.3f} {r['rss_after'] / 2**20:>11,.0f} {r['bytes_per_row']:>7.0f} {r['row_bytes']:>9} {r['ratio']:>7.3f} "
                f"{r.get('store_bytes_per_row', float('nan')):>11.0f} {r.get('store_ratio', float('nan')):>11.3f}")  # fmt: skip
        say(f"(at once: right after the fill; settled: {c['settle_s']:g} s later, the target's figure: B/row and ratio are its RSS growth "
            "over the raw bytes; store: the bytes the row store says it holds, table_stats)")  # fmt: skip
    if report["ctr"] is not None:
        x = report["ctr"]
        say("")
        say(f"CTR example: {x['samples']:,} samples x {x['passes']} pass(es), batch {x['batch_size']}, {x['optimizer']} lr {x['lr']:g}")
        p, t = x["pdps"], x["torch"]
        say(f"  pdps ({p['trainers']} trainers x {p['pservers']} pservers, {p['mode']}, inproc): {p['samples_per_s']:,.0f} samples/s, AUC {p['auc']:.3f}")
        say(f"  torch (one process, EmbeddingBag sparse=True + Adagrad): {t['samples_per_s']:,.0f} samples/s, AUC {t['auc']:.3f}")
    say("")
    say("seconds: " + ", ".join(f"{k} {v:.1f}" for k, v in report["section_s"].items()) + f"; total {report['total_s']:.1f}")
    for name, r in report["ratios"].items():
        target = f"   target {'<=' if name == 'memory' else '>='} {r['target']:g}: {'MET' if r['met'] else 'MISSED'}" if "target" in r else "   (no target)"
        say(f"{name:<16} {r['value']:.3f}x{target}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--rows", type=int, help=f"rows of the table (default {FULL['rows']:,}, --quick {QUICK['rows']:,})")
    p.add_argument("--ids", type=int, help=f"distinct ids per step (default {FULL['ids']:,}, --quick {QUICK['ids']:,})")
    p.add_argument("--repeats", type=int, help=f"timed steps per route (default {FULL['repeats']}, --quick {QUICK['repeats']})")
    p.add_argument("--warmup", type=int, help=f"untimed steps first (default {FULL['warmup']}, --quick {QUICK['warmup']})")
    p.add_argument("--ctr-samples", type=int, help=f"CTR training samples (default {FULL['ctr_samples']:,}, --quick {QUICK['ctr_samples']:,})")
    p.add_argument("--ctr-passes", type=int, help=f"CTR passes (default {FULL['ctr_passes']}, --quick {QUICK['ctr_passes']})")
    p.add_argument("--skip", nargs="+", choices=SECTIONS, default=[], help="parts not to run")
    p.add_argument("--tmp", type=Path, default=Path(tempfile.gettempdir()), help="where the CTR dataset goes")
    p.add_argument("--quick", action="store_true", help="1M rows, 8k ids a step, 3 steps, a small CTR run")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout's last line")
    p.add_argument("--trim-every", type=float, help=f"the pserver processes' trim_every (default {FULL['trim_every']:g}, --quick {QUICK['trim_every']:g}; "
                   "0: no malloc_trim, to compare)")
    args = p.parse_args(argv)
    preset = QUICK if args.quick else FULL
    rows, ids, repeats, ctr_samples, ctr_passes = (getattr(args, k) or preset[k] for k in ("rows", "ids", "repeats", "ctr_samples", "ctr_passes"))
    warmup = preset["warmup"] if args.warmup is None else args.warmup
    trim_every = preset["trim_every"] if args.trim_every is None else args.trim_every
    if not 1 <= ids <= rows or repeats < 1 or warmup < 0 or ctr_samples < 1 or ctr_passes < 1:
        p.error("--ids must be in [1, --rows]; --repeats, --ctr-samples and --ctr-passes positive; --warmup not negative")
    if ids > (1 << 20):
        p.error("--ids is at most sparse_max_ids (1,048,576)")
    sections = set(SECTIONS) - set(args.skip)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)
    began = time.monotonic()
    load_start = os.getloadavg()
    try:
        report = run(rows=rows, ids=ids, repeats=repeats, warmup=warmup, ctr_samples=ctr_samples, ctr_passes=ctr_passes, sections=sections, tmp=args.tmp,
                     trim_every=trim_every)
    except (RuntimeError, TimeoutError, pdps.PdpsError) as exc:
        say(f"bench/sparse.py: {exc}")
        return 1
    finish("bench/sparse.py", argv, began,
           {"rows": rows, "ids": ids, "dim": DIM, "dtype": "float32", "pservers": PSERVERS, "repeats": repeats, "warmup": warmup, "lr": LR,
            "rules": ["SGD", "Adagrad"] if "memory" in sections else ["SGD"], "ctr_samples": ctr_samples, "ctr_passes": ctr_passes,
            "sections": sorted(sections), "torch_threads": THREADS,
            "trim_every": trim_every, "settle_s": settle_s(trim_every)},
           report, packages=("torch", "grpcio", "numpy"), table=print_table, as_json=args.json, loadavg_start=load_start)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
