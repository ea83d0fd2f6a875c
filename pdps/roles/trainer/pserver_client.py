"""The trainer's side of the pservers: where each one serves (``ps/<i>``), and calls
that wait out a pserver that is unreachable or not ready, with backoff."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from pdps.core.backoff import Backoff
from pdps.core.errors import ConfigError, CorruptRecord, EpochChanged, NotInitialized, NotReady, PdpsError, SlotMapChanged, StalePush, StoreError, Timeout, TransportError, Unauthenticated
from pdps.core.job import JobConfig, Keys, decode_as
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap
from pdps.core.wire import Request
from pdps.ports.coordination import CoordinationStore
from pdps.ports.transport import Channel, ConcurrentCalls, Message, Transport
from pdps.roles import calls
from pdps.roles.trainer.discovery import DISCOVERY_TIMEOUT, WAIT_LOG_EVERY, Waits, wait_for_key
from pdps.runtime.retry import Retry

log = logging.getLogger(__name__)

#: Pauses between tries of a pserver that is unreachable or not ready.
UNREACHABLE_BACKOFF = Backoff(first=0.02, longest=0.5)


@attrs.define
class Part:
    """One pserver as a trainer sees it: its channel and the blocks it is the primary
    of (pushed to it, pulled from it); ``held``: every block it holds a copy of (its
    initial values), ``blocks`` unless the job keeps replicas."""

    index: int
    channel: Channel
    blocks: list[Block]
    address: str = ""
    held: list[Block] = attrs.field(factory=list)
    keys: list[str] = attrs.field(init=False)
    round_no: int = 0
    version: int = 0
    incarnation: str | None = None
    slots: tuple[int, ...] = ()  # the slots of its blocks

    def __attrs_post_init__(self) -> None:
        self.keys = [b.key for b in self.blocks]
        self.held = self.held if self.held or not self.blocks else self.blocks


class PserverGroup:
    """The pservers of a job, for pushing to and pulling from (trainers and tools).

    A pserver that cannot be reached (it died; it is restarting elsewhere) or is not
    ready (it is loading a checkpoint) is retried with backoff for up to ``patience``
    seconds, looking its address up again in ``ps/<i>`` each time, and the wait is
    logged and recorded (:class:`Waits`) once it lasts more than a few seconds.
    """

    def __init__(
        self,
        store: CoordinationStore,
        transport: Transport,
        config: JobConfig,
        specs: Sequence[ParamSpec],
        *,
        waits: Waits | None = None,
        patience: float = DISCOVERY_TIMEOUT,
        tables: bool = False,
    ) -> None:
        keys = Keys(config.name)
        #: the model has sparse tables: rows hash into every slot, so every pserver that
        #: is the primary of a slot is a part, whether it holds a block or not
        self._tables = tables
        self._store, self._transport, self._keys = store, transport, keys
        self._waits = waits
        self.patience = patience
        self._specs, self._min_block = list(specs), config.min_block
        #: the parameters this trainer pushes and pulls (a pipeline stage's: see
        #: :meth:`restrict`); None: every parameter of the model
        self.only: frozenset[str] | None = None
        slot_map = decode_as(wait_for_key(store, keys.slotmap, "the job's slot map"), keys.slotmap, SlotMap.from_json)
        self.parts: list[Part] = []
        self.backups_only: list[Part] = []  # replicas: pservers that hold backup copies only
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._use(slot_map)

    def _use(self, slot_map: SlotMap) -> None:
        """Address the pservers ``slot_map`` names, keeping the channels (and what each
        pserver last said) of those addressed already."""
        layout = Layout.build(self._specs, slot_map, self._min_block)
        old = {p.index: p for p in self.parts + self.backups_only}
        round_no = max((p.round_no for p in self.parts), default=0)
        parts: list[Part] = []
        backups_only: list[Part] = []
        slot_of = {b.key: s for b, s in zip(layout.blocks, layout.slots)}
        for i in range(slot_map.num_pservers):
            blocks = layout.blocks_of(i)
            if self.only is not None:
                blocks = [b for b in blocks if b.param in self.only]
            if not blocks and self._tables and i in slot_map.owners:
                prev = old.pop(i, None)
                addr = prev.address if prev is not None else self._address_of(i, wait=True)
                assert addr is not None
                slots = tuple(s for s, o in enumerate(slot_map.owners) if o == i)
                channel = prev.channel if prev is not None else self._transport.connect(addr)
                keep = {} if prev is None else {"round_no": prev.round_no, "version": prev.version, "incarnation": prev.incarnation}
                parts.append(Part(i, channel, [], addr, layout.blocks_held(i), slots=slots, **({"round_no": round_no} | keep)))
                continue
            if not blocks:
                held = layout.blocks_held(i)
                if held:  # replicas: it holds backup copies only, and is called only to give them their initial values
                    prev = old.pop(i, None)
                    addr = prev.address if prev is not None else self._address_of(i, wait=True)
                    assert addr is not None
                    backups_only.append(Part(i, prev.channel if prev is not None else self._transport.connect(addr), [], addr, held))
                continue  # a pserver whose slots hold no block of this model is never called
            slots = tuple(sorted({slot_of[b.key] for b in blocks}))
            prev = old.pop(i, None)
            if prev is not None:
                parts.append(Part(i, prev.channel, blocks, prev.address, layout.blocks_held(i), round_no=prev.round_no, version=prev.version, incarnation=prev.incarnation, slots=slots))
                continue
            addr = self._address_of(i, wait=True)
            assert addr is not None
            parts.append(Part(i, self._transport.connect(addr), blocks, addr, layout.blocks_held(i), round_no=round_no, slots=slots))
        for gone in old.values():
            gone.channel.close()
        self.layout, self.parts, self.backups_only = layout, parts, backups_only
        # Calls to different pservers overlap when the transport's calls release the GIL
        # (gRPC); in-process calls are plain function calls and stay on this thread.
        transport = self._transport
        if isinstance(transport, ConcurrentCalls) and transport.concurrent and len(parts) > 1:
            if self._pool is None or self._pool_size < len(parts):
                if self._pool is not None:
                    self._pool.shutdown(wait=True)
                self._pool, self._pool_size = ThreadPoolExecutor(len(parts), thread_name_prefix="pdps-pserver-call"), len(parts)

    def restrict(self, params: Sequence[str]) -> None:
        """Push to and pull from the pservers only the blocks of ``params`` (a pipeline
        stage's parameters, by the whole model's names): a pserver holding none of them
        is no part any more. The layout stays the whole model's, so every stage agrees
        on where each block lives. Pulls then name their blocks (``PullRequest.blocks``)."""
        known = {s.name for s in self._specs}
        unknown = sorted(set(params) - known)
        if unknown:
            raise ConfigError(f"cannot restrict the pserver group to parameters the model does not have: {unknown[:5]}")
        self.only = frozenset(params)
        self._use(self.layout.slot_map)

    def refresh(self) -> bool:
        """Follow a resize: re-read the slot map and, if it is newer than the one these
        parts were computed from, address the pservers it names. True if it was."""
        key = self._keys.slotmap
        kv = self._store.get(key)
        if kv is None:
            return False
        slot_map = decode_as(kv.value, key, SlotMap.from_json)
        if slot_map.version <= self.layout.slot_map.version:
            return False
        log.info("following the job's resize: slot map version %d -> %d (%d pservers)", self.layout.slot_map.version, slot_map.version, slot_map.num_pservers)
        self._use(slot_map)
        return True

    def _address_of(self, index: int, *, wait: bool = False) -> str | None:
        key = self._keys.pserver(index)
        if wait:
            raw = wait_for_key(self._store, key, f"pserver {index}")
        else:
            kv = self._store.get(key)
            raw = None if kv is None else kv.value
        return None if raw is None else decode_as(raw, key, lambda d: str(d["addr"]))

    def _reconnect(self, part: Part) -> None:
        """Follow ``ps/<i>`` to wherever pserver i serves now."""
        try:
            addr = self._address_of(part.index)
        except (StoreError, CorruptRecord) as exc:
            log.debug("cannot look pserver %d up: %s", part.index, exc)
            return
        if addr is not None and addr != part.address:
            log.warning("pserver %d moved from %s to %s; reconnecting", part.index, part.address, addr)
            part.channel.close()
            part.channel = self._transport.connect(addr)
            part.address = addr

    def _map_moved(self, part: Part, exc: PdpsError) -> None:
        """Raise SlotMapChanged if the job's slot map is newer than the one ``part`` was
        addressed by: an unreachable pserver may have left the job in a resize, and one
        that keeps saying not ready may have been failed over (fenced, its lease lapsed)."""
        try:
            kv = self._store.get(self._keys.slotmap)
            current = None if kv is None else decode_as(kv.value, kv.key, SlotMap.from_json).version
        except (StoreError, CorruptRecord):
            return
        if current is not None and current > self.layout.slot_map.version:
            raise SlotMapChanged(
                f"pserver {part.index} cannot serve ({exc}) and the job's slot map is at version {current} "
                f"(this trainer's is {self.layout.slot_map.version}): a resize moved its slots",
                sent=self.layout.slot_map.version, current=current,
            )

    def call(self, part: Part, method: str, request: Message, into: Sequence[Any] | None = None) -> Message:
        """Call one pserver, pausing and retrying while it is unreachable or not ready.
        ``into``: where the reply's tensors may be received (see ``Channel.call``)."""
        retrying = Retry(UNREACHABLE_BACKOFF, deadline=self.patience)
        last_log = 0.0
        since = 0.0
        while True:
            try:
                reply = part.channel.call(method, request) if into is None else part.channel.call(method, request, into=into)
                if retrying.elapsed >= WAIT_LOG_EVERY:
                    log.warning("pserver %d answers again after %.0fs", part.index, retrying.elapsed)
                if retrying.failures and self._waits is not None:
                    self._waits.done()
                return reply
            except NotInitialized:
                raise  # the caller initializes it
            except NotReady as exc:
                error: PdpsError = exc
                self._map_moved(part, exc)
            except TransportError as exc:
                if isinstance(exc, (Timeout, Unauthenticated)):  # a wrong token stays wrong
                    raise
                error = exc
                self._map_moved(part, exc)  # a resize let this pserver go: follow the map, not the pserver
                self._reconnect(part)
            if not retrying.failures:
                since = time.time()
            if not retrying.note():
                raise error
            waited = retrying.elapsed
            if waited >= WAIT_LOG_EVERY and waited - last_log >= WAIT_LOG_EVERY:
                last_log = waited
                if self._waits is not None:
                    self._waits.waiting(f"{method}: {error}", [f"pserver {part.index} at {part.address}"], since)
                else:
                    log.warning("waiting %.0fs for pserver %d at %s: %s", waited, part.index, part.address, error)
            retrying.pause()

    def ask(self, part: Part, request: Request, into: Sequence[Any] | None = None) -> Any:
        """:meth:`call` with a typed request; its typed reply (:mod:`pdps.core.wire`)."""
        return request.REPLY.decode(self.call(part, request.METHOD, calls.message(request), into))

    def call_each(self, requests: Sequence[tuple[Part, Request]], into: Callable[[Part], Sequence[Any]] | None = None) -> list[Any]:
        """Call several pservers, concurrently where the transport allows; their typed
        replies. A stale push, or a request for a slot map the pserver no longer serves
        (:class:`SlotMapChanged`: a resize), comes back in its place in the list; any
        other error is raised once all calls ended (an :class:`EpochChanged` first: the
        caller must start over). ``into(part)``: where a reply's tensors may be received."""

        def one(part: Part, request: Request) -> Any:
            try:
                return self.ask(part, request, None if into is None else into(part))
            except (StalePush, SlotMapChanged) as exc:
                return exc

        if self._pool is None or len(requests) < 2:
            results: list[Any] = []
            for part, req in requests:
                results.append(one(part, req))
            return results
        futures = [self._pool.submit(one, part, req) for part, req in requests]
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        if errors:
            raise next((e for e in errors if isinstance(e, EpochChanged)), errors[0])
        return [f.result() for f in futures]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        for p in self.parts + self.backups_only:
            p.channel.close()


