"""Sparse tables in the core: TableSpec, row slots, first-touch init, row rules, entry names."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pdps.core.errors import ConfigError
from pdps.core.slots import parse_entry
from pdps.core.tables import (
    DEFAULT_PENDING_CAPACITY,
    ROW_RULES,
    InitSpec,
    TableSpec,
    check_row_rule,
    check_tables,
    init_rows,
    parse_row_entry,
    parse_table_entry,
    row_entry,
    row_rule_for,
    row_slots,
    splitmix64,
    table_entry,
    table_salt,
)

M64 = (1 << 64) - 1
GAMMA = 0x9E3779B97F4A7C15


def sm64(x: int) -> int:
    """splitmix64's first output from seed x, in Python ints (the reference)."""
    z = (x + GAMMA) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def draw(spec: TableSpec, row: int, k: int) -> int:
    key = sm64(sm64(spec.seed ^ table_salt(spec.name)) ^ (row & M64))
    return sm64((key + k * GAMMA) & M64)


# --- hashing and slots -------------------------------------------------------------------


def test_splitmix64_is_the_reference_generator():
    # splitmix64 seeded with 0 gives 0xE220A8397B1DCDAF first (Vigna's reference)
    assert int(splitmix64(0)) == 0xE220A8397B1DCDAF
    xs = [0, 1, 2**63, M64, 12345678901234567]
    assert [int(v) for v in splitmix64(np.array(xs, dtype=np.uint64))] == [sm64(x) for x in xs]


def test_table_salt_is_blake2b_not_python_hash():
    import hashlib

    assert table_salt("emb.weight") == int.from_bytes(hashlib.blake2b(b"emb.weight", digest_size=8).digest(), "big")
    assert table_salt("emb.weight") != table_salt("emb2.weight")


def test_row_slots_match_the_formula_for_any_int64():
    ids = np.array([0, 1, -1, 2**63 - 1, -(2**63), 99991], dtype=np.int64)
    slots = row_slots("t", ids, 256)
    assert slots.dtype == np.int64 and slots.shape == ids.shape
    assert slots.tolist() == [sm64((int(i) & M64) ^ table_salt("t")) % 256 for i in ids]
    assert row_slots("t", ids.reshape(2, 3), 7).shape == (2, 3)
    assert row_slots("t", np.array([], dtype=np.int64), 7).shape == (0,)
    with pytest.raises(ConfigError, match="num_slots"):
        row_slots("t", ids, 0)
    with pytest.raises(ValueError, match="integers"):
        row_slots("t", np.array([1.5]), 8)


# --- init --------------------------------------------------------------------------------


def test_uniform_init_is_bit_exact_against_the_formula():
    spec = TableSpec(name="h.weight", dim=5, init=InitSpec("uniform", (-0.25, 0.5)), seed=7)
    ids = np.array([3, -9, 2**62 + 5, 0], dtype=np.int64)
    got = init_rows(spec, ids)
    want = [[-0.25 + (0.5 - -0.25) * ((draw(spec, int(i), j) >> 11) * 2.0**-53) for j in range(5)] for i in ids]
    assert got.dtype == np.float64 and got.shape == (4, 5)
    assert got.tolist() == want  # exact equality, not approx


def test_normal_init_is_box_muller_of_two_uniforms():
    spec = TableSpec(name="e.weight", dim=3, init=InitSpec("normal", (0.5, 2.0)), seed=1)
    got = init_rows(spec, np.array([11], dtype=np.int64))[0]
    for j in range(3):
        u1 = ((draw(spec, 11, 2 * j) >> 11) + 1) * 2.0**-53
        u2 = (draw(spec, 11, 2 * j + 1) >> 11) * 2.0**-53
        assert got[j] == pytest.approx(0.5 + 2.0 * math.sqrt(-2 * math.log(u1)) * math.cos(2 * math.pi * u2), rel=1e-14)


def test_init_is_the_same_whatever_the_order_or_split_of_ids():
    spec = TableSpec(name="e.weight", dim=4, seed=3)
    ids = np.arange(-50, 150, dtype=np.int64)
    whole = init_rows(spec, ids)
    perm = np.random.default_rng(0).permutation(ids.size)
    assert np.array_equal(init_rows(spec, ids[perm]), whole[perm])
    parts = np.concatenate([init_rows(spec, ids[a:b]) for a, b in [(0, 1), (1, 77), (77, 200)]])
    assert np.array_equal(parts, whole)


def test_init_differs_by_seed_and_table_and_padding_row_is_zero():
    ids = np.arange(10, dtype=np.int64)
    a = init_rows(TableSpec(name="a", dim=4, num_rows=10, padding_idx=2), ids)
    assert not a[2].any() and np.count_nonzero(a) == 9 * 4
    assert not np.array_equal(a, init_rows(TableSpec(name="b", dim=4), ids))
    assert not np.array_equal(init_rows(TableSpec(name="a", dim=4, seed=1), ids)[3], a[3])
    assert not init_rows(TableSpec(name="z", dim=4, init=InitSpec("zeros")), ids).any()
    assert init_rows(TableSpec(name="z", dim=4), np.array([], dtype=np.int64)).shape == (0, 4)


def test_normal_init_has_the_asked_moments():
    rows = init_rows(TableSpec(name="e", dim=8, init=InitSpec("normal", (1.0, 3.0))), np.arange(20_000))
    assert rows.mean() == pytest.approx(1.0, abs=0.05) and rows.std() == pytest.approx(3.0, rel=0.02)
    u = init_rows(TableSpec(name="u", dim=8, init=InitSpec("uniform", (-2.0, 1.0))), np.arange(20_000))
    assert u.min() >= -2.0 and u.max() < 1.0 and u.mean() == pytest.approx(-0.5, abs=0.02)


# --- TableSpec ---------------------------------------------------------------------------


def test_table_spec_round_trips_through_json():
    spec = TableSpec(
        name="emb.weight", dim=16, dtype="float64", num_rows=1000, padding_idx=0, init=InitSpec("uniform", (-0.1, 0.1)),
        seed=5, admit_after=3, pending_capacity=10, ttl_steps=80, capacity=500, floor=100, sweep_every=4,
    )
    assert TableSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert spec.bounded and spec.sweep_period == 4 and spec.itemsize == 8 and spec.row_bytes == 128
    h = TableSpec(name="h", dim=3, ttl_steps=20)
    assert not h.bounded and h.sweep_period == 2 and h.pending_limit == DEFAULT_PENDING_CAPACITY
    assert TableSpec(name="h", dim=3).sweep_period == 1 and h.init == InitSpec("normal", (0.0, 1.0))


# --- row rules ---------------------------------------------------------------------------


def test_row_rules_fill_defaults_and_name_their_state():
    assert check_row_rule("SGD", {"lr": 0.1}) == {"lr": 0.1, "maximize": False}
    assert check_row_rule("Adagrad", {}) == {"lr": 0.01, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False}
    assert check_row_rule("SparseAdam", {"betas": (0.5, 0.6)})["betas"] == [0.5, 0.6]
    assert check_row_rule("SGD", {"lr": 0.1, "momentum": 0, "nesterov": False}) == {"lr": 0.1, "maximize": False}
    assert ROW_RULES["Adagrad"].state == ("sum",) and ROW_RULES["SparseAdam"].state == ("exp_avg", "exp_avg_sq")
    assert ROW_RULES["RowWiseAdagrad"].state_width("acc", 16) == 1 and ROW_RULES["Adagrad"].state_width("sum", 16) == 16
    assert [row_rule_for(n) for n in ("SGD", "Adagrad", "Adam", "AdamW")] == ["SGD", "Adagrad", "SparseAdam", None]


# --- entry names -------------------------------------------------------------------------


def test_entry_names_parse_back_and_never_pass_for_blocks():
    for kind in ("ids", "values", "state.sum", "count", "last_age", "pending_ids", "pending_counts"):
        name = row_entry("emb.weight", 17, kind)
        assert name == f"emb.weight#17/{kind}"
        assert parse_row_entry(name) == ("emb.weight", 17, kind)
        assert parse_entry(name) is None and parse_table_entry(name) is None
    assert table_entry("emb.weight", "step") == "emb.weight/scalar.step"
    assert parse_table_entry("emb.weight/scalar.step") == ("emb.weight", "step")
    assert parse_row_entry("emb.weight/scalar.step") is None and parse_entry("emb.weight/scalar.step") is None
    for block in ("fc.weight@0:10/values", "fc.weight@0:10/state.exp_avg", "fc.weight@0:10/scalar.step"):
        assert parse_entry(block) is not None
        assert parse_row_entry(block) is None and parse_table_entry(block) is None
    for bad in ("t#x/ids", "t#1/idz", "#1/ids", "t#1", "t#-1/ids", "t#1/state.", "t/scalar.", "t/values"):
        assert parse_row_entry(bad) is None and parse_table_entry(bad) is None


def test_check_tables_refuses_duplicates_and_ttl_seconds_with_replicas():
    check_tables([TableSpec(name="a", dim=2, ttl_seconds=5.0)], replicas=1)
    with pytest.raises(ConfigError, match="'a'"):
        check_tables([TableSpec(name="a", dim=2), TableSpec(name="a", dim=3)])
    with pytest.raises(ConfigError, match="ttl_seconds=5.0 .*replicas=2.*ttl_steps"):
        check_tables([TableSpec(name="a", dim=2, ttl_seconds=5.0)], replicas=2)
