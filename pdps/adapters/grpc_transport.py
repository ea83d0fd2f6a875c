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
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs
import grpc
import numpy as np
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdps.core.errors import (
    ConfigError,
    GradientRejected,
    NoSuchJob,
    NotReady,
    PdpsError,
    StalePush,
    Timeout,
    TransportError,
    UnknownTaskError,
    error_classes,
)
from pdps.ports.transport import Handler, Message

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

RETRY_FIRST = 0.05
RETRY_MAX = 1.0

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
]
_CLIENT_OPTIONS = _OPTIONS + [
    # While the channel backs off after a refused connection, calls fail at once with
    # the old error; its default (1 s first, up to 120 s) would hide a server that came
    # up from the call retries below for that long.
    ("grpc.initial_reconnect_backoff_ms", int(RETRY_FIRST * 1000)),
    ("grpc.max_reconnect_backoff_ms", 250),
]

# ----------------------------------------------------------------------------------
# dtypes: every non-quantized torch dtype, by its name without "torch."

DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype) and not str(d).startswith("torch.q")
}
_DTYPE_NAMES = {d: name for name, d in DTYPES.items()}


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
            pos += 8 if wire == 1 else 4
            if pos > len(buf):
                raise FrameError("fixed-size field runs past the end of the frame")
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
    method, meta, specs = "", "", []
    for field, _wire, value in _fields(buf):
        if field == 1:
            method = _text(value, "method")
        elif field == 2:
            meta = _text(value, "meta_json")
        elif field == 3:
            if not isinstance(value, memoryview):
                raise FrameError("tensor spec is not a length-delimited field")
            specs.append(_decode_spec(value))
    return Header(method, meta, tuple(specs))


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
    return _field_bytes(1, b"".join(parts))


def chunk_prefix(size: int) -> bytes:
    """Tag and length of a chunk frame whose payload (``size`` bytes) follows."""
    return b"\x12" + _varint(size)


# ----------------------------------------------------------------------------------
# Tensors to frames and back.


class _Rejected(Exception):
    """A stream that breaks the protocol or a limit; ``status`` says how."""

    def __init__(self, status: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _outgoing(method: str, meta: Mapping[str, Any], tensors: Sequence[Any]) -> tuple[bytes, list[memoryview]]:
    """The header frame and each tensor's bytes (views of contiguous CPU storage)."""
    try:
        meta_json = json.dumps(dict(meta), separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise TransportError(f"meta of {method or 'a reply'!r} is not JSON-safe: {exc}") from exc
    specs, views = [], []
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.dtype not in _DTYPE_NAMES:
            what = type(t).__name__ if not isinstance(t, torch.Tensor) else f"{t.layout} {t.dtype} tensor"
            raise TransportError(f"tensor {i} of {method or 'a reply'!r} cannot travel: {what} (dense tensors only)")
        t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
        nbytes = t.numel() * t.element_size()
        specs.append(TensorSpec(_DTYPE_NAMES[t.dtype], tuple(t.shape), nbytes))
        if nbytes:
            views.append(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return encode_header(Header(method, meta_json, tuple(specs))), views


def _frames(header: bytes, views: Sequence[memoryview], chunk_bytes: int) -> Iterator[bytes]:
    """The header frame, then the tensors' bytes in chunks (small tensors share one)."""
    yield header
    pending: list[Any] = []
    size = 0
    for view in views:
        pos = 0
        while pos < len(view):
            take = min(chunk_bytes - size, len(view) - pos)
            pending.append(view[pos : pos + take])
            size += take
            pos += take
            if size == chunk_bytes:
                yield b"".join([chunk_prefix(size), *pending])
                pending, size = [], 0
    if size:
        yield b"".join([chunk_prefix(size), *pending])


class _Inbound:
    """One direction's tensors being received: checked specs, one buffer, chunks placed as they come."""

    def __init__(self, specs: Sequence[TensorSpec], limit: int | None) -> None:
        self._layout: list[tuple[torch.dtype, tuple[int, ...], int, int]] = []  # dtype, shape, offset, nbytes
        offset = declared = 0
        for i, spec in enumerate(specs):
            dtype = DTYPES.get(spec.dtype)
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
        self._buffer: torch.Tensor | None = None
        self._segments = [(start, n) for _, _, start, n in self._layout if n]
        self._segment = 0
        self._filled = 0  # bytes of the current segment already written

    def allocate(self) -> None:
        self._buffer = _RECEIVE_BUFFERS.take(self.size)
        self._array = self._buffer.numpy()

    def add(self, chunk: memoryview) -> None:
        n = len(chunk)
        if self.received + n > self.declared:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"chunks carry more than the {self.declared} bytes the header declares",
            )
        if self._buffer is None:
            self.allocate()
        source = np.frombuffer(chunk, dtype=np.uint8)
        pos = 0
        while pos < n:
            start, size = self._segments[self._segment]
            take = min(size - self._filled, n - pos)
            at = start + self._filled
            np.copyto(self._array[at : at + take], source[pos : pos + take])  # releases the GIL
            pos += take
            self._filled += take
            if self._filled == size:
                self._segment += 1
                self._filled = 0
        self.received += n

    def finish(self) -> list[torch.Tensor]:
        if self.received < self.declared:
            raise _Rejected(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"stream ended after {self.received} of the {self.declared} tensor bytes the header declares",
            )
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
                    self._arrays.remove(min(idle, key=lambda a: a.size))
                if len(self._arrays) < self._keep and sum(a.size for a in self._arrays) + size <= self._max_bytes:
                    self._arrays.append(best)
            return torch.from_numpy(best)[:size]


#: Shared by every server and channel of the process.
_RECEIVE_BUFFERS = _BufferPool(keep=POOLED_BUFFERS, max_bytes=POOLED_MAX_BYTES, min_bytes=POOLED_MIN_BYTES)


def _receive(frames: Iterator[bytes], limit: int | None, want_method: bool) -> tuple[Header, dict, _Inbound]:
    """Read the header of one direction of a call; ``_fill`` then reads its tensors. Raises _Rejected."""
    first = next(frames, None)
    if first is None:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "stream ended before its header frame")
    header = _decode(first)
    if not isinstance(header, Header):
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "the first frame must be a header, not a chunk")
    if want_method and not header.method:
        raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "header names no method")
    meta = _meta(header.meta_json)
    inbound = _Inbound(header.tensors, limit)
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
    for data in frames:
        chunk = _decode(data)
        if not isinstance(chunk, memoryview):
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, "a second header frame in one stream")
        inbound.add(chunk)
    return inbound.finish()


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
    """A running gRPC server. ``address`` is ``grpc://host:port`` with the real port."""

    def __init__(self, transport: GrpcTransport, bind: str, handlers: Mapping[str, Handler], publish_host: str) -> None:
        self._transport = transport
        self._handlers = dict(handlers)
        self._lock = threading.Lock()
        self._closed = False
        self._expected_auth = f"Bearer {transport.token}".encode() if transport.token is not None else None
        self._executor = ThreadPoolExecutor(max_workers=transport.workers, thread_name_prefix="pdps-grpc")
        self._server = grpc.server(self._executor, options=_SERVER_OPTIONS)
        call = grpc.stream_stream_rpc_method_handler(self._serve_call)  # raw bytes both ways
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {"Call": call}),))
        self._health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
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
        self._server.start()
        for name in ("", SERVICE):
            self._health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.port = port
        self.address = f"grpc://{_hostport(publish_host, port)}"
        log.info("serving %s at %s (%s)", sorted(self._handlers), self.address, "TLS" if transport.tls else "plaintext")

    def close(self, grace: float = CLOSE_GRACE) -> None:
        """Report NOT_SERVING, refuse new calls, give in-flight ones ``grace`` seconds."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._health.enter_graceful_shutdown()
        self._server.stop(grace).wait(grace + 5.0)
        self._executor.shutdown(wait=False)
        log.info("stopped serving at %s", self.address)

    def _check_token(self, context: grpc.ServicerContext) -> None:
        if self._expected_auth is None:
            return
        sent = _metadata_value(context.invocation_metadata(), "authorization")
        if sent is None:
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "no bearer token: this server requires one")
        if not hmac.compare_digest(sent.encode(), self._expected_auth):
            raise _Rejected(grpc.StatusCode.UNAUTHENTICATED, "wrong bearer token")

    def _serve_call(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        requests = iter(requests)
        try:
            self._check_token(context)
            header, meta, inbound = _receive(requests, self._transport.max_request_bytes, want_method=True)
            handler = self._handlers.get(header.method)
            if handler is None:
                raise _Rejected(grpc.StatusCode.UNIMPLEMENTED, f"no method {header.method!r} here (it serves {sorted(self._handlers)})")
            tensors = _fill(inbound, requests)
        except _Rejected as exc:
            log.warning("rejected a call from %s at %s: %s", context.peer(), self.address, exc.message)
            context.abort(exc.status, exc.message)
        except grpc.RpcError:
            log.debug("caller %s went away before its request was whole", context.peer())
            return
        # The client retries an UNAVAILABLE call only when it did not see this marker.
        context.send_initial_metadata(((ACCEPTED_KEY, "1"),))
        method = header.method
        try:
            reply = handler(Message(meta, tensors))
        except PdpsError as exc:
            context.set_trailing_metadata(((ERROR_CODE_KEY, exc.code),))
            context.abort(_status_of(exc), str(exc))
        except Exception as exc:
            log.exception("handler %r at %s raised", method, self.address)
            context.abort(grpc.StatusCode.INTERNAL, f"handler {method!r} raised {type(exc).__name__}: {exc}")
        try:
            if not isinstance(reply, Message):
                raise TransportError(f"handler {method!r} returned {type(reply).__name__}, not Message")
            header_frame, views = _outgoing("", reply.meta, reply.tensors)
        except TransportError as exc:
            log.error("bad reply from handler %r at %s: %s", method, self.address, exc)
            context.abort(grpc.StatusCode.INTERNAL, str(exc))
        yield from _frames(header_frame, views, self._transport.chunk_bytes)


# ----------------------------------------------------------------------------------
# Client.


class GrpcChannel:
    """Calls to one ``grpc://`` address over one cached gRPC channel; thread-safe."""

    def __init__(self, transport: GrpcTransport, address: str) -> None:
        host, port = _split(address)
        self.address = address
        self._transport = transport
        target = _hostport(host, port)
        if transport.tls is not None:
            self._channel = grpc.secure_channel(target, transport.tls.channel_credentials(), options=_CLIENT_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(target, options=_CLIENT_OPTIONS)
        self._call = self._channel.stream_stream(CALL_PATH)  # raw bytes both ways
        self._metadata = (("authorization", f"Bearer {transport.token}"),) if transport.token is not None else None
        self._closed = False

    def call(self, method: str, request: Message, *, timeout: float | None = None) -> Message:
        if self._closed:
            raise TransportError(f"channel to {self.address} is closed")
        meta = dict(request.meta)
        if timeout is not None and "timeout" not in meta:
            meta["timeout"] = timeout  # handlers that wait (a sync pull) honour it
        header, views = _outgoing(method, meta, request.tensors)
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        retry_until = start + self._transport.connect_timeout
        if deadline is not None:
            retry_until = min(retry_until, deadline)
        backoff = RETRY_FIRST
        attempts = 0
        while True:
            attempts += 1
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise Timeout(f"call {method!r} to {self.address} ran past its {timeout} s deadline")
            try:
                call = self._call(_frames(header, views, self._transport.chunk_bytes), timeout=remaining, metadata=self._metadata)
            except ValueError as exc:  # grpc refuses calls on a closed channel
                raise TransportError(f"cannot call {method!r} on {self.address}: {exc}") from exc
            try:
                return self._reply(call, method)
            except grpc.RpcError as exc:
                accepted = _metadata_value(call.initial_metadata(), ACCEPTED_KEY) is not None
                if call.code() == grpc.StatusCode.UNAVAILABLE and not accepted and time.monotonic() + backoff < retry_until:
                    log.debug("%s unavailable (%s); retrying %r in %.2f s", self.address, call.details(), method, backoff)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, RETRY_MAX)
                    continue
                raise self._error(call, method, timeout, accepted, attempts, time.monotonic() - start) from exc

    def _reply(self, call: Any, method: str) -> Message:
        frames = iter(call)
        try:
            _, meta, inbound = _receive(frames, None, want_method=False)
            tensors = _fill(inbound, frames)
        except _Rejected as exc:
            call.cancel()
            raise TransportError(f"bad reply to {method!r} from {self.address}: {exc.message}") from exc
        return Message(meta, tensors)

    def _error(self, call: Any, method: str, timeout: float | None, accepted: bool, attempts: int, spent: float) -> PdpsError:
        code, details = call.code(), call.details() or ""
        remote = _metadata_value(call.trailing_metadata(), ERROR_CODE_KEY)
        if remote is not None:
            exc = _rebuild(remote, details)
            if exc is not None:
                return exc
            return TransportError(f"{method!r} at {self.address} raised an error this side does not know ({remote}): {details}")
        where = f"{method!r} at {self.address}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return Timeout(f"call {where} ran past its {timeout} s deadline")
        if code == grpc.StatusCode.UNAUTHENTICATED:
            return TransportError(f"authentication failed for {where}: {details} (give both sides the same token)")
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

    def close(self) -> None:
        self._closed = True
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
        self.token = token
        self.tls = tls
        self.chunk_bytes = chunk_bytes
        self.max_request_bytes = max_request_bytes
        self.connect_timeout = connect_timeout
        self.advertise_host = advertise_host
        self.workers = workers

    def serve(self, address: str, handlers: Mapping[str, Handler]) -> GrpcEndpoint:
        """Serve at ``grpc://HOST:PORT`` (PORT 0 picks a free one). A wildcard HOST
        (0.0.0.0, ::) publishes ``advertise_host``, else this machine's hostname."""
        host, port = _split(address)
        publish = host
        if host in _WILDCARD_HOSTS:
            publish = self.advertise_host or socket.gethostname()
        return GrpcEndpoint(self, _hostport(host, port), handlers, publish)

    def connect(self, address: str) -> GrpcChannel:
        return GrpcChannel(self, address)
