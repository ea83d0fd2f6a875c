"""p2p between pipeline stages over any transport: mailboxes, send, recv, batch send/recv.

Each process of a pipeline serves one method, ``p2p``, on an endpoint of its own (any
transport: ``inproc://``, ``grpc://``). Rules of this module:

* A send is a call to the receiver's ``p2p`` method, which puts the message in the
  receiver's mailbox and returns: a send never waits for its receive, so no order of
  sends and receives deadlocks (no even/odd ordering as Paddle's and Megatron's
  rendezvous sends need). ``recv`` waits on the mailbox until its deadline.
* A message is ``(src, tag)``: the tag names one message (``f"{step}/{mb}/act"``), so
  the same ``(src, tag)`` arriving again before it was received is refused.
* Wire (docs/transport.md, "p2p"): meta ``src``, ``tag``, ``session`` (the sender's
  incarnation), ``meta_id`` and, the first time a (peer, signature) pair travels,
  ``tensor_meta``: :mod:`pdps.core.tensormeta`'s vector. The tensors are each tensor's
  raw bytes (``uint8`` views: no copy in process; the gRPC adapter's tensor frames, its
  bulk channel for large ones, over the wire). The receiver rebuilds each tensor as a
  view of those bytes by the cached meta; a byte count that does not match, or an id it
  does not know, is a :class:`~pdps.core.errors.MetaError`: nothing is cut or guessed.
  A sender whose id was not known sends the meta again (the receiver restarted, or two
  concurrent sends raced their first meta).
* A send hands its tensors over: in process the receiver holds views of the very
  memory, so the sender must not write them afterwards.
* ``check_finite``: a floating tensor holding NaN or Inf is refused
  (:class:`~pdps.core.errors.GradientRejected`) before anything is sent (Paddle's
  ``FLAGS_pp_check_naninf``); in a batch, before any of its sends.
* A failed call drops the peer's channel and re-resolves its address (``peers``): a
  restarted peer has a new one, and the send goes there once, its meta sent again.

This module imports no torch: it works the tensors it is given through their own
methods and their own library (``torch`` for a ``torch.Tensor``).
"""

from __future__ import annotations

import logging
import secrets
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdps.core.errors import BadRequest, ConfigError, GradientRejected, MetaError, Timeout, TransportError
from pdps.core.tensormeta import (
    DTYPE_NAMES,
    DTYPE_NUMBERS,
    DTYPE_SIZES,
    FLOATING,
    MAX_TENSORS,
    MetaCache,
    ReceivedMetas,
    TensorMeta,
    decode_meta,
    describe,
    encode_meta,
    signature,
)
from pdps.ports.link import Link
from pdps.ports.transport import Channel, ConcurrentCalls, Message, Transport

log = logging.getLogger(__name__)

METHOD = "p2p"
#: Longest tag, in characters.
MAX_TAG = 256
#: Threads sending a batch's messages at once (transports with ConcurrentCalls).
SEND_THREADS = 8

Tensor = Any  # a torch.Tensor: this module does not import torch

__all__ = ["METHOD", "P2P", "Link"]


class _Outgoing:
    """One message ready to go: its metas and each tensor's raw bytes."""

    __slots__ = ("peer", "tag", "metas", "raws", "nbytes")

    def __init__(self, peer: int, tag: str, metas: tuple[TensorMeta, ...], raws: list[Tensor]) -> None:
        self.peer, self.tag, self.metas, self.raws = peer, tag, metas, raws
        self.nbytes = sum(m.nbytes for m in metas)


class P2P:
    """A process's p2p: its ``p2p`` endpoint (at ``address``, which the transport may
    complete: a port 0 or an empty inproc name) and its channels to the other ranks.

    ``peers(rank)`` gives the address a rank serves at (asked again after a failed
    call); ``timeout`` (seconds) bounds each send's call and, by default, each receive.

    ``stats`` (cumulative floats): ``bytes_sent`` / ``bytes_received`` (tensor bytes),
    ``messages`` (sent), ``messages_received``, ``meta_sent`` (messages that carried
    their tensor meta), ``meta_resent`` (of those, sent again after the receiver did
    not know the id).
    """

    def __init__(
        self,
        transport: Transport,
        rank: int,
        address: str,
        *,
        peers: Callable[[int], str],
        check_finite: bool = False,
        timeout: float = 60.0,
    ) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ConfigError(f"p2p rank must be a whole number >= 0, got {rank!r}")
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0):
            raise ConfigError(f"p2p timeout must be a positive number of seconds, got {timeout!r}")
        self.rank = rank
        self.check_finite = check_finite
        self._transport = transport
        self._peers = peers
        self._timeout = float(timeout)
        self._session = secrets.token_hex(8)  # this incarnation: a restart's meta ids start over
        self._lock = threading.Lock()  # the sending side: cache, channels, stats
        self._cond = threading.Condition()  # the receiving side: mailbox, received metas
        self._cache = MetaCache()
        self._received = ReceivedMetas()
        self._channels: dict[int, tuple[str, Channel]] = {}
        self._mailbox: dict[tuple[int, str], list[Tensor]] = {}
        self._last_meta: dict[int, tuple[TensorMeta, ...]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._concurrent = isinstance(transport, ConcurrentCalls) and bool(transport.concurrent)
        self.stats: dict[str, float] = {
            "bytes_sent": 0.0,
            "bytes_received": 0.0,
            "messages": 0.0,
            "messages_received": 0.0,
            "meta_sent": 0.0,
            "meta_resent": 0.0,
        }
        self._endpoint = transport.serve(address, {METHOD: self._handle})
        self.address: str = self._endpoint.address

    # --- sending ------------------------------------------------------------------------

    def send(self, peer: int, tag: str, tensors: Sequence[Tensor], *, stop_gradient: Sequence[bool] | None = None) -> None:
        """Deliver ``tensors`` to ``peer``'s mailbox under ``tag``. ``stop_gradient`` per
        tensor (default: those that do not require grad); the receiver's floating
        tensors that do not stop the gradient require grad."""
        out = self._prepare(peer, tag, tensors, stop_gradient)
        self._check_finite([out])
        self._deliver(out)

    def batch_send_recv(
        self, sends: Sequence[tuple[int, str, Sequence[Tensor]]], recvs: Sequence[tuple[int, str]], *, timeout: float | None = None
    ) -> list[list[Tensor]]:
        """Every send (at once over a transport whose calls overlap, else in order), then
        every receive, each within ``timeout``. No send waits for a receive, so two ranks
        that each send before they receive do not deadlock."""
        outs = [self._prepare(peer, tag, tensors, None) for peer, tag, tensors in sends]
        self._check_finite(outs)
        if self._concurrent and len(outs) > 1:
            futures = [self._sender().submit(self._deliver, out) for out in outs]
            errors = [f.exception() for f in futures]
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        else:
            for out in outs:
                self._deliver(out)
        return [self.recv(peer, tag, timeout=timeout) for peer, tag in recvs]

    def _prepare(self, peer: int, tag: str, tensors: Sequence[Tensor], stop_gradient: Sequence[bool] | None) -> _Outgoing:
        if isinstance(peer, bool) or not isinstance(peer, int) or peer < 0:
            raise ConfigError(f"p2p peer must be a rank (a whole number >= 0), got {peer!r}")
        _check_tag(tag)
        tensors = list(tensors)
        if not 1 <= len(tensors) <= MAX_TENSORS:
            raise MetaError(f"p2p message {tag!r} to rank {peer} has {len(tensors)} tensors: a message carries 1 to {MAX_TENSORS}")
        if stop_gradient is not None:
            stop_gradient = list(stop_gradient)
            if len(stop_gradient) != len(tensors):
                raise ConfigError(f"p2p message {tag!r}: {len(stop_gradient)} stop_gradient flags for {len(tensors)} tensors")
        metas, raws = [], []
        for i, t in enumerate(tensors):
            dtype = DTYPE_NUMBERS.get(str(getattr(t, "dtype", "")).removeprefix("torch."))
            if dtype is None or not hasattr(t, "detach"):
                what = f"a {t.dtype} tensor" if hasattr(t, "dtype") else type(t).__name__
                raise MetaError(f"tensor {i} of p2p message {tag!r} to rank {peer} is {what}: p2p carries tensors of {', '.join(DTYPE_NUMBERS)}")
            stop = (not t.requires_grad) if stop_gradient is None else bool(stop_gradient[i])
            if dtype not in FLOATING:
                stop = True  # no gradient flows into integers or booleans
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            metas.append(TensorMeta(tuple(t.shape), dtype, stop))
            raws.append(t.reshape(-1).view(_library(t).uint8))
        return _Outgoing(peer, tag, tuple(metas), raws)

    def _check_finite(self, outs: Sequence[_Outgoing]) -> None:
        if not self.check_finite:
            return
        for out in outs:
            for i, (m, raw) in enumerate(zip(out.metas, out.raws)):
                if m.dtype in FLOATING and m.numel and not bool(_rebuild(raw, m).isfinite().all()):
                    raise GradientRejected(
                        f"rank {self.rank}: tensor {i} ({m}) of p2p message {out.tag!r} to rank {out.peer} holds NaN or Inf;"
                        " nothing was sent (check_finite)"
                    )

    def _deliver(self, out: _Outgoing) -> None:
        """One call to the peer's ``p2p``: the meta once per (peer, signature); again after
        the receiver did not know its id; to the peer's new address after a failed call."""
        sig = signature(out.metas)
        with self._lock:
            ident, is_new = self._cache.ident(out.peer, sig)
        try:
            self._call(out, ident, is_new)
        except MetaError:
            if is_new:
                raise
            with self._lock:
                self._cache.forget_id(out.peer, ident)
                ident, _ = self._cache.ident(out.peer, sig)
                self.stats["meta_resent"] += 1
            self._call(out, ident, True)
        with self._lock:
            self.stats["messages"] += 1
            self.stats["bytes_sent"] += out.nbytes

    def _call(self, out: _Outgoing, ident: int, with_meta: bool) -> None:
        meta: dict[str, Any] = {"src": self.rank, "tag": out.tag, "session": self._session, "meta_id": ident}
        if with_meta:
            meta["tensor_meta"] = encode_meta(out.metas)
        address, channel = self._channel(out.peer)
        try:
            channel.call(METHOD, Message(meta, out.raws), timeout=self._timeout)
        except TransportError as exc:
            again = self._reresolve(out.peer, address)
            if again is None:
                raise
            log.info("p2p: rank %d moved from %s to %s (%s); sending %r there", out.peer, address, again, exc, out.tag)
            with self._lock:
                ident, _ = self._cache.ident(out.peer, signature(out.metas))  # the new process knows no meta
            meta.update(meta_id=ident, tensor_meta=encode_meta(out.metas))
            with_meta = True
            _, channel = self._channel(out.peer, again)
            channel.call(METHOD, Message(meta, out.raws), timeout=self._timeout)
        if with_meta:
            with self._lock:
                self.stats["meta_sent"] += 1

    def _channel(self, peer: int, address: str | None = None) -> tuple[str, Channel]:
        """The channel to ``peer``: the one held, else a new one to ``address`` or, without
        it, to where ``peers`` says (asked outside the lock: it may read a store)."""
        with self._lock:
            held = self._channels.get(peer)
            if held is not None and (address is None or held[0] == address):
                return held
        if address is None:
            address = self._peers(peer)
        channel = self._transport.connect(address)
        with self._lock:
            held = self._channels.get(peer)
            if self._closed or (held is not None and held[0] == address):
                channel.close()
                if self._closed:
                    raise TransportError(f"p2p of rank {self.rank} is closed")
                return held  # type: ignore[return-value]
            if held is not None:
                held[1].close()  # the peer moved
            self._channels[peer] = (address, channel)
            return address, channel

    def _reresolve(self, peer: int, failed: str) -> str | None:
        """After a failed call to ``failed``: drop that channel; the peer's new address, if it moved."""
        with self._lock:
            held = self._channels.get(peer)
            if held is not None and held[0] == failed:
                del self._channels[peer]
                held[1].close()
            self._cache.forget(peer)  # whoever serves there next knows none of our metas
        try:
            address = self._peers(peer)
        except Exception as exc:  # the directory's own failure: the call's error is the one to raise
            log.warning("p2p: cannot resolve rank %d again: %s", peer, exc)
            return None
        return address if address != failed else None

    def _sender(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix=f"pdps-p2p-{self.rank}")
            return self._pool

    # --- receiving ----------------------------------------------------------------------

    def recv(self, peer: int, tag: str, *, timeout: float | None = None) -> list[Tensor]:
        """The tensors ``peer`` sent under ``tag``, waiting for them up to ``timeout``
        seconds (default: the P2P's); Timeout past it names the peer, the tag and the
        meta last received from that peer."""
        wait = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        key = (peer, tag)
        with self._cond:
            while key not in self._mailbox:
                if self._closed:
                    raise TransportError(f"p2p of rank {self.rank} closed while waiting for {tag!r} from rank {peer}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Timeout(self._waited(peer, tag, wait))
                self._cond.wait(left)
            return self._mailbox.pop(key)

    def _waited(self, peer: int, tag: str, wait: float) -> str:
        last = self._last_meta.get(peer)
        expected = f"expected {describe(last)} (the meta last received from it)" if last else "nothing received from it yet"
        held = sorted(t for src, t in self._mailbox if src == peer)
        holding = f"; the mailbox holds its {held[:8]!r}" if held else ""
        return f"rank {self.rank} waited {wait:g} s for {tag!r} from rank {peer}: {expected}{holding}"

    def _handle(self, request: Message) -> Message:
        """The ``p2p`` method: check the message whole, then put it in the mailbox."""
        src, tag, session, ident, vector = _header(request.meta)
        who = f"p2p message {tag!r} from rank {src} to rank {self.rank}"
        metas = None
        if vector is not None:
            try:
                metas, _ = decode_meta(vector)
            except MetaError as exc:
                raise MetaError(f"{who}: {exc}", field="tensor_meta") from exc
        else:
            with self._cond:
                metas = self._received.get(src, session, ident)
            if metas is None:
                raise MetaError(f"{who} names meta id {ident}, which rank {self.rank} does not know (never guessed): the sender sends its meta again")
        raws = list(request.tensors)
        if len(raws) != len(metas):
            raise MetaError(f"{who} carries {len(raws)} tensors but its meta {len(metas)}: {describe(metas)}")
        tensors = [_check_raw(raw, m, i, who) for i, (raw, m) in enumerate(zip(raws, metas))]
        with self._cond:
            if vector is not None:
                self._received.learn(src, session, ident, metas)
            key = (src, tag)
            if key in self._mailbox:
                raise BadRequest(f"{who} arrived twice before it was received: a tag names one message (step/microbatch/direction)", field="tag")
            self._mailbox[key] = tensors
            self._last_meta[src] = metas
            self.stats["messages_received"] += 1
            self.stats["bytes_received"] += sum(m.nbytes for m in metas)
            self._cond.notify_all()
        return Message({})

    def pending(self) -> list[tuple[int, str]]:
        """The ``(src, tag)`` of messages delivered and not received yet."""
        with self._cond:
            return sorted(self._mailbox)

    def close(self) -> None:
        """Stop serving, close the channels; receives waiting now raise TransportError."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._endpoint.close()
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
            pool, self._pool = self._pool, None
        for _, channel in channels:
            channel.close()
        if pool is not None:
            pool.shutdown(wait=False)

    def __enter__(self) -> P2P:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_tag(tag: Any) -> None:
    if not isinstance(tag, str) or not tag or len(tag) > MAX_TAG:
        raise ConfigError(f"p2p tag must be a non-empty string of at most {MAX_TAG} characters, got {tag!r:.80}")


def _header(meta: Mapping[str, Any]) -> tuple[int, str, str, int, list[int] | None]:
    """``(src, tag, session, meta_id, tensor_meta or None)`` of a request, each checked."""

    def field(key: str, ok: Callable[[Any], bool], what: str) -> Any:
        value = meta.get(key)
        if value is None or not ok(value):
            raise BadRequest(f"p2p request field {key!r} must be {what}, got {value!r:.80}", field=key)
        return value

    def count(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    src = field("src", count, "a rank (a whole number >= 0)")
    tag = field("tag", lambda v: isinstance(v, str) and 0 < len(v) <= MAX_TAG, f"a non-empty string of at most {MAX_TAG} characters")
    session = field("session", lambda v: isinstance(v, str) and 0 < len(v) <= 64, "the sender's session (a non-empty string)")
    ident = field("meta_id", count, "a whole number >= 0")
    vector = meta.get("tensor_meta")
    if vector is not None and not isinstance(vector, list):
        raise MetaError(f"p2p request field 'tensor_meta' must be a list of ints, got {type(vector).__name__}", field="tensor_meta")
    return src, tag, session, ident, vector


def _library(t: Tensor) -> Any:
    """The library of tensor ``t`` (``torch``), where its dtypes live."""
    return sys.modules[type(t).__module__.partition(".")[0]]


def _rebuild(raw: Tensor, meta: TensorMeta) -> Tensor:
    """``raw`` (bytes, uint8) seen as the tensor ``meta`` describes: a view, no copy."""
    if raw.storage_offset() % DTYPE_SIZES[meta.dtype]:
        raw = raw.clone()  # misaligned for the dtype (a hand-made request): the one copy
    return raw.view(getattr(_library(raw), DTYPE_NAMES[meta.dtype])).reshape(meta.shape)


def _check_raw(raw: Tensor, meta: TensorMeta, i: int, who: str) -> Tensor:
    """Tensor ``i`` of a message rebuilt from its bytes, refusing any mismatch."""
    if str(getattr(raw, "dtype", "")) != "torch.uint8" or raw.dim() != 1:
        what = f"{raw.dtype}{list(raw.shape)}" if hasattr(raw, "dtype") else type(raw).__name__
        raise MetaError(f"tensor {i} of {who} is {what}: p2p tensors travel as their raw bytes (1-D uint8)")
    n = int(raw.numel())
    if n != meta.nbytes:
        raise MetaError(f"tensor {i} of {who} has {n} bytes but its meta {meta} takes {meta.nbytes}: refused (never cut or padded)")
    if meta.dtype == DTYPE_NUMBERS["bool"] and n and int(raw.max()) > 1:
        raise MetaError(f"tensor {i} of {who} is bool but holds bytes other than 0 and 1")
    t = _rebuild(raw, meta)
    if not meta.stop_gradient and meta.dtype in FLOATING:
        t.requires_grad_(True)
    return t
