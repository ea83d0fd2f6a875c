"""Pipeline stages in torch: cutting an ``nn.Sequential`` into stages, and running one
stage's share of a schedule (design/pipeline.md §5).

* :func:`split` cuts a model into contiguous stages, each an ``nn.Sequential`` of the
  model's own children under their own names, so a stage's ``named_parameters()`` are
  the whole model's names (``"3.weight"``) and its parameters the very same tensors.
* :class:`StageRunner` runs one rank's actions of a schedule (:mod:`pdps.core.pipeline`)
  for one step over a :class:`~pdps.ports.link.Link`: it receives a microbatch's input
  before its ``F`` (stages after the first), sends the output after it (stages before
  the last), receives the output's gradient before the ``B`` and sends the input's
  gradient after it. The first stage cuts the batch into the microbatches and sends the
  targets to the last stage (``stop_gradient``), which weights each microbatch's loss by
  its share of the batch, so the gradients summed over microbatches are those of the
  batch-mean loss and the step's loss is the batch's. ``.grad`` accumulates on the
  stage's parameters (the caller zeroes it and steps its optimizer).

Between stages an activation is a tensor or a tuple of tensors, handed to the next
stage's module as one argument as ``nn.Sequential`` hands it from child to child (so
the stages compose to the whole model); its floating tensors carry gradients back. Shapes may change from one microbatch to the next and
from one step to the next: every message carries its tensors' meta.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from torch import nn

from pdps.core.errors import BadRequest, ConfigError
from pdps.core.pipeline import Action, Op, check_rank, lower_rank
from pdps.nn import tables_of
from pdps.ports.link import Link

__all__ = ["StageRunner", "split"]


def split(model: nn.Sequential, stages: int, *, points: Sequence[int] | None = None) -> list[nn.Sequential]:
    """Cut ``model`` into ``stages`` contiguous stages. ``points``: the child indices at
    which stages 1.. start (``stages - 1`` of them, increasing, inside ``(0, children)``);
    without them, the cut that makes the largest stage's parameter count least, among
    those the largest stage's child count least, and among those the latest cuts (a
    child without parameters, an activation, stays with the one before it). A stage holds the model's children
    (not copies) under the model's names. Refused: a model that is not an
    ``nn.Sequential``, a sparse table in it (no stage pulls or pushes rows), fewer children
    than stages, bad points, a parameter two stages share."""
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"split cuts an nn.Sequential into stages; got {type(model).__name__}: wrap the model's layers in one")
    tables = [name for name, _, _ in tables_of(model)]
    if tables:
        raise ConfigError(
            f"the model holds sparse tables {tables}: a pipeline stage does not pull or push table rows (docs/pipeline.md, limits);"
            " give the embedding a dense weight (sparse=False), or train the model with ctx.attach() and ctx.step()"
        )
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ConfigError(f"split needs stages >= 1, got {stages!r}")
    children = list(model._modules.items())  # not named_children(): it skips a module listed twice
    n = len(children)
    if n < stages:
        raise ConfigError(f"the model has {n} children, fewer than the {stages} stages asked for: a stage holds at least one child")
    if points is None:
        starts = _balanced([sum(p.numel() for p in m.parameters()) for _, m in children], stages)
    else:
        starts = list(points)
        if len(starts) != stages - 1:
            raise ConfigError(f"points {starts} name {len(starts)} cuts; {stages} stages need {stages - 1} (the child index each stage after the first starts at)")
        for i, p in enumerate(starts):
            if not isinstance(p, int) or isinstance(p, bool) or not 0 < p < n:
                raise ConfigError(f"points[{i}] is {p!r}: a cut is a child index in [1, {n - 1}]")
            if i and p <= starts[i - 1]:
                raise ConfigError(f"points {starts} do not increase at index {i}: each stage holds at least one child")
    bounds = [0, *starts, n]
    out = [nn.Sequential(OrderedDict(children[bounds[s] : bounds[s + 1]])) for s in range(stages)]
    owner: dict[int, tuple[int, str]] = {}
    for s, stage in enumerate(out):
        for name, p in stage.named_parameters():
            first, first_name = owner.setdefault(id(p), (s, name))
            if first != s:
                raise ConfigError(f"parameter {name!r} of stage {s} is {first_name!r} of stage {first}: cut elsewhere (points=) so shared layers stay on one stage")
    return out


def _balanced(weights: Sequence[int], stages: int) -> list[int]:
    """The starts of stages 1.. of the contiguous cut of ``weights`` whose heaviest part
    is least, then whose longest part is least, then whose cuts are latest."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")

    def best_cut(cost: Callable[[int, int], float]) -> tuple[float, list[int]]:
        # best[k][i]: the least max cost cutting the first i children into k parts.
        best = [[inf] * (n + 1) for _ in range(stages + 1)]
        back = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0
        for k in range(1, stages + 1):
            for i in range(k, n - (stages - k) + 1):
                for j in range(k - 1, i):
                    c = max(best[k - 1][j], cost(j, i))
                    if c <= best[k][i]:  # ties: the latest cut, so a layer without parameters stays with the one before
                        best[k][i], back[k][i] = c, j
        starts, i = [], n
        for k in range(stages, 1, -1):
            i = back[k][i]
            starts.append(i)
        return best[stages][n], starts[::-1]

    heaviest, _ = best_cut(lambda j, i: prefix[i] - prefix[j])
    _, starts = best_cut(lambda j, i: i - j if prefix[i] - prefix[j] <= heaviest else inf)
    return starts


@attrs.define(eq=False)
class StageRunner:
    """Runs stage ``stage`` of ``stages`` (``module``, e.g. one of :func:`split`'s) over
    ``link``. ``ranks``: the link rank of each stage of this pipeline (default
    ``0..stages-1``; with data parallelism ``HybridGroup.get_pipe_parallel_group()``).
    ``loss_fn(output, target)`` (the last stage's, required there) returns the mean loss
    over its microbatch. ``timeout``: seconds a receive waits before
    :class:`~pdps.core.errors.Timeout`. ``activations`` counts the microbatches whose
    ``F`` is done and ``B`` not yet; ``peak_activations`` is its most during the last
    :meth:`run`."""

    module: nn.Module
    stage: int
    stages: int
    link: Link
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    ranks: Sequence[int] | None = attrs.field(default=None, kw_only=True)
    timeout: float = attrs.field(default=60.0, kw_only=True)
    activations: int = attrs.field(default=0, init=False)
    peak_activations: int = attrs.field(default=0, init=False)
    _step: int = attrs.field(default=0, init=False)
    _plan: tuple[tuple[Action, ...], int, list[Action]] | None = attrs.field(default=None, init=False)  # the last run's actions, checked and lowered

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.stages, int) or self.stages < 1 or not isinstance(self.stage, int) or not 0 <= self.stage < self.stages:
            raise ConfigError(f"stage {self.stage!r} of {self.stages!r} stages: stages >= 1 and 0 <= stage < stages")
        self.ranks = tuple(range(self.stages)) if self.ranks is None else tuple(self.ranks)
        if len(self.ranks) != self.stages:
            raise ConfigError(f"ranks {self.ranks} name {len(self.ranks)} ranks for {self.stages} stages: one rank per stage")
        if self.is_last and self.loss_fn is None:
            raise ConfigError(f"stage {self.stage} is the last of {self.stages}: it needs a loss_fn(output, target)")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def run(self, actions: Sequence[Action], inputs: Any = None, targets: Any = None, *, step: int | None = None) -> float | None:
        """Run this rank's ``actions`` (compute only, or already lowered) of one step.

        The first stage takes the batch: ``inputs`` and ``targets`` each a tensor cut
        along dim 0 into as many microbatches as ``actions`` name
        (``torch.tensor_split``: sizes may differ by one), or a list of the microbatches
        (shapes may differ between them, e.g. sequence lengths). Other stages take
        neither. ``step`` tags the messages (default: one more than the last run's; every
        stage of a pipeline must agree). Returns the batch-mean loss on the last stage,
        ``None`` elsewhere."""
        self._step = self._step if step is None else step
        tag = f"{self._step}"
        self._step += 1
        microbatches, lowered = self._lowered(actions)

        pieces: list[Any] = []
        labels: list[Any] = []
        if self.is_first:
            pieces = _microbatches(inputs, microbatches, "inputs")
            labels = _microbatches(targets, microbatches, "targets")
            for m, (x, y) in enumerate(zip(pieces, labels)):
                if x.shape[0] != y.shape[0]:
                    raise ConfigError(f"microbatch {m} holds {x.shape[0]} inputs and {y.shape[0]} targets: give as many of each")
            if not self.is_last:
                self.link.send(self.ranks[-1], f"{tag}/targets", labels, stop_gradient=[True] * len(labels))
        elif inputs is not None or targets is not None:
            raise ConfigError(f"stage {self.stage} was given inputs or targets: the first stage takes the batch and sends the targets on")
        elif self.is_last:
            labels = self.link.recv(self.ranks[0], f"{tag}/targets", timeout=self.timeout)
            if len(labels) != microbatches:
                raise BadRequest(f"stage {self.stage} received {len(labels)} targets for step {tag}, expected one per microbatch ({microbatches})", field="targets")
        sizes = [int(y.shape[0]) for y in labels]
        batch = sum(sizes)

        held_in: dict[int, list[torch.Tensor]] = {}
        held_out: dict[int, Any] = {}
        grads_from_next: dict[int, list[torch.Tensor]] = {}
        grads_to_prev: dict[int, list[torch.Tensor]] = {}
        loss: Any = 0.0
        self.activations = self.peak_activations = 0
        for a in lowered:
            mb, mtag = a.microbatch, f"{tag}/{a.microbatch}"
            if a.op is Op.RECV_ACT:
                received = self.link.recv(self.ranks[self.stage - 1], f"{mtag}/act", timeout=self.timeout)
                held_in[mb] = [x.detach().requires_grad_(True) if x.is_floating_point() else x for x in received]
            elif a.op is Op.FORWARD:
                xs = [pieces[mb]] if self.is_first else held_in[mb]
                out = self.module(xs[0] if len(xs) == 1 else tuple(xs))  # as nn.Sequential hands one child's output to the next
                if self.is_last:
                    mean = self.loss_fn(out, labels[mb])  # type: ignore[misc]
                    if not isinstance(mean, torch.Tensor) or mean.dim() != 0:
                        raise ConfigError(f"loss_fn returned {type(mean).__name__} {getattr(mean, 'shape', '')}: it must return a scalar tensor (the mean over the microbatch)")
                    weighted = mean * (sizes[mb] / batch)
                    held_out[mb] = weighted
                    loss = loss + weighted.detach()
                else:
                    held_out[mb] = list(out) if isinstance(out, (tuple, list)) else [out]
                self.activations += 1
                self.peak_activations = max(self.peak_activations, self.activations)
            elif a.op is Op.SEND_ACT:
                outs = held_out[mb]
                self.link.send(self.ranks[self.stage + 1], f"{mtag}/act", [o.detach() for o in outs],
                               stop_gradient=[not o.is_floating_point() for o in outs])
            elif a.op is Op.RECV_GRAD:
                grads_from_next[mb] = self.link.recv(self.ranks[self.stage + 1], f"{mtag}/grad", timeout=self.timeout)
            elif a.op is Op.BACKWARD:
                self._backward(mb, mtag, held_out.pop(mb), grads_from_next.pop(mb, None))
                self.activations -= 1
                if not self.is_first:
                    grads_to_prev[mb] = [x.grad if x.grad is not None else torch.zeros_like(x) for x in held_in.pop(mb) if x.is_floating_point()]
            else:  # Op.SEND_GRAD
                grads = grads_to_prev.pop(mb)
                self.link.send(self.ranks[self.stage - 1], f"{mtag}/grad", grads, stop_gradient=[True] * len(grads))
        return float(loss) if self.is_last else None

    def _lowered(self, actions: Sequence[Action]) -> tuple[int, list[Action]]:
        """``actions`` checked and lowered: (microbatches, actions with communication).
        A step runs the same actions as the last one, so the last plan is kept (checking
        and lowering is on the step's critical path: about 0.5 ms a stage)."""
        key = tuple(actions)
        if self._plan is not None and self._plan[0] == key:
            return self._plan[1], self._plan[2]
        if any(isinstance(a, Action) and a.stage != self.stage for a in key):
            wrong = next(a for a in key if isinstance(a, Action) and a.stage != self.stage)
            raise ConfigError(f"the runner of stage {self.stage} was given {wrong}: one runner runs one stage (run interleaved chunks with a runner each)")
        microbatches = check_rank(key, self.stage, self.stages)
        lowered = lower_rank(key, self.stages, {self.stage})
        self._plan = (key, microbatches, lowered)
        return microbatches, lowered

    def _backward(self, mb: int, mtag: str, out: Any, grads: list[torch.Tensor] | None) -> None:
        if self.is_last:
            out.backward()
            return
        floating = [o for o in out if o.is_floating_point()]
        if grads is None or len(grads) != len(floating):
            raise BadRequest(f"stage {self.stage} received {0 if grads is None else len(grads)} gradients for {mtag}, expected {len(floating)} (one per floating output)", field="grad")
        pairs = [(o, g) for o, g in zip(floating, grads) if o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])


def _microbatches(batch: Any, microbatches: int, name: str) -> list[Any]:
    if isinstance(batch, torch.Tensor):
        rows = batch.shape[0] if batch.dim() else 0
        if rows < microbatches:
            raise ConfigError(f"{name} holds {rows} rows, fewer than the {microbatches} microbatches: give at least one row per microbatch")
        return list(torch.tensor_split(batch, microbatches, dim=0))
    if isinstance(batch, (list, tuple)) and all(isinstance(t, torch.Tensor) and t.dim() > 0 for t in batch):
        if len(batch) != microbatches:
            raise ConfigError(f"{name} holds {len(batch)} microbatches; the schedule runs {microbatches}")
        empty = [m for m, t in enumerate(batch) if t.shape[0] == 0]
        if empty:
            raise ConfigError(f"{name}' microbatch {empty[0]} has no rows: each microbatch needs at least one")
        return list(batch)
    raise ConfigError(f"the first stage needs {name}: a tensor (cut along dim 0) or a list of one tensor per microbatch, got {type(batch).__name__}")
