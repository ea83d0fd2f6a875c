"""Asking for a resize, and reading how far it is: what ``pdps scale`` and
:func:`pdps.scale` do, and what the roles read (the rules are in
:mod:`pdps.core.elastic`).

Asking writes the desired counts (``ps_desired``, ``trainers_desired``) and a
``requested`` resize record in one transaction that holds only while no other resize
is in progress: one at a time, decided by the store. The master does the rest.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable

from pdps.core.elastic import Resize, ResizeState, check_counts, describe
from pdps.core.errors import ConfigError, CorruptRecord, ResizeInProgress, Timeout
from pdps.core.headcount import Desired, parse_count
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.sgd import Mode
from pdps.core.slots import SlotMap
from pdps.core.txn import Decision, Done, Write
from pdps.ports.coordination import Compare, CoordinationStore, EventType, KeyValue, Put, TxnOp, WatchEvent
from pdps.runtime.cas import read_modify_write

log = logging.getLogger(__name__)

#: How often a waiter reads the resize record again (a watch wakes it sooner).
REREAD = 0.5



def new_resize_id(kind: str = "") -> str:
    """A resize's id: when it was asked (sortable, readable in ``pdps status``), what
    asked for it, and 6 random hex digits, so that two asked in the same second differ."""
    return "-".join(p for p in (time.strftime("%Y%m%d-%H%M%S"), kind, uuid.uuid4().hex[:6]) if p)


def read_resize(store: CoordinationStore, keys: Keys) -> tuple[Resize | None, KeyValue | None]:
    kv = store.get(keys.resize)
    return (None if kv is None else decode_as(kv.value, kv.key, Resize.from_json)), kv


def read_map(store: CoordinationStore, keys: Keys) -> SlotMap:
    kv = store.get(keys.slotmap)
    if kv is None:
        raise ConfigError(f"job {keys.job!r} has no slot map ({keys.slotmap}): start its master (or publish the job) first")
    return decode_as(kv.value, kv.key, SlotMap.from_json)


def _job_done(store: CoordinationStore, keys: Keys) -> bool:
    kv = store.get(keys.state)
    try:
        state = None if kv is None else decode_json(kv.value, kv.key)
    except CorruptRecord:
        return False
    return isinstance(state, dict) and state.get("state") == "done"


def resizes_got(store: CoordinationStore, keys: Keys, version: int) -> list[int]:
    """The pservers that hold every slot map ``version`` gives them (those that received slots and said so)."""
    return sorted(int(kv.key.rsplit("/", 1)[1]) for kv in store.range(keys.resize_got(version)))


def request_resize(
    store: CoordinationStore,
    keys: Keys,
    *,
    pservers: int | None = None,
    trainers: int | None = None,
    wait: bool = False,
    timeout: float | None = None,
    by: str = "",
    progress: Callable[[Resize], None] | None = None,
) -> Resize:
    """Ask for the job to run with ``pservers`` pservers and/or ``trainers`` trainers.

    Refused with :class:`ResizeInProgress` (naming it) while another resize is in
    progress, unless ``wait``: then this waits for that one to finish, asks, and waits
    for its own to finish too (``progress`` is called with the record as it moves).
    :class:`~pdps.core.errors.Timeout` after ``timeout`` seconds of waiting. Returns
    the record as written (or, with ``wait``, as finished).
    """
    current = read_map(store, keys)
    check_counts(pservers, trainers, current.num_slots, current.replicas)
    found = store.get(keys.config)
    job = None if found is None else JobConfig.decode(found.value, keys.config)
    if job is not None and job.pipeline_stages > 1 and trainers is not None:
        if trainers != job.trainers:  # its ranks are laid out for the configured count (docs/pipeline.md, limits)
            raise ConfigError(
                f"job {keys.job!r} runs pipelines of {job.pipeline_stages} stages on {job.trainers} trainers: "
                f"this version cannot change a pipeline job's trainer count; change --pservers only"
            )
    if pservers is not None and pservers != current.num_pservers and current.replicas > 1:
        if job is not None and job.mode is Mode.ASYNC:
            raise ConfigError(
                f"job {keys.job!r} is async with replicas = {current.replicas}: this version cannot change its pserver count "
                f"(a primary moving while its forwards are on their way could leave its copies apart); change --trainers only"
            )
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        ahead, _ = read_resize(store, keys)
        if ahead is not None and ahead.active:
            if not wait:
                raise ResizeInProgress(f"job {keys.job!r}: {describe(ahead, resizes_got(store, keys, ahead.to_map.version) if ahead.to_map else ())} is in progress, asked by {ahead.by or 'an operator'}; wait for it (pdps scale --wait) or ask again once it is done")
            wait_resized(store, keys, ahead.id, deadline=deadline, progress=progress)
        mine = Resize(
            id=new_resize_id(), state=ResizeState.REQUESTED,
            pservers=read_map(store, keys).num_pservers if pservers is None else pservers,
            trainers=trainers, requested=time.time(), by=by,
        )

        def ask(found: KeyValue | None) -> Decision:
            if found is not None and decode_as(found.value, found.key, Resize.from_json).active:
                return Done(None)  # another asker got in first: look again
            ops: list[TxnOp] = [Put(keys.resize, json.dumps(mine.to_json()).encode())]
            if pservers is not None:
                ops.append(Put(keys.ps_desired, str(pservers).encode()))
            if trainers is not None:
                ops.append(Put(keys.trainers_desired, str(trainers).encode()))
            return Write((Compare.unchanged(keys.resize, found),), ops, result=mine)

        written = read_modify_write(store, keys.resize, ask, what=f"asking job {keys.job!r} to resize")
        if written is None:
            continue
        log.info("job %r: asked for %s", keys.job, describe(written))
        if not wait:
            return written
        return wait_resized(store, keys, written.id, deadline=deadline, progress=progress)


def wait_resized(
    store: CoordinationStore, keys: Keys, resize_id: str, *, deadline: float | None = None, progress: Callable[[Resize], None] | None = None
) -> Resize:
    """Wait until resize ``resize_id`` is done (or another one replaced it); the record."""
    moved = threading.Event()

    def on_event(event: WatchEvent) -> None:
        if event.key == keys.resize and event.type is EventType.PUT:
            moved.set()

    watch = store.watch(keys.resize, on_event)
    try:
        last: Resize | None = None
        while True:
            now, _ = read_resize(store, keys)
            if now is None or now.id != resize_id or not now.active:
                return now if now is not None and now.id == resize_id else last or now  # type: ignore[return-value]
            if progress is not None and now != last:
                progress(now)
            last = now
            if _job_done(store, keys):
                raise ConfigError(f"job {keys.job!r} has ended; {describe(now)} will not finish")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise Timeout(f"job {keys.job!r}: {describe(now)} has not finished")
            moved.wait(REREAD if left is None else min(REREAD, left))
            moved.clear()
    finally:
        watch.cancel()


def read_desired(store: CoordinationStore, keys: Keys, configured_trainers: int) -> Desired:
    """The counts the job wants now (``configured_trainers`` until a resize names one)."""
    ps, trainers = store.get(keys.ps_desired), store.get(keys.trainers_desired)
    if ps is None:
        raise ConfigError(f"job {keys.job!r} has no {keys.ps_desired}; start its master (or publish the job) first")
    return Desired(parse_count(ps.value, ps.key), configured_trainers if trainers is None else parse_count(trainers.value, trainers.key))
