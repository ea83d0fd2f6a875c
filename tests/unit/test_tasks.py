"""The task queue, driven directly: feed events, compare the returned changes."""

from __future__ import annotations

import itertools
import json

import pytest

from pdps.core import tasks
from pdps.core.errors import ConfigError, InvalidTransition, UnknownTaskError
from pdps.core.tasks import (
    TRANSITIONS,
    Assignment,
    Counts,
    Event,
    Ignored,
    PassCompleted,
    PassStarted,
    State,
    TaskChanged,
    TaskQueue,
    TaskRecord,
    TaskSpec,
    WaitReason,
)


def specs(n: int) -> list[TaskSpec]:
    return [TaskSpec(id=i, location=f"mem://shard-{i // 4}", part=i % 4, records=10 + i) for i in range(n)]


def queue(n: int = 3, **kw) -> TaskQueue:
    kw.setdefault("timeout", 10.0)
    return TaskQueue.create(specs(n), **kw)


class Shadow:
    """What a shell persists: one record per task key plus the pass number, written
    only from the changes a transition returns."""

    def __init__(self) -> None:
        self.records: dict[int, TaskRecord] = {}
        self.pass_no = 0

    def apply(self, changes) -> None:
        for c in changes:
            if isinstance(c, TaskChanged):
                self.records[c.record.id] = c.record
            elif isinstance(c, PassStarted):
                self.pass_no = c.pass_no

    def restore(self, q: TaskQueue) -> TaskQueue:
        return TaskQueue.restore(
            q.specs(),
            list(self.records.values()),
            pass_no=self.pass_no,
            failure_max=q.failure_max,
            timeout=q.timeout,
            max_in_flight=q.max_in_flight,
        )


def sets(q: TaskQueue) -> dict[State, set[int]]:
    return {s: q.ids_in(s) for s in State}


def dispatched(q: TaskQueue, trainer: str, now: float) -> Assignment:
    a, changes = q.dispatch(trainer, now)
    assert isinstance(a, Assignment), a
    assert len(changes) == 1
    return a


# --- dispatch -----------------------------------------------------------------------


def test_dispatch_moves_head_to_pending_increments_attempt_and_sets_deadline():
    q = queue(3, timeout=7.5)
    a, changes = q.dispatch("t1", now=100.0)
    assert a == Assignment(task=specs(3)[0], attempt=1, pass_no=0, deadline=107.5)
    rec = TaskRecord(id=0, pass_no=0, state=State.PENDING, attempt=1, failures=0, trainer="t1", deadline=107.5)
    assert changes == [TaskChanged(rec, Event.DISPATCH)]
    assert q.record(0) == rec
    assert q.in_flight("t1") == {0}
    assert q.counts() == Counts(pass_no=0, todo=2, pending=1, done=0, failed=0)
    assert q.next_deadline() == 107.5


def test_dispatch_follows_todo_order_and_next_deadline_is_earliest():
    q = queue(3, max_in_flight=3)
    assert [dispatched(q, "t", now).task.id for now in (5.0, 1.0, 3.0)] == [0, 1, 2]
    assert q.next_deadline() == 11.0


def test_dispatch_waits_at_cap_per_trainer():
    q = queue(4, max_in_flight=2)
    dispatched(q, "t1", 0.0)
    dispatched(q, "t1", 0.0)
    assert q.dispatch("t1", 0.0) == (WaitReason.AT_CAP, [])
    # another trainer is not capped by t1's load
    assert dispatched(q, "t2", 0.0).task.id == 2
    assert q.in_flight("t1") == {0, 1}
    # finishing one frees a place under the cap
    q.finish(0, 1)
    assert dispatched(q, "t1", 0.0).task.id == 3


def test_the_queue_holds_one_string_per_trainer_however_many_tasks_it_took():
    # equal names in distinct strings, as two requests decoded from the wire carry them;
    # the audit keeps every attempt's trainer, so one copy each would cost a string a task
    # at a million tasks (bench/master_memory.py)
    first, second = "".join(["t", "1"]), "".join(["t", "1"])
    assert first == second and first is not second
    q = queue(2, max_in_flight=2)
    dispatched(q, first, 0.0)
    dispatched(q, second, 0.0)
    assert q.record(0).trainer is q.record(1).trainer


def test_drained_versus_pass_complete():
    q = queue(1)
    a = dispatched(q, "t1", 0.0)
    assert q.dispatch("t2", 0.0) == (WaitReason.DRAINED, [])
    q.finish(a.task.id, a.attempt)
    assert q.dispatch("t2", 0.0) == (WaitReason.PASS_COMPLETE, [])
    assert q.dispatch("t1", 0.0) == (WaitReason.PASS_COMPLETE, [])


def test_dispatch_rejects_empty_trainer_id_without_changing_anything():
    q = queue(1)
    before = q.records()
    with pytest.raises(ConfigError):
        q.dispatch("", 0.0)
    assert q.records() == before


# --- finish -------------------------------------------------------------------------


def test_finish_moves_to_done_and_clears_trainer():
    q = queue(2)
    a = dispatched(q, "t1", 0.0)
    changes = q.finish(a.task.id, a.attempt)
    rec = TaskRecord(id=0, pass_no=0, state=State.DONE, attempt=1, failures=0, trainer=None, deadline=None)
    assert changes == [TaskChanged(rec, Event.FINISH)]
    assert q.in_flight("t1") == set()
    assert q.counts() == Counts(0, todo=1, pending=0, done=1, failed=0)
    assert not q.pass_complete


def test_finishing_the_last_task_completes_the_pass():
    q = queue(2, max_in_flight=2)
    a0, a1 = dispatched(q, "t", 0.0), dispatched(q, "t", 0.0)
    assert len(q.finish(a0.task.id, a0.attempt)) == 1
    changes = q.finish(a1.task.id, a1.attempt)
    assert changes[1:] == [PassCompleted(pass_no=0, done=2, failed=())]
    assert q.pass_complete


# --- stale and late reports ---------------------------------------------------------


def test_stale_attempt_is_ignored_and_changes_nothing():
    q = queue(1)
    a = dispatched(q, "t1", 0.0)
    q.expire(now=100.0)  # back to todo
    b = dispatched(q, "t2", 100.0)
    assert b.task.id == a.task.id and b.attempt == a.attempt + 1
    before = q.records()
    for method, event in ((q.finish, Event.FINISH), (q.fail, Event.FAIL), (q.give_back, Event.GIVE_BACK)):
        changes = method(a.task.id, a.attempt)
        assert len(changes) == 1
        ig = changes[0]
        assert isinstance(ig, Ignored)
        assert (ig.task_id, ig.attempt, ig.event) == (a.task.id, a.attempt, event)
        assert "stale" in ig.reason
        assert q.records() == before
    # a report from the future is no better than one from the past
    assert isinstance(q.finish(a.task.id, b.attempt + 1)[0], Ignored)
    assert q.records() == before


def test_finish_for_a_task_that_timed_out_is_ignored():
    q = queue(1)
    a = dispatched(q, "t1", 0.0)
    timed_out = q.expire(now=10.0)
    assert [c.record.state for c in timed_out] == [State.TODO]
    before = q.records()
    changes = q.finish(a.task.id, a.attempt)  # same attempt, but no longer pending
    assert len(changes) == 1 and isinstance(changes[0], Ignored)
    assert "pending" in changes[0].reason
    assert q.records() == before
    assert q.record(0).state is State.TODO


def test_report_for_a_task_never_dispatched_is_ignored():
    q = queue(1)
    before = q.records()
    [ig] = q.finish(0, 0)
    assert isinstance(ig, Ignored) and (ig.task_id, ig.attempt, ig.event) == (0, 0, Event.FINISH)
    assert "todo" in ig.reason
    assert q.records() == before


def test_report_from_a_previous_pass_is_ignored():
    q = queue(1)
    a = dispatched(q, "t1", 0.0)
    q.finish(a.task.id, a.attempt)
    q.start_next_pass()
    # before the task is dispatched again: the same attempt, but the task is todo
    before = q.records()
    assert isinstance(q.finish(a.task.id, a.attempt)[0], Ignored)
    assert isinstance(q.fail(a.task.id, a.attempt)[0], Ignored)
    assert q.records() == before
    # after: the attempt kept counting across the pass, so the old one is stale
    b = dispatched(q, "t2", 0.0)
    assert b.attempt == a.attempt + 1 and b.pass_no == 1
    before = q.records()
    assert isinstance(q.finish(a.task.id, a.attempt)[0], Ignored)
    assert q.records() == before
    assert q.finish(b.task.id, b.attempt)[0].record.state is State.DONE


def test_unknown_task_raises():
    q = queue(2)
    for call in (lambda: q.finish(99, 1), lambda: q.fail(99, 1), lambda: q.give_back(99, 1), lambda: q.record(99), lambda: q.spec(99)):
        with pytest.raises(UnknownTaskError) as ei:
            call()
        assert "99" in str(ei.value)


# --- failures -----------------------------------------------------------------------


def test_expire_requeues_late_tasks_with_one_more_failure():
    q = queue(3, max_in_flight=3, timeout=10.0)
    dispatched(q, "t", 0.0)  # deadline 10
    dispatched(q, "t", 5.0)  # deadline 15
    assert q.expire(now=9.9) == []
    changes = q.expire(now=10.0)
    rec = TaskRecord(id=0, pass_no=0, state=State.TODO, attempt=1, failures=1, trainer=None, deadline=None)
    assert changes == [TaskChanged(rec, Event.TIMEOUT)]
    assert q.in_flight("t") == {1}
    assert q.record(1).state is State.PENDING
    # todo order: a timed-out task goes to the back
    assert dispatched(q, "u", 20.0).task.id == 2


def test_fail_requeues_with_one_more_failure():
    q = queue(2)
    a = dispatched(q, "t1", 0.0)
    changes = q.fail(a.task.id, a.attempt)
    assert changes == [TaskChanged(TaskRecord(id=0, pass_no=0, state=State.TODO, attempt=1, failures=1), Event.FAIL)]


def test_trainer_lost_requeues_all_its_tasks_at_once():
    q = queue(5, max_in_flight=2)
    dispatched(q, "t1", 0.0)  # 0
    dispatched(q, "t2", 0.0)  # 1
    dispatched(q, "t1", 0.0)  # 2
    changes = q.trainer_lost("t1")
    assert [(c.record.id, c.record.state, c.record.failures, c.event) for c in changes] == [
        (0, State.TODO, 1, Event.TRAINER_LOST),
        (2, State.TODO, 1, Event.TRAINER_LOST),
    ]
    assert all(c.record.trainer is None and c.record.deadline is None for c in changes)
    assert q.in_flight("t1") == set()
    assert q.in_flight("t2") == {1}
    assert q.trainer_lost("t1") == []
    assert q.trainer_lost("never-seen") == []


def test_give_back_goes_to_front_of_todo_without_a_failure():
    q = queue(3)
    a = dispatched(q, "t1", 0.0)
    q.fail(a.task.id, a.attempt)  # task 0: failures 1, back of todo -> todo is [1, 2, 0]
    b = dispatched(q, "t1", 0.0)
    assert b.task.id == 1
    changes = q.give_back(b.task.id, b.attempt)
    rec = TaskRecord(id=1, pass_no=0, state=State.TODO, attempt=1, failures=0, trainer=None, deadline=None)
    assert changes == [TaskChanged(rec, Event.GIVE_BACK)]
    assert dispatched(q, "t2", 0.0).task.id == 1  # front, not back

    c = dispatched(q, "t3", 0.0)  # task 2
    q.fail(c.task.id, c.attempt)
    d = dispatched(q, "t3", 0.0)  # task 0, failures 1
    assert d.task.id == 0
    q.give_back(d.task.id, d.attempt)
    assert q.record(0).failures == 1  # unchanged by a give-back


def test_task_fails_once_failures_exceed_failure_max_and_completion_is_announced_once():
    q = queue(2, failure_max=3)
    # task 1 succeeds first so that task 0 is the last one standing
    a = dispatched(q, "a", 0.0)
    b = dispatched(q, "b", 0.0)
    assert (a.task.id, b.task.id) == (0, 1)
    assert q.finish(*_ids(b))[0].record.state is State.DONE
    seen_states = []
    all_changes = []
    for i in range(4):
        if i:
            a = dispatched(q, "a", float(i))
        changes = q.fail(*_ids(a))
        all_changes += changes
        seen_states.append((changes[0].record.state, changes[0].record.failures))
    assert seen_states == [(State.TODO, 1), (State.TODO, 2), (State.TODO, 3), (State.FAILED, 4)]
    completed = [c for c in all_changes if isinstance(c, PassCompleted)]
    assert completed == [PassCompleted(pass_no=0, done=1, failed=(0,))]
    assert q.pass_complete
    assert q.dispatch("a", 9.0) == (WaitReason.PASS_COMPLETE, [])
    # a late report after completion changes nothing and announces nothing
    assert [type(c) for c in q.fail(*_ids(a))] == [Ignored]
    assert q.expire(1e9) == [] and q.trainer_lost("a") == []


def test_failure_max_zero_fails_on_first_failure():
    q = queue(1, failure_max=0)
    a = dispatched(q, "t", 0.0)
    changes = q.expire(now=1e6)
    assert changes == [
        TaskChanged(TaskRecord(id=0, pass_no=0, state=State.FAILED, attempt=1, failures=1), Event.TIMEOUT),
        PassCompleted(pass_no=0, done=0, failed=(0,)),
    ]
    assert a.attempt == 1


@pytest.mark.parametrize("how", ["fail", "expire", "trainer_lost"])
def test_pass_whose_last_task_fails_still_completes(how):
    q = queue(3, failure_max=1, max_in_flight=3)
    done = [dispatched(q, "t", 0.0) for _ in range(2)]
    for a in done:
        q.finish(*_ids(a))
    last = dispatched(q, "t", 0.0)
    q.fail(*_ids(last))  # failures 1 == failure_max: still todo
    assert not q.pass_complete
    last = dispatched(q, "t", 100.0)
    if how == "fail":
        changes = q.fail(*_ids(last))
    elif how == "expire":
        changes = q.expire(now=1000.0)
    else:
        changes = q.trainer_lost("t")
    assert changes[0].record.state is State.FAILED
    assert changes[1:] == [PassCompleted(pass_no=0, done=2, failed=(2,))]
    assert q.pass_complete
    assert q.counts() == Counts(0, todo=0, pending=0, done=2, failed=1)


def _ids(a: Assignment) -> tuple[int, int]:
    return a.task.id, a.attempt


# --- passes -------------------------------------------------------------------------


def test_start_next_pass_before_completion_raises():
    q = queue(2)
    with pytest.raises(InvalidTransition) as ei:
        q.start_next_pass()
    assert ei.value.event is Event.NEW_PASS and ei.value.state is State.TODO
    a = dispatched(q, "t", 0.0)
    b = dispatched(q, "u", 0.0)
    q.finish(*_ids(a))
    with pytest.raises(InvalidTransition) as ei:
        q.start_next_pass()  # b still pending
    assert ei.value.state is State.PENDING
    assert q.pass_no == 0
    q.finish(*_ids(b))
    assert q.start_next_pass() == [PassStarted(1)]


def test_start_next_pass_is_one_write_and_resets_failures_but_keeps_attempts():
    q = queue(3, failure_max=0, max_in_flight=3)
    a0, a1, a2 = (dispatched(q, "t", 0.0) for _ in range(3))
    q.finish(*_ids(a0))
    q.fail(*_ids(a1))  # failed for this pass
    q.finish(*_ids(a2))
    assert q.counts() == Counts(0, todo=0, pending=0, done=2, failed=1)

    changes = q.start_next_pass()
    assert changes == [PassStarted(pass_no=1)]
    assert q.pass_no == 1
    assert q.counts() == Counts(1, todo=3, pending=0, done=0, failed=0)
    assert q.records() == [TaskRecord(id=i, pass_no=1, state=State.TODO, attempt=1, failures=0) for i in range(3)]
    # the failed task is trained again, with a fresh attempt number
    got = [dispatched(q, "t", 0.0) for _ in range(3)]
    assert [(g.task.id, g.attempt, g.pass_no) for g in got] == [(0, 2, 1), (1, 2, 1), (2, 2, 1)]
    # and a full second pass announces its own completion
    changes = list(itertools.chain.from_iterable(q.finish(*_ids(g)) for g in got))
    assert [c for c in changes if isinstance(c, PassCompleted)] == [PassCompleted(1, 3, ())]


# --- restore ------------------------------------------------------------------------


def test_restore_from_persisted_changes_reproduces_a_running_queue():
    q = queue(8, max_in_flight=2, failure_max=1, timeout=5.0)
    shadow = Shadow()
    # pass 0: everything done or failed
    while not q.pass_complete:
        a, ch = q.dispatch("t", 0.0)
        shadow.apply(ch)
        shadow.apply(q.fail(*_ids(a)) if a.task.id in (2, 5) else q.finish(*_ids(a)))
    assert q.ids_in(State.FAILED) == {2, 5}
    shadow.apply(q.start_next_pass())
    # pass 1: a bit of everything, leaving some tasks untouched (older-pass records)
    runs = {}
    for trainer, now in (("a", 1.0), ("b", 2.0), ("a", 3.0), ("b", 4.0), ("c", 5.0)):
        a, ch = q.dispatch(trainer, now)
        shadow.apply(ch)
        runs[a.task.id] = a
    shadow.apply(q.finish(*_ids(runs[0])))  # done
    shadow.apply(q.fail(*_ids(runs[1])))  # todo, failures 1
    shadow.apply(q.give_back(*_ids(runs[2])))  # todo, front
    shadow.apply(q.expire(now=9.0))  # task 3 (deadline 9) times out
    # pending: 4 (c, deadline 10); todo: 2, 5, 6, 7 untouched in pass 1, plus 1, 3
    assert q.ids_in(State.PENDING) == {4}
    assert any(r.pass_no == 0 for r in shadow.records.values())

    r = shadow.restore(q)
    assert r.pass_no == q.pass_no == 1
    assert sets(r) == sets(q)
    assert sorted(r.records(), key=lambda x: x.id) == sorted(q.records(), key=lambda x: x.id)
    assert r.counts() == q.counts()
    assert {t: r.in_flight(t) for t in "abc"} == {t: q.in_flight(t) for t in "abc"}
    assert r.next_deadline() == q.next_deadline() == 10.0
    assert {i: r.record(i).attempt for i in range(8)} == {i: q.record(i).attempt for i in range(8)}
    # the restored queue fences the same stale reports
    assert isinstance(r.finish(3, runs[3].attempt)[0], Ignored)
    assert r.finish(4, runs[4].attempt)[0].record.state is State.DONE


def test_restore_reads_older_pass_records_as_todo_keeping_attempts():
    recs = [
        TaskRecord(id=0, pass_no=2, state=State.DONE, attempt=5, failures=0),
        TaskRecord(id=1, pass_no=2, state=State.PENDING, attempt=7, failures=2, trainer="x", deadline=3.0),
        TaskRecord(id=2, pass_no=3, state=State.PENDING, attempt=9, failures=1, trainer="y", deadline=4.0),
    ]
    q = TaskQueue.restore(specs(4), recs, pass_no=3, max_in_flight=2)
    assert q.record(0) == TaskRecord(id=0, pass_no=3, state=State.TODO, attempt=5)
    assert q.record(1) == TaskRecord(id=1, pass_no=3, state=State.TODO, attempt=7)
    assert q.record(2) == recs[2]
    assert q.record(3) == TaskRecord(id=3, pass_no=3, state=State.TODO)
    assert q.in_flight("x") == set() and q.in_flight("y") == {2}
    assert q.counts() == Counts(3, todo=3, pending=1, done=0, failed=0)


def test_restore_rejects_bad_records():
    with pytest.raises(ConfigError, match="99"):
        TaskQueue.restore(specs(2), [TaskRecord(id=99, pass_no=0, state=State.TODO)], pass_no=0)
    with pytest.raises(ConfigError, match="beyond"):
        TaskQueue.restore(specs(2), [TaskRecord(id=0, pass_no=4, state=State.DONE)], pass_no=3)
    with pytest.raises(InvalidTransition):
        TaskQueue.restore(specs(2), [TaskRecord(id=0, pass_no=0, state=State.PENDING, attempt=1)], pass_no=0)


def test_record_and_spec_json_round_trip():
    rec = TaskRecord(id=3, pass_no=2, state=State.PENDING, attempt=4, failures=1, trainer="t", deadline=12.5)
    assert TaskRecord.from_json(json.loads(json.dumps(rec.to_json()))) == rec
    plain = TaskRecord(id=3, pass_no=2, state=State.DONE)
    assert TaskRecord.from_json(json.loads(json.dumps(plain.to_json()))) == plain
    spec = specs(6)[5]
    assert TaskSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


# --- O(1) writes ----------------------------------------------------------------------


def test_changes_per_transition_are_constant_on_a_large_queue():
    n = 10_000
    q = queue(n, max_in_flight=1)
    worst = 0
    for i in range(n):
        a, ch = q.dispatch("t", float(i))
        worst = max(worst, len(ch))
        ch = q.finish(*_ids(a))
        worst = max(worst, len(ch))
    assert q.pass_complete
    assert ch[-1] == PassCompleted(0, n, ())
    assert worst <= 2
    assert q.start_next_pass() == [PassStarted(1)]
    a, ch = q.dispatch("t", 0.0)
    assert len(ch) == 1
    assert len(q.give_back(*_ids(a))) == 1
    a, _ = q.dispatch("t", 0.0)
    assert len(q.fail(*_ids(a))) == 1


# --- the transition table -------------------------------------------------------------


def test_every_transition_outside_the_table_raises():
    legal = 0
    for state, event, target in itertools.product(State, Event, State):
        rec = TaskRecord(id=1, pass_no=0, state=state)
        if target in TRANSITIONS.get((state, event), frozenset()):
            tasks._check(rec, event, target)
            legal += 1
        else:
            with pytest.raises(InvalidTransition) as ei:
                tasks._check(rec, event, target)
            assert (ei.value.state, ei.value.event) == (state, event)
            assert "task 1" in str(ei.value)
    assert legal == sum(len(v) for v in TRANSITIONS.values())


def test_done_task_cannot_be_finished_by_a_transition():
    # a DONE record fed a FINISH through the internal move is refused by the table
    q = queue(1)
    a = dispatched(q, "t", 0.0)
    q.finish(*_ids(a))
    with pytest.raises(InvalidTransition):
        q._move(q.record(0), Event.FINISH, State.DONE)
    assert q.record(0).state is State.DONE


# --- configuration ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"failure_max": -1},
        {"timeout": 0.0},
        {"timeout": -5.0},
        {"timeout": float("nan")},
        {"max_in_flight": 0},
    ],
)
def test_config_errors(kw):
    with pytest.raises(ConfigError):
        TaskQueue.create(specs(2), **kw)
    with pytest.raises(ConfigError):
        TaskQueue.restore(specs(2), [], pass_no=0, **kw)


def test_no_tasks_and_duplicate_ids_are_config_errors():
    with pytest.raises(ConfigError, match="no tasks"):
        TaskQueue.create([])
    dup = specs(3) + [TaskSpec(id=1, location="x", part=0, records=1)]
    with pytest.raises(ConfigError, match="duplicate task id 1"):
        TaskQueue.create(dup)


def test_defaults():
    q = TaskQueue.create(specs(1))
    assert (q.failure_max, q.timeout, q.max_in_flight, q.pass_no) == (3, 60.0, 1, 0)


def test_a_task_whose_dispatch_reply_was_lost_is_handed_out_again_not_left_to_time_out():
    q = TaskQueue.create(specs(3), timeout=60.0)
    first, _ = q.dispatch("t1", 0.0)
    assert isinstance(first, Assignment)
    # t1 asks again holding nothing: it never got the answer above
    again = q.redeliver("t1", holding=[])
    assert again is not None and (again.task, again.attempt, again.pass_no) == (first.task, first.attempt, first.pass_no)
    assert q.redeliver("t1", holding=[first.task.id]) is None  # it knows: nothing to hand out again
    assert q.redeliver("t2") is None
    assert q.record(first.task.id).attempt == 1 and q.counts().pending == 1  # nothing changed
