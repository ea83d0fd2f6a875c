"""The pieces of ``pdps.simulate_control_plane``: its clock, its latency model, its audit check."""

from __future__ import annotations

import pytest

from pdps.adapters.memory_store import MemoryStore
from pdps.core.audit import Attempt, AuditEntry, Outcome
from pdps.core.errors import ConfigError
from pdps.core.job import Keys
from pdps.ports.data import read_whole
from pdps.runtime.counting import StoreCounts
from pdps.shell.control_plane import AuditCheck, Latency, Records, SimClock, check_audit, critical_calls, simulated_seconds


def counts(calls: dict[str, int]) -> StoreCounts:
    return StoreCounts(calls=calls, reads={}, writes={}, bytes_written={}, bytes_read={}, conflicts={}, events={"tasks": 7})


def test_the_clock_stands_still_until_moved_and_never_goes_back():
    clock = SimClock()
    assert clock() == clock() == 0.0
    assert clock.advance(1.5) == 1.5 == clock()
    assert clock.advance_to(1.0) == 1.5  # earlier: stays
    assert clock.advance_to(4.0) == 4.0 == clock()
    with pytest.raises(ValueError, match="forward"):
        clock.advance(-1.0)
    assert clock() == 4.0


def test_a_lease_on_the_simulated_clock_expires_only_when_the_simulation_moves_time():
    clock = SimClock()
    store = MemoryStore(clock=clock)
    lease = store.grant_lease(10.0)
    store.put("/k", b"v", lease=lease)
    clock.advance(9.9)  # no keep-alive, however long the wall clock runs: still alive
    store.tick()
    assert store.get("/k") is not None
    clock.advance(0.2)
    store.tick()
    assert store.get("/k") is None


def test_simulated_time_is_the_mean_trainers_store_round_trips_and_messages():
    store = counts({"get": 30, "commit": 10, "keep_alive": 99, "grant_lease": 2, "watch": 5})
    messages = {"push": 40, "pull": 40, "get_task": 5, "finish_task": 5}
    trips, latencies = critical_calls(store, messages, pservers=4)
    assert trips == 40  # keep-alives, leases and watches run beside the work; events are not calls
    assert latencies == 10 + 10 + 5 + 5  # a push (or pull) to all 4 pservers is one fan-out
    latency = Latency(store_s=0.001, message_s=0.002)
    assert simulated_seconds(store, messages, trainers=2, pservers=4, latency=latency) == pytest.approx((40 * 0.001 + 30 * 0.002) / 2)


@pytest.mark.parametrize("bad", [-0.001, "1ms", True, None])
def test_a_latency_that_is_not_seconds_is_refused(bad):
    with pytest.raises(ConfigError, match="store_s"):
        Latency(store_s=bad)


def test_the_audit_check_counts_how_each_task_ended():
    store = MemoryStore()
    keys = Keys("audited")
    done = Attempt(attempt=1, trainer="trainer-0", outcome=Outcome.DONE)
    logs = {
        0: (done,),
        1: (Attempt(attempt=1, trainer="trainer-1", outcome=Outcome.TRAINER_LOST, applied=0), Attempt(attempt=2, trainer="trainer-0", outcome=Outcome.DONE)),
        2: (done, Attempt(attempt=2, trainer="trainer-1", outcome=Outcome.DONE)),
        3: (Attempt(attempt=1, trainer="trainer-0", outcome=Outcome.PENDING),),
    }  # task 4 has no entry
    for tid, attempts in logs.items():
        store.put(keys.audit_entry(0, tid), AuditEntry(0, tid, attempts).encode())
    check = check_audit(store, keys, tasks=5, records=2)
    assert check == AuditCheck(tasks=5, done_once=2, done_more=1, not_done=2, attempts=6, records=10, records_once=4, trainers=2)
    assert not check.ok
    assert AuditCheck(tasks=2, done_once=2, done_more=0, not_done=0, attempts=3, records=4, records_once=4, trainers=1).ok


def test_the_dataset_describes_its_tasks_and_refuses_a_bad_size():
    source = Records(3, 2)
    assert [(t.id, t.records) for t in source.tasks()] == [(0, 2), (1, 2), (2, 2)]
    assert read_whole(source, source.tasks()[0])["x"].shape == (2, 1)
    with pytest.raises(ConfigError, match="tasks"):
        Records(0)
