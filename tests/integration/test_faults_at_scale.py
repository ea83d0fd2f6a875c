"""Fault injection at scale: ``pdps.simulate(..., faults=pdps.Faults(...))`` on a job of
100 trainers x 4 pservers x 1,000 one-record tasks kills 1% of the trainers, one
pserver and the master, each at a seeded moment of the pass. The pass completes and its
audit has every task done exactly once, every record trained exactly once.

The model is bench/scale.py's: 32 scalars and a loss that costs microseconds, so what
runs is the control plane (about 10-15 s a job on 2 cores)."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

import pdps
from bench.scale import Records, train
from pdps.adapters.memory_store import MemoryStore
from pdps.shell.status import pass_audit

TRAINERS, PSERVERS, TASKS = 100, 4, 1000

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode,seed", [("sync", 2), ("async", 1)])
def test_a_pass_survives_one_percent_of_trainers_a_pserver_and_the_master_killed(mode, seed):
    store = MemoryStore()
    faults = pdps.Faults(seed=seed, trainers=0.01, pservers=1, master=True)
    result = pdps.simulate(
        train, dataset=Records(TASKS, 1), store=store, trainers=TRAINERS, pservers=PSERVERS, mode=mode, batch_size=1,
        overlap="off", min_block=1, num_slots=64, compute=pdps.open_compute("torch", device="cpu"), timeout=120,
        checkpoint_url=f"memory://faults-{uuid.uuid4().hex[:8]}", checkpoint_every=2,
        faults=faults,
    )  # fmt: skip

    # what was planned struck, each mid-pass: one trainer (1%), one pserver, the master
    plan = faults.plan(result.config)
    assert [i.fault for i in result.faults] == list(plan)
    assert sorted(f.role for f in plan) == ["master", "pserver", "trainer"]
    assert all(i.pass_no == 0 and 0 < i.done < TASKS for i in result.faults), result.faults
    assert result.killed == tuple(f.target for f in plan if f.role == "trainer")

    # the pass completed: nothing lost, nothing twice
    assert (result.passes, result.tasks_done, result.tasks_failed) == (1, TASKS, 0)
    audit = pass_audit(store, result.config.name, 0)
    assert audit["summary"]["done"] == TASKS and audit["summary"]["failed"] == 0
    done_attempts = Counter(sum(a["outcome"] == "done" for a in e["attempts"]) for e in audit["entries"])
    assert done_attempts == {1: TASKS}, done_attempts
    assert all(e["outcome"] == "done" and e["record_counts"] == [[1, 1]] for e in audit["entries"])
    assert audit["summary"]["records_trained"] == TASKS and audit["summary"]["records_trained_more_than_once"] == 0
    # the faults were felt: the killed trainer's task was re-queued, the pserver's restart rolled work back
    outcomes = Counter(a["outcome"] for e in audit["entries"] for a in e["attempts"])
    assert outcomes["trainer_lost"] == 1 and outcomes["rolled_back"] > 0, outcomes
