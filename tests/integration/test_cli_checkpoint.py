"""``pdps checkpoint list|inspect|restore`` as a real subprocess, against checkpoints a
real sync job committed to local files through a real etcd."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.fsspec_storage import TEMP_PREFIX
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.job import Keys, decode_json
from pdps.registry import open_storage
from pdps.runtime import recovery
from tests.servers import free_port

pytestmark = pytest.mark.integration

JOB = "ckpt-cli"


def classify(ctx: pdps.TrainerContext) -> None:
    torch.manual_seed(0)
    model = ctx.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))


@pytest.fixture
def job(etcd_store, tmp_path):
    """A finished sync job on etcd that committed checkpoints every 2 rounds (3 kept).
    A checkpoint due while a pserver still writes the last one is skipped (by design),
    so the job runs about 18 rounds: 3 committed even when the disk is slow (with 9 a
    CI run once committed only 2)."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(480, 4)).astype(np.float32)
    data = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": x, "y": (x[:, 0] + x[:, 1] > 0).astype(np.int64)}, data, shards=2, row_group_size=40)
    ckpt = tmp_path / "ckpt"
    pdps.simulate(
        classify, dataset=data, store=etcd_store, name=JOB, trainers=2, pservers=2, mode="sync", batch_size=16, passes=1,
        checkpoint_url=ckpt.as_uri(), checkpoint_every=2, checkpoint_keep=3, min_block=1, num_slots=8,
    )  # fmt: skip
    pointer = decode_json(etcd_store.get(Keys(JOB).checkpoint).value, "checkpoint")
    assert len(pointer["history"]) == 3
    return etcd_store, ckpt, pointer


def round_of(store, ckpt_id: str) -> int:
    """The round checkpoint ``ckpt_id`` was taken after, as its info record says."""
    return decode_json(store.get(Keys(JOB).checkpoint_info(ckpt_id)).value, ckpt_id)["round"]


def pdps_checkpoint(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdps", "checkpoint", *args], capture_output=True, text=True, timeout=120, env=env
    )


def as_json(out: subprocess.CompletedProcess) -> dict:
    assert out.stdout, out.stderr
    return json.loads(out.stdout)


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF  # same size, different crc32: only the checksum can tell
    path.write_bytes(bytes(data))


def keep_running(store) -> None:
    # simulate() runs the job to its end, and restore refuses a done job (nothing would
    # follow the new epoch). A job whose roles still run has state "running": writing it
    # back stands in for keeping a master, pservers and trainers alive through the CLI.
    store.put(Keys(JOB).state, json.dumps({"state": "running"}).encode())


def test_list_shows_the_committed_history_newest_first_the_latest_marked_and_what_else_exists(job):
    store, ckpt, pointer = job
    storage = open_storage(ckpt.as_uri())
    orphan = "ckpt-0000-0000000001-abcd"  # a crashed writer's leftover the store never heard of
    storage.put(f"{orphan}/ps-0.safetensors", b"half a part")
    # pservers killed mid-write: one left only its temporary file, one left it in the latest checkpoint
    killed = "ckpt-0000-0000000000-dead"
    (ckpt / killed).mkdir()
    (ckpt / killed / f"{TEMP_PREFIX}1-ps-1.safetensors").write_bytes(b"half")
    stale = f"{pointer['id']}/{TEMP_PREFIX}2-manifest.json"
    (ckpt / stale).write_bytes(b"{")
    rounds = [round_of(store, i) for i in pointer["history"]]
    assert rounds == sorted(rounds, reverse=True) and rounds[0] == pointer["round"]
    writing = f"ckpt-0000-{rounds[0] + 2:010d}-beef"  # announced, no part written yet
    assert store.commit((), (recovery.announce(Keys(JOB), writing, 0, rounds[0] + 2, "sync"),)).succeeded

    out = pdps_checkpoint("list", "--store", store.url, "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    listing = as_json(out)
    assert (listing["job"], listing["storage"], listing["epoch"]) == (JOB, ckpt.as_uri(), None)
    rows = listing["checkpoints"]
    assert [r["id"] for r in rows] == [writing, *pointer["history"], orphan, killed]
    assert [r["state"] for r in rows] == ["writing", "latest", "committed", "committed", "orphan", "orphan"]
    assert [r["in_storage"] for r in rows] == [False, True, True, True, True, True]
    assert [r["round"] for r in rows] == [rounds[0] + 2, *rounds, 1, 0] and all(r["epoch"] == 0 for r in rows)
    assert rows[1]["created"] == pointer["created"] and rows[4]["created"] is None
    assert [[t["path"] for t in r["leftovers"]] for r in rows] == [[], [stale], [], [], [], [f"{killed}/{TEMP_PREFIX}1-ps-1.safetensors"]]
    left = rows[1]["leftovers"][0]
    assert left["bytes"] == 1 and left["modified"] == (ckpt / stale).stat().st_mtime and 0 <= left["age"] < 600
    assert listing["orphan_grace"] == pdps.JobConfig().checkpoint_orphan_grace

    text = pdps_checkpoint("list", store.url, "--job", JOB)  # the store as STORE_URL, as pdps status takes it
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(f"job {JOB} on {store.url}: epoch 0 (never rolled back)\n")
    lines = text.stdout.splitlines()
    assert lines[3].split()[:4] == [writing, "0", str(rounds[0] + 2), "writing"] and lines[3].endswith("missing")
    assert lines[4].split()[:4] == [pointer["id"], "0", str(rounds[0]), "latest"] and lines[4].endswith("yes")
    assert lines[7].split()[:4] == [orphan, "0", "1", "orphan"]
    assert lines[8].split()[:4] == [killed, "0", "0", "orphan"] and lines[8].endswith("yes")
    assert "leftovers of writes that never finished" in lines[9] and "checkpoint_orphan_grace" in lines[9]
    assert [line.split()[:2] for line in lines[10:]] == [[stale, "1"], [f"{killed}/{TEMP_PREFIX}1-ps-1.safetensors", "4"]]


def test_inspect_verifies_every_part_and_exits_1_naming_a_checksum_mismatch(job):
    store, ckpt, pointer = job
    out = pdps_checkpoint("inspect", "--store", store.url, "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    report = as_json(out)
    assert (report["id"], report["state"], report["round"], report["epoch"]) == (pointer["id"], "latest", pointer["round"], 0)
    assert report["sound"] is True and report["problems"] == [] and report["extra"] == {"mode": "sync", "pservers": 2}
    assert [p["name"] for p in report["parts"]] == ["master", "ps-0", "ps-1"]
    assert [p["layout"] for p in report["parts"]] == [None, "blocks", "blocks"]  # pserver parts keyed by block
    for p in report["parts"]:
        assert p["result"] == "ok" and p["checksum"].startswith("crc32:")
        assert p["bytes"] == (ckpt / p["path"]).stat().st_size

    flip_last_byte(ckpt / pointer["id"] / "ps-1.safetensors")
    bad = pdps_checkpoint("inspect", pointer["id"], "--store", store.url, "--job", JOB, "--json")
    assert bad.returncode == 1, bad.stderr
    report = as_json(bad)
    results = {p["name"]: p["result"] for p in report["parts"]}
    assert results["master"] == results["ps-0"] == "ok"
    assert "ps-1.safetensors fails its checksum: crc32:" in results["ps-1"]
    assert report["sound"] is False and report["problems"] == [results["ps-1"]]
    text = pdps_checkpoint("inspect", "--store", store.url, "--job", JOB)
    assert text.returncode == 1
    assert "UNUSABLE: 1 problem" in text.stdout and "fails its checksum" in text.stdout

    older = pdps_checkpoint("inspect", pointer["history"][1], "--store", store.url, "--job", JOB, "--json")
    assert older.returncode == 0 and as_json(older)["state"] == "committed"
    assert as_json(older)["round"] == round_of(store, pointer["history"][1])


def test_restore_refuses_a_done_job_and_rolls_a_running_one_back_to_the_newest_sound_checkpoint(job):
    store, ckpt, pointer = job
    keys = Keys(JOB)
    done = pdps_checkpoint("restore", "--store", store.url, "--job", JOB)
    assert done.returncode == 1 and f"job '{JOB}' is done" in done.stderr and done.stdout == ""
    assert store.get(keys.epoch) is None

    keep_running(store)
    latest, second, third = pointer["history"]
    flip_last_byte(ckpt / latest / "ps-0.safetensors")
    refused = pdps_checkpoint("restore", latest, "--store", store.url, "--job", JOB)
    assert refused.returncode == 1 and f"checkpoint {latest} fails verification" in refused.stderr and "crc32" in refused.stderr
    assert store.get(keys.epoch) is None  # refused before anything changed

    out = pdps_checkpoint("restore", "--store", store.url, "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    result = as_json(out)
    assert (result["checkpoint"], result["round"], result["previous"]) == (second, round_of(store, second), None)
    stored = decode_json(store.get(keys.epoch).value, keys.epoch)
    assert result["epoch"] == stored
    assert (stored["epoch"], stored["checkpoint"], stored["round"]) == (1, second, round_of(store, second))
    assert stored["reason"] == "operator: pdps checkpoint restore"
    assert (ckpt / second / "manifest.json").exists()  # what every role now loads

    status = subprocess.run([sys.executable, "-m", "pdps", "status", store.url, "--job", JOB, "--json"], capture_output=True, text=True)
    assert status.returncode == 0 and json.loads(status.stdout)["epoch"] == stored
    listing = as_json(pdps_checkpoint("list", store.url, "--job", JOB, "--json"))
    assert listing["epoch"] == stored

    text = pdps_checkpoint("restore", third, "--store", store.url, "--job", JOB)
    assert text.returncode == 0, text.stderr
    assert text.stdout.startswith(
        f"job {JOB} on {store.url}: epoch 2 starts from {third} (round {round_of(store, third)}), replacing epoch 1, from {second}"
    )
    assert "pservers reload" in text.stdout
    assert recovery.read_epoch(store, keys)[0].checkpoint == third


def forget_commit(store, pointer: dict) -> None:
    """The store loses the commit of the newest checkpoint (etcd restored from a backup
    taken just before it): the pointer is the one before, the checkpoint's records are
    gone, and its files are whole in storage."""
    keys = Keys(JOB)
    newest, before = pointer["history"][:2]
    store.delete_prefix(f"{keys.checkpoints}{newest}/")
    previous = {**pointer, "id": before, "round": round_of(store, before), "history": pointer["history"][1:]}
    store.put(keys.checkpoint, json.dumps(previous).encode())


def test_restore_of_a_checkpoint_that_is_not_committed_needs_force(job):
    store, ckpt, pointer = job
    keys = Keys(JOB)
    keep_running(store)
    newest = pointer["history"][0]
    forget_commit(store, pointer)

    refused = pdps_checkpoint("restore", newest, "--store", store.url, "--job", JOB)
    assert refused.returncode == 1 and f"checkpoint {newest} of job '{JOB}' is orphan, not committed" in refused.stderr
    assert "--force" in refused.stderr and store.get(keys.epoch) is None

    out = pdps_checkpoint("restore", newest, "--force", "--store", store.url, "--job", JOB, "--json")
    assert out.returncode == 0, out.stderr
    stored = decode_json(store.get(keys.epoch).value, keys.epoch)
    assert as_json(out)["epoch"] == stored and (stored["epoch"], stored["checkpoint"], stored["round"]) == (1, newest, pointer["round"])


def test_a_forced_restore_keeps_the_files_of_the_checkpoint_it_starts_from(job):
    store, ckpt, pointer = job
    keep_running(store)
    newest = pointer["history"][0]
    forget_commit(store, pointer)
    out = pdps_checkpoint("restore", newest, "--force", "--store", store.url, "--job", JOB)
    assert out.returncode == 0, out.stderr
    assert (ckpt / newest / "manifest.json").exists(), "the pservers of epoch 1 have nothing to load"


def test_storage_the_job_names_can_be_overridden_and_one_that_cannot_be_read_is_named(job):
    store, ckpt, pointer = job
    moved = ckpt.parent / "mounted-elsewhere"
    shutil.move(ckpt, moved)  # the operator's machine sees the files at another path

    listing = as_json(pdps_checkpoint("list", "--store", store.url, "--job", JOB, "--json"))
    assert [r["in_storage"] for r in listing["checkpoints"]] == [False, False, False]
    gone = pdps_checkpoint("inspect", "--store", store.url, "--job", JOB)
    assert gone.returncode == 1 and "has no manifest" in gone.stdout
    here = pdps_checkpoint("inspect", "--store", store.url, "--job", JOB, "--storage", moved.as_uri(), "--json")
    assert here.returncode == 0, here.stderr
    assert as_json(here)["storage"] == moved.as_uri() and as_json(here)["sound"] is True

    env = {
        **os.environ, "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1",
    }  # fmt: skip
    dead = pdps_checkpoint("list", "--store", store.url, "--job", JOB, "--storage", "s3://bucket/ckpt", env=env)
    assert dead.returncode == 2 and dead.stdout == ""
    assert "pdps: error: cannot read checkpoint storage s3://bucket/ckpt: " in dead.stderr


def test_unknown_jobs_ids_and_stores_are_named(job):
    store, _, pointer = job
    nojob = pdps_checkpoint("list", "--store", store.url, "--job", "nope", "--json")
    assert nojob.returncode == 1 and "job 'nope' does not exist" in nojob.stderr and nojob.stdout == ""
    for action in ("inspect", "restore"):
        unknown = pdps_checkpoint(action, "ckpt-0000-0000000099-dead", "--store", store.url, "--job", JOB)
        assert unknown.returncode == 1, unknown.stderr
        assert f"job '{JOB}' has no checkpoint ckpt-0000-0000000099-dead" in unknown.stderr and pointer["id"] in unknown.stderr
    notid = pdps_checkpoint("inspect", "latest", "--store", store.url, "--job", JOB)
    assert notid.returncode == 1 and "'latest' is not a checkpoint id" in notid.stderr
    url = f"etcd://127.0.0.1:{free_port()}"
    down = pdps_checkpoint("list", "--store", url, "--connect-timeout", "0.3")
    assert down.returncode == 2 and f"coordination store {url} unreachable" in down.stderr
    missing = pdps_checkpoint("list")
    assert missing.returncode == 2 and "a coordination store is required" in missing.stderr
