"""What ``pdps status`` says about a streaming job (docs/online.md): the ``stream`` field
and its human line, and the audits a streaming job has (windows, not passes)."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pdps
from pdps import streams
from pdps.adapters.memory_store import MemoryStore
from pdps.core.errors import NoSuchPass
from pdps.core.job import Keys
from pdps.shell.status import format_status, job_status, pass_audit, stream_text

pytestmark = pytest.mark.integration


def train(ctx: pdps.TrainerContext) -> None:
    model = ctx.attach(torch.nn.Linear(3, 1).double())
    for batch in ctx.batches():
        ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))


@pytest.fixture(scope="module")
def finished():
    """A streaming job of 3 windows of 40 records, run to its end: (store, job)."""
    rng = np.random.default_rng(1)
    url = f"memory-stream://status-{uuid.uuid4().hex[:8]}"
    streams.append(url, {"x": rng.normal(size=(150, 3)), "y": rng.normal(size=150)})
    store = MemoryStore()
    result = pdps.simulate(train, dataset=url, store=store, trainers=2, window_records=40, windows=3, task_records=20, timeout=60)
    return store, result.config.name


def test_a_done_job_has_nothing_untrained_whatever_lag_the_master_wrote_last(finished):
    # The master measures its lag about once a second; a job can end (and its master
    # stop) between two measures, leaving the last one from before the last tasks ran.
    store, job = finished
    keys = Keys(job)
    stale = json.loads(store.get(keys.stream_lag).value)
    stale.update(tasks_untrained=1, records_untrained=20)
    store.put(keys.stream_lag, json.dumps(stale).encode())
    stream = job_status(store, job)["stream"]
    assert (stream["tasks_untrained"], stream["records_untrained"]) == (0, 0), stream
    assert stream["records_untasked"] == 30  # after the last window: never tasked, still in the stream


def test_the_human_line_tells_windows_closed_from_windows_opened(finished):
    store, job = finished
    status = job_status(store, job)
    assert stream_text(status["stream"]).startswith("windows: 3 closed, 3 opened; 120 records in 6 tasks; ")
    st = dict(status["stream"], windows_closed=1)  # a job part-way: 1 closed, 3 opened
    assert stream_text(st).startswith("windows: 1 closed, 3 opened; ")
    assert "  stream      windows: 3 closed" in format_status(status, "memory://")


def test_a_pass_audit_of_a_streaming_job_points_to_its_windows(finished):
    store, job = finished
    with pytest.raises(NoSuchPass, match=r"reads a stream: it has windows, not passes \(pdps status --window N\)"):
        pass_audit(store, job, 0)


def test_backpressure_is_told_whenever_the_master_holds_stream_max_tasks_with_data_left_to_cut():
    """docs/online.md: `backpressure` is true while the master holds stream_max_tasks
    unfinished tasks and cuts no more. A master whose poll had just filled the queue up
    again (a task finished since its last turn) reported it false, so a job held back the
    whole time by a fast producer mostly showed no backpressure."""
    import threading
    import time

    url = f"memory-stream://pressure-{uuid.uuid4().hex[:8]}"
    streams.append(url, {"x": np.zeros((600, 3)), "y": np.zeros(600)})

    def slow_train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(torch.nn.Linear(3, 1).double())
        for batch in ctx.batches():
            ctx.step(F.mse_loss(model(batch["x"]).squeeze(1), batch["y"]))
            time.sleep(0.02)  # a task of one step finishes within the master's turn (50 ms)

    store, seen, stop = MemoryStore(), {}, threading.Event()

    def watch() -> None:
        while not stop.wait(0.1):
            for job in {kv.key.split("/")[2] for kv in store.range("/pdps/")}:
                lag = store.get(Keys(job).stream_lag)
                if lag is not None:
                    got = json.loads(lag.value)
                    seen[got["at"]] = got

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        pdps.simulate(
            slow_train, dataset=url, store=store, batch_size=10, window_records=300, windows=2, task_records=10, stream_max_tasks=2, timeout=60
        )
    finally:
        stop.set()
        watcher.join()
    held = [lag for lag in seen.values() if lag["tasks_untrained"] == 2 and lag["records_untasked"]]
    assert held, seen  # the master measured at least once while held back
    assert all(lag["backpressure"] for lag in held), held
    assert not any(lag["backpressure"] for lag in seen.values() if lag["tasks_untrained"] < 2 or not lag["records_untasked"]), seen
