"""The torch adapter of the row port: one embedding table's rows on a pserver.

:class:`TorchRows` holds the rows of one table (:class:`~pdps.core.tables.TableSpec`)
whose ids fall in the slots this pserver holds, with the row rule's state per row
(design/sparse-embeddings.md §2, §4, §6). Its rules:

* **Storage.** Each per-row quantity (the row, each state tensor of the rule, and the
  update count and last-update step when the table evicts) is a :class:`_Column`; a row
  is a *position* in them, found by id through :class:`~pdps.core.rowindex.IdIndex`.
  Evicted positions go to a free list and are reused first. On the CPU a column is
  *flat*: one anonymous memory mapping, doubled in place as rows come (``mremap``: no
  copy; untouched pages cost nothing), so a gather is one ``index_select`` in the
  caller's order and a scatter one numpy row assignment. Elsewhere (CUDA) it is chunks
  of ``chunk_rows`` (65,536) rows, growth adding a chunk; a gather or scatter groups its
  positions by chunk (one ``index_select`` / ``index_copy_`` per chunk touched) and an
  update steps the rows in that chunk order (the rules are row-local), so only the
  gradient is permuted, once. Flat was 2x chunked for a pull and a push of 32k random
  rows of 5M (4.7 + 6.9 ms against 10 + 10, one thread): no sort, no permutation, one
  call instead of one per chunk.
* **Reads never create.** :meth:`TorchRows.lookup` answers an id with no row with the
  table's init value (:func:`~pdps.core.tables.init_rows`, computed, not stored).
  Rows are created when a gradient is applied (sync: at round close; async: at the
  push), past admission (:mod:`pdps.core.rowpolicy`), so every replica creates the
  same rows in the same order.
* **Rules.** ``SGD``, ``Adagrad`` and ``SparseAdam`` run through the public
  ``torch.optim`` class on a scratch Parameter holding the gathered rows, with a
  coalesced sparse gradient over them and the table's step in its state: each of
  them is row-local once the gradient is coalesced, so stepping the gathered rows is
  what torch does to the whole table. ``RowWiseAdagrad`` (FBGEMM's) and SparseAdam
  with ``row_steps`` (a step count per row) are own kernels.
* **The table step** moves once per applied section set: a sync round in which any
  trainer staged a section of the table (possibly empty), or an async push with one.
  It is torch's per-parameter step (Adagrad's ``lr_decay``, SparseAdam's bias
  correction) and the clock of ``ttl_steps``.
* **Checks first.** :meth:`TorchRows.check` refuses a bad section before anything is
  staged or applied; ``stage``, ``apply`` and ``apply_staged`` trust their input.
  A refusal changes nothing but the ``refused`` counter.

Not thread-safe: the pserver calls a store under its lock.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from pdps.adapters.torch_compute import _device, dtype_name, torch_dtype
from pdps.core import rowpolicy
from pdps.core.errors import BadRequest, ConfigError, GradientRejected
from pdps.core.rowindex import IdIndex
from pdps.core.tables import (
    ROW_RULES,
    TableSpec,
    check_row_rule,
    init_rows,
    parse_row_entry,
    parse_table_entry,
    row_entry,
    row_slots,
    table_entry,
)

#: Rows per chunk of storage off the CPU: the most a table wastes is one chunk less one row.
CHUNK_ROWS = 1 << 16
#: Rows a flat (CPU) column maps at first; it doubles from there (virtual memory: a page
#: costs memory once a row in it is written).
FLAT_MIN_ROWS = 1 << 12
_PAGE = mmap.PAGESIZE
#: The job setting ``sparse_max_ids``'s default: ids in one section of a push or pull.
DEFAULT_MAX_IDS = 1 << 20
#: Callers (trainers) whose last lookup a store keeps for their next apply, at most.
LOOKUPS_KEPT = 32


# --- storage ---------------------------------------------------------------------------------


#: dtypes numpy holds as they are (bfloat16 it does not)
_NUMPY_OF = {torch.float16: np.float16, torch.float32: np.float32, torch.float64: np.float64, torch.int32: np.int32, torch.int64: np.int64}
_NUMPY_DTYPES = frozenset(_NUMPY_OF)


def _pages(nbytes: int) -> int:
    """``nbytes`` rounded up to whole pages (at least one)."""
    return max(1, -(-nbytes // _PAGE)) * _PAGE


def _anonymous(size: int) -> mmap.mmap:
    """A private anonymous mapping of ``size`` bytes (zeros, touched lazily)."""
    return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized tensor; on the CPU, of memory from numpy where numpy holds the dtype.

    A gather's output is megabytes a call, freed once the reply is sent. torch takes
    such blocks with ``posix_memalign``, and glibc does not hand a freed block back for the
    next aligned request of the same size: every call touched fresh pages (2,048 page
    faults for 32k rows of 64 float32, 2-3 ms on the 2-core VM, more than the gather's
    copying). numpy's plain ``malloc`` reuses the freed block (0 faults a call)."""
    if device.type == "cpu" and dtype in _NUMPY_DTYPES:
        return torch.from_numpy(np.empty(shape, dtype=_NUMPY_OF[dtype]))
    return torch.empty(shape, dtype=dtype, device=device)


def _permuted(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t``'s rows in ``index``'s order, as a new tensor (``index_select`` into :func:`_empty`:
    with ``out``, torch gathers rows without the per-row cost of ``index_copy_``)."""
    out = _empty((len(index), *t.shape[1:]), t.dtype, t.device)
    return torch.index_select(t, 0, index, out=out)


class _Plan:
    """Positions grouped by chunk. Gathered tensors are in *plan order*: the rows of
    each chunk touched, one contiguous run per chunk, so a gather is one
    ``index_select`` per chunk straight into its run, and a scatter one ``index_copy_``
    from it. The rules are row-local, so they step rows in plan order as well;
    :meth:`arrange` and :meth:`restore` permute a tensor between the caller's order and
    plan order (nothing to do when the positions already run chunk by chunk): both are
    gathers, ``restore`` by the inverse permutation."""

    def __init__(self, order: torch.Tensor | None, runs: list[tuple[int, int, int, torch.Tensor]], n: int) -> None:
        self.order, self.runs, self.n = order, runs, n
        self._inverse: torch.Tensor | None = None

    def arrange(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (caller's order) in plan order."""
        return t if self.order is None else _permuted(t, self.order)

    def restore(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (plan order) in the caller's order."""
        if self.order is None:
            return t
        if self._inverse is None:
            inverse = torch.empty_like(self.order)
            inverse[self.order] = torch.arange(self.n, device=self.order.device)
            self._inverse = inverse
        return _permuted(t, self._inverse)


class _Column:
    """One per-row quantity: rows of ``[width]`` (a scalar where ``width`` is None).
    ``fill`` is what a new row starts from (None: written by the creator). Gathers and
    scatters are in plan order (:class:`_Plan`). Two layouts, chosen by ``chunk_rows``:

    * **flat** (None; the CPU): one tensor over an anonymous memory mapping, grown in
      place (``mremap``: no copy, the pages not touched yet cost nothing), so a gather
      is one ``index_select`` in the caller's order and a plan never sorts;
    * **chunked**: ``[chunk_rows, width]`` tensors, growth adds one (devices, where
      there is no mapping to grow)."""

    def __init__(self, width: int | None, dtype: torch.dtype, device: torch.device, fill: float | None = None, *, chunk_rows: int | None = None) -> None:
        self.width, self.dtype, self.device, self.fill = width, dtype, device, fill
        self.chunk_rows = chunk_rows
        self.chunks: list[torch.Tensor] = []  # flat: the one view of the mapping
        self.capacity = 0  # rows the chunks or the mapping hold
        self._used = 0  # rows handed out (flat: the pages touched, at most)
        self._row_bytes = (width or 1) * torch.empty((), dtype=dtype).element_size()
        self._map: mmap.mmap | None = None

    @property
    def nbytes(self) -> int:
        if self.chunk_rows is not None:
            return sum(c.nbytes for c in self.chunks)
        return min(_pages(self._used * self._row_bytes), self.capacity * self._row_bytes)

    def reserve(self, rows: int) -> None:
        """Room for positions ``[0, rows)``."""
        self._used = max(self._used, rows)
        if self.chunk_rows is not None:
            while self.capacity < rows:
                shape = (self.chunk_rows,) if self.width is None else (self.chunk_rows, self.width)
                self.chunks.append(torch.empty(shape, dtype=self.dtype, device=self.device))
                self.capacity += self.chunk_rows
        elif rows > self.capacity:
            self._grow(max(rows, 2 * self.capacity, FLAT_MIN_ROWS))

    def _grow(self, rows: int) -> None:
        size = _pages(rows * self._row_bytes)
        self.chunks = []  # drop the view: the mapping cannot move while one is alive
        if self._map is None:
            self._map = _anonymous(size)
        else:
            try:
                self._map.resize(size)
            except BufferError:  # a view of the old rows is still held elsewhere: copy, leave it the old mapping
                old, self._map = self._map, _anonymous(size)
                n = self.capacity * self._row_bytes
                np.frombuffer(self._map, dtype=np.uint8, count=n)[:] = np.frombuffer(old, dtype=np.uint8, count=n)
        self.capacity = size // self._row_bytes
        flat = torch.from_numpy(np.frombuffer(self._map, dtype=np.uint8, count=self.capacity * self._row_bytes)).view(self.dtype)
        self.chunks = [flat if self.width is None else flat.view(self.capacity, self.width)]

    def gather(self, plan: _Plan) -> torch.Tensor:
        shape = (plan.n,) if self.width is None else (plan.n, self.width)
        out = _empty(shape, self.dtype, self.device)
        for c, a, b, local in plan.runs:
            torch.index_select(self.chunks[c], 0, local, out=out[a:b])
        return out

    def scatter(self, plan: _Plan, values: torch.Tensor) -> None:
        # On the CPU, numpy's row assignment copies a row at a time: 1.75x torch's index_copy_
        # (measured at 32k rows of 64 float32 into 77 chunks). Same dtype only: it would cast.
        rows = self.device.type == "cpu" and values.device.type == "cpu" and values.dtype == self.dtype and self.dtype in _NUMPY_DTYPES
        for c, a, b, local in plan.runs:
            if rows:
                self.chunks[c].numpy()[local.numpy()] = values[a:b].detach().numpy()
            else:
                self.chunks[c].index_copy_(0, local, values[a:b])

    def add(self, plan: _Plan, values: torch.Tensor, alpha: float) -> None:
        """``rows += alpha * values`` (plan order) in place: one ``index_add_`` per run,
        nothing gathered or scattered."""
        for c, a, b, local in plan.runs:
            self.chunks[c].index_add_(0, local, values[a:b], alpha=alpha)

    def put(self, plan: _Plan, value: float) -> None:
        for c, _, _, local in plan.runs:
            self.chunks[c].index_fill_(0, local, value)


class _Looked:
    """A caller's last lookup, kept for its next apply (design §10's lookup token): the
    ids, their positions (-1: no row then) and, when every id had a row, the plan of
    the positions; with the store's ``moves`` and ``generation`` when it was made."""

    __slots__ = ("ids", "pos", "plan", "moves", "generation")

    def __init__(self, ids: np.ndarray, pos: np.ndarray, plan: _Plan | None, moves: int, generation: int) -> None:
        self.ids, self.pos, self.plan, self.moves, self.generation = ids, pos, plan, moves, generation


class _Pending:
    """Ids touched fewer than ``admit_after`` times, with their counts and the table
    step of their last touch, bounded by ``capacity`` (the oldest go first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.index = IdIndex()
        self.ids = np.empty(0, dtype=np.int64)
        self.counts = np.empty(0, dtype=np.int64)
        self.seen = np.empty(0, dtype=np.int64)
        self._free = np.empty(0, dtype=np.int64)
        self._next = 0

    def __len__(self) -> int:
        return len(self.index)

    @property
    def nbytes(self) -> int:
        return self.index.nbytes + self.ids.nbytes + self.counts.nbytes + self.seen.nbytes + self._free.nbytes

    def counts_of(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = self.index.lookup(ids)
        return at, np.where(at >= 0, self.counts[np.maximum(at, 0)] if len(self.counts) else 0, 0)

    def touch(self, ids: np.ndarray, admit_after: int, step: int) -> np.ndarray:
        """One touch of ``ids`` (no row yet): the mask of those admitted now (their
        pending entry goes); the others are counted, new ones entered."""
        at, before = self.counts_of(ids)
        admitted, counts = rowpolicy.admit(before, admit_after)
        self.remove(ids[admitted & (at >= 0)])
        old = ~admitted & (at >= 0)
        self.counts[at[old]] = counts[old]
        self.seen[at[old]] = step
        new = ~admitted & (at < 0)
        self.put(ids[new], counts[new], np.full(int(new.sum()), step, dtype=np.int64))
        return admitted

    def put(self, ids: np.ndarray, counts: np.ndarray, seen: np.ndarray) -> None:
        """Enter ``ids`` (none pending yet) with these counts and last touches."""
        if not len(ids):
            return
        k = len(ids)
        take = min(k, len(self._free))
        fresh = k - take
        at = np.concatenate([self._free[len(self._free) - take :], np.arange(self._next, self._next + fresh, dtype=np.int64)])
        self._free = self._free[: len(self._free) - take]
        self._next += fresh
        if self._next > len(self.ids):
            size = max(self._next, 2 * len(self.ids), 1024)
            self.ids, self.counts, self.seen = (np.resize(a, size) for a in (self.ids, self.counts, self.seen))
        self.ids[at], self.counts[at], self.seen[at] = ids, counts, seen
        self.index.insert(ids, at)

    def remove(self, ids: np.ndarray) -> None:
        if not len(ids):
            return
        at = self.index.lookup(ids)
        at = at[at >= 0]
        self.index.delete(self.ids[at])
        self._free = np.concatenate([self._free, at])

    def enforce(self) -> int:
        """Drop the oldest entries past the capacity; how many went."""
        if len(self) <= self.capacity:
            return 0
        ids, at = self.index.items()
        drop = rowpolicy.pending_drops(self.seen[at], ids, self.capacity)
        self.remove(ids[drop])
        return len(drop)

    def items(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every entry: ids, counts, last-touch steps."""
        ids, at = self.index.items()
        return ids, self.counts[at], self.seen[at]


# --- rules ------------------------------------------------------------------------------------


class _TorchRule:
    """A torch.optim class stepping the gathered rows: the rows are the data of a
    scratch Parameter, the section's gradient its coalesced sparse grad, and the
    rule's state the gathered state with the table's step."""

    def __init__(self, name: str, args: Mapping[str, Any], dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.name = name
        self._scratch = torch.nn.Parameter(torch.zeros((1, dim), dtype=dtype, device=device))
        self._empty = self._scratch.data
        try:
            self._opt = getattr(torch.optim, ROW_RULES[name].torch_class)([self._scratch], **args)
        except (TypeError, ValueError, RuntimeError) as exc:
            raise ConfigError(f"row rule {name!r} refused its arguments {dict(args)}: {exc}") from exc
        self._opt.state.clear()  # Adagrad fills state at construction: the rows bring theirs
        # torch keeps Adagrad's step as a tensor of its scalar dtype
        self._step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32

    def step(self, rows: torch.Tensor, state: dict[str, torch.Tensor], grads: torch.Tensor, step: int) -> None:
        p = self._scratch
        n = rows.shape[0]
        index = torch.arange(n, device=rows.device).unsqueeze(0)
        p.data = rows
        p.grad = torch.sparse_coo_tensor(index, grads, tuple(rows.shape), is_coalesced=True, check_invariants=False)
        before: Any = torch.tensor(float(step - 1), dtype=self._step_dtype) if self.name == "Adagrad" else step - 1
        self._opt.state[p] = {**state, "step": before} if self.name != "SGD" else {}
        try:
            with torch.sparse.check_sparse_tensor_invariants(enable=False):  # arange indices: coalesced by construction
                self._opt.step()
        finally:
            p.grad = None
            live = self._opt.state.pop(p, {})
            stepped = p.data
            p.data = self._empty
        if stepped.data_ptr() != rows.data_ptr():  # torch stepped out of place: take its result
            rows.copy_(stepped)
        for k, t in state.items():
            if live.get(k) is not None and live[k] is not t:
                t.copy_(live[k])


class _RowWiseAdagrad:
    """FBGEMM's row-wise Adagrad: one accumulator per row, ``acc += mean(g^2)``,
    ``row -= lr * g / (sqrt(acc) + eps)``."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        self.lr, self.eps = float(args["lr"]), float(args["eps"])

    def step(self, rows: torch.Tensor, state: dict[str, torch.Tensor], grads: torch.Tensor, step: int) -> None:
        acc = state["acc"]
        g = grads.to(acc.dtype)
        acc.add_(g.square().mean(dim=1, keepdim=True))
        rows.sub_((self.lr * g / (acc.sqrt() + self.eps)).to(rows.dtype))


class _LazyAdam:
    """SparseAdam with a step count per row (``row_steps``): torch's update, with each
    row's bias correction by its own number of updates (lazy Adam), not the table's."""

    def __init__(self, args: Mapping[str, Any]) -> None:
        self.lr, self.eps = float(args["lr"]), float(args["eps"])
        self.beta1, self.beta2 = (float(b) for b in args["betas"])
        self.maximize = bool(args.get("maximize", False))

    def step(self, rows: torch.Tensor, state: dict[str, torch.Tensor], grads: torch.Tensor, step: int) -> None:
        g = -grads if self.maximize else grads
        m, v, steps = state["exp_avg"], state["exp_avg_sq"], state["step"]
        steps.add_(1)
        m.add_((g - m).mul_(1 - self.beta1))
        v.add_((g * g - v).mul_(1 - self.beta2))
        t = steps.to(torch.float64)
        size = (self.lr * torch.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)).to(rows.dtype).unsqueeze(1)
        rows.add_(-size * (m / (v.sqrt() + self.eps)))


def _rule(name: str, args: dict[str, Any], dim: int, dtype: torch.dtype, device: torch.device) -> tuple[Any, dict[str, tuple[int | None, torch.dtype, float]]]:
    """The kernel of row rule ``name`` and its per-row state: name -> (width, dtype, start value)."""
    if name == "RowWiseAdagrad":
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype  # one scalar per row: keep it exact
        return _RowWiseAdagrad(args), {"acc": (1, acc, float(args["initial_accumulator_value"]))}
    if name == "SparseAdam" and args.get("row_steps"):
        state = {"exp_avg": (dim, dtype, 0.0), "exp_avg_sq": (dim, dtype, 0.0), "step": (None, torch.int64, 0.0)}
        return _LazyAdam(args), state
    torch_args = {k: v for k, v in args.items() if k != "row_steps"}
    if "betas" in torch_args:
        torch_args["betas"] = tuple(torch_args["betas"])
    fill = float(args.get("initial_accumulator_value", 0.0))
    return _TorchRule(name, torch_args, dim, dtype, device), {k: (ROW_RULES[name].state_width(k, dim), dtype, fill) for k in ROW_RULES[name].state}


# --- the store ------------------------------------------------------------------------------


def _numpy(t: Any) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        return t.detach().cpu().numpy()
    return np.asarray(t)


class TorchRows:
    """The rows of table ``spec`` in ``slots`` (of ``num_slots``) on one pserver, stepped
    by row rule ``rule`` with ``args`` (checked by :func:`~pdps.core.tables.check_row_rule`
    and by one step on a scratch row here). ``clock`` (seconds) times ``ttl_seconds``;
    ``max_ids`` is the job's ``sparse_max_ids``."""

    def __init__(
        self,
        spec: TableSpec,
        rule: str,
        args: Mapping[str, Any],
        slots: Collection[int],
        num_slots: int,
        clock: Callable[[], float] = time.monotonic,
        *,
        device: str | torch.device = "cpu",
        max_ids: int = DEFAULT_MAX_IDS,
        chunk_rows: int | None = None,
    ) -> None:
        if chunk_rows is not None and (chunk_rows < 1 or chunk_rows & (chunk_rows - 1)):
            raise ConfigError(f"chunk_rows must be a power of two, got {chunk_rows}")
        if max_ids < 1:
            raise ConfigError(f"sparse_max_ids must be >= 1, got {max_ids}")
        if num_slots < 1:
            raise ConfigError(f"num_slots must be >= 1, got {num_slots}")
        self.spec = spec
        self.rule = rule
        self.args = check_row_rule(rule, args)
        self.num_slots = num_slots
        self.max_ids = max_ids
        self.device = torch.device(_device(device))
        self.dtype = torch_dtype(spec.dtype)
        self._sum_dtype = torch.float32 if self.dtype in (torch.float16, torch.bfloat16) else self.dtype
        self._clock = clock
        if chunk_rows is None and self.device.type != "cpu":
            chunk_rows = CHUNK_ROWS
        self._chunk_rows = chunk_rows  # None: flat columns (the CPU)
        self._shift, self._mask = (0, 0) if chunk_rows is None else (chunk_rows.bit_length() - 1, chunk_rows - 1)
        self._kernel, state = _rule(rule, self.args, spec.dim, self.dtype, self.device)
        # SGD is stateless: a store adds ``-lr * grad`` into the rows where they lie
        # (:meth:`_Column.add`) instead of gathering, stepping and scattering them (a third
        # of a push's time), where that is bit for bit torch's sparse step: float32 and
        # float64 on the CPU (float16 and bfloat16 round otherwise; devices: not measured)
        self._add_alpha: float | None = None
        if rule == "SGD" and self.device.type == "cpu" and self.dtype in (torch.float32, torch.float64):
            lr = float(self.args["lr"])
            self._add_alpha = lr if self.args.get("maximize", False) else -lr
        self._values = _Column(spec.dim, self.dtype, self.device, chunk_rows=chunk_rows)
        self._state = {k: _Column(w, dt, self.device, fill, chunk_rows=chunk_rows) for k, (w, dt, fill) in state.items()}
        # per-row bookkeeping only where a policy reads it
        self._evicts = bool(spec.capacity or spec.ttl_steps or spec.ttl_seconds)
        self._count = _Column(None, torch.int32, self.device, 0, chunk_rows=chunk_rows) if self._evicts else None
        self._last = _Column(None, torch.int64, self.device, chunk_rows=chunk_rows) if self._evicts else None
        self._when = _Column(None, torch.float64, self.device, chunk_rows=chunk_rows) if spec.ttl_seconds else None
        self._index = IdIndex()
        self._free = np.empty(0, dtype=np.int64)
        self._next = 0  # positions below this were handed out once
        self._pending = _Pending(spec.pending_limit) if spec.admit_after > 1 else None
        self._held = np.zeros(num_slots, dtype=bool)
        self._hold(slots)
        self.step = 0
        self._last_sweep = clock() if spec.ttl_seconds else 0.0
        #: sync: the open round's sections, key -> source -> (ids, grads, map version)
        self._staged: dict[str, dict[int, tuple[np.ndarray, torch.Tensor, int]]] = {}
        self._buffers: dict[tuple[str, int], tuple[np.ndarray, torch.Tensor]] = {}
        self._generation = 0  # moves whenever the set of rows changes (export pages are planned against it)
        self._moves = 0  # moves whenever a row leaves its position (removed: the position may go to another id)
        self._looked: dict[str, _Looked] = {}  # caller -> its last lookup, for its next apply (LOOKUPS_KEPT at most)
        self.reused = 0  # applies that took their caller's lookup instead of probing the index
        self._order: tuple[Any, ...] | None = None
        self._counters = dict.fromkeys(("created", "admitted", "pending_dropped", "evicted_ttl", "evicted_lfu", "refused"), 0)
        self._try_rule()

    @property
    def slots(self) -> frozenset[int]:
        return frozenset(np.flatnonzero(self._held).tolist())

    def hold(self, slots: Collection[int]) -> None:
        """Hold ``slots`` from now on (a resize gave them here; their rows, if any, come
        through :meth:`import_slots`): their ids pass :meth:`check`."""
        self._hold(slots)

    def _hold(self, slots: Collection[int]) -> None:
        at = np.asarray(sorted(slots), dtype=np.int64)
        if len(at) and (at[0] < 0 or at[-1] >= self.num_slots):
            raise ConfigError(f"table {self.spec.name!r}: slots {sorted(slots)} are not all in [0, {self.num_slots})")
        self._held[at] = True

    def _try_rule(self) -> None:
        """One step of the rule on a scratch row: arguments torch only checks when
        stepping are refused here, with nothing stored."""
        dim = self.spec.dim
        rows = torch.zeros((1, dim), dtype=self.dtype, device=self.device)
        state = {k: torch.full((1,) if c.width is None else (1, c.width), c.fill or 0, dtype=c.dtype, device=self.device) for k, c in self._state.items()}
        try:
            self._kernel.step(rows, state, torch.zeros((1, dim), dtype=self.dtype, device=self.device), 1)
        except (TypeError, ValueError, RuntimeError, KeyError) as exc:
            raise ConfigError(f"row rule {self.rule!r} failed a step with arguments {self.args}: {exc}") from exc

    # --- positions --------------------------------------------------------------------------

    def _columns(self) -> list[_Column]:
        return [c for c in (self._values, *self._state.values(), self._count, self._last, self._when) if c is not None]

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))
        return t if self.device.type == "cpu" else t.to(self.device)

    def _plan(self, pos: np.ndarray) -> _Plan:
        """``pos`` grouped by chunk (one argsort, unless they already run chunk by chunk;
        flat columns: one run in the caller's order)."""
        n = len(pos)
        if not n:
            return _Plan(None, [], 0)
        if self._chunk_rows is None:
            return _Plan(None, [(0, 0, n, self._tensor(pos))], n)
        chunk = pos >> self._shift
        order = None
        if n > 1 and np.any(chunk[1:] < chunk[:-1]):
            # a stable sort by chunk; numpy radix-sorts 16-bit keys (20x a 64-bit sort at 32k positions)
            order = np.argsort(chunk.astype(np.uint16) if int(chunk.max()) < 1 << 16 else chunk, kind="stable")
            chunk, pos = chunk[order], pos[order]
        cuts = [0, *(np.flatnonzero(chunk[1:] != chunk[:-1]) + 1).tolist(), n]
        local = self._tensor(pos & self._mask)
        runs = [(int(chunk[a]), a, b, local[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]
        return _Plan(None if order is None else self._tensor(order), runs, n)

    def _alloc(self, k: int) -> np.ndarray:
        take = min(k, len(self._free))
        fresh = k - take
        pos = np.concatenate([self._free[len(self._free) - take :], np.arange(self._next, self._next + fresh, dtype=np.int64)])
        self._free = self._free[: len(self._free) - take]
        self._next += fresh
        for col in self._columns():
            col.reserve(self._next)
        return pos

    def _create(self, ids: np.ndarray, now: float) -> np.ndarray:
        """New rows for ``ids`` (none has one): init values, the rule's start state."""
        pos = self._alloc(len(ids))
        plan = self._plan(pos)
        self._values.scatter(plan, plan.arrange(torch.from_numpy(init_rows(self.spec, ids)).to(self.dtype).to(self.device)))
        for col in self._state.values():
            col.put(plan, col.fill or 0)
        self._mark(plan, now, fresh=True)
        self._index.insert(ids, pos)
        self._generation += 1
        return pos

    def _mark(self, plan: _Plan, now: float, *, fresh: bool = False) -> None:
        """Bookkeeping of an update at this table step (``fresh``: of new rows)."""
        if self._count is not None:
            if fresh:
                self._count.put(plan, 0)
            else:
                self._count.scatter(plan, self._count.gather(plan) + 1)
            self._last.put(plan, self.step)
        if self._when is not None:
            self._when.put(plan, now)

    def _remove(self, ids: np.ndarray, pos: np.ndarray) -> None:
        if len(ids):
            self._index.delete(ids)
            self._free = np.concatenate([self._free, pos])
            self._generation += 1
            self._moves += 1

    def _keep_lookup(self, key: str, ids: np.ndarray, pos: np.ndarray, plan: _Plan | None) -> None:
        self._looked.pop(key, None)
        self._looked[key] = _Looked(ids.copy(), pos, plan, self._moves, self._generation)
        while len(self._looked) > LOOKUPS_KEPT:
            del self._looked[next(iter(self._looked))]  # the oldest

    def _positions(self, ids: np.ndarray, key: str | None) -> tuple[np.ndarray, _Plan | None]:
        """The position of each id (-1: no row) and, when known, their plan: from
        ``key``'s last lookup if it was of the same ids and no row has left its position
        since (rows created since are looked up), else from the index."""
        looked = None if key is None else self._looked.pop(key, None)
        if looked is None or looked.moves != self._moves or not np.array_equal(looked.ids, ids):
            return self._index.lookup(ids), None
        self.reused += 1
        if looked.plan is not None:
            return looked.pos, looked.plan
        pos = looked.pos
        if looked.generation != self._generation:  # rows were created since: some of the missing ones may be among them
            missing = np.flatnonzero(pos < 0)
            pos[missing] = self._index.lookup(ids[missing])
        return pos, None

    # --- checks ------------------------------------------------------------------------------

    def check(self, ids: Any, grads: Any | None, trainer: str, *, finite: bool = True, slots: Collection[int] | None = None) -> None:
        """Refuse a bad section (design §3, in order): GradientRejected for a push
        (``grads`` given), BadRequest for a pull, each naming the table, the trainer and
        the field. Changes nothing but the ``refused`` counter."""
        try:
            self._check(ids, grads, trainer, finite, slots)
        except BadRequest:
            self._counters["refused"] += 1
            raise

    def _check(self, ids: Any, grads: Any | None, trainer: str, finite: bool, slots: Collection[int] | None) -> None:
        push = grads is not None
        error = GradientRejected if push else BadRequest
        t, dim = self.spec.name, self.spec.dim
        doing, outcome = ("pushed", "nothing was applied") if push else ("pulled", "nothing was read")
        field = f"tables.{t}.ids"

        def refuse(what: str, field: str = field) -> None:
            raise error(f"table {t!r}, {field} {doing} by trainer {trainer!r}: {what}; {outcome}", field=field, trainer=trainer)

        if not isinstance(ids, torch.Tensor):
            refuse(f"the ids are a {type(ids).__name__}, not a tensor")
        if ids.dtype != torch.int64:
            refuse(f"{dtype_name(ids.dtype)} ids: ids travel as int64 (send ids.long())")
        if ids.dim() != 1:
            refuse(f"ids of shape {tuple(ids.shape)}: ids are 1-D, [n]")
        a = _numpy(ids)
        n = len(a)
        if n > 1:
            bad = np.flatnonzero(a[1:] <= a[:-1])
            if len(bad):
                k = int(bad[0])
                if a[k + 1] == a[k]:
                    refuse(f"id {int(a[k])} appears twice (positions {k} and {k + 1}): sum the gradients of one id before pushing, one entry per id")
                refuse(f"ids are not ascending at position {k + 1} ({int(a[k + 1])} after {int(a[k])}): send them sorted (torch.unique sorts)")
        if self.spec.bounded and n and (a[0] < 0 or a[-1] >= self.spec.num_rows):
            first = int(a[0]) if a[0] < 0 else int(a[np.searchsorted(a, self.spec.num_rows)])
            refuse(f"id {first} is outside the table's [0, {self.spec.num_rows})")
        if n > self.max_ids:
            refuse(f"{n} ids in one section, more than sparse_max_ids = {self.max_ids}: raise sparse_max_ids or cut the batch")
        if n:
            held = self._held if slots is None else self._slot_mask(slots)
            where = row_slots(t, a, self.num_slots)
            out = np.flatnonzero(~held[where])
            if len(out):
                k = int(out[0])
                refuse(
                    f"id {int(a[k])} is in slot {int(where[k])}, whose rows this pserver does not hold "
                    f"({len(out)} such ids): the trainer's slot map is out of date, re-fetch it"
                )
        if not push:
            return
        gfield = f"tables.{t}.grads"
        if not isinstance(grads, torch.Tensor):
            refuse(f"the gradients are a {type(grads).__name__}, not a tensor", gfield)
        if grads.dim() != 2 or grads.shape[1] != dim:
            width = grads.shape[-1] if grads.dim() else "()"
            refuse(f"a row gradient of shape {tuple(grads.shape)} (width {width}) for table {t!r} of width {dim}: gradients are [n, {dim}]", gfield)
        if grads.shape[0] != n:
            refuse(f"{grads.shape[0]} gradient rows for {n} ids: one row per id", gfield)
        if grads.dtype != self.dtype:
            refuse(f"{dtype_name(grads.dtype)} gradients for a {self.spec.dtype} table: send the table's dtype", gfield)
        if not finite or not n:
            return
        # A sum is finite only if every element is (NaN and inf propagate): one pass, no
        # mask. Overflow of finite values also gives inf, so only then is each row looked at.
        if bool(torch.isfinite(grads.sum())):
            return
        bad_rows = torch.nonzero(~torch.isfinite(grads).all(dim=1)).flatten()
        if len(bad_rows):
            k = int(bad_rows[0])
            nan, inf = int(torch.isnan(grads).sum()), int(torch.isinf(grads).sum())
            refuse(f"the gradient of id {int(a[k])} is not finite ({nan} NaN and {inf} infinite values in the section)", gfield)

    def _slot_mask(self, slots: Collection[int] | np.ndarray) -> np.ndarray:
        """``slots`` as a mask over the table's slots (a bool array is taken as one)."""
        if isinstance(slots, np.ndarray) and slots.dtype == bool:
            if slots.shape != (self.num_slots,):
                raise ConfigError(f"table {self.spec.name!r}: a slot mask of shape {slots.shape} for {self.num_slots} slots")
            return slots
        mask = np.zeros(self.num_slots, dtype=bool)
        mask[np.asarray(sorted(slots), dtype=np.int64)] = True
        return mask

    # --- sync rounds: stage per trainer, apply the union ----------------------------------------

    def stage(
        self, key: str, ids: Any, grads: Any, *, keep: bool = False, source: int = -1, version: int = 0,
        covers: Collection[int] | np.ndarray | None = None,
    ) -> None:
        """Keep ``key``'s section for the open round, replacing an earlier one from the
        same ``source``: copied into a buffer of its own, reused round after round, or
        (``keep``: the caller gives the tensors away) held as given. Half-precision
        gradients are kept in float32, where the round sums them.

        With replicas a pserver stages a trainer's section from several sources: the
        trainer's own push (``source`` -1) and each primary's forward of the rows it
        backs up (``source``: that primary), of disjoint slots. ``covers``, the slots
        this section carries ``key``'s rows of in slot map ``version``, takes those rows
        out of ``key``'s sections staged by an older map: after a failover a trainer
        pushes again, by the newer map, rows a forward staged here already."""
        a = _numpy(ids)
        n = len(a)
        if covers is not None:
            self._uncover(key, source, version, covers)
        staged = self._staged.setdefault(key, {})
        if keep and grads.dtype == self._sum_dtype and grads.device == self.device:
            staged[source] = (a, grads, version)
            return
        buf_ids, buf = self._buffers.get((key, source), (np.empty(0, dtype=np.int64), None))
        if buf is None or buf.shape[0] < n:
            size = max(n, 2 * (0 if buf is None else buf.shape[0]))
            buf_ids = np.empty(size, dtype=np.int64)
            buf = torch.empty((size, self.spec.dim), dtype=self._sum_dtype, device=self.device)
            self._buffers[key, source] = (buf_ids, buf)
        buf_ids[:n] = a
        buf[:n].copy_(grads)
        staged[source] = (buf_ids[:n], buf[:n], version)

    def _uncover(self, key: str, source: int, version: int, covers: Collection[int] | np.ndarray) -> None:
        """Take the rows of slots ``covers`` out of ``key``'s sections from other
        sources staged by a map older than ``version`` (none, but after a failover)."""
        staged = self._staged.get(key, {})
        stale = [s for s, (_, _, v) in staged.items() if s != source and v < version]
        if not stale:
            return
        mask = self._slot_mask(covers)
        for s in stale:
            a, g, v = staged[s]
            keep = np.flatnonzero(~mask[row_slots(self.spec.name, a, self.num_slots)])
            if len(keep) < len(a):
                staged[s] = (a[keep], g.index_select(0, self._tensor(keep)), v)

    def staged(self) -> set[str]:
        return {key for key, sections in self._staged.items() if sections}

    def unstage(self, key: str | None = None, *, forget: bool = False) -> None:
        """Drop ``key``'s staged sections, from every source (all keys' if None);
        ``forget`` also frees their buffers."""
        if key is None:
            self._staged.clear()
        else:
            self._staged.pop(key, None)
        if forget:
            for k in [k for k in self._buffers if key is None or k[0] == key]:
                del self._buffers[k]

    def apply_staged(self, weights: Sequence[tuple[str, float]]) -> bool:
        """Close a sync round: the union of the staged sections of the keys in
        ``weights`` (ascending ids), each id's gradient summed as ``w * g`` in that order,
        one step of the rule. Keys that staged nothing did not use the table. Then
        nothing is staged. False, with nothing applied, if no key staged a section.

        A key's sections from several sources hold disjoint ids, so each id's sum runs
        over the keys in the order given wherever its rows are staged: every copy of a
        slot sums, and steps, its rows alike."""
        parts = [(section[:2], float(w)) for k, w in weights for _, section in sorted(self._staged.get(k, {}).items())]
        self._staged.clear()
        if not parts:
            return False
        if len(parts) == 1:
            (ids, g), w = parts[0]
            grads = g if w == 1.0 else g * w
        else:
            ids, inverse = np.unique(np.concatenate([a for (a, _), _ in parts]), return_inverse=True)
            grads = torch.zeros((len(ids), self.spec.dim), dtype=self._sum_dtype, device=self.device)
            inv, at = self._tensor(inverse.reshape(-1)), 0
            for (a, g), w in parts:
                grads.index_add_(0, inv[at : at + len(a)], g, alpha=w)
                at += len(a)
        self._apply(ids, grads.to(self.dtype))
        return True

    def apply(self, ids: Any, grads: Any, *, step: int | None = None, key: str | None = None) -> None:
        """Async: one step of the rule with this section (checked before). ``step``: the
        table step to apply it at, leaving this store's own unchanged (a backup applying
        its primary's push at the primary's step: an async table step is per pserver);
        it evicts nothing then (async jobs with replicas evict by no step). ``key``: the
        caller, whose last :meth:`lookup` (with the same ``key``) of the same ids is
        reused instead of probing the index again, unless a row left its position since;
        the outcome is the same either way."""
        self._apply(_numpy(ids), grads.to(self.device), step, key)

    def _apply(self, ids: np.ndarray, grads: torch.Tensor, at_step: int | None = None, key: str | None = None) -> None:
        own = self.step
        now = self._clock() if self._when is not None else 0.0
        self.step = own + 1 if at_step is None else at_step  # the kernels, the marks and admission read self.step
        try:
            self._step_rows(ids, grads, now, key)
        finally:
            if at_step is not None:
                self.step = own
        if at_step is None:
            self._evict(now)

    def _step_rows(self, ids: np.ndarray, grads: torch.Tensor, now: float, key: str | None = None) -> None:
        pos, plan = self._positions(ids, key)
        missing = np.flatnonzero(pos < 0)
        if len(missing):
            plan = None
            new = ids[missing]
            if self._pending is not None:
                admitted = self._pending.touch(new, self.spec.admit_after, self.step)
                self._counters["pending_dropped"] += self._pending.enforce()
                missing, new = missing[admitted], new[admitted]
                self._counters["admitted"] += len(new)
            if len(new):
                pos[missing] = self._create(new, now)
                self._counters["created"] += len(new)
            kept = np.flatnonzero(pos >= 0)
            if len(kept) < len(pos):
                pos, grads = pos[kept], grads.index_select(0, self._tensor(kept))
        if len(pos):
            plan = self._plan(pos) if plan is None else plan
            if self._add_alpha is not None:
                self._values.add(plan, plan.arrange(grads).to(self.dtype), self._add_alpha)
                self._mark(plan, now)
                return
            rows = self._values.gather(plan)
            state = {k: col.gather(plan) for k, col in self._state.items()}
            self._kernel.step(rows, state, plan.arrange(grads), self.step)
            self._values.scatter(plan, rows)
            for k, col in self._state.items():
                col.scatter(plan, state[k])
            self._mark(plan, now)

    # --- eviction --------------------------------------------------------------------------------

    def _rows_meta(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Every row: ids, positions, update counts, last-update steps."""
        ids, pos = self._index.items()
        plan = self._plan(pos)
        return ids, pos, _numpy(plan.restore(self._count.gather(plan))), _numpy(plan.restore(self._last.gather(plan)))

    def _evict(self, now: float) -> None:
        spec = self.spec
        if not self._evicts:
            return
        by_steps = spec.ttl_steps and rowpolicy.sweep_due(self.step, spec.sweep_period)
        by_time = False
        if spec.ttl_seconds:
            by_time = rowpolicy.sweep_due(self.step, spec.sweep_every) if spec.sweep_every else now - self._last_sweep >= spec.ttl_seconds / 8
        if by_steps or by_time:
            self._last_sweep = now
            ids, pos, counts, last = self._rows_meta()
            mask = np.zeros(len(ids), dtype=bool)
            if spec.ttl_steps:
                mask |= rowpolicy.expired(last, self.step, spec.ttl_steps)
            if spec.ttl_seconds:
                plan = self._plan(pos)
                mask |= rowpolicy.expired(_numpy(plan.restore(self._when.gather(plan))), now, spec.ttl_seconds)
            gone = rowpolicy.ttl_victims(mask, counts, ids, spec.floor)
            self._remove(ids[gone], pos[gone])
            self._counters["evicted_ttl"] += len(gone)
        if spec.capacity and len(self._index) > spec.capacity:
            ids, pos, counts, last = self._rows_meta()
            gone = rowpolicy.lfu_victims(counts, ids, spec.capacity, spec.floor, protect=last == self.step)
            self._remove(ids[gone], pos[gone])
            self._counters["evicted_lfu"] += len(gone)

    # --- reads --------------------------------------------------------------------------------

    def lookup(self, ids: Any, *, key: str | None = None) -> torch.Tensor:
        """``[n, dim]`` rows of ``ids`` (a new tensor): stored rows, and the init value
        of ids with no row. Creates nothing. ``key``: the caller (a trainer), whose
        positions of these ids are kept for its next :meth:`apply`."""
        a = _numpy(ids)
        pos = self._index.lookup(a)
        have = np.flatnonzero(pos >= 0)
        if len(have) == len(a):
            plan = self._plan(pos)
            if key is not None:
                self._keep_lookup(key, a, pos, plan)
            return plan.restore(self._values.gather(plan))
        if key is not None:
            self._keep_lookup(key, a, pos.copy(), None)
        out = _empty((len(a), self.spec.dim), self.dtype, self.device)
        if len(have):
            plan = self._plan(pos[have])
            at = self._tensor(have)
            out.index_copy_(0, at if plan.order is None else at.index_select(0, plan.order), self._values.gather(plan))
        absent = np.flatnonzero(pos < 0)
        out.index_copy_(0, self._tensor(absent), torch.from_numpy(init_rows(self.spec, a[absent])).to(self.dtype).to(self.device))
        return out

    # --- moving and saving slots ----------------------------------------------------------------

    def _ordered(self, slots: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rows of ``slots`` in (slot, id) order: ids, positions, slots (kept while
        the set of rows stays the same, so paging an export hashes once)."""
        key = (tuple(slots), self._generation)
        if self._order is not None and self._order[0] == key:
            return self._order[1]
        ids, pos = self._index.items()
        where = row_slots(self.spec.name, ids, self.num_slots)
        wanted = np.zeros(self.num_slots, dtype=bool)
        wanted[np.asarray(slots, dtype=np.int64)] = True
        keep = np.flatnonzero(wanted[where])
        ids, pos, where = ids[keep], pos[keep], where[keep]
        order = np.lexsort((ids, where))
        out = (ids[order], pos[order], where[order])
        self._order = (key, out)
        return out

    def export_slots(self, slots: Collection[int], offset: int = 0, limit: int | None = None) -> tuple[dict[str, Any], bool]:
        """The rows of ``slots`` (those held here) in (slot, id) order, ``offset`` on, at
        most ``limit`` (default all), copied: per slot ``ids``, ``values``, ``state.<k>``
        and, where the table evicts, ``count`` and ``last_age`` (table step - last
        update), the pending ids and their counts with the first page; and the table's
        ``scalar.step``. Returns the entries and whether rows remain past this page."""
        if offset < 0 or (limit is not None and limit < 1):
            raise ConfigError(f"export of table {self.spec.name!r}: offset {offset} must be >= 0 and limit {limit} >= 1")
        want = [s for s in sorted(set(slots)) if 0 <= s < self.num_slots and self._held[s]]
        ids, pos, where = self._ordered(want)
        end = len(ids) if limit is None else min(len(ids), offset + limit)
        ids, pos, where = ids[offset:end], pos[offset:end], where[offset:end]
        plan = self._plan(pos)
        cols = {"values": plan.restore(self._values.gather(plan))}
        cols.update((f"state.{k}", plan.restore(c.gather(plan))) for k, c in self._state.items())
        if self._count is not None:
            cols["count"] = plan.restore(self._count.gather(plan))
            cols["last_age"] = self.step - plan.restore(self._last.gather(plan))
        name = self.spec.name
        out: dict[str, Any] = {table_entry(name, "step"): torch.tensor(self.step, dtype=torch.int64)}
        lo = np.searchsorted(where, want, side="left")
        hi = np.searchsorted(where, want, side="right")
        for s, a, b in zip(want, lo.tolist(), hi.tolist()):
            if b == a:  # a slot without rows has no entries: the slot map says who holds it
                continue
            out[row_entry(name, s, "ids")] = torch.from_numpy(ids[a:b].copy())
            for kind, t in cols.items():
                out[row_entry(name, s, kind)] = t[a:b]
        if self._pending is not None and offset == 0:
            p_ids, p_counts, p_seen = self._pending.items()
            p_where = row_slots(name, p_ids, self.num_slots)
            order = np.lexsort((p_ids, p_where))
            p_ids, p_counts, p_seen, p_where = p_ids[order], p_counts[order], p_seen[order], p_where[order]
            lo = np.searchsorted(p_where, want, side="left")
            hi = np.searchsorted(p_where, want, side="right")
            for s, a, b in zip(want, lo.tolist(), hi.tolist()):
                if b == a:
                    continue
                out[row_entry(name, s, "pending_ids")] = torch.from_numpy(p_ids[a:b].copy())
                out[row_entry(name, s, "pending_counts")] = torch.from_numpy(p_counts[a:b].astype(np.int32))
                out[row_entry(name, s, "pending_age")] = torch.from_numpy(self.step - p_seen[a:b])  # the step of its last touch, as an age
        return out, end < len(self._ordered(want)[0])

    def snapshot(self, slots: Collection[int]) -> dict[str, Any]:
        """Every row of ``slots`` with its state, copied (a checkpoint part's share)."""
        return self.export_slots(slots)[0]

    def import_slots(self, entries: Mapping[str, Any]) -> None:
        """Load :meth:`export_slots` entries, from any pserver's cut: rows of ids held
        already are replaced, the others created; the table step becomes the larger of
        the two (ages are kept: ``last = step - last_age``). Entries of other tables
        are ignored. ConfigError, with nothing changed, if an entry does not fit."""
        name = self.spec.name
        by_slot: dict[int, dict[str, Any]] = {}
        step = self.step
        for key, t in entries.items():
            parsed = parse_row_entry(key)
            if parsed is not None:
                table, slot, kind = parsed
                if table == name:
                    by_slot.setdefault(slot, {})[kind] = t
                continue
            scalar = parse_table_entry(key)
            if scalar == (name, "step"):
                step = max(step, int(t))
        loaded = []
        for slot in sorted(by_slot):
            loaded.append((slot, self._fitting(slot, by_slot[slot])))
        self.step = step
        now = self._clock() if self._when is not None else 0.0
        for slot, got in loaded:
            self._held[slot] = True
            ids = got["ids"]
            if len(ids):
                pos = self._index.lookup(ids)
                new = np.flatnonzero(pos < 0)
                if len(new):
                    pos[new] = self._alloc(len(new))
                    self._index.insert(ids[new], pos[new])
                    self._generation += 1
                plan = self._plan(pos)
                self._values.scatter(plan, plan.arrange(got["values"]))
                for k, col in self._state.items():
                    if k in got["state"]:
                        col.scatter(plan, plan.arrange(got["state"][k]))
                    else:  # saved under a rule without this state: the rule's start
                        col.put(plan, col.fill or 0)
                if self._count is not None:
                    if "count" in got:
                        self._count.scatter(plan, plan.arrange(got["count"]))
                    else:
                        self._count.put(plan, 0)
                    age = got.get("last_age")
                    if age is not None:
                        self._last.scatter(plan, plan.arrange(self.step - age))
                    else:
                        self._last.put(plan, self.step)
                if self._when is not None:
                    self._when.put(plan, now)
            if self._pending is not None and "pending_ids" in got:
                p_ids = got["pending_ids"]
                fresh = (self._index.lookup(p_ids) < 0) & (self._pending.index.lookup(p_ids) < 0)
                seen = self.step - got["pending_age"] if "pending_age" in got else np.full(len(p_ids), self.step, dtype=np.int64)
                self._pending.put(p_ids[fresh], got["pending_counts"][fresh], seen[fresh])
        if self._pending is not None:
            self._pending.enforce()

    def _fitting(self, slot: int, got: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of one slot, checked and converted (ConfigError otherwise)."""
        name, dim = self.spec.name, self.spec.dim
        where = f"table {name!r} slot {slot}"
        if not 0 <= slot < self.num_slots:
            raise ConfigError(f"{where}: the entries are for a slot outside [0, {self.num_slots}): saved with another num_slots")
        out: dict[str, Any] = {"state": {}}

        def tensor(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            if kind not in got:
                raise ConfigError(f"{where}: no {kind!r} entry beside the ids")
            t = got[kind]
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                have = f"{tuple(t.shape)} {dtype_name(t.dtype)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise ConfigError(f"{where}: entry {kind!r} is {have}, expected {shape} {dtype_name(dtype)}")
            return t.to(self.device)

        if "ids" in got:
            a = _numpy(tensor("ids", (len(got["ids"]),), torch.int64))
            if len(a) > 1 and not np.all(a[1:] > a[:-1]):
                raise ConfigError(f"{where}: the ids are not strictly ascending")
            if len(a) and not np.all(row_slots(name, a, self.num_slots) == slot):
                raise ConfigError(f"{where}: some ids belong to other slots (saved with another num_slots or table name)")
            n = len(a)
            out["ids"] = a
            out["values"] = tensor("values", (n, dim), self.dtype)
            for k, col in self._state.items():
                if f"state.{k}" in got:
                    shape = (n,) if col.width is None else (n, col.width)
                    out["state"][k] = tensor(f"state.{k}", shape, col.dtype)
            if "count" in got:
                out["count"] = tensor("count", (n,), torch.int32)
            if "last_age" in got:
                out["last_age"] = tensor("last_age", (n,), torch.int64)
        else:
            out["ids"] = np.empty(0, dtype=np.int64)
        if "pending_ids" in got:
            p = tensor("pending_ids", (len(got["pending_ids"]),), torch.int64)
            out["pending_ids"] = _numpy(p)
            out["pending_counts"] = _numpy(tensor("pending_counts", (len(p),), torch.int32)).astype(np.int64)
            if "pending_age" in got:
                out["pending_age"] = _numpy(tensor("pending_age", (len(p),), torch.int64))
        return out

    def drop_slots(self, slots: Collection[int]) -> None:
        """Forget the rows (and pending ids) of ``slots`` and stop holding them."""
        gone = [s for s in sorted(set(slots)) if 0 <= s < self.num_slots]
        if not gone:
            return
        ids, pos, _ = self._ordered(gone)
        self._remove(ids, pos)
        if self._pending is not None:
            p_ids, _, _ = self._pending.items()
            drop = np.zeros(self.num_slots, dtype=bool)
            drop[gone] = True
            self._pending.remove(p_ids[drop[row_slots(self.spec.name, p_ids, self.num_slots)]])
        self._held[gone] = False
        self._generation += 1

    # --- status ----------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """``rows``; ``bytes``: everything the store holds (chunks, index, free list,
        pending map, staging buffers); and the counters."""
        held = sum(c.nbytes for c in self._columns()) + self._index.nbytes + self._free.nbytes + self._held.nbytes
        held += sum(a.nbytes + g.nbytes for a, g in self._buffers.values())
        held += sum(a.nbytes + g.nbytes for k, sections in self._staged.items() for s, (a, g, _) in sections.items() if (k, s) not in self._buffers)
        pending = 0
        if self._pending is not None:
            held += self._pending.nbytes
            pending = len(self._pending)
        return {"rows": len(self._index), "bytes": int(held), "pending": pending, **self._counters}

