"""The audit of a pass: every attempt at every task, which trainer made it and how it ended.

Rules, in a few lines:

* One log per (pass, task): the task's attempts in that pass, in dispatch order.
* A dispatch opens an attempt (outcome ``pending``, the trainer the record names).
  The event that ends it sets its outcome: finish → ``done``, a failure report →
  ``failed``, ``timeout``, ``trainer_lost``, give-back → ``given_back``. The trainer
  comes from the attempt as opened: a finished or failed record no longer names it.
* An attempt records the records it trained: ``[offset, applied)``, where ``applied``
  is what its ending event says (the attempt's fenced progress record,
  :mod:`pdps.core.progress`), or the task's end for a ``done`` attempt. The master
  fences an attempt before it re-queues the task, so nothing of it is applied later
  and the next attempt starts at its ``applied``: per-record counts
  (:func:`record_counts`) are exact.
* A finish report for an attempt the master had already ended by ``timeout`` or
  ``trainer_lost`` (the queue ignores it) sets ``late_finish`` on that attempt. It
  trained nothing beyond its ``applied``: the fence refused its later steps.
* A checkpoint rollback undoes what was trained or being trained since the
  checkpoint: those attempts (done, pending, or finished late) become ``rolled_back``
  (:meth:`AuditLog.roll_back`, :func:`roll_back_attempts`).
* A new pass starts every log empty; the logs of earlier passes stay as persisted.
* Speculation: a backup attempt is an attempt of its task like any other (opened by
  ``speculate``, from the record it starts at). Of two racers, the one that lost gets
  ``beaten``, and an attempt that ended while the other goes on gets its outcome, each
  with what it trained: up to the record the backup started at (the race's first
  commit fenced the loser), so the counts stay exact.

The log is derived only from the changes :class:`~pdps.core.tasks.TaskQueue` returns,
so it never disagrees with the queue when the shell persists both in one
transaction; each transition touches one task's log (O(1) in the size of the queue).
"""

from __future__ import annotations

import enum
import hashlib
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import CorruptRecord
from pdps.core.job import Keys, decode_as, decode_json
from pdps.core.progress import count_records
from pdps.core.speculation import AttemptEnded
from pdps.core.tasks import Change, Event, Ignored, PassStarted, State, TaskChanged, TaskRecord, TaskSpec


class Outcome(str, enum.Enum):
    PENDING = "pending"  # in flight
    DONE = "done"
    FAILED = "failed"  # the trainer reported that it could not train the task
    TIMEOUT = "timeout"
    TRAINER_LOST = "trainer_lost"
    GIVEN_BACK = "given_back"
    ROLLED_BACK = "rolled_back"  # a checkpoint rollback undid it
    BEATEN = "beaten"  # a racing attempt committed its records first

    def __str__(self) -> str:
        return self.value


#: The outcome each ending event gives the attempt it ends.
ENDED_BY: Mapping[Event, Outcome] = {
    Event.FINISH: Outcome.DONE,
    Event.FAIL: Outcome.FAILED,
    Event.TIMEOUT: Outcome.TIMEOUT,
    Event.TRAINER_LOST: Outcome.TRAINER_LOST,
    Event.GIVE_BACK: Outcome.GIVEN_BACK,
    Event.BEATEN: Outcome.BEATEN,
}

#: Outcomes after which a late finish report still means the records were trained.
_LATE_FINISH_AFTER = frozenset({Outcome.TIMEOUT, Outcome.TRAINER_LOST})


@attrs.frozen
class Attempt:
    """One attempt at a task: who made it and how it ended."""

    attempt: int
    trainer: str | None  # None only when the dispatch was never audited (a log started afresh)
    outcome: Outcome
    offset: int = 0  # the record the attempt started reading at (a resumed task)
    late_finish: bool = False
    #: the attempt trained records [offset, applied) (None: pending, or done to the end)
    applied: int | None = None

    def trained_range(self, records: int) -> tuple[int, int]:
        """The records ``[start, end)`` of a task of ``records`` records whose gradients
        this attempt put into the parameters (empty while it is pending: its progress is
        in its progress record until it ends)."""
        if self.outcome is Outcome.PENDING or (self.outcome is Outcome.ROLLED_BACK and self.applied is None):
            return (self.offset, self.offset)
        if self.applied is not None:
            return (self.offset, max(self.offset, self.applied))
        return (self.offset, records if self.outcome is Outcome.DONE else self.offset)

    @property
    def trained(self) -> bool:
        """It put records into the parameters and no rollback undid them."""
        if self.outcome is Outcome.PENDING:
            return False
        if self.applied is not None:
            return self.applied > self.offset
        return self.outcome is Outcome.DONE

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"attempt": self.attempt, "trainer": self.trainer, "outcome": self.outcome.value}
        if self.offset:
            d["offset"] = self.offset
        if self.applied is not None:
            d["applied"] = self.applied
        if self.late_finish:
            d["late_finish"] = True
        return d

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> Attempt:
        attempt, trainer, offset, late = d["attempt"], d["trainer"], d.get("offset", 0), d.get("late_finish", False)
        applied = d.get("applied")
        if type(attempt) is not int or attempt < 1 or type(offset) is not int or offset < 0:
            raise ValueError(f"attempt must be an integer >= 1 and offset >= 0, got {attempt!r}, {offset!r}")
        if not (applied is None or (type(applied) is int and applied >= 0)):
            raise ValueError(f"applied must be a whole number >= 0, got {applied!r}")
        if not (trainer is None or isinstance(trainer, str)) or not isinstance(late, bool):
            raise ValueError(f"trainer must be a string or null and late_finish a boolean, got {trainer!r}, {late!r}")
        # one string per trainer, not one per attempt: a restored pass holds an attempt per task
        trainer = None if trainer is None else sys.intern(trainer)
        return cls(attempt=attempt, trainer=trainer, outcome=Outcome(d["outcome"]), offset=offset, late_finish=late, applied=applied)


@attrs.frozen
class AuditEntry:
    """Persist this: the attempts of one task in one pass (its audit key)."""

    pass_no: int
    task_id: int
    attempts: tuple[Attempt, ...]

    def encode(self) -> bytes:
        """The stored value: a compact JSON list of attempts."""
        return encode_attempts(self.attempts)


_COMPACT = json.JSONEncoder(separators=(",", ":"))  # one encoder: json.dumps with options builds one per call


def encode_attempts(attempts: Iterable[Attempt]) -> bytes:
    return _COMPACT.encode([a.to_json() for a in attempts]).encode()


def decode_attempts(raw: bytes, key: str) -> tuple[Attempt, ...]:
    """The attempts stored at ``key``; anything else raises :class:`CorruptRecord` naming it."""
    value = decode_json(raw, key)
    try:
        if not isinstance(value, list):
            raise TypeError(f"expected a JSON list of attempts, got {type(value).__name__}")
        attempts = tuple(Attempt.from_json(d) for d in value)
    except (KeyError, TypeError, ValueError) as exc:
        raise CorruptRecord(f"{key} is not an audit entry ({exc!r}): {raw[:200]!r}", key) from exc
    return attempts


def roll_back_attempts(attempts: Sequence[Attempt], after: int = 0) -> tuple[Attempt, ...]:
    """``attempts`` with every attempt numbered above ``after`` that trained or was
    training (done, pending, or finished late) marked ``rolled_back``.

    Pure, for the log of any pass: the current one through :meth:`AuditLog.roll_back`,
    earlier ones as read from the store.
    """
    return tuple(
        attrs.evolve(a, outcome=Outcome.ROLLED_BACK, applied=None)
        if a.attempt > after and (a.trained or a.outcome is Outcome.PENDING or a.late_finish) and a.outcome is not Outcome.ROLLED_BACK
        else a
        for a in attempts
    )


def kept_by_checkpoint(record: TaskRecord | None, pass_no: int, *, finished: bool = False) -> int:
    """The last attempt of ``pass_no`` whose training a checkpoint holding ``record``
    for the task keeps: ``after`` for :func:`roll_back_attempts`.

    A task done, failed or todo in the checkpoint keeps the attempts it had made. A
    task pending in it loses the pending attempt (its trainer is told to drop it; the
    task resumes at the records that attempt had trained, under a new attempt), unless
    ``finished``: that attempt had trained the task's last record by the checkpoint. A
    record of an earlier pass, or none, keeps nothing of ``pass_no``.
    """
    if record is None or record.pass_no != pass_no:
        return 0
    if record.state is State.PENDING and not finished:
        return record.attempt - 1
    return record.attempt


@attrs.define
class AuditLog:
    """The attempt logs of the current pass, kept in step with the task queue.

    Build it empty for a new job, or with :meth:`restore` from the persisted
    entries of the current pass; feed it every transition's changes with
    :meth:`record`, which returns the entries to persist.
    """

    pass_no: int = 0
    #: a tuple per task, replaced on each change: a task has an attempt or two, and a
    #: list would take 40 bytes a task more (its over-allocated item array)
    _logs: dict[int, tuple[Attempt, ...]] = attrs.field(factory=dict)

    @classmethod
    def restore(cls, pass_no: int, entries: Mapping[int, Sequence[Attempt]]) -> AuditLog:
        """The log of ``pass_no`` as persisted: ``entries`` maps task id → attempts."""
        return cls(pass_no=pass_no, logs={tid: tuple(attempts) for tid, attempts in entries.items() if attempts})

    def attempts(self, task_id: int) -> tuple[Attempt, ...]:
        return self._logs.get(task_id, ())

    def entries(self) -> dict[int, tuple[Attempt, ...]]:
        return dict(self._logs)

    def forget(self, task_ids: Iterable[int]) -> None:
        """Drop finished tasks' logs from memory (a streaming job's closed window: its
        entries are persisted and final)."""
        for tid in task_ids:
            self._logs.pop(tid, None)

    def record(self, changes: Iterable[Change]) -> list[AuditEntry]:
        """Follow one transition; return the entries it changed (at most one per task)."""
        out: dict[tuple[int, int], AuditEntry] = {}
        for ch in changes:
            if isinstance(ch, TaskChanged):
                self._follow(ch.record, ch.event, ch.applied)
                out[self.pass_no, ch.record.id] = self._entry(ch.record.id)
            elif isinstance(ch, AttemptEnded):
                self._end(ch.task_id, ch.attempt, ENDED_BY[ch.event], ch.applied)
                out[self.pass_no, ch.task_id] = self._entry(ch.task_id)
            elif isinstance(ch, Ignored):
                if ch.event is Event.FINISH and self._late_finish(ch.task_id, ch.attempt):
                    out[self.pass_no, ch.task_id] = self._entry(ch.task_id)
            elif isinstance(ch, PassStarted):
                self.pass_no = ch.pass_no
                self._logs.clear()
        return list(out.values())

    def roll_back(
        self, records: Iterable[TaskRecord], *, finished: Iterable[int] = (), kept: Mapping[int, int] | None = None
    ) -> list[AuditEntry]:
        """The queue was rolled back to a checkpoint holding ``records`` (the task
        records as the checkpoint saved them): every attempt of this pass the
        checkpoint does not keep (:func:`kept_by_checkpoint`) and that trained or was
        training becomes ``rolled_back``. ``finished`` names the tasks pending in the
        checkpoint whose attempt had trained their last record by then (the rollback
        counts them done): that attempt is kept, and marked ``done`` if it was not.
        ``kept`` maps the other tasks pending in the checkpoint to the record their
        attempt had trained up to by then: that attempt is ``rolled_back`` with those
        records still counted (``applied``), since the checkpoint holds them and the task
        resumes after them. Returns the entries that changed, to persist.

        A checkpoint of an earlier pass keeps nothing of this one. The shell then also
        rolls back the persisted entries of the passes in between (:func:`roll_back_attempts`
        with ``after=0``), and continues with ``AuditLog.restore(checkpoint's pass,
        its entries)`` rolled back the same way by this method.
        """
        by_id = {r.id: r for r in records}
        done = set(finished)
        changed = []
        for tid, log in self._logs.items():
            rec = by_id.get(tid)
            keep = kept_by_checkpoint(rec, self.pass_no, finished=tid in done)
            new = roll_back_attempts(log, keep)
            if tid in done and rec is not None and rec.state is State.PENDING and keep:
                i = _find(new, keep)
                if i is not None and new[i].outcome is not Outcome.DONE:
                    new = _replaced(new, i, outcome=Outcome.DONE)
            elif kept and tid in kept and rec is not None and rec.state is State.PENDING and rec.pass_no == self.pass_no:
                i = _find(new, rec.attempt)
                if i is not None and new[i].outcome is Outcome.ROLLED_BACK:
                    new = _replaced(new, i, applied=kept[tid])
            if new != log:
                self._logs[tid] = new
                changed.append(self._entry(tid))
        return changed

    # --- internals --------------------------------------------------------------------

    def _follow(self, rec: TaskRecord, event: Event, applied: int | None = None) -> None:
        log = self._logs.get(rec.id, ())
        if event is Event.DISPATCH:
            self._logs[rec.id] = (*log, Attempt(attempt=rec.attempt, trainer=rec.trainer, outcome=Outcome.PENDING, offset=rec.offset))
            return
        if event is Event.SPECULATE and rec.backup is not None:
            b = rec.backup
            self._logs[rec.id] = (*log, Attempt(attempt=b.attempt, trainer=b.trainer, outcome=Outcome.PENDING, offset=b.offset))
            return
        outcome = ENDED_BY.get(event)
        if outcome is None or rec.state is State.PENDING:
            # NEW_PASS is not a TaskChanged event; a task still pending after an ending
            # event goes on with the other racer: the AttemptEnded beside it names the one that ended
            return
        self._end(rec.id, rec.attempt, outcome, applied)

    def _end(self, task_id: int, attempt: int, outcome: Outcome, applied: int | None) -> None:
        log = self._logs.get(task_id, ())
        i = _find(log, attempt)
        if i is None:  # its dispatch was not audited (a log started afresh): keep what is known
            self._logs[task_id] = (*log, Attempt(attempt=attempt, trainer=None, outcome=outcome, applied=applied))
        else:
            self._logs[task_id] = _replaced(log, i, outcome=outcome, applied=applied)

    def _late_finish(self, task_id: int, attempt: int) -> bool:
        log = self._logs.get(task_id, ())
        i = _find(log, attempt)
        if i is None or log[i].late_finish or log[i].outcome not in _LATE_FINISH_AFTER:
            return False
        self._logs[task_id] = _replaced(log, i, late_finish=True)
        return True

    def _entry(self, task_id: int) -> AuditEntry:
        return AuditEntry(self.pass_no, task_id, self._logs.get(task_id, ()))


def _replaced(log: tuple[Attempt, ...], i: int, **fields: Any) -> tuple[Attempt, ...]:
    """``log`` with its attempt at ``i`` changed by ``fields``."""
    return (*log[:i], attrs.evolve(log[i], **fields), *log[i + 1 :])


def _find(log: Sequence[Attempt], attempt: int) -> int | None:
    """The index of the newest entry for ``attempt`` (the end of the list, nearly always)."""
    for i in range(len(log) - 1, -1, -1):
        if log[i].attempt == attempt:
            return i
    return None


# --- record counts ------------------------------------------------------------------


def record_counts(attempts: Iterable[Attempt], records: int) -> list[list[int]]:
    """How many times each record of a task was trained in a pass, from its attempts,
    as runs ``[count, length]`` in record order (``[[1, records]]``: exactly once)."""
    return count_records([a.trained_range(records) for a in attempts], records)


def encode_record_counts(specs: Iterable[TaskSpec]) -> list[list[int]]:
    """Each task's record count, as runs ``[first_id, tasks, records]`` over the task
    ids in order: one run for a dataset of equal parts with ids 0..n-1."""
    runs: list[list[int]] = []
    for s in sorted(specs, key=lambda s: s.id):
        last = runs[-1] if runs else None
        if last is not None and last[0] + last[1] == s.id and last[2] == s.records:
            last[1] += 1
        else:
            runs.append([s.id, 1, s.records])
    return runs


def decode_record_counts(runs: Any) -> dict[int, int]:
    """Task id → records, from :func:`encode_record_counts`'s runs (ValueError/TypeError if they are not)."""
    out: dict[int, int] = {}
    if not isinstance(runs, list):
        raise TypeError(f"expected a list of [first_id, tasks, records] runs, got {type(runs).__name__}")
    for run in runs:
        first, n, records = run
        if not all(type(v) is int for v in run) or n < 1 or records < 0:
            raise ValueError(f"not a [first_id, tasks, records] run: {run!r}")
        for tid in range(first, first + n):
            out[tid] = records
    return out


# --- the dataset's record counts, as the job stores them --------------------------------

#: The most bytes in one chunk of record counts (``queue/records/<k>``): however many
#: tasks, no value or transaction of them comes near a store's request limit (etcd
#: refuses requests over 1.5 MiB by default).
CHUNK_BYTES = 64 * 1024
#: The ``prev`` of the first chunk, and the header's ``sha256`` when there is none.
_NO_CHUNK = hashlib.sha256(b"").hexdigest()


def _digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()


def _chunk(prev: str, runs: Sequence[str]) -> bytes:
    return ('{"prev":"' + prev + '","runs":[' + ",".join(runs) + "]}").encode()


@attrs.frozen
class RecordCounts:
    """Each task's record count as the job stores them: ``chunks``, the runs of
    :func:`encode_record_counts` in values of at most :data:`CHUNK_BYTES`,
    ``{"prev": sha256, "runs": [[first_id, tasks, records], ...]}`` at
    ``queue/records/<k>``, and :attr:`header`, the ``queue`` record,
    ``{"tasks": N, "chunks": K, "sha256": ...}``.

    The header holds the sha256 of the last chunk and each chunk that of the one before
    it: a reader who trusts the header checks every chunk and names the one missing or
    changed, and no value grows with the number of tasks."""

    tasks: int
    chunks: tuple[bytes, ...]

    @classmethod
    def of(cls, specs: Sequence[TaskSpec]) -> RecordCounts:
        room = CHUNK_BYTES - len(_chunk(_NO_CHUNK, ()))
        batches: list[list[str]] = []
        used = room
        for run in encode_record_counts(specs):
            text = "[%d,%d,%d]" % tuple(run)
            if used + len(text) + 1 > room:  # + 1: the comma
                batches.append([])
                used = 0
            batches[-1].append(text)
            used += len(text) + 1
        chunks: list[bytes] = []
        for batch in batches:
            chunks.append(_chunk(_digest(chunks[-1]) if chunks else _NO_CHUNK, batch))
        return cls(len(specs), tuple(chunks))

    @property
    def sha256(self) -> str:
        return _digest(self.chunks[-1]) if self.chunks else _NO_CHUNK

    @property
    def header(self) -> bytes:
        return json.dumps({"tasks": self.tasks, "chunks": len(self.chunks), "sha256": self.sha256}).encode()

    def agrees(self, header: QueueHeader) -> bool:
        """Whether a stored header holds these counts (one that holds none agrees)."""
        if header.sha256 is not None:
            return (header.chunks, header.sha256) == (len(self.chunks), self.sha256)
        if header.runs is None:
            return True
        return header.runs == {tid: n for raw in self.chunks for tid, n in decode_record_counts(json.loads(raw)["runs"]).items()}


@attrs.frozen
class QueueHeader:
    """What a stored ``queue`` record says: the number of tasks and where their record
    counts are: in ``chunks`` the last of which has the digest ``sha256`` (this pdps),
    inline as ``runs`` (task id → records: an older pdps), or nowhere (older still)."""

    tasks: int
    chunks: int | None = None
    sha256: str | None = None
    runs: dict[int, int] | None = None

    @classmethod
    def from_json(cls, d: Any) -> QueueHeader:
        """The header in ``d``; KeyError, TypeError or ValueError if it is not one
        (:func:`~pdps.core.job.decode_as` makes them a CorruptRecord naming the key)."""
        tasks = int(d["tasks"])
        if "chunks" not in d:
            return cls(tasks, runs=None if d.get("records") is None else decode_record_counts(d["records"]))
        chunks, sha = d["chunks"], d["sha256"]
        if type(chunks) is not int or chunks < 0 or not isinstance(sha, str) or len(sha) != 64:
            raise ValueError(f"not a number of chunks and a sha256: {chunks!r}, {sha!r}")
        return cls(tasks, chunks, sha)

    def counts(self, stored: Mapping[str, bytes], keys: Keys) -> dict[int, int] | None:
        """Task id → records (``None``: the record holds none), reading the chunks from
        ``stored`` (key → value). A chunk that is missing, or does not match the digest
        the header or the next chunk holds for it, raises CorruptRecord naming it."""
        if self.chunks is None:
            return self.runs
        out: dict[int, int] = {}
        expect, holder = self.sha256, keys.queue
        for k in reversed(range(self.chunks)):
            key = keys.queue_chunk(k)
            raw = stored.get(key)
            if raw is None or _digest(raw) != expect:
                why = "is missing" if raw is None else f"does not match the sha256 {holder} holds for it"
                raise CorruptRecord(
                    f"{key} {why}, so the record counts of job {keys.job!r} are incomplete; start the job's "
                    f"master: it rewrites them from the dataset when the dataset still agrees with {keys.queue}",
                    key,
                )
            expect, runs = decode_as(raw, key, lambda d: (str(d["prev"]), decode_record_counts(d["runs"])))
            out.update(runs)
            holder = key
        return out
