"""Role metrics: the boundaries measured by wrapping them, the launcher's ports and its
two displays. Real adapters in memory (memory store, inproc transport), no servers."""

from __future__ import annotations

import io
import logging
from pathlib import Path

import pytest
import torch
from prometheus_client import generate_latest

from pdps.adapters.inproc import InprocTransport
from pdps.adapters.memory_store import MemoryStore
from pdps.adapters.prometheus_metrics import RoleMetrics, scrape, serve
from pdps.core.errors import ConfigError, LeaseExpired, StoreError
from pdps.core.job import JobConfig
from pdps.ports.coordination import CoordinationStore
from pdps.ports.transport import Message, Transport
from pdps.shell.launch import Launcher
from pdps.shell.launch_view import LiveView, PlainView, RoleRow, Snapshot, open_view
from pdps.shell.settings import resolve

PKG = Path(__file__).resolve().parents[2] / "pdps"


def samples(metrics: RoleMetrics) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out[s.name + str(sorted(s.labels.items()))] = s.value
    return out


def value(metrics: RoleMetrics, name: str, **labels: str) -> float:
    want = {"job": "j", "role": "trainer", "id": "t-0", **labels}
    return sum(v for k, v in samples(metrics).items() if k.startswith(name + "[") and str(sorted(want.items()))[1:-1] in k)


def test_roles_and_core_do_not_import_prometheus():
    for path in sorted([*(PKG / "roles").glob("*.py"), *(PKG / "core").glob("*.py")]):
        assert "prometheus_client" not in path.read_text(), f"{path.relative_to(PKG)} imports prometheus_client: metrics belong in an adapter"


def test_counted_store_counts_each_store_error_by_class_and_stays_a_store():
    metrics = RoleMetrics("j", "trainer", "t-0")
    inner = MemoryStore()
    store = metrics.store(inner)
    assert isinstance(store, CoordinationStore)
    store.put("/k", b"v")
    assert store.get("/k").value == b"v" and store.url == inner.url
    for _ in range(2):
        with pytest.raises(LeaseExpired):
            store.keep_alive(12345)
    inner.close()
    assert store.closed  # a property is read from the store each time, not copied
    with pytest.raises(StoreError):
        store.get("/k")
    assert value(metrics, "pdps_store_errors_total", error="LeaseExpired") == 2
    assert value(metrics, "pdps_store_errors_total", error="StoreError") == 1


def test_metered_transport_times_and_weighs_calls_on_both_sides():
    client, server = RoleMetrics("j", "trainer", "t-0"), RoleMetrics("j", "pserver", "0")
    tensor = torch.zeros(10, dtype=torch.float32)  # 40 bytes

    def echo(req: Message) -> Message:
        return Message({}, [tensor, tensor])

    def refuse(req: Message) -> Message:
        raise ConfigError("no")

    transport = server.transport(InprocTransport())
    assert isinstance(transport, Transport) and transport.scheme == "inproc"
    endpoint = transport.serve("inproc://", {"push": echo, "refuse": refuse})
    try:
        channel = client.transport(InprocTransport()).connect(endpoint.address)
        for _ in range(3):
            channel.call("push", Message({}, [tensor]))
        with pytest.raises(ConfigError):
            channel.call("refuse", Message({}))
        assert channel.stats["calls"] == 4  # the inner channel's own figures show through
    finally:
        endpoint.close()
    assert value(client, "pdps_rpc_seconds_count", side="client", method="push") == 3
    assert value(client, "pdps_rpc_sent_bytes_total", side="client", method="push") == 3 * 40
    assert value(client, "pdps_rpc_received_bytes_total", side="client", method="push") == 3 * 80
    assert value(client, "pdps_rpc_errors_total", side="client", method="refuse", error="ConfigError") == 1
    mine = {"job": "j", "role": "pserver", "id": "0"}
    assert value(server, "pdps_rpc_seconds_count", side="server", method="push", **mine) == 3
    assert value(server, "pdps_rpc_received_bytes_total", side="server", method="push", **mine) == 3 * 40
    assert value(server, "pdps_rpc_sent_bytes_total", side="server", method="push", **mine) == 3 * 80
    assert value(server, "pdps_rpc_errors_total", side="server", method="refuse", error="ConfigError", **mine) == 1


def test_a_reading_is_taken_at_each_scrape_and_labelled_with_the_current_id():
    metrics = RoleMetrics("j", "pserver", "unclaimed")
    counters = {"pserver_updates": 0, "pserver_round": 4, "pserver_epoch": 0, "pserver_rollbacks": 0, "checkpoint_write_seconds": (0, 0.0)}
    metrics.watch(lambda: counters)
    counters["pserver_updates"] = 7
    counters["checkpoint_write_seconds"] = (2, 0.5)
    metrics.id = "1"  # claimed its index
    mine = {"role": "pserver", "id": "1"}
    assert value(metrics, "pdps_pserver_updates_total", **mine) == 7
    assert value(metrics, "pdps_pserver_round", **mine) == 4
    assert value(metrics, "pdps_checkpoint_write_seconds_count", **mine) == 2
    assert value(metrics, "pdps_checkpoint_write_seconds_sum", **mine) == 0.5


def test_served_over_http_and_a_taken_port_is_a_config_error():
    import urllib.request

    metrics = RoleMetrics("j", "trainer", "t-0")
    metrics.watch(lambda: {"trainer_samples": 96, "trainer_steps": 3})
    server = serve(metrics, "127.0.0.1", 0)
    try:
        assert server.url.startswith("http://127.0.0.1:") and server.url.endswith("/metrics")
        with urllib.request.urlopen(server.url, timeout=5) as reply:
            text = reply.read().decode()
        assert scrape(text, ["pdps_trainer_samples_total", "pdps_trainer_steps_total"]) == {"pdps_trainer_samples_total": 96, "pdps_trainer_steps_total": 3}
        port = int(server.url.rsplit(":", 1)[1].split("/")[0])
        with pytest.raises(ConfigError, match=f"127.0.0.1:{port}"):
            serve(RoleMetrics("j", "trainer", "t-1"), "127.0.0.1", port)
    finally:
        server.close()


def launch_values(**flags):
    return resolve("launch", {"target": "pdps.examples.digits:train", **flags}, env={"PDPS_STORE": "memory://"})


def test_launch_gives_each_role_its_own_metrics_port():
    config = JobConfig(trainers=3, pservers=2)
    view = PlainView(config, io.StringIO())
    ports = {r.name: r.metrics_port for r in Launcher(launch_values(metrics_port=9100), config, view).plan()}
    assert ports == {"master": 9100, "pserver-0": 9101, "pserver-1": 9102, "trainer-0": 9103, "trainer-1": 9104, "trainer-2": 9105}
    assert {r.metrics_port for r in Launcher(launch_values(), config, view).plan()} == {0}  # each a free port
    assert {r.metrics_port for r in Launcher(launch_values(metrics_port=None), config, view).plan()} == {None}
    with pytest.raises(ConfigError, match="metrics_port 65533"):
        Launcher(launch_values(metrics_port=65533), config, view).plan()


def test_metrics_port_setting_reads_none_and_refuses_a_port_out_of_range():
    assert resolve("trainer", {}, env={"PDPS_STORE": "memory://", "PDPS_METRICS_PORT": "none"})["metrics_port"] is None
    assert resolve("pserver", {}, env={"PDPS_STORE": "memory://"})["metrics_port"] == 0
    with pytest.raises(ConfigError, match="metrics_port"):
        resolve("master", {}, env={"PDPS_STORE": "memory://", "PDPS_METRICS_PORT": "70000"})


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_launch_shows_plain_lines_off_a_terminal():
    err = io.StringIO()
    view = open_view(JobConfig(passes=5), err)
    assert isinstance(view, PlainView)
    view.log("[master] hello")
    view.show(Snapshot(1, 31, 40, roles=[RoleRow("trainer-0", "running")]))
    view.show(Snapshot(1, 31, 40))  # unchanged: not repeated
    view.show(Snapshot(4, 40, 40))
    view.close()
    assert err.getvalue() == "[master] hello\npass 2/5  tasks 31/40\npass 5/5  tasks 40/40\n"


def test_launch_shows_a_streaming_jobs_window_not_its_pass():
    err = io.StringIO()
    view = open_view(JobConfig(window_records=100, windows=3), err)
    view.show(Snapshot(0, 2, 4, windows_closed=1))
    view.show(Snapshot(0, 9, 9, windows_closed=3))  # the last window closed: still 3/3
    endless = open_view(JobConfig(window_seconds=60.0), err)
    endless.show(Snapshot(0, 5, 6, windows_closed=6))
    assert err.getvalue() == "window 2/3  tasks 2/4\nwindow 3/3  tasks 9/9\nwindow 7  tasks 5/6\n"
    terminal = Terminal()
    live = open_view(JobConfig(window_records=100, windows=3), terminal)
    live.show(Snapshot(0, 2, 4, windows_closed=1))
    live.close()
    assert "window 2/3" in terminal.getvalue()


def test_launch_draws_a_live_table_on_a_terminal():
    err = Terminal()
    root = logging.getLogger()
    handler = logging.StreamHandler(err)
    root.addHandler(handler)
    try:
        view = open_view(JobConfig(name="live", passes=5), err)
        assert isinstance(view, LiveView)
        view.log("[pserver-0] serving")
        logging.getLogger("pdps.test").warning("from the launcher's own log")
        rows = [RoleRow("master", "running", metrics="http://127.0.0.1:9100/metrics"), RoleRow("trainer-0", "finished", 1, 42, 1234.0)]
        view.show(Snapshot(1, 31, 40, roles=rows, samples_per_second=1234.0))
        view.close()
        assert handler.stream is err  # given back
    finally:
        root.removeHandler(handler)
    out = err.getvalue()
    assert "\x1b[" in out  # drawn with terminal control sequences, not plain lines
    for text in ("[pserver-0] serving", "from the launcher's own log", "job live", "pass 2/5", "tasks 31/40", "1,234 samples/s", "trainer-0", "finished", "42", "http://127.0.0.1:9100/metrics"):
        assert text in out, text
    assert "pass 2/5  tasks 31/40\n" not in out.replace("\r", "")  # not the plain line
