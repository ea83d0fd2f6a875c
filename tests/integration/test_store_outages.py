"""Store outages: at startup, mid-job for a while, and mid-job for too long.

Each test runs its own throwaway server so it can take it away: etcd is killed
and restarted on the same port and data (its leases survive a restart), Redis is
frozen with SIGSTOP and thawed (without persistence a restart would lose the job).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.adapters.parquet import write_parquet_shards
from pdps.core.errors import PdpsError, StoreUnavailable
from pdps.registry import connect_store
from pdps.shell.status import job_status
from tests.servers import EtcdServer, RedisServer, free_port

pytestmark = pytest.mark.integration

TASKS = 20


@pytest.fixture
def dataset(tmp_path) -> str:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(TASKS * 4, 3)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    url = f"{tmp_path.as_uri()}/data"
    write_parquet_shards({"x": x, "y": y}, url, shards=2, row_group_size=4)
    return url


def slow_train(ctx):
    """Train a tiny model, slowly enough that an outage lands mid-job."""
    gen = __import__("torch").Generator().manual_seed(0)
    model = nn.Linear(3, 2)
    for p in model.parameters():
        p.data.uniform_(-0.1, 0.1, generator=gen)
    model = ctx.attach(model)
    for batch in ctx.batches():
        ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        time.sleep(0.05)
    return ctx.steps


def run_in_thread(**kwargs):
    box: dict = {}

    def target():
        try:
            box["result"] = pdps.simulate(slow_train, **kwargs)
        except BaseException as exc:
            box["error"] = exc
        box["ended"] = time.monotonic()

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread, box


def wait_for_progress(url: str, job: str, done: int, thread: threading.Thread) -> None:
    store = connect_store(url)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and thread.is_alive():
            if store.get(f"/pdps/{job}/queue") is not None and job_status(store, job)["done"] >= done:
                return
            time.sleep(0.05)
        raise AssertionError(f"job {job} never reached {done} tasks done")
    finally:
        store.close()


# --- at startup ---------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["etcd", "redis"])
def test_an_unreachable_store_at_startup_fails_naming_the_url_after_bounded_retries(scheme, caplog):
    url = f"{scheme}://127.0.0.1:{free_port()}" + ("/0" if scheme == "redis" else "")
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        connect_store(url, timeout=1.5)
    elapsed = time.monotonic() - start
    assert url in str(info.value) and "unreachable for" in str(info.value)
    assert 1.5 <= elapsed < 15
    assert any("retrying" in r.getMessage() for r in caplog.records)  # it did retry

    cli = subprocess.run(
        [sys.executable, "-m", "pdps", "status", url, "--connect-timeout", "1"], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 2 and url in cli.stderr and "Traceback" not in cli.stderr


# --- mid-job ------------------------------------------------------------------------


def restart_etcd(server) -> None:
    server.kill()
    time.sleep(3.0)
    server.start()


def freeze_redis(server) -> None:
    server.pause()
    time.sleep(3.0)
    server.resume()


@pytest.mark.parametrize(
    "server_cls, outage, mode",
    [(EtcdServer, restart_etcd, "sync"), (RedisServer, freeze_redis, "async")],
    ids=["etcd-killed-and-restarted", "redis-frozen-and-thawed"],
)
def test_roles_pause_through_a_3s_outage_and_resume(dataset, server_cls, outage, mode):
    with server_cls() as server:
        thread, box = run_in_thread(
            dataset=dataset, store=server.url, name="outage", trainers=2, passes=2, batch_size=2, lease_ttl=10.0, mode=mode
        )
        wait_for_progress(server.url, "outage", 5, thread)
        outage(server)
        thread.join(120)
    assert not thread.is_alive()
    assert "error" not in box, box.get("error")
    result = box["result"]
    assert (result.passes, result.tasks_done, result.tasks_failed) == (2, 2 * TASKS, 0)


@pytest.mark.parametrize("server_cls", [EtcdServer, RedisServer], ids=["etcd", "redis"])
def test_an_outage_past_the_deadline_stops_the_job_with_a_clear_error(dataset, server_cls):
    server = server_cls().start()
    try:
        thread, box = run_in_thread(
            dataset=dataset, store=server.url, name="gone", trainers=2, passes=50, batch_size=2,
            lease_ttl=10.0, mode="async", store_outage_deadline=2.0,
        )  # fmt: skip
        wait_for_progress(server.url, "gone", 3, thread)
        server.kill()
        killed_at = time.monotonic()
        thread.join(90)
    finally:
        server.stop()
    assert not thread.is_alive(), "the job did not stop after the store went away"
    error = box.get("error")
    assert isinstance(error, PdpsError), box
    text = f"{error} {error.__cause__!r}"
    assert server.url in text and "unreachable for" in text and "limit 2 s" in text, text
    assert box["ended"] - killed_at < 60
