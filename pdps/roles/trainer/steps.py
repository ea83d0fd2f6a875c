"""How a trainer's step reaches the parameters: the sync round (push, commit the
contribution under the round's prefix, pull the round's result) and the async cadence
(push every ``push_every`` batches of a task, pull every ``pull_every``), each
advancing the task's progress record so every record applies exactly once.

:class:`SyncRound` and :class:`AsyncCadence` are parts of
:class:`~pdps.roles.trainer.context.TrainerContext`: the state they read and write
(the pserver group, the replica, the attempt held, the counters) lives there.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any

import attrs

from pdps.core.errors import EpochChanged, GradientRejected, SlotMapChanged, StalePush
from pdps.core.job import Keys, decode_as
from pdps.core.progress import TaskProgress
from pdps.core.sgd import Contribution, Mode, RoundRecord, RoundState
from pdps.core.txn import Decision, Done, Write
from pdps.core.wire import CheckpointRequest, PullReply, PullRequest, PushReply, PushRequest
from pdps.ports.coordination import Compare, CoordinationStore, KeyValue, Op, Put, TxnOp
from pdps.roles.trainer.discovery import WAIT_LOG_EVERY
from pdps.runtime.cas import read_modify_write

if TYPE_CHECKING:
    from pdps.roles.trainer.context import Batch
    from pdps.roles.trainer.pserver_client import Part

log = logging.getLogger(__name__)

#: A call refused because a resize changed the slot map is sent again, addressed by the
#: new map, at most this many times in a row (each refusal is one more resize).
MAP_CHANGES_PER_CALL = 8

# what a contribution's read-modify-write found instead of committing
_CLOSED = object()  # the round had closed
_ALREADY = object()  # our contribution was in it already


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
class Attempt:
    """The task attempt this trainer is training, and its progress record as last read
    or written (the value a compare-and-set must find)."""

    task: int
    attempt: int
    pass_no: int
    key: str
    raw: bytes | None
    progress: TaskProgress

    @classmethod
    def read(cls, store: CoordinationStore, keys: Keys, task: int, attempt: int, pass_no: int) -> Attempt:
        key = keys.task_progress(task)
        held = cls(task, attempt, pass_no, key, None, TaskProgress.decode(None, key))
        held.refresh(store)
        return held

    def refresh(self, store: CoordinationStore) -> None:
        kv = store.get(self.key)
        self.raw = None if kv is None else kv.value
        self.progress = TaskProgress.decode(self.raw, self.key)

    def advance(self, start: int, end: int) -> tuple[Compare, Put, TaskProgress]:
        """The compare and write that record records ``[start, end)`` as trained;
        StalePush once the master has fenced this attempt, a later one took the task,
        or a racing attempt committed those records first."""
        new = self.progress.advance(self.attempt, start, end)
        guard = Compare.absent(self.key) if self.raw is None else Compare.value(self.key, Op.EQ, self.raw)
        return guard, Put(self.key, new.encode()), new

    def advanced(self, new: TaskProgress) -> None:
        self.raw, self.progress = new.encode(), new


class SyncRound:
    """The sync-round protocol of :class:`~pdps.roles.trainer.context.TrainerContext`."""

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
            push = PushRequest(self.trainer_id, epoch=self._epoch, version=self._slot_version, round_no=round_no, samples=samples)
            try:
                if loss is not None and self._pipeline is not None:
                    replies = self._pipeline.push(loss, [push] * len(self._group.parts))
                    if any(isinstance(r, SlotMapChanged) for r in replies):
                        # a failover or a resize at this round's boundary refused a piece: the
                        # gradient is whole still (sync pieces are not zeroed), so push all of it
                        # again by the new map, into the same round (staging replaces what the
                        # pieces staged)
                        self._follow_map()
                        replies = self._push_each(push)
                else:
                    self._replica.check_finite(self.trainer_id)  # all pservers or none: fail before the first push
                    if self._tables is not None:
                        self._tables.check_finite(self.trainer_id)
                    replies = self._push_each(push)
            except GradientRejected as exc:
                refused, replies = exc, []
            for part, reply in zip(self._group.parts, replies):
                if isinstance(reply, (StalePush, SlotMapChanged)):
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
        # pushed, refused or dropped, the next step starts clean (sync, the overlap
        # pipeline's workers leave the gradient whole for a push again by a new map)
        self._zero_grad()
        if stale:
            self._pull_fresh()
        else:
            self._pull_round(round_no)
        if refused is not None:
            raise refused

    def _push_each(self, push: PushRequest) -> list:
        """Sync: stage the gradient on every pserver. A resize that switched the map at
        this round boundary refuses it (SlotMapChanged): push again, by the new map
        (staging replaces what a pserver staged before, so no block counts twice)."""
        assert self._replica is not None and self._group is not None
        for _ in range(MAP_CHANGES_PER_CALL):
            push = attrs.evolve(push, version=self._slot_version)
            rows = self._row_sections()
            requests = [(part, self._with_rows(attrs.evolve(push, blocks=tuple(part.keys), tensors=self._replica.grads(part.blocks)), rows, part)) for part in self._group.parts]
            replies = self._call_each(requests)
            if not any(isinstance(r, SlotMapChanged) for r in replies):
                break
            self._follow_map()
        return replies

    def _row_sections(self) -> dict[int, list[tuple[str, Any, Any]]] | None:
        """The step's gradient rows of the model's tables, per pserver (None: no tables)."""
        if self._tables is None:
            return None
        assert self._group is not None
        return self._tables.sections([p.index for p in self._group.parts])

    @staticmethod
    def _with_rows(push: PushRequest, rows: dict[int, list[tuple[str, Any, Any]]] | None, part: Part) -> PushRequest:
        """``push`` to ``part`` with its row sections (a table's ids, then their gradient
        rows, after the dense tensors)."""
        if rows is None:
            return push
        sections = rows.get(part.index, [])
        tensors = list(push.tensors)
        for _, ids, grads in sections:
            tensors += [ids, grads]
        return attrs.evolve(push, tables=tuple((name, int(ids.numel())) for name, ids, _ in sections), tensors=tuple(tensors))

    def _commit(self, round_no: int, contribution: Contribution) -> bool:
        """Commit our contribution to round ``round_no``; False if the round had closed.

        The contribution is a key of its own, written once, in a transaction that holds
        only while the round has no close marker. A contribution that trained records
        advances its task's progress record in the same transaction (exactly once per
        record): if the master has fenced the attempt meanwhile, the step is not applied
        (a zero-sample contribution keeps the round going) and :meth:`batches` drops
        the task."""
        marker = self._keys.round_closed(self._epoch, round_no)
        mine = self._keys.contribution(self._epoch, round_no, self.trainer_id)
        held = self._attempt if contribution.samples and contribution.task is not None else None
        blind = True

        def read() -> tuple[KeyValue | None, KeyValue | None]:
            nonlocal blind
            if blind:  # the round is open and ours unwritten nearly always: try without reading (the guards hold it)
                blind = False
                return None, None
            return self._store.get(marker), self._store.get(mine)

        def contribute(found: tuple[KeyValue | None, KeyValue | None]) -> Decision:
            nonlocal held, contribution
            closed, prior = found
            record = RoundRecord(
                round_no,
                {} if prior is None else {self.trainer_id: decode_as(prior.value, prior.key, Contribution.from_json)},
                RoundState.OPEN if closed is None else RoundState.CLOSED,
            )
            guards: list[Compare] = [Compare.absent(marker), Compare.absent(mine)]
            ops: list[TxnOp] = []
            advanced = None
            if held is not None:
                try:
                    guard, put, advanced = held.advance(contribution.start, contribution.offset)
                except StalePush as exc:  # the master fenced our attempt: contribute nothing
                    self._lose_task(exc)
                    held, contribution = None, Contribution(0)
                else:
                    guards.append(guard)
                    ops.append(put)
            try:
                updated = record.contribute(self.trainer_id, contribution)
            except StalePush:
                return Done(_CLOSED)
            if updated is record:  # committed already (a retry whose reply was lost)
                return Done(_ALREADY)
            ops.insert(0, Put(mine, json.dumps(contribution.to_json()).encode()))
            return Write(guards, ops, result=advanced)

        def moved() -> None:
            if held is not None:
                held.refresh(self._store)  # the round or the progress record moved: look again

        outcome = read_modify_write(self._store, read, contribute, what=f"{self.trainer_id}'s contribution to round {round_no}", on_conflict=moved)
        if outcome is _CLOSED:
            return False
        if held is not None:
            if outcome is _ALREADY:
                held.refresh(self._store)
            else:
                held.advanced(outcome)
            self._applied(contribution, round_no)
        return True

    def _applied(self, c: Contribution, round_no: int | None) -> None:
        """Note a step that went into the parameters (:attr:`history`)."""
        assert self._attempt is not None and c.task is not None and c.attempt is not None
        self.history.append(StepRecord(round_no, self._epoch, self._attempt.pass_no, c.task, c.attempt, c.start, c.offset, c.samples))

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


    def _named(self, request: PullRequest, part: Part) -> PullRequest:
        """``request`` to ``part``, naming its blocks when this trainer pulls only some
        of the model's (a pipeline stage: :meth:`PserverGroup.restrict`)."""
        assert self._group is not None
        return request if self._group.only is None else attrs.evolve(request, blocks=tuple(part.keys))

    def _pull_round(self, round_no: int) -> None:
        """Sync: wait for round ``round_no`` to close on every pserver and load the result.
        A long wait is logged with whom the round waits for; a checkpoint taken right
        after the round is reported to the master before anything else happens."""
        assert self._group is not None
        first = time.time()
        last_log = 0.0
        request = PullRequest(self.trainer_id, epoch=self._epoch, version=self._slot_version, after_round=round_no, slice_s=WAIT_LOG_EVERY)
        pending = list(self._group.parts)
        checkpoint = None
        newer = 0  # the newest slot map a pserver says it serves
        while pending:
            replies = self._call_each([(part, self._named(request, part)) for part in pending], into=self._into)
            self._time("barrier", max((r.wait_s or 0.0 for r in replies if isinstance(r, PullReply)), default=0.0))
            if any(isinstance(r, SlotMapChanged) for r in replies):
                # the round switched the map (a resize): pull it from the pservers the new map names
                self._follow_map()
                request = attrs.evolve(request, version=self._slot_version)
                pending = list(self._group.parts)
                continue
            still = []
            for part, reply in zip(pending, replies):
                assert isinstance(reply, PullReply)  # pulls are never stale
                if reply.waiting is not None:
                    still.append((part, reply.waiting))
                    continue
                self._load(part, reply)
                checkpoint = reply.checkpoint or checkpoint
                newer = max(newer, reply.map_version or 0)
            pending = [p for p, _ in still]
            if still and time.time() - last_log >= WAIT_LOG_EVERY:
                last_log = time.time()
                whom = sorted({t for _, ts in still for t in ts})
                self._waits.waiting(f"the barrier of round {round_no}", whom, first)
        if last_log:
            self._waits.done()
        if newer > self._slot_version:
            # the round switched the map (a resize) and was served from the old one: address
            # the new map's pservers now, rather than have the next push refused after
            # sending the whole gradient
            self._follow_map()
        if checkpoint is not None:
            self._master.call(CheckpointRequest(self.trainer_id, checkpoint, epoch=self._epoch))


class AsyncCadence:
    """The async cadence of :class:`~pdps.roles.trainer.context.TrainerContext`."""

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
        records = None if held is None or acc is None else (held.pass_no, held.task, held.attempt, acc[0], acc[1])
        metas = [
            PushRequest(
                self.trainer_id, epoch=self._epoch, version=self._slot_version, updates=part.version,
                records=records, incarnation=part.incarnation, blocks=tuple(part.keys),
            )
            for part in self._group.parts
        ]
        if loss is not None and self._pipeline is not None:
            replies = self._pipeline.push(loss, metas)  # (its workers zero each piece once pushed, refused or not)
        else:
            try:
                self._replica.check_finite(self.trainer_id)
                if self._tables is not None:
                    self._tables.check_finite(self.trainer_id)
                rows = self._row_sections()
                requests = [(part, self._with_rows(attrs.evolve(meta, tensors=self._replica.grads(part.blocks)), rows, part)) for part, meta in zip(self._group.parts, metas)]
                replies = self._call_each(requests)
            finally:
                self._zero_grad()  # pushed or refused: the next step starts clean
        stale = False
        for part, reply in zip(self._group.parts, replies):
            if isinstance(reply, (StalePush, SlotMapChanged)):
                # a resize moved slots (SlotMapChanged): that pserver applied none of it, and
                # the push is dropped there as a stale one would be
                stale = True
                self.stale_pushes += 1
                log.info("trainer %s: pserver %d dropped a push: %s", self.trainer_id, part.index, reply)
            else:
                self.pushes += 1
                self._acknowledged(part, reply)
        if held is not None and acc is not None:
            self._record_progress(held, acc)
        return stale

    def _acknowledged(self, part: Part, reply: PushReply) -> None:
        """Async: count a push the pserver applied, per slot (:attr:`acknowledged`)."""
        if not reply.duplicate:
            for slot in part.slots:
                self.acknowledged[slot] += 1

    def _record_progress(self, held: Attempt, records: tuple[int, int]) -> None:
        """Async: every pserver has the push of ``records``: advance the task's progress
        record (compare-and-set). A fenced attempt drops its task; its pushes beyond the
        fence are the pservers' to ignore (they apply each task's records once)."""
        def advance(_: object) -> Decision:
            try:
                guard, put, new = held.advance(records[0], records[1])
            except StalePush as exc:
                self._lose_task(exc)
                return Done(None)
            return Write((guard,), (put,), result=new)

        new = read_modify_write(
            self._store, lambda: None, advance, what=f"progress of task {held.task}", on_conflict=lambda: held.refresh(self._store)
        )
        if new is not None:
            held.advanced(new)
            samples = records[1] - records[0]
            self.history.append(StepRecord(None, self._epoch, held.pass_no, held.task, held.attempt, records[0], records[1], samples))

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
