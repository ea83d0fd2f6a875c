"""Sparse embedding tables: what a table is, where its rows live, what a new row holds.

* A table (:class:`TableSpec`) is a named ``[ids, dim]`` matrix kept on the pservers a
  row at a time: only rows that exist are stored, over a bounded id range
  (``num_rows``) or the whole int64 space (``num_rows=None``, a hash embedding).
* A row's slot is a function of ``(table, id, num_slots)`` alone (:func:`row_slots`):
  splitmix64 of ``id ^ table_salt(table)``, vectorized over uint64. Rows never follow
  the block placement of :class:`~pdps.core.slots.SlotMap`; the owner of a row is
  ``slot_map.owners[slot]``, so a resize or a failover moves rows with their slots
  and every process agrees on where each row is.
* A row's first value (:func:`init_rows`) is counter-based: element ``j`` of row
  ``id`` comes from splitmix64 of ``(seed, salt, id, j)``, with no state, so it is the
  same whatever the order, the batching or the number of pservers. Uniform draws take
  53 bits of the integer (exact everywhere); normal ones are Box-Muller of two such
  uniforms through numpy's ``log``/``sqrt``/``cos`` (exact within one numpy build).
* The row rules (:data:`ROW_RULES`) say which optimizers step rows, with which
  arguments, and refuse those that would make a sparse step dense.
* Entry names (:func:`row_entry`, :func:`table_entry`) are how rows are named in a
  checkpoint part and a slot migration, beside the blocks' ``<param>@<first>:<end>/...``
  (:func:`pdps.core.slots.block_entry`), never colliding with them.

Everything here is pure: numpy over whole id arrays, no loop per row.
"""

from __future__ import annotations

import difflib
import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
import numpy as np

from pdps.core.errors import ConfigError
from pdps.core.job import shown

#: The dtypes a table stores (those dense parameters train in, pdps.core.slots).
TABLE_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}
#: ``pending_capacity=0`` means this many pending ids per table per pserver.
DEFAULT_PENDING_CAPACITY = 1 << 20

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_TWO_TO_MINUS_53 = 2.0**-53
# init_rows draws this many uint64 at a time at most: its scratch stays in cache
_INIT_CHUNK = 1 << 15

# Characters a table name may not hold: they separate the parts of entry names.
_NAME_SEPARATORS = ("#", "/", "@")


# --- hashing ---------------------------------------------------------------------------


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    """The first output of a splitmix64 generator seeded with each ``x`` (uint64,
    elementwise, wrapping): ``mix(x + 0x9E3779B97F4A7C15)``. Counter-based, so the
    ``k``-th output of the stream seeded with ``s`` is ``splitmix64(s + k * gamma)``."""
    z = np.array(x, dtype=np.uint64)  # a copy, stepped in place: wrapping, and no scalar overflow warning
    z += _GAMMA
    z ^= z >> np.uint64(30)
    z *= _MIX1
    z ^= z >> np.uint64(27)
    z *= _MIX2
    z ^= z >> np.uint64(31)
    return z


def table_salt(name: str) -> int:
    """The salt of a table's hashes: blake2b of its name (8-byte digest, big-endian, as
    :func:`pdps.core.slots.slot_of` hashes blocks), never Python's salted ``hash``."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "big")


def as_ids(ids: Any, what: str = "ids") -> np.ndarray:
    """``ids`` as an int64 array (uint64 reinterpreted, other integer dtypes widened);
    ValueError for anything that is not an array of integers."""
    arr = np.asarray(ids)
    if arr.dtype == np.int64:
        return arr
    if arr.dtype == np.uint64:
        return arr.view(np.int64)
    if arr.dtype.kind in "iu" or (arr.size == 0 and arr.dtype.kind == "f"):
        return arr.astype(np.int64)
    raise ValueError(f"{what} must be integers (int64), got an array of {arr.dtype}")


def _as_u64(ids: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(ids, dtype=np.int64).view(np.uint64)


def row_slots(name: str, ids: Any, num_slots: int) -> np.ndarray:
    """The slot of each row ``ids`` of table ``name`` among ``num_slots``: int64, the
    shape of ``ids``. ``splitmix64(uint64(id) ^ table_salt(name)) % num_slots``."""
    if isinstance(num_slots, bool) or not isinstance(num_slots, (int, np.integer)) or num_slots < 1:
        raise ConfigError(f"num_slots must be a whole number >= 1, got {shown(num_slots)}")
    u = _as_u64(as_ids(ids))
    h = splitmix64(u ^ np.uint64(table_salt(name)))
    return (h % np.uint64(num_slots)).astype(np.int64)


# --- the table -------------------------------------------------------------------------


def _whole(value: Any) -> Any:
    # numpy integers (a shape, a count computed in numpy) count as the ints they are
    return int(value) if isinstance(value, np.integer) else value


def _seconds(value: Any) -> Any:
    return float(value) if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool) else value


def _init_spec(value: Any) -> Any:
    return InitSpec.from_json(value) if isinstance(value, Mapping) else value


def _float_args(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(float(v) if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) else v for v in value)
    return value


#: Init kinds and the names of their arguments.
INIT_KINDS = {"normal": ("mean", "std"), "uniform": ("low", "high"), "zeros": ()}


@attrs.frozen
class InitSpec:
    """The distribution of a new row: ``normal(mean, std)``, ``uniform(low, high)`` or
    ``zeros()``. Checked when made (ConfigError naming the kind and the arguments)."""

    kind: str
    args: tuple[float, ...] = attrs.field(default=(), converter=_float_args)

    def __attrs_post_init__(self) -> None:
        if self.kind not in INIT_KINDS:
            close = difflib.get_close_matches(str(self.kind), INIT_KINDS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"the kinds are {', '.join(INIT_KINDS)}"
            raise ConfigError(f"unknown init kind {shown(self.kind)}; {hint}")
        names = INIT_KINDS[self.kind]
        if not isinstance(self.args, tuple) or len(self.args) != len(names) or not all(isinstance(a, float) for a in self.args):
            want = f"({', '.join(names)})" if names else "no arguments"
            raise ConfigError(f"init {self.kind!r} takes {want}, got {shown(self.args)}")
        if not all(math.isfinite(a) for a in self.args):
            raise ConfigError(f"init {self.kind!r}: arguments must be finite, got {self.args}")
        if self.kind == "normal" and self.args[1] < 0:
            raise ConfigError(f"init 'normal': std must be >= 0, got {self.args[1]}")
        if self.kind == "uniform" and self.args[0] > self.args[1]:
            raise ConfigError(f"init 'uniform': low must be <= high, got low={self.args[0]}, high={self.args[1]}")

    def to_json(self) -> dict:
        return {"kind": self.kind, "args": list(self.args)}

    @classmethod
    def from_json(cls, obj: Mapping) -> InitSpec:
        if not isinstance(obj, Mapping) or "kind" not in obj or set(obj) - {"kind", "args"}:
            raise ConfigError(f"an init is {{'kind': ..., 'args': [...]}}, got {obj!r}")
        return cls(kind=obj["kind"], args=tuple(obj.get("args", ())))


#: torch's nn.Embedding draws its weight from N(0, 1) (``init.normal_``).
DEFAULT_INIT = InitSpec("normal", (0.0, 1.0))


def check_table_name(name: Any) -> None:
    """ConfigError unless ``name`` can name a table (and so its entries)."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a table's name must be a non-empty string, got {shown(name)}")
    try:
        name.encode()
    except UnicodeEncodeError:
        raise ConfigError(f"a table's name must be valid unicode text, got {name!r}") from None
    bad = [c for c in _NAME_SEPARATORS if c in name]
    if bad:
        raise ConfigError(
            f"table {name!r}: a table's name may not hold {' or '.join(map(repr, bad))} (they separate the parts of "
            "checkpoint entry names); name the module otherwise"
        )


@attrs.frozen(kw_only=True)
class TableSpec:
    """A sparse table: what every process agrees on about it (published as JSON with
    the model, key ``model_tables``). Checked when made: a bad field raises ConfigError
    naming the table, the field and the value.

    ``num_rows`` None: ids are any int64. ``admit_after`` c: the c-th touch of an id
    creates its row (1: the first). ``ttl_steps`` / ``ttl_seconds`` / ``capacity``
    (per pserver) / ``floor``: eviction, 0 for none. ``sweep_every`` 0: every
    ``max(1, ttl_steps // 8)`` table steps. ``pending_capacity`` 0:
    :data:`DEFAULT_PENDING_CAPACITY`.
    """

    name: str
    dim: int = attrs.field(converter=_whole)
    dtype: str = "float32"
    num_rows: int | None = attrs.field(default=None, converter=_whole)
    padding_idx: int | None = attrs.field(default=None, converter=_whole)
    init: InitSpec = attrs.field(default=DEFAULT_INIT, converter=_init_spec)
    seed: int = attrs.field(default=0, converter=_whole)
    admit_after: int = attrs.field(default=1, converter=_whole)
    pending_capacity: int = attrs.field(default=0, converter=_whole)
    ttl_steps: int = attrs.field(default=0, converter=_whole)
    ttl_seconds: float = attrs.field(default=0.0, converter=_seconds)
    capacity: int = attrs.field(default=0, converter=_whole)
    floor: int = attrs.field(default=0, converter=_whole)
    sweep_every: int = attrs.field(default=0, converter=_whole)

    def __attrs_post_init__(self) -> None:
        check_table_name(self.name)
        where = f"table {self.name!r}"

        def whole(field: str, minimum: int, below: int | None = None) -> None:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (below is not None and value >= below):
                bound = f">= {minimum}" if below is None else f"in [{minimum}, {below})"
                raise ConfigError(f"{where}: {field} must be a whole number {bound}, got {shown(value)}")

        whole("dim", 1)
        if self.dtype not in TABLE_DTYPES:
            raise ConfigError(f"{where}: dtype {shown(self.dtype)} is not a floating dtype pdps stores ({', '.join(TABLE_DTYPES)})")
        if self.num_rows is not None:
            whole("num_rows", 1, 1 << 63)
        if self.padding_idx is not None:
            if self.num_rows is not None:
                whole("padding_idx", 0, self.num_rows)  # torch's modules store it normalized to [0, num_embeddings)
            else:
                whole("padding_idx", -(1 << 63), 1 << 63)
        if not isinstance(self.init, InitSpec):
            raise ConfigError(f"{where}: init must be an InitSpec, got {shown(self.init)}")
        whole("seed", 0, 1 << 64)
        whole("admit_after", 1)
        whole("pending_capacity", 0)
        whole("ttl_steps", 0)
        if not isinstance(self.ttl_seconds, float) or not math.isfinite(self.ttl_seconds) or self.ttl_seconds < 0:
            raise ConfigError(f"{where}: ttl_seconds must be a finite number of seconds >= 0, got {shown(self.ttl_seconds)}")
        whole("capacity", 0)
        whole("floor", 0)
        whole("sweep_every", 0)
        if self.capacity and self.floor > self.capacity:
            raise ConfigError(
                f"{where}: floor {self.floor} is above capacity {self.capacity}: the floor is the fewest rows "
                "eviction leaves, and capacity the most a pserver keeps; lower floor or raise capacity"
            )

    @property
    def bounded(self) -> bool:
        """Ids are ``[0, num_rows)`` (a torch Embedding); unbounded: any int64."""
        return self.num_rows is not None

    @property
    def sweep_period(self) -> int:
        """Table steps between two TTL sweeps."""
        return self.sweep_every or max(1, self.ttl_steps // 8)

    @property
    def pending_limit(self) -> int:
        """The most ids waiting for admission per pserver."""
        return self.pending_capacity or DEFAULT_PENDING_CAPACITY

    @property
    def itemsize(self) -> int:
        return TABLE_DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        return self.dim * self.itemsize

    def to_json(self) -> dict:
        out = attrs.asdict(self, recurse=False)
        out["init"] = self.init.to_json()
        return out

    @classmethod
    def from_json(cls, obj: Mapping) -> TableSpec:
        if not isinstance(obj, Mapping):
            raise ConfigError(f"a table is a JSON object, got {shown(obj)}")
        known = {a.name for a in attrs.fields(cls)}
        extra = sorted(set(obj) - known)
        if extra:
            raise ConfigError(f"table {obj.get('name')!r}: unknown field(s) {extra}; a table has {sorted(known)}")
        if "name" not in obj or "dim" not in obj:
            raise ConfigError(f"a table needs at least a name and a dim, got {dict(obj)!r}")
        return cls(**dict(obj))


def check_tables(specs: Iterable[TableSpec], *, replicas: int = 1, asynchronous: bool = False) -> None:
    """ConfigError for tables a job cannot run together: two of one name, or, with
    ``replicas > 1``, a policy by which the copies of a slot would diverge. Every copy
    applies the same sections, so a decision that reads only a row's own counters and
    the table step is the same on each; these are not:

    * ``ttl_seconds``: each copy reads its own clock;
    * ``capacity`` and ``floor``, and the bounded map of ids awaiting admission
      (``admit_after > 1``): they rank every row (or pending id) of the table on one
      pserver, and a backup holds other slots' rows beside a primary's;
    * ``ttl_steps`` in an async job (``asynchronous``): an async table step counts the
      pushes one pserver applied, so a backup's rows of several primaries age by
      different counts."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ConfigError(f"two tables are named {spec.name!r}: table names are unique in a model")
        seen.add(spec.name)
        if replicas < 2:
            continue
        where = f"table {spec.name!r}"
        if spec.ttl_seconds:
            raise ConfigError(
                f"{where}: ttl_seconds={spec.ttl_seconds} cannot run with replicas={replicas}: each copy "
                "of a slot would evict by its own clock and the copies would diverge; use ttl_steps"
            )
        ranked = [f"{name}={getattr(spec, name)}" for name in ("capacity", "floor") if getattr(spec, name)]
        if spec.admit_after > 1:
            ranked.append(f"admit_after={spec.admit_after}")
        if ranked:
            raise ConfigError(
                f"{where}: {' and '.join(ranked)} cannot run with replicas={replicas}: they rank all the rows (or ids awaiting "
                "admission) one pserver holds, and a backup holds other slots' rows beside its primary's, so the copies of a slot "
                "would evict or admit different ids; run with replicas=1, or without them (ttl_steps evicts alike on every copy)"
            )
        if asynchronous and spec.ttl_steps:
            raise ConfigError(
                f"{where}: ttl_steps={spec.ttl_steps} cannot run in an async job with replicas={replicas}: an async table step counts "
                "the pushes one pserver applied, so a backup's copies would age by another count than their primaries'; "
                "run it sync, or with replicas=1"
            )


# --- first-touch init ------------------------------------------------------------------


def init_rows(spec: TableSpec, ids: Any) -> np.ndarray:
    """The first value of rows ``ids`` (1-D): float64 ``[len(ids), spec.dim]``; callers
    cast to the table's dtype. The padding row is zero.

    Element ``j`` of row ``id``: with ``key = splitmix64(splitmix64(seed ^ salt) ^ id)``
    and ``draw(k) = splitmix64(key + k * gamma)`` (the k-th output of splitmix64 seeded
    with ``key``), ``u(k) = (draw(k) >> 11) * 2**-53`` in [0, 1):

    * ``uniform(low, high)``: ``low + (high - low) * u(j)``;
    * ``normal(mean, std)``: ``mean + std * sqrt(-2 log(u(2j) + 2**-53)) * cos(2 pi u(2j+1))``;
    * ``zeros()``: 0.
    """
    arr = as_ids(ids)
    if arr.ndim != 1:
        raise ValueError(f"init_rows takes a 1-D array of ids, got shape {arr.shape}")
    n, dim, kind = arr.shape[0], spec.dim, spec.init.kind
    out = np.zeros((n, dim), dtype=np.float64)
    if kind != "zeros" and n:
        draws = dim * 2 if kind == "normal" else dim
        seed_key = splitmix64(np.uint64(spec.seed) ^ np.uint64(table_salt(spec.name)))
        counters = np.arange(draws, dtype=np.uint64) * _GAMMA
        step = max(1, _INIT_CHUNK // draws)
        u64 = _as_u64(arr)
        for start in range(0, n, step):  # a loop per chunk of rows (scratch in cache), never per row
            keys = splitmix64(seed_key ^ u64[start : start + step])
            bits = splitmix64(keys[:, None] + counters[None, :])
            u = (bits >> np.uint64(11)).astype(np.float64)
            u *= _TWO_TO_MINUS_53
            block = out[start : start + step]
            if kind == "uniform":
                low, high = spec.init.args
                block[:] = low + (high - low) * u
            else:
                mean, std = spec.init.args
                radius = np.sqrt(-2.0 * np.log(u[:, 0::2] + _TWO_TO_MINUS_53))
                block[:] = mean + std * (radius * np.cos((2.0 * np.pi) * u[:, 1::2]))
    if spec.padding_idx is not None:
        out[arr == spec.padding_idx] = 0.0
    return out


# --- row rules ---------------------------------------------------------------------------


@attrs.frozen
class RowRule:
    """An optimizer that steps rows: its arguments with their defaults (JSON-safe),
    the per-row state tensors it keeps (``state``; those in ``scalar_state`` are one
    value per row, ``[n, 1]``, the others ``[n, dim]``), the arguments it refuses
    unless neutral (``refused``: name -> (neutral values, why)), those that must be
    > 0 rather than >= 0 (``positive``, as torch checks them), and the torch.optim
    class that steps it (``torch_class``; None: pdps's own kernel)."""

    name: str
    defaults: Mapping[str, Any]
    state: tuple[str, ...]
    scalar_state: tuple[str, ...] = ()
    refused: Mapping[str, tuple[tuple[Any, ...], str]] = attrs.field(factory=dict)
    positive: frozenset[str] = frozenset()
    torch_class: str | None = None

    def state_width(self, key: str, dim: int) -> int:
        """Columns of state ``key`` for rows of ``dim``."""
        if key not in self.state:
            raise KeyError(f"row rule {self.name!r} keeps no state {key!r} (it keeps {list(self.state)})")
        return 1 if key in self.scalar_state else dim


_DENSE_SGD = "torch turns the step dense with it (the update reads every row of the parameter, and a momentum buffer keeps moving every row ever touched)"
_REFUSED_KERNEL = "a pserver chooses the kernels that step rows itself"
_KERNEL_ARGS = {
    "foreach": ((None, False), _REFUSED_KERNEL),
    "fused": ((None, False), _REFUSED_KERNEL),
    "differentiable": ((False,), "a pserver steps rows outside autograd, so there is no graph to differentiate"),
}

ROW_RULES: dict[str, RowRule] = {
    "SGD": RowRule(
        "SGD",
        {"lr": 1e-3, "maximize": False},
        (),
        refused={
            "momentum": ((0, 0.0), _DENSE_SGD),
            "dampening": ((0, 0.0), _DENSE_SGD),
            "nesterov": ((False,), _DENSE_SGD),
            "weight_decay": ((0, 0.0), "torch turns the step dense with it (grad.add(param, alpha=weight_decay) reads every row)"),
            **_KERNEL_ARGS,
        },
        torch_class="SGD",
    ),
    "Adagrad": RowRule(
        "Adagrad",
        {"lr": 1e-2, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False},
        ("sum",),
        refused={
            "weight_decay": ((0, 0.0), "torch refuses it with sparse gradients ('weight_decay option is not compatible with sparse gradients')"),
            **_KERNEL_ARGS,
        },
        torch_class="Adagrad",
    ),
    "RowWiseAdagrad": RowRule(
        "RowWiseAdagrad",
        {"lr": 1e-2, "eps": 1e-8, "initial_accumulator_value": 0.0},
        ("acc",),
        scalar_state=("acc",),
        refused={"weight_decay": ((0, 0.0), "decaying every row each step is a dense update"), **_KERNEL_ARGS},
    ),
    "SparseAdam": RowRule(
        "SparseAdam",
        {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "maximize": False, "row_steps": False},
        ("exp_avg", "exp_avg_sq"),
        refused={
            "weight_decay": ((0, 0.0), "torch.optim.SparseAdam has none: decaying every row each step is a dense update"),
            "amsgrad": ((False,), "torch.optim.SparseAdam has no amsgrad variant"),
            **_KERNEL_ARGS,
        },
        positive=frozenset({"lr", "eps"}),  # torch.optim.SparseAdam: "Invalid learning rate" / "Invalid epsilon value" at 0
        torch_class="SparseAdam",
    ),
}

# The row rule a dense optimizer's tables get when no sparse_optimizer is named.
_ROW_RULE_OF = {"SGD": "SGD", "Adagrad": "Adagrad", "Adam": "SparseAdam"}


def row_rule_for(dense_optimizer: str) -> str | None:
    """The row rule of a dense optimizer's tables (SGD -> SGD, Adagrad -> Adagrad, Adam ->
    SparseAdam); None where a job with tables must name ``sparse_optimizer`` itself."""
    return _ROW_RULE_OF.get(dense_optimizer)


def _number(rule: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"row rule {rule!r}: {key} must be a finite number, got {shown(value)}")
    return float(value)


def _check_arg(rule: RowRule, key: str, value: Any) -> Any:
    name = rule.name
    if key in ("maximize", "row_steps"):
        if not isinstance(value, bool):
            raise ConfigError(f"row rule {name!r}: {key} must be true or false, got {shown(value)}")
        return value
    if key == "betas":
        if not isinstance(value, (list, tuple)) or len(value) != 2:
            raise ConfigError(f"row rule {name!r}: betas must be a pair [beta1, beta2], got {shown(value)}")
        betas = [_number(name, key, b) for b in value]
        for i, b in enumerate(betas):
            if not 0.0 <= b < 1.0:
                raise ConfigError(f"row rule {name!r}: betas[{i}] must be in [0, 1), got {b}")
        return betas
    number = _number(name, key, value)
    if key in rule.positive and not number > 0:
        raise ConfigError(f"row rule {name!r}: {key} must be > 0, got {value!r}")
    if number < 0:
        raise ConfigError(f"row rule {name!r}: {key} must be >= 0, got {value!r}")
    return number


def check_row_rule(name: str, args: Mapping[str, Any] | None) -> dict[str, Any]:
    """The arguments of row rule ``name`` with its defaults filled in (JSON-safe: betas
    a list, numbers floats); neutral values of refused arguments (``momentum=0``) are
    dropped. ConfigError for an unknown rule (with the nearest name), an argument the
    rule does not take (with the nearest one), a refused argument (with why) or a
    value out of range."""
    rule = ROW_RULES.get(name) if isinstance(name, str) else None
    if rule is None:
        if isinstance(name, str) and row_rule_for(name) not in (None, name):
            hint = f"the row rule of {name!r} is {row_rule_for(name)!r}"
        else:
            close = difflib.get_close_matches(str(name), ROW_RULES, n=1) or [r for r in ROW_RULES if r.lower() == str(name).lower()]
            hint = f"did you mean {close[0]!r}?" if close else "a table's rows are stepped by one of them"
        raise ConfigError(f"unknown row rule {shown(name)} ({hint}); the row rules are {', '.join(ROW_RULES)}")
    if args is None:
        args = {}
    if not isinstance(args, Mapping):
        raise ConfigError(f"row rule {name!r}: its arguments must be a mapping, got {shown(args)}")
    out = dict(rule.defaults)
    for key, value in args.items():
        if not isinstance(key, str):
            raise ConfigError(f"row rule {name!r}: argument names must be strings, got {key!r}")
        if key in rule.refused:
            neutral, why = rule.refused[key]
            if any(value is n or (type(value) is type(n) and value == n) for n in neutral):
                continue
            raise ConfigError(
                f"row rule {name!r}: argument {key}={value!r} is refused: {why}; leave it out of sparse_optimizer_args "
                "(they default to optimizer_args: give sparse_optimizer_args to set the rows' own)"
            )
        if key not in rule.defaults:
            close = difflib.get_close_matches(key, rule.defaults, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"it takes {', '.join(rule.defaults)}"
            raise ConfigError(f"row rule {name!r} takes no argument {key!r} ({hint}); arguments given: {dict(args)}")
        out[key] = _check_arg(rule, key, value)
    return out


# --- entry names -----------------------------------------------------------------------

#: The entries of a table's slot besides ``state.<k>``.
ROW_ENTRY_KINDS = ("ids", "values", "count", "last_age", "pending_ids", "pending_counts", "pending_age")


def _row_kind_ok(kind: str) -> bool:
    if kind in ROW_ENTRY_KINDS:
        return True
    state = kind.removeprefix("state.")
    return kind.startswith("state.") and bool(state) and not any(c in state for c in _NAME_SEPARATORS)


def _scalar_kind_ok(kind: str) -> bool:
    return bool(kind) and not any(c in kind for c in _NAME_SEPARATORS)


def row_entry(table: str, slot: int, kind: str) -> str:
    """``<table>#<slot>/<kind>``: the name of one slot's rows of a table in a checkpoint
    part or a migration (kind: ids, values, state.<k>, count, last_age, pending_ids,
    pending_counts)."""
    check_table_name(table)
    if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or slot < 0:
        raise ValueError(f"a slot is a whole number >= 0, got {shown(slot)}")
    if not isinstance(kind, str) or not _row_kind_ok(kind):
        raise ValueError(f"{kind!r} is no kind of row entry: {', '.join(ROW_ENTRY_KINDS)} or state.<name>")
    return f"{table}#{int(slot)}/{kind}"


def table_entry(table: str, kind: str) -> str:
    """``<table>/scalar.<kind>``: a value of the whole table (``step``)."""
    check_table_name(table)
    if not isinstance(kind, str) or not _scalar_kind_ok(kind):
        raise ValueError(f"{kind!r} is no name of a table scalar")
    return f"{table}/scalar.{kind}"


def _table_name_ok(table: str) -> bool:
    return bool(table) and not any(c in table for c in _NAME_SEPARATORS)


def parse_row_entry(name: str) -> tuple[str, int, str] | None:
    """``(table, slot, kind)`` of a :func:`row_entry` name; None for any other name
    (a block's ``<param>@<first>:<end>/...`` included)."""
    table, hash_, rest = name.partition("#")
    slot, slash, kind = rest.partition("/")
    if not (hash_ and slash and _table_name_ok(table) and slot.isascii() and slot.isdigit() and _row_kind_ok(kind)):
        return None
    return table, int(slot), kind


def parse_table_entry(name: str) -> tuple[str, str] | None:
    """``(table, kind)`` of a :func:`table_entry` name; None for any other name (a
    block's ``<param>@<first>:<end>/scalar.<k>`` included)."""
    table, slash, rest = name.partition("/")
    kind = rest.removeprefix("scalar.")
    if not (slash and rest.startswith("scalar.") and _table_name_ok(table) and _scalar_kind_ok(kind)):
        return None
    return table, kind
