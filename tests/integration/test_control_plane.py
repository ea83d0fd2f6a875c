"""``pdps.simulate_control_plane`` at small scale: the real roles run one pass, the audit
shows every task done once, and the report adds up (per role to the whole, messages to
what the mode implies)."""

from __future__ import annotations

import pytest

import pdps
from pdps.core.errors import ConfigError
from pdps.core.tasks import TaskQueue, WaitReason

ROLE_NAMES = ("master", "pservers", "trainers")


def added(report, what):
    return {k: sum(getattr(r.store, what).get(k, 0) for r in report.roles.values()) for k in getattr(report.whole, what)}


def test_a_sync_pass_is_audited_done_once_and_its_counts_add_up():
    report = pdps.simulate_control_plane(trainers=20, pservers=4, tasks=500, mode="sync", seed=1)
    assert set(report.roles) == set(ROLE_NAMES)
    assert report.tasks_done == 500 and report.audit.ok and report.audit.done_once == 500 and report.audit.attempts == 500
    assert report.audit.trainers == 20  # sync: every trainer holds a task in every round
    # every write is some role's: the roles' counts add up to the shared store's
    for what in ("writes", "bytes_written", "conflicts"):
        assert added(report, what) == dict(getattr(report.whole, what)), what
    assert report.total("keys_written") == report.whole.total("writes")
    # sync, one record a task: each task is one step, pushed to every pserver; the trainers send every message
    trainers = report.roles["trainers"]
    assert trainers.messages["push"] == 4 * 500 and report.steps == 500
    assert trainers.messages["pull"] >= 4 * 500 and trainers.messages["finish_task"] == 500
    assert report.roles["master"].message_count == report.roles["pservers"].message_count == 0
    # the master writes each task's record and audit at its dispatch and its finish
    assert report.roles["master"].store.writes["tasks"] == report.roles["master"].store.writes["audit"] == 2 * 500
    assert report.simulated_seconds > 0 and report.simulated_seconds_per_step == pytest.approx(report.simulated_seconds * 20 / 500)
    assert 0 < report.master_bytes_per_task < 1024


def test_an_async_pass_that_steps_on_one_task_in_ten_pushes_only_those():
    seen = []
    report = pdps.simulate_control_plane(trainers=10, pservers=4, tasks=400, mode="async", step_every=10, seed=2, progress=seen.append)
    assert report.audit.ok and report.tasks_done == 400
    times = [s["simulated_seconds"] for s in seen]
    assert times and times == sorted(times) and times[-1] <= report.simulated_seconds and "done" in seen[-1]
    pushes = report.roles["trainers"].messages["push"]
    assert pushes == 4 * report.steps and 10 <= report.steps <= 400 // 10 + 10  # each trainer's 1st, 11th, ... task
    assert report.roles["trainers"].messages["finish_task"] == 400


def test_the_simulation_runs_the_masters_own_dispatch_rule(monkeypatch):
    dispatch = TaskQueue.dispatch

    def drained_for_all_but_trainer_0(self, trainer, now):
        if trainer != "trainer-0" and self.counts().todo:
            return WaitReason.DRAINED, []
        return dispatch(self, trainer, now)

    monkeypatch.setattr(TaskQueue, "dispatch", drained_for_all_but_trainer_0)
    report = pdps.simulate_control_plane(trainers=3, pservers=2, tasks=30, mode="async")
    monkeypatch.undo()
    assert pdps.simulate_control_plane(trainers=3, pservers=2, tasks=30, mode="sync").audit.trainers == 3
    assert report.audit.ok and report.audit.trainers == 1  # trainer-0 trained every task (without the rule: 3 trainers)


def test_bad_arguments_are_refused_before_anything_runs():
    with pytest.raises(ConfigError, match="step_every"):
        pdps.simulate_control_plane(trainers=2, pservers=1, tasks=4, mode="sync", step_every=2)
    with pytest.raises(ConfigError, match="trainers"):
        pdps.simulate_control_plane(trainers=0, pservers=1, tasks=4)
