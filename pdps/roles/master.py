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

A task record that cannot be decoded is moved to ``quarantine/<id>`` (its task is
trained again from todo); undecodable job state (``config``, ``pass``, ``state``,
``queue``) stops the master with :class:`~pdps.core.errors.CorruptRecord` naming the key.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from pdps.core.errors import ConfigError, CorruptRecord, FencingError, LeaseExpired, PdpsError, StoreUnavailable
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.slots import SlotMap
from pdps.core.tasks import (
    Assignment,
    Change,
    Ignored,
    PassCompleted,
    PassStarted,
    TaskChanged,
    TaskQueue,
    TaskRecord,
    TaskSpec,
    WaitReason,
)
from pdps.ports.coordination import Compare, CoordinationStore, Delete, EventType, Fence, KeyValue, Op, Put, TxnOp, WatchEvent
from pdps.ports.data import DataSource
from pdps.ports.transport import Endpoint, Message, Transport

log = logging.getLogger(__name__)

#: How long a trainer told to wait should sleep before asking again.
RETRY_IN = 0.05


def publish_job(store: CoordinationStore, config: JobConfig) -> JobConfig:
    """Write the job's config, desired pserver count and slot map unless they exist.

    Returns the config in force: an existing job keeps its own, and a different one
    is refused rather than silently ignored.
    """
    keys = Keys(config.name)
    slot_map = SlotMap.initial(config.pservers, config.num_slots)
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
        diff = {k: (v, config.to_json()[k]) for k, v in existing.to_json().items() if config.to_json()[k] != v}
        raise ConfigError(f"job {config.name!r} already exists with other settings (stored, given): {diff}")
    return existing


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
    ) -> None:
        self.config = config
        self._store = store
        self._transport = transport
        self._source = source
        self._address = address
        self._clock = clock
        self._keys = Keys(config.name)
        self._lock = threading.RLock()
        self._stopped = threading.Event()
        self._queue: TaskQueue | None = None
        self._fence: Fence | None = None
        self._endpoint: Endpoint | None = None
        self._threads: list[threading.Thread] = []
        self._watch = None
        self._keeper = None
        self.done = threading.Event()
        self.leading = threading.Event()  # set while this master holds the lock and serves
        self.error: BaseException | None = None  # why it stopped, if not by stop()
        self.passes_completed = 0
        #: The records as restored from the store when this master took over (before it
        #: re-queued the tasks of departed trainers); ``None`` for a new job.
        self.restored: list[TaskRecord] | None = None

    # --- lifecycle --------------------------------------------------------------------

    def start(self, *, standby: bool = False) -> None:
        """Take the lock, restore the queue and serve.

        If another master holds the lock, raise :class:`ConfigError`, or with
        ``standby`` wait (blocking) until the lock is free and take over. A standby
        stopped while it waits returns without serving.
        """
        from pdps.roles.lease import LeaseKeeper

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
            self._queue = self._load_queue(specs)
            self._resume()
        except BaseException:
            self._keeper.stop()  # give the lock back: another master may do better
            raise
        self._endpoint = self._transport.serve(
            self._address,
            {"get_task": self._get_task, "finish_task": self._finish_task, "fail_task": self._fail_task, "give_back": self._give_back},
        )
        self._write([Put(self._keys.master_addr, self._endpoint.address.encode(), self._keeper.lease)])
        self._watch = self._store.watch(self._keys.trainers, self._on_trainer_event)
        self._reconcile()  # trainers that went while no master was watching
        t = threading.Thread(target=self._timer_loop, name="pdps-master-timer", daemon=True)
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
        if self._endpoint is not None:
            self._endpoint.close()
        for t in self._threads:
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

    def counts(self):
        with self._lock:
            assert self._queue is not None
            return self._queue.counts()

    # --- state ------------------------------------------------------------------------

    def _load_queue(self, specs: list[TaskSpec]) -> TaskQueue:
        cfg = self.config
        limits = {"failure_max": cfg.failure_max, "timeout": cfg.task_timeout, "max_in_flight": cfg.max_in_flight}
        kv = self._store.get(self._keys.pass_no)
        if kv is None:
            queue = TaskQueue.create(specs, **limits)
            self._write(
                [
                    Put(self._keys.pass_no, b"0"),
                    Put(self._keys.state, b'{"state": "running"}'),
                    Put(self._keys.queue, json.dumps({"tasks": len(specs)}).encode()),
                ]
            )
            return queue
        pass_no = _int_record(kv)
        state = self._stored_state()
        queue_kv = self._store.get(self._keys.queue)
        if queue_kv is None:
            self._write([Put(self._keys.queue, json.dumps({"tasks": len(specs)}).encode())])
        elif decode_as(queue_kv.value, queue_kv.key, _task_count) != len(specs):
            raise ConfigError(f"{self._keys.queue} says {queue_kv.value!r} but the dataset {cfg.dataset!r} now has {len(specs)} tasks")
        ids = {s.id for s in specs}
        records = []
        for rec_kv in self._store.range(self._keys.tasks):
            try:
                records.append(decode_record(rec_kv, self._keys, pass_no, ids))
            except CorruptRecord as exc:
                self._quarantine(rec_kv, exc)
        queue = TaskQueue.restore(specs, records, pass_no=pass_no, now=self._clock(), **limits)
        self.restored = queue.records()
        self.passes_completed = len(self._store.range(self._keys.passes))
        if state.get("state") == "done":
            self.done.set()
        return queue

    def _stored_state(self) -> dict:
        kv = self._store.get(self._keys.state)
        if kv is None:
            raise CorruptRecord(f"{self._keys.state} is missing although {self._keys.pass_no} exists", self._keys.state)
        state = decode_json(kv.value, kv.key)
        if not isinstance(state, dict) or state.get("state") not in ("running", "done"):
            raise CorruptRecord(f"{kv.key} holds {kv.value[:100]!r}, not a job state", kv.key)
        return state

    def _quarantine(self, kv: KeyValue, exc: CorruptRecord) -> None:
        """Move an undecodable task record aside; its task starts over from todo."""
        aside = self._keys.quarantine + kv.key.rsplit("/", 1)[1]
        note = {"key": kv.key, "error": str(exc), "value": base64.b64encode(kv.value).decode(), "mod_revision": kv.mod_revision}
        ops: list[TxnOp] = [Put(aside, json.dumps(note).encode()), Delete(kv.key)]
        self._store.commit((Compare.revision(kv.key, Op.EQ, kv.mod_revision),), ops, fence=self._fence)
        log.error("quarantined %s (moved to %s); its task will be trained again: %s", kv.key, aside, exc)

    def _resume(self) -> None:
        """A restored pass may have completed before the restart: act on it now."""
        assert self._queue is not None
        with self._lock:
            if not self.done.is_set():
                self._apply(self._queue.check_completion())

    def _write(self, ops: Sequence[TxnOp]) -> None:
        if ops:
            try:
                self._store.commit((), ops, fence=self._fence)
            except FencingError:
                self._step_down("its lock is held by another master")
                raise
            except StoreUnavailable as exc:  # the outage outlasted store_outage_deadline
                self._fail(exc)
                raise

    def _apply(self, changes: list[Change]) -> None:
        """Persist a transition, then act on its notices. Called with the lock held."""
        assert self._queue is not None
        ops: list[TxnOp] = []
        follow: list[Change] = []
        for ch in changes:
            if isinstance(ch, TaskChanged):
                ops.append(Put(self._keys.task(ch.record.id), json.dumps(ch.record.to_json()).encode()))
            elif isinstance(ch, PassStarted):
                ops.append(Put(self._keys.pass_no, str(ch.pass_no).encode()))
            elif isinstance(ch, PassCompleted):
                summary = {"pass": ch.pass_no, "done": ch.done, "failed": list(ch.failed)}
                ops.append(Put(self._keys.pass_summary(ch.pass_no), json.dumps(summary).encode()))
                follow.append(ch)
            elif isinstance(ch, Ignored):
                log.info("ignored %s for task %d attempt %d: %s", ch.event, ch.task_id, ch.attempt, ch.reason)
        self._write(ops)
        for ch in follow:
            assert isinstance(ch, PassCompleted)
            self.passes_completed = max(self.passes_completed, ch.pass_no + 1)
            if ch.failed:
                log.warning("pass %d: %d tasks failed for this pass: %s", ch.pass_no, len(ch.failed), list(ch.failed)[:20])
            log.info("pass %d complete: %d done, %d failed", ch.pass_no, ch.done, len(ch.failed))
            if self.passes_completed < self.config.passes:
                self._apply(self._queue.start_next_pass())
            else:
                self._write([Put(self._keys.state, json.dumps({"state": "done", "passes": self.passes_completed}).encode())])
                self.done.set()

    # --- handlers ---------------------------------------------------------------------

    def _check_leading(self) -> None:
        if self._stopped.is_set():
            raise FencingError(f"this master of job {self.config.name!r} has stepped down; ask the one at {self._keys.master_addr}")

    def _get_task(self, req: Message) -> Message:
        trainer = str(req.meta["trainer"])
        with self._lock:
            assert self._queue is not None
            self._check_leading()
            if self.done.is_set():
                return Message({"done": True})
            if self._store.get(self._keys.trainer(trainer)) is None:
                # Its tasks were re-queued when its key went; it must not take new ones.
                raise LeaseExpired(f"trainer {trainer!r} is not registered in job {self.config.name!r} (its lease expired?); re-register first")
            result, changes = self._queue.dispatch(trainer, self._clock())
            self._apply(changes)
            if isinstance(result, Assignment):
                return Message({"task": result.task.to_json(), "attempt": result.attempt, "pass": result.pass_no})
            if result is WaitReason.PASS_COMPLETE and self.done.is_set():
                return Message({"done": True})
            return Message({"wait": str(result), "retry_in": RETRY_IN})

    def _report(self, req: Message, event: Callable[[int, int], list[Change]]) -> Message:
        with self._lock:
            self._check_leading()
            changes = event(int(req.meta["task"]), int(req.meta["attempt"]))
            self._apply(changes)
            ignored = next((c for c in changes if isinstance(c, Ignored)), None)
            return Message({"accepted": ignored is None, "reason": ignored.reason if ignored else None})

    def _finish_task(self, req: Message) -> Message:
        assert self._queue is not None
        return self._report(req, self._queue.finish)

    def _fail_task(self, req: Message) -> Message:
        assert self._queue is not None
        log.warning("trainer %s failed task %s: %s", req.meta.get("trainer"), req.meta.get("task"), req.meta.get("error"))
        return self._report(req, self._queue.fail)

    def _give_back(self, req: Message) -> Message:
        assert self._queue is not None
        return self._report(req, self._queue.give_back)

    # --- background -------------------------------------------------------------------

    def _on_trainer_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.DELETE or self._stopped.is_set():
            return
        self._trainer_gone(self._keys.trainer_id(event.key))

    def _trainer_gone(self, trainer: str) -> None:
        with self._lock:
            assert self._queue is not None
            changes = self._queue.trainer_lost(trainer)
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
                with self._lock:
                    assert self._queue is not None
                    deadline = self._queue.next_deadline()
                    if deadline is not None and deadline <= self._clock():
                        self._guarded(self._queue.expire(self._clock()))
                if self._clock() >= next_reconcile and not self._stopped.is_set():
                    next_reconcile = self._clock() + every
                    self._reconcile()
            except StoreUnavailable as exc:  # the outage outlasted store_outage_deadline
                self._fail(exc)
            except Exception as exc:
                log.exception("master timer failed")
                self._fail(exc)

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


def _task_count(d: dict) -> int:
    return int(d["tasks"])


def _int_record(kv: KeyValue) -> int:
    try:
        return int(kv.value)
    except ValueError as exc:
        raise CorruptRecord(f"{kv.key} holds {kv.value[:100]!r}, not a pass number", kv.key) from exc
