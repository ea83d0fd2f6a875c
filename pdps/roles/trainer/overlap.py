"""The overlap engine: a trainer's communication beside its computation
(``JobConfig.overlap``), driven by the model replica's gradient and forward hooks."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.errors import EpochChanged, SlotMapChanged, StalePush
from pdps.core.sgd import Mode
from pdps.core.slots import Block
from pdps.core.wire import PullReply, PullRequest, PushReply, PushRequest, Request
from pdps.roles.trainer.pserver_client import Part

if TYPE_CHECKING:
    from pdps.roles.trainer.context import TrainerContext


#: of parameters whose gradients are ready gather until they reach this, so a small
#: model sends one message per pserver a step, and a large one a few.
BUCKET_NUMEL = 1 << 20


class Pipeline:
    """Communication beside computation for one trainer (``JobConfig.overlap``).

    A push-step arms it: as backward accumulates each parameter's gradient, a hook adds
    that parameter's blocks of each pserver to the pserver's bucket; a bucket of
    :data:`BUCKET_NUMEL` elements goes to the pserver's worker thread, which pushes it
    (``"part": true``) and, async, then zeroes those blocks. The pservers check each
    piece is finite (the trainer makes no pass of its own over the gradient) and stage
    it; an async step is applied by a last ``"final"`` message once every piece was
    accepted everywhere. Sync, the gradient stays whole until the round is committed: a
    piece a pserver refused because the slot map moved (a failover, a resize at this
    round's boundary) comes back as :class:`SlotMapChanged`, and the trainer pushes the
    whole gradient again by the new map, as it does without overlap; it zeroes the
    gradient itself once the round is committed (``ctx.step`` returns with it zero).
    Async, once the pushes are in, the pull goes out bucket by bucket in forward order
    and :meth:`need` (a forward pre-hook) waits for a module's own parameters only.
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
        self._meta: list[PushRequest] | None = None  # per part, while a push-step's backward runs
        self._sync = ctx.config.mode is Mode.SYNC  # sync: the trainer zeroes the gradient once the round is committed
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

    def push(self, loss: Any, metas: list[PushRequest]) -> list[PushReply | StalePush | SlotMapChanged]:
        """``loss.backward()`` with each slot pushed as soon as it is ready; one reply
        per part (StalePush if it dropped the step; sync, SlotMapChanged if a piece was
        refused by a map it no longer serves), once every piece has been answered.
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
        # (async, the workers zero each piece once pushed: the caller must not zero the
        # buffer again, and parameters no piece covers hold no gradient anyone reads)
        results = self._replies(self._pushes)
        if error is not None:
            raise error
        if self._ctx.config.mode is Mode.ASYNC:
            ends = [(pi, self._workers[pi].submit(self._call, part, attrs.evolve(metas[pi], blocks=(), part=True, final=True)))
                    for pi, part in enumerate(self._group.parts) if not isinstance(results[pi], StalePush)]
            results = self._replies(ends, results)
        return results

    def _replies(self, calls: list[tuple[int, Future]], results: list[Any] | None = None) -> list[Any]:
        """Wait for every call (part position, its reply); a part's result is its last
        reply, or StalePush if any was; the first error (an EpochChanged first) is raised
        once all have ended."""
        t0 = time.perf_counter()
        results = [None] * len(self._workers) if results is None else list(results)
        failures: list[BaseException] = []
        for pi, fut in calls:
            exc = fut.exception()
            if exc is None:
                reply = fut.result()
                if isinstance(reply, (StalePush, SlotMapChanged)) or not isinstance(results[pi], (StalePush, SlotMapChanged)):
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
        request = attrs.evolve(self._meta[pi], blocks=tuple(b.key for b in blocks), part=True, first=first, tensors=tensors)
        self._pushes.append((pi, self._workers[pi].submit(self._push_piece, part, request, blocks)))

    def _push_piece(self, part: Part, request: PushRequest, blocks: list[Block]) -> PushReply | StalePush | SlotMapChanged:
        """Push one piece (the pserver checks it is finite); async, then zero its
        gradient blocks here, off the trainer's thread: the step no longer needs them."""
        try:
            return self._call(part, request)
        finally:
            if not self._sync:
                self._replica.zero_blocks(blocks)

    def _call(self, part: Part, request: Request, into: Sequence[Any] | None = None) -> Any:
        t0 = time.perf_counter()
        try:
            reply = self._group.ask(part, request, into)
        except StalePush as exc:
            return exc
        except SlotMapChanged as exc:  # a failover or a resize moved slots
            if not isinstance(request, PushRequest):
                raise
            if self._sync:
                return exc  # the trainer pushes the step again, by the new map
            return StalePush(f"pserver {part.index} serves a new slot map: {exc}")  # async: this push is dropped there
        finally:
            self._ctx._time("comm", time.perf_counter() - t0)
        if isinstance(reply, PushReply) and reply.update_s is not None:
            self._ctx._time("update", reply.update_s)
        return reply

    # --- pulls, during the next forward (async) ----------------------------------------

    def pull_ahead(self) -> None:
        """Send the pull of every slot, bucket by bucket in forward order; :meth:`need`
        waits for them."""
        request = PullRequest(self._ctx.trainer_id, epoch=self._ctx.epoch, version=self._group.layout.slot_map.version)
        fresh = [True] * len(self._workers)
        buckets: list[tuple[list[int], list[Block]]] = [([], []) for _ in self._workers]  # (parameters, blocks)

        def send(pi: int) -> None:
            params, blocks = buckets[pi]
            if not blocks:
                return
            part = self._group.parts[pi]
            first, fresh[pi] = fresh[pi], False
            fut = self._workers[pi].submit(self._pull, part, blocks, attrs.evolve(request, blocks=tuple(b.key for b in blocks)), first)
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

    def _pull(self, part: Part, blocks: list[Block], request: PullRequest, first: bool) -> None:
        reply = self._call(part, request, into=self._replica.value_blocks(blocks))
        assert isinstance(reply, PullReply)
        # the step's pushes are checked against the oldest update count this pull saw
        part.version = reply.updates if first else min(part.version, reply.updates)
        part.round_no = reply.round_no
        part.incarnation = reply.incarnation
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

