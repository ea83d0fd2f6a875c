"""The master's part in a resize: move the job's ``resize`` record through its table
(:mod:`pdps.core.elastic`), one fenced transaction per step.

* A desired pserver count (``ps_desired``) that differs from the live map's with no
  resize in progress, as an operator (``kubectl scale``) writes it, becomes a resize.
* ``requested``: more pservers wanted -> ``growing``; fewer -> ``migrating``; the same
  (trainers only) -> ``done``. A checkpoint being written goes first: a resize never
  interleaves with one.
* ``growing``: once every new index is claimed -> ``migrating``.
* ``migrating`` decides the new map. An async job (or one whose model is not known
  yet, so nothing has values) switches to it in the same transaction; a sync job at
  the next round boundary (the pserver closing that round writes it).
* Once every receiving pserver holds its slots (``resize_got/<version>/<i>``) ->
  ``done``; departing pservers and trainers then leave by themselves.

Every step reads the store afresh, so a master that takes over (a standby) carries
on from wherever the record is.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from pdps.core.elastic import Resize, ResizeState, describe
from pdps.core.slots import SlotMap
from pdps.core.errors import PdpsError
from pdps.core.job import JobConfig, Keys, decode_as, says_done
from pdps.core.sgd import Mode
from pdps.core.txn import Fence
from pdps.ports.coordination import Compare, CoordinationStore, EventType, KeyValue, Put, TxnOp, WatchEvent
from pdps.ports.transport import Transport
from pdps.runtime import recovery
from pdps.runtime.resizing import new_resize_id, read_map, read_resize, resizes_got

log = logging.getLogger(__name__)

#: How often the driver looks again without a watch event.
POLL = 0.5
PROBE_EVERY = 0.25  # seconds between probes of the pservers' addresses (_reap)
#: A checkpoint still being written after this long is taken for an orphan (its writer
#: died): a resize waits for younger ones only.
CHECKPOINT_PATIENCE = 120.0
#: Replicas: how long (in lease TTLs) slots short of copies wait for a replacement of
#: the pserver that held them before their copies are made on the others.
REPLENISH_WAIT = 3


class ResizeDriver:
    def __init__(self, store: CoordinationStore, config: JobConfig, fence: Fence | None, stopped: threading.Event, transport: Transport | None = None) -> None:
        self._store, self._config, self._fence, self._stopped = store, config, fence, stopped
        self._transport = transport
        self._probed = 0.0  # when the pservers' addresses were last probed
        self._keys = Keys(config.name)
        self._wake = threading.Event()
        self._said: tuple[str, str] | None = None
        self._short_since: float | None = None  # when the live map was first seen short of copies
        self._seen_claimed: set[int] = set()  # pserver indexes seen held by a live process
        self._done = False  # the job's state says done (its last rounds may still be closing)

    def run(self) -> None:
        keys = self._keys
        watches = [self._store.watch(prefix, self._on_event) for prefix in (keys.resize, keys.ps_desired, keys.pservers, keys.root + "resize_got/", keys.slotmap, keys.state)]
        state = self._store.get(keys.state)
        self._done = self._done or (state is not None and says_done(state.value, state.key))
        try:
            while not self._stopped.is_set():
                try:
                    self.step()
                except PdpsError as exc:
                    log.warning("master: a resize step failed (%s); trying again", exc)
                self._wake.wait(POLL if self._transport is None else PROBE_EVERY)
                self._wake.clear()
        finally:
            for w in watches:
                w.cancel()

    def _leaving(self) -> bool:
        """The job is done and its trainers have left: no round will close any more, and
        pservers that go now are leaving, not dying (no failover, no new copies)."""
        return self._done and not self._store.range(self._keys.trainers)

    def _on_event(self, event: WatchEvent) -> None:
        if event.key == self._keys.state:
            self._done = event.type is EventType.PUT and event.value is not None and says_done(event.value, event.key)
        self._wake.set()

    def step(self) -> None:
        """One step of the job's resize, if one can be taken now."""
        keys = self._keys
        leaving = self._leaving()
        if not leaving:
            self._reap()
        resize, found = read_resize(self._store, keys)
        live = read_map(self._store, keys)
        if resize is None or not resize.active:
            if live.replicas > 1 and not leaving:
                claimed = self._claimed()
                if self._fail_over(live, claimed) or self._replenish(live, found, claimed):
                    return
            self._adopt_desired(live.num_pservers, found)
            return
        self._say(resize)
        if resize.state is ResizeState.MIGRATING:
            if live.replicas > 1 and self._drop_dead_receiver(resize, found, live):
                return
            self._migrate(resize, found, live.version)
            return
        if self._checkpoint_writing():
            return  # a resize is ordered after a checkpoint in progress
        if resize.state is ResizeState.REQUESTED:
            if resize.pservers > live.num_pservers:
                self._write(found, resize.grow(), [Put(keys.ps_desired, str(resize.pservers).encode())])
            elif resize.pservers == live.num_pservers:
                self._write(found, resize.finish())
            else:
                self._plan(resize, found, live)
        elif resize.state is ResizeState.GROWING:
            if set(range(resize.pservers)) <= self._claimed():
                self._plan(resize, found, live)

    def _reap(self) -> None:
        """Revoke the lease of a pserver whose address refuses connections (at most every
        PROBE_EVERY): its process is gone (a listening socket closes with its process),
        so its claim need not live out its TTL. Failover (replicas) or the replacement's
        claim then follow at once. A pserver that may be alive (stopped, cut off: the
        probe cannot tell) keeps its lease until the TTL decides."""
        if self._transport is None or time.monotonic() - self._probed < PROBE_EVERY:
            return
        self._probed = time.monotonic()
        for kv in self._store.range(self._keys.pservers):
            if kv.lease is None or not kv.key.rsplit("/", 1)[1].isdigit():
                continue
            try:
                address = decode_as(kv.value, kv.key, lambda d: str(d["addr"]))
                if not self._transport.refuses(address):
                    continue
                self._store.revoke_lease(kv.lease)
            except PdpsError as exc:
                log.warning("master: could not probe %s (%s)", kv.key, exc)
                continue
            log.warning("master: pserver %s at %s refuses connections: its process is gone; its claim goes now, not a lease TTL later", kv.key.rsplit("/", 1)[1], address)

    def _claimed(self) -> set[int]:
        """The pserver indexes held by a live process (``ps/<i>``)."""
        return {int(kv.key.rsplit("/", 1)[1]) for kv in self._store.range(self._keys.pservers) if kv.key.rsplit("/", 1)[1].isdigit()}

    def _fail_over(self, live: SlotMap, claimed: set[int]) -> bool:
        """Replicas: a pserver of the live map whose claim has gone (its lease expired)
        is dropped from every slot it held, one of each slot's surviving copies becoming
        the primary where it was, in one fenced transaction: nothing rolls back, and no
        bytes move. Slots whose every copy it held are left to the rollback its
        replacement asks for. True if a map was written."""
        keys = self._keys
        seen, self._seen_claimed = self._seen_claimed, self._seen_claimed | claimed
        if self._store.get(keys.initialized) is None:
            return False  # no values anywhere yet: a pserver not claimed is starting, not gone
        for p in range(live.num_pservers):
            if p in claimed or p not in seen or not live.held_by(p) or live.lost_with(p):
                continue  # (a pserver this master never saw alive: its replacement drops its own copies)
            kv = self._store.get(keys.slotmap)
            guards = [Compare.unchanged(keys.slotmap, kv), Compare.absent(keys.pserver(p))]
            after = live.without(p)
            try:
                written = self._store.commit(guards, [Put(keys.slotmap, json.dumps(after.to_json()).encode())], fence=self._fence).succeeded
            except PdpsError as exc:
                log.warning("master: could not fail pserver %d over (%s); trying again", p, exc)
                return False
            if written:
                log.warning("master: pserver %d is gone; its slots' backups take over (slot map version %d -> %d), nothing rolls back", p, live.version, after.version)
            return written
        return False

    def _drop_dead_receiver(self, resize: Resize, found: KeyValue | None, live: SlotMap) -> bool:
        """A re-replication whose only receiver's claim has gone (seen alive before) is
        dropped with it (:meth:`Resize.without_receiver`), in one fenced transaction:
        the copies it was getting are planned again, no rollback. True if written."""
        keys = self._keys
        claimed = self._claimed()
        seen, self._seen_claimed = self._seen_claimed, self._seen_claimed | claimed
        for p in resize.receivers():
            after = resize.without_receiver(live, p) if p not in claimed and p in seen else None
            if after is None:
                continue
            kv = self._store.get(keys.slotmap)
            guards = [Compare.unchanged(keys.slotmap, kv), Compare.unchanged(keys.resize, found), Compare.absent(keys.pserver(p))]
            ops = [Put(keys.slotmap, json.dumps(after.to_json()).encode()), Put(keys.resize, json.dumps(resize.finish().to_json()).encode())]
            try:
                written = self._store.commit(guards, ops, fence=self._fence).succeeded
            except PdpsError as exc:
                log.warning("master: could not drop pserver %d from %s (%s); trying again", p, resize.id, exc)
                return False
            if written:
                self._store.delete_prefix(keys.resize_got(live.version))
                self._store.delete_prefix(keys.resize_ready(live.version))
                log.warning("master: pserver %d died receiving its copies (%s); dropped from the map (version %d -> %d), to be planned again, nothing rolls back",
                            p, resize.id, live.version, after.version)
            return written
        return False

    def _replenish(self, live: SlotMap, found: KeyValue | None, claimed: set[int]) -> bool:
        """Replicas: slots with fewer copies than the job keeps get them back, made on
        the live pservers (a replacement holding nothing first), as a resize that moves
        only those copies. True if one was asked for."""
        short = live.under_replicated()
        members = {p for p in claimed if p < live.num_pservers}
        if not short or len(members) < live.replicas:
            self._short_since = None
            return False
        if self._short_since is None:
            self._short_since = time.monotonic()
        empty = any(not live.held_by(p) for p in members)
        if not empty and time.monotonic() - self._short_since < REPLENISH_WAIT * self._config.lease_ttl:
            return False  # a replacement may come back at the dead index: the copies go to it then
        asked = Resize(id=new_resize_id("replenish"), state=ResizeState.REQUESTED, pservers=live.num_pservers,
                       trainers=None, requested=time.time(), by="master: re-replication")
        # sync: the replacement takes its share of the primaries back in the same switch
        # (async keeps them: a primary moving mid-forward could leave its copies apart)
        planned = asked.replenish(live, members, balance=self._config.mode is Mode.SYNC)
        if not planned.moves():
            return False
        if self._write(found, planned, self._switch_now(planned)):
            log.warning("master: %d slots have fewer than %d copies: %s", len(short), live.replicas, describe(planned))
            return True
        return False

    def _adopt_desired(self, pservers: int, found: KeyValue | None) -> None:
        """The operator path: a desired count written straight into ``ps_desired``."""
        kv = self._store.get(self._keys.ps_desired)
        try:
            desired = int(kv.value) if kv is not None else pservers
        except ValueError:
            log.error("master: %s holds %r, not a pserver count; ignored", self._keys.ps_desired, kv.value[:40] if kv else b"")
            return
        if desired == pservers or not max(1, self._config.replicas) <= desired <= self._config.num_slots:
            return
        if self._config.replicas > 1 and self._config.mode is Mode.ASYNC:
            log.error("master: %s says %d pservers, but an async job with replicas cannot change its pserver count yet; ignored", self._keys.ps_desired, desired)
            return
        resize = Resize(id=new_resize_id("desired"), state=ResizeState.REQUESTED, pservers=desired, trainers=None, requested=time.time(), by=f"{self._keys.ps_desired}")
        if self._write(found, resize):
            log.warning("master: %s says %d pservers, the job runs %d: %s", self._keys.ps_desired, desired, pservers, describe(resize))

    def _plan(self, resize: Resize, found: KeyValue | None, live: SlotMap) -> None:
        planned = resize.plan(live)
        if self._write(found, planned, self._switch_now(planned)):
            log.warning("master: %s: %d slots move", describe(planned), len(planned.moves()))

    def _switch_now(self, planned: Resize) -> list[TxnOp]:
        """The map's flip, written with the plan when nothing has values yet (no trainer
        attached) or the job is async; a sync job switches at a round boundary."""
        assert planned.to_map is not None
        if self._config.mode is Mode.ASYNC or self._store.get(self._keys.model) is None:
            return [Put(self._keys.slotmap, json.dumps(planned.to_map.to_json()).encode())]
        return []

    def _migrate(self, resize: Resize, found: KeyValue | None, live_version: int) -> None:
        assert resize.to_map is not None
        version = resize.to_map.version
        if live_version < version:
            # a sync job switches at the next round boundary; with no trainer left to close
            # one (the pservers see nobody registered), now
            if not any(True for _ in self._store.range(self._keys.trainers)):
                self._write(found, resize, [Put(self._keys.slotmap, json.dumps(resize.to_map.to_json()).encode())])
            return
        got = resizes_got(self._store, self._keys, version)
        if set(resize.receivers()) <= set(got):
            if self._write(found, resize.finish()):
                self._store.delete_prefix(self._keys.resize_got(version))
                self._store.delete_prefix(self._keys.resize_ready(version))
                log.warning("master: %s", describe(resize.finish()))

    def _checkpoint_writing(self) -> bool:
        now = time.time()
        for d in recovery.describe(self._store, self._keys):
            if d["state"] == "writing" and now - float(d.get("started") or 0.0) < CHECKPOINT_PATIENCE:
                return True
        return False

    def _write(self, found: KeyValue | None, resize: Resize, ops: list[TxnOp] | None = None) -> bool:
        """Write the record (and ``ops``) if it is still as read; False if it moved."""
        keys = self._keys
        guard = Compare.unchanged(keys.resize, found)
        try:
            return self._store.commit((guard,), [Put(keys.resize, json.dumps(resize.to_json()).encode()), *(ops or ())], fence=self._fence).succeeded
        except PdpsError as exc:
            log.info("master: could not move %s (%s); reading it again", resize.id, exc)
            return False

    def _say(self, resize: Resize) -> None:
        said = (resize.id, resize.state.value)
        if said != self._said:
            self._said = said
            log.info("master: %s", describe(resize))

