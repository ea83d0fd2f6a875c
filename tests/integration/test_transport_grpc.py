"""The grpc:// transport: the transport contract (over gRPC alone and over the bulk
channel), plus what only a wire has (codec, limits, deadlines, retries, token, TLS,
health, published addresses, the bulk channel's routing, hello and failures)."""

from __future__ import annotations

import os
import select
import socket
import ssl
import subprocess
import sys
import threading
import time
from pathlib import Path

import attrs
import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdps.adapters import grpc_transport as gt
from pdps.adapters.grpc_transport import GrpcTransport, TlsConfig
from pdps.core import wire
from pdps.core.errors import ConfigError, InvalidTransition, NotReady, StalePush, Timeout, TransportError, Unauthenticated
from pdps.ports.transport import ChannelStats, ConcurrentCalls, Message
from pdps.roles import calls
from tests.tls import make_tls
from tests.unit.contract_transport import KEPT, TransportContract, echo

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "pdps" / "adapters" / "proto"
LOCAL = "grpc://127.0.0.1:0"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def same(req: Message) -> Message:
    """Replies with the request itself: the reply aliases the request's buffer."""
    return Message(dict(req.meta), list(req.tensors))


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture
def serve():
    """serve(handlers, transport=None) -> endpoint; every endpoint is closed after the test."""
    endpoints = []

    def start(handlers, transport=None, address=LOCAL):
        ep = (transport or GrpcTransport()).serve(address, handlers)
        endpoints.append(ep)
        return ep

    yield start
    for ep in endpoints:
        ep.close()


class TestGrpc(TransportContract):
    """The contract over gRPC alone, and over the bulk channel: with bulk_threshold 0,
    every call after the first to a server takes it."""

    @pytest.fixture(params=[0, None], ids=["bulk", "grpc-only"])
    def transport(self, request):
        return GrpcTransport(bulk_threshold=request.param)

    @pytest.fixture(autouse=True)
    def calls_take_the_expected_path(self, request, transport):
        """With the bulk channel on, one call teaches the transport the bulk port of
        ``served``; every call the test then makes to it must take the bulk channel."""
        if "served" not in request.fixturenames:
            yield
            return
        served = request.getfixturevalue("served")
        if transport.bulk_threshold is None:
            yield
            assert served.bulk_port is None and served.bulk_calls == 0
            return
        transport.connect(served.address).call("total", Message({}))
        assert served.grpc_calls == 1
        yield
        assert served.grpc_calls == 1, "a call went over gRPC, not over the bulk channel"

    @pytest.fixture
    def address(self):
        return LOCAL

    @pytest.fixture
    def unreachable(self):
        return f"grpc://127.0.0.1:{free_port()}"

    def test_requests_arrive_owned(self, transport, served):
        """Received into buffers of the transport's own: the handler may keep them (a
        sync pserver stages a gradient so, without a copy)."""
        KEPT.clear()
        transport.connect(served.address).call("keep", Message({}, [torch.ones(4)]))
        assert [owned for owned, _ in KEPT] == [True]


# --- tensors on the wire ----------------------------------------------------------


@pytest.mark.parametrize("dtype", sorted(gt.dtypes()), ids=str)
def test_every_dtype_and_shape_roundtrips_bit_for_bit(serve, dtype):
    d = gt.dtypes()[dtype]
    ch = GrpcTransport().connect(serve({"same": same}).address)
    sent = []
    for shape in [(), (0,), (7,), (3, 5), (2, 0, 3), (2, 3, 1, 4)]:
        n = torch.Size(shape).numel() * d.itemsize
        high = 2 if d == torch.bool else 256
        sent.append(torch.randint(0, high, (n,), dtype=torch.uint8).view(d).reshape(shape))
    reply = ch.call("same", Message({"dtype": dtype}, sent))
    assert reply.meta["dtype"] == dtype
    for got, want in zip(reply.tensors, sent, strict=True):
        assert got.dtype == d and got.shape == want.shape
        assert torch.equal(raw_bytes(got), raw_bytes(want))


def test_64_mib_tensor_roundtrips(serve):
    ch = GrpcTransport().connect(serve({"same": same}).address)
    big = torch.randn(16 << 20)  # 64 MiB of float32
    reply = ch.call("same", Message({}, [big, torch.arange(5)]), timeout=120)
    assert torch.equal(reply.tensors[0], big) and torch.equal(reply.tensors[1], torch.arange(5))


def test_non_contiguous_and_odd_tensors_travel_as_their_values(serve):
    ch = GrpcTransport().connect(serve({"same": same}).address)
    base = torch.arange(48, dtype=torch.float64).view(6, 8)
    cases = [
        base.t()[::2],  # transposed, strided
        base[:, 3],  # a column
        torch.ones(3).expand(4, 3),  # stride 0
        torch.randn(3, requires_grad=True) * 2,  # part of a graph
        torch.tensor([1 + 2j, 3 - 4j]).conj(),  # lazily conjugated
        torch.tensor(2.5),  # 0-d
    ]
    reply = ch.call("same", Message({}, cases))
    for got, want in zip(reply.tensors, cases, strict=True):
        assert got.is_contiguous() and got.shape == want.shape and torch.equal(got, want.detach().resolve_conj())


def test_reply_tensors_held_by_the_caller_are_never_overwritten(serve):
    """Receive buffers are reused, but only once nothing references them."""
    values = {"v": torch.zeros(1 << 19)}  # 2 MiB: above the pooling threshold
    ch = GrpcTransport().connect(serve({"pull": lambda req: Message({}, [values["v"]])}).address)
    first = ch.call("pull", Message({})).tensors[0]
    for i in range(1, 4):
        values["v"] = torch.full((1 << 19,), float(i))
        assert ch.call("pull", Message({})).tensors[0][0].item() == i
    assert torch.count_nonzero(first).item() == 0


@pytest.mark.parametrize("bulk_threshold", [0, None], ids=["bulk", "grpc-only"])
def test_a_reply_is_received_into_the_callers_tensors_when_they_match(serve, bulk_threshold):
    """``into``: the reply lands in the caller's memory (a trainer's model), no copy
    after; tensors that do not match are ignored and the reply arrives as usual."""
    transport = GrpcTransport(bulk_threshold=bulk_threshold)
    values = [torch.randn(1 << 18), torch.arange(6, dtype=torch.float64).view(2, 3)]
    ch = transport.connect(serve({"pull": lambda req: Message({}, values)}).address)
    ch.call("pull", Message({}))  # with the bulk channel on, the next calls take it
    flat = torch.zeros((1 << 18) + 6, dtype=torch.float32)
    into = [flat[: 1 << 18], torch.zeros(2, 3, dtype=torch.float64)]
    reply = ch.call("pull", Message({}), into=into)
    assert all(got is want for got, want in zip(reply.tensors, into, strict=True))
    assert torch.equal(flat[: 1 << 18], values[0]) and torch.equal(into[1], values[1])
    assert not flat[1 << 18 :].any()  # nothing written past the view
    for wrong in ([into[0]], [into[0], torch.zeros(3, 2, dtype=torch.float64)], [into[0], torch.zeros(2, 3)],
                  [torch.zeros(1 << 19)[::2], into[1]]):
        reply = ch.call("pull", Message({}), into=wrong)  # count, shape, dtype, layout: no match
        assert all(got is not w for got, w in zip(reply.tensors, wrong))
        assert torch.equal(reply.tensors[0], values[0]) and torch.equal(reply.tensors[1], values[1])


@pytest.mark.parametrize("bulk_threshold", [0, None], ids=["bulk", "grpc-only"])
def test_row_sections_cross_unchanged_and_pulled_rows_land_in_the_callers_buffer(serve, bulk_threshold):
    """Rows of sparse tables (design/sparse-embeddings.md §3) are plain tensors to the
    transport: a push's int64 ids (anywhere in int64) and [n, dim] gradients arrive bit
    for bit after its dense tensors, and a pull's rows are received into the slice of
    the caller's [U, dim] buffer they belong in."""
    transport = GrpcTransport(bulk_threshold=bulk_threshold)
    table = torch.randn(100, 8, dtype=torch.float64)
    pushed: list[wire.PushRequest] = []
    state = {"round_no": 0, "updates": 1, "epoch": 0, "incarnation": "i"}

    def push(req: wire.PushRequest) -> wire.PushReply:
        pushed.append(req)
        return wire.PushReply(**state)

    def pull(req: wire.PullRequest) -> wire.PullReply:
        sections = tuple((name, len(ids)) for name, ids, _ in req.row_sections)
        return wire.PullReply(**state, tables=sections, tensors=tuple(table[ids % 100] for _, ids, _ in req.row_sections))

    ep = serve(calls.serve({wire.PushRequest: push, wire.PullRequest: pull}), transport)
    ch = transport.connect(ep.address)
    ids = torch.tensor([-(2**63), -(2**62) - 3, -1, 0, 7, 2**62 + 5, 2**63 - 1], dtype=torch.int64)
    grads, dense = torch.randn(7, 8, dtype=torch.float64), torch.randn(3, 4)
    empty = (ids[:0], torch.zeros(0, 8, dtype=torch.float64))
    for _ in range(2):  # with the bulk channel on, the second round takes it
        sent = wire.PushRequest("t0", updates=0, blocks=("w@0",), tables=(("emb", 7), ("tags", 0)), tensors=(dense, ids, grads, *empty))
        calls.call(ch, sent, timeout=10)
        got = pushed.pop()
        assert got.tables == (("emb", 7), ("tags", 0)) and torch.equal(got.dense_tensors[0], dense)
        (name, got_ids, got_grads), (_, no_ids, no_grads) = got.row_sections
        assert name == "emb" and got_ids.dtype == torch.int64 and got_ids.tolist() == ids.tolist()
        assert torch.equal(raw_bytes(got_grads), raw_bytes(grads)) and no_ids.shape == (0,) and no_grads.shape == (0, 8)

        buffer = torch.zeros(5, 8, dtype=torch.float64)  # the trainer's [U, dim] rows; this pserver owns 2..4
        wanted = torch.tensor([5, 0, 99])
        into = [buffer[2:5]]
        reply = calls.call(ch, wire.PullRequest("t0", blocks=(), tables=(("emb", 3),), tensors=(wanted,)), timeout=10, into=into)
        [(name, got_rows)] = reply.table_rows
        assert name == "emb" and got_rows is into[0] and torch.equal(buffer[2:5], table[wanted]) and not buffer[:2].any()
    assert (ep.grpc_calls, ep.bulk_calls) == ((1, 3) if bulk_threshold == 0 else (4, 0))


def echo_from_8_threads(ch) -> None:
    """80 echo calls, 10 from each of 8 threads sharing ``ch``; each gets its own reply."""
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for i in range(10):
                x = torch.full((1000 + 37 * k,), float(k * 100 + i))
                reply = ch.call("echo", Message({"k": k, "i": i}, [x]), timeout=30)
                assert reply.meta["echo"]["k"] == k and reply.meta["echo"]["i"] == i
                assert torch.equal(reply.tensors[0], x)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


def test_concurrent_calls_from_8_threads_on_one_channel(serve):
    ch = GrpcTransport().connect(serve({"echo": echo}).address)
    assert GrpcTransport.concurrent is True
    assert isinstance(GrpcTransport(), ConcurrentCalls) and isinstance(ch, ChannelStats)
    echo_from_8_threads(ch)


# --- meta, deadlines, errors --------------------------------------------------------


@pytest.mark.parametrize("via", ["grpc", "bulk"])
def test_timeout_travels_as_the_deadline_and_leaves_meta_alone(serve, via):
    """Over gRPC the handler's deadline is gRPC's own (``time_remaining()``); over the
    bulk channel it is the header's ``timeout``. The caller's meta arrives as sent."""
    seen = []

    def look(req: Message) -> Message:
        seen.append((dict(req.meta), req.deadline))
        return Message({})

    ep = serve({"look": look, "ping": ping})
    ch = over_bulk(ep) if via == "bulk" else GrpcTransport(bulk_threshold=None).connect(ep.address)
    start = time.monotonic()
    ch.call("look", Message({}), timeout=7.5)
    ch.call("look", Message({"after_round": 99}), timeout=7.5)
    end = time.monotonic()
    ch.call("look", Message({}))
    assert [meta for meta, _ in seen] == [{}, {"after_round": 99}, {}]
    assert all(start + 7.5 - 5 < d < end + 7.5 + 1 for _, d in seen[:2]) and seen[2][1] is None
    assert ep.bulk_calls == (3 if via == "bulk" else 0)


def test_deadline_raises_timeout(serve):
    release = threading.Event()

    def stall(req: Message) -> Message:
        release.wait(10)
        return Message({})

    ch = GrpcTransport().connect(serve({"stall": stall}).address)
    start = time.monotonic()
    with pytest.raises(Timeout, match="'stall'"):
        ch.call("stall", Message({}), timeout=0.5)
    assert time.monotonic() - start < 5
    release.set()


def test_handler_bug_is_a_transport_error_naming_address_method_and_message(serve):
    def buggy(req: Message) -> Message:
        raise KeyError("weights")

    def wrong_reply(req: Message) -> Message:
        return {"not": "a Message"}  # type: ignore[return-value]

    ep = serve({"buggy": buggy, "wrong": wrong_reply, "echo": echo})
    ch = GrpcTransport().connect(ep.address)
    with pytest.raises(TransportError) as info:
        ch.call("buggy", Message({}))
    assert type(info.value) is TransportError
    assert ep.address in str(info.value) and "'buggy'" in str(info.value) and "KeyError" in str(info.value)
    with pytest.raises(TransportError, match="returned dict, not Message"):
        ch.call("wrong", Message({}))
    assert ch.call("echo", Message({"still": "up"})).meta == {"echo": {"still": "up"}}


def test_request_over_max_request_bytes_is_refused_before_the_handler(serve):
    calls = []
    ep = serve({"echo": lambda req: calls.append(1) or echo(req)}, GrpcTransport(max_request_bytes=1 << 20))
    ch = GrpcTransport().connect(ep.address)
    with pytest.raises(TransportError, match="max_request_bytes"):
        ch.call("echo", Message({}, [torch.zeros((1 << 18) + 1)]))  # 1 MiB + 4 bytes
    assert calls == []
    assert ch.call("echo", Message({}, [torch.zeros(1 << 18)])).tensors[0].numel() == 1 << 18  # exactly the limit


def test_bad_meta_is_refused_on_the_callers_side():
    with pytest.raises(TransportError, match="not JSON-safe"):
        GrpcTransport().connect("grpc://127.0.0.1:1").call("m", Message({"x": object()}))
    with pytest.raises(TransportError, match="cannot travel"):
        GrpcTransport().connect("grpc://127.0.0.1:1").call("m", Message({}, [torch.ones(2).to_sparse()]))


# --- retries ---------------------------------------------------------------------------


def test_call_retries_until_a_late_server_comes_up():
    port = free_port()
    endpoints = []

    def late() -> None:
        time.sleep(1.0)
        endpoints.append(GrpcTransport().serve(f"grpc://127.0.0.1:{port}", {"echo": echo}))

    starter = threading.Thread(target=late)
    starter.start()
    try:
        reply = GrpcTransport(connect_timeout=10).connect(f"grpc://127.0.0.1:{port}").call("echo", Message({"n": 1}), timeout=10)
        assert reply.meta == {"echo": {"n": 1}}
    finally:
        starter.join()
        for ep in endpoints:
            ep.close()


def test_no_retry_once_the_server_accepted_the_request():
    """The connection dies while the handler runs, and a server is back on the same
    port at once: a retry would run the handler a second time."""
    runs = []
    entered = threading.Event()

    def slow(req: Message) -> Message:
        runs.append(req.meta["n"])
        entered.set()
        time.sleep(1.0)
        return Message({})

    first = GrpcTransport().serve(LOCAL, {"slow": slow})
    second = []

    def kill() -> None:
        entered.wait(10)
        first.close(grace=0)
        second.append(GrpcTransport().serve(f"grpc://127.0.0.1:{first.port}", {"slow": slow}))

    killer = threading.Thread(target=kill)
    killer.start()
    try:
        with pytest.raises(TransportError, match="after the server accepted it"):
            GrpcTransport().connect(first.address).call("slow", Message({"n": 1}), timeout=10)
    finally:
        killer.join()
        for ep in second:
            ep.close()
    assert runs == [1]
    assert second, "the second server did not come up"


def test_unreachable_address_is_named_after_bounded_retries():
    address = f"grpc://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(TransportError, match=f"cannot reach {address}"):
        GrpcTransport(connect_timeout=0.5).connect(address).call("echo", Message({}))
    assert time.monotonic() - start < 5


def test_an_unreachable_address_within_a_call_deadline_is_named_as_such():
    """A deadline shorter than connect_timeout ends the retries: the Timeout says the peer
    could not be reached, not only that time ran out."""
    address = f"grpc://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(Timeout, match=f"cannot reach {address} for 'echo' within its 0.5 s deadline"):
        GrpcTransport(connect_timeout=30).connect(address).call("echo", Message({}), timeout=0.5)
    assert time.monotonic() - start < 5


# --- token -----------------------------------------------------------------------------


def test_token_required_wrong_and_right(serve):
    calls = []
    ep = serve({"echo": lambda req: calls.append(1) or echo(req)}, GrpcTransport(token="s3cret"))
    with pytest.raises(Unauthenticated, match="authentication failed.*no bearer token"):
        GrpcTransport().connect(ep.address).call("echo", Message({}, [torch.ones(3)]))
    with pytest.raises(Unauthenticated, match="authentication failed.*wrong bearer token"):
        GrpcTransport(token="guess").connect(ep.address).call("echo", Message({}, [torch.ones(3)]))
    assert calls == []
    reply = GrpcTransport(token="s3cret").connect(ep.address).call("echo", Message({"ok": 1}))
    assert reply.meta == {"echo": {"ok": 1}} and calls == [1]


def test_a_trainer_does_not_retry_a_wrong_token(serve):
    """A wrong token stays wrong: the trainer's master client raises Unauthenticated at
    its first call, where an unreachable master is looked up again for 120 s."""
    from pdps.adapters.memory_store import MemoryStore
    from pdps.core.job import Keys
    from pdps.core.wire import GetTaskRequest
    from pdps.roles.trainer.master_client import MasterClient

    calls = []
    ep = serve({"get_task": lambda req: calls.append(1) or Message({})}, GrpcTransport(token="s3cret"))
    store, keys = MemoryStore(), Keys("tokens")
    store.put(keys.master_addr, ep.address.encode())
    client = MasterClient(store, GrpcTransport(token="guess"), keys, "t0")
    start = time.monotonic()
    with pytest.raises(Unauthenticated, match="authentication failed"):
        client.call(GetTaskRequest(trainer="t0"))
    assert time.monotonic() - start < 30 and calls == []


def test_bad_options_are_config_errors():
    bad = (
        {"token": ""},
        {"token": "two\nlines"},
        {"chunk_bytes": 10},
        {"workers": 0},
        {"connect_timeout": 0},
        {"bulk_threshold": -1},
        {"bulk_threshold": 1.5},
        {"handshake_timeout": 0},
        {"idle_timeout": float("inf")},
        {"max_connections": 0},
        {"max_streams": 1.5},
    )
    for kwargs in bad:
        with pytest.raises(ConfigError):
            GrpcTransport(**kwargs)
    with pytest.raises(ConfigError, match="cert=..., key="):
        GrpcTransport(tls=TlsConfig(ca="/nonexistent")).serve(LOCAL, {})
    with pytest.raises(ConfigError, match="/nonexistent/ca.pem"):
        GrpcTransport(tls=TlsConfig(ca="/nonexistent/ca.pem")).connect("grpc://127.0.0.1:1")


# --- health --------------------------------------------------------------------------


def test_health_serving_then_not_serving_after_close_and_exempt_from_the_token():
    ep = GrpcTransport(token="s3cret").serve(LOCAL, {"echo": echo})
    channel = grpc.insecure_channel(ep.address.removeprefix("grpc://"))
    stub = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    for service in ("", gt.SERVICE):
        assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == serving
    watch = stub.Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == serving
    closer = threading.Thread(target=ep.close)
    closer.start()
    assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
    watch.cancel()
    closer.join(10)
    assert not closer.is_alive()
    ep.close()  # idempotent
    channel.close()


# --- TLS -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    return make_tls(tmp_path_factory.mktemp("tls"))


def test_tls_call(serve, tls):
    ep = serve({"echo": echo}, GrpcTransport(tls=TlsConfig(cert=tls["server_cert"], key=tls["server_key"])))
    ch = GrpcTransport(tls=TlsConfig(ca=tls["ca"])).connect(ep.address)
    assert torch.equal(ch.call("echo", Message({}, [torch.arange(4)]), timeout=10).tensors[0], torch.arange(4))


def test_mutual_tls_call_and_a_client_without_certificate_is_refused(serve, tls):
    server = GrpcTransport(tls=TlsConfig(cert=tls["server_cert"], key=tls["server_key"], ca=tls["ca"]))
    ep = serve({"echo": echo}, server)
    client = GrpcTransport(tls=TlsConfig(cert=tls["client_cert"], key=tls["client_key"], ca=tls["ca"]))
    assert client.connect(ep.address).call("echo", Message({"m": 1}), timeout=10).meta == {"echo": {"m": 1}}
    with pytest.raises(TransportError, match=f"cannot reach {ep.address}"):
        GrpcTransport(tls=TlsConfig(ca=tls["ca"]), connect_timeout=0.5).connect(ep.address).call("echo", Message({}))


def test_plaintext_client_to_tls_server_fails(serve, tls):
    ep = serve({"echo": echo}, GrpcTransport(tls=TlsConfig(cert=tls["server_cert"], key=tls["server_key"])))
    with pytest.raises(TransportError, match=ep.address):
        GrpcTransport(connect_timeout=0.5).connect(ep.address).call("echo", Message({}), timeout=5)


def test_tls_client_without_the_ca_fails(serve, tls):
    ep = serve({"echo": echo}, GrpcTransport(tls=TlsConfig(cert=tls["server_cert"], key=tls["server_key"])))
    with pytest.raises(TransportError, match=ep.address):
        GrpcTransport(tls=TlsConfig(), connect_timeout=0.5).connect(ep.address).call("echo", Message({}), timeout=5)


def test_tls_client_to_plaintext_server_fails(serve, tls):
    ep = serve({"echo": echo})
    with pytest.raises(TransportError, match=ep.address):
        GrpcTransport(tls=TlsConfig(ca=tls["ca"]), connect_timeout=0.5).connect(ep.address).call("echo", Message({}), timeout=5)


# --- addresses -------------------------------------------------------------------------


def test_wildcard_bind_publishes_the_advertised_host(serve):
    ep = serve({"echo": echo}, GrpcTransport(advertise_host="pserver-0.pdps.svc"), address="grpc://0.0.0.0:0")
    assert ep.address == f"grpc://pserver-0.pdps.svc:{ep.port}"
    reply = GrpcTransport().connect(f"grpc://127.0.0.1:{ep.port}").call("echo", Message({"via": "loopback"}))
    assert reply.meta == {"echo": {"via": "loopback"}}
    ep2 = serve({"echo": echo}, address="grpc://0.0.0.0:0")
    assert ep2.address == f"grpc://{socket.gethostname()}:{ep2.port}"
    assert serve({}).address.startswith("grpc://127.0.0.1:")  # a named host is published as given


def test_bad_addresses_and_a_taken_port(serve):
    for bad in ("inproc://x", "grpc://no-port", "grpc://host:notaport"):
        with pytest.raises(TransportError, match="grpc://host:port"):
            GrpcTransport().connect(bad)
    ep = serve({})
    with pytest.raises(TransportError, match="cannot serve gRPC"):
        GrpcTransport().serve(f"grpc://127.0.0.1:{ep.port}", {})


def test_registry_opens_the_grpc_transport_with_options():
    from pdps.registry import open_transport

    transport = open_transport("grpc", token="t", chunk_bytes=2 << 20)
    assert isinstance(transport, GrpcTransport) and transport.token == "t" and transport.chunk_bytes == 2 << 20
    assert isinstance(open_transport("grpc://"), GrpcTransport)


# --- the codec and the generated code --------------------------------------------------


def test_generated_code_is_fresh(tmp_path):
    """Fails when transport.proto changed without scripts/gen-proto being run."""
    env = {**os.environ, "PYTHON": sys.executable}
    subprocess.run([str(ROOT / "scripts" / "gen-proto"), str(tmp_path)], check=True, capture_output=True, timeout=120, env=env)
    for name in ("transport_pb2.py", "transport_pb2_grpc.py"):
        assert (tmp_path / name).read_bytes() == (PROTO / name).read_bytes(), f"{name} is stale: run scripts/gen-proto"


def test_generated_stub_names_the_path_the_adapter_serves():
    from pdps.adapters.proto import transport_pb2, transport_pb2_grpc

    assert transport_pb2.DESCRIPTOR.services_by_name["Transport"].full_name == gt.SERVICE
    assert hasattr(transport_pb2_grpc.TransportStub, "__init__") and gt.CALL_PATH == f"/{gt.SERVICE}/Call"


HEADERS = [
    gt.Header("", "", ()),
    gt.Header("push", '{"trainer":"t1","round":3}', (gt.TensorSpec("float32", (3, 4), 48), gt.TensorSpec("bool", (), 1))),
    gt.Header("ünïcode", '{"k":"✓"}', (gt.TensorSpec("bfloat16", (0, 5), 0), gt.TensorSpec("", (), 0))),
    gt.Header("m", "{}", (gt.TensorSpec("int64", (-1, 1 << 40), 1 << 62),)),  # negative dims encode as int64
    gt.Header("pull", '{"after_round":4}', (), timeout=29.75),  # a bulk request's deadline
    gt.Header("", "", (gt.TensorSpec("float32", (2,), 8),), timeout=1e-9),
]


@pytest.mark.parametrize("header", HEADERS)
def test_hand_codec_and_generated_classes_agree_on_headers(header):
    from pdps.adapters.proto import transport_pb2 as pb

    ours = gt.encode_header(header)
    frame = pb.Frame.FromString(ours)
    assert frame.WhichOneof("body") == "header"
    assert frame.header.method == header.method and frame.header.meta_json == header.meta_json
    assert frame.header.timeout == header.timeout
    specs = [gt.TensorSpec(s.dtype, tuple(s.shape), s.nbytes) for s in frame.header.tensors]
    assert specs == list(header.tensors)
    theirs = pb.Frame(
        header=pb.Header(
            method=header.method,
            meta_json=header.meta_json,
            tensors=[pb.TensorSpec(dtype=s.dtype, shape=s.shape, nbytes=s.nbytes) for s in header.tensors],
            timeout=header.timeout,
        )
    ).SerializeToString()
    assert theirs == ours
    assert gt.decode_frame(theirs) == header
    if header.timeout:  # what the bulk channel sends: the timeout added to a header encoded without it
        assert gt.with_timeout(gt.encode_header(attrs.evolve(header, timeout=0.0)), header.timeout) == ours


@pytest.mark.parametrize("timeout", [-1.0, float("nan"), float("inf")])
def test_a_header_timeout_that_is_no_time_left_is_malformed(timeout):
    from pdps.adapters.proto import transport_pb2 as pb

    frame = pb.Frame(header=pb.Header(method="m", timeout=timeout)).SerializeToString()
    with pytest.raises(gt.FrameError, match="timeout must be a finite number of seconds >= 0"):
        gt.decode_frame(frame)


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300, 1 << 20])
def test_hand_codec_and_generated_classes_agree_on_chunks(size):
    from pdps.adapters.proto import transport_pb2 as pb

    payload = bytes(range(256)) * (size // 256) + bytes(size % 256)
    ours = gt.chunk_prefix(size) + payload
    frame = pb.Frame.FromString(ours)
    assert frame.WhichOneof("body") == "chunk" and frame.chunk == payload
    theirs = pb.Frame(chunk=payload).SerializeToString()
    assert theirs == ours
    assert bytes(gt.decode_frame(theirs)) == payload


def test_decoder_reads_what_protobuf_may_also_write():
    """Unpacked repeated shape and unknown fields are valid protobuf: accepted."""
    from pdps.adapters.proto import transport_pb2 as pb

    spec = b"\x0a\x07float32" + b"\x10\x02\x10\x03" + b"\x18\x18" + b"\x20\x07"  # shape unpacked; field 4 unknown
    header = b"\x0a\x01m" + b"\x1a" + bytes([len(spec)]) + spec + b"\x2d\x00\x00\x00\x00"  # field 5 fixed32 unknown
    frame = b"\x0a" + bytes([len(header)]) + header + b"\x39" + bytes(8)  # field 7 fixed64 unknown
    parsed = pb.Frame.FromString(frame).header
    want = gt.Header("m", "", (gt.TensorSpec("float32", (2, 3), 24),))
    assert (parsed.method, list(parsed.tensors[0].shape), parsed.tensors[0].nbytes) == ("m", [2, 3], 24)
    assert gt.decode_frame(frame) == want


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty frame"),
        (b"\x0a\x05ab", "past the end"),
        (b"\x12\x80", "truncated varint"),
        (b"\x0b", "wire type 3"),
        (b"\x08\x01", "not length-delimited"),
        (b"\x0a\x00\x12\x00", "one body"),
        (b"\x0a\x03\x0a\x01\xff", "not UTF-8"),
        (b"\x0a" + b"\xff" * 11, "longer than 10 bytes"),
    ],
)
def test_decoder_rejects_malformed_frames(data, message):
    with pytest.raises(gt.FrameError, match=message):
        gt.decode_frame(data)


# --- the bulk channel ----------------------------------------------------------------------


def ping(req: Message) -> Message:
    return Message({})


def over_bulk(ep, **options) -> gt.GrpcChannel:
    """A channel to ``ep`` (which serves ``ping``) whose every call takes the bulk
    channel: bulk_threshold 0, and one call over gRPC has taught it the bulk port."""
    ch = GrpcTransport(bulk_threshold=0, **options).connect(ep.address)
    grpc_before, bulk_before = ep.grpc_calls, ep.bulk_calls
    ch.call("ping", Message({}), timeout=10)
    assert (ep.grpc_calls, ep.bulk_calls) == (grpc_before + 1, bulk_before)
    return ch


def bulk_socket(ep, token: str | None = None) -> socket.socket:
    """A raw connection to ``ep``'s bulk port, hello sent (with ``token``)."""
    sock = socket.create_connection(("127.0.0.1", ep.bulk_port), timeout=10)
    secret = (token or "").encode()
    sock.sendall(b"PDPSBULK" + bytes([1]) + len(secret).to_bytes(2, "big") + secret)
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the peer sends until it closes (a timeout fails: never a hang)."""
    out = bytearray()
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return bytes(out)


def test_bulk_is_off_with_threshold_none_and_on_by_default(serve):
    ep = serve({"echo": echo}, GrpcTransport(bulk_threshold=None))
    assert ep.bulk_port is None
    ch = GrpcTransport().connect(ep.address)
    for _ in range(2):
        assert torch.equal(ch.call("echo", Message({}, [torch.zeros(1 << 19)])).tensors[0], torch.zeros(1 << 19))
    assert (ep.grpc_calls, ep.bulk_calls) == (2, 0)
    assert serve({}).bulk_port is not None


def test_a_fixed_bulk_port_is_used_and_a_taken_one_is_a_clear_error(serve):
    from tests.servers import free_port

    port = free_port()
    ep = serve({"echo": echo}, GrpcTransport(bulk_port=port, bulk_threshold=0))
    assert ep.bulk_port == port
    ch = GrpcTransport(bulk_threshold=0).connect(ep.address)
    for _ in range(2):
        ch.call("echo", Message({}, [torch.ones(4)]))
    assert ep.bulk_calls == 1  # the second call went to the fixed port
    with pytest.raises(TransportError, match=f"bulk channel.*{port}|{port}.*bulk"):
        GrpcTransport(bulk_port=port).serve("grpc://127.0.0.1:0", {"echo": echo})
    with pytest.raises(ConfigError, match="bulk_port"):
        GrpcTransport(bulk_port=70000)


def test_64_mib_tensor_roundtrips_over_bulk(serve):
    ep = serve({"same": same, "ping": ping})
    ch = GrpcTransport().connect(ep.address)  # the default threshold, 1 MiB
    ch.call("ping", Message({}))
    big = torch.randn(16 << 20)
    reply = ch.call("same", Message({"k": "v"}, [big, torch.arange(5), torch.zeros(0)]), timeout=120)
    assert reply.meta == {"k": "v"}
    assert torch.equal(reply.tensors[0], big) and torch.equal(reply.tensors[1], torch.arange(5)) and reply.tensors[2].shape == (0,)
    assert (ep.grpc_calls, ep.bulk_calls) == (1, 1)


def test_every_dtype_roundtrips_over_bulk(serve):
    ep = serve({"same": same, "ping": ping})
    ch = over_bulk(ep)
    sent = []
    for name, d in sorted(gt.dtypes().items()):
        high = 2 if d == torch.bool else 256
        sent.append(torch.randint(0, high, (3 * 5 * d.itemsize,), dtype=torch.uint8).view(d).reshape(3, 5))
    reply = ch.call("same", Message({}, sent))
    for got, want in zip(reply.tensors, sent, strict=True):
        assert got.dtype == want.dtype and torch.equal(raw_bytes(got), raw_bytes(want))
    assert ep.bulk_calls == 1


def test_big_requests_and_big_replies_take_the_bulk_channel(serve):
    """A push (big request) goes over bulk once the port is known; a pull (tiny
    request, big reply) from its second call; small calls stay on gRPC."""
    big = torch.ones(1 << 19)  # 2 MiB, over the default threshold
    ep = serve({"pull": lambda req: Message({}, [big]), "push": lambda req: Message({}), "ping": ping})
    ch = GrpcTransport().connect(ep.address)
    calls = [("pull", []), ("pull", []), ("push", [big]), ("ping", []), ("ping", []), ("pull", [])]
    seen = []
    for method, tensors in calls:
        ch.call(method, Message({}, tensors))
        seen.append((ep.grpc_calls, ep.bulk_calls))
    assert seen == [(1, 0), (1, 1), (1, 2), (2, 2), (3, 2), (3, 3)]


def test_concurrent_calls_from_8_threads_over_bulk(serve):
    ep = serve({"echo": echo, "ping": ping})
    echo_from_8_threads(over_bulk(ep))
    assert (ep.grpc_calls, ep.bulk_calls) == (1, 80)


@pytest.mark.parametrize("via", ["grpc", "bulk"])
def test_handler_errors_keep_their_class_over_both_paths(serve, via):
    """A handler's PdpsError arrives as the same class and message over gRPC and over the
    bulk channel; there a handler's own Timeout stays a Timeout (a deadline is a socket
    timeout); a handler's bug is a TransportError naming the address."""

    def fail(req: Message) -> Message:
        kind = req.meta["kind"]
        if kind == "transition":
            raise InvalidTransition("task 7", "done", "lease", "finished tasks are never leased")
        if kind == "not_ready":
            raise NotReady("parameters not initialized")
        if kind == "timeout":
            raise Timeout("waited 3 s for round 4")
        if kind == "bug":
            raise KeyError("weights")
        raise StalePush("version 3 is 5 behind")

    ep = serve({"fail": fail, "echo": echo, "ping": ping})
    ch = over_bulk(ep) if via == "bulk" else GrpcTransport(bulk_threshold=None).connect(ep.address)
    with pytest.raises(InvalidTransition, match="'task 7' in state done cannot take event lease: finished tasks"):
        ch.call("fail", Message({"kind": "transition"}))
    with pytest.raises(NotReady, match="not initialized"):
        ch.call("fail", Message({"kind": "not_ready"}))
    with pytest.raises(Timeout, match="waited 3 s for round 4"):
        ch.call("fail", Message({"kind": "timeout"}, [torch.ones(3)]), timeout=30)
    with pytest.raises(StalePush, match="5 behind"):
        ch.call("fail", Message({"kind": "stale"}))
    with pytest.raises(TransportError) as info:
        ch.call("fail", Message({"kind": "bug"}))
    assert type(info.value) is TransportError and ep.address in str(info.value) and "KeyError" in str(info.value)
    with pytest.raises(TransportError, match="has no method 'nope'"):
        ch.call("nope", Message({}, [torch.ones(3)]))
    assert ch.call("echo", Message({"still": "up"})).meta == {"echo": {"still": "up"}}
    assert ep.bulk_calls == (7 if via == "bulk" else 0)


@pytest.mark.parametrize("via", ["grpc", "bulk"])
def test_max_request_bytes_over_both_paths(serve, via):
    calls = []
    ep = serve({"echo": lambda req: calls.append(1) or echo(req), "ping": ping}, GrpcTransport(max_request_bytes=1 << 20))
    ch = over_bulk(ep) if via == "bulk" else GrpcTransport(bulk_threshold=None).connect(ep.address)
    for size in (1 << 20, 16 << 20):  # 1 MiB + 4 bytes, 64 MiB: refused from the header alone
        with pytest.raises(TransportError, match="max_request_bytes"):
            ch.call("echo", Message({}, [torch.zeros((size >> 2) + 1)]), timeout=30)
    assert calls == []
    assert ch.call("echo", Message({}, [torch.zeros(1 << 18)])).tensors[0].numel() == 1 << 18  # exactly the limit
    assert calls == [1]
    assert ep.bulk_calls == (3 if via == "bulk" else 0)


def test_bulk_deadline_raises_timeout(serve):
    release = threading.Event()

    def stall(req: Message) -> Message:
        release.wait(10)
        return Message({})

    ep = serve({"stall": stall, "ping": ping})
    ch = over_bulk(ep)
    start = time.monotonic()
    with pytest.raises(Timeout, match="'stall'.*deadline"):
        ch.call("stall", Message({}, [torch.ones(4)]), timeout=0.5)
    assert time.monotonic() - start < 5
    release.set()
    assert ep.bulk_calls == 1
    ch.call("ping", Message({}), timeout=10)  # a fresh connection replaces the one given up
    assert ep.bulk_calls == 2


def test_bulk_hello_with_a_wrong_or_missing_token_is_refused(serve):
    calls = []
    ep = serve({"echo": lambda req: calls.append(1) or echo(req), "ping": ping}, GrpcTransport(token="s3cret"))
    request = b"\x01" + (0).to_bytes(4, "big")  # would be a request, were the hello accepted
    for token in ("guess", None, "s3cret-but-longer"):
        with bulk_socket(ep, token) as sock:
            sock.sendall(request)
            assert read_to_end(sock) == b"\x02"  # refused (wrong token), then closed
    with bulk_socket(ep, "s3cret") as sock:
        sock.shutdown(socket.SHUT_WR)
        assert read_to_end(sock) == b"\x00"  # accepted; closed when the client is done
    assert calls == [] and ep.bulk_calls == 0
    ch = over_bulk(ep, token="s3cret")
    assert ch.call("echo", Message({"ok": 1}, [torch.ones(2)])).meta == {"echo": {"ok": 1}}
    assert calls == [1] and ep.bulk_calls == 1


def test_bulk_over_tls_and_mutual_tls(serve, tls):
    server_tls = TlsConfig(cert=tls["server_cert"], key=tls["server_key"])
    mutual = TlsConfig(cert=tls["server_cert"], key=tls["server_key"], ca=tls["ca"])
    client = {"server-only": TlsConfig(ca=tls["ca"]), "mutual": TlsConfig(cert=tls["client_cert"], key=tls["client_key"], ca=tls["ca"])}
    for name, server in (("server-only", server_tls), ("mutual", mutual)):
        ep = serve({"same": same, "ping": ping}, GrpcTransport(tls=server))
        ch = over_bulk(ep, tls=client[name])
        x = torch.randn(3 << 18)  # 3 MiB: several TLS writes and many records
        assert torch.equal(ch.call("same", Message({}, [x]), timeout=30).tensors[0], x)
        assert ep.bulk_calls == 1, name


def hello_answer(port: int, context: ssl.SSLContext | None = None) -> bytes:
    """The server's answer to a hello without a token at ``port`` (over TLS with
    ``context``); b"" when the connection failed or closed first."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        try:
            sock = raw if context is None else context.wrap_socket(raw, server_hostname="127.0.0.1")
            sock.sendall(b"PDPSBULK\x01\x00\x00")
            return sock.recv(1)
        except (ssl.SSLError, ConnectionError):
            return b""


def test_plaintext_and_tls_bulk_ports_do_not_mix(serve, tls):
    mutual = TlsConfig(cert=tls["server_cert"], key=tls["server_key"], ca=tls["ca"])
    tls_ep = serve({"ping": ping}, GrpcTransport(tls=mutual))
    plain_ep = serve({"ping": ping})
    with_cert = TlsConfig(cert=tls["client_cert"], key=tls["client_key"], ca=tls["ca"]).client_context()
    without_cert = TlsConfig(ca=tls["ca"]).client_context()
    assert hello_answer(plain_ep.bulk_port) == b"\x00"
    assert hello_answer(tls_ep.bulk_port, with_cert) == b"\x00"
    assert hello_answer(tls_ep.bulk_port) == b""  # plaintext to a TLS port
    assert hello_answer(plain_ep.bulk_port, with_cert) == b""  # TLS to a plaintext port
    assert hello_answer(tls_ep.bulk_port, without_cert) == b""  # no client certificate at a mutual-TLS port
    assert tls_ep.bulk_calls == plain_ep.bulk_calls == 0


def test_endpoint_closed_with_idle_bulk_connections(serve):
    ep = serve({"echo": echo, "ping": ping})
    ch = over_bulk(ep, connect_timeout=0.5)
    ch.call("echo", Message({}, [torch.ones(3)]))  # leaves an idle connection in the pool
    ep.close()
    start = time.monotonic()
    with pytest.raises(TransportError, match=ep.address):
        ch.call("echo", Message({}, [torch.ones(3)]), timeout=5)
    assert time.monotonic() - start < 5


def test_a_connection_the_server_dropped_is_replaced_without_running_a_handler_twice(serve):
    runs = []
    # The server closes idle connections fast; the client (120 s) still reuses them.
    ep = serve({"echo": lambda req: runs.append(req.meta["n"]) or echo(req), "ping": ping}, GrpcTransport(idle_timeout=0.2))
    ch = over_bulk(ep)
    for n in range(3):
        assert ch.call("echo", Message({"n": n}, [torch.ones(3)])).meta["echo"]["n"] == n
        time.sleep(0.5)  # the pooled connection is closed by the server: the next call finds it dead
    assert runs == [0, 1, 2]
    assert (ep.grpc_calls, ep.bulk_calls) == (1, 3)


def test_handler_runs_once_when_the_bulk_connection_dies_after_the_request_was_accepted():
    runs = []
    entered = threading.Event()

    def slow(req: Message) -> Message:
        runs.append(req.meta["n"])
        entered.set()
        time.sleep(1.0)
        return Message({})

    first = GrpcTransport().serve(LOCAL, {"slow": slow, "ping": ping})
    second = []

    def kill() -> None:
        entered.wait(10)
        first.close(grace=0)
        second.append(GrpcTransport().serve(f"grpc://127.0.0.1:{first.port}", {"slow": slow, "ping": ping}))

    ch = over_bulk(first)
    killer = threading.Thread(target=kill)
    killer.start()
    try:
        with pytest.raises(TransportError, match="after the server accepted it"):
            ch.call("slow", Message({"n": 1}, [torch.ones(3)]), timeout=10)
    finally:
        killer.join()
        for ep in second:
            ep.close()
    assert runs == [1] and first.bulk_calls == 1
    assert second, "the second server did not come up"


def test_an_unreachable_bulk_port_sends_calls_over_grpc_and_is_logged_once(serve, caplog):
    ep = serve({"echo": echo, "ping": ping})
    ch = over_bulk(ep)
    ep._bulk.close(0)  # gRPC still serves; the bulk port refuses connections
    with caplog.at_level("WARNING", logger=gt.__name__):
        for n in range(3):
            assert ch.call("echo", Message({"n": n}, [torch.ones(3)])).meta == {"echo": {"n": n}}
    assert (ep.grpc_calls, ep.bulk_calls) == (4, 0)
    warnings = [r for r in caplog.records if "bulk channel" in r.getMessage()]
    assert len(warnings) == 1 and ep.address in warnings[0].getMessage()


# --- client-side stats ---------------------------------------------------------------


@pytest.mark.parametrize("bulk_threshold", [0, None], ids=["bulk", "grpc-only"])
def test_channel_stats_move_on_a_loopback_call(serve, bulk_threshold):
    transport = GrpcTransport(bulk_threshold=bulk_threshold, chunk_bytes=64 << 10)
    ep = serve({"same": same}, transport)
    channel = transport.connect(ep.address)
    assert channel.stats == {"serialize": 0.0, "calls": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0}
    sent = torch.arange(1 << 18, dtype=torch.float32)  # 1 MiB: 16 chunk frames over gRPC
    for i in range(3):  # the first learns the bulk port; the others take the bulk channel
        reply = channel.call("same", Message({"i": i}, [sent]))
        assert torch.equal(reply.tensors[0], sent)
    stats = dict(channel.stats)
    assert stats["calls"] == 3
    assert 3 * sent.nbytes < stats["bytes_sent"] < 3 * (sent.nbytes + 1024)  # + each header frame
    assert 3 * sent.nbytes < stats["bytes_received"] < 3 * (sent.nbytes + 1024)
    assert 0.0 < stats["serialize"] < 10.0
    with pytest.raises(TransportError):
        channel.call("nope", Message({}))
    assert channel.stats["calls"] == 4 and channel.stats["bytes_received"] == stats["bytes_received"]
    channel.close()


def test_channel_stats_add_up_over_concurrent_calls(serve):
    transport = GrpcTransport()
    ep = serve({"same": same}, transport)
    channel = transport.connect(ep.address)
    sent = torch.ones(1000)
    threads = [threading.Thread(target=lambda: [channel.call("same", Message({}, [sent])) for _ in range(10)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert channel.stats["calls"] == 40
    for key in ("bytes_sent", "bytes_received"):  # none lost to a race: 40 x (header frame + 4000)
        assert 40 * 4000 < channel.stats[key] < 40 * 5000
        assert (channel.stats[key] - 40 * 4000) % 40 == 0
    channel.close()


# --- connection hygiene: deadlines, caps, refusal warnings --------------------------------

#: HTTP/2 as a client opens it: the preface, then an empty SETTINGS frame.
H2_OPEN = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")
H2_PING = bytes.fromhex("000008060000000000") + bytes(8)


def h2_call_headers(stream: int = 1) -> bytes:
    """A HEADERS frame opening a call of the transport (HPACK literals, no compression)."""
    fields = [(":method", "POST"), (":scheme", "http"), (":path", gt.CALL_PATH), (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")]
    block = b"".join(b"\x00" + bytes([len(n)]) + n.encode() + bytes([len(v)]) + v.encode() for n, v in fields)
    return len(block).to_bytes(3, "big") + b"\x01\x04" + stream.to_bytes(4, "big") + block


def raw_connection(port: int, first: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(first)
    sock.setblocking(False)
    return sock


def watch_until_closed(socks: dict[socket.socket, bytes], within: float, every: float = 0.2) -> dict[socket.socket, float]:
    """Read (and discard) what the server sends on each socket until it closes it, for
    at most ``within`` seconds; every ``every`` seconds, send the next byte of each
    socket's drip (a slowloris). Returns the seconds after which each was closed."""
    start = time.monotonic()
    closed: dict[socket.socket, float] = {}
    sent = 0
    next_drip = start
    while len(closed) < len(socks) and time.monotonic() - start < within:
        ready, _, _ = select.select([s for s in socks if s not in closed], [], [], every / 2)
        for sock in ready:
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, BlockingIOError) as exc:
                data = b"" if isinstance(exc, ConnectionResetError) else b"-"
            if not data:
                closed[sock] = time.monotonic() - start
        if time.monotonic() >= next_drip:
            next_drip += every
            for sock, drip in socks.items():
                if sock not in closed and sent < len(drip):
                    try:
                        sock.send(drip[sent : sent + 1])
                    except OSError:
                        closed[sock] = time.monotonic() - start
            sent += 1
    return closed


def test_idle_slow_and_silent_connections_are_closed_on_both_ports_while_calls_go_on(serve):
    ep = serve({"echo": echo, "ping": ping}, GrpcTransport(handshake_timeout=1.0, idle_timeout=2.0))
    ch = over_bulk(ep)
    hello = b"PDPSBULK\x01\x00\x00"
    peers = {
        "grpc, never a byte": [(raw_connection(ep.port), b"") for _ in range(50)],
        "grpc, a byte every 0.2 s": [(raw_connection(ep.port), H2_OPEN) for _ in range(5)],
        "grpc, HTTP/2 open, then silent": [(raw_connection(ep.port, H2_OPEN), b"") for _ in range(3)],
        "grpc, a call opened, then silent (ignores keepalive pings)": [(raw_connection(ep.port, H2_OPEN + h2_call_headers()), b"") for _ in range(2)],
        "grpc, pings without calls": [(raw_connection(ep.port, H2_OPEN), H2_PING * 40) for _ in range(2)],
        "bulk, never a byte": [(raw_connection(ep.bulk_port), b"") for _ in range(10)],
        "bulk, a byte every 0.2 s": [(raw_connection(ep.bulk_port), hello) for _ in range(5)],
        "bulk, hello, then silent": [(raw_connection(ep.bulk_port, hello), b"") for _ in range(3)],
    }
    try:
        assert ch.call("echo", Message({"n": 1}, [torch.ones(3)]), timeout=10).meta["echo"]["n"] == 1
        closed = watch_until_closed({s: drip for group in peers.values() for s, drip in group}, within=20.0)
        left_open = {name: sum(s not in closed for s, _ in group) for name, group in peers.items()}
        assert left_open == dict.fromkeys(peers, 0)
        # the deadlines are 1 s (handshake, hello, a ping's answer) and 2 s (idle): nothing took long
        assert max(closed.values()) < 10.0
        assert ch.call("echo", Message({"n": 2}, [torch.ones(3)]), timeout=10).meta["echo"]["n"] == 2
        assert ep.bulk_calls == 2
    finally:
        for group in peers.values():
            for sock, _ in group:
                sock.close()


def test_connections_beyond_max_connections_are_closed_at_once_on_both_ports(serve):
    ep = serve({"echo": echo, "ping": ping}, GrpcTransport(max_connections=2))
    held = [raw_connection(ep.port, H2_OPEN) for _ in range(2)]
    try:
        extra = raw_connection(ep.port, H2_OPEN)
        assert watch_until_closed({extra: b""}, within=5.0)  # closed at once, before any SETTINGS
        extra.close()
        with pytest.raises(TransportError, match="cannot reach"):
            GrpcTransport(connect_timeout=0.5).connect(ep.address).call("echo", Message({}), timeout=5)
    finally:
        for sock in held:
            sock.close()
    ch = over_bulk(ep)  # the held connections are gone: there is room again
    bulk_held = [bulk_socket(ep), bulk_socket(ep)]
    try:
        for sock in bulk_held:
            assert sock.recv(1) == b"\x00"
        with bulk_socket(ep) as third:
            assert read_to_end(third) == b"\x03"  # busy
        assert ch.call("echo", Message({"n": 1}, [torch.ones(3)])).meta == {"echo": {"n": 1}}
        assert (ep.grpc_calls, ep.bulk_calls) == (2, 0)  # the bulk port was full: over gRPC
    finally:
        for sock in bulk_held:
            sock.close()


def test_calls_beyond_max_streams_on_one_connection_wait_their_turn(serve):
    lock = threading.Lock()
    running = [0, 0]  # now, most at once

    def hold(req: Message) -> Message:
        with lock:
            running[0] += 1
            running[1] = max(running)
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return Message({"n": req.meta["n"]})

    ep = serve({"hold": hold}, GrpcTransport(max_streams=2, bulk_threshold=None))
    ch = GrpcTransport(bulk_threshold=None).connect(ep.address)
    replies: list[int] = []
    threads = [threading.Thread(target=lambda n=n: replies.append(ch.call("hold", Message({"n": n}), timeout=30).meta["n"])) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(replies) == list(range(6))  # none refused: the client queued them
    assert running[1] <= 2


def test_a_flood_of_refusals_logs_a_few_warnings_and_then_one_summary(serve, caplog):
    ep = serve({"echo": echo, "ping": ping}, GrpcTransport(token="s3cret"))
    intruder = GrpcTransport(token="guess", bulk_threshold=None).connect(ep.address)
    with caplog.at_level("WARNING", logger="pdps"):
        for _ in range(30):
            with pytest.raises(TransportError, match="authentication failed"):
                intruder.call("echo", Message({}))
        for _ in range(30):
            with bulk_socket(ep, "guess") as sock:
                assert read_to_end(sock) == b"\x02"
        ep.close()
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert 2 <= len(lines) <= 10, lines
    summaries = [line for line in lines if " more " in line]
    assert len(summaries) == 1 and ep.address in summaries[0] and "127.0.0.1" in summaries[0], lines
    told = len(lines) - 1 + int(summaries[0].split(" more ")[0].split()[-1])
    assert told == 60  # each refusal is either told on its own or counted in the summary


def test_a_tls_handshake_that_never_comes_is_given_up_on_both_ports(serve, tls):
    server = TlsConfig(cert=tls["server_cert"], key=tls["server_key"], ca=tls["ca"])
    ep = serve({"ping": ping}, GrpcTransport(tls=server, handshake_timeout=1.0))
    silent = [raw_connection(port) for port in (ep.port, ep.bulk_port) for _ in range(5)]
    try:
        closed = watch_until_closed(dict.fromkeys(silent, b""), within=20.0)
        assert len(closed) == len(silent) and max(closed.values()) < 5.0  # 10 s without the option, on both ports
    finally:
        for sock in silent:
            sock.close()
    client = TlsConfig(cert=tls["client_cert"], key=tls["client_key"], ca=tls["ca"])
    assert GrpcTransport(tls=client).connect(ep.address).call("ping", Message({}), timeout=10).meta == {}


def test_a_full_receive_buffer_pool_makes_room_for_a_larger_buffer_than_it_holds():
    """The pool drops its smallest idle buffer, found by identity: comparing numpy arrays
    with == (list.remove) raised on buffers of other sizes, and every call receiving
    into a new size failed once the pool was full (a 1 GiB model after a 64 MiB one)."""
    pool = gt._BufferPool(keep=2, max_bytes=1 << 30, min_bytes=1)
    pool.take(36 << 20)
    pool.take(4 << 20)  # both idle once their tensors go; the smallest is not the first
    got = pool.take(100 << 20)
    assert got.numel() == 100 << 20
    assert sorted(a.size for a in pool._arrays) == [36 << 20, 100 << 20]  # the smallest idle one made room


SLOW_SERVER = """
import sys, time
from pdps.adapters.grpc_transport import GrpcTransport
from pdps.ports.transport import Message
def slow(req):
    time.sleep(float(req.meta["s"]))
    return Message({"slept": req.meta["s"]})
ep = GrpcTransport().serve("grpc://127.0.0.1:0", {"slow": slow})
print(ep.address, flush=True)
sys.stdin.read()
"""


def test_a_call_to_a_stopped_process_fails_and_a_long_quiet_call_does_not():
    """While a call is open the client pings the server: a server process stopped
    (SIGSTOP) answers no ping, so the call fails instead of hanging, and so does a call
    made while it stays stopped (its handshake is given up); a handler that
    takes several ping intervals to answer, sending nothing meanwhile, is not cut off
    (the server accepts the pings)."""
    import os
    import signal
    import subprocess
    import sys
    import threading

    from pdps.adapters.grpc_transport import CALL_PING_S

    root = str(Path(__file__).parents[2])
    server = subprocess.Popen([sys.executable, "-c", SLOW_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": root})
    try:
        address = server.stdout.readline().strip()
        channel = GrpcTransport(connect_timeout=3.0).connect(address)  # the default (10 s) would only make this test longer
        quiet = 2.5 * CALL_PING_S
        assert channel.call("slow", Message({"s": quiet}), timeout=60).meta == {"slept": quiet}
        threading.Timer(0.5, os.kill, (server.pid, signal.SIGSTOP)).start()
        began = time.monotonic()
        with pytest.raises(TransportError, match="ping timeout"):
            channel.call("slow", Message({"s": 1.0}), timeout=60)
        assert time.monotonic() - began < 30
        began = time.monotonic()  # a call made while it is stopped: its kernel still accepts the connection
        with pytest.raises(TransportError, match="cannot reach"):
            channel.call("slow", Message({"s": 1.0}), timeout=60)
        assert time.monotonic() - began < 8  # connect_timeout and a handshake's margin, not the 20 s gRPC waits by default
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.wait()
