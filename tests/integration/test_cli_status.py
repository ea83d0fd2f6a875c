"""``pdps status`` as a real subprocess against a job on a real etcd and Redis."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.parquet import ParquetSource, write_parquet_shards
from pdps.core.job import JobConfig, Keys
from pdps.ports.transport import Message
from pdps.roles.master import Master
from pdps.roles.pserver import claim_index

pytestmark = pytest.mark.integration

FIELDS = {"job", "pass", "todo", "pending", "done", "failed", "quarantined", "trainers", "pservers", "checkpoint"}


@pytest.fixture(params=["etcd", "redis"])
def real_store(request):
    return request.getfixturevalue(f"{request.param}_store")


def pdps_status(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdps", "status", *args], capture_output=True, text=True, timeout=60)


def test_status_shows_queues_members_and_checkpoint(real_store, tmp_path):
    url = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": np.zeros((12, 2), np.float32)}, url, shards=2, row_group_size=2)  # 6 tasks
    config = JobConfig(name="shown", dataset=url, pservers=2, passes=3, lease_ttl=30.0)
    keys = Keys(config.name)
    master = Master(real_store, InprocTransport(), ParquetSource(url), config)
    master.start()
    try:
        lease = real_store.grant_lease(30)
        for t in ("trainer-b", "trainer-a"):
            real_store.put(keys.trainer(t), b"{}", lease=lease)
        assert claim_index(real_store, keys, lease, b'{"addr": "grpc://127.0.0.1:7001"}') == 0
        channel = master._transport.connect(master.address)
        first = channel.call("get_task", Message({"trainer": "trainer-a"})).meta
        channel.call("finish_task", Message({"trainer": "trainer-a", "task": first["task"]["id"], "attempt": first["attempt"]}))
        channel.call("get_task", Message({"trainer": "trainer-a"}))

        out = pdps_status(real_store.url, "--job", "shown", "--json")
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert FIELDS <= set(status)
        assert {k: status[k] for k in ("job", "pass", "todo", "pending", "done", "failed", "quarantined", "checkpoint")} == {
            "job": "shown", "pass": 0, "todo": 4, "pending": 1, "done": 1, "failed": 0, "quarantined": 0, "checkpoint": None,
        }  # fmt: skip
        assert status["trainers"] == ["trainer-a", "trainer-b"]
        assert status["pservers"] == [{"index": 0, "address": "grpc://127.0.0.1:7001"}] and status["pservers_desired"] == 2

        real_store.put(keys.checkpoint, json.dumps({"id": "ckpt-000007", "step": 7}).encode())
        text = pdps_status(real_store.url, "--job", "shown")
        assert text.returncode == 0
        assert "todo 4, pending 1, done 1, failed 0, quarantined 0" in text.stdout
        assert "trainer-a, trainer-b" in text.stdout and "ckpt-000007" in text.stdout
        assert status["layout"] is None and "layout      none yet" in text.stdout  # no trainer has attached

        # a model of one row cannot be spread over the job's 2 pservers: status says so
        real_store.put(keys.model, json.dumps([{"name": "bias", "shape": [1], "dtype": "float32"}]).encode())
        status = json.loads(pdps_status(real_store.url, "--job", "shown", "--json").stdout)
        assert FIELDS <= set(status)
        layout = status["layout"]
        assert {k: layout[k] for k in ("blocks", "pservers", "pservers_holding")} == {"blocks": 1, "pservers": 2, "pservers_holding": 1}
        assert len(layout["idle"]) == 1 and "1 of 2 pservers hold no part of the model" in layout["warning"]
        text = pdps_status(real_store.url, "--job", "shown")
        assert "layout      1 block on 1 of 2 pservers" in text.stdout and f"WARNING: {layout['warning']}" in text.stdout
    finally:
        master.stop()


def test_status_of_a_job_that_does_not_exist_names_it(real_store):
    out = pdps_status(real_store.url, "--job", "nope", "--json")
    assert out.returncode == 1
    assert "job 'nope' does not exist" in out.stderr and out.stdout == ""


def test_a_store_given_without_a_scheme_is_a_clear_error_suggesting_one():
    out = pdps_status("127.0.0.1:2379")
    assert out.returncode == 2
    assert out.stderr.strip() == "pdps: error: coordination store '127.0.0.1:2379' has no scheme: give a URL, e.g. etcd://127.0.0.1:2379 or redis://127.0.0.1:2379"


def test_status_uses_the_default_job_name(real_store):
    out = pdps_status(real_store.url)
    assert out.returncode == 1 and "job 'default' does not exist" in out.stderr


def test_the_audit_of_every_pass_of_a_real_job_accounts_for_every_record(etcd_store, etcd_server, tmp_path):
    import pdps
    import torch.nn.functional as F
    from torch import nn

    url = f"{tmp_path.as_uri()}/data"
    rng = np.random.default_rng(0)
    x = rng.normal(size=(130, 4)).astype(np.float32)
    write_parquet_shards({"x": x, "y": (x[:, 0] > 0).astype(np.int64)}, url, shards=2, row_group_size=20)
    source = ParquetSource(url)
    sizes = {t.id: t.records for t in source.tasks()}
    assert len(set(sizes.values())) > 1  # ragged row groups: the counts per task matter

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 2)))
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))

    result = pdps.simulate(train, dataset=source, store=etcd_store, name="audited", trainers=2, passes=2, mode="async", batch_size=8)
    assert result.passes == 2 and result.tasks_failed == 0

    for n, flag in ((0, [etcd_server.url]), (1, ["--store", etcd_server.url])):
        out = pdps_status(*flag, "--job", "audited", "--pass", str(n), "--json")
        assert out.returncode == 0, out.stderr
        audit = json.loads(out.stdout)
        assert (audit["job"], audit["pass"], audit["tasks"], audit["records"]) == ("audited", n, len(sizes), 130)
        assert {e["task"]: e["records"] for e in audit["entries"]} == sizes
        for e in audit["entries"]:
            assert e["outcome"] == "done" and e["trained"] >= 1, e
            assert e["attempts"][-1]["outcome"] == "done" and e["attempts"][-1]["trainer"] in ("trainer-0", "trainer-1")
        assert audit["summary"]["records_trained"] == 130
        assert (audit["summary"]["done"], audit["summary"]["failed"]) == (len(sizes), 0)

    text = pdps_status(etcd_server.url, "--job", "audited", "--pass", "1")
    assert text.returncode == 0 and "audit of pass 1" in text.stdout
    assert f"{len(sizes)} tasks: done {len(sizes)}, failed 0, pending 0, todo 0; 130 of 130 records trained" in text.stdout
    missing = pdps_status(etcd_server.url, "--job", "audited", "--pass", "2")
    assert missing.returncode == 1 and "has no pass 2: passes 0..1 exist" in missing.stderr
    refused = pdps_status(etcd_server.url, "--pass", "-1")
    assert refused.returncode == 2 and "must be at least 0" in refused.stderr


def test_status_shows_who_waits_for_whom_and_since_when(real_store):
    import re
    import time

    from pdps.roles.trainer.discovery import Waits

    keys = Keys("waiting")
    real_store.put(keys.config, JobConfig(name="waiting").encode())
    since = time.time() - 12
    waits = Waits(real_store, keys, "t1", lambda: None)  # what a trainer at the barrier records
    waits.waiting("the barrier of round 92", ["t0"], since)
    real_store.put(keys.wait("t2"), b"not json")

    out = pdps_status(real_store.url, "--job", "waiting", "--json")
    assert out.returncode == 0, out.stderr
    status = json.loads(out.stdout)
    assert status["epoch"] is None
    first, broken = status["waits"]
    assert {k: first[k] for k in ("who", "what", "for", "since")} == {"who": "t1", "what": "the barrier of round 92", "for": ["t0"], "since": since}
    assert 12 <= first["seconds"] < 12 + 60
    assert broken["who"] == "t2" and broken["seconds"] is None and "cannot decode" in broken["error"]

    text = pdps_status(real_store.url, "--job", "waiting")
    assert text.returncode == 0, text.stderr
    clock = time.strftime("%H:%M:%S", time.localtime(since))
    line = re.search(rf"^  waiting:\n    t1 has waited (\d+)s \(since {clock}\) for t0 \(the barrier of round 92\)$", text.stdout, re.M)
    assert line and int(line.group(1)) >= 12, text.stdout
    assert "  epoch       0 (never rolled back)" in text.stdout

    waits.done()
    real_store.delete(keys.wait("t2"))
    after = pdps_status(real_store.url, "--job", "waiting", "--json")
    assert json.loads(after.stdout)["waits"] == []
    assert "waiting:" not in pdps_status(real_store.url, "--job", "waiting").stdout


def test_status_shows_the_slot_map_bytes_per_pserver_and_a_resize_as_it_goes(etcd_store):
    """A sync job of 3 pservers asked for 2: the record moves as the master moves it
    (planned, the map switched at a round boundary, receivers reporting, done)."""
    from pdps.core.slots import SlotMap
    from pdps.runtime.resizing import request_resize
    from pdps.shell.status import size_text

    store, keys = etcd_store, Keys("resizing")
    store.put(keys.config, JobConfig(name="resizing", pservers=3, trainers=2, num_slots=12).encode())
    live = SlotMap.initial(3, 12)
    store.put(keys.slotmap, json.dumps(live.to_json()).encode())
    store.put(keys.ps_desired, b"3")
    model = [{"name": "w", "shape": [96, 8], "dtype": "float32"}, {"name": "b", "shape": [8], "dtype": "float64"}]
    store.put(keys.model, json.dumps(model).encode())
    values = 96 * 8 * 4 + 8 * 8

    def status() -> dict:
        out = pdps_status(etcd_store.url, "--job", "resizing", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def text() -> str:
        out = pdps_status(etcd_store.url, "--job", "resizing")
        assert out.returncode == 0, out.stderr
        return out.stdout

    before = status()
    assert before["slot_map"] == {"version": 1, "pservers": 3, "slots": 12, "base": None, "replicas": 1, "under_replicated": 0}
    per = before["layout"]["per_pserver"]
    assert [(p["index"], p["slots"]) for p in per] == [(0, 4), (1, 4), (2, 4)]
    assert sum(p["bytes"] for p in per) == values and all(p["bytes"] > 0 for p in per)
    assert (before["pservers_desired"], before["trainers_desired"], before["resize"]) == (3, 2, None)
    shown = text()
    assert "  slot map    version 1: 12 slots on 3 pservers" in shown
    assert f"                2 not running: 4 slots, {size_text(per[2]['bytes'])} of values" in shown
    assert "resize" not in shown

    asked = request_resize(store, keys, pservers=2, trainers=4, by="pdps scale")
    requested = status()["resize"]
    assert {k: requested[k] for k in ("id", "state", "pservers", "trainers", "by", "from_version", "to_version", "slots_moving", "progress")} == {
        "id": asked.id, "state": "requested", "pservers": 2, "trainers": 4, "by": "pdps scale",
        "from_version": None, "to_version": None, "slots_moving": None, "progress": None,
    }  # fmt: skip
    assert (status()["pservers_desired"], status()["trainers_desired"]) == (2, 4)
    assert f"  resize      {asked.id} to 2 pservers, 4 trainers: requested (asked by pdps scale at " in text()

    # the master plans the shrink; a sync job keeps its map until the next round closes
    planned = asked.plan(live)
    store.put(keys.resize, json.dumps(planned.to_json()).encode())
    migrating = status()
    rec = migrating["resize"]
    assert (rec["state"], rec["from_version"], rec["to_version"]) == ("migrating", 1, 2)
    leaving = migrating["layout"]["per_pserver"][2]  # shrinking moves exactly the departing pserver's slots
    assert (rec["slots_moving"], rec["bytes_moving"]) == (leaving["slots"], leaving["bytes"])
    assert (rec["receivers"], rec["received"], rec["progress"]) == ([0, 1], [], "0 of 2 receivers")
    assert migrating["slot_map"]["version"] == 1
    assert f"migrating, map 1 -> 2 (not switched yet), {leaving['slots']} slots" in text()

    # the closing pserver switches the map; pserver 1 holds its slots
    store.put(keys.slotmap, json.dumps(planned.to_map.to_json()).encode())
    store.put(keys.resize_got(2, 1), b"{}")
    switched = status()
    assert switched["slot_map"] == {"version": 2, "pservers": 2, "slots": 12, "base": 3, "replicas": 1, "under_replicated": 0}
    assert [(p["index"], p["slots"]) for p in switched["layout"]["per_pserver"]] == [(0, 6), (1, 6)]
    assert sum(p["bytes"] for p in switched["layout"]["per_pserver"]) == values
    assert (switched["resize"]["received"], switched["resize"]["progress"]) == ([1], "1 of 2 receivers")
    shown = text()
    assert "  slot map    version 2: 12 slots on 2 pservers (blocks placed for 3)" in shown
    assert (
        f"  resize      {asked.id} to 2 pservers, 4 trainers: migrating, map 1 -> 2, "
        f"{leaving['slots']} slots ({size_text(leaving['bytes'])} of values) moving, 1 of 2 receivers hold their slots" in shown
    ), shown

    store.put(keys.resize, json.dumps(planned.finish().to_json()).encode())
    done = status()["resize"]
    assert (done["state"], done["received"], done["progress"]) == ("done", [0, 1], "2 of 2 receivers")
    assert f"  resize      last: {asked.id} to 2 pservers, 4 trainers: done" in text()

    store.put(keys.resize, b'{"id": "x"')  # an undecodable record must not break status
    broken = status()["resize"]
    assert set(broken) == {"error"} and "resize" in broken["error"]
    assert "  resize      unreadable: " in text()


def test_status_of_a_live_job_grown_in_process_counts_what_moved(tmp_path):
    """A live async job (master, pservers, a trainer that attached its model) grown
    2 -> 3 by the real master: status, read at every step of the record, ends at the new
    map, and the bytes it says moved are the bytes the new pserver received."""
    import time

    from torch import nn

    from pdps.core.elastic import ResizeState
    from pdps.roles.pserver import Pserver
    from pdps.registry import open_checkpoint_files
    from pdps.runtime.resizing import request_resize, wait_resized
    from pdps.shell.status import format_status, job_status
    from tests.integration.jobkit import start_job

    url = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": np.zeros((40, 4), np.float32)}, url, shards=2, row_group_size=10)
    job = start_job(ParquetSource(url), name="grown", mode="async", pservers=2, num_slots=16, min_block=1, lease_ttl=2.0)
    keys = Keys("grown")
    try:
        trainer = job.trainer("t0")
        trainer.register()
        model = trainer.attach(nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4)).double())
        values = sum(p.numel() * p.element_size() for p in model.parameters())
        before = job_status(job.store, "grown")
        assert before["slot_map"]["version"] == 1 and before["resize"] is None
        assert sum(p["bytes"] for p in before["layout"]["per_pserver"]) == values

        seen: list[dict] = []
        asked = request_resize(job.store, keys, pservers=3, by="test")
        grown = Pserver(job.store, job.transport, job.compute, job.config, checkpoints=open_checkpoint_files(job.config.checkpoint_url))
        grown.start()
        job.pservers.append(grown)
        done = wait_resized(job.store, keys, asked.id, deadline=time.monotonic() + 60, progress=lambda r: seen.append(job_status(job.store, "grown")))
        assert done.state is ResizeState.DONE
        assert {s["resize"]["state"] for s in seen} <= {"requested", "growing", "migrating"} and seen

        after = job_status(job.store, "grown")
        assert after["slot_map"] == {"version": 2, "pservers": 3, "slots": 16, "base": 2, "replicas": 1, "under_replicated": 0}
        rec = after["resize"]
        assert (rec["id"], rec["state"], rec["from_version"], rec["to_version"]) == (asked.id, "done", 1, 2)
        assert (rec["receivers"], rec["received"], rec["progress"]) == ([2], [2], "1 of 1 receivers")
        per = after["layout"]["per_pserver"]
        assert sorted(p["slots"] for p in per) == [5, 5, 6]
        assert sum(p["bytes"] for p in per) == values
        # a grow moves exactly the new pserver's slots, and plain SGD keeps no state beside the values
        assert rec["bytes_moving"] == per[2]["bytes"] == grown.received_bytes > 0
        assert f"  resize      last: {asked.id} to 3 pservers: done (asked by test at " in format_status(after, job.store.url)
    finally:
        job.close()
