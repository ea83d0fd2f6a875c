"""``inproc://name`` transport: calls are plain function calls in the caller's thread.

Nothing is serialized and no tensor is copied: the handler receives the caller's
tensors and the caller receives the handler's (see the port for who may keep or
write what). A handler's PdpsError reaches the caller unchanged; any other exception
is logged with its traceback and raised as the TransportError a gRPC caller would
get. Services live in a process-wide table, so any role in the process can reach any
other by address.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

from pdps.core.errors import PdpsError, TransportError
from pdps.ports.transport import Handler, Message

log = logging.getLogger(__name__)

_services: dict[str, Mapping[str, Handler]] = {}
_services_lock = threading.Lock()
_auto_names = itertools.count(1)


def _name(address: str) -> str:
    if not address.startswith("inproc://"):
        raise TransportError(f"not an inproc address: {address!r} (expected inproc://name)")
    return address[len("inproc://") :].strip("/")


class InprocEndpoint:
    def __init__(self, address: str) -> None:
        self.address = address

    def close(self) -> None:
        with _services_lock:
            _services.pop(_name(self.address), None)


def tensor_bytes(tensors: object) -> int:
    try:
        return sum(t.numel() * t.element_size() for t in tensors)  # type: ignore[attr-defined, union-attr]
    except (AttributeError, TypeError):
        return 0  # not tensors: the handler or the caller finds out


class InprocChannel:
    """Calls to one ``inproc://`` service.

    ``stats`` has the keys of the gRPC channel's (cumulative floats, updated under a
    lock once per call): ``serialize`` stays 0.0, since tensors pass by reference;
    ``calls`` counts calls (those that raised too); ``bytes_sent`` / ``bytes_received``
    add up the tensor bytes of requests / of replies, handed over without a copy.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._name = _name(address)
        self.stats: dict[str, float] = {"serialize": 0.0, "calls": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0}
        self._stats_lock = threading.Lock()

    def call(self, method: str, request: Message, *, timeout: float | None = None, into: Any = None) -> Message:
        """The handler, in this thread. ``into`` is ignored: the reply's tensors are the
        callee's own (zero copy), which the caller copies from."""
        received = 0
        try:
            reply = self._call(method, request, timeout)
            received = tensor_bytes(reply.tensors)
            return reply
        finally:
            with self._stats_lock:
                self.stats["calls"] += 1
                self.stats["bytes_sent"] += tensor_bytes(request.tensors)
                self.stats["bytes_received"] += received

    def _call(self, method: str, request: Message, timeout: float | None) -> Message:
        # A deadline cannot interrupt a function running in this very thread: handlers
        # that wait end their wait by the request's deadline.
        deadline = None if timeout is None else time.monotonic() + timeout
        if request.deadline != deadline:
            request = Message(request.meta, request.tensors, deadline=deadline)
        handlers = _services.get(self._name)
        if handlers is None:
            raise TransportError(f"nothing is served at {self.address}")
        handler = handlers.get(method)
        if handler is None:
            raise TransportError(f"{self.address} has no method {method!r} (it serves {sorted(handlers)})")
        try:
            reply = handler(request)
        except PdpsError:
            raise
        except Exception as exc:
            log.exception("handler %r at %s raised", method, self.address)
            raise TransportError(f"{method!r} at {self.address} failed on the server: handler {method!r} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(reply, Message):
            raise TransportError(f"handler {method!r} at {self.address} returned {type(reply).__name__}, not Message")
        return reply

    def close(self) -> None:
        pass


class InprocTransport:
    scheme = "inproc"

    def serve(self, address: str, handlers: Mapping[str, Handler]) -> InprocEndpoint:
        name = _name(address)
        with _services_lock:
            if not name:
                name = f"auto-{next(_auto_names)}"
            if name in _services:
                raise TransportError(f"inproc://{name} is already served in this process")
            _services[name] = dict(handlers)
        return InprocEndpoint(f"inproc://{name}")

    def connect(self, address: str) -> InprocChannel:
        return InprocChannel(address)

    def refuses(self, address: str) -> bool:
        with _services_lock:
            return _name(address) not in _services
