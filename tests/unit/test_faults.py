"""``pdps.Faults``: the seeded plan of who dies when, and the refusals of faults that
cannot work. (The faults striking a running job: tests/integration/test_faults_at_scale.py.)"""

from __future__ import annotations

import pytest

import pdps
from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import ConfigError, StoreUnavailable
from pdps.core.job import JobConfig
from pdps.ports.coordination import Put
from pdps.shell.faults import Fault, MortalStore


def job(**settings) -> JobConfig:
    return JobConfig(**{"name": "f", "dataset": "memory://d", "trainers": 100, "pservers": 4, **settings})


def test_the_same_seed_gives_the_same_plan_and_another_seed_another():
    faults = pdps.Faults(seed=7, trainers=0.05, pservers=2, master=True)
    plan = faults.plan(job())
    assert plan == pdps.Faults(seed=7, trainers=0.05, pservers=2, master=True).plan(job())
    assert any(pdps.Faults(seed=s, trainers=0.05, pservers=2, master=True).plan(job()) != plan for s in range(8, 12))


def test_a_plan_kills_the_share_asked_for_each_at_its_own_moment_inside_the_window():
    plan = pdps.Faults(seed=3, trainers=0.05, pservers=2, master=True, window=(0.3, 0.6)).plan(job())
    trainers = [f.index for f in plan if f.role == "trainer"]
    pservers = [f.index for f in plan if f.role == "pserver"]
    assert len(trainers) == len(set(trainers)) == 5 and all(0 <= i < 100 for i in trainers)
    assert len(pservers) == len(set(pservers)) == 2 and all(0 <= i < 4 for i in pservers)
    assert [f for f in plan if f.role == "master"] == [Fault("master", None, next(f.at for f in plan if f.role == "master"))]
    assert [f.at for f in plan] == sorted(f.at for f in plan) and all(0.3 <= f.at <= 0.6 for f in plan)
    assert {f.target for f in plan} >= {f"trainer-{i}" for i in trainers} | {"master"}


def test_any_share_above_zero_kills_at_least_one_trainer_and_none_kills_none():
    assert [f.role for f in pdps.Faults(trainers=0.001).plan(job(trainers=10))] == ["trainer"]
    assert pdps.Faults().plan(job()) == ()


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", True), ("seed", -1), ("seed", 1.0),
        ("trainers", 1.0), ("trainers", -0.1), ("trainers", "0.01"), ("trainers", float("nan")), ("trainers", True),
        ("pservers", -1), ("pservers", 1.5), ("master", 1), ("pass_no", -1),
        ("window", (0.8, 0.2)), ("window", (0.2, 1.0)), ("window", [0.2, 0.8]), ("window", (0.2,)),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_naming_the_field(field, value):
    with pytest.raises(ConfigError, match=rf"faults\.{field} must be"):
        pdps.Faults(**{field: value})


@pytest.mark.parametrize(
    "faults,settings,words",
    [
        (pdps.Faults(trainers=0.99), {"trainers": 10}, "faults.trainers=0.99 kills 10 of the job's 10 trainers"),
        (pdps.Faults(pservers=2), {"pservers": 1}, "faults.pservers=2 kills more pservers than the job's 1"),
        (pdps.Faults(master=True, pass_no=2), {"passes": 2}, "faults.pass_no=2 is no pass of the job"),
    ],
)
def test_faults_the_job_cannot_have_are_refused_before_it_starts(faults, settings, words):
    with pytest.raises(ConfigError, match=words):
        faults.plan(job(**settings))
    store = MemoryStore()
    with pytest.raises(ConfigError, match=words):
        pdps.simulate(lambda ctx: None, dataset="memory://d", store=store, faults=faults, **{"trainers": 100, "pservers": 4, **settings})
    assert store.range("") == []  # nothing started


def test_simulate_refuses_faults_that_are_not_a_faults_value():
    with pytest.raises(ConfigError, match=r"faults must be a pdps.Faults or None, got \{'master': True\} \(dict\)"):
        pdps.simulate(lambda ctx: None, dataset="memory://d", faults={"master": True})


def test_a_dead_roles_store_neither_keeps_nor_revokes_its_lease():
    inner = MemoryStore()
    store = MortalStore(inner)
    lease = store.grant_lease(10.0)
    store.commit((), (Put("/k", b"v", lease),))
    store.keep_alive(lease)
    store.die()
    with pytest.raises(StoreUnavailable):
        store.keep_alive(lease)
    with pytest.raises(StoreUnavailable):
        store.revoke_lease(lease)
    assert inner.get("/k").value == b"v"  # the lease is left to run out, as a killed process's
    assert store.get("/k").value == b"v"  # everything else still goes through
