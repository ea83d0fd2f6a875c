"""The transport contract. Every adapter's test class inherits it.

A subclass supplies ``transport`` (the adapter) and ``address`` (a fresh address to
serve at: ``inproc://`` or ``grpc://127.0.0.1:0``).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

from pdps.core.errors import GradientRejected, NotReady, StalePush, Timeout, TransportError
from pdps.ports.transport import Message


def echo(req: Message) -> Message:
    return Message({"echo": dict(req.meta)}, [t.clone() for t in req.tensors])


def total(req: Message) -> Message:
    return Message({"sum": float(sum(t.sum().item() for t in req.tensors))})


def reject(req: Message) -> Message:
    raise GradientRejected(f"gradient for w from trainer {req.meta.get('trainer')!r} holds NaN")


#: What ``raise_`` raises, by the request's meta ``"kind"``: typed errors and a bug.
RAISED = {
    "rejected": GradientRejected("gradient for w from trainer 't7' holds NaN"),
    "not_ready": NotReady("pserver 2 holds no parameters yet; a trainer initializes it"),
    "stale": StalePush("push of version 3 is 5 behind pserver 0 (staleness 2)"),
    "timeout": Timeout("round 4 did not close in 3s; waiting for ['t2']"),
    "bug": KeyError("weights"),
}


def raise_(req: Message) -> Message:
    raise RAISED[req.meta["kind"]]


#: The deadline each call to ``deadline`` saw: the request's, as the handler got it.
DEADLINES: list[float | None] = []


def deadline(req: Message) -> Message:
    DEADLINES.append(req.deadline)
    return Message({"left": None if req.deadline is None else req.deadline - time.monotonic()})


#: What ``keep`` kept: the request's tensors as they are when it says they are ``owned``,
#: copies otherwise; and each request's ``owned``.
KEPT: list[tuple[bool, list]] = []


def keep(req: Message) -> Message:
    KEPT.append((req.owned, list(req.tensors) if req.owned else [t.clone() for t in req.tensors]))
    return Message({})


class TransportContract:
    @pytest.fixture
    def served(self, transport, address):
        handlers = {"echo": echo, "total": total, "reject": reject, "raise": raise_, "deadline": deadline, "keep": keep}
        endpoint = transport.serve(address, handlers)
        yield endpoint
        endpoint.close()

    def test_meta_and_tensors_roundtrip(self, transport, served):
        ch = transport.connect(served.address)
        tensors = [torch.arange(12, dtype=torch.float32).view(3, 4), torch.tensor([1.5], dtype=torch.float64), torch.zeros(0)]
        reply = ch.call("echo", Message({"a": 1, "b": [1, "x"]}, tensors))
        assert reply.meta == {"echo": {"a": 1, "b": [1, "x"]}}
        assert len(reply.tensors) == 3
        for got, want in zip(reply.tensors, tensors):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)

    def test_a_handler_keeps_owned_tensors_and_nothing_later_changes_them(self, transport, served):
        """Request tensors are borrowed unless the request is ``owned``: then the handler
        may keep them as they are, and neither the caller nor later calls change them."""
        ch = transport.connect(served.address)
        KEPT.clear()
        sent = [torch.arange(float(n), dtype=torch.float32) for n in (3, 1 << 19)]  # small, and a receive buffer's size
        ch.call("keep", Message({}, sent))
        for t in sent:
            t.fill_(-1.0)  # the caller reuses its buffers at once
        for _ in range(3):
            ch.call("keep", Message({}, [torch.full_like(t, 7.0) for t in sent]))
        assert [type(owned) for owned, _ in KEPT] == [bool] * 4
        assert [torch.equal(k, torch.arange(float(t.numel()))) for k, t in zip(KEPT[0][1], sent)] == [True, True]

    def test_call_without_tensors(self, transport, served):
        reply = transport.connect(served.address).call("total", Message({}))
        assert reply.meta == {"sum": 0.0} and list(reply.tensors) == []

    def test_handler_error_arrives_as_same_class_and_message(self, transport, served):
        ch = transport.connect(served.address)
        with pytest.raises(GradientRejected, match="trainer 't7' holds NaN"):
            ch.call("reject", Message({"trainer": "t7"}))
        assert ch.call("total", Message({}, [torch.ones(3)])).meta["sum"] == 3.0  # still serving

    @pytest.mark.parametrize("kind", ["rejected", "not_ready", "stale", "timeout"])
    def test_every_typed_error_arrives_as_its_exact_class_and_message(self, transport, served, kind):
        with pytest.raises(type(RAISED[kind])) as info:
            transport.connect(served.address).call("raise", Message({"kind": kind}), timeout=30)
        assert type(info.value) is type(RAISED[kind]) and str(info.value) == str(RAISED[kind])

    def test_a_handler_bug_is_a_transport_error_naming_the_method_and_the_exception(self, transport, served, caplog):
        """An exception that is no PdpsError is a bug of the server: the caller gets a
        plain TransportError naming address, method, exception type and message; the
        server logs the traceback and keeps serving."""
        ch = transport.connect(served.address)
        with caplog.at_level(logging.ERROR), pytest.raises(TransportError) as info:
            ch.call("raise", Message({"kind": "bug"}))
        assert type(info.value) is TransportError
        for part in (served.address, "'raise'", "KeyError", "'weights'"):
            assert part in str(info.value), part
        logged = [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], KeyError)]
        assert len(logged) == 1 and "'raise'" in logged[0].getMessage() and served.address in logged[0].getMessage()
        assert ch.call("total", Message({}, [torch.ones(2)])).meta == {"sum": 2.0}  # still serving

    def test_the_callers_timeout_reaches_the_handler_as_its_deadline(self, transport, served):
        """The deadline is ``time.monotonic()`` of the handler's process: in this one
        process, about the caller's own ``now + timeout`` (gRPC rounds it up by a few
        milliseconds). It is no meta key."""
        ch = transport.connect(served.address)
        DEADLINES.clear()
        before = time.monotonic()
        left = ch.call("deadline", Message({}), timeout=30).meta["left"]
        after = time.monotonic()
        assert 30 - (after - before) - 5 < left < 31
        assert before + 30 - 5 < DEADLINES[0] < after + 31
        assert ch.call("deadline", Message({})).meta == {"left": None}
        assert DEADLINES[1] is None
        assert ch.call("echo", Message({"a": 1}), timeout=30).meta == {"echo": {"a": 1}}  # meta arrives as sent

    def test_a_deadline_the_caller_puts_on_its_request_is_not_sent(self, transport, served):
        """Only ``timeout`` sets a deadline: the handler sees None without one."""
        DEADLINES.clear()
        transport.connect(served.address).call("deadline", Message({}, deadline=time.monotonic() + 5))
        assert DEADLINES == [None]

    def test_unknown_method(self, transport, served):
        with pytest.raises(TransportError, match="nope"):
            transport.connect(served.address).call("nope", Message({}))

    def test_unknown_address(self, transport, served, unreachable):
        with pytest.raises(TransportError):
            transport.connect(unreachable).call("echo", Message({}), timeout=2.0)

    def test_closed_endpoint_stops_serving(self, transport, address):
        endpoint = transport.serve(address, {"echo": echo})
        endpoint.close()
        with pytest.raises(TransportError):
            transport.connect(endpoint.address).call("echo", Message({}), timeout=2.0)

    def test_refuses_says_true_only_once_nothing_serves(self, transport, address):
        """The fast path of failure detection: an endpoint serving is never reported
        gone; one closed (its process dead) is, over TCP because the port refuses."""
        endpoint = transport.serve(address, {"echo": echo})
        assert transport.refuses(endpoint.address) is False
        endpoint.close()
        deadline = time.monotonic() + 10  # a gRPC server's port closes after its grace
        while not transport.refuses(endpoint.address):
            assert time.monotonic() < deadline, f"{endpoint.address} still accepts connections after its endpoint closed"
            time.sleep(0.05)
