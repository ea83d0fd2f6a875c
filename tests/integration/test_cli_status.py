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
    finally:
        master.stop()


def test_status_of_a_job_that_does_not_exist_names_it(real_store):
    out = pdps_status(real_store.url, "--job", "nope", "--json")
    assert out.returncode == 1
    assert "job 'nope' does not exist" in out.stderr and out.stdout == ""


def test_status_uses_the_default_job_name(real_store):
    out = pdps_status(real_store.url)
    assert out.returncode == 1 and "job 'default' does not exist" in out.stderr
