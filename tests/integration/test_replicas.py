"""Shard replicas: every slot held by ``replicas`` pservers, a primary and its backups,
each applying every closed sync round whole."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import pdps
from pdps.core.job import Keys
from pdps.runtime.resizing import read_map
from pdps.shell.status import format_status, job_status
from tests.integration.jobkit import start_job
from tests.integration.test_elastic import resize, source, train_recording  # noqa: F401 - source is a fixture
from tests.integration.test_transactional_sync import LR, closed_rounds, replay


def equals_a_replay(job, grads) -> None:
    """The job's parameters equal a replay of its closed rounds with ``grads``, in float64."""
    rounds = closed_rounds(job.store, job.config.name)
    got = torch.cat([p.reshape(-1) for p in pdps.fetch_parameters(job.store, job.transport, job.config).values()])
    torch.testing.assert_close(got, replay(rounds, grads), rtol=0, atol=1e-10)


def replace_and_replenish(job, index: int, deadline: float) -> None:
    """Start a replacement pserver at ``index`` (as a StatefulSet would) and wait, until
    ``deadline``, for every slot to have its copies again."""
    from pdps.registry import open_checkpoint_files
    from pdps.roles.pserver import Pserver

    replacement = Pserver(job.store, job.transport, job.compute, job.config, address="inproc://", index=index, claim_wait=30.0,
                          checkpoints=open_checkpoint_files(job.config.checkpoint_url))
    replacement.start()
    job.pservers[index] = replacement
    while read_map(job.store, Keys(job.config.name)).under_replicated():
        assert time.monotonic() < deadline, "no re-replication"
        time.sleep(0.02)


def copies_agree(job) -> int:
    """Every copy of every block, on every pserver the live map names as its holder, is
    the same; the copies compared."""
    live = read_map(job.store, Keys(job.config.name))
    seen: dict[str, torch.Tensor] = {}
    compared = 0
    for ps in job.pservers:
        if ps.departed.is_set():
            continue
        shard = ps._shard
        held = set(live.held_by(ps.index))
        for b, v in zip(shard.blocks, shard.views()):
            if ps._slot_of[b.key] not in held:
                continue
            if b.key in seen:
                torch.testing.assert_close(v, seen[b.key], rtol=0, atol=0)
                compared += 1
            else:
                seen[b.key] = v.clone()
    return compared


@pytest.mark.parametrize("transport", ["inproc", "grpc"])
def test_sync_with_two_replicas_trains_as_one_and_keeps_every_copy_equal(source, transport):
    from pdps.adapters.grpc_transport import GrpcTransport

    kw = {} if transport == "inproc" else {"transport": GrpcTransport(), "address": "grpc://127.0.0.1:0"}
    job = start_job(source, name=f"replicas-{transport}", mode="sync", pservers=3, replicas=2, min_block=1, num_slots=12, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=1, keep_rounds=100000, task_timeout=60.0, **kw)
    try:
        grads = train_recording(job, 2)
        equals_a_replay(job, grads)
        assert read_map(job.store, Keys(job.config.name)).replicas == 2
        assert copies_agree(job) > 0
        status = job_status(job.store, job.config.name)
        assert status["slot_map"]["replicas"] == 2 and status["slot_map"]["under_replicated"] == 0
        per = status["layout"]["per_pserver"]
        assert sum(p["slots"] for p in per) == sum(p["backups"] for p in per) == 12  # each slot: one primary, one backup
        assert sum(p["bytes"] for p in per) == sum(p["backup_bytes"] for p in per) > 0
        assert "12 slots on 3 pservers, 2 copies of each" in format_status(status, "memory://")
        assert all(ps.rollbacks == 0 for ps in job.pservers)
    finally:
        job.close()


def test_a_replicated_job_resized_keeps_two_copies_and_trains_as_one(source):
    job = start_job(source, name="replicas-resize", mode="sync", pservers=2, replicas=2, min_block=1, num_slots=12, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=1, keep_rounds=100000, task_timeout=60.0)
    try:
        grads = train_recording(job, 1, steps_before=5, during=lambda _: (resize(job, 3), resize(job, 2)))
        equals_a_replay(job, grads)
        live = read_map(job.store, Keys(job.config.name))
        assert live.num_pservers == 2 and all(len(live.holders(s)) == 2 for s in range(live.num_slots))
        assert copies_agree(job) > 0
        assert all(ps.rollbacks == 0 for ps in job.pservers)
    finally:
        job.close()


@pytest.mark.parametrize("replaced", ["after the failover", "at once"])
def test_a_pserver_that_dies_costs_no_rollback_and_its_copies_are_made_again(source, replaced):
    """Sync, 2 replicas, 3 pservers: pserver 1 dies (as a killed process: its endpoint
    gone, which the master's probe notices, revoking its claim). The master drops it
    from the map once its claim has gone, a backup becomes the primary of each of its
    slots, and training goes on in the same epoch; a replacement at index 1 gets every
    missing copy back while training continues (a replacement started at once, which
    claims the index as soon as the old claim has gone, drops the dead copies from the
    map itself if the master has not yet). Training equals a replay of the rounds, with
    nothing rolled back, and every copy agrees at the end."""
    job = start_job(source, name=f"replicas-failover-{replaced.replace(' ', '-')}", mode="sync", pservers=3, replicas=2, min_block=1, num_slots=12, lease_ttl=1.0,
                    optimizer_args={"lr": LR}, batch_size=5, passes=2, keep_rounds=100000, task_timeout=60.0)
    keys = Keys(job.config.name)
    events: dict[str, float] = {}

    def kill_and_replace(_) -> None:
        victim = job.pservers[1]
        events["killed"] = time.monotonic()
        victim.crash()
        deadline = time.monotonic() + 30
        while replaced == "after the failover" and read_map(job.store, keys).held_by(1):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.02)
        events["failed over"] = time.monotonic()
        replace_and_replenish(job, 1, deadline + 30)
        events["replenished"] = time.monotonic()

    try:
        grads = train_recording(job, 2, steps_before=8, during=kill_and_replace)
        assert set(events) == {"killed", "failed over", "replenished"}
        assert all(ps.epoch == 0 and ps.rollbacks == 0 for ps in job.pservers)
        assert all(ctx.rollbacks == 0 for ctx in job.trainers)
        equals_a_replay(job, grads)
        live = read_map(job.store, keys)
        assert not live.under_replicated() and live.held_by(1)  # the replacement holds copies again
        assert copies_agree(job) > 0
    finally:
        job.close()


def test_a_pserver_whose_lease_lapses_serves_nothing_and_its_backup_takes_over(source):
    """A primary that stops refreshing its lease (as a process stopped past its TTL, or
    cut off from the store) but keeps running: once a TTL has passed since its last
    refresh it refuses every call, closes no round and records no checkpoint part,
    while the master promotes its backups and training goes on, with no rollback."""
    from pdps.core.errors import NotReady
    from pdps.core.wire import PullRequest
    from pdps.roles import calls

    job = start_job(source, name="replicas-lapsed", mode="sync", pservers=3, replicas=2, min_block=1, num_slots=12, lease_ttl=1.0,
                    optimizer_args={"lr": LR}, batch_size=5, passes=1, keep_rounds=100000, task_timeout=60.0)
    keys = Keys(job.config.name)
    refused: list[str] = []

    def lapse(_) -> None:
        stopped = job.pservers[1]
        stopped._keeper.stop(revoke=False)  # its refreshes stop; everything else runs on
        deadline = time.monotonic() + 30
        while read_map(job.store, keys).held_by(1):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.02)
        with pytest.raises(NotReady, match="fenced"):
            calls.call(job.transport.connect(stopped.address), PullRequest("a-trainer"))
        refused.append(stopped.address)

    try:
        grads = train_recording(job, 2, steps_before=5, during=lapse)
        assert refused
        assert all(ps.epoch == 0 and ps.rollbacks == 0 for ps in job.pservers)
        equals_a_replay(job, grads)
    finally:
        job.close()


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_async_with_two_replicas_loses_no_acknowledged_push_when_a_primary_dies(source, overlap):
    """Async, 2 replicas, 3 pservers: every push a primary applied reaches its backup, in
    the primary's order, before the trainer is told; pserver 1 dies mid-job, its backups
    take over (no rollback), a replacement gets the missing copies while training goes
    on. At the end every copy of a slot is equal, and each slot's holders applied every
    push the trainers were told of (and at most the few whose answer the death cut off).
    With ``overlap``, steps are pushed in pieces while backward runs."""
    import collections

    from tests.integration.test_elastic_acceptance import train_threads, wait_steps

    job = start_job(source, name=f"replicas-async-{overlap}", mode="async", pservers=3, replicas=2, min_block=1, num_slots=12, lease_ttl=2.0,
                    optimizer="Adam", optimizer_args={"lr": 0.01}, batch_size=5, passes=2, task_timeout=60.0, overlap=overlap)
    keys = Keys(job.config.name)
    try:
        contexts, threads, steps, errors = train_threads(job, 2, delay=0.01)
        wait_steps(steps, errors, 10)
        job.pservers[1].crash()
        deadline = time.monotonic() + 30
        while read_map(job.store, keys).held_by(1):
            assert time.monotonic() < deadline, "no failover"
            time.sleep(0.02)
        replace_and_replenish(job, 1, deadline + 30)
        wait_steps(steps, errors, 5)  # training goes on with the new copies
        for th in threads:
            th.join(timeout=60)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads)
        assert all(ps.epoch == 0 and ps.rollbacks == 0 for ps in job.pservers)
        live = read_map(job.store, keys)
        assert not live.under_replicated() and live.held_by(1)
        assert copies_agree(job) > 0
        acknowledged = sum((ctx.acknowledged for ctx in contexts), collections.Counter())
        for s in range(live.num_slots):
            for holder in live.holders(s):
                applied = job.pservers[holder].applied_by_slot.get(s, 0)
                assert acknowledged[s] <= applied <= acknowledged[s] + len(contexts), (s, holder, applied, acknowledged[s])
    finally:
        job.close()


def test_an_async_job_with_replicas_refuses_a_pserver_resize_and_takes_a_trainer_one(source):
    """A primary moving while its forwards are on their way could leave its copies apart,
    so an async job with replicas keeps its pserver count (trainers may change)."""
    from pdps.core.errors import ConfigError

    job = start_job(source, name="replicas-async-scale", mode="async", pservers=2, replicas=2, min_block=1, num_slots=8, lease_ttl=2.0, passes=1)
    try:
        with pytest.raises(ConfigError, match="async with replicas = 2: this version cannot change its pserver count"):
            pdps.scale(job.store, job=job.config.name, pservers=3)
        assert read_map(job.store, Keys(job.config.name)).version == 1  # nothing asked
        asked = pdps.scale(job.store, job=job.config.name, trainers=2)
        assert asked["trainers"] == 2
    finally:
        job.close()


def test_a_dead_pservers_claim_goes_when_its_address_refuses_not_a_ttl_later(source):
    """The master probes the pservers' addresses: one that refuses connections (its
    process gone) has its lease revoked, so the failover does not wait out a long TTL."""
    job = start_job(source, name="replicas-reaped", mode="sync", pservers=3, replicas=2, min_block=1, num_slots=12, lease_ttl=30.0,
                    optimizer_args={"lr": LR}, batch_size=5, passes=1, keep_rounds=100000, task_timeout=60.0)
    keys = Keys(job.config.name)
    took: list[float] = []

    def kill(_) -> None:
        job.pservers[1].crash()  # as a killed process: its endpoint gone, its lease left to run out
        began = time.monotonic()
        while read_map(job.store, keys).held_by(1):
            assert time.monotonic() - began < 15, "no failover within half the lease TTL"
            time.sleep(0.02)
        took.append(time.monotonic() - began)

    try:
        grads = train_recording(job, 2, steps_before=5, during=kill)
        assert took and all(ps.rollbacks == 0 for ps in job.pservers)
        equals_a_replay(job, grads)
    finally:
        job.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_job_that_ends_records_no_failover_as_its_pservers_leave(source, mode):
    """The job done, its pservers stop before the master: leaving, not dying. The map
    the job ends with is the one it trained on (no failover, nothing short of copies)."""
    from pdps.adapters.memory_store import MemoryStore
    from torch import nn
    from torch.nn import functional as F

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["x"].float()), batch["y"].float()))

    store = MemoryStore()
    pdps.simulate(train, dataset=source, store=store, name=f"ends-{mode}", trainers=2, pservers=3, replicas=2, num_slots=12, mode=mode,
                  batch_size=20, optimizer="SGD", optimizer_args={"lr": 0.01})
    live = read_map(store, Keys(f"ends-{mode}"))
    assert (live.version, live.under_replicated()) == (1, [])
    status = job_status(store, f"ends-{mode}")
    assert status["slot_map"]["under_replicated"] == 0


def test_sync_overlap_a_pserver_killed_mid_push_changes_nothing_and_drops_no_step(tmp_path):
    """``pdps.simulate`` with ``Faults(pservers=1)``, sync, overlap on (each slot pushed
    as backward reaches it), 2 replicas: the push cut off by the kill is pushed again by
    the failover's map into the same round, so the job equals a run without the kill
    bit for bit and every record is in a step that was applied. The overlap pipeline
    used to turn the refused piece into a stale push and drop the step: one batch never
    trained, while the audit counted its records (a new user's comparison found it)."""
    from pdps.adapters.parquet import write_parquet_shards

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 8)).astype(np.float32)
    write_parquet_shards({"x": x, "y": (x[:, :4].sum(axis=1) > 0).astype(np.int64)}, f"{tmp_path.as_uri()}/d", shards=4, row_group_size=50)

    def fit(ctx) -> None:
        g = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
        with torch.no_grad():
            for p in model.parameters():
                p.uniform_(-0.3, 0.3, generator=g)
        model = ctx.attach(model)
        for b in ctx.batches():
            ctx.step(torch.nn.functional.cross_entropy(model(b["x"]), b["y"]))

    job = dict(dataset=f"{tmp_path.as_uri()}/d", trainers=1, pservers=2, mode="sync", batch_size=25, replicas=2, overlap="on", timeout=120)
    clean = pdps.simulate(fit, **job)
    faulty = pdps.simulate(fit, faults=pdps.Faults(seed=1, pservers=1), **job)
    (fault,) = faulty.faults
    assert 0 < fault.done < 40  # killed mid-pass (its seeded moment: 20-80% of the 40 tasks done)
    for run in (clean, faulty):
        steps = [s for h in run.history.values() for s in h]
        assert (run.steps, len(steps), sum(s.end - s.start for s in steps)) == (80, 80, 2000)
    for name, want in clean.params.items():
        assert torch.equal(faulty.params[name], want), name
