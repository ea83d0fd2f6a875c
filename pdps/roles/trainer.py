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

from pdps.core.errors import ConfigError, FencingError, LeaseExpired, NotReady, PdpsError, StalePush, Timeout, TransportError
from pdps.core.job import JobConfig, Keys, decode_as, decode_json
from pdps.core.sgd import Mode
from pdps.core.slots import Block, Layout, ParamSpec, SlotMap
from pdps.core.tasks import TaskSpec
from pdps.ports.compute import Compute, ModelReplica
from pdps.ports.coordination import Compare, CoordinationStore, Put
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


@attrs.define
class _Part:
    """One pserver as a trainer sees it: its channel and the blocks it holds."""

    index: int
    channel: Channel
    blocks: list[Block]
    keys: list[str] = attrs.field(init=False)
    round_no: int = 0
    version: int = 0

    def __attrs_post_init__(self) -> None:
        self.keys = [b.key for b in self.blocks]


class PserverGroup:
    """The pservers of a job, for pushing to and pulling from (trainers and tools)."""

    def __init__(self, store: CoordinationStore, transport: Transport, config: JobConfig, specs: Sequence[ParamSpec]) -> None:
        keys = Keys(config.name)
        slot_map = decode_as(wait_for_key(store, keys.slotmap, "the job's slot map"), keys.slotmap, SlotMap.from_json)
        self.layout = Layout.build(specs, slot_map, config.min_block)
        self.parts: list[_Part] = []
        for i in range(slot_map.num_pservers):
            blocks = self.layout.blocks_of(i)
            if not blocks:
                continue  # a pserver whose slots hold no block of this model is never called
            addr = decode_as(wait_for_key(store, keys.pserver(i), f"pserver {i}"), keys.pserver(i), lambda d: str(d["addr"]))
            self.parts.append(_Part(i, transport.connect(addr), blocks))
        # Calls to different pservers overlap when the transport's calls release the GIL
        # (gRPC); in-process calls are plain function calls and stay on this thread.
        self._pool = None
        if getattr(transport, "concurrent", False) and len(self.parts) > 1:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(len(self.parts), thread_name_prefix="pdps-pserver-call")

    def call(self, part: _Part, method: str, request: Message) -> Message:
        """Call one pserver, retrying while it is not ready (it learns the model lazily)."""
        deadline = time.monotonic() + DISCOVERY_TIMEOUT
        while True:
            try:
                return part.channel.call(method, request)
            except NotReady:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.02)

    def call_each(self, method: str, requests: Sequence[tuple[_Part, Message]]) -> list[Message | StalePush]:
        """Call several pservers, concurrently where the transport allows. A stale push
        comes back in its place in the list; any other error is raised once all calls ended."""

        def one(part: _Part, request: Message) -> Message | StalePush:
            try:
                return self.call(part, method, request)
            except StalePush as exc:
                return exc

        if self._pool is None or len(requests) < 2:
            return [one(part, req) for part, req in requests]
        futures = [self._pool.submit(one, part, req) for part, req in requests]
        errors = [f.exception() for f in futures]
        for exc in errors:
            if exc is not None:
                raise exc
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
        self._batch: Batch | None = None
        self._stepped: Batch | None = None  # the last batch step() ran on
        self._batch_no = 0
        self._stop = threading.Event()
        self._kill_after: int | None = None
        self.killed = False
        self.steps = 0  # mini-batches stepped
        self.pushes = 0
        self.stale_pushes = 0
        self.tasks_done = 0
        self.metrics: dict[str, float] = {}  # free for the training function; shown as progress

    # --- lifecycle --------------------------------------------------------------------

    @property
    def device(self) -> str:
        return self._compute.device

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
        self.register()
        replica = self._compute.replica(model)
        specs_json = json.dumps([s.to_json() for s in replica.specs]).encode()
        # The trainer that publishes the model initializes every pserver, so the initial
        # values come from one replica even if the trainers' own initializations differ.
        first = self._store.commit((Compare.absent(self._keys.model),), (Put(self._keys.model, specs_json),)).succeeded
        stored = decode_json(self._store.get(self._keys.model).value, self._keys.model)  # type: ignore[union-attr]
        if stored != json.loads(specs_json):
            raise ConfigError(f"trainer {self.trainer_id!r}: the model does not match the job's ({self._keys.model}): {_diff(stored, replica.specs)}")
        group = PserverGroup(self._store, self._transport, self.config, replica.specs)
        if first:
            for part in group.parts:
                group.call(part, "init", Message({"trainer": self.trainer_id}, replica.values(part.blocks)))
        self._replica, self._group = replica, group
        self._pull()
        replica.zero_grad()
        return model

    def pull(self) -> None:
        """Fetch the current parameters from every pserver into the model now."""
        self._pull()

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
                    reply = self._call_master("get_task", Message({"trainer": self.trainer_id}))
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
                if "wait" in reply.meta:
                    if self.config.mode is Mode.SYNC and self._replica is not None:
                        self._idle_round()
                    else:
                        time.sleep(float(reply.meta.get("retry_in", 0.05)))
                    continue
                task = TaskSpec.from_json(reply.meta["task"])
                attempt, pass_no = int(reply.meta["attempt"]), int(reply.meta["pass"])
                held = (task.id, attempt)
                try:
                    columns = self._source.read(task)
                except Exception as exc:  # an unreadable task fails, the trainer goes on
                    log.error("trainer %s cannot read task %d (%s part %d): %s", self.trainer_id, task.id, task.location, task.part, exc)
                    self._report("fail_task", held, error=str(exc))
                    held = None
                    continue
                n = len(next(iter(columns.values()))) if columns else 0
                for start in range(0, n, bs):
                    cols = {k: torch.from_numpy(v[start : start + bs]) for k, v in columns.items()}
                    if self._replica is not None and self._replica.device != "cpu":
                        cols = {k: v.to(self._replica.device) for k, v in cols.items()}
                    self._batch = Batch(cols, min(bs, n - start), task, pass_no, last=start + bs >= n)
                    yield self._batch
                    if self._stop.is_set() and not self._batch.last:
                        break
                else:
                    self._report("finish_task", held)
                    held = None
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
        trainer's gradient (of a *mean*-reduced loss) by it.
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
        if self.config.mode is Mode.SYNC:
            self._sync_round(samples)
        else:
            self._async_step()

    def _sync_round(self, samples: int) -> None:
        assert self._replica is not None and self._group is not None
        if samples:
            self._replica.check_finite(self.trainer_id)  # all pservers or none: fail before the first push
        requests = [
            (part, Message({"trainer": self.trainer_id, "round": part.round_no, "samples": samples, "blocks": part.keys}, self._replica.grads(part.blocks) if samples else []))
            for part in self._group.parts
        ]
        stale = False
        for (part, _), reply in zip(requests, self._group.call_each("push", requests)):
            if isinstance(reply, StalePush):
                stale = True
                self.stale_pushes += 1
                log.warning("trainer %s: push to pserver %d was stale (%s); pulling", self.trainer_id, part.index, reply)
            elif samples:
                self.pushes += 1
        self._replica.zero_grad()
        self._pull(after_round=not stale)

    def _idle_round(self) -> None:
        """Contribute zero samples so the barrier need not wait for an idle trainer."""
        self._sync_round(0)

    def _async_step(self) -> None:
        assert self._replica is not None
        self._batch_no += 1
        cadence = self.config.cadence
        must_pull = False
        if cadence.push_due(self._batch_no):
            must_pull = self._async_push()
        if must_pull or cadence.pull_due(self._batch_no):
            self._pull()

    def _async_push(self) -> bool:
        """Push the summed gradients to every pserver; True if one of them said pull."""
        assert self._replica is not None and self._group is not None
        self._replica.check_finite(self.trainer_id)
        requests = [
            (part, Message({"trainer": self.trainer_id, "version": part.version, "blocks": part.keys}, self._replica.grads(part.blocks)))
            for part in self._group.parts
        ]
        stale = False
        for (part, _), reply in zip(requests, self._group.call_each("push", requests)):
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
            self._async_push()
            self._batch_no = 0

    def _pull(self, after_round: bool = False) -> None:
        """Load every pserver's values; with ``after_round``, first wait for the round this
        trainer just pushed to close (sync)."""
        assert self._group is not None
        replica = self._replica
        requests = []
        for part in self._group.parts:
            meta: dict[str, Any] = {"trainer": self.trainer_id}
            if after_round:
                meta["after_round"] = part.round_no
            requests.append((part, Message(meta)))
        for part, reply in zip(self._group.parts, self._group.call_each("pull", requests)):
            assert isinstance(reply, Message)  # pulls are never stale
            part.round_no = int(reply.meta["round"])
            part.version = int(reply.meta["version"])
            if replica is not None:
                replica.load(part.blocks, reply.tensors)

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
