"""The control plane on a real etcd and Redis: the job shape of ``bench/scale.py`` at the
largest size this machine runs, counted on pdps's side and by the store itself, against
the same job on ``memory://`` (the prediction).

A benchmark, not a test: it prints figures and ratios and asserts nothing.
docs/scale.md is the cost model and (section "Real stores") the store limits these figures
are read against.

What runs
---------
* Throwaway servers on free 127.0.0.1 ports (``tests/servers.py``: etcd and
  ``redis-server``, data under /dev/shm, Redis persisting nothing), each with its
  **default limits** (etcd: 1.5 MiB a request, 128 operations a transaction, a 2 GiB
  quota), so that a job that fits here fits a stock server.
* On each store (``--stores``: ``memory`` first, the prediction, then ``etcd`` and
  ``redis``), two real jobs through ``pdps.simulate`` (the library's master, pservers and
  trainers, ``inproc://`` transport, sync mode, ``overlap`` off), the data source, model
  and training function of ``bench/scale.py``:

  - **steps**: ``--trainers`` trainer threads (200) x ``--pservers`` (4); each trainer
    holds one task of ``--steps`` records (6), one record a batch, so the job is
    ``--steps`` sync rounds with every trainer in each;
  - **tasks**: ``--task-trainers`` trainers (8) over ``--tasks`` tasks (100,000) of one
    record each; the training function takes each batch and does not step, so what
    runs is the per-task control plane: the master's ``get_task`` / ``finish_task``
    (group-committed), the trainer's read of the attempt's progress.

* The store is wrapped in :class:`pdps.runtime.counting.CountingStore` (calls, reads
  and writes by key family, bytes, compare-and-set conflicts) and the transport in the
  Prometheus meter (``pdps.adapters.prometheus_metrics``), whose client-side call counts
  are the messages. In the steps job ``memory://`` waits ``--latency-ms`` (0.5) before
  each ``get`` and ``commit``, as in ``bench/scale.py``: a networked store's round trip,
  without which trainers committing together would hardly ever race. The tasks job
  has no race to model (the master has one transaction in flight at a time), so there
  ``memory://`` waits for nothing.
* **The steady window**, marked from the training function (nothing here reads a
  key's layout, so a change to the round protocol needs no change here): for steps,
  from the moment the first trainer is back from its step 1 (round 1 closed) to the
  moment the first is back from its last step, divided by the rounds between; for
  tasks, from the batch of task N/10 to that of task 9N/10 (batches counted over all
  trainers), divided by the tasks between. ``contributions / step`` (trainer steps in
  the window per round) says whether every trainer took part in every round.
* **The store's own view**, read at the same two marks: etcd's ``/metrics`` on its
  client URL (``etcd_mvcc_range_total``, ``_put_total``, ``_txn_total``,
  ``_delete_total``, ``etcd_debugging_mvcc_total_put_size_in_bytes``: the bytes of the
  revisions written, the history that counts against the quota,
  ``etcd_server_proposals_committed_total``, the gRPC bytes and messages received,
  ``etcd_debugging_mvcc_events_total``: watch events sent; the database size and live
  keys at the end); Redis's ``INFO`` (``total_commands_processed``, the network bytes,
  ``used_memory``, ``instantaneous_ops_per_sec`` at the second mark, the keys).
* Ratios: each figure on etcd and on Redis over the same figure on ``memory://``
  (measured / predicted: timing-dependent figures, the conflicts and the reads of
  waiting pulls, may differ; writes and messages should not), and the store's count
  over pdps's (etcd's puts / pdps's writes, its put bytes / pdps's bytes written, Redis
  commands / pdps's store operations).

Run
---
    .venv/bin/python bench/scale_stores.py                # ~5 min on 2 cores
    .venv/bin/python bench/scale_stores.py --quick        # ~10 s
    .venv/bin/python bench/scale_stores.py --stores memory etcd --trainers 100 --tasks 20000
    .venv/bin/python bench/scale_stores.py --quick --json    # table on stderr, JSON on stdout's last line
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shlex
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for bench.* and tests.servers (throwaway etcd / Redis)

import torch  # noqa: E402

import pdps  # noqa: E402
from bench.machine import describe  # noqa: E402
from bench.scale import LEASE_TTL, messages, say  # noqa: E402
from pdps.shell.control_plane import Records, scalars  # noqa: E402
from pdps.adapters.prometheus_metrics import RoleMetrics  # noqa: E402
from pdps.core.job import Keys  # noqa: E402
from pdps.registry import open_compute, open_store, open_transport  # noqa: E402
from pdps.ports.coordination import Put  # noqa: E402
from pdps.runtime.counting import CountingStore, StoreCounts  # noqa: E402
from tests.servers import EtcdServer, RedisServer  # noqa: E402

STORES = ("memory", "etcd", "redis")
FULL = {"trainers": 200, "pservers": 4, "steps": 6, "tasks": 100_000, "task_trainers": 8, "latency_ms": 0.5}
QUICK = {"trainers": 20, "pservers": 2, "steps": 4, "tasks": 2_000, "task_trainers": 2, "latency_ms": 0.5}
JOB_TIMEOUT_S = 900.0  # one job, at most
FIRST_STEP = 1  # the window opens when the first trainer is back from this step: round 1 closed

#: etcd's counters of interest: the name in /metrics -> the name shown
ETCD_COUNTERS = {
    "etcd_mvcc_range_total": "ranges",
    "etcd_mvcc_put_total": "puts",
    "etcd_mvcc_txn_total": "txns",
    "etcd_mvcc_delete_total": "deletes",
    "etcd_debugging_mvcc_total_put_size_in_bytes": "put bytes",
    "etcd_server_proposals_committed_total": "proposals committed",
    "grpc_server_msg_received_total": "requests",
    "etcd_network_client_grpc_received_bytes_total": "bytes received",
    "etcd_network_client_grpc_sent_bytes_total": "bytes sent",
    "etcd_debugging_mvcc_events_total": "watch events sent",
}
ETCD_GAUGES = {
    "etcd_mvcc_db_total_size_in_bytes": "db size",
    "etcd_mvcc_db_total_size_in_use_in_bytes": "db size in use",
    "etcd_debugging_mvcc_keys_total": "keys",
}
REDIS_COUNTERS = {"total_commands_processed": "commands", "total_net_input_bytes": "bytes received", "total_net_output_bytes": "bytes sent"}
REDIS_GAUGES = {"used_memory": "used memory", "instantaneous_ops_per_sec": "instantaneous ops/s", "keys": "keys"}


# --- the store's own view ------------------------------------------------------------------


class NoView:
    """``memory://`` has no server to ask."""

    counters: dict[str, str] = {}
    gauges: dict[str, str] = {}
    version = "in process"

    def read(self) -> dict[str, float]:
        return {}


class EtcdView:
    """etcd's Prometheus endpoint on its client URL: the counters and gauges above."""

    counters, gauges = ETCD_COUNTERS, ETCD_GAUGES

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{self.base}/version", timeout=10) as resp:
            self.version = "etcd " + json.loads(resp.read())["etcdserver"]

    def read(self) -> dict[str, float]:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out = dict.fromkeys([*self.counters, *self.gauges], 0.0)
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in out:  # summed over labels (gRPC method, ...)
                    out[s.name] += s.value
        return out


class RedisView:
    """Redis's ``INFO``: the counters and gauges above (``keys``: db 0's)."""

    counters, gauges = REDIS_COUNTERS, REDIS_GAUGES

    def __init__(self, port: int) -> None:
        import redis

        self._client = redis.Redis(host="127.0.0.1", port=port)
        self.version = "Redis " + self._client.info("server")["redis_version"]

    def read(self) -> dict[str, float]:
        info = self._client.info("all")
        out = {k: float(info.get(k, 0)) for k in [*self.counters, *self.gauges] if k != "keys"}
        out["keys"] = float(info.get("db0", {}).get("keys", 0))
        return out


@contextlib.contextmanager
def store_server(name: str) -> Any:
    """(url, view) of a fresh store: a throwaway server with its default limits, or ``memory://``."""
    if name == "memory":
        yield "memory://", NoView()
        return
    server = {"etcd": EtcdServer, "redis": RedisServer}[name]()
    try:
        server.start()
        yield server.url, (EtcdView if name == "etcd" else RedisView)(server.port)
    finally:
        server.stop()


# --- counting ------------------------------------------------------------------------------


class Measured(CountingStore):
    """A counting store that also notes the largest value written and the largest
    transaction (as etcd's ``--max-txn-ops`` counts it), each with its key family; and
    that waits ``latency`` seconds before each ``get`` and ``commit``, a networked
    store's round trip, for ``memory://`` (see ``bench/scale.py``)."""

    def __init__(self, inner: Any, *, root: str, latency: float = 0.0) -> None:
        super().__init__(inner, root=root)
        self.latency = latency
        self.largest_value: tuple[int, str] = (0, "")
        self.largest_txn: tuple[int, str] = (0, "")

    def _note(self, ops: Sequence[Any], txn_ops: int) -> None:
        with self._lock:
            for op in ops:
                if isinstance(op, Put) and len(op.value) > self.largest_value[0]:
                    self.largest_value = (len(op.value), self.family(op.key))
            if ops and txn_ops > self.largest_txn[0]:
                self.largest_txn = (txn_ops, self.family(ops[0].key))

    def get(self, key: str) -> Any:
        if self.latency:
            time.sleep(self.latency)
        return super().get(key)

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        self._note((Put(key, value, lease),), 1)
        return super().put(key, value, lease=lease)

    def commit(self, compares: Any, success: Any, failure: Any = (), *, fence: Any = None) -> Any:
        if self.latency:
            time.sleep(self.latency)
        # etcd's count: the longest of the three lists, plus the outer fence's compares a
        # fenced transaction is nested in (etcdserver/api/v3rpc/key.go, checkTxnRequest)
        fenced = len(fence.compares()) if fence is not None else 0
        self._note(success, fenced + max(len(compares), len(success), len(failure)))
        return super().commit(compares, success, failure, fence=fence)


class Window:
    """The counts at two marks of a job, noted from the training function.

    ``tick(n)`` is called after each step (``n``: the trainer's steps so far) or each
    batch (``n`` None: the ticks so far, over all trainers, are the mark). The first
    tick to reach ``first`` or ``last`` notes pdps's counts, the messages, the time, the
    ticks before it, and the store's own view.
    """

    def __init__(self, store: CountingStore, metrics: RoleMetrics, view: Any, first: int, last: int) -> None:
        self._store, self._metrics, self._view = store, metrics, view
        self.first, self.last = first, last
        self._lock = threading.Lock()
        self.ticks = 0
        self.at: dict[int, dict[str, Any]] = {}

    def tick(self, n: int | None = None) -> None:
        with self._lock:
            self.ticks += 1
            mark = self.ticks if n is None else n
            if mark not in (self.first, self.last) or mark in self.at:
                return
            noted = self.at[mark] = {"counts": self._store.counts(), "messages": messages(self._metrics), "t": time.perf_counter(),
                                     "ticks": self.ticks - 1}
        noted["view"] = self._view.read()  # outside the lock: an HTTP scrape takes milliseconds

    def figures(self, unit: str) -> dict[str, Any]:
        """Per ``unit`` (a round or a task) of the window, on pdps's side and the store's."""
        if set(self.at) != {self.first, self.last}:
            raise RuntimeError(f"the job reached marks {sorted(self.at)} of {self.first} and {self.last}: no steady window to count")
        a, b = self.at[self.first], self.at[self.last]
        units = self.last - self.first
        c: StoreCounts = b["counts"].minus(a["counts"])
        msgs = {k: v - a["messages"].get(k, 0) for k, v in b["messages"].items() if v - a["messages"].get(k, 0)}
        seconds = b["t"] - a["t"]
        per = lambda x: x / units  # noqa: E731
        families = sorted(set().union(*(c.to_json()[w] for w in ("reads", "writes", "events"))))
        view = {**{k: per(b["view"][k] - a["view"][k]) for k in self._view.counters}, **{k: b["view"][k] for k in self._view.gauges}}
        return {
            "units": units,
            "seconds": seconds,
            f"ticks_per_{unit}": per(b["ticks"] - a["ticks"]),
            f"s_per_{unit}": per(seconds),
            "store_ops_per_s": c.ops / seconds,
            f"ops_per_{unit}": per(c.ops),
            f"reads_per_{unit}": per(c.total("reads")),
            f"writes_per_{unit}": per(c.total("writes")),
            f"bytes_written_per_{unit}": per(c.total("bytes_written")),
            f"bytes_read_per_{unit}": per(c.total("bytes_read")),
            f"conflicts_per_{unit}": per(c.total("conflicts")),
            f"events_per_{unit}": per(c.total("events")),
            f"messages_per_{unit}": per(sum(msgs.values())),
            "calls": {k: per(v) for k, v in sorted(c.calls.items())},
            "by_family": {f: {w: per(c.to_json()[w].get(f, 0)) for w in ("reads", "writes", "bytes_written", "bytes_read", "conflicts", "events")}
                          for f in families},
            "store_view": view,  # counters per unit, gauges at the second mark
            "store_view_per_s": {k: (b["view"][k] - a["view"][k]) / seconds for k in self._view.counters},
        }


# --- the jobs ------------------------------------------------------------------------------


def job(url: str, view: Any, *, trainers: int, pservers: int, tasks: int, records: int, first: int, last: int, steps: bool,
        latency: float, timeout: float) -> dict[str, Any]:
    """One simulated job on ``url``; its window's figures per round (``steps``) or per task."""
    name = f"stores-{uuid.uuid4().hex[:8]}"
    keys = Keys(name)
    inner = open_store(url)
    store = Measured(inner, root=keys.root, latency=latency)
    metrics = RoleMetrics(name, "job", "all")
    window = Window(store, metrics, view, first, last)

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(scalars(ctx.config.pservers))
        for batch in ctx.batches():
            if steps:
                ctx.step((model.w * batch["x"].sum()).sum())
                window.tick(ctx.steps)
            else:
                window.tick()

    view_before = view.read()
    began = time.perf_counter()
    try:
        result = pdps.simulate(
            train, dataset=Records(tasks, records), store=store, transport=metrics.transport(open_transport("inproc")),
            compute=open_compute("torch", device="cpu"), timeout=timeout, name=name, trainers=trainers, pservers=pservers, mode="sync",
            batch_size=1, overlap="off", min_block=1, num_slots=max(64, 8 * pservers), lease_ttl=LEASE_TTL,
        )
        seconds = time.perf_counter() - began
        view_after = view.read()
        whole = store.counts()
    finally:
        inner.close()
    unit = "step" if steps else "task"
    return {
        "trainers": trainers,
        "pservers": pservers,
        "tasks": tasks,
        "records_per_task": records,
        "tasks_done": result.tasks_done,
        "job_s": seconds,
        "job_ops": whole.ops,
        "job_writes": whole.total("writes"),
        "job_bytes_written": whole.total("bytes_written"),
        "job_bytes_read": whole.total("bytes_read"),
        "largest_value_bytes": store.largest_value[0],
        "largest_value_family": store.largest_value[1],
        "largest_txn_ops": store.largest_txn[0],
        "largest_txn_family": store.largest_txn[1],
        "job_store_view": {k: view_after[k] - view_before[k] for k in view.counters} | {k: view_after[k] for k in view.gauges},
        **window.figures(unit),
    }


def on_store(name: str, sizes: dict[str, Any], timeout: float) -> dict[str, Any]:
    latency = sizes["latency_ms"] / 1000 if name == "memory" else 0.0
    with store_server(name) as (url, view):
        t, p, s = sizes["trainers"], sizes["pservers"], sizes["steps"]
        say(f"[{name}] steps: {t} trainers x {p} pservers, {s} sync steps ...")
        step_row = job(url, view, trainers=t, pservers=p, tasks=t, records=s, first=FIRST_STEP, last=s, steps=True, latency=latency, timeout=timeout)
        say(f"[{name}]   {step_row['ops_per_step']:,.0f} store ops, {step_row['bytes_written_per_step']:,.0f} B written, "
            f"{step_row['conflicts_per_step']:,.1f} conflicts per step; {1000 * step_row['s_per_step']:,.0f} ms/step ({step_row['job_s']:.1f} s)")
        n, k = sizes["tasks"], sizes["task_trainers"]
        say(f"[{name}] tasks: {n:,} tasks x 1 record, {k} trainers ...")
        task_row = job(url, view, trainers=k, pservers=p, tasks=n, records=1, first=n // 10, last=n - n // 10, steps=False,
                       latency=0.0, timeout=timeout)
        say(f"[{name}]   {task_row['ops_per_task']:,.1f} store ops, {task_row['bytes_written_per_task']:,.0f} B written per task; "
            f"{task_row['store_ops_per_s']:,.0f} store ops/s ({task_row['job_s']:.1f} s)")
        return {"store": name, "server": view.version, "latency_ms": 1000 * latency, "steps": step_row, "tasks": task_row}


RATIO_FIGURES = {
    "steps": ("ops_per_step", "reads_per_step", "writes_per_step", "bytes_written_per_step", "bytes_read_per_step", "conflicts_per_step",
              "messages_per_step", "s_per_step"),
    "tasks": ("ops_per_task", "reads_per_task", "writes_per_task", "bytes_written_per_task", "bytes_read_per_task", "messages_per_task",
              "s_per_task"),
}
#: the store's count over pdps's: (store view key, pdps figure)
AGREEMENT = {
    "etcd": (("etcd_mvcc_put_total", "writes"), ("etcd_debugging_mvcc_total_put_size_in_bytes", "bytes_written"),
             ("grpc_server_msg_received_total", "ops"), ("etcd_mvcc_range_total", "reads")),
    "redis": (("total_commands_processed", "ops"), ("total_net_input_bytes", "bytes_written")),
}


def run(stores: Sequence[str], sizes: dict[str, Any], timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    rows = [on_store(s, sizes, timeout) for s in stores]
    predicted = next((r for r in rows if r["store"] == "memory"), None)
    for r in rows:
        r["vs_memory"] = {
            kind: {f: (r[kind][f] / predicted[kind][f] if predicted[kind][f] else None) for f in figures}
            for kind, figures in RATIO_FIGURES.items()
        } if predicted is not None and r is not predicted else {}
        r["store_vs_pdps"] = {
            kind: {f"{key} / {ours}": (r[kind]["store_view"][key] / r[kind][f"{ours}_per_{kind[:-1]}"] if r[kind][f"{ours}_per_{kind[:-1]}"] else None)
                   for key, ours in AGREEMENT.get(r["store"], ())}
            for kind in RATIO_FIGURES
        }
    return {
        "bench": "stores",
        "config": {**sizes, "stores": list(stores)},
        "machine": describe("torch", "pdps", "redis", "etcd3"),
        "loadavg": list(os.getloadavg()),
        "results": rows,
        "total_s": time.perf_counter() - t0,
    }


# --- the report ----------------------------------------------------------------------------


def _num(v: Any) -> str:
    if v is None:
        return "-"
    if abs(v) >= 100:
        return f"{v:,.0f}"
    return f"{v:,.1f}" if abs(v) >= 1 else f"{v:.3g}"


def _table(p: Callable[..., None], rows: Sequence[dict[str, Any]], lines: Sequence[tuple[str, Callable[[dict[str, Any]], Any]]], ratios: bool) -> None:
    names = [r["store"] for r in rows]
    ratio_of = [r for r in rows if r["store"] != "memory"] if ratios and "memory" in names else []
    h = f"{'':<30}" + "".join(f"{n:>13}" for n in names) + "".join(f"{r['store'] + '/mem':>12}" for r in ratio_of)
    p(h)
    p("-" * len(h))
    mem = next((r for r in rows if r["store"] == "memory"), None)
    for label, get in lines:
        vals = [get(r) for r in rows]
        line = f"{label:<30}" + "".join(f"{_num(v):>13}" for v in vals)
        for r in ratio_of:
            a, b = get(r), get(mem)  # type: ignore[arg-type]
            line += f"{(f'{a / b:.2f}x' if a is not None and b else '-'):>12}"
        p(line)


def print_report(report: dict[str, Any], out: Any) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    cfg, rows = report["config"], report["results"]
    p("stores: " + ", ".join(f"{r['store']} ({r['server']})" for r in rows)
      + f"; in the steps job memory:// waits {cfg['latency_ms']:g} ms before each get and commit (a round trip); "
      "the servers run with their default limits")
    for kind, unit in (("steps", "step"), ("tasks", "task")):
        first = rows[0][kind]
        p("")
        if kind == "steps":
            p(f"sync steps: {first['trainers']} trainers x {first['pservers']} pservers, {cfg['steps']} steps each; "
              f"per round of the steady window ({first['units']} rounds)")
        else:
            p(f"tasks: {first['tasks']:,} tasks of 1 record, {first['trainers']} trainers, no steps; per task of the steady window "
              f"({first['units']:,} tasks)")
        lines: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
            (f"store ops / {unit}", lambda r, k=kind, u=unit: r[k][f"ops_per_{u}"]),
            ("  reads", lambda r, k=kind, u=unit: r[k][f"reads_per_{u}"]),
            ("  writes", lambda r, k=kind, u=unit: r[k][f"writes_per_{u}"]),
            ("  watch events", lambda r, k=kind, u=unit: r[k][f"events_per_{u}"]),
            (f"B written / {unit}", lambda r, k=kind, u=unit: r[k][f"bytes_written_per_{u}"]),
            (f"B read / {unit}", lambda r, k=kind, u=unit: r[k][f"bytes_read_per_{u}"]),
            (f"conflicts / {unit}", lambda r, k=kind, u=unit: r[k][f"conflicts_per_{u}"]),
            (f"messages / {unit}", lambda r, k=kind, u=unit: r[k][f"messages_per_{u}"]),
            (f"{'contributions / step' if kind == 'steps' else 'batches / task'}", lambda r, k=kind, u=unit: r[k][f"ticks_per_{u}"]),
            (f"ms / {unit}", lambda r, k=kind, u=unit: 1000 * r[k][f"s_per_{u}"]),
            ("store ops / s", lambda r, k=kind: r[k]["store_ops_per_s"]),
            ("whole job: s", lambda r, k=kind: r[k]["job_s"]),
            ("largest value written, B", lambda r, k=kind: r[k]["largest_value_bytes"]),
            ("largest txn, etcd's ops", lambda r, k=kind: r[k]["largest_txn_ops"]),
        ]
        _table(p, rows, lines, ratios=True)
        p("(largest value, in: " + ", ".join(f"{r['store']} {r[kind]['largest_value_family']}/" for r in rows)
          + "; largest transaction, in: " + ", ".join(f"{r['store']} {r[kind]['largest_txn_family']}/" for r in rows)
          + "; a transaction counted as etcd counts --max-txn-ops: the longest of its compares, success and failure lists, "
          "plus the 2 compares of a fence)")
        p(f"by key family, per {unit} (reads / writes / B written / B read):")
        for r in rows:
            fams = r[kind]["by_family"]
            p(f"  {r['store']:<7}" + "; ".join(f"{f} {v['reads']:,.1f}/{v['writes']:,.1f}/{v['bytes_written']:,.0f}/{v['bytes_read']:,.0f}"
                                                 for f, v in fams.items() if v["reads"] or v["writes"] or v["events"]))
        for r in rows:
            view = r[kind]["store_view"]
            if not view:
                continue
            names = {**({} if r["store"] != "etcd" else ETCD_COUNTERS), **({} if r["store"] != "redis" else REDIS_COUNTERS)}
            gauges = ETCD_GAUGES if r["store"] == "etcd" else REDIS_GAUGES
            p(f"  {r['store']}'s own count, per {unit}: " + ", ".join(f"{names[k]} {_num(view[k])}" for k in names))
            p(f"  {r['store']}'s own rate, per s: " + ", ".join(f"{names[k]} {_num(v)}" for k, v in r[kind]["store_view_per_s"].items()))
            p(f"  {r['store']} at the window's end: " + ", ".join(f"{gauges[k]} {_num(view[k])}" for k in gauges))
            agree = r["store_vs_pdps"][kind]
            if agree:
                p(f"  {r['store']} / pdps: " + ", ".join(f"{k} {_num(v)}" for k, v in agree.items()))
    p(f"\ntotal run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stores", nargs="+", choices=STORES, default=list(STORES), help="the stores, in order (memory:// is the prediction)")
    ap.add_argument("--quick", action="store_true", help=f"smaller sizes: {QUICK}")
    ap.add_argument("--trainers", type=int, help=f"trainers of the steps job (default {FULL['trainers']})")
    ap.add_argument("--pservers", type=int, help=f"pservers of both jobs (default {FULL['pservers']})")
    ap.add_argument("--steps", type=int, help=f"sync steps per trainer (default {FULL['steps']}, at least {FIRST_STEP + 2})")
    ap.add_argument("--tasks", type=int, help=f"tasks of the tasks job (default {FULL['tasks']:,}, at least 10)")
    ap.add_argument("--task-trainers", type=int, help=f"trainers of the tasks job (default {FULL['task_trainers']})")
    ap.add_argument("--latency-ms", type=float, help=f"memory:// in the steps job: the wait before each get and commit (default {FULL['latency_ms']})")
    ap.add_argument("--timeout", type=float, default=JOB_TIMEOUT_S, help="seconds one job may take (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="table on stderr, one JSON object as stdout's last line")
    args = ap.parse_args(argv)
    sizes = dict(QUICK if args.quick else FULL)
    for k in sizes:
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    if min(sizes["trainers"], sizes["pservers"], sizes["task_trainers"]) < 1:
        ap.error("trainers, pservers and task trainers must be positive")
    if sizes["steps"] < FIRST_STEP + 2 or sizes["tasks"] < 10:
        ap.error(f"--steps must be at least {FIRST_STEP + 2} and --tasks at least 10 (a window of at least two)")
    if sizes["latency_ms"] < 0:
        ap.error("--latency-ms must be at least 0")
    report = run(args.stores, sizes, args.timeout)
    report["command"] = shlex.join(["python", "bench/scale_stores.py", *(sys.argv[1:] if argv is None else argv)])
    print_report(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, sort_keys=True, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
