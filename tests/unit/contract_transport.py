"""The transport contract. Every adapter's test class inherits it.

A subclass supplies ``transport`` (the adapter) and ``address`` (a fresh address to
serve at: ``inproc://`` or ``grpc://127.0.0.1:0``).
"""

from __future__ import annotations

import pytest
import torch

from pdps.core.errors import GradientRejected, TransportError
from pdps.ports.transport import Message


def echo(req: Message) -> Message:
    return Message({"echo": dict(req.meta)}, [t.clone() for t in req.tensors])


def total(req: Message) -> Message:
    return Message({"sum": float(sum(t.sum().item() for t in req.tensors))})


def reject(req: Message) -> Message:
    raise GradientRejected(f"gradient for w from trainer {req.meta.get('trainer')!r} holds NaN")


class TransportContract:
    @pytest.fixture
    def served(self, transport, address):
        endpoint = transport.serve(address, {"echo": echo, "total": total, "reject": reject})
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

    def test_call_without_tensors(self, transport, served):
        reply = transport.connect(served.address).call("total", Message({}))
        assert reply.meta == {"sum": 0.0} and list(reply.tensors) == []

    def test_handler_error_arrives_as_same_class_and_message(self, transport, served):
        ch = transport.connect(served.address)
        with pytest.raises(GradientRejected, match="trainer 't7' holds NaN"):
            ch.call("reject", Message({"trainer": "t7"}))
        assert ch.call("total", Message({}, [torch.ones(3)])).meta["sum"] == 3.0  # still serving

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
