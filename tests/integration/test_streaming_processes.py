"""Streaming jobs with every role its own process (docs/operations.md "A streaming job as processes"): a Redis
stream, etcd, gRPC; a trainer SIGKILLed in the middle of a task it has partly trained
leaves every record of every window trained exactly once, and ``pdps launch`` runs a
streaming job to its end with a summary in windows."""

from __future__ import annotations

import json
import signal
import time

import numpy as np
import pytest

from pdps import streams
from pdps.core.job import Keys
from pdps.core.progress import TaskProgress
from pdps.registry import open_store
from pdps.shell.status import job_status
from tests.integration.test_processes import TARGETS, job_name, last_json, procs, run_pdps, wait_until  # noqa: F401 - procs is a fixture

pytestmark = pytest.mark.integration

#: K records per task, N per window, W windows, batches of B: each task is K/B steps.
K, N, W, B = 50, 300, 2, 10
TARGET = f"{TARGETS / 'stream.py'}:train"


def fill_stream(redis_server, job: str, records: int, seed: int) -> str:
    """A fresh Redis stream holding ``records`` records of the target's shape; its URL."""
    url = f"redis-stream://127.0.0.1:{redis_server.port}/0/{job}"
    rng = np.random.default_rng(seed)
    streams.append(url, {"x": rng.normal(size=(records, 3)), "y": rng.normal(size=records)})
    return url


def check_windows_by_cli(store_url: str, job: str, windows: int = W) -> list[dict]:
    """``pdps status --window N --json`` for each window: closed, each record trained
    exactly once; the audits."""
    audits = []
    for w in range(windows):
        proc = run_pdps("status", store_url, "--job", job, "--window", str(w), "--json", timeout=60)
        assert proc.returncode == 0, proc.stderr[-3000:]
        a = json.loads(proc.stdout)
        s = a["summary"]
        assert a["state"] == "closed", a
        assert a["records"] == N and s["failed"] == 0, (w, s)
        assert s["records_trained_exactly_once"] == N and s["records_trained_more_than_once"] == 0, (w, s)
        audits.append(a)
    return audits


def check_stream_by_cli(store_url: str, job: str, records: int, untasked: tuple = (0,), windows: int = W) -> dict:
    """``pdps status --json``'s ``stream``: ended, every window closed, no lag."""
    proc = run_pdps("status", store_url, "--job", job, "--json", timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stream = json.loads(proc.stdout)["stream"]
    assert stream["ended"] and stream["windows_closed"] == windows and stream["records"] == records, stream
    assert stream["records_untasked"] in untasked and (stream["tasks_untrained"], stream["records_untrained"]) == (0, 0), stream
    return stream


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_trainer_sigkilled_mid_task_on_a_stream_leaves_every_record_once(etcd_server, redis_server, procs, mode):
    """A master, a pserver and three trainers, each its own process, train 2 windows of a
    Redis stream; one trainer is SIGKILLed while it holds a task it has partly trained
    (its progress record is past the attempt's offset). The next attempt resumes at the
    records it had trained: by ``pdps status --window N --json`` every record of every
    window is trained exactly once, and the lag is 0 at the end."""
    job = job_name()
    keys = Keys(job)
    url = fill_stream(redis_server, job, W * N, seed=11)
    common = ("--store", etcd_server.url, "--job", job)
    master = procs(
        "master", *common, "--dataset", url, "--transport", "grpc", "--mode", mode, "--window-records", str(N),
        "--windows", str(W), "--task-records", str(K), "--batch-size", str(B), "--lease-ttl", "1", "--linger", "5",
    )  # fmt: skip
    pserver = procs("pserver", *common, "--transport", "grpc")
    trainers = {
        f"t{i}": procs("trainer", *common, "--transport", "grpc", "--trainer-id", f"t{i}", TARGET, env={"STREAM_STEP_DELAY": "0.1"})
        for i in range(3)
    }
    store = open_store(etcd_server.url)
    try:

        def partly_trained() -> tuple[str, int, int] | None:
            """A trainer holding a task whose current attempt trained some records, not all."""
            for kv in store.range(keys.tasks):
                rec = json.loads(kv.value)
                if rec["state"] != "pending" or rec["trainer"] not in trainers:
                    continue
                pkv = store.get(keys.task_progress(rec["id"]))
                progress = TaskProgress.decode(None if pkv is None else pkv.value, keys.task_progress(rec["id"]))
                if progress.attempt == rec["attempt"] and rec.get("offset", 0) < progress.applied < K:
                    return rec["trainer"], rec["id"], progress.applied
            return None

        victim, task, applied = wait_until(partly_trained, 30, "a trainer part-way through a task", every=0.02)
        trainers[victim].send_signal(signal.SIGKILL)
        assert master.wait(timeout=30) == 0
        for tid, p in trainers.items():
            if tid != victim:
                assert p.wait(timeout=15) == 0, tid
        pserver.send_signal(signal.SIGTERM)
        assert pserver.wait(timeout=15) == 0
    finally:
        store.close()

    audits = check_windows_by_cli(etcd_server.url, job, W)
    attempts = {e["task"]: e["attempts"] for a in audits for e in a["entries"]}
    killed = [a for a in attempts[task] if a["trainer"] == victim]
    assert [a["outcome"] for a in killed] == ["trainer_lost"] and killed[0].get("applied", 0) >= applied, attempts[task]
    resumed = attempts[task][attempts[task].index(killed[0]) + 1]
    assert resumed["outcome"] == "done" and resumed["offset"] == killed[0]["applied"] > 0, attempts[task]
    check_stream_by_cli(etcd_server.url, job, W * N)


def test_launch_runs_a_streaming_job_and_sums_it_up_in_windows(etcd_server, redis_server):
    """``pdps launch --dataset redis-stream://... --window-records N --windows W``: the
    roles as processes train the stream's records to the job's end; the progress lines
    and the summary count windows (the summary keeps the fields of a job with passes and
    adds ``windows`` and ``records``), and every window's audit shows each record once."""
    job = job_name()
    url = fill_stream(redis_server, job, W * N, seed=12)
    proc = run_pdps(
        "launch", "--job", job, "--store", etcd_server.url, "--dataset", url, "--window-records", str(N), "--windows", str(W),
        "--task-records", str(K), "--batch-size", str(B), "--trainers", "2", "--pservers", "1", "--restart", "never", "--json", TARGET,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert set(summary) == {"mode", "trainers", "pservers", "passes", "tasks_done", "tasks_failed", "steps", "seconds", "windows", "records"}
    assert (summary["windows"], summary["records"], summary["passes"]) == (W, W * N, 1), summary
    assert (summary["tasks_done"], summary["tasks_failed"]) == (W * N // K, 0) and summary["steps"] > 0, summary
    assert f"window {W}/{W}" in proc.stderr and "pass 1/1" not in proc.stderr
    assert f"done after {W} windows ({W * N} records), " in proc.stderr
    assert f"job {job!r} is done after {W} windows" in proc.stderr  # the master's log, relayed
    check_windows_by_cli(etcd_server.url, job, W)
    check_stream_by_cli(etcd_server.url, job, W * N)


def test_an_in_process_launch_of_a_stream_sums_it_up_in_windows(monkeypatch):
    """``--transport inproc`` runs the same streaming job in this process: the same summary."""
    import io

    from pdps.shell.launch import launch
    from pdps.shell.settings import resolve

    url = f"memory-stream://s-{job_name()}"
    rng = np.random.default_rng(13)
    streams.append(url, {"x": rng.normal(size=(W * N, 3)), "y": rng.normal(size=W * N)})
    flags = {
        "store": "memory://", "transport": "inproc", "trainers": 2, "pservers": 1, "json": True, "target": TARGET, "job": job_name(),
        "dataset": url, "window_records": N, "windows": W, "task_records": K, "batch_size": B,
    }  # fmt: skip
    values = resolve("launch", flags, env={})
    out, err = io.StringIO(), io.StringIO()
    previous = signal.getsignal(signal.SIGTERM)  # launch() handles SIGTERM in the main thread
    try:
        assert launch(values, out=out, err=err) == 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = last_json(out.getvalue())
    assert (summary["windows"], summary["records"], summary["passes"], summary["tasks_done"]) == (W, W * N, 1, W * N // K), summary
    assert f"window {W}/{W}" in err.getvalue() and f"done after {W} windows ({W * N} records), " in err.getvalue()


def test_a_standby_master_process_takes_over_a_stream_from_a_sigkilled_one(etcd_server, redis_server, procs):
    """Two ``pdps master`` processes; the leader is SIGKILLed once it has cut the stream's
    last task and the first of 3 windows has closed. The standby restores the stream
    from the store (cursor, windows, tasks) and serves it to the end: every record of
    every window once. It cuts nothing more, yet the lag is its to measure while the
    last windows drain (not the dead master's figures until the job is done)."""
    windows = 3
    job = job_name()
    keys = Keys(job)
    url = fill_stream(redis_server, job, windows * N, seed=14)
    common = ("--store", etcd_server.url, "--job", job, "--transport", "grpc")
    leader = procs(
        "master", *common, "--dataset", url, "--window-records", str(N), "--windows", str(windows), "--task-records", str(K),
        "--batch-size", str(B), "--lease-ttl", "1",
    )  # fmt: skip
    store = open_store(etcd_server.url)
    try:
        first = wait_until(lambda: (kv := store.get(keys.master_addr)) and kv.value.decode(), 60, "the first master")
        standby = procs("master", *common, "--linger", "5")
        procs("pserver", *common)
        trainers = [procs("trainer", *common, "--trainer-id", f"t{i}", TARGET, env={"STREAM_STEP_DELAY": "0.05"}) for i in range(2)]

        def ended_and_first_window_closed() -> bool:
            kv, pos = store.get(keys.window(0)), json.loads(store.get(keys.stream).value)
            return pos["ended"] and kv is not None and json.loads(kv.value).get("closed_at") is not None

        wait_until(ended_and_first_window_closed, 60, "the last task cut and window 0 closed")
        killed_at = time.time()
        leader.send_signal(signal.SIGKILL)
        leader.wait(timeout=10)
        wait_until(lambda: (kv := store.get(keys.master_addr)) and kv.value.decode() != first, 30, "the standby to take over")

        def measured_by_the_standby() -> dict | None:
            lag = job_status(store, job)["stream"]
            return lag if lag["lag_at"] and lag["lag_at"] > killed_at and lag["tasks_untrained"] else None

        lag = wait_until(measured_by_the_standby, 20, "a lag measured by the standby while the windows drain")
        assert lag["windows_closed"] < windows and lag["records_untrained"] > 0, lag
        assert standby.wait(timeout=40) == 0
        for t in trainers:
            assert t.wait(timeout=15) == 0
    finally:
        store.close()
    check_windows_by_cli(etcd_server.url, job, windows)
    # the standby polls the stream no more: it cannot tell what lies beyond the cursor (None)
    # unless the dead master had said
    check_stream_by_cli(etcd_server.url, job, windows * N, untasked=(0, None), windows=windows)
