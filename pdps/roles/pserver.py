"""A parameter server: holds the blocks of its slots and applies the job's optimizer.

It claims an index ``/ps/<i>`` (the first free one below the desired count, by
transaction), learns the model and slot map from the store when the first trainer
arrives, and serves ``init``, ``push`` and ``pull``. The consistency rules are the
core's (:mod:`pdps.core.sgd`); this shell adds locking, waiting and membership.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from pdps.core.errors import ConfigError, GradientRejected, NotReady, StoreError, Timeout, TransportError
from pdps.core.job import JobConfig, Keys, decode_as
from pdps.core.sgd import Barrier, Mode, check_staleness
from pdps.core.slots import Layout, ParamSpec, SlotMap
from pdps.ports.compute import Compute, ParameterShard
from pdps.ports.coordination import Compare, CoordinationStore, EventType, Put, WatchEvent
from pdps.ports.transport import Endpoint, Message, Transport

log = logging.getLogger(__name__)

#: A waiting pull logs whom it waits for after this many seconds, and again as often.
WAIT_LOG_EVERY = 5.0


def claim_index(store: CoordinationStore, keys: Keys, lease: int, value: bytes, *, index: int | None = None, wait: float = 0.0) -> int:
    """Claim ``/ps/<index>``, or the first free index below the desired count, by transaction.

    A fixed ``index`` (a StatefulSet's ordinal) that another lease still holds is
    waited for up to ``wait`` seconds: a restarted pserver's old claim lives until
    its lease runs out.
    """
    kv = store.get(keys.ps_desired)
    if kv is None:
        raise ConfigError(f"job has no {keys.ps_desired}; start the master (or publish the job) first")
    desired = int(kv.value)
    if index is not None and not 0 <= index < desired:
        raise ConfigError(f"pserver index {index} is out of range: job {keys.job!r} has {desired} pservers (0..{desired - 1})")
    deadline = time.monotonic() + wait
    while True:
        for i in range(desired) if index is None else (index,):
            if store.commit((Compare.absent(keys.pserver(i)),), (Put(keys.pserver(i), value, lease),)).succeeded:
                return i
            kv = store.get(keys.pserver(i))
            if kv is not None and kv.value == value and kv.lease == lease:
                return i  # our own claim, whose reply an outage lost (the value names our address)
        if time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if index is not None:
        raise ConfigError(f"pserver index {index} of job {keys.job!r} is still held by another pserver after {wait:.0f}s")
    raise ConfigError(f"all {desired} pserver indexes of job {keys.job!r} are taken")


_MISSING = object()


def _field(req: Message, name: str, kind: type, default: object = _MISSING):
    """``req.meta[name]`` as ``kind`` (an int is a float too); a missing or mistyped
    field is the caller's error, refused before anything changes."""
    if name not in req.meta:
        if default is _MISSING:
            raise GradientRejected(f"request names no {name!r}")
        return default
    value = req.meta[name]
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else kind):
        raise GradientRejected(f"request field {name!r} must be {kind.__name__}, got {value!r}")
    return kind(value)


class Pserver:
    def __init__(
        self,
        store: CoordinationStore,
        transport: Transport,
        compute: Compute,
        config: JobConfig,
        *,
        address: str = "inproc://",
        index: int | None = None,
        claim_wait: float = 0.0,
    ) -> None:
        self.config = config
        self._want_index = index
        self._claim_wait = claim_wait
        self._store = store
        self._transport = transport
        self._compute = compute
        self._address = address
        self._keys = Keys(config.name)
        self._cond = threading.Condition(threading.RLock())
        self._shard: ParameterShard | None = None
        self._barrier = Barrier()
        self._members: set[str] = set()
        self.version = 0  # updates applied
        self.index: int | None = None
        self._endpoint: Endpoint | None = None
        self._keeper = None
        self._watch = None
        self._stopped = False

    def start(self) -> None:
        from pdps.roles.lease import LeaseKeeper

        self._compute.check_optimizer(self.config.optimizer, self.config.optimizer_args)  # never serve a bad rule
        self._endpoint = self._transport.serve(self._address, {"init": self._init, "push": self._push, "pull": self._pull})
        self._keeper = LeaseKeeper(self._store, self.config.lease_ttl, name="pserver")
        value = json.dumps({"addr": self._endpoint.address}).encode()
        try:
            self.index = claim_index(self._store, self._keys, self._keeper.lease, value, index=self._want_index, wait=self._claim_wait)
        except BaseException:
            self.stop()
            raise
        self._watch = self._store.watch(self._keys.trainers, self._on_trainer_event)
        log.info("pserver %d of job %r serving at %s", self.index, self.config.name, self._endpoint.address)

    def stop(self) -> None:
        """Stop serving: waiting pulls end first, in-flight calls finish, then the claim goes."""
        self._stopped = True
        with self._cond:
            self._cond.notify_all()
        if self._watch is not None:
            self._watch.cancel()
        if self._endpoint is not None:
            self._endpoint.close()
        if self._keeper is not None:
            self._keeper.stop()

    @property
    def lease_lost(self) -> bool:
        """True once the store dropped this pserver's lease (its index may be someone else's)."""
        return self._keeper is not None and self._keeper.lost

    @property
    def address(self) -> str:
        assert self._endpoint is not None
        return self._endpoint.address

    @property
    def steps(self) -> int:
        return self.version

    # --- handlers ---------------------------------------------------------------------

    def _init(self, req: Message) -> Message:
        with self._cond:
            shard = self._ensure_shard()
            if not shard.initialized:
                trainer = _field(req, "trainer", str)
                shard.initialize(req.tensors, trainer)
                log.info("pserver %s initialized %d blocks from trainer %s", self.index, len(shard.blocks), trainer)
            return Message({"version": self.version})

    def _push(self, req: Message) -> Message:
        trainer = _field(req, "trainer", str)
        samples = _field(req, "samples", int, 0)
        if samples < 0:
            raise GradientRejected(f"push from trainer {trainer!r} claims {samples} samples")
        with self._cond:
            shard = self._ready_shard()
            if self.config.mode is Mode.SYNC:
                if samples:
                    self._check_blocks(req.meta.get("blocks"), trainer)  # before any state changes
                    shard.check(req.tensors, trainer)
                elif req.tensors:
                    raise ConfigError(f"trainer {trainer!r} pushed tensors with zero samples")
                self._barrier.contribute(trainer, _field(req, "round", int), samples)
                if samples:
                    shard.accumulate(req.tensors, float(samples))
                self._members.add(trainer)
                self._maybe_close_round()
                return Message({"round": self._barrier.round_no, "version": self.version})
            self._check_blocks(req.meta.get("blocks"), trainer)
            shard.check(req.tensors, trainer)
            seen = _field(req, "version", int)
            if not 0 <= seen <= self.version:
                raise GradientRejected(f"push from trainer {trainer!r} was computed on version {seen}, which pserver {self.index} never served (now {self.version})")
            check_staleness(seen, self.version, self.config.staleness)
            shard.apply(req.tensors)
            self.version += 1
            return Message({"version": self.version})

    def _pull(self, req: Message) -> Message:
        after = _field(req, "after_round", int, None)
        timeout = _field(req, "timeout", float, 600.0)
        with self._cond:
            shard = self._ready_shard()
            if after is not None:
                self._wait_round_closed(int(after), timeout)
            return Message({"round": self._barrier.round_no, "version": self.version}, shard.views())

    def _check_blocks(self, keys: object, trainer: str) -> None:
        """The push must name exactly this pserver's blocks, in order (``param@row``)."""
        assert self._shard is not None
        mine = [b.key for b in self._shard.blocks]
        if keys == mine:
            return
        if not isinstance(keys, list):
            raise GradientRejected(f"push from trainer {trainer!r} does not name its blocks")
        known = set(mine)
        unknown = [k for k in keys if k not in known]
        if unknown:
            raise GradientRejected(
                f"trainer {trainer!r} pushed a gradient for parameter {str(unknown[0]).split('@')[0]!r} "
                f"(block {unknown[0]!r}), which pserver {self.index} does not hold"
            )
        missing = [b.describe() for b in self._shard.blocks if b.key not in set(keys)]
        if missing:
            raise GradientRejected(f"push from trainer {trainer!r} lacks gradients for {missing[:5]}")
        raise GradientRejected(
            f"push from trainer {trainer!r} names pserver {self.index}'s blocks out of order or more than once: "
            f"expected {mine[:5]}..., got {keys[:5]}..."
        )

    # --- sync rounds ------------------------------------------------------------------

    def _wait_round_closed(self, round_no: int, timeout: float) -> None:
        start = last_log = time.monotonic()
        while self._barrier.round_no <= round_no:
            if self._stopped:
                raise TransportError(f"pserver {self.index} stopped while round {round_no} was open")
            now = time.monotonic()
            if now - start >= timeout:
                raise Timeout(f"pserver {self.index}: round {round_no} did not close in {timeout:.0f}s; waiting for {sorted(self._barrier.waiting_for(self._members))}")
            if now - last_log >= WAIT_LOG_EVERY:
                last_log = now
                log.warning(
                    "pserver %s: round %d waiting %.0fs for trainers %s",
                    self.index, round_no, now - start, sorted(self._barrier.waiting_for(self._members)),
                )
            self._cond.wait(min(1.0, timeout - (now - start)))

    def _maybe_close_round(self) -> None:
        """Close the open round if every current member has contributed (lock held)."""
        if not self._barrier.ready(self._members):
            return
        # The watch may lag behind the store: confirm membership with an authoritative read,
        # so a trainer that has registered but not been announced yet is still waited for.
        try:
            live = {self._keys.trainer_id(kv.key) for kv in self._store.range(self._keys.trainers)}
        except StoreError as exc:
            log.warning("pserver %s could not read membership (%s); round stays open", self.index, exc)
            return
        self._members = live
        if not self._barrier.ready(self._members):
            return
        result = self._barrier.close()
        if result.applies_update:
            assert self._shard is not None
            self._shard.apply_accumulated(1.0 / result.total)
            self.version += 1
        self._cond.notify_all()

    def _on_trainer_event(self, event: WatchEvent) -> None:
        trainer = self._keys.trainer_id(event.key)
        with self._cond:
            if event.type is EventType.DELETE:
                self._members.discard(trainer)
                if self._shard is not None and self._shard.initialized:
                    self._maybe_close_round()
            else:
                self._members.add(trainer)

    # --- model ------------------------------------------------------------------------

    def _ensure_shard(self) -> ParameterShard:
        if self._shard is None:
            model = self._store.get(self._keys.model)
            slots = self._store.get(self._keys.slotmap)
            if model is None or slots is None:
                raise NotReady(f"job {self.config.name!r} has no model description yet; a trainer must attach first")
            specs = decode_as(model.value, model.key, lambda ds: [ParamSpec.from_json(d) for d in ds])
            layout = Layout.build(specs, decode_as(slots.value, slots.key, SlotMap.from_json), self.config.min_block)
            assert self.index is not None
            self._shard = self._compute.shard(layout.blocks_of(self.index), self.config.optimizer, self.config.optimizer_args)
            self._members = {self._keys.trainer_id(kv.key) for kv in self._store.range(self._keys.trainers)}
        return self._shard

    def _ready_shard(self) -> ParameterShard:
        shard = self._ensure_shard()
        if not shard.initialized:
            raise NotReady(f"pserver {self.index} has no initial parameters yet; call init first")
        return shard
