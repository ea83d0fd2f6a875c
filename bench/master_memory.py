"""Master memory per task: what the master holds for a job of N tasks, traced with tracemalloc.

A benchmark, not a test: it prints figures and asserts nothing about them.

What is measured (bytes per task = bytes tracemalloc sees retained, after a garbage
collection, divided by ``--tasks``)
----------------------------------------------------------------------------------------
* The dataset: ``--tasks`` tasks as the Parquet adapter describes them, one location
  string per file shared by its ``--parts`` row groups, 1,000 records each.
* ``fresh``: ``TaskQueue.create`` over the dataset (its specs included: the queue
  keeps them), as a master serving a new job holds it.
* ``pass``: that queue driven through one whole pass in this process, but for the
  last task (so that the pass is not complete and a restarting master finds it as
  it was): every task dispatched to one of ``--trainers`` trainers, a fresh id
  string per call as a request decoded from the wire carries it, and finished;
  every change fed to an ``AuditLog``, as the master does. ``queue`` and ``audit``
  are that state split: the audit is what dropping the log frees.
* ``restore``: a real :class:`pdps.roles.master.Master` (inproc transport, no
  trainer) started on a ``memory://`` store holding what that pass left there (the
  job's keys as a master wrote them, a record and an audit entry per task): what it
  retains once serving (queue, audit, its own maps: every structure restoring built
  and kept), and ``restore_peak``, the most it held while restoring (the store's
  copies of keys and values it read, decoded JSON, ...). The store's own memory is
  not counted: it is in the base the figure is taken from.
* ``total``: the most the master retains in any of these states, the figure to hold
  against the 1 KiB per task budget.

Run
---
    .venv/bin/python bench/master_memory.py --tasks 100000
    .venv/bin/python bench/master_memory.py --tasks 1000000 --json   # ~3-6 min on 2 cores

``measure(tasks, trainers, parts) -> dict`` is importable; ``--json`` prints it as
the last line of stdout.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from pdps.adapters.inproc import InprocTransport  # noqa: E402
from pdps.adapters.memory_store import MemoryStore  # noqa: E402
from pdps.core.audit import AuditLog, encode_attempts  # noqa: E402
from pdps.core.job import JobConfig, Keys  # noqa: E402
from pdps.core.tasks import Assignment, TaskQueue, TaskSpec  # noqa: E402
from pdps.ports.coordination import Put  # noqa: E402
from pdps.roles.master import Master  # noqa: E402

BUDGET = 1024  # bytes per task (issue 15)
RECORDS = 1000  # records per task
JOB = "bench-memory"
TXN = 10_000  # puts per transaction when filling the store


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


class Dataset:
    """A data source that only describes tasks, as the Parquet adapter does: a file's
    row groups share its location string."""

    def __init__(self, n: int, parts: int) -> None:
        self.url = f"bench://tasks-{n}"
        self.n, self.parts = n, parts

    def tasks(self) -> list[TaskSpec]:
        out = []
        for first in range(0, self.n, self.parts):
            location = f"s3://bucket/dataset/part-{first // self.parts:06d}.parquet"
            out.extend(TaskSpec(id=i, location=location, part=i - first, records=RECORDS) for i in range(first, min(first + self.parts, self.n)))
        return out

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Any:  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


def retained() -> int:
    gc.collect()
    return tracemalloc.get_traced_memory()[0]


def run_pass(queue: TaskQueue, audit: AuditLog, trainers: int, tasks: int) -> None:
    """Dispatch and finish every task but the last, feeding the audit."""
    for i in range(tasks - 1):
        trainer = "trainer-%d" % (i % trainers)  # a new string per call, as decoded from a request
        assignment, changes = queue.dispatch(trainer, 1000.0)
        assert isinstance(assignment, Assignment), assignment
        audit.record(changes)
        audit.record(queue.finish(assignment.task.id, assignment.attempt))


def fill_store(store: MemoryStore, config: JobConfig, source: Dataset, queue: TaskQueue, audit: AuditLog) -> None:
    """The store as a master serving this pass would leave it: the job's keys written
    by a real master, then a record and an audit entry per task touched."""
    master = Master(store, InprocTransport(), source, config)
    master.start()
    master.stop()
    keys = Keys(config.name)
    ops = [Put(keys.task(r.id), json.dumps(r.to_json()).encode()) for r in queue.records() if r.attempt]
    ops += [Put(keys.audit_entry(audit.pass_no, tid), encode_attempts(attempts)) for tid, attempts in audit.entries().items()]
    for i in range(0, len(ops), TXN):
        store.commit((), ops[i : i + TXN])


def measure(tasks: int, trainers: int = 1000, parts: int = 100) -> dict[str, Any]:
    if tasks < 2:
        raise SystemExit("--tasks must be at least 2")
    source = Dataset(tasks, parts)
    config = JobConfig(name=JOB, dataset=source.url, lease_ttl=30.0, task_timeout=1e6, passes=2, failure_max=3)
    limits = {"failure_max": config.failure_max, "timeout": config.task_timeout, "max_in_flight": config.max_in_flight}
    seconds: dict[str, float] = {}

    tracemalloc.start()
    base = retained()
    t0 = time.perf_counter()
    queue = TaskQueue.create(source.tasks(), **limits)
    fresh = retained() - base
    audit = AuditLog()
    t1 = time.perf_counter()
    seconds["create"] = t1 - t0
    run_pass(queue, audit, trainers, tasks)
    seconds["pass"] = time.perf_counter() - t1
    after_pass = retained() - base

    say(f"{tasks} tasks: pass done in {seconds['pass']:.1f} s; filling the store")
    store = MemoryStore()  # traced, but counted in the base of what follows
    fill_store(store, config, source, queue, audit)
    with_audit = retained()
    del audit
    audit_bytes = with_audit - retained()
    del queue

    base = retained()
    tracemalloc.reset_peak()
    t2 = time.perf_counter()
    master = Master(store, InprocTransport(), source, config)
    master.start()
    seconds["restore"] = time.perf_counter() - t2
    restored = retained() - base
    peak = tracemalloc.get_traced_memory()[1] - base
    counts = master.counts()
    master.stop()
    tracemalloc.stop()
    store.close()
    if counts.done != tasks - 1 or counts.todo != 1:
        raise SystemExit(f"the restored master does not see the pass as left: {counts}")

    per = {
        "fresh": fresh / tasks,
        "pass": after_pass / tasks,
        "pass_queue": (after_pass - audit_bytes) / tasks,
        "pass_audit": audit_bytes / tasks,
        "restore": restored / tasks,
        "restore_peak": peak / tasks,
    }
    total = max(per["fresh"], per["pass"], per["restore"])
    return {
        "suite": "master_memory",
        "config": {"tasks": tasks, "trainers": trainers, "parts": parts, "records": RECORDS},
        "bytes_per_task": {k: round(v, 1) for k, v in per.items()},
        "total_bytes_per_task": round(total, 1),
        "budget_bytes_per_task": BUDGET,
        "within_budget": total <= BUDGET,
        "total_mib": round(total * tasks / 2**20, 1),
        "seconds": {k: round(v, 2) for k, v in seconds.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", type=int, default=100_000)
    p.add_argument("--trainers", type=int, default=1000, help="trainer ids the pass hands tasks to")
    p.add_argument("--parts", type=int, default=100, help="row groups per file (tasks sharing a location)")
    p.add_argument("--json", action="store_true", help="print the result as JSON on the last line of stdout")
    args = p.parse_args(argv)
    r = measure(args.tasks, args.trainers, args.parts)
    b = r["bytes_per_task"]
    print(f"master memory, {args.tasks:,} tasks ({args.trainers} trainers, {args.parts} tasks a file), bytes per task:")
    for name, about in (
        ("fresh", "new job: queue and specs"),
        ("pass_queue", "after a pass: queue and specs"),
        ("pass_audit", "after a pass: audit log"),
        ("pass", "after a pass: queue + audit"),
        ("restore", "restarted master: all it retains"),
        ("restore_peak", "restarted master: peak while restoring"),
    ):
        print(f"  {name:<13} {b[name]:>8.1f}  {about}")
    print(f"  {'total':<13} {r['total_bytes_per_task']:>8.1f}  the most retained ({r['total_mib']} MiB); budget {BUDGET}: {'within' if r['within_budget'] else 'OVER'}")
    if args.json:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
