"""Sparse tables in the core: TableSpec, row slots, first-touch init, row rules, entry names."""

from __future__ import annotations

import json
import math

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

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


@pytest.mark.parametrize("name", ["emb.weight", "h", "features.0.weight"])
@pytest.mark.parametrize("ids", ["sequential", "int64"])
def test_row_slots_spread_evenly(name, ids):
    """10^5 ids over 256 slots: every slot within 1.5x of every other (~390 +- 20 each)."""
    values = np.arange(100_000) if ids == "sequential" else np.random.default_rng(7).integers(-(2**63), 2**63 - 1, 100_000)
    loads = np.bincount(row_slots(name, values, 256), minlength=256)
    assert loads.sum() == 100_000 and loads.max() <= 1.5 * loads.min()


def test_row_slots_depend_on_the_table():
    ids = np.arange(100_000)
    same = np.mean(row_slots("a.weight", ids, 256) == row_slots("b.weight", ids, 256))
    assert same < 0.01  # ~1/256: two tables' rows of one id land apart


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


@settings(max_examples=60, deadline=None)
@given(
    ids=st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=40),
    cut=st.integers(0, 40),
    seed=st.integers(0, 2**64 - 1),
    kind=st.sampled_from(["normal", "uniform"]),
    data=st.data(),
)
def test_init_of_a_row_depends_on_nothing_but_its_id(ids, cut, seed, kind, data):
    """Any order, any split into batches, duplicates: each row is the same."""
    spec = TableSpec(name="t.weight", dim=3, seed=seed, init=InitSpec(kind, (0.0, 1.0)))
    arr = np.array(ids, dtype=np.int64)
    whole = init_rows(spec, arr)
    perm = np.array(data.draw(st.permutations(range(len(ids)))), dtype=np.int64)
    assert np.array_equal(init_rows(spec, arr[perm]), whole[perm])
    assert np.array_equal(np.concatenate([init_rows(spec, arr[:cut]), init_rows(spec, arr[cut:])]), whole)
    one = init_rows(spec, arr[:1])
    assert np.array_equal(init_rows(spec, np.repeat(arr[:1], 3)), np.repeat(one, 3, axis=0))
    assert np.isfinite(whole).all()


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


@pytest.mark.parametrize(
    "fields, says",
    [
        ({"name": ""}, "non-empty string, got ''"),
        ({"name": 5}, "got 5 (int)"),
        ({"name": "emb#1"}, "table 'emb#1': a table's name may not hold '#'"),
        ({"name": "a/b@c"}, "may not hold '/' or '@'"),
        ({"name": "a\ud800"}, "must be valid unicode text"),
        ({"dim": 0}, "table 't': dim must be a whole number >= 1, got 0 (int)"),
        ({"dim": 2.0}, "dim must be a whole number >= 1, got 2.0 (float)"),
        ({"dim": True}, "dim must be a whole number >= 1, got True (bool)"),
        ({"dtype": "int8"}, "table 't': dtype 'int8' (str) is not a floating dtype"),
        ({"num_rows": 0}, "num_rows must be a whole number in [1, 9223372036854775808), got 0"),
        ({"num_rows": 10, "padding_idx": 10}, "padding_idx must be a whole number in [0, 10), got 10"),
        ({"num_rows": 10, "padding_idx": -1}, "padding_idx must be a whole number in [0, 10), got -1"),
        ({"padding_idx": 2**63}, "padding_idx must be a whole number in [-9223372036854775808, 9223372036854775808)"),
        ({"init": "normal"}, "init must be an InitSpec, got 'normal' (str)"),
        ({"seed": -1}, "seed must be a whole number in [0, 18446744073709551616), got -1"),
        ({"admit_after": 0}, "admit_after must be a whole number >= 1, got 0"),
        ({"pending_capacity": -1}, "pending_capacity must be a whole number >= 0, got -1"),
        ({"ttl_steps": -3}, "ttl_steps must be a whole number >= 0, got -3"),
        ({"ttl_seconds": -1}, "ttl_seconds must be a finite number of seconds >= 0, got -1.0 (float)"),
        ({"ttl_seconds": float("nan")}, "ttl_seconds must be a finite number of seconds >= 0, got nan"),
        ({"ttl_seconds": "5"}, "ttl_seconds must be a finite number of seconds >= 0, got '5' (str)"),
        ({"capacity": -1}, "capacity must be a whole number >= 0, got -1"),
        ({"capacity": 10, "floor": 11}, "table 't': floor 11 is above capacity 10"),
        ({"sweep_every": -1}, "sweep_every must be a whole number >= 0, got -1"),
    ],
)
def test_table_spec_refuses_bad_fields_by_name(fields, says):
    with pytest.raises(ConfigError) as err:
        TableSpec(**{"name": "t", "dim": 4, **fields})
    assert says in str(err.value)


@pytest.mark.parametrize(
    "kind, args, says",
    [
        ("gauss", (), "unknown init kind 'gauss' (str); the kinds are normal, uniform, zeros"),
        ("nromal", (0, 1), "did you mean 'normal'?"),
        ("normal", (0,), "init 'normal' takes (mean, std), got (0.0,)"),
        ("zeros", (1,), "init 'zeros' takes no arguments"),
        ("uniform", ("a", 1), "init 'uniform' takes (low, high), got ('a', 1.0)"),
        ("normal", (0, -1), "std must be >= 0, got -1.0"),
        ("uniform", (1, -1), "low must be <= high, got low=1.0, high=-1.0"),
        ("uniform", (0, float("inf")), "arguments must be finite, got (0.0, inf)"),
    ],
)
def test_init_spec_refuses_bad_kinds_and_arguments(kind, args, says):
    with pytest.raises(ConfigError) as err:
        InitSpec(kind, args)
    assert says in str(err.value)


def test_table_spec_from_json_refuses_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match=r"table 't': unknown field\(s\) \['dims'\]"):
        TableSpec.from_json({"name": "t", "dims": 4})
    with pytest.raises(ConfigError, match="at least a name and a dim"):
        TableSpec.from_json({"name": "t"})
    with pytest.raises(ConfigError, match="an init is"):
        TableSpec.from_json({"name": "t", "dim": 2, "init": {"kind": "normal", "std": 1}})
    assert TableSpec.from_json({"name": "t", "dim": np.int64(2)}).dim == 2  # numpy ints are whole numbers


# --- row rules ---------------------------------------------------------------------------


def test_row_rules_fill_defaults_and_name_their_state():
    assert check_row_rule("SGD", {"lr": 0.1}) == {"lr": 0.1, "maximize": False}
    assert check_row_rule("Adagrad", {}) == {"lr": 0.01, "lr_decay": 0.0, "initial_accumulator_value": 0.0, "eps": 1e-10, "maximize": False}
    assert check_row_rule("SparseAdam", {"betas": (0.5, 0.6)})["betas"] == [0.5, 0.6]
    assert check_row_rule("SGD", {"lr": 0.1, "momentum": 0, "nesterov": False}) == {"lr": 0.1, "maximize": False}
    assert ROW_RULES["Adagrad"].state == ("sum",) and ROW_RULES["SparseAdam"].state == ("exp_avg", "exp_avg_sq")
    assert ROW_RULES["RowWiseAdagrad"].state_width("acc", 16) == 1 and ROW_RULES["Adagrad"].state_width("sum", 16) == 16
    assert [row_rule_for(n) for n in ("SGD", "Adagrad", "Adam", "AdamW")] == ["SGD", "Adagrad", "SparseAdam", None]


@pytest.mark.parametrize(
    "name, args, says",
    [
        ("Adam", {}, "unknown row rule 'Adam' (str) (the row rule of 'Adam' is 'SparseAdam')"),
        ("sgd", {}, "did you mean 'SGD'?"),
        ("Lion", {}, "the row rules are SGD, Adagrad, RowWiseAdagrad, SparseAdam"),
        ("Adagrad", {"lr_dcay": 0.1}, "row rule 'Adagrad' takes no argument 'lr_dcay' (did you mean 'lr_decay'?)"),
        ("SGD", {"zzz": 1}, "takes no argument 'zzz' (it takes lr, maximize)"),
        ("SGD", {"momentum": 0.9}, "row rule 'SGD': argument momentum=0.9 is refused: torch turns the step dense"),
        ("SGD", {"dampening": 0.1}, "argument dampening=0.1 is refused"),
        ("SGD", {"nesterov": True}, "argument nesterov=True is refused"),
        ("SGD", {"weight_decay": 1e-4}, "argument weight_decay=0.0001 is refused: torch turns the step dense"),
        ("Adagrad", {"weight_decay": 0.1}, "'weight_decay option is not compatible with sparse gradients'"),
        ("SparseAdam", {"amsgrad": True}, "argument amsgrad=True is refused: torch.optim.SparseAdam has no amsgrad"),
        ("SparseAdam", {"foreach": True}, "argument foreach=True is refused: a pserver chooses the kernels"),
        ("SGD", {"lr": -0.1}, "row rule 'SGD': lr must be >= 0, got -0.1"),
        ("SparseAdam", {"lr": 0}, "row rule 'SparseAdam': lr must be > 0, got 0"),
        ("SparseAdam", {"eps": 0.0}, "eps must be > 0, got 0.0"),
        ("Adagrad", {"eps": -1e-10}, "eps must be >= 0, got -1e-10"),
        ("Adagrad", {"lr_decay": -1}, "lr_decay must be >= 0, got -1"),
        ("RowWiseAdagrad", {"initial_accumulator_value": -1}, "initial_accumulator_value must be >= 0"),
        ("SparseAdam", {"betas": [1.0, 0.9]}, "betas[0] must be in [0, 1), got 1.0"),
        ("SparseAdam", {"betas": [0.9, -0.1]}, "betas[1] must be in [0, 1), got -0.1"),
        ("SparseAdam", {"betas": [0.9]}, "betas must be a pair [beta1, beta2], got [0.9] (list)"),
        ("SGD", {"maximize": "yes"}, "maximize must be true or false, got 'yes' (str)"),
        ("SparseAdam", {"row_steps": 1}, "row_steps must be true or false, got 1 (int)"),
        ("SGD", {"lr": "0.1"}, "lr must be a finite number, got '0.1' (str)"),
        ("SGD", {"lr": True}, "lr must be a finite number, got True (bool)"),
        ("SGD", {"lr": float("nan")}, "lr must be a finite number, got nan"),
        ("SGD", [("lr", 0.1)], "its arguments must be a mapping"),
    ],
)
def test_row_rules_refuse_with_the_name_and_the_value(name, args, says):
    with pytest.raises(ConfigError) as err:
        check_row_rule(name, args)
    assert says in str(err.value)


def test_row_rule_results_are_json_safe_and_none_is_no_arguments():
    for name in ROW_RULES:
        args = check_row_rule(name, None)
        assert json.loads(json.dumps(args)) == args and args == dict(ROW_RULES[name].defaults)
    assert check_row_rule("RowWiseAdagrad", {"lr": 1}) == {"lr": 1.0, "eps": 1e-8, "initial_accumulator_value": 0.0}
    with pytest.raises(KeyError, match="keeps no state 'sum'"):
        ROW_RULES["SGD"].state_width("sum", 4)


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


TABLE_NAMES = st.text(st.characters(blacklist_characters="#/@", blacklist_categories=("Cs",)), min_size=1, max_size=12)


@settings(max_examples=80, deadline=None)
@given(
    table=TABLE_NAMES,
    slot=st.integers(0, 10**6),
    kind=st.sampled_from(["ids", "values", "count", "last_age", "pending_ids", "pending_counts", "state.sum", "state.exp_avg"]),
    first=st.integers(0, 10**6),
    rows=st.integers(1, 10**6),
    what=st.sampled_from(["values", "state.exp_avg", "scalar.step"]),
)
def test_row_and_block_entry_names_never_collide(table, slot, kind, first, rows, what):
    row, scalar = row_entry(table, slot, kind), table_entry(table, "step")
    assert parse_row_entry(row) == (table, slot, kind) and parse_table_entry(scalar) == (table, "step")
    assert parse_entry(row) is None and parse_entry(scalar) is None
    assert parse_table_entry(row) is None and parse_row_entry(scalar) is None
    # a block of a parameter of the same name (a table's name is a parameter name)
    block = f"{table}@{first}:{first + rows}/{what}"
    assert parse_entry(block) == (table, first, first + rows, what)
    assert parse_row_entry(block) is None and parse_table_entry(block) is None


def test_entry_names_refuse_what_would_not_parse_back():
    for call, says in [
        (lambda: row_entry("t", 1, "idz"), "'idz' is no kind of row entry"),
        (lambda: row_entry("t", 1, "state."), "no kind of row entry"),
        (lambda: row_entry("t", -1, "ids"), "a slot is a whole number >= 0, got -1"),
        (lambda: table_entry("t", "a/b"), "no name of a table scalar"),
    ]:
        with pytest.raises(ValueError, match=says):
            call()
    with pytest.raises(ConfigError, match="may not hold '#'"):
        row_entry("t#", 1, "ids")


def test_check_tables_refuses_duplicates_and_ttl_seconds_with_replicas():
    check_tables([TableSpec(name="a", dim=2, ttl_seconds=5.0)], replicas=1)
    with pytest.raises(ConfigError, match="'a'"):
        check_tables([TableSpec(name="a", dim=2), TableSpec(name="a", dim=3)])
    with pytest.raises(ConfigError, match="ttl_seconds=5.0 .*replicas=2.*ttl_steps"):
        check_tables([TableSpec(name="a", dim=2, ttl_seconds=5.0)], replicas=2)


@pytest.mark.parametrize(
    "fields,match",
    [
        ({"capacity": 100}, "capacity=100 cannot run with replicas=2"),
        ({"capacity": 100, "floor": 10}, "capacity=100 and floor=10 cannot run with replicas=2"),
        ({"admit_after": 3}, "admit_after=3 cannot run with replicas=2"),
    ],
)
def test_check_tables_refuses_policies_that_rank_a_pservers_rows_with_replicas(fields, match):
    spec = TableSpec(name="a", dim=2, **fields)
    check_tables([spec], replicas=1, asynchronous=True)
    with pytest.raises(ConfigError, match=f"table 'a': {match}.*backup holds other slots' rows"):
        check_tables([spec], replicas=2)


def test_check_tables_refuses_ttl_steps_with_replicas_in_async_jobs_only():
    spec = TableSpec(name="a", dim=2, ttl_steps=8)
    check_tables([spec], replicas=2)  # sync: every copy's table step moves in the same rounds
    check_tables([spec], replicas=1, asynchronous=True)
    with pytest.raises(ConfigError, match="table 'a': ttl_steps=8 cannot run in an async job with replicas=2"):
        check_tables([spec], replicas=2, asynchronous=True)
