"""``pdps.Session``: seed 003's ``session.eval(targets=[loss, optimizer], feed=...)``.

The user writes the model, the loss and the optimizer in Python; a session runs them.
A target is a :class:`Loss` (the model and a function ``fn(model, feed) -> loss``)
or the user's ``torch.optim.Optimizer`` instance itself. ``eval`` returns one value
per target: the loss's value (a float, at the parameters before this eval's update)
and ``None`` for the optimizer, whose evaluation applies exactly one update. A
session holds one program: one loss (one model) and at most one optimizer.

Both kinds of session run the same program: the optimizer is converted into a graph
rule (:func:`pdps.adapters.torch_graph.graph_rule`, cached) and the update runs from
that graph, never from the optimizer's own ``step``.

* :meth:`Session.local`: one runtime. Forward and backward on the whole feed, then the
  rule (:class:`~pdps.adapters.torch_graph.GraphOptimizer`) on the model's parameters.
* :meth:`Session.remote`: a sync job over ``store`` and ``transport``: ``pservers`` real
  :class:`~pdps.roles.pserver.Pserver` roles holding the parameters, their state and the
  rule, and ``trainers`` trainer workers (:class:`~pdps.roles.trainer.TrainerContext`,
  each on a thread of this process with a replica of the model). One eval with the
  optimizer is *one* sync round: the feed is cut into ``trainers`` shares along its
  first dimension, every trainer computes forward and backward on its share and pushes
  with its share's sample count, the pservers apply the sample-weighted mean of the
  gradients (the gradient of the whole feed's mean loss) once, and every trainer pulls
  the result; the user's model is then given the pulled parameters. No task queue is
  involved, so no trainer takes two shares and none contributes zero samples.
"""

from __future__ import annotations

import copy
import queue
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from pdps.core.errors import ConfigError, PdpsError
from pdps.ports.coordination import CoordinationStore
from pdps.ports.transport import Transport

#: Seconds one eval waits for the trainer workers before it is an error.
EVAL_TIMEOUT = 120.0


@attrs.frozen(eq=False)
class Loss:
    """A loss target: ``fn(model, feed)`` returns a 0-d tensor, the *mean* of a
    per-sample loss over the feed's samples (so a remote session's shares, weighted by
    their sizes, give the whole feed's loss and gradient)."""

    model: Any  # torch.nn.Module
    fn: Callable[[Any, Mapping[str, Any]], Any]

    def __attrs_post_init__(self) -> None:
        import torch

        if not isinstance(self.model, torch.nn.Module):
            raise ConfigError(f"Loss takes a torch.nn.Module as model, got {type(self.model).__name__}")
        if not callable(self.fn):
            raise ConfigError(f"Loss takes a function fn(model, feed) -> loss, got {type(self.fn).__name__}")


def _loss_value(loss: Any) -> Any:
    import torch

    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        raise ConfigError(f"a Loss's fn must return a 0-d floating tensor (a mean over the feed), got {type(loss).__name__} {getattr(loss, 'shape', '')}")
    return loss


class Session:
    """Evaluates targets over feeds; see the module docstring. Use :meth:`local` or
    :meth:`remote`, and :meth:`close` it (or use it as a context manager)."""

    def __init__(self, runtime: _Runtime) -> None:
        self._runtime = runtime
        self._loss: Loss | None = None
        self._optimizer: Any = None
        self._rule: dict[str, Any] | None = None
        self._closed = False

    # --- making one ----------------------------------------------------------------------

    @classmethod
    def local(cls) -> Session:
        """A session with one runtime, in this thread."""
        return cls(_Local())

    @classmethod
    def remote(
        cls,
        *,
        store: str | CoordinationStore = "memory://",
        transport: str | Transport = "inproc://",
        trainers: int = 1,
        pservers: int = 1,
        address: str | None = None,
        **settings: Any,
    ) -> Session:
        """A session whose evals run as a sync job: ``pservers`` pserver roles over
        ``store`` and ``transport`` (a URL or an adapter), ``trainers`` trainer workers.

        ``address`` is where the pservers serve: by default ``inproc://`` in process,
        and over gRPC (``"grpc"``, ``"grpc://"``, ``"grpc://HOST"`` or a gRPC adapter)
        127.0.0.1 or HOST at a free port each; another adapter at ``<its scheme>://``
        (:func:`pdps.shell.sim.serve_address`). ``settings`` are
        further :class:`~pdps.core.job.JobConfig` fields (``min_block``, ``lease_ttl``,
        ``name``, ...). The job starts at the first eval, with its model and optimizer.
        """
        for name, value in (("trainers", trainers), ("pservers", pservers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"Session.remote: {name} must be a whole number >= 1, got {value!r}")
        for name in ("mode", "optimizer", "optimizer_args", "dataset"):
            if name in settings:
                raise ConfigError(f"Session.remote: {name} is set by the session (sync, the optimizer's graph rule), not given")
        return cls(_Remote(store, transport, trainers, pservers, address, settings))

    # --- evaluating ------------------------------------------------------------------------

    def eval(self, targets: Sequence[Any], feed: Mapping[str, Any]) -> list[Any]:
        """The value of each target, in order: a :class:`Loss`'s value (float) at the
        parameters before this eval; ``None`` for the optimizer, which applies one update
        of the loss's gradient over the whole feed. ``targets=[loss]`` changes nothing."""
        import torch

        if self._closed:
            raise ConfigError("session.eval: the session is closed")
        if isinstance(targets, (str, bytes)) or not isinstance(targets, Sequence) or not targets:
            raise ConfigError(f"session.eval: targets must be a non-empty list of a pdps.Loss and/or a torch.optim.Optimizer, got {targets!r}")
        losses = [t for t in targets if isinstance(t, Loss)]
        optimizers = [t for t in targets if isinstance(t, torch.optim.Optimizer)]
        others = [t for t in targets if not isinstance(t, (Loss, torch.optim.Optimizer))]
        if others:
            raise ConfigError(f"session.eval: targets may be a pdps.Loss and a torch.optim.Optimizer, got {type(others[0]).__name__}")
        if len(losses) > 1 or len(optimizers) > 1:
            raise ConfigError("session.eval: targets name at most one Loss and one optimizer")
        loss = losses[0] if losses else self._loss
        if loss is None:
            raise ConfigError("session.eval: targets: the optimizer minimizes a pdps.Loss; name the loss in targets (at least in the first eval)")
        if self._loss is not None and loss is not self._loss:
            raise ConfigError("session.eval: targets: a session runs one program; this Loss is not the one its first eval named (open another session)")
        optimizer = optimizers[0] if optimizers else None
        if optimizer is not None:
            self._check_optimizer(optimizer, loss)
        feed = _check_feed(feed)
        if self._loss is None:
            self._runtime.start(loss, self._rule)
            self._loss = loss
        value = self._runtime.eval(loss, feed, update=optimizer is not None)
        return [value if isinstance(t, Loss) else None for t in targets]

    def _check_optimizer(self, optimizer: Any, loss: Loss) -> None:
        from pdps.adapters.torch_graph import graph_rule

        if self._optimizer is not None:
            if optimizer is not self._optimizer:
                raise ConfigError("session.eval: targets: a session runs one optimizer; this one is not the one it runs (open another session)")
            return
        params = [p for p in loss.model.parameters()]
        if not params:
            raise ConfigError("session.eval: targets: the Loss's model has no parameters for the optimizer to update")
        mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if mine != {id(p) for p in params}:
            raise ConfigError("session.eval: targets: the optimizer must be made over the Loss's model.parameters(), all of them")
        if self._loss is not None and self._runtime.needs_rule_at_start:
            raise ConfigError("session.eval: targets: a remote session's job starts with its optimizer: name the optimizer in its first eval")
        _, args = graph_rule(optimizer, params[0].dtype)  # converted once per class, hyper-parameters and dtype
        self._optimizer, self._rule = optimizer, args["graph"]
        if self._loss is not None:
            self._runtime.set_rule(self._rule)

    # --- the end ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the session's roles (a remote session's trainers and pservers) and free
        what it holds. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._runtime.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_feed(feed: Any) -> dict[str, Any]:
    import torch

    if not isinstance(feed, Mapping) or not feed:
        raise ConfigError(f"session.eval: feed must be a non-empty mapping of names to tensors, got {type(feed).__name__}")
    sizes = {}
    for name, value in feed.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ConfigError(f"session.eval: feed[{name!r}] must be a tensor with a first (sample) dimension, got {type(value).__name__}")
        sizes[name] = int(value.shape[0])
    if len(set(sizes.values())) != 1:
        raise ConfigError(f"session.eval: feed: every tensor must have the same number of samples (first dimension), got {sizes}")
    return dict(feed)


# --- runtimes -------------------------------------------------------------------------------


class _Runtime:
    needs_rule_at_start = False

    def start(self, loss: Loss, rule: dict[str, Any] | None) -> None:
        raise NotImplementedError

    def set_rule(self, rule: dict[str, Any]) -> None:
        raise NotImplementedError

    def eval(self, loss: Loss, feed: dict[str, Any], *, update: bool) -> float:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _Local(_Runtime):
    """One runtime: the whole program in this thread, the update from the graph rule."""

    def __init__(self) -> None:
        self._runner: Any = None
        self._params: list[Any] = []

    def start(self, loss: Loss, rule: dict[str, Any] | None) -> None:
        self._params = list(loss.model.parameters())
        if rule is not None:
            self.set_rule(rule)

    def set_rule(self, rule: dict[str, Any]) -> None:
        from pdps.adapters.torch_graph import GraphOptimizer

        self._runner = GraphOptimizer(self._params, rule)

    def eval(self, loss: Loss, feed: dict[str, Any], *, update: bool) -> float:
        import torch

        if not update:
            with torch.no_grad():
                return float(_loss_value(loss.fn(loss.model, feed)))
        assert self._runner is not None
        for p in self._params:
            p.grad = None
        value = _loss_value(loss.fn(loss.model, feed))
        value.backward()
        self._runner.step()
        for p in self._params:
            p.grad = None
        return float(value.detach())


class _NoData:
    """The data source of a session's trainers: the feed comes with each eval."""

    url = "session://feed"

    def tasks(self) -> list[Any]:
        return []


@attrs.define
class _Worker:
    """One trainer worker: its context, its replica of the model, its thread and inbox;
    it answers ``(index, value or exception)`` into the session's outbox."""

    index: int
    ctx: Any
    model: Any
    outbox: queue.Queue
    inbox: queue.Queue = attrs.field(factory=queue.Queue)
    thread: threading.Thread | None = None


class _Remote(_Runtime):
    """A sync job: real pserver roles and trainer workers over the given store and transport."""

    needs_rule_at_start = True

    def __init__(self, store: Any, transport: Any, trainers: int, pservers: int, address: str | None, settings: dict[str, Any]) -> None:
        from pdps.registry import connect_store, open_transport

        self._own_store = isinstance(store, str) and not (store.startswith("memory://") and store.rstrip("/") != "memory:")
        from pdps.shell.sim import serve_address

        self._transport = open_transport(transport) if isinstance(transport, str) else transport
        if address is None:
            address = serve_address(transport, self._transport, roles=pservers, what="Session.remote")
        self._address = address
        self._store = connect_store(store) if isinstance(store, str) else store  # last: nothing to close if an argument is refused
        self._trainers, self._pservers = trainers, pservers
        self._settings = settings
        self._roles: list[Any] = []
        self._workers: list[_Worker] = []
        self._outbox: queue.Queue = queue.Queue()
        self._failed: BaseException | None = None

    def set_rule(self, rule: dict[str, Any]) -> None:  # pragma: no cover - refused before (needs_rule_at_start)
        raise ConfigError("a remote session's job starts with its optimizer")

    def start(self, loss: Loss, rule: dict[str, Any] | None) -> None:
        from pdps.core.job import JobConfig
        from pdps.registry import open_compute
        from pdps.roles.master import publish_job
        from pdps.roles.pserver import Pserver
        from pdps.roles.trainer import TrainerContext

        settings = {"name": f"session-{uuid.uuid4().hex[:8]}", "lease_ttl": 2.0} | self._settings
        optimizer = {"optimizer": "graph", "optimizer_args": {"graph": rule}} if rule is not None else {}
        config = JobConfig(dataset=_NoData.url, mode="sync", trainers=self._trainers, pservers=self._pservers, **optimizer, **settings)
        compute = open_compute("torch", device="cpu")
        compute.check_optimizer(config.optimizer, config.optimizer_args)
        publish_job(self._store, config)
        try:
            for i in range(config.pservers):
                ps = Pserver(self._store, self._transport, compute, config, index=i, address=self._address)
                self._roles.append(ps)
                ps.start()
            for i in range(config.trainers):
                ctx = TrainerContext(self._store, self._transport, compute, _NoData(), config, trainer_id=f"trainer-{i}", publisher="trainer-0")
                ctx.register()
                self._workers.append(_Worker(i, ctx, copy.deepcopy(loss.model), self._outbox))
            for w in self._workers:
                w.thread = threading.Thread(target=self._serve, args=(w,), name=f"pdps-session-{w.ctx.trainer_id}", daemon=True)
                w.thread.start()
            self._answers()  # attached (the first publishes the model's values)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def _serve(w: _Worker) -> None:
        """A trainer worker: attach, then one command at a time from the session."""
        import torch

        try:
            w.ctx.attach(w.model)
        except BaseException as exc:
            w.outbox.put((w.index, exc))
            return
        w.outbox.put((w.index, None))
        while True:
            job = w.inbox.get()
            if job is None:
                return
            loss, share, update = job
            try:
                if update:
                    value = _loss_value(loss.fn(w.model, share))
                    w.ctx.step(value, samples=_samples(share))
                else:
                    with torch.no_grad():
                        value = _loss_value(loss.fn(w.model, share))
                w.outbox.put((w.index, float(value.detach())))
            except BaseException as exc:  # the session raises it
                w.outbox.put((w.index, exc))

    def _answers(self) -> list[Any]:
        """One answer of every worker, in their order. A worker that failed leaves the
        job at once (so a round the others wait in closes without it), and the first
        error is raised once all answered; the session is then failed for good."""
        got: dict[int, Any] = {}
        error: BaseException | None = None
        while len(got) < len(self._workers):
            try:
                i, value = self._outbox.get(timeout=EVAL_TIMEOUT)
            except queue.Empty:
                self._failed = PdpsError(f"session: trainer workers {sorted(set(range(len(self._workers))) - set(got))} did not answer in {EVAL_TIMEOUT:.0f}s")
                raise self._failed from None
            got[i] = value
            if isinstance(value, BaseException):
                error = error or value
                self._workers[i].ctx.leave()
        if error is not None:
            self._failed = error
            raise error
        return [got[i] for i in range(len(self._workers))]

    def eval(self, loss: Loss, feed: dict[str, Any], *, update: bool) -> float:
        import torch

        if self._failed is not None:
            raise ConfigError(f"session.eval: the session failed in an earlier eval ({self._failed!r}); close it and open another")
        n = len(self._workers)
        samples = _samples(feed)
        if samples < n:
            raise ConfigError(f"session.eval: feed has {samples} samples, fewer than the session's {n} trainers: each trainer needs a share")
        shares = [dict(zip(feed, parts)) for parts in zip(*(torch.tensor_split(v, n) for v in feed.values()))]
        for w, share in zip(self._workers, shares):
            w.inbox.put((loss, share, update))
        values = self._answers()
        if update:  # the user's model gets what the pservers applied (pulled by every trainer)
            with torch.no_grad():
                for mine, pulled in zip(loss.model.parameters(), self._workers[0].model.parameters()):
                    mine.copy_(pulled)
        # each share's loss is a mean over its samples: weighted by them, the whole feed's mean
        return sum(v * _samples(s) for v, s in zip(values, shares)) / samples

    def close(self) -> None:
        for w in self._workers:
            w.inbox.put(None)
        for w in self._workers:
            if w.thread is not None:
                w.thread.join(timeout=10)
            w.ctx.leave()
        for ps in self._roles:
            ps.stop()
        self._workers, self._roles = [], []
        if self._own_store:
            self._store.close()


def _samples(feed: Mapping[str, Any]) -> int:
    return int(next(iter(feed.values())).shape[0])
