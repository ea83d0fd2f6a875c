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

Optional: a channel may carry ``stats``, a dict of cumulative client-side floats for
a per-step breakdown (both adapters here have it; read it with
``getattr(channel, "stats", None)``, since other adapters need not): ``"serialize"``
(seconds spent encoding requests and decoding replies into tensors, not waiting on
the wire; 0.0 in process), ``"calls"``, ``"bytes_sent"`` and ``"bytes_received"``.
docs/transport.md says what each adapter counts.
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
    # Optional, not part of the protocol: stats: dict[str, float] (see the module docstring).

    def call(self, method: str, request: Message, *, timeout: float | None = None, into: Sequence[Any] | None = None) -> Message:
        """Call ``method``. ``into`` is a hint: tensors the reply's tensors may be received
        into, sparing the caller a copy (the gRPC adapter does when they match; the reply
        then holds these very tensors). An adapter may ignore it."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Transport(Protocol):
    scheme: str

    def serve(self, address: str, handlers: Mapping[str, Handler]) -> Endpoint:
        """Serve ``handlers`` at ``address`` (a port of 0 or an empty name picks a free one)."""
        ...

    def connect(self, address: str) -> Channel: ...
