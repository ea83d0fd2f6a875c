"""Hostile bytes against one live grpc:// server: every bad stream ends with a non-OK
status, the server keeps serving, and the parameter it holds is unchanged.

The server (started once for the module) requires a token and accepts at most 1 MiB
of tensors per request. It serves ``push`` (adds a float32[1024] gradient into its
parameter, GradientRejected for any other shape or dtype) and ``pull``. The fuzzer
talks raw gRPC (no adapter client, bytes in and out) so it can send anything, and
raw TCP to the server's bulk channel port (hello, prefixes, headers, tensor bytes).
"""

from __future__ import annotations

import json
import socket
import struct
import threading

import grpc
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdps.adapters import grpc_transport as gt
from pdps.core.errors import GradientRejected
from pdps.ports.transport import Message

TOKEN = "fuzz-token"
LIMIT = 1 << 20
N = 1024
AUTH = (("authorization", f"Bearer {TOKEN}"),)
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED}


class ParameterServer:
    def __init__(self) -> None:
        self.param = torch.zeros(N, dtype=torch.float32)
        self.lock = threading.Lock()

    def push(self, req: Message) -> Message:
        if len(req.tensors) != 1 or req.tensors[0].dtype != torch.float32 or req.tensors[0].shape != (N,):
            got = [(str(t.dtype), tuple(t.shape)) for t in req.tensors]
            raise GradientRejected(f"push needs one float32[{N}] gradient, got {got}")
        with self.lock:
            self.param += req.tensors[0]
        return Message({"ok": True})

    def pull(self, req: Message) -> Message:
        with self.lock:
            return Message({}, [self.param.clone()])


@pytest.fixture(scope="module")
def live():
    state = ParameterServer()
    transport = gt.GrpcTransport(token=TOKEN, max_request_bytes=LIMIT)
    endpoint = transport.serve("grpc://127.0.0.1:0", {"push": state.push, "pull": state.pull})
    yield state, transport, endpoint
    endpoint.close()


@pytest.fixture(scope="module")
def server(live):
    state, transport, endpoint = live
    client = transport.connect(endpoint.address)  # 4 KiB calls: below the bulk threshold, over gRPC
    raw = grpc.insecure_channel(endpoint.address.removeprefix("grpc://"))
    yield state, client, raw
    raw.close()
    client.close()


@pytest.fixture(scope="module")
def bulk_port(live):
    return live[2].bulk_port


def call_raw(raw: grpc.Channel, frames: list[bytes], metadata=AUTH, path: str = gt.CALL_PATH) -> grpc.StatusCode:
    """Send ``frames`` as they are; the call's final status (a deadline: never a hang)."""
    call = raw.stream_stream(path)(iter(frames), timeout=10, metadata=metadata)
    try:
        for _ in call:
            pass
    except grpc.RpcError:
        pass
    code = call.code()
    assert code != grpc.StatusCode.DEADLINE_EXCEEDED, "the server hung on a bad stream"
    return code


def header(method: str = "push", meta: str = "{}", specs=((("float32", (N,), 4 * N)),)) -> bytes:
    return gt.encode_header(gt.Header(method, meta, tuple(gt.TensorSpec(d, tuple(s), n) for d, s, n in specs)))


def chunks(data: bytes, size: int = 1000) -> list[bytes]:
    return [gt.chunk_prefix(len(data[i : i + size])) + data[i : i + size] for i in range(0, len(data), size)]


GRADIENT = torch.ones(N, dtype=torch.float32).numpy().tobytes()


def assert_refused_and_unchanged(server, frames, metadata=AUTH, path=gt.CALL_PATH, expected=REFUSED) -> None:
    state, client, raw = server
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    code = call_raw(raw, frames, metadata, path)
    assert code in expected, code
    after = client.call("pull", Message({}), timeout=10).tensors[0]  # still serving
    assert torch.equal(raw_bits(after), raw_bits(before))


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


def test_a_valid_raw_push_changes_the_parameter(server):
    """The baseline that makes the refusals below mean something."""
    state, client, raw = server
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    assert call_raw(raw, [header(), *chunks(GRADIENT)]) == grpc.StatusCode.OK
    after = client.call("pull", Message({}), timeout=10).tensors[0]
    assert torch.equal(after, before + 1)


@FUZZ
@given(st.lists(st.binary(max_size=80), max_size=6))
def test_random_frames(server, frames):
    assert_refused_and_unchanged(server, frames)


@FUZZ
@given(st.integers(0, 4 * N - 1), st.integers(64, 4096))
def test_truncated_stream(server, sent, size):
    assert_refused_and_unchanged(server, [header(), *chunks(GRADIENT[:sent], size)])


@FUZZ
@given(st.binary(min_size=1, max_size=3000), st.integers(256, 4096))
def test_more_bytes_than_declared(server, extra, size):
    assert_refused_and_unchanged(server, [header(), *chunks(GRADIENT + extra, size)])


def _not_a_json_object(text: str) -> bool:
    if not text:
        return False  # empty meta means {}
    try:
        return not isinstance(json.loads(text), dict)
    except ValueError:
        return True


@FUZZ
@given(st.text(max_size=40).filter(_not_a_json_object))
def test_meta_that_is_not_a_json_object(server, meta):
    assert_refused_and_unchanged(server, [header(meta=meta), *chunks(GRADIENT)])


@FUZZ
@given(st.text(max_size=20).filter(lambda name: name not in gt.dtypes()))
def test_unknown_dtype(server, dtype):
    assert_refused_and_unchanged(server, [header(specs=[(dtype, (N,), 4 * N)]), *chunks(GRADIENT)])


@FUZZ
@given(st.lists(st.integers(-(1 << 40), 1 << 12), max_size=4), st.integers(0, 1 << 40))
def test_shape_and_nbytes_that_disagree(server, shape, nbytes):
    numel = 1
    for d in shape:
        numel *= d
    if min(shape, default=0) >= 0 and numel * 4 == nbytes:
        nbytes += 4
    assert_refused_and_unchanged(server, [header(specs=[("float32", shape, nbytes)]), *chunks(GRADIENT)])


@FUZZ
@given(
    st.one_of(
        st.integers(LIMIT + 1, 1 << 40).map(lambda n: [n]),  # one tensor over the limit
        st.lists(st.integers(1, LIMIT), min_size=2, max_size=4).filter(lambda sizes: sum(sizes) > LIMIT),  # several
    )
)
def test_declared_size_over_the_limit(server, sizes):
    specs = [("uint8", (n,), n) for n in sizes]
    assert_refused_and_unchanged(server, [header(specs=specs), *chunks(GRADIENT)], expected={grpc.StatusCode.RESOURCE_EXHAUSTED})


@FUZZ
@given(st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30)))
def test_wrong_or_missing_token(server, token):
    if token == TOKEN:
        token += "x"
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    assert_refused_and_unchanged(server, [header(), *chunks(GRADIENT)], metadata=metadata, expected={grpc.StatusCode.UNAUTHENTICATED})


@FUZZ
@given(st.text(min_size=1, max_size=30).filter(lambda m: m not in ("push", "pull")))
def test_unknown_method_in_the_header(server, method):
    assert_refused_and_unchanged(server, [header(method=method), *chunks(GRADIENT)], expected={grpc.StatusCode.UNIMPLEMENTED})


@FUZZ
@given(st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30))
def test_unknown_grpc_method_path(server, name):
    path = f"/{name}" if f"/{name}" != gt.CALL_PATH else "/x"
    assert_refused_and_unchanged(server, [header(), *chunks(GRADIENT)], path=path, expected={grpc.StatusCode.UNIMPLEMENTED})


def test_a_shape_with_too_many_dimensions(server):
    """Checking a shape is bounded work: 100,000 dimensions of 2**62 are refused unread."""
    assert_refused_and_unchanged(server, [header(specs=[("float32", [1 << 62] * 100_000, 4)])])


@FUZZ
@given(st.sampled_from(["chunk first", "two headers", "bool bytes", "wrong shape", "wrong dtype", "two tensors"]))
def test_well_formed_but_wrong_requests(server, case):
    frames = {
        "chunk first": [*chunks(GRADIENT), header()],
        "two headers": [header(), header(), *chunks(GRADIENT)],
        "bool bytes": [header(specs=[("bool", (4 * N,), 4 * N)]), *chunks(GRADIENT)],
        "wrong shape": [header(specs=[("float32", (N // 2, 2), 4 * N)]), *chunks(GRADIENT)],
        "wrong dtype": [header(specs=[("int32", (N,), 4 * N)]), *chunks(GRADIENT)],
        "two tensors": [header(specs=[("float32", (N // 2,), 2 * N)] * 2), *chunks(GRADIENT)],
    }[case]
    assert_refused_and_unchanged(server, frames)


# --- the bulk channel's port ---------------------------------------------------------------

ACCEPTED, REPLY, ERROR = 2, 3, 4


def hello(token: str | None = TOKEN, magic: bytes = b"PDPSBULK", version: int = 1) -> bytes:
    secret = (token or "").encode()
    return magic + bytes([version]) + len(secret).to_bytes(2, "big") + secret


def bulk_message(head: bytes, payload: bytes = b"", kind: int = 1) -> bytes:
    return struct.pack("!BI", kind, len(head)) + head + payload


def bulk_exchange(port: int, data: bytes) -> bytes:
    """Send ``data`` to the bulk port, close the sending side, and return all the
    server sent until it closed (a 10 s timeout fails: the server must never hang)."""
    out = bytearray()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may refuse and close before reading everything
        try:
            while chunk := sock.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail("the bulk server hung on a bad stream")
    return bytes(out)


def bulk_answer(data: bytes) -> tuple[int | None, list[tuple[int, dict | None, bytes]]]:
    """The hello status and the messages (kind, meta, tensor bytes) in a server's answer."""
    if not data:
        return None, []
    messages, pos = [], 1
    while pos < len(data):
        kind, size = struct.unpack_from("!BI", data, pos)
        pos += 5
        if size == 0:
            messages.append((kind, None, b""))
            continue
        head = gt.decode_frame(data[pos : pos + size])
        pos += size
        nbytes = sum(spec.nbytes for spec in head.tensors)
        messages.append((kind, json.loads(head.meta_json or "{}"), data[pos : pos + nbytes]))
        pos += nbytes
    return data[0], messages


def bulk_pull(port: int) -> torch.Tensor:
    """The parameter, pulled over the bulk port with raw bytes."""
    status, messages = bulk_answer(bulk_exchange(port, hello() + bulk_message(header("pull", specs=()))))
    assert status == 0 and [m[0] for m in messages] == [ACCEPTED, REPLY], messages
    return torch.frombuffer(bytearray(messages[1][2]), dtype=torch.float32)


def assert_bulk_refused_and_unchanged(server, port, data, expected=("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED")) -> list:
    """``data`` after a valid hello: no handler runs (an ERROR or a plain close answers
    it), the parameter is unchanged, and both gRPC and the bulk port still serve."""
    state, client, raw = server
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    status, messages = bulk_answer(bulk_exchange(port, hello() + data))
    assert status == 0
    assert ACCEPTED not in [m[0] for m in messages], messages
    for kind, meta, _ in messages:
        assert kind == ERROR and meta["status"] in expected, messages
    after = client.call("pull", Message({}), timeout=10).tensors[0]
    assert torch.equal(raw_bits(after), raw_bits(before))
    assert torch.equal(raw_bits(bulk_pull(port)), raw_bits(before))
    return messages


def test_a_valid_raw_bulk_push_changes_the_parameter(server, bulk_port):
    """The baseline that makes the refusals below mean something."""
    state, client, raw = server
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    status, messages = bulk_answer(bulk_exchange(bulk_port, hello() + bulk_message(header(), GRADIENT)))
    assert status == 0 and [(kind, meta) for kind, meta, _ in messages] == [(ACCEPTED, None), (REPLY, {"ok": True})]
    after = client.call("pull", Message({}), timeout=10).tensors[0]
    assert torch.equal(after, before + 1) and torch.equal(bulk_pull(bulk_port), before + 1)


@FUZZ
@given(st.binary(max_size=200))
def test_bulk_random_bytes_after_the_hello(server, bulk_port, data):
    state, client, raw = server
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    bulk_exchange(bulk_port, hello() + data)  # may even be a valid pull: only a push changes the parameter
    assert torch.equal(raw_bits(client.call("pull", Message({}), timeout=10).tensors[0]), raw_bits(before))
    assert torch.equal(raw_bits(bulk_pull(bulk_port)), raw_bits(before))


@FUZZ
@given(st.binary(max_size=60), st.binary(max_size=100))
def test_bulk_random_hello(server, bulk_port, greeting, rest):
    state, client, raw = server
    if greeting.startswith(hello()):
        greeting = b"X" + greeting
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    answer = bulk_exchange(bulk_port, greeting + bulk_message(header(), GRADIENT) + rest)
    assert answer in (b"", b"\x01", b"\x02"), answer  # a refusal, or closed before a whole hello
    assert torch.equal(raw_bits(bulk_pull(bulk_port)), raw_bits(before))


@FUZZ
@given(st.sampled_from([b"PDPSBULX", b"pdpsbulk", b"HTTP/1.1", b"\x16\x03\x01\x02\x00\x01\x00\x01"]), st.integers(0, 255))
def test_bulk_bad_magic_or_version(server, bulk_port, magic, version):
    state, client, raw = server
    if magic == b"PDPSBULK" or version == 1:
        version = 2
    answer = bulk_exchange(bulk_port, hello(magic=magic, version=version) + bulk_message(header(), GRADIENT))
    assert answer == b"\x01"
    answer = bulk_exchange(bulk_port, hello(version=version) + bulk_message(header(), GRADIENT))
    assert answer == b"\x01"


@FUZZ
@given(st.one_of(st.none(), st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=30)))
def test_bulk_wrong_or_missing_token(server, bulk_port, token):
    state, client, raw = server
    if token == TOKEN:
        token += "x"
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    assert bulk_exchange(bulk_port, hello(token) + bulk_message(header(), GRADIENT)) == b"\x02"
    assert torch.equal(raw_bits(bulk_pull(bulk_port)), raw_bits(before))


@FUZZ
@given(st.text(max_size=40).filter(_not_a_json_object))
def test_bulk_meta_that_is_not_a_json_object(server, bulk_port, meta):
    messages = assert_bulk_refused_and_unchanged(server, bulk_port, bulk_message(header(meta=meta), GRADIENT))
    assert messages and "meta" in messages[0][1]["message"]


@FUZZ
@given(st.binary(max_size=100))
def test_bulk_header_that_is_not_a_frame(server, bulk_port, junk):
    assert_bulk_refused_and_unchanged(server, bulk_port, bulk_message(junk, GRADIENT))


@FUZZ
@given(
    st.one_of(
        st.integers(LIMIT + 1, 1 << 40).map(lambda n: [n]),
        st.lists(st.integers(1, LIMIT), min_size=2, max_size=4).filter(lambda sizes: sum(sizes) > LIMIT),
    )
)
def test_bulk_declared_size_over_the_limit(server, bulk_port, sizes):
    specs = [("uint8", (n,), n) for n in sizes]
    messages = assert_bulk_refused_and_unchanged(server, bulk_port, bulk_message(header(specs=specs), GRADIENT), expected=("RESOURCE_EXHAUSTED",))
    assert len(messages) == 1


@FUZZ
@given(st.integers(0, 4 * N - 1))
def test_bulk_truncated_payload(server, bulk_port, sent):
    messages = assert_bulk_refused_and_unchanged(server, bulk_port, bulk_message(header(), GRADIENT[:sent]))
    assert len(messages) == 1 and "ended early" in messages[0][1]["message"]


@FUZZ
@given(st.integers(0, 300))
def test_bulk_truncated_prefix_or_header(server, bulk_port, cut):
    whole = bulk_message(header(), GRADIENT)
    assert_bulk_refused_and_unchanged(server, bulk_port, whole[: min(cut, len(whole) - len(GRADIENT) - 1)])


@FUZZ
@given(st.integers(0, 255).filter(lambda kind: kind != 1), st.integers(0, (1 << 32) - 1))
def test_bulk_wrong_kind_or_huge_header_length(server, bulk_port, kind, size):
    messages = assert_bulk_refused_and_unchanged(server, bulk_port, struct.pack("!BI", kind, size) + header() + GRADIENT)
    assert len(messages) == 1
    huge = assert_bulk_refused_and_unchanged(server, bulk_port, struct.pack("!BI", 1, gt.MAX_FRAME_BYTES + 1 + size % 1000) + GRADIENT)
    assert len(huge) == 1


@FUZZ
@given(st.text(min_size=1, max_size=30).filter(lambda m: m not in ("push", "pull")))
def test_bulk_unknown_method(server, bulk_port, method):
    messages = assert_bulk_refused_and_unchanged(server, bulk_port, bulk_message(header(method=method), GRADIENT), expected=("UNIMPLEMENTED",))
    assert len(messages) == 1


@FUZZ
@given(st.sampled_from(["bool bytes", "wrong shape", "wrong dtype", "two tensors", "bad dims"]))
def test_bulk_well_formed_but_wrong_requests(server, bulk_port, case):
    """Refused by the checks, or accepted and rejected by the handler: unchanged either way."""
    state, client, raw = server
    head = {
        "bool bytes": header(specs=[("bool", (4 * N,), 4 * N)]),
        "wrong shape": header(specs=[("float32", (N // 2, 2), 4 * N)]),
        "wrong dtype": header(specs=[("int32", (N,), 4 * N)]),
        "two tensors": header(specs=[("float32", (N // 2,), 2 * N)] * 2),
        "bad dims": header(specs=[("float32", [1 << 62] * 100_000, 4)]),
    }[case]
    before = client.call("pull", Message({}), timeout=10).tensors[0].clone()
    status, messages = bulk_answer(bulk_exchange(bulk_port, hello() + bulk_message(head, GRADIENT)))
    assert status == 0 and messages[-1][0] == ERROR
    assert messages[-1][1]["status"] in ("INVALID_ARGUMENT",) and messages[-1][1].get("code") in (None, "gradient_rejected")
    assert torch.equal(raw_bits(bulk_pull(bulk_port)), raw_bits(before))
