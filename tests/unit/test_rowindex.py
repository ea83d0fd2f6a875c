"""IdIndex: the vectorized open-addressing index of a pserver's rows of one table,
checked against a dict under random inserts, deletes and lookups."""

from __future__ import annotations

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdps.core.rowindex import MAX_POSITION, IdIndex

INT64 = st.integers(-(2**63), 2**63 - 1)
# Few distinct values, so that deletes hit, ids repeat and small tables collide; the
# int64 extremes and multiples of big powers of two for the hash's corners.
IDS = st.one_of(
    st.integers(0, 60),
    INT64,
    st.sampled_from([-(2**63), 2**63 - 1, -1, 2**62, 2**32, 3 * 2**40, -(2**58)]),
)


def arr(values) -> np.ndarray:
    return np.array(list(values), dtype=np.int64)


class IdIndexMachine(RuleBasedStateMachine):
    """An IdIndex and a dict take the same operations; they must always agree, and
    the index must keep its load and tombstone bounds."""

    @initialize(capacity=st.sampled_from([0, 3, 40]))
    def create(self, capacity):
        self.idx = IdIndex(capacity)
        self.model: dict[int, int] = {}

    @rule(ids=st.lists(IDS, max_size=40, unique=True), data=st.data())
    def insert(self, ids, data):
        new = [i for i in ids if i not in self.model]
        positions = data.draw(st.lists(st.integers(0, MAX_POSITION), min_size=len(new), max_size=len(new)))
        self.idx.insert(arr(new), np.array(positions, dtype=np.int64))
        self.model.update(zip(new, positions))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), duplicate=st.booleans())
    def refused_insert_changes_nothing(self, data, duplicate):
        held = data.draw(st.sampled_from(sorted(self.model)))
        fresh = data.draw(IDS.filter(lambda i: i not in self.model))
        ids = [fresh, fresh] if duplicate else [fresh, held]
        before = self.idx.items(), self.idx.buckets, self.idx.tombstones
        with pytest.raises(ValueError, match=f"id {fresh if duplicate else held} "):
            self.idx.insert(arr(ids), np.array([1, 2]))
        after = self.idx.items(), self.idx.buckets, self.idx.tombstones
        assert all(np.array_equal(a, b) for a, b in zip(before[0], after[0])) and before[1:] == after[1:]

    @rule(ids=st.lists(IDS, max_size=30))
    def delete(self, ids):
        held = {i for i in ids if i in self.model}
        assert self.idx.delete(arr(ids)) == len(held)
        for i in held:
            del self.model[i]

    @precondition(lambda self: len(self.model) > 4)
    @rule(data=st.data())
    def delete_most(self, data):
        """Many deletes at once: past a quarter of the buckets, tombstones force a rebuild."""
        held = sorted(self.model)
        keep = data.draw(st.sets(st.sampled_from(held), max_size=len(held) // 4))
        gone = [i for i in held if i not in keep]
        assert self.idx.delete(arr(gone)) == len(gone)
        for i in gone:
            del self.model[i]

    @rule(ids=st.lists(IDS, max_size=50))
    def lookup(self, ids):
        assert self.idx.lookup(arr(ids)).tolist() == [self.model.get(i, -1) for i in ids]

    @invariant()
    def holds_what_the_dict_holds(self):
        ids, positions = self.idx.items()
        assert len(self.idx) == len(self.model)
        assert ids.tolist() == sorted(self.model) and positions.tolist() == [self.model[i] for i in sorted(self.model)]
        assert ids.dtype == np.int64 and positions.dtype == np.int64

    @invariant()
    def load_and_tombstones_stay_bounded(self):
        buckets = self.idx.buckets
        assert buckets & (buckets - 1) == 0 and self.idx.nbytes == 12 * buckets
        assert self.idx.tombstones == np.count_nonzero(self.idx._pos == -2)  # the count that drives rebuilds
        assert len(self.idx) + self.idx.tombstones <= 0.6 * buckets
        assert self.idx.tombstones * 4 <= buckets


TestIdIndexMachine = IdIndexMachine.TestCase
TestIdIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_insert_lookup_delete():
    idx = IdIndex()
    ids = np.array([5, -3, 2**62, -(2**63), 0], dtype=np.int64)
    idx.insert(ids, np.arange(5) * 10)
    assert len(idx) == 5
    assert idx.lookup(np.array([0, 5, 7, -(2**63), 2**62])).tolist() == [40, 0, -1, 30, 20]
    assert idx.lookup(np.array([[0, 7], [5, 5]])).tolist() == [[40, -1], [0, 0]]  # the shape of the ids
    assert idx.lookup(np.array([], dtype=np.int64)).shape == (0,)
    assert idx.delete(np.array([5, 5, 8])) == 1 and len(idx) == 4
    assert idx.lookup(np.array([5, -3])).tolist() == [-1, 10]
    idx.insert(np.array([5], dtype=np.uint64), np.array([99], dtype=np.int32))  # any integer dtypes
    got_ids, got_pos = idx.items()
    assert got_ids.tolist() == sorted(ids.tolist()) and dict(zip(got_ids.tolist(), got_pos.tolist()))[5] == 99
    idx.insert(np.array([], dtype=np.int64), np.array([], dtype=np.int64))
    assert len(idx) == 5


def test_growth_keeps_every_entry():
    idx = IdIndex()
    ids = np.random.default_rng(1).choice(1 << 40, size=20_000, replace=False).astype(np.int64)
    for a in range(0, ids.size, 3_000):
        idx.insert(ids[a : a + 3_000], np.arange(a, min(a + 3_000, ids.size)))
    assert len(idx) == ids.size and idx.buckets * 0.6 >= ids.size
    assert np.array_equal(idx.lookup(ids), np.arange(ids.size))
    assert idx.nbytes == idx.buckets * 12 <= ids.size * 12 / 0.3  # at least 30% full after a doubling


def test_capacity_sizes_the_table_up_front_and_sequential_ids_work():
    idx = IdIndex(capacity=10_000)
    buckets = idx.buckets
    idx.insert(np.arange(10_000), np.arange(10_000)[::-1])
    assert idx.buckets == buckets  # no rebuild on the way
    assert np.array_equal(idx.lookup(np.arange(-5, 10_005)), np.r_[[-1] * 5, np.arange(10_000)[::-1], [-1] * 5])


def test_tombstones_are_reused_then_rebuilt_away():
    idx = IdIndex(capacity=1000)
    buckets = idx.buckets
    idx.insert(np.arange(1000), np.arange(1000))
    assert idx.delete(np.arange(0, 1000, 2)) == 500 and idx.tombstones == 500  # below a quarter of the buckets
    idx.insert(np.arange(0, 1000, 2), np.arange(500))  # the same ids come back into their old buckets
    assert idx.tombstones == 0 and idx.buckets == buckets and len(idx) == 1000
    idx.delete(np.arange(700))  # past a quarter: rebuilt, smaller
    assert idx.tombstones == 0 and idx.buckets < buckets
    kept = np.arange(700, 1000)
    assert np.array_equal(idx.lookup(np.arange(1000)), np.r_[[-1] * 700, np.where(kept % 2, kept, kept // 2)])


def test_bad_inputs_change_nothing():
    idx = IdIndex(capacity=100)
    idx.insert(np.array([1, 2, 3]), np.array([0, 1, 2]))
    buckets = idx.buckets
    for ids, pos, match in [
        ([4, 4], [5, 6], "id 4 is given more than once"),
        ([4, 2], [5, 6], "id 2 is held .at position 1"),
        ([4], [5, 6], "one position per id: 1 ids, 2 positions"),
        ([4], [-1], r"positions must be in \[0, 2147483647\]"),
        ([4], [MAX_POSITION + 1], "positions must be in"),
        ([4], [1.5], "positions must be integers"),
        ([4.5], [1], "ids must be integers"),
    ]:
        with pytest.raises(ValueError, match=match):
            idx.insert(np.array(ids), np.array(pos))
    assert len(idx) == 3 and idx.buckets == buckets and idx.lookup(np.array([1, 2, 3, 4])).tolist() == [0, 1, 2, -1]
    with pytest.raises(ValueError, match="ids must be integers"):
        idx.lookup(np.array([1.0]))
    with pytest.raises(ValueError, match="capacity"):
        IdIndex(-1)
