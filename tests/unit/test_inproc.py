from __future__ import annotations

import itertools

import pytest
import torch

from pdps.adapters.inproc import InprocTransport
from pdps.core.errors import TransportError
from pdps.ports.transport import ChannelStats, ConcurrentCalls, Message
from tests.unit.contract_transport import TransportContract

_names = itertools.count()


class TestInproc(TransportContract):
    @pytest.fixture
    def transport(self):
        return InprocTransport()

    @pytest.fixture
    def address(self):
        return f"inproc://contract-{next(_names)}"

    @pytest.fixture
    def unreachable(self):
        return "inproc://nobody-serves-this"


def test_no_copies_either_way():
    """The handler sees the caller's storage and the caller sees the handler's."""
    state = torch.arange(6, dtype=torch.float32)
    seen = []

    def handler(req: Message) -> Message:
        seen.append(req.tensors[0].data_ptr())
        return Message({}, [state[2:4]])

    def owned(req: Message) -> Message:
        return Message({"owned": req.owned})

    t = InprocTransport()
    ep = t.serve("inproc://", {"h": handler, "owned": owned})
    sent = torch.ones(1024)
    reply = t.connect(ep.address).call("h", Message({}, [sent]))
    assert seen == [sent.data_ptr()]
    # the caller's own tensors: borrowed, never given away
    assert t.connect(ep.address).call("owned", Message({}, [sent])).meta == {"owned": False}
    assert reply.tensors[0].data_ptr() == state[2:].data_ptr()
    ep.close()


def test_auto_names_are_unique_and_duplicates_refused():
    t = InprocTransport()
    a, b = t.serve("inproc://", {}), t.serve("inproc://", {})
    assert a.address != b.address
    with pytest.raises(TransportError, match="already served"):
        t.serve(a.address, {})
    a.close(), b.close()


def test_bad_address():
    with pytest.raises(TransportError, match="inproc://name"):
        InprocTransport().connect("grpc://x:1").call("m", Message({}))


def test_channel_stats_count_calls_and_bytes_but_no_serialize_time():
    def handler(req: Message) -> Message:
        return Message({}, [torch.zeros(3, dtype=torch.float64)])

    t = InprocTransport()
    ep = t.serve("inproc://", {"h": handler})
    channel = t.connect(ep.address)
    assert channel.stats == {"serialize": 0.0, "calls": 0.0, "bytes_sent": 0.0, "bytes_received": 0.0}
    for _ in range(2):
        channel.call("h", Message({}, [torch.ones(1024), torch.ones(2, dtype=torch.int16)]))
    with pytest.raises(TransportError):
        channel.call("nope", Message({}))
    assert channel.stats == {"serialize": 0.0, "calls": 3.0, "bytes_sent": 2 * 4100.0, "bytes_received": 2 * 24.0}
    ep.close()


def test_optional_capabilities_are_checked_with_isinstance():
    """Channels count (``stats``); calls run in the caller's thread, so the transport
    does not declare concurrent calls."""
    t = InprocTransport()
    ep = t.serve("inproc://", {})
    assert isinstance(t.connect(ep.address), ChannelStats)
    assert not isinstance(t, ConcurrentCalls)
    ep.close()
