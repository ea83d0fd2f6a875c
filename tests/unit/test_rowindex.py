"""IdIndex: the vectorized open-addressing index of a pserver's rows of one table."""

from __future__ import annotations

import numpy as np
import pytest

from pdps.core.rowindex import MAX_POSITION, IdIndex


def test_insert_lookup_delete():
    idx = IdIndex()
    ids = np.array([5, -3, 2**62, -(2**63), 0], dtype=np.int64)
    idx.insert(ids, np.arange(5) * 10)
    assert len(idx) == 5
    assert idx.lookup(np.array([0, 5, 7, -(2**63), 2**62])).tolist() == [40, 0, -1, 30, 20]
    assert idx.lookup(np.array([], dtype=np.int64)).shape == (0,)
    assert idx.delete(np.array([5, 5, 8])) == 1 and len(idx) == 4
    assert idx.lookup(np.array([5, -3])).tolist() == [-1, 10]
    idx.insert(np.array([5]), np.array([99]))
    got_ids, got_pos = idx.items()
    assert got_ids.tolist() == sorted(ids.tolist()) and dict(zip(got_ids.tolist(), got_pos.tolist()))[5] == 99


def test_growth_keeps_every_entry():
    idx = IdIndex()
    rng = np.random.default_rng(1)
    ids = rng.choice(1 << 40, size=20_000, replace=False).astype(np.int64)
    for a in range(0, ids.size, 3_000):
        idx.insert(ids[a : a + 3_000], np.arange(a, min(a + 3_000, ids.size)))
    assert len(idx) == ids.size and idx.buckets * 0.6 >= ids.size
    assert np.array_equal(idx.lookup(ids), np.arange(ids.size))
    assert idx.nbytes == idx.buckets * 12


def test_bad_inserts_change_nothing():
    idx = IdIndex(capacity=100)
    idx.insert(np.array([1, 2, 3]), np.array([0, 1, 2]))
    buckets = idx.buckets
    for ids, pos, match in [
        ([4, 4], [5, 6], "id 4 is given more than once"),
        ([4, 2], [5, 6], "id 2 is held"),
        ([4], [5, 6], "one position per id"),
        ([4], [-1], "positions must be in"),
        ([4], [MAX_POSITION + 1], "positions must be in"),
    ]:
        with pytest.raises(ValueError, match=match):
            idx.insert(np.array(ids), np.array(pos))
    assert len(idx) == 3 and idx.buckets == buckets and idx.lookup(np.array([1, 2, 3, 4])).tolist() == [0, 1, 2, -1]
