"""Blocks, slots and the slot map: pure functions, checked by example and by property."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import textwrap

import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from pdps.core.errors import ConfigError
from pdps.core.slots import (
    DEFAULT_NUM_SLOTS,
    Block,
    Layout,
    ParamSpec,
    SlotMap,
    block_floor,
    cut_blocks,
    slot_of,
)

# --- cut_blocks ---------------------------------------------------------------------


def test_blocks_are_whole_rows_of_at_least_min_block():
    p = ParamSpec("w", (10, 3), "float32")  # 30 elements, 3 per row
    blocks = cut_blocks([p], min_block=7)  # 3 rows (9 elements) per block
    assert [(b.row_start, b.row_end) for b in blocks] == [(0, 3), (3, 6), (6, 10)]  # tail row joined
    assert [b.numel for b in blocks] == [9, 9, 12]
    assert [b.offset for b in blocks] == [0, 9, 18]
    assert [b.shape for b in blocks] == [(3, 3), (3, 3), (4, 3)]
    assert [b.key for b in blocks] == ["w@0", "w@3", "w@6"]
    assert blocks[2].describe() == "w[6:10]"
    assert all(b.param == "w" and b.index == 0 and b.dtype == "float32" for b in blocks)


def test_tail_that_fills_a_block_stays_its_own_block():
    blocks = cut_blocks([ParamSpec("w", (9, 3), "float32")], min_block=7)
    assert [(b.row_start, b.row_end) for b in blocks] == [(0, 3), (3, 6), (6, 9)]


def test_parameter_smaller_than_min_block_is_one_block():
    blocks = cut_blocks([ParamSpec("b", (5,), "float16")], min_block=4096)
    assert blocks == [Block("b", 0, 0, 5, 0, 5, (5,), "float16")]


def test_row_wider_than_min_block_gives_one_row_per_block():
    blocks = cut_blocks([ParamSpec("emb", (3, 100), "float32")], min_block=10)
    assert [(b.row_start, b.row_end, b.numel, b.offset) for b in blocks] == [(0, 1, 100, 0), (1, 2, 100, 100), (2, 3, 100, 200)]


def test_scalar_and_1d_parameters():
    params = [ParamSpec("scale", (), "float32"), ParamSpec("bias", (10,), "float64"), ParamSpec("t", (), "bfloat16")]
    blocks = cut_blocks(params, min_block=4)
    assert blocks[0] == Block("scale", 0, 0, 1, 0, 1, (), "float32")
    assert [(b.row_start, b.row_end, b.offset, b.shape) for b in blocks[1:3]] == [(0, 4, 1, (4,)), (4, 10, 5, (6,))]
    assert blocks[3] == Block("t", 2, 0, 1, 11, 1, (), "bfloat16")


def test_empty_parameter_is_one_empty_block():
    blocks = cut_blocks([ParamSpec("a", (2,), "float32"), ParamSpec("z", (0, 4), "float32"), ParamSpec("c", (3,), "float32")], 1)
    z = [b for b in blocks if b.param == "z"]
    assert len(z) == 1 and z[0].numel == 0 and z[0].offset == 2
    assert [b.offset for b in blocks if b.param == "c"] == [2, 3, 4]


def test_cut_blocks_config_errors():
    with pytest.raises(ConfigError):
        cut_blocks([ParamSpec("w", (4,), "float32")], min_block=0)
    with pytest.raises(ConfigError, match="unique"):
        cut_blocks([ParamSpec("w", (4,), "float32"), ParamSpec("w", (2,), "float32")])
    with pytest.raises(ConfigError, match="dtype"):
        ParamSpec("w", (4,), "int64")
    with pytest.raises(ConfigError, match="negative"):
        ParamSpec("w", (4, -1), "float32")


shapes = st.lists(st.integers(0, 9), min_size=0, max_size=3).map(tuple)
models = st.lists(shapes, min_size=1, max_size=5).map(
    lambda ss: [ParamSpec(f"p{i}", s, "float32") for i, s in enumerate(ss)]
)


@settings(max_examples=200, deadline=None)
@given(params=models, min_block=st.integers(1, 40))
def test_blocks_tile_the_flat_model_exactly(params, min_block):
    blocks = cut_blocks(params, min_block)
    # contiguous, in order, covering [0, total)
    offset = 0
    for b in blocks:
        assert b.offset == offset
        offset += b.numel
    assert offset == sum(p.numel for p in params)
    for index, p in enumerate(params):
        mine = [b for b in blocks if b.param == p.name]
        assert all(b.index == index for b in mine)
        # rows [0, rows) covered by consecutive whole-row blocks
        assert mine[0].row_start == 0 and mine[-1].row_end == p.rows
        assert all(x.row_end == y.row_start for x, y in zip(mine, mine[1:]))
        for b in mine:
            assert b.numel == (b.row_end - b.row_start) * p.row_numel if p.shape else b.numel == 1
            assert b.shape == ((b.row_end - b.row_start, *p.shape[1:]) if p.shape else ())
            assert b.offset == sum(q.numel for q in params[:index]) + b.row_start * p.row_numel
        # only a whole parameter may be smaller than min_block
        if len(mine) > 1:
            assert all(b.numel >= min_block for b in mine)
            # and a block is never a whole extra block too big: dropping its last row
            # would fall below min_block, except for the one holding the merged tail
            assert all((b.row_end - b.row_start - 1) * p.row_numel < min_block for b in mine[:-1])


# --- slot_of ------------------------------------------------------------------------


def test_slot_of_is_deterministic_and_in_range():
    keys = [f"layer{i}.weight@{r}" for i in range(20) for r in (0, 128)]
    first = [slot_of(k, 256) for k in keys]
    assert first == [slot_of(k, 256) for k in keys]
    assert all(0 <= s < 256 for s in first)
    assert len(set(first)) > 10  # it spreads keys, it does not map them all to one slot
    assert slot_of("anything", 1) == 0


_LAYOUT_SCRIPT = textwrap.dedent(
    """
    import json
    from pdps.core.slots import Layout, ParamSpec, SlotMap
    params = [ParamSpec("emb", (1000, 64), "float32"), ParamSpec("fc.weight", (64, 64), "float32"),
              ParamSpec("fc.bias", (64,), "float32"), ParamSpec("scale", (), "float32")]
    layout = Layout.build(params, SlotMap.initial(3).rebalance(5), min_block=1024)
    print(json.dumps({"keys": [b.key for b in layout.blocks], "slots": list(layout.slots),
                      "owners": [layout.pserver_of(i) for i in range(len(layout.blocks))],
                      "hash": hash("emb@0")}))
    """
)


def test_layout_is_the_same_in_another_process():
    runs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _LAYOUT_SCRIPT], env=env, capture_output=True, text=True, check=True, timeout=60)
        runs.append(json.loads(out.stdout))
    # the salted str hash does differ between the two processes ...
    assert runs[0]["hash"] != runs[1]["hash"]
    # ... and the layout does not, nor does it differ from this process's
    here = {}
    exec(_LAYOUT_SCRIPT.replace("print(", "here['out'] = ("), {"here": here})
    local = json.loads(here["out"])
    for r in runs:
        assert {k: r[k] for k in ("keys", "slots", "owners")} == {k: local[k] for k in ("keys", "slots", "owners")}
    assert len(local["keys"]) > 10


# --- SlotMap ------------------------------------------------------------------------


def balanced(m: SlotMap) -> bool:
    load = m.load()
    return max(load) - min(load) <= 1 and sum(load) == m.num_slots


def min_moves(old: SlotMap, m: int) -> int:
    """The fewest slots any balanced map on ``m`` pservers must move away from ``old``.

    A balanced map gives every pserver ``S // m`` or one more, with exactly ``S % m``
    of the larger quotas; a pserver keeps at most min(have, quota) of its slots, and
    the larger quotas keep the most when they go to the pservers holding the most.
    """
    s = old.num_slots
    have = [sum(1 for o in old.owners if o == p) for p in range(m)]
    base, extra = divmod(s, m)
    order = sorted(have, reverse=True)
    overlap = sum(min(h, base + 1) for h in order[:extra]) + sum(min(h, base) for h in order[extra:])
    return s - overlap


def brute_min_moves(old: SlotMap, m: int) -> int:
    """The same bound by trying every choice of which pservers get the larger quota."""
    s = old.num_slots
    have = [sum(1 for o in old.owners if o == p) for p in range(m)]
    base, extra = divmod(s, m)
    best = 0
    for big in itertools.combinations(range(m), extra):
        best = max(best, sum(min(have[p], base + (p in big)) for p in range(m)))
    return s - best


@st.composite
def slot_maps(draw, balanced_only: bool = True):
    num_slots = draw(st.integers(1, 64))
    n = draw(st.integers(1, min(num_slots, 12)))
    if balanced_only:
        m = SlotMap.initial(n, num_slots)
        for k in draw(st.lists(st.integers(1, min(num_slots, 12)), max_size=3)):
            m = m.rebalance(k)
        return m
    owners = draw(st.lists(st.integers(0, n - 1), min_size=num_slots, max_size=num_slots))
    return SlotMap(version=draw(st.integers(1, 5)), num_pservers=n, owners=owners)


def test_initial_map_is_round_robin():
    m = SlotMap.initial(3, num_slots=7)
    assert m == SlotMap(version=1, num_pservers=3, owners=(0, 1, 2, 0, 1, 2, 0))
    assert m.load() == [3, 2, 2]
    assert SlotMap.initial(2).num_slots == DEFAULT_NUM_SLOTS


@settings(max_examples=150, deadline=None)
@given(num_slots=st.integers(1, 300), data=st.data())
def test_initial_map_is_balanced(num_slots, data):
    n = data.draw(st.integers(1, min(num_slots, 40)))
    m = SlotMap.initial(n, num_slots)
    assert m.num_slots == num_slots and m.num_pservers == n and m.version == 1
    assert balanced(m)


@settings(max_examples=300, deadline=None)
@given(old=slot_maps(), data=st.data())
def test_rebalance_is_balanced_and_moves_the_minimum(old, data):
    m = data.draw(st.integers(1, old.num_slots))
    new = old.rebalance(m)
    assert new.num_pservers == m and new.num_slots == old.num_slots
    assert new.version == old.version + 1
    assert balanced(new)
    assert old.moved(new) == min_moves(old, m)
    # a slot moves only off a removed pserver or off one holding more than its share
    for s, (a, b) in enumerate(zip(old.owners, new.owners)):
        if a != b and a < m:
            assert old.load()[a] > new.load()[a]


@settings(max_examples=150, deadline=None)
@given(old=slot_maps(balanced_only=False), data=st.data())
def test_rebalance_from_any_map_moves_the_minimum(old, data):
    m = data.draw(st.integers(1, min(old.num_slots, 8)))
    new = old.rebalance(m)
    assert balanced(new)
    assert old.moved(new) == min_moves(old, m) == brute_min_moves(old, m)


def test_rebalance_examples():
    four = SlotMap.initial(4, num_slots=8)  # 0 1 2 3 0 1 2 3
    three = four.rebalance(3)
    assert three.load() == [3, 3, 2] and three.version == 2
    assert four.moved(three) == 2  # only pserver 3's two slots move
    assert [o for o, p in zip(four.owners, three.owners) if o != p] == [3, 3]
    back = three.rebalance(4)
    assert back.load() == [2, 2, 2, 2] and three.moved(back) == 2


@settings(max_examples=100, deadline=None)
@given(old=slot_maps())
def test_rebalance_to_the_same_count_moves_nothing(old):
    new = old.rebalance(old.num_pservers)
    assert new.owners == old.owners
    assert new.version == old.version + 1


def test_slot_map_config_errors():
    for n in (0, -1):
        with pytest.raises(ConfigError, match="at least one pserver"):
            SlotMap.initial(n)
    with pytest.raises(ConfigError):
        SlotMap.initial(3, num_slots=0)
    with pytest.raises(ConfigError):
        SlotMap.initial(5, num_slots=4)
    m = SlotMap.initial(2, num_slots=4)
    with pytest.raises(ConfigError):
        m.rebalance(0)
    with pytest.raises(ConfigError):
        m.rebalance(5)
    with pytest.raises(ConfigError, match="out of range"):
        SlotMap(version=1, num_pservers=2, owners=(0, 2))


@settings(max_examples=50, deadline=None)
@given(m=slot_maps(balanced_only=False))
def test_slot_map_json_round_trip(m):
    assert SlotMap.from_json(json.loads(json.dumps(m.to_json()))) == m


@settings(max_examples=50, deadline=None)
@given(params=models)
def test_param_spec_json_round_trip(params):
    assert [ParamSpec.from_json(json.loads(json.dumps(p.to_json()))) for p in params] == params


# --- Layout -------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(params=models, min_block=st.integers(1, 20), old=slot_maps())
def test_layout_blocks_of_partitions_all_blocks(params, min_block, old):
    layout = Layout.build(params, old, min_block)
    # each block sits in its hash slot, but for the few moved to pservers that had none
    moved = [i for i, b in enumerate(layout.blocks) if layout.slots[i] != slot_of(b.key, old.num_slots)]
    assert len(moved) < old.placement.num_pservers
    per = [layout.blocks_of(p) for p in range(old.num_pservers)]
    assert sum(len(x) for x in per) == len(layout.blocks)
    seen = [b for x in per for b in x]
    assert sorted(seen, key=lambda b: (b.offset, b.index)) == list(layout.blocks)
    for p, mine in enumerate(per):
        # model order, and each block on the pserver its slot maps to
        assert [b.offset for b in mine] == sorted(b.offset for b in mine)
        assert all(layout.pserver_of(layout.blocks.index(b)) == p for b in mine)


# --- spreading a model over every pserver ----------------------------------------------


def spec(*named_shapes: tuple[str, tuple[int, ...]]) -> list[ParamSpec]:
    return [ParamSpec(name, shape, "float32") for name, shape in named_shapes]


LOGISTIC = spec(("weight", (2, 20)), ("bias", (2,)))  # nn.Linear(20, 2)
MLP = spec(("0.weight", (32, 64)), ("0.bias", (32,)), ("2.weight", (10, 32)), ("2.bias", (10,)))  # 64-32-10


def holding(layout: Layout) -> list[int]:
    """The pservers that hold at least one element of the model."""
    return [p for p in range(layout.slot_map.num_pservers) if any(b.numel for b in layout.blocks_of(p))]


@pytest.mark.parametrize("params,pservers", [(LOGISTIC, 2), (MLP, 3)], ids=["logistic-2", "mlp-3"])
def test_a_small_model_gives_every_pserver_a_share(params, pservers):
    layout = Layout.build(params, SlotMap.initial(pservers))  # the default min_block, 4096
    assert holding(layout) == list(range(pservers))
    assert layout.idle_pservers == () and layout.spread_warning() is None


def test_a_model_with_fewer_rows_than_pservers_says_which_pservers_idle():
    layout = Layout.build(spec(("bias", (1,))), SlotMap.initial(3))
    assert len(layout.blocks) == 1 and len(holding(layout)) == 1
    assert layout.idle_pservers == tuple(p for p in range(3) if p not in holding(layout))
    warning = layout.spread_warning()
    assert warning is not None and "2 of 3 pservers hold no part of the model" in warning
    assert "1 row" in warning and "at most 1 pserver" in warning


def test_a_big_model_keeps_the_blocks_of_min_block():
    params = spec(("emb", (10000, 64)), ("fc.weight", (256, 64)), ("fc.bias", (256,)))
    for pservers in (1, 4, 16):
        layout = Layout.build(params, SlotMap.initial(pservers))
        assert block_floor(params, pservers, 4096) == 4096
        assert layout.blocks == tuple(cut_blocks(params, 4096))
        assert layout.slots == tuple(slot_of(b.key, 256) for b in layout.blocks)
        assert layout.idle_pservers == ()


def test_block_floor_shrinks_for_a_small_model_and_never_passes_min_block():
    assert block_floor(LOGISTIC, 1, 4096) == 6  # 42 elements in about 8 blocks
    assert block_floor(MLP, 3, 4096) == 101  # 2410 elements in about 24 blocks
    assert block_floor(MLP, 3, 50) == 50
    assert block_floor(spec(("bias", (1,))), 3, 4096) == 1
    with pytest.raises(ConfigError):
        block_floor(MLP, 0, 4096)


@st.composite
def spread_cases(draw):
    params = draw(
        st.lists(st.lists(st.integers(0, 40), min_size=0, max_size=3).map(tuple), min_size=1, max_size=6).map(
            lambda ss: [ParamSpec(f"p{i}", s, "float32") for i, s in enumerate(ss)]
        )
    )
    num_slots = draw(st.integers(1, 64))
    return params, SlotMap.initial(draw(st.integers(1, min(num_slots, 12))), num_slots), draw(st.integers(1, 5000))


@settings(max_examples=100, deadline=None)
@given(params=models, min_block=st.integers(1, 20), first=slot_maps(), sizes=st.lists(st.integers(1, 12), min_size=1, max_size=4))
def test_a_resized_map_moves_slots_never_blocks(params, min_block, first, sizes):
    """Elastic resizing re-places slots only: the blocks, and the slot of each, stay
    those of the job's first map, whatever the pserver count becomes."""
    first = SlotMap.initial(first.num_pservers, first.num_slots)
    before = Layout.build(params, first, min_block)
    resized = first
    for m in sizes:
        resized = resized.rebalance(min(m, first.num_slots))
        assert resized.base == first.num_pservers
        after = Layout.build(params, SlotMap.from_json(json.loads(json.dumps(resized.to_json()))), min_block)
        assert after.blocks == before.blocks and after.slots == before.slots
        assert all(after.pserver_of(i) == resized.owners[s] for i, s in enumerate(after.slots))


@settings(max_examples=300, deadline=None)
@given(case=spread_cases())
def test_every_pserver_gets_a_share_when_the_model_has_the_rows(case):
    params, slot_map, min_block = case
    layout = Layout.build(params, slot_map, min_block)
    m = slot_map.num_pservers
    rows = sum(p.rows for p in params if p.numel)
    held = holding(layout)
    assert len(held) == min(rows, m)
    assert layout.idle_pservers == tuple(p for p in range(m) if p not in held)
    assert (layout.spread_warning() is None) == (rows >= m)
    # bounded: the blocks of min_block, or a few per pserver, plus a few per parameter
    total = sum(p.numel for p in params)
    assert len(layout.blocks) <= max(-(-total // min_block), 8 * m) + 3 * len(params)
    # the same map from the same inputs
    assert Layout.build(params, SlotMap.from_json(slot_map.to_json()), min_block) == layout


def test_a_pserver_without_slots_is_named_idle_for_that_reason():
    layout = Layout.build(MLP, SlotMap(version=1, num_pservers=3, owners=(0, 1, 0, 1)))
    assert layout.idle_pservers == (2,) and holding(layout) == [0, 1]
    assert layout.spread_warning() == "1 of 3 pservers hold no part of the model (pserver 2): the slot map gives them no slot"
