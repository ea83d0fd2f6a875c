"""Elastic jobs: pservers and trainers added and removed while training runs, slots
migrating pserver to pserver, and training unchanged by it."""

from __future__ import annotations

import collections
import json
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pdps
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.elastic import ResizeState
from pdps.core.job import Keys
from pdps.roles.pserver import Pserver
from pdps.registry import open_checkpoint_files
from pdps.runtime.resizing import read_map, read_resize, request_resize, wait_resized
from tests.integration.jobkit import start_job
from tests.integration.test_transactional_sync import LR, closed_rounds, flat_grad, make_model, replay


@pytest.fixture
def source(tmp_path) -> ParquetSource:
    rng = np.random.default_rng(5)
    x = rng.normal(size=(600, 4))
    y = np.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], axis=1)
    write_parquet_shards({"x": x, "y": y}, f"{tmp_path.as_uri()}/d", shards=3, row_group_size=20)
    return ParquetSource(f"{tmp_path.as_uri()}/d")


def add_pserver(job) -> Pserver:
    address = job.master.address.split("://")[0] + ("://127.0.0.1:0" if job.master.address.startswith("grpc") else "://")
    ps = Pserver(job.store, job.transport, job.compute, job.config, address=address, checkpoints=open_checkpoint_files(job.config.checkpoint_url))
    ps.start()
    job.pservers.append(ps)
    return ps


def resize(job, pservers: int, timeout: float = 60.0) -> None:
    """Ask, start the pservers a grow needs (as pdps launch does), wait until done."""
    keys = Keys(job.config.name)
    asked = request_resize(job.store, keys, pservers=pservers, by="test")
    while len([p for p in job.pservers if not p.departed.is_set()]) < pservers:
        add_pserver(job)
    done = wait_resized(job.store, keys, asked.id, deadline=time.monotonic() + timeout)
    assert done.state is ResizeState.DONE, done
    for ps in [p for p in job.pservers if p.departed.is_set()]:
        ps.stop()  # as its process would: exit 0
        job.pservers.remove(ps)


def train_recording(job, trainers: int, *, steps_before: int = 0, during=None) -> dict[tuple[int, int, str], torch.Tensor]:
    """Train ``trainers`` trainers of ``job`` on threads through the whole job, each
    step's gradient recorded by (epoch, round, trainer) for a replay; ``during(steps)``
    runs once ``steps_before`` steps are done, ``steps()`` being the steps done so far.
    Raises what a trainer raised."""
    grads: dict[tuple[int, int, str], torch.Tensor] = {}
    lock = threading.Lock()
    steps = [0]
    errors: list[BaseException] = []
    ctxs = [job.trainer(f"t{i}") for i in range(trainers)]
    for c in ctxs:
        c.register()

    def train(ctx) -> None:
        try:
            model = ctx.attach(make_model())
            for batch in ctx.batches():
                loss = F.mse_loss(model(batch["x"]), batch["y"])
                round_no = max(p.round_no for p in ctx._group.parts)
                loss.backward(retain_graph=True)
                with lock:
                    grads[(ctx.epoch, round_no, ctx.trainer_id)] = flat_grad(model)
                model.zero_grad(set_to_none=False)
                ctx.step(loss)
                with lock:
                    steps[0] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=train, args=(c,)) for c in ctxs]
    for th in threads:
        th.start()
    if during is not None:
        deadline = time.monotonic() + 30
        while steps[0] < steps_before and time.monotonic() < deadline and not errors:
            time.sleep(0.02)
        during(lambda: steps[0])
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    assert not any(th.is_alive() for th in threads)
    return grads


def test_sync_training_resized_2_3_1_2_equals_a_replay_of_its_rounds(source):
    job = start_job(source, name="elastic-sync", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=2, keep_rounds=100000, task_timeout=60.0)

    def resizes(steps) -> None:
        keys = Keys(job.config.name)
        for target in (3, 1, 2):
            deadline = time.monotonic() + 30
            before = steps()
            while steps() < before + 6 and time.monotonic() < deadline:
                time.sleep(0.02)
            resize(job, target)
            assert read_map(job.store, keys).num_pservers == target

    try:
        grads = train_recording(job, 2, during=resizes)
        rounds = closed_rounds(job.store, job.config.name)
        maps = [r.map_version for _, r in rounds if r.map_version is not None]
        assert len(maps) == 3, maps
        got = torch.cat([p.reshape(-1) for p in pdps.fetch_parameters(job.store, job.transport, job.config).values()])
        torch.testing.assert_close(got, replay(rounds, grads), rtol=0, atol=1e-10)
        assert sum(t.map_changes for t in job.trainers) >= 3
    finally:
        job.close()


def test_one_resize_at_a_time_and_counts_in_bounds(source):
    """``pdps.scale`` refuses a second resize while one is in progress, naming it, and
    counts no job can run with; the desired counts land in the store with the record."""
    from pdps.adapters.memory_store import MemoryStore
    from pdps.core.errors import ConfigError, ResizeInProgress
    from pdps.roles.master import publish_job

    store = MemoryStore()
    config = publish_job(store, pdps.JobConfig(name="bounds", dataset=source.url, pservers=2, num_slots=4))
    keys = Keys(config.name)
    for bad in ({"pservers": 0}, {"pservers": 5}, {"trainers": 0}, {}):
        with pytest.raises(ConfigError):
            pdps.scale(store, job="bounds", **bad)
    assert store.get(keys.resize) is None
    first = pdps.scale(store, job="bounds", pservers=3, trainers=4)
    assert first["state"] == "requested" and first["pservers"] == 3
    assert store.get(keys.ps_desired).value == b"3" and store.get(keys.trainers_desired).value == b"4"
    with pytest.raises(ResizeInProgress, match=first["id"]):
        pdps.scale(store, job="bounds", pservers=1)
    assert store.get(keys.ps_desired).value == b"3"


def test_a_pipeline_jobs_trainer_count_is_not_resized(source):
    """docs/pipeline.md: a pipeline job's trainers are its ranks (P x D, laid out when the
    job starts), so another trainer count is refused, nothing written; its pservers may
    still be asked for."""
    from pdps.adapters.memory_store import MemoryStore
    from pdps.core.errors import ConfigError
    from pdps.roles.master import publish_job

    store = MemoryStore()
    publish_job(store, pdps.JobConfig(name="pipes", dataset=source.url, trainers=4, pipeline_stages=2, pservers=2, num_slots=4))
    keys = Keys("pipes")
    for trainers in (2, 6, 3):
        with pytest.raises(ConfigError, match="cannot change a pipeline job's trainer count"):
            pdps.scale(store, job="pipes", pservers=3, trainers=trainers)
    assert store.get(keys.resize) is None and store.get(keys.trainers_desired) is None
    assert pdps.scale(store, job="pipes", pservers=3, trainers=4)["pservers"] == 3


def test_pdps_scale_command_asks_and_refuses_by_name(etcd_server, source):
    import json
    import subprocess
    import sys

    from pdps.registry import connect_store
    from pdps.roles.master import publish_job

    url = etcd_server.url
    store = connect_store(url)
    try:
        publish_job(store, pdps.JobConfig(name="scale-cli", dataset=source.url, pservers=2, num_slots=8))
    finally:
        store.close()
    run = lambda *a: subprocess.run([sys.executable, "-m", "pdps", "scale", "--store", url, "--job", "scale-cli", *a], capture_output=True, text=True, timeout=120)
    ok = run("--pservers", "3", "--json")
    assert ok.returncode == 0, ok.stderr
    record = json.loads(ok.stdout.strip().splitlines()[-1])
    assert record["state"] == "requested" and record["pservers"] == 3
    again = run("--pservers", "1")
    assert again.returncode == 1 and record["id"] in again.stderr and "in progress" in again.stderr
    bad = run("--pservers", "9")
    assert bad.returncode == 1 and "at most 8 pservers" in bad.stderr
    for flag, bound in (("--pservers", "at least 1 pserver"), ("--trainers", "at least 1 trainer")):  # out of bounds below too: exit 1
        zero = run(flag, "0")
        assert zero.returncode == 1 and bound in zero.stderr, zero.stderr


def test_pdps_scale_refuses_a_job_that_is_done(etcd_server, source):
    """No master is left to carry the resize out: it was written, and --wait waited forever."""
    import subprocess
    import sys

    from pdps.registry import connect_store
    from pdps.roles.master import publish_job

    store = connect_store(etcd_server.url)
    keys = Keys("scale-done")
    try:
        publish_job(store, pdps.JobConfig(name="scale-done", dataset=source.url, pservers=2, num_slots=8))
        store.put(keys.state, b'{"state": "done"}')
        argv = [sys.executable, "-m", "pdps", "scale", "--store", etcd_server.url, "--job", "scale-done", "--pservers", "3", "--wait", "--timeout", "5"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip() == "pdps: job 'scale-done' is done: there is nothing to resize (run a new job with the counts you want)"
        assert store.get(keys.resize) is None and store.get(keys.ps_desired).value == b"2"
    finally:
        store.close()


def test_fewer_trainers_wanted_the_surplus_gives_its_task_back_and_leaves(source):
    """``pdps.scale(trainers=2)`` on a sync job of 3: the last trainer stops after its
    batch, gives its task back (not a failure) and leaves; the other two finish the
    job, and every record of every pass is trained exactly once."""
    from pdps.adapters.memory_store import MemoryStore

    store = MemoryStore()
    asked = threading.Event()

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(make_model())
        for n, batch in enumerate(ctx.batches()):
            loss = F.mse_loss(model(batch["x"]), batch["y"])
            ctx.step(loss)
            if ctx.trainer_id == "trainer-0" and n == 4 and not asked.is_set():
                asked.set()
                pdps.scale(store, job=ctx.config.name, trainers=2)
            time.sleep(0.005)

    result = pdps.simulate(train, dataset=source, store=store, trainers=3, pservers=2, mode="sync", batch_size=10, passes=2,
                           lease_ttl=2.0, task_timeout=60.0, min_block=1, num_slots=8)
    assert asked.is_set()
    keys = Keys(result.config.name)
    assert store.get(keys.trainers_desired).value == b"2"
    from pdps.shell.status import pass_audit

    for pass_no in range(2):
        summary = pass_audit(store, result.config.name, pass_no)["summary"]
        assert summary["records_trained"] == 600 and summary["records_trained_more_than_once"] == 0, summary
        assert summary["failed"] == 0, summary
    assert len(result.history["trainer-2"]) < len(result.history["trainer-0"])


def train_and_leave(job) -> None:
    """Three steps of one trainer, which then leaves the job: no trainer is left."""
    ctx = job.trainer("t0")
    model = ctx.attach(make_model())
    x = torch.randn(5, 4, dtype=torch.float64)
    for _ in range(3):
        ctx.step(F.mse_loss(model(x), torch.zeros(5, 2, dtype=torch.float64)), samples=5)
    ctx.leave()
    job.trainers.clear()


@pytest.mark.parametrize("mode,wire", [("sync", "inproc"), ("async", "grpc")])
def test_a_job_with_no_trainer_left_is_resized_and_keeps_its_parameters(source, mode, wire):
    """No trainer to close a round: the master switches the map itself, the slots move
    (with Adam's state, over gRPC too), and the parameters are those the trainers left."""
    from pdps.adapters.grpc_transport import GrpcTransport

    over = {} if wire == "inproc" else {"transport": GrpcTransport(), "address": "grpc://127.0.0.1:0"}
    job = start_job(source, name=f"idle-{mode}", mode=mode, pservers=2, min_block=1, num_slots=8, lease_ttl=2.0, optimizer="Adam",
                    optimizer_args={"lr": 0.01}, **over)
    try:
        train_and_leave(job)
        before = pdps.fetch_parameters(job.store, job.transport, job.config)
        resize(job, 3)
        after = pdps.fetch_parameters(job.store, job.transport, job.config)
        assert read_map(job.store, Keys(job.config.name)).num_pservers == 3
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        assert sum(p.received_bytes for p in job.pservers) > 0
    finally:
        job.close()


def test_a_model_read_while_a_resize_moves_its_slots_starts_over_on_the_new_map(source, monkeypatch):
    """``pdps.fetch_parameters`` of a job whose slots move under it (a replenish still
    running as ``simulate`` finishes, say): the pserver refuses the read computed for the
    old map, and the read starts over on the new one. Here the resize runs between the
    read's first request being computed and its being sent."""
    from pdps.roles.trainer.pserver_client import PserverGroup

    job = start_job(source, name="elastic-fetch", mode="sync", pservers=2, min_block=1, num_slots=8, lease_ttl=2.0, optimizer_args={"lr": LR})
    try:
        train_and_leave(job)
        before = pdps.fetch_parameters(job.store, job.transport, job.config)
        ask, asked = PserverGroup.ask, []

        def resized_first(self, part, request, into=None):
            if not asked:
                asked.append(request.version)
                resize(job, 3)  # the slots move after the request was computed for the old map
            return ask(self, part, request, into)

        monkeypatch.setattr(PserverGroup, "ask", resized_first)
        after = pdps.fetch_parameters(job.store, job.transport, job.config)
        assert asked == [1] and read_map(job.store, Keys(job.config.name)).version == 2
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    finally:
        job.close()


def test_a_sync_switch_holds_up_nothing_it_need_not(source, monkeypatch):
    """What a sync resize's switch costs the trainers, by the store's own order of
    events: every pserver of the new map says its shard is built (``resize_ready``)
    before the map switches; with the slots held up on their way (a source answering
    its migrate call 1.5 s late), the trainer's push of the next round is staged on the
    receiving pserver and its contribution committed before that pserver has its slots
    (``resize_got``); no push is refused for the old map (the pull of the switching
    round told the trainer the new one); and training still equals a replay."""
    from pdps.core.errors import SlotMapChanged
    from pdps.roles.pserver import MIGRATE_DELAY_ENV

    monkeypatch.setenv(MIGRATE_DELAY_ENV, "1.5")
    refused = collections.Counter()
    check = Pserver._check_slot_map

    def counting(self, req):
        try:
            return check(self, req)
        except SlotMapChanged:
            refused[req.METHOD] += 1
            raise

    monkeypatch.setattr(Pserver, "_check_slot_map", counting)
    job = start_job(source, name="elastic-switch", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=1, keep_rounds=100000, task_timeout=60.0)
    keys = Keys(job.config.name)
    events: list = []
    watch = job.store.watch(keys.root, lambda e: events.append(e) if e.type.name == "PUT" else None)
    try:
        grads = train_recording(job, 1, steps_before=4, during=lambda _: resize(job, 3))
        watch.cancel()
        order = sorted(events, key=lambda e: e.revision)
        flip = next(i for i, e in enumerate(order) if e.key == keys.slotmap and json.loads(e.value)["version"] == 2)
        ready = {e.key.rsplit("/", 1)[1] for e in order[:flip] if e.key.startswith(keys.resize_ready(2))}
        assert ready == {"0", "1", "2"}, ready
        since = next(r for _, r in closed_rounds(job.store, job.config.name) if r.map_version == 2).round_no + 1
        committed = next(i for i, e in enumerate(order) if e.key == keys.contribution(0, since, "t0"))
        got = next(i for i, e in enumerate(order) if e.key == keys.resize_got(2, 2))
        assert flip < committed < got, (flip, committed, got)
        assert not refused, refused
        assert not list(job.store.range(keys.resize_ready(2)))  # dropped with the resize done
        rounds = closed_rounds(job.store, job.config.name)
        final = torch.cat([p.reshape(-1) for p in pdps.fetch_parameters(job.store, job.transport, job.config).values()])
        torch.testing.assert_close(final, replay(rounds, grads), rtol=0, atol=1e-10)
    finally:
        job.close()


def test_an_async_source_still_building_its_empty_shard_hands_its_slots_over(source, monkeypatch):
    """A shrink to one pserver: the leaving pserver builds its (empty) shard of the new map
    ahead, but the switch does not wait for it (it holds nothing there). Its building is
    held up 1.5 s, as on a loaded machine, so the new map reaches it mid-build and the
    receiver's migrate call comes while it waits for the build: the call waits too (the
    map is not switched until the slots are set aside), and the job goes on with no
    rollback and every acknowledged push applied."""
    prepare = Pserver._prepare

    def slow(self, to_map, trainers):
        if self.index == 1 and to_map.num_pservers == 1:
            time.sleep(1.5)
        return prepare(self, to_map, trainers)

    monkeypatch.setattr(Pserver, "_prepare", slow)
    job = start_job(source, name="elastic-async-build", mode="async", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=1, task_timeout=60.0)
    everyone = list(job.pservers)
    errors: list[BaseException] = []
    steps = [0]

    def train(ctx) -> None:
        try:
            model = ctx.attach(make_model())
            for batch in ctx.batches():
                ctx.step(F.mse_loss(model(batch["x"]), batch["y"]))
                steps[0] += 1
                time.sleep(0.02)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            errors.append(exc)

    ctx = job.trainer("t0")
    ctx.register()
    th = threading.Thread(target=train, args=(ctx,), daemon=True)
    th.start()
    try:
        deadline = time.monotonic() + 30
        while steps[0] < 5 and time.monotonic() < deadline and not errors:
            time.sleep(0.01)
        resize(job, 1)
        th.join(timeout=60)
        assert not errors and not th.is_alive(), errors
        assert [ps.epoch for ps in job.pservers] == [0]  # no rollback
        applied = collections.Counter()
        for ps in everyone:
            applied.update(ps.applied_by_slot)
        assert +applied == +ctx.acknowledged and ctx.acknowledged
    finally:
        job.close()


@pytest.mark.parametrize("when", ["growing", "migrating"])
def test_a_master_replaced_in_the_middle_of_a_resize_finishes_it(source, monkeypatch, when):
    """The master stops while a grow waits for its new pserver (``growing``) or while the
    slots are on their way (``migrating``: a source answers its migrate call 1.5 s late);
    a standby master takes the lock and carries the resize on from its record to
    ``done``. Training equals a replay, and the audit counts every record once."""
    from pdps.roles.master import Master
    from pdps.roles.pserver import MIGRATE_DELAY_ENV
    from pdps.shell.status import pass_audit

    if when == "migrating":
        monkeypatch.setenv(MIGRATE_DELAY_ENV, "1.5")
    job = start_job(source, name=f"elastic-master-{when}", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=1, keep_rounds=100000, task_timeout=60.0)
    keys = Keys(job.config.name)
    standby = Master(job.store, job.transport, source, job.config, address="inproc://", checkpoints=open_checkpoint_files(job.config.checkpoint_url))
    took_over = threading.Thread(target=standby.start, kwargs={"standby": True})
    took_over.start()

    def replace_master_mid_resize(_) -> None:
        asked = request_resize(job.store, keys, pservers=3, by="test")
        if when == "migrating":
            add_pserver(job)
        seen = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = read_resize(job.store, keys)[0]
            if seen is not None and seen.state is ResizeState(when):
                break
            time.sleep(0.01)
        assert seen is not None and seen.state is ResizeState(when), seen
        job.master.stop()
        took_over.join(timeout=30)
        assert standby.leading.is_set()
        job.master = standby
        if when == "growing":
            add_pserver(job)
        done = wait_resized(job.store, keys, asked.id, deadline=time.monotonic() + 60)
        assert done.state is ResizeState.DONE and read_map(job.store, keys).num_pservers == 3

    try:
        grads = train_recording(job, 1, steps_before=4, during=replace_master_mid_resize)
        rounds = closed_rounds(job.store, job.config.name)
        final = torch.cat([p.reshape(-1) for p in pdps.fetch_parameters(job.store, job.transport, job.config).values()])
        torch.testing.assert_close(final, replay(rounds, grads), rtol=0, atol=1e-10)
        summary = pass_audit(job.store, job.config.name, 0)["summary"]
        assert summary["records_trained"] == 600 and summary["records_trained_more_than_once"] == 0 and summary["failed"] == 0, summary
    finally:
        standby.stop()
        job.close()


def test_a_source_killed_mid_migration_costs_one_rollback_however_late_its_replacement(source, tmp_path, monkeypatch):
    """Growing 2 -> 3 (sync, one copy of each slot), pserver 0 is crashed while the
    migrate calls are held, and its replacement starts only after SOURCE_GONE lease TTLs
    (as on a busy machine: a fresh-clone run saw it take 5.5 s). The receiver waits for
    it rather than rolling the job back itself, since the replacement rolls back anyway:
    one rollback for one death, onto the new map, every record trained once."""
    from pdps.roles.pserver import MIGRATE_DELAY_ENV, SOURCE_GONE
    from pdps.runtime import recovery
    from pdps.shell.status import pass_audit

    monkeypatch.setenv(MIGRATE_DELAY_ENV, "1.5")
    step = pdps.TrainerContext.step

    def paced(self, *args, **kwargs):
        time.sleep(0.05)  # steps as long as the resize needs to flip before the job ends
        return step(self, *args, **kwargs)

    monkeypatch.setattr(pdps.TrainerContext, "step", paced)
    ttl = 0.5
    job = start_job(source, name="elastic-late-source", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=ttl,
                    optimizer_args={"lr": LR}, batch_size=10, passes=2, keep_rounds=100000, task_timeout=60.0,
                    checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=4)  # fmt: skip
    keys = Keys(job.config.name)

    def kill_a_source_mid_migration(_) -> None:
        asked = request_resize(job.store, keys, pservers=3, by="test")
        add_pserver(job)
        deadline = time.monotonic() + 30
        while read_map(job.store, keys).version < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert read_map(job.store, keys).num_pservers == 3  # flipped: the slots are on their way
        time.sleep(0.3)  # into the held calls
        job.pservers[0].crash()
        time.sleep(ttl + SOURCE_GONE * ttl + 1.0)  # its claim gone, and SOURCE_GONE TTLs more
        replacement = Pserver(job.store, job.transport, job.compute, job.config, index=0, claim_wait=10.0,
                              checkpoints=open_checkpoint_files(job.config.checkpoint_url))  # fmt: skip
        replacement.start()
        job.pservers[0] = replacement
        done = wait_resized(job.store, keys, asked.id, deadline=time.monotonic() + 60)
        assert done.state is ResizeState.DONE and read_map(job.store, keys).num_pservers == 3

    try:
        train_recording(job, 2, steps_before=6, during=kill_a_source_mid_migration)
        epoch, _ = recovery.read_epoch(job.store, keys)
        assert epoch.epoch == 1 and "pserver 0 restarted" in epoch.reason, epoch
        for pass_no in range(2):
            summary = pass_audit(job.store, job.config.name, pass_no)["summary"]
            assert summary["records_trained"] == 600 and summary["records_trained_more_than_once"] == 0 and summary["failed"] == 0, summary
    finally:
        job.close()


def test_a_pserver_that_claims_its_index_while_a_checkpoint_holds_the_grow_writes_no_part(source, tmp_path, monkeypatch):
    """A grow is asked while a checkpoint is being written (here one that never ends:
    announced, no part), so it waits in ``requested``; its new pserver starts at once,
    claims index 2 and takes its place in the rounds, holding nothing. The checkpoints
    taken meanwhile, in the 2-pserver map, commit all the same: it writes no part of
    them (a checkpoint commits with one part per pserver of its map, no more: with its
    part none ever did, and the grow waited CHECKPOINT_PATIENCE, 120 s, for them). The
    first commit deletes the stuck one, and the grow then goes on."""
    from pdps.runtime import recovery

    step = pdps.TrainerContext.step

    def paced(self, *args, **kwargs):
        time.sleep(0.05)
        return step(self, *args, **kwargs)

    monkeypatch.setattr(pdps.TrainerContext, "step", paced)
    job = start_job(source, name="elastic-early-pserver", mode="sync", pservers=2, min_block=1, num_slots=16, lease_ttl=2.0,
                    optimizer_args={"lr": LR}, batch_size=10, passes=2, keep_rounds=100000, task_timeout=60.0,
                    checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=2)  # fmt: skip
    keys = Keys(job.config.name)

    def grow_behind_a_checkpoint(_) -> None:
        stuck = recovery.announce(keys, recovery.new_checkpoint_id(0, 1), 0, 1, "sync", 2)
        job.store.put(stuck.key, stuck.value)
        asked = request_resize(job.store, keys, pservers=3, by="test")
        spare = add_pserver(job)
        assert spare.index == 2 and read_map(job.store, keys).num_pservers == 2
        placed = max(ps.round_no for ps in job.pservers)
        deadline = time.monotonic() + 30
        pointer = None
        while time.monotonic() < deadline:
            pointer, _ = recovery.read_pointer(job.store, keys)
            if pointer is not None and pointer.round > placed + 4:
                break
            time.sleep(0.02)
        assert pointer is not None and pointer.round > placed + 4, (pointer, placed)
        done = wait_resized(job.store, keys, asked.id, deadline=time.monotonic() + 30)
        assert done.state is ResizeState.DONE and read_map(job.store, keys).num_pservers == 3

    try:
        train_recording(job, 2, steps_before=4, during=grow_behind_a_checkpoint)
        assert [ps.epoch for ps in job.pservers] == [0, 0, 0]  # no rollback
    finally:
        job.close()
