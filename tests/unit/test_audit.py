"""The audit of a pass, driven directly: feed the queue's changes, compare the entries."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant, rule

from pdps.core.audit import (
    record_counts,
    Attempt,
    AuditEntry,
    AuditLog,
    CHUNK_BYTES,
    Outcome,
    QueueHeader,
    RecordCounts,
    decode_attempts,
    decode_record_counts,
    encode_record_counts,
    kept_by_checkpoint,
    roll_back_attempts,
)
from pdps.core.errors import CorruptRecord
from pdps.core.job import Keys, decode_as
from pdps.core.speculation import AttemptEnded
from pdps.core.tasks import Event, PassStarted, State, TaskChanged, TaskQueue, TaskRecord, TaskSpec
from tests.unit.test_tasks_stateful import TaskQueueMachine


def specs(n: int) -> list[TaskSpec]:
    return [TaskSpec(id=i, location=f"mem://shard-{i}", part=0, records=10 + i) for i in range(n)]


class Audited:
    """A queue and its audit log, fed the way the master feeds them; ``stored`` is what
    the master would have persisted: one entry per (pass, task), last write wins."""

    def __init__(self, n: int = 3, **kw) -> None:
        kw.setdefault("timeout", 10.0)
        self.q = TaskQueue.create(specs(n), **kw)
        self.log = AuditLog()
        self.stored: dict[tuple[int, int], tuple[Attempt, ...]] = {}
        self.last: list[AuditEntry] = []

    def feed(self, changes) -> list[AuditEntry]:
        self.last = self.log.record(changes)
        for e in self.last:
            self.stored[e.pass_no, e.task_id] = e.attempts
        return self.last

    def dispatch(self, trainer: str, now: float = 0.0):
        a, changes = self.q.dispatch(trainer, now)
        self.feed(changes)
        return a


def A(attempt, trainer, outcome, **kw) -> Attempt:  # noqa: N802 - reads like the table it builds
    return Attempt(attempt=attempt, trainer=trainer, outcome=Outcome(outcome), **kw)


# --- the events ---------------------------------------------------------------------


def test_a_dispatch_opens_a_pending_attempt_naming_its_trainer():
    au = Audited()
    a = au.dispatch("t1")
    assert au.last == [AuditEntry(0, a.task.id, (A(1, "t1", "pending"),))]


@pytest.mark.parametrize(
    "end, outcome",
    [
        (lambda q, a: q.finish(a.task.id, a.attempt), "done"),
        (lambda q, a: q.fail(a.task.id, a.attempt), "failed"),
        (lambda q, a: q.expire(now=100.0), "timeout"),
        (lambda q, a: q.trainer_lost("t1"), "trainer_lost"),
        (lambda q, a: q.give_back(a.task.id, a.attempt), "given_back"),
    ],
    ids=["finish", "fail", "timeout", "trainer_lost", "give_back"],
)
def test_the_event_that_ends_an_attempt_is_its_outcome_and_the_trainer_is_kept(end, outcome):
    au = Audited()
    a = au.dispatch("t1")
    changes = end(au.q, a)
    assert changes[0].record.trainer is None  # the record forgets the trainer; the audit does not
    assert au.feed(changes) == [AuditEntry(0, a.task.id, (A(1, "t1", outcome),))]


def test_a_failure_then_a_success_are_two_attempts_of_one_task():
    au = Audited(1)
    a = au.dispatch("t1")
    au.feed(au.q.fail(a.task.id, a.attempt))
    b = au.dispatch("t2")
    assert b.attempt == 2
    au.feed(au.q.finish(b.task.id, b.attempt))
    assert au.log.attempts(0) == (A(1, "t1", "failed"), A(2, "t2", "done"))
    assert au.stored == {(0, 0): au.log.attempts(0)}
    assert [x.trained for x in au.log.attempts(0)] == [False, True]


def test_a_given_back_task_is_tried_again_without_a_failure():
    au = Audited(2)
    a = au.dispatch("t1")
    au.feed(au.q.give_back(a.task.id, a.attempt))
    b = au.dispatch("t2")
    assert b.task.id == a.task.id  # back at the front of todo
    au.feed(au.q.finish(b.task.id, b.attempt))
    assert au.log.attempts(a.task.id) == (A(1, "t1", "given_back"), A(2, "t2", "done"))


def test_each_transition_writes_only_the_task_it_touched():
    au = Audited(3, max_in_flight=3)
    for _ in range(3):
        au.dispatch("t")
    assert [e.task_id for e in au.feed(au.q.expire(now=100.0))] == [0, 1, 2]  # one transition, three tasks
    assert [e.task_id for e in au.feed(au.q.fail(0, 1))] == []  # ignored: nothing to write
    assert au.log.record([]) == []


def test_a_late_finish_after_a_timeout_marks_the_attempt_but_counts_only_what_it_applied():
    au = Audited(1)
    a = au.dispatch("t1")
    au.feed(au.q.expire(now=100.0, applied={0: 4}))  # the fence: t1 had applied records 0..3
    b = au.dispatch("t2", now=100.0)
    assert b.offset == 4
    au.feed(au.q.finish(b.task.id, b.attempt))
    late = au.q.finish(a.task.id, a.attempt)  # t1 read the whole task, but its later steps were refused
    assert late[0].event is Event.FINISH and late[0].reason.startswith("stale")
    assert au.feed(late) == [AuditEntry(0, 0, (A(1, "t1", "timeout", late_finish=True, applied=4), A(2, "t2", "done", offset=4)))]
    assert [x.trained for x in au.log.attempts(0)] == [True, True]
    records = au.q.spec(0).records
    assert record_counts(au.log.attempts(0), records) == [[1, records]]  # every record exactly once
    assert au.feed(au.q.finish(a.task.id, a.attempt)) == []  # a repeated report changes nothing


def test_late_reports_that_train_nothing_are_not_recorded():
    au = Audited(1)
    a = au.dispatch("t1")
    au.feed(au.q.fail(a.task.id, a.attempt))
    assert au.feed(au.q.finish(a.task.id, a.attempt)) == []  # it said it failed: its finish is noise
    assert au.feed(au.q.give_back(a.task.id, a.attempt)) == []
    assert au.feed(au.q.finish(a.task.id, 7)) == []  # an attempt that never was
    assert au.log.attempts(0) == (A(1, "t1", "failed"),)


def test_a_new_pass_starts_every_log_empty_and_attempts_keep_counting():
    au = Audited(2, max_in_flight=2)
    for _ in range(2):
        a = au.dispatch("t1")
        au.feed(au.q.finish(a.task.id, a.attempt))
    au.feed(au.q.start_next_pass())
    assert au.log.pass_no == 1 and au.log.entries() == {}
    a = au.dispatch("t2")
    assert au.last == [AuditEntry(1, a.task.id, (A(2, "t2", "pending"),))]
    assert au.stored[0, a.task.id] == (A(1, "t1", "done"),)  # pass 0's entry stays as written


def test_a_late_finish_from_the_previous_pass_writes_nothing():
    au = Audited(1)
    a = au.dispatch("t1")
    au.feed(au.q.expire(now=100.0))
    b = au.dispatch("t2", now=100.0)
    au.feed(au.q.finish(b.task.id, b.attempt))
    au.feed(au.q.start_next_pass())
    assert au.feed(au.q.finish(a.task.id, a.attempt)) == []


def test_a_pass_started_in_the_same_batch_of_changes_files_the_entries_under_their_pass():
    log = AuditLog()
    rec = TaskRecord(id=0, pass_no=0, state=State.PENDING, attempt=1, trainer="t")
    out = log.record([TaskChanged(rec, Event.DISPATCH), PassStarted(1), TaskChanged(attrs.evolve(rec, pass_no=1, attempt=2), Event.DISPATCH)])
    assert [(e.pass_no, e.task_id, e.attempts) for e in out] == [(0, 0, (A(1, "t", "pending"),)), (1, 0, (A(2, "t", "pending"),))]


def test_the_offset_a_resumed_attempt_starts_at_is_kept():
    log = AuditLog()
    rec = TaskRecord(id=3, pass_no=0, state=State.PENDING, attempt=2, trainer="t", offset=40)
    [e] = log.record([TaskChanged(rec, Event.DISPATCH)])
    assert e.attempts == (A(2, "t", "pending", offset=40),)
    assert json.loads(e.encode()) == [{"attempt": 2, "trainer": "t", "outcome": "pending", "offset": 40}]


# --- restore ------------------------------------------------------------------------


def test_a_restored_log_appends_to_what_was_persisted():
    au = Audited(2)
    a = au.dispatch("t1")
    au.feed(au.q.fail(a.task.id, a.attempt))
    b = au.dispatch("t2")  # pending when the master stops
    # a new master: the queue from its records, the log from its entries
    log = AuditLog.restore(0, {tid: attempts for (p, tid), attempts in au.stored.items() if p == 0})
    assert log.entries() == au.log.entries()
    [e] = log.record(au.q.finish(b.task.id, b.attempt))
    assert e.attempts[-1] == A(b.attempt, "t2", "done")  # the trainer came from the persisted dispatch


def test_a_log_started_afresh_still_records_how_an_attempt_ended():
    au = Audited(1)
    a = au.dispatch("t1")
    log = AuditLog.restore(0, {})  # its entry was lost (quarantined)
    [e] = log.record(au.q.finish(a.task.id, a.attempt))
    assert e.attempts == (A(1, None, "done"),)


# --- rollback -----------------------------------------------------------------------


def test_roll_back_undoes_what_trained_or_was_training_after_the_kept_attempt():
    attempts = (
        A(1, "a", "failed"),
        A(2, "b", "timeout", late_finish=True),
        A(3, "c", "done"),
        A(4, "d", "pending"),
    )
    assert roll_back_attempts(attempts, after=0) == (
        A(1, "a", "failed"),  # a failure stays a failure
        A(2, "b", "rolled_back", late_finish=True),
        A(3, "c", "rolled_back"),
        A(4, "d", "rolled_back"),
    )
    assert roll_back_attempts(attempts, after=3) == attempts[:3] + (A(4, "d", "rolled_back"),)
    assert roll_back_attempts(roll_back_attempts(attempts), after=0) == roll_back_attempts(attempts)  # idempotent
    assert not any(a.trained for a in roll_back_attempts(attempts))


def test_kept_by_checkpoint():
    done = TaskRecord(id=0, pass_no=2, state=State.DONE, attempt=5)
    pending = TaskRecord(id=0, pass_no=2, state=State.PENDING, attempt=5, trainer="t", offset=30)
    todo = TaskRecord(id=0, pass_no=2, state=State.TODO, attempt=5, failures=1)
    assert kept_by_checkpoint(done, 2) == 5
    assert kept_by_checkpoint(pending, 2) == 4  # the pending attempt is dropped; a new one resumes at its offset
    assert kept_by_checkpoint(todo, 2) == 5
    assert kept_by_checkpoint(done, 3) == 0  # a checkpoint of an earlier pass keeps nothing of this one
    assert kept_by_checkpoint(None, 2) == 0


def test_the_log_rolls_back_to_a_checkpoint_of_its_queue():
    au = Audited(3, max_in_flight=3)
    a0 = au.dispatch("t")
    au.feed(au.q.finish(a0.task.id, a0.attempt))
    a1 = au.dispatch("t")
    checkpoint = {r.id: r for r in au.q.records()}  # 0 done, 1 pending, 2 todo
    au.feed(au.q.finish(a1.task.id, a1.attempt))
    a2 = au.dispatch("t")
    changed = au.log.roll_back(checkpoint.values())
    assert {e.task_id: e.attempts for e in changed} == {1: (A(1, "t", "rolled_back"),), 2: (A(1, "t", "rolled_back"),)}
    assert au.log.attempts(0) == (A(1, "t", "done"),)
    assert au.log.roll_back(checkpoint.values()) == []  # nothing left to undo
    assert a2.task.id == 2


def test_a_task_whose_attempt_had_trained_its_last_record_by_the_checkpoint_keeps_it_as_done():
    au = Audited(2, max_in_flight=2)
    a0 = au.dispatch("t")
    au.dispatch("u")
    checkpoint = au.q.records()  # both pending; t had pushed task 0's last batch, u had not
    au.feed(au.q.expire(now=100.0))  # both time out after the checkpoint
    changed = au.log.roll_back(checkpoint, finished=[a0.task.id])
    assert {e.task_id: e.attempts for e in changed} == {0: (A(1, "t", "done"),)}
    assert au.log.attempts(1) == (A(1, "u", "timeout"),)  # a failure stays a failure
    assert kept_by_checkpoint(checkpoint[0], 0, finished=True) == 1


def test_what_a_rolled_back_attempt_had_trained_by_the_checkpoint_still_counts():
    """A task pending in the checkpoint resumes after the records its attempt had
    trained by then (the checkpoint holds them): those records count once, the ones the
    attempt trained after the checkpoint do not (the rollback undid them)."""
    au = Audited(1)
    a = au.dispatch("t")
    checkpoint = au.q.records()  # pending; its progress at the checkpoint: records 0..5
    au.feed(au.q.expire(now=100.0, applied={0: 9}))  # after it, it got to 9 and timed out
    changed = au.log.roll_back(checkpoint, kept={a.task.id: 6})
    # records 6..8 were undone by the rollback; 0..5 are in the checkpoint
    assert {e.task_id: e.attempts for e in changed} == {0: (A(1, "t", "rolled_back", applied=6),)}
    au2 = Audited(1)
    b = au2.dispatch("t")
    checkpoint = au2.q.records()
    changed = au2.log.roll_back(checkpoint, kept={b.task.id: 6})
    assert {e.task_id: e.attempts for e in changed} == {0: (A(1, "t", "rolled_back", applied=6),)}
    records = au2.q.spec(0).records
    assert record_counts(au2.log.attempts(0), records) == [[1, 6], [0, records - 6]]  # the next attempt starts at 6


def test_a_rollback_to_an_earlier_pass_undoes_the_whole_current_pass():
    au = Audited(1)
    a = au.dispatch("t")
    au.feed(au.q.finish(a.task.id, a.attempt))
    checkpoint = au.q.records()  # pass 0, done
    au.feed(au.q.start_next_pass())
    b = au.dispatch("t")
    au.feed(au.q.finish(b.task.id, b.attempt))
    [e] = au.log.roll_back(checkpoint)
    assert (e.pass_no, e.attempts) == (1, (A(2, "t", "rolled_back"),))
    # the checkpoint's own pass, as the shell reads it back: nothing after the checkpoint to undo
    earlier = AuditLog.restore(0, {0: au.stored[0, 0]})
    assert earlier.roll_back(checkpoint) == [] and earlier.attempts(0) == (A(1, "t", "done"),)


# --- the stored form ----------------------------------------------------------------


def test_entries_round_trip_as_a_compact_json_list():
    e = AuditEntry(0, 1, (A(1, "t1", "timeout", late_finish=True), A(2, None, "done", offset=5)))
    raw = e.encode()
    assert json.loads(raw) == [
        {"attempt": 1, "trainer": "t1", "outcome": "timeout", "late_finish": True},
        {"attempt": 2, "trainer": None, "outcome": "done", "offset": 5},
    ]
    assert b" " not in raw
    assert decode_attempts(raw, "k") == e.attempts


def test_decoded_entries_hold_one_string_per_trainer():
    # a restored pass holds an attempt per task: one copy of its trainer's name each
    # would cost a string a task at a million tasks (bench/master_memory.py)
    raw = AuditEntry(0, 1, (A(1, "t1", "done"),)).encode()
    first, second = decode_attempts(raw, "k")[0], decode_attempts(raw, "k")[0]
    assert first.trainer == "t1" and first.trainer is second.trainer


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff",
        b"{}",
        b"[1]",
        b'[{"attempt": 1, "trainer": "t"}]',
        b'[{"attempt": 1, "trainer": "t", "outcome": "won"}]',
        b'[{"attempt": 0, "trainer": "t", "outcome": "done"}]',
        b'[{"attempt": "1", "trainer": "t", "outcome": "done"}]',
        b'[{"attempt": 1, "trainer": 7, "outcome": "done"}]',
        b'[{"attempt": 1, "trainer": "t", "outcome": "done", "offset": -1}]',
        b'[{"attempt": 1, "trainer": "t", "outcome": "done", "late_finish": "yes"}]',
    ],
)
def test_an_undecodable_entry_raises_corrupt_record_naming_its_key(raw):
    with pytest.raises(CorruptRecord) as info:
        decode_attempts(raw, "/pdps/j/audit/000000/00000001")
    assert info.value.key == "/pdps/j/audit/000000/00000001"


def test_audit_keys():
    keys = Keys("j")
    assert keys.audit_entry(3, 7) == "/pdps/j/audit/000003/00000007"
    assert keys.audit_entry(3, 7).startswith(keys.audit_pass(3)) and keys.audit_pass(3).startswith(keys.audit)
    assert keys.task_id(keys.audit_entry(3, 7)) == 7
    assert keys.quarantined_audit(3, 7) == "/pdps/j/quarantine/audit/000003/00000007"
    assert keys.quarantined_audit(3, 7).startswith(keys.quarantined_audit(3))


def test_record_counts_are_stored_as_runs():
    same = [TaskSpec(id=i, location="x", part=i, records=100) for i in range(100_000)]
    assert encode_record_counts(same) == [[0, 100_000, 100]]
    mixed = [TaskSpec(id=i, location="x", part=0, records=r) for i, r in [(0, 5), (1, 5), (2, 3), (5, 3), (6, 3)]]
    runs = encode_record_counts(reversed(mixed))
    assert runs == [[0, 2, 5], [2, 1, 3], [5, 2, 3]]
    assert decode_record_counts(json.loads(json.dumps(runs))) == {0: 5, 1: 5, 2: 3, 5: 3, 6: 3}
    for bad in ({"0": 5}, [[0, 0, 5]], [[0, 1]], [[0, 1, -1]], [[0, 1, "5"]]):
        with pytest.raises((TypeError, ValueError)):
            decode_record_counts(bad)


def varying(n: int) -> list[TaskSpec]:
    """``n`` tasks whose record counts all differ from their neighbours': one run each."""
    return [TaskSpec(id=i, location="x", part=i, records=100 + i % 7) for i in range(n)]


def stored(counts: RecordCounts, keys: Keys) -> dict[str, bytes]:
    """The chunks as a master writes them: key → value."""
    return {keys.queue_chunk(k): raw for k, raw in enumerate(counts.chunks)}


def header(counts: RecordCounts) -> QueueHeader:
    return decode_as(counts.header, "queue", QueueHeader.from_json)


def test_record_counts_are_stored_in_chunks_of_bounded_size_that_read_back():
    keys = Keys("j")
    tasks = varying(20_000)
    counts = RecordCounts.of(tasks)
    assert len(counts.chunks) > 4 and all(len(raw) <= CHUNK_BYTES for raw in counts.chunks)
    assert len(counts.header) < 200  # the same for any number of tasks
    assert json.loads(counts.header) == {"tasks": 20_000, "chunks": len(counts.chunks), "sha256": counts.sha256}
    assert header(counts).counts(stored(counts, keys), keys) == {s.id: s.records for s in tasks}
    assert RecordCounts.of(list(reversed(tasks))) == counts  # the same counts, the same bytes
    equal = RecordCounts.of([TaskSpec(id=i, location="x", part=i, records=100) for i in range(100_000)])
    assert [json.loads(raw)["runs"] for raw in equal.chunks] == [[[0, 100_000, 100]]]
    none = RecordCounts.of([])
    assert none.chunks == () and header(none).counts({}, keys) == {}


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_chunk_missing_or_changed_is_named(k):
    keys = Keys("j")
    counts = RecordCounts.of(varying(16_000))
    assert len(counts.chunks) == 4
    chunks = stored(counts, keys)
    name = keys.queue_chunk(k)
    changed = {**chunks, name: chunks[name].replace(b",101]", b",108]", 1)}
    assert changed[name] != chunks[name]
    swapped = {**chunks, name: chunks[keys.queue_chunk((k + 1) % 4)]}
    del chunks[name]
    for bad, why in ((chunks, "is missing"), (changed, "does not match the sha256"), (swapped, "does not match the sha256")):
        with pytest.raises(CorruptRecord, match=why) as info:
            header(counts).counts(bad, keys)
        assert info.value.key == name
        assert "start the job's master" in str(info.value)


def test_a_stored_header_agrees_only_with_the_same_counts():
    tasks = varying(1_000)
    counts = RecordCounts.of(tasks)
    assert counts.agrees(header(counts))
    assert not counts.agrees(header(RecordCounts.of(varying(999))))
    assert not counts.agrees(header(RecordCounts.of([*varying(999), TaskSpec(id=999, location="x", part=0, records=1)])))
    inline = {"tasks": 1_000, "records": encode_record_counts(tasks)}  # written by an older pdps
    assert decode_as(json.dumps(inline).encode(), "queue", QueueHeader.from_json).counts({}, Keys("j")) == {s.id: s.records for s in tasks}
    assert counts.agrees(QueueHeader.from_json(inline))
    assert not counts.agrees(QueueHeader.from_json({**inline, "records": [[0, 1_000, 100]]}))
    assert counts.agrees(QueueHeader.from_json({"tasks": 1_000}))  # older still: no counts to disagree
    for bad in (b'{"tasks": 3, "chunks": -1, "sha256": "%s"}' % (b"0" * 64), b'{"tasks": 3, "chunks": 1, "sha256": "ab"}', b'{"tasks": 3, "chunks": 1}'):
        with pytest.raises(CorruptRecord) as info:
            decode_as(bad, "/pdps/j/queue", QueueHeader.from_json)
        assert info.value.key == "/pdps/j/queue"


# --- under random event sequences ---------------------------------------------------


FAILURE_OUTCOMES = (Outcome.FAILED, Outcome.TIMEOUT, Outcome.TRAINER_LOST)


class AuditMachine(TaskQueueMachine):
    """The queue machine's random events, with an audit log fed every transition's
    changes and a shadow of the entries a shell persists."""

    def apply(self, changes) -> None:
        super().apply(changes)
        if not hasattr(self, "log"):  # the first transition of pass 0: every attempt was 0
            self.log = AuditLog()
            self.stored: dict[tuple[int, int], tuple[Attempt, ...]] = {}
            self.first_attempt = dict.fromkeys(self.ids, 0)
            self.racer_failures = dict.fromkeys(self.ids, 0)  # failed racers: the task was not re-queued
        for e in self.log.record(changes):
            assert e.pass_no == self.q.pass_no
            self.stored[e.pass_no, e.task_id] = e.attempts
        for c in changes:
            if isinstance(c, AttemptEnded) and c.event in (Event.FAIL, Event.TIMEOUT, Event.TRAINER_LOST):
                self.racer_failures[c.task_id] += 1
        if any(isinstance(c, PassStarted) for c in changes):
            self.first_attempt = {r.id: r.issued for r in self.q.records()}
            self.racer_failures = dict.fromkeys(self.ids, 0)

    @rule()
    def crash_and_restore(self):
        super().crash_and_restore()
        if hasattr(self, "log"):
            p = self.q.pass_no
            self.log = AuditLog.restore(p, {t: a for (q, t), a in self.stored.items() if q == p})

    @invariant()
    def the_audit_agrees_with_the_queue(self):
        if not hasattr(self, "log"):
            return
        assert self.log.pass_no == self.q.pass_no
        for rec in self.q.records():
            log = self.log.attempts(rec.id)
            assert [a.attempt for a in log] == list(range(self.first_attempt[rec.id] + 1, rec.issued + 1))
            assert sum(a.outcome in FAILURE_OUTCOMES for a in log) == rec.failures + self.racer_failures[rec.id]
            racers = self.q.racers(rec.id)
            assert [(a.attempt, a.trainer) for a in log if a.outcome is Outcome.PENDING] == sorted((r.attempt, r.trainer) for r in racers)
            own = next((a for a in log if a.attempt == rec.attempt), None)
            if rec.state is State.PENDING:
                assert own == A(rec.attempt, rec.trainer, "pending", offset=rec.offset)
            elif rec.state is State.DONE:
                assert own.outcome is Outcome.DONE and sum(a.outcome is Outcome.DONE for a in log) == 1
            elif rec.state is State.FAILED:
                assert own.outcome in FAILURE_OUTCOMES
            elif log:
                assert log[-1].outcome not in (Outcome.PENDING, Outcome.DONE)
            assert all(a.outcome in (Outcome.TIMEOUT, Outcome.TRAINER_LOST) for a in log if a.late_finish)

    @invariant()
    def what_was_persisted_restores_the_live_log(self):
        if hasattr(self, "log"):
            p = self.q.pass_no
            assert {t: a for (q, t), a in self.stored.items() if q == p} == self.log.entries()


TestAuditMachine = AuditMachine.TestCase
TestAuditMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
