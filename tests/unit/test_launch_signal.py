"""The launcher's SIGTERM stops it even when the signal lands inside a handler that
catches PdpsError (a fresh-clone run saw a launcher ignore SIGTERM for 60 s: the signal
came while it read the job's desired counts, whose store errors it rides out)."""

from __future__ import annotations

import io
import signal

import pytest

from pdps import open_store
from pdps.core.job import JobConfig
from pdps.shell import launch
from pdps.shell.launch_view import PlainView


def test_a_sigterm_swallowed_by_a_store_read_still_stops_the_watch(monkeypatch):
    reads = []

    def read_desired(*_args):
        reads.append(1)
        launch._on_sigterm(signal.SIGTERM, None)  # the signal arrives inside the read

    monkeypatch.setattr(launch, "read_desired", read_desired)
    monkeypatch.setattr(launch, "_stopped_by", [])
    config = JobConfig(name="sig", dataset="file:///nowhere", pservers=1, trainers=1)
    launcher = launch.Launcher({"timeout": 30.0}, config, PlainView(config, io.StringIO()))
    launcher._roles = [launch.Role("trainer-0", "trainer", [])]  # not started: the job goes on
    store = open_store("memory://launch-signal")
    with pytest.raises(launch.Interrupted, match="launcher stopped by SIGTERM"):
        launcher._watch(store, start=launch.time.monotonic())
    assert reads == [1]  # stopped on the next turn, not at the job's timeout


def test_the_record_of_a_stop_is_cleared_by_the_next_launch(monkeypatch):
    monkeypatch.setattr(launch, "_stopped_by", [])
    with pytest.raises(launch.Interrupted):
        launch._on_sigterm(signal.SIGTERM, None)
    with pytest.raises(launch.Interrupted):
        launch._check_stopped()
    launch._stopped_by.clear()
    launch._check_stopped()  # nothing recorded: no stop


def test_a_job_done_before_the_first_progress_tick_still_prints_where_it_ended(monkeypatch):
    """A CI run saw a 4 s streaming job end with no ``window 2/2`` line: the launcher
    printed progress once a second, and the job finished between two lines. Its last
    turn now prints the job as it ended."""
    from pdps.shell import status

    monkeypatch.setattr(launch, "_stopped_by", [])
    monkeypatch.setattr(launch, "PROGRESS_EVERY", 1e9)  # no periodic line at all
    monkeypatch.setattr(launch, "read_desired", lambda *_args: None)
    monkeypatch.setattr(launch, "job_done", lambda *_args: True)
    ended = {"pass": 1, "done": 12, "failed": 0, "todo": 0, "pending": 0, "tasks": 12, "stream": {"windows_closed": 2}}
    monkeypatch.setattr(status, "job_status", lambda *_args: ended)
    config = JobConfig(name="quick", dataset="redis-stream://127.0.0.1:1/s", pservers=1, trainers=1, window_records=300, windows=2)
    err = io.StringIO()
    launcher = launch.Launcher({"timeout": 30.0}, config, PlainView(config, err))
    launcher._roles = [launch.Role("trainer-0", "trainer", [])]
    launcher._roles[0].finished = True
    launcher._watch(open_store("memory://launch-quick"), start=launch.time.monotonic())
    assert err.getvalue() == "window 2/2  tasks 12/12\n"
