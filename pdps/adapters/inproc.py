"""``inproc://name`` transport: calls are plain function calls in the caller's thread.

Nothing is serialized and no tensor is copied: the handler receives the caller's
tensors and the caller receives the handler's (see the port for who may keep or
write what). Errors raised by a handler reach the caller unchanged. Services live in
a process-wide table, so any role in the process can reach any other by address.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Mapping

from pdps.core.errors import TransportError
from pdps.ports.transport import Handler, Message

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


class InprocChannel:
    def __init__(self, address: str) -> None:
        self.address = address
        self._name = _name(address)

    def call(self, method: str, request: Message, *, timeout: float | None = None) -> Message:
        # A deadline cannot interrupt a function running in this very thread, so it is
        # handed to the handler as meta "timeout"; handlers that wait honour it.
        if timeout is not None and "timeout" not in request.meta:
            request = Message({**request.meta, "timeout": timeout}, request.tensors)
        handlers = _services.get(self._name)
        if handlers is None:
            raise TransportError(f"nothing is served at {self.address}")
        handler = handlers.get(method)
        if handler is None:
            raise TransportError(f"{self.address} has no method {method!r} (it serves {sorted(handlers)})")
        reply = handler(request)
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
