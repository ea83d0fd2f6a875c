"""The audit a master persists on the memory store, and ``pass_audit`` reading it back.

A small job driven through the master's endpoint by hand: a trainer that fails a
task, one that times out and finishes late, a give-back, a trainer whose lease goes,
a master that restarts. The audit in the store must say exactly that.
"""

from __future__ import annotations

import json
import time

import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.shell.cli import build_parser
from pdps.core.errors import ConfigError, CorruptRecord, NoSuchJob, NoSuchPass
from pdps.core.job import JobConfig, Keys
from pdps.core.tasks import TaskSpec
from pdps.ports.transport import Message
from tests.unit.test_master_state import Clock
from pdps.roles.master import Master
from pdps.shell.status import format_pass_audit, job_status, pass_audit

KEYS = Keys("job")


class Tasks:
    """A data source that only describes ``n`` tasks of 10, 11, 12, ... records."""

    def __init__(self, n: int, records: int = 10) -> None:
        self.url = f"memory://tasks-{n}"
        self.n, self.records = n, records

    def tasks(self) -> list[TaskSpec]:
        return [TaskSpec(id=i, location="part", part=i, records=self.records + i) for i in range(self.n)]

    def read(self, task, *, start=0, batch_size):  # pragma: no cover - never called by the master
        raise AssertionError("the master must not read records")


def start(store, n: int = 4, clock=None, source=None, **settings) -> Master:
    settings = {"lease_ttl": 30.0, "task_timeout": 60.0, **settings}
    config = JobConfig(name="job", dataset=f"memory://tasks-{n}", **settings)
    master = Master(store, InprocTransport(), source or Tasks(n), config, clock=clock or Clock(1000.0))
    master.start()
    return master


def register(store, trainer: str) -> None:
    store.put(KEYS.trainer(trainer), b"{}", lease=store.grant_lease(30))


def call(master: Master, method: str, **meta) -> dict:
    return master._transport.connect(master.address).call(method, Message(meta)).meta


def take(master: Master, trainer: str) -> tuple[int, int]:
    reply = call(master, "get_task", trainer=trainer)
    assert "task" in reply, reply
    return reply["task"]["id"], reply["attempt"]


def report(master: Master, method: str, trainer: str, task: tuple[int, int]) -> dict:
    return call(master, method, trainer=trainer, task=task[0], attempt=task[1])


def stored_audit(store, pass_no: int) -> dict[int, list[str]]:
    """Task id → ``attempt:trainer:outcome[+late_finish]`` of each stored attempt."""
    out = {}
    for kv in store.range(KEYS.audit_pass(pass_no)):
        out[KEYS.task_id(kv.key)] = [
            f"{a['attempt']}:{a['trainer']}:{a['outcome']}" + ("+late_finish" if a.get("late_finish") else "") for a in json.loads(kv.value)
        ]
    return out


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


def test_the_audit_in_the_store_is_what_happened_and_every_task_of_every_pass_is_accounted_for():
    store, clock = MemoryStore(), Clock(1000.0)
    for t in ("a", "b", "c"):
        register(store, t)
    master = start(store, clock=clock, failure_max=1, passes=2)
    try:
        t0 = take(master, "a")
        report(master, "fail_task", "a", t0)  # 0: a fails it
        t1 = take(master, "b")
        report(master, "finish_task", "b", t1)  # 1: b trains it
        t2 = take(master, "a")
        clock.now += 61  # 2: a times out ...
        wait_for(lambda: json.loads(store.get(KEYS.task(t2[0])).value)["state"] == "todo")
        t3 = take(master, "c")
        report(master, "give_back", "c", t3)  # 3: c gives it back ...
        assert report(master, "finish_task", "a", t2)["accepted"] is False  # ... and a finishes 2 late
        t3b = take(master, "c")
        report(master, "finish_task", "c", t3b)  # ... and takes 3 again
        t0b = take(master, "b")
        store.delete(KEYS.trainer("b"))  # 0: b's lease goes: its second failure fails the task
        wait_for(lambda: json.loads(store.get(KEYS.task(t0b[0])).value)["state"] == "failed")
        t2b = take(master, "a")
        report(master, "finish_task", "a", t2b)  # 2: a trains it; pass 0 is complete
        assert (t0[0], t1[0], t2[0], t3[0], t3b[0], t0b[0], t2b[0]) == (0, 1, 2, 3, 3, 0, 2)
        for _ in range(4):  # pass 1: a trains every task
            report(master, "finish_task", "a", take(master, "a"))
        assert master.done.is_set()
    finally:
        master.stop()

    assert stored_audit(store, 0) == {
        0: ["1:a:failed", "2:b:trainer_lost"],
        1: ["1:b:done"],
        2: ["1:a:timeout+late_finish", "2:a:done"],
        3: ["1:c:given_back", "2:c:done"],
    }
    assert stored_audit(store, 1) == {0: ["3:a:done"], 1: ["2:a:done"], 2: ["3:a:done"], 3: ["3:a:done"]}

    first = pass_audit(store, "job", 0)
    assert (first["job"], first["pass"], first["tasks"], first["records"], first["corrupt"]) == ("job", 0, 4, 46, [])
    assert [(e["task"], e["records"], e["outcome"], e["trained"]) for e in first["entries"]] == [
        (0, 10, "failed", 0), (1, 11, "done", 1), (2, 12, "done", 1), (3, 13, "done", 1),
    ]  # fmt: skip
    # the master fenced attempt 1 of task 2 when it timed out (no step of it had committed,
    # so it applied nothing): its late finish trained nothing, and each record counts once
    assert first["entries"][2]["attempts"] == [
        {"attempt": 1, "trainer": "a", "outcome": "timeout", "applied": 0, "late_finish": True},
        {"attempt": 2, "trainer": "a", "outcome": "done"},
    ]
    assert [e["record_counts"] for e in first["entries"]] == [[[0, 10]], [[1, 11]], [[1, 12]], [[1, 13]]]
    assert first["summary"] == {
        "done": 3, "failed": 1, "pending": 0, "todo": 0,
        "records_trained": 11 + 12 + 13, "records_trained_more_than_once": 0, "records_trained_exactly_once": 36, "attempts_total": 7,
    }  # fmt: skip
    second = pass_audit(store, "job", 1)
    assert second["summary"] == {
        "done": 4, "failed": 0, "pending": 0, "todo": 0,
        "records_trained": 46, "records_trained_more_than_once": 0, "records_trained_exactly_once": 46, "attempts_total": 4,
    }  # fmt: skip
    for audit in (first, second):  # every task of every pass, done or failed
        assert [e["task"] for e in audit["entries"]] == [0, 1, 2, 3]
        assert all(e["outcome"] in ("done", "failed") for e in audit["entries"])
    assert json.loads(json.dumps(first)) == first  # JSON-safe

    text = format_pass_audit(first, "memory://")
    assert "audit of pass 0" in text
    assert "1:a:timeout+late_finish..0 2:a:done" in text and "1:a:failed..0 2:b:trainer_lost..0" in text
    assert "4 tasks: done 3, failed 1, pending 0, todo 0; 36 of 46 records trained, 0 more than once; 7 attempts" in text


def test_each_transition_is_one_transaction_with_the_task_record_and_its_audit():
    commits = []
    store = MemoryStore()
    register(store, "t")
    master = start(store)
    real_commit = store.commit

    def commit(compares, success, failure=(), *, fence=None):
        commits.append(sorted(op.key for op in success))
        return real_commit(compares, success, failure, fence=fence)

    store.commit = commit
    try:
        task = take(master, "t")
        report(master, "finish_task", "t", task)
    finally:
        master.stop()
    assert commits == [[KEYS.audit_entry(0, 0), KEYS.task(0)]] * 2


def test_a_restarted_master_appends_to_the_audit_of_the_pass():
    store = MemoryStore()
    register(store, "a")
    first = start(store, n=2)
    t0 = take(first, "a")
    report(first, "fail_task", "a", t0)
    held = take(first, "a")  # pending while the master goes away
    first.stop()

    second = start(store, n=2, clock=Clock(5.0))  # a standby taking over: another clock
    try:
        report(second, "finish_task", "a", held)
        report(second, "finish_task", "a", take(second, "a"))
        assert second.done.is_set()
    finally:
        second.stop()
    assert stored_audit(store, 0) == {0: ["1:a:failed", "2:a:done"], 1: ["1:a:done"]}
    assert pass_audit(store, "job", 0)["summary"]["done"] == 2


def test_a_pass_that_already_has_entries_appends_to_them():
    """A pass run again after a rollback keeps the attempts the rollback undid."""
    store = MemoryStore()
    register(store, "a")
    undone = [{"attempt": 2, "trainer": "x", "outcome": "rolled_back"}]
    store.put(KEYS.audit_entry(1, 0), json.dumps(undone).encode())
    master = start(store, n=1, passes=2)
    try:
        for _ in range(2):
            report(master, "finish_task", "a", take(master, "a"))
        assert master.done.is_set()
    finally:
        master.stop()
    assert stored_audit(store, 1) == {0: ["2:x:rolled_back", "2:a:done"]}
    assert pass_audit(store, "job", 1)["entries"][0]["trained"] == 1


def test_a_rollback_marks_what_the_checkpoint_does_not_keep_in_every_pass_since():
    store = MemoryStore()
    register(store, "a")
    master = start(store, n=2, passes=3)
    try:
        report(master, "finish_task", "a", take(master, "a"))
        held = take(master, "a")
        snapshot = master._queue.records()  # the checkpoint: pass 0, task 0 done, task 1 pending
        report(master, "finish_task", "a", held)
        for _ in range(2):  # pass 1, all of it
            report(master, "finish_task", "a", take(master, "a"))
        take(master, "a")  # pass 2, one pending
        with master._lock:
            master._write(master._roll_back_audit(snapshot, 0))
            assert master._audit.pass_no == 0
            assert master._roll_back_audit(snapshot, 0) == []  # idempotent
    finally:
        master.stop()
    assert stored_audit(store, 0) == {0: ["1:a:done"], 1: ["1:a:rolled_back"]}
    assert stored_audit(store, 1) == {0: ["2:a:rolled_back"], 1: ["2:a:rolled_back"]}
    assert stored_audit(store, 2) == {0: ["3:a:rolled_back"]}


def test_an_undecodable_audit_entry_is_quarantined_and_the_job_goes_on():
    store = MemoryStore()
    register(store, "a")
    first = start(store, n=2)
    report(first, "fail_task", "a", take(first, "a"))
    first.stop()
    store.put(KEYS.audit_entry(0, 0), b"\xff not json")
    store.put(KEYS.audit_entry(0, 9), b"[]")  # a task the dataset does not have
    assert pass_audit(store, "job", 0)["corrupt"] == [KEYS.audit_entry(0, 0)]  # read before any master acts

    second = start(store, n=2)
    try:
        assert store.get(KEYS.audit_entry(0, 0)) is None and store.get(KEYS.audit_entry(0, 9)) is None
        note = json.loads(store.get(KEYS.quarantined_audit(0, 0)).value)
        assert note["key"] == KEYS.audit_entry(0, 0) and "cannot decode" in note["error"]
        while "task" in (reply := call(second, "get_task", trainer="a")):
            call(second, "finish_task", trainer="a", task=reply["task"]["id"], attempt=reply["attempt"])
        assert second.done.is_set()
    finally:
        second.stop()
    assert stored_audit(store, 0) == {0: ["2:a:done"], 1: ["1:a:done"]}  # task 0's log started afresh
    audit = pass_audit(store, "job", 0)
    assert sorted(audit["corrupt"]) == [KEYS.audit_entry(0, 0), KEYS.audit_entry(0, 9)]
    assert audit["summary"]["done"] == 2
    assert job_status(store, "job")["quarantined"] == 2


def test_pass_audit_of_a_running_pass_shows_pending_and_todo():
    store = MemoryStore()
    register(store, "a")
    master = start(store, n=3, passes=3)
    try:
        report(master, "finish_task", "a", take(master, "a"))
        take(master, "a")
        audit = pass_audit(store, "job", 0)
    finally:
        master.stop()
    assert [(e["outcome"], e["trained"]) for e in audit["entries"]] == [("done", 1), ("pending", 0), ("todo", 0)]
    assert audit["entries"][2]["attempts"] == []
    assert {k: audit["summary"][k] for k in ("done", "pending", "todo", "records_trained")} == {"done": 1, "pending": 1, "todo": 1, "records_trained": 10}


def test_pass_audit_of_a_pass_or_job_that_does_not_exist_says_which_exist():
    store = MemoryStore()
    with pytest.raises(NoSuchJob, match="job 'job' does not exist"):
        pass_audit(store, "job", 0)
    start(store, passes=3).stop()
    with pytest.raises(NoSuchPass, match=r"job 'job' has no pass 1: passes 0\.\.0 exist so far \(of 3\)"):
        pass_audit(store, "job", 1)
    store.delete_prefix(KEYS.audit)
    store.put(KEYS.pass_no, b"1")  # as if pass 0 ran under a pdps without audits
    with pytest.raises(NoSuchPass, match="no audit of pass 0"):
        pass_audit(store, "job", 0)


def test_record_counts_are_kept_once_and_added_to_a_job_from_before_them():
    store = MemoryStore()
    start(store, n=3).stop()
    chunked = store.get(KEYS.queue).value
    assert json.loads(chunked)["chunks"] == 1
    assert json.loads(store.get(KEYS.queue_chunk(0)).value)["runs"] == [[0, 1, 10], [1, 1, 11], [2, 1, 12]]
    inline = b'{"tasks": 3, "records": [[0, 1, 10], [1, 1, 11], [2, 1, 12]]}'
    for older in (b'{"tasks": 3}', inline):  # written by older pdps: no counts, counts inline
        store.delete_prefix(KEYS.queue_records)
        store.put(KEYS.queue, older)
        if older == inline:
            assert pass_audit(store, "job", 0)["records"] == 33
        start(store, n=3).stop()
        assert store.get(KEYS.queue).value == chunked
        assert pass_audit(store, "job", 0)["records"] == 33
    store.put(KEYS.queue, inline.replace(b"[2, 1, 12]", b"[2, 1, 13]"))
    with pytest.raises(ConfigError, match="record counts"):
        start(store, n=3)
    store.put(KEYS.queue, chunked)
    with pytest.raises(ConfigError, match="record counts"):
        start(store, n=3, source=Tasks(3, records=20))  # the dataset changed under the job


def test_a_chunk_of_record_counts_missing_or_changed_is_named_and_rewritten_by_the_master(caplog):
    store = MemoryStore()
    start(store, n=10_000).stop()
    assert json.loads(store.get(KEYS.queue).value)["chunks"] == 3
    first, last = KEYS.queue_chunk(0), KEYS.queue_chunk(2)
    records = pass_audit(store, "job", 0)["records"]
    store.delete(first)
    store.put(last, store.get(last).value.replace(b",10001]", b",10002]"))
    with pytest.raises(CorruptRecord, match="does not match") as info:
        pass_audit(store, "job", 0)
    assert info.value.key == last
    with pytest.raises(ConfigError, match="record counts"):  # the dataset changed too: refused, nothing rewritten
        start(store, n=10_000, source=Tasks(10_000, records=11))
    assert store.get(first) is None
    start(store, n=10_000).stop()
    assert f"rewrote 2 chunks of record counts that were missing or changed ({first}, {last})" in caplog.text
    assert pass_audit(store, "job", 0)["records"] == records


@pytest.mark.parametrize("value, message", [("-1", "must be at least 0"), ("one", "expected a pass number"), ("1.5", "expected a pass number")])
def test_status_refuses_a_pass_that_is_not_a_whole_number_from_0(value, message, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["status", "memory://", "--pass", value])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_status_takes_the_store_as_an_argument_or_a_flag():
    parse = build_parser().parse_args
    assert parse(["status", "etcd://h:1", "--pass", "0"]).pass_no == 0
    assert parse(["status", "--store", "etcd://h:1"]).store_flag == "etcd://h:1"
    assert parse(["status", "etcd://h:1"]).pass_no is None
