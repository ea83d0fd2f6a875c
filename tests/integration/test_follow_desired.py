"""Whoever starts processes follows the job's desired counts (issue 16, "who starts
processes"): ``pdps launch`` starts the pservers and trainers a resize adds and lets
those a resize removes leave; ``pdps.simulate`` does the same with threads; a pserver
started with an index beyond the job's pservers (a StatefulSet scaled up first) asks
for the grow itself, and one whose index a shrink removed waits.

Written to stay true once pservers migrate slots live: they check who starts and who
claims, not the job's final slot map.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import attrs
import pytest
import torch.nn.functional as F
from torch import nn

import pdps
from pdps.core.elastic import Resize, ResizeState
from pdps.core.job import JobConfig, Keys
from pdps.core.slots import SlotMap
from pdps.registry import connect_store
from pdps.roles.master import publish_job
from pdps.runtime.resizing import read_resize, request_resize
from pdps.shell.process import make_room
from tests.integration.test_inprocess_job import digits_like

pytestmark = pytest.mark.integration

TARGETS = Path(__file__).parent / "targets"


def job_name() -> str:
    return f"f-{uuid.uuid4().hex[:8]}"


def wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture
def launched(tmp_path):
    """Start ``pdps launch ARGS`` in the background; SIGTERM what still runs at the end."""
    started: list[tuple[subprocess.Popen, Path]] = []

    def start(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
        log = tmp_path / f"launch-{len(started)}.log"
        with log.open("w") as err:
            p = subprocess.Popen([sys.executable, "-m", "pdps", *args], stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
        started.append((p, log))
        return p, log

    yield start
    for p, log in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)  # the launcher stops its roles on the way out
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        print(f"--- launch (exit {p.returncode}) ---\n{log.read_text()[-6000:]}")


def test_launch_starts_the_pservers_and_trainers_a_resize_adds(etcd_server, launched):
    """2 pservers and 2 trainers; ``pdps scale``'s request asks for 3 of each while the job
    runs: the launcher starts pserver-2 (which claims index 2) and trainer-2 (which registers)."""
    job = job_name()
    proc, log = launched(
        "launch", "--job", job, "--trainers", "2", "--pservers", "2", "--store", etcd_server.url, "--passes", "50",
        "--restart", "never", f"{TARGETS / 'slow.py'}:train", env={"SLOW_TRAIN_DELAY": "0.2"},
    )  # fmt: skip
    store, keys = connect_store(etcd_server.url), Keys(job)
    try:
        wait_until(lambda: len(store.range(keys.trainers)) == 2 or proc.poll() is not None, 120, "both trainers to register")
        assert proc.poll() is None, log.read_text()[-3000:]
        request_resize(store, keys, pservers=3, trainers=3, by="test")
        wait_until(lambda: store.get(keys.pserver(2)) is not None or proc.poll() is not None, 120, "a third pserver to claim index 2")
        wait_until(lambda: store.get(keys.trainer("trainer-2")) is not None or proc.poll() is not None, 120, "trainer-2 to register")
        assert proc.poll() is None, log.read_text()[-3000:]
    finally:
        store.close()
    said = log.read_text()
    assert "[launch] the job wants 3 pservers: starting pserver-2 (index 2)" in said
    assert "[launch] the job wants 3 trainers: starting trainer-2" in said
    assert "[pserver-2]" in said and "[trainer-2]" in said  # their logs, relayed and named
    assert "pserver-3" not in said and "trainer-3" not in said  # each started once


def test_launch_lets_a_removed_trainer_leave_and_finishes_without_it(etcd_server, launched):
    """3 trainers; the desired count drops to 2, written as an operator writes it: trainer-2
    leaves by itself (exit 0). The launcher neither restarts nor replaces it, nor counts
    it as a failure, and the job finishes with the other two."""
    job = job_name()
    proc, log = launched(
        "launch", "--job", job, "--trainers", "3", "--pservers", "1", "--store", etcd_server.url, "--passes", "2",
        "--restart", "never", "--json", f"{TARGETS / 'elastic.py'}:leave_when_fewer",
    )  # fmt: skip
    store, keys = connect_store(etcd_server.url), Keys(job)
    try:
        wait_until(lambda: len(store.range(keys.trainers)) == 3 or proc.poll() is not None, 120, "the trainers to register")
        store.put(keys.trainers_desired, b"2")
    finally:
        store.close()
    out, _ = proc.communicate(timeout=240)
    said = log.read_text()
    assert proc.returncode == 0, said[-3000:]
    assert "[launch] trainer-2 left the job (exited 0)" in said
    assert "restarting" not in said and "starting trainer-3" not in said
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["passes"] == 2 and summary["tasks_failed"] == 0 and summary["tasks_done"] == 2 * 36


def test_simulate_starts_a_trainer_when_more_are_wanted(tmp_path):
    """A raised ``trainers_desired`` gets a third trainer thread, which registers and trains."""
    source = digits_like(tmp_path.as_uri(), rows=1200, parts=24)
    name = job_name()
    store = pdps.open_store(f"memory://{name}")
    keys = Keys(name)
    joined = threading.Event()

    def train(ctx: pdps.TrainerContext) -> str:
        model = ctx.attach(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
        if ctx.trainer_id == "trainer-0":
            request_resize(store, keys, trainers=3, by="test")
        if ctx.trainer_id == "trainer-2":
            joined.set()
        joined.wait(30)  # the job goes on (no task is done) until the third trainer is in
        for batch in ctx.batches():
            ctx.step(F.cross_entropy(model(batch["x"]), batch["y"]))
        return ctx.trainer_id

    result = pdps.simulate(train, dataset=source, store=store, name=name, trainers=2, pservers=1, mode="async", batch_size=10, passes=1, optimizer="SGD", optimizer_args={"lr": 0.1})
    assert joined.is_set()
    assert sorted(result.trainers) == ["trainer-0", "trainer-1", "trainer-2"]
    assert result.trainers["trainer-2"] == "trainer-2"
    assert result.tasks_done == 24 and result.tasks_failed == 0


@pytest.fixture
def published(etcd_server):
    """A job with 2 pservers published in etcd (no role runs): its store and config."""
    store = connect_store(etcd_server.url)
    config = publish_job(store, JobConfig(name=job_name(), dataset="file:///nowhere", pservers=2, trainers=2))
    yield store, config
    store.close()


def test_a_pserver_pod_beyond_the_job_asks_for_the_grow_and_claims_its_index(etcd_server, published, tmp_path):
    """``kubectl scale`` first: a pserver started with index 2 in a 2-pserver job asks for
    a resize to 3 pservers itself, then claims index 2."""
    store, config = published
    keys = Keys(config.name)
    err = (tmp_path / "pserver.log").open("w")
    p = subprocess.Popen(
        [sys.executable, "-m", "pdps", "pserver", "--store", etcd_server.url, "--job", config.name, "--index", "2", "--listen", "127.0.0.1:0", "--metrics-port", "none"],
        stdout=subprocess.PIPE, stderr=err, text=True,
    )  # fmt: skip
    try:
        said = json.loads(p.stdout.readline())  # {"pserver": i, "address": ...} once it serves
        assert said["pserver"] == 2
        assert store.get(keys.ps_desired).value == b"3"
        resize, _ = read_resize(store, keys)
        assert resize is not None and (resize.pservers, resize.by) == (3, "pserver pod 2")
        assert json.loads(store.get(keys.pserver(2)).value)["addr"] == said["address"]
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=60)
        err.close()
        print((tmp_path / "pserver.log").read_text()[-3000:])
    assert p.returncode == 0


def test_a_pserver_pod_within_the_job_asks_for_nothing(published):
    store, config = published
    assert make_room(store, config, 1, threading.Event()) is True
    assert read_resize(store, Keys(config.name))[0] is None and store.get(Keys(config.name).ps_desired).value == b"2"


def test_a_pserver_pod_beyond_the_job_queues_behind_a_resize_in_progress(published):
    """Pods 2 and 3 start together: pod 3 asks for 4 pservers, so pod 2 claims without asking;
    pod 4, arriving during that resize, asks once it is done."""
    store, config = published
    keys = Keys(config.name)
    stop = threading.Event()
    assert make_room(store, config, 3, stop) is True
    assert store.get(keys.ps_desired).value == b"4"
    assert make_room(store, config, 2, stop) is True  # 2 < 4: nothing to ask
    first, _ = read_resize(store, keys)
    answer: list[bool] = []
    pod4 = threading.Thread(target=lambda: answer.append(make_room(store, config, 4, stop)))
    pod4.start()
    time.sleep(1.5)  # pod 4 finds the resize to 4 in progress: it waits
    assert store.get(keys.ps_desired).value == b"4" and not answer
    store.put(keys.resize, json.dumps(attrs.evolve(first, state=ResizeState.DONE).to_json()).encode())  # the master finished it
    pod4.join(30)
    assert answer == [True]
    assert store.get(keys.ps_desired).value == b"5"
    assert read_resize(store, keys)[0].by == "pserver pod 4"


def test_a_restarted_pod_whose_index_a_shrink_removed_waits(published):
    """A shrink from 3 to 2 pservers is done; pod 2, restarted by its StatefulSet before the
    operator scaled it down, must not undo the shrink: it waits, and claims once a resize
    wants 3 again."""
    store, config = published
    keys = Keys(config.name)
    three = SlotMap.initial(3, config.num_slots)
    shrink = Resize(id="shrink", state=ResizeState.DONE, pservers=2, trainers=None, requested=time.time(), from_map=three, to_map=three.rebalance(2))
    store.put(keys.resize, json.dumps(shrink.to_json()).encode())
    stop, answer = threading.Event(), []
    pod2 = threading.Thread(target=lambda: answer.append(make_room(store, config, 2, stop)))
    pod2.start()
    time.sleep(1.5)
    assert not answer and store.get(keys.ps_desired).value == b"2"  # asked for nothing
    store.put(keys.ps_desired, b"3")  # pdps scale --pservers 3
    pod2.join(30)
    assert answer == [True]
    stop.set()
    assert make_room(store, config, 3, stop) is False  # asked to stop while waiting
