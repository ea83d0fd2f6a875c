"""``grpc://host:port`` transport: calls between processes over gRPC.

This module owns the wire format (the frames of ``proto/transport.proto``, encoded and
decoded here by hand), the server (``serve``: bearer-token check, size limits, the
``pdps-accepted`` marker, error mapping, the standard health service, TLS) and the
client (``connect``: deadlines, retries that never run a handler twice, turning every
``grpc.RpcError`` into a :class:`~pdps.core.errors.PdpsError`). docs/transport.md
describes all of it and what was measured.

One call is one bidirectional stream: a header frame (method, meta as JSON, tensor
specs), then the tensors' raw bytes concatenated and cut into ``chunk_bytes`` chunk
frames; the reply has the same shape. Chunk payloads are copied once into the frame
on the way out and once, on the way in, into one buffer allocated from the header
(reused across calls once no tensor uses it); the received tensors are views into
that buffer. Nothing is pickled.

Calls that move at least ``bulk_threshold`` bytes of tensors take the bulk channel
instead (the sockets are in ``bulk.py``): the same header frame on a plain or TLS
TCP connection, then the tensors' bytes written from their own memory and read
straight into that buffer. Both paths share the header, its checks, the handler
call and the error mapping below.
"""

from __future__ import annotations

import functools
import hmac
import json
import logging
import math
import socket
import ssl
import struct
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs
import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdps.adapters import bulk
from pdps.adapters.refusals import RefusalLog
from pdps.core.backoff import Backoff
from pdps.core.errors import (
    ConfigError,
    GradientRejected,
    NoSuchJob,
    NotReady,
    PdpsError,
    StalePush,
    Timeout,
    TransportError,
    Unauthenticated,
    UnknownTaskError,
    error_classes,
)
from pdps.ports.transport import Handler, Message
from pdps.runtime.retry import Retry

if TYPE_CHECKING:
    import torch
else:

    class _LazyTorch:
        """torch, imported at its first use: a master's calls carry no tensors, so a
        master process never loads it (1-2 s of CPU and some 200 MB a process)."""

        def __getattr__(self, name: str) -> Any:
            import torch as module

            globals()["torch"] = module  # later uses find the module itself
            return getattr(module, name)

    torch = _LazyTorch()

log = logging.getLogger(__name__)

SERVICE = "pdps.transport.v1.Transport"
CALL_PATH = f"/{SERVICE}/Call"

#: Tensor bytes per chunk frame. 1, 2 and 4 MiB measured within a few per cent of
#: each other on loopback (docs/transport.md); 1 MiB keeps per-stream memory lowest.
DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 4 << 10
MAX_CHUNK_BYTES = 16 << 20
#: gRPC message ceiling on both sides: the largest chunk plus room for a header frame.
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + (1 << 20)
#: Seconds in-flight calls get to finish when an endpoint closes.
CLOSE_GRACE = 1.0
CALL_PING_S = 2.0  # while a call is open, the client pings this often and waits as long for the answer
REFUSES_PROBE_S = 0.5  # ``refuses``: a connect that has not been refused by then cannot tell
#: Receive buffers kept for reuse by the process (see _BufferPool): how many, how many
#: bytes in all, and the smallest worth keeping.
POOLED_BUFFERS = 8
POOLED_MAX_BYTES = 1 << 30
POOLED_MIN_BYTES = 1 << 20
#: Most dimensions a received tensor may have (bounds the work of checking a shape).
MAX_DIMS = 64
#: Receive buffers place each tensor at a multiple of this, so any dtype view is aligned.
ALIGN = 64

ACCEPTED_KEY = "pdps-accepted"  # initial metadata: the request was whole and valid; the handler runs now
ERROR_CODE_KEY = "pdps-error-code"  # trailing metadata: the PdpsError.code a handler raised
BULK_PORT_KEY = "pdps-bulk-port"  # initial metadata, with the marker: the server's bulk channel port

#: Tensor bytes from which a call takes the bulk channel (docs/transport.md).
DEFAULT_BULK_THRESHOLD = 1 << 20
#: Seconds a client sends everything to a server over gRPC after its bulk port could not be reached.
BULK_RETRY_AFTER = 60.0

#: Seconds left above which a gRPC call has no deadline: grpcio reports none as about 2**63 s.
_NO_DEADLINE = 1e12

#: How a call to a server not (yet) listening pauses before it tries again.
RETRY_FIRST = 0.05
RETRY_MAX = 1.0
RECONNECT = Backoff(first=RETRY_FIRST, longest=RETRY_MAX)

#: Defaults of the server's connection limits (docs/transport.md, "Connections"): the
#: handshake deadline and the idle time are the bulk channel's. Connections are capped
#: far above the bulk channel's 64: a refused gRPC connection fails its calls, where a
#: refused bulk connection only sends them over gRPC.
DEFAULT_MAX_CONNECTIONS = 1024
#: Concurrent calls per connection; more wait on the client's side. RFC 9113 asks for
#: at least 100.
DEFAULT_MAX_STREAMS = 100

_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_FRAME_BYTES),
    ("grpc.max_send_message_length", MAX_FRAME_BYTES),
    # Measured on loopback (docs/transport.md): together these halve the CPU gRPC spends
    # receiving 64 MiB (about 45 -> 20 ms) and raise a stream from ~1.2 to ~2 GB/s.
    # Without BDP probing a stream's window still opens to the size of the message
    # being read, so up to a chunk is in flight.
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.max_frame_size", (1 << 24) - 1),
    ("grpc.experimental.tcp_read_chunk_size", 4 << 20),
    ("grpc.experimental.tcp_min_read_chunk_size", 1 << 20),
    ("grpc.experimental.tcp_max_read_chunk_size", 4 << 20),
]
_SERVER_OPTIONS = _OPTIONS + [
    ("grpc.so_reuseport", 0),  # a port in use must fail to bind, not be shared silently
    # A peer may not ping without calls, and while a call is open (our clients ping
    # every CALL_PING_S, data or not: a sync pull waiting at the barrier) at most every
    # CALL_PING_S / 2 (this option is the receiving side's in grpc core, whatever its
    # name says); two pings sooner and its connection is closed (GOAWAY too_many_pings).
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.min_ping_interval_without_data_ms", int(CALL_PING_S * 500)),
    ("grpc.http2.max_ping_strikes", 2),
    # The server's own pings go on while a call waits without data (a sync pull).
    ("grpc.http2.max_pings_without_data", 0),
]
_CLIENT_OPTIONS = _OPTIONS + [
    # While the channel backs off after a refused connection, calls fail at once with
    # the old error; its default (1 s first, up to 120 s) would hide a server that came
    # up from the call retries below for that long.
    ("grpc.initial_reconnect_backoff_ms", int(RETRY_FIRST * 1000)),
    ("grpc.max_reconnect_backoff_ms", 250),
    # While a call is open, ping the server every CALL_PING_S and give up on the
    # connection if a ping is not answered within as long: a peer whose process is
    # stopped (SIGSTOP, a frozen VM) keeps its socket open and would hold the call
    # forever; this way the call fails (UNAVAILABLE) and the caller looks elsewhere.
    # (The server's gRPC threads answer pings however busy its handlers are.)
    ("grpc.keepalive_time_ms", int(CALL_PING_S * 1000)),
    ("grpc.keepalive_timeout_ms", int(CALL_PING_S * 1000)),
    ("grpc.keepalive_permit_without_calls", 0),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", int(CALL_PING_S * 1000)),  # (its default, 5 min, would allow one)
    ("grpc.http2.ping_timeout_ms", int(CALL_PING_S * 1000)),  # grpcio 1.85 enforces this one
    # ... and a connection whose HTTP/2 handshake does not finish within as long is given
    # up (a stopped process's kernel still accepts the TCP connection; the default waits 20 s)
    ("grpc.min_reconnect_backoff_ms", int(CALL_PING_S * 1000)),
]


def _server_options(transport: GrpcTransport) -> list[tuple[str, Any]]:
    """The server's options with the transport's connection limits (verified by
    tests/integration/test_transport_grpc.py against grpcio, whose core reads them)."""

    def ms(seconds: float) -> int:
        return max(1, round(seconds * 1000))

    return _SERVER_OPTIONS + [
        # The TLS handshake and, plaintext too, the client's HTTP/2 preface and SETTINGS:
        # a socket that sends nothing, or dribbles, is closed after this.
        ("grpc.server_handshake_timeout_ms", ms(transport.handshake_timeout)),
        ("grpc.max_connection_idle_ms", ms(transport.idle_timeout)),  # no call for that long: GOAWAY, closed
        # While a call is in flight, a ping every idle_timeout / 2 seconds that must be
        # answered within handshake_timeout: a peer that vanished, or a socket holding a
        # call open without speaking HTTP/2, is dropped and its handler's thread freed.
        ("grpc.keepalive_time_ms", ms(transport.idle_timeout / 2)),
        ("grpc.keepalive_timeout_ms", ms(transport.handshake_timeout)),
        ("grpc.http2.ping_timeout_ms", ms(transport.handshake_timeout)),  # grpcio 1.85 enforces this one
        ("grpc.max_allowed_incoming_connections", transport.max_connections),  # more are closed at once
        ("grpc.max_concurrent_streams", transport.max_streams),
    ]


# ----------------------------------------------------------------------------------
# dtypes: every non-quantized torch dtype, by its name without "torch." (built at the first
# tensor: torch is imported then, not with this module)

@functools.cache
def dtypes() -> dict[str, torch.dtype]:
    import torch as module  # the module itself: vars() of the lazy stand-in is empty

    return {str(d).removeprefix("torch."): d for d in vars(module).values() if isinstance(d, module.dtype) and not str(d).startswith("torch.q")}


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {d: name for name, d in dtypes().items()}


# ----------------------------------------------------------------------------------
# The codec: proto3 wire format of Frame / Header / TensorSpec, by hand.


class FrameError(ValueError):
    """Bytes that are not a well-formed frame."""


@attrs.frozen
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@attrs.frozen
class Header:
    method: str
    meta_json: str
    tensors: tuple[TensorSpec, ...] = ()
    timeout: float = 0.0  # a bulk request's: seconds its caller had left as it sent it; 0: none


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while shift < 70:
        if pos >= len(buf):
            raise FrameError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            if result >> 64:
                raise FrameError("varint above 64 bits")
            return result, pos
        shift += 7
    raise FrameError("varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field; unknown fields are skipped by the caller."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise FrameError("field number 0")
        value: Any = None
        if wire == 0:
            value, pos = _read_varint(buf, pos)
        elif wire == 2:
            size, pos = _read_varint(buf, pos)
            if pos + size > len(buf):
                raise FrameError("length-delimited field runs past the end of the frame")
            value, pos = buf[pos : pos + size], pos + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if pos + size > len(buf):
                raise FrameError("fixed-size field runs past the end of the frame")
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise FrameError(f"unsupported wire type {wire} (field {field})")
        yield field, wire, value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, memoryview):
        raise FrameError(f"{what} is not a length-delimited field")
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"{what} is not UTF-8") from exc


def _int64(v: int) -> int:
    return v - (1 << 64) if v >> 63 else v


def _decode_spec(buf: memoryview) -> TensorSpec:
    dtype, shape, nbytes = "", [], 0
    for field, wire, value in _fields(buf):
        if field == 1:
            dtype = _text(value, "tensor dtype")
        elif field == 2 and wire == 2:  # packed, as proto3 writes it
            pos = 0
            while pos < len(value):
                dim, pos = _read_varint(value, pos)
                shape.append(_int64(dim))
        elif field == 2 and wire == 0:
            shape.append(_int64(value))
        elif field == 3:
            if wire != 0:
                raise FrameError("tensor nbytes is not a varint")
            nbytes = value
        elif field == 2:
            raise FrameError("tensor shape has the wrong wire type")
    return TensorSpec(dtype, tuple(shape), nbytes)


def _decode_header(buf: memoryview) -> Header:
    method, meta, specs, timeout = "", "", [], 0.0
    for field, wire, value in _fields(buf):
        if field == 1:
            method = _text(value, "method")
        elif field == 2:
            meta = _text(value, "meta_json")
        elif field == 3:
            if not isinstance(value, memoryview):
                raise FrameError("tensor spec is not a length-delimited field")
            specs.append(_decode_spec(value))
        elif field == 4:
            if wire != 1:
                raise FrameError("timeout is not a double")
            (timeout,) = struct.unpack("<d", value)
            if not (math.isfinite(timeout) and timeout >= 0):
                raise FrameError(f"timeout must be a finite number of seconds >= 0, got {timeout}")
    return Header(method, meta, tuple(specs), timeout)


def decode_frame(data: bytes) -> Header | memoryview:
    """A frame's header, or its chunk payload as a view into ``data`` (not copied)."""
    buf = memoryview(data)
    if len(buf) >= 2 and buf[0] == 0x12:  # the common case: only a chunk field
        size, pos = _read_varint(buf, 1)
        if pos + size == len(buf):
            return buf[pos:]
    body = None
    for field, wire, value in _fields(buf):
        if field in (1, 2):
            if wire != 2:
                raise FrameError(f"frame field {field} is not length-delimited")
            if body is not None:
                raise FrameError("a frame holds one body, header or chunk, not two")
            body = (field, value)
    if body is None:
        raise FrameError("empty frame: neither header nor chunk")
    return _decode_header(body[1]) if body[0] == 1 else body[1]


def _field_bytes(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_header(header: Header) -> bytes:
    """The Frame holding ``header``, byte for byte as protobuf serializes it."""
    parts = []
    if header.method:
        parts.append(_field_bytes(1, header.method.encode()))
    if header.meta_json:
        parts.append(_field_bytes(2, header.meta_json.encode()))
    for spec in header.tensors:
        fields = b""
        if spec.dtype:
            fields += _field_bytes(1, spec.dtype.encode())
        if spec.shape:
            fields += _field_bytes(2, b"".join(_varint(d & 0xFFFFFFFFFFFFFFFF) for d in spec.shape))
        if spec.nbytes:
            fields += _varint(3 << 3) + _varint(spec.nbytes)
        parts.append(_field_bytes(3, fields))
    if header.timeout:
        parts.append(_timeout_field(header.timeout))
    return _field_bytes(1, b"".join(parts))


def _timeout_field(timeout: float) -> bytes:
    return _varint(4 << 3 | 1) + struct.pack("<d", timeout)


def with_timeout(frame: bytes, timeout: float) -> bytes:
    """The header frame ``frame`` (which has no timeout) with ``timeout`` set, as
    :func:`encode_header` would write it, without encoding the rest again."""
    _, pos = _read_varint(memoryview(frame), 1)  # past the frame's tag: the header's length
    return _field_bytes(1, frame[pos:] + _timeout_field(timeout))


def chunk_prefix(size: int) -> bytes:
    """Tag and length of a chunk frame whose payload (``size`` bytes) follows."""
    return b"\x12" + _varint(size)


# ----------------------------------------------------------------------------------
# Tensors to frames and back.


class _Rejected(Exception):
    """A call that ends with the non-OK ``status``: a stream that breaks the protocol or a
    limit, or (with ``code``, the PdpsError.code) a handler that raised."""

    def __init__(self, status: grpc.StatusCode, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code


def _outgoing(method: str, meta: Mapping[str, Any], tensors: Sequence[Any]) -> tuple[bytes, list[memoryview]]:
    """The header frame and each tensor's bytes (views of contiguous CPU storage)."""
    try:
        meta_json = json.dumps(dict(meta), separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TransportError(f"meta of {method or 'a reply'!r} is not JSON-safe: {exc}") from exc
    specs, views = [], []
    names = _dtype_names() if tensors else {}
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype not in names:
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.layout} {t.dtype} tensor"
            raise TransportError(f"tensor {i} of {method or 'a reply'!r} cannot travel: {what} (dense tensors only)")
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(names[t.dtype], tuple(t.shape), nbytes))
        if nbytes:
            views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return encode_header(Header(method, meta_json, tuple(specs))), views


def _frames(header: bytes, views: Sequence[memoryview], chunk_bytes: int, tally: _Tally | None = None) -> Iterator[bytes]:
    """The header frame, then the tensors' bytes in chunks (small tensors share one).

    With ``tally``, the seconds spent joining chunk frames (the copy) go to its ``encode``.
    """
    yield header
    pending: list[Any] = []
    size = 0
    clock = time.perf_counter
    for view in views:
        pos = 0
        while pos < len(view):
            take = min(chunk_bytes - size, len(view) - pos)
            pending.append(view[pos : pos + take])
            size += take
            pos += take
            if size == chunk_bytes:
                t0 = clock()
                frame = b"".join([chunk_prefix(size), *pending])
                if tally is not None:
                    tally.encode += clock() - t0
                yield frame
                pending, size = [], 0
    if size:
        t0 = clock()
        frame = b"".join([chunk_prefix(size), *pending])
        if tally is not None:
            tally.encode += clock() - t0
        yield frame


class _Tally:
    """One client call's share of its channel's ``stats``: seconds of encoding work (on
    gRPC's request thread: ``encode``) and of decoding work (the caller's thread:
    ``decode``), and the reply bytes received (header frame + tensor bytes)."""

    __slots__ = ("encode", "decode", "received")

    def __init__(self, encode: float = 0.0) -> None:
        self.encode = encode
        self.decode = 0.0
        self.received = 0


class _Inbound:
    """One direction's tensors being received: checked specs, one buffer, chunks placed as they come."""

    def __init__(self, specs: Sequence[TensorSpec], limit: int | None, into: Sequence[torch.Tensor] | None = None) -> None:
        self._layout: list[tuple[torch.dtype, tuple[int, ...], int, int]] = []  # dtype, shape, offset, nbytes
        offset = declared = 0
        known = dtypes() if specs else {}
        for i, spec in enumerate(specs):
            dtype = known.get(spec.dtype)
            if dtype is None:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {i} has unknown dtype {spec.dtype!r}")
            if len(spec.shape) > MAX_DIMS:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {i} has {len(spec.shape)} dimensions, more than {MAX_DIMS}")
            if any(d < 0 for d in spec.shape):
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"tensor {i} has a negative dimension: {list(spec.shape)}")
            expect = math.prod(spec.shape) * dtype.itemsize
            if expect != spec.nbytes:
                raise _Rejected(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"tensor {i} declares {spec.nbytes} bytes but {spec.dtype}{list(spec.shape)} takes {expect}",
                )
            declared += spec.nbytes
            if limit is not None and declared > limit:
                raise _Rejected(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"request declares more than {limit} bytes of tensors (max_request_bytes)",
                )
            self._layout.append((dtype, spec.shape, offset, spec.nbytes))
            offset = -(-(offset + spec.nbytes) // ALIGN) * ALIGN
        self.declared = declared
        self.received = 0
        self.size = offset
        self.work = 0.0  # seconds spent placing bytes and building tensors, not waiting on the wire
        self._buffer: torch.Tensor | None = None
        self._segments = [(start, n) for _, _, start, n in self._layout if n]
        self._segment = 0
        self._filled = 0  # bytes of the current segment already written
        # The caller's tensors, when they match the reply: its bytes land there, not in a
        # receive buffer the caller would copy from (a trainer pulling into its model).
        self._into = list(into) if into is not None and _matches(into, self._layout) else None
        self._targets: list[np.ndarray] = []  # where each non-empty segment's bytes go

    def allocate(self) -> None:
        if self._into is not None:
            self._targets = [t.detach().reshape(-1).view(torch.uint8).numpy() for t in self._into if t.numel()]
            return
        self._buffer = _RECEIVE_BUFFERS.take(self.size)
        array = self._buffer.numpy()
        self._targets = [array[start : start + n] for start, n in self._segments]

    def add(self, chunk: memoryview) -> None:
        n = len(chunk)
        if self.received + n > self.declared:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunks carry more than the {self.declared} bytes the header declares",
            )
        if not self._targets:
            self.allocate()
        source = np.frombuffer(chunk, dtype=np.uint8)
        pos = 0
        while pos < n:
            _, size = self._segments[self._segment]
            take = min(size - self._filled, n - pos)
            at = self._filled
            np.copyto(self._targets[self._segment][at : at + take], source[pos : pos + take])  # releases the GIL
            pos += take
            self._filled += take
            if self._filled == size:
                self._segment += 1
                self._filled = 0
        self.received += n

    def read_from(self, read_into: Callable[[memoryview], object]) -> list[torch.Tensor]:
        """Every tensor byte, put in place by ``read_into(view)`` (the bulk channel's recv_into), then ``finish``."""
        clock = time.perf_counter
        if self._segments:
            t0 = clock()
            self.allocate()
            self.work += clock() - t0
            for target, (_, size) in zip(self._targets, self._segments):
                read_into(memoryview(target))
                self.received += size
        t0 = clock()
        out = self.finish()
        self.work += clock() - t0
        return out

    def finish(self) -> list[torch.Tensor]:
        if self.received < self.declared:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream ended after {self.received} of the {self.declared} tensor bytes the header declares",
            )
        if self._into is not None:
            for i, ((dtype, _, _, nbytes), t) in enumerate(zip(self._layout, self._into)):
                if dtype == torch.bool and nbytes and int(t.view(torch.uint8).max()) > 1:
                    raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"bool tensor {i} holds bytes other than 0 and 1")
            return list(self._into)
        out = []
        for i, (dtype, shape, start, nbytes) in enumerate(self._layout):
            if dtype == torch.bool and nbytes and int(self._buffer[start : start + nbytes].max()) > 1:  # type: ignore[index]
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"bool tensor {i} holds bytes other than 0 and 1")
            if nbytes == 0:
                out.append(torch.empty(0, dtype=torch.uint8).view(dtype).reshape(shape))
            else:
                assert self._buffer is not None
                out.append(self._buffer[start : start + nbytes].view(dtype).reshape(shape))
        return out


def _matches(into: Sequence[torch.Tensor], layout: Sequence[tuple[torch.dtype, tuple[int, ...], int, int]]) -> bool:
    """Whether ``into`` can take a reply of this layout in place: as many tensors, each
    on the CPU, contiguous, of the same dtype and shape, outside autograd."""
    return len(into) == len(layout) and all(
        isinstance(t, torch.Tensor)
        and t.device.type == "cpu"
        and t.is_contiguous()
        and not t.requires_grad
        and t.dtype == dtype
        and tuple(t.shape) == tuple(shape)
        for t, (dtype, shape, _, _) in zip(into, layout)
    )


class _BufferPool:
    """Receive buffers, reused once nothing references them any more.

    Touching fresh memory is what costs here: filling 64 MiB freshly allocated by
    torch.empty measured 1.1 GB/s, by numpy.empty 9 GB/s, a reused buffer 18 GB/s. So
    large buffers come from numpy and are kept (at most ``keep`` of them, ``max_bytes``
    in all) for later calls. A buffer is handed out again only when no tensor uses it:
    every tensor made from it holds a reference to its numpy array, so the array's
    reference count says whether one is still alive. Nobody ever sees their tensors
    overwritten, whatever they keep.
    """

    def __init__(self, keep: int, max_bytes: int, min_bytes: int) -> None:
        self._keep, self._max_bytes, self._min_bytes = keep, max_bytes, min_bytes
        self._arrays: list[np.ndarray] = []
        self._lock = threading.Lock()
        self._idle_refs = self._refs_of_idle()

    @staticmethod
    def _refs_of_idle() -> int:
        """The reference count of an array only the pool holds, read as ``take`` reads it."""
        arrays = [np.empty(0, dtype=np.uint8)]
        for arr in arrays:
            return sys.getrefcount(arr)
        raise AssertionError

    def take(self, size: int) -> torch.Tensor:
        if size < self._min_bytes:
            return torch.from_numpy(np.empty(size, dtype=np.uint8))
        with self._lock:
            best, idle = None, []
            for arr in self._arrays:
                if sys.getrefcount(arr) <= self._idle_refs:
                    idle.append(arr)
                    if size <= arr.size <= 2 * size and (best is None or arr.size < best.size):
                        best = arr
            if best is None:
                best = np.empty(size, dtype=np.uint8)
                if len(self._arrays) >= self._keep and idle:
                    smallest = min(idle, key=lambda a: a.size)  # by identity: == on arrays compares their elements
                    self._arrays = [a for a in self._arrays if a is not smallest]
                if len(self._arrays) < self._keep and sum(a.size for a in self._arrays) + size <= self._max_bytes:
                    self._arrays.append(best)
            return torch.from_numpy(best)[:size]


#: Shared by every server and channel of the process.
_RECEIVE_BUFFERS = _BufferPool(keep=POOLED_BUFFERS, max_bytes=POOLED_MAX_BYTES, min_bytes=POOLED_MIN_BYTES)


def _receive(first: bytes | None, limit: int | None, want_method: bool, into: Sequence[torch.Tensor] | None = None) -> tuple[Header, dict, _Inbound]:
    """Check the header frame of one direction of a call; ``_fill`` or ``_Inbound.read_from``
    then reads its tensors. Raises _Rejected."""
    if first is None:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "stream ended before its header frame")
    header = _decode(first)
    if not isinstance(header, Header):
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be a header, not a chunk")
    if want_method and not header.method:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "header names no method")
    meta = _meta(header.meta_json)
    inbound = _Inbound(header.tensors, limit, into)
    return header, meta, inbound


def _decode(data: bytes) -> Header | memoryview:
    try:
        return decode_frame(data)
    except FrameError as exc:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"malformed frame: {exc}") from exc


def _meta(text: str) -> dict:
    try:
        meta = json.loads(text) if text else {}
    except (ValueError, RecursionError) as exc:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"meta is not valid JSON: {exc}") from exc
    if not isinstance(meta, dict):
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"meta must be a JSON object, not {type(meta).__name__}")
    return meta


def _fill(inbound: _Inbound, frames: Iterator[bytes]) -> list[torch.Tensor]:
    """Place every chunk frame's bytes, then ``finish``; the time not spent waiting for
    frames goes to ``inbound.work``."""
    clock = time.perf_counter
    for data in frames:
        t0 = clock()
        chunk = _decode(data)
        if not isinstance(chunk, memoryview):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "a second header frame in one stream")
        inbound.add(chunk)
        inbound.work += clock() - t0
    t0 = clock()
    out = inbound.finish()
    inbound.work += clock() - t0
    return out


# ----------------------------------------------------------------------------------
# Errors across the wire.

# First match wins. Never UNAVAILABLE: the client retries that.
_STATUS_OF_ERROR: tuple[tuple[type | tuple[type, ...], grpc.StatusCode], ...] = (
    (Timeout, grpc.StatusCode.DEADLINE_EXCEEDED),
    (StalePush, grpc.StatusCode.ABORTED),
    ((UnknownTaskError, NoSuchJob), grpc.StatusCode.NOT_FOUND),
    ((GradientRejected, ConfigError), grpc.StatusCode.INVALID_ARGUMENT),
    (NotReady, grpc.StatusCode.FAILED_PRECONDITION),
    (PdpsError, grpc.StatusCode.FAILED_PRECONDITION),
)


def _status_of(exc: PdpsError) -> grpc.StatusCode:
    return next(status for cls, status in _STATUS_OF_ERROR if isinstance(exc, cls))


def _rebuild(code: str, message: str) -> PdpsError | None:
    """The PdpsError a remote handler raised, from its code and message."""
    cls = error_classes().get(code)
    if cls is None:
        return None
    try:
        return cls(message)
    except TypeError:  # a constructor that wants more than a message (InvalidTransition)
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        return exc


def _metadata_value(metadata: Any, key: str) -> str | None:
    for k, v in metadata or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else v
    return None


# ----------------------------------------------------------------------------------
# TLS, addresses.


@attrs.frozen
class TlsConfig:
    """PEM file paths. Server: ``cert`` + ``key``, and ``ca`` to require client
    certificates signed by it (mTLS). Client: ``ca`` to trust (system roots when
    None), ``cert`` + ``key`` to present for mTLS."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    def _read(self, path: str | None) -> bytes | None:
        if path is None:
            return None
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc

    def server_credentials(self) -> grpc.ServerCredentials:
        if not (self.cert and self.key):
            raise ConfigError("a TLS server needs TlsConfig(cert=..., key=...)")
        return grpc.ssl_server_credentials(
            [(self._read(self.key), self._read(self.cert))],
            root_certificates=self._read(self.ca),
            require_client_auth=self.ca is not None,
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert) != bool(self.key):
            raise ConfigError("a TLS client certificate needs both cert and key")
        return grpc.ssl_channel_credentials(
            root_certificates=self._read(self.ca), private_key=self._read(self.key), certificate_chain=self._read(self.cert)
        )

    def server_context(self) -> ssl.SSLContext:
        """The same as ``server_credentials``, for the bulk channel's sockets."""
        if not (self.cert and self.key):
            raise ConfigError("a TLS server needs TlsConfig(cert=..., key=...)")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        self._load(context)
        if self.ca is not None:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self) -> ssl.SSLContext:
        """The same as ``channel_credentials``, for the bulk channel's sockets: it checks
        that the server's certificate names the host dialled."""
        if bool(self.cert) != bool(self.key):
            raise ConfigError("a TLS client certificate needs both cert and key")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the certificate and the host name
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.ca is None:
            context.load_default_certs()
        self._load(context)
        return context

    def _load(self, context: ssl.SSLContext) -> None:
        try:
            if self.cert and self.key:
                context.load_cert_chain(self.cert, self.key)
            if self.ca is not None:
                context.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"cannot load TLS files {[p for p in (self.cert, self.key, self.ca) if p]}: {exc}") from exc


_WILDCARD_HOSTS = {"0.0.0.0", "::", ""}


def _split(address: str) -> tuple[str, int]:
    """(host, port) of ``grpc://host:port``; IPv6 hosts come without brackets."""
    if not address.startswith("grpc://"):
        raise TransportError(f"not a grpc address: {address!r} (expected grpc://host:port)")
    try:
        parts = urllib.parse.urlsplit("//" + address[len("grpc://") :].rstrip("/"))
        host, port = parts.hostname, parts.port
    except ValueError as exc:
        raise TransportError(f"bad grpc address {address!r}: {exc} (expected grpc://host:port)") from exc
    if host is None or port is None:
        raise TransportError(f"bad grpc address {address!r} (expected grpc://host:port)")
    return host, port


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ----------------------------------------------------------------------------------
# Server.


class GrpcEndpoint:
    """A running gRPC server and its bulk channel. ``address`` is ``grpc://host:port``
    with the real port; ``bulk_port`` is the bulk channel's (None when it is off)."""

    def __init__(self, transport: GrpcTransport, host: str, port: int, handlers: Mapping[str, Handler], publish_host: str) -> None:
        self._transport = transport
        self._handlers = dict(handlers)
        self._lock = threading.Lock()
        self._closed = False
        self.grpc_calls = 0  # calls received over gRPC and over the bulk channel (tests read them)
        self.bulk_calls = 0
        self._expected_auth = f"Bearer {transport.token}".encode() if transport.token is not None else None
        bulk_context = transport.tls.server_context() if transport.tls is not None and transport.bulk_threshold is not None else None
        self._executor = ThreadPoolExecutor(max_workers=transport.workers, thread_name_prefix="pdps-grpc")
        self._server = grpc.server(self._executor, options=_server_options(transport))
        call = grpc.stream_stream_rpc_method_handler(self._serve_call)  # raw bytes both ways
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Call": call}),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        bind = _hostport(host, port)
        try:
            if transport.tls is not None:
                port = self._server.add_secure_port(bind, transport.tls.server_credentials())
            else:
                port = self._server.add_insecure_port(bind)
        except RuntimeError as exc:
            port = 0
            reason = str(exc)
        else:
            reason = "address in use or not local"
        if not port:
            self._executor.shutdown(wait=False)
            raise TransportError(f"cannot serve gRPC at {bind}: {reason}")
        self.port = port
        self.address = f"grpc://{_hostport(publish_host, port)}"
        self._refusals = RefusalLog(log, self.address)  # of gRPC calls and bulk connections alike
        self._bulk: bulk.Listener | None = None
        self.bulk_port: int | None = None
        if transport.bulk_threshold is not None:
            try:
                self._bulk = bulk.Listener(
                    host,
                    token=transport.token,
                    tls=bulk_context,
                    serve=self._serve_bulk,
                    name=self.address,
                    refusals=self._refusals,
                    port=transport.bulk_port,
                    handshake_timeout=transport.handshake_timeout,
                    idle_timeout=transport.idle_timeout,
                    max_connections=transport.max_connections,
                )
            except OSError as exc:
                self._server.stop(0)
                self._executor.shutdown(wait=False)
                where = f"{host} port {transport.bulk_port}" if transport.bulk_port else host
                raise TransportError(f"cannot open the bulk channel of {self.address} on {where}: {exc}") from exc
            self.bulk_port = self._bulk.port
        self._accepted_metadata: tuple[tuple[str, str], ...] = ((ACCEPTED_KEY, "1"),)
        if self.bulk_port is not None:
            self._accepted_metadata += ((BULK_PORT_KEY, str(self.bulk_port)),)
        self._server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        bulk_note = "no bulk channel" if self.bulk_port is None else f"bulk channel on port {self.bulk_port}"
        log.info("serving %s at %s (%s, %s)", sorted(self._handlers), self.address, "TLS" if transport.tls else "plaintext", bulk_note)

    def close(self, grace: float = CLOSE_GRACE) -> None:
        """Report NOT_SERVING, refuse new calls, give in-flight ones ``grace`` seconds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._health.enter_graceful_shutdown()
        stopped = self._server.stop(grace)
        if self._bulk is not None:
            self._bulk.close(grace)  # at the same time as gRPC's grace
        stopped.wait(grace + 5.0)
        self._executor.shutdown(wait=False)
        self._refusals.flush()
        log.info("stopped serving at %s", self.address)

    def _count(self, over_bulk: bool) -> None:
        with self._lock:
            if over_bulk:
                self.bulk_calls += 1
            else:
                self.grpc_calls += 1

    def _check_token(self, context: grpc.ServicerContext) -> None:
        if self._expected_auth is None:
            return
        sent = _metadata_value(context.invocation_metadata(), "authorization")
        if sent is None:
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "no bearer token: this server requires one")
        if not hmac.compare_digest(sent.encode(), self._expected_auth):
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")

    def _handler(self, method: str) -> Handler:
        handler = self._handlers.get(method)
        if handler is None:
            raise _Rejected(grpc.StatusCode.UNIMPLEMENTED, f"no method {method!r} here (it serves {sorted(self._handlers)})")
        return handler

    def _call_handler(
        self, handler: Handler, method: str, meta: dict, tensors: list[torch.Tensor], deadline: float | None
    ) -> tuple[bytes, list[memoryview]]:
        """Call the handler of an accepted request: its reply's header frame and tensor
        views, or _Rejected carrying the error it raised."""
        try:
            reply = handler(Message(meta, tensors, deadline=deadline, owned=True))  # received into buffers nobody else holds
        except PdpsError as exc:
            raise _Rejected(_status_of(exc), str(exc), exc.code) from exc
        except Exception as exc:
            log.exception("handler %r at %s raised", method, self.address)
            raise _Rejected(grpc.StatusCode.INTERNAL, f"handler {method!r} raised {type(exc).__name__}: {exc}") from exc
        try:
            if not isinstance(reply, Message):
                raise TransportError(f"handler {method!r} returned {type(reply).__name__}, not Message")
            return _outgoing("", reply.meta, reply.tensors)
        except TransportError as exc:
            log.error("bad reply from handler %r at %s: %s", method, self.address, exc)
            raise _Rejected(grpc.StatusCode.INTERNAL, str(exc)) from exc

    def _serve_call(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        self._count(over_bulk=False)
        requests = iter(requests)
        try:
            self._check_token(context)
            header, meta, inbound = _receive(next(requests, None), self._transport.max_request_bytes, want_method=True)
            handler = self._handler(header.method)
            tensors = _fill(inbound, requests)
        except _Rejected as exc:
            self._refusals.refused("rejected a call", context.peer(), exc.message)
            context.abort(exc.status, exc.message)
        except grpc.RpcError:
            log.debug("caller %s went away before its request was whole", context.peer())
            return
        # The client retries an UNAVAILABLE call only when it did not see this marker.
        context.send_initial_metadata(self._accepted_metadata)
        remaining = context.time_remaining()  # gRPC's own deadline: the caller's timeout, less the time it took to get here
        deadline = None if remaining is None or remaining > _NO_DEADLINE else time.monotonic() + remaining
        try:
            header_frame, views = self._call_handler(handler, header.method, meta, tensors, deadline)
        except _Rejected as exc:
            if exc.code is not None:
                context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code),))
            context.abort(exc.status, exc.message)
        yield from _frames(header_frame, views, self._transport.chunk_bytes)

    def _serve_bulk(self, conn: bulk.Connection, kind: int, length: int) -> bool:
        """One call over the bulk channel (its prefix read); True keeps the connection.

        The same checks as a gRPC call, all on the header before any tensor byte is
        read; the token was checked by the connection's hello.
        """
        self._count(over_bulk=True)
        stall = bulk.STALL_TIMEOUT
        try:
            if kind != bulk.REQUEST:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"expected a request, got a message of kind {kind}")
            if length > MAX_FRAME_BYTES:
                raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"header of {length} bytes, more than {MAX_FRAME_BYTES}")
            header, meta, inbound = _receive(bytes(conn.read_bytes(length, stall=stall)), self._transport.max_request_bytes, want_method=True)
            deadline = time.monotonic() + header.timeout if header.timeout else None
            handler = self._handler(header.method)
            tensors = inbound.read_from(lambda view: conn.read_into(view, stall=stall))
        except _Rejected as exc:
            self._refusals.refused("rejected a bulk call", conn.peer, exc.message)
            _send_bulk_error(conn, exc)
            return False  # the rest of the request, if any, is unread: the connection is done
        except bulk.PeerClosed as exc:
            self._refusals.refused("rejected a bulk call", conn.peer, f"{exc} before the request was whole")
            _send_bulk_error(conn, _Rejected(grpc.StatusCode.INVALID_ARGUMENT, f"the request ended early: {exc}"))
            return False
        conn.send(bulk.ACCEPTED, b"", stall=stall)  # the client retries elsewhere only without it
        try:
            header_frame, views = self._call_handler(handler, header.method, meta, tensors, deadline)
        except _Rejected as exc:
            _send_bulk_error(conn, exc)
            return True
        conn.send(bulk.REPLY, header_frame, views, stall=stall)
        return True


def _send_bulk_error(conn: bulk.Connection, exc: _Rejected) -> None:
    """An ERROR message: a header frame whose meta holds the status, message and PdpsError code."""
    meta = {"status": exc.status.name, "message": exc.message}
    if exc.code is not None:
        meta["code"] = exc.code
    try:
        conn.send(bulk.ERROR, encode_header(Header("", json.dumps(meta), ())), stall=bulk.STALL_TIMEOUT)
    except OSError as err:
        log.debug("could not send %s to %s: %s", exc.status.name, conn.peer, err)


# ----------------------------------------------------------------------------------
# Client.


@attrs.define
class _BulkPeer:
    """What a transport's clients know of one server's bulk channel (shared by its channels to that address)."""

    port: int | None = None  # learned from the marker metadata of a gRPC call
    unreachable: int | None = None  # a port that could not be reached ...
    retry_at: float = 0.0  # ... and is not tried again before this time.monotonic()
    reply_bytes: dict[str, int] = attrs.Factory(dict)  # method -> tensor bytes of its last reply


class _NotRun(Exception):
    """A bulk call failed where the server cannot have run its handler: it may be sent again."""


class GrpcChannel:
    """Calls to one ``grpc://`` address: over one cached gRPC channel, or over pooled
    connections to the server's bulk channel for calls that move many tensor bytes
    (docs/transport.md says which); thread-safe.

    ``stats`` holds cumulative client-side figures of this channel's calls (floats):
    ``serialize``, seconds spent encoding requests (header, chunk frames) and decoding
    replies into tensors, not waiting on the wire; ``calls``, calls made (those that
    raised too); ``bytes_sent`` / ``bytes_received``, header frame + tensor bytes of
    each request / of each reply received (not gRPC's, HTTP/2's or TCP's framing).
    Updated under a lock once per call; read it, or copy it with ``dict(channel.stats)``.
    """

    def __init__(self, transport: GrpcTransport, address: str) -> None:
        host, port = _split(address)
        self.address = address
        self._host = host
        self._transport = transport
        target = _hostport(host, port)
        if transport.tls is not None:
            self._channel = grpc.secure_channel(target, transport.tls.channel_credentials(), options=_CLIENT_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=_CLIENT_OPTIONS)
        self._stream = self._channel.stream_stream(CALL_PATH)  # raw bytes both ways
        self._metadata = (("authorization", f"Bearer {transport.token}"),) if transport.token is not None else None
        self._peer = transport._bulk_peer(address) if transport.bulk_threshold is not None else None
        self._bulk_tls = transport._bulk_client_context() if self._peer is not None else None
        self._pool = bulk.Pool(transport.idle_timeout)
        self._closed = False
        self.stats: dict[str, float] = {"serialize": 0.0, "calls": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0}
        self._stats_lock = threading.Lock()

    def call(self, method: str, request: Message, *, timeout: float | None = None, into: Sequence[torch.Tensor] | None = None) -> Message:
        """One call. ``into``: tensors the reply's tensors are received into when they
        match (count, dtype, shape; CPU, contiguous), saving the caller a copy; the reply
        then holds these very tensors. On a failed call they may hold part of a reply."""
        if self._closed:
            raise TransportError(f"channel to {self.address} is closed")
        t0 = time.perf_counter()
        header, views = _outgoing(method, request.meta, request.tensors)
        nbytes = sum(len(v) for v in views)
        tally = _Tally(encode=time.perf_counter() - t0)
        try:
            return self._call(method, header, views, nbytes, timeout, tally, into)
        finally:
            with self._stats_lock:
                stats = self.stats
                stats["calls"] += 1
                stats["serialize"] += tally.encode + tally.decode
                stats["bytes_sent"] += len(header) + nbytes
                stats["bytes_received"] += tally.received

    def _call(
        self, method: str, header: bytes, views: list[memoryview], nbytes: int, timeout: float | None, tally: _Tally, into: Sequence[torch.Tensor] | None = None
    ) -> Message:
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        bulk_port = self._bulk_route(method, nbytes)
        if bulk_port is not None:
            try:
                return self._seen(method, self._call_bulk(bulk_port, method, header, views, timeout, deadline, tally, into))
            except _NotRun as exc:
                log.debug("%r to %s goes over gRPC: %s", method, self.address, exc)
        retry_until = start + self._transport.connect_timeout
        if deadline is not None:
            retry_until = min(retry_until, deadline)
        unavailable = Retry(RECONNECT, deadline=max(0.0, retry_until - time.monotonic()))
        attempts = 0
        unreached: str | None = None  # why the last try found no server (None: none failed so)
        while True:
            attempts += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                if unreached is not None:  # the deadline ran out while the peer could not be reached
                    raise self._unreachable(method, timeout, attempts - 1, time.monotonic() - start, unreached)
                raise Timeout(f"call {method!r} to {self.address} ran past its {timeout} s deadline")
            try:
                call = self._stream(_frames(header, views, self._transport.chunk_bytes, tally), timeout=remaining, metadata=self._metadata)
            except ValueError as exc:  # grpc refuses calls on a closed channel
                raise TransportError(f"cannot call {method!r} on {self.address}: {exc}") from exc
            try:
                return self._seen(method, self._reply(call, method, tally, into))
            except grpc.RpcError as exc:
                accepted = _metadata_value(call.initial_metadata(), ACCEPTED_KEY) is not None
                code, details, spent = call.code(), call.details() or "", time.monotonic() - start
                if code == grpc.StatusCode.UNAVAILABLE and not accepted:
                    unreached = details
                    if unavailable.note():
                        log.debug("%s unavailable (%s); retrying %r (try %d)", self.address, details, method, attempts + 1)
                        unavailable.pause()
                        continue
                    if deadline is not None and retry_until >= deadline:  # the call's deadline, not connect_timeout, ended the retries
                        raise self._unreachable(method, timeout, attempts, spent, details) from exc
                elif code == grpc.StatusCode.DEADLINE_EXCEEDED and not accepted and unreached is not None:
                    raise self._unreachable(method, timeout, attempts, spent, unreached) from exc  # still connecting when time ran out
                remote = _metadata_value(call.trailing_metadata(), ERROR_CODE_KEY)
                raise self._error(code, details, remote, method, timeout, accepted, attempts, spent) from exc

    def _unreachable(self, method: str, timeout: float | None, attempts: int, spent: float, details: str) -> Timeout:
        """The Timeout of a call whose deadline ran out before any try reached the server."""
        return Timeout(
            f"cannot reach {self.address} for {method!r} within its {timeout} s deadline ({attempts} attempts in {spent:.1f} s;"
            f" is it serving, with TLS on both sides or neither?): {details}"
        )

    def _reply(self, call: Any, method: str, tally: _Tally, into: Sequence[torch.Tensor] | None = None) -> Message:
        frames = iter(call)
        try:
            first = next(frames, None)
            t0 = time.perf_counter()
            _, meta, inbound = _receive(first, None, want_method=False, into=into)
            tally.decode += time.perf_counter() - t0
            tensors = _fill(inbound, frames)
            tally.decode += inbound.work
            tally.received = len(first) + inbound.declared  # type: ignore[arg-type]
        except _Rejected as exc:
            call.cancel()
            raise TransportError(f"bad reply to {method!r} from {self.address}: {exc.message}") from exc
        if self._peer is not None:
            self._learn_bulk_port(_metadata_value(call.initial_metadata(), BULK_PORT_KEY))
        return Message(meta, tensors)

    def _error(
        self, code: grpc.StatusCode | None, details: str, remote: str | None, method: str, timeout: float | None, accepted: bool, attempts: int, spent: float
    ) -> PdpsError:
        """The error a failed call raises, from its status (gRPC's, or the bulk channel's ERROR)."""
        if remote is not None:
            exc = _rebuild(remote, details)
            if exc is not None:
                return exc
            return TransportError(f"{method!r} at {self.address} raised an error this side does not know ({remote}): {details}")
        where = f"{method!r} at {self.address}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Timeout(f"call {where} ran past its {timeout} s deadline")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return Unauthenticated(f"authentication failed for {where}: {details} (give both sides the same token)")
        if code == grpc.StatusCode.UNIMPLEMENTED:
            return TransportError(f"{self.address} has no method {method!r}: {details}")
        if code == grpc.StatusCode.UNAVAILABLE and accepted:
            return TransportError(f"connection lost during {where} after the server accepted it (not retried: it may have run): {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            return TransportError(
                f"cannot reach {self.address} for {method!r} ({attempts} attempts in {spent:.1f} s; is it serving,"
                f" with TLS on both sides or neither?): {details}"
            )
        if code == grpc.StatusCode.INTERNAL:
            return TransportError(f"{where} failed on the server: {details}")
        if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return TransportError(f"{self.address} rejected {method!r}: {details}")
        return TransportError(f"call {where} failed: {code.name if code else 'no status'}: {details}")

    # --- the bulk channel -------------------------------------------------------------

    def _bulk_route(self, method: str, nbytes: int) -> int | None:
        """The bulk port to send this call to, or None for gRPC."""
        peer, threshold = self._peer, self._transport.bulk_threshold
        if peer is None or threshold is None or peer.port is None:
            return None
        if nbytes >= threshold or peer.reply_bytes.get(method, -1) >= threshold:
            return peer.port
        return None

    def _seen(self, method: str, reply: Message) -> Message:
        if self._peer is not None:
            self._peer.reply_bytes[method] = sum(t.numel() * t.element_size() for t in reply.tensors)
        return reply

    def _learn_bulk_port(self, value: str | None) -> None:
        try:
            port = int(value)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return
        peer = self._peer
        assert peer is not None
        if 0 < port < 65536 and port != peer.port and not (port == peer.unreachable and time.monotonic() < peer.retry_at):
            peer.port = port

    def _bulk_unreachable(self, port: int, exc: BaseException) -> None:
        peer = self._peer
        assert peer is not None
        first = peer.unreachable != port
        peer.unreachable, peer.retry_at = port, time.monotonic() + BULK_RETRY_AFTER
        if peer.port == port:
            peer.port = None
        say = log.warning if first else log.debug
        say("cannot reach the bulk channel of %s at port %d (%s); its calls go over gRPC for %.0f s", self.address, port, exc, BULK_RETRY_AFTER)

    def _call_bulk(
        self,
        port: int,
        method: str,
        header: bytes,
        views: Sequence[memoryview],
        timeout: float | None,
        deadline: float | None,
        tally: _Tally,
        into: Sequence[torch.Tensor] | None = None,
    ) -> Message:
        """The call over the bulk channel. A connection that fails before the server
        accepted the request is replaced once; then _NotRun sends the call over gRPC."""
        conn = self._pool.take(port) or self._bulk_connect(port, deadline)
        try:
            return self._bulk_exchange(conn, method, header, views, timeout, deadline, tally, into)
        except _NotRun as exc:
            log.debug("bulk connection to %s failed before %r was accepted (%s); trying a fresh one", self.address, method, exc)
        return self._bulk_exchange(self._bulk_connect(port, deadline), method, header, views, timeout, deadline, tally, into)

    def _bulk_connect(self, port: int, deadline: float | None) -> bulk.Connection:
        t = self._transport
        try:
            return bulk.connect(self._host, port, token=t.token, tls=self._bulk_tls, deadline=deadline)
        except bulk.HelloRefused as exc:
            if exc.status == bulk.HELLO_BAD_TOKEN:
                raise Unauthenticated(f"authentication failed for the bulk channel of {self.address}: {exc} (give both sides the same token)") from exc
            if exc.status == bulk.HELLO_NOT_BULK:
                self._bulk_unreachable(port, exc)
            raise _NotRun(str(exc)) from exc
        except bulk.Unreachable as exc:
            if deadline is None or time.monotonic() < deadline:  # not merely out of time
                self._bulk_unreachable(port, exc)
            raise _NotRun(str(exc)) from exc
        except OSError as exc:
            raise _NotRun(f"bulk hello with {self._host}:{port} failed: {exc}") from exc

    def _bulk_exchange(
        self,
        conn: bulk.Connection,
        method: str,
        header: bytes,
        views: Sequence[memoryview],
        timeout: float | None,
        deadline: float | None,
        tally: _Tally,
        into: Sequence[torch.Tensor] | None = None,
    ) -> Message:
        accepted = in_step = False
        error: PdpsError | None = None  # raised after the socket errors are sorted out (Timeout is an OSError)
        try:
            if deadline is not None:  # no gRPC deadline travels with it: the header carries the time left
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                header = with_timeout(header, left)
            try:
                conn.send(bulk.REQUEST, header, views, deadline=deadline)
            except TimeoutError:
                raise
            except OSError:  # the server may have refused the request and closed: its ERROR waits
                error = self._bulk_refusal(conn, method, timeout)
                if error is None:
                    raise
            if error is None:
                kind, length = self._bulk_prefix(conn, deadline)
                if kind == bulk.ACCEPTED:
                    accepted = True
                    kind, length = self._bulk_prefix(conn, deadline)
                if kind == bulk.ERROR:
                    error = self._bulk_error(conn.read_bytes(length, deadline=deadline), method, timeout, accepted)
                    in_step = accepted  # a handler's error; a refusal closes the connection
                elif kind != bulk.REPLY or not accepted:
                    error = TransportError(f"bad reply to {method!r} from {self.address}: bulk message of kind {kind} out of turn")
                else:
                    try:
                        first = conn.read_bytes(length, deadline=deadline)
                        t0 = time.perf_counter()
                        _, meta, inbound = _receive(bytes(first), None, want_method=False, into=into)
                        tally.decode += time.perf_counter() - t0
                        reply = Message(meta, inbound.read_from(lambda view: conn.read_into(view, deadline=deadline)))
                        tally.decode += inbound.work
                        tally.received = length + inbound.declared
                    except _Rejected as exc:
                        error = TransportError(f"bad reply to {method!r} from {self.address}: {exc.message}")
        except TimeoutError as exc:
            conn.close()
            raise Timeout(f"call {method!r} to {self.address} ran past its {timeout} s deadline") from exc
        except OSError as exc:
            conn.close()
            if not accepted:
                raise _NotRun(f"connection lost before the server accepted the request: {exc}") from exc
            raise TransportError(
                f"connection lost during {method!r} at {self.address} (bulk channel) after the server accepted it"
                f" (not retried: it may have run): {exc}"
            ) from exc
        if error is None:
            self._pool.give(conn)
            return reply
        if in_step:
            self._pool.give(conn)
        else:
            conn.close()
        raise error

    def _bulk_prefix(self, conn: bulk.Connection, deadline: float | None) -> tuple[int, int]:
        prefix = conn.read_prefix(deadline=deadline)
        assert prefix is not None
        if prefix[1] > MAX_FRAME_BYTES:
            raise bulk.PeerClosed(f"{self.address} sent a bulk header of {prefix[1]} bytes")  # out of step: drop it
        return prefix

    def _bulk_refusal(self, conn: bulk.Connection, method: str, timeout: float | None) -> PdpsError | None:
        """After a failed send: the error the server sent before it closed, if it did."""
        try:
            kind, length = self._bulk_prefix(conn, time.monotonic() + 1.0)
            if kind == bulk.ERROR:
                return self._bulk_error(conn.read_bytes(length, deadline=time.monotonic() + 1.0), method, timeout, accepted=False)
        except OSError:
            pass
        return None

    def _bulk_error(self, data: bytearray, method: str, timeout: float | None, accepted: bool) -> PdpsError:
        try:
            _, meta, _ = _receive(bytes(data), 0, want_method=False)
            status, details, remote = grpc.StatusCode[meta["status"]], str(meta["message"]), meta.get("code")
        except (_Rejected, KeyError, TypeError) as exc:
            return TransportError(f"bad error reply to {method!r} from {self.address}: {exc}")
        return self._error(status, details, remote if isinstance(remote, str) else None, method, timeout, accepted, 1, 0.0)

    def close(self) -> None:
        self._closed = True
        self._pool.close()
        self._channel.close()


class GrpcTransport:
    """The ``grpc://`` transport. Options apply to both the servers it starts and the
    channels it opens (docs/transport.md lists them)."""

    scheme = "grpc"
    concurrent = True  # calls release the GIL: callers may fan out calls on threads

    def __init__(
        self,
        *,
        token: str | None = None,
        tls: TlsConfig | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_request_bytes: int = 1 << 31,
        connect_timeout: float = 10.0,
        advertise_host: str | None = None,
        workers: int = 16,
        bulk_threshold: int | None = DEFAULT_BULK_THRESHOLD,
        bulk_port: int = 0,
        handshake_timeout: float = bulk.HELLO_TIMEOUT,
        idle_timeout: float = bulk.SERVER_IDLE,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_streams: int = DEFAULT_MAX_STREAMS,
    ) -> None:
        if token is not None and (not token or not token.isascii() or not token.isprintable()):
            raise ConfigError("the gRPC token must be a non-empty printable ASCII string")
        if tls is not None and not isinstance(tls, TlsConfig):
            raise ConfigError(f"tls must be a TlsConfig, not {type(tls).__name__}")
        if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise ConfigError(f"chunk_bytes={chunk_bytes} is outside [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}]")
        if max_request_bytes < 0:
            raise ConfigError(f"max_request_bytes={max_request_bytes} is negative")
        if not connect_timeout > 0:
            raise ConfigError(f"connect_timeout={connect_timeout} must be positive")
        if workers < 1:
            raise ConfigError(f"workers={workers} must be at least 1")
        if bulk_threshold is not None and (isinstance(bulk_threshold, bool) or not isinstance(bulk_threshold, int) or bulk_threshold < 0):
            raise ConfigError(f"bulk_threshold={bulk_threshold!r} must be a byte count >= 0, or None to turn the bulk channel off")
        if not 0 <= bulk_port <= 65535:
            raise ConfigError(f"bulk_port={bulk_port} is not a TCP port (0 picks a free one)")
        for name, seconds in (("handshake_timeout", handshake_timeout), ("idle_timeout", idle_timeout)):
            if isinstance(seconds, bool) or not (isinstance(seconds, (int, float)) and 0 < seconds < math.inf):
                raise ConfigError(f"{name}={seconds!r} must be a positive number of seconds")
        for name, count in (("max_connections", max_connections), ("max_streams", max_streams)):
            if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count < 1 << 31:
                raise ConfigError(f"{name}={count!r} must be a whole number from 1 to 2**31 - 1")
        self.token = token
        self.tls = tls
        self.chunk_bytes = chunk_bytes
        self.max_request_bytes = max_request_bytes
        self.connect_timeout = connect_timeout
        self.advertise_host = advertise_host
        self.workers = workers
        self.bulk_threshold = bulk_threshold
        self.bulk_port = bulk_port  # where servers listen for bulk connections (0: a free port)
        self.handshake_timeout = float(handshake_timeout)  # connection limits of its servers (docs/transport.md)
        self.idle_timeout = float(idle_timeout)
        self.max_connections = max_connections
        self.max_streams = max_streams
        self._bulk_lock = threading.Lock()
        self._bulk_peers: dict[str, _BulkPeer] = {}
        self._bulk_tls: ssl.SSLContext | None = None

    def serve(self, address: str, handlers: Mapping[str, Handler]) -> GrpcEndpoint:
        """Serve at ``grpc://HOST:PORT`` (PORT 0 picks a free one). A wildcard HOST
        (0.0.0.0, ::) publishes ``advertise_host``, else this machine's hostname."""
        host, port = _split(address)
        publish = host
        if host in _WILDCARD_HOSTS:
            publish = self.advertise_host or socket.gethostname()
        return GrpcEndpoint(self, host, port, handlers, publish)

    def connect(self, address: str) -> GrpcChannel:
        return GrpcChannel(self, address)

    def refuses(self, address: str) -> bool:
        host, port = _split(address)
        try:
            socket.create_connection((host, port), timeout=REFUSES_PROBE_S).close()
        except ConnectionRefusedError:
            return True
        except OSError:  # a timeout, an unreachable host: cannot tell
            return False
        return False

    def _bulk_peer(self, address: str) -> _BulkPeer:
        with self._bulk_lock:
            return self._bulk_peers.setdefault(address, _BulkPeer())

    def _bulk_client_context(self) -> ssl.SSLContext | None:
        """The TLS context of this transport's bulk connections (made once)."""
        if self.tls is None:
            return None
        with self._bulk_lock:
            if self._bulk_tls is None:
                self._bulk_tls = self.tls.client_context()
            return self._bulk_tls
