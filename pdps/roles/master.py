"""The master: owns the task queue of one job and serves it to trainers.

The imperative shell around :class:`pdps.core.tasks.TaskQueue`: it reads the clock,
persists each transition's changes (one key per touched task, guarded by its fenced
lock), watches trainer membership and re-queues the tasks of a trainer whose lease
expired, and starts the next pass or ends the job when a pass completes.

Leadership: a master serves only while it holds ``master/lock`` through its lease,
and every write carries the lock's fence, so a master that lost its lease cannot
change anything; it steps down at the first refused write or lost keep-alive. A
standby (``start(standby=True)``) waits for the lock, then restores the queue from
the per-task records and carries on: pending tasks get a fresh timeout, and tasks
held by trainers that are no longer registered go back to todo at once.

Every transition also writes the audit of the touched task, ``audit/<pass>/<id>``
(:mod:`pdps.core.audit`), in the same transaction as its record, so the audit and the
queue never disagree; a master that takes over restores the current pass's audit so
later attempts append to it.

Group commit: the master writes through a :class:`~pdps.runtime.group_commit.GroupCommitStore`
around its store. A transition changes the in-memory queue under the master's lock and
*stages* its writes; the lock is then released and the caller waits for the fenced
transaction holding them, which it shares with the transitions other trainers' calls
made meanwhile, in the order they were made. A reply (task handed out, report
accepted, even "wait") is sent only once the transaction holding its transition (or,
for a reply that changed nothing, every transition before it) succeeded. If a
transaction fails, every transition staged with it or after it fails too, none is
acknowledged: a lost lock or lease (``FencingError``, ``LeaseExpired``) or an outage
past the deadline steps the master down; any other error makes it rebuild its queue
and audit from the store before the next transition, so memory never stays ahead of
the store.

A task record that cannot be decoded is moved to ``quarantine/<id>`` (its task is
trained again from todo), an audit entry to ``quarantine/audit/<pass>/<id>`` (that
task's log of the pass starts afresh; ``pdps status --pass`` lists it); undecodable
job state (``config``, ``pass``, ``state``, ``queue``) stops the master with
:class:`~pdps.core.errors.CorruptRecord` naming the key.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence

from pdps.core.audit import (
    AuditEntry,
    AuditLog,
    QueueHeader,
    RecordCounts,
    decode_attempts,
    encode_attempts,
    roll_back_attempts,
)
from pdps.core.checkpoints import MASTER_PART, Epoch
from pdps.core.errors import ConfigError, CorruptRecord, FencingError, LeaseExpired, PdpsError, StoreUnavailable
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.progress import TaskProgress
from pdps.core.sgd import Mode
from pdps.core.speculation import Racer, Speculation
from pdps.core.slots import SlotMap
from pdps.core.tasks import (
    Assignment,
    TasksAdded,
    Change,
    Ignored,
    PassCompleted,
    PassStarted,
    TaskChanged,
    TaskQueue,
    TaskRecord,
    TaskSpec,
    WaitReason,
    rolled_back,
    rolled_back_stream,
)
from pdps.core.tasks import State as TaskState
from pdps.core.txn import Decision, Done, Write
from pdps.core.updategraph import brief_args
from pdps.core.wire import (
    CheckpointReply,
    CheckpointRequest,
    FailTaskRequest,
    FinishTaskRequest,
    GetTaskReply,
    GetTaskRequest,
    GiveBackRequest,
    ReportReply,
    TaskReport,
)
from pdps.ports.checkpoints import CheckpointFiles
from pdps.ports.coordination import Compare, CoordinationStore, Delete, EventType, Fence, KeyValue, Op, Put, TxnOp, WatchEvent
from pdps.core.windows import Window, WindowChanged, Windows
from pdps.ports.data import DataSource, StreamingSource
from pdps.ports.transport import Endpoint, Transport
from pdps.roles import calls
from pdps.roles.resizer import ResizeDriver
from pdps.runtime import recovery
from pdps.runtime.cas import read_modify_write
from pdps.runtime.group_commit import MAX_TXN_OPS, GroupCommitStore, Staged, copy_error
from pdps.runtime.rounds import read_round

log = logging.getLogger(__name__)

#: How long a trainer told to wait should sleep before asking again.
RETRY_IN = 0.05
#: How often a streaming job's master polls its source.
FEED_EVERY = 0.05


class _Read:
    """One read of trainer registrations, shared by the get_task calls that arrived before it started."""

    __slots__ = ("keys", "live", "error", "done")

    def __init__(self) -> None:
        self.keys: set[str] = set()
        self.live: set[str] = set()
        self.error: BaseException | None = None
        self.done = False


def publish_job(store: CoordinationStore, config: JobConfig) -> JobConfig:
    """Write the job's config, desired pserver count and slot map unless they exist.

    Returns the config in force: an existing job keeps its own, and a different one
    is refused rather than silently ignored.
    """
    keys = Keys(config.name)
    slot_map = SlotMap.initial(config.pservers, config.num_slots, config.replicas)
    store.commit(
        (Compare.absent(keys.config),),
        (
            Put(keys.config, config.encode()),
            Put(keys.ps_desired, str(config.pservers).encode()),
            Put(keys.slotmap, json.dumps(slot_map.to_json()).encode()),
        ),
    )
    existing = JobConfig.decode(store.get(keys.config).value, keys.config)  # type: ignore[union-attr]
    if existing != config:
        given = config.to_json()
        # an update rule shipped as a graph is shown by its digest, not its ~10 KB of nodes
        diff = {k: _brief(k, v, given[k]) for k, v in existing.to_json().items() if given[k] != v}
        raise ConfigError(f"job {config.name!r} already exists with other settings (stored, given): {diff}")
    return existing


def _brief(name: str, stored: object, given: object) -> tuple[object, object]:
    if name in ("optimizer_args", "sparse_optimizer_args"):
        return brief_args(stored), brief_args(given)
    return stored, given


class Master:
    def __init__(
        self,
        store: CoordinationStore,
        transport: Transport,
        source: DataSource,
        config: JobConfig,
        *,
        address: str = "inproc://",
        clock: Callable[[], float] = time.monotonic,
        checkpoints: CheckpointFiles | None = None,
        max_txn_ops: int = MAX_TXN_OPS,
        wall: Callable[[], float] = time.time,
        on_window: Callable[[Window], None] | None = None,
        before_job: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        #: a streaming source: tasks are cut as data arrives, in windows (see _feed)
        self._streaming = isinstance(source, StreamingSource)
        self._wall = wall  # windows' times are persisted and read elsewhere: wall-clock seconds
        self._on_window = on_window  # told of each window closed, once durable (post-window hooks)
        self._before_job = before_job  # run once the lock is held, before the first task is served
        self._windows: Windows | None = None
        # one for the master's life: its ring of finish times survives a queue rebuilt from the store
        self._speculation = Speculation(config.speculation, config.speculation_multiplier, config.speculation_min_finished)
        self._stream_pos: dict = {}  # {cursor, next_id, records, ended} as in the store's `stream`
        self._lag: dict = {}
        self._polled: dict = {}  # what the newest poll said of the source: records_untasked, stalled
        self._files = recovery.files_for(config, checkpoints)
        self._epoch = 0  # the job's epoch whose queue this master serves (see recovery)
        self._snapshots: set[str] = set()
        self._writers: list[threading.Thread] = []
        self._store = GroupCommitStore(store, max_txn_ops=max_txn_ops, on_failure=self._commit_failed)
        self._transport = transport
        self._source = source
        self._address = address
        self._clock = clock
        self._keys = Keys(config.name)
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._queue: TaskQueue | None = None
        self._audit = AuditLog()  # the current pass's attempts, kept in step with _queue
        self._fence: Fence | None = None
        self._endpoint: Endpoint | None = None
        self._threads: list[threading.Thread] = []
        self._watch = None
        self._watches: list = []
        self._keeper = None
        self.done = threading.Event()
        self.leading = threading.Event()  # set while this master holds the lock and serves
        self.error: BaseException | None = None  # why it stopped, if not by stop()
        self.passes_completed = 0
        #: The records as restored from the store when this master took over (before it
        #: re-queued the tasks of departed trainers); ``None`` for a new job.
        self.restored: list[TaskRecord] | None = None
        self._rebuild_due = False  # a transaction failed: reload the queue before the next transition
        self._departures = 0  # trainers found gone, so a registration read outside the lock can be trusted
        self._reads = threading.Condition(threading.Lock())  # group read of registrations (see _registered)
        self._next_read: _Read | None = None  # joined by arriving calls until it starts
        self._reading = False

    # --- lifecycle --------------------------------------------------------------------

    def start(self, *, standby: bool = False) -> None:
        """Take the lock, restore the queue and serve.

        If another master holds the lock, raise :class:`ConfigError`, or with
        ``standby`` wait (blocking) until the lock is free and take over. A standby
        stopped while it waits returns without serving.
        """
        from pdps.runtime.lease import LeaseKeeper

        if self._streaming:
            specs: list[TaskSpec] = []
            if not (self.config.window_records or self.config.window_seconds):
                raise ConfigError(
                    f"the dataset {self.config.dataset!r} is a stream: give the job windows (window_records and/or window_seconds)"
                )
        else:
            streaming_only = [n for n in ("window_records", "window_seconds", "windows", "checkpoint_windows", "export_url", "evaluate") if getattr(self.config, n)]
            if streaming_only:
                raise ConfigError(
                    f"{', '.join(streaming_only)} are for a streaming dataset (redis-stream://, memory-stream://, a Parquet "
                    f"directory with ?follow=1), but {self.config.dataset!r} is a finite one: it is trained in passes"
                )
            specs = self._source.tasks()  # a bad dataset fails here, before any task is created
        publish_job(self._store, self.config)
        self._keeper = LeaseKeeper(self._store, self.config.lease_ttl, name="master", on_lost=self._lease_lost)
        owner = f"master-{uuid.uuid4().hex[:8]}".encode()
        self._fence = self._store.acquire_lock(self._keys.master_lock, self._keeper.lease, owner)
        if self._fence is None and standby:
            log.info("job %r has a master; standing by for its lock", self.config.name)
            while self._fence is None and not self._stopped.wait(min(0.2, self.config.lease_ttl / 4)):
                self._fence = self._store.acquire_lock(self._keys.master_lock, self._keeper.lease, owner)
            if self._fence is None:
                self._keeper.stop()
                return
        if self._fence is None:
            self._keeper.stop()
            raise ConfigError(f"job {self.config.name!r} already has a master (lock {self._keys.master_lock} is held)")
        try:
            if self._before_job is not None:
                self._before_job()
            self._queue = self._load_queue(specs)
            self._catch_up_epoch()
            self._resume()
        except BaseException:
            self._keeper.stop()  # give the lock back: another master may do better
            raise
        handlers = {
            GetTaskRequest: self._get_task,
            FinishTaskRequest: self._finish_task,
            FailTaskRequest: self._fail_task,
            GiveBackRequest: self._give_back,
            CheckpointRequest: self._checkpoint,
        }
        self._endpoint = self._transport.serve(self._address, calls.serve(handlers))
        self._write([Put(self._keys.master_addr, self._endpoint.address.encode(), self._keeper.lease)])
        self._watch = self._store.watch(self._keys.trainers, self._on_trainer_event)
        self._watches.append(self._store.watch(self._keys.epoch, self._on_epoch_event))
        with self._lock:  # a rollback begun after the catch-up above and before the watch reached no callback
            self._restore_epoch(recovery.read_epoch(self._store, self._keys)[0])
        if self.config.mode is Mode.ASYNC:
            self._watches.append(self._store.watch(self._keys.checkpoints, self._on_checkpoint_event))
        self._reconcile()  # trainers that went while no master was watching
        t = threading.Thread(target=self._timer_loop, name="pdps-master-timer", daemon=True)
        t.start()
        self._threads.append(t)
        resizer = ResizeDriver(self._store, self.config, self._fence, self._stopped, self._transport)
        t = threading.Thread(target=resizer.run, name="pdps-master-resizer", daemon=True)
        t.start()
        self._threads.append(t)
        if self._streaming:
            t = threading.Thread(target=self._feed, name="pdps-master-source", daemon=True)
            t.start()
            self._threads.append(t)
        self.leading.set()
        c = self._queue.counts()
        log.info("master of job %r serving at %s: pass %d, %d todo, %d pending, %d done", self.config.name, self._endpoint.address, c.pass_no, c.todo, c.pending, c.done)

    def stop(self) -> None:
        self._stopped.set()
        self.leading.clear()
        if self._watch is not None:
            self._watch.cancel()
        for w in self._watches:
            w.cancel()
        if self._endpoint is not None:
            self._endpoint.close()
        for t in self._threads + self._writers:
            if t is not threading.current_thread():
                t.join()
        if self._keeper is not None:
            self._keeper.stop()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint.address

    @property
    def commit_stats(self) -> dict[str, int]:
        """Transactions and transitions committed by group commit (for tests and benchmarks)."""
        return self._store.stats

    def counts(self):
        with self._lock:
            assert self._queue is not None
            return self._queue.counts()

    # --- state ------------------------------------------------------------------------

    def _load_queue(self, specs: list[TaskSpec]) -> TaskQueue:
        cfg = self.config
        limits = self._limits()
        if self._streaming:
            return self._load_stream_queue(limits)
        kv = self._store.get(self._keys.pass_no)
        # the record counts go in once, for the audit (pdps status --pass): O(runs) here, never per transition
        counts = RecordCounts.of(specs)
        if kv is None:
            queue = TaskQueue.create(specs, **limits)
            self._store_record_counts(counts)  # before the transaction whose header names them
            self._write(
                [
                    Put(self._keys.pass_no, b"0"),
                    Put(self._keys.state, b'{"state": "running"}'),
                    Put(self._keys.queue, counts.header),
                ]
            )
            self._audit = AuditLog(pass_no=0)
            return queue
        pass_no = _int_record(kv)
        state = self._stored_state()
        queue_kv = self._store.get(self._keys.queue)
        header = None if queue_kv is None else decode_as(queue_kv.value, queue_kv.key, QueueHeader.from_json)
        if header is not None and header.tasks != len(specs):
            raise ConfigError(f"{self._keys.queue} says {queue_kv.value[:100]!r} but the dataset {cfg.dataset!r} now has {len(specs)} tasks")
        if header is not None and not counts.agrees(header):
            raise ConfigError(
                f"{self._keys.queue} holds other per-task record counts than the dataset {cfg.dataset!r} has now: "
                "the dataset changed under the job (its audit would not add up)"
            )
        rewritten = self._store_record_counts(counts)
        if header is not None and header.chunks is not None and rewritten:
            log.warning(
                "rewrote %d chunks of record counts that were missing or changed (%s): the dataset's counts agree with %s",
                len(rewritten),
                ", ".join(rewritten[:5]),
                self._keys.queue,
            )
        if queue_kv is None or queue_kv.value != counts.header:  # no queue record, or one an older pdps wrote
            self._write([Put(self._keys.queue, counts.header)])
        ids = {s.id for s in specs}
        records = []
        for rec_kv in self._store.range(self._keys.tasks):
            try:
                records.append(decode_record(rec_kv, self._keys, pass_no, ids))
            except CorruptRecord as exc:
                self._quarantine(rec_kv, exc)
        queue = TaskQueue.restore(specs, records, pass_no=pass_no, now=self._clock(), **limits)
        self.restored = queue.records()
        self._audit = self._restore_audit(pass_no, ids)
        self.passes_completed = len(self._store.range(self._keys.passes))
        if state.get("state") == "done":
            self.done.set()
        return queue

    def _limits(self) -> dict:
        cfg = self.config
        return {"failure_max": cfg.failure_max, "timeout": cfg.task_timeout, "max_in_flight": cfg.max_in_flight, "speculation": self._speculation}

    def _load_stream_queue(self, limits: dict) -> TaskQueue:
        """A streaming job's queue: new, or its windows not closed yet as stored."""
        cfg = self.config
        kv = self._store.get(self._keys.pass_no)
        if kv is None:
            self._stream_pos = {"cursor": self._source.start_cursor(), "next_id": 0, "records": 0, "ended": False}
            self._windows = Windows.restore((), records=cfg.window_records, seconds=cfg.window_seconds)
            self._write(
                [
                    Put(self._keys.pass_no, b"0"),
                    Put(self._keys.state, b'{"state": "running"}'),
                    Put(self._keys.stream, json.dumps(self._stream_pos).encode()),
                ]
            )
            self._audit = AuditLog(pass_no=0)
            return TaskQueue.open_ended(**limits)
        pass_no = _int_record(kv)
        state = self._stored_state()
        self._stream_pos = self._stored_stream()
        next_id = self._stream_pos["next_id"]
        stored = self._stored_windows()
        self._windows = Windows.restore(stored.values(), records=cfg.window_records, seconds=cfg.window_seconds)
        first = self._windows.first_live_task(next_id)
        closed = [w for w in stored.values() if w.no < self._windows.closed]
        forgotten = (sum(w.done for w in closed), sum(len(w.failed) for w in closed))
        specs = self._stored_specs(range(first, next_id))
        ids = {s.id for s in specs}
        records = []
        for rec_kv in self._store.range(self._keys.tasks):
            try:
                if self._keys.task_id(rec_kv.key) >= first:
                    records.append(decode_record(rec_kv, self._keys, pass_no, ids))
            except (CorruptRecord, ValueError) as exc:
                self._quarantine(rec_kv, exc if isinstance(exc, CorruptRecord) else CorruptRecord(str(exc), rec_kv.key))
        queue = TaskQueue.restore(
            specs, records, pass_no=pass_no, now=self._clock(), next_id=next_id, stream_ended=bool(self._stream_pos["ended"]),
            forgotten=forgotten, **limits,
        )  # fmt: skip
        self.restored = queue.records()
        self._audit = self._restore_audit(pass_no, ids, below=first)
        self.passes_completed = len(self._store.range(self._keys.passes))
        if state.get("state") == "done":
            self.done.set()
        return queue

    def _stored_stream(self) -> dict:
        kv = self._store.get(self._keys.stream)
        if kv is None:
            raise CorruptRecord(f"{self._keys.stream} is missing although {self._keys.pass_no} exists: not a streaming job?", self._keys.stream)

        def parse(d: dict) -> dict:
            pos = {"cursor": str(d["cursor"]), "next_id": int(d["next_id"]), "records": int(d["records"]), "ended": bool(d["ended"])}
            if pos["next_id"] < 0:
                raise ValueError("a negative next_id")
            return pos

        return decode_as(kv.value, kv.key, parse)

    def _stored_windows(self) -> dict[int, Window]:
        windows = {w.no: w for kv in self._store.range(self._keys.windows) for w in [decode_as(kv.value, kv.key, Window.from_json)]}
        missing = sorted(set(range(len(windows))) - set(windows))
        if missing:
            raise CorruptRecord(f"{self._keys.window(missing[0])} is missing, but later windows are stored", self._keys.window(missing[0]))
        return windows

    def _stored_specs(self, ids: range) -> list[TaskSpec]:
        """The specs of a streaming job's tasks ``ids`` (memory's where it has them)."""
        have = {} if self._queue is None else {s.id: s for s in self._queue.specs()}
        out = []
        for tid in ids:
            spec = have.get(tid)
            if spec is None:
                kv = self._store.get(self._keys.spec(tid))
                if kv is None:
                    raise CorruptRecord(f"{self._keys.spec(tid)} is missing: the stream's task {tid} cannot be read again", self._keys.spec(tid))
                spec = decode_as(kv.value, kv.key, TaskSpec.from_json)
            out.append(spec)
        return out

    def _store_record_counts(self, counts: RecordCounts) -> list[str]:
        """Write the chunks of ``counts`` that the store lacks or holds otherwise, one per
        transaction; returns their keys."""
        stored = {kv.key: kv.value for kv in self._store.range(self._keys.queue_records)}
        written = []
        for k, raw in enumerate(counts.chunks):
            key = self._keys.queue_chunk(k)
            if stored.get(key) != raw:
                self._write([Put(key, raw)])
                written.append(key)
        return written

    def _stored_state(self) -> dict:
        kv = self._store.get(self._keys.state)
        if kv is None:
            raise CorruptRecord(f"{self._keys.state} is missing although {self._keys.pass_no} exists", self._keys.state)
        state = decode_json(kv.value, kv.key)
        if not isinstance(state, dict) or state.get("state") not in ("running", "done"):
            raise CorruptRecord(f"{kv.key} holds {kv.value[:100]!r}, not a job state", kv.key)
        return state

    def _restore_audit(self, pass_no: int, ids: set[int], below: int = 0) -> AuditLog:
        """The current pass's attempt logs, so that later attempts append to them.

        An undecodable entry (or one for a task the dataset lacks) is quarantined and
        that task's log of the pass starts afresh: the audit must not stop the job, and
        the original bytes stay in the quarantine note for ``pdps status`` to point at.
        """
        entries = {}
        for kv in self._store.range(self._keys.audit_pass(pass_no)):
            name = kv.key.rsplit("/", 1)[1]
            if name.isdigit() and int(name) < below:
                continue  # a streaming job's task of a closed window: its log is final
            try:
                if not name.isdigit() or int(name) not in ids:
                    raise CorruptRecord(f"{kv.key} is an audit entry for no task of the dataset", kv.key)
                entries[int(name)] = decode_attempts(kv.value, kv.key)
            except CorruptRecord as exc:
                aside = self._keys.quarantined_audit(pass_no) + name
                self._quarantine(kv, exc, aside=aside, then="that task's audit of the pass starts afresh")
        return AuditLog.restore(pass_no, entries)

    def _quarantine(self, kv: KeyValue, exc: CorruptRecord, *, aside: str | None = None, then: str = "its task will be trained again") -> None:
        """Move an undecodable record aside (a task record to ``quarantine/<id>``: its task starts over from todo)."""
        aside = aside or self._keys.quarantine + kv.key.rsplit("/", 1)[1]
        note = {"key": kv.key, "error": str(exc), "value": base64.b64encode(kv.value).decode(), "mod_revision": kv.mod_revision}
        ops: list[TxnOp] = [Put(aside, json.dumps(note).encode()), Delete(kv.key)]
        self._store.commit((Compare.revision(kv.key, Op.EQ, kv.mod_revision),), ops, fence=self._fence)
        log.error("quarantined %s (moved to %s); %s: %s", kv.key, aside, then, exc)

    def _resume(self) -> None:
        """A restored pass may have completed before the restart: act on it now."""
        assert self._queue is not None
        with self._lock:
            if not self.done.is_set():
                self._apply(self._queue.check_completion())

    @contextlib.contextmanager
    def _locked(self):
        """The master's lock, for work on the queue: first rebuilds the queue from the
        store if a transaction failed since (memory must not stay ahead of the store)."""
        with self._lock:
            if self._rebuild_due and not self._stopped.is_set():
                self._rebuild()
            yield

    def _write(self, ops: Sequence[TxnOp]) -> None:
        """Write ``ops`` in a fenced transaction, after every transition staged before
        them (lock held); returns once they are durable."""
        if ops:
            self._store.commit((), ops, fence=self._fence)

    def _apply(self, changes: list[Change]) -> None:
        """Persist a transition and act on its notices (lock held); returns once durable."""
        self._store.wait(self._stage(changes))

    def _stage(self, changes: list[Change]) -> Staged | None:
        """Stage the writes of a transition for the next group commit, and act on its
        notices in memory (lock held). The caller must wait for the result before it
        tells anyone about the transition. One that writes nothing returns the latest
        staged writes (or ``None``): what it answers may rest on the transitions before it."""
        assert self._queue is not None
        ops: list[TxnOp] = []
        after: list[Callable[[], None]] = []
        self._transition_ops(changes, ops, after)
        return self._store.stage(ops, fence=self._fence, after=after)

    def _transition_ops(self, changes: list[Change], ops: list[TxnOp], after: list[Callable[[], None]]) -> None:
        assert self._queue is not None
        follow: list[PassCompleted] = []
        finished = False
        for ch in changes:
            if isinstance(ch, TaskChanged):
                ops.append(Put(self._keys.task(ch.record.id), json.dumps(ch.record.to_json()).encode()))
                finished = finished or ch.record.state in (TaskState.DONE, TaskState.FAILED)
            elif isinstance(ch, TasksAdded):
                ops.extend(Put(self._keys.spec(spec.id), json.dumps(spec.to_json()).encode()) for spec in ch.specs)
            elif isinstance(ch, PassStarted):
                ops.append(Put(self._keys.pass_no, str(ch.pass_no).encode()))
            elif isinstance(ch, PassCompleted):
                summary = {"pass": ch.pass_no, "done": ch.done, "failed": list(ch.failed)}
                ops.append(Put(self._keys.pass_summary(ch.pass_no), json.dumps(summary).encode()))
                follow.append(ch)
            elif isinstance(ch, Ignored):
                log.info("ignored %s for task %d attempt %d: %s", ch.event, ch.task_id, ch.attempt, ch.reason)
        ops.extend(self._audit_put(entry) for entry in self._audit.record(changes))  # same transaction
        if finished and self._windows is not None:
            self._close_windows(ops, after)
        if any(isinstance(ch, PassStarted) for ch in changes):
            # a pass run again after a rollback has entries already: its new attempts append to them
            self._audit = self._restore_audit(self._audit.pass_no, {s.id for s in self._queue.specs()})
        for pc in follow:  # the next pass (or the job's end) goes in the same transaction
            self.passes_completed = max(self.passes_completed, pc.pass_no + 1)
            if pc.failed:
                log.warning("pass %d: %d tasks failed for this pass: %s", pc.pass_no, len(pc.failed), list(pc.failed)[:20])
            log.info("pass %d complete: %d done, %d failed", pc.pass_no, pc.done, len(pc.failed))
            if self.passes_completed < self.config.passes:
                self._transition_ops(self._queue.start_next_pass(), ops, after)
            else:
                ops.append(Put(self._keys.state, json.dumps({"state": "done", "passes": self.passes_completed}).encode()))
                if self._windows is not None:  # the lag's last word, with the job's: nothing is left untrained
                    # the newest poll's word on the source too: the job may end before the next
                    # measure (about once a second), and nothing is polled after it
                    self._lag = dict(self._lag, **self._polled, tasks_untrained=0, records_untrained=0, backpressure=False, at=self._wall())
                    ops.append(Put(self._keys.stream_lag, json.dumps(self._lag).encode()))
                after.append(self.done.set)  # "done" is said only once it is durable

    def _close_windows(self, ops: list[TxnOp], after: list[Callable[[], None]]) -> None:
        """Close the windows whose tasks all finished, in the transaction at hand (lock
        held): their tasks leave memory, and the post-window work starts once it is durable."""
        assert self._queue is not None and self._windows is not None
        queue = self._queue

        def state_of(tid: int) -> TaskState | None:
            return None if queue.forgotten(tid) else queue.record(tid).state

        for closed in self._windows.settle(state_of, self._wall()):
            w = closed.window
            ops.append(Put(self._keys.window(w.no), w.encode()))
            if self.config.checkpoint_windows and (w.no + 1) % self.config.checkpoint_windows == 0:
                ops.append(Put(self._keys.checkpoint_wanted, json.dumps({"window": w.no}).encode()))
            queue.forget(w.tasks)
            self._audit.forget(w.tasks)
            log.info("window %d closed: tasks %d..%d, %d records, %d failed", w.no, w.first, w.end - 1, w.records, len(w.failed))
            if self._on_window is not None:
                after.append(lambda w=w: self._window_closed(w))

    def _window_closed(self, window: Window) -> None:
        assert self._on_window is not None
        try:
            self._on_window(window)
        except Exception:  # post-window work must not stop the job; its failure is logged
            log.exception("post-window work for window %d failed", window.no)

    def _commit_failed(self, error: BaseException) -> Callable[[], None] | None:
        """A group commit failed (none of its transitions was acknowledged): what the
        master does about it, once the engine's lock is released."""
        if isinstance(error, FencingError):
            return lambda: self._step_down("its lock is held by another master")
        if isinstance(error, LeaseExpired):
            return lambda: self._step_down(f"its lease is gone: {error}")
        if isinstance(error, StoreUnavailable):  # the outage outlasted store_outage_deadline
            return lambda: self._fail(error)
        self._rebuild_due = True  # set before any caller hears of the failure: its next call reloads first
        return None

    def _rebuild(self) -> None:
        """Reload the queue and the audit from the store after a failed transaction (lock
        held), as a master taking over would: the store is the truth, and nothing that
        failed was acknowledged."""
        assert self._queue is not None
        log.warning("master of job %r reloads its queue from the store after a failed transaction", self.config.name)
        self._store.resume()
        self._rebuild_due = False
        restored = self.restored
        try:
            self._queue = self._load_queue(self._queue.specs())
            self._catch_up_epoch()
            if not self.done.is_set():
                self._apply(self._queue.check_completion())
        except FencingError:
            raise
        except BaseException:
            self._rebuild_due = True  # try again before the next transition
            raise
        finally:
            self.restored = restored

    def _audit_put(self, entry: AuditEntry) -> Put:
        """The write of one audit entry, for the transaction of the change that made it."""
        return Put(self._keys.audit_entry(entry.pass_no, entry.task_id), entry.encode())

    def _roll_back_audit(
        self, snapshot: Sequence[TaskRecord], pass_no: int, finished: Iterable[int] = (), kept: Mapping[int, int] | None = None
    ) -> list[TxnOp]:
        """The audit's part of a rollback to a checkpoint that saved ``snapshot`` at pass
        ``pass_no`` (lock held): the writes that mark ``rolled_back`` what the checkpoint
        does not keep, in the current pass, the passes in between and the checkpoint's
        own; the log then follows the checkpoint's pass. ``finished``: tasks pending in
        the snapshot whose attempt had trained their last record (the rollback counts
        them done); ``kept``: the other tasks pending in it, with the record their attempt
        had trained up to (still counted). Idempotent, so a rollback redone by the next
        master redoes it too.
        """
        assert self._queue is not None
        finished = set(finished)
        ops: list[TxnOp] = [self._audit_put(e) for e in self._audit.roll_back(snapshot, finished=finished, kept=kept)]
        if pass_no == self._audit.pass_no:
            return ops
        for p in range(pass_no + 1, self._audit.pass_no):
            for kv in self._store.range(self._keys.audit_pass(p)):
                try:
                    attempts = decode_attempts(kv.value, kv.key)
                except CorruptRecord:
                    continue  # a restoring master quarantines it
                undone = roll_back_attempts(attempts)
                if undone != attempts:
                    ops.append(Put(kv.key, encode_attempts(undone)))
        self._audit = self._restore_audit(pass_no, {s.id for s in self._queue.specs()})
        ops += [self._audit_put(e) for e in self._audit.roll_back(snapshot, finished=finished, kept=kept)]
        return ops

    # --- handlers ---------------------------------------------------------------------

    def _check_leading(self) -> None:
        if self._stopped.is_set():
            raise FencingError(f"this master of job {self.config.name!r} has stepped down; ask the one at {self._keys.master_addr}")

    def _registered(self, trainer: str) -> bool:
        """Whether the trainer's key exists, read after this call began.

        Group read: the calls arriving while a read is in flight join the next one, a
        single ``get`` for one trainer or one ``range`` of ``trainers/`` for several,
        so that concurrent get_task calls share a round trip as their transitions share
        a transaction. A read that started before a call arrived never answers it."""
        key = self._keys.trainer(trainer)
        cv = self._reads
        with cv:
            read = self._next_read
            if read is None:
                read = self._next_read = _Read()
            read.keys.add(key)
            while not read.done:
                if self._reading or self._next_read is not read:
                    cv.wait()
                    continue
                self._reading, self._next_read = True, None  # from now on, arrivals join another read
                cv.release()
                try:
                    if len(read.keys) == 1:
                        read.live = {key} if self._store.get(key) is not None else set()
                    else:
                        read.live = {kv.key for kv in self._store.range(self._keys.trainers)}
                except BaseException as exc:  # every call waiting for this read fails
                    read.error = exc
                finally:
                    cv.acquire()
                    self._reading, read.done = False, True
                    cv.notify_all()
        if read.error is not None:
            raise copy_error(read.error)
        return key in read.live

    def _get_task(self, req: GetTaskRequest) -> GetTaskReply:
        trainer = req.trainer
        # The registration read is made before taking the lock, so that the trainers'
        # reads overlap instead of queueing. Read again under the lock if a trainer was
        # found gone meanwhile: its tasks were re-queued and it must not take new ones.
        departures = self._departures
        registered = self._registered(trainer)
        with self._locked():
            assert self._queue is not None
            self._check_leading()
            if self.done.is_set():
                return GetTaskReply(done=True)
            if req.epoch is not None and req.epoch > self._epoch:
                return GetTaskReply(wait="rolling back", retry_in=RETRY_IN, epoch=self._epoch)
            if departures != self._departures:
                registered = self._registered(trainer)
            if not registered:
                # Its tasks were re-queued when its key went; it must not take new ones.
                raise LeaseExpired(f"trainer {trainer!r} is not registered in job {self.config.name!r} (its lease expired?); re-register first")
            again = self._queue.redeliver(trainer, req.holding) if req.holding is not None else None
            if again is not None:
                log.warning("trainer %s asks for work while holding task %d attempt %d (a lost reply?): handing it out again", trainer, again.task.id, again.attempt)
                result, changes = again, []
            else:
                result, changes = self._queue.dispatch(trainer, self._clock())
                if result is WaitReason.DRAINED and (late := self._queue.straggler(trainer, self._clock())) is not None:
                    result, changes = self._speculate(late, trainer)
                    result = result or WaitReason.DRAINED
            durable = self._stage(changes)
            epoch_now = self._epoch
        self._store.wait(durable)  # the lock is free for the transitions that join this one's transaction
        if isinstance(result, Assignment):
            return GetTaskReply(task=result.task, attempt=result.attempt, pass_no=result.pass_no, offset=result.offset, epoch=epoch_now)
        if result is WaitReason.PASS_COMPLETE and self.done.is_set():
            return GetTaskReply(done=True)
        return GetTaskReply(wait=str(result), retry_in=RETRY_IN, epoch=epoch_now)

    def _report(self, req: TaskReport, event: Callable[..., list[Change]], *, ends_attempt: bool = False) -> ReportReply:
        """A trainer's report on its attempt: ``event(queue, task, attempt[, applied])``
        applied to the queue as it is once the lock is held. Never to a queue looked up
        before: a rollback (or a rebuild) that held the lock meanwhile replaced it, and a
        report applied to the one it replaced was lost in memory yet written to the store
        (a fault run saw a task finished in the rolled-back queue trained again)."""
        task, attempt = req.task, req.attempt
        with self._locked():
            queue = self._queue
            assert queue is not None
            self._check_leading()
            if ends_attempt:
                racer = None if queue.forgotten(task) else next((r for r in queue.racers(task) if r.attempt == attempt), None)
                changes, applied = self._fence_attempts([] if racer is None else [(task, racer)])
                changes += event(queue, task, attempt, applied.get(task))
            else:
                changes = event(queue, task, attempt)
            durable = self._stage(changes)
        self._store.wait(durable)
        ignored = next((c for c in changes if isinstance(c, Ignored)), None)
        return ReportReply(accepted=ignored is None, reason=ignored.reason if ignored else None)

    def _finish_task(self, req: FinishTaskRequest) -> ReportReply:
        return self._report(req, lambda queue, task, attempt: queue.finish(task, attempt, self._clock()))  # timed: speculation's median

    def _fail_task(self, req: FailTaskRequest) -> ReportReply:
        log.warning("trainer %s failed task %s: %s", req.trainer, req.task, req.error)
        return self._report(req, TaskQueue.fail, ends_attempt=True)

    def _give_back(self, req: GiveBackRequest) -> ReportReply:
        return self._report(req, TaskQueue.give_back, ends_attempt=True)

    def _fence_attempts(self, ending: Iterable[tuple[int, Racer]]) -> tuple[list[Change], dict[int, int]]:
        """End these pending attempts in their tasks' progress records (lock held), before
        their tasks are re-queued: from then on no step of theirs can be applied. Returns
        how far each had trained, where the next attempt resumes (exactly once per record).

        An attempt racing another (speculation) may have lost the race without the queue
        knowing yet: the progress record read here says so, and the returned changes end
        the loser first (``beaten``), so the ending attempt is credited its own records."""
        assert self._queue is not None
        applied: dict[int, int] = {}
        changes: list[Change] = []
        for task, racer in ending:
            key = self._keys.task_progress(task)
            read: list[TaskProgress] = []

            def fence(kv: KeyValue | None, key: str = key, racer: Racer = racer) -> Decision:
                progress = TaskProgress.decode(None if kv is None else kv.value, key)
                read[:] = [progress]
                fenced = progress.fence(racer.attempt, racer.offset)
                if fenced == progress:  # fenced already (a master before this one got this far)
                    return Done(fenced)
                # a lost race means the attempt's trainer advanced it meanwhile: read again
                return Write((Compare.unchanged(key, kv),), (Put(key, fenced.encode()),), result=fenced)

            fenced = read_modify_write(self._store, key, fence, what=f"fence task {task} attempt {racer.attempt}", fence=self._fence)
            racers = self._queue.racers(task)
            for loser in [r for r in racers if len(racers) > 1 and read and not read[0].allows(r.attempt)]:
                changes += self._queue.beaten(task, loser.attempt)  # (the ending one itself: its event is then ignored)
            applied[task] = fenced.applied
        return changes, applied

    def _speculate(self, rec: TaskRecord, trainer: str) -> tuple[Assignment | None, list[Change]]:
        """Open a race for straggler ``rec`` with a backup attempt by ``trainer`` (lock
        held): first in the task's progress record (the backup reads from where it
        stands; the first of the two to commit a range wins), then in the queue."""
        assert self._queue is not None
        backup = rec.issued + 1
        key = self._keys.task_progress(rec.id)
        records = self._queue.spec(rec.id).records

        def open_race(kv: KeyValue | None) -> Decision:
            progress = TaskProgress.decode(None if kv is None else kv.value, key)
            if progress.applied >= records or not progress.allows(rec.attempt):
                return Done(None)  # nothing left to race for, or the attempt is over already
            raced = progress.open_race(rec.attempt, backup)
            return Write((Compare.unchanged(key, kv),), (Put(key, raced.encode()),), result=raced)

        raced = read_modify_write(self._store, key, open_race, what=f"race task {rec.id} attempt {rec.attempt}", fence=self._fence)
        if raced is None or raced.applied < rec.offset:
            return None, []
        now = self._clock()
        changes = self._queue.speculate(rec.id, trainer, backup, raced.applied, now)
        log.warning(
            "task %d attempt %d by %s is a straggler: backup attempt %d by %s races it from record %d",
            rec.id, rec.attempt, rec.trainer, backup, trainer, raced.applied,
        )  # fmt: skip
        new = next(c.record for c in changes if isinstance(c, TaskChanged))
        assert new.backup is not None
        return Assignment(self._queue.spec(rec.id), backup, self._queue.pass_no, new.backup.deadline, raced.applied), changes

    # --- checkpoints and rollbacks ----------------------------------------------------

    @property
    def epoch(self) -> int:
        return self._epoch

    def _checkpoint(self, req: CheckpointRequest) -> CheckpointReply:
        """Sync: a trainer reports a checkpoint taken right after the round it pulled.
        Every trainer calls this before any other call of its next step, so the first
        call finds the queue exactly as it was when that round closed."""
        with self._locked():
            self._check_leading()
            self._snapshot(req.checkpoint)
        return CheckpointReply(accepted=True, epoch=self._epoch)

    def _on_checkpoint_event(self, event: WatchEvent) -> None:
        """Async: snapshot the queue when pserver 0 announces a checkpoint."""
        if event.type is not EventType.PUT or not event.key.endswith("/info") or self._stopped.is_set():
            return
        try:
            info = decode_json(event.value or b"", event.key)
        except CorruptRecord:
            return
        if isinstance(info, dict) and info.get("state") == "writing" and isinstance(info.get("id"), str):
            with self._locked():
                self._snapshot(info["id"])

    def _snapshot(self, ckpt_id: str) -> None:
        """Copy the queue for checkpoint ``ckpt_id`` now (lock held); write it in the background."""
        assert self._queue is not None
        if ckpt_id in self._snapshots or self._files is None:
            return
        info_kv = self._store.get(self._keys.checkpoint_info(ckpt_id))
        if info_kv is None:
            return  # abandoned by a rollback
        info = decode_json(info_kv.value, info_kv.key)
        if int(info.get("epoch", -1)) != self._epoch or info.get("state") != "writing":
            return
        if self._fence is not None and info_kv.mod_revision < self._fence.revision:
            # announced before this master took the lock: the queue as its round left it is
            # gone (trainers have reported here since), and the master before may have written
            # and recorded the part already. The checkpoint stays uncommitted; the next one will do.
            return
        self._store.flush()  # the snapshot holds only what is durable
        self._snapshots.add(ckpt_id)
        progress: dict[str, list] = {}
        if info.get("mode") == "sync" and int(info["round"]) > 0:
            record = read_round(self._store, self._keys, self._epoch, int(info["round"]) - 1)
            if record is not None:
                for c in record.contributions.values():
                    if c.task is not None and c.attempt is not None:
                        progress[str(c.task)] = [c.attempt, c.offset, c.last]
        state = {
            "epoch": self._epoch,
            "round": int(info["round"]),
            "pass": self._queue.pass_no,
            "passes_completed": self.passes_completed,
            "records": [r.to_json() for r in self._queue.records()],
            "progress": progress,
        }
        if self._windows is not None:  # a streaming job: the records are those of its unfinished windows
            state["next_id"], state["windows_closed"] = self._queue.next_id, self._windows.closed
        t = threading.Thread(target=self._write_snapshot, args=(ckpt_id, state), name=f"pdps-ckpt-{ckpt_id}", daemon=True)
        self._writers = [w for w in self._writers if w.is_alive()] + [t]
        t.start()

    def _write_snapshot(self, ckpt_id: str, state: dict) -> None:
        assert self._files is not None
        try:
            part = self._files.write_json_part(f"{ckpt_id}/{MASTER_PART}.json", state, name=MASTER_PART)
            if recovery.record_part(self._store, self._keys, ckpt_id, part):
                recovery.try_commit(self._store, self._files, self.config, ckpt_id)
        except PdpsError as exc:
            log.error("master could not write its part of checkpoint %s: %s", ckpt_id, exc)

    def _catch_up_epoch(self) -> None:
        """At takeover: finish a rollback the previous master did not (or never saw)."""
        epoch, _ = recovery.read_epoch(self._store, self._keys)
        restored = int(self._stored_state().get("epoch", 0))
        self._epoch = restored
        if epoch.epoch > restored:
            with self._lock:
                self._restore_epoch(epoch)

    def _saved_queue(self, epoch: Epoch) -> tuple[list[TaskRecord], dict[int, tuple[int, int, bool]], dict] | None:
        """The queue as the epoch's checkpoint saved it: its task records, the progress of
        the round it followed, and the whole master part; None for a rollback to the start."""
        if epoch.checkpoint is None or self._files is None:
            return None
        manifest = self._files.read_manifest(epoch.checkpoint)
        state = self._files.read_json_part(manifest.parts[MASTER_PART])
        snapshot = [TaskRecord.from_json(d) for d in state["records"]]
        progress = {int(k): (int(v[0]), int(v[1]), bool(v[2])) for k, v in state["progress"].items()}
        return snapshot, progress, state

    def _restore_stream_epoch(self, epoch: Epoch) -> None:
        """:meth:`_restore_epoch` for a streaming job (lock held): the windows closed since
        the checkpoint are sealed again, their tasks come back from the store, and every
        task added since is todo again; the cursor stays (no data is tasked twice)."""
        assert self._queue is not None and self._windows is not None
        snapshot: list[TaskRecord] = []
        progress: dict[int, tuple[int, int, bool]] = {}
        snapshot_next = closed_then = 0
        saved = self._saved_queue(epoch)
        if saved is not None:
            snapshot, progress, state = saved
            snapshot_next, closed_then = int(state["next_id"]), int(state["windows_closed"])
        next_id = self._queue.next_id
        stored = self._stored_windows()
        reopened = self._windows.rolled_back(closed_then, stored)
        first = self._windows.first_live_task(next_id)
        closed = [w for w in stored.values() if w.no < closed_then]
        specs = self._stored_specs(range(first, next_id))
        current = {r.id: r for r in self._queue.records()}
        for kv in self._store.range(self._keys.tasks):  # the attempts of tasks forgotten since
            tid = self._keys.task_id(kv.key)
            if tid >= first and tid not in current:
                with contextlib.suppress(CorruptRecord):
                    current[tid] = decode_record(kv, self._keys, 0)
        records = rolled_back_stream(snapshot, current.values(), progress, first=first, snapshot_next=snapshot_next, next_id=next_id)
        queue = TaskQueue.restore(
            specs, records, pass_no=0, next_id=next_id, stream_ended=not self._queue.open,
            forgotten=(sum(w.done for w in closed), sum(len(w.failed) for w in closed)), **self._limits(),
        )  # fmt: skip
        ops: list[TxnOp] = [Put(self._keys.task(r.id), json.dumps(r.to_json()).encode()) for r in records]
        ops += [Put(self._keys.window(ch.window.no), ch.window.encode()) for ch in reopened]
        ops.extend(Delete(kv.key) for kv in self._store.range(self._keys.passes))
        finished, kept = _pending_at(snapshot, progress)
        self._audit = self._restore_audit(0, set(range(first, next_id)), below=first)
        ops += [self._audit_put(e) for e in self._audit.roll_back([r for r in snapshot if r.id >= first], finished=finished, kept=kept)]
        for i in range(0, len(ops), 100):
            self._write(ops[i : i + 100])
        self._write([Put(self._keys.state, json.dumps({"state": "running", "epoch": epoch.epoch}).encode())])
        self._queue, self.passes_completed, self._epoch = queue, 0, epoch.epoch
        self._snapshots.clear()
        self.done.clear()
        c = queue.counts()
        log.warning(
            "master rolled the stream back to %s (epoch %d): closed windows re-opened: %s; %d todo, %d pending",
            epoch.checkpoint or "the start", epoch.epoch, [ch.window.no for ch in reopened], c.todo, c.pending,
        )  # fmt: skip

    def _on_epoch_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.PUT or self._stopped.is_set():
            return
        try:
            epoch = Epoch.from_json(decode_json(event.value or b"", event.key))
        except (CorruptRecord, KeyError, TypeError, ValueError):
            log.error("master ignores an undecodable epoch record %r", (event.value or b"")[:200])
            return
        with self._lock:
            try:
                if self._rebuild_due and not self._stopped.is_set():
                    self._rebuild()  # (which may restore the epoch itself)
                self._restore_epoch(epoch)
            except FencingError:
                pass  # stepped down
            except PdpsError as exc:
                self._fail(exc)

    def _restore_epoch(self, epoch: Epoch) -> None:
        """Put the queue back where the epoch's checkpoint had it (lock held).

        Tasks done or failed at the checkpoint stay so; tasks pending then resume at
        the records their attempt had trained; everything trained since is todo again.
        Attempts never go back, so reports of attempts made after the checkpoint are
        ignored. The job's ``state`` records the epoch last, so a master that dies
        half-way leaves the next one to redo the whole restore.
        """
        assert self._queue is not None
        if epoch.epoch <= self._epoch:
            return
        self._store.flush()  # the transitions before the rollback are durable (or it waits for a rebuild)
        if self._windows is not None:
            self._restore_stream_epoch(epoch)
            return
        specs = self._queue.specs()
        pass_no, completed, progress = 0, 0, {}
        snapshot = [TaskRecord(id=s.id, pass_no=0, state=TaskState.TODO) for s in specs]
        saved = self._saved_queue(epoch)
        if saved is not None:
            snapshot, progress, state = saved
            pass_no, completed = int(state["pass"]), int(state["passes_completed"])
        records = rolled_back(snapshot, self._queue.records(), progress, pass_no=pass_no)
        queue = TaskQueue.restore(specs, records, pass_no=pass_no, **self._limits())
        ops: list[TxnOp] = [Put(self._keys.task(r.id), json.dumps(r.to_json()).encode()) for r in queue.records()]
        ops.append(Put(self._keys.pass_no, str(pass_no).encode()))
        ops.extend(Delete(kv.key) for kv in self._store.range(self._keys.passes) if int(kv.key.rsplit("/", 1)[1]) >= pass_no)
        finished, kept = _pending_at(snapshot, progress)
        ops.extend(self._roll_back_audit(snapshot, pass_no, finished, kept))
        for i in range(0, len(ops), 100):
            self._write(ops[i : i + 100])
        self._write([Put(self._keys.state, json.dumps({"state": "running", "epoch": epoch.epoch}).encode())])
        self._queue, self.passes_completed, self._epoch = queue, completed, epoch.epoch
        self._snapshots.clear()
        self.done.clear()
        c = queue.counts()
        log.warning(
            "master rolled the queue back to %s (epoch %d): pass %d, %d todo, %d done, %d failed",
            epoch.checkpoint or "the start", epoch.epoch, c.pass_no, c.todo, c.done, c.failed,
        )
        self._apply(queue.check_completion())

    # --- background -------------------------------------------------------------------

    def _on_trainer_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.DELETE or self._stopped.is_set():
            return
        self._trainer_gone(self._keys.trainer_id(event.key))

    def _trainer_gone(self, trainer: str) -> None:
        with self._locked():
            assert self._queue is not None
            self._departures += 1  # a get_task that read the trainer's key before this reads it again
            held = [(t, r) for t in sorted(self._queue.in_flight(trainer)) for r in self._queue.racers(t) if r.trainer == trainer]
            changes, applied = self._fence_attempts(held)
            changes += self._queue.trainer_lost(trainer, applied)
            if changes:
                log.warning("trainer %s is gone; re-queued its tasks %s", trainer, [c.record.id for c in changes if isinstance(c, TaskChanged)])
            self._guarded(changes)

    def _reconcile(self) -> None:
        """Re-queue the tasks of holders that are not registered: a watch can miss a
        deletion (before this master existed, or across a store reconnect)."""
        assert self._queue is not None
        with self._lock:
            holders = self._queue.holders()
        if not holders:
            return
        live = {self._keys.trainer_id(kv.key) for kv in self._store.range(self._keys.trainers)}
        for trainer in sorted(holders - live):
            self._trainer_gone(trainer)

    def _timer_loop(self) -> None:
        every = max(0.5, self.config.lease_ttl / 2)
        next_reconcile = self._clock() + every
        while not self._stopped.wait(0.05):
            try:
                with self._locked():
                    assert self._queue is not None
                    deadline = self._queue.next_deadline()
                    if deadline is not None and deadline <= self._clock():
                        now = self._clock()
                        changes, applied = self._fence_attempts(self._queue.expired_racers(now))
                        self._guarded(changes + self._queue.expire(now, applied))
                if self._clock() >= next_reconcile and not self._stopped.is_set():
                    next_reconcile = self._clock() + every
                    self._reconcile()
            except StoreUnavailable as exc:  # the outage outlasted store_outage_deadline
                self._fail(exc)
            except Exception as exc:
                log.exception("master timer failed")
                self._fail(exc)

    # --- streaming ----------------------------------------------------------------------

    def _feed(self) -> None:
        """The source thread of a streaming job: poll the source outside the lock, then
        add what it cut in one fenced transaction with the cursor, so each piece of data
        becomes exactly one task; seal windows by time; write the lag about once a second."""
        partial_since: float | None = None  # since when a partial task has been waiting
        lag_due = 0.0
        arrivals = None
        more = False  # the last poll cut all it was allowed to: poll again at once
        while not self._stopped.wait(0 if more else FEED_EVERY):
            more = False
            try:
                if self.done.is_set() and lag_due:
                    lag_due = 0.0
                    self._write_lag(arrivals)  # the job's last word on its lag: nothing untrained
                if self.done.is_set() or not self.leading.is_set():
                    continue
                with self._locked():
                    assert self._queue is not None and self._windows is not None
                    if self._stopped.is_set():
                        continue
                    # once the stream has ended nothing more is cut, but the lag still drains
                    if self._queue.open and self._windows.due(self._wall()):
                        self._guarded_ops(self._windows.seal(self._wall()))
                    budget = self.config.stream_max_tasks - self._queue.unfinished()
                    cursor, room = self._stream_pos["cursor"], self._windows.room()
                    last_window = bool(self.config.windows) and self._windows.sealed == self.config.windows - 1
                if budget > 0 and self._queue.open:
                    k = self.config.task_records
                    size, most = (k, budget) if room is None else ((room, 1) if room < k else (k, min(budget, room // k)))
                    if last_window and room is not None:
                        most = 1  # a cut may hold more than the room (a row group): none may spill past the job's last window
                    flush = partial_since is not None and self._clock() - partial_since >= self.config.stream_linger
                    arrivals = self._source.poll(cursor, task_records=size, max_tasks=most, flush=flush)
                    with self._locked():
                        if self._stream_pos["cursor"] != cursor or self._stopped.is_set():
                            continue  # a rollback or another master moved it meanwhile: poll again
                        self._add_tasks(arrivals)
                    more = len(arrivals.cuts) == most
                    waiting = not arrivals.cuts and arrivals.backlog != 0  # None: the source cannot tell, so flush after the linger
                    partial_since = (partial_since or self._clock()) if waiting else None
                if self._clock() >= lag_due:
                    lag_due = self._clock() + 1.0
                    self._write_lag(arrivals)
            except StoreUnavailable as exc:
                self._fail(exc)
            except FencingError:
                pass  # stepped down
            except PdpsError as exc:
                log.error("master could not poll the stream %s (trying again): %s", self.config.dataset, exc)
                self._stopped.wait(1.0)
            except Exception as exc:
                log.exception("master source thread failed")
                self._fail(exc)

    def _add_tasks(self, arrivals) -> None:
        """Add the tasks ``arrivals`` cut, with the new cursor and the windows they fill (lock held)."""
        assert self._queue is not None and self._windows is not None
        self._polled = {"records_untasked": arrivals.backlog, "stalled": arrivals.stalled}
        changes: list[Change] = self._queue.add_tasks([(c.location, c.part, c.records) for c in arrivals.cuts])
        added = [s for ch in changes if isinstance(ch, TasksAdded) for s in ch.specs]
        windows = self._windows.added(added, self._wall())
        last = self.config.windows and self._windows.sealed >= self.config.windows
        if last:
            changes += self._queue.end_stream()
        pos = dict(self._stream_pos, cursor=arrivals.cursor, next_id=self._queue.next_id, ended=bool(last))
        pos["records"] += sum(s.records for s in added)
        if pos == self._stream_pos:
            return
        ops: list[TxnOp] = [Put(self._keys.window(ch.window.no), ch.window.encode()) for ch in windows]
        ops.append(Put(self._keys.stream, json.dumps(pos).encode()))
        self._stream_pos = pos
        after: list[Callable[[], None]] = []
        self._transition_ops(changes, ops, after)
        self._store.wait(self._store.stage(ops, fence=self._fence, after=after))
        if last:
            log.info("the job's %d windows are sealed: no more tasks are cut from %s", self.config.windows, self.config.dataset)

    def _guarded_ops(self, windows: list[WindowChanged]) -> None:
        """Persist sealed windows (lock held); the window may close at once if its tasks are done."""
        assert self._queue is not None
        ops: list[TxnOp] = [Put(self._keys.window(ch.window.no), ch.window.encode()) for ch in windows]
        after: list[Callable[[], None]] = []
        if windows and self._windows is not None:
            last = self.config.windows and self._windows.sealed >= self.config.windows
            changes = self._queue.end_stream() if last else []
            if last:
                self._stream_pos = dict(self._stream_pos, ended=True)
                ops.append(Put(self._keys.stream, json.dumps(self._stream_pos).encode()))
            self._close_windows(ops, after)
            self._transition_ops(changes, ops, after)
        self._store.wait(self._store.stage(ops, fence=self._fence, after=after))

    def _write_lag(self, arrivals) -> None:
        """``stream/lag``: what the job has not trained yet (for pdps status)."""
        with self._locked():
            assert self._queue is not None
            untrained = [(self._queue.spec(r.id).records - r.offset) for r in self._queue.records() if r.state in (TaskState.TODO, TaskState.PENDING)]
            # held back now: stream_max_tasks unfinished, with data still to cut (a poll that
            # filled the queue up is backpressure too, not only a turn that could not poll)
            backpressure = (
                self._queue.open and len(untrained) >= self.config.stream_max_tasks and (arrivals is None or arrivals.backlog != 0)
            )
            lag = {
                "records_untasked": None if arrivals is None else arrivals.backlog,
                "tasks_untrained": len(untrained),
                "records_untrained": sum(untrained),
                "backpressure": bool(backpressure),
                "stalled": None if arrivals is None else arrivals.stalled,
                "windows_closed": 0 if self._windows is None else self._windows.closed,
                "at": self._wall(),
            }
            if arrivals is None and self._lag:
                lag["records_untasked"], lag["stalled"] = self._lag.get("records_untasked"), self._lag.get("stalled")
            self._lag = lag
        self._write([Put(self._keys.stream_lag, json.dumps(lag).encode())])

    def _guarded(self, changes: list[Change]) -> None:
        """Persist changes made off a request (a timer, a watch), where nobody can be told."""
        try:
            self._apply(changes)
        except FencingError:
            pass  # _write stepped down
        except StoreUnavailable:
            raise
        except PdpsError:
            log.exception("master could not persist a transition")

    def _fail(self, exc: BaseException) -> None:
        log.error("master of job %r stops: %s", self.config.name, exc)
        if self.error is None:
            self.error = exc
        self._step_down(str(exc))

    def _step_down(self, why: str) -> None:
        if self._stopped.is_set():
            return
        log.error("master of job %r steps down: %s", self.config.name, why)
        self._stopped.set()
        self.leading.clear()
        if self._watch is not None:
            self._watch.cancel()
        if self._endpoint is not None:
            self._endpoint.close()

    def _lease_lost(self) -> None:
        self._step_down("its lease expired")


def _pending_at(snapshot: Iterable[TaskRecord], progress: Mapping[int, tuple[int, int, bool]]) -> tuple[list[int], dict[int, int]]:
    """Of the tasks pending in a checkpoint: those whose attempt had trained their last
    record by then (the rollback counts them done), and the others with the record their
    attempt had reached (kept: the task resumes after it)."""
    finished: list[int] = []
    kept: dict[int, int] = {}
    for r in snapshot:
        seen = progress.get(r.id)
        if r.state is TaskState.PENDING and seen is not None and seen[0] == r.attempt:
            if seen[2]:
                finished.append(r.id)
            else:
                kept[r.id] = seen[1]
    return finished, kept


def decode_record(kv: KeyValue, keys: Keys, pass_no: int, ids: set[int] | range | None = None) -> TaskRecord:
    """The task record stored at ``kv``, checked against its key, the job's pass and
    task ids; anything else raises :class:`CorruptRecord` naming the key."""
    try:
        rec = TaskRecord.from_json(decode_json(kv.value, kv.key))
        key_id = keys.task_id(kv.key)
    except CorruptRecord:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CorruptRecord(f"{kv.key} is not a task record: {exc!r}", kv.key) from exc
    if rec.id != key_id or (ids is not None and rec.id not in ids) or rec.pass_no > pass_no or (rec.state.value == "pending" and not rec.trainer):
        raise CorruptRecord(f"{kv.key} holds an impossible record {kv.value[:200]!r} (job at pass {pass_no})", kv.key)
    return rec


def _int_record(kv: KeyValue) -> int:
    try:
        return int(kv.value)
    except ValueError as exc:
        raise CorruptRecord(f"{kv.key} holds {kv.value[:100]!r}, not a pass number", kv.key) from exc
