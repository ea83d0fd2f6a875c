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

* :class:`RowShard` (pserver side) holds the rows of one embedding table that live in
  the slots a pserver holds (design/sparse-embeddings.md): created when their first
  gradient is applied, stepped by a row rule, evicted by the table's policy.

Tensors crossing this port are shaped like their block (``Block.shape``), or ``[n,
dim]`` for rows with their ids ``[n]`` int64, strictly ascending. Validation
(:meth:`ParameterShard.check`, :meth:`RowShard.check`) happens before any state
changes; ``stage`` and ``apply`` trust their input, so the caller checks first.

Aliasing: ``grads`` and ``values`` hand out views, so a pushed gradient must be
consumed (staged, i.e. copied, or applied) before the trainer's next ``zero_grad``,
which holds while calls are synchronous. ``views`` alias the shard: in async mode a pull
copied outside the pserver's lock may mix two versions, as Downpour's reads do; in
sync mode pulls happen between rounds and see one version.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from pdps.core.slots import Block, ParamSpec
from pdps.core.tables import TableSpec


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
class RowShard(Protocol):
    """The rows of one table in the slots a pserver holds, with the row rule's state.

    A row exists once a gradient for its id was applied (and admitted); a pull of an
    id with no row is answered with the table's init value, computed, never stored.
    Every decision (creation, admission, eviction) depends only on the ids, the
    gradients and replicated counters, so backups fed the same pushes stay equal. Not
    thread-safe: the pserver calls it under its lock."""

    step: int  # the table step: rounds (sync) or pushes (async) applied with a section of this table
    slots: frozenset[int]  # the slots whose rows are held here

    def check(self, ids: Any, grads: Any | None, trainer: str, *, finite: bool = True, slots: Collection[int] | None = None) -> None:
        """Raise GradientRejected (a push: ``grads`` given) or BadRequest (a pull:
        ``grads`` None) naming the table, the trainer and the field, unless ``ids`` are
        int64, 1-D, strictly ascending, within a bounded table's range, at most the
        job's ``sparse_max_ids``, all in ``slots`` (default: the slots held here), and
        ``grads`` are ``[n, dim]`` of the table's dtype and (unless ``finite`` is False)
        finite. Counts a refusal in ``stats()["refused"]``; changes nothing else."""
        ...

    def stage(
        self, key: str, ids: Any, grads: Any, *, keep: bool = False, source: int = -1, version: int = 0,
        covers: Collection[int] | Any | None = None,
    ) -> None:
        """Keep ``key``'s (a trainer's) section for the open sync round, replacing one
        staged before from the same ``source`` (-1: the trainer's own push; else the
        primary that forwarded it, with replicas; ``keep``: hold the given tensors
        instead of a copy). ``covers``: the slots (or a bool mask over them) this
        section carries in slot map ``version``, whose rows it takes out of ``key``'s
        sections from other sources staged by an older map (a push sent again after a
        failover)."""
        ...

    def staged(self) -> set[str]:
        """The keys with a section staged."""
        ...

    def unstage(self, key: str | None = None, *, forget: bool = False) -> None:
        """Drop ``key``'s staged section (all if None); ``forget`` also frees its buffer."""
        ...

    def apply_staged(self, weights: Sequence[tuple[str, float]]) -> bool:
        """Close a sync round: the union of the sections staged by the keys of
        ``weights``, each id's gradient ``sum(w * g)`` in the given order, one step of
        the rule (keys of ``weights`` that staged nothing did not use the table this
        round). Then nothing is staged. False (nothing applied, the table step stays)
        if none of them staged a section."""
        ...

    def apply(self, ids: Any, grads: Any, *, step: int | None = None, key: str | None = None) -> None:
        """Async: one step of the rule with this section (checked before); ``step``: at
        that table step (a primary's, forwarded to its backup), this store's own
        unchanged and nothing evicted. ``key``: the caller (a trainer); a store may reuse
        what its last ``lookup(..., key=key)`` of the same ids found, while no row has
        left its place since: the outcome is the same as without ``key``."""
        ...

    def lookup(self, ids: Any, *, key: str | None = None) -> Any:
        """``[n, dim]`` rows of ``ids`` (a new tensor): the stored rows, the init value
        for ids with no row. Never creates a row. ``key``: the caller, whose next
        ``apply`` may reuse this lookup (a trainer pushes the rows it pulled)."""
        ...

    def export_slots(self, slots: Collection[int], offset: int = 0, limit: int | None = None) -> tuple[dict[str, Any], bool]:
        """The rows of ``slots`` in (slot, id) order from ``offset``, at most ``limit``,
        with their state (a slot without rows has no entries), as entries named by :func:`pdps.core.tables.row_entry` and
        :func:`~pdps.core.tables.table_entry` (copies), and whether rows remain past the
        page: what a migration sends and a checkpoint stores."""
        ...

    def import_slots(self, entries: Mapping[str, Any]) -> None:
        """Load :meth:`export_slots` entries (of any pserver's cut); the slots they hold
        rows of are then held here (:meth:`hold` takes those without rows). Entries of other tables are ignored. ConfigError, with nothing
        changed, for an entry that does not fit."""
        ...

    def snapshot(self, slots: Collection[int]) -> dict[str, Any]:
        """Every row of ``slots`` with its state, copied now (for a checkpoint part)."""
        ...

    def hold(self, slots: Collection[int]) -> None:
        """Hold ``slots`` from now on (given here by a resize, rows or none)."""
        ...

    def drop_slots(self, slots: Collection[int]) -> None:
        """Forget the rows of ``slots`` (moved away) and stop holding them."""
        ...

    def stats(self) -> dict[str, int]:
        """``rows, bytes`` (what the store holds now) and the counters ``created,
        admitted, pending, pending_dropped, evicted_ttl, evicted_lfu, refused``."""
        ...


@runtime_checkable
class Compute(Protocol):
    device: str

    def check_optimizer(self, name: str, kwargs: Mapping[str, Any]) -> None:
        """Raise ConfigError unless ``name`` is an element-wise rule and ``kwargs`` are
        JSON-safe and accepted by it; a rule shipped as a graph (``"graph"``) that its
        checker refuses raises that :class:`~pdps.core.errors.BadGraph` (a ConfigError)
        as it is, with its own message."""
        ...

    def replica(self, module: Any) -> ModelReplica: ...

    def tensors(self, columns: Mapping[str, Any], device: str = "cpu") -> dict[str, Any]:
        """Columns of records (numpy arrays, as a data source reads them) as the tensors
        a model takes, on ``device``; on the CPU they share the arrays' memory."""
        ...

    def shard(self, blocks: Sequence[Block], optimizer: str, optimizer_args: Mapping[str, Any]) -> ParameterShard: ...

    def rows(
        self,
        spec: TableSpec,
        rule: str,
        args: Mapping[str, Any],
        slots: Collection[int],
        num_slots: int,
        clock: Callable[[], float],
        *,
        max_ids: int | None = None,
    ) -> RowShard:
        """The row store of table ``spec`` on a pserver holding ``slots`` of
        ``num_slots``, stepped by row rule ``rule`` (a name of
        :data:`pdps.core.tables.ROW_RULES`) with ``args``; ``clock`` (seconds) times
        ``ttl_seconds``; a push or pull of more than ``max_ids`` ids is refused (None: the
        default of the job setting ``sparse_max_ids``)."""
        ...

    def tables(self, module: Any, options: Mapping[str, Any] | None = None) -> TrainerTables:
        """Take ``module``'s sparse tables out of it (each swapped for a stand-in that
        pulls its rows), before :meth:`replica` binds the rest (:mod:`pdps.nn`). Falsy
        when the model has none."""
        ...


@runtime_checkable
class StageRun(Protocol):
    """One pipeline stage's runner (``pdps.adapters.torch_pipeline.StageRunner``): runs
    this stage's actions of one step over a link (design/pipeline.md §5)."""

    peak_activations: int

    def run(self, actions: Sequence[Any], inputs: Any = None, targets: Any = None, *, step: int | None = None) -> float | None:
        """Run ``actions``; the first stage takes ``inputs`` and ``targets`` (a tensor
        cut into microbatches, or a list of them); the batch-mean loss on the last stage."""
        ...


@runtime_checkable
class PipelineCompute(Protocol):
    """A compute that can cut a model into pipeline stages and run one of them."""

    def split(self, model: Any, stages: int, *, points: Sequence[int] | None = None) -> list[Any]:
        """``model`` cut into ``stages`` contiguous stages holding its own parameters
        under the whole model's names (ConfigError for a model that cannot be cut)."""
        ...

    def stage_runner(
        self, module: Any, stage: int, stages: int, link: Any, loss_fn: Callable[[Any, Any], Any] | None, *, ranks: Sequence[int], timeout: float
    ) -> StageRun:
        """A runner of stage ``stage`` (``module``) over ``link``, its pipeline's stages at ``ranks``."""
        ...


@runtime_checkable
class ThreadedCompute(Protocol):
    """A compute that knows how many CPU threads it computes with in this process (a
    trainer weighs them against the host's cores before overlapping communication)."""

    @property
    def threads(self) -> int: ...


@runtime_checkable
class TrainerTables(Protocol):
    """A trainer's side of a model's sparse tables (see ``pdps.adapters.torch_tables``):
    rows pulled by each forward, gradient rows pushed per pserver."""

    specs: list[TableSpec]

    def __bool__(self) -> bool: ...

    def connect(self, route: Callable[[], Sequence[int]], pull: Callable[[Mapping[int, list[tuple[str, Any]]]], Mapping[int, Sequence[Any]]]) -> None:
        """``route()``: the slot map's owner of each slot, now; ``pull({pserver: [(table,
        ids)]})``: their rows, per pserver, in order (raising SlotMapChanged once the
        trainer has followed a resize: the ids are routed again)."""
        ...

    def sections(self, pservers: Sequence[int]) -> dict[int, list[tuple[str, Any, Any]]]:
        """Per pserver: ``(table, ids, gradient rows)`` for every table the step used
        (ids ascending, unique, possibly none)."""
        ...

    def check_finite(self, trainer: str) -> None:
        """GradientRejected naming the table if a gradient row holds NaN or Inf."""
        ...

    def clear(self) -> None:
        """Forget the step's rows (pushed, refused or dropped)."""
        ...
