"""Admission and eviction decisions: counted cases, ties, floors, and determinism."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdps.core import rowpolicy
from pdps.core.errors import ConfigError


def test_tie_break_is_splitmix64_and_spreads_neighbouring_ids():
    # the reference value of splitmix64 for state 0 (first output of the generator seeded 0)
    assert int(rowpolicy.tie_break(np.array([0]))[0]) == 0xE220A8397B1DCDAF
    h = rowpolicy.tie_break(np.arange(1000))
    assert len(np.unique(h)) == 1000
    assert not (np.all(np.diff(h.astype(np.float64)) > 0) or np.all(np.diff(h.astype(np.float64)) < 0))
    # negative ids are their two's complement: defined, distinct from the positive ones
    assert rowpolicy.tie_break(np.array([-1]))[0] != rowpolicy.tie_break(np.array([1]))[0]


def test_shrink_target_is_a_sixteenth_below():
    assert [rowpolicy.shrink_target(c) for c in (1, 15, 16, 100, 1600)] == [1, 15, 15, 94, 1500]


def test_admit_counts_touches_and_admits_at_the_c_th():
    admitted, counts = rowpolicy.admit(np.array([0, 1, 2, 5]), 3)
    assert admitted.tolist() == [False, False, True, True]
    assert counts.tolist() == [1, 2, 3, 6]
    admitted, counts = rowpolicy.admit(np.array([0, 0]), 1)  # c = 1: every touch creates
    assert admitted.tolist() == [True, True]
    with pytest.raises(ConfigError, match="admit_after must be >= 1"):
        rowpolicy.admit(np.array([0]), 0)


def test_three_touches_create_a_row_when_admit_after_is_three():
    pending: dict[int, int] = {}
    created = []
    for touch in range(1, 6):
        ids = np.array([7, 8]) if touch % 2 else np.array([7])  # 7 touched every time, 8 every other
        ids = np.array([i for i in ids.tolist() if i not in {r for _, r in created}], dtype=np.int64)  # rows exist
        admitted, counts = rowpolicy.admit(np.array([pending.get(int(i), 0) for i in ids]), 3)
        for i, a, c in zip(ids.tolist(), admitted.tolist(), counts.tolist()):
            if a:
                created.append((touch, i))
                pending.pop(i, None)
            else:
                pending[i] = c
    assert created == [(3, 7), (5, 8)]
    assert pending == {}


def test_pending_drops_the_oldest_down_to_the_shrink_target():
    ids = np.arange(100, 120)  # 20 entries, capacity 16: shrink to 15, drop 5
    seen = np.array([5] * 10 + [1, 2, 3, 4] + [9] * 6)
    drops = rowpolicy.pending_drops(seen, ids, 16)
    assert len(drops) == 5
    # the four oldest (seen 1..4), then one of the ten at step 5, picked by hash
    assert set(drops.tolist()) >= {10, 11, 12, 13}
    fifth = (set(drops.tolist()) - {10, 11, 12, 13}).pop()
    tied = np.arange(10)
    assert fifth == tied[np.argmin(rowpolicy.tie_break(ids[tied]))]
    assert np.all(np.diff(drops) > 0)  # positions come sorted
    assert len(rowpolicy.pending_drops(seen, ids, 20)) == 0
    with pytest.raises(ConfigError, match="capacity must be >= 1"):
        rowpolicy.pending_drops(seen, ids, 0)


def test_expired_and_sweep_due():
    assert rowpolicy.expired(np.array([0, 5, 6, 10]), 10, 5).tolist() == [True, True, False, False]
    assert rowpolicy.expired(np.array([1.0, 2.5]), 4.0, 2.0).tolist() == [True, False]
    assert [s for s in range(0, 13) if rowpolicy.sweep_due(s, 4)] == [4, 8, 12]
    assert not rowpolicy.sweep_due(3, 0)


def test_ttl_evicts_every_expired_row_above_the_floor():
    ids = np.arange(10)
    counts = np.arange(10)[::-1].copy()  # id 0 updated most
    mask = np.zeros(10, dtype=bool)
    mask[[1, 3, 5, 7]] = True
    assert rowpolicy.ttl_victims(mask, counts, ids, floor=0).tolist() == [1, 3, 5, 7]
    assert rowpolicy.ttl_victims(mask, counts, ids, floor=6).tolist() == [1, 3, 5, 7]  # 6 stay anyway
    # floor 8: two of the expired stay, the two most updated (ids 1 and 3)
    assert rowpolicy.ttl_victims(mask, counts, ids, floor=8).tolist() == [5, 7]
    assert rowpolicy.ttl_victims(mask, counts, ids, floor=10).tolist() == []
    assert rowpolicy.ttl_victims(np.zeros(10, dtype=bool), counts, ids, floor=0).tolist() == []


def test_ttl_floor_ties_go_by_hash():
    ids = np.array([11, 22, 33, 44])
    mask = np.ones(4, dtype=bool)
    victims = rowpolicy.ttl_victims(mask, np.ones(4), ids, floor=1)  # three go, the highest hash stays
    stays = ids[np.argmax(rowpolicy.tie_break(ids))]
    assert sorted(ids[victims].tolist()) == sorted(set(ids.tolist()) - {int(stays)})


def test_lfu_evicts_the_least_updated_down_to_the_target():
    ids = np.arange(200, 220)  # 20 rows, capacity 16: down to 15
    counts = np.array([3] * 20)
    counts[[0, 4, 8]] = 1
    counts[[1, 2]] = 2
    victims = rowpolicy.lfu_victims(counts, ids, capacity=16)
    assert len(victims) == 5
    assert set(victims.tolist()) == {0, 4, 8, 1, 2}
    assert len(rowpolicy.lfu_victims(counts, ids, capacity=20)) == 0
    assert len(rowpolicy.lfu_victims(counts, ids, capacity=0)) == 0  # 0: no capacity
    # the floor holds above the shrink target: 20 rows, capacity 16, floor 18 -> 2 go
    assert set(rowpolicy.lfu_victims(counts, ids, capacity=16, floor=18).tolist()) == {0, 4}
    # or is exact: floor 16 -> 4 go, and ties at count 2 by hash
    four = rowpolicy.lfu_victims(counts, ids, capacity=16, floor=16)
    assert set(four.tolist()) >= {0, 4, 8} and len(four) == 4
    assert (set(four.tolist()) - {0, 4, 8}).pop() == [1, 2][int(np.argmin(rowpolicy.tie_break(ids[[1, 2]])))]


def test_lfu_protects_rows_just_updated():
    ids = np.arange(20)
    counts = np.full(20, 5)
    counts[:4] = 1  # the four least updated were all touched by this step
    protect = np.zeros(20, dtype=bool)
    protect[:4] = True
    victims = rowpolicy.lfu_victims(counts, ids, capacity=16, protect=protect)
    assert len(victims) == 5 and not set(victims.tolist()) & {0, 1, 2, 3}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=60, unique=True),
    st.integers(1, 40),
    st.integers(0, 40),
    st.integers(0, 3),
    st.randoms(use_true_random=False),
)
def test_decisions_do_not_depend_on_the_order_rows_are_held_in(id_list, capacity, floor, top, rnd):
    ids = np.array(id_list, dtype=np.int64)
    counts = np.array([rnd.randint(0, top) for _ in id_list])
    last = np.array([rnd.randint(0, 5) for _ in id_list])
    floor = min(floor, capacity)
    perm = np.array(rnd.sample(range(len(ids)), len(ids)))

    def lfu(i, c):
        return set(i[rowpolicy.lfu_victims(c, i, capacity, floor)].tolist())

    def ttl(i, c, lst):
        return set(i[rowpolicy.ttl_victims(rowpolicy.expired(lst, 5, 3), c, i, floor)].tolist())

    assert lfu(ids, counts) == lfu(ids[perm], counts[perm])
    assert ttl(ids, counts, last) == ttl(ids[perm], counts[perm], last[perm])
    left = len(ids) - len(lfu(ids, counts))
    assert left >= min(len(ids), floor) and (len(ids) <= capacity or left == max(floor, rowpolicy.shrink_target(capacity)))
    assert len(ids) - len(ttl(ids, counts, last)) >= min(len(ids), floor)
