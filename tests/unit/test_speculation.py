"""Speculative execution in the task queue: stragglers, backups, races won and lost."""

from __future__ import annotations

import pytest

from pdps.core.audit import AuditLog, Outcome, record_counts
from pdps.core.errors import ConfigError, InvalidTransition
from pdps.core.speculation import MAX_BACKUPS, AttemptEnded, Racer, Speculation
from pdps.core.tasks import Assignment, Event, State, TaskChanged, TaskQueue, TaskRecord, TaskSpec, WaitReason

RECORDS = 100


def queue(n: int = 12, **speculation) -> TaskQueue:
    specs = [TaskSpec(id=i, location=f"mem://s{i}", part=0, records=RECORDS) for i in range(n)]
    return TaskQueue.create(specs, timeout=1000.0, max_in_flight=1, speculation=Speculation(**speculation))


def finish_some(q: TaskQueue, k: int, seconds: float, now: float = 0.0) -> float:
    """``k`` tasks dispatched and finished by trainer f, each in ``seconds``."""
    for _ in range(k):
        a, _ = q.dispatch("f", now)
        assert isinstance(a, Assignment)
        now += seconds
        q.finish(a.task.id, a.attempt, now)
    return now


def test_records_without_speculation_persist_as_before():
    rec = TaskRecord(id=1, pass_no=0, state=State.PENDING, attempt=2, trainer="a", deadline=5.0)
    assert rec.issued == 2
    assert set(rec.to_json()) == {"id", "pass_no", "state", "attempt", "failures", "trainer", "deadline"}
    raced = TaskRecord(id=1, pass_no=0, state=State.PENDING, attempt=2, trainer="a", deadline=5.0, backup=Racer(3, "b", 9.0, 40), issued=3)
    assert TaskRecord.from_json(raced.to_json()) == raced
    assert TaskRecord.from_json(rec.to_json()) == rec


def test_no_straggler_while_speculation_is_off_or_before_min_finished():
    q = queue()  # off by default
    now = finish_some(q, 8, 1.0)
    q.dispatch("slow", now)
    assert q.straggler("idle", now + 100) is None
    q = queue(enabled=True)
    now = finish_some(q, 7, 1.0)
    q.dispatch("slow", now)
    assert q.straggler("idle", now + 100) is None  # 7 finishes: too few to tell


def test_a_task_running_past_multiplier_times_the_median_is_a_straggler_for_other_trainers():
    q = queue(enabled=True)
    now = finish_some(q, 8, 1.0)  # 0.01 s per record
    a, _ = q.dispatch("slow", now)
    assert q.straggler("idle", now + 1.5) is None  # exactly 1.5x: not yet
    rec = q.straggler("idle", now + 1.6)
    assert rec is not None and rec.id == a.task.id
    assert q.straggler("slow", now + 1.6) is None  # not a backup of its own attempt


def test_a_backup_that_finishes_first_wins_and_the_audit_counts_each_record_once():
    q, audit = queue(enabled=True), AuditLog()
    a, changes = q.dispatch("slow", 0.0)
    audit.record(changes)
    t = a.task.id
    changes = q.speculate(t, "fast", attempt=2, offset=40, now=1.0)
    audit.record(changes)
    rec = q.record(t)
    assert rec.backup == Racer(2, "fast", 1001.0, 40) and rec.issued == 2
    assert q.in_flight("fast") == {t} and q.in_flight("slow") == {t}
    assert q.dispatch("fast", 1.0) == (WaitReason.AT_CAP, [])  # a backup counts against max_in_flight
    changes = q.finish(t, 2, now=5.0)
    audit.record(changes)
    assert changes[0] == TaskChanged(q.record(t), Event.FINISH)
    assert AttemptEnded(t, 1, "slow", Event.BEATEN, 40) in changes  # the master tells "slow" to stop
    assert q.record(t).state is State.DONE and q.holders() == set()
    attempts = audit.attempts(t)
    assert [(x.attempt, x.outcome) for x in attempts] == [(1, Outcome.BEATEN), (2, Outcome.DONE)]
    assert record_counts(attempts, RECORDS) == [[1, RECORDS]]
    assert q.finish(t, 1)[0].reason  # the loser's finish is ignored


def test_a_primary_that_finishes_first_leaves_its_backup_beaten_with_nothing_trained():
    q, audit = queue(enabled=True), AuditLog()
    a, changes = q.dispatch("slow", 0.0)
    audit.record(changes)
    audit.record(q.speculate(a.task.id, "fast", 2, 40, 1.0))
    audit.record(q.finish(a.task.id, 1))
    attempts = audit.attempts(a.task.id)
    assert [(x.attempt, x.outcome, x.trained_range(RECORDS)) for x in attempts] == [(1, Outcome.DONE, (0, RECORDS)), (2, Outcome.BEATEN, (40, 40))]


def test_a_primary_that_fails_promotes_its_backup_and_the_next_attempt_is_new():
    q, audit = queue(enabled=True), AuditLog()
    a, changes = q.dispatch("slow", 0.0)
    audit.record(changes)
    t = a.task.id
    audit.record(q.speculate(t, "fast", 2, 40, 1.0))
    changes = q.trainer_lost("slow")
    audit.record(changes)
    rec = q.record(t)
    assert (rec.state, rec.attempt, rec.trainer, rec.offset, rec.backup, rec.failures) == (State.PENDING, 2, "fast", 40, None, 0)
    assert AttemptEnded(t, 1, "slow", Event.TRAINER_LOST, 40) in changes
    assert q.in_flight("slow") == set()
    assert q.redeliver("fast") == Assignment(q.spec(t), 2, 0, 1001.0, 40)
    audit.record(q.fail(t, 2, applied=70))  # alone now: a failure as ever, resuming at 70
    assert (q.record(t).state, q.record(t).offset) == (State.TODO, 70)
    assert [(x.attempt, x.outcome, x.trained_range(RECORDS)) for x in audit.attempts(t)] == [
        (1, Outcome.TRAINER_LOST, (0, 40)),
        (2, Outcome.FAILED, (40, 70)),
    ]


def test_beaten_ends_the_loser_and_a_backup_expiring_leaves_the_primary():
    q = queue(enabled=True)
    a, _ = q.dispatch("slow", 0.0)
    t = a.task.id
    q.speculate(t, "fast", 2, 40, 500.0)
    assert q.expired_racers(1200.0) == [(t, Racer(1, "slow", 1000.0, 0))]
    changes = q.expire(1200.0)
    assert q.record(t).attempt == 2 and AttemptEnded(t, 1, "slow", Event.TIMEOUT, 40) in changes
    q.speculate(t, "other", 3, 60, 1300.0)
    assert q.beaten(t, 3)[1] == AttemptEnded(t, 3, "other", Event.BEATEN, 60)
    assert q.record(t).backup is None and q.record(t).issued == 3
    assert q.beaten(t, 3)[0].reason  # no race any more: ignored


def test_a_task_is_raced_max_backups_times_per_dispatch_whichever_attempt_wins():
    """Each backup wins its race and holds the task, and is a straggler in its turn: after
    MAX_BACKUPS races the task is raced no more, until it is handed out again."""
    q = queue(enabled=True)
    now = finish_some(q, 8, 1.0)
    a, _ = q.dispatch("t0", now)
    t, holder, trainers = a.task.id, a.attempt, ("t0", "t1")
    for race in range(MAX_BACKUPS):
        now += 10.0
        other = trainers[(race + 1) % 2]
        assert q.straggler(other, now).id == t
        q.speculate(t, other, q.record(t).issued + 1, q.record(t).offset, now)
        backup = q.record(t).issued
        q.beaten(t, holder)  # the backup committed first: it holds the task alone
        holder = backup
        assert (q.record(t).attempt, q.record(t).raced) == (backup, race + 1)
    idle = next(x for x in trainers if x != q.record(t).trainer)
    assert q.straggler(idle, now + 1000.0) is None
    assert TaskRecord.from_json(q.record(t).to_json()) == q.record(t)  # a new master reads the count
    q.give_back(t, holder, 0)
    b, _ = q.dispatch("t0", now)
    assert b.task.id == t and q.record(t).raced == 0
    assert q.straggler("t1", now + 1000.0).id == t


def test_both_racers_expiring_requeue_the_task_as_one_failure():
    q = queue(enabled=True)
    a, _ = q.dispatch("slow", 0.0)
    t = a.task.id
    q.speculate(t, "fast", 2, 40, 0.0)
    changes = q.expire(2000.0, applied={t: 40})
    assert [c for c in changes if isinstance(c, TaskChanged)] == [TaskChanged(q.record(t), Event.TIMEOUT, 40)]
    assert AttemptEnded(t, 2, "fast", Event.TIMEOUT, 40) in changes
    assert (q.record(t).state, q.record(t).offset, q.record(t).failures) == (State.TODO, 40, 1)
    assert q.holders() == set()


@pytest.mark.parametrize(
    "trainer, attempt, offset, why",
    [("slow", 2, 40, "holds its attempt"), ("fast", 3, 40, "takes attempt 2"), ("fast", 2, RECORDS, "outside records"), ("busy", 2, 40, "max_in_flight")],
)
def test_a_bad_backup_is_refused_and_changes_nothing(trainer, attempt, offset, why):
    q = queue(enabled=True)
    a, _ = q.dispatch("slow", 0.0)
    q.dispatch("busy", 0.0)
    before = q.records()
    with pytest.raises(InvalidTransition, match=why):
        q.speculate(a.task.id, trainer, attempt, offset, 1.0)
    assert q.records() == before


def test_speculation_settings_are_checked():
    with pytest.raises(ConfigError, match="speculation_multiplier"):
        Speculation(multiplier=0)
    with pytest.raises(ConfigError, match="speculation_min_finished"):
        Speculation(min_finished=0)


def test_a_min_finished_the_median_never_holds_is_refused_when_the_job_is_made():
    """The master keeps the last RING finishes: a job asking for more would fail when its
    master starts (after `pdps launch` started every role); it is refused up front."""
    from pdps.core.job import JobConfig
    from pdps.core.speculation import RING

    assert JobConfig(speculation_min_finished=RING).speculation_min_finished == RING
    with pytest.raises(ConfigError, match=f"speculation_min_finished must be between 1 and {RING}"):
        JobConfig(speculation_min_finished=RING + 1)
