"""The master's task queue: everything that changes a task's state lives in this file.

Rules, in a few lines:

* A task is in exactly one of four states: todo, pending, done, failed.
* ``dispatch`` moves the head of todo to pending for one trainer and increments the
  task's *attempt*. Every later report names that attempt; a report for another
  attempt, or for a task no longer pending, changes nothing (it is returned as
  :class:`Ignored`). The attempt never resets, not even across passes, so it fences
  reports from earlier passes too.
* A timeout, a failure report, or the loss of the owning trainer (its lease expired)
  sends the task back to todo with ``failures + 1``; once ``failures`` exceeds
  ``failure_max`` the task is failed for this pass. A graceful give-back returns it
  to todo without counting a failure.
* Each of those events may say how far the ended attempt had trained (``applied``,
  from its fenced progress record, :mod:`pdps.core.progress`): the next attempt
  resumes there, so no record is trained twice; an attempt that had trained every
  record leaves the task done.
* A pass is complete when todo and pending are both empty, however many tasks failed.
  The next pass puts every task, failed ones included, back into todo with zero
  failures.
* A trainer holds at most ``max_in_flight`` pending tasks, backups included.
* Speculation (:mod:`pdps.core.speculation`): a pending task may hold one backup
  attempt beside its own; the first finish of either makes it done and the other
  beaten, a failure of one leaves it pending with the other.

An *open-ended* queue (a streaming dataset, :meth:`TaskQueue.open_ended`) starts
empty: :meth:`TaskQueue.add_tasks` appends tasks with the next ids as data arrives
(:class:`TasksAdded`), its one pass is complete only after :meth:`TaskQueue.end_stream`,
and :meth:`TaskQueue.forget` drops finished tasks from memory (a report for one
is ignored as done), so memory holds the unfinished tasks, not the stream.

The queue does no I/O and reads no clock: ``now`` is an argument. Every transition
returns the list of *changes* it made, one :class:`TaskChanged` per touched task
(and :class:`PassStarted` for a new pass, which rewrites no task: a record whose
``pass_no`` is older than the queue's pass *is* todo), so the shell persists each
transition with O(1) writes.
"""

from __future__ import annotations

import enum
import sys
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Union

import attrs

from pdps.core.errors import ConfigError, InvalidTransition, UnknownTaskError
from pdps.core.machine import move
from pdps.core.speculation import MAX_BACKUPS, AttemptEnded, Racer, Speculation


class State(str, enum.Enum):
    TODO = "todo"
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"

    def __str__(self) -> str:
        return self.value


class Event(str, enum.Enum):
    DISPATCH = "dispatch"
    FINISH = "finish"
    FAIL = "fail"  # the trainer reported that it could not train the task
    TIMEOUT = "timeout"
    TRAINER_LOST = "trainer_lost"  # the owning trainer's lease expired
    GIVE_BACK = "give_back"  # graceful shutdown: not a failure
    NEW_PASS = "new_pass"
    SPECULATE = "speculate"  # a backup attempt races the pending one
    BEATEN = "beaten"  # the other racer committed first: this attempt is over

    def __str__(self) -> str:
        return self.value


_FAILURES = frozenset({Event.FAIL, Event.TIMEOUT, Event.TRAINER_LOST})

#: The legal transitions. A failure event leads to TODO, or to FAILED once the
#: failure count exceeds ``failure_max``; the queue picks which. An event that ends one
#: of two racing attempts leaves the task PENDING with the other.
TRANSITIONS: Mapping[tuple[State, Event], frozenset[State]] = {
    (State.TODO, Event.DISPATCH): frozenset({State.PENDING}),
    (State.PENDING, Event.FINISH): frozenset({State.DONE}),
    # ... or DONE when the ended attempt had applied every record of the task
    (State.PENDING, Event.FAIL): frozenset({State.TODO, State.FAILED, State.DONE, State.PENDING}),
    (State.PENDING, Event.TIMEOUT): frozenset({State.TODO, State.FAILED, State.DONE, State.PENDING}),
    (State.PENDING, Event.TRAINER_LOST): frozenset({State.TODO, State.FAILED, State.DONE, State.PENDING}),
    (State.PENDING, Event.GIVE_BACK): frozenset({State.TODO, State.DONE, State.PENDING}),
    (State.PENDING, Event.SPECULATE): frozenset({State.PENDING}),
    (State.PENDING, Event.BEATEN): frozenset({State.PENDING}),
    (State.DONE, Event.NEW_PASS): frozenset({State.TODO}),
    (State.FAILED, Event.NEW_PASS): frozenset({State.TODO}),
}


@attrs.frozen
class TaskSpec:
    """What a task is: one readable part of the dataset (e.g. a Parquet row group)."""

    id: int
    location: str  # a shard URL or path the data source understands
    part: int  # index inside the shard (row group, ...)
    records: int  # number of records, for progress and sample accounting

    def to_json(self) -> dict:
        return {"id": self.id, "location": self.location, "part": self.part, "records": self.records}  # attrs.asdict, spelled out: it is on every dispatch

    @classmethod
    def from_json(cls, d: Mapping) -> TaskSpec:
        return cls(id=int(d["id"]), location=str(d["location"]), part=int(d["part"]), records=int(d["records"]))


@attrs.frozen
class TaskRecord:
    """Where one task stands. This is what the shell persists, one key per task."""

    id: int
    pass_no: int
    state: State
    attempt: int = 0
    failures: int = 0
    trainer: str | None = None
    deadline: float | None = None
    offset: int = 0  # records already trained into the parameters (a checkpoint restore resumes here)
    #: a backup attempt racing this one (pending only)
    backup: Racer | None = None
    #: the highest attempt number ever handed out for the task (a beaten backup's, too):
    #: the next attempt is ``issued + 1``
    issued: int = attrs.field(default=attrs.Factory(lambda rec: rec.attempt, takes_self=True))
    #: backups started since the task was last dispatched (pending only): a task is raced
    #: :data:`MAX_BACKUPS` times at most per dispatch, whichever attempt wins each race
    raced: int = 0

    def to_json(self) -> dict:
        # attrs.asdict's dict, spelled out (it is on every transition), with the state's value
        d = {
            "id": self.id,
            "pass_no": self.pass_no,
            "state": self.state.value,
            "attempt": self.attempt,
            "failures": self.failures,
            "trainer": self.trainer,
            "deadline": self.deadline,
        }
        if self.offset:
            d["offset"] = self.offset  # records written before offsets existed read the same
        if self.backup is not None:  # and those written before speculation
            d["backup"] = self.backup.to_json()
        if self.issued != self.attempt:
            d["issued"] = self.issued
        if self.raced:
            d["raced"] = self.raced
        return d

    @classmethod
    def from_json(cls, d: Mapping) -> TaskRecord:
        return cls(
            id=int(d["id"]),
            pass_no=int(d["pass_no"]),
            state=State(d["state"]),
            attempt=int(d["attempt"]),
            failures=int(d["failures"]),
            trainer=d.get("trainer"),
            deadline=None if d.get("deadline") is None else float(d["deadline"]),
            offset=int(d.get("offset", 0)),
            backup=None if d.get("backup") is None else Racer.from_json(d["backup"]),
            issued=int(d.get("issued", d["attempt"])),
            raced=int(d.get("raced", 0)),
        )


# --- what a transition returns ------------------------------------------------------


@attrs.frozen
class TaskChanged:
    """Persist this record (the task's key)."""

    record: TaskRecord
    event: Event
    #: how far the attempt this event ended had trained (records ``[0, applied)`` of the
    #: task are in the parameters); None where the event ends no attempt or nobody knows
    applied: int | None = None


@attrs.frozen
class PassStarted:
    """Persist the pass number. Records of older passes now read as todo."""

    pass_no: int


@attrs.frozen
class PassCompleted:
    """Todo and pending are empty: the pass is over. A notice; nothing to persist."""

    pass_no: int
    done: int
    failed: tuple[int, ...]


@attrs.frozen
class TasksAdded:
    """New tasks of an open-ended queue, todo at the end of the queue: persist their
    specs (a streaming source cannot make them again)."""

    specs: tuple[TaskSpec, ...]
    next_id: int  # the id the next task added will get


@attrs.frozen
class Ignored:
    """A report that changed nothing (stale attempt, task no longer pending)."""

    task_id: int
    attempt: int
    event: Event
    reason: str


Change = Union[TaskChanged, PassStarted, PassCompleted, TasksAdded, Ignored, AttemptEnded]


@attrs.frozen
class Assignment:
    """A task handed to a trainer, with the attempt its reports must carry."""

    task: TaskSpec
    attempt: int
    pass_no: int
    deadline: float
    offset: int = 0  # start reading the task at this record


class WaitReason(str, enum.Enum):
    AT_CAP = "at_cap"  # the trainer already holds max_in_flight tasks
    DRAINED = "drained"  # todo is empty but tasks are pending elsewhere: ask again later
    PASS_COMPLETE = "pass_complete"  # todo and pending are empty

    def __str__(self) -> str:
        return self.value


@attrs.frozen
class Counts:
    pass_no: int
    todo: int
    pending: int
    done: int
    failed: int


@attrs.define
class TaskQueue:
    """The todo / pending / done / failed queues of one job.

    Build it with :meth:`create` for a new job or :meth:`restore` from persisted
    records; drive it with the event methods, each of which returns its changes.
    """

    failure_max: int
    timeout: float
    max_in_flight: int
    _specs: dict[int, TaskSpec]
    _records: dict[int, TaskRecord]
    _pass_no: int
    #: todo in dispatch order: a task leaves it only from the head (a todo task's one
    #: event is its dispatch), so a deque serves, at 8 bytes a task where an ordered
    #: dict took about 100 and kept its table at full size as the pass drained it
    _todo: deque[int] = attrs.field(factory=deque)
    _pending: dict[int, None] = attrs.field(factory=dict)
    _by_trainer: dict[str, set[int]] = attrs.field(factory=dict)
    _completion_announced: bool = False
    speculation: Speculation = attrs.field(factory=Speculation)
    #: open-ended (streaming) queues only: the id the next added task gets, whether the
    #: stream has ended (completion may be announced), and the finished tasks forgotten
    _open_ended: bool = False
    _next_id: int = 0
    _stream_ended: bool = False
    _forgotten: Counts | None = None

    # --- construction -----------------------------------------------------------------

    @classmethod
    def create(
        cls,
        specs: Sequence[TaskSpec],
        *,
        failure_max: int = 3,
        timeout: float = 60.0,
        max_in_flight: int = 1,
        speculation: Speculation | None = None,
    ) -> TaskQueue:
        """A new job at pass 0 with every task in todo (in the order given)."""
        return cls.restore(specs, (), pass_no=0, failure_max=failure_max, timeout=timeout, max_in_flight=max_in_flight, speculation=speculation)

    @classmethod
    def open_ended(
        cls, *, failure_max: int = 3, timeout: float = 60.0, max_in_flight: int = 1, speculation: Speculation | None = None
    ) -> TaskQueue:
        """A new streaming job's queue: empty, at pass 0, filled by :meth:`add_tasks`."""
        return cls.restore(
            (), (), pass_no=0, failure_max=failure_max, timeout=timeout, max_in_flight=max_in_flight, next_id=0, speculation=speculation
        )

    @classmethod
    def restore(
        cls,
        specs: Sequence[TaskSpec],
        records: Iterable[TaskRecord],
        *,
        pass_no: int,
        failure_max: int = 3,
        timeout: float = 60.0,
        max_in_flight: int = 1,
        now: float | None = None,
        next_id: int | None = None,
        stream_ended: bool = False,
        forgotten: tuple[int, int] = (0, 0),
        speculation: Speculation | None = None,
    ) -> TaskQueue:
        """Rebuild a queue from persisted records; a task without a record, or with a
        record from an older pass, is todo.

        Pending tasks keep their deadlines unless ``now`` is given: then each gets a
        full ``timeout`` from ``now``. A restarted master passes it, because a deadline
        read from the store was set on another process's clock.

        ``next_id`` makes the queue open-ended: ``specs`` are its tasks still in memory
        (those of ids below ``next_id`` not among them are finished and forgotten), and
        ``stream_ended`` says whether tasks may still be added; ``forgotten`` is how many
        of the forgotten ones are (done, failed), for the counts.
        """
        _check_config(failure_max, timeout, max_in_flight)
        if not specs and next_id is None:
            raise ConfigError("the dataset produced no tasks; a job needs at least one")
        by_id: dict[int, TaskSpec] = {}
        for s in specs:
            if s.id in by_id:
                raise ConfigError(f"duplicate task id {s.id}")
            by_id[s.id] = s
        q = cls(
            failure_max=failure_max,
            timeout=timeout,
            max_in_flight=max_in_flight,
            specs=by_id,
            records={},
            pass_no=pass_no,
            speculation=speculation or Speculation(),
        )
        if next_id is not None:
            beyond = [s.id for s in specs if not 0 <= s.id < next_id]
            if beyond:
                raise ConfigError(f"task ids {beyond[:10]} are not below the stream's next id {next_id}")
            q._open_ended, q._next_id, q._stream_ended = True, next_id, stream_ended
            q._forgotten = Counts(pass_no, 0, 0, *forgotten)
        seen = {r.id: r for r in records}
        unknown = set(seen) - set(by_id)
        if unknown:
            raise ConfigError(f"persisted records for task ids the dataset does not have: {sorted(unknown)[:10]}")
        for tid in by_id:
            rec = seen.get(tid)
            if rec is None:
                rec = TaskRecord(id=tid, pass_no=pass_no, state=State.TODO)
            elif rec.pass_no < pass_no:
                rec = TaskRecord(id=tid, pass_no=pass_no, state=State.TODO, attempt=rec.attempt, issued=rec.issued)
            elif rec.pass_no > pass_no:
                raise ConfigError(f"task {tid} has a record for pass {rec.pass_no}, beyond the job's pass {pass_no}")
            elif rec.state is State.PENDING and now is not None:
                backup = None if rec.backup is None else attrs.evolve(rec.backup, deadline=now + timeout)
                rec = attrs.evolve(rec, deadline=now + timeout, backup=backup)
            q._index(rec)
        q._completion_announced = False
        return q

    # --- reading ----------------------------------------------------------------------

    @property
    def pass_no(self) -> int:
        return self._pass_no

    @property
    def pass_complete(self) -> bool:
        return not self._todo and not self._pending and (self._stream_ended or not self._open_ended)

    @property
    def open(self) -> bool:
        """An open-ended queue whose stream has not ended: tasks may still be added."""
        return self._open_ended and not self._stream_ended

    @property
    def next_id(self) -> int:
        """The id the next added task gets (the number of tasks a queue made so far)."""
        return self._next_id if self._open_ended else len(self._specs)

    def unfinished(self) -> int:
        """Tasks todo or pending."""
        return len(self._todo) + len(self._pending)

    def record(self, task_id: int) -> TaskRecord:
        try:
            return self._records[task_id]
        except KeyError:
            if self.forgotten(task_id):
                raise UnknownTaskError(f"task {task_id} is finished and no longer in memory") from None
            raise UnknownTaskError(f"no task {task_id} in this job") from None

    def forgotten(self, task_id: int) -> bool:
        """A task of an open-ended queue that finished and was dropped from memory."""
        return self._open_ended and 0 <= task_id < self._next_id and task_id not in self._records

    def spec(self, task_id: int) -> TaskSpec:
        try:
            return self._specs[task_id]
        except KeyError:
            raise UnknownTaskError(f"no task {task_id} in this job") from None

    def records(self) -> list[TaskRecord]:
        return list(self._records.values())

    def specs(self) -> list[TaskSpec]:
        return list(self._specs.values())

    def ids_in(self, state: State) -> set[int]:
        return {tid for tid, r in self._records.items() if r.state is state}

    def in_flight(self, trainer: str) -> set[int]:
        return set(self._by_trainer.get(trainer, ()))

    def holders(self) -> set[str]:
        """The trainers that hold pending tasks."""
        return set(self._by_trainer)

    def counts(self) -> Counts:
        """The queue's counts; an open-ended queue's done and failed include the tasks it forgot."""
        done = failed = 0
        for r in self._records.values():
            done += r.state is State.DONE
            failed += r.state is State.FAILED
        if self._forgotten is not None:
            done, failed = done + self._forgotten.done, failed + self._forgotten.failed
        return Counts(self._pass_no, len(self._todo), len(self._pending), done, failed)

    def next_deadline(self) -> float | None:
        """The earliest deadline among pending tasks, for the shell's timer."""
        deadlines = [r.deadline for t in self._pending for r in self.racers(t)]
        return min((d for d in deadlines if d is not None), default=None)

    # --- events -----------------------------------------------------------------------

    def add_tasks(self, cuts: Sequence[tuple[str, int, int]]) -> list[Change]:
        """Append tasks ``(location, part, records)`` to an open-ended queue's todo, with
        the next ids in order. Refused once the stream has ended or on a batch queue."""
        if not self._open_ended:
            raise InvalidTransition("queue", "batch", "add_tasks", "only a streaming job's queue takes new tasks")
        if self._stream_ended:
            raise InvalidTransition("queue", "ended", "add_tasks", "the stream has ended: no task may be added")
        added = []
        for location, part, records in cuts:
            if records < 1:
                raise ConfigError(f"a task needs at least one record, got {records} for {location} part {part}")
            spec = TaskSpec(id=self._next_id, location=location, part=part, records=records)
            self._next_id += 1
            self._specs[spec.id] = spec
            self._index(TaskRecord(id=spec.id, pass_no=self._pass_no, state=State.TODO))
            added.append(spec)
        if not added:
            return []
        self._completion_announced = False
        return [TasksAdded(tuple(added), self._next_id)]

    def end_stream(self) -> list[Change]:
        """No more tasks will be added: the pass completes once todo and pending drain."""
        if self._open_ended:
            self._stream_ended = True
        return self._completion()

    def forget(self, task_ids: Iterable[int]) -> None:
        """Drop finished tasks of an open-ended queue from memory (their records are in
        the store); a later report for one is ignored as done. Unfinished ones stay."""
        if self._forgotten is None:
            return
        done = failed = 0
        for tid in task_ids:
            rec = self._records.get(tid)
            if rec is None or rec.state not in (State.DONE, State.FAILED):
                continue
            del self._records[tid]
            del self._specs[tid]
            done += rec.state is State.DONE
            failed += rec.state is State.FAILED
        f = self._forgotten
        self._forgotten = attrs.evolve(f, done=f.done + done, failed=f.failed + failed)

    def dispatch(self, trainer: str, now: float) -> tuple[Assignment | WaitReason, list[Change]]:
        """Hand the head of todo to ``trainer``, or say why it must wait."""
        if not trainer:
            raise ConfigError("a trainer id must be a non-empty string")
        if len(self._by_trainer.get(trainer, ())) >= self.max_in_flight:
            return WaitReason.AT_CAP, []
        if not self._todo:
            return (WaitReason.DRAINED if self._pending or self.open else WaitReason.PASS_COMPLETE), []
        tid = self._todo[0]
        rec = self._records[tid]
        # one string per trainer, not one per dispatch: the audit keeps the name of every attempt
        trainer = sys.intern(trainer)
        new = self._move(
            rec, Event.DISPATCH, State.PENDING, attempt=rec.issued + 1, issued=rec.issued + 1, trainer=trainer, deadline=now + self.timeout,
            raced=0,
        )
        assignment = Assignment(
            task=self._specs[tid], attempt=new.attempt, pass_no=self._pass_no, deadline=now + self.timeout, offset=rec.offset
        )
        return assignment, [TaskChanged(new, Event.DISPATCH)]

    def redeliver(self, trainer: str, holding: Iterable[int] = ()) -> Assignment | None:
        """The oldest task ``trainer`` holds but does not know it holds, as it was handed
        out, or None.

        A trainer says which tasks it holds when it asks for work. One it does not name
        was dispatched by an answer it never received (the reply was lost, or the master
        died after persisting the dispatch): it gets the same attempt again instead of
        waiting for the task to time out. Changes nothing.
        """
        held = self._by_trainer.get(trainer, set()) - set(holding)
        if not held:
            return None
        tid, mine = min(((t, self._held_by(t, trainer)) for t in held), key=lambda h: h[1].attempt)
        return Assignment(self._specs[tid], mine.attempt, self._pass_no, mine.deadline, mine.offset)

    def finish(self, task_id: int, attempt: int, now: float | None = None) -> list[Change]:
        """The trainer of ``attempt`` trained the task. ``now``: when, for the median
        speculation compares attempts with. The first finish of a raced task makes it
        done and returns the other attempt :class:`AttemptEnded` (BEATEN)."""
        if self._racing(task_id, attempt):
            return self._race_won(task_id, attempt)
        rec, ignored = self._current(task_id, attempt, Event.FINISH)
        if ignored:
            return [ignored]
        if now is not None and rec.deadline is not None:
            self.speculation.finished(now - (rec.deadline - self.timeout), self._specs[task_id].records - rec.offset)
        new = self._move(rec, Event.FINISH, State.DONE, trainer=None, deadline=None, offset=0)
        return [TaskChanged(new, Event.FINISH), *self._completion()]

    def fail(self, task_id: int, attempt: int, applied: int | None = None) -> list[Change]:
        """The trainer of ``attempt`` could not train the task (counts as a failure).
        ``applied``: how far the attempt had trained (the next one resumes there). One of
        two racing attempts leaves the task to the other (``applied`` unused)."""
        if self._racing(task_id, attempt):
            return self._racer_ends(task_id, attempt, Event.FAIL)
        rec, ignored = self._current(task_id, attempt, Event.FAIL)
        if ignored:
            return [ignored]
        return [self._failure(rec, Event.FAIL, applied), *self._completion()]

    def give_back(self, task_id: int, attempt: int, applied: int | None = None) -> list[Change]:
        """Graceful shutdown: the task goes back to the front of todo, not counted as a
        failure, resuming at ``applied`` (or done, if that was every record). One of two
        racing attempts leaves the task to the other (``applied`` unused)."""
        if self._racing(task_id, attempt):
            return self._racer_ends(task_id, attempt, Event.GIVE_BACK)
        rec, ignored = self._current(task_id, attempt, Event.GIVE_BACK)
        if ignored:
            return [ignored]
        offset = rec.offset if applied is None else applied
        if offset >= self._specs[task_id].records > 0:
            return [self._finished_by(rec, Event.GIVE_BACK, offset), *self._completion()]
        new = self._move(rec, Event.GIVE_BACK, State.TODO, trainer=None, deadline=None, offset=offset)
        self._todo.rotate(1)  # _move appended the task: to the front of todo instead
        return [TaskChanged(new, Event.GIVE_BACK, applied)]

    def expired(self, now: float) -> list[TaskRecord]:
        """The pending tasks whose deadline has passed (what :meth:`expire` would end), so
        the shell can fence their attempts first. Changes nothing."""
        return [self._records[t] for t in self._pending if (self._records[t].deadline or 0.0) <= now]

    def expire(self, now: float, applied: Mapping[int, int] | None = None) -> list[Change]:
        """Send every pending task whose deadline has passed back to todo (a failure),
        each resuming at ``applied[task]`` where given. Of two racing attempts, one
        whose deadline passed leaves the task to the other."""
        applied = applied or {}
        changes = self._racers_expire(now, applied)
        changes += [self._failure(rec, Event.TIMEOUT, applied.get(rec.id)) for rec in self.expired(now)]
        return changes + self._completion() if changes else changes

    def trainer_lost(self, trainer: str, applied: Mapping[int, int] | None = None) -> list[Change]:
        """The trainer's lease expired: re-queue its pending tasks at once (a failure
        each), each resuming at ``applied[task]`` where given."""
        applied = applied or {}
        tids = sorted(self._by_trainer.get(trainer, ()))
        changes: list[Change] = []
        for t in tids:
            if self._records[t].backup is not None:  # one of two racers: the other goes on
                changes += self._racer_ends(t, self._held_by(t, trainer).attempt, Event.TRAINER_LOST)
            else:
                changes.append(self._failure(self._records[t], Event.TRAINER_LOST, applied.get(t)))
        return changes + self._completion() if changes else changes

    def check_completion(self) -> list[Change]:
        """``PassCompleted`` if the pass is complete and not yet announced.

        For a queue just restored from records: its pass may have completed before the
        restart, and no later event would announce it.
        """
        return self._completion()

    def start_next_pass(self) -> list[Change]:
        """Begin the next pass: every task back to todo with zero failures.

        Raises :class:`InvalidTransition` while tasks are still todo or pending.
        """
        if not self.pass_complete:
            busy = next(iter(self._todo or self._pending))
            raise InvalidTransition(
                f"task {busy}", self._records[busy].state, Event.NEW_PASS, f"pass {self._pass_no} is not complete"
            )
        self._pass_no += 1
        for rec in list(self._records.values()):
            _check(rec, Event.NEW_PASS, State.TODO)
            self._drop(rec)
            self._index(TaskRecord(id=rec.id, pass_no=self._pass_no, state=State.TODO, attempt=rec.attempt, issued=rec.issued))
        self._completion_announced = False
        return [PassStarted(self._pass_no)]

    # --- internals --------------------------------------------------------------------

    def _current(self, task_id: int, attempt: int, event: Event) -> tuple[TaskRecord, Ignored | None]:
        if self.forgotten(task_id):
            gone = TaskRecord(id=task_id, pass_no=self._pass_no, state=State.DONE)
            return gone, Ignored(task_id, attempt, event, "task is finished (no longer in memory)")
        rec = self.record(task_id)
        if attempt != rec.attempt:
            return rec, Ignored(task_id, attempt, event, f"stale attempt {attempt}; current is {rec.attempt}")
        if rec.state is not State.PENDING:
            return rec, Ignored(task_id, attempt, event, f"task is {rec.state}, no longer pending")
        return rec, None

    def _failure(self, rec: TaskRecord, event: Event, applied: int | None = None) -> TaskChanged:
        offset = rec.offset if applied is None else applied
        if offset >= self._specs[rec.id].records > 0:
            return self._finished_by(rec, event, offset)  # nothing is left to train
        failures = rec.failures + 1
        target = State.FAILED if failures > self.failure_max else State.TODO
        new = self._move(rec, event, target, failures=failures, trainer=None, deadline=None, offset=offset)
        return TaskChanged(new, event, applied)

    def _finished_by(self, rec: TaskRecord, event: Event, applied: int) -> TaskChanged:
        """``event`` ended an attempt that had applied every record: the task is done."""
        new = self._move(rec, event, State.DONE, trainer=None, deadline=None, offset=0)
        return TaskChanged(new, event, applied)

    def _completion(self) -> list[Change]:
        if self.pass_complete and not self._completion_announced:
            self._completion_announced = True
            c = self.counts()
            return [PassCompleted(self._pass_no, c.done, tuple(sorted(self.ids_in(State.FAILED))))]
        return []

    def _move(self, rec: TaskRecord, event: Event, target: State, **fields: object) -> TaskRecord:
        _check(rec, event, target)
        new = attrs.evolve(rec, state=target, **fields)
        self._drop(rec)
        self._index(new)
        return new

    def _drop(self, rec: TaskRecord) -> None:
        if rec.state is State.TODO:
            self._todo.remove(rec.id)  # the head (see _todo): found at the first look
        self._pending.pop(rec.id, None)
        for trainer in (rec.trainer, None if rec.backup is None else rec.backup.trainer):
            held = None if trainer is None else self._by_trainer.get(trainer)
            if held is not None:
                held.discard(rec.id)
                if not held:
                    del self._by_trainer[trainer]  # type: ignore[arg-type]

    def _index(self, rec: TaskRecord) -> None:
        self._records[rec.id] = rec
        if rec.state is State.TODO:
            self._todo.append(rec.id)
        elif rec.state is State.PENDING:
            self._pending[rec.id] = None
            if rec.trainer is None:
                raise InvalidTransition(f"task {rec.id}", rec.state, "restore", "a pending record must name its trainer")
            self._by_trainer.setdefault(rec.trainer, set()).add(rec.id)
            if rec.backup is not None:
                self._by_trainer.setdefault(rec.backup.trainer, set()).add(rec.id)


    # --- speculation (pdps.core.speculation) ------------------------------------------

    def racers(self, task_id: int) -> tuple[Racer, ...]:
        """The attempts a pending task's trainers hold, its own first, then its backup's."""
        rec = self.record(task_id)
        if rec.state is not State.PENDING or rec.trainer is None:
            return ()
        own = Racer(rec.attempt, rec.trainer, rec.deadline or 0.0, rec.offset)
        return (own,) if rec.backup is None else (own, rec.backup)

    def expired_racers(self, now: float) -> list[tuple[int, Racer]]:
        """(task, attempt) of every pending attempt, backups included, whose deadline has
        passed: what :meth:`expire` ends, for the shell to fence first. Changes nothing."""
        return [(t, r) for t in self._pending for r in self.racers(t) if r.deadline <= now]

    def straggler(self, trainer: str, now: float) -> TaskRecord | None:
        """The pending task a backup attempt by ``trainer`` should race, or None: the one
        furthest past its expected time (:meth:`Speculation.overdue`), among those with no
        backup that ``trainer`` does not hold and whose attempt has beaten fewer than
        :data:`MAX_BACKUPS` backups since it was dispatched, while ``trainer`` has room.
        Changes nothing."""
        if not self.speculation.enabled or len(self._by_trainer.get(trainer, ())) >= self.max_in_flight:
            return None
        best: tuple[float, int] | None = None
        for t in self._pending:
            rec = self._records[t]
            # a primary mid-step often commits the range a fresh backup starts at, and wins; a
            # backup that wins holds the task and may be raced in turn: MAX_BACKUPS races per
            # dispatch at most, whoever wins them (a task that is only long is not raced forever)
            if rec.backup is not None or rec.raced >= MAX_BACKUPS or rec.trainer == trainer or rec.deadline is None:
                continue
            late = self.speculation.overdue(now - (rec.deadline - self.timeout), self._specs[t].records - rec.offset)
            if late is not None and (best is None or (late, -t) > (best[0], -best[1])):
                best = (late, t)
        return None if best is None else self._records[best[1]]

    def speculate(self, task_id: int, trainer: str, attempt: int, offset: int, now: float) -> list[Change]:
        """Start backup attempt ``attempt`` (the task's ``issued + 1``) of a pending task
        for ``trainer``, reading from record ``offset`` (where the progress record stood
        when the master opened the race). The trainer is answered as for a dispatch:
        ``Assignment(spec, attempt, pass_no, deadline, offset)`` from the changed record's
        ``backup``. Raises :class:`InvalidTransition` (nothing changed) for a task that
        is not pending, races already, is held by ``trainer``, or for a ``trainer`` at
        its cap, an attempt that is not the next one, or an offset outside the task."""
        rec = self.record(task_id)

        def refuse(why: str) -> InvalidTransition:
            return InvalidTransition(f"task {task_id}", rec.state, Event.SPECULATE, why)

        if not trainer:
            raise ConfigError("a trainer id must be a non-empty string")
        if rec.state is not State.PENDING:
            raise refuse("only a pending task can race")
        if rec.backup is not None:
            raise refuse(f"attempt {rec.backup.attempt} races it already (one backup at a time)")
        if rec.trainer == trainer:
            raise refuse(f"trainer {trainer!r} holds its attempt {rec.attempt}")
        if len(self._by_trainer.get(trainer, ())) >= self.max_in_flight:
            raise refuse(f"trainer {trainer!r} holds {self.max_in_flight} tasks already (max_in_flight)")
        if attempt != rec.issued + 1:
            raise refuse(f"a backup takes attempt {rec.issued + 1}, not {attempt}")
        if not rec.offset <= offset < self._specs[task_id].records:
            raise refuse(f"offset {offset} is outside records [{rec.offset}, {self._specs[task_id].records}) of the running attempt")
        backup = Racer(attempt, sys.intern(trainer), now + self.timeout, offset)
        new = self._move(rec, Event.SPECULATE, State.PENDING, backup=backup, issued=attempt, raced=rec.raced + 1)
        return [TaskChanged(new, Event.SPECULATE)]

    def beaten(self, task_id: int, attempt: int) -> list[Change]:
        """The task's progress record shows that racing attempt ``attempt`` lost: the
        other committed first. It is over; the other holds the task alone. The shell
        calls it when a fence's read of the progress record finds it so, before ending
        the other attempt (:meth:`TaskProgress.allows`)."""
        if not self._racing(task_id, attempt):
            return [Ignored(task_id, attempt, Event.BEATEN, f"attempt {attempt} is not one of two racing for the task")]
        return self._racer_ends(task_id, attempt, Event.BEATEN)

    def _racing(self, task_id: int, attempt: int) -> bool:
        rec = self._records.get(task_id)
        if rec is None:
            return False  # finished and forgotten, or unknown: _current says which
        return rec.backup is not None and attempt in (rec.attempt, rec.backup.attempt)

    def _held_by(self, task_id: int, trainer: str) -> Racer:
        return next(r for r in self.racers(task_id) if r.trainer == trainer)

    def _racer_ends(self, task_id: int, attempt: int, event: Event) -> list[Change]:
        """One of two racers ends: the other holds the task alone (a backup left alone
        becomes the task's attempt). The ended one trained nothing from the race on."""
        rec = self._records[task_id]
        own, backup = self.racers(task_id)
        ended, other = (backup, own) if attempt == backup.attempt else (own, backup)
        new = self._move(
            rec, event, State.PENDING, attempt=other.attempt, trainer=other.trainer, deadline=other.deadline, offset=other.offset, backup=None
        )
        return [TaskChanged(new, event), AttemptEnded(task_id, ended.attempt, ended.trainer, event, backup.offset)]

    def _race_won(self, task_id: int, attempt: int) -> list[Change]:
        rec = self._records[task_id]
        own, backup = self.racers(task_id)
        loser = own if attempt == backup.attempt else backup
        new = self._move(rec, Event.FINISH, State.DONE, attempt=attempt, trainer=None, deadline=None, offset=0, backup=None)
        won = TaskChanged(new, Event.FINISH)
        return [won, AttemptEnded(task_id, loser.attempt, loser.trainer, Event.BEATEN, backup.offset), *self._completion()]

    def _racers_expire(self, now: float, applied: Mapping[int, int]) -> list[Change]:
        """The raced tasks one of whose attempts expired: that one leaves the task to
        the other; where both expired, the backup leaves and the task's own attempt
        fails as any expired attempt does."""
        changes: list[Change] = []
        for t in [t for t in self._pending if self._records[t].backup is not None]:
            late = [r for r in self.racers(t) if r.deadline <= now]
            if len(late) == 1:
                changes += self._racer_ends(t, late[0].attempt, Event.TIMEOUT)
            elif late:
                rec = self._records[t]
                b = rec.backup
                assert b is not None
                alone = self._move(rec, Event.TIMEOUT, State.PENDING, backup=None)
                changes += [self._failure(alone, Event.TIMEOUT, applied.get(t)), AttemptEnded(t, b.attempt, b.trainer, Event.TIMEOUT, b.offset)]
        return changes

def _check(rec: TaskRecord, event: Event, target: State) -> None:
    move(TRANSITIONS, f"task {rec.id}", rec.state, event, target)


def _check_config(failure_max: int, timeout: float, max_in_flight: int) -> None:
    if failure_max < 0:
        raise ConfigError(f"failure_max must be >= 0, got {failure_max}")
    if not timeout > 0:
        raise ConfigError(f"task timeout must be > 0 seconds, got {timeout}")
    if max_in_flight < 1:
        raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}")


def rolled_back(
    snapshot: Iterable[TaskRecord],
    current: Iterable[TaskRecord],
    progress: Mapping[int, tuple[int, int, bool]],
    *,
    pass_no: int,
) -> list[TaskRecord]:
    """The task records of a queue rolled back to a checkpoint.

    ``snapshot`` is the queue as the checkpoint saved it (at pass ``pass_no``),
    ``current`` the records now (only their attempts matter: an attempt never goes
    back, so reports of attempts made after the checkpoint stay fenced), and
    ``progress`` maps a task to ``(attempt, records trained, last)`` as the round
    the checkpoint followed recorded it. A task done or failed at the checkpoint stays
    so; a pending one goes back to todo, resuming at the records its attempt had
    trained (or done, if that was all of them); everything else is todo as saved.
    """
    attempts = {r.id: r.issued for r in current}
    out = []
    for rec in snapshot:
        attempt = max(rec.attempt, attempts.get(rec.id, 0))
        issued = max(rec.issued, attempt)
        if rec.pass_no < pass_no:
            out.append(TaskRecord(id=rec.id, pass_no=pass_no, state=State.TODO, attempt=attempt, issued=issued))
            continue
        if rec.state in (State.DONE, State.FAILED):
            out.append(attrs.evolve(rec, attempt=attempt, issued=issued, trainer=None, deadline=None, backup=None))
            continue
        offset = rec.offset
        if rec.state is State.PENDING:
            seen = progress.get(rec.id)
            if seen is not None and seen[0] in (rec.attempt, None if rec.backup is None else rec.backup.attempt):
                if seen[2]:
                    out.append(attrs.evolve(rec, state=State.DONE, attempt=attempt, issued=issued, trainer=None, deadline=None, offset=0, backup=None))
                    continue
                offset = seen[1]
        out.append(attrs.evolve(rec, state=State.TODO, attempt=attempt, issued=issued, trainer=None, deadline=None, offset=offset, backup=None))
    return out


def rolled_back_stream(
    snapshot: Iterable[TaskRecord],
    current: Iterable[TaskRecord],
    progress: Mapping[int, tuple[int, int, bool]],
    *,
    first: int,
    snapshot_next: int,
    next_id: int,
) -> list[TaskRecord]:
    """The records of a streaming job's tasks ``first..next_id-1`` rolled back to a
    checkpoint that saved ``snapshot`` (its unfinished windows' tasks) when the job had
    ``snapshot_next`` tasks.

    Tasks in the snapshot roll back as :func:`rolled_back` says; tasks added after the
    checkpoint are todo from their first record. ``current`` holds the records now
    (their attempts: an attempt never goes back). A task below ``snapshot_next`` that
    the snapshot lacks had finished by then (its window had closed): it stays done.
    """
    now = {r.id: r for r in current}
    out = {r.id: r for r in rolled_back([r for r in snapshot if r.id >= first], now.values(), progress, pass_no=0)}
    for tid in range(first, next_id):
        if tid in out:
            continue
        attempt = now[tid].attempt if tid in now else 0
        state = State.TODO if tid >= snapshot_next else State.DONE
        out[tid] = TaskRecord(id=tid, pass_no=0, state=state, attempt=attempt)
    return [out[tid] for tid in range(first, next_id)]
