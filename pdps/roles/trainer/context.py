"""The trainer role and :class:`TrainerContext`, the object a training function receives.

A training function looks the same in one process and across many::

    def train(ctx: pdps.TrainerContext) -> None:
        model = ctx.attach(make_model())          # parameters now come from the pservers
        for batch in ctx.batches():               # tasks leased from the master, cut into batches
            loss = loss_fn(model(batch["x"]), batch["y"])
            ctx.step(loss)                        # backward, then push/pull as the mode says

``attach`` binds the model to flat buffers, publishes its parameter layout (the
first trainer's initial values win) and pulls. ``batches`` leases tasks, reads
their records and reports each task finished after its last batch; a task whose
records cannot be read is reported failed. ``step`` runs ``loss.backward()`` and
then follows the job's mode: sync pushes every batch into a barrier round and
pulls the round's result; async sums gradients for ``push_every`` batches, pushes,
and pulls every ``pull_every`` batches.

With ``overlap`` (the default) communication runs beside computation: each
parameter's slots go to their pservers as soon as backward has produced its gradient,
while backward goes on with the layers before it (one thread per pserver keeps each
pserver's messages in order), and in async mode the pull that follows runs while the
next forward does, each module waiting only for its own parameters.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import ConfigError, DatasetError, EpochChanged, LeaseExpired, NotInitialized, PdpsError, SlotMapChanged, StalePush, Timeout
from pdps.core.headcount import parse_count, surplus
from pdps.core.job import JobConfig, Keys, decode_json
from pdps.core.sgd import Mode
from pdps.core.slots import ParamSpec
from pdps.core.tables import check_tables
from pdps.core.tasks import TaskSpec
from pdps.core.wire import (
    AppliedRequest,
    FailTaskRequest,
    FinishTaskRequest,
    GetTaskRequest,
    GiveBackRequest,
    InitRequest,
    PullReply,
    PullRequest,
    PushReply,
    Request,
)
from pdps.ports.compute import Compute, ModelReplica, ThreadedCompute, TrainerTables
from pdps.ports.coordination import Compare, CoordinationStore, EventType, Put, WatchEvent
from pdps.ports.data import Columns, DataSource
from pdps.ports.transport import ChannelStats, ConcurrentCalls, Transport
from pdps.roles.trainer.discovery import DISCOVERY_TIMEOUT, Waits, wait_for_key
from pdps.roles.trainer.master_client import MasterClient
from pdps.roles.trainer.overlap import Pipeline
from pdps.roles.trainer.pserver_client import Part, PserverGroup
from pdps.roles.trainer.steps import MAP_CHANGES_PER_CALL, AsyncCadence, Attempt, StepRecord, SyncRound

log = logging.getLogger(__name__)


class Killed(BaseException):
    """Raised inside a training function to simulate a crash (``pdps.simulate``'s ``kill``).

    A BaseException, so a user's ``except Exception`` does not swallow it.
    """


@attrs.frozen
class Batch(Mapping[str, Any]):
    """One mini-batch: named tensors (columns of the task's records) and where it came from."""

    columns: Mapping[str, Any]
    size: int
    task: TaskSpec
    pass_no: int
    last: bool = False  # the task's final batch
    attempt: int = 0  # the task's attempt this batch belongs to
    start: int = 0  # index of the batch's first record in the task

    def __getitem__(self, name: str) -> Any:
        try:
            return self.columns[name]
        except KeyError:
            raise KeyError(f"batch has no column {name!r}; columns: {sorted(self.columns)}") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.columns)

    def __len__(self) -> int:
        return len(self.columns)


#: Per-step time categories of :attr:`TrainerContext.timings`.
TIMINGS = ("compute", "data", "serialize", "network", "update", "barrier", "wait")


class TrainerContext(SyncRound, AsyncCadence):
    """What a training function receives. See the module docstring for the loop."""

    def __init__(
        self,
        store: CoordinationStore,
        transport: Transport,
        compute: Compute,
        source: DataSource,
        config: JobConfig,
        *,
        trainer_id: str | None = None,
        publisher: str | None = None,
    ) -> None:
        self.config = config
        self.trainer_id = trainer_id or f"trainer-{uuid.uuid4().hex[:8]}"
        #: the trainer whose model the job takes: others attach only after it has
        #: published (or left), so which trainer a differing model refuses never depends
        #: on timing. None: the first trainer to attach publishes.
        self._publisher = publisher if publisher != self.trainer_id else None
        self._store = store
        self._transport = transport
        self._compute = compute
        self._source = source
        self._keys = Keys(config.name)
        self._replica: ModelReplica | None = None
        self._group: PserverGroup | None = None
        self._master = MasterClient(store, transport, self._keys, self.trainer_id)
        self._keeper = None
        self._waits = Waits(store, self._keys, self.trainer_id, lambda: None if self._keeper is None else self._keeper.lease)
        self._batch: Batch | None = None
        self._stepped: Batch | None = None  # the last batch step() ran on
        self._batch_no = 0
        self._stop = threading.Event()
        self._kill_after: int | None = None
        self._slow: float = 1.0  # a test hook: each step takes this many times as long (slow_down)
        self._last_step: float | None = None
        self._epoch = 0
        self._abandon = False  # a rollback or a fence voided the current task: batches() drops it
        self._refused = False  # ... the task's progress record refused the attempt: batches() gives it back
        self._attempt: Attempt | None = None  # the task attempt being trained
        self._acc: tuple[int, int] | None = None  # async: records [start, end) summed since the last push
        #: every step of this trainer that was applied, in order (:class:`StepRecord`)
        self.history: list[StepRecord] = []
        #: How long an unreachable or unready pserver is waited for before it is an error.
        self.patience = DISCOVERY_TIMEOUT
        self.killed = False
        self.steps = 0  # mini-batches stepped
        self.samples = 0  # their samples
        self.pushes = 0
        self.stale_pushes = 0
        self.tasks_done = 0
        self.rollbacks = 0  # epochs this trainer followed
        self.map_changes = 0  # resizes this trainer followed (slot maps it moved to)
        self.left_by_resize = False  # fewer trainers were wanted, and this one left
        self._desired_watch: Any = None
        #: async: pushes a pserver acknowledged as applied, per slot (a push counts once for
        #: each slot of the pserver it went to); a pserver counts what it applied the same way
        self.acknowledged: Counter[int] = Counter()
        self.metrics: dict[str, float] = {}  # free for the training function; shown as progress
        self._pipeline: Pipeline | None = None
        #: sync: this trainer takes part in the rounds (a pipeline stage after the first
        #: does not: its stage 0 commits for the pipeline, roles/trainer/pipeline.py)
        self._rounds_member = True
        self._tables: TrainerTables | None = None  # the model's sparse tables, if it has any
        self._times: dict[str, float] = defaultdict(float)
        self._times_lock = threading.Lock()
        self._mark: float | None = None  # when control last went back to the training function
        self._mark_wait = 0.0

    # --- where the time goes ------------------------------------------------------------

    @property
    def timings(self) -> dict[str, float]:
        """Seconds this trainer spent since attach, by kind (:data:`TIMINGS`):

        ``compute``: the training function's own time (forward, metrics) and backward;
        ``data``: leasing tasks and reading their records; ``serialize``: encoding and
        decoding messages (transports that report it: gRPC); ``update``: the pservers
        taking pushes (async: applying them); ``barrier``: sync rounds (committing a
        contribution, waiting for the round to close); ``network``: the rest of the
        time calls to pservers took; ``wait``: the trainer thread blocked on those
        calls. With ``overlap``, calls run beside computation, so ``serialize`` +
        ``update`` + ``barrier`` + ``network`` may exceed ``wait``: only ``wait`` is
        added to a step.
        """
        with self._times_lock:
            t = dict(self._times)
        out = {k: t.get(k, 0.0) for k in TIMINGS}
        channels = [] if self._group is None else [p.channel for p in self._group.parts]
        out["serialize"] = sum(float(c.stats.get("serialize", 0.0)) for c in channels if isinstance(c, ChannelStats))
        out["network"] = max(0.0, t.get("comm", 0.0) - out["serialize"] - out["update"] - out["barrier"])
        return out

    def _time(self, kind: str, seconds: float) -> None:
        with self._times_lock:
            self._times[kind] += seconds

    def _back_to_user(self) -> None:
        self._mark = time.perf_counter()
        self._mark_wait = self._times["wait"]

    def _user_time(self) -> None:
        """Count the time since control went to the training function as compute (less
        any wait for pulls its forward did)."""
        if self._mark is not None:
            self._time("compute", max(0.0, time.perf_counter() - self._mark - (self._times["wait"] - self._mark_wait)))
            self._mark = None

    # --- lifecycle --------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._compute.device

    @property
    def epoch(self) -> int:
        return self._epoch

    def register(self) -> None:
        """Join the job: a leased key under ``trainers/`` (the barrier waits for members)."""
        from pdps.runtime.lease import LeaseKeeper

        if self._keeper is not None:
            return
        self._keeper = LeaseKeeper(self._store, self.config.lease_ttl, name=self.trainer_id)
        info = json.dumps({"id": self.trainer_id, "since": time.time()}).encode()
        key = self._keys.trainer(self.trainer_id)
        ok = self._store.commit((Compare.absent(key),), (Put(key, info, self._keeper.lease),))
        if not ok.succeeded and _holds(self._store, key, info):
            ok = attrs.evolve(ok, succeeded=True)  # our own write, whose reply an outage lost
        if not ok.succeeded:
            self._keeper.stop()
            self._keeper = None
            raise ConfigError(f"trainer id {self.trainer_id!r} is already registered in job {self.config.name!r}")
        if self._desired_watch is None:
            self._desired_watch = self._store.watch(self._keys.trainers_desired, self._on_desired)

    def _on_desired(self, event: WatchEvent) -> None:
        """Fewer trainers wanted (``pdps scale --trainers N``): if this one is among the
        surplus of the trainers registered now, it stops after its current batch, gives
        its task back (not a failure) and :meth:`batches` ends. Trainers that join later
        are not asked to leave: an operator may add them past the count."""
        if event.type is not EventType.PUT or event.key != self._keys.trainers_desired or event.value is None:
            return
        try:
            desired = parse_count(event.value, event.key)
            live = [self._keys.trainer_id(kv.key) for kv in self._store.range(self._keys.trainers)]
        except PdpsError as exc:
            log.warning("trainer %s cannot follow %s: %s", self.trainer_id, self._keys.trainers_desired, exc)
            return
        if self.trainer_id in surplus(live, desired):
            log.warning("trainer %s leaves the job: %d trainers are wanted, %d run", self.trainer_id, desired, len(live))
            self.left_by_resize = True
            self.request_stop()

    def _rejoin(self) -> None:
        log.warning("trainer %s is no longer registered (lease lost); registering again", self.trainer_id)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        self.register()

    def leave(self, *, crashed: bool = False) -> None:
        """Leave the job. ``crashed`` lets the lease run out instead, as a dead process would."""
        watch, self._desired_watch = self._desired_watch, None
        if watch is not None:
            watch.cancel()
        if not crashed:
            self._waits.done()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop(revoke=not crashed)
        pipeline, self._pipeline = self._pipeline, None
        if pipeline is not None:
            pipeline.close()
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def request_stop(self) -> None:
        """Graceful shutdown: after the current batch, give the task back (or finish it, if
        that batch was its last) and end :meth:`batches`."""
        self._stop.set()

    def kill_after(self, steps: int) -> None:
        """Make :meth:`step` raise :class:`Killed` once ``steps`` batches have been stepped."""
        self._kill_after = steps

    def slow_down(self, factor: float) -> None:
        """A test hook making a straggler: each step, with the work before it since the
        step before, takes ``factor`` times as long (the trainer sleeps the difference)."""
        if not factor >= 1:
            raise ConfigError(f"slow_down factor must be >= 1, got {factor!r}")
        self._slow = float(factor)

    # --- the model --------------------------------------------------------------------

    def attach(self, model: Any, tables: Mapping[str, Any] | None = None) -> Any:
        """Bind ``model`` to the job: publish its layout, initialize the pservers, pull.

        The first trainer to attach publishes the model's layout and initial values
        (one compare-and-set decides it once); every other trainer waits for the
        pservers and pulls. A trainer whose model differs from the job's is refused
        with :class:`ConfigError` naming the difference. Returns the same model, whose
        parameters now hold the job's current values.

        The model's sparse tables (``nn.Embedding``/``nn.EmbeddingBag`` with
        ``sparse=True``, ``pdps.nn.HashEmbedding``) live on the pservers only: they are
        swapped for stand-ins that pull the rows each batch uses (:mod:`pdps.nn`).
        ``tables`` gives a replaced torch table its options
        (``{"emb.weight": pdps.nn.TableOptions(...)}``).
        """
        from pdps.runtime import recovery

        self.register()
        if self._publisher is not None:
            publisher = self._keys.trainer(self._publisher)
            wait_for_key(self._store, self._keys.model, f"trainer {self._publisher}'s model", unless=lambda: self._store.get(publisher) is None)
        row_tables = self._compute.tables(model, tables)  # before the replica: the tables leave the model
        if row_tables and not any(p.requires_grad for p in model.parameters()):
            raise ConfigError("the model holds sparse tables and no dense parameter: pdps needs at least one trainable dense parameter beside its tables")
        if row_tables:
            from pdps.roles.pserver import sparse_rule

            sparse_rule(self.config)  # a job whose optimizer has no row rule is refused here, before anything is published
            # with replicas, a policy by which a slot's copies would diverge is refused here
            check_tables(row_tables.specs, replicas=self.config.replicas, asynchronous=self.config.mode is Mode.ASYNC)
            if self.config.export_url:
                raise ConfigError("the model has sparse tables, and exporting a table's rows is not built yet: run the job without export_url")
        replica = self._compute.replica(model)
        specs_json = json.dumps([s.to_json() for s in replica.specs]).encode()
        tables_json = json.dumps([t.to_json() for t in row_tables.specs]).encode() if row_tables else None
        puts = [Put(self._keys.model, specs_json)] + ([Put(self._keys.model_tables, tables_json)] if tables_json is not None else [])
        # The trainer that publishes the model initializes every pserver, so the initial
        # values come from one replica even if the trainers' own initializations differ.
        first = self._store.commit((Compare.absent(self._keys.model),), puts).succeeded
        stored = decode_json(self._store.get(self._keys.model).value, self._keys.model)  # type: ignore[union-attr]
        if stored != json.loads(specs_json):
            raise ConfigError(f"trainer {self.trainer_id!r}: the model does not match the job's ({self._keys.model}): {_diff(stored, replica.specs)}")
        stored_kv = self._store.get(self._keys.model_tables)
        stored_tables = [] if stored_kv is None else decode_json(stored_kv.value, self._keys.model_tables)
        mine = [] if tables_json is None else json.loads(tables_json)
        if stored_tables != mine:
            raise ConfigError(f"trainer {self.trainer_id!r}: the model's tables do not match the job's ({self._keys.model_tables}): job has {stored_tables}, this trainer has {mine}")
        self._epoch = recovery.read_epoch(self._store, self._keys)[0].epoch
        group = PserverGroup(self._store, self._transport, self.config, replica.specs, waits=self._waits, patience=self.patience, tables=bool(row_tables))
        self._replica, self._group = replica, group
        if row_tables:
            self._tables = row_tables
            row_tables.connect(lambda: self._group.layout.slot_map.owners, self._pull_rows)  # type: ignore[union-attr]
        if first:
            spread = group.layout.spread_warning() if not row_tables else None
            if spread is not None:  # said once, by the trainer that published the model; pdps status says it too
                log.warning("trainer %s: %s", self.trainer_id, spread)
            for part in group.parts + group.backups_only:
                self._init_part(part)
            self._store.put(self._keys.initialized, json.dumps({"by": self.trainer_id, "time": time.time()}).encode())
        self._pull_fresh()
        if self.config.mode is Mode.SYNC and self._rounds_member:
            self._join()
        self._zero_grad()
        if self._pipeline is None and self._overlaps():
            self._pipeline = Pipeline(self)
        self._back_to_user()
        return model

    def _zero_grad(self) -> None:
        """The step is over (pushed, refused or dropped): zero the gradients, forget its rows."""
        assert self._replica is not None
        self._replica.zero_grad()
        if self._tables is not None:
            self._tables.clear()

    def _pull_rows(self, asks: Mapping[int, list[tuple[str, Any]]]) -> dict[int, list[Any]]:
        """Rows for a table's forward: one pull per pserver (``asks``: pserver -> [(table,
        ids)]), their rows in the same order. A rollback meanwhile is followed (the step
        is then dropped); a resize raises SlotMapChanged once followed, for the caller to
        route the ids again."""
        assert self._group is not None
        by_index = {p.index: p for p in self._group.parts}
        requests = []
        for index, sections in asks.items():
            part = by_index.get(index)
            if part is None:
                self._follow_map()
                raise SlotMapChanged(f"pserver {index} holds no part of this trainer's slot map any more", sent=self._slot_version, current=self._slot_version)
            requests.append((part, PullRequest(
                self.trainer_id, epoch=self._epoch, version=self._slot_version, blocks=(),
                tables=tuple((name, int(ids.numel())) for name, ids in sections), tensors=tuple(ids for _, ids in sections),
            )))
        while True:
            try:
                replies = self._call_each(requests)
                break
            except (EpochChanged, NotInitialized) as exc:
                log.warning("trainer %s: %s", self.trainer_id, exc)
                self._resync()  # the step this forward is for is dropped (batches() moves on)
                requests = [(part, attrs.evolve(req, epoch=self._epoch, version=self._slot_version)) for part, req in requests]
        for reply in replies:
            if isinstance(reply, SlotMapChanged):
                self._follow_map()
                raise reply
        return {part.index: list(reply.tensors) for (part, _), reply in zip(requests, replies)}

    @property
    def overlapping(self) -> bool:
        """Whether this trainer's communication runs beside its computation (``overlap``)."""
        return self._pipeline is not None

    def _overlaps(self) -> bool:
        """``overlap``: "on", "off", or "auto": on where it pays. Overlap moves the
        communication beside the computation, so it gains only where there is something
        idle to run it on: a GPU computing (the CPU is free), pservers in this process
        (their work is plain memory traffic), or CPU cores beyond the trainer's compute
        threads. On a host whose cores the trainer's threads already fill, serializing
        for gRPC beside backward slows both (measured on 2 cores: 0.34x of torch with
        overlap, 0.38-0.45x without)."""
        if self._tables is not None:
            # a table's rows are pulled by its forward and pushed after backward: the
            # pipeline's per-slot pushes do not carry them (yet)
            if self.config.overlap == "on":
                log.warning("trainer %s: overlap is off for a model with sparse tables", self.trainer_id)
            return False
        if self.config.overlap != "auto":
            return self.config.overlap == "on"
        if self.device != "cpu" or not (isinstance(self._transport, ConcurrentCalls) and self._transport.concurrent):
            return True
        return isinstance(self._compute, ThreadedCompute) and (os.cpu_count() or 1) > self._compute.threads

    @property
    def _slot_version(self) -> int:
        """The version of the slot map this trainer's layout was computed from."""
        assert self._group is not None
        return self._group.layout.slot_map.version

    def _init_part(self, part: Part) -> None:
        """Give pserver ``part`` this replica's values, unless it has some already."""
        assert self._replica is not None and self._group is not None
        self._group.ask(part, InitRequest(self.trainer_id, epoch=self._epoch, version=self._slot_version, tensors=self._replica.values(part.held)))

    def pull(self) -> None:
        """Fetch the current parameters from every pserver into the model now."""
        self._pull_fresh()

    def applied(self) -> dict[int, list[list[int]]]:
        """What each pserver has applied in the current epoch: pserver index ->
        ``[task, attempt, start, end]`` rows (records ``[start, end)`` of the task), to
        check ``pdps status --pass N`` against. After :meth:`batches` has ended, every
        step of the job is in it."""
        if self._group is None:
            raise ConfigError("call ctx.attach(model) before ctx.applied()")
        request = AppliedRequest(self.trainer_id, epoch=self._epoch, version=self._slot_version)
        return {part.index: [list(r) for r in self._group.ask(part, request).ledger] for part in self._group.parts}

    # --- pipeline parallelism -----------------------------------------------------------

    def pipeline(self, model: Any, loss_fn: Callable[[Any, Any], Any], *, points: Sequence[int] | None = None, address: str | None = None) -> Any:
        """Make this trainer a stage of a pipeline job (``pipeline_stages`` >= 2): claim a
        rank, attach ``model`` (the whole model, an ``nn.Sequential``) and keep to the
        stage's parameters. Returns a :class:`~pdps.roles.trainer.pipeline.PipelineStage`;
        its ``train(prepare)`` runs until the job is done (docs/pipeline.md)."""
        from pdps.roles.trainer.pipeline import PipelineStage

        return PipelineStage(self, model, loss_fn, points=points, address=address)

    # --- data -------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Mini-batches of the tasks leased from the master, until the job is done."""
        held: tuple[int, int] | None = None  # (task, attempt) leased and not yet reported
        bs = self.config.batch_size
        self._user_time()
        fetching = time.perf_counter()
        try:
            rejoins = 0
            while not self._stop.is_set():
                try:
                    # "holding": a task the master says we hold but we never heard of
                    # (its reply was lost) comes back to us rather than timing out
                    reply = self._master.call(GetTaskRequest(self.trainer_id, epoch=self._epoch, holding=()))
                except LeaseExpired:
                    # Our key is gone (the lease ran out in an outage or a long pause) and the
                    # master has re-queued what we held: join again, a few times at most.
                    rejoins += 1
                    if rejoins > 3:
                        raise
                    self._rejoin()
                    continue
                rejoins = 0
                if reply.done:
                    break
                if reply.epoch is not None and reply.epoch > self._epoch:
                    self._resync()  # the master has rolled back: so do we
                    continue
                if reply.task is None or reply.attempt is None or reply.pass_no is None:  # "wait"
                    self._idle(0.05 if reply.retry_in is None else reply.retry_in)
                    continue
                task, attempt, pass_no, offset = reply.task, reply.attempt, reply.pass_no, reply.offset or 0
                held = (task.id, attempt)
                self._attempt = Attempt.read(self._store, self._keys, task.id, attempt, pass_no)
                try:
                    self._attempt.progress.check(attempt)
                except StalePush as exc:  # the master ended this attempt, or a racing one beat it, before we began
                    log.warning("trainer %s drops task %d attempt %d: %s", self.trainer_id, task.id, attempt, exc)
                    self._attempt = None
                    self._give_up(held)
                    held = None
                    continue
                if self._attempt.progress.attempt == attempt:
                    offset = max(offset, self._attempt.progress.applied)  # handed to us again: go on
                n = task.records
                if offset:
                    log.info("trainer %s resumes task %d at record %d of %d (trained that far before: a checkpoint restored, or a task given back)", self.trainer_id, task.id, offset, n)
                self._abandon = self._refused = False
                device = "cpu" if self._replica is None else self._replica.device
                reader: Iterator[Columns] | None = None  # one batch held at a time, never the task
                start = min(offset, n)
                while start < n:
                    try:
                        if reader is None:
                            reader = iter(self._source.read(task, start=start, batch_size=bs))
                        columns = next(reader, None)
                        if columns is None:
                            raise DatasetError(f"{task.location} part {task.part} ended at record {start}, its task says {n}")
                    except Exception as exc:  # an unreadable task fails, the trainer goes on
                        log.error("trainer %s cannot read task %d (%s part %d): %s", self.trainer_id, task.id, task.location, task.part, exc)
                        self._report("fail_task", held, error=str(exc))
                        held = None
                        break
                    cols = self._compute.tensors(columns, device)
                    self._batch = Batch(cols, min(bs, n - start), task, pass_no, last=start + bs >= n, attempt=attempt, start=start)
                    self._time("data", time.perf_counter() - fetching)
                    self._back_to_user()
                    yield self._batch
                    self._user_time()
                    fetching = time.perf_counter()
                    if self._abandon:
                        break
                    if self._stop.is_set() and not self._batch.last:
                        break
                    start += bs
                else:
                    self._report("finish_task", held)
                    held = None
                if self._abandon:
                    # The job rolled back to a checkpoint (the master has put this task
                    # where the checkpoint had it), or the master fenced this attempt
                    # (it gave up on it and re-queued the task): the attempt is void.
                    log.warning("trainer %s drops task %d attempt %d: the job rolled back or the master re-queued it", self.trainer_id, task.id, attempt)
                    if self._refused:
                        self._give_up(held)
                    held = None
                    self._abandon = self._refused = False
                self._attempt = None
            self._flush()
            if self._pipeline is not None:
                self._pipeline.drain()  # the model holds the job's values when the loop ends
        except GeneratorExit:  # the user left the loop: push what the last batches summed
            if not self.killed:
                self._flush()
            raise
        finally:
            # A crash reports nothing (the lease runs out and the master re-queues). Leaving
            # right after stepping a task's last batch finishes it; leaving mid-task, a
            # user's ``break`` or an error included, gives it back (not a failure).
            if held is not None and not self.killed:
                done = self._batch is not None and self._batch.last and self._stepped is self._batch
                try:
                    self._report("finish_task" if done else "give_back", held)
                except PdpsError as exc:
                    log.warning("trainer %s could not report task %d: %s", self.trainer_id, held[0], exc)
            self._batch = None

    def _give_up(self, held: tuple[int, int] | None) -> None:
        """The task's progress record refused our attempt: the master ended it (it
        ignores the give-back), or a racing attempt of the task committed first (the
        master still counts the task against us and would hand the attempt to us again):
        give it back, never finish it."""
        if held is None:
            return
        try:
            self._report("give_back", held)
        except PdpsError as exc:
            log.warning("trainer %s could not give back task %d: %s", self.trainer_id, held[0], exc)

    def _report(self, method: str, held: tuple[int, int], **extra: Any) -> None:
        task, attempt = held
        report = {"finish_task": FinishTaskRequest, "fail_task": FailTaskRequest, "give_back": GiveBackRequest}[method]
        reply = self._master.call(report(self.trainer_id, task, attempt, **extra))
        if not reply.accepted:
            # e.g. the task timed out and went back to todo: someone else will train it
            log.warning("trainer %s: master ignored %s of task %d attempt %d: %s", self.trainer_id, method, task, attempt, reply.reason)
        elif method == "finish_task":
            self.tasks_done += 1

    # --- steps ------------------------------------------------------------------------

    def step(self, loss: Any, samples: int | None = None) -> None:
        """Backward ``loss``, then push and pull as the job's mode says.

        ``samples`` defaults to the size of the current batch; sync-SGD weights each
        trainer's gradient (of a *mean*-reduced loss) by it. If the job rolls back to
        a checkpoint meanwhile, the step is dropped, the model re-fetched, and
        :meth:`batches` moves on to a fresh task.
        """
        if self._replica is None or self._group is None:
            raise ConfigError("call ctx.attach(model) before ctx.step()")
        if self._kill_after is not None and self.steps >= self._kill_after:
            self.killed = True
            raise Killed(self.trainer_id)
        if samples is None:
            if self._batch is None:
                raise ConfigError("ctx.step() outside ctx.batches() needs samples=")
            samples = self._batch.size
        self._user_time()
        try:
            if self._abandon:
                # a pull during this batch's forward found the job rolled back: its
                # gradient belongs to the old epoch, and batches() moves on
                self._zero_grad()
                return
            sync = self.config.mode is Mode.SYNC
            # with overlap, backward runs inside the push: each slot leaves when it is ready
            overlap = self._pipeline is not None and (samples > 0 if sync else self._push_due(self._batch_no + 1))
            if not overlap:
                began = time.perf_counter()
                loss.backward()
                self._time("compute", time.perf_counter() - began)
            self.steps += 1
            self.samples += samples
            self._stepped = self._batch
            if not sync and self._batch is not None:  # the records this push will carry
                b = self._batch
                self._acc = (b.start if self._acc is None else self._acc[0], b.start + b.size)
            try:
                if sync:
                    self._sync_round(samples, loss if overlap else None)
                else:
                    self._async_step(loss if overlap else None)
            except (EpochChanged, NotInitialized) as exc:
                # a rollback, or a pserver that restarted empty: drop the step, re-fetch
                log.warning("trainer %s: %s", self.trainer_id, exc)
                self._resync()
        finally:
            if self._slow > 1:
                now = time.perf_counter()
                if self._last_step is not None:
                    time.sleep((self._slow - 1) * (now - self._last_step))
                self._last_step = time.perf_counter()
            self._back_to_user()

    def _pull_failed(self, exc: BaseException) -> None:
        """A pull sent ahead failed: follow a rollback or a resize as a step would, or raise."""
        if isinstance(exc, SlotMapChanged):
            self._pull_fresh()
            return
        if not isinstance(exc, (EpochChanged, NotInitialized)):
            raise exc
        log.warning("trainer %s: %s", self.trainer_id, exc)
        self._resync()

    def _lose_task(self, why: BaseException) -> None:
        """The master gave up on our attempt and fenced it, or a racing attempt committed
        first: nothing more of it is applied; batches() drops the task and gives it back."""
        if not self._abandon:
            log.warning("trainer %s: its attempt at the task is over (%s); dropping it", self.trainer_id, why)
        self._abandon = self._refused = True

    def _into(self, part: Part) -> Sequence[Any]:
        """Where a pull from ``part`` may land: the model's own memory (no copy after)."""
        assert self._replica is not None
        return self._replica.value_blocks(part.blocks)

    def _call_each(self, requests: Sequence[tuple[Part, Request]], into: Callable[[Part], Sequence[Any]] | None = None) -> list[Any]:
        """:meth:`PserverGroup.call_each`, timed (the trainer thread waits for it all)."""
        assert self._group is not None
        began = time.perf_counter()
        try:
            replies = self._group.call_each(requests, into)
        finally:
            spent = time.perf_counter() - began
            self._time("comm", spent)
            self._time("wait", spent)
        self._time("update", sum(r.update_s or 0.0 for r in replies if isinstance(r, PushReply)))
        return replies

    def _follow_map(self) -> None:
        """A resize moved slots: address the pservers the new slot map names (the
        model's blocks are the same; only who holds them changed)."""
        assert self._group is not None
        pipeline = self._pipeline
        if pipeline is not None:
            pipeline.close()  # its workers are per pserver
            self._pipeline = None
        if self._group.refresh():
            self.map_changes += 1
        if pipeline is not None:
            self._pipeline = Pipeline(self)

    def _pull_fresh(self) -> None:
        """Load every pserver's current values (initializing any that has none),
        following a resize that moved slots meanwhile."""
        assert self._group is not None
        if self._pipeline is not None:
            self._pipeline.drain()
        for _ in range(MAP_CHANGES_PER_CALL):
            try:
                return self._pull_each()
            except SlotMapChanged as exc:
                log.info("trainer %s: %s", self.trainer_id, exc)
                self._follow_map()
        self._pull_each()

    def _pull_each(self) -> None:
        assert self._group is not None
        request = PullRequest(self.trainer_id, epoch=self._epoch, version=self._slot_version)
        for part in self._group.parts:
            waited = time.monotonic()
            while True:
                try:
                    began = time.perf_counter()
                    try:
                        reply = self._group.ask(part, self._named(request, part), self._into(part))
                    finally:
                        spent = time.perf_counter() - began
                        self._time("comm", spent)
                        self._time("wait", spent)
                    break
                except NotInitialized as not_yet:
                    # Before the job's first initialization, wait for the trainer that
                    # published the model (it writes `initialized` once every pserver
                    # has its values); after it (a rollback with no checkpoint), any
                    # trainer's values will do.
                    if self._store.get(self._keys.initialized) is not None:
                        self._init_part(part)
                    else:
                        left = DISCOVERY_TIMEOUT - (time.monotonic() - waited)
                        try:
                            wait_for_key(self._store, self._keys.initialized, "the initial parameters", timeout=max(0.0, left))
                        except Timeout:
                            raise not_yet from None
            self._load(part, reply)

    def _load(self, part: Part, reply: PullReply) -> None:
        part.round_no = reply.round_no
        part.version = reply.updates
        part.incarnation = reply.incarnation
        if self._replica is not None:
            self._replica.load(part.blocks, reply.tensors)

    def _resync(self) -> None:
        """Follow the job into its current epoch: drop the step, re-fetch the parameters."""
        from pdps.runtime import recovery

        assert self._replica is not None
        self._abandon = self._batch is not None
        self._batch_no = 0
        self._zero_grad()
        while True:  # a second rollback while we follow the first: follow that one
            epoch = recovery.read_epoch(self._store, self._keys)[0]
            if epoch.epoch > self._epoch:
                log.warning("trainer %s follows the job into epoch %d (%s)", self.trainer_id, epoch.epoch, epoch.checkpoint or "from scratch")
                self.rollbacks += 1
            self._epoch = max(self._epoch, epoch.epoch)
            try:
                self._pull_fresh()
                if epoch.checkpoint is None and self._group is not None:
                    for part in self._group.backups_only:  # nobody pulls from these: initialize them here
                        self._init_part(part)
                return
            except EpochChanged as exc:
                log.warning("trainer %s: %s", self.trainer_id, exc)




def _holds(store: CoordinationStore, key: str, value: bytes) -> bool:
    kv = store.get(key)
    return kv is not None and kv.value == value


def _diff(stored: list[dict], specs: Sequence[ParamSpec]) -> str:
    mine = [s.to_json() for s in specs]
    for a, b in zip(stored, mine):
        if a != b:
            return f"job has {a}, this trainer has {b}"
    return f"job has {len(stored)} parameters, this trainer has {len(mine)}"
