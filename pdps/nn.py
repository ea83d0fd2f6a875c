"""Sparse embedding tables that live on the pservers (``import pdps.nn``).

A model handed to :meth:`pdps.TrainerContext.attach` keeps its dense parameters on the
trainer (one flat buffer, as always), but each of its *tables* lives only on the
pservers, row by row:

* every ``nn.Embedding(..., sparse=True)`` and ``nn.EmbeddingBag(..., sparse=True)``
  with a trainable weight (a bounded id space, ``0 <= id < num_embeddings``), and
* every :class:`HashEmbedding` (any int64 id: an unbounded id space).

``attach`` swaps each of them, in its parent module, for a :class:`RemoteTable` that
holds no parameter. Per forward, a remote table de-duplicates the batch's ids, pulls
only those rows (one call per pserver) into a compact ``[unique ids, dim]`` leaf, and
runs torch's own ``F.embedding`` / ``F.embedding_bag`` on it; the step pushes one
gradient row per unique id to the pserver that owns it. The trainer never allocates
the table: build one too big for a trainer with ``device="meta"``
(``nn.EmbeddingBag(10**9, 64, sparse=True, device="meta")``).

A row starts from :func:`init_rows`, a deterministic function of (table, id, seed):
**not** from the values torch put in the module (they are dropped with it). The
default init is torch's for ``nn.Embedding`` (``normal(0, 1)``, the padding row zero),
``uniform(-1/sqrt(dim), 1/sqrt(dim))`` for :class:`HashEmbedding`; :class:`TableOptions`
changes it, and sets admission and eviction, per table.

After a job, the tables come back as :class:`TableRows` (every row that exists, the
init value for any other id); :func:`bind` makes a model's tables read from them, to
evaluate it in one process.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pdps.core.errors import ConfigError
from pdps.core.tables import InitSpec, TableSpec
from pdps.core.tables import init_rows as _init_rows

__all__ = ["HashEmbedding", "RemoteTable", "TableOptions", "TableRows", "bind", "init_rows", "tables_of"]

_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float64: "float64"}
_TORCH_DTYPES = {v: k for k, v in _DTYPES.items()}


@attrs.frozen
class TableOptions:
    """Per-table settings for a replaced ``nn.Embedding`` / ``nn.EmbeddingBag``
    (``ctx.attach(model, tables={"emb.weight": TableOptions(...)})``); a
    :class:`HashEmbedding` takes the same as keyword arguments.

    ``init``: ``("normal", mean, std)``, ``("uniform", low, high)`` or ``("zeros",)``;
    ``seed`` varies it. ``admit_after``: a row is created at an id's c-th touch (a
    pushed batch holding it); before that its gradients are dropped. ``ttl_steps`` /
    ``ttl_seconds``: a row not updated for that long is evicted. ``capacity``: rows per
    pserver, the least frequently updated evicted past it, never below ``floor``.
    """

    init: tuple[Any, ...] | None = None
    seed: int = 0
    admit_after: int = 1
    ttl_steps: int = 0
    ttl_seconds: float = 0.0
    capacity: int = 0
    floor: int = 0

    def spec(self, name: str, dim: int, dtype: str, num_rows: int | None, padding_idx: int | None, default_init: InitSpec) -> TableSpec:
        init = default_init if self.init is None else _init_spec(self.init, name)
        return TableSpec(
            name=name, dim=dim, dtype=dtype, num_rows=num_rows, padding_idx=padding_idx, init=init, seed=self.seed,
            admit_after=self.admit_after, ttl_steps=self.ttl_steps, ttl_seconds=self.ttl_seconds,
            capacity=self.capacity, floor=self.floor,
        )


def _init_spec(init: Any, name: str) -> InitSpec:
    if isinstance(init, InitSpec):
        return init
    if not isinstance(init, (tuple, list)) or not init or not isinstance(init[0], str):
        raise ConfigError(f"table {name!r}: init must be ('normal', mean, std), ('uniform', low, high) or ('zeros',), got {init!r}")
    return InitSpec(init[0], tuple(float(a) for a in init[1:]))


def init_rows(spec: TableSpec, ids: Any) -> torch.Tensor:
    """The value a row of ``spec``'s table starts from, for each of ``ids`` (a tensor or
    array of int64): the same on every trainer, pserver and run. Use it to give a
    single-process torch model the same start as a pdps job (``weight.copy_(...)``)."""
    arr = np.ascontiguousarray(torch.as_tensor(ids).detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1))
    return torch.from_numpy(_init_rows(spec, arr)).to(_TORCH_DTYPES[spec.dtype])


class HashEmbedding(nn.Module):
    """An embedding over any int64 id (an unbounded id space), living on the pservers.

    ``HashEmbedding(dim, mode=None)`` maps ids of any shape to ``[..., dim]`` (as
    ``nn.Embedding``); with ``mode="sum"`` or ``"mean"`` it sums or averages bags (as
    ``nn.EmbeddingBag``: 2-D input, one bag per row, or 1-D input with ``offsets``).
    It holds no values: it works once its model is attached to a job, or bound to
    fetched rows (:func:`bind`). Keyword arguments are :class:`TableOptions`'.
    """

    def __init__(
        self, dim: int, *, mode: str | None = None, dtype: torch.dtype = torch.float32, init: tuple[Any, ...] | None = None,
        seed: int = 0, admit_after: int = 1, ttl_steps: int = 0, ttl_seconds: float = 0.0, capacity: int = 0, floor: int = 0,
    ) -> None:
        super().__init__()
        if not isinstance(dim, int) or dim < 1:
            raise ConfigError(f"HashEmbedding dim must be a whole number >= 1, got {dim!r}")
        if mode not in (None, "sum", "mean"):
            raise ConfigError(f"HashEmbedding mode must be None, 'sum' or 'mean', got {mode!r}")
        if dtype not in _DTYPES:
            raise ConfigError(f"HashEmbedding dtype must be a floating dtype, got {dtype}")
        self.dim, self.mode, self.dtype = dim, mode, dtype
        self.options = TableOptions(init=init, seed=seed, admit_after=admit_after, ttl_steps=ttl_steps, ttl_seconds=ttl_seconds, capacity=capacity, floor=floor)

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        raise ConfigError(
            "a HashEmbedding lives on the pservers: attach its model to a job (ctx.attach(model)), "
            "or bind it to fetched rows with pdps.nn.bind(model, params) to evaluate it"
        )

    def extra_repr(self) -> str:
        return f"{self.dim}, mode={self.mode!r}, dtype={self.dtype}"


def _spec_of(name: str, module: nn.Module, options: TableOptions | None) -> TableSpec:
    if isinstance(module, HashEmbedding):
        if options is not None:
            raise ConfigError(f"table {name!r} is a HashEmbedding: give its options to HashEmbedding(...), not to attach")
        bound = 1.0 / math.sqrt(module.dim)
        return module.options.spec(name, module.dim, _DTYPES[module.dtype], None, None, InitSpec("uniform", (-bound, bound)))
    weight = module.weight
    dtype = _DTYPES.get(weight.dtype)
    if dtype is None:
        raise ConfigError(f"table {name!r} has dtype {weight.dtype}; tables hold floating rows (float16, bfloat16, float32, float64)")
    if getattr(module, "max_norm", None) is not None:
        raise ConfigError(
            f"table {name!r} sets max_norm: torch renormalizes looked-up rows in place during forward, "
            "and a trainer never writes rows; drop max_norm, or normalize the output instead"
        )
    if module.scale_grad_by_freq:
        raise ConfigError(f"table {name!r} sets scale_grad_by_freq, which torch does not support with sparse gradients")
    if isinstance(module, nn.EmbeddingBag) and module.mode == "max":
        raise ConfigError(f"table {name!r} is an EmbeddingBag with mode='max', which torch does not support with sparse gradients")
    num, dim = weight.shape
    return (options or TableOptions()).spec(name, int(dim), dtype, int(num), module.padding_idx, InitSpec("normal", (0.0, 1.0)))


def tables_of(model: nn.Module, options: Mapping[str, TableOptions] | None = None) -> list[tuple[str, nn.Module, TableSpec]]:
    """The tables ``model`` holds, as ``(state-dict name of the weight, module, spec)``:
    every sparse ``nn.Embedding`` / ``nn.EmbeddingBag`` with a trainable weight and every
    :class:`HashEmbedding`. ConfigError for a table pdps cannot serve (``max_norm``,
    ``mode='max'``, a weight shared with another module) or options naming no table."""
    options = dict(options or {})
    found: list[tuple[str, nn.Module, TableSpec]] = []
    weights: dict[int, str] = {}
    for path, module in model.named_modules():
        name = f"{path}.weight" if path else "weight"
        if isinstance(module, HashEmbedding):
            found.append((name, module, _spec_of(name, module, options.pop(name, None))))
            continue
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
            if id(module.weight) in weights:
                raise ConfigError(f"table {name!r} shares its weight with {weights[id(module.weight)]!r}: a table lives on the pservers, so it cannot be tied")
            weights[id(module.weight)] = name
            found.append((name, module, _spec_of(name, module, options.pop(name, None))))
    if options:
        names = [n for n, _, _ in found]
        raise ConfigError(f"table options name {sorted(options)}, which are not tables of the model (its tables: {names})")
    for other, p in model.named_parameters(remove_duplicate=False):  # a table's weight under another name: tied
        if id(p) in weights and other != weights[id(p)]:
            raise ConfigError(f"table {weights[id(p)]!r} shares its weight with parameter {other!r}: a table lives on the pservers, so it cannot be tied")
    return found


class RemoteTable(nn.Module):
    """What stands in a model for a table once it is attached (or bound): it holds no
    parameter, and looks rows up through ``rows(table, unique_ids) -> [n, dim] tensor``
    (the trainer pulls them from the pservers; :func:`bind` reads fetched rows)."""

    def __init__(self, spec: TableSpec, original: nn.Module, rows: Callable[[RemoteTable, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.spec = spec
        if isinstance(original, HashEmbedding):
            self.bag = original.mode is not None
            self.mode = original.mode or "mean"
            self.scale_grad_by_freq = False
            self.include_last_offset = False
        else:
            self.bag = isinstance(original, nn.EmbeddingBag)
            self.mode = getattr(original, "mode", "mean")
            self.scale_grad_by_freq = original.scale_grad_by_freq
            self.include_last_offset = getattr(original, "include_last_offset", False)
        self._rows = rows

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        spec = self.spec
        if not self.bag and (offsets is not None or per_sample_weights is not None):  # nn.Embedding.forward has neither
            raise TypeError(f"table {spec.name!r} is an embedding, not a bag: it takes no offsets or per_sample_weights")
        if input.dtype not in (torch.int64, torch.int32):
            raise ConfigError(f"table {spec.name!r} takes int64 (or int32) ids, got {input.dtype}")
        ids = input.to(torch.int64)
        if spec.num_rows is not None and ids.numel():
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= spec.num_rows:
                raise IndexError(f"index out of range in self: table {spec.name!r} has {spec.num_rows} rows, got id {low if low < 0 else high}")
        unique, inverse = torch.unique(ids.reshape(-1), sorted=True, return_inverse=True)
        rows = self._rows(self, unique)
        inverse = inverse.reshape(ids.shape)
        pad = None
        if spec.padding_idx is not None and unique.numel():
            at = int(torch.searchsorted(unique, torch.tensor(spec.padding_idx, dtype=torch.int64, device=unique.device)))
            if at < unique.numel() and int(unique[at]) == spec.padding_idx:
                pad = at
        if not self.bag:
            return F.embedding(inverse, rows, padding_idx=pad, scale_grad_by_freq=self.scale_grad_by_freq)
        return F.embedding_bag(
            inverse, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset, padding_idx=pad, scale_grad_by_freq=self.scale_grad_by_freq,
        )

    def extra_repr(self) -> str:
        return f"{self.spec.name!r}, dim={self.spec.dim}, rows={'unbounded' if self.spec.num_rows is None else self.spec.num_rows}"


def replace_tables(model: nn.Module, found: list[tuple[str, nn.Module, TableSpec]], rows: Callable[[RemoteTable, torch.Tensor], torch.Tensor]) -> dict[str, RemoteTable]:
    """Swap each table module of ``found`` for a :class:`RemoteTable` in its parent."""
    stand_ins: dict[str, RemoteTable] = {}
    for name, module, spec in found:
        path = name[: -len(".weight")] if name.endswith(".weight") else ""
        stand_in = RemoteTable(spec, module, rows)
        if not path:
            raise ConfigError("the model itself is a table: wrap it in a module (pdps replaces tables inside their parent)")
        parent_path, _, child = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, child, stand_in)
        stand_ins[name] = stand_in
    return stand_ins


@attrs.frozen(eq=False)
class TableRows:
    """A table's rows as a job left them: ``ids`` (int64, ascending) and their
    ``values`` ``[len(ids), dim]``. :meth:`lookup` gives any id's row, the init value
    for an id that has none (never touched, not admitted, or evicted)."""

    spec: TableSpec
    ids: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return int(self.ids.numel())

    def lookup(self, ids: Any) -> torch.Tensor:
        want = torch.as_tensor(ids, dtype=torch.int64).reshape(-1)
        out = init_rows(self.spec, want).to(self.values.dtype)
        if len(self) and want.numel():
            at = torch.searchsorted(self.ids, want).clamp(max=len(self) - 1)
            hit = self.ids[at] == want
            out[hit] = self.values[at[hit]]
        return out


def bind(model: nn.Module, params: Mapping[str, Any]) -> nn.Module:
    """Make ``model``'s tables read from fetched rows (``params[<table name>]``, a
    :class:`TableRows`, as :func:`pdps.fetch_parameters` and ``SimulationResult.params``
    give them) and load its dense parameters from ``params``: to evaluate a trained
    model in one process. Returns the model."""
    found = tables_of(model)
    missing = [name for name, _, _ in found if not isinstance(params.get(name), TableRows)]
    if missing:
        raise ConfigError(f"no fetched rows for tables {missing} in the parameters given ({sorted(params)[:8]}...)")

    def rows(table: RemoteTable, unique: torch.Tensor) -> torch.Tensor:
        got = params[table.spec.name].lookup(unique.cpu())
        return got.to(unique.device)

    replace_tables(model, found, rows)
    dense = {k: v for k, v in params.items() if not isinstance(v, TableRows)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in dense:
                p.copy_(torch.as_tensor(dense[name]).reshape(p.shape))
    return model
