"""Transport port: named request/response calls between roles, carrying tensors.

A *service* is a mapping of method names to handlers, served at an address whose
scheme picks the adapter (``inproc://name``, ``grpc://host:port``). A call sends a
JSON-safe ``meta`` mapping plus a sequence of tensors and gets a :class:`Message`
back the same shape.

Contract (every adapter passes ``tests/unit/contract_transport.py``):

* Request tensors are *borrowed* by the handler for the duration of the call: a
  handler that keeps data must copy it. Reply tensors may alias the server's memory
  (the in-process adapter copies nothing): callers read or copy them and never write.
* A handler raising a :class:`~pdps.core.errors.PdpsError` makes the call raise the
  same class with the same message on the caller's side.
* An unknown address or method raises :class:`~pdps.core.errors.TransportError`;
  a call running past ``timeout`` seconds raises :class:`~pdps.core.errors.Timeout`.
  The in-process adapter runs the handler in the caller's thread and cannot
  interrupt it: it hands the deadline to the handler as meta ``"timeout"``, and
  handlers that wait (a sync pull at the barrier) honour it.
* Nothing is pickled: meta is JSON-safe, tensors travel as raw bytes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.frozen
class Message:
    meta: Mapping[str, Any] = attrs.field(factory=dict)
    tensors: Sequence[Any] = ()  # torch.Tensor


Handler = Callable[[Message], Message]


class Endpoint(Protocol):
    """A running service; ``address`` is where callers reach it."""

    address: str

    def close(self) -> None: ...


class Channel(Protocol):
    def call(self, method: str, request: Message, *, timeout: float | None = None) -> Message: ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    scheme: str

    def serve(self, address: str, handlers: Mapping[str, Handler]) -> Endpoint:
        """Serve ``handlers`` at ``address`` (a port of 0 or an empty name picks a free one)."""
        ...

    def connect(self, address: str) -> Channel: ...
