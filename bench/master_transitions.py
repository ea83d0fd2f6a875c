"""Master task transitions per second on memory, etcd and Redis, against a whole-queue snapshot baseline.

A benchmark, not a test: it prints figures and ratios and asserts nothing about speed.

What runs, per backend (``--backends``, default memory etcd redis)
--------------------------------------------------------------------
* A throwaway server on a free 127.0.0.1 port (``tests/servers.py``; data under
  /dev/shm, so etcd's fsync costs next to nothing and Redis persists nothing). etcd
  runs with ``--max-request-bytes 64 MiB --quota-backend-bytes 8 GiB`` for both runs,
  so pdps and the baseline meet the same server. ``memory://`` needs no server.
* pdps: a real :class:`pdps.roles.master.Master` (``inproc://`` transport) over a
  ``--tasks`` queue (default 100,000; a fake data source that only describes tasks),
  ``task_timeout`` 1e6 s so nothing expires, ``lease_ttl`` 30 s, ``passes`` large so the
  job never ends mid-run. ``--clients`` threads (default 64: a 100,000-task job is
  served to many trainers; it was 4, which leaves the master little to batch), each a
  trainer registered under its own lease, loop ``get_task`` / ``finish_task`` through
  the master's transport endpoint for ``--seconds`` (default 5) or
  ``--max-transitions``. A dispatch is one transition, an accepted finish is one.
  The master group-commits: the transitions made while one fenced transaction is in
  flight go together in the next (each with its task record and audit entry, at
  most etcd's 128 operations a transaction), and a client is answered only once its
  transition's transaction succeeded; ``txn/tr`` below shows the sharing.
* baseline (the original design): the same Master, subclassed here so that a
  transition writes ONE key holding gzip(JSON list of every task record of the
  queue) instead of the per-task Puts, fenced the same way and in the same
  transaction as the pass keys. Pass handling is the library's own code: the
  subclass strips the per-task changes, lets ``Master._transition_ops`` run, and
  stages the snapshot with its writes; one transition per transaction, as the
  original wrote (no group commit). A bounded sample is timed:
  ``--baseline-transitions`` (default 200), the same clients, at most
  ``--baseline-seconds``.
  The baseline is made as cheap as it can be: each record's JSON is cached and
  re-encoded only when the record changes, so a snapshot costs a join, an encode and
  gzip (``--gzip-level``, default 6 = zlib's and Go's default), not 100k
  ``to_json`` calls. The naive encode (what the cache saves) is timed once per
  backend and printed; the run checks that both give the same bytes and that the
  stored snapshot decodes to the queue's records.
* Every store call of both masters goes through the same counting proxy: bytes
  written per transition = key + value bytes of the Puts in ``commit``/``put`` during
  the timed phase; it also times ``commit`` and the reads (``get``, ``range``). The
  master has one transaction in flight at a time, so commit time per transition is
  what the transactions cost; reads overlap them (and ``rest`` may go negative).

What is timed
-------------
* transitions/s = transitions / (wall time from releasing the clients to the last
  one stopping). One dispatch + finish per client runs untimed first.
* latency = each client's call time (``get_task`` or ``finish_task``), p50 / p99; with
  several clients it includes waiting for the master's lock behind the others, and
  for the transaction that carries the transition.
* Both runs use the same clients; ``--clients 4`` gives the old default's figures.

Run
---
    .venv/bin/python bench/master_transitions.py                       # ~2-3 min on 2 cores
    .venv/bin/python bench/master_transitions.py --clients 4           # the old default
    .venv/bin/python bench/master_transitions.py --tasks 1000 --seconds 2 --baseline-transitions 50
    .venv/bin/python bench/master_transitions.py --backends etcd --json /tmp/m.json

``run(backends, tasks, clients, seconds, baseline_transitions) -> dict`` is importable.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for tests.servers (throwaway etcd / Redis)

from bench.machine import describe  # noqa: E402
from pdps.adapters.inproc import InprocTransport  # noqa: E402
from pdps.core.job import JobConfig, Keys  # noqa: E402
from pdps.core.tasks import Change, PassStarted, TaskChanged, TaskSpec  # noqa: E402
from pdps.ports.coordination import Put, TxnOp  # noqa: E402
from pdps.ports.transport import Message  # noqa: E402
from pdps.registry import open_store  # noqa: E402
from pdps.runtime.lease import LeaseKeeper  # noqa: E402
from pdps.roles.master import Master  # noqa: E402
from pdps.runtime.group_commit import GroupCommitStore  # noqa: E402

BACKENDS = ("memory", "etcd", "redis")
ETCD_MAX_REQUEST_BYTES = 64 << 20
ETCD_QUOTA_BACKEND_BYTES = 8 << 30
LEASE_TTL = 30.0
TASK_TIMEOUT = 1e6  # nothing expires during a run
PASSES = 1_000_000  # the job never ends mid-run
WARMUP_PAIRS = 1  # untimed dispatch + finish per client before the clock starts
WARMUP_S = 600.0  # at most this long (the baseline's warm-up with many clients takes a while)
CLIENT_JOIN_S = 30.0  # how long to wait for a client thread after stop is asked


def say(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


# --- the data source, the counting proxy, the baseline master ---------------------------


class Tasks:
    """A data source that only describes ``n`` tasks (the master never reads records)."""

    def __init__(self, n: int) -> None:
        self.url = f"bench://tasks-{n}"
        self.n = n

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location=f"part-{i // 1000}", part=i % 1000, records=10) for i in range(self.n)]

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Any:  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


class CountingStore:
    """Delegates to a store; sums key + value bytes of every Put it is asked to write
    (Delete: key bytes) and times ``commit`` and the reads (``get`` and ``range``)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.url = inner.url
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        with self._lock:
            self.bytes = 0
            self.commits = 0
            self.commit_s = 0.0
            self.gets = 0
            self.get_s = 0.0

    @staticmethod
    def _size(ops: Sequence[TxnOp]) -> int:
        return sum(len(op.key.encode()) + (len(op.value) if isinstance(op, Put) else 0) for op in ops)

    def commit(self, compares, success, failure=(), *, fence=None):
        t0 = time.perf_counter()
        try:
            return self.inner.commit(compares, success, failure, fence=fence)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.bytes += self._size(success)
                self.commits += 1
                self.commit_s += dt

    def put(self, key, value, *, lease=None):
        t0 = time.perf_counter()
        try:
            return self.inner.put(key, value, lease=lease)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.bytes += len(key.encode()) + len(value)
                self.commits += 1
                self.commit_s += dt

    def get(self, key):
        t0 = time.perf_counter()
        try:
            return self.inner.get(key)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.gets += 1
                self.get_s += dt

    def range(self, prefix):
        t0 = time.perf_counter()
        try:
            return self.inner.range(prefix)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.gets += 1
                self.get_s += dt

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class SnapshotMaster(Master):
    """The original design's persistence: every transition rewrites one key holding
    gzip(JSON list of every task record), instead of one key per touched task.

    ``_stage`` drops the per-task changes and flags a snapshot; the library's
    ``Master._transition_ops`` then runs unchanged (pass keys, pass completion, next
    pass, job done) and the transition's writes carry the snapshot as well, in the same
    fenced transaction. Group commit is off (:class:`OneAtATime`: one transition per
    transaction), as in the original design. Each record's JSON is cached and re-encoded only when the
    record changes (a PassStarted re-encodes all), so the bytes are exactly
    ``gzip.compress(json.dumps([r.to_json() for r in queue.records()]).encode())``
    at a fraction of the Python cost.
    """

    def __init__(self, *args: Any, gzip_level: int = 6, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._store = OneAtATime(self._store.inner, max_txn_ops=self._store.max_txn_ops, on_failure=self._commit_failed)
        self.snapshot_key = self._keys.root + "snapshot"
        self.gzip_level = gzip_level
        self._rec_json: dict[int, str] | None = None
        self._snapshot_due = False
        self.snapshots = 0
        self.snapshot_bytes = 0  # of the last one written
        self.snapshot_raw_bytes = 0
        self.encode_s = 0.0

    def start(self, *, standby: bool = False) -> None:
        super().start(standby=standby)
        with self._lock:
            self._rebuild_cache()  # outside the timed phase

    def _rebuild_cache(self) -> None:
        assert self._queue is not None
        self._rec_json = {r.id: json.dumps(r.to_json()) for r in self._queue.records()}

    def encode_snapshot(self) -> bytes:
        """gzip(JSON list of every task record), from the cache."""
        t0 = time.perf_counter()
        if self._rec_json is None:
            self._rebuild_cache()
        assert self._rec_json is not None
        raw = ("[" + ", ".join(self._rec_json.values()) + "]").encode()
        data = gzip.compress(raw, compresslevel=self.gzip_level, mtime=0)
        self.encode_s += time.perf_counter() - t0
        self.snapshot_raw_bytes, self.snapshot_bytes = len(raw), len(data)
        return data

    def encode_snapshot_naively(self) -> bytes:
        """The same bytes, encoded from scratch (for the check and the printed cost)."""
        assert self._queue is not None
        raw = json.dumps([r.to_json() for r in self._queue.records()]).encode()
        return gzip.compress(raw, compresslevel=self.gzip_level, mtime=0)

    def _stage(self, changes: list[Change]) -> Any:
        rest: list[Change] = []
        for ch in changes:
            if isinstance(ch, TaskChanged):
                self._snapshot_due = True
                if self._rec_json is not None:
                    self._rec_json[ch.record.id] = json.dumps(ch.record.to_json())
            else:
                if isinstance(ch, PassStarted):
                    self._snapshot_due = True
                    self._rec_json = None  # every record was rewritten: re-encode all
                rest.append(ch)
        ops: list[TxnOp] = []
        after: list[Callable[[], None]] = []
        self._transition_ops(rest, ops, after)  # the pass keys, ...
        if self._snapshot_due:  # ... with the snapshot, in the same transaction
            self._snapshot_due = False
            ops.insert(0, Put(self.snapshot_key, self.encode_snapshot()))
            self.snapshots += 1
        return self._store.stage(ops, fence=self._fence, after=after)


class OneAtATime(GroupCommitStore):
    """Group commit off: one transition per transaction, as in the original design
    (each writes its own snapshot)."""

    def _take_batch(self) -> list[Any]:
        batch = self._staged[:1]
        del self._staged[:1]
        return batch


# --- driving a master -------------------------------------------------------------------


class Tickets:
    """At most ``n`` transitions in all, shared by the clients."""

    def __init__(self, n: int) -> None:
        self.left = n
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self.left <= 0:
                return False
            self.left -= 1
            return True

    def give_back(self) -> None:
        with self._lock:
            self.left += 1


def drive(master: Master, trainers: list[str], *, limit: int, seconds: float, each: bool = False) -> dict[str, Any]:
    """Clients (one thread per trainer) loop get_task / finish_task until ``limit``
    transitions in all (with ``each``: per client) or ``seconds`` are reached; returns
    counts, wall time and latencies. A client that runs out of transitions between a
    dispatch and its finish leaves that task pending (it holds it: max_in_flight is 1),
    so the untimed warm-up uses ``each`` with an even limit."""
    address = master.address
    transport = master._transport  # the master's own InprocTransport
    shared = Tickets(limit)
    own = [Tickets(limit) if each else shared for _ in trainers]
    stop = threading.Event()
    start = threading.Barrier(len(trainers) + 1)
    lat: list[list[float]] = [[] for _ in trainers]
    counts = [[0, 0, 0] for _ in trainers]  # dispatches, finishes, waits
    errors: list[BaseException] = []
    t_deadline = [0.0]

    def client(i: int, trainer: str) -> None:
        ch = transport.connect(address)
        tickets = own[i]
        my_lat, my_counts = lat[i], counts[i]
        try:
            start.wait()
            while not stop.is_set() and time.perf_counter() < t_deadline[0]:
                if not tickets.take():
                    return
                t0 = time.perf_counter()
                reply = ch.call("get_task", Message({"trainer": trainer})).meta
                dt = time.perf_counter() - t0
                if "task" not in reply:
                    tickets.give_back()
                    if reply.get("done"):
                        return
                    my_counts[2] += 1
                    stop.wait(float(reply.get("retry_in", 0.05)))
                    continue
                my_lat.append(dt)
                my_counts[0] += 1
                if time.perf_counter() >= t_deadline[0] or not tickets.take():
                    return  # the task stays pending; the master is stopped afterwards
                meta = {"trainer": trainer, "task": reply["task"]["id"], "attempt": reply["attempt"]}
                t0 = time.perf_counter()
                done = ch.call("finish_task", Message(meta)).meta
                dt = time.perf_counter() - t0
                if not done.get("accepted"):
                    raise RuntimeError(f"finish of task {meta['task']} was refused: {done.get('reason')}")
                my_lat.append(dt)
                my_counts[1] += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)
            stop.set()
        finally:
            ch.close()

    threads = [threading.Thread(target=client, args=(i, t), name=f"bench-client-{i}", daemon=True) for i, t in enumerate(trainers)]
    for t in threads:
        t.start()
    try:
        t0 = time.perf_counter()
        t_deadline[0] = t0 + seconds
        start.wait()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        stop.set()
        with contextlib.suppress(threading.BrokenBarrierError):
            start.abort()
        for t in threads:
            t.join(CLIENT_JOIN_S)
    if errors:
        raise errors[0]
    if master.error is not None or not master.leading.is_set():
        raise RuntimeError(f"the master stopped serving during the run: {master.error!r}")
    all_lat = sorted(x for xs in lat for x in xs)
    n = len(all_lat)
    return {
        "transitions": n,
        "dispatches": sum(c[0] for c in counts),
        "finishes": sum(c[1] for c in counts),
        "waits": sum(c[2] for c in counts),
        "seconds": wall,
        "per_s": n / wall if wall > 0 else 0.0,
        "p50_ms": 1000 * _quantile(all_lat, 0.50),
        "p99_ms": 1000 * _quantile(all_lat, 0.99),
        "mean_ms": 1000 * statistics.fmean(all_lat) if n else float("nan"),
    }


def _quantile(sorted_xs: list[float], q: float) -> float:
    if not sorted_xs:
        return float("nan")
    return sorted_xs[min(len(sorted_xs) - 1, int(q * len(sorted_xs)))]


def measure(
    stack: contextlib.ExitStack,
    store: CountingStore,
    make: Callable[..., Master],
    *,
    label: str,
    tasks: int,
    clients: int,
    limit: int,
    seconds: float,
) -> tuple[Master, dict[str, Any]]:
    """Start a master on a fresh job, register the clients' trainers, warm up, time."""
    job = f"bench-{label}-{uuid.uuid4().hex[:8]}"
    keys = Keys(job)
    trainers = [f"trainer-{i}" for i in range(clients)]
    for tid in trainers:  # registered on the inner store: not counted
        keeper = LeaseKeeper(store.inner, LEASE_TTL, name=f"bench-{tid}")
        stack.callback(keeper.stop)
        store.inner.put(keys.trainer(tid), b"{}", lease=keeper.lease)
    config = JobConfig(name=job, dataset=f"bench://tasks-{tasks}", lease_ttl=LEASE_TTL, task_timeout=TASK_TIMEOUT, passes=PASSES)
    t0 = time.perf_counter()
    master = make(store, InprocTransport(), Tasks(tasks), config, address="inproc://")
    master.start()
    stack.callback(master.stop)
    start_s = time.perf_counter() - t0
    warm = drive(master, trainers, limit=2 * WARMUP_PAIRS, seconds=WARMUP_S, each=True)  # untimed warm-up
    if warm["transitions"] != 2 * WARMUP_PAIRS * clients or master.counts().pending:
        raise RuntimeError(f"the warm-up did not leave the queue idle: {warm}, {master.counts()}")
    store.reset()
    if isinstance(master, SnapshotMaster):
        master.encode_s = 0.0
    row = drive(master, trainers, limit=limit, seconds=seconds)
    n = max(1, row["transitions"])
    row.update(
        {
            "job": job,
            "master_start_s": start_s,
            "bytes_written": store.bytes,
            "bytes_per_transition": store.bytes / n,
            "commits_per_transition": store.commits / n,
            "commit_ms_per_transition": 1000 * store.commit_s / n,
            "get_ms_per_transition": 1000 * store.get_s / n,
        }
    )
    return master, row


# --- one backend ------------------------------------------------------------------------


def run_backend(
    backend: str, *, tasks: int, clients: int, seconds: float, max_transitions: int, baseline_transitions: int, baseline_seconds: float, gzip_level: int
) -> dict[str, Any]:
    from tests.servers import EtcdServer, RedisServer

    with contextlib.ExitStack() as stack:
        server_args: list[str] = []
        if backend == "memory":
            url = "memory://"
        elif backend == "etcd":
            server_args = ["--max-request-bytes", str(ETCD_MAX_REQUEST_BYTES), "--quota-backend-bytes", str(ETCD_QUOTA_BACKEND_BYTES)]
            server = EtcdServer(extra_args=tuple(server_args))
            stack.callback(server.stop)
            server.start()
            url = server.url
        elif backend == "redis":
            server = RedisServer()
            stack.callback(server.stop)
            server.start()
            url = server.url
        else:
            raise ValueError(f"unknown backend {backend!r}; choose from {BACKENDS}")
        inner = open_store(url)
        stack.callback(inner.close)
        store = CountingStore(inner)

        say(f"[{backend}] pdps: master over {tasks:,} tasks, {clients} clients, {seconds:g} s or {max_transitions:,} transitions")
        with contextlib.ExitStack() as phase:  # the master and its trainers stop before the baseline starts
            _, pdps = measure(phase, store, Master, label="pdps", tasks=tasks, clients=clients, limit=max_transitions, seconds=seconds)
        say(f"[{backend}] pdps: {pdps['per_s']:,.0f} transitions/s ({pdps['transitions']:,} in {pdps['seconds']:.1f} s)")

        say(f"[{backend}] baseline: snapshot master over {tasks:,} tasks, {baseline_transitions} transitions (at most {baseline_seconds:g} s)")

        def make_snapshot_master(*args: Any, **kwargs: Any) -> SnapshotMaster:
            return SnapshotMaster(*args, gzip_level=gzip_level, **kwargs)

        with contextlib.ExitStack() as phase:
            master, base = measure(
                phase, store, make_snapshot_master, label="snapshot", tasks=tasks, clients=clients, limit=baseline_transitions, seconds=baseline_seconds
            )
            assert isinstance(master, SnapshotMaster)
            n = max(1, base["transitions"])
            with master._lock:  # check: the stored snapshot is the queue, byte for byte
                t0 = time.perf_counter()
                naive = master.encode_snapshot_naively()
                naive_s = time.perf_counter() - t0
                stored = inner.get(master.snapshot_key)
                records = [r.to_json() for r in master._queue.records()]  # type: ignore[union-attr]
            if stored is None or stored.value != naive or json.loads(gzip.decompress(stored.value)) != records:
                raise RuntimeError("the stored snapshot is not gzip(JSON of the queue's records): the baseline is broken")
            base.update(
                {
                    "snapshots_written": master.snapshots,
                    "snapshot_bytes": master.snapshot_bytes,
                    "snapshot_raw_bytes": master.snapshot_raw_bytes,
                    "encode_ms_per_transition": 1000 * master.encode_s / n,
                    "naive_encode_ms": 1000 * naive_s,
                }
            )
        say(f"[{backend}] baseline: {base['per_s']:,.1f} transitions/s ({base['transitions']} in {base['seconds']:.1f} s)")
        return {
            "backend": backend,
            "server_args": server_args,
            "pdps": pdps,
            "baseline": base,
            "ratio_transitions_per_s": pdps["per_s"] / base["per_s"] if base["per_s"] else float("inf"),
            "ratio_bytes_per_transition": base["bytes_per_transition"] / pdps["bytes_per_transition"] if pdps["bytes_per_transition"] else float("inf"),
        }


def run(
    backends: Sequence[str] = BACKENDS,
    tasks: int = 100_000,
    clients: int = 64,
    seconds: float = 5.0,
    baseline_transitions: int = 200,
    *,
    max_transitions: int = 1_000_000,
    baseline_seconds: float = 60.0,
    gzip_level: int = 6,
) -> dict[str, Any]:
    """Run every backend in turn; returns the results as a JSON-safe dict."""
    if tasks < 1 or clients < 1 or seconds <= 0 or baseline_transitions < 1 or max_transitions < 1 or baseline_seconds <= 0:
        raise ValueError("tasks, clients, seconds, baseline_transitions, max_transitions and baseline_seconds must be positive")
    t0 = time.perf_counter()
    load_start = os.getloadavg()
    rows = [
        run_backend(
            b,
            tasks=tasks,
            clients=clients,
            seconds=seconds,
            max_transitions=max_transitions,
            baseline_transitions=baseline_transitions,
            baseline_seconds=baseline_seconds,
            gzip_level=gzip_level,
        )
        for b in backends
    ]
    return {
        "bench": "master_transitions",
        "tasks": tasks,
        "clients": clients,
        "seconds": seconds,
        "max_transitions": max_transitions,
        "baseline_transitions": baseline_transitions,
        "baseline_seconds": baseline_seconds,
        "gzip_level": gzip_level,
        "machine": machine(),
        "loadavg_start": list(load_start),
        "loadavg_end": list(os.getloadavg()),
        "results": rows,
        "total_s": time.perf_counter() - t0,
    }


# --- reporting --------------------------------------------------------------------------


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "not installed"
    return out.splitlines()[0] if out else "unknown"


def machine() -> dict[str, Any]:
    m = describe("grpcio", "redis", "pdps", etcd=_version(["etcd", "--version"]), redis_server=_version(["redis-server", "--version"]))
    m["redis_py"] = m.pop("redis")
    return m


def print_report(report: dict[str, Any], command: str) -> None:
    m = report["machine"]
    print(f"command: {command}")
    print(f"machine: {m['cpu_count']} CPUs ({m['cpu_model']}), Python {m['python']}, {m['platform']}")
    print(f"servers: {m['etcd']}; {m['redis_server']}; clients: grpcio {m['grpcio']}, redis-py {m['redis_py']}")
    ls, le = report["loadavg_start"], report["loadavg_end"]
    print(f"load average (1/5/15 min) at start {ls[0]:.2f} {ls[1]:.2f} {ls[2]:.2f}, at end {le[0]:.2f} {le[1]:.2f} {le[2]:.2f}")
    print(
        f"queue {report['tasks']:,} tasks, {report['clients']} clients; pdps timed for {report['seconds']:g} s "
        f"(at most {report['max_transitions']:,} transitions); baseline: {report['baseline_transitions']} transitions "
        f"(at most {report['baseline_seconds']:g} s), gzip level {report['gzip_level']}"
    )
    print()
    h = (
        f"{'backend':<8} {'pdps tr/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'B/tr':>6}   "
        f"{'base tr/s':>10} {'p50 ms':>7} {'p99 ms':>7} {'B/tr':>9}   {'tr/s ratio':>10} {'B/tr ratio':>10}"
    )
    print(h)
    print("-" * len(h))
    for r in report["results"]:
        p, b = r["pdps"], r["baseline"]
        print(
            f"{r['backend']:<8} {p['per_s']:>10,.0f} {p['p50_ms']:>7.3f} {p['p99_ms']:>7.3f} {p['bytes_per_transition']:>6.0f}   "
            f"{b['per_s']:>10,.1f} {b['p50_ms']:>7.2f} {b['p99_ms']:>7.2f} {b['bytes_per_transition']:>9,.0f}   "
            f"{r['ratio_transitions_per_s']:>9,.1f}x {r['ratio_bytes_per_transition']:>9,.0f}x"
        )
    print("(tr/s ratio = pdps / baseline transitions per second; B/tr ratio = baseline / pdps bytes written per transition)")
    print()
    print("where a transition's time goes, ms (one transaction in flight at a time; reads overlap it):")
    h2 = f"{'backend':<8} {'run':<9} {'transitions':>11} {'1/rate':>8} {'commit':>8} {'get':>8} {'encode':>8} {'rest':>8} {'txn/tr':>7} {'waits':>6}"
    print(h2)
    print("-" * len(h2))
    for r in report["results"]:
        for name in ("pdps", "baseline"):
            x = r[name]
            per = 1000 / x["per_s"] if x["per_s"] else float("nan")
            enc = x.get("encode_ms_per_transition", 0.0)
            rest = per - x["commit_ms_per_transition"] - x["get_ms_per_transition"] - enc
            print(
                f"{r['backend']:<8} {name:<9} {x['transitions']:>11,} {per:>8.3f} {x['commit_ms_per_transition']:>8.3f} "
                f"{x['get_ms_per_transition']:>8.3f} {enc:>8.3f} {rest:>8.3f} {x['commits_per_transition']:>7.2f} {x['waits']:>6}"
            )
    print("(commit = store.commit, the fenced transaction (one per batch of transitions: the clients wait in it together);")
    print(" get = store.get of a trainer's key (group read: one get, or a range of trainers/, per batch of get_task calls);")
    print(" encode = building the gzip snapshot; rest = the queue, the master and waiting; txn/tr = transactions per transition;")
    print(" waits = get_task answers 'wait' (todo empty at a pass's end while other clients finish), not transitions)")
    print()
    for r in report["results"]:
        p, b = r["pdps"], r["baseline"]
        store_p = p["commit_ms_per_transition"] + p["get_ms_per_transition"]
        store_b = b["commit_ms_per_transition"] + b["get_ms_per_transition"]
        print(
            f"{r['backend']}: snapshot {b['snapshot_bytes']:,} B gzip ({b['snapshot_raw_bytes']:,} B JSON) for {report['tasks']:,} tasks; "
            f"a naive encode (to_json of every record + dumps + gzip) takes {b['naive_encode_ms']:.0f} ms, "
            f"the cached one {b['encode_ms_per_transition']:.1f} ms; store time alone (commit + get) per transition: "
            f"baseline {store_b:.3f} ms / pdps {store_p:.3f} ms = {store_b / store_p if store_p else float('inf'):.1f}x"
        )
    print(f"\ntotal run time {report['total_s']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="stores to measure (default: all three)")
    p.add_argument("--tasks", type=int, default=100_000, help="tasks in the queue (default 100000)")
    p.add_argument("--clients", type=int, default=64, help="client threads, one trainer each (default 64; it was 4)")
    p.add_argument("--seconds", type=float, default=5.0, help="how long to time pdps per backend (default 5)")
    p.add_argument("--max-transitions", type=int, default=1_000_000, help="pdps stops after this many transitions (default 1000000)")
    p.add_argument("--baseline-transitions", type=int, default=200, help="transitions timed for the snapshot baseline (default 200)")
    p.add_argument("--baseline-seconds", type=float, default=60.0, help="the baseline stops after this long (default 60)")
    p.add_argument("--gzip-level", type=int, default=6, choices=range(0, 10), metavar="0-9", help="the baseline's gzip level (default 6)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = p.parse_args(argv)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    command = " ".join(shlex.quote(a) for a in [sys.executable, *(sys.argv if argv is None else [sys.argv[0], *argv])])
    report = run(
        args.backends,
        args.tasks,
        args.clients,
        args.seconds,
        args.baseline_transitions,
        max_transitions=args.max_transitions,
        baseline_seconds=args.baseline_seconds,
        gzip_level=args.gzip_level,
    )
    report["command"] = command
    print_report(report, command)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
