"""p2p over real gRPC on 127.0.0.1: two (or three) P2P objects in one process, each
serving its own ``grpc://`` endpoint; tensors as the transport's raw-byte frames, a
large one over the bulk channel, refusals rebuilt as the same classes on the caller."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from pdps.adapters.grpc_transport import GrpcTransport
from pdps.core.errors import BadRequest, GradientRejected, MetaError, Timeout
from pdps.core.tensormeta import DTYPE_NUMBERS
from pdps.ports.transport import Message
from pdps.runtime.p2p import METHOD, P2P

pytestmark = pytest.mark.integration

LOCAL = "grpc://127.0.0.1:0"
ALL_DTYPES = [getattr(torch, name) for name in DTYPE_NUMBERS]


@pytest.fixture
def ranks():
    """ranks(n, **options) -> [P2P, ...] over one GrpcTransport, reaching each other by ``book``."""
    made: list[P2P] = []
    book: dict[int, str] = {}
    transport = GrpcTransport(connect_timeout=1.0)  # a call to a port nobody serves gives up after 1 s (default 10)

    def start(n: int, **options) -> list[P2P]:
        out = []
        for r in range(len(book), len(book) + n):
            p = P2P(transport, r, LOCAL, peers=book.__getitem__, **options)
            book[r] = p.address
            out.append(p)
        made.extend(out)
        return out

    start.book = book
    start.transport = transport
    yield start
    for p in made:
        p.close()


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-1000, 1000, shape, dtype=dtype)


def test_every_dtype_and_several_tensors_round_trip(ranks):
    a, b = ranks(2)
    assert a.address.startswith("grpc://127.0.0.1:") and a.address != b.address
    for i, dtype in enumerate(ALL_DTYPES):
        sent = [sample(dtype, (3, 5)), sample(dtype, ()), sample(dtype, (0, 4)), sample(dtype, (6, 8)).t()]
        a.send(1, f"0/{i}/act", sent)
        got = b.recv(0, f"0/{i}/act", timeout=10)
        assert [(t.dtype, tuple(t.shape)) for t in got] == [(t.dtype, tuple(t.shape)) for t in sent]
        assert all(torch.equal(g, s) for g, s in zip(got, sent))
        assert got[0]._base is not None  # a view of the transport's receive buffer, not a copy
    assert a.stats["meta_sent"] == len(ALL_DTYPES) and b.stats["messages_received"] == len(ALL_DTYPES)
    x = torch.randn(4, 8, requires_grad=True)
    a.send(1, "grad-flag", [x * 2, torch.arange(4)])
    act, ids = b.recv(0, "grad-flag", timeout=10)
    assert act.requires_grad and not ids.requires_grad


def test_meta_once_then_only_its_id(ranks):
    a, b = ranks(2)
    for i in range(4):
        a.send(1, f"{i}/0/act", [torch.full((2, 8), float(i))])
    a.send(1, "last", [torch.zeros(1, 8)])  # a smaller last microbatch: a new signature
    assert a.stats["meta_sent"] == 2 and a.stats["messages"] == 5
    assert [b.recv(0, f"{i}/0/act", timeout=10)[0][0, 0].item() for i in range(4)] == [0.0, 1.0, 2.0, 3.0]


def test_refusals_reach_the_grpc_caller_as_the_same_class(ranks):
    (b,) = ranks(1)
    channel = ranks.transport.connect(b.address)
    base = {"src": 5, "tag": "x", "session": "s", "meta_id": 0}
    short = torch.zeros(3).view(torch.uint8)
    with pytest.raises(MetaError, match=r"tensor 0 of p2p message 'x' from rank 5 to rank 0 has 12 bytes but its meta float32\[4\] takes 16"):
        channel.call(METHOD, Message({**base, "tensor_meta": [0, 1, 4, 1, 1]}, [short]), timeout=10)
    with pytest.raises(MetaError, match="names meta id 0, which rank 0 does not know"):
        channel.call(METHOD, Message(base, [short]), timeout=10)
    with pytest.raises(MetaError, match=r"tensor meta position 0 \(type\) is 3"):
        channel.call(METHOD, Message({**base, "tensor_meta": [3]}, [short]), timeout=10)
    a, c = ranks(2)  # ranks 1 and 2
    a.send(0, "dup", [torch.ones(2)])
    with pytest.raises(BadRequest, match="'dup' from rank 1 to rank 0 arrived twice before it was received"):
        a.send(0, "dup", [torch.ones(2)])
    assert b.pending() == [(1, "dup")]


def test_check_finite_and_deadlines(ranks):
    a, b = ranks(2, check_finite=True)
    with pytest.raises(GradientRejected, match="rank 0: tensor 0 .* of p2p message '1/0/grad' to rank 1 holds NaN or Inf; nothing was sent"):
        a.send(1, "1/0/grad", [torch.tensor([float("nan")])])
    a.send(1, "1/0/act", [torch.zeros(2, 3)])
    b.recv(0, "1/0/act", timeout=10)
    with pytest.raises(Timeout, match=r"rank 1 waited 0.1 s for '1/1/act' from rank 0: expected float32\[2, 3\]"):
        b.recv(0, "1/1/act", timeout=0.1)


def test_batch_send_recv_both_ways_at_once(ranks):
    a, b = ranks(2)
    out: dict[int, list] = {}

    def run(me: P2P, peer: int) -> None:
        sends = [(peer, f"{me.rank}/{mb}", [torch.full((1024,), float(me.rank * 10 + mb))]) for mb in range(4)]
        out[me.rank] = me.batch_send_recv(sends, [(peer, f"{peer}/{mb}") for mb in range(4)], timeout=20)

    threads = [threading.Thread(target=run, args=(me, peer)) for me, peer in ((a, 1), (b, 0))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "batch_send_recv deadlocked"
    assert time.monotonic() - t0 < 30
    assert [g[0][0].item() for g in out[0]] == [10.0, 11.0, 12.0, 13.0]
    assert [g[0][0].item() for g in out[1]] == [0.0, 1.0, 2.0, 3.0]


def test_a_64_mib_tensor_takes_the_bulk_channel(ranks):
    a, b = ranks(2, timeout=120)
    a.send(1, "hello", [torch.ones(1)])  # over gRPC: teaches the channel the bulk port
    big = torch.randn(16 << 20)  # 64 MiB of float32
    a.send(1, "big", [big, torch.arange(5)])
    got, small = b.recv(0, "big", timeout=120)
    assert torch.equal(got, big) and torch.equal(small, torch.arange(5))
    assert b._endpoint.bulk_calls == 1 and b._endpoint.grpc_calls == 1
    assert a.stats["bytes_sent"] == 4 + big.numel() * 4 + 5 * 8


def test_a_restarted_peer_is_found_at_its_new_address(ranks):
    a, b = ranks(2)
    a.send(1, "one", [torch.ones(3)])
    b.recv(0, "one", timeout=10)
    b.close()
    b2 = P2P(ranks.transport, 1, LOCAL, peers=ranks.book.__getitem__)
    try:
        ranks.book[1] = b2.address
        t0 = time.monotonic()
        a.send(1, "two", [torch.ones(3)])  # fails at the old port, resolves rank 1 again, meta and all
        assert time.monotonic() - t0 < 5  # connect_timeout, then the new address
        assert torch.equal(b2.recv(0, "two", timeout=10)[0], torch.ones(3))
        assert a.stats["meta_sent"] == 2
    finally:
        b2.close()
