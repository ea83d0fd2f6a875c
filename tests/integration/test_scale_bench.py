"""bench/scale.py measures the library's own roles, not copies of them: a change to the
master's dispatch rule (in core) changes what its simulated job does."""

from __future__ import annotations

from bench import scale
from pdps.core.tasks import TaskQueue, WaitReason


def test_the_scale_job_runs_the_real_roles_and_counts_every_family(monkeypatch):
    row = scale.sync_steps(2, 2, 3, timeout=60)
    assert row["trained_by"] == {"trainer-0": [0], "trainer-1": [1]} or row["trained_by"] == {"trainer-0": [1], "trainer-1": [0]}
    assert row["tasks_done"] == 2 and row["rounds_in_window"] == 2
    # each step: every trainer contributes to the round record, pushes to and pulls from each pserver
    assert row["by_family_per_step"]["rounds"]["writes"] >= 2
    assert row["messages_by_method_per_step"]["push"] == 4 and row["messages_by_method_per_step"]["pull"] >= 4

    dispatch = TaskQueue.dispatch

    def never_to_trainer_0(self, trainer, now):
        if trainer == "trainer-0" and self.counts().todo:
            return WaitReason.DRAINED, []
        return dispatch(self, trainer, now)

    monkeypatch.setattr(TaskQueue, "dispatch", never_to_trainer_0)
    row = scale.sync_steps(2, 2, 3, timeout=60)
    assert row["trained_by"] == {"trainer-0": [], "trainer-1": [0, 1]}


def test_the_master_keeps_less_than_a_kib_per_task_and_writes_per_task_alike_at_two_sizes():
    small, large = scale.master_memory(1_000), scale.master_memory(10_000)
    assert 0 < large["master_bytes_per_task"] < 1024
    assert large["master_bytes_per_task"] < 2 * small["master_bytes_per_task"]
    a, b = scale.master_store(1_000, 50), scale.master_store(10_000, 50)
    assert a["finished"] == b["finished"] == 50
    assert a["writes_per_task"] == b["writes_per_task"] > 0


def test_a_pserver_reads_the_jobs_state_at_most_once_a_second_not_at_every_waiting_pull():
    """Whether the job is done is kept by a watch; a waiting pull no longer reads it
    (before: several reads of ``state`` per sync step at 8 trainers)."""
    from pdps.roles.pserver import MEMBERS_FRESH

    row = scale.sync_steps(8, 2, 4, timeout=60)
    rounds = row["rounds_in_window"]
    reads = row["by_family_per_step"].get("state", {}).get("reads", 0.0) * rounds
    window_s = row["s_per_step"] * rounds
    assert reads <= row["pservers"] * (window_s / MEMBERS_FRESH + 1), (reads, window_s)
