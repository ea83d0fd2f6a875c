"""Compute port: the tensor math of trainers and pservers.

Two holders:

* :class:`ModelReplica` (trainer side) binds a user's model to *one flat parameter
  buffer and one flat gradient buffer*: every parameter becomes a view of the
  first, its ``.grad`` a view of the second, so autograd accumulates straight into
  the buffer and a block of the layout is a contiguous range of it. Pushing hands
  out views (no copy); pulling copies into the buffer.
* :class:`ParameterShard` (pserver side) holds the blocks one pserver owns in a flat
  buffer, with the job's optimizer over it. Because pdps only runs *element-wise*
  optimizers, updating shards independently is exactly updating the whole model.

Tensors crossing this port are shaped like their block (``Block.shape``). Validation
(:meth:`ParameterShard.check`) happens before any state changes; ``stage`` and
``apply`` trust their input, so the caller checks first.

Aliasing: ``grads`` and ``values`` hand out views, so a pushed gradient must be
consumed (staged, i.e. copied, or applied) before the trainer's next ``zero_grad``,
which holds while calls are synchronous. ``views`` alias the shard: in async mode a pull
copied outside the pserver's lock may mix two versions, as Downpour's reads do; in
sync mode pulls happen between rounds and see one version.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pdps.core.slots import Block, ParamSpec


@runtime_checkable
class ModelReplica(Protocol):
    specs: list[ParamSpec]
    device: str

    def grads(self, blocks: Sequence[Block]) -> list[Any]:
        """Views of the gradient buffer, one per block, shaped like the block."""
        ...

    def values(self, blocks: Sequence[Block]) -> list[Any]:
        """Views of the parameter buffer, one per block."""
        ...

    def load(self, blocks: Sequence[Block], tensors: Sequence[Any]) -> None:
        """Copy pulled values into the model."""
        ...

    def check_finite(self, trainer: str) -> None:
        """Raise GradientRejected naming the parameter if a gradient holds NaN or Inf
        (checked before a push, so a bad step reaches no pserver at all)."""
        ...

    def zero_grad(self) -> None: ...

    # Overlap of communication with computation (``JobConfig.overlap``):

    def on_grad_ready(self, fn: Callable[[int], None]) -> Callable[[], None]:
        """Call ``fn(i)`` once backward has accumulated parameter ``i``'s gradient."""
        ...

    def before_forward(self, fn: Callable[[list[int]], None]) -> Callable[[], None]:
        """Call ``fn(indices)`` before the forward of each part of the model owning them."""
        ...

    def value_blocks(self, blocks: Sequence[Block]) -> list[Any]:
        """Views of the parameter buffer for ``blocks``: where a pull may be received."""
        ...

    def grad_blocks(self, blocks: Sequence[Block]) -> list[Any]:
        """Views of the gradient buffer for ``blocks``, unchecked, safe while backward runs."""
        ...

    def zero_blocks(self, blocks: Sequence[Block]) -> None:
        """Zero these blocks of the gradient buffer (once pushed)."""
        ...

    def load_blocks(self, blocks: Sequence[Block], tensors: Sequence[Any]) -> None:
        """Copy pulled values in, safe while the model runs on another thread."""
        ...


@runtime_checkable
class ParameterShard(Protocol):
    blocks: tuple[Block, ...]
    initialized: bool

    def initialize(self, tensors: Sequence[Any], trainer: str) -> None:
        """Take the initial values (copied). Raises GradientRejected on a mismatch."""
        ...

    def check(self, tensors: Sequence[Any], trainer: str, what: str = "gradient", indices: Sequence[int] | None = None, *, finite: bool = True) -> None:
        """Raise GradientRejected naming the parameter and trainer unless ``tensors``
        match the blocks (those at ``indices`` when given) in count, shape and dtype and
        (unless ``finite`` is False: checked already, by the pserver forwarding them)
        hold only finite values."""
        ...

    def stage(self, key: str, tensors: Sequence[Any], indices: Sequence[int] | None = None, *, keep: bool = False) -> None:
        """Keep a copy of ``key``'s (a trainer's) gradient, replacing one staged before:
        for the open sync round, or for an async step pushed in pieces; ``indices`` names
        the blocks of a push of some slots (default all). ``key`` counts as staged once
        every block is. ``keep``: the caller gives the tensors away (nobody writes them
        any more), so the shard may hold them instead of a copy. Nothing is applied until :meth:`apply_staged` or
        :meth:`apply_staged_step`."""
        ...

    def reserve(self, keys: Iterable[str]) -> None:
        """Allocate (and touch) the staging buffers of ``keys`` ahead of their first
        :meth:`stage`, and the gradient buffer: a shard built ahead of a resize's switch
        then allocates nothing in its first round."""
        ...

    def staged(self) -> set[str]:
        """The keys staged for the open round."""
        ...

    def unstage(self, key: str | None = None, *, forget: bool = False) -> None:
        """Drop ``key``'s staged gradient (all if None); ``forget`` also frees its buffer."""
        ...

    def apply_staged(self, weights: Sequence[tuple[str, float]]) -> None:
        """Close a sync round: one optimizer step with ``sum(w * staged[key])`` summed in
        the given order; then nothing is staged. Raises KeyError if a key is not staged.
        Not for an empty round: momentum rules would still move the parameters."""
        ...

    def apply_staged_step(self, key: str) -> bool:
        """Async, a step pushed in pieces: one optimizer step of the blocks ``key`` has
        staged, each with its staged gradient (the others do not move); then ``key`` has
        nothing staged, and other keys keep theirs. False (nothing applied) if ``key``
        has staged nothing."""
        ...

    def staged_step(self, key: str) -> tuple[list[int], list[Any]]:
        """The positions of the blocks ``key`` has staged (an async step in pieces), and
        their staged gradients (views, valid until ``key`` stages again): what
        :meth:`apply_staged_step` would apply."""
        ...

    def apply(self, tensors: Sequence[Any], indices: Sequence[int] | None = None) -> None:
        """Async: one optimizer step with these gradients, of the blocks at ``indices``
        (default all; the others do not move). The tensors may be used in place."""
        ...

    def views(self) -> list[Any]:
        """Current values, one view per block (aliases the shard: read, never write)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Values and optimizer state as flat tensors only (safetensors-friendly, no pickle)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def export_blocks(self, indices: Sequence[int] | None = None) -> dict[str, Any]:
        """The blocks at ``indices`` (default all) with their optimizer state, keyed by
        block (``<param>@<first row>:<end row>/values``, ``.../state.<k>``,
        ``.../scalar.<k>``), aliasing the shard: what a slot migration sends and a
        checkpoint stores."""
        ...

    def import_blocks(self, entries: Mapping[str, Any]) -> None:
        """Load every block from :meth:`export_blocks` entries of any cut of the same
        parameters; the shard is then initialized. ConfigError if rows are missing."""
        ...

    def expect_import(self) -> None:
        """The values are on their way (a resize moving slots here): :meth:`stage` is
        allowed before the shard is initialized, and the next :meth:`import_blocks`
        keeps what was staged."""
        ...

    def snapshot(self, counters: Mapping[str, int], indices: Sequence[int] | None = None) -> dict[str, Any]:
        """:meth:`export_blocks` of the blocks at ``indices`` (default all) copied now
        (the shard may step on while the copy is written to a checkpoint part), with
        each of ``counters`` as a 0-d int64 tensor under its name."""
        ...


@runtime_checkable
class Compute(Protocol):
    device: str

    def check_optimizer(self, name: str, kwargs: Mapping[str, Any]) -> None:
        """Raise ConfigError unless ``name`` is an element-wise rule and ``kwargs`` are
        JSON-safe and accepted by it."""
        ...

    def replica(self, module: Any) -> ModelReplica: ...

    def tensors(self, columns: Mapping[str, Any], device: str = "cpu") -> dict[str, Any]:
        """Columns of records (numpy arrays, as a data source reads them) as the tensors
        a model takes, on ``device``; on the CPU they share the arrays' memory."""
        ...

    def shard(self, blocks: Sequence[Block], optimizer: str, optimizer_args: Mapping[str, Any]) -> ParameterShard: ...


@runtime_checkable
class ThreadedCompute(Protocol):
    """A compute that knows how many CPU threads it computes with in this process (a
    trainer weighs them against the host's cores before overlapping communication)."""

    @property
    def threads(self) -> int: ...
