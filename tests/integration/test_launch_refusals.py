"""``pdps launch`` refuses bad input before it creates the job or starts a role: one
``pdps: error:`` line, exit 2, and no job in the store (without these checks the
roles started, failed, and the job was left behind)."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import numpy as np
import pytest
import redis

import pdps.shell.launch  # noqa: F401  (imported before a test swaps sys.stdout)
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.job import Keys
from pdps.registry import open_store

pytestmark = pytest.mark.integration


@pytest.fixture
def job():
    return f"r-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "train.py"
    path.write_text("def train(ctx):\n    return None\n")
    return f"{path}:train"


@pytest.fixture
def dataset(tmp_path):
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    url = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": x, "y": (x[:, 0] > 10).astype(np.int64)}, url, shards=1, row_group_size=10)
    return url


def launch(*args: str) -> tuple[int, str]:
    """``pdps launch ARGS`` (a failing job gives up at once): its exit code and the
    ``pdps: error:`` lines it printed."""
    argv = [sys.executable, "-m", "pdps", "launch", "--restart", "never", "--timeout", "30", "--pservers", "1", "--trainers", "1", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pdps: error:")]
    return proc.returncode, "\n".join(errors) or proc.stderr[-3000:]


def no_job(url: str, job: str) -> bool:
    store = open_store(url)
    try:
        return not store.range(Keys(job).root)
    finally:
        store.close()


def test_a_missing_dataset_is_refused_before_the_job_exists(etcd_server, job, target, tmp_path):
    code, error = launch("--store", etcd_server.url, "--job", job, "--dataset", f"{tmp_path.as_uri()}/nowhere", target)
    assert code == 2
    assert error.startswith("pdps: error: no dataset at") and "nowhere" in error, error
    assert no_job(etcd_server.url, job)


def test_unreadable_tls_files_are_refused_before_the_job_exists(etcd_server, job, target, dataset, tmp_path):
    missing = tmp_path / "no-such-cert.pem"
    code, error = launch(
        "--store", etcd_server.url, "--job", job, "--dataset", dataset, "--tls-cert", str(missing), "--tls-key", str(missing), target
    )
    assert code == 2
    assert error == f"pdps: error: tls_cert {missing} is not a readable file"
    assert no_job(etcd_server.url, job)


def test_an_unknown_optimizer_is_refused_before_the_job_exists(etcd_server, job, target, dataset):
    code, error = launch("--store", etcd_server.url, "--job", job, "--dataset", dataset, "--optimizer", "Lion", target)
    assert code == 2
    assert error.startswith("pdps: error:") and "'Lion'" in error, error
    assert no_job(etcd_server.url, job)


def test_a_memory_store_is_refused_for_role_processes(job, target, dataset):
    code, error = launch("--store", "memory://", "--job", job, "--dataset", dataset, target)
    assert code == 2
    assert error.startswith("pdps: error: store memory:// is in this process's memory") and "etcd:// or redis://" in error, error


def test_a_redis_that_cannot_deliver_watches_is_refused_before_the_job_exists(redis_server, job, target, dataset):
    server = redis.Redis(host="127.0.0.1", port=redis_server.port)
    flags = server.config_get("notify-keyspace-events")["notify-keyspace-events"]
    server.config_set("notify-keyspace-events", "")
    try:
        code, error = launch("--store", redis_server.url, "--job", job, "--dataset", dataset, target)
    finally:
        server.config_set("notify-keyspace-events", flags)
    assert code == 2
    assert error.startswith(f"pdps: error: redis at {redis_server.url} has notify-keyspace-events=''"), error
    assert no_job(redis_server.url, job)


def test_launch_called_in_process_prints_where_stdout_is_now(capsys, target, dataset, job):
    """``cli.main(["launch", ...])`` in a process whose ``sys.stdout`` was swapped after
    pdps was imported (pytest's capture, a notebook) prints its --json line there."""
    from pdps.shell import cli

    assert cli.main(["launch", "--store", "memory://", "--job", job, "--dataset", dataset, "--json", target]) == 2
    out = capsys.readouterr().out
    line = json.loads(out.strip().splitlines()[-1])
    assert line["job"] == job and "memory://" in line["error"], out


@pytest.mark.parametrize("hook", ["before-job", "evaluate"])
def test_a_hook_that_cannot_be_imported_is_refused_before_the_job_exists(etcd_server, job, target, tmp_path, hook):
    """docs/online.md: a hook that cannot be imported is a ConfigError naming it, raised
    before the master starts (the master process would fail on it, restarted until
    max_restarts ran out)."""
    landing = tmp_path / "landing"
    landing.mkdir()
    code, error = launch(
        "--store", etcd_server.url, "--job", job, "--dataset", f"{landing.as_uri()}?follow=1", "--window-records", "10",
        "--windows", "1", f"--{hook}", "no_such_module_xyz:fn", target,
    )  # fmt: skip
    name = hook.replace("-", "_")
    assert code == 2
    assert error.startswith(f"pdps: error: {name} 'no_such_module_xyz:fn': cannot import 'no_such_module_xyz'"), error
    assert no_job(etcd_server.url, job)
