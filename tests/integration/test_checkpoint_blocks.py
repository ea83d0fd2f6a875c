"""Checkpoints keyed by block restore onto any pserver count: through ``pdps checkpoint
restore`` into a job of another size, through a rollback after the slot map changed,
and from checkpoints written per pserver by pdps before (converted on read). Real
roles in one process, real checkpoint files on local disk and on S3 (moto)."""

from __future__ import annotations

import json
import time

import attrs
import pytest
import torch
from torch import nn

import pdps
from pdps.adapters import safetensors_files as files
from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.torch_compute import TorchCompute, TorchShard
from pdps.core.checkpoints import Manifest, PartInfo
from pdps.core.errors import ConfigError
from pdps.core.job import Keys, decode_json
from pdps.core.slots import Layout, ParamSpec, SlotMap
from pdps.registry import open_checkpoint_files, open_storage
from pdps.roles.pserver import Pserver
from pdps.runtime import recovery
from pdps.runtime.recovery import new_checkpoint_id
from pdps.shell import checkpoint_cli
from pdps.shell.sim import fetch_parameters
from tests.integration.jobkit import start_job
from tests.integration.test_inprocess_job import digits_like
from tests.integration.test_recovery import classify, wait_until

pytestmark = pytest.mark.integration

JOB = "blocks"
SLOTS = 8
ADAM = {"optimizer": "Adam", "optimizer_args": {"lr": 0.01}}
STATE = ("exp_avg", "exp_avg_sq")


@pytest.fixture(params=["file", "s3"])
def url(request, tmp_path) -> str:
    if request.param == "file":
        return f"{tmp_path.as_uri()}/ckpt"
    bucket = request.getfixturevalue("s3_env").create_bucket()
    return f"s3://{bucket}/ckpt"


@pytest.fixture
def source(tmp_path):
    return digits_like(tmp_path.as_uri(), rows=480, parts=12)


@pytest.fixture
def taken(source, url):
    """A finished sync job of 2 pservers training with Adam that committed checkpoints:
    (its store, the storage, the newest committed checkpoint's manifest)."""
    store = MemoryStore()
    pdps.simulate(
        classify, dataset=source, store=store, name=JOB, trainers=2, pservers=2, mode="sync", batch_size=16, passes=1,
        checkpoint_url=url, checkpoint_every=4, checkpoint_keep=2, min_block=1, num_slots=SLOTS, **ADAM,
    )  # fmt: skip
    pointer = decode_json(store.get(Keys(JOB).checkpoint).value, "checkpoint")
    storage = open_storage(url)
    return store, storage, files.read_manifest(storage, pointer["id"])


def pserver_parts(manifest: Manifest) -> dict[int, PartInfo]:
    return {int(name[3:]): p for name, p in manifest.parts.items() if name.startswith("ps-")}


def assembled(entries: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each parameter's values and per-element optimizer state, put together row by row
    from block entries (``<param>@<first>:<end>/<what>``)."""
    rows: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for key, t in entries.items():
        block, what = key.rsplit("/", 1)
        param, span = block.rsplit("@", 1)
        if what == "values" or (what.startswith("state.") and t.dim() > 0):
            rows.setdefault(f"{param}/{what}", []).append((int(span.split(":")[0]), t.reshape(-1)))
    return {k: torch.cat([t for _, t in sorted(parts, key=lambda x: x[0])]) for k, parts in rows.items()}


def in_checkpoint(storage, manifest: Manifest) -> tuple[dict[str, torch.Tensor], int]:
    """What a checkpoint written in blocks holds, parameter by parameter, and the
    pservers' version (sync: every pserver applies every round)."""
    entries: dict[str, torch.Tensor] = {}
    versions = set()
    for part in pserver_parts(manifest).values():
        assert part.layout == "blocks", part
        tensors = files.read_part(storage, part)
        versions.add(int(tensors.pop("pdps.version")))
        entries.update({k: v.clone() for k, v in tensors.items()})
    assert len(versions) == 1 and versions != {0}
    whole = assembled(entries)
    assert {f"0.weight/state.{k}" for k in STATE} <= set(whole)  # Adam's moments are in it
    return whole, versions.pop()


def on_pservers(pservers: list[Pserver]) -> dict[str, torch.Tensor]:
    """The same, from the pservers' shards as they are now."""
    entries: dict[str, torch.Tensor] = {}
    for ps in pservers:
        entries.update({k: v.clone() for k, v in ps._shard.export_blocks().items()})
    return assembled(entries)


def assert_restored(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for key, t in want.items():
        torch.testing.assert_close(got[key], t, rtol=0, atol=0, msg=key)


def params_of(fetched: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"{name}/values": t.reshape(-1) for name, t in fetched.items()}


def restore_into_new_job(source, url: str, pservers: int, ckpt_id: str, replicas: int = 1):
    """A fresh job of the same name with ``pservers`` pservers, a trainer attached (with
    other initial values), rolled back by ``pdps checkpoint restore`` to ``ckpt_id``."""
    job = start_job(source, name=JOB, mode="sync", pservers=pservers, replicas=replicas, min_block=1, num_slots=SLOTS, checkpoint_url=url, **ADAM)
    ctx = job.trainer("t0")
    ctx.register()
    torch.manual_seed(123)
    ctx.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    result = checkpoint_cli.restore(job.store, open_storage(url), JOB, ckpt_id, force=True)  # the new job's store never knew it
    assert result["checkpoint"] == ckpt_id and result["epoch"]["epoch"] == 1
    wait_until(lambda: all(ps.epoch == 1 and ps.state.value == "serving" for ps in job.pservers), 30, "every pserver in epoch 1")
    return job


@pytest.mark.parametrize("count", [3, 1])
def test_a_checkpoint_of_two_pservers_restores_into_a_job_of_another_count(taken, source, url, count):
    _, storage, manifest = taken
    want, version = in_checkpoint(storage, manifest)
    job = restore_into_new_job(source, url, count, manifest.id)
    try:
        assert all(ps.version == version for ps in job.pservers)
        fetched = fetch_parameters(job.store, job.transport, job.config)
        assert_restored(params_of(fetched), {k: v for k, v in want.items() if k.endswith("/values")})
        assert_restored(on_pservers(job.pservers), want)  # Adam's moments too
    finally:
        job.close()


def test_a_rollback_after_the_slot_map_changed_loads_each_pserver_its_new_blocks(taken):
    """The job grew from 2 to 3 pservers (a resized slot map keeps the first map's cut)
    and then rolls back: each pserver loads the blocks the new map gives it, from
    whichever parts of the checkpoint hold them."""
    store, storage, manifest = taken
    want, version = in_checkpoint(storage, manifest)
    keys = Keys(JOB)
    config = pdps.JobConfig.decode(store.get(keys.config).value)
    grown = SlotMap.initial(2, SLOTS).rebalance(3)
    assert any(new == 2 for _, _, new in SlotMap.initial(2, SLOTS).moves(grown))
    store.put(keys.slotmap, json.dumps(grown.to_json()).encode())
    store.put(keys.ps_desired, b"3")
    store.put(keys.state, json.dumps({"state": "running"}).encode())  # the job runs on
    config, transport = attrs.evolve(config, pservers=3), InprocTransport()
    servers = [Pserver(store, transport, TorchCompute("cpu"), config, index=i, checkpoints=open_checkpoint_files(config.checkpoint_url)) for i in range(3)]
    try:
        for ps in servers:
            ps.start()  # each finds the job initialized: a restart, which rolls back
        epoch, _ = recovery.read_epoch(store, keys)
        assert epoch.checkpoint == manifest.id and epoch.epoch >= 1
        wait_until(lambda: all(ps.epoch == epoch.epoch and ps._shard is not None and ps._shard.initialized for ps in servers), 30, "the rollback")
        assert all(ps._shard.blocks for ps in servers) and servers[2]._slot_map == grown
        assert_restored(params_of(fetch_parameters(store, transport, config)), {k: v for k, v in want.items() if k.endswith("/values")})
        assert_restored(on_pservers(servers), want)
    finally:
        for ps in servers:
            ps.stop()


def write_old_format(storage, manifest: Manifest, specs: list[ParamSpec]) -> str:
    """The checkpoint ``manifest`` describes, written again as pdps wrote checkpoints
    before they were keyed by block: each part the concatenated ``state_dict()`` of the
    shard pserver i had under the job's first slot map, plus ``pdps.version``."""
    old_id = new_checkpoint_id(manifest.epoch, manifest.round)
    entries: dict[str, torch.Tensor] = {}
    version = {}
    for i, part in pserver_parts(manifest).items():
        tensors = files.read_part(storage, part)
        version[i] = tensors.pop("pdps.version")
        entries.update({k: v.clone() for k, v in tensors.items()})
    layout = Layout.build(specs, SlotMap.initial(len(version), SLOTS), 1)
    parts = {}
    for i in version:
        shard = TorchShard(layout.blocks_of(i), ADAM["optimizer"], ADAM["optimizer_args"])
        shard.import_blocks(entries)
        old = {k: v.clone() for k, v in shard.state_dict().items()} | {"pdps.version": version[i]}
        assert "values" in old and "state.exp_avg" in old
        parts[f"ps-{i}"] = files.write_part(storage, f"{old_id}/ps-{i}.safetensors", old, name=f"ps-{i}")
    master = files.read_json_part(storage, manifest.parts["master"])
    parts["master"] = files.write_json_part(storage, f"{old_id}/master.json", master, name="master")
    old_manifest = Manifest(id=old_id, job=manifest.job, round=manifest.round, epoch=manifest.epoch, created=time.time(), parts=parts, extra=manifest.extra)
    old_json = old_manifest.to_json()
    assert all("layout" not in p for p in old_json["parts"].values())  # as pdps wrote them before
    storage.put(old_manifest.path, json.dumps(old_json).encode())
    return old_id


def model_specs(store) -> list[ParamSpec]:
    kv = store.get(Keys(JOB).model)
    return [ParamSpec.from_json(d) for d in decode_json(kv.value, kv.key)]


@pytest.mark.parametrize("count", [2, 3])
def test_a_checkpoint_written_per_pserver_before_still_restores(taken, source, url, count):
    store, storage, manifest = taken
    want, version = in_checkpoint(storage, manifest)
    old_id = write_old_format(storage, manifest, model_specs(store))
    assert files.verify(storage, files.read_manifest(storage, old_id)) == []
    job = restore_into_new_job(source, url, count, old_id)
    try:
        report = checkpoint_cli.inspect_checkpoint(job.store, storage, JOB, old_id)
        assert report["sound"] and [p["layout"] for p in report["parts"]] == [None, "pserver", "pserver"]
        assert "written by an older pdps" in checkpoint_cli.format_inspection(report, "memory")
        assert all(ps.version == version for ps in job.pservers)
        assert_restored(params_of(fetch_parameters(job.store, job.transport, job.config)), {k: v for k, v in want.items() if k.endswith("/values")})
        assert_restored(on_pservers(job.pservers), want)
    finally:
        job.close()


def test_a_checkpoint_written_per_pserver_for_another_cut_is_refused_naming_what_to_match(tmp_path):
    """An old checkpoint says neither num_slots nor min_block: loaded into a job cut
    differently, its parts do not fit, and the error says what the job must match."""
    specs = [ParamSpec("w", (40, 3), "float32"), ParamSpec("b", (40,), "float32")]

    def rows(b) -> torch.Tensor:  # each row holds its index
        return torch.arange(b.row_start, b.row_end, dtype=torch.float32).reshape(-1, *[1] * (len(b.shape) - 1)).expand(b.shape).clone()

    store, storage = MemoryStore(), open_storage(f"{tmp_path.as_uri()}/ckpt")
    store.put(Keys(JOB).model, json.dumps([s.to_json() for s in specs]).encode())
    config = pdps.JobConfig(name=JOB, dataset="file:///d", pservers=2, num_slots=SLOTS, min_block=1, **ADAM)
    ckpt_id = new_checkpoint_id(0, 4)
    then = Layout.build(specs, SlotMap.initial(2, SLOTS), 1)
    parts = {}
    for i in range(2):
        shard = TorchShard(then.blocks_of(i), ADAM["optimizer"], ADAM["optimizer_args"])
        shard.initialize([rows(b) for b in shard.blocks], "t")
        shard.apply([torch.ones(b.shape) for b in shard.blocks])
        old = {k: v.clone() for k, v in shard.state_dict().items()} | {"pdps.version": torch.tensor(4)}
        parts[f"ps-{i}"] = files.write_part(storage, f"{ckpt_id}/ps-{i}.safetensors", old, name=f"ps-{i}")
    files.write_manifest(storage, Manifest(id=ckpt_id, job=JOB, round=4, epoch=0, created=time.time(), parts=parts))

    def shard_of(cfg: pdps.JobConfig, pservers: int) -> TorchShard:
        layout = Layout.build(specs, SlotMap.initial(pservers, cfg.num_slots), cfg.min_block)
        return TorchShard(layout.blocks_of(0), ADAM["optimizer"], ADAM["optimizer_args"])

    fits = shard_of(config, 3)
    assert recovery.load_shard(store, open_checkpoint_files(storage.url), config, ckpt_id, fits) == 4
    for b, v in zip(fits.blocks, fits.views()):  # one Adam step of lr 0.01 on gradients of 1
        torch.testing.assert_close(v, rows(b) - 0.01, rtol=0, atol=1e-6)
    other = attrs.evolve(config, num_slots=SLOTS + 1)  # (twice as many would place every block as before)
    refused = shard_of(other, 3)
    with pytest.raises(ConfigError, match="num_slots") as err:
        recovery.load_shard(store, open_checkpoint_files(storage.url), other, ckpt_id, refused)
    assert ckpt_id in str(err.value) and "min_block" in str(err.value)
    assert not refused.initialized


@pytest.mark.parametrize("taken_with, restored_with", [((3, 2), (2, 1)), ((2, 1), (3, 2))])
def test_a_checkpoint_holds_each_block_once_and_restores_onto_any_replicas(source, tmp_path, taken_with, restored_with):
    """With replicas, each block is written once (by its primary); a checkpoint restores
    into a job of other pservers and replicas, every copy of a block loaded."""
    url = f"{tmp_path.as_uri()}/ckpt"
    store = MemoryStore()
    pdps.simulate(
        classify, dataset=source, store=store, name=JOB, trainers=2, pservers=taken_with[0], replicas=taken_with[1], mode="sync",
        batch_size=16, passes=1, checkpoint_url=url, checkpoint_every=4, checkpoint_keep=2, min_block=1, num_slots=SLOTS, **ADAM,
    )  # fmt: skip
    storage = open_storage(url)
    manifest = files.read_manifest(storage, decode_json(store.get(Keys(JOB).checkpoint).value, "checkpoint")["id"])
    written = [k for part in pserver_parts(manifest).values() for k in files.read_part(storage, part) if k.endswith("/values")]
    assert len(written) == len(set(written))  # no block twice
    want, _ = in_checkpoint(storage, manifest)
    job = restore_into_new_job(source, url, restored_with[0], manifest.id, replicas=restored_with[1])
    try:
        assert_restored(params_of(fetch_parameters(job.store, job.transport, job.config)), {k: v for k, v in want.items() if k.endswith("/values")})
        copies = 0
        for ps in job.pservers:  # every copy, primary or backup, holds the checkpoint's rows
            for b, v in zip(ps._shard.blocks, ps._shard.views()):
                row = b.numel // max(1, b.row_end - b.row_start)
                torch.testing.assert_close(v.reshape(-1), want[f"{b.param}/values"][b.row_start * row : b.row_end * row], rtol=0, atol=0)
                copies += 1
        assert copies == len(job.pservers[0]._layout.blocks) * restored_with[1]
    finally:
        job.close()
