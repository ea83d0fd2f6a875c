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
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import (
    ConfigError,
    CorruptRecord,
    EpochChanged,
    FencingError,
    LeaseExpired,
    NotInitialized,
    NotReady,
    PdpsError,
    StalePush,
    StoreError,
    Timeout,
    TransportError,
)
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.sgd import Contribution, Mode, RoundRecord
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap
from pdps.core.tasks import TaskSpec
from pdps.ports.compute import Compute, ModelReplica
from pdps.ports.coordination import Compare, CoordinationStore, Op, Put
from pdps.ports.data import DataSource
from pdps.ports.transport import Channel, Message, Transport

log = logging.getLogger(__name__)

#: How long a role waits for another to appear in the store before giving up.
DISCOVERY_TIMEOUT = 120.0


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


def wait_for_key(
    store: CoordinationStore, key: str, what: str, timeout: float = DISCOVERY_TIMEOUT, *, unless: Callable[[], bool] | None = None
) -> bytes | None:
    """The value of ``key`` once it exists; ``None`` if ``unless()`` turns true first."""
    start = last = time.monotonic()
    while True:
        kv = store.get(key)
        if kv is not None:
            return kv.value
        if unless is not None and unless():
            return None
        now = time.monotonic()
        if now - start > timeout:
            raise Timeout(f"gave up after {timeout:.0f}s waiting for {what} ({key})")
        if now - last > 5.0:
            last = now
            log.warning("waiting %.0fs for %s (%s)", now - start, what, key)
        time.sleep(0.02)


#: A trainer waiting longer than this (at the barrier, for a pserver) says whom it waits for.
WAIT_LOG_EVERY = 5.0


@attrs.define
class _Part:
    """One pserver as a trainer sees it: its channel and the blocks it holds."""

    index: int
    channel: Channel
    blocks: list[Block]
    address: str = ""
    keys: list[str] = attrs.field(init=False)
    round_no: int = 0
    version: int = 0
    incarnation: str | None = None

    def __attrs_post_init__(self) -> None:
        self.keys = [b.key for b in self.blocks]


class Waits:
    """Say, in the log and under ``waits/<who>`` in the store, whom a role has been
    waiting for and since when (``pdps status`` shows these records)."""

    def __init__(self, store: CoordinationStore, keys: Keys, who: str, lease: Callable[[], int | None]) -> None:
        self._store, self._keys, self._who, self._lease = store, keys, who, lease
        self._posted: str | None = None

    def waiting(self, what: str, whom: Sequence[str], since: float) -> None:
        """Log and record a wait that has lasted since ``since`` (``time.time()``)."""
        seconds = time.time() - since
        log.warning("%s: waiting %.0fs for %s (%s) since %s", self._who, seconds, ", ".join(whom) or "nobody known", what, time.strftime("%H:%M:%S", time.localtime(since)))
        record = json.dumps({"who": self._who, "what": what, "for": list(whom), "since": since}).encode()
        if record == self._posted:
            return
        try:
            self._store.put(self._keys.wait(self._who), record, lease=self._lease())
            self._posted = record.decode()
        except StoreError as exc:  # the log line said it already
            log.debug("could not record the wait: %s", exc)

    def done(self) -> None:
        if self._posted is None:
            return
        self._posted = None
        try:
            self._store.delete(self._keys.wait(self._who))
        except StoreError as exc:
            log.debug("could not clear the wait record: %s", exc)


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
    ) -> None:
        keys = Keys(config.name)
        self._store, self._transport, self._keys = store, transport, keys
        self._waits = waits
        self.patience = patience
        slot_map = decode_as(wait_for_key(store, keys.slotmap, "the job's slot map"), keys.slotmap, SlotMap.from_json)
        self.layout = Layout.build(specs, slot_map, config.min_block)
        self.parts: list[_Part] = []
        for i in range(slot_map.num_pservers):
            blocks = self.layout.blocks_of(i)
            if not blocks:
                continue  # a pserver whose slots hold no block of this model is never called
            addr = self._address_of(i, wait=True)
            assert addr is not None
            self.parts.append(_Part(i, transport.connect(addr), blocks, addr))
        # Calls to different pservers overlap when the transport's calls release the GIL
        # (gRPC); in-process calls are plain function calls and stay on this thread.
        self._pool = None
        if getattr(transport, "concurrent", False) and len(self.parts) > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(len(self.parts), thread_name_prefix="pdps-pserver-call")

    def _address_of(self, index: int, *, wait: bool = False) -> str | None:
        key = self._keys.pserver(index)
        if wait:
            raw = wait_for_key(self._store, key, f"pserver {index}")
        else:
            kv = self._store.get(key)
            raw = None if kv is None else kv.value
        return None if raw is None else decode_as(raw, key, lambda d: str(d["addr"]))

    def _reconnect(self, part: _Part) -> None:
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

    def call(self, part: _Part, method: str, request: Message) -> Message:
        """Call one pserver, pausing and retrying while it is unreachable or not ready."""
        first: float | None = None
        last_log = 0.0
        delay = 0.02
        while True:
            try:
                reply = part.channel.call(method, request)
                if first is not None and time.monotonic() - first >= WAIT_LOG_EVERY:
                    log.warning("pserver %d answers again after %.0fs", part.index, time.monotonic() - first)
                if first is not None and self._waits is not None:
                    self._waits.done()
                return reply
            except NotInitialized:
                raise  # the caller initializes it
            except NotReady as exc:
                error: PdpsError = exc
            except TransportError as exc:
                if isinstance(exc, Timeout):
                    raise
                error = exc
                self._reconnect(part)
            now = time.monotonic()
            if first is None:
                first, since = now, time.time()
            if now - first > self.patience:
                raise error
            if now - first >= WAIT_LOG_EVERY and now - last_log >= WAIT_LOG_EVERY:
                last_log = now
                if self._waits is not None:
                    self._waits.waiting(f"{method}: {error}", [f"pserver {part.index} at {part.address}"], since)
                else:
                    log.warning("waiting %.0fs for pserver %d at %s: %s", now - first, part.index, part.address, error)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def call_each(self, method: str, requests: Sequence[tuple[_Part, Message]]) -> list[Message | StalePush]:
        """Call several pservers, concurrently where the transport allows. A stale push
        comes back in its place in the list; any other error is raised once all calls
        ended (an :class:`EpochChanged` first: the caller must start over)."""

        def one(part: _Part, request: Message) -> Message | StalePush:
            try:
                return self.call(part, method, request)
            except StalePush as exc:
                return exc

        if self._pool is None or len(requests) < 2:
            results: list[Message | StalePush] = []
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
        for p in self.parts:
            p.channel.close()


class TrainerContext:
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
    ) -> None:
        self.config = config
        self.trainer_id = trainer_id or f"trainer-{uuid.uuid4().hex[:8]}"
        self._store = store
        self._transport = transport
        self._compute = compute
        self._source = source
        self._keys = Keys(config.name)
        self._replica: ModelReplica | None = None
        self._group: PserverGroup | None = None
        self._master: Channel | None = None
        self._keeper = None
        self._waits = Waits(store, self._keys, self.trainer_id, lambda: None if self._keeper is None else self._keeper.lease)
        self._batch: Batch | None = None
        self._stepped: Batch | None = None  # the last batch step() ran on
        self._batch_no = 0
        self._stop = threading.Event()
        self._kill_after: int | None = None
        self._epoch = 0
        self._abandon = False  # a rollback voided the current task: batches() drops it
        #: How long an unreachable or unready pserver is waited for before it is an error.
        self.patience = DISCOVERY_TIMEOUT
        self.killed = False
        self.steps = 0  # mini-batches stepped
        self.pushes = 0
        self.stale_pushes = 0
        self.tasks_done = 0
        self.rollbacks = 0  # epochs this trainer followed
        self.metrics: dict[str, float] = {}  # free for the training function; shown as progress

    # --- lifecycle --------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._compute.device

    @property
    def epoch(self) -> int:
        return self._epoch

    def register(self) -> None:
        """Join the job: a leased key under ``trainers/`` (the barrier waits for members)."""
        from pdps.roles.lease import LeaseKeeper

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

    def _rejoin(self) -> None:
        log.warning("trainer %s is no longer registered (lease lost); registering again", self.trainer_id)
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop()
        self.register()

    def leave(self, *, crashed: bool = False) -> None:
        """Leave the job. ``crashed`` lets the lease run out instead, as a dead process would."""
        if not crashed:
            self._waits.done()
        keeper, self._keeper = self._keeper, None
        if keeper is not None:
            keeper.stop(revoke=not crashed)
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

    # --- the model --------------------------------------------------------------------

    def attach(self, model: Any) -> Any:
        """Bind ``model`` to the job: publish its layout, initialize the pservers, pull.

        The first trainer to attach publishes the model's layout and initial values;
        every other trainer waits for the pservers and pulls. Returns the same model,
        whose parameters now hold the job's current values.
        """
        from pdps.roles import recovery

        self.register()
        replica = self._compute.replica(model)
        specs_json = json.dumps([s.to_json() for s in replica.specs]).encode()
        # The trainer that publishes the model initializes every pserver, so the initial
        # values come from one replica even if the trainers' own initializations differ.
        first = self._store.commit((Compare.absent(self._keys.model),), (Put(self._keys.model, specs_json),)).succeeded
        stored = decode_json(self._store.get(self._keys.model).value, self._keys.model)  # type: ignore[union-attr]
        if stored != json.loads(specs_json):
            raise ConfigError(f"trainer {self.trainer_id!r}: the model does not match the job's ({self._keys.model}): {_diff(stored, replica.specs)}")
        self._epoch = recovery.read_epoch(self._store, self._keys)[0].epoch
        group = PserverGroup(self._store, self._transport, self.config, replica.specs, waits=self._waits, patience=self.patience)
        self._replica, self._group = replica, group
        if first:
            for part in group.parts:
                self._init_part(part)
            self._store.put(self._keys.initialized, json.dumps({"by": self.trainer_id, "time": time.time()}).encode())
        self._pull_fresh()
        if self.config.mode is Mode.SYNC:
            self._join()
        replica.zero_grad()
        return model

    def _init_part(self, part: _Part) -> None:
        """Give pserver ``part`` this replica's values, unless it has some already."""
        assert self._replica is not None and self._group is not None
        meta = {"trainer": self.trainer_id, "epoch": self._epoch}
        self._group.call(part, "init", Message(meta, self._replica.values(part.blocks)))

    def pull(self) -> None:
        """Fetch the current parameters from every pserver into the model now."""
        self._pull_fresh()

    # --- data -------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Mini-batches of the tasks leased from the master, until the job is done."""
        import torch  # the context hands torch tensors to the user's model

        held: tuple[int, int] | None = None  # (task, attempt) leased and not yet reported
        bs = self.config.batch_size
        try:
            rejoins = 0
            while not self._stop.is_set():
                try:
                    # "holding": a task the master says we hold but we never heard of
                    # (its reply was lost) comes back to us rather than timing out
                    reply = self._call_master("get_task", Message({"trainer": self.trainer_id, "epoch": self._epoch, "holding": []}))
                except LeaseExpired:
                    # Our key is gone (the lease ran out in an outage or a long pause) and the
                    # master has re-queued what we held: join again, a few times at most.
                    rejoins += 1
                    if rejoins > 3:
                        raise
                    self._rejoin()
                    continue
                rejoins = 0
                if reply.meta.get("done"):
                    break
                if int(reply.meta.get("epoch", self._epoch)) > self._epoch:
                    self._resync()  # the master has rolled back: so do we
                    continue
                if "wait" in reply.meta:
                    self._idle(float(reply.meta.get("retry_in", 0.05)))
                    continue
                task = TaskSpec.from_json(reply.meta["task"])
                attempt, pass_no = int(reply.meta["attempt"]), int(reply.meta["pass"])
                offset = int(reply.meta.get("offset", 0))
                held = (task.id, attempt)
                try:
                    columns = self._source.read(task)
                except Exception as exc:  # an unreadable task fails, the trainer goes on
                    log.error("trainer %s cannot read task %d (%s part %d): %s", self.trainer_id, task.id, task.location, task.part, exc)
                    self._report("fail_task", held, error=str(exc))
                    held = None
                    continue
                n = len(next(iter(columns.values()))) if columns else 0
                if offset:
                    log.info("trainer %s resumes task %d at record %d of %d (a checkpoint restore)", self.trainer_id, task.id, offset, n)
                self._abandon = False
                for start in range(min(offset, n), n, bs):
                    cols = {k: torch.from_numpy(v[start : start + bs]) for k, v in columns.items()}
                    if self._replica is not None and self._replica.device != "cpu":
                        cols = {k: v.to(self._replica.device) for k, v in cols.items()}
                    self._batch = Batch(cols, min(bs, n - start), task, pass_no, last=start + bs >= n, attempt=attempt, start=start)
                    yield self._batch
                    if self._abandon:
                        break
                    if self._stop.is_set() and not self._batch.last:
                        break
                else:
                    self._report("finish_task", held)
                    held = None
                if self._abandon:
                    # The job rolled back to a checkpoint: the master has put this task
                    # where the checkpoint had it, and its attempt is void.
                    log.warning("trainer %s drops task %d attempt %d: the job rolled back", self.trainer_id, task.id, attempt)
                    held = None
                    self._abandon = False
            self._flush()
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

    def _report(self, method: str, held: tuple[int, int], **extra: Any) -> None:
        task, attempt = held
        reply = self._call_master(method, Message({"trainer": self.trainer_id, "task": task, "attempt": attempt, **extra}))
        if not reply.meta.get("accepted", True):
            # e.g. the task timed out and went back to todo: someone else will train it
            log.warning("trainer %s: master ignored %s of task %d attempt %d: %s", self.trainer_id, method, task, attempt, reply.meta.get("reason"))
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
        loss.backward()
        self.steps += 1
        self._stepped = self._batch
        try:
            if self.config.mode is Mode.SYNC:
                self._sync_round(samples)
            else:
                self._async_step()
        except (EpochChanged, NotInitialized) as exc:
            # a rollback, or a pserver that restarted empty: drop the step, re-fetch
            log.warning("trainer %s: %s", self.trainer_id, exc)
            self._resync()

    def _contribution(self, samples: int) -> Contribution:
        b = self._batch
        if b is None or not samples:
            return Contribution(samples)
        return Contribution(samples, b.task.id, b.attempt, b.start + b.size, b.last)

    def _sync_round(self, samples: int) -> None:
        """Push to every pserver (staged there), commit the contribution to the round's
        record, then pull the round's result: the step applies everywhere or nowhere."""
        assert self._replica is not None and self._group is not None
        round_no = max(p.round_no for p in self._group.parts)
        stale = False
        if samples:
            self._replica.check_finite(self.trainer_id)  # all pservers or none: fail before the first push
            meta = {"trainer": self.trainer_id, "round": round_no, "samples": samples, "epoch": self._epoch}
            requests = [(part, Message({**meta, "blocks": part.keys}, self._replica.grads(part.blocks))) for part in self._group.parts]
            for part, reply in zip(self._group.parts, self._group.call_each("push", requests)):
                if isinstance(reply, StalePush):
                    stale = True
                    log.warning("trainer %s: push to pserver %d was stale (%s); pulling", self.trainer_id, part.index, reply)
        if not stale:
            stale = not self._commit(round_no, self._contribution(samples))
        if stale:
            self.stale_pushes += 1
        elif samples:
            self.pushes += len(self._group.parts)
        self._replica.zero_grad()
        if stale:
            self._pull_fresh()
        else:
            self._pull_round(round_no)

    def _commit(self, round_no: int, contribution: Contribution) -> bool:
        """Add our contribution to round ``round_no``'s record; False if it had closed."""
        key = self._keys.round(self._epoch, round_no)
        while True:
            kv = self._store.get(key)
            record = RoundRecord(round_no) if kv is None else decode_as(kv.value, kv.key, RoundRecord.from_json)
            try:
                updated = record.contribute(self.trainer_id, contribution)
            except StalePush:
                return False
            if updated is record:
                return True  # committed already (a retry whose reply was lost)
            guard = Compare.absent(key) if kv is None else Compare.revision(key, Op.EQ, kv.mod_revision)
            if self._store.commit((guard,), (Put(key, json.dumps(updated.to_json()).encode()),)).succeeded:
                return True

    def _idle(self, pause: float) -> None:
        """No task for now. Sync: contribute zero samples, so the round need not wait for
        us; pause only if the round applied nothing (every trainer is idle)."""
        if self.config.mode is not Mode.SYNC or self._group is None:
            time.sleep(pause)
            return
        before = [p.version for p in self._group.parts]
        try:
            self._sync_round(0)
        except EpochChanged as exc:
            log.warning("trainer %s: %s", self.trainer_id, exc)
            self._resync()
        if before == [p.version for p in self._group.parts]:
            time.sleep(pause)

    def _join(self) -> None:
        """Sync: become a participant with a zero-sample contribution before computing
        anything, so our first real gradient is never stale."""
        assert self._group is not None
        while True:
            round_no = max(p.round_no for p in self._group.parts)
            if self._commit(round_no, Contribution(0)):
                self._pull_round(round_no)
                return
            self._pull_fresh()

    def _async_step(self) -> None:
        assert self._replica is not None
        self._batch_no += 1
        cadence = self.config.cadence
        must_pull = False
        if cadence.push_due(self._batch_no):
            must_pull = self._async_push()
        if must_pull or cadence.pull_due(self._batch_no):
            self._pull_fresh()

    def _async_push(self) -> bool:
        """Push the summed gradients to every pserver; True if one of them said pull."""
        assert self._replica is not None and self._group is not None
        self._replica.check_finite(self.trainer_id)
        requests = []
        for part in self._group.parts:
            meta = {"trainer": self.trainer_id, "version": part.version, "blocks": part.keys, "epoch": self._epoch, "incarnation": part.incarnation}
            requests.append((part, Message(meta, self._replica.grads(part.blocks))))
        stale = False
        for part, reply in zip(self._group.parts, self._group.call_each("push", requests)):
            if isinstance(reply, StalePush):
                stale = True
                self.stale_pushes += 1
                log.info("trainer %s: pserver %d dropped a stale push: %s", self.trainer_id, part.index, reply)
            else:
                self.pushes += 1
        self._replica.zero_grad()
        return stale

    def _flush(self) -> None:
        """Async: push what was accumulated since the last push, so no batch is lost."""
        if self.config.mode is Mode.ASYNC and self._replica is not None and self._batch_no % self.config.push_every:
            try:
                self._async_push()
            except EpochChanged:
                self._resync()
            self._batch_no = 0

    def _pull_round(self, round_no: int) -> None:
        """Sync: wait for round ``round_no`` to close on every pserver and load the result.
        A long wait is logged with whom the round waits for; a checkpoint taken right
        after the round is reported to the master before anything else happens."""
        assert self._group is not None
        first = time.time()
        last_log = 0.0
        meta = {"trainer": self.trainer_id, "epoch": self._epoch, "after_round": round_no, "slice": WAIT_LOG_EVERY}
        pending = list(self._group.parts)
        checkpoint = None
        while pending:
            replies = self._group.call_each("pull", [(part, Message(meta)) for part in pending])
            still = []
            for part, reply in zip(pending, replies):
                assert isinstance(reply, Message)  # pulls are never stale
                if "waiting" in reply.meta:
                    still.append((part, reply.meta["waiting"]))
                    continue
                self._load(part, reply)
                checkpoint = reply.meta.get("checkpoint") or checkpoint
            pending = [p for p, _ in still]
            if still and time.time() - last_log >= WAIT_LOG_EVERY:
                last_log = time.time()
                whom = sorted({t for _, ts in still for t in ts})
                self._waits.waiting(f"the barrier of round {round_no}", whom, first)
        if last_log:
            self._waits.done()
        if checkpoint is not None:
            self._call_master("checkpoint", Message({"trainer": self.trainer_id, "checkpoint": checkpoint, "epoch": self._epoch}))

    def _pull_fresh(self) -> None:
        """Load every pserver's current values (initializing any that has none)."""
        assert self._group is not None
        meta = {"trainer": self.trainer_id, "epoch": self._epoch}
        for part in self._group.parts:
            waited = time.monotonic()
            while True:
                try:
                    reply = self._group.call(part, "pull", Message(meta))
                    break
                except NotInitialized:
                    # Before the job's first initialization, wait for the trainer that
                    # published the model; after it (a rollback with no checkpoint), any
                    # trainer's values will do.
                    if self._store.get(self._keys.initialized) is not None:
                        self._init_part(part)
                    elif time.monotonic() - waited > DISCOVERY_TIMEOUT:
                        raise
                    else:
                        time.sleep(0.02)
            self._load(part, reply)

    def _load(self, part: _Part, reply: Message) -> None:
        part.round_no = int(reply.meta["round"])
        part.version = int(reply.meta["version"])
        part.incarnation = reply.meta.get("incarnation")
        if self._replica is not None:
            self._replica.load(part.blocks, reply.tensors)

    def _resync(self) -> None:
        """Follow the job into its current epoch: drop the step, re-fetch the parameters."""
        from pdps.roles import recovery

        assert self._replica is not None
        self._abandon = self._batch is not None
        self._batch_no = 0
        self._replica.zero_grad()
        while True:  # a second rollback while we follow the first: follow that one
            epoch = recovery.read_epoch(self._store, self._keys)[0]
            if epoch.epoch > self._epoch:
                log.warning("trainer %s follows the job into epoch %d (%s)", self.trainer_id, epoch.epoch, epoch.checkpoint or "from scratch")
                self.rollbacks += 1
            self._epoch = max(self._epoch, epoch.epoch)
            try:
                self._pull_fresh()
                return
            except EpochChanged as exc:
                log.warning("trainer %s: %s", self.trainer_id, exc)

    def _master_channel(self) -> Channel | None:
        """The master's channel; ``None`` once the job is done and its master has left."""
        if self._master is None:
            addr = wait_for_key(self._store, self._keys.master_addr, "the master", unless=lambda: job_done(self._store, self._keys))
            if addr is None:
                return None
            self._master = self._transport.connect(addr.decode())
        return self._master

    def _call_master(self, method: str, request: Message) -> Message:
        """Call the master; if it is gone or has stepped down, find the current one.

        A standby takes over within about a lease TTL and publishes its address under
        ``master/addr``; until then this retries with backoff, for at most
        ``DISCOVERY_TIMEOUT`` seconds. A master that left because the job is done
        answers for itself through the store: there are no more tasks.
        """
        deadline: float | None = None
        delay = 0.05
        while True:
            channel = self._master_channel()
            if channel is None:
                return Message({"done": True} if method == "get_task" else {"accepted": False, "reason": "the job is done"})
            try:
                return channel.call(method, request)
            except (TransportError, FencingError) as exc:
                if isinstance(exc, Timeout):
                    raise
                now = time.monotonic()
                deadline = deadline or now + DISCOVERY_TIMEOUT
                if now > deadline:
                    raise
                log.warning("trainer %s: master unavailable for %s (%s); looking it up again", self.trainer_id, method, exc)
                channel.close()
                self._master = None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)


def job_done(store: CoordinationStore, keys: Keys) -> bool:
    """True once the job's ``state`` says its last pass is done."""
    kv = store.get(keys.state)
    if kv is None:
        return False
    state = decode_json(kv.value, kv.key)
    return isinstance(state, dict) and state.get("state") == "done"


def _holds(store: CoordinationStore, key: str, value: bytes) -> bool:
    kv = store.get(key)
    return kv is not None and kv.value == value


def _diff(stored: list[dict], specs: Sequence[ParamSpec]) -> str:
    mine = [s.to_json() for s in specs]
    for a, b in zip(stored, mine):
        if a != b:
            return f"job has {a}, this trainer has {b}"
    return f"job has {len(stored)} parameters, this trainer has {len(mine)}"
