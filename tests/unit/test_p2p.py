"""p2p over the in-process transport: mailboxes, the meta cache, refusals, deadlines."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import torch

from pdps.adapters.inproc import InprocTransport
from pdps.core.errors import BadRequest, ConfigError, GradientRejected, MetaError, Timeout, TransportError
from pdps.core.tensormeta import DTYPE_NUMBERS
from pdps.ports.transport import Message
from pdps.runtime.p2p import METHOD, P2P

_names = itertools.count()


class ConcurrentInproc(InprocTransport):
    """The in-process transport declaring overlapping calls: batches send from threads."""

    concurrent = True


@pytest.fixture
def ranks():
    """ranks(n, transport=None, **options) -> [P2P, ...], each reaching the others by ``book``."""
    made: list[P2P] = []
    book: dict[int, str] = {}

    def start(n: int, transport=None, **options) -> list[P2P]:
        transport = transport or InprocTransport()
        out = []
        for r in range(n):
            p = P2P(transport, r, f"inproc://p2p-{next(_names)}", peers=book.__getitem__, **options)
            book[r] = p.address
            out.append(p)
        made.extend(out)
        return out

    start.book = book
    yield start
    for p in made:
        p.close()


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(-1000, 1000, shape, dtype=dtype)


ALL_DTYPES = [getattr(torch, name) for name in DTYPE_NUMBERS]


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=[str(d) for d in ALL_DTYPES])
def test_round_trip_for_every_dtype_without_a_copy(ranks, dtype):
    a, b = ranks(2)
    sent = [sample(dtype, (3, 5)), sample(dtype, ()), sample(dtype, (0, 4)), sample(dtype, (2, 1, 3))]
    a.send(1, "0/0/act", sent)
    got = b.recv(0, "0/0/act", timeout=1)
    assert [(t.dtype, tuple(t.shape)) for t in got] == [(t.dtype, tuple(t.shape)) for t in sent]
    assert all(torch.equal(g, s) for g, s in zip(got, sent))
    # in process the receiver holds views of the sender's memory
    assert [g.data_ptr() for g in got if g.numel()] == [s.data_ptr() for s in sent if s.numel()]
    assert a.stats["bytes_sent"] == b.stats["bytes_received"] == sum(t.numel() * t.element_size() for t in sent)


def test_non_contiguous_tensors_arrive_whole(ranks):
    a, b = ranks(2)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = [base.t(), base[:, ::2], torch.arange(10, dtype=torch.bfloat16)[1::3]]
    a.send(1, "t", sent)
    got = b.recv(0, "t", timeout=1)
    assert all(torch.equal(g, s) and g.is_contiguous() for g, s in zip(got, sent))


def test_gradient_flags_follow_requires_grad_or_stop_gradient(ranks):
    a, b = ranks(2)
    x = torch.randn(2, 3, requires_grad=True)
    act = x * 2
    a.send(1, "act", [act, torch.ones(2), torch.arange(3)])
    got = b.recv(0, "act", timeout=1)
    assert [t.requires_grad for t in got] == [True, False, False]
    (got[0] * 3).sum().backward()  # a stage's input takes its gradient
    assert torch.equal(got[0].grad, torch.full((2, 3), 3.0))
    a.send(1, "forced", [act, torch.ones(2), torch.arange(3)], stop_gradient=[True, False, False])
    assert [t.requires_grad for t in b.recv(0, "forced", timeout=1)] == [False, True, False]  # no gradient into ints
    with pytest.raises(ConfigError, match="2 stop_gradient flags for 1 tensors"):
        a.send(1, "bad", [act], stop_gradient=[True, True])


def test_meta_travels_once_per_peer_and_signature(ranks):
    a, b, c = ranks(3)
    four, two = torch.zeros(4, 8), torch.zeros(2, 8)
    for i, t in enumerate([four, four, two, four, two]):
        a.send(1, f"m{i}", [t])
    assert a.stats["meta_sent"] == 2 and a.stats["messages"] == 5
    a.send(2, "m0", [four])  # another peer: its own first time
    assert a.stats["meta_sent"] == 3
    got = [b.recv(0, f"m{i}", timeout=1)[0] for i in range(5)]
    assert [tuple(t.shape) for t in got] == [(4, 8), (4, 8), (2, 8), (4, 8), (2, 8)]
    a.send(1, "several", [four, two])  # several tensors are one signature
    a.send(1, "several2", [four, two])
    assert a.stats["meta_sent"] == 4


def test_recv_past_its_deadline_names_the_peer_the_tag_and_the_expected_meta(ranks):
    a, b = ranks(2)
    t0 = time.monotonic()
    with pytest.raises(Timeout, match=r"rank 1 waited 0.05 s for '0/0/act' from rank 0: nothing received from it yet"):
        b.recv(0, "0/0/act", timeout=0.05)
    assert 0.05 <= time.monotonic() - t0 < 1.0
    a.send(1, "0/0/act", [torch.zeros(4, 8, requires_grad=True) * 1])
    a.send(1, "0/2/act", [torch.zeros(3)])
    b.recv(0, "0/0/act", timeout=1)
    with pytest.raises(Timeout, match=r"for '0/1/act' from rank 0: expected float32\[3\] \(the meta last received from it\); the mailbox holds its \['0/2/act'\]"):
        b.recv(0, "0/1/act", timeout=0.05)


def test_recv_waits_for_a_send_from_another_thread(ranks):
    a, b = ranks(2)
    timer = threading.Timer(0.05, lambda: a.send(1, "late", [torch.ones(2)]))
    timer.start()
    assert torch.equal(b.recv(0, "late", timeout=5)[0], torch.ones(2))
    timer.join()


def test_check_finite_refuses_before_anything_is_sent(ranks):
    a, b = ranks(2, check_finite=True)
    bad = torch.tensor([1.0, float("nan")])
    with pytest.raises(GradientRejected, match=r"rank 0: tensor 1 \(float32\[2\]\) of p2p message '3/1/grad' to rank 1 holds NaN or Inf"):
        a.send(1, "3/1/grad", [torch.ones(2), bad])
    with pytest.raises(GradientRejected, match="'inf' to rank 1 holds NaN or Inf"):
        a.send(1, "inf", [torch.tensor([float("inf")], dtype=torch.bfloat16)])
    # in a batch, before any of its sends
    with pytest.raises(GradientRejected, match="'second'"):
        a.batch_send_recv([(1, "first", [torch.ones(2)]), (1, "second", [bad])], [])
    assert b.pending() == [] and a.stats["messages"] == 0
    a.send(1, "ints", [torch.arange(3)])  # integers are always finite
    unchecked, peer = ranks(2)  # check_finite off: NaN travels
    unchecked.send(1, "nan", [bad])
    assert torch.isnan(peer.recv(0, "nan", timeout=1)[0][1])


def test_the_same_tag_twice_before_its_receive_is_refused(ranks):
    a, b = ranks(2)
    a.send(1, "0/0/act", [torch.ones(2)])
    with pytest.raises(BadRequest, match=r"p2p message '0/0/act' from rank 0 to rank 1 arrived twice before it was received"):
        a.send(1, "0/0/act", [torch.zeros(2)])
    assert torch.equal(b.recv(0, "0/0/act", timeout=1)[0], torch.ones(2))  # the first one stays
    a.send(1, "0/0/act", [torch.zeros(2)])  # received: the tag is free again
    assert torch.equal(b.recv(0, "0/0/act", timeout=1)[0], torch.zeros(2))


def request(meta: dict, tensors) -> Message:
    base = {"src": 7, "tag": "x", "session": "s1", "meta_id": 0}
    return Message({**base, **meta}, tensors)


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def test_a_byte_count_that_does_not_match_the_meta_is_refused(ranks):
    (b,) = ranks(1)
    channel = InprocTransport().connect(b.address)
    with pytest.raises(MetaError, match=r"tensor 0 of p2p message 'x' from rank 7 to rank 0 has 12 bytes but its meta float32\[4\] takes 16: refused"):
        channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [raw(torch.zeros(3))]))
    with pytest.raises(MetaError, match="has 20 bytes but its meta float32"):
        channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [raw(torch.zeros(5))]))
    with pytest.raises(MetaError, match="carries 2 tensors but its meta 1"):
        channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [raw(torch.zeros(4)), raw(torch.zeros(4))]))
    with pytest.raises(MetaError, match=r"tensor 0 of .* is torch.float32\[4\]: p2p tensors travel as their raw bytes"):
        channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [torch.zeros(4)]))
    with pytest.raises(MetaError, match="is bool but holds bytes other than 0 and 1"):
        channel.call(METHOD, request({"tensor_meta": [0, 1, 2, 6, 1]}, [torch.tensor([1, 2], dtype=torch.uint8)]))
    assert b.pending() == []
    # refused messages taught nothing: id 0 is still unknown
    with pytest.raises(MetaError, match="names meta id 0, which rank 0 does not know"):
        channel.call(METHOD, request({}, [raw(torch.zeros(4))]))
    channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [raw(torch.arange(4.0))]))
    assert torch.equal(b.recv(7, "x", timeout=1)[0], torch.arange(4.0))


def test_an_unknown_meta_id_is_refused_never_guessed(ranks):
    (b,) = ranks(1)
    channel = InprocTransport().connect(b.address)
    channel.call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1]}, [raw(torch.zeros(4))]))
    with pytest.raises(MetaError, match=r"'y' from rank 7 to rank 0 names meta id 1, which rank 0 does not know \(never guessed\)"):
        channel.call(METHOD, request({"tag": "y", "meta_id": 1}, [raw(torch.zeros(4))]))
    with pytest.raises(MetaError, match="names meta id 0"):  # a restarted sender's ids mean nothing yet
        channel.call(METHOD, request({"tag": "y", "session": "s2"}, [raw(torch.zeros(4))]))
    channel.call(METHOD, request({"tag": "y"}, [raw(torch.ones(4))]))  # id 0 of session s1 is known
    assert torch.equal(b.recv(7, "y", timeout=1)[0], torch.ones(4))


@pytest.mark.parametrize(
    "meta, error, message",
    [
        ({"src": -1}, BadRequest, r"field 'src' must be a rank"),
        ({"src": True}, BadRequest, r"field 'src' must be a rank"),
        ({"src": None}, BadRequest, r"field 'src' must be a rank"),
        ({"tag": ""}, BadRequest, r"field 'tag' must be a non-empty string"),
        ({"tag": 3}, BadRequest, r"field 'tag' must be a non-empty string"),
        ({"session": ""}, BadRequest, r"field 'session'"),
        ({"meta_id": "0"}, BadRequest, r"field 'meta_id' must be a whole number"),
        ({"tensor_meta": "0,1,4,1,1"}, MetaError, r"field 'tensor_meta' must be a list of ints, got str"),
        ({"tensor_meta": [0, 1, 4, 9, 1]}, MetaError, r"'x' from rank 7 to rank 0: tensor meta position 3 \(tensor 0's dtype number\) is 9"),
        ({"tensor_meta": [0, 1, 4, 1]}, MetaError, r"tensor meta ends at position 4"),
    ],
)
def test_malformed_requests_are_refused_naming_the_field(ranks, meta, error, message):
    (b,) = ranks(1)
    with pytest.raises(error, match=message):
        InprocTransport().connect(b.address).call(METHOD, request({"tensor_meta": [0, 1, 4, 1, 1], **meta}, [raw(torch.zeros(4))]))
    assert b.pending() == []


def test_a_send_the_codec_cannot_carry_is_refused(ranks):
    a, _ = ranks(2)
    with pytest.raises(MetaError, match=r"tensor 0 of p2p message 'u' to rank 1 is a torch.uint8 tensor: p2p carries tensors of float16, float32"):
        a.send(1, "u", [torch.zeros(2, dtype=torch.uint8)])
    with pytest.raises(MetaError, match="has 0 tensors"):
        a.send(1, "none", [])
    with pytest.raises(MetaError, match="tensor 0 of p2p message 'list' to rank 1 is list"):
        a.send(1, "list", [[1.0]])
    with pytest.raises(ConfigError, match="p2p tag must be a non-empty string"):
        a.send(1, "", [torch.ones(1)])
    with pytest.raises(ConfigError, match="p2p peer must be a rank"):
        a.send(-1, "t", [torch.ones(1)])


@pytest.mark.parametrize("transport", [InprocTransport, ConcurrentInproc], ids=["in-order", "concurrent"])
def test_batch_send_recv_where_each_rank_sends_before_it_receives(ranks, transport):
    """Two ranks each send before they receive (activations one way, gradients the
    other, twice): with mailboxes, neither waits for the other's receive."""
    a, b = ranks(2, transport=transport())
    out: dict[int, list] = {}

    def run(me: P2P, peer: int, value: float) -> None:
        t = torch.full((16,), value)
        out[me.rank] = me.batch_send_recv([(peer, f"{me.rank}/act", [t]), (peer, f"{me.rank}/grad", [t * 2])], [(peer, f"{peer}/act"), (peer, f"{peer}/grad")], timeout=5)

    threads = [threading.Thread(target=run, args=args) for args in ((a, 1, 1.0), (b, 0, 3.0))]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 5
    assert [g[0][0].item() for g in out[0]] == [3.0, 6.0] and [g[0][0].item() for g in out[1]] == [1.0, 2.0]


def test_a_concurrent_batch_that_races_its_first_meta_recovers(ranks):
    """Concurrent sends of one new signature: one carries the meta, the others only its
    id, and may arrive first; the receiver refuses those and they send the meta again."""
    a, b = ranks(2, transport=ConcurrentInproc())
    sends = [(1, f"m{i}", [torch.full((4,), float(i))]) for i in range(8)]
    a.batch_send_recv(sends, [])
    assert [b.recv(0, f"m{i}", timeout=1)[0][0].item() for i in range(8)] == [float(i) for i in range(8)]
    assert a.stats["meta_sent"] == 1 + a.stats["meta_resent"]


def test_a_restarted_receiver_gets_the_meta_again(ranks):
    a, b = ranks(2)
    a.send(1, "one", [torch.ones(3)])
    b.recv(0, "one", timeout=1)
    b.close()
    # at a new address: the failed call resolves rank 1 again and sends there, meta included
    (b2,) = ranks(1)
    ranks.book[1] = b2.address
    a.send(1, "two", [torch.ones(3)])
    assert torch.equal(b2.recv(0, "two", timeout=1)[0], torch.ones(3))
    assert a.stats["meta_sent"] == 2
    # at the same address: the receiver does not know the id, the sender sends the meta again
    b2.close()
    b3 = P2P(InprocTransport(), 1, b2.address, peers=ranks.book.__getitem__)
    try:
        a.send(1, "three", [torch.ones(3)])
        assert torch.equal(b3.recv(0, "three", timeout=1)[0], torch.ones(3))
        assert a.stats["meta_resent"] == 1 and a.stats["meta_sent"] == 3
    finally:
        b3.close()


def test_a_peer_gone_for_good_raises_the_transport_error(ranks):
    a, b = ranks(2)
    b.close()
    with pytest.raises(TransportError, match="nothing is served at"):
        a.send(1, "t", [torch.ones(1)])
    assert a.stats["messages"] == 0


def test_close_ends_a_waiting_receive(ranks):
    (a,) = ranks(1)
    threading.Timer(0.05, a.close).start()
    with pytest.raises(TransportError, match="closed while waiting for 't' from rank 3"):
        a.recv(3, "t", timeout=5)


def test_sending_to_itself(ranks):
    (a,) = ranks(1)
    a.send(0, "loop", [torch.arange(3)])
    assert torch.equal(a.recv(0, "loop", timeout=1)[0], torch.arange(3))
