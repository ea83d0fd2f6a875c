"""Transport port: named request/response calls between roles, carrying tensors.

A *service* is a mapping of method names to handlers, served at an address whose
scheme picks the adapter (``inproc://name``, ``grpc://host:port``). A call sends a
JSON-safe ``meta`` mapping plus a sequence of tensors and gets a :class:`Message`
back the same shape.

Contract (every adapter passes ``tests/unit/contract_transport.py``):

* Request tensors are *borrowed* by the handler for the duration of the call: a
  handler that keeps data must copy it, unless the request is :attr:`Message.owned`
  (an adapter that received them into memory of its own gives them away). Reply tensors may alias the server's memory
  (the in-process adapter copies nothing): callers read or copy them and never write.
* A handler raising a :class:`~pdps.core.errors.PdpsError` makes the call raise the
  same class with the same message on the caller's side.
* A handler raising anything else has a bug: the server logs the traceback and goes
  on serving; the caller gets a plain :class:`~pdps.core.errors.TransportError`
  naming the address, the method, the exception's type and its message.
* An unknown address or method raises :class:`~pdps.core.errors.TransportError`;
  a call running past ``timeout`` seconds raises :class:`~pdps.core.errors.Timeout`.
* The handler receives the caller's ``timeout`` as the request's
  :attr:`Message.deadline`: a :func:`time.monotonic` value of the handler's own
  process (``None`` without a timeout). Handlers that wait (a sync pull at the
  barrier) give up by then; the in-process adapter runs the handler in the caller's
  thread and cannot interrupt it, so there the deadline is all that ends a wait. A
  ``deadline`` the caller puts on its request is not sent: only ``timeout`` sets one.
* Nothing is pickled: meta is JSON-safe, tensors travel as raw bytes.

Optional capabilities, which other adapters need not have, are small protocols
checked with ``isinstance``: :class:`ChannelStats` (a channel's cumulative counters,
for a per-step breakdown) and :class:`ConcurrentCalls` (a transport whose calls from
several threads overlap). docs/transport.md says what each adapter has and counts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs


@attrs.frozen
class Message:
    """A request or a reply. ``deadline`` is set by the transport on the request a
    handler receives (see the module docstring); replies leave it ``None``. ``owned``,
    set by the transport on a request it received into memory of its own: nobody else
    holds or writes its tensors, so the handler may keep them without a copy."""

    meta: Mapping[str, Any] = attrs.field(factory=dict)
    tensors: Sequence[Any] = ()  # torch.Tensor
    deadline: float | None = attrs.field(default=None, kw_only=True)
    owned: bool = attrs.field(default=False, kw_only=True)


Handler = Callable[[Message], Message]


class Endpoint(Protocol):
    """A running service; ``address`` is where callers reach it."""

    address: str

    def close(self) -> None: ...


class Channel(Protocol):
    def call(self, method: str, request: Message, *, timeout: float | None = None, into: Sequence[Any] | None = None) -> Message:
        """Call ``method``; past ``timeout`` seconds it raises Timeout, and the handler
        gets the deadline (see the module docstring). ``into`` is a hint: tensors the reply's tensors may be received
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

    def refuses(self, address: str) -> bool:
        """True when nothing serves at ``address`` for sure (in process: no such
        endpoint; over TCP: the connection is refused, the listening socket is gone with
        its process). False when something may: it answers, or the probe cannot tell (a
        timeout, an unreachable host). A failure detector's fast path: a False answer
        leaves the slow, safe one (a lease running out) to decide."""
        ...


@runtime_checkable
class ChannelStats(Protocol):
    """A channel that counts: ``stats`` holds cumulative client-side floats, for a
    per-step breakdown. ``"serialize"``: seconds spent encoding requests and decoding
    replies into tensors, not waiting on the wire (0.0 in process); ``"calls"``;
    ``"bytes_sent"`` and ``"bytes_received"``."""

    stats: dict[str, float]


@runtime_checkable
class ConcurrentCalls(Protocol):
    """A transport whose calls from several threads run at the same time (they release
    the GIL while they wait on the wire), when ``concurrent`` is True: calls to several
    servers are then worth making from a thread pool."""

    concurrent: bool
