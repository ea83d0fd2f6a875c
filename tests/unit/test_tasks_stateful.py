"""The task queue under random event sequences, with a shadow of what a shell persists.

The shadow is written only from the changes each transition returns, so the
invariant "restoring the shadow gives back the live queue" checks that those O(1)
changes are all a shell needs to persist.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import given, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdps.core.audit import AuditLog, Outcome, record_counts
from pdps.core.errors import InvalidTransition
from pdps.core.speculation import AttemptEnded
from pdps.core.tasks import (
    Assignment,
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

TRAINERS = ("a", "b", "c")


def specs(n: int) -> list[TaskSpec]:
    return [TaskSpec(id=i, location=f"mem://s{i}", part=0, records=1) for i in range(n)]


def by_id(records: list[TaskRecord]) -> dict[int, TaskRecord]:
    return {r.id: r for r in records}


class TaskQueueMachine(RuleBasedStateMachine):
    @initialize(
        n=st.integers(1, 6),
        failure_max=st.integers(0, 2),
        cap=st.integers(1, 3),
        timeout=st.sampled_from([1.0, 5.0]),
    )
    def create(self, n, failure_max, cap, timeout):
        self.ids = set(range(n))
        self.q = TaskQueue.create(specs(n), failure_max=failure_max, timeout=timeout, max_in_flight=cap)
        self.now = 0.0
        self.shadow: dict[int, TaskRecord] = {}
        self.shadow_pass = 0
        self.announced: dict[int, int] = {}  # pass -> PassCompleted count
        self.old_reports: set[tuple[int, int]] = set()  # (task, attempt) ever handed out
        self.audit = AuditLog()

    # --- helpers ----------------------------------------------------------------------

    def apply(self, changes) -> None:
        self.audit.record(changes)
        for c in changes:
            if isinstance(c, TaskChanged):
                self.shadow[c.record.id] = c.record
            elif isinstance(c, PassStarted):
                self.shadow_pass = c.pass_no
            elif isinstance(c, PassCompleted):
                assert c.pass_no == self.q.pass_no
                self.announced[c.pass_no] = self.announced.get(c.pass_no, 0) + 1
                assert c.failed == tuple(sorted(self.q.ids_in(State.FAILED)))
                assert c.done == len(self.q.ids_in(State.DONE))
        # at most one write per task, and a completion notice only at the end
        touched = [c.record.id for c in changes if isinstance(c, TaskChanged)]
        assert len(touched) == len(set(touched))
        assert all(not isinstance(c, PassCompleted) for c in changes[:-1])

    def restored(self) -> TaskQueue:
        return TaskQueue.restore(
            self.q.specs(),
            list(self.shadow.values()),
            pass_no=self.shadow_pass,
            failure_max=self.q.failure_max,
            timeout=self.q.timeout,
            max_in_flight=self.q.max_in_flight,
        )

    def raced(self) -> list[int]:
        return sorted(t for t in self.q.ids_in(State.PENDING) if self.q.record(t).backup is not None)

    def report(self, method, event: Event, task: int, target: State | None) -> None:
        before = by_id(self.q.records())
        rec = before[task]
        changes = getattr(self.q, method)(task, rec.attempt)
        self.apply(changes)
        assert isinstance(changes[0], TaskChanged)
        new = changes[0].record
        assert (new.id, new.attempt, new.trainer, new.deadline, changes[0].event) == (task, rec.attempt, None, None, event)
        if target is None:  # a failure: todo or failed, one more failure
            assert new.failures == rec.failures + 1
            assert new.state is (State.FAILED if new.failures > self.q.failure_max else State.TODO)
        else:
            assert new.state is target and new.failures == rec.failures
        assert by_id(self.q.records()) == {**before, task: new}
        assert len(changes) <= 2

    # --- rules ------------------------------------------------------------------------

    @rule(trainer=st.sampled_from(TRAINERS), dt=st.integers(0, 3))
    def dispatch(self, trainer, dt):
        self.now += dt
        held = self.q.in_flight(trainer)
        todo_before = self.q.ids_in(State.TODO)
        pending_before = self.q.ids_in(State.PENDING)
        before = by_id(self.q.records())
        result, changes = self.q.dispatch(trainer, self.now)
        self.apply(changes)
        if isinstance(result, Assignment):
            tid = result.task.id
            assert len(held) < self.q.max_in_flight
            assert tid in todo_before
            assert result.attempt == before[tid].issued + 1  # a beaten backup's number is never reused
            assert result.deadline == self.now + self.q.timeout
            assert result.pass_no == self.q.pass_no
            assert changes == [TaskChanged(self.q.record(tid), Event.DISPATCH)]
            assert self.q.in_flight(trainer) == held | {tid}
            self.old_reports.add((tid, result.attempt))
        else:
            assert changes == []
            if len(held) >= self.q.max_in_flight:
                assert result is WaitReason.AT_CAP
            elif not todo_before:
                assert result is (WaitReason.DRAINED if pending_before else WaitReason.PASS_COMPLETE)
            else:
                raise AssertionError(f"{trainer} waits ({result}) while todo holds {todo_before}")

    @precondition(lambda self: self.q.ids_in(State.PENDING) - set(self.raced()))
    @rule(data=st.data(), event=st.sampled_from([Event.FINISH, Event.FAIL, Event.GIVE_BACK]))
    def report_current(self, data, event):
        task = data.draw(st.sampled_from(sorted(self.q.ids_in(State.PENDING) - set(self.raced()))))
        if event is Event.FINISH:
            self.report("finish", event, task, State.DONE)
        elif event is Event.FAIL:
            self.report("fail", event, task, None)
        else:
            self.report("give_back", event, task, State.TODO)

    @rule(trainer=st.sampled_from(TRAINERS), dt=st.integers(0, 3), data=st.data())
    def speculate(self, trainer, dt, data):
        """A backup attempt for some pending task (the straggler rule aside: any task)."""
        self.now += dt
        free = [t for t in self.q.ids_in(State.PENDING) if self.q.record(t).backup is None and self.q.record(t).trainer != trainer]
        if not free:
            return
        task = data.draw(st.sampled_from(sorted(free)))
        rec = self.q.record(task)
        held = self.q.in_flight(trainer)
        if len(held) >= self.q.max_in_flight:
            before = self.q.records()
            try:
                self.q.speculate(task, trainer, rec.issued + 1, rec.offset, self.now)
            except InvalidTransition:
                assert self.q.records() == before
                return
            raise AssertionError(f"{trainer} at its cap got a backup of task {task}")
        changes = self.q.speculate(task, trainer, rec.issued + 1, rec.offset, self.now)
        self.apply(changes)
        new = self.q.record(task)
        assert changes == [TaskChanged(new, Event.SPECULATE)]
        assert (new.attempt, new.trainer, new.issued) == (rec.attempt, rec.trainer, rec.issued + 1)
        assert new.backup.attempt == rec.issued + 1 and new.backup.trainer == trainer
        assert self.q.in_flight(trainer) == held | {task}
        self.old_reports.add((task, new.backup.attempt))

    @precondition(lambda self: self.raced())
    @rule(data=st.data(), method=st.sampled_from(["finish", "fail", "give_back", "beaten"]), which=st.sampled_from([0, 1]))
    def report_racer(self, data, method, which):
        task = data.draw(st.sampled_from(self.raced()))
        rec = self.q.record(task)
        ended, other = (rec.backup.attempt, rec.attempt)[:: 1 if which else -1]
        trainers = {rec.attempt: rec.trainer, rec.backup.attempt: rec.backup.trainer}
        changes = getattr(self.q, method)(task, ended)
        self.apply(changes)
        new = self.q.record(task)
        if method == "finish":  # the first finish wins; the other is beaten
            assert new.state is State.DONE and new.attempt == ended and new.issued == rec.issued
            loser = other
            assert AttemptEnded(task, loser, trainers[loser], Event.BEATEN, rec.backup.offset) in changes
        else:  # the other racer holds the task alone, with its own deadline and offset
            assert new.state is State.PENDING and new.backup is None
            assert (new.attempt, new.trainer, new.failures) == (other, trainers[other], rec.failures)
            event = Event.BEATEN if method == "beaten" else Event(method)
            assert AttemptEnded(task, ended, trainers[ended], event, rec.backup.offset) in changes
        assert task not in self.q.in_flight(trainers[ended]) or trainers[ended] == new.trainer

    @precondition(lambda self: self.old_reports)
    @rule(data=st.data(), method=st.sampled_from(["finish", "fail", "give_back"]))
    def report_stale(self, data, method):
        task, attempt = data.draw(st.sampled_from(sorted(self.old_reports)))
        rec = self.q.record(task)
        live = {r.attempt for r in self.q.racers(task)}
        while attempt in live:
            attempt = data.draw(st.sampled_from([attempt - 1, attempt + 1, attempt + 2]))
        before = self.q.records()
        counts = self.q.counts()
        changes = getattr(self.q, method)(task, attempt)
        self.apply(changes)
        assert len(changes) == 1 and isinstance(changes[0], Ignored)
        assert (changes[0].task_id, changes[0].attempt, changes[0].event) == (task, attempt, Event(method))
        assert self.q.records() == before
        assert self.q.counts() == counts

    @rule(jump=st.sampled_from([0.0, 0.5, 1.0, 3.0, 10.0]))
    def expire(self, jump):
        self.now += jump
        late = {t for t, _ in self.q.expired_racers(self.now)}
        survives = {t for t in late if any(r.deadline > self.now for r in self.q.racers(t))}
        before = by_id(self.q.records())
        changes = self.q.expire(self.now)
        self.apply(changes)
        got = [c for c in changes if isinstance(c, TaskChanged)]
        assert {c.record.id for c in got} == late
        for c in got:
            assert c.event is Event.TIMEOUT
            if c.record.id in survives:
                assert c.record.state is State.PENDING and c.record.deadline > self.now
            else:
                assert c.record.failures == before[c.record.id].failures + 1
                assert c.record.state in (State.TODO, State.FAILED)
        assert self.q.expired_racers(self.now) == []

    @rule(trainer=st.sampled_from(TRAINERS))
    def trainer_lost(self, trainer):
        held = self.q.in_flight(trainer)
        changes = self.q.trainer_lost(trainer)
        self.apply(changes)
        got = [c for c in changes if isinstance(c, TaskChanged)]
        assert {c.record.id for c in got} == held
        assert all(c.event is Event.TRAINER_LOST for c in got)
        assert self.q.in_flight(trainer) == set()
        assert trainer not in self.q.holders()

    @precondition(lambda self: self.q.pass_complete)
    @rule()
    def start_next_pass(self):
        attempts = {r.id: r.attempt for r in self.q.records()}
        old = self.q.pass_no
        changes = self.q.start_next_pass()
        self.apply(changes)
        assert changes == [PassStarted(old + 1)]
        assert self.q.ids_in(State.TODO) == self.ids
        assert {r.id: r.attempt for r in self.q.records()} == attempts
        assert all(r.failures == 0 for r in self.q.records())

    @rule()
    def crash_and_restore(self):
        """The master restarts from what the shell persisted and carries on."""
        self.q = self.restored()

    # --- invariants -------------------------------------------------------------------

    @invariant()
    def every_task_is_in_exactly_one_queue(self):
        parts = {s: self.q.ids_in(s) for s in State}
        assert sum(len(p) for p in parts.values()) == len(self.ids)
        assert set().union(*parts.values()) == self.ids
        c = self.q.counts()
        assert (c.todo, c.pending, c.done, c.failed) == tuple(len(parts[s]) for s in State)
        assert c.pass_no == self.q.pass_no

    @invariant()
    def shadow_restores_the_live_queue(self):
        r = self.restored()
        assert r.pass_no == self.q.pass_no
        assert by_id(r.records()) == by_id(self.q.records())
        assert r.counts() == self.q.counts()
        for t in TRAINERS:
            assert r.in_flight(t) == self.q.in_flight(t)

    @invariant()
    def trainers_hold_at_most_cap(self):
        pending = self.q.ids_in(State.PENDING)
        held = set()
        for t in TRAINERS:
            mine = self.q.in_flight(t)
            assert len(mine) <= self.q.max_in_flight
            assert all(t in {r.trainer for r in self.q.racers(i)} for i in mine)
            held |= mine
        assert held == pending
        for i in pending:  # two racers are two trainers, and no attempt is newer than issued
            racers = self.q.racers(i)
            assert len({r.trainer for r in racers}) == len(racers)
            assert self.q.record(i).issued >= max(r.attempt for r in racers)

    @invariant()
    def the_audit_follows_every_racer_and_counts_each_record_once(self):
        if self.audit.pass_no != self.q.pass_no:
            return  # the machine started its pass with a restored queue's pass
        for t in self.ids:
            attempts = self.audit.attempts(t)
            assert {a.attempt for a in attempts if a.outcome is Outcome.PENDING} == {r.attempt for r in self.q.racers(t)}
            if self.q.record(t).state is State.DONE:
                assert record_counts(attempts, 1) == [[1, 1]]

    @invariant()
    def failure_counts_respect_failure_max(self):
        for r in self.q.records():
            if r.state is State.FAILED:
                assert r.failures == self.q.failure_max + 1
            else:
                assert r.failures <= self.q.failure_max

    @invariant()
    def a_complete_pass_is_all_done_or_failed_and_announced_once(self):
        assert all(n == 1 for n in self.announced.values())
        if self.q.pass_complete:
            assert all(r.state in (State.DONE, State.FAILED) for r in self.q.records())
            assert self.announced.get(self.q.pass_no) == 1


TestTaskQueueMachine = TaskQueueMachine.TestCase
TestTaskQueueMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 12),
    failure_max=st.integers(0, 3),
    cap=st.integers(1, 3),
    data=st.data(),
)
def test_a_pass_drains_within_bounded_steps(n, failure_max, cap, data):
    """Whatever fails, dispatching and reporting always reaches the end of the pass."""
    q = TaskQueue.create(specs(n), failure_max=failure_max, timeout=1.0, max_in_flight=cap)
    now = 0.0
    completed = []
    # every task is dispatched at most failure_max + 1 times before it fails, or
    # finishes: no more dispatches than that, and one report or expiry per dispatch
    bound = n * (failure_max + 1)
    dispatches = 0
    trainers = ["a", "b"]
    while not q.pass_complete:
        assert dispatches <= bound, f"pass still open after {dispatches} dispatches"
        got = []
        for t in trainers:
            while True:
                a, _ = q.dispatch(t, now)
                if not isinstance(a, Assignment):
                    break
                dispatches += 1
                got.append(a)
        assert got, "nothing pending and nothing dispatched, yet the pass is open"
        for a in got:
            outcome = data.draw(st.sampled_from(["finish", "fail", "timeout"]), label=f"task {a.task.id}")
            if outcome == "finish":
                changes = q.finish(a.task.id, a.attempt)
            elif outcome == "fail":
                changes = q.fail(a.task.id, a.attempt)
            else:
                continue
            completed += [c for c in changes if isinstance(c, PassCompleted)]
        now += 2.0  # past every deadline
        completed += [c for c in q.expire(now) if isinstance(c, PassCompleted)]
    assert dispatches <= bound
    states = {r.id: r.state for r in q.records()}
    assert set(states.values()) <= {State.DONE, State.FAILED}
    failed = tuple(sorted(t for t, s in states.items() if s is State.FAILED))
    assert completed == [PassCompleted(0, n - len(failed), failed)]
    assert q.dispatch("a", now) == (WaitReason.PASS_COMPLETE, [])
