"""Where pdps's control plane stops scaling: store operations, bytes, compare-and-set
conflicts and messages per sync step as the trainers and pservers grow, and what one
task costs the master as the tasks grow.

A benchmark, not a test: it prints figures and ratios between sizes and asserts nothing.
docs/scale.md is the cost model these figures check.

What runs
---------
* **Sync steps** (``--trainers``, ``--pservers``: every pair): a real job through
  ``pdps.simulate`` (the library's master, pservers and trainers; nothing copied) on
  ``memory://`` with ``inproc://``, sync mode, ``overlap`` off (one thread per trainer,
  not one per trainer and pserver). Each trainer gets one task of ``--steps`` records,
  one record a batch, so it takes ``--steps`` sync steps. The compute is torch with a
  model of ``8 x pservers`` scalars (about 8 one-element blocks per pserver): every push,
  stage, apply and pull runs its real code on tensors that cost microseconds, so what
  the figures weigh is the control plane. (A compute that only counts would need a
  second way for ``simulate`` to fetch the final parameters; the counts below do not
  depend on what a step computes.)
  The store is wrapped in :class:`pdps.runtime.counting.CountingStore` and the transport
  in the Prometheus meter (``pdps.adapters.prometheus_metrics``), whose client-side call
  counts are the messages. The figures are those of the **steady window**: from the
  commit that closes round 1 (every trainer has its task) to the one that closes round
  ``--steps`` (the last full round), divided by the rounds in it. Each ``get`` and
  ``commit`` waits ``--latency-ms`` first (default 0.5), a networked store's round trip:
  on ``memory://`` alone a read and the commit after it are microseconds apart, and
  trainers committing to the same round record would hardly ever race.
  Reads made by pulls waiting at the barrier depend on time (a waiting pull re-reads
  the round record every 0.25 s), so they vary from run to run; writes, conflicts and
  messages do not much.
* **Tasks** (``--tasks``): a real Master over a data source that only describes N tasks,
  on a counting ``memory://`` store. Memory: ``tracemalloc`` around building what the
  master keeps per task (the task specs and :class:`pdps.core.tasks.TaskQueue`), bytes
  per task. Store: one trainer loops ``get_task`` / ``finish_task`` over the typed calls
  for ``--finishes`` tasks; store operations and bytes per finished task (a dispatch and
  a finish), and what the master's start wrote per task.

* **One whole pass** (``--pass``, instead of the above): ``pdps.simulate_control_plane``
  at 1,000 trainers x 64 pservers x 1,000,000 one-record tasks (``--trainers``,
  ``--pservers``, ``--tasks``: the first of each), async, each trainer stepping on one
  task in ``--step-every`` (1,000) it holds: every task is leased, read, finished and
  audited by the real master, while the pservers' traffic (2 x 64 messages a step) runs at
  1/1,000 of the tasks, since 128 messages for each of 1M tasks do not fit this machine.
  It prints per role store operations, keys and bytes written and read, conflicts and
  messages, the master's memory per task, simulated time, and the audit (every task done
  exactly once). docs/scale.md, "One pass at scale", has the figures.

Ratios (the targets of ``pdps bench --suite scale``): each cost at the largest size
over the same cost at the smallest, next to the growth of the size itself: at 10x the
trainers a linear cost per step grows 10x (the target allows 12x); a per-task cost
flat in the tasks grows 1x (1.2x allowed).

Run
---
    .venv/bin/python bench/scale.py                 # ~45 s on 2 cores
    .venv/bin/python bench/scale.py --quick         # ~7 s
    .venv/bin/python bench/scale.py --trainers 10 100 300 --pservers 16 --tasks 10000   # ~1 min
    .venv/bin/python bench/scale.py --trainers 10 50 --pservers 4 --tasks 10000 --json
    .venv/bin/python bench/scale.py --pass          # one async pass, 1,000 x 64 x 1M tasks: ~25 min
    .venv/bin/python bench/scale.py --pass --trainers 100 --pservers 8 --tasks 20000    # ~15 s

``--json``: the table and progress on stderr, one JSON object on stdout's last line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
import time
import tracemalloc
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import pdps  # noqa: E402
from bench.machine import describe  # noqa: E402
from pdps.adapters.prometheus_metrics import RoleMetrics  # noqa: E402
from pdps.core.job import JobConfig, Keys  # noqa: E402
from pdps.core.tasks import TaskQueue  # noqa: E402
from pdps.core.wire import FinishTaskRequest, GetTaskRequest  # noqa: E402
from pdps.registry import open_compute, open_store, open_transport  # noqa: E402
from pdps.roles import calls  # noqa: E402
from pdps.roles.master import Master  # noqa: E402
from pdps.ports.coordination import Put  # noqa: E402
from pdps.runtime.counting import CountingStore, StoreCounts  # noqa: E402
from pdps.shell.control_plane import Records, train  # noqa: E402

FULL = {"trainers": (10, 100), "pservers": (4, 16), "steps": 6, "tasks": (10_000, 100_000, 1_000_000), "finishes": 2_000, "latency_ms": 0.5}
QUICK = {"trainers": (5, 50), "pservers": (2, 8), "steps": 5, "tasks": (2_000, 20_000), "finishes": 500, "latency_ms": 0.5}
#: --pass: one whole pass at the issue's scale (docs/scale.md, "One pass at scale")
PASS = {"trainers": 1000, "pservers": 64, "tasks": 1_000_000, "step_every": 1000}
JOB_TIMEOUT_S = 300.0  # one simulated job, at most
LEASE_TTL = attrs.fields(JobConfig).lease_ttl.default  # a job's default, not simulate's short one
FIRST_ROUND = 1  # every trainer holds its task from this round on
#: the growth a target allows a cost, over the growth of the size: 1.2x linear in the
#: trainers and the pservers (12x at 10x the trainers), 1.2x flat in the tasks
SLACK = 1.2
LINEAR_IN = ("trainers", "pservers")
MEMORY_SLACK = 1.5  # the queue's dicts and sets grow by doubling: their slack per task swings with N


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# The dataset (``Records``: tasks described, nothing read) and the training function
# (``train``: torch on 8 x pservers scalars) are the library's, those of
# ``pdps.simulate_control_plane`` (pdps/shell/control_plane.py).


# --- counting messages -------------------------------------------------------------------


def messages(metrics: RoleMetrics) -> dict[str, int]:
    """Calls made so far, by method, as the meter's client side counted them."""
    out: dict[str, int] = {}
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "pdps_rpc_seconds_count" and s.labels.get("side") == "client":
                out[s.labels["method"]] = out.get(s.labels["method"], 0) + int(s.value)
    return out


class MarkedStore(CountingStore):
    """A counting store that notes the counts (and the messages so far) just before the
    commit that closes round ``first`` or round ``last`` (kept if that commit wins), in
    the closing pserver's thread; and that waits ``latency`` seconds before each ``get`` and ``commit``, a
    networked store's round trip (on ``memory://`` a read and the commit after it are
    microseconds apart, so trainers committing together rarely race)."""

    def __init__(self, inner: Any, metrics: RoleMetrics, keys: Keys, first: int, last: int, latency: float) -> None:
        super().__init__(inner, root=keys.root)
        self._metrics, self._keys = metrics, keys
        self.first, self.last, self.latency = first, last, latency
        self.at: dict[int, tuple[StoreCounts, dict[str, int], float]] = {}
        self.record_bytes = 0  # the close marker of round ``last``

    def get(self, key: str) -> Any:
        if self.latency:
            time.sleep(self.latency)
        return super().get(key)

    def commit(self, compares: Any, success: Any, failure: Any = (), *, fence: Any = None) -> Any:
        if self.latency:
            time.sleep(self.latency)
        # Noted *before* the commit that writes the marker: once it is written, the other
        # pservers' watches may apply the round and answer its pulls before this commit
        # returns. Before it, every push of the round is in and none of its pulls is out.
        marks = []
        for op in success:
            entry = self._keys.round_entry(op.key) if isinstance(op, Put) else None
            if entry is not None and entry[2] is None and entry[1] in (self.first, self.last):  # a close marker
                marks.append((entry[1], len(op.value), (self.counts(), messages(self._metrics), time.perf_counter())))
        result = super().commit(compares, success, failure, fence=fence)
        if result.succeeded:
            for round_no, size, at in marks:
                self.at[round_no] = at
                self.record_bytes = size
        return result


def sync_steps(trainers: int, pservers: int, steps: int, *, latency: float = 0.0, timeout: float = JOB_TIMEOUT_S) -> dict[str, Any]:
    """One simulated job; the costs per sync step in its steady window."""
    if steps < FIRST_ROUND + 2:
        raise ValueError(f"steps must be at least {FIRST_ROUND + 2} (a window of at least two rounds), got {steps}")
    name = f"scale-{uuid.uuid4().hex[:8]}"
    keys = Keys(name)
    inner = open_store("memory://")
    metrics = RoleMetrics(name, "job", "all")
    store = window = MarkedStore(inner, metrics, keys, FIRST_ROUND, steps, latency)
    transport = metrics.transport(open_transport("inproc"))
    began = time.perf_counter()
    try:
        result = pdps.simulate(
            train, dataset=Records(trainers, steps), store=store, transport=transport, compute=open_compute("torch", device="cpu"),
            timeout=timeout, name=name, trainers=trainers, pservers=pservers, mode="sync", batch_size=1, overlap="off",
            min_block=1, num_slots=max(64, 8 * pservers), lease_ttl=LEASE_TTL,
        )
        rounds_run = len(inner.range(keys.rounds))
    finally:
        inner.close()
    seconds = time.perf_counter() - began
    if set(window.at) != {window.first, window.last}:
        raise RuntimeError(f"the job closed rounds {sorted(window.at)} of {window.first} and {window.last}: no steady window to count")
    (c0, m0, t0), (c1, m1, t1) = window.at[window.first], window.at[window.last]
    rounds = window.last - window.first
    c = c1.minus(c0)
    msgs = {k: v - m0.get(k, 0) for k, v in m1.items() if v - m0.get(k, 0)}
    per = lambda x: x / rounds  # noqa: E731
    row = {
        "trainers": trainers,
        "pservers": pservers,
        "latency_ms": 1000 * latency,
        "rounds_in_window": rounds,
        "rounds_run": rounds_run,
        "tasks_done": result.tasks_done,
        "job_s": seconds,
        "s_per_step": (t1 - t0) / rounds,
        "store_ops_per_step": per(c.ops),
        "reads_per_step": per(c.total("reads")),
        "writes_per_step": per(c.total("writes")),
        "bytes_written_per_step": per(c.total("bytes_written")),
        "bytes_read_per_step": per(c.total("bytes_read")),
        "bytes_per_step": per(c.total("bytes_written") + c.total("bytes_read")),
        "conflicts_per_step": per(c.total("conflicts")),
        "messages_per_step": per(sum(msgs.values())),
        "messages_by_method_per_step": {k: per(v) for k, v in sorted(msgs.items())},
        "round_marker_bytes": window.record_bytes,
        "window": c.to_json(),
        "trained_by": {t: sorted({s.task for s in steps_of}) for t, steps_of in sorted(result.history.items())},
    }
    row["by_family_per_step"] = {
        f: {what: per(c.to_json()[what].get(f, 0)) for what in ("reads", "writes", "bytes_written", "bytes_read", "conflicts", "events")}
        for f in sorted(set().union(*(c.to_json()[w] for w in ("reads", "writes", "events"))))
    }
    return row


# --- the master, per task ----------------------------------------------------------------


def master_memory(tasks: int) -> dict[str, float]:
    """Bytes the master keeps per task: its task specs and its queue, by tracemalloc."""
    source = Records(tasks, 10)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        specs = source.tasks()
        after_specs = tracemalloc.get_traced_memory()[0]
        queue = TaskQueue.create(specs)
        after_queue = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert queue.counts().todo == tasks
    return {"specs_bytes_per_task": (after_specs - base) / tasks, "queue_bytes_per_task": (after_queue - after_specs) / tasks,
            "master_bytes_per_task": (after_queue - base) / tasks}


def master_store(tasks: int, finishes: int) -> dict[str, Any]:
    """Store costs of a real master over ``tasks`` tasks: its start, and a dispatch + a finish."""
    name = f"scale-master-{uuid.uuid4().hex[:8]}"
    keys = Keys(name)
    store = CountingStore(open_store("memory://"), root=keys.root)
    source = Records(tasks, 10)
    config = JobConfig(name=name, dataset=source.url, lease_ttl=60.0, task_timeout=1e6)
    transport = open_transport("inproc")
    master = Master(store, transport, source, config)
    began = time.perf_counter()
    try:
        master.start()
        start = store.counts()
        trainer = "trainer-0"
        store.put(keys.trainer(trainer), b"{}", lease=store.grant_lease(60.0))
        channel = transport.connect(master.address)
        before = store.counts()
        done = 0
        deadline = time.monotonic() + 120.0
        while done < min(finishes, tasks) and time.monotonic() < deadline:
            reply = calls.call(channel, GetTaskRequest(trainer=trainer, holding=()))
            if reply.task is None:
                raise RuntimeError(f"the master answered {reply} with {tasks - done} tasks left")
            calls.call(channel, FinishTaskRequest(trainer=trainer, task=reply.task.id, attempt=reply.attempt))
            done += 1
        c = store.counts().minus(before)
    finally:
        master.stop()
        store.close()
    return {
        "tasks": tasks,
        "finished": done,
        "seconds": time.perf_counter() - began,
        "start_ops": start.ops,
        "start_bytes_written_per_task": start.total("bytes_written") / tasks,
        "store_ops_per_task": c.ops / done,
        "writes_per_task": c.total("writes") / done,
        "bytes_written_per_task": c.total("bytes_written") / done,
        "bytes_read_per_task": c.total("bytes_read") / done,
        "window": c.to_json(),
    }


# --- one whole pass (--pass) ------------------------------------------------------------


def one_pass(trainers: int, pservers: int, tasks: int, step_every: int, mode: str = "async") -> dict[str, Any]:
    """One pass through ``pdps.simulate_control_plane``: its report as JSON, per role."""
    torch.set_num_threads(1)
    say(f"one {mode} pass: {trainers:,} trainers x {pservers} pservers x {tasks:,} one-record tasks, a step on one task in {step_every} ...")
    began, last = time.perf_counter(), [0.0]

    def progress(state: dict[str, Any]) -> None:
        if time.perf_counter() - last[0] >= 30:
            last[0] = time.perf_counter()
            say(f"  {last[0] - began:,.0f} s: {state['done']:,} done, {state['pending']:,} pending, {state['todo']:,} todo; "
                f"{state['simulated_seconds']:.2f} simulated s")

    report = pdps.simulate_control_plane(trainers=trainers, pservers=pservers, tasks=tasks, mode=mode, step_every=step_every, timeout=3600.0,
                                         progress=progress)
    return {"bench": "scale-pass", "machine": describe("torch", "pdps"), "loadavg": list(os.getloadavg()), "pass": report.to_json()}


def print_pass(report: dict[str, Any], out: Any) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    r = report["pass"]
    n = r["tasks_done"] or 1
    p(f"one {r['mode']} pass: {r['trainers']:,} trainers x {r['pservers']} pservers x {r['tasks']:,} tasks of {r['records']} record(s), "
      f"a step on one task in {r['step_every']}: {r['wall_seconds']:,.0f} s of wall time")
    h = f"{'role':<9} {'store ops':>11} {'keys written':>12} {'B written':>14} {'B read':>14} {'conflicts':>9} {'messages':>11} {'ops/task':>8} {'B w/task':>8}"
    p(h)
    p("-" * len(h))
    for name, role in r["roles"].items():
        p(f"{name:<9} {role['store_ops']:>11,} {role['keys_written']:>12,} {role['bytes_written']:>14,} {role['bytes_read']:>14,} "
          f"{role['conflicts']:>9,} {role['messages']:>11,} {role['store_ops'] / n:>8.2f} {role['bytes_written'] / n:>8,.0f}")
    for name, role in r["roles"].items():
        p(f"  {name}: store calls " + ", ".join(f"{k} {v:,}" for k, v in role["store_calls"].items())
          + ("; messages " + ", ".join(f"{k} {v:,}" for k, v in role["messages_by_method"].items()) if role["messages_by_method"] else ""))
    a = r["audit"]
    p(f"tasks done {r['tasks_done']:,}; trainer steps {r['steps']:,}; master memory {r['master_bytes_per_task']:,.0f} B per task")
    p(f"simulated time {r['simulated_seconds']:,.2f} s ({1000 * r['simulated_seconds_per_task']:.2f} ms a task, "
      f"{1000 * r['simulated_seconds_per_step']:.2f} ms a step; latency {r['latency']})")
    p(f"audit: {a['done_once']:,} of {a['tasks']:,} tasks done exactly once, {a['done_more']} more than once, {a['not_done']} not done; "
      f"{a['records_once']:,} of {a['records']:,} records trained exactly once; {a['attempts']:,} attempts: {'OK' if a['ok'] else 'FAILED'}")


# --- the run -----------------------------------------------------------------------------


def ratio(rows: Sequence[dict[str, Any]], figure: str, axis: str, **fixed: Any) -> dict[str, Any]:
    """``figure`` at the largest ``axis`` over at the smallest (the other axes ``fixed``);
    1.0 for a cost that is zero at both."""
    rows = sorted((r for r in rows if all(r[k] == v for k, v in fixed.items())), key=lambda r: r[axis])
    small, large = rows[0], rows[-1]
    growth = large[axis] / small[axis]
    # zero at both sizes has not grown; from zero to something has, without bound
    value = large[figure] / small[figure] if small[figure] else (1.0 if not large[figure] else float("inf"))
    return {"value": value, "figure": figure, "axis": axis, "from": small[axis], "to": large[axis], "size_growth": growth,
            "allowed": SLACK * (growth if axis in LINEAR_IN else 1.0) if figure != "master_bytes_per_task" else MEMORY_SLACK, **fixed}


def run(trainers: Sequence[int], pservers: Sequence[int], steps: int, tasks: Sequence[int], finishes: int, latency_ms: float = 0.0) -> dict[str, Any]:
    t0 = time.perf_counter()
    torch.set_num_threads(1)
    steps_rows = []
    for p in pservers:
        for t in trainers:
            say(f"sync steps: {t} trainers x {p} pservers, {steps} steps each ...")
            row = sync_steps(t, p, steps, latency=latency_ms / 1000)
            say(f"  {row['store_ops_per_step']:,.0f} store ops, {row['bytes_per_step']:,.0f} B, {row['conflicts_per_step']:,.0f} conflicts, "
                f"{row['messages_per_step']:,.0f} messages per step ({row['job_s']:.1f} s)")
            steps_rows.append(row)
    task_rows = []
    for n in tasks:
        say(f"master: {n:,} tasks ...")
        row = {**master_memory(n), **master_store(n, finishes)}
        say(f"  {row['master_bytes_per_task']:,.0f} B of memory, {row['store_ops_per_task']:.1f} store ops, "
            f"{row['bytes_written_per_task']:,.0f} B written per task")
        task_rows.append(row)
    lo_p, hi_p, most = min(pservers), max(pservers), max(trainers)
    ratios = {}
    for figure, short in (("store_ops_per_step", "ops"), ("writes_per_step", "writes"), ("bytes_per_step", "bytes"), ("conflicts_per_step", "conflicts"),
                          ("messages_per_step", "messages")):
        ratios[f"step_{short}_trainers"] = ratio(steps_rows, figure, "trainers", pservers=lo_p)
        if len(pservers) > 1:
            ratios[f"step_{short}_trainers_{hi_p}ps"] = ratio(steps_rows, figure, "trainers", pservers=hi_p)
            ratios[f"step_{short}_pservers"] = ratio(steps_rows, figure, "pservers", trainers=most)
    for figure, short in (("store_ops_per_task", "ops"), ("bytes_written_per_task", "bytes"), ("master_bytes_per_task", "memory")):
        ratios[f"task_{short}_tasks"] = ratio(task_rows, figure, "tasks")
    return {
        "bench": "scale",
        "config": {"trainers": list(trainers), "pservers": list(pservers), "steps": steps, "tasks": list(tasks), "finishes": finishes,
                   "latency_ms": latency_ms},
        "machine": describe("torch", "pdps"),
        "loadavg": list(os.getloadavg()),
        "steps": steps_rows,
        "tasks": task_rows,
        "master_bytes_per_task": max(r["master_bytes_per_task"] for r in task_rows),
        "ratios": ratios,
        "total_s": time.perf_counter() - t0,
    }


def print_report(report: dict[str, Any], out: Any) -> None:
    p = lambda *a: print(*a, file=out)  # noqa: E731
    cfg = report["config"]
    p(f"sync steps ({cfg['steps']} per trainer; figures per step of the steady window; inproc, memory:// with a "
      f"{cfg['latency_ms']:g} ms round trip per get and commit, torch on scalars):")
    h = (f"{'trainers':>8} {'pservers':>8} {'ops':>9} {'reads':>8} {'writes':>7} {'B written':>10} {'B read':>11} "
         f"{'conflicts':>9} {'messages':>8} {'marker B':>9} {'ms/step':>8}")
    p(h)
    p("-" * len(h))
    for r in report["steps"]:
        p(f"{r['trainers']:>8} {r['pservers']:>8} {r['store_ops_per_step']:>9,.0f} {r['reads_per_step']:>8,.0f} {r['writes_per_step']:>7,.0f} "
          f"{r['bytes_written_per_step']:>10,.0f} {r['bytes_read_per_step']:>11,.0f} {r['conflicts_per_step']:>9,.1f} "
          f"{r['messages_per_step']:>8,.0f} {r['round_marker_bytes']:>9,} {1000 * r['s_per_step']:>8.1f}")
    p("(ops: store calls + watch events delivered; marker B: a round's close marker; reads by waiting pulls depend on time)")
    p("")
    p("per key family and step, at the largest job:")
    big = max(report["steps"], key=lambda r: (r["trainers"], r["pservers"]))
    for f, v in big["by_family_per_step"].items():
        p(f"  {f:<12} reads {v['reads']:>9,.1f}  writes {v['writes']:>7,.1f}  B written {v['bytes_written']:>11,.0f}  "
          f"B read {v['bytes_read']:>12,.0f}  conflicts {v['conflicts']:>7,.1f}  events {v['events']:>7,.1f}")
    p("  messages: " + ", ".join(f"{k} {v:,.1f}" for k, v in big["messages_by_method_per_step"].items()))
    p("")
    p("the master, per task:")
    h = f"{'tasks':>8} {'B memory':>9} {'specs B':>8} {'queue B':>8} {'ops':>6} {'writes':>7} {'B written':>10} {'B read':>8} {'start B/task':>12}"
    p(h)
    p("-" * len(h))
    for r in report["tasks"]:
        p(f"{r['tasks']:>8,} {r['master_bytes_per_task']:>9,.0f} {r['specs_bytes_per_task']:>8,.0f} {r['queue_bytes_per_task']:>8,.0f} "
          f"{r['store_ops_per_task']:>6.1f} {r['writes_per_task']:>7.1f} {r['bytes_written_per_task']:>10,.0f} "
          f"{r['bytes_read_per_task']:>8,.0f} {r['start_bytes_written_per_task']:>12.3f}")
    p("(ops, writes, bytes: per task dispatched and finished; start B/task: what the master's start wrote, per task)")
    p("")
    p("ratios, largest size / smallest (a linear cost grows as the size; 'allowed' is the target):")
    for name, r in report["ratios"].items():
        fixed = ", ".join(f"{k} {r[k]}" for k in ("pservers", "trainers") if k in r)
        p(f"  {name:<28} {r['value']:>8.2f}x  ({r['figure']} at {r['axis']} {r['from']:,} -> {r['to']:,}"
          f"{', ' + fixed if fixed else ''}; size x{r['size_growth']:g}, allowed {r['allowed']:g}x)")
    p(f"\ntotal run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"smaller sizes: {QUICK}")
    ap.add_argument("--trainers", type=int, nargs="+", help=f"trainer counts (default {FULL['trainers']})")
    ap.add_argument("--pservers", type=int, nargs="+", help=f"pserver counts (default {FULL['pservers']})")
    ap.add_argument("--steps", type=int, help=f"sync steps per trainer (default {FULL['steps']}, at least 3)")
    ap.add_argument("--tasks", type=int, nargs="+", help=f"queue sizes for the master (default {FULL['tasks']})")
    ap.add_argument("--finishes", type=int, help=f"tasks dispatched and finished per queue size (default {FULL['finishes']})")
    ap.add_argument("--latency-ms", type=float, help=f"a store round trip: the wait before each get and commit of the sync jobs "
                    f"(default {FULL['latency_ms']})")
    ap.add_argument("--pass", dest="whole_pass", action="store_true",
                    help=f"instead: one whole async pass through pdps.simulate_control_plane, {PASS['trainers']:,} trainers x "
                    f"{PASS['pservers']} pservers x {PASS['tasks']:,} tasks by default (--trainers, --pservers, --tasks: the first of each)")
    ap.add_argument("--step-every", type=int, default=PASS["step_every"], help="--pass: a step on one task in this many (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="table on stderr, one JSON object as stdout's last line")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    if args.whole_pass:
        shape = {k: (getattr(args, k) or [PASS[k]])[0] for k in ("trainers", "pservers", "tasks")}
        if min(shape.values()) < 1 or args.step_every < 1:
            ap.error("trainers, pservers, tasks and --step-every must be positive")
        report = one_pass(**shape, step_every=args.step_every)
        report["command"] = shlex.join(["python", "bench/scale.py", *(sys.argv[1:] if argv is None else argv)])
        print_pass(report, sys.stderr if args.json else sys.stdout)
        if args.json:
            print(json.dumps(report, sort_keys=True))
        return 0
    sizes = dict(QUICK if args.quick else FULL)
    for k in sizes:
        if getattr(args, k) is not None:
            sizes[k] = getattr(args, k)
    if min(sizes["trainers"]) < 1 or min(sizes["pservers"]) < 1 or min(sizes["tasks"]) < 1 or sizes["finishes"] < 1:
        ap.error("trainers, pservers, tasks and finishes must be positive")
    if sizes["latency_ms"] < 0:
        ap.error("--latency-ms must be at least 0")
    report = run(sizes["trainers"], sizes["pservers"], sizes["steps"], sizes["tasks"], sizes["finishes"], sizes["latency_ms"])
    report["command"] = shlex.join(["python", "bench/scale.py", *(sys.argv[1:] if argv is None else argv)])
    print_report(report, sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(report, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
