"""Typed calls over the transport port: the roles' side of :mod:`pdps.core.wire`.

A role serves handlers that take a typed request and return a typed reply
(:func:`serve`); a caller sends a typed request and gets its typed reply
(:func:`call`). Nothing else in the roles touches a message's ``meta``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pdps.core.wire import Request, Wire
from pdps.ports.transport import Channel, Handler, Message


def message(obj: Wire) -> Message:
    return Message(*obj.encode())


def serve(handlers: Mapping[type[Request], Callable[[Any], Wire]]) -> dict[str, Handler]:
    """Transport handlers, by method, that decode (and so validate) each request before
    its typed handler sees it, and encode the typed reply."""

    def typed(cls: type[Request], handler: Callable[[Any], Wire]) -> Handler:
        return lambda msg: message(handler(cls.decode(msg)))

    return {cls.METHOD: typed(cls, handler) for cls, handler in handlers.items()}


def call(channel: Channel, request: Request, *, timeout: float | None = None, into: Sequence[Any] | None = None) -> Any:
    """Send ``request``; its reply, decoded as its class's ``REPLY``."""
    kwargs: dict[str, Any] = {}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if into is not None:
        kwargs["into"] = into
    return request.REPLY.decode(channel.call(request.METHOD, message(request), **kwargs))
