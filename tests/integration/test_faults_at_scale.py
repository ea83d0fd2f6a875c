"""Fault injection at scale: ``pdps.simulate(..., faults=pdps.Faults(...))`` on a job of
100 trainers x 4 pservers x 1,000 one-record tasks kills 1% of the trainers, one
pserver and the master, each at a seeded moment of the pass. The pass completes and its
audit has every task done exactly once, every record trained exactly once.

The model is bench/scale.py's: 32 scalars and a loss that costs microseconds, so what
runs is the control plane (about 10-15 s a job on 2 cores)."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections import Counter

import pytest

import pdps
from bench.scale import Records, train
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.core.checkpoints import MASTER_PART, CheckpointInfo, Manifest, PartInfo, State
from pdps.core.job import Keys
from pdps.core.wire import CheckpointRequest, FinishTaskRequest, GetTaskRequest
from pdps.ports.transport import Channel
from pdps.registry import open_checkpoint_files
from pdps.roles import calls
from pdps.roles.master import Master
from pdps.runtime import recovery
from pdps.shell.faults import MortalStore
from pdps.shell.status import pass_audit
from tests.integration.test_master_durable import register

TRAINERS, PSERVERS, TASKS = 100, 4, 1000

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("mode,seed", [("sync", 2), ("async", 1)])
def test_a_pass_survives_one_percent_of_trainers_a_pserver_and_the_master_killed(mode, seed):
    store, checkpoints = MemoryStore(), f"memory://faults-{uuid.uuid4().hex[:8]}"
    faults = pdps.Faults(seed=seed, trainers=0.01, pservers=1, master=True)
    result = pdps.simulate(
        train, dataset=Records(TASKS, 1), store=store, trainers=TRAINERS, pservers=PSERVERS, mode=mode, batch_size=1,
        overlap="off", min_block=1, num_slots=64, compute=pdps.open_compute("torch", device="cpu"), timeout=120,
        checkpoint_url=checkpoints, checkpoint_every=2,
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
    # the faults were felt: the pserver's restart rolled work back, and the task the killed
    # trainer held went to another (re-queued when its lease ran out, or by the rollback first)
    outcomes = Counter(a["outcome"] for e in audit["entries"] for a in e["attempts"])
    assert outcomes["rolled_back"] > 0, outcomes
    by_killed = {a["outcome"] for e in audit["entries"] for a in e["attempts"] if a["trainer"] == result.killed[0]}
    assert by_killed - {"done"} and by_killed <= {"done", "trainer_lost", "rolled_back"}, by_killed
    # and every checkpoint the job kept is sound: none was written over by a role that took over
    files = open_checkpoint_files(checkpoints)
    pointer = store.get(Keys(result.config.name).checkpoint)
    for ckpt in json.loads(pointer.value)["history"]:
        assert files.verify(files.read_manifest(ckpt)) == [], ckpt


# --- what killing the master at scale found ----------------------------------------------


def checkpoint_round_2(store: MemoryStore, keys: Keys, master: Channel) -> str:
    """Checkpoint ``ckpt-0000-0000000002-0001`` announced as the pserver closing round 2
    announces it, and reported to the master at ``master`` (a channel) by trainer ``t``,
    the first to report it: the master snapshots its queue as that round left it."""
    ckpt = "ckpt-0000-0000000002-0001"
    info = CheckpointInfo(id=ckpt, epoch=0, round=2, mode="sync", state=State.WRITING, started=time.time())
    store.put(keys.checkpoint_info(ckpt), json.dumps(info.to_json()).encode())
    assert calls.call(master, CheckpointRequest(trainer="t", checkpoint=ckpt)).accepted
    return ckpt


def test_a_standby_master_does_not_rewrite_the_part_of_a_checkpoint_announced_before_it_took_over(tmp_path):
    """A sync checkpoint's master part is the queue as it was when the checkpoint's round
    closed: the first trainer to report the checkpoint finds it so. Kill the master after
    it wrote that part: trainers that had not reported the checkpoint yet report it to the
    standby, whose queue has moved on meanwhile (here: a task handed out). The standby
    must not write its queue as that round's (at scale it overwrote the recorded part,
    and the committed checkpoint failed its checksum at the next rollback)."""
    source = Records(4, 1)
    config = pdps.JobConfig(
        name="standby-ckpt", dataset=source.url, mode="sync", lease_ttl=1.0, checkpoint_url=f"{tmp_path.as_uri()}/ckpt"
    )
    keys, store, transport = Keys(config.name), MemoryStore(), InprocTransport()
    files = open_checkpoint_files(config.checkpoint_url)
    mortal = MortalStore(store)
    old = Master(mortal, transport, source, config, checkpoints=files)
    old.start()
    standby = Master(store, transport, source, config, checkpoints=open_checkpoint_files(config.checkpoint_url))
    trainers = [register(store, config, t) for t in ("t", "u")]
    try:
        to_old = transport.connect(old.address)
        ckpt = checkpoint_round_2(store, keys, to_old)
        task = calls.call(to_old, GetTaskRequest(trainer="t")).task  # the queue moves on
        mortal.die()
        old.stop()  # joins the writer of its part
        recorded = store.get(keys.checkpoint_part(ckpt, MASTER_PART)).value
        assert all(r["state"] == "todo" for r in files.read_json_part(PartInfo.from_json(json.loads(recorded)))["records"])

        taking_over = threading.Thread(target=standby.start, kwargs={"standby": True}, daemon=True)
        taking_over.start()
        assert standby.leading.wait(30), "the standby never took over"
        to_standby = transport.connect(standby.address)
        assert calls.call(to_standby, CheckpointRequest(trainer="u", checkpoint=ckpt)).accepted
        standby.stop()  # joins any writer of a part
        assert store.get(keys.checkpoint_part(ckpt, MASTER_PART)).value == recorded
        part = files.read_json_part(PartInfo.from_json(json.loads(recorded)))  # and the file still passes its checksum
        assert [r["state"] for r in part["records"] if r["id"] == task.id] == ["todo"]
    finally:
        for keeper in trainers:
            keeper.stop()
        old.stop()
        standby.stop()


def test_a_report_that_waited_for_a_rollback_is_judged_by_the_rolled_back_queue(tmp_path):
    """The fault job above once audited a task done twice. A trainer's finish report
    reached the master while it was rolling back (lock held): the report had looked up
    the queue before it waited for the lock, then finished the task in the queue the
    rollback had just replaced. The task was todo in the new one, so it was handed out
    and trained again, and the old queue's "done" went to the store and the audit.
    Here the lock is held while the rollback runs and the report waits for it."""
    source = Records(4, 1)
    config = pdps.JobConfig(name="report-rollback", dataset=source.url, mode="sync", lease_ttl=2.0, checkpoint_url=f"{tmp_path.as_uri()}/ckpt")
    keys, store, transport = Keys(config.name), MemoryStore(), InprocTransport()
    files = open_checkpoint_files(config.checkpoint_url)
    master = Master(store, transport, source, config, checkpoints=files)
    master.start()
    keepers = [register(store, config, t) for t in ("t", "u")]
    try:
        channel = transport.connect(master.address)
        ckpt = checkpoint_round_2(store, keys, channel)  # the queue as round 2 left it: all todo
        got = calls.call(channel, GetTaskRequest(trainer="t"))  # after the checkpoint: the rollback undoes it
        for writer in master._writers:  # the master's part of the checkpoint is written
            writer.join(10)
        part = PartInfo.from_json(json.loads(store.get(keys.checkpoint_part(ckpt, MASTER_PART)).value))
        files.write_manifest(Manifest(id=ckpt, job=config.name, round=2, epoch=0, created=time.time(), parts={MASTER_PART: part}))

        replies: list = []
        with master._lock:  # the master is busy: the report waits, as it did behind the rollback
            reporter = threading.Thread(target=lambda: replies.append(calls.call(channel, FinishTaskRequest("t", got.task.id, got.attempt))))
            reporter.start()
            time.sleep(0.3)  # it is waiting for the lock by now (wide margin)
            master._restore_epoch(recovery.rollback(store, files, keys, "a pserver restarted", checkpoint=ckpt))
        reporter.join(10)

        assert [r.accepted for r in replies] == [False], replies  # the attempt belongs to the epoch rolled back
        audit = pass_audit(store, config.name, 0)
        [entry] = [e for e in audit["entries"] if e["task"] == got.task.id]
        assert [a["outcome"] for a in entry["attempts"]] == ["rolled_back"] and entry["outcome"] == "todo", entry
        again = calls.call(channel, GetTaskRequest(trainer="u", epoch=1))
        assert (again.task.id, again.attempt) == (got.task.id, got.attempt + 1)
        assert calls.call(channel, FinishTaskRequest("u", again.task.id, again.attempt)).accepted
        entry = next(e for e in pass_audit(store, config.name, 0)["entries"] if e["task"] == got.task.id)
        assert [a["outcome"] for a in entry["attempts"]] == ["rolled_back", "done"] and entry["record_counts"] == [[1, 1]], entry
    finally:
        for keeper in keepers:
            keeper.stop()
        master.stop()
