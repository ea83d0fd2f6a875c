"""``pdps.simulate_control_plane``: what a job's control plane costs, per pass and per role.

It runs a real job through :func:`pdps.simulate` (the library's :class:`~pdps.roles.master.Master`,
:class:`~pdps.roles.pserver.Pserver` and :class:`~pdps.roles.trainer.TrainerContext`; no copy
of their logic) on ``memory://`` with ``inproc://``, with compute that costs microseconds
(torch on a model of ``8 x pservers`` scalars, :func:`train`) over a dataset that only
describes its tasks (:class:`Records`), and counts what each role asks of the store and
the transport:

* each role kind (``master``, ``pservers``, ``trainers``) is built on its own
  :class:`~pdps.runtime.counting.CountingStore` over the one shared store, and on its own
  metered transport (``pdps.adapters.prometheus_metrics``: its client-side calls are the
  messages it sent);
* leases run on a :class:`SimClock`, a clock that moves only when the simulation moves it
  (to the simulated time so far, about once a second): a role's keep-alive thread starved
  of CPU by a thousand trainer threads does not let its lease expire, since simulated
  time only passes as the trainers make progress;
* simulated time comes from a stated latency model (:class:`Latency`, :func:`simulated_seconds`);
* after the pass, the master's audit (``audit/<pass>/<id>``, :mod:`pdps.core.audit`) is read
  back and checked (:class:`AuditCheck`), and a takeover master's start is weighed with
  ``tracemalloc`` for the master's memory per task.
"""

from __future__ import annotations

import threading
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import attrs
import numpy as np

from pdps.core.audit import Outcome, decode_attempts, record_counts
from pdps.core.errors import ConfigError
from pdps.core.job import Keys, require_whole_number, shown
from pdps.core.sgd import Mode
from pdps.core.tasks import TaskSpec
from pdps.ports.coordination import CoordinationStore
from pdps.ports.data import Columns
from pdps.ports.transport import Transport
from pdps.runtime.counting import CountingStore, StoreCounts

ROLES = ("master", "pservers", "trainers")
#: store calls made on a role's keep-alive or watch threads, beside its work: off the critical path
BACKGROUND_CALLS = frozenset({"keep_alive", "grant_lease", "revoke_lease", "watch"})
#: the messages that go to every pserver of a step at once (one latency for the fan-out)
FAN_OUT = frozenset({"push", "pull"})


# --- the dataset, the model, the training function ------------------------------------------


class Records:
    """A data source of ``tasks`` tasks of ``records`` one-number records each: it
    describes its tasks and reads nothing (a task's records are ones, made on demand)."""

    def __init__(self, tasks: int, records: int = 1) -> None:
        require_whole_number("tasks", tasks, 1)
        require_whole_number("records", records, 1)
        self.url = f"sim://records-{tasks}x{records}"
        self.n, self.records = tasks, records

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location=f"part-{i // 1000}", part=i % 1000, records=self.records) for i in range(self.n)]

    def read(self, task: TaskSpec, *, start: int = 0, batch_size: int) -> Iterator[Columns]:
        for low in range(start, task.records, batch_size):
            yield {"x": np.ones((min(batch_size, task.records - low), 1), dtype=np.float32)}


def scalars(pservers: int) -> Any:
    """The stand-in model: ``8 x pservers`` scalars, about 8 one-element blocks a pserver
    (with ``min_block=1``), so every pserver holds some and every push and pull reaches all."""
    import torch

    class Scalars(torch.nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(rows, 1))

    return Scalars(8 * pservers)


def train(ctx: Any) -> None:
    """Train :func:`scalars` on every batch: each step runs its real push, apply and pull."""
    model = ctx.attach(scalars(ctx.config.pservers))
    for batch in ctx.batches():
        ctx.step((model.w * batch["x"].sum()).sum())


def stepping_every(n: int) -> Any:
    """A training function that steps on one task in ``n`` a trainer holds (its 1st,
    (n+1)-th, ...) and leases, reads and finishes the others without a step: the task
    control plane (dispatch, finish, audit) at full rate, the pservers' at ``1/n``.
    ``n=1`` is :func:`train`. Async mode only: a sync trainer that skips a step leaves
    its round waiting."""
    require_whole_number("n", n, 1)

    def train_sparsely(ctx: Any) -> None:
        model = ctx.attach(scalars(ctx.config.pservers))
        held = 0
        for batch in ctx.batches():
            if held % n == 0:
                ctx.step((model.w * batch["x"].sum()).sum())
            if batch.last:
                held += 1

    return train_sparsely


# --- simulated time ----------------------------------------------------------------------


@attrs.define
class SimClock:
    """A clock that stands still until told to move (the store's lease clock in a
    simulation): ``clock()`` is the simulated time, in seconds from 0."""

    _now: float = 0.0
    _lock: threading.Lock = attrs.field(factory=threading.Lock, init=False, repr=False)

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        """Move ``seconds`` (>= 0) forward; the new time."""
        if not seconds >= 0:
            raise ValueError(f"a clock moves forward: cannot advance by {seconds!r} seconds")
        with self._lock:
            self._now += seconds
            return self._now

    def advance_to(self, when: float) -> float:
        """Move to ``when`` if that is later (a clock never goes back); the new time."""
        with self._lock:
            self._now = max(self._now, when)
            return self._now


@attrs.frozen
class Latency:
    """The latency model of simulated time: one store round trip costs ``store_s``, one
    message (or one fan-out of messages to every pserver) costs ``message_s``."""

    store_s: float = 0.0005
    message_s: float = 0.0005

    def __attrs_post_init__(self) -> None:
        for name in ("store_s", "message_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ConfigError(f"latency {name} must be a number of seconds >= 0, got {shown(value)}")


def critical_calls(store: StoreCounts, messages: Mapping[str, int], pservers: int) -> tuple[int, float]:
    """The store round trips and message latencies on the trainers' paths, summed over
    trainers: every store call a trainer made but those of its keep-alive and watch
    threads (:data:`BACKGROUND_CALLS`), and every message it sent, a push or a pull to
    all ``pservers`` of a step counting once (they go out together: :data:`FAN_OUT`)."""
    trips = sum(n for method, n in store.calls.items() if method not in BACKGROUND_CALLS)
    latencies = sum(n / pservers if method in FAN_OUT else n for method, n in messages.items())
    return trips, latencies


def simulated_seconds(store: StoreCounts, messages: Mapping[str, int], *, trainers: int, pservers: int, latency: Latency) -> float:
    """The simulated time of a job whose trainers made these calls: the mean trainer's
    path, ``(store round trips x store_s + message latencies x message_s) / trainers``
    (:func:`critical_calls`). A trainer's calls are sequential (one thread); what a
    pserver or the master does while answering a message is inside that message's
    latency; a sync round's barrier adds nothing beyond the slowest trainer's calls,
    and trainers in step make the same calls, so the mean path is the round's."""
    trips, latencies = critical_calls(store, messages, pservers)
    return (trips * latency.store_s + latencies * latency.message_s) / trainers


# --- the report ------------------------------------------------------------------------------


@attrs.frozen
class RoleReport:
    """What one role kind (every instance of it together) asked of the store and the transport."""

    store: StoreCounts
    messages: Mapping[str, int]  # method -> calls this role made (client side)

    @property
    def store_ops(self) -> int:
        return self.store.ops

    @property
    def keys_written(self) -> int:
        return self.store.total("writes")

    @property
    def bytes_written(self) -> int:
        return self.store.total("bytes_written")

    @property
    def bytes_read(self) -> int:
        return self.store.total("bytes_read")

    @property
    def conflicts(self) -> int:
        return self.store.total("conflicts")

    @property
    def message_count(self) -> int:
        return sum(self.messages.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "store_ops": self.store_ops, "store_calls": dict(sorted(self.store.calls.items())), "keys_written": self.keys_written,
            "bytes_written": self.bytes_written, "bytes_read": self.bytes_read, "conflicts": self.conflicts,
            "messages": self.message_count, "messages_by_method": dict(sorted(self.messages.items())), "by_family": self.store.to_json(),
        }


@attrs.frozen
class AuditCheck:
    """The master's audit of the pass, read back from ``audit/<pass>/<id>``.

    ``done_once``: tasks with exactly one ``done`` attempt; ``done_more``: with more than
    one; ``not_done``: with none (or no audit entry at all); ``records_once``: records the
    audit counts as trained exactly once (:func:`pdps.core.audit.record_counts`);
    ``trainers``: the trainers that made a ``done`` attempt."""

    tasks: int
    done_once: int
    done_more: int
    not_done: int
    attempts: int
    records: int
    records_once: int
    trainers: int

    @property
    def ok(self) -> bool:
        """Every task done exactly once, every record trained exactly once."""
        return self.done_once == self.tasks and not self.done_more and not self.not_done and self.records_once == self.records


@attrs.frozen
class ControlPlaneReport:
    """What :func:`simulate_control_plane` measured, for one pass (see its docstring)."""

    trainers: int
    pservers: int
    tasks: int
    records: int  # per task
    mode: str
    roles: Mapping[str, RoleReport]  # "master", "pservers", "trainers"
    steps: int  # trainer steps, summed over trainers (pushes / pservers); a sync round is one step of each trainer
    tasks_done: int
    wall_seconds: float
    simulated_seconds: float
    latency: Latency
    master_bytes_per_task: float
    audit: AuditCheck
    #: the shared store's counts, every role's calls and ``simulate``'s own reads (of the
    #: config, the final parameters, the pass summaries): writes add up to the roles' sum
    whole: StoreCounts
    step_every: int = 1

    @property
    def simulated_seconds_per_step(self) -> float:
        """Simulated time over the mean trainer's steps (a sync round is one step of each)."""
        return self.simulated_seconds * self.trainers / self.steps if self.steps else 0.0

    @property
    def simulated_seconds_per_task(self) -> float:
        """Simulated time over the mean trainer's tasks."""
        return self.simulated_seconds * self.trainers / self.tasks_done if self.tasks_done else 0.0

    def total(self, what: str) -> int:
        """A figure of :class:`RoleReport` (``store_ops``, ``keys_written``, ...) summed over roles."""
        return sum(getattr(r, what) for r in self.roles.values())

    def to_json(self) -> dict[str, Any]:
        return {
            **{k: getattr(self, k) for k in ("trainers", "pservers", "tasks", "records", "mode", "steps", "tasks_done", "wall_seconds",
                                             "simulated_seconds", "master_bytes_per_task", "step_every")},
            "simulated_seconds_per_step": self.simulated_seconds_per_step,
            "simulated_seconds_per_task": self.simulated_seconds_per_task,
            "latency": attrs.asdict(self.latency),
            "roles": {name: r.to_json() for name, r in self.roles.items()},
            "audit": {**attrs.asdict(self.audit), "ok": self.audit.ok},
            "whole": self.whole.to_json(),
        }


# --- the entry ----------------------------------------------------------------------------------


def simulate_control_plane(
    *,
    trainers: int,
    pservers: int,
    tasks: int,
    records: int = 1,
    mode: str = "sync",
    seed: int = 0,
    step_every: int = 1,
    latency: Latency | None = None,
    timeout: float = 3600.0,
    progress: Callable[[dict[str, Any]], None] | None = None,
    **settings: Any,
) -> ControlPlaneReport:
    """Run one pass of a job of ``trainers`` x ``pservers`` over ``tasks`` tasks of
    ``records`` records (one record a batch, so one step a record) and report what its
    control plane cost, per role. Every role is the library's own, through
    :func:`pdps.simulate`.

    ``mode``: ``"sync"`` (every step a barrier round: each trainer pushes to and pulls
    from every pserver and commits its contribution) or ``"async"``. ``step_every=n``
    (async only) steps on one task in ``n`` each trainer holds and only leases, reads and
    finishes the others: the task control plane at full rate with the pservers' traffic
    at ``1/n``. Why: a step costs ``2 x pservers`` messages whatever the mode (an async
    trainer pushes at the end of every task, so that a push never mixes two tasks'
    records), so a pass of 1,000,000 one-record tasks at 64 pservers that stepped on
    every task would send 128M messages, hours of this process's CPU; a sync pass is
    also 1,000 barrier rounds of 1,000 trainers. ``bench/scale.py --pass`` runs the
    1,000 x 64 x 1M pass async with ``step_every=1000`` (each trainer steps on its
    first task: 128k pserver messages). A sync job of 1,000 x 64 x 3,000 tasks takes about
    13 minutes here (docs/scale.md). ``seed`` names the job (``cp-<seed>-...``): the
    simulation has no other randomness, thread scheduling aside. ``latency``: the
    :class:`Latency` model of simulated time (0.5 ms a store round trip and a message by
    default). ``settings``: other :class:`~pdps.core.job.JobConfig` fields;
    ``task_timeout`` defaults to ``timeout``: the master times tasks out on the wall
    clock, which at a thousand threads on two cores says nothing about the job.
    ``progress`` is called about once a second with ``simulate``'s progress (the pass's
    ``todo``, ``pending`` and ``done`` counts, each trainer's ``metrics``) and
    ``simulated_seconds``.

    The report (:class:`ControlPlaneReport`): per role (``report.roles["master"]``,
    ``["pservers"]``, ``["trainers"]``, each a :class:`RoleReport`), store operations
    (calls by method, and watch events delivered), keys written, bytes written and read,
    compare-and-swap conflicts (transactions whose compares failed) and messages by
    method; the steps taken, tasks done, wall seconds; ``simulated_seconds`` (and
    ``simulated_seconds_per_step``) from the latency model (:func:`simulated_seconds`);
    ``master_bytes_per_task``: what a master taking over the finished pass holds (its
    queue and the pass's audit, restored from the store), by ``tracemalloc`` around its
    start, per task; ``audit``: the pass's audit read back (:class:`AuditCheck`,
    ``audit.ok``: every task done exactly once, every record trained exactly once).
    """
    import pdps
    from pdps.adapters.memory_store import MemoryStore
    from pdps.adapters.prometheus_metrics import RoleMetrics
    from pdps.registry import open_compute, open_transport

    for name, value, least in (("trainers", trainers, 1), ("pservers", pservers, 1), ("tasks", tasks, 1), ("records", records, 1),
                               ("step_every", step_every, 1), ("seed", seed, 0)):
        require_whole_number(name, value, least)
    job_mode = Mode.parse(mode)
    if step_every > 1 and job_mode is not Mode.ASYNC:
        raise ConfigError(f"step_every={step_every} needs mode='async': a sync trainer that skips a step leaves its round waiting")
    latency = Latency() if latency is None else latency
    if not isinstance(latency, Latency):
        raise ConfigError(f"latency must be a pdps.shell.control_plane.Latency, got {shown(latency)}")
    name = settings.pop("name", f"cp-{seed}-{uuid.uuid4().hex[:6]}")
    keys = Keys(name)
    clock = SimClock()
    memory = MemoryStore(url="memory://", clock=clock, reap_every=0.05)
    shared = CountingStore(memory, root=keys.root)
    transport = open_transport("inproc")
    counted: dict[str, tuple[CountingStore, RoleMetrics]] = {}

    def role_adapters(role: str, store: CoordinationStore, tr: Transport) -> tuple[CoordinationStore, Transport]:
        kind = role + "s" if role != "master" else role
        if kind not in counted:
            metrics = RoleMetrics(name, role, "all")
            counted[kind] = (CountingStore(store, root=keys.root), metrics)
        store_of, metrics = counted[kind]
        return store_of, metrics.transport(tr)

    def trainer_report() -> RoleReport:
        if "trainers" not in counted:
            return RoleReport(StoreCounts({}, {}, {}, {}, {}, {}, {}), {})
        store_of, metrics = counted["trainers"]
        return RoleReport(store_of.counts(), _messages(metrics))

    def advance(state: dict[str, Any] | None) -> None:
        r = trainer_report()
        now = clock.advance_to(simulated_seconds(r.store, r.messages, trainers=trainers, pservers=pservers, latency=latency))
        if progress is not None and state is not None:
            progress({**state, "simulated_seconds": now})

    settings.setdefault("task_timeout", timeout)
    began = time.perf_counter()
    try:
        result = pdps.simulate(
            train if step_every == 1 else stepping_every(step_every),
            dataset=Records(tasks, records), store=shared, transport=transport, compute=open_compute("torch", device="cpu"),
            timeout=timeout, progress=advance, _role_adapters=role_adapters, name=name, trainers=trainers, pservers=pservers,
            mode=job_mode.value, batch_size=1, overlap="off", min_block=1, num_slots=max(64, 8 * pservers),
            lease_ttl=settings.pop("lease_ttl", 10.0), passes=1, **settings,
        )
        wall = time.perf_counter() - began
        roles = {kind: RoleReport(store_of.counts(), _messages(metrics)) for kind, (store_of, metrics) in sorted(counted.items())}
        whole = shared.counts()
        advance(None)
        audit = check_audit(memory, keys, tasks, records)
        held = master_bytes_per_task(memory, transport, result.config, Records(tasks, records))
    finally:
        memory.close()
    steps = roles["trainers"].messages.get("push", 0) // pservers
    return ControlPlaneReport(
        trainers=trainers, pservers=pservers, tasks=tasks, records=records, mode=job_mode.value, roles=roles, steps=steps,
        tasks_done=result.tasks_done, wall_seconds=wall, simulated_seconds=clock(), latency=latency, master_bytes_per_task=held,
        audit=audit, whole=whole, step_every=step_every,
    )


def _messages(metrics: Any) -> dict[str, int]:
    """Calls made so far, by method, as a role's meter counted them on the client side."""
    out: Counter[str] = Counter()
    for family in metrics.registry.collect():
        for s in family.samples:
            if s.name == "pdps_rpc_seconds_count" and s.labels.get("side") == "client":
                out[s.labels["method"]] += int(s.value)
    return {k: v for k, v in sorted(out.items()) if v}


def check_audit(store: CoordinationStore, keys: Keys, tasks: int, records: int, pass_no: int = 0) -> AuditCheck:
    """Read the audit of ``pass_no`` back and count how each task ended in it."""
    done: Counter[int] = Counter()
    by: set[str | None] = set()
    attempts = once = 0
    for kv in store.range(keys.audit_pass(pass_no)):
        tried = decode_attempts(kv.value, kv.key)
        tid = keys.task_id(kv.key)
        attempts += len(tried)
        done[tid] = sum(a.outcome is Outcome.DONE for a in tried)
        by.update(a.trainer for a in tried if a.outcome is Outcome.DONE)
        once += sum(length for count, length in record_counts(tried, records) if count == 1)
    return AuditCheck(
        tasks=tasks,
        done_once=sum(1 for t in range(tasks) if done.get(t) == 1),
        done_more=sum(1 for n in done.values() if n > 1),
        not_done=sum(1 for t in range(tasks) if not done.get(t)),
        attempts=attempts,
        records=tasks * records,
        records_once=once,
        trainers=len(by),
    )


def master_bytes_per_task(store: CoordinationStore, transport: Transport, config: Any, source: Records) -> float:
    """What a master holds per task at the end of the pass: ``tracemalloc`` around the
    start of a master taking the finished job over (it restores the queue and the pass's
    audit, what the master that ran the pass held), over the tasks."""
    from pdps.roles.master import Master

    master = Master(store, transport, source, config)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        master.start()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
        master.stop()
    return held / source.n
