"""The trainer's pipeline role: a trainer as one stage of a pipeline job
(design/pipeline.md §5; the user's guide is docs/pipeline.md).

A job with ``pipeline_stages`` P > 1 runs ``trainers`` = P × D trainers: D data-parallel
pipelines of P stages. Rules, in a few lines:

* **Ranks.** Each trainer claims the lowest free rank of ``[0, P * D)`` under its lease
  (:mod:`pdps.runtime.hybrid`), serving its p2p endpoint (:class:`~pdps.runtime.p2p.P2P`)
  at the address it claims with. The rank decides its stage (``rank % P``) and its
  pipeline (``rank // P``): :class:`~pdps.core.hybrid.HybridGroup`'s accessors.
* **Parameters.** Every trainer builds the whole model and attaches it (the layout on
  the pservers is the whole model's, the first trainer's values initialize them), then
  keeps to its stage's parameters: it pushes and pulls only their blocks
  (:meth:`~pdps.roles.trainer.pserver_client.PserverGroup.restrict`).
* **Stage 0 holds the task.** It is the pipeline's trainer as the master and the sync
  rounds know it: it leases tasks, reads each batch, cuts it into microbatches
  (``pipeline_microbatches``, fewer for a batch of fewer rows) and sends a step header
  down the pipeline: ``[kind, step, round, samples, microbatches]``, kind 0 a step, 1 the
  end. The other stages leave the job's trainers (they are no participants of a round)
  and follow the headers.
* **Sync, exactly.** A pipeline is *one participant* of a round: every stage pushes its
  own blocks' gradients (``part``) under stage 0's trainer id, so on each pserver that
  key is staged once every block it holds has come, whichever stage sent it. Every stage
  tells stage 0 its push was accepted (``<step>/pushed``); only then does stage 0 commit
  the contribution (the batch's samples, its records), so a round never names a gradient
  that is not wholly staged. Each stage's gradient is the sum over microbatches of the
  microbatch losses weighted by their share of the batch, i.e. the gradient of the
  batch-mean loss, so the round's update (the sample-weighted mean over pipelines) is
  the one single-process training on the pipelines' concatenated batches makes.
  Every stage then pulls the round's result for its own blocks.
* **Async** (``push_every = pull_every = 1``): the stages push their blocks as pieces of
  one step under stage 0's trainer id, each reporting the updates it last saw from each
  pserver; stage 0 then sends the step's ``final`` (with its records) to every pserver
  that took a piece, so each pserver applies the pipeline's whole step at once and each
  task's records once; then stage 0 records the task's progress and every stage pulls.
* **Failure.** Every receive has a deadline (``pipeline_timeout``); a stage whose peer
  died raises :class:`~pdps.core.errors.Timeout` naming the peer and what it waited for,
  so its pipeline stops (no hang). Stage 0's task goes back to the queue (given back
  when it stops, re-queued by the master when it died); a stage waiting for the next
  header gives up as soon as stage 0's rank claim is gone. A restarted trainer claims the
  free rank (a dead one's frees when its lease runs out) and the pipeline forms again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from pdps.core.errors import ConfigError, EpochChanged, NotInitialized, SlotMapChanged, StalePush, Timeout, TransportError
from pdps.core.hybrid import HybridGroup, HybridLayout
from pdps.core.job import says_done
from pdps.core.pipeline import gpipe, one_f_one_b
from pdps.core.sgd import Mode
from pdps.core.wire import PushRequest
from pdps.ports.compute import PipelineCompute
from pdps.ports.coordination import Delete
from pdps.roles.trainer.discovery import DISCOVERY_TIMEOUT
from pdps.roles.trainer.pserver_client import PserverGroup
from pdps.runtime.hybrid import claim_rank, ranks, release
from pdps.runtime.watching import watch_until
from pdps.runtime.p2p import P2P

if TYPE_CHECKING:
    from pdps.roles.trainer.context import Batch, TrainerContext

log = logging.getLogger(__name__)

#: Header kinds: a step follows; the pipeline's work is over.
STEP, END = 0, 1
#: The schedules of ``pipeline_schedule``: per-rank action lists (:mod:`pdps.core.pipeline`).
SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}

__all__ = ["END", "STEP", "Header", "PipelineStage"]


@attrs.frozen
class Header:
    """What stage 0 sends down its pipeline before each step (tag ``h/<step>``)."""

    kind: int
    step: int
    round_no: int
    samples: int
    microbatches: int

    def values(self) -> list[int]:
        return [self.kind, self.step, self.round_no, self.samples, self.microbatches]

    @classmethod
    def parse(cls, values: Sequence[int], src: int) -> Header:
        """A received header; anything else is refused naming the sender."""
        if len(values) != 5 or values[0] not in (STEP, END) or any(v < 0 for v in values) or (values[0] == STEP and (values[3] < 1 or values[4] < 1)):
            raise ConfigError(f"rank {src} sent a malformed pipeline header {list(values)!r}: expected [kind 0|1, step, round, samples >= 1, microbatches >= 1]")
        return cls(*(int(v) for v in values))


#: Seconds between looks at the claim of the peer a receive waits for.
WATCH_EVERY = 0.5


class WatchedLink:
    """The stage's :class:`~pdps.runtime.p2p.P2P` as a Link whose receives also watch the
    peer's rank claim: a peer whose claim is gone (it left, or died and its lease ran
    out) or taken by another trainer ends the wait at once with a
    :class:`~pdps.core.errors.Timeout` naming it, rather than at the deadline."""

    def __init__(self, p2p: P2P, look: Callable[[int], Any], members: Callable[[int], str], rank: Callable[[], int]) -> None:
        self._p2p, self._look, self._members, self._rank = p2p, look, members, rank

    def send(self, peer: int, tag: str, tensors: Sequence[Any], *, stop_gradient: Sequence[bool] | None = None) -> None:
        self._p2p.send(peer, tag, tensors, stop_gradient=stop_gradient)

    def recv(self, peer: int, tag: str, *, timeout: float | None = None) -> list[Any]:
        wait = self._p2p._timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        while True:
            left = deadline - time.monotonic()
            try:
                return self._p2p.recv(peer, tag, timeout=max(0.0, min(WATCH_EVERY, left)))
            except Timeout:
                if time.monotonic() >= deadline:
                    raise Timeout(self._p2p._waited(peer, tag, wait)) from None
            claim = self._look(peer)
            if claim is None or claim.member != self._members(peer):
                raise Timeout(self.left(peer, tag, claim))

    def left(self, peer: int, tag: str, claim: Any) -> str:
        """What a wait for ``tag`` from ``peer`` ends with once the peer's rank claim is
        gone (``claim`` None) or held by another trainer."""
        now = "free" if claim is None else f"held by {claim.member}"
        return f"rank {self._rank()} waited for {tag!r} from rank {peer} ({self._members(peer)}), which left the pipeline (its rank is {now})"

    def batch_send_recv(self, sends: Sequence[tuple[int, str, Sequence[Any]]], recvs: Sequence[tuple[int, str]], *, timeout: float | None = None) -> list[list[Any]]:
        for peer, tag, tensors in sends:
            self.send(peer, tag, tensors)
        return [self.recv(peer, tag, timeout=timeout) for peer, tag in recvs]


class PipelineStage:
    """This trainer's stage of a pipeline job: made by :meth:`TrainerContext.pipeline`,
    run by :meth:`train`.

    ``model`` is the whole model (an ``nn.Sequential``, built alike by every trainer);
    ``loss_fn(output, target)`` the mean loss over a microbatch (used on the last stage);
    ``points`` where the stages start (default: balanced by parameter count);
    ``address`` where this stage's p2p endpoint serves (default: the transport's
    loopback, a free port).
    """

    def __init__(
        self,
        ctx: TrainerContext,
        model: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        points: Sequence[int] | None = None,
        address: str | None = None,
    ) -> None:
        config = ctx.config
        stages = config.pipeline_stages
        if stages < 2:
            raise ConfigError(f"ctx.pipeline() runs a stage of a pipeline job: set pipeline_stages >= 2 (the job has {stages}); without it, train with ctx.attach() and ctx.step()")
        compute = ctx._compute
        if not isinstance(compute, PipelineCompute):
            raise ConfigError(f"the trainer's compute ({type(compute).__name__}) cannot cut a model into pipeline stages")
        if not callable(loss_fn):
            raise ConfigError(f"ctx.pipeline() needs loss_fn(output, target), the mean loss over a microbatch; got {loss_fn!r}")
        self._ctx = ctx
        self._compute = compute
        self._store = ctx._store
        self._keys = ctx._keys
        self.layout = HybridLayout.from_counts(config.trainers, stages)
        parts = compute.split(model, stages, points=points)  # refuses a model that cannot be cut, before anything is claimed
        for s, part in enumerate(parts):  # every trainer cuts alike: each refuses at once, none waits for a rank never claimed
            if not any(p.requires_grad for p in part.parameters()):
                raise ConfigError(f"stage {s} holds no trainable parameter: cut the model elsewhere (points=)")
        ctx.register()
        assert ctx._keeper is not None
        self._lease = ctx._keeper.lease
        transport = ctx._transport
        scheme = getattr(transport, "scheme", "grpc")
        where = address or (f"{scheme}://" if scheme == "inproc" else f"{scheme}://127.0.0.1:0")
        self._p2p = P2P(transport, 0, where, peers=self._address_of, timeout=config.pipeline_timeout)
        self._claims: dict[int, Any] | None = {}
        try:
            self.group: HybridGroup = claim_rank(
                self._store, self._keys, self.layout, ctx.trainer_id, self._p2p.address, self._lease, wait=DISCOVERY_TIMEOUT
            )
            self._p2p.rank = self.group.rank
            self.stage = self.group.get_stage_id()
            self.module = parts[self.stage]
            if not self.group.is_first_stage:
                # not a participant of the sync rounds: stage 0 commits for the pipeline
                key = self._keys.trainer(ctx.trainer_id)
                self._store.commit((), (Delete(key),))
                ctx._rounds_member = False
            names = [n for n, p in self.module.named_parameters() if p.requires_grad]
            self._claims = self._wait_for_pipeline()
            if self._claims is not None:
                ctx.attach(model)
                if ctx._pipeline is not None:  # per-slot pushes during backward: not for a stage (it pushes after its step)
                    ctx._pipeline.close()
                    ctx._pipeline = None
                assert ctx._group is not None
                ctx._group.restrict(names)
        except BaseException:
            self._close(release_rank=True)
            raise
        self._ranks = self.group.get_pipe_parallel_group()
        self._first = self._ranks[0]
        #: the job was done before this stage's pipeline formed (a restart after the end): train() returns at once
        self.job_done = self._claims is None
        self._lead = "" if self._claims is None else self._claims[self._first].member  # stage 0's trainer id: the key every stage pushes under
        self._link = WatchedLink(self._p2p, lambda r: ranks(self._store, self._keys).get(r), lambda r: self._claims[r].member if self._claims else "", lambda: self.group.rank)
        self.runner = compute.stage_runner(
            self.module, self.stage, stages, self._link, loss_fn if self.group.is_last_stage else None, ranks=self._ranks, timeout=config.pipeline_timeout
        )
        self._schedule = SCHEDULES[config.pipeline_schedule]
        self._sync = config.mode is Mode.SYNC
        #: async, stage 0: every pserver of the model (its step's finals go to those its stages pushed to)
        self._everyone: PserverGroup | None = None
        if not self._sync and self.group.is_first_stage and not self.job_done:
            assert ctx._replica is not None
            self._everyone = PserverGroup(self._store, ctx._transport, config, ctx._replica.specs, waits=ctx._waits, patience=ctx.patience)
        self._loaded: int | None = None  # the round whose result this stage holds (stages after the first)
        #: steps this stage ran; on stage 0 and the last stage, each step's batch-mean loss
        self.steps = 0
        self.losses: list[float] = []
        self.peak_activations = 0
        if not self.job_done:
            log.info("trainer %s is stage %d of pipeline %d (rank %d of %d)", ctx.trainer_id, self.stage, self.group.get_data_parallel_rank(), self.group.rank, self.layout.world_size)

    # --- the loop ---------------------------------------------------------------------

    def train(self, prepare: Callable[[Batch], tuple[Any, Any]]) -> list[float]:
        """Train until the job is done. ``prepare(batch)`` (stage 0 only) returns the
        batch's ``(inputs, targets)``: each a tensor cut along dim 0 into the job's
        microbatches, or a list of microbatches (shapes may differ between them: a
        sequence length). Returns :attr:`losses` (stage 0 and the last stage: each step's
        batch-mean loss; other stages: empty)."""
        from pdps.roles.trainer.context import Killed

        crashed = False
        try:
            if self.job_done:
                log.info("trainer %s: the job is done; pipeline rank %d has nothing to train", self._ctx.trainer_id, self.group.rank)
            elif self.group.is_first_stage:
                self._run_first(prepare)
            else:
                self._run_follower()
        except Killed:
            crashed = True
            raise
        finally:
            self._close(release_rank=not crashed)
        return self.losses

    def _run_first(self, prepare: Callable[[Batch], tuple[Any, Any]]) -> None:
        ctx = self._ctx
        step = 0
        batches = ctx.batches()
        try:
            for batch in batches:
                self._maybe_killed()
                inputs, targets = prepare(batch)
                microbatches = len(inputs) if isinstance(inputs, (list, tuple)) else max(1, min(ctx.config.pipeline_microbatches, batch.size))
                # the step's weight in the round: the rows its loss is the mean over (the batch's, unless prepare dropped some)
                samples = sum(int(t.shape[0]) for t in targets) if isinstance(targets, (list, tuple)) else int(targets.shape[0])
                assert ctx._group is not None
                round_no = max(p.round_no for p in ctx._group.parts)
                header = Header(STEP, step, round_no, samples, microbatches)
                self._send_header(header)
                self.runner.run(self._actions(microbatches), inputs, targets, step=step)
                self._note_run()
                stale = self._push(round_no, samples)
                seen: dict[int, int] = {}
                for r in [self._first, *self._ranks[1:]]:
                    got = self._seen() if r == self._first else self._link.recv(r, f"{step}/pushed", timeout=ctx.config.pipeline_timeout)[0].tolist()
                    if r != self._first:
                        stale = stale or bool(got[0])
                        if r == self._ranks[-1]:
                            self.losses.append(float(got[1]))
                            ctx.metrics["loss"] = float(got[1])
                        got = got[2:]
                    for index, version in zip(got[::2], got[1::2]):
                        seen[int(index)] = min(seen.get(int(index), int(version)), int(version))
                if self._sync:
                    self._settle(round_no, batch, samples, stale, step)
                else:
                    ctx.steps += 1
                    ctx.samples += samples
                    ctx._stepped = batch
                    applied = not stale and self._apply(batch, seen)
                    ctx._zero_grad()
                    self._tell(step, applied)
                    ctx._pull_fresh()
                step += 1
        except (Timeout, TransportError) as exc:
            log.error("trainer %s (stage 0 of pipeline %d): the pipeline is broken: %s", ctx.trainer_id, self.group.get_data_parallel_rank(), exc)
            raise
        finally:
            batches.close()  # a broken step's task goes back to the queue now (a crash's: when its lease runs out)
        self._send_header(Header(END, step, 0, 0, 0))

    def _run_follower(self) -> None:
        try:
            self._follow()
        except (Timeout, TransportError) as exc:
            log.error("trainer %s (stage %d of pipeline %d): the pipeline is broken: %s", self._ctx.trainer_id, self.stage, self.group.get_data_parallel_rank(), exc)
            raise

    def _follow(self) -> None:
        ctx = self._ctx
        expected = 0
        while True:
            header = self._wait_header(expected)
            if header.kind == END:
                return
            self._maybe_killed()
            if self._sync and header.round_no > 0 and self._loaded != header.round_no - 1:
                ctx._pull_round(header.round_no - 1)  # rounds went by without this stage (stage 0 idle)
            loss = self.runner.run(self._actions(header.microbatches), step=header.step)
            self._note_run()
            stale = self._push(header.round_no, header.samples)
            if loss is not None:
                self.losses.append(loss)
                ctx.metrics["loss"] = loss
            told = np.array([float(stale), float("nan") if loss is None else loss, *([] if self._sync else self._seen())], dtype=np.float64)
            self._p2p.send(self._first, f"{header.step}/pushed", [self._tensor(told)], stop_gradient=[True])
            ctx._zero_grad()
            ctx.steps += 1
            ctx.samples += header.samples
            # the round closes only once stage 0 committed (or gave up on) the step: wait
            # for its word, watching its claim, rather than for a round nobody may commit
            committed = bool(self._link.recv(self._first, f"{header.step}/committed", timeout=ctx.config.pipeline_timeout)[0].tolist()[0])
            if not self._sync:
                ctx._pull_fresh()  # async: the values as they are now, this stage's blocks
            elif committed:
                ctx._pull_round(header.round_no)
                self._loaded = header.round_no
            else:
                ctx._pull_fresh()
                self._loaded = None
            expected = header.step + 1

    # --- pieces -------------------------------------------------------------------------

    def _actions(self, microbatches: int) -> list[Any]:
        return self._schedule(self.layout.pipeline, microbatches)[self.stage]

    def _note_run(self) -> None:
        self.steps += 1
        self.peak_activations = max(self.peak_activations, int(self.runner.peak_activations))

    def _maybe_killed(self) -> None:
        """``pdps.simulate``'s ``kill``: crash after that many steps."""
        from pdps.roles.trainer.context import Killed

        ctx = self._ctx
        if ctx._kill_after is not None and self.steps >= ctx._kill_after:
            ctx.killed = True
            raise Killed(ctx.trainer_id)

    def _tensor(self, values: np.ndarray) -> Any:
        return self._compute.tensors({"v": values})["v"]  # type: ignore[attr-defined]

    def _send_header(self, header: Header) -> None:
        tensor = self._tensor(np.array(header.values(), dtype=np.int64))
        for r in self._ranks[1:]:
            self._p2p.send(r, f"h/{header.step}", [tensor], stop_gradient=[True])

    def _wait_header(self, step: int) -> Header:
        """The header of ``step`` from stage 0, however long stage 0 waits for work, as
        long as it holds its rank (a Timeout naming it once it does not). A stop asked of
        this trainer (SIGTERM) between steps ends its part: an end header of its own."""
        tag = f"h/{step}"
        while True:
            if self._ctx._stop.is_set():
                log.warning("trainer %s leaves pipeline %d (stage %d) between steps: asked to stop", self._ctx.trainer_id, self.group.get_data_parallel_rank(), self.stage)
                return Header(END, step, 0, 0, 0)
            try:
                got = self._link.recv(self._first, tag, timeout=2 * WATCH_EVERY)
            except Timeout:
                claim = ranks(self._store, self._keys).get(self._first)
                if claim is None or claim.member != self._lead:
                    raise Timeout(self._link.left(self._first, tag, claim)) from None
                continue  # stage 0 is there, waiting for work itself
            return Header.parse([int(v) for v in got[0].tolist()], self._first)

    def _push(self, round_no: int, samples: int) -> bool:
        """Stage this stage's blocks' gradients under stage 0's key on every pserver
        holding some: for ``round_no`` (sync), or as pieces of stage 0's step (async, which
        stage 0's ``final`` applies); True if a pserver refused them as stale."""
        ctx = self._ctx
        assert ctx._group is not None and ctx._replica is not None
        ctx._replica.check_finite(ctx.trainer_id)
        if self._sync:
            base = PushRequest(self._lead, epoch=ctx._epoch, version=ctx._slot_version, round_no=round_no, samples=samples, part=True)
            metas = [base] * len(ctx._group.parts)
        else:
            metas = [
                PushRequest(self._lead, epoch=ctx._epoch, version=ctx._slot_version, updates=part.version, incarnation=part.incarnation, part=True)
                for part in ctx._group.parts
            ]
        requests = [(part, attrs.evolve(meta, blocks=tuple(part.keys), tensors=tuple(ctx._replica.grads(part.blocks)))) for part, meta in zip(ctx._group.parts, metas)]
        replies = ctx._call_each(requests)
        stale = False
        for part, reply in zip(ctx._group.parts, replies):
            if isinstance(reply, (StalePush, SlotMapChanged)):
                stale = True
                log.warning("trainer %s: push to pserver %d was stale (%s)", ctx.trainer_id, part.index, reply)
        if not stale:
            ctx.pushes += len(requests)
        return stale

    def _seen(self) -> list[float]:
        """``[pserver, updates seen]`` pairs of this stage's pservers, flat (async)."""
        assert self._ctx._group is not None
        return [float(v) for part in self._ctx._group.parts for v in (part.index, part.version)]

    def _apply(self, batch: Batch, seen: dict[int, int]) -> bool:
        """Async, stage 0, every stage's pieces accepted: the ``final`` of the step to every
        pserver that took a piece (with the fewest updates any stage saw there, and the
        step's records: each pserver applies a task's records once), then the task's
        progress. Whether every pserver applied it (or had already)."""
        ctx = self._ctx
        assert self._everyone is not None and ctx._attempt is not None
        held = ctx._attempt
        records = (held.pass_no, held.task, held.attempt, batch.start, batch.start + batch.size)
        parts = [p for p in self._everyone.parts if p.index in seen]
        finals = [
            (p, PushRequest(self._lead, epoch=ctx._epoch, version=ctx._slot_version, updates=seen[p.index], records=records, part=True, final=True, blocks=(), tensors=()))
            for p in parts
        ]
        replies = self._everyone.call_each(finals)
        applied = True
        for part, reply in zip(parts, replies):
            if isinstance(reply, (StalePush, SlotMapChanged)):
                applied = False
                ctx.stale_pushes += 1
                log.warning("trainer %s: pserver %d dropped the pipeline's step: %s", ctx.trainer_id, part.index, reply)
        if applied:
            ctx._record_progress(held, (batch.start, batch.start + batch.size))
        return applied

    def _settle(self, round_no: int, batch: Batch, samples: int, stale: bool, step: int) -> None:
        """Stage 0, every stage's push accepted: commit the pipeline's contribution, tell
        the other stages whether it went into round ``round_no`` (``<step>/committed``),
        then pull the round's result (as :meth:`TrainerContext.step` does for one trainer)."""
        ctx = self._ctx
        ctx.steps += 1
        ctx.samples += samples
        ctx._stepped = batch
        try:
            if not stale:
                stale = not ctx._commit(round_no, ctx._contribution(samples, batch))
            if stale:
                ctx.stale_pushes += 1
            ctx._zero_grad()
        except (EpochChanged, NotInitialized) as exc:
            self._tell(step, False)
            log.warning("trainer %s: %s", ctx.trainer_id, exc)
            ctx._resync()
            return
        self._tell(step, not stale)
        try:
            if stale:
                ctx._pull_fresh()
            else:
                ctx._pull_round(round_no)
        except (EpochChanged, NotInitialized) as exc:
            log.warning("trainer %s: %s", ctx.trainer_id, exc)
            ctx._resync()

    def _tell(self, step: int, committed: bool) -> None:
        told = self._tensor(np.array([int(committed)], dtype=np.int64))
        for r in self._ranks[1:]:
            self._link.send(r, f"{step}/committed", [told], stop_gradient=[True])

    def _wait_for_pipeline(self) -> dict[int, Any] | None:
        """The claims of this pipeline's ranks once all are claimed; None if the job is
        done first (the other pipelines finished it while this one formed again)."""
        mine = self.group.get_pipe_parallel_group()
        missing: list[int] = []
        done = object()

        def look() -> Any:
            kv = self._store.get(self._keys.state)
            if kv is not None and says_done(kv.value, kv.key):
                return done
            claimed = ranks(self._store, self._keys)
            missing[:] = [r for r in mine if r not in claimed]
            return None if missing else {r: claimed[r] for r in mine}

        def what() -> str:
            return f"every rank of pipeline {self.group.get_data_parallel_rank()} of job {self._keys.job!r} to be claimed: ranks {missing} are not"

        found = watch_until(self._store, self._keys.pipeline_ranks, look, DISCOVERY_TIMEOUT, what)
        return None if found is done else found

    def _address_of(self, rank: int) -> str:
        """Where ``rank``'s p2p endpoint serves, by the claims the pipeline formed with: a
        send never reaches another trainer that took the rank since (a failed send is
        the pipeline broken, not a peer to look up again)."""
        held = None if self._claims is None else self._claims.get(rank)
        if held is None:
            raise Timeout(f"pipeline rank {rank} of job {self._keys.job!r} was not claimed when the pipeline formed")
        return str(held.addr)

    def _close(self, *, release_rank: bool) -> None:
        self._p2p.close()
        everyone, self._everyone = getattr(self, "_everyone", None), None
        if everyone is not None:
            everyone.close()
        if release_rank and hasattr(self, "group"):
            try:
                release(self._store, self._keys, self.group.rank, self._lease)
            except Exception as exc:  # noqa: BLE001 - leaving anyway: the lease frees it
                log.warning("trainer %s could not release pipeline rank %d: %s", self._ctx.trainer_id, self.group.rank, exc)
