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
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import (
    ConfigError,
    CorruptRecord,
    EpochChanged,
    FencingError,
    GradientRejected,
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
from pdps.core.progress import TaskProgress
from pdps.core.sgd import Contribution, Mode, RoundRecord
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap
from pdps.core.tasks import TaskSpec
from pdps.ports.compute import Compute, ModelReplica
from pdps.ports.coordination import Compare, CoordinationStore, Op, Put, TxnOp
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


@attrs.frozen
class StepRecord:
    """What one step of this trainer put into the parameters (:attr:`TrainerContext.history`).

    ``round`` is the sync round it joined (None in async mode); ``samples`` its weight
    in that round; the records ``[start, end)`` of ``task`` (attempt ``attempt`` of pass
    ``pass_no``) are the ones its gradient was computed on. Only steps that were applied
    (committed to a round, or pushed to every pserver) are recorded.
    """

    round: int | None
    epoch: int
    pass_no: int
    task: int
    attempt: int
    start: int
    end: int
    samples: int


@attrs.define
class _Attempt:
    """The task attempt this trainer is training, and its progress record as last read
    or written (the value a compare-and-set must find)."""

    task: int
    attempt: int
    pass_no: int
    key: str
    raw: bytes | None
    progress: TaskProgress

    @classmethod
    def read(cls, store: CoordinationStore, keys: Keys, task: int, attempt: int, pass_no: int) -> _Attempt:
        key = keys.task_progress(task)
        held = cls(task, attempt, pass_no, key, None, TaskProgress.decode(None, key))
        held.refresh(store)
        return held

    def refresh(self, store: CoordinationStore) -> None:
        kv = store.get(self.key)
        self.raw = None if kv is None else kv.value
        self.progress = TaskProgress.decode(self.raw, self.key)

    def advance(self, end: int) -> tuple[Compare, Put, TaskProgress]:
        """The compare and write that move the record to ``end``; StalePush once the
        master has fenced this attempt (or a later one took the task)."""
        new = self.progress.advance(self.attempt, end)
        guard = Compare.absent(self.key) if self.raw is None else Compare.value(self.key, Op.EQ, self.raw)
        return guard, Put(self.key, new.encode()), new

    def advanced(self, new: TaskProgress) -> None:
        self.raw, self.progress = new.encode(), new


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

    def call(self, part: _Part, method: str, request: Message, into: Sequence[Any] | None = None) -> Message:
        """Call one pserver, pausing and retrying while it is unreachable or not ready.
        ``into``: where the reply's tensors may be received (see ``Channel.call``)."""
        first: float | None = None
        last_log = 0.0
        delay = 0.02
        while True:
            try:
                reply = part.channel.call(method, request) if into is None else part.channel.call(method, request, into=into)
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

    def call_each(
        self, method: str, requests: Sequence[tuple[_Part, Message]], into: Callable[[_Part], Sequence[Any]] | None = None
    ) -> list[Message | StalePush]:
        """Call several pservers, concurrently where the transport allows. A stale push
        comes back in its place in the list; any other error is raised once all calls
        ended (an :class:`EpochChanged` first: the caller must start over). ``into(part)``:
        where a reply's tensors may be received."""

        def one(part: _Part, request: Message) -> Message | StalePush:
            try:
                return self.call(part, method, request, None if into is None else into(part))
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


#: Elements of one overlapped push or pull to one pserver (4 MiB of float32): the slots
#: of parameters whose gradients are ready gather until they reach this, so a small
#: model sends one message per pserver a step, and a large one a few.
BUCKET_NUMEL = 1 << 20


class _Pipeline:
    """Communication beside computation for one trainer (``JobConfig.overlap``).

    A push-step arms it: as backward accumulates each parameter's gradient, a hook adds
    that parameter's blocks of each pserver to the pserver's bucket; a bucket of
    :data:`BUCKET_NUMEL` elements goes to the pserver's worker thread, which pushes it
    (``"part": true``) and then zeroes those blocks. The pservers check each piece is
    finite (the trainer makes no pass of its own over the gradient) and stage it; an
    async step is applied by a last ``"final"`` message once every piece was accepted
    everywhere. Async, once the pushes are in, the pull goes out bucket by bucket in
    forward order and :meth:`need` (a forward pre-hook) waits for a module's own
    parameters only.
    """

    def __init__(self, ctx: TrainerContext) -> None:
        assert ctx._replica is not None and ctx._group is not None
        self._ctx = ctx
        self._replica = ctx._replica
        self._group = ctx._group
        #: parameter index -> [(part position, that part's block positions)]
        self._pieces: dict[int, list[tuple[int, list[int]]]] = defaultdict(list)
        for pi, part in enumerate(self._group.parts):
            by_param: dict[int, list[int]] = defaultdict(list)
            for bi, b in enumerate(part.blocks):
                by_param[b.index].append(bi)
            for i, positions in by_param.items():
                self._pieces[i].append((pi, positions))
        self._workers = [ThreadPoolExecutor(1, thread_name_prefix=f"{ctx.trainer_id}-ps{part.index}") for part in self._group.parts]
        self._meta: list[dict] | None = None  # per part, while a push-step's backward runs
        self._sent: set[int] = set()
        self._bucket: list[list[int]] = []  # per part: block positions ready and not yet sent
        self._pushes: list[tuple[int, Future]] = []  # (part position, its reply)
        self._pulls: dict[int, list[Future]] = {}  # parameter -> its pulls in flight
        self._lock = threading.Lock()
        self._removers = [self._replica.on_grad_ready(self._ready)]
        if ctx.config.mode is Mode.ASYNC:
            self._removers.append(self._replica.before_forward(self.need))

    def close(self) -> None:
        for remove in self._removers:
            remove()
        self._removers = []
        for w in self._workers:
            w.shutdown(wait=True, cancel_futures=True)

    # --- pushes, during backward ----------------------------------------------------

    def push(self, loss: Any, metas: list[dict]) -> list[Message | StalePush]:
        """``loss.backward()`` with each slot pushed as soon as it is ready; one reply
        per part (StalePush if it dropped the step), once every piece has been answered.
        Async, only then, and only if no piece was refused anywhere, does each pserver
        get the step's ``final`` message, which applies what it staged: a refused piece
        raises here and the step changes no parameter anywhere."""
        self._meta, self._sent, self._pushes = metas, set(), []
        self._bucket = [[] for _ in self._workers]
        error: BaseException | None = None
        try:
            t0 = time.perf_counter()
            loss.backward()
            self._ctx._time("compute", time.perf_counter() - t0)
            for i in sorted(set(self._pieces) - self._sent):  # parameters this loss does not reach
                self._ready(i)
            for pi, bucket in enumerate(self._bucket):
                self._send(pi, bucket)
        except BaseException as exc:  # backward failed: nothing more goes out
            error = exc
        finally:
            self._meta = None
        # (the workers zero each piece once pushed: the caller must not zero the buffer
        # again, and parameters no piece covers hold no gradient anyone reads)
        results = self._replies(self._pushes)
        if error is not None:
            raise error
        if self._ctx.config.mode is Mode.ASYNC:
            ends = [(pi, self._workers[pi].submit(self._call, part, "push", Message({**metas[pi], "blocks": [], "part": True, "final": True})))
                    for pi, part in enumerate(self._group.parts) if not isinstance(results[pi], StalePush)]
            results = self._replies(ends, results)
        return results

    def _replies(self, calls: list[tuple[int, Future]], results: list[Message | StalePush] | None = None) -> list[Message | StalePush]:
        """Wait for every call (part position, its reply); a part's result is its last
        reply, or StalePush if any was; the first error (an EpochChanged first) is raised
        once all have ended."""
        t0 = time.perf_counter()
        results = [Message({})] * len(self._workers) if results is None else list(results)
        failures: list[BaseException] = []
        for pi, fut in calls:
            exc = fut.exception()
            if exc is None:
                reply = fut.result()
                if isinstance(reply, StalePush) or not isinstance(results[pi], StalePush):
                    results[pi] = reply
            else:
                failures.append(exc)
        self._ctx._time("wait", time.perf_counter() - t0)
        if failures:
            raise next((e for e in failures if isinstance(e, EpochChanged)), failures[0])
        return results

    def _ready(self, i: int) -> None:
        """Hook: parameter ``i``'s gradient is complete; queue its slots."""
        if self._meta is None or i in self._sent:
            return
        self._sent.add(i)
        for pi, positions in self._pieces.get(i, ()):
            bucket = self._bucket[pi]
            bucket.extend(positions)
            blocks = self._group.parts[pi].blocks
            if sum(blocks[j].numel for j in bucket) >= BUCKET_NUMEL:
                self._send(pi, bucket)
                self._bucket[pi] = []

    def _send(self, pi: int, positions: list[int]) -> None:
        """Push these blocks of part ``pi`` (in the pserver's order); the step's first
        push to a pserver says so (``first``: an async pserver drops what an unfinished
        step of ours staged)."""
        assert self._meta is not None
        if not positions:
            return
        part = self._group.parts[pi]
        blocks = [part.blocks[j] for j in sorted(positions)]
        tensors = self._replica.grad_blocks(blocks)
        first = not any(p == pi for p, _ in self._pushes)
        meta = {**self._meta[pi], "blocks": [b.key for b in blocks], "part": True, "first": first}
        self._pushes.append((pi, self._workers[pi].submit(self._push_piece, part, Message(meta, tensors), blocks)))

    def _push_piece(self, part: _Part, request: Message, blocks: list[Block]) -> Message | StalePush:
        """Push one piece (the pserver checks it is finite), then zero its gradient
        blocks here, off the trainer's thread: the step no longer needs them."""
        try:
            return self._call(part, "push", request)
        finally:
            self._replica.zero_blocks(blocks)

    def _call(self, part: _Part, method: str, request: Message, into: Sequence[Any] | None = None) -> Message | StalePush:
        t0 = time.perf_counter()
        try:
            reply = self._group.call(part, method, request, into)
        except StalePush as exc:
            return exc
        finally:
            self._ctx._time("comm", time.perf_counter() - t0)
        self._ctx._time("update", float(reply.meta.get("update_s", 0.0)))
        return reply

    # --- pulls, during the next forward (async) ----------------------------------------

    def pull_ahead(self) -> None:
        """Send the pull of every slot, bucket by bucket in forward order; :meth:`need`
        waits for them."""
        meta = {"trainer": self._ctx.trainer_id, "epoch": self._ctx.epoch}
        fresh = [True] * len(self._workers)
        buckets: list[tuple[list[int], list[Block]]] = [([], []) for _ in self._workers]  # (parameters, blocks)

        def send(pi: int) -> None:
            params, blocks = buckets[pi]
            if not blocks:
                return
            part = self._group.parts[pi]
            first, fresh[pi] = fresh[pi], False
            fut = self._workers[pi].submit(self._pull, part, blocks, Message({**meta, "blocks": [b.key for b in blocks]}), first)
            for i in params:
                self._pulls.setdefault(i, []).append(fut)
            buckets[pi] = ([], [])

        with self._lock:
            for i in sorted(self._pieces):
                for pi, positions in self._pieces[i]:
                    params, blocks = buckets[pi]
                    params.append(i)
                    blocks.extend(self._group.parts[pi].blocks[j] for j in positions)
                    if sum(b.numel for b in blocks) >= BUCKET_NUMEL:
                        send(pi)
            for pi in range(len(self._workers)):
                send(pi)

    def _pull(self, part: _Part, blocks: list[Block], request: Message, first: bool) -> None:
        reply = self._call(part, "pull", request, into=self._replica.value_blocks(blocks))
        assert isinstance(reply, Message)
        version = int(reply.meta["version"])
        # the step's pushes are checked against the oldest version this pull saw
        part.version = version if first else min(part.version, version)
        part.round_no = int(reply.meta["round"])
        part.incarnation = reply.meta.get("incarnation")
        self._replica.load_blocks(blocks, reply.tensors)

    def need(self, indices: Sequence[int]) -> None:
        """Forward pre-hook: wait until these parameters' pulls have landed."""
        with self._lock:
            futures = [f for i in indices for f in self._pulls.pop(i, ())]
        if futures:
            self._wait(futures)

    def drain(self) -> None:
        """Wait for every pull in flight (before anything else reads the parameters)."""
        with self._lock:
            futures = [f for fs in self._pulls.values() for f in fs]
            self._pulls.clear()
        if futures:
            self._wait(futures)

    def _wait(self, futures: list[Future]) -> None:
        t0 = time.perf_counter()
        errors = [e for e in (f.exception() for f in futures) if e is not None]
        self._ctx._time("wait", time.perf_counter() - t0)
        if errors:
            # a failed pull (a rollback, a pserver that restarted): the other pulls are
            # void too; fetch everything again the way a plain step would
            self.drain()
            self._ctx._pull_failed(errors[0])


#: Per-step time categories of :attr:`TrainerContext.timings`.
TIMINGS = ("compute", "data", "serialize", "network", "update", "barrier", "wait")


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
        self._master: Channel | None = None
        self._keeper = None
        self._waits = Waits(store, self._keys, self.trainer_id, lambda: None if self._keeper is None else self._keeper.lease)
        self._batch: Batch | None = None
        self._stepped: Batch | None = None  # the last batch step() ran on
        self._batch_no = 0
        self._stop = threading.Event()
        self._kill_after: int | None = None
        self._epoch = 0
        self._abandon = False  # a rollback or a fence voided the current task: batches() drops it
        self._attempt: _Attempt | None = None  # the task attempt being trained
        self._acc: tuple[int, int] | None = None  # async: records [start, end) summed since the last push
        #: every step of this trainer that was applied, in order (:class:`StepRecord`)
        self.history: list[StepRecord] = []
        #: How long an unreachable or unready pserver is waited for before it is an error.
        self.patience = DISCOVERY_TIMEOUT
        self.killed = False
        self.steps = 0  # mini-batches stepped
        self.pushes = 0
        self.stale_pushes = 0
        self.tasks_done = 0
        self.rollbacks = 0  # epochs this trainer followed
        self.metrics: dict[str, float] = {}  # free for the training function; shown as progress
        self._pipeline: _Pipeline | None = None
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
        out["serialize"] = sum(float((getattr(c, "stats", None) or {}).get("serialize", 0.0)) for c in channels)
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

    # --- the model --------------------------------------------------------------------

    def attach(self, model: Any) -> Any:
        """Bind ``model`` to the job: publish its layout, initialize the pservers, pull.

        The first trainer to attach publishes the model's layout and initial values
        (one compare-and-set decides it once); every other trainer waits for the
        pservers and pulls. A trainer whose model differs from the job's is refused
        with :class:`ConfigError` naming the difference. Returns the same model, whose
        parameters now hold the job's current values.
        """
        from pdps.runtime import recovery

        self.register()
        if self._publisher is not None:
            publisher = self._keys.trainer(self._publisher)
            wait_for_key(self._store, self._keys.model, f"trainer {self._publisher}'s model", unless=lambda: self._store.get(publisher) is None)
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
            spread = group.layout.spread_warning()
            if spread is not None:  # said once, by the trainer that published the model; pdps status says it too
                log.warning("trainer %s: %s", self.trainer_id, spread)
            for part in group.parts:
                self._init_part(part)
            self._store.put(self._keys.initialized, json.dumps({"by": self.trainer_id, "time": time.time()}).encode())
        self._pull_fresh()
        if self.config.mode is Mode.SYNC:
            self._join()
        replica.zero_grad()
        if self._pipeline is None and self._overlaps():
            self._pipeline = _Pipeline(self)
        self._back_to_user()
        return model

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
        if self.config.overlap != "auto":
            return self.config.overlap == "on"
        if self.device != "cpu" or not getattr(self._transport, "concurrent", False):
            return True
        threads = getattr(self._compute, "threads", None)
        return threads is not None and (os.cpu_count() or 1) > threads

    def _init_part(self, part: _Part) -> None:
        """Give pserver ``part`` this replica's values, unless it has some already."""
        assert self._replica is not None and self._group is not None
        meta = {"trainer": self.trainer_id, "epoch": self._epoch}
        self._group.call(part, "init", Message(meta, self._replica.values(part.blocks)))

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
        meta = {"trainer": self.trainer_id, "epoch": self._epoch}
        return {part.index: [list(r) for r in self._group.call(part, "applied", Message(meta)).meta["ledger"]] for part in self._group.parts}

    # --- data -------------------------------------------------------------------------

    def batches(self) -> Iterator[Batch]:
        """Mini-batches of the tasks leased from the master, until the job is done."""
        import torch  # the context hands torch tensors to the user's model

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
                self._attempt = _Attempt.read(self._store, self._keys, task.id, attempt, pass_no)
                try:
                    self._attempt.progress.check(attempt)
                except StalePush as exc:  # the master ended this attempt before we began
                    log.warning("trainer %s drops task %d attempt %d: %s", self.trainer_id, task.id, attempt, exc)
                    held = self._attempt = None
                    continue
                if self._attempt.progress.attempt == attempt:
                    offset = max(offset, self._attempt.progress.applied)  # handed to us again: go on
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
                    self._time("data", time.perf_counter() - fetching)
                    self._back_to_user()
                    yield self._batch
                    self._user_time()
                    fetching = time.perf_counter()
                    if self._abandon:
                        break
                    if self._stop.is_set() and not self._batch.last:
                        break
                else:
                    self._report("finish_task", held)
                    held = None
                if self._abandon:
                    # The job rolled back to a checkpoint (the master has put this task
                    # where the checkpoint had it), or the master fenced this attempt
                    # (it gave up on it and re-queued the task): the attempt is void.
                    log.warning("trainer %s drops task %d attempt %d: the job rolled back or the master re-queued it", self.trainer_id, task.id, attempt)
                    held = None
                    self._abandon = False
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
        self._user_time()
        try:
            if self._abandon:
                # a pull during this batch's forward found the job rolled back: its
                # gradient belongs to the old epoch, and batches() moves on
                self._replica.zero_grad()
                return
            sync = self.config.mode is Mode.SYNC
            # with overlap, backward runs inside the push: each slot leaves when it is ready
            overlap = self._pipeline is not None and (samples > 0 if sync else self._push_due(self._batch_no + 1))
            if not overlap:
                began = time.perf_counter()
                loss.backward()
                self._time("compute", time.perf_counter() - began)
            self.steps += 1
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
            self._back_to_user()

    def _pull_failed(self, exc: BaseException) -> None:
        """A pull sent ahead failed: follow a rollback as a step would, or raise."""
        if not isinstance(exc, (EpochChanged, NotInitialized)):
            raise exc
        log.warning("trainer %s: %s", self.trainer_id, exc)
        self._resync()

    @staticmethod
    def _contribution(samples: int, batch: Batch | None) -> Contribution:
        """What we commit to a round: ``samples`` of ``batch`` (None: no batch; zero
        samples of a batch: it was consumed, and its refused gradient applies nowhere)."""
        if batch is None:
            return Contribution(samples)
        return Contribution(samples, batch.task.id, batch.attempt, batch.start + batch.size, batch.last, start=batch.start)

    def _sync_round(self, samples: int, loss: Any = None) -> None:
        """Push to every pserver (staged there), commit the contribution to the round's
        record, then pull the round's result: the step applies everywhere or nowhere.
        With ``loss`` (overlap), its backward runs here, each slot pushed when ready.
        A refused gradient (not finite) is committed as zero samples, so the round need
        not wait for us and applies none of it; then GradientRejected is raised."""
        assert self._replica is not None and self._group is not None
        if self._pipeline is not None:
            self._pipeline.drain()
        round_no = max(p.round_no for p in self._group.parts)
        stale = False
        refused: GradientRejected | None = None
        if samples:
            meta = {"trainer": self.trainer_id, "round": round_no, "samples": samples, "epoch": self._epoch}
            try:
                if loss is not None and self._pipeline is not None:
                    replies = self._pipeline.push(loss, [meta] * len(self._group.parts))
                else:
                    self._replica.check_finite(self.trainer_id)  # all pservers or none: fail before the first push
                    requests = [(part, Message({**meta, "blocks": part.keys}, self._replica.grads(part.blocks))) for part in self._group.parts]
                    replies = self._call_each("push", requests)
            except GradientRejected as exc:
                refused, replies = exc, []
            for part, reply in zip(self._group.parts, replies):
                if isinstance(reply, StalePush):
                    stale = True
                    log.warning("trainer %s: push to pserver %d was stale (%s); pulling", self.trainer_id, part.index, reply)
        if not stale:
            began = time.perf_counter()
            batch = self._batch if samples else None
            stale = not self._commit(round_no, self._contribution(0 if refused else samples, batch))
            self._time("barrier", time.perf_counter() - began)
        if refused is None and stale:
            self.stale_pushes += 1
        elif refused is None and samples:
            self.pushes += len(self._group.parts)
        if loss is None or self._pipeline is None:
            # pushed or refused, the next step starts clean (the pipeline's workers zeroed
            # each piece they pushed, refused or not)
            self._replica.zero_grad()
        if stale:
            self._pull_fresh()
        else:
            self._pull_round(round_no)
        if refused is not None:
            raise refused

    def _commit(self, round_no: int, contribution: Contribution) -> bool:
        """Add our contribution to round ``round_no``'s record; False if it had closed.

        A contribution that trained records advances its task's progress record in the
        same transaction (exactly once per record): if the master has fenced the attempt
        meanwhile, the step is not applied (a zero-sample contribution keeps the round
        going) and :meth:`batches` drops the task."""
        key = self._keys.round(self._epoch, round_no)
        held = self._attempt if contribution.samples and contribution.task is not None else None
        while True:
            kv = self._store.get(key)
            record = RoundRecord(round_no) if kv is None else decode_as(kv.value, kv.key, RoundRecord.from_json)
            guards: list[Compare] = [Compare.absent(key) if kv is None else Compare.revision(key, Op.EQ, kv.mod_revision)]
            ops: list[TxnOp] = []
            advanced = None
            if held is not None:
                try:
                    guard, put, advanced = held.advance(contribution.offset)
                except StalePush as exc:
                    self._lose_task(exc)
                    held, contribution = None, Contribution(0)
                    continue
                guards.append(guard)
                ops.append(put)
            try:
                updated = record.contribute(self.trainer_id, contribution)
            except StalePush:
                return False
            if updated is record:  # committed already (a retry whose reply was lost)
                if held is not None:
                    held.refresh(self._store)
                    self._applied(contribution, round_no)
                return True
            ops.insert(0, Put(key, json.dumps(updated.to_json()).encode()))
            if self._store.commit(tuple(guards), tuple(ops)).succeeded:
                if held is not None and advanced is not None:
                    held.advanced(advanced)
                    self._applied(contribution, round_no)
                return True
            if held is not None:
                held.refresh(self._store)  # the round or the progress record moved: look again

    def _applied(self, c: Contribution, round_no: int | None) -> None:
        """Note a step that went into the parameters (:attr:`history`)."""
        assert self._attempt is not None and c.task is not None and c.attempt is not None
        self.history.append(StepRecord(round_no, self._epoch, self._attempt.pass_no, c.task, c.attempt, c.start, c.offset, c.samples))

    def _lose_task(self, why: BaseException) -> None:
        """The master gave up on our attempt and fenced it: nothing more of it is
        applied; batches() drops the task."""
        if not self._abandon:
            log.warning("trainer %s: the master re-queued its task (%s); dropping it", self.trainer_id, why)
        self._abandon = True

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

    def _push_due(self, batch_no: int) -> bool:
        """Async: push after the ``batch_no``-th batch? Every ``push_every`` batches of a
        task, and after its last batch: a push never mixes two tasks' records, so how
        far a task has trained is a push boundary (exactly once per record)."""
        return self.config.cadence.push_due(batch_no) or (self._batch is not None and self._batch.last)

    def _async_step(self, loss: Any = None) -> None:
        assert self._replica is not None
        self._batch_no += 1
        cadence = self.config.cadence
        must_pull = False
        if self._push_due(self._batch_no):
            must_pull = self._async_push(loss)
            if self._batch is not None and self._batch.last:
                self._batch_no = 0  # the next task counts its batches from its start
        if must_pull or not cadence.pull_due(self._batch_no):
            if must_pull:
                self._pull_fresh()
        elif self._pipeline is not None:
            self._pipeline.pull_ahead()  # lands while the next forward runs
        else:
            self._pull_fresh()

    def _async_push(self, loss: Any = None) -> bool:
        """Push the summed gradients to every pserver; True if one of them said pull.
        With ``loss`` (overlap), its backward runs here, each slot pushed when ready. A
        refused gradient (not finite) applies nowhere and is dropped, the whole sum since
        the last push: the next step starts clean; GradientRejected is raised."""
        assert self._replica is not None and self._group is not None
        if self._pipeline is not None:
            self._pipeline.drain()
        held, acc = self._attempt, self._acc
        self._acc = None  # these records leave with this push, or are dropped with it if it is refused
        records = None if held is None or acc is None else [held.pass_no, held.task, held.attempt, acc[0], acc[1]]
        metas = [
            {"trainer": self.trainer_id, "version": part.version, "blocks": part.keys, "epoch": self._epoch, "incarnation": part.incarnation, "records": records}
            for part in self._group.parts
        ]
        if loss is not None and self._pipeline is not None:
            replies = self._pipeline.push(loss, metas)  # (its workers zero each piece once pushed, refused or not)
        else:
            try:
                self._replica.check_finite(self.trainer_id)
                requests = [(part, Message(meta, self._replica.grads(part.blocks))) for part, meta in zip(self._group.parts, metas)]
                replies = self._call_each("push", requests)
            finally:
                self._replica.zero_grad()  # pushed or refused: the next step starts clean
        stale = False
        for part, reply in zip(self._group.parts, replies):
            if isinstance(reply, StalePush):
                stale = True
                self.stale_pushes += 1
                log.info("trainer %s: pserver %d dropped a stale push: %s", self.trainer_id, part.index, reply)
            else:
                self.pushes += 1
        if held is not None and acc is not None:
            self._record_progress(held, acc)
        return stale

    def _record_progress(self, held: _Attempt, records: tuple[int, int]) -> None:
        """Async: every pserver has the push of ``records``: advance the task's progress
        record (compare-and-set). A fenced attempt drops its task; its pushes beyond the
        fence are the pservers' to ignore (they apply each task's records once)."""
        while True:
            try:
                guard, put, new = held.advance(records[1])
            except StalePush as exc:
                self._lose_task(exc)
                return
            if self._store.commit((guard,), (put,)).succeeded:
                held.advanced(new)
                samples = records[1] - records[0]
                self.history.append(StepRecord(None, self._epoch, held.pass_no, held.task, held.attempt, records[0], records[1], samples))
                return
            held.refresh(self._store)

    def _flush(self) -> None:
        """Async: push what was accumulated since the last push, so no batch is lost."""
        if self.config.mode is Mode.ASYNC and self._replica is not None and self._batch_no % self.config.push_every:
            try:
                self._async_push()
            except EpochChanged:
                self._resync()
            except GradientRejected as exc:  # the loop has ended: nobody is left to catch it
                log.error("trainer %s drops the gradient of its last %d batches: %s", self.trainer_id, self._batch_no % self.config.push_every, exc)
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
            replies = self._call_each("pull", [(part, Message(meta)) for part in pending], into=self._into)
            self._time("barrier", max(float(r.meta.get("wait_s", 0.0)) for r in replies if isinstance(r, Message)))
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

    def _into(self, part: _Part) -> Sequence[Any]:
        """Where a pull from ``part`` may land: the model's own memory (no copy after)."""
        assert self._replica is not None
        return self._replica.value_blocks(part.blocks)

    def _call_each(
        self, method: str, requests: Sequence[tuple[_Part, Message]], into: Callable[[_Part], Sequence[Any]] | None = None
    ) -> list[Message | StalePush]:
        """:meth:`PserverGroup.call_each`, timed (the trainer thread waits for it all)."""
        assert self._group is not None
        began = time.perf_counter()
        try:
            replies = self._group.call_each(method, requests, into)
        finally:
            spent = time.perf_counter() - began
            self._time("comm", spent)
            self._time("wait", spent)
        self._time("update", sum(float(r.meta.get("update_s", 0.0)) for r in replies if isinstance(r, Message)))
        return replies

    def _pull_fresh(self) -> None:
        """Load every pserver's current values (initializing any that has none)."""
        assert self._group is not None
        if self._pipeline is not None:
            self._pipeline.drain()
        meta = {"trainer": self.trainer_id, "epoch": self._epoch}
        for part in self._group.parts:
            waited = time.monotonic()
            while True:
                try:
                    began = time.perf_counter()
                    try:
                        reply = self._group.call(part, "pull", Message(meta), self._into(part))
                    finally:
                        spent = time.perf_counter() - began
                        self._time("comm", spent)
                        self._time("wait", spent)
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
        from pdps.runtime import recovery

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
