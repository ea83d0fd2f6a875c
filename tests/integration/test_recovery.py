"""Checkpoints and rollbacks inside one process: real roles on a memory store, real
checkpoint files on local storage. The multi-process fault-injection suite
(``test_faults.py``) kills real processes; these tests pin each mechanism down."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters import safetensors_files as files
from pdps.adapters.fsspec_storage import TEMP_PREFIX
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.parquet import ParquetSource
from pdps.adapters.safetensors_files import SafetensorsFiles
from pdps.core.job import Keys, decode_json
from pdps.registry import open_checkpoint_files, open_storage
from pdps.roles.pserver import Pserver
from pdps.runtime import recovery
from pdps.runtime.recovery import new_checkpoint_id
from tests.integration.jobkit import leftovers_on_disk, start_job
from tests.integration.test_inprocess_job import digits_like


@pytest.fixture
def source(tmp_path) -> ParquetSource:
    return digits_like(tmp_path.as_uri(), rows=720, parts=18)  # 18 tasks of 40 rows


def classify(ctx: pdps.TrainerContext) -> None:
    torch.manual_seed(0)
    model = ctx.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))


def pointer(store, job: str) -> dict | None:
    kv = store.get(Keys(job).checkpoint)
    return None if kv is None else decode_json(kv.value, kv.key)


def wait_until(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


def checkpointed_job(source, tmp_path, **settings):
    """A finished sync job that committed several checkpoints; returns (store, storage, name)."""
    store = MemoryStore()
    url = f"{tmp_path.as_uri()}/ckpt"
    result = pdps.simulate(
        classify, dataset=source, store=store, trainers=2, pservers=2, mode="sync", batch_size=16, passes=1,
        checkpoint_url=url, checkpoint_every=4, checkpoint_keep=3, min_block=1, num_slots=8, **settings,
    )
    return store, open_storage(url), result.config.name


def test_checkpoints_commit_by_pointer_keep_the_last_n_and_each_verifies(source, tmp_path):
    store, storage, job = checkpointed_job(source, tmp_path)
    ptr = pointer(store, job)
    assert ptr is not None and len(ptr["history"]) == 3 and ptr["history"][0] == ptr["id"]
    assert set(files.list_ids(storage)) >= set(ptr["history"])
    rounds = []
    for ckpt in ptr["history"]:
        manifest = files.read_manifest(storage, ckpt)
        assert files.verify(storage, manifest) == []
        assert set(manifest.parts) == {"ps-0", "ps-1", "master"}
        rounds.append(manifest.round)
        queue = files.read_json_part(storage, manifest.parts["master"])
        assert queue["round"] == manifest.round and len(queue["records"]) == len(source.tasks())
    assert rounds == sorted(rounds, reverse=True) and all(r % 4 == 0 for r in rounds)
    # older ones were deleted after the commits that superseded them; nothing in flight is left
    leftovers = set(files.list_ids(storage)) - set(ptr["history"])
    assert all(i > ptr["id"] for i in leftovers), leftovers
    assert leftovers_on_disk(tmp_path / "ckpt") == [], "deleted checkpoints take their folders with them"


@pytest.mark.parametrize("mode,restore", [("sync", "job"), ("async", "job"), ("async", "lost")])
def test_a_restarted_pserver_restores_and_the_job_finishes(source, tmp_path, mode, restore):
    """``restore="job"``: the whole job rolls back to the checkpoint (a new epoch).
    ``restore="lost"`` (async): only the restarted pserver reloads its slots."""
    job = start_job(
        source, name="rollback", mode=mode, restore=restore, trainers=2, pservers=2, min_block=1, num_slots=8,
        lease_ttl=1.0, passes=2, batch_size=8, checkpoint_url=f"{tmp_path.as_uri()}/ckpt", checkpoint_every=5,
        optimizer_args={"lr": 0.1},
    )
    try:
        ctxs = [job.trainer(f"t{i}") for i in range(2)]
        for c in ctxs:
            c.register()
        errors: list[BaseException] = []

        def run(c) -> None:
            try:
                classify(c)
            except BaseException as exc:  # reported below
                errors.append(exc)
            finally:
                c.leave()

        threads = [threading.Thread(target=run, args=(c,), daemon=True) for c in ctxs]
        for t in threads:
            t.start()
        wait_until(lambda: pointer(job.store, "rollback") is not None, 60, "a committed checkpoint")
        committed = pointer(job.store, "rollback")
        progress = (lambda: job.pservers[1].round_no) if mode == "sync" else (lambda: job.pservers[0].version)
        wait_until(lambda: progress() > committed["round"] + 3, 60, "steps after the checkpoint")
        job.pservers[1].crash()
        replacement = Pserver(
            job.store, job.transport, job.compute, job.config, index=1, claim_wait=10.0,
            checkpoints=open_checkpoint_files(job.config.checkpoint_url),
        )  # fmt: skip
        replacement.start()  # finds the job initialized: rolls everyone back
        job.pservers[1] = replacement
        for t in threads:
            t.join(timeout=120)
        assert not errors, errors
        assert job.master.done.is_set()
        epoch, _ = recovery.read_epoch(job.store, Keys("rollback"))
        if restore == "lost":
            assert epoch.epoch == 0 and job.master.epoch == 0 and replacement.epoch == 0
            assert all(c.rollbacks == 0 for c in ctxs)
            # the replacement went on from its checkpoint's version, serving every trainer (a
            # trainer whose push caught the crash gets one stale push and pulls; one whose pull
            # caught it pulls from the replacement at once: which, depends on the moment)
            assert replacement.version > committed["round"] + 3
        else:
            assert epoch.epoch == 1 and epoch.checkpoint is not None
            assert epoch.round >= committed["round"] and epoch.round % 5 == 0
            assert job.master.epoch == 1 and job.pservers[0].epoch == 1 and replacement.epoch == 1
            assert all(c.rollbacks == 1 for c in ctxs)
        summaries = [decode_json(kv.value, kv.key) for kv in job.store.range(Keys("rollback").passes)]
        assert [s["pass"] for s in summaries] == [0, 1] and all(s["done"] == len(source.tasks()) for s in summaries)
    finally:
        job.close()


def test_half_written_checkpoint_is_never_restored_and_its_parts_are_cleaned_up(source, tmp_path):
    store, storage, job = checkpointed_job(source, tmp_path, checkpoint_orphan_grace=60.0)
    keys = Keys(job)
    latest = pointer(store, job)["id"]
    # a checkpoint whose writers died between parts: ps-0 and the master wrote theirs, ps-1
    # was killed half-way through its part, and its temporary file stayed (a minute old)
    half = new_checkpoint_id(0, 10_000)
    store.put(keys.checkpoint_info(half), json.dumps({"id": half, "epoch": 0, "round": 10_000, "mode": "sync", "state": "writing", "started": time.time()}).encode())
    for name in ("ps-0", "master"):
        part = files.write_part(storage, f"{half}/{name}.safetensors", {"values": torch.ones(4)}, name=name)
        assert recovery.record_part(store, keys, half, part)
    config = pdps.JobConfig.decode(store.get(keys.config).value)
    root = tmp_path / "ckpt"

    def temp_file(ckpt_id: str, name: str, age: float) -> str:
        path = root / ckpt_id / f"{TEMP_PREFIX}{ckpt_id[-4:]}-{name}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half a part")
        os.utime(path, (time.time() - age,) * 2)
        return str(path.relative_to(root))

    temp_file(half, "ps-1.safetensors", 61)
    temp_file(latest, "manifest.json", 61)  # a second committer killed while writing the manifest
    writing = temp_file(new_checkpoint_id(0, 10_001), "ps-0.safetensors", 0)  # a live writer's: kept
    assert not recovery.try_commit(store, SafetensorsFiles(storage), config, half)  # a part is missing: no commit
    assert pointer(store, job)["id"] == latest
    epoch = recovery.rollback(store, SafetensorsFiles(storage), keys, "test", grace=config.checkpoint_orphan_grace)
    assert epoch.checkpoint == latest
    assert half not in files.list_ids(storage), "the abandoned checkpoint's parts are deleted"
    assert not store.range(f"{keys.checkpoints}{half}/"), "and so are its records"
    assert leftovers_on_disk(root) == [writing], "dead writers' files and empty folders are gone, a live one's stays"
    # a writer of the old epoch that finishes late can neither record nor commit
    part = files.write_part(storage, f"{half}/ps-1.safetensors", {"values": torch.ones(4)}, name="ps-1")
    assert not recovery.record_part(store, keys, half, part)
    assert not recovery.try_commit(store, SafetensorsFiles(storage), config, half)
    # the next commit, whose ps-1 was written again after a first attempt was killed,
    # deletes that late part with its folder, and the killed attempt's file
    after = new_checkpoint_id(1, 10_002)
    assert store.commit((), (recovery.announce(keys, after, 1, 10_002, "sync"),)).succeeded
    for name in ("ps-0", "ps-1", "master"):
        part = files.write_part(storage, f"{after}/{name}.safetensors", {"values": torch.ones(4)}, name=name)
        assert recovery.record_part(store, keys, after, part)
    temp_file(after, "ps-1.safetensors", 61)
    assert recovery.try_commit(store, SafetensorsFiles(storage), config, after)
    assert leftovers_on_disk(root) == [writing] and half not in files.list_ids(storage)


def test_corrupt_latest_checkpoint_falls_back_to_the_previous_one(source, tmp_path, caplog):
    store, storage, job = checkpointed_job(source, tmp_path)
    keys = Keys(job)
    latest, previous, third = pointer(store, job)["history"]
    manifest = files.read_manifest(storage, latest)
    path = manifest.parts["ps-1"].path
    data = bytearray(storage.get(path))
    data[-3] ^= 0xFF  # one flipped bit of a parameter value
    storage.put(path, bytes(data))
    with caplog.at_level(logging.ERROR, logger="pdps.runtime.recovery"):
        epoch = recovery.rollback(store, SafetensorsFiles(storage), keys, "test")
    assert epoch.checkpoint == previous
    assert any("falling back to checkpoint " + previous in r.getMessage() for r in caplog.records)
    assert any(latest in r.getMessage() and "crc32" in r.getMessage() for r in caplog.records)
    assert pointer(store, job)["history"] == [previous, third]  # the pointer followed the rollback
    # a missing part is treated the same
    storage.delete(files.read_manifest(storage, previous).parts["master"].path)
    assert recovery.choose(store, SafetensorsFiles(storage), keys).id == third


def test_a_rollback_to_an_older_checkpoint_moves_the_pointer_so_a_later_restart_keeps_it(source, tmp_path):
    """An operator restores B while A is the newest: a pserver restarting afterwards must
    roll back to B (or later), never to A, which belongs to the abandoned timeline."""
    store, storage, job = checkpointed_job(source, tmp_path)
    keys = Keys(job)
    newest, older = pointer(store, job)["history"][:2]
    first = recovery.rollback(store, SafetensorsFiles(storage), keys, "operator", checkpoint=older)
    assert first.checkpoint == older and pointer(store, job)["id"] == older
    assert newest not in pointer(store, job)["history"]
    again = recovery.rollback(store, SafetensorsFiles(storage), keys, "pserver 1 restarted")
    assert (again.epoch, again.checkpoint) == (2, older)
    # A failure seen in an epoch the job has left (a migration call of epoch 1 answered
    # late by a restarted source) is moot: no third epoch. A fresh-clone run rolled back
    # twice for one kill before rollbacks took the epoch the failure was seen in.
    late = recovery.rollback(store, SafetensorsFiles(storage), keys, "pserver 2 cannot receive slots [11]", since=1)
    assert late == again and recovery.read_epoch(store, keys)[0] == again
    assert recovery.rollback(store, SafetensorsFiles(storage), keys, "seen now", since=2).epoch == 3


def test_a_rollback_between_a_starting_pservers_read_of_the_epoch_and_its_watch_is_entered():
    """A pserver reads the job's epoch, then starts watching it. A fresh-clone run saw
    another pserver's restart roll the job back in between: the starting pserver never
    saw the new epoch, served the old one, refused every push for it, and the job hung
    (test_replicas_acceptance, both copies killed at once). Here the rollback is written
    the moment the watch is asked for: the pserver must come up in the new epoch."""
    from pdps.adapters.inproc import InprocTransport
    from pdps.adapters.torch_compute import TorchCompute
    from pdps.core.checkpoints import Epoch
    from pdps.roles.master import publish_job

    config = pdps.JobConfig(name="epoch-race", dataset="file:///nowhere", mode="sync", pservers=1)
    keys = Keys(config.name)

    class RollbackBeforeTheWatch(MemoryStore):
        def watch(self, prefix, callback):
            if prefix == keys.epoch:  # as another pserver's restart would, just now
                self.put(keys.epoch, json.dumps(Epoch(1, None, 0, "a pserver restarted").to_json(time.time())).encode())
            return super().watch(prefix, callback)

    store = RollbackBeforeTheWatch()
    publish_job(store, config)
    ps = Pserver(store, InprocTransport(), TorchCompute("cpu"), config)
    ps.start()
    try:
        assert ps.epoch == 1 and ps.rollbacks == 1
    finally:
        ps.stop()
        store.close()


def test_a_rollback_between_a_starting_masters_catch_up_and_its_watch_is_entered():
    """The master's start has the same gap: it catches up with the epoch, then watches it."""
    from bench.scale import Records
    from pdps.adapters.inproc import InprocTransport
    from pdps.core.checkpoints import Epoch
    from pdps.roles.master import Master

    source = Records(4, 1)
    config = pdps.JobConfig(name="epoch-race-master", dataset=source.url, mode="sync")
    keys = Keys(config.name)

    class RollbackBeforeTheWatch(MemoryStore):
        def watch(self, prefix, callback):
            if prefix == keys.epoch:
                self.put(keys.epoch, json.dumps(Epoch(1, None, 0, "a pserver restarted").to_json(time.time())).encode())
            return super().watch(prefix, callback)

    store = RollbackBeforeTheWatch()
    master = Master(store, InprocTransport(), source, config)
    master.start()
    try:
        assert master.epoch == 1
        assert json.loads(store.get(keys.state).value)["epoch"] == 1  # the queue was rolled back, and says so
    finally:
        master.stop()
        store.close()
