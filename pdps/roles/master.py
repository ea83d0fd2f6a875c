"""The master: owns the task queue of one job and serves it to trainers.

The imperative shell around :class:`pdps.core.tasks.TaskQueue`: it reads the clock,
persists each transition's changes (one key per touched task, guarded by its fenced
lock), watches trainer membership and re-queues the tasks of a trainer whose lease
expired, and starts the next pass or ends the job when a pass completes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence

from pdps.core.errors import ConfigError, FencingError, LeaseExpired, PdpsError
from pdps.core.job import JobConfig, Keys
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
    WaitReason,
)
from pdps.ports.coordination import Compare, CoordinationStore, EventType, Fence, Put, WatchEvent
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
    existing = JobConfig.decode(store.get(keys.config).value)  # type: ignore[union-attr]
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
        self.passes_completed = 0

    # --- lifecycle --------------------------------------------------------------------

    def start(self) -> None:
        from pdps.roles.lease import LeaseKeeper

        specs = self._source.tasks()  # a bad dataset fails here, before any task is created
        publish_job(self._store, self.config)
        self._keeper = LeaseKeeper(self._store, self.config.lease_ttl, name="master", on_lost=self._lease_lost)
        owner = f"master-{uuid.uuid4().hex[:8]}".encode()
        self._fence = self._store.acquire_lock(self._keys.master_lock, self._keeper.lease, owner)
        if self._fence is None:
            self._keeper.stop()
            raise ConfigError(f"job {self.config.name!r} already has a master (lock {self._keys.master_lock} is held)")
        self._queue = self._load_queue(specs)
        self._resume()
        self._endpoint = self._transport.serve(
            self._address,
            {"get_task": self._get_task, "finish_task": self._finish_task, "fail_task": self._fail_task, "give_back": self._give_back},
        )
        self._write([Put(self._keys.master_addr, self._endpoint.address.encode(), self._keeper.lease)])
        self._watch = self._store.watch(self._keys.trainers, self._on_trainer_event)
        t = threading.Thread(target=self._timer_loop, name="pdps-master-timer", daemon=True)
        t.start()
        self._threads.append(t)
        c = self._queue.counts()
        log.info("master of job %r serving at %s: pass %d, %d todo, %d done", self.config.name, self._endpoint.address, c.pass_no, c.todo, c.done)

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.cancel()
        if self._endpoint is not None:
            self._endpoint.close()
        for t in self._threads:
            t.join()
        if self._keeper is not None:
            self._keeper.stop()

    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint.address

    def counts(self):
        with self._lock:
            assert self._queue is not None
            return self._queue.counts()

    # --- state ------------------------------------------------------------------------

    def _load_queue(self, specs) -> TaskQueue:
        cfg = self.config
        kv = self._store.get(self._keys.pass_no)
        if kv is None:
            queue = TaskQueue.create(specs, failure_max=cfg.failure_max, timeout=cfg.task_timeout, max_in_flight=cfg.max_in_flight)
            self._write([Put(self._keys.pass_no, b"0"), Put(self._keys.state, b'{"state": "running"}')])
            return queue
        records = [TaskRecord.from_json(json.loads(kv.value)) for kv in self._store.range(self._keys.tasks)]
        queue = TaskQueue.restore(
            specs, records, pass_no=int(kv.value), failure_max=cfg.failure_max, timeout=cfg.task_timeout, max_in_flight=cfg.max_in_flight
        )
        self.passes_completed = len(self._store.range(self._keys.passes))
        return queue

    def _resume(self) -> None:
        """A restored pass may have completed before the restart: act on it now."""
        assert self._queue is not None
        with self._lock:
            self._apply(self._queue.check_completion())

    def _write(self, ops: Sequence[Put]) -> None:
        if ops:
            self._store.commit((), ops, fence=self._fence)

    def _apply(self, changes: list[Change]) -> None:
        """Persist a transition, then act on its notices. Called with the lock held."""
        assert self._queue is not None
        ops: list[Put] = []
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

    def _get_task(self, req: Message) -> Message:
        trainer = str(req.meta["trainer"])
        with self._lock:
            assert self._queue is not None
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
        trainer = self._keys.trainer_id(event.key)
        with self._lock:
            assert self._queue is not None
            changes = self._queue.trainer_lost(trainer)
            if changes:
                log.warning("trainer %s is gone; re-queued its tasks %s", trainer, [c.record.id for c in changes if isinstance(c, TaskChanged)])
            self._guarded(changes)

    def _timer_loop(self) -> None:
        while not self._stopped.wait(0.05):
            with self._lock:
                assert self._queue is not None
                deadline = self._queue.next_deadline()
                if deadline is not None and deadline <= self._clock():
                    self._guarded(self._queue.expire(self._clock()))

    def _guarded(self, changes: list[Change]) -> None:
        try:
            self._apply(changes)
        except FencingError:
            log.error("master of job %r lost its lock; stepping down", self.config.name)
            self._stopped.set()
        except PdpsError:
            log.exception("master could not persist a transition")

    def _lease_lost(self) -> None:
        log.error("master of job %r lost its lease; stepping down", self.config.name)
        self._stopped.set()
        if self._endpoint is not None:
            self._endpoint.close()
