"""Hostile bytes against one live grpc:// server: every bad stream ends with a non-OK
status, the server keeps serving, and the parameter it holds is unchanged.

The server (started once for the module) requires a token and accepts at most 1 MiB
of tensors per request. It serves ``push`` (adds a float32[1024] gradient into its
parameter, GradientRejected for any other shape or dtype) and ``pull``. The fuzzer
talks raw gRPC (no adapter client, bytes in and out) so it can send anything.
"""

from __future__ import annotations

import json
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
def server():
    state = ParameterServer()
    transport = gt.GrpcTransport(token=TOKEN, max_request_bytes=LIMIT)
    endpoint = transport.serve("grpc://127.0.0.1:0", {"push": state.push, "pull": state.pull})
    client = transport.connect(endpoint.address)
    raw = grpc.insecure_channel(endpoint.address.removeprefix("grpc://"))
    yield state, client, raw
    raw.close()
    client.close()
    endpoint.close()


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
@given(st.text(max_size=20).filter(lambda name: name not in gt.DTYPES))
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
