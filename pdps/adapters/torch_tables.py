"""A trainer's side of the tables of a model (:class:`TorchTables`, the
:class:`~pdps.ports.compute.TrainerTables` port over torch).

What it owns: the step's rows. Per forward of a :class:`~pdps.nn.RemoteTable`, the
batch's ids are de-duplicated (``torch.unique``, sorted), split by the pserver owning
each id's slot (:func:`pdps.core.tables.row_slots`, the owner from the slot map), pulled
with one call per pserver through the ``pull`` the trainer gives (:meth:`connect`), and
gathered into one ``[unique ids, dim]`` leaf that autograd fills. At the push, each
table's gradient rows are summed per id (a table called twice in a step) and split per
pserver again: :meth:`sections`. Nothing of a table outlives a step; nothing the size
of a table is ever allocated here (:attr:`largest_rows` counts the biggest leaf).

Rules:

* Only calls made with autograd on are recorded (an evaluation under ``torch.no_grad``
  pushes nothing), and only rows that received a gradient are pushed.
* Every pserver gets a section for every table the step used, empty where it owns
  none of the ids: a table's step count (Adagrad's ``lr_decay``, SparseAdam's bias
  correction) then moves on every pserver alike, as torch's single ``step()`` does.
* The padding id's row is never pushed (torch's sparse gradient leaves it out too).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from pdps.core.errors import GradientRejected, SlotMapChanged
from pdps.core.tables import TableSpec, row_slots
from pdps.nn import RemoteTable, TableOptions, replace_tables, tables_of

#: A lookup answered SlotMapChanged (a resize moved slots; the trainer then follows the
#: map) routes its ids again by the new map, up to this many times.
MAP_CHANGES_PER_PULL = 8
#: route() -> (slot owners, by slot), as the trainer's slot map says now
Route = Callable[[], Sequence[int]]
#: pull({pserver: [(table, ids)]}) -> {pserver: [rows, one per (table, ids)]}
Pull = Callable[[Mapping[int, list[tuple[str, torch.Tensor]]]], Mapping[int, Sequence[torch.Tensor]]]


class TorchTables:
    """The tables of one attached model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, options: Mapping[str, TableOptions] | None = None) -> None:
        found = tables_of(model, options)
        self.specs: list[TableSpec] = [spec for _, _, spec in found]
        self._route: Route | None = None
        self._pull: Pull | None = None
        #: table -> the (unique ids, rows leaf) of each call this step, autograd on
        self._calls: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.largest_rows = 0  # the most rows one lookup held (a table-sized one would show here)
        self.pulled_rows = 0
        self.stand_ins = replace_tables(model, found, self._rows)
        del found  # the user's table modules go with the model's references to them

    def __bool__(self) -> bool:
        return bool(self.specs)

    def connect(self, route: Route, pull: Pull) -> None:
        """Where rows come from: ``route()`` gives the slot map's owners, ``pull`` calls
        the pservers."""
        self._route, self._pull = route, pull

    # --- forward ------------------------------------------------------------------------

    def _owners(self, name: str, ids: torch.Tensor) -> np.ndarray:
        assert self._route is not None
        owners = np.asarray(self._route(), dtype=np.int64)
        return owners[row_slots(name, ids.detach().cpu().numpy(), len(owners))]

    def _rows(self, table: RemoteTable, unique: torch.Tensor) -> torch.Tensor:
        if self._pull is None:
            raise RuntimeError(f"table {table.spec.name!r} is not connected to a job")
        spec = table.spec
        n = int(unique.numel())
        dtype = getattr(torch, spec.dtype)
        rows = torch.empty((n, spec.dim), dtype=dtype, device=unique.device)
        if n:
            for changes in range(MAP_CHANGES_PER_PULL + 1):
                owner = self._owners(spec.name, unique)
                order = np.argsort(owner, kind="stable")
                bounds = np.searchsorted(owner[order], np.arange(owner.max() + 2))
                asks: dict[int, list[tuple[str, torch.Tensor]]] = {}
                where: dict[int, torch.Tensor] = {}
                for p in range(len(bounds) - 1):
                    lo, hi = bounds[p], bounds[p + 1]
                    if hi > lo:
                        at = torch.from_numpy(order[lo:hi]).to(unique.device)
                        where[p] = at
                        asks[p] = [(spec.name, unique[at].cpu())]
                try:
                    got = self._pull(asks)
                    break
                except SlotMapChanged:
                    # a resize moved slots: the trainer followed the map, so route the ids by it again
                    if changes == MAP_CHANGES_PER_PULL:
                        raise
            with torch.no_grad():
                for p, at in where.items():
                    rows[at] = got[p][0].to(device=rows.device, dtype=dtype)
        self.largest_rows = max(self.largest_rows, n)
        self.pulled_rows += n
        if torch.is_grad_enabled():
            rows.requires_grad_()
            self._calls.setdefault(spec.name, []).append((unique, rows))
        return rows

    # --- push ---------------------------------------------------------------------------

    def _summed(self, spec: TableSpec) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's gradient rows of ``spec``'s table, one per unique id (ascending);
        None if no call of it received a gradient."""
        calls = [(u, r.grad) for u, r in self._calls.get(spec.name, []) if r.grad is not None]
        if not calls:
            return None
        if len(calls) == 1:
            ids, grads = calls[0]
        else:
            all_ids = torch.cat([u for u, _ in calls])
            ids, inverse = torch.unique(all_ids, sorted=True, return_inverse=True)
            grads = torch.zeros((int(ids.numel()), spec.dim), dtype=calls[0][1].dtype, device=calls[0][1].device)
            grads.index_add_(0, inverse, torch.cat([g for _, g in calls]))
        if spec.padding_idx is not None:
            keep = ids != spec.padding_idx
            if not bool(keep.all()):
                ids, grads = ids[keep], grads[keep]
        return ids.cpu().contiguous(), grads.contiguous()

    def sections(self, pservers: Sequence[int]) -> dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]]:
        """Per pserver of ``pservers``: ``(table, ids, gradient rows)`` for every table this
        step used (ids ascending int64, possibly none)."""
        out: dict[int, list[tuple[str, torch.Tensor, torch.Tensor]]] = {p: [] for p in pservers}
        for spec in self.specs:
            summed = self._summed(spec)
            if summed is None:
                continue
            ids, grads = summed
            owner = torch.from_numpy(self._owners(spec.name, ids)) if ids.numel() else torch.empty(0, dtype=torch.int64)
            for p in pservers:
                mask = owner == p
                out[p].append((spec.name, ids[mask], grads[mask.to(grads.device)]))
        return out

    def check_finite(self, trainer: str) -> None:
        """GradientRejected naming the table if a gradient row holds NaN or Inf."""
        for name, calls in self._calls.items():
            for _, rows in calls:
                g = rows.grad
                if g is not None and not bool(torch.isfinite(g).all()):
                    nan, inf = int(torch.isnan(g).sum()), int(torch.isinf(g).sum())
                    raise GradientRejected(f"gradient rows of table {name!r} on trainer {trainer!r} hold {nan} NaN and {inf} infinite values; nothing was pushed", field="tables", trainer=trainer)

    @property
    def used(self) -> bool:
        return any(self._calls.values())

    def clear(self) -> None:
        """The step is over (pushed, refused or dropped): forget its rows."""
        self._calls.clear()

