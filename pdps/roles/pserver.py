"""A parameter server: holds the blocks of its slots and applies the job's optimizer.

It claims an index ``/ps/<i>`` (the first free one below the desired count, by
transaction), learns the model and slot map from the store when the first trainer
arrives, and serves ``init``, ``push`` and ``pull``. The consistency rules are the
core's (:mod:`pdps.core.sgd`); this shell adds locking, waiting and membership.

Sync rounds are transactions (:class:`~pdps.core.sgd.RoundRecord`): a push only
*stages* a trainer's gradient; each trainer then commits its contribution under the
round's prefix in the store, and the round's close marker, written once, freezes whose
staged gradients every pserver applies. A pserver learns what was committed from a
watch on ``rounds/`` (one event per contribution), and reads a round's keys once, to
apply it.

Recovery: a pserver that starts in a job whose pservers were already initialized is
a *restart*. It rolls the whole job back to the latest sound checkpoint (a new
epoch, :mod:`pdps.runtime.recovery`), or, for an async job with ``restore="lost"``,
reloads only its own slots. Every pserver follows the ``epoch`` record: it loads its
part of the epoch's checkpoint and refuses requests of older epochs
(:class:`~pdps.core.errors.EpochChanged`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from pdps.core.backoff import Backoff
from pdps.core.checkpoints import Epoch
from pdps.core.elastic import Resize, ResizeState
from pdps.core.headcount import claimable
from pdps.core.errors import (
    BadRequest,
    ConfigError,
    CorruptRecord,
    EpochChanged,
    GradientRejected,
    InvalidTransition,
    NotInitialized,
    NotReady,
    PdpsError,
    SlotMapChanged,
    StalePush,
    StorageError,
    StoreError,
    Timeout,
    TransportError,
)
from pdps.core.job import JobConfig, Keys, decode_as, decode_json, says_done
from pdps.core.lifecycle import HALTED, UNSETTLED, PserverEvent, PserverState, next_state
from pdps.core.sgd import Mode, RoundRecord, check_staleness, participants
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap
from pdps.core.tables import TableSpec, check_row_rule, parse_row_entry, row_entry, row_rule_for, row_slots
from pdps.core.txn import Decision, Done, Write
from pdps.core.updategraph import digest
from pdps.core.wire import (
    AppliedReply,
    AppliedRequest,
    RuleReply,
    RuleRequest,
    InitReply,
    InitRequest,
    MigrateReply,
    MigrateRequest,
    ReplicateRequest,
    PserverRequest,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
)
from pdps.ports.checkpoints import CheckpointFiles
from pdps.ports.compute import Compute, ParameterShard, RowShard
from pdps.ports.coordination import Compare, CoordinationStore, EventType, KeyValue, Put, TxnOp, WatchEvent
from pdps.ports.transport import Channel, Endpoint, Transport
from pdps.roles import calls
from pdps.runtime import recovery
from pdps.runtime.cas import read_modify_write
from pdps.runtime.resizing import read_map, read_resize
from pdps.runtime.rounds import read_round
from pdps.runtime.retry import Retry, retry

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
    # A shrinking job's departing pservers keep their indexes until the resize is done
    # (one that restarts mid-handoff can claim its index again).
    live = store.get(keys.slotmap)
    mapped = 0 if live is None else decode_as(live.value, live.key, SlotMap.from_json).num_pservers
    desired = claimable(int(kv.value), mapped, read_resize(store, keys)[0])
    if index is not None and not 0 <= index < desired:
        raise ConfigError(f"pserver index {index} is out of range: job {keys.job!r} has {desired} pservers (0..{desired - 1})")
    candidates = range(desired) if index is None else (index,)

    def claim(held: dict[int, KeyValue | None]) -> Decision:
        for i, kv in held.items():
            if kv is None:
                return Write((Compare.absent(keys.pserver(i)),), (Put(keys.pserver(i), value, lease),), result=i)
            if kv.value == value and kv.lease == lease:
                return Done(i)  # our own claim, whose reply an outage lost (the value names our address)
        return Done(None)  # all taken

    waiting = Retry(CLAIM_POLL, deadline=wait)
    while True:
        claimed = read_modify_write(store, lambda: {i: store.get(keys.pserver(i)) for i in candidates}, claim, what="claiming a pserver index")
        if claimed is not None:
            return claimed
        if not waiting.failed():
            break
    if index is not None:
        raise ConfigError(f"pserver index {index} of job {keys.job!r} is still held by another pserver after {wait:.0f}s")
    raise ConfigError(f"all {desired} pserver indexes of job {keys.job!r} are taken")


#: How often a pserver asks again for an index another pserver's lease still holds.
CLAIM_POLL = Backoff(first=0.1, longest=0.1)
#: Loading a checkpoint part: tries, and the pauses between them (storage may lag).
LOAD_ATTEMPTS = 5
LOAD_BACKOFF = Backoff(first=0.2, longest=1.6)
#: Task attempts whose applied records a pserver remembers for the ``applied`` call.
LEDGER_ATTEMPTS = 100_000
#: Async: tasks whose high-water mark a pserver keeps (the newest pushed). A late push
#: comes from an attempt that still runs, and the tasks that have one at a time are a
#: few per trainer: a task this far back has long finished, and an endless stream's
#: task ids would otherwise grow the marks without bound.
MARKED_TASKS = 100_000
#: What closing a round returns when this pserver wrote its marker.
_CLOSED_HERE = object()
#: A sync pull that waits this long at the barrier answers "still waiting" with whom it
#: waits for, so the trainer can say so; the trainer then asks again.
PULL_SLICE = WAIT_LOG_EVERY
#: A round that seems to wait for someone reads its keys and the membership from the
#: store (not the watches) when the last such read is older than this, in case a watch
#: missed an event.
MEMBERS_FRESH = 1.0
#: ... and, each time such a read finds nothing the watches had not told, waits twice as
#: long before the next, up to this: a round that waits for slow trainers is not read
#: once a second by every pserver (at 1,000 trainers, 190 KB a read).
STUCK_LONGEST = 16.0
#: The round-closing thread looks again at least this often (the watches wake it as
#: soon as the round can close or has closed).
POLL = MEMBERS_FRESH
#: A source pserver unregistered this many lease TTLs has lost the slots it held: the
#: receiver asks for a rollback (its replacement, if any, restarts empty).
SOURCE_GONE = 3
#: What asking a source for slots returns when it lost them.
_LOST = object()
#: A request that needs the slots a pserver is receiving waits this long for them
#: before it is answered NotReady (and sent again by the caller, with backoff).
PENDING_WAIT = 5.0
#: How long a switch waits for the shard being built ahead for it.
PREPARE_WAIT = 60.0
#: A receiving pserver asks for at most this many bytes of slots per call.
MIGRATE_CALL_BYTES = 32 << 20
#: Sync: how long a resize's switch waits for every pserver of the new map to have
#: built its shard ahead (``resize_ready``) before it happens anyway (a pserver that
#: never says so, being dead or restarting, then builds it at the switch).
READY_PATIENCE = 10.0
#: Pauses between tries of a source pserver that is unreachable or has not switched yet.
MIGRATE_BACKOFF = Backoff(first=0.02, longest=0.5)
#: Fault injection for tests: seconds a pserver sleeps between writing its checkpoint
#: part and recording it (so a test can kill it in the middle of a checkpoint).
CHECKPOINT_DELAY_ENV = "_PDPS_FAULT_CHECKPOINT_DELAY"  # not PDPS_*: the launcher passes it on
#: ... and seconds a source pserver holds each ``migrate`` call before it answers (so a
#: test can kill the source or the receiver in the middle of a migration).
MIGRATE_DELAY_ENV = "_PDPS_FAULT_MIGRATE_DELAY"


class _Connection:
    """A channel to one pserver, kept across calls while its address stays the same."""

    def __init__(self) -> None:
        self.address: str | None = None
        self.channel: Channel | None = None

    def to(self, transport: Transport, address: str) -> Channel:
        if self.channel is None or address != self.address:
            self.close()
            self.channel, self.address = transport.connect(address), address
        return self.channel

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None


@attrs.define(eq=False)
class _Forward:
    """One gradient on its way to a backup, and how its delivery ended."""

    request: ReplicateRequest
    done: threading.Event = attrs.field(factory=threading.Event)
    error: BaseException | None = None


@attrs.define(eq=False)
class _LeavingRows:
    """The rows of the slots a pserver gave up in a resize, copied when it switched maps
    (its row stores dropped them then), kept until the resize is done: ``steps``, each
    table's step entry (:func:`~pdps.core.tables.table_entry`); ``slots``, slot -> table
    -> kind -> tensor (the kinds of :func:`~pdps.core.tables.row_entry`; a slot without
    rows maps to nothing). A receiver pages through one slot's rows at a time
    (:meth:`page`)."""

    steps: dict[str, object]
    slots: dict[int, dict[str, dict[str, object]]]

    @classmethod
    def of(cls, tables: dict[str, RowShard], give: Sequence[int]) -> _LeavingRows:
        steps: dict[str, object] = {}
        slots: dict[int, dict[str, dict[str, object]]] = {s: {} for s in give}
        for name, rows in sorted(tables.items()):
            entries, _ = rows.export_slots(give)  # one gather per table, split by slot below
            for key, t in entries.items():
                row = parse_row_entry(key)
                if row is None:
                    steps[key] = t  # the table's step
                else:
                    slots[row[1]].setdefault(row[0], {})[row[2]] = t
        return cls(steps, slots)

    def page(self, slot: int, offset: int, budget: int) -> tuple[list[str], list[object], bool]:
        """Entries of ``slot``'s rows from the ``offset``-th on (table by table in name
        order, each in id order), at most ``budget`` bytes of them (one row at least),
        with every table's step and, in the first page, the ids awaiting admission; and
        whether rows remain past them."""
        names: list[str] = list(self.steps)
        tensors: list[object] = list(self.steps.values())
        tables = sorted(self.slots[slot].items())
        if offset == 0:
            for table, kinds in tables:
                for kind in sorted(k for k in kinds if k.startswith("pending_")):
                    names.append(row_entry(table, slot, kind))
                    tensors.append(kinds[kind])
                    budget -= int(kinds[kind].nbytes)  # type: ignore[attr-defined]
        start = 0  # the first row of the table, counted over the slot's tables in order
        end = offset  # rows before this one are sent (by earlier pages, or this one)
        for table, kinds in tables:
            n = _rows_in(kinds)
            lo = end - start
            start += n
            if lo >= n:
                continue
            per_row = sum(int(t.nbytes) for k, t in kinds.items() if not k.startswith("pending_")) / n  # type: ignore[attr-defined]
            room = int(budget // per_row)
            if room < 1 and end > offset:
                break
            hi = min(n, lo + max(room, 1))
            for kind, t in sorted(kinds.items()):
                if not kind.startswith("pending_"):
                    names.append(row_entry(table, slot, kind))
                    tensors.append(t[lo:hi])  # type: ignore[index]
            budget -= int((hi - lo) * per_row)
            end += hi - lo
            if hi < n:
                break
        return names, tensors, end < sum(_rows_in(kinds) for _, kinds in tables)


def _rows_in(kinds: dict[str, object]) -> int:
    ids = kinds.get("ids")
    return 0 if ids is None else int(ids.shape[0])  # type: ignore[attr-defined]


class _InOrder:
    """Async, at a primary: the gradients one backup must apply, sent one call at a time
    in the order they were queued (the order the primary applied them), on a thread of
    its own. A backup thus applies them in that order, and a call sent again after a
    lost reply is the only one it can see twice (``seq`` tells it)."""

    def __init__(self, send: Callable[[ReplicateRequest], None], name: str) -> None:
        self._send = send
        self._queue: deque[_Forward] = deque()
        self._cond = threading.Condition()
        self._closed = False
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def put(self, request: ReplicateRequest) -> _Forward:
        item = _Forward(request)
        with self._cond:
            if self._closed:
                item.error = NotReady("the pserver is stopping")
                item.done.set()
            else:
                self._queue.append(item)
                self._cond.notify()
        return item

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                item = self._queue[0]
            try:
                self._send(item.request)
            except BaseException as exc:  # noqa: BLE001 - the pushing call raises it to its trainer
                item.error = exc
            finally:
                with self._cond:
                    self._queue.popleft()
                item.done.set()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()


#: how often a pserver records its row counts per table (``table_stats/<i>``), at most
TABLE_STATS_EVERY = 5.0


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
        checkpoints: CheckpointFiles | None = None,
    ) -> None:
        self.config = config
        self._want_index = index
        self._claim_wait = claim_wait
        self._store = store
        self._transport = transport
        self._compute = compute
        self._address = address
        self._files = recovery.files_for(config, checkpoints)
        self._keys = Keys(config.name)
        lock = threading.RLock()
        self._cond = threading.Condition(lock)  # waiting pulls: a round applied, an epoch entered, a halt
        #: the round-closing thread: the open round may be closable (a contribution, a marker,
        #: a trainer gone, the job done). Waiting pulls do not poll: a thousand of them at
        #: each of many pservers, waking to look, would cost more CPU than the job.
        self._closer = threading.Condition(lock)
        self._waiters = 0  # pulls waiting at the barrier
        self._shard: ParameterShard | None = None
        #: the model's sparse tables (``model_tables``; None: not read yet), and the rows of
        #: each in the slots this pserver holds a copy of (primary or backup)
        self._table_specs: list[TableSpec] | None = None
        self._tables: dict[str, RowShard] = {}
        #: ... masks over the slots of the map served: those this pserver is the primary of
        #: (trainers push and pull their rows here), per backup pserver those of them it
        #: backs up (forwarded their rows), and per primary pserver its slots held here
        self._row_primary: np.ndarray | None = None
        self._row_backups: dict[int, np.ndarray] = {}
        self._row_backed: dict[int, np.ndarray] = {}
        self._slot_map: SlotMap | None = None  # the map served: read at start, switched by resizes
        self._layout: Layout | None = None  # the model's blocks on _slot_map (once the model is known)
        self._specs: list[ParamSpec] | None = None
        #: a resize: slot map version -> slot -> the block entries of the slots this pserver
        #: gave up when it switched to that map, kept until their receivers have them
        self._outgoing: dict[int, dict[int, dict[str, object]]] = {}
        self._outgoing_applied: dict[int, dict[int, int]] = {}  # ... and their applied_by_slot
        self._outgoing_forwarded: dict[int, dict[int, int]] = {}  # ... and the forwards queued by then (async replicas)
        #: ... and the rows of those slots' tables, copied when it switched (paged to receivers)
        self._outgoing_rows: dict[int, _LeavingRows] = {}
        #: slots this pserver receives in the map it serves, by source pserver: until they
        #: are all here, it serves no parameters (NotReady)
        self._pending: dict[int, list[int]] = {}
        self._received: dict[str, object] = {}  # block entries: those kept and those received
        self._resize: Resize | None = None  # the job's newest resize, as the watch reports it
        #: (map version, layout, its shard): the shard of the map a resize switches to, built ahead
        self._prepared: tuple[int, Layout, ParameterShard] | None = None
        self._preparing: int | None = None  # the map version whose shard is being built ahead
        self._primary: list[int] | None = None  # shard positions of the blocks this pserver is the primary of (None: all)
        self._forwards: dict[int, list[int]] = {}  # backup pserver -> shard positions of its blocks this pserver is the primary of
        self._peers: dict[int, _Connection] = {}  # backup pserver -> the connection forwards go over
        self._peers_lock = threading.Lock()
        self._slot_of: dict[str, int] = {}  # block key -> its slot, in the map served
        #: async, at a primary: backup pserver -> its forwards, in order, and how many were queued
        self._in_order: dict[int, _InOrder] = {}
        self._sent_seq: dict[int, int] = {}
        #: async, at a backup: primary pserver -> (its incarnation, the last forward applied from it)
        self._streams: dict[int, tuple[str | None, int]] = {}
        #: ... block key -> (its primary, its incarnation, seq): a copy received holds that
        #: primary's forwards up to seq (queued before it switched, they may still come)
        self._copied: dict[str, tuple[int, str | None, int]] = {}
        self._ready: dict[int, set[int]] = {}  # map version -> the pservers whose shard of it is built ahead
        self._migrating_since: tuple[int, float] | None = None  # (map version, when this pserver saw it migrating)
        #: sync, (map version, round, shard): the shard of the map this pserver switched
        #: from after that round, served to pulls of that round for that map (_frozen_for)
        self._frozen: tuple[int, int, ParameterShard, list[int] | None] | None = None
        self._halted = threading.Event()  # set once, when it stops or crashes
        self.departed = threading.Event()  # a resize took every slot away and the job let this pserver go
        #: async: pushes applied here, per slot (a push counts once for each slot it
        #: stepped); a slot's count moves with it, so the job's counts add up across resizes
        self.applied_by_slot: dict[int, int] = {}
        self._my_slots: tuple[int, ...] = ()
        self.sent_bytes = 0  # slot state sent to receiving pservers, and received from sources
        self.received_bytes = 0
        #: bytes of row sections taken (ids and gradients) and rows served (pulls): what
        #: the process's allocator trimmer (pdps.shell.allocator) watches
        self.row_bytes = 0
        self.version = 0  # updates applied
        self.epoch = 0
        self.round_no = 0  # the open sync round
        self._prev: set[str] | None = None  # contributors of the last round (None: the epoch's first)
        self._round_checkpoint: tuple[int, str] | None = None  # (round, checkpoint taken after it)
        #: the open round's participants that have not committed yet, as far as the watch
        #: on rounds/ has told (None: work it out again, the round or the membership moved)
        self._waiting: set[str] | None = None
        self._seen: dict[int, set[str]] = {}  # round -> the trainers the watch saw commit to it
        self._marked: set[int] = set()  # rounds whose close marker the watch saw
        self._round_read = time.monotonic()  # when the open round opened here, or was last read
        self._stuck_after = MEMBERS_FRESH  # how long the open round may wait before it is read again
        self._closers: tuple[int, ...] = ()  # the pservers that close rounds in turn (those holding some of the model)
        self._placed = True  # False: a sync pserver a resize adds, until it has seen the open round
        self._gone: set[str] = set()  # trainers whose key went: their staging buffers can go
        #: async: each task's high-water mark, (pass, end) of the records [0, end) of it
        #: applied here (an attempt pushes a task's records in order, from where the last
        #: one's progress ended): records pushed again (a re-queued task's first push, a
        #: retried call, a timed-out attempt's late push) are not applied twice. The
        #: newest MARKED_TASKS tasks.
        self._marks: OrderedDict[int, tuple[int, int]] = OrderedDict()
        #: (task, attempt) -> the records applied here, as merged [start, end) ranges (the
        #: ``applied`` call; the newest LEDGER_ATTEMPTS attempts of this epoch)
        self._ledger: OrderedDict[tuple[int, int], list[list[int]]] = OrderedDict()
        self._members: set[str] = set()  # registered trainers, as the watch reports them
        self._members_read = 0.0  # when _members was last read from the store
        # Whether the job's state says done: kept by a watch, and read again at most every
        # MEMBERS_FRESH (a watch may miss an event), not at every pull that waits.
        self._done = False
        self._state_read = -MEMBERS_FRESH
        self.state = PserverState.NEW  # moved only by _move, through pdps.core.lifecycle
        self.incarnation = uuid.uuid4().hex[:12]
        self._fenced = False  # logged once per spell
        self.rollbacks = 0  # epochs entered after the first
        self.index: int | None = None
        self._endpoint: Endpoint | None = None
        self._keeper = None
        self._watches: list = []
        self._writers: list[threading.Thread] = []
        self._seen_checkpoints: set[str] = set()
        self._last_checkpoint = time.monotonic()
        self._window_wanted: bytes | None = None  # a window's checkpoint_wanted, not yet taken
        self.checkpoint_parts = 0  # parts of checkpoints written, and the seconds it took
        self.checkpoint_seconds = 0.0

    def _move(self, event: PserverEvent) -> None:
        """Take ``event`` through the lifecycle table (lock held)."""
        self.state = next_state(f"pserver {self.index}", self.state, event)

    def start(self) -> None:
        from pdps.runtime.lease import LeaseKeeper

        with self._cond:
            self._move(PserverEvent.START)

        self._compute.check_optimizer(self.config.optimizer, self.config.optimizer_args)  # never serve a bad rule
        handlers = {
            InitRequest: self._init, PushRequest: self._push, PullRequest: self._pull,
            AppliedRequest: self._applied_records, MigrateRequest: self._migrate, ReplicateRequest: self._replicate,
            RuleRequest: self._rule,
        }
        self._endpoint = self._transport.serve(self._address, calls.serve(handlers))
        self._keeper = LeaseKeeper(self._store, self.config.lease_ttl, name="pserver")
        value = json.dumps({"addr": self._endpoint.address}).encode()
        try:
            self.index = claim_index(self._store, self._keys, self._keeper.lease, value, index=self._want_index, wait=self._claim_wait)
            slots = self._store.get(self._keys.slotmap)
            if slots is None:
                raise ConfigError(f"job {self.config.name!r} has no slot map ({self._keys.slotmap}); start the master (or publish the job) first")
            self._slot_map = decode_as(slots.value, slots.key, SlotMap.from_json)
            epoch, _ = recovery.read_epoch(self._store, self._keys)
            # a pserver the live map gives no slot yet (a resize is growing the job) is new, not restarted
            initialized = self._store.get(self._keys.initialized) is not None
            restart = initialized and self.index < self._slot_map.num_pservers and bool(self._slot_map.held_by(self.index))
            if restart and self._slot_map.replicas > 1 and not self._slot_map.lost_with(self.index):
                restart = not self._drop_own_copies()  # every slot it held has another copy: no rollback
            # ... and, sync, takes its place in the rounds at the first round the watch shows it
            self._placed = not (initialized and not restart and self.config.mode is Mode.SYNC)
            if not self._placed:
                with self._cond:
                    self._ensure_shard()  # of the live map: empty, until the resize switches it
            with self._cond:
                self.epoch, self.round_no = epoch.epoch, epoch.round
            self._watches.append(self._store.watch(self._keys.trainers, self._on_trainer_event))
            with self._cond:
                self._live(fresh=True)
            self._watches.append(self._store.watch(self._keys.epoch, self._on_epoch_event))
            self._watches.append(self._store.watch(self._keys.resize, self._on_resize_event))
            self._watches.append(self._store.watch(self._keys.slotmap, self._on_slotmap_event))
            if self.config.checkpoint_windows:
                self._watches.append(self._store.watch(self._keys.checkpoint_wanted, self._on_checkpoint_wanted))
            if self.config.mode is Mode.SYNC:
                self._watches.append(self._store.watch(self._keys.state, self._on_state_event))
                self._watches.append(self._store.watch(self._keys.rounds, self._on_round_event))
            with self._cond:  # after the watches: a switch in between is seen by one or the other
                self._resize = read_resize(self._store, self._keys)[0]
                if self._resize is not None and self._resize.state is ResizeState.MIGRATING:
                    self._start_preparing(self._resize)
                if self._placed:
                    self._switch_map(read_map(self._store, self._keys))  # a resize may have flipped it since it was read
                else:
                    self._follow_since()
            if self.config.mode is Mode.SYNC:
                threading.Thread(target=self._close_rounds, name=f"pdps-ps-rounds-{self.index}", daemon=True).start()
            threading.Thread(target=self._report_tables, name=f"pdps-ps-tables-{self.index}", daemon=True).start()
            if self.config.mode is Mode.ASYNC:
                self._watches.append(self._store.watch(self._keys.checkpoints, self._on_checkpoint_event))
            if not restart:
                with self._cond:
                    if self.state is PserverState.STARTING:  # else an epoch that began meanwhile was entered
                        self._move(PserverEvent.SERVE)
            elif self.config.mode is Mode.ASYNC and self.config.restore == "lost":
                self._restore_own_slots()
            else:
                self._enter_epoch(self._rollback(f"pserver {self.index} restarted"))
            # The epoch was read before its watch began: a rollback in between (another
            # pserver's restart) reached no callback, and this pserver would serve the old
            # epoch for good (a fresh-clone run saw a job hang so). Read it again now that
            # the watch is on: a later one the watch brings, an earlier one this does.
            latest, _ = recovery.read_epoch(self._store, self._keys)
            if latest.epoch > self.epoch:
                self._enter_epoch(latest)
        except BaseException:
            self.stop()
            raise
        log.info("pserver %d of job %r serving at %s (epoch %d)", self.index, self.config.name, self._endpoint.address, self.epoch)

    def stop(self) -> None:
        """Stop serving: waiting pulls end first, in-flight calls finish, checkpoint parts
        being written are finished and recorded, then the claim goes."""
        self._halt(crashed=False)

    def crash(self) -> None:
        """Stop as a killed process would (tests, simulations): calls fail at once, the
        claim lives until its lease runs out, and no checkpoint part is recorded."""
        self._halt(crashed=True)

    def _halt(self, *, crashed: bool) -> None:
        with self._cond:
            halted = self.state in HALTED
            self._move(PserverEvent.CRASH if crashed else PserverEvent.STOP)  # a halted pserver stays as it ended
            self._cond.notify_all()
            self._closer.notify_all()
        if halted:
            return
        self._halted.set()
        for sender in self._in_order.values():
            sender.close()
        for w in self._watches:
            w.cancel()
        if self._endpoint is not None:
            self._endpoint.close()
        if not crashed:
            for t in self._writers:
                t.join(timeout=30)
            self._put_table_stats()  # what it ends with, for pdps status after the job
        if self._keeper is not None:
            self._keeper.stop(revoke=not crashed)

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

    def _state(self) -> dict:
        """The fields of every reply (:class:`~pdps.core.wire.PserverReply`)."""
        return {
            "round_no": self.round_no, "updates": self.version, "epoch": self.epoch, "incarnation": self.incarnation,
            "map_version": None if self._slot_map is None else self._slot_map.version,
        }

    def _check_lease(self) -> None:
        """Serve nothing once this pserver's lease may have run out (a process stopped
        past its TTL, a store out of reach): its claim may be gone and a backup promoted
        in its place, so what it holds may no longer be the job's. NotReady: the caller
        waits, and follows the map once the job has moved on."""
        if self._keeper is not None and not self._keeper.held:
            if not self._fenced:
                self._fenced = True
                log.warning("pserver %s is fenced: its lease may have run out; it serves nothing until it is renewed", self.index)
            raise NotReady(f"pserver {self.index} is fenced: its lease may have run out (a backup may serve its slots now)")
        self._fenced = False

    def _check_request(self, req: PserverRequest) -> None:
        """Refuse a request of another epoch or slot map; the caller holds the lock."""
        self._check_lease()
        if self.state in UNSETTLED:
            raise NotReady(f"pserver {self.index} is {self.state} (epoch {self.epoch})")
        self._check_slot_map(req)
        epoch = req.epoch
        if epoch is None or epoch == self.epoch:
            return
        if epoch < self.epoch:
            raise EpochChanged(f"pserver {self.index} is at epoch {self.epoch} (the job rolled back); the request was for epoch {epoch}")
        raise NotReady(f"pserver {self.index} has not entered epoch {epoch} yet (at {self.epoch})")

    def _check_slot_map(self, req: PserverRequest) -> None:
        """Refuse a request computed for another slot map than the one served here. A
        request for a newer map than this pserver's: an async pserver looks the map up
        (a watch may be late); a sync one switches only at the round boundary the
        resize chose, so the caller waits (NotReady)."""
        if self._slot_map is None:
            raise NotReady(f"pserver {self.index} is starting")
        if req.version is not None and req.version > self._slot_map.version:
            stored = read_map(self._store, self._keys)
            if self.config.mode is Mode.ASYNC:
                self._switch_map(stored)
            if self._slot_map.version < req.version <= stored.version:
                raise NotReady(f"pserver {self.index} serves slot map version {self._slot_map.version} until round {self.round_no} closes; the request is for version {req.version}")
        if req.version is not None and req.version != self._slot_map.version:
            raise SlotMapChanged(
                f"{req.METHOD} from trainer {req.trainer!r} was computed for slot map version {req.version}, but pserver {self.index} "
                f"serves version {self._slot_map.version}: re-read the slot map",
                sent=req.version, current=self._slot_map.version,
            )

    def _init(self, req: InitRequest) -> InitReply:
        with self._cond:
            self._check_request(req)
            shard = self._ensure_shard()
            req.claim(shard.blocks)
            if not shard.initialized:
                shard.initialize(req.tensors, req.trainer)
                log.info("pserver %s initialized %d blocks from trainer %s (epoch %d)", self.index, len(shard.blocks), req.trainer, self.epoch)
            return InitReply(**self._state())

    def _push(self, req: PushRequest) -> PushReply:
        trainer = req.trainer
        with self._cond:
            began = time.perf_counter()  # the pserver's own time: what "update" means in a step breakdown
            self._check_request(req)
            shard = self._receiving_shard() if self.config.mode is Mode.SYNC else self._ready_shard()
            if req.incarnation is not None and req.incarnation != self.incarnation:
                raise StalePush(f"pserver {self.index} restarted since trainer {trainer!r} last pulled from it: pull first")
            if self.config.mode is not Mode.SYNC:
                reply, queued = self._push_async(req, shard, began)
            else:
                indices = self._claim(req, shard.blocks, self._primary)  # before any state changes
                sections = self._checked_rows(req)
                self._stage_round(req, shard, indices)
                self._stage_rows(req, sections, source=-1, covers=self._row_primary)
                reply = PushReply(**self._state(), update_s=time.perf_counter() - began)
                forwards = self._forwards_of(req, indices, req.dense_tensors, sections, samples=req.samples, round_no=req.round_no, primary=self.index)
        # off the lock: the trainer is answered once every backup has it
        if self.config.mode is not Mode.SYNC:
            for item in queued:
                item.done.wait()
                if item.error is not None:
                    raise item.error
        elif forwards:
            self._forward(forwards)
        return reply

    def _replicate(self, req: ReplicateRequest) -> PushReply:
        """A gradient for blocks this pserver backs up, forwarded by their primary. Sync:
        staged as the trainer's own push is. Async: applied, in the primary's order."""
        with self._cond:
            began = time.perf_counter()
            if self.config.mode is not Mode.SYNC:
                return self._replicate_async(req, began)
            self._check_request(req)
            round_no = req.require("round_no")
            if round_no > self.round_no:
                # trainers pull from primaries only, so a backup may still be applying the
                # round before (receiving copies, say): its staged gradients are still needed
                self._wait_round_closed(round_no - 1, self.epoch, PENDING_WAIT)
                if round_no > self.round_no:
                    raise NotReady(f"pserver {self.index} is still at round {self.round_no}; the gradient forwarded is for round {round_no}")
            shard = self._receiving_shard()
            indices = req.claim(shard.blocks, self.index)
            primary, backed = self._forwarder(req)
            sections = self._checked_rows(req, backed)
            self._stage_round(req, shard, indices)
            self._stage_rows(req, sections, source=primary, covers=backed)
            return PushReply(**self._state(), update_s=time.perf_counter() - began)

    def _forwarder(self, req: ReplicateRequest) -> tuple[int, np.ndarray | None]:
        """(Lock held) the primary that forwarded ``req``, and the mask of its slots this
        pserver holds (None: the job has no tables): a forward's rows are of those."""
        if req.primary is None:
            if req.tables:
                raise GradientRejected(f"a forward of trainer {req.trainer!r}'s rows to pserver {self.index} names no primary", field="primary", trainer=req.trainer)
            return -1, None
        if self._row_primary is None:
            return req.primary, None
        return req.primary, self._row_backed.get(req.primary, np.zeros_like(self._row_primary))

    def _stage_rows(self, req: PushRequest, sections: list[tuple[str, object, object]], *, source: int, covers: np.ndarray | None) -> None:
        """(Lock held) stage ``req``'s row sections (checked) for the open round: a
        trainer's own (``source`` -1) or a primary's forward, carrying the rows of slots
        ``covers`` in the map served."""
        assert self._slot_map is not None
        for name, ids, grads in sections:
            self._tables[name].stage(req.trainer, ids, grads, keep=req.owned, source=source, version=self._slot_map.version, covers=covers)

    def _replicate_async(self, req: ReplicateRequest, began: float) -> PushReply:
        """Async (lock held): apply a forwarded gradient, if its sender is still the
        primary of its blocks here and this pserver holds them (a late forward from a
        pserver that lost them in a failover is refused, SlotMapChanged), once (a
        forward sent again is acknowledged, not applied)."""
        self._check_lease()
        if self.state in UNSETTLED or self._slot_map is None:
            raise NotReady(f"pserver {self.index} is {self.state} (epoch {self.epoch})")
        if req.epoch is not None and req.epoch != self.epoch:
            raise (EpochChanged if req.epoch < self.epoch else NotReady)(f"pserver {self.index} is at epoch {self.epoch}; the forward was for epoch {req.epoch}")
        if req.version is not None and req.version > self._slot_map.version:
            self._check_slot_map(req)  # switches to the stored map (the watch may be late); refused if it is still older
        for name in ("primary", "seq"):
            if getattr(req, name) is None:
                raise GradientRejected(f"a forward of trainer {req.trainer!r}'s gradient to async pserver {self.index} lacks field {name!r}", field=name, trainer=req.trainer)
        shard = self._ready_shard()
        indices = req.claim(shard.blocks, self.index)  # a malformed forward is refused by name first
        primary = req.primary
        owners = self._slot_map.owners
        blocks = req.blocks or ()
        wrong = [k for k in blocks if owners[self._slot_of[k]] != primary]
        if wrong:
            raise SlotMapChanged(
                f"pserver {self.index} backs up none of blocks {wrong[:4]} for pserver {primary} in slot map version {self._slot_map.version} "
                f"(the forward was sent by version {req.version})",
                sent=req.version or 0, current=self._slot_map.version,
            )
        _, backed = self._forwarder(req)
        sections = self._forwarded_rows(req, backed)
        last = self._streams.get(primary)
        if last is not None and last[0] == req.incarnation and req.seq <= last[1]:
            return PushReply(**self._state(), update_s=time.perf_counter() - began, duplicate=True)
        # A copy received from this primary holds the forwards it had queued when it
        # switched maps. (Rows need no such care: a forward's sections are cut by the map
        # the primary served when it queued it, which gave a new copy's slot no rows here.)
        held_already = [k for k in blocks if (c := self._copied.get(k)) is not None and c[:2] == (primary, req.incarnation) and req.seq <= c[2]]
        if blocks and len(held_already) == len(blocks) and not sections:
            return PushReply(**self._state(), update_s=time.perf_counter() - began, duplicate=True)
        dense = list(req.dense_tensors)
        at = list(indices) if indices is not None else list(range(len(shard.blocks)))
        if held_already:
            keep = [i for i, k in enumerate(blocks) if k not in held_already]
            dense, at = [dense[i] for i in keep], [at[i] for i in keep]
        if dense:
            shard.check(dense, req.trainer, indices=at, finite=False)  # the primary checked their values
            shard.apply(dense, at)
        steps = dict(req.steps or ())
        for name, ids, grads in sections:
            self._tables[name].apply(ids, grads, step=steps[name])  # at the primary's table step
        self._streams[primary] = (req.incarnation, req.seq)
        rows_slots = set() if backed is None or not req.tables else set(np.flatnonzero(backed).tolist())
        for slot in {self._slot_of[k] for k in blocks if k not in held_already} | rows_slots:
            self.applied_by_slot[slot] = self.applied_by_slot.get(slot, 0) + 1
        return PushReply(**self._state(), update_s=time.perf_counter() - began)

    def _forwarded_rows(self, req: ReplicateRequest, backed: np.ndarray | None) -> list[tuple[str, object, object]]:
        """Async (lock held): a forward's row sections, checked: each table's step given,
        and every id in a slot of the forwarding primary held here (SlotMapChanged if
        not: a late forward from a pserver that lost them in a failover)."""
        sections = req.row_sections
        if not sections:
            return sections
        assert self._slot_map is not None
        steps = dict(req.steps or ())
        for name, ids, grads in sections:
            rows = self._table(name, req.trainer)
            rows.check(ids, grads, req.trainer, finite=False)  # the primary checked their values
            if name not in steps:
                raise GradientRejected(f"a forward of trainer {req.trainer!r}'s rows of table {name!r} to async pserver {self.index} names no table step (field 'steps')", field="steps", trainer=req.trainer)
            where = row_slots(name, np.asarray(ids), self._slot_map.num_slots)
            outside = np.flatnonzero(~backed[where]) if backed is not None else np.arange(len(where))
            if len(outside):
                slot = int(where[outside[0]])
                raise SlotMapChanged(
                    f"pserver {self.index} backs up no rows of slot {slot} (table {name!r}) for pserver {req.primary} in slot map version "
                    f"{self._slot_map.version} (the forward was sent by version {req.version})",
                    sent=req.version or 0, current=self._slot_map.version,
                )
        return sections


    def _stage_round(self, req: PushRequest, shard: ParameterShard, indices: list[int] | None) -> None:
        """Sync (lock held): stage ``req``'s gradient for the open round it names."""
        trainer = req.trainer
        round_no = req.require("round_no")
        if not req.samples:
            raise GradientRejected(f"trainer {trainer!r} pushed for round {round_no} with zero samples; commit it instead", field="samples", trainer=trainer)
        if round_no > self.round_no:
            self._advance(self.round_no)  # it may have closed in the store, unseen here yet
            self._check_slot_map(req)  # ... and switched the map (a resize)
        if round_no < self.round_no:
            raise StalePush(f"round {round_no} is closed; the open round is {self.round_no}: pull and compute again")
        if round_no > self.round_no:
            raise InvalidTransition(f"trainer {trainer}", f"round {self.round_no}", f"push for round {round_no}", "pull first")
        # a forward's values were checked by the primary forwarding it: one pass fewer over it here
        shard.check(req.dense_tensors, trainer, indices=indices, finite=not isinstance(req, ReplicateRequest))
        shard.stage(trainer, req.dense_tensors, indices, keep=req.owned)  # applied only if the closed round holds its contribution

    def _claim(self, req: PushRequest | PullRequest, blocks: Sequence[Block], primary: list[int] | None) -> list[int] | None:
        """The positions in ``blocks`` (a shard's) that ``req`` is for: the blocks named,
        among those this pserver is the primary of (``primary``; None: all of them)."""
        if primary is None:
            return req.claim(blocks, self.index)
        picked = req.claim([blocks[i] for i in primary], self.index)
        return primary if picked is None else [primary[i] for i in picked]

    def _forwards_of(
        self, req: PushRequest, indices: Sequence[int] | None, tensors: Sequence[object], rows: Sequence[tuple[str, object, object]] = (), **fields: object,
    ) -> list[tuple[int, ReplicateRequest]]:
        """(Lock held) what of ``req``'s gradient (``tensors``, at shard positions
        ``indices``, None: all; ``rows``, its row sections) each backup must have too:
        the blocks it backs up, and of each section the ids whose slots it backs up.
        A push with row sections reaches every backup of this pserver's slots, whether
        it holds one of their blocks or not, with a section per table, empty if none of
        the ids is its: each copy's table step moves with the primary's."""
        backups = set(self._forwards) | (set(self._row_backups) if rows else set())
        if not backups:
            return []
        assert self._shard is not None and self._slot_map is not None
        at = {i: n for n, i in enumerate(indices if indices is not None else range(len(self._shard.blocks)))}
        where = [row_slots(name, np.asarray(ids), self._slot_map.num_slots) for name, ids, _ in rows]
        out = []
        for backup in sorted(backups):
            pos = [i for i in self._forwards.get(backup, ()) if i in at]
            if not pos and not rows:
                continue
            dense = [tensors[at[i]] for i in pos]
            mask = self._row_backups.get(backup)
            sections = []
            for (name, ids, grads), slots in zip(rows, where):
                take = np.flatnonzero(mask[slots]) if mask is not None else np.empty(0, dtype=np.int64)
                if len(take) < len(slots):  # (all of them: the tensors as they are)
                    ids, grads = ids[take], grads[take]  # type: ignore[index]
                sections.append((name, ids, grads))
            out.append((backup, ReplicateRequest(
                req.trainer, epoch=req.epoch, version=req.version, blocks=tuple(self._shard.blocks[i].key for i in pos), part=True,
                tables=tuple((name, len(ids)) for name, ids, _ in sections) if rows else None,  # type: ignore[arg-type]
                tensors=(*dense, *(t for _, ids, grads in sections for t in (ids, grads))), **fields,  # type: ignore[arg-type]
            )))
        return out

    def _call_peer(self, backup: int, request: ReplicateRequest) -> None:
        """One call to pserver ``backup``, over the connection kept for it (its address
        read from the store when there is none: after a failed call, it is read again)."""
        with self._peers_lock:
            connection = self._peers.get(backup)
            channel = connection.channel if connection is not None else None
        if channel is None:
            kv = self._store.get(self._keys.pserver(backup))
            if kv is None:
                raise NotReady(f"pserver {backup} is not registered")
            address = decode_as(kv.value, kv.key, lambda d: str(d["addr"]))
            with self._peers_lock:
                channel = self._peers.setdefault(backup, _Connection()).to(self._transport, address)
        try:
            calls.call(channel, request)
        except TransportError:
            with self._peers_lock:  # it may be broken: the next try connects afresh
                self._peers.pop(backup, _Connection()).close()
            raise

    def _queue_forwards(
        self, req: PushRequest, indices: Sequence[int] | None, tensors: Sequence[object], rows: Sequence[tuple[str, object, object]] = (),
    ) -> list[_Forward]:
        """Async (lock held, a step checked and about to be applied here): queue its
        gradient for each backup, behind what was queued for it before (so each backup
        applies in the order this pserver does). Its row sections go with the table
        steps this pserver applies them at (each moves by one), which the backups
        apply them at."""
        assert self._slot_map is not None
        if self._forwards and self.config.optimizer_args.get("maximize"):
            # a maximizing rule may negate its gradients in place while the forwards are read
            tensors = [t.clone() for t in tensors]  # type: ignore[attr-defined]
        steps = tuple((name, self._tables[name].step + 1) for name, _, _ in rows) if rows else None
        queued = []
        for backup, request in self._forwards_of(req, indices, tensors, rows, primary=self.index, incarnation=self.incarnation, steps=steps):
            seq = self._sent_seq[backup] = self._sent_seq.get(backup, 0) + 1
            request = attrs.evolve(request, epoch=self.epoch, version=self._slot_map.version, seq=seq)
            sender = self._in_order.get(backup)
            if sender is None:
                sender = self._in_order[backup] = _InOrder(lambda r, b=backup: self._deliver(b, r), f"pdps-ps-forward-{self.index}-{backup}")
            queued.append(sender.put(request))
        return queued

    def _deliver(self, backup: int, request: ReplicateRequest) -> None:
        """Async: send ``request`` to pserver ``backup``, retried while it is unreachable
        or not ready, for as long as it backs up these blocks here (the forwards after it
        wait behind it: one given up would leave a gap). Ends with SlotMapChanged if this
        pserver is no longer their primary (the push then counts for nothing), and with
        nothing to do once ``backup`` no longer backs them up (a failover dropped it)."""
        waiting = Retry(MIGRATE_BACKOFF)
        last_log = 0.0
        while True:
            try:
                self._call_peer(backup, request)
                return
            except (NotReady, TransportError, StoreError, SlotMapChanged) as exc:
                error: PdpsError = exc
            try:
                newer = isinstance(error, SlotMapChanged) and error.current > request.version  # type: ignore[operator]
                with self._cond:
                    if newer:
                        self._switch_map(read_map(self._store, self._keys))
                    if self.state in HALTED:
                        raise NotReady(f"pserver {self.index} stopped before pserver {backup} had trainer {request.trainer!r}'s gradient")
                    if self.epoch != request.epoch:
                        raise EpochChanged(f"pserver {self.index} entered epoch {self.epoch}; trainer {request.trainer!r}'s gradient was for epoch {request.epoch}")
                    if not self._still_backs(backup, request):
                        return
            except StoreError as exc:
                log.warning("pserver %s could not read the slot map: %s", self.index, exc)
            if waiting.elapsed - last_log >= WAIT_LOG_EVERY:
                last_log = waiting.elapsed
                log.warning("pserver %s waits %.0fs to pass trainer %r's gradient on to pserver %d: %s", self.index, waiting.elapsed, request.trainer, backup, error)
            waiting.note()
            waiting.pause()

    def _still_backs(self, backup: int, request: ReplicateRequest) -> bool:
        """(Lock held) whether ``backup`` still backs up ``request``'s blocks or rows,
        which this pserver must still be the primary of (SlotMapChanged otherwise). A
        forward with row sections is owed to every backup of this pserver's slots (its
        sections, even empty, move the backup's table step)."""
        assert self._slot_map is not None
        slots = {self._slot_of.get(k) for k in request.blocks or ()}
        for name, ids, _ in request.row_sections:
            slots.update(np.unique(row_slots(name, np.asarray(ids), self._slot_map.num_slots)).tolist())
        if None in slots or any(self._slot_map.owners[s] != self.index for s in slots):  # type: ignore[index]
            raise SlotMapChanged(
                f"pserver {self.index} is no longer the primary of the blocks or rows trainer {request.trainer!r} pushed (slot map version "
                f"{self._slot_map.version}): the push counts for nothing", sent=request.version or 0, current=self._slot_map.version,
            )
        if request.tables:
            slots.update(s for s, owner in enumerate(self._slot_map.owners) if owner == self.index)
        return any(backup in self._slot_map.backups[s] for s in slots)  # type: ignore[index]

    def _forward(self, forwards: list[tuple[int, ReplicateRequest]]) -> None:
        """Send each backup its share of a push (concurrently), retried while it is
        unreachable or not ready, until the map no longer names it a backup of those
        blocks (a failover dropped it: nothing is owed to it), up to SOURCE_GONE lease
        TTLs; then NotReady, which the trainer waits out and pushes again (staging
        replaces what was staged)."""
        def send(backup: int, request: ReplicateRequest) -> None:
            waiting = Retry(MIGRATE_BACKOFF, deadline=SOURCE_GONE * self.config.lease_ttl)
            while True:
                try:
                    self._call_peer(backup, request)
                    return
                except (NotReady, TransportError, StoreError) as exc:
                    with self._cond:
                        if not self._still_backs(backup, request):
                            return
                    if not waiting.note():
                        raise NotReady(f"pserver {self.index} could not pass trainer {request.trainer!r}'s gradient on to pserver {backup}, a backup of its slots: {exc}") from exc
                    waiting.pause()

        if len(forwards) == 1:
            send(*forwards[0])
            return
        errors: list[BaseException] = []

        def run(backup: int, request: ReplicateRequest) -> None:
            try:
                send(backup, request)
            except BaseException as exc:  # noqa: BLE001 - raised below, on the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=run, args=f, name=f"pdps-ps-forward-{self.index}-{f[0]}", daemon=True) for f in forwards]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def _push_async(self, req: PushRequest, shard: ParameterShard, began: float) -> tuple[PushReply, list[_Forward]]:
        """Async (lock held): apply the push, or stage its piece. What it applies is
        queued for the backups of its blocks first (checked already, it cannot be
        refused now), so they apply it while this pserver does; the caller waits for
        them off the lock."""
        trainer = req.trainer
        seen = req.require("updates")
        if not req.part:
            indices = self._claim(req, shard.blocks, self._primary)
            dense = req.dense_tensors
            shard.check(dense, trainer, indices=indices)
            sections = self._checked_rows(req)
            self._check_updates(seen, trainer)
            if self._applied_already(req.records):
                return PushReply(**self._state(), update_s=time.perf_counter() - began, duplicate=True), []
            queued = self._queue_forwards(req, indices, dense, sections)
            shard.apply(dense, indices)
            for name, ids, grads in sections:
                self._tables[name].apply(ids, grads, key=trainer)  # the positions of its pull of these ids, if nothing moved since
        else:
            if req.tables:
                raise GradientRejected(f"trainer {trainer!r} sent row sections in a push of some slots; rows ride in whole pushes", field="tables", trainer=trainer)
            outcome, staged = self._stage_piece(shard, req, seen)
            if staged is None:
                return PushReply(**self._state(), update_s=time.perf_counter() - began, duplicate=outcome == "duplicate"), []
            queued = self._queue_forwards(req, *staged)
            shard.apply_staged_step(trainer)
        self.version += 1
        for slot in self._my_slots:
            self.applied_by_slot[slot] = self.applied_by_slot.get(slot, 0) + 1
        records = req.records
        if records is not None:
            self._mark_applied(records)
            self._note_applied(records[1], records[2], records[3], records[4])
        self._maybe_announce_async()
        return PushReply(**self._state(), update_s=time.perf_counter() - began), queued

    def _applied_already(self, records: tuple[int, int, int, int, int] | None) -> bool:
        """These records of this (pass, task) were applied here already, all of them
        (below the task's mark, or of a pass before the mark's): the push of an attempt
        that died before recording its progress, sent again by the next one, a timed-out
        attempt's late push, or a call retried. Once is enough. StalePush if only some
        were: the push is one sum, which cannot be applied in part."""
        if records is None:
            return False
        pass_no, task, _, start, end = records
        mark = self._marks.get(task)
        if mark is None or pass_no > mark[0]:
            return False  # the task's first records here in this pass
        if pass_no < mark[0] or end <= mark[1]:
            return True  # a pass ends once every pserver has all its tasks' records
        if start >= mark[1]:
            return False
        raise StalePush(
            f"a push of records [{start}, {end}) of task {task} (pass {pass_no}) overlaps records [0, {mark[1]}), which pserver "
            f"{self.index} applied already: it is one sum and is dropped whole"
        )

    def _mark_applied(self, records: tuple[int, int, int, int, int]) -> None:
        pass_no, task, _, _, end = records
        self._marks[task] = (pass_no, end)
        self._marks.move_to_end(task)
        while len(self._marks) > MARKED_TASKS:
            self._marks.popitem(last=False)

    def _stage_piece(self, shard: ParameterShard, req: PushRequest, seen: int) -> tuple[str, tuple[list[int], list[object]] | None]:
        """Async, a step pushed slot by slot while the trainer's backward runs: stage each
        piece, and apply the step only at its ``final`` message, which the trainer sends
        once every pserver has accepted every piece. A step with a non-finite slot on any
        pserver thus changes nothing anywhere. ``first`` opens a step, dropping what an
        unfinished one staged; a refused piece voids the step here. Returns "staged",
        "ready" with the step to apply (its shard positions and staged gradients), or
        "duplicate" (a final whose records were applied here already)."""
        trainer = req.trainer
        if req.first:
            shard.unstage(trainer)
        try:
            indices = self._claim(req, shard.blocks, self._primary)
            shard.check(req.tensors, trainer, indices=indices)
            shard.stage(trainer, req.tensors, indices)
            if not req.final:
                return "staged", None
            self._check_updates(seen, trainer)
            duplicate = self._applied_already(req.records)
        except (GradientRejected, StalePush):
            shard.unstage(trainer)
            raise
        if duplicate:
            shard.unstage(trainer)
            return "duplicate", None
        step = shard.staged_step(trainer)  # views of its staging buffer: the trainer stages nothing until it is answered
        if not step[0]:
            raise StalePush(f"pserver {self.index} holds no piece of the step trainer {trainer!r} ends (dropped meanwhile): pull and compute again")
        return "ready", step

    def _check_updates(self, seen: int, trainer: str) -> None:
        """Async: ``seen`` (the update count a gradient was computed on) was served here and
        is within the staleness bound."""
        if seen > self.version:
            raise GradientRejected(
                f"push from trainer {trainer!r} was computed on {seen} updates (field 'updates'), which pserver {self.index} never served (now {self.version})",
                field="updates", trainer=trainer,
            )
        check_staleness(seen, self.version, self.config.staleness)

    def _note_applied(self, task: int, attempt: int, start: int, end: int) -> None:
        ranges = self._ledger.setdefault((task, attempt), [])
        self._ledger.move_to_end((task, attempt))
        if ranges and ranges[-1][1] == start:
            ranges[-1][1] = end
        else:
            ranges.append([start, end])
        while len(self._ledger) > LEDGER_ATTEMPTS:
            self._ledger.popitem(last=False)

    def applied(self) -> list[list[int]]:
        """What this pserver has applied in its epoch, per task attempt, as
        ``[task, attempt, start, end]`` rows (records ``[start, end)`` of the task): to
        check an audit (``pdps status --pass N``) against. The newest
        :data:`LEDGER_ATTEMPTS` attempts are kept."""
        with self._cond:
            return [[t, a, lo, hi] for (t, a), ranges in self._ledger.items() for lo, hi in ranges]

    def _applied_records(self, req: AppliedRequest) -> AppliedReply:
        """The ``applied`` call: :meth:`applied`, as the reply's ``ledger``."""
        with self._cond:
            self._check_lease()
            self._check_slot_map(req)
            held = set(self._slot_map.held_by(self.index)) if self._slot_map is not None and self.index is not None else set()
            slots = tuple(sorted((s, n) for s, n in self.applied_by_slot.items() if s in held))
            return AppliedReply(**self._state(), ledger=tuple(tuple(row) for row in self.applied()), slots=slots)

    def _rule(self, req: RuleRequest) -> RuleReply:
        """The ``rule`` call: the rule was checked on decode (a hostile one never gets
        here); say its digest and whether it is the one this pserver runs. Changes nothing."""
        sent = digest(req.rule)
        own = self.config.optimizer_args.get("graph") if self.config.optimizer == "graph" else None
        with self._cond:
            self._check_lease()
            self._check_slot_map(req)
            return RuleReply(**self._state(), digest=sent, runs=isinstance(own, dict) and digest(own) == sent)

    def _pull(self, req: PullRequest) -> PullReply:
        after, slice_s = req.after_round, req.slice_s
        timeout = 600.0 if req.deadline is None else max(0.0, req.deadline - time.monotonic())
        with self._cond:
            extra: dict[str, object] = {}
            if self._frozen_for(req):
                return self._frozen_reply(req, extra)
            self._check_request(req)
            shard = self._ready_shard()
            if req.dump is not None:
                return self._dump(req)
            indices = self._claim(req, shard.blocks, self._primary)
            if after is not None and self.config.mode is Mode.SYNC:
                epoch = self.epoch
                began = time.perf_counter()
                closed = self._wait_round_closed(after, epoch, timeout if slice_s is None else min(slice_s, timeout))
                extra["wait_s"] = time.perf_counter() - began  # the barrier, in a step breakdown
                if not closed:
                    if slice_s is None:
                        raise Timeout(f"pserver {self.index}: round {after} did not close in {timeout:.0f}s; waiting for {sorted(self._waiting or ())}")
                    return PullReply(**self._state(), waiting=tuple(sorted(self._waiting or ())), **extra)  # type: ignore[arg-type]
                if self._round_checkpoint is not None and self._round_checkpoint[0] == after:
                    extra["checkpoint"] = self._round_checkpoint[1]
                if self._frozen_for(req):
                    return self._frozen_reply(req, extra)
                self._check_slot_map(req)  # the round may have switched the map (a resize)
                shard = self._ready_shard()
                indices = self._claim(req, shard.blocks, self._primary)
            elif self.config.mode is Mode.SYNC:
                self._advance(self.round_no)  # serve every round the store has closed
            views = shard.views()
            if indices is not None:  # some slots only: a trainer pulling while its forward runs
                views = [views[i] for i in indices]
            if req.tables:
                rows = self._looked_up(req)
                return PullReply(**self._state(), tables=req.tables, tensors=[*views, *rows], **extra)  # type: ignore[arg-type]
            return PullReply(**self._state(), tensors=views, **extra)  # type: ignore[arg-type]

    def _dump(self, req: PullRequest) -> PullReply:
        """(Lock held) a page of the rows of one table in one slot (fetching a job's rows)."""
        assert req.dump is not None
        name, slot, offset, limit = req.dump
        rows = self._table(name, req.trainer, push=False)
        if slot not in rows.slots:
            raise BadRequest(f"pull from {req.trainer!r}: pserver {self.index} holds no rows of slot {slot} (it holds copies of {len(rows.slots)} slots)", field="dump", trainer=req.trainer)
        entries, more = rows.export_slots([slot], offset, limit)
        ids = entries.get(row_entry(name, slot, "ids"))
        values = entries.get(row_entry(name, slot, "values"))
        if ids is None or values is None:  # the slot holds no row of the table
            return PullReply(**self._state(), more=False)
        return PullReply(**self._state(), more=more, tensors=[ids, values])

    def _live_pservers(self) -> int | None:
        """The pservers of the slot map served: one part each in a checkpoint taken now."""
        return None if self._slot_map is None else self._slot_map.num_pservers

    def _report_tables(self) -> None:
        """Put this pserver's row counts per table (``table_stats/<i>``) every
        :data:`TABLE_STATS_EVERY` seconds while they change: ``pdps status`` sums them.
        Never on the push path."""
        last = None
        while not self._halted.wait(TABLE_STATS_EVERY):
            last = self._put_table_stats(last)

    def _put_table_stats(self, last: dict | None = None) -> dict | None:
        with self._cond:
            if not self._tables or self.index is None:
                return last
            stats = {name: rows.stats() for name, rows in self._tables.items()}
        if stats == last:
            return last
        try:
            record = {"at": time.time(), "incarnation": self.incarnation, "tables": stats}
            self._store.put(self._keys.table_stats(self.index), json.dumps(record).encode())
        except StoreError as exc:
            log.warning("pserver %s could not record its table stats: %s", self.index, exc)
            return last
        return stats

    def _checked_rows(self, req: PushRequest, slots: np.ndarray | None = None) -> list[tuple[str, object, object]]:
        """(Lock held) ``req``'s row sections, each checked by its table (ids, shapes,
        finite values, ownership) before anything is staged or applied: a trainer's ids
        in the slots this pserver is the primary of; a forward's in ``slots``."""
        sections = req.row_sections
        forward = isinstance(req, ReplicateRequest)
        for name, ids, grads in sections:
            self._table(name, req.trainer).check(ids, grads, req.trainer, finite=not forward, slots=slots if forward else self._row_primary)
            self.row_bytes += ids.nbytes + grads.nbytes  # type: ignore[attr-defined]
        return sections

    def _table(self, name: str, trainer: str, *, push: bool = True) -> RowShard:
        rows = self._tables.get(name)
        if rows is None:
            known = sorted(self._tables) or "none"
            error = GradientRejected if push else BadRequest
            raise error(f"trainer {trainer!r} named table {name!r}, which the job's model does not have (its tables: {known})", field="tables", trainer=trainer)
        return rows

    def _looked_up(self, req: PullRequest) -> list[object]:
        """(Lock held) the rows a pull asks for, per section (checked first)."""
        ids_of = req.tensors
        out = []
        for (name, _), ids in zip(req.tables or (), ids_of):
            rows = self._table(name, req.trainer, push=False)
            rows.check(ids, None, req.trainer, slots=self._row_primary)  # pulls are served by primaries
            out.append(rows.lookup(ids, key=req.trainer))  # kept for the trainer's push of the same ids
            self.row_bytes += out[-1].nbytes
        return out

    def _frozen_for(self, req: PullRequest) -> bool:
        """Sync: a pull of the round after which this pserver switched maps, computed for
        the map it switched from. The shard of that map is frozen at that round (nothing
        writes it any more; the slots it gave up are sent from it), so the pull is served
        from it at once: the trainer computes the next step while the receiving pservers
        fetch their slots, instead of waiting for them."""
        frozen = self._frozen
        return (
            frozen is not None and req.after_round == frozen[1] and req.version == frozen[0]
            and req.epoch in (None, self.epoch) and self.config.mode is Mode.SYNC
        )

    def _frozen_reply(self, req: PullRequest, extra: dict[str, object]) -> PullReply:
        assert self._frozen is not None
        shard, primary = self._frozen[2], self._frozen[3]
        indices = self._claim(req, shard.blocks, primary)
        views = shard.views()
        if indices is not None:
            views = [views[i] for i in indices]
        return PullReply(**self._state(), tensors=views, **extra)  # type: ignore[arg-type]

    # --- sync rounds ------------------------------------------------------------------

    def _wait_round_closed(self, round_no: int, epoch: int, patience: float) -> bool:
        """Wait (lock held) until ``round_no`` is applied here; False if ``patience`` ran out."""
        start = last_log = time.monotonic()
        self._waiters += 1
        self._closer.notify_all()  # a pull waits: the round-closing thread looks again if it seemed stuck
        try:
            while self.round_no <= round_no:
                if self.state in HALTED:
                    raise TransportError(f"pserver {self.index} stopped while round {round_no} was open")
                if self.epoch != epoch:
                    raise EpochChanged(f"pserver {self.index} rolled back to epoch {self.epoch} while round {round_no} was open")
                if self._advance(round_no):
                    continue
                now = time.monotonic()
                if now - start >= patience:
                    return False
                if now - last_log >= WAIT_LOG_EVERY:
                    last_log = now
                    log.warning("pserver %s: round %d waiting %.0fs for trainers %s", self.index, round_no, now - start, sorted(self._waiting or ()))
                # woken when the round is applied (by the round-closing thread or another pull)
                self._cond.wait(min(WAIT_LOG_EVERY, max(0.0, patience - (now - start))))
            return True
        finally:
            self._waiters -= 1

    def _advance(self, round_no: int) -> bool:
        """Close ``round_no`` if every participant committed, and apply it once it is
        closed (by us or another pserver). True once it is applied here.

        Who has committed comes from the watch on ``rounds/``, so a pull that finds the
        round still waiting costs no store read. The round's keys are read (one range)
        to close it and to apply it, and when it has looked stuck for MEMBERS_FRESH (a
        watch may miss an event; twice as long after each such read that found nothing
        new, up to STUCK_LONGEST). One pserver per round (the pservers holding part of the model in turn) closes it
        as soon as it is ready; the others close it only if it still is not closed after
        MEMBERS_FRESH (that pserver may be gone), so a round costs one close, not one
        race per pserver."""
        if self._pending and round_no in self._marked:
            return False  # closed, and applied here once the slots being received are in
        stuck = time.monotonic() - self._round_read >= self._stuck_after
        if round_no not in self._marked and not stuck and not (self._ready_by_watch(round_no) and self._closes(round_no)):
            return False
        try:
            record = read_modify_write(
                self._store, lambda: self._read_round(round_no, fresh=stuck), self._decide_close, what=f"pserver {self.index} closing round {round_no}"
            )
            if record is _CLOSED_HERE:
                if round_no >= self.config.keep_rounds:
                    self._store.delete_prefix(self._keys.round(self.epoch, round_no - self.config.keep_rounds))
                record = self._read_round(round_no, fresh=False)  # with any contribution that landed before the marker
        except StoreError as exc:
            log.warning("pserver %s could not read round %d (%s); it stays open", self.index, round_no, exc)
            return False
        if record is None or not record.closed:
            return False
        if record.map_version is not None and self._preparing == record.map_version:
            self._await_prepared(record.map_version)  # before the round is applied: nothing moves meanwhile
            if self.round_no != round_no:
                return True  # applied by another thread while this one waited
        if self._pending:  # receiving slots (a resize): their gradients are staged; apply once they are in
            self._marked.add(round_no)
            return False
        self._apply_round(record)
        return True

    def _ready_by_watch(self, round_no: int) -> bool:
        """Whether, as the watch on ``rounds/`` tells, ``round_no`` can close."""
        seen = self._seen.get(round_no, set())
        if self._waiting is None:
            self._waiting = participants(self._live(fresh=False), self._prev) - seen
        return bool(seen) and (not self._waiting or self._job_done())

    def _close_rounds(self) -> None:
        """Sync, on its own thread: close the open round (if this pserver closes it) and
        apply it as soon as the watch says it can, whether or not a pull waits here (a
        trainer pulls its pservers one after another where the transport is not
        concurrent)."""
        with self._cond:
            while self.state not in HALTED:
                round_no = self.round_no
                # a pserver that holds no slot applies nothing; one a resize adds waits for its place in the rounds
                ready = self.state is PserverState.SERVING and self._shard is not None and self._placed
                # stuck: open a while with someone in it, where a watch may have missed an event
                stuck = time.monotonic() - self._round_read >= self._stuck_after and (self._waiters or self._seen.get(round_no))
                if ready and (round_no in self._marked or self._ready_by_watch(round_no) or stuck):
                    try:
                        self._advance(round_no)
                    except PdpsError as exc:  # the round's gradients are missing here: a rollback is on its way
                        log.warning("pserver %s could not apply round %d: %s", self.index, round_no, exc)
                if self.round_no == round_no:
                    self._closer.wait(POLL)

    def _closes(self, round_no: int) -> bool:
        """Whether this pserver closes ``round_no`` as soon as it is ready: the pservers
        that hold some of the model take the rounds in turn."""
        return bool(self._closers) and self._closers[round_no % len(self._closers)] == self.index

    def _read_round(self, round_no: int, *, fresh: bool) -> RoundRecord | None:
        """The round's keys, as a record; what it says replaces what the watch told."""
        record = read_round(self._store, self._keys, self.epoch, round_no)
        self._round_read = time.monotonic()
        if record is not None and not record.closed:
            told = self._seen.get(round_no, set())
            members = set(self._members)
            self._seen[round_no] = set(record.contributions)
            self._waiting = record.waiting_for(participants(self._live(fresh=fresh), self._prev))
            if fresh and told == self._seen[round_no] and members == self._members:
                self._stuck_after = min(2 * self._stuck_after, STUCK_LONGEST)  # the watches missed nothing
        return record

    def _decide_close(self, record: RoundRecord | None) -> Decision:
        """Close the round if it is ready: write its marker (once: a marker another
        pserver wrote first fails the guard, and the round is read again, closed)."""
        if record is None:
            return Done(None)  # nobody committed yet
        if record.closed:
            return Done(record)
        if self._keeper is not None and not self._keeper.held:
            return Done(None)  # fenced: what it would write with the marker (a flip, a checkpoint) may be stale
        waiting = record.waiting_for(participants(self._members, self._prev))
        if waiting and not (record.contributions and self._job_done()):
            return Done(None)
        round_no = record.round_no
        ckpt = self._checkpoint_due(round_no)
        marker = self._keys.round_closed(self.epoch, round_no)
        flip = self._flip_due()
        ops: list[TxnOp] = [Put(marker, json.dumps(record.close(ckpt, None if flip is None else flip.version).marker_json()).encode())]
        if flip is not None:  # a resize: every pserver switches maps once it has applied this round
            ops.append(Put(self._keys.slotmap, json.dumps(flip.to_json()).encode()))
            since = {"version": flip.version, "epoch": self.epoch, "round": round_no + 1}
            ops.append(Put(self._keys.slotmap_since, json.dumps(since).encode()))
        if ckpt is not None:
            ops.append(recovery.announce(self._keys, ckpt, self.epoch, round_no + 1, "sync", self._live_pservers()))
        return Write((Compare.absent(marker),), ops, result=_CLOSED_HERE)

    def _live(self, *, fresh: bool) -> set[str]:
        """The registered trainers: the watch-fed set, or (``fresh``) read from the store."""
        if fresh:
            self._members = {self._keys.trainer_id(t.key) for t in self._store.range(self._keys.trainers)}
            self._members_read = time.monotonic()
        return self._members

    def _job_done(self) -> bool:
        """Once the job is done, a round waits for nobody: trainers that got no more
        tasks have stopped stepping, whether or not they have left yet."""
        if time.monotonic() - self._state_read >= MEMBERS_FRESH:
            self._state_read = time.monotonic()
            kv = self._store.get(self._keys.state)
            self._done = kv is not None and says_done(kv.value, kv.key)
        return self._done

    def _on_state_event(self, event: WatchEvent) -> None:
        if event.key != self._keys.state:
            return
        with self._cond:
            self._done = event.type is EventType.PUT and event.value is not None and says_done(event.value, event.key)
            if self._done:
                self._closer.notify_all()  # a round waiting on trainers that have stopped can close

    def _apply_round(self, record: RoundRecord) -> None:
        assert self._shard is not None
        weights = record.weights_to_apply()
        row_weights = weights if self._tables else []
        if not self._shard.blocks:
            weights = []  # no block of the model is here (a pserver a resize adds or lets go, or one holding rows only)
        missing = [t for t, _ in weights if t not in self._shard.staged()]
        if missing:
            # Only a pserver that lost its state can lack a committed gradient; the job
            # must roll back rather than apply a partial step.
            reason = f"pserver {self.index} lacks the committed gradients of {missing} for round {record.round_no}"
            log.error("%s", reason)
            self._move(PserverEvent.ROLL_BACK)
            threading.Thread(target=self._request_rollback, args=(reason, self.epoch), daemon=True).start()
            raise EpochChanged(reason)
        rows_applied = False
        for rows in self._tables.values():
            rows_applied = rows.apply_staged(row_weights) or rows_applied  # a table the round used moves its step
            rows.unstage()
        if weights:
            self._shard.apply_staged(weights)
        if weights or rows_applied:
            self.version += 1
            for c in record.contributions.values():
                if c.samples and c.task is not None and c.attempt is not None:
                    self._note_applied(c.task, c.attempt, c.start, c.offset)
        self._shard.unstage()
        for t in self._gone - set(record.contributions):
            self._shard.unstage(t, forget=True)
            for rows in self._tables.values():
                rows.unstage(t, forget=True)
        self._gone &= set(record.contributions)
        self._prev = set(record.contributions)
        self.round_no = record.round_no + 1
        self._waiting = None
        self._round_read, self._stuck_after = time.monotonic(), MEMBERS_FRESH
        for r in [r for r in self._seen if r <= record.round_no]:
            del self._seen[r]
        self._marked = {r for r in self._marked if r > record.round_no}
        if record.checkpoint is not None:
            self._round_checkpoint = (record.round_no, record.checkpoint)
            self._window_wanted = None  # whoever closed the round took the checkpoint a window asked for
            if self._in_checkpoint(None):
                self._snapshot(record.checkpoint)
        self._frozen = None  # a round applied after a switch: the frozen shard is past
        if record.map_version is not None and self._slot_map is not None and record.map_version > self._slot_map.version:
            before = (self._slot_map.version, self._shard, self._primary)
            self._switch_map(read_map(self._store, self._keys))
            if before[1] is not None and before[1].initialized:
                # (the same shard when this pserver kept every copy it held: nothing writes it
                # before the next round, which no trainer can push to before pulling this one)
                self._frozen = (before[0], record.round_no, before[1], before[2])
        self._cond.notify_all()
        self._closer.notify_all()  # the next round may be closable already

    def _on_round_event(self, event: WatchEvent) -> None:
        """A contribution or a close marker was written: note it, and wake the
        round-closing thread when the open round can close or has closed."""
        if event.type is not EventType.PUT:
            return  # old rounds being dropped
        entry = self._keys.round_entry(event.key)
        if entry is None:
            return
        epoch, round_no, trainer = entry
        with self._cond:
            if not self._placed and epoch == self.epoch:
                # rounds before this one were the old map's, which gave this pserver nothing
                self.round_no, self._placed, self._waiting = max(self.round_no, round_no), True, None
            if epoch != self.epoch or round_no < self.round_no:
                return
            if trainer is None:
                self._marked.add(round_no)
            else:
                self._seen.setdefault(round_no, set()).add(trainer)
                if round_no != self.round_no or (self._waiting is not None and trainer not in self._waiting):
                    return
                if self._waiting is not None:
                    self._waiting.discard(trainer)
                    if self._waiting:
                        return
                    # ready: the pserver that closes this round has MEMBERS_FRESH to do it before the others do
                    self._round_read, self._stuck_after = time.monotonic(), MEMBERS_FRESH
            if round_no == self.round_no:
                self._closer.notify_all()

    def _on_trainer_event(self, event: WatchEvent) -> None:
        trainer = self._keys.trainer_id(event.key)
        with self._cond:
            self._waiting = None  # the participants may have changed
            if event.type is EventType.DELETE:
                self._members.discard(trainer)
                if self.config.mode is Mode.SYNC:
                    self._gone.add(trainer)  # its staged gradient goes once no round names it
                elif self._shard is not None:
                    self._shard.unstage(trainer, forget=True)  # a step it never ended
                self._closer.notify_all()  # the round may be ready now
            else:
                self._members.add(trainer)

    # --- checkpoints ------------------------------------------------------------------

    def _on_checkpoint_wanted(self, event: WatchEvent) -> None:
        """A streaming job's window closed and ``checkpoint_windows`` wants a checkpoint
        after it: due at the next round closed (sync) or update (async, pserver 0)."""
        if event.type is EventType.PUT:
            with self._cond:
                self._window_wanted = event.value

    def _checkpoint_due(self, round_no: int) -> str | None:
        """Sync: the id of a checkpoint to take right after ``round_no``, if one is due."""
        cfg = self.config
        if not cfg.checkpoints or self._files is None:
            return None
        by_count = cfg.checkpoint_every and (round_no + 1) % cfg.checkpoint_every == 0
        by_time = cfg.checkpoint_seconds and time.monotonic() - self._last_checkpoint >= cfg.checkpoint_seconds
        if not (by_count or by_time or self._window_wanted) or self._writing():
            return None
        return recovery.new_checkpoint_id(self.epoch, round_no + 1)

    def _maybe_announce_async(self) -> None:
        """Async: pserver 0 announces a checkpoint every ``checkpoint_every`` updates or
        ``checkpoint_seconds``; every role snapshots when it sees the announcement."""
        cfg = self.config
        if self.index != 0 or not cfg.checkpoints or self._files is None:
            return
        if self._resize is not None and self._resize.active:
            return  # a resize moves slots: a checkpoint waits, so no slot is in it twice or not at all
        by_count = cfg.checkpoint_every and self.version % cfg.checkpoint_every == 0
        by_time = cfg.checkpoint_seconds and time.monotonic() - self._last_checkpoint >= cfg.checkpoint_seconds
        if not (by_count or by_time or self._window_wanted) or self._writing():
            return
        self._last_checkpoint, self._window_wanted = time.monotonic(), None
        ckpt = recovery.new_checkpoint_id(self.epoch, self.version)
        try:
            self._store.commit((Compare.absent(self._keys.checkpoint_info(ckpt)),), (recovery.announce(self._keys, ckpt, self.epoch, self.version, "async", self._live_pservers()),))
        except StoreError as exc:
            log.warning("pserver 0 could not announce checkpoint %s: %s", ckpt, exc)

    def _writing(self) -> bool:
        """This pserver is still writing a part: a checkpoint due now is skipped rather
        than queued, so slow storage never piles copies of the shard up in memory."""
        return any(w.is_alive() for w in self._writers)

    def _on_checkpoint_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.PUT or not event.key.endswith("/info"):
            return
        try:
            info = decode_json(event.value, event.key)
        except CorruptRecord:
            return
        with self._cond:
            ckpt = str(info.get("id"))
            if info.get("state") != "writing" or int(info.get("epoch", -1)) != self.epoch or ckpt in self._seen_checkpoints:
                return
            if self._shard is None or not self._shard.initialized or self.state is not PserverState.SERVING or self._pending:
                return
            if not self._in_checkpoint(info.get("pservers")):
                return
            self._snapshot(ckpt)

    def _in_checkpoint(self, pservers: object) -> bool:
        """Whether this pserver writes a part of a checkpoint announced in a slot map of
        ``pservers`` pservers (None: in this pserver's map, as a sync round's is). One a
        grow has started, beyond that map, writes none: the checkpoint commits with one
        part per pserver of its map, no more and no fewer, so an extra part kept every
        checkpoint from committing (and the resize, which waits for a checkpoint being
        written, from starting) until the map grew."""
        if self.index is None:
            return False
        if not isinstance(pservers, int) or isinstance(pservers, bool):
            pservers = None if self._slot_map is None else self._slot_map.num_pservers
        return pservers is None or self.index < pservers

    def _snapshot(self, ckpt_id: str) -> None:
        """Copy this shard's state now (lock held) and write it in the background."""
        assert self._shard is not None
        self._seen_checkpoints.add(ckpt_id)
        self._last_checkpoint = time.monotonic()
        # with replicas, each block and each slot's rows are written by its primary only (once
        # per checkpoint)
        state = self._shard.snapshot({"pdps.version": self.version}, self._primary)
        for rows in self._tables.values():
            state.update(rows.snapshot(self._my_slots))  # copies: rows move on while the part is written
        t = threading.Thread(target=self._write_part, args=(ckpt_id, state), name=f"pdps-ckpt-{ckpt_id}", daemon=True)
        self._writers = [w for w in self._writers if w.is_alive()] + [t]
        t.start()

    def _write_part(self, ckpt_id: str, state: dict) -> None:
        import os

        assert self._files is not None and self.index is not None
        try:
            began = time.monotonic()
            part = recovery.write_shard_part(self._files, ckpt_id, self.index, state)
            with self._cond:
                self.checkpoint_parts += 1
                self.checkpoint_seconds += time.monotonic() - began
            delay = float(os.environ.get(CHECKPOINT_DELAY_ENV, "0") or 0)
            if delay:
                time.sleep(delay)
            if self.state is PserverState.CRASHED:
                return  # a dead process records nothing
            if self._keeper is not None and not self._keeper.held:
                log.error("pserver %s does not record its part of checkpoint %s: its lease may have run out (a backup may hold its slots now)", self.index, ckpt_id)
                return
            if recovery.record_part(self._store, self._keys, ckpt_id, part):
                recovery.try_commit(self._store, self._files, self.config, ckpt_id)
        except PdpsError as exc:
            log.error("pserver %s could not write its part of checkpoint %s: %s", self.index, ckpt_id, exc)

    # --- rollbacks --------------------------------------------------------------------

    def _rollback(self, reason: str, since: int | None = None) -> Epoch:
        return recovery.rollback(self._store, self._files, self._keys, reason, grace=self.config.checkpoint_orphan_grace, since=since)

    def _request_rollback(self, reason: str, since: int) -> None:
        """Ask for a rollback because of what this pserver saw in epoch ``since``: a no-op
        once the job has left that epoch (a rollback meanwhile restored everything, e.g. a
        source's restart, whose lost slots a migration call of the old epoch reports late)."""
        if self._keeper is not None and not self._keeper.held:
            # its index may be someone else's by now (a backup promoted in its place): what
            # it lacks is no reason for the job to roll back
            log.error("pserver %s may have lost its lease; not asking for a rollback (%s)", self.index, reason)
            return
        try:
            self._rollback(reason, since)
        except PdpsError as exc:
            log.error("pserver %s could not start a rollback (%s): %s", self.index, reason, exc)

    def _on_epoch_event(self, event: WatchEvent) -> None:
        if event.type is not EventType.PUT:
            return
        try:
            epoch = Epoch.from_json(decode_json(event.value, event.key))
        except (CorruptRecord, KeyError, TypeError, ValueError):
            log.error("pserver %s ignores an undecodable epoch record %r", self.index, event.value[:200])
            return
        self._enter_epoch(epoch)

    def _enter_epoch(self, epoch: Epoch) -> None:
        """Drop the open round and load this pserver's part of the epoch's checkpoint."""
        with self._cond:
            if self.state in HALTED or epoch.epoch < self.epoch or (epoch.epoch == self.epoch and self.state is PserverState.SERVING):
                return  # a late event, or an epoch entered already
            self.epoch, self.round_no, self._prev, self._placed = epoch.epoch, epoch.round, None, True
            self._seen, self._marked, self._waiting = {}, set(), None
            self._round_read, self._stuck_after = time.monotonic(), MEMBERS_FRESH
            self._move(PserverEvent.LOAD)
            self._round_checkpoint = None
            self._outgoing.clear()  # every pserver loads its slots of the map it serves from the checkpoint
            self._outgoing_rows.clear()
            self._frozen = None
            self._outgoing_applied.clear()
            self._outgoing_forwarded.clear()
            self._copied.clear()
            self._pending, self._received = {}, {}
            self._marks.clear()  # the parameters go back: so does what they hold
            self._ledger.clear()
            self.rollbacks += 1
            self._cond.notify_all()  # waiting pulls end with EpochChanged
            self._closer.notify_all()
            try:
                shard = self._ensure_shard()
            except NotReady:
                shard = None  # no trainer ever attached: nothing to restore
            if shard is not None:
                shard.unstage()
                self._tables = self._build_tables()  # empty: rows start from init, or from the checkpoint
                if epoch.checkpoint is None:
                    shard.initialized = False  # a trainer initializes it again with its values
                else:
                    self.version = self._load_part(epoch.checkpoint, shard)
            self._last_checkpoint = time.monotonic()
            self._move(PserverEvent.SERVE)
            self._cond.notify_all()
            r = self._resize  # a rollback in the middle of a resize: the checkpoint gave this pserver its slots
            receiving = r is not None and r.active and r.to_map is not None and self._slot_map is not None and r.to_map.version == self._slot_map.version and self.index in r.receivers()
            got = self._slot_map.version if receiving and self._slot_map is not None else None
        self._report_got(got)
        log.warning("pserver %s entered epoch %d from %s", self.index, epoch.epoch, epoch.checkpoint or "scratch")

    def _load_part(self, ckpt_id: str, shard: ParameterShard) -> int:
        assert self._files is not None and self.index is not None
        files = self._files

        def load() -> int:
            version = recovery.load_shard(self._store, files, self.config, ckpt_id, shard, self._tables)
            log.info("pserver %s loaded checkpoint %s (version %d)", self.index, ckpt_id, version)
            return version

        return retry(
            load,
            on=(StorageError, KeyError),
            policy=LOAD_BACKOFF,
            attempts=LOAD_ATTEMPTS,
            waiting=lambda exc, _: log.warning("pserver %s: loading checkpoint %s failed (%s); retrying", self.index, ckpt_id, exc),
            giving_up=lambda exc, _: StorageError(f"pserver {self.index} cannot load its part of checkpoint {ckpt_id}: {exc}"),
        )

    def _restore_own_slots(self) -> None:
        """Async ``restore="lost"``: reload only this pserver's part; the others go on."""
        manifest = recovery.choose(self._store, self._files, self._keys) if self._files is not None else None
        with self._cond:
            self._move(PserverEvent.LOAD)
            if manifest is not None:
                self.version = self._load_part(manifest.id, self._ensure_shard())
                log.warning("pserver %s restored its own slots from checkpoint %s; the other pservers keep theirs", self.index, manifest.id)
            else:
                log.warning("pserver %s restarted with no checkpoint to restore; a trainer will initialize it with its values", self.index)
            self._move(PserverEvent.SERVE)

    # --- resizing ---------------------------------------------------------------------

    def _flip_due(self) -> SlotMap | None:
        """Sync: the map a resize switches to at the round being closed, if one waits:
        once every pserver of it has built its shard ahead (a round is not held up by
        one being built), or READY_PATIENCE after the resize began migrating."""
        r = self._resize
        if r is None or r.state is not ResizeState.MIGRATING or r.to_map is None or r.from_map is None or self._slot_map is None:
            return None
        if r.from_map.version != self._slot_map.version:
            return None
        version = r.to_map.version
        building = {p for p in range(r.to_map.num_pservers) if r.to_map.held_by(p)}  # a pserver holding nothing builds nothing
        if building <= self._ready.get(version, set()):
            return r.to_map
        since = self._migrating_since
        if since is None or since[0] != version:
            self._migrating_since = since = (version, time.monotonic())
        if time.monotonic() - since[1] >= READY_PATIENCE:
            log.warning("pserver %s switches to slot map version %d although pservers %s have not said their shard is built", self.index, version, sorted(building - self._ready.get(version, set())))
            return r.to_map
        return None

    def _on_resize_event(self, event: WatchEvent) -> None:
        if event.type is EventType.PUT and event.key.startswith(self._keys.root + "resize_ready/"):
            version, index = event.key.rsplit("/", 2)[-2:]
            if version.isdigit() and index.isdigit():
                with self._cond:
                    self._ready.setdefault(int(version), set()).add(int(index))
                    self._closer.notify_all()
            return
        if event.type is not EventType.PUT or event.key != self._keys.resize:
            return
        try:
            resize = decode_as(event.value, event.key, Resize.from_json)
        except CorruptRecord as exc:
            log.error("pserver %s ignores a resize record it cannot read: %s", self.index, exc)
            return
        with self._cond:
            self._resize = resize
            if resize.state is ResizeState.MIGRATING:
                self._closer.notify_all()  # the next round's closer flips the map
                self._start_preparing(resize)
            if resize.state is not ResizeState.DONE or resize.to_map is None:
                return
            for v in [v for v in self._outgoing_rows if v <= resize.to_map.version]:
                del self._outgoing_rows[v]
            for v in [v for v in self._outgoing if v <= resize.to_map.version]:
                del self._outgoing[v]  # every receiver has its slots
                self._outgoing_applied.pop(v, None)
                self._outgoing_forwarded.pop(v, None)
            leaving = self.index is not None and self.index >= resize.to_map.num_pservers and self._slot_map is not None and self._slot_map.version >= resize.to_map.version
        if leaving:
            log.warning("pserver %s handed its slots off (%s); leaving the job", self.index, resize.id)
            self.departed.set()
            # stop from a thread of its own: stopping cancels this very watch
            threading.Thread(target=self.stop, name=f"pdps-ps-leave-{self.index}", daemon=True).start()

    def _start_preparing(self, resize: Resize) -> None:
        """A resize is migrating (lock held): build the shard of its map ahead of the switch."""
        to_map = resize.to_map
        if to_map is None or self._slot_map is None or to_map.version <= self._slot_map.version:
            return
        if self._specs is None:  # a pserver the resize adds has held nothing yet
            model = self._store.get(self._keys.model)
            if model is None:
                return  # no model: the master switches the map at once
            self._specs = decode_as(model.value, model.key, lambda ds: [ParamSpec.from_json(d) for d in ds])
        if self._preparing == to_map.version or (self._prepared is not None and self._prepared[0] == to_map.version):
            return
        self._preparing = to_map.version
        self._ready.setdefault(to_map.version, set()).update(int(kv.key.rsplit("/", 1)[1]) for kv in self._store.range(self._keys.resize_ready(to_map.version)))
        threading.Thread(target=self._prepare, args=(to_map, set(self._members)), name=f"pdps-ps-prepare-{self.index}", daemon=True).start()

    def _prepare(self, to_map: SlotMap, trainers: set[str]) -> None:
        """Build the shard of ``to_map`` before the switch, off the lock, with its buffers
        touched and a staging buffer per trainer (building those of a large model takes
        seconds while training runs; at the switch it would pause every trainer), then
        say so in the store (``resize_ready``): the switch waits for every pserver's."""
        assert self._specs is not None and self.index is not None
        built = False
        try:
            layout = Layout.build(self._specs, to_map, self.config.min_block)
            shard = self._compute.shard(layout.blocks_held(self.index), self.config.optimizer, self.config.optimizer_args)
            shard.reserve(trainers)
            built = True
        finally:
            with self._cond:
                self._preparing = None
                self._cond.notify_all()
        with self._cond:
            if built and self._slot_map is not None and self._slot_map.version < to_map.version:
                self._prepared = (to_map.version, layout, shard)
                self._cond.notify_all()
        try:
            self._store.put(self._keys.resize_ready(to_map.version, self.index), b"{}")
        except StoreError as exc:
            log.warning("pserver %s could not say its shard of slot map version %d is built (%s); the switch waits a while for it", self.index, to_map.version, exc)

    def _await_prepared(self, version: int) -> None:
        """Wait (lock held, released while waiting) for the shard of map ``version`` being
        built ahead, rather than building it a second time under the lock."""
        deadline = time.monotonic() + PREPARE_WAIT
        while self._preparing == version and self.state not in HALTED and time.monotonic() < deadline:
            self._cond.wait(max(0.0, deadline - time.monotonic()))

    def _on_slotmap_event(self, event: WatchEvent) -> None:
        """A new map: async pservers switch at once. Sync ones switch at the round
        boundary the close marker names, or here while they hold no parameters yet."""
        if event.type is not EventType.PUT or event.key != self._keys.slotmap:
            return
        try:
            new = decode_as(event.value, event.key, SlotMap.from_json)
        except CorruptRecord as exc:
            log.error("pserver %s ignores a slot map it cannot read: %s", self.index, exc)
            return
        with self._cond:
            if self.config.mode is Mode.ASYNC or self._store.get(self._keys.initialized) is None:
                self._switch_map(new)
            elif self._slot_map is not None and new.version > self._slot_map.version and not self._slot_map.moves(new) and new.num_pservers == self._slot_map.num_pservers:
                # a failover (replicas): a dead pserver's copies dropped, a backup now the
                # primary of its slots; no copy moves, so mid-round is as good as any time
                self._switch_map(new)
            elif not self._placed:
                self._follow_since()
            elif not self._live(fresh=True):
                # sync with no trainer to close a round (the master flipped the map itself):
                # apply what the rounds closed, then switch here
                while self._placed and self._shard is not None and self._advance(self.round_no):
                    pass
                self._switch_map(new)

    def _follow_since(self) -> None:
        """Sync, a pserver a resize adds, not yet placed in the rounds (lock held): if the
        map that gives it slots is live already, switch to it and take its place at the
        round that map begins with (``slotmap_since``, written with the switching round's
        close marker); the rounds before it were the old map's, which gave it nothing."""
        live = read_map(self._store, self._keys)
        kv = self._store.get(self._keys.slotmap_since)
        since = None if kv is None else decode_json(kv.value, kv.key)
        if self._slot_map is None or live.version <= self._slot_map.version:
            return
        if isinstance(since, dict) and since.get("version") == live.version and since.get("epoch") == self.epoch:
            self.round_no, self._placed, self._waiting = max(self.round_no, int(since["round"])), True, None
            self._switch_map(live)
        elif not self._live(fresh=True):
            self._switch_map(live)  # switched with no round (no trainer left): placed by the next round it sees

    def _switch_map(self, new: SlotMap) -> None:
        """Serve ``new`` from now on (lock held). The blocks this pserver gives up are kept
        aside (aliasing the old shard, which nothing writes any more) for their receivers;
        those it keeps go into a new shard; those it receives are fetched from their old
        owners, and until they are all here it serves no parameters. The rows of the
        model's tables follow the map the same way (:meth:`_move_rows`), every slot
        moving with its rows."""
        old = self._slot_map
        if old is None or new.version <= old.version or self.index is None:
            return
        # The shard of ``new`` built ahead, waited for (the lock released meanwhile) before
        # anything here says ``new`` is served: a migrate call for ``new`` that came in the
        # wait would otherwise find the map switched and nothing set aside for it yet.
        self._await_prepared(new.version)
        old = self._slot_map
        if old is None or new.version <= old.version:
            return  # another thread switched while this one waited
        if self._shard is None:
            try:
                self._ensure_shard()  # the shard of the old map: empty for a pserver the resize adds
            except NotReady:
                pass
        self._slot_map = new
        log.warning("pserver %s switches from slot map version %d (%d pservers) to %d (%d pservers)", self.index, old.version, old.num_pservers, new.version, new.num_pservers)
        got = None
        if self._shard is None or self._specs is None:
            got = new.version  # no model yet: nothing to hand over
        elif (
            [b.key for b in Layout.build(self._specs, new, self.config.min_block).blocks_held(self.index)] == [b.key for b in self._shard.blocks]
            and not any(self.index in (src, dst) for _, src, dst in old.moves(new))
        ):
            # this pserver holds the same copies and makes none anew (a failover promoted a
            # backup, or dropped another pserver's): the shard, staged gradients and all, stays
            self._use_layout(Layout.build(self._specs, new, self.config.min_block))
        else:
            before = self._shard
            if not before.blocks and not before.initialized and self._store.get(self._keys.initialized) is not None:
                before.import_blocks({})  # nothing of the model was here: nothing is missing either
            prepared, self._prepared = self._prepared, None
            if prepared is None or prepared[0] != new.version:
                prepared = None
            layout = Layout.build(self._specs, new, self.config.min_block) if prepared is None else prepared[1]
            slot_of = {b.key: slot for b, slot in zip(layout.blocks, layout.slots)}
            mine = {b.key for b in layout.blocks_held(self.index)}
            keep = [i for i, b in enumerate(before.blocks) if b.key in mine]
            # what each new copy of a slot is made from (with replicas, a pserver may give a
            # copy of a slot it keeps)
            sending = {slot for slot, src, _ in old.moves(new) if src == self.index}
            give = [i for i, b in enumerate(before.blocks) if slot_of[b.key] in sending]
            self._use_layout(layout)
            self._shard = self._compute.shard(self._blocks(), self.config.optimizer, self.config.optimizer_args) if prepared is None else prepared[2]
            self._pending, self._received = {}, {}
            if before.initialized:
                outgoing: dict[int, dict[str, object]] = {}
                for i in give:
                    outgoing.setdefault(slot_of[before.blocks[i].key], {}).update(before.export_blocks([i]))
                counted = set(outgoing) | (sending if self._tables else set())  # a slot of rows only counts its pushes too
                if counted:
                    if outgoing:
                        self._outgoing[new.version] = outgoing
                    kept = {slot_of[k] for k in mine}
                    self._outgoing_applied[new.version] = {
                        slot: self.applied_by_slot.get(slot, 0) if slot in kept else self.applied_by_slot.pop(slot, 0) for slot in sorted(counted)
                    }
                    self._outgoing_forwarded[new.version] = dict(self._sent_seq)
                self._received = dict(before.export_blocks(keep))
                has_blocks = {slot_of[b.key] for b in self._shard.blocks}
                for slot, src, dst in old.moves(new):
                    if dst == self.index and (slot in has_blocks or self._tables):  # every slot holds rows
                        self._pending.setdefault(src, []).append(slot)
            self._move_rows(new, sending, send=before.initialized)
            if self._pending:
                # sync pushes are staged while the slots come (the round applies once they are in)
                self._shard.expect_import()
                threading.Thread(target=self._fetch, args=(new.version, self.epoch), name=f"pdps-ps-fetch-{self.index}", daemon=True).start()
            else:
                if before.initialized:
                    self._shard.import_blocks(self._received)
                self._received = {}
                got = new.version
        self._waiting = None
        self._cond.notify_all()  # waiting pulls look at the map again
        self._closer.notify_all()
        if got is not None and any(dst == self.index for _, _, dst in old.moves(new)):  # only receivers report
            threading.Thread(target=self._report_got, args=(got,), daemon=True).start()

    def _move_rows(self, new: SlotMap, sending: set[int], *, send: bool) -> None:
        """(Lock held, switching to ``new``) the row stores follow the map: the rows of the
        slots this pserver gives up are copied aside for their receivers (``send``: the
        job has values; kept until the resize is done) and dropped from the stores, so a
        section of one of those ids is refused here from now on; the slots it receives
        are held (their rows come through :meth:`_fetch`; a push for them is staged
        meanwhile)."""
        if not self._tables:
            return
        assert self.index is not None
        mine = set(new.held_by(self.index))  # every copy: a backup's rows are its primary's
        if send and sending:
            self._outgoing_rows[new.version] = _LeavingRows.of(self._tables, sorted(sending))
        for rows in self._tables.values():
            held = rows.slots
            rows.drop_slots(sorted(held - mine))
            rows.hold(sorted(mine - held))

    def _drop_own_copies(self) -> bool:
        """A restarted pserver (replicas, sync) that the live map still names as a holder:
        its copies are gone, and every slot it held has another one. Drop it from them in
        the store (as the master does when its claim expires), so the job carries on
        without a rollback and the master makes the missing copies again, here. True
        once the live map gives it nothing."""
        while True:
            kv = self._store.get(self._keys.slotmap)
            assert kv is not None and self.index is not None
            live = decode_as(kv.value, kv.key, SlotMap.from_json)
            if not live.held_by(self.index):
                self._slot_map = live
                return True
            if live.lost_with(self.index):
                return False
            ahead, found = read_resize(self._store, self._keys)
            guards = [Compare.unchanged(self._keys.slotmap, kv)]
            ops: list[TxnOp] = []
            if ahead is not None and ahead.active:
                # a re-replication whose only receiver this pserver was: dropped, and planned again
                dropped = ahead.without_receiver(live, self.index)
                if dropped is None:
                    return False  # a resize is planning on this map: a rollback restores it, as with one copy
                guards.append(Compare.unchanged(self._keys.resize, found))
                ops.append(Put(self._keys.resize, json.dumps(ahead.finish().to_json()).encode()))
            after = live.without(self.index)
            if self._store.commit(guards, [Put(self._keys.slotmap, json.dumps(after.to_json()).encode()), *ops]).succeeded:
                log.warning("pserver %s restarted without its copies; every slot it held has another (slot map version %d -> %d): no rollback%s",
                            self.index, live.version, after.version, f"; re-replication {ahead.id} is dropped, to be planned again" if ops else "")
                self._slot_map = after
                if ops:
                    self._store.delete_prefix(self._keys.resize_got(live.version))
                    self._store.delete_prefix(self._keys.resize_ready(live.version))
                return True

    def _migrate(self, req: MigrateRequest) -> MigrateReply:
        """Hand over the state ``slots`` had when this pserver switched to map ``version``."""
        delay = float(os.environ.get(MIGRATE_DELAY_ENV, "0") or 0)
        if delay:
            log.warning("pserver %s holds %s's migrate call for slots %s of slot map version %s %.1fs (fault injection)", self.index, req.trainer, list(req.slots[:8]), req.version, delay)
            time.sleep(delay)
        with self._cond:
            self._check_lease()
            if self._slot_map is None:
                raise NotReady(f"pserver {self.index} is starting")
            if self._slot_map.version < (req.version or 0):
                self._check_slot_map(req)  # not switched yet (NotReady), or a map that never was
            if req.row_offset is not None:
                return self._migrate_rows(req, req.row_offset)
            held = self._outgoing.get(req.version or 0, {})
            missing = [slot for slot in req.slots if slot not in held]
            if missing:
                raise NotInitialized(f"pserver {self.index} no longer holds slots {missing} of slot map version {req.version} (it restarted, or the job rolled back)")
            names: list[str] = []
            tensors: list[object] = []
            for slot in req.slots:
                for name, t in held.get(slot, {}).items():
                    names.append(name)
                    tensors.append(t)
            self.sent_bytes += sum(int(t.nbytes) for t in tensors)  # type: ignore[attr-defined]
            counts = self._outgoing_applied.get(req.version or 0, {})
            applied = tuple((slot, counts.get(slot, 0)) for slot in req.slots)
            forwarded = tuple(sorted(self._outgoing_forwarded.get(req.version or 0, {}).items()))
            return MigrateReply(**self._state(), names=tuple(names), applied=applied, forwarded=forwarded, tensors=tuple(tensors))

    def _migrate_rows(self, req: MigrateRequest, offset: int) -> MigrateReply:
        """(Lock held) a page of the rows of the one slot ``req`` names, as it was when
        this pserver switched to map ``req.version``: at most MIGRATE_CALL_BYTES of them
        from the ``offset``-th on, ``more`` if rows follow. The first page of a slot
        holding no block carries its async push count (a block's migration carries it
        otherwise)."""
        version = req.version or 0
        leaving = self._outgoing_rows.get(version)
        slot = req.slots[0]
        if leaving is None or slot not in leaving.slots:
            raise NotInitialized(f"pserver {self.index} no longer holds the rows of slot {slot} of slot map version {version} (it restarted, or the job rolled back)")
        names, tensors, more = leaving.page(slot, offset, MIGRATE_CALL_BYTES)
        self.sent_bytes += sum(int(t.nbytes) for t in tensors)  # type: ignore[attr-defined]
        with_blocks = slot in self._outgoing.get(version, {})
        counts = self._outgoing_applied.get(version, {})
        applied = ((slot, counts.get(slot, 0)),) if offset == 0 and not with_blocks and slot in counts else ()
        return MigrateReply(**self._state(), names=tuple(names), more=more, applied=applied, tensors=tuple(tensors))

    def _fetch(self, version: int, epoch: int) -> None:
        """Receive this pserver's new slots of map ``version`` from their old owners (one
        thread and one connection per source, reused for every call: a fresh gRPC
        connection starts with a small flow-control window), then start serving them
        (its own thread; ends early if the epoch or map moves)."""
        began = time.monotonic()
        with self._cond:
            sources = {src: list(slots) for src, slots in self._pending.items()}
            layout = self._layout
        assert layout is not None
        sizes = layout.slot_bytes()
        with_blocks = set(layout.slots)  # the slots holding some block of the model
        outcome: dict[int, object] = {}  # source -> bytes received, or why it stopped (None: the map moved on; _LOST)
        lost: list[str] = []

        def receive(src: int, slots: list[int]) -> None:
            batches: list[list[int]] = []
            for slot in (s for s in slots if s in with_blocks):
                if not batches or (batches[-1] and sum(sizes[x] for x in batches[-1]) + sizes[slot] > MIGRATE_CALL_BYTES):
                    batches.append([])
                batches[-1].append(slot)
            fetched, channel = 0, _Connection()
            try:
                for batch in batches:
                    reply = self._ask_source(src, batch, version, epoch, channel)
                    if reply is _LOST:
                        lost.append(f"pserver {self.index} cannot receive slots {batch[:8]} of slot map version {version}: pserver {src} lost them")
                        outcome[src] = _LOST
                        return
                    if not isinstance(reply, MigrateReply):
                        outcome[src] = None
                        return
                    with self._cond:
                        if self.epoch != epoch or self._slot_map is None or self._slot_map.version != version:
                            outcome[src] = None
                            return
                        self._received.update(zip(reply.names, reply.tensors))
                        for slot, n in reply.applied:
                            self.applied_by_slot[slot] = self.applied_by_slot.get(slot, 0) + n
                        for backup, seq in reply.forwarded:
                            if backup == self.index:  # the state received holds these forwards already
                                for key in (b.key for b, slot in zip(layout.blocks, layout.slots) if slot in batch):
                                    self._copied[key] = (src, reply.incarnation, seq)
                        got = sum(int(t.nbytes) for t in reply.tensors)
                        self.received_bytes += got
                        fetched += got
                for slot in slots if self._tables else ():
                    got = self._fetch_rows(src, slot, version, epoch, channel)
                    if not isinstance(got, int):
                        if got is _LOST:
                            lost.append(f"pserver {self.index} cannot receive the rows of slot {slot} of slot map version {version} from pserver {src}")
                        outcome[src] = got
                        return
                    fetched += got
                outcome[src] = fetched
            finally:
                channel.close()

        threads = [threading.Thread(target=receive, args=item, name=f"pdps-ps-fetch-{self.index}-from-{item[0]}", daemon=True) for item in sorted(sources.items())]
        for t in threads[1:]:
            t.start()
        if threads:
            threads[0].run()  # the first source on this thread
        for t in threads[1:]:
            t.join()
        if lost:
            # the job rolls back, and every pserver loads its slots of this map from the checkpoint
            self._request_rollback(lost[0], epoch)
            return
        if any(not isinstance(v, int) for v in outcome.values()):
            return  # the epoch or the map moved on: the checkpoint restores these slots
        fetched = sum(v for v in outcome.values() if isinstance(v, int))
        with self._cond:
            if self.epoch != epoch or self._slot_map is None or self._slot_map.version != version or self._shard is None:
                return
            self._shard.import_blocks(self._received)
            self._pending, self._received = {}, {}
            self._cond.notify_all()
            self._closer.notify_all()  # a round closed meanwhile can be applied now
        log.warning("pserver %s received its slots of slot map version %d (%d bytes) in %.2fs", self.index, version, fetched, time.monotonic() - began)
        self._report_got(version)

    def _fetch_rows(self, src: int, slot: int, version: int, epoch: int, channel: _Connection) -> object:
        """Receive the rows of ``slot`` from pserver ``src``, page after page, each
        imported into the row stores as it comes (nothing reads them before every slot
        is in): the bytes received; None once the epoch or map moved on; _LOST when the
        source lost them or sent what does not fit."""
        offset = fetched = 0
        while True:
            reply = self._ask_source(src, [slot], version, epoch, channel, row_offset=offset)
            if not isinstance(reply, MigrateReply):
                return reply
            entries = dict(zip(reply.names, reply.tensors))
            rows = sum(int(t.shape[0]) for key, t in entries.items() if (e := parse_row_entry(key)) is not None and e[2] == "ids")  # type: ignore[attr-defined]
            with self._cond:
                if self.epoch != epoch or self._slot_map is None or self._slot_map.version != version:
                    return None
                try:
                    for table in self._tables.values():
                        table.import_slots(entries)  # (entries of other tables are ignored)
                except ConfigError as exc:
                    log.error("pserver %s cannot import the rows of slot %d from pserver %d: %s", self.index, slot, src, exc)
                    return _LOST
                for s, n in reply.applied:
                    self.applied_by_slot[s] = self.applied_by_slot.get(s, 0) + n
                got = sum(int(t.nbytes) for t in reply.tensors)
                self.received_bytes += got
                fetched += got
            if not reply.more:
                return fetched
            if not rows:
                log.error("pserver %s: pserver %d says rows of slot %d follow row %d, but sent none", self.index, src, slot, offset)
                return _LOST
            offset += rows

    def _ask_source(self, src: int, slots: list[int], version: int, epoch: int, connection: _Connection, *, row_offset: int | None = None) -> object:
        """One migrate call to pserver ``src`` (over ``connection``), retried while it is
        unreachable or has not switched yet: its reply; None once this pserver's epoch
        or map has moved on; _LOST when the source restarted without the slots, or has
        been gone SOURCE_GONE lease TTLs (then the job must roll back) and no replacement
        of it would roll the job back by itself. ``row_offset``:
        a page of the one slot's rows (:meth:`_fetch_rows`)."""
        request = MigrateRequest(f"pserver-{self.index}", epoch=epoch, version=version, slots=tuple(slots), row_offset=row_offset)
        waiting = Retry(MIGRATE_BACKOFF)
        unregistered_since: float | None = None
        with self._cond:
            # A source the new map keeps, each of whose slots has one copy: its replacement
            # rolls the job back when it starts (and nothing trains without it meanwhile),
            # so its absence is waited out, not answered with a rollback of this pserver's
            # own: both would run when the replacement takes longer than SOURCE_GONE TTLs
            # to start (a busy machine), costing the job a second rollback for one death.
            m = self._slot_map
            restarts_roll_back = m is not None and m.version == version and m.replicas == 1 and src < m.num_pservers and bool(m.held_by(src))
        while True:
            gone = False
            with self._cond:
                if self.state in HALTED or self.epoch != epoch or self._slot_map is None or self._slot_map.version != version:
                    return None
            try:
                kv = self._store.get(self._keys.pserver(src))
                if kv is None:
                    gone = True
                    raise NotReady(f"pserver {src} is not registered")
                address = decode_as(kv.value, kv.key, lambda d: str(d["addr"]))
                try:
                    return calls.call(connection.to(self._transport, address), request)
                except TransportError:
                    connection.close()  # it may be broken: the next try connects afresh
                    raise
            except NotInitialized as exc:  # (a NotReady: caught first)
                log.error("pserver %s cannot receive slots %s: %s", self.index, slots[:8], exc)
                return _LOST  # the source restarted without them
            except (NotReady, TransportError, StoreError, EpochChanged) as exc:
                if waiting.elapsed >= WAIT_LOG_EVERY and waiting.failures % 10 == 0:
                    log.warning("pserver %s waits %.0fs for slots %s from pserver %d: %s", self.index, waiting.elapsed, slots[:8], src, exc)
                waiting.note()
                waiting.pause()
            if unregistered_since is None and gone:
                unregistered_since = time.monotonic()
            elif not gone:
                unregistered_since = None
            if unregistered_since is not None and not restarts_roll_back and time.monotonic() - unregistered_since > SOURCE_GONE * self.config.lease_ttl:
                log.error("pserver %s cannot receive slots %s: pserver %d has been gone for %.0fs", self.index, slots[:8], src, time.monotonic() - unregistered_since)
                return _LOST

    def _report_got(self, version: int | None) -> None:
        """Say in the store that this pserver holds every slot map ``version`` gives it
        (the master finishes a resize once every receiver has said so, and then drops
        these keys)."""
        if version is None or version < 2 or self.index is None:
            return
        try:
            self._store.put(self._keys.resize_got(version, self.index), json.dumps({"received_bytes": self.received_bytes}).encode())
        except StoreError as exc:
            log.error("pserver %s could not report its slots of map %d: %s", self.index, version, exc)

    # --- model ------------------------------------------------------------------------

    def _ensure_shard(self) -> ParameterShard:
        if self._shard is None:
            model = self._store.get(self._keys.model)
            if model is None:
                raise NotReady(f"job {self.config.name!r} has no model description yet; a trainer must attach first")
            self._specs = decode_as(model.value, model.key, lambda ds: [ParamSpec.from_json(d) for d in ds])
            tables = self._store.get(self._keys.model_tables)
            self._table_specs = [] if tables is None else decode_as(tables.value, tables.key, lambda ds: [TableSpec.from_json(d) for d in ds])
            assert self.index is not None and self._slot_map is not None
            self._use_layout(Layout.build(self._specs, self._slot_map, self.config.min_block))
            self._shard = self._compute.shard(self._blocks(), self.config.optimizer, self.config.optimizer_args)
            self._tables = self._build_tables()
        return self._shard

    def _build_tables(self) -> dict[str, RowShard]:
        """A row store per table of the model, for the slots this pserver holds a copy of
        (primary or backup: a backup applies every section its primary does, so a
        failover promotes it with every row and its state), stepped by the job's row
        rule (``sparse_optimizer``, or the row rule of ``optimizer``)."""
        specs = self._table_specs or []
        if not specs:
            return {}
        assert self._slot_map is not None and self.index is not None
        rule, args = sparse_rule(self.config)
        slots = self._slot_map.held_by(self.index)
        clock = time.time
        return {
            spec.name: self._compute.rows(spec, rule, args, slots, self._slot_map.num_slots, clock, max_ids=self.config.sparse_max_ids)
            for spec in specs
        }

    def _blocks(self) -> list:
        assert self._layout is not None and self.index is not None
        return self._layout.blocks_held(self.index)

    def _use_layout(self, layout: Layout) -> None:
        self._layout = layout
        assert self.index is not None
        self._my_slots = tuple(sorted({s for b, s in zip(layout.blocks, layout.slots) if layout.slot_map.owners[s] == self.index}))
        # replicas: this pserver's shard holds copies of other primaries' blocks too; trainers
        # push and pull only the blocks it is the primary of, whose gradients it forwards
        # to their backups
        slot_of = self._slot_of = dict(zip((b.key for b in layout.blocks), layout.slots))
        held = layout.blocks_held(self.index)
        primary = [i for i, b in enumerate(held) if layout.slot_map.owners[slot_of[b.key]] == self.index]
        self._primary = None if len(primary) == len(held) else primary
        forwards: dict[int, list[int]] = {}
        for i in primary:
            for backup in layout.slot_map.backups[slot_of[held[i].key]] if layout.slot_map.replicas > 1 else ():
                forwards.setdefault(backup, []).append(i)
        self._forwards = forwards
        idle = set(layout.idle_pservers)  # they see no pull: one of them would close its rounds a second late
        if self._table_specs:  # rows hash into every slot: every pserver owning a slot is a part
            idle = {p for p in range(layout.slot_map.num_pservers) if p not in layout.slot_map.owners}
            self._my_slots = tuple(s for s, owner in enumerate(layout.slot_map.owners) if owner == self.index)
            self._use_row_masks(layout.slot_map)
        self._closers = tuple(p for p in range(layout.slot_map.num_pservers) if p not in idle)

    def _use_row_masks(self, slot_map: SlotMap) -> None:
        """The slot masks rows are checked and forwarded by, for ``slot_map``."""
        assert self.index is not None
        owners = np.asarray(slot_map.owners, dtype=np.int64)
        held = np.zeros(slot_map.num_slots, dtype=bool)
        held[slot_map.held_by(self.index)] = True
        self._row_primary = owners == self.index
        self._row_backed = {int(p): (owners == p) & held for p in np.unique(owners[held & ~self._row_primary])}
        backups: dict[int, np.ndarray] = {}
        for s in np.flatnonzero(self._row_primary).tolist():
            for b in slot_map.backups[s]:
                backups.setdefault(b, np.zeros(slot_map.num_slots, dtype=bool))[s] = True
        self._row_backups = backups

    def _receiving_shard(self) -> ParameterShard:
        """Sync, where a push is staged: the shard, even while slots are being received
        (a gradient needs no values to be staged; the round it is for applies once the
        slots are in, so the trainer's push overlaps the migration instead of waiting)."""
        if self._pending and self._shard is not None:
            return self._shard
        return self._ready_shard()

    def _ready_shard(self) -> ParameterShard:
        if self._pending:  # receiving slots: wait for them a while (woken when they are in), then say so
            deadline = time.monotonic() + PENDING_WAIT
            while self._pending and self.state not in HALTED and time.monotonic() < deadline:
                self._cond.wait(max(0.0, deadline - time.monotonic()))
        if self._pending:
            raise NotReady(
                f"pserver {self.index} is receiving slots of slot map version {self._slot_map.version if self._slot_map else '?'} "
                f"from pserver {', '.join(map(str, sorted(self._pending)))}"
            )
        shard = self._ensure_shard()
        if not shard.initialized:
            raise NotInitialized(f"pserver {self.index} has no parameter values (epoch {self.epoch}); call init first")
        return shard


def sparse_rule(config: JobConfig) -> tuple[str, dict]:
    """The row rule a job's tables are stepped by, and its arguments (checked): the
    ``sparse_optimizer`` setting, or the row rule of ``optimizer``."""
    name = config.sparse_optimizer or row_rule_for(config.optimizer)
    if name is None:
        raise ConfigError(
            f"the model has sparse tables and optimizer {config.optimizer!r} has no row rule: "
            "set sparse_optimizer (SGD, Adagrad, RowWiseAdagrad or SparseAdam)"
        )
    args = config.sparse_optimizer_args if config.sparse_optimizer or config.sparse_optimizer_args else config.optimizer_args
    return name, check_row_rule(name, args)
