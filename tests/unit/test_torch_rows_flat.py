"""TorchRows' flat layout (the CPU's): one memory mapping per column, grown in place.

The rules, checks and slot moves run on both layouts in test_torch_rows.py; this is what
only the flat one does: double its mapping as rows come, keep every row through each
growth (moved by the kernel, or copied when a view of the old rows is still held), and
count the pages of the rows handed out, not the mapping's capacity.
"""

from __future__ import annotations

import numpy as np
import torch

import pdps.adapters.torch_rows as torch_rows
from pdps.adapters.torch_rows import TorchRows
from pdps.core.tables import TableSpec

N, DIM, SLOTS = 1000, 8, 16
SPEC = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N)


def test_a_flat_store_grows_its_mapping_and_keeps_every_row_even_past_a_held_view(monkeypatch):
    monkeypatch.setattr(torch_rows, "FLAT_MIN_ROWS", 16)
    flat = TorchRows(SPEC, "Adagrad", {"lr": 0.1}, range(SLOTS), SLOTS)
    chunked = TorchRows(SPEC, "Adagrad", {"lr": 0.1}, range(SLOTS), SLOTS, chunk_rows=64)
    assert flat._chunk_rows is None and flat._values.capacity == 0  # the CPU's default: flat, nothing mapped yet
    rng = np.random.default_rng(7)
    capacities, view = [], None
    for k in range(12):
        ids = torch.from_numpy(np.unique(rng.integers(0, N, 90)))
        g = torch.from_numpy(rng.standard_normal((len(ids), DIM)))
        for r in (flat, chunked):
            r.apply(ids, g)
        capacities.append(flat._values.capacity)
        if k == 3:  # a view of the rows outlives the next growths: the mapping cannot move, so it is copied
            view = flat._values.chunks[0][:4]
    assert capacities == sorted(capacities) and capacities[0] >= 16 and capacities[-1] > capacities[3]  # grew past the view
    assert view is not None and bool(torch.isfinite(view).all())  # the old mapping lives as long as the view
    assert torch.equal(flat.lookup(torch.arange(N)), chunked.lookup(torch.arange(N)))
    a, b = (r.export_slots(range(SLOTS))[0] for r in (flat, chunked))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    # a flat store counts the pages of the rows handed out, not the mapping's capacity
    rows = flat.stats()["rows"]
    assert rows == chunked.stats()["rows"] and flat._values.nbytes == -(-rows * DIM * 8 // 4096) * 4096 < flat._values.capacity * DIM * 8
