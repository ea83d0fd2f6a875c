"""TorchRows: the row store of a table on a pserver, against torch on a full table.

Every rule is compared with torch stepping a whole ``[1000, 8]`` float64 table with
``sparse=True`` gradients; refusals are checked to change nothing; export/import is
checked to be the identity across any cut of the slots; admission and eviction are
counted on scripted ids. Every test runs on both layouts of the store: small chunks (64
rows, so gathers and scatters cross chunks: the layout off the CPU) and flat (the CPU's).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pdps.adapters.torch_compute import TorchCompute
from pdps.adapters.torch_rows import TorchRows
from pdps.core import rowpolicy
from pdps.core.errors import BadRequest, ConfigError, GradientRejected
from pdps.core.tables import TableSpec, init_rows, row_slots
from pdps.ports.compute import RowShard

N, DIM, SLOTS = 1000, 8, 16
SPEC = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N)


LAYOUT = {"chunk_rows": 64}


@pytest.fixture(autouse=True, params=[64, None], ids=["chunks-of-64", "flat"])
def layout(request):
    LAYOUT["chunk_rows"] = request.param
    yield request.param
    LAYOUT["chunk_rows"] = 64


def store(spec: TableSpec = SPEC, rule: str = "SGD", args: dict | None = None, slots=range(SLOTS), **kw) -> TorchRows:
    kw.setdefault("chunk_rows", LAYOUT["chunk_rows"])
    return TorchRows(spec, rule, args or {}, slots, SLOTS, **kw)


def section(rng: np.random.Generator, n: int, dim: int = DIM, high: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    ids = np.unique(rng.integers(0, high, n))
    return torch.from_numpy(ids), torch.from_numpy(rng.standard_normal((len(ids), dim)))


def exported(r: TorchRows, slots=range(SLOTS)) -> dict[str, np.ndarray]:
    return {k: v.numpy().copy() for k, v in r.export_slots(slots)[0].items()}


def assert_same_entries(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y), k


def test_the_torch_compute_builds_a_row_shard():
    r = TorchCompute("cpu").rows(SPEC, "Adagrad", {"lr": 0.1}, range(4), 4, lambda: 0.0, max_ids=10)
    assert isinstance(r, RowShard) and isinstance(r, TorchRows)
    assert r.slots == frozenset(range(4)) and r.max_ids == 10 and r.step == 0
    with pytest.raises(ConfigError, match="unknown row rule 'Adam'.*SparseAdam"):
        TorchCompute("cpu").rows(SPEC, "Adam", {}, range(4), 4, lambda: 0.0)
    with pytest.raises(ConfigError, match="momentum"):
        store(rule="SGD", args={"momentum": 0.9})


# --- the rules against torch -------------------------------------------------------------------

RULES = [
    ("SGD", {"lr": 0.3}, torch.optim.SGD),
    ("Adagrad", {"lr": 0.2, "lr_decay": 0.1, "initial_accumulator_value": 0.05}, torch.optim.Adagrad),
    ("SparseAdam", {"lr": 0.05, "betas": [0.8, 0.9]}, torch.optim.SparseAdam),
]
# one round per step: (trainer, weight) pairs, and which trainers push an empty section
# (step 3: everyone's section is empty, which still moves torch's step count)
ROUNDS = 5
WEIGHTS = [("t0", 0.5), ("t1", 0.25), ("t2", 0.25)]


def reference(cls, args: dict) -> tuple[torch.nn.Embedding, torch.optim.Optimizer]:
    """torch's own: the full table as an ``nn.Embedding(sparse=True)`` starting from pdps's init."""
    emb = torch.nn.Embedding(N, DIM, sparse=True, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init_rows(SPEC, np.arange(N))))
    return emb, cls(emb.parameters(), **{k: tuple(v) if isinstance(v, list) else v for k, v in args.items()})


@pytest.mark.parametrize("rule,args,cls", RULES, ids=[r[0] for r in RULES])
def test_sync_rounds_of_several_trainers_equal_torch_on_the_full_table(rule, args, cls):
    rng = np.random.default_rng(1)
    r = store(rule=rule, args=args)
    touched: set[int] = set()
    emb, ref = reference(cls, args)
    for step in range(ROUNDS):
        ref.zero_grad()
        for k, (trainer, w) in enumerate(WEIGHTS):
            ids, g = section(rng, 0 if step == 3 or (step == 1 and k == 2) else 120)
            r.check(ids, g, trainer)
            r.stage(trainer, ids, g)
            touched |= set(ids.tolist())
            (emb(ids) * g).sum().mul(w).backward()  # sparse=True: the weight's grad is sparse, its rows w * g
        assert emb.weight.grad.is_sparse
        assert r.staged() == {"t0", "t1", "t2"}
        assert r.apply_staged(WEIGHTS) is True
        assert r.staged() == set()
        ref.step()
    assert r.step == ROUNDS
    torch.testing.assert_close(r.lookup(torch.arange(N)), emb.weight.detach(), rtol=0, atol=1e-12)
    # the rule's state too, row by row, where rows exist
    entries = r.export_slots(range(SLOTS))[0]
    for name in r._state:
        ids = torch.cat([v for k, v in sorted(entries.items()) if k.endswith("/ids")])
        state = torch.cat([entries[k.replace("/ids", f"/state.{name}")] for k in sorted(entries) if k.endswith("/ids")])
        torch.testing.assert_close(state, ref.state[emb.weight][name][ids], rtol=0, atol=1e-12)
    assert r.stats()["created"] == r.stats()["rows"] == len(touched)


@pytest.mark.parametrize("rule,args,cls", RULES, ids=[r[0] for r in RULES])
def test_async_pushes_equal_torch_stepping_each_push(rule, args, cls):
    rng = np.random.default_rng(2)
    r = store(rule=rule, args=args)
    emb, ref = reference(cls, args)
    for step in range(ROUNDS):
        ids, g = section(rng, 0 if step == 2 else 200)
        r.check(ids, g, "t0")
        r.apply(ids, g)
        ref.zero_grad()
        (emb(ids) * g).sum().backward()
        ref.step()
    assert r.step == ROUNDS
    torch.testing.assert_close(r.lookup(torch.arange(N)), emb.weight.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("maximize", [False, True])
def test_sgd_rows_move_bit_for_bit_as_torchs_sparse_sgd(dtype, maximize):
    """SGD adds into the rows where they lie (float32 and float64) or steps the gathered
    rows with torch.optim.SGD (half precision): either way, the exact bits of torch's
    own sparse step on the whole table."""
    spec = TableSpec(name="emb", dim=DIM, dtype=dtype, num_rows=N)
    rng = np.random.default_rng(3)
    r = store(spec, "SGD", {"lr": 0.37, "maximize": maximize})
    assert (r._add_alpha is not None) == (dtype in ("float32", "float64"))
    emb = torch.nn.Embedding(N, DIM, sparse=True, dtype=getattr(torch, dtype))
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init_rows(spec, np.arange(N))))
    ref = torch.optim.SGD(emb.parameters(), lr=0.37, maximize=maximize)
    for _ in range(3):
        ids, g = section(rng, 300)
        g = g.to(emb.weight.dtype)
        r.check(ids, g, "t0")
        r.apply(ids, g)
        ref.zero_grad()
        (emb(ids) * g).sum().backward()
        ref.step()
    assert torch.equal(r.lookup(torch.arange(N)), emb.weight.detach())


def test_a_push_reusing_its_trainers_pull_equals_one_probing_the_index():
    # design §10's lookup token: the pull's positions serve the same trainer's push of the
    # same ids, unless a row left its place since (LFU evictions here), and rows created
    # since (by another trainer, or by this push) are looked up; never a different outcome
    spec = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N, capacity=300)
    keyed, plain = (store(spec, "RowWiseAdagrad", {"lr": 0.1}, chunk_rows=128) for _ in range(2))  # own kernel: dense ops, fast
    rng = np.random.default_rng(7)
    for k in range(15):
        ids, g = section(rng, 120)
        pulled = keyed.lookup(ids, key="t0")
        torch.testing.assert_close(pulled, plain.lookup(ids), rtol=0, atol=0)
        if k % 3 == 1:  # another trainer's push in between: creates rows, and evicts past capacity
            other, og = section(rng, 80)
            keyed.apply(other, og, key="t1")
            plain.apply(other, og)
        if k % 5 == 4:  # a push of other ids than pulled: probed
            ids, g = section(rng, 60)
        keyed.apply(ids, g, key="t0")
        plain.apply(ids, g)
        assert keyed.stats() == plain.stats()
    assert_same_entries(exported(keyed), exported(plain))
    assert keyed.stats()["evicted_lfu"] > 0
    # 15 pushes: 3 of other ids, 5 after another trainer's push (which evicts, once past capacity)
    assert 8 <= keyed.reused <= 12


def test_a_kept_lookup_is_used_once_and_only_by_its_own_key():
    r = store()
    ids, g = section(np.random.default_rng(3), 50)
    r.apply(ids, g)  # every id has a row
    r.lookup(ids, key="t0")
    r.apply(ids, g, key="t1")  # another trainer's: probes
    assert r.reused == 0
    r.apply(ids, g, key="t0")
    r.apply(ids, g, key="t0")  # its lookup was taken by the push before
    assert r.reused == 1


def test_a_round_where_no_trainer_used_the_table_does_not_step_it():
    r = store(rule="SparseAdam", args={"lr": 0.1})
    ids, g = section(np.random.default_rng(3), 10)
    r.stage("t9", ids, g)  # staged, but not in the round's weights: dropped at close
    assert r.apply_staged([("t0", 1.0), ("t1", 1.0)]) is False
    assert r.step == 0 and r.staged() == set() and r.stats()["rows"] == 0
    r.stage("t1", ids, g)
    assert r.apply_staged([("t0", 1.0), ("t1", 1.0)]) is True  # t0 did not use the table: t1 alone
    assert r.step == 1 and r.stats()["rows"] == len(ids)


def test_row_wise_adagrad_is_fbgemms_formula():
    lr, eps, acc0 = 0.3, 1e-6, 0.1
    r = store(rule="RowWiseAdagrad", args={"lr": lr, "eps": eps, "initial_accumulator_value": acc0})
    rng = np.random.default_rng(4)
    table = init_rows(SPEC, np.arange(N))
    acc = np.full((N, 1), acc0)
    for _ in range(ROUNDS):
        ids, g = section(rng, 300)
        r.apply(ids, g)
        i, gn = ids.numpy(), g.numpy()
        acc[i] += np.mean(gn * gn, axis=1, keepdims=True)
        table[i] -= lr * gn / (np.sqrt(acc[i]) + eps)
    np.testing.assert_allclose(r.lookup(torch.arange(N)).numpy(), table, rtol=0, atol=1e-12)
    entries = r.export_slots(range(SLOTS))[0]
    some = next(k for k in entries if k.endswith("/state.acc"))
    assert entries[some].shape[1] == 1  # one accumulator per row
    ids = entries[some.replace("state.acc", "ids")].numpy()
    np.testing.assert_allclose(entries[some].numpy(), acc[ids], rtol=0, atol=1e-12)


def test_sparse_adam_with_row_steps_corrects_each_row_by_its_own_updates():
    lr, b1, b2, eps = 0.05, 0.8, 0.9, 1e-8
    r = store(rule="SparseAdam", args={"lr": lr, "betas": [b1, b2], "eps": eps, "row_steps": True})
    rng = np.random.default_rng(5)
    table = init_rows(SPEC, np.arange(N))
    m, v, t = np.zeros((N, DIM)), np.zeros((N, DIM)), np.zeros(N)
    for _ in range(ROUNDS):
        ids, g = section(rng, 300)
        r.apply(ids, g)
        i, gn = ids.numpy(), g.numpy()
        t[i] += 1
        m[i] = b1 * m[i] + (1 - b1) * gn
        v[i] = b2 * v[i] + (1 - b2) * gn * gn
        size = lr * np.sqrt(1 - b2 ** t[i]) / (1 - b1 ** t[i])
        table[i] -= size[:, None] * m[i] / (np.sqrt(v[i]) + eps)
    assert len(np.unique(t[t > 0])) > 1  # rows did differ in their counts
    np.testing.assert_allclose(r.lookup(torch.arange(N)).numpy(), table, rtol=0, atol=1e-12)


# --- reads --------------------------------------------------------------------------------------


def test_lookup_answers_missing_ids_with_their_init_and_creates_nothing():
    spec = TableSpec(name="hash", dim=4, dtype="float32")  # unbounded: any int64
    r = store(spec)
    ids = torch.tensor([-(2**62), -5, 3, 2**62])
    assert torch.equal(r.lookup(ids), torch.from_numpy(init_rows(spec, ids.numpy())).float())
    assert r.stats()["rows"] == 0
    g = torch.ones((2, 4))
    r.apply(ids[1:3], g)
    got = r.lookup(ids)
    want = torch.from_numpy(init_rows(spec, ids.numpy())).float()
    want[1:3] -= 1e-3 * g  # SGD's default lr
    assert torch.equal(got, want)
    assert r.stats()["rows"] == 2 and r.stats()["created"] == 2


# --- refusals -------------------------------------------------------------------------------------


def test_every_refusal_names_the_field_and_changes_nothing():
    spec = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N, admit_after=2, capacity=900, ttl_steps=50)
    held = [s for s in range(SLOTS) if s != 5]
    r = store(spec, "Adagrad", {"lr": 0.1}, slots=held, max_ids=64)
    rng = np.random.default_rng(6)
    for _ in range(4):  # rows, state, counts, ages and pending ids to compare
        ids, g = section(rng, 40)
        keep = row_slots("emb", ids.numpy(), SLOTS) != 5
        r.apply(ids[keep], g[keep])
    r.stage("t0", *section(rng, 5))
    assert r.stats()["rows"] > 0 and r.stats()["pending"] > 0
    before, stats = exported(r, held), r.stats()
    where = row_slots("emb", np.arange(N), SLOTS)
    a, b, c = np.flatnonzero(where != 5)[:3].tolist()
    ok = torch.tensor([a, b, c])
    in_slot_5 = int(np.flatnonzero(where == 5)[0])
    g3 = torch.zeros((3, DIM), dtype=torch.float64)
    nan = g3.clone()
    nan[1, 2] = float("nan")
    inf = g3.clone()
    inf[2, 0] = float("inf")
    cases = [
        ([a, b, c], g3, "ids", "list, not a tensor"),
        (ok.float(), g3, "ids", "float32 ids: ids travel as int64"),
        (ok.view(3, 1), g3, "ids", r"shape \(3, 1\): ids are 1-D"),
        (torch.tensor([a, b, b]), g3, "ids", f"id {b} appears twice .* sum the gradients of one id"),
        (torch.tensor([a, c, b]), g3, "ids", f"not ascending at position 2 .{b} after {c}."),
        (torch.tensor([-1, b, c]), g3, "ids", r"id -1 is outside the table's \[0, 1000\)"),
        (torch.tensor([a, b, N]), g3, "ids", f"id {N} is outside"),
        (torch.arange(65), torch.zeros((65, DIM), dtype=torch.float64), "ids", "65 ids .* sparse_max_ids = 64: raise sparse_max_ids or cut the batch"),
        (torch.tensor([in_slot_5]), g3[:1], "ids", f"id {in_slot_5} is in slot 5, whose rows this pserver does not hold"),
        (ok, torch.zeros((3, 7), dtype=torch.float64), "grads", "width 7.* of width 8"),
        (ok, torch.zeros((2, DIM), dtype=torch.float64), "grads", "2 gradient rows for 3 ids"),
        (ok, g3.float(), "grads", "float32 gradients for a float64 table"),
        (ok, nan, "grads", f"gradient of id {b} is not finite .1 NaN"),
        (ok, inf, "grads", f"gradient of id {c} is not finite .0 NaN and 1 infinite"),
        (ok, g3.numpy(), "grads", "ndarray, not a tensor"),
    ]
    for ids, grads, field, match in cases:
        with pytest.raises(GradientRejected, match=match) as err:
            r.check(ids, grads, "t7")
        assert err.value.field == f"tables.emb.{field}" and err.value.trainer == "t7"
        assert "table 'emb'" in str(err.value) and "'t7'" in str(err.value)
    # a pull is refused as a bad request, not a rejected gradient
    with pytest.raises(BadRequest, match="pulled by trainer 't8'.*appears twice") as err:
        r.check(torch.tensor([a, a]), None, "t8")
    assert not isinstance(err.value, GradientRejected)
    # the slots a caller names (a primary's own) replace the held ones
    with pytest.raises(GradientRejected, match="in slot"):
        r.check(ok, g3, "t7", slots=[])
    r.check(ok[:0], g3[:0], "t7", slots=[])  # an empty section is fine anywhere
    r.check(ok, nan, "t7", finite=False)  # checked already by whoever forwards it
    assert_same_entries(before, exported(r, held))
    after = r.stats()
    assert after.pop("refused") == len(cases) + 2 and stats.pop("refused") == 0
    assert after == stats and r.staged() == {"t0"}


# --- moving slots ---------------------------------------------------------------------------------


def trained(rule: str = "Adagrad", steps: int = 6, **spec_kw) -> TorchRows:
    spec = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N, **spec_kw)
    r = store(spec, rule, {"lr": 0.1})
    rng = np.random.default_rng(7)
    for _ in range(steps):
        r.apply(*section(rng, 150))
    return r


def test_export_then_import_across_another_slot_split_is_the_identity():
    a = trained(admit_after=2, capacity=600, ttl_steps=100)
    assert a.stats()["rows"] > 150 and a.stats()["pending"] > 0
    whole = exported(a)
    # two pservers of 5 and 11 slots
    left, right = range(0, 5), range(5, SLOTS)
    b = store(a.spec, "Adagrad", {"lr": 0.1}, slots=left)
    c = store(a.spec, "Adagrad", {"lr": 0.1}, slots=())
    b.import_slots(a.export_slots(left)[0])
    c.import_slots(a.export_slots(right)[0])
    assert c.slots == frozenset(s for s in right if any(k.startswith(f"emb#{s}/") for k in whole))
    assert b.step == c.step == a.step
    assert_same_entries(exported(b, left), exported(a, left))
    assert_same_entries(exported(c, right), exported(a, right))
    # and back onto one, in pages of 7 rows
    d = store(a.spec, "Adagrad", {"lr": 0.1}, slots=())
    for src, part in ((b, left), (c, right)):
        offset, more = 0, True
        while more:
            page, more = src.export_slots(part, offset, 7)
            assert sum(len(v) for k, v in page.items() if k.endswith("/ids")) <= 7
            d.import_slots(page)
            offset += 7
    assert_same_entries(exported(d), whole)
    assert d.stats()["rows"] == a.stats()["rows"] and d.stats()["pending"] == a.stats()["pending"]
    # the cut changes no later step: the same push to a and to b + c
    ids, g = section(np.random.default_rng(8), 200)
    a.apply(ids, g)
    mine = row_slots("emb", ids.numpy(), SLOTS) < 5
    b.apply(ids[mine], g[mine])
    c.apply(ids[~mine], g[~mine])
    assert_same_entries({**exported(b, left), **exported(c, right)}, exported(a))


def test_import_refuses_entries_that_do_not_fit_and_changes_nothing():
    a = trained()
    entries = a.export_slots(range(SLOTS))[0]
    key = next(k for k in entries if k.endswith("/values"))
    r = store(a.spec, "Adagrad", {"lr": 0.1}, slots=())
    for bad, match in (
        ({**entries, key: entries[key].float()}, "expected .* float64"),
        ({**entries, key: entries[key][:, :4]}, "expected"),
        ({k: v for k, v in entries.items() if k != key}, "no 'values' entry"),
        ({**entries, key.replace("values", "ids"): entries[key.replace("values", "ids")].flip(0)}, "not strictly ascending"),
    ):
        with pytest.raises(ConfigError, match=match):
            r.import_slots(bad)
        assert r.stats()["rows"] == 0 and r.step == 0 and r.slots == frozenset()
    moved = {k.replace("emb#3/", "emb#13/"): v for k, v in entries.items() if not k.startswith("emb#13/")}
    with pytest.raises(ConfigError, match="belong to other slots"):
        r.import_slots(moved)
    # a checkpoint saved under SGD (no state) loads under Adagrad: the rule's start state
    sgd = trained("SGD")
    r.import_slots(sgd.export_slots(range(SLOTS))[0])
    state = r.export_slots(range(SLOTS))[0]
    assert all(torch.all(v == 0) for k, v in state.items() if "/state.sum" in k)
    assert r.stats()["rows"] == sgd.stats()["rows"]


def test_drop_slots_forgets_their_rows_and_stops_holding_them():
    a = trained()
    rows = a.stats()["rows"]
    gone = exported(a, [2, 3])
    n_gone = sum(len(v) for k, v in gone.items() if k.endswith("/ids"))
    a.drop_slots([2, 3])
    assert a.stats()["rows"] == rows - n_gone and 2 not in a.slots
    assert exported(a, [2, 3]) == {"emb/scalar.step": np.array(a.step)}
    some = int(np.flatnonzero(row_slots("emb", np.arange(N), SLOTS) == 2)[0])
    with pytest.raises(GradientRejected, match="slot 2"):
        a.check(torch.tensor([some]), torch.zeros((1, DIM), dtype=torch.float64), "t0")
    # the freed positions are reused before the store grows
    capacity = a._values.capacity
    a.hold([2, 3])
    a.import_slots({k: torch.from_numpy(v) for k, v in gone.items()})
    assert a.stats()["rows"] == rows and a._values.capacity == capacity


# --- replicas: a backup's copies stepped as its primaries' ---------------------------------------

SPARSE_ADAM = {"lr": 0.05, "betas": [0.8, 0.9]}


def split(name: str, ids: torch.Tensor, g: torch.Tensor, slots) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids of a section (and their gradient rows) in ``slots``."""
    keep = torch.from_numpy(np.flatnonzero(np.isin(row_slots(name, ids.numpy(), SLOTS), list(slots))))
    return ids[keep], g[keep]


def test_a_backup_staging_each_primarys_forward_steps_its_copies_bit_for_bit_as_the_primary():
    """Sync, two pservers each the primary of half the slots and the backup of the other
    half: each stages a trainer's own section and its primary's forward (disjoint ids)
    and applies the round's union; every copy of a slot ends equal to its primary's
    bit for bit, and both equal one store fed every section whole."""
    rng = np.random.default_rng(21)
    left, right = range(SLOTS // 2), range(SLOTS // 2, SLOTS)
    a, b = store(rule="SparseAdam", args=SPARSE_ADAM), store(rule="SparseAdam", args=SPARSE_ADAM)  # each holds every slot
    whole = store(rule="SparseAdam", args=SPARSE_ADAM)
    for step in range(ROUNDS):
        for trainer, _ in WEIGHTS:
            ids, g = section(rng, 0 if step == 3 else 150)
            whole.stage(trainer, ids, g)
            mine_a, mine_b = split("emb", ids, g, left), split("emb", ids, g, right)
            a.check(*mine_a, trainer, slots=left)
            a.stage(trainer, *mine_a, covers=left, version=1)
            a.stage(trainer, *mine_b, source=1, covers=right, version=1)  # pserver 1's forward
            b.stage(trainer, *mine_b, covers=right, version=1)
            b.stage(trainer, *mine_a, source=0, covers=left, version=1)
        assert a.staged() == b.staged() == {"t0", "t1", "t2"}
        for r in (a, b, whole):
            assert r.apply_staged(WEIGHTS) is True
    assert a.step == b.step == whole.step == ROUNDS
    assert_same_entries(exported(a), exported(b))
    for k, v in exported(a).items():
        np.testing.assert_allclose(v, exported(whole)[k], rtol=0, atol=1e-12, err_msg=k)


def test_a_push_sent_again_by_a_newer_map_replaces_the_rows_a_forward_staged():
    """After a failover a trainer pushes again, by the newer map, to the pserver now the
    primary of slots whose rows an older forward of its push staged there already: the
    forward's rows of those slots go (they are not summed twice); a forward of another
    trainer, who does not push again, stays; rows of slots the new push does not cover
    stay too."""
    rng = np.random.default_rng(22)
    left, right = list(range(SLOTS // 2)), list(range(SLOTS // 2, SLOTS))
    b = store(rule="SparseAdam", args=SPARSE_ADAM)
    whole = store(rule="SparseAdam", args=SPARSE_ADAM)
    sections = {t: section(rng, 150) for t, _ in WEIGHTS}
    for trainer, (ids, g) in sections.items():
        whole.stage(trainer, ids, g)
        b.stage(trainer, *split("emb", ids, g, right), covers=right, version=1)
        b.stage(trainer, *split("emb", ids, g, left), source=0, covers=left, version=1)  # pserver 0's forward, then it dies
    # t0's push to pserver 0 failed: it pushes again by map 2, where pserver 1 is the
    # primary of every slot; t1 and t2 were answered and push nothing again
    b.stage("t0", *sections["t0"], covers=left + right, version=2)
    b.stage("t1", *split("emb", *sections["t1"], right), covers=left[:0], version=2)  # covers nothing new: the forward stays
    assert b.apply_staged(WEIGHTS) and whole.apply_staged(WEIGHTS)
    for k, v in exported(b).items():
        np.testing.assert_allclose(v, exported(whole)[k], rtol=0, atol=1e-12, err_msg=k)


def test_async_a_backup_applies_its_primarys_pushes_at_the_primarys_table_step():
    """Async: a backup's own table step counts its own pushes; it applies a primary's
    forwarded section at the step the primary applied it at, so its copies equal the
    primary's (SparseAdam's bias correction reads the step), and its own step stays."""
    left, right = range(SLOTS // 2), range(SLOTS // 2, SLOTS)
    a, b = store(rule="SparseAdam", args=SPARSE_ADAM), store(rule="SparseAdam", args=SPARSE_ADAM)
    counted = store(rule="SparseAdam", args=SPARSE_ADAM)  # b, were its own step to count the forwards too
    rng = np.random.default_rng(23)
    for k in range(7):
        ids, g = section(rng, 100)
        if k % 3 == 2:  # a push to b alone: b's own step moves, a's does not
            b.apply(*split("emb", ids, g, right))
            counted.apply(*split("emb", ids, g, right))
            continue
        a.apply(*split("emb", ids, g, left))
        b.apply(*split("emb", ids, g, left), step=a.step)  # a's forward
        counted.apply(*split("emb", ids, g, left))
    assert (a.step, b.step) == (5, 2)
    rows_of = lambda r: {k: v for k, v in exported(r, left).items() if "#" in k}  # noqa: E731 - the slots' entries, not the step
    assert_same_entries(rows_of(a), rows_of(b))
    assert not np.array_equal(rows_of(counted)["emb#0/values"], rows_of(a)["emb#0/values"])


# --- admission and eviction, counted ------------------------------------------------------------


def push(r: TorchRows, ids: list[int], g: float = 1.0) -> None:
    t = torch.tensor(sorted(ids), dtype=torch.int64)
    r.apply(t, torch.full((len(ids), r.spec.dim), g, dtype=torch.float64))


def test_admission_creates_a_row_at_its_third_touch_from_that_touch_alone():
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, admit_after=3)
    r = store(spec, "SGD", {"lr": 1.0})
    push(r, [1, 2], 5.0)
    push(r, [1], 7.0)
    assert r.stats()["rows"] == 0 and r.stats()["pending"] == 2
    push(r, [1, 2], 0.5)  # 1's third touch; 2's second
    s = r.stats()
    assert (s["rows"], s["created"], s["admitted"], s["pending"]) == (1, 1, 1, 1)
    # the row is init plus the third touch's step only: the first two gradients were dropped
    np.testing.assert_array_equal(r.lookup(torch.tensor([1])).numpy(), init_rows(spec, np.array([1])) - 0.5)
    push(r, [2])
    push(r, [1, 2])  # both exist now: plain updates, no admission
    s = r.stats()
    assert (s["rows"], s["created"], s["admitted"], s["pending"], s["pending_dropped"]) == (2, 2, 2, 0, 0)


def test_the_pending_map_drops_the_oldest_past_its_capacity():
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, admit_after=3, pending_capacity=16)
    r = store(spec)
    push(r, list(range(10)))  # step 1
    push(r, list(range(100, 110)))  # step 2: 20 pending > 16, down to 15: 5 of the step-1 ids go
    s = r.stats()
    assert (s["pending"], s["pending_dropped"], s["rows"]) == (15, 5, 0)
    kept = set(r._pending.items()[0].tolist())
    assert set(range(100, 110)) <= kept
    dropped = set(range(10)) - kept
    order = np.argsort(rowpolicy.tie_break(np.arange(10)), kind="stable")
    assert dropped == set(order[:5].tolist())  # ties among the oldest by hash of the id


def test_ttl_evicts_rows_not_updated_for_ttl_steps_down_to_the_floor():
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, ttl_steps=4, sweep_every=1, floor=3)
    r = store(spec)
    push(r, [1, 2, 3, 4, 5])  # step 1
    push(r, [1])  # step 2
    push(r, [2, 9])  # step 3
    push(r, [9])  # step 4: nothing is 4 steps old yet
    assert r.stats()["evicted_ttl"] == 0
    push(r, [9])  # step 5: 3, 4 and 5 are 4 steps old; 3 rows stay (1, 2, 9), the floor
    assert (r.stats()["evicted_ttl"], r.stats()["rows"]) == (3, 3)
    push(r, [9])  # step 6: 1 has expired, but the floor keeps it
    push(r, [9])  # step 7: 1 and 2 have expired; the floor keeps both
    assert (r.stats()["evicted_ttl"], r.stats()["rows"]) == (3, 3)
    push(r, [7])  # step 8: a fourth row; one of 1 and 2 (2 updates each) may go: the lower hash
    assert (r.stats()["evicted_ttl"], r.stats()["rows"]) == (4, 3)
    gone = [1, 2][int(np.argmin(rowpolicy.tie_break(np.array([1, 2]))))]
    ids = np.concatenate([v.numpy() for k, v in r.export_slots(range(SLOTS))[0].items() if k.endswith("/ids")])
    assert set(ids.tolist()) == {1, 2, 7, 9} - {gone}
    # an evicted id comes back from its init value
    np.testing.assert_array_equal(r.lookup(torch.tensor([3])).numpy(), init_rows(spec, np.array([3])))


def test_ttl_seconds_evicts_by_the_clock():
    now = [100.0]
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, ttl_seconds=10.0, sweep_every=1)
    r = store(spec, clock=lambda: now[0])
    push(r, [1, 2])
    now[0] = 105.0
    push(r, [2])
    now[0] = 110.0
    push(r, [3])  # 1 is 10 s old
    assert r.stats()["evicted_ttl"] == 1 and r.stats()["rows"] == 2
    assert r.lookup(torch.tensor([2])).tolist() != init_rows(spec, np.array([2])).tolist()


def test_lfu_evicts_the_least_updated_below_capacity_sparing_this_steps_rows():
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, capacity=16)
    r = store(spec)
    for _ in range(3):
        push(r, list(range(12)))  # 12 rows updated 3 times
    push(r, [12, 13])  # 14 rows
    assert r.stats()["evicted_lfu"] == 0
    push(r, list(range(100, 105)))  # 19 > 16: down to 15, 4 go: 12 and 13 (1 update), two of 0..11 by hash
    s = r.stats()
    assert (s["rows"], s["evicted_lfu"]) == (15, 4)
    ids = np.array(sorted(np.concatenate([v.numpy() for k, v in r.export_slots(range(SLOTS))[0].items() if k.endswith("/ids")])))
    order = np.argsort(rowpolicy.tie_break(np.arange(12)), kind="stable")
    assert set(range(100, 105)) <= set(ids.tolist())
    assert set(ids.tolist()) == set(range(12)) - set(order[:2].tolist()) | set(range(100, 105))


def test_lfu_never_goes_below_the_floor():
    spec = TableSpec(name="emb", dim=2, dtype="float64", num_rows=N, capacity=16, floor=16)
    r = store(spec)
    push(r, list(range(17)))
    s = r.stats()
    assert (s["rows"], s["evicted_lfu"]) == (16, 1)


# --- stats and memory ---------------------------------------------------------------------------


def test_stats_count_rows_and_the_bytes_held():
    r = store(TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N), "Adagrad", {"lr": 0.1})
    s = r.stats()
    assert s == dict(rows=0, bytes=s["bytes"], pending=0, created=0, admitted=0, pending_dropped=0, evicted_ttl=0, evicted_lfu=0, refused=0)

    def chunk_bytes() -> int:
        return r.stats()["bytes"] - r._index.nbytes - r._free.nbytes - r._held.nbytes

    assert chunk_bytes() == 0
    push(r, list(range(64)))  # one chunk of 64 rows: values and Adagrad's sum
    assert chunk_bytes() == 2 * 64 * DIM * 8
    push(r, [64])  # the 65th row adds a chunk
    assert chunk_bytes() == 2 * 2 * 64 * DIM * 8
    r.stage("t0", torch.tensor([1, 2]), torch.zeros((2, DIM), dtype=torch.float64))
    assert chunk_bytes() == 2 * 2 * 64 * DIM * 8 + 2 * 8 + 2 * DIM * 8  # the staging buffer counts too
    s = r.stats()
    assert (s["rows"], s["created"], s["admitted"]) == (65, 65, 0)


@pytest.mark.parametrize(
    "pending_capacity",
    [
        0,
        128,
    ],
)
def test_a_copy_made_by_import_then_fed_the_same_pushes_stays_equal(pending_capacity):
    """What a backup replenished through a migration relies on: same pushes, same
    creations, admissions and evictions, whatever the chunking or the positions."""
    spec = TableSpec(name="emb", dim=DIM, dtype="float64", num_rows=N, admit_after=2, capacity=80, floor=20, ttl_steps=6,
                     pending_capacity=pending_capacity)
    a = store(spec, "SparseAdam", {"lr": 0.01})
    rng = np.random.default_rng(9)
    for _ in range(8):
        a.apply(*section(rng, 120))
    b = store(spec, "SparseAdam", {"lr": 0.01}, slots=(), chunk_rows=32)
    b.import_slots(a.export_slots(range(SLOTS))[0])
    for _ in range(8):
        ids, g = section(rng, 120)
        a.apply(ids, g)
        b.apply(ids, g)
    assert a.stats()["evicted_lfu"] > 0 and a.stats()["evicted_ttl"] > 0 and a.stats()["pending"] > 0
    assert_same_entries(exported(a), exported(b))


def test_half_precision_rounds_sum_in_float32_and_round_once():
    spec = TableSpec(name="emb", dim=4, dtype="bfloat16", num_rows=N)
    r = store(spec, "SGD", {"lr": 1.0})
    ids = torch.tensor([3, 7])
    g1 = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.25, 0.125, 1e-3]]).bfloat16()
    g2 = torch.tensor([[1e-3, 1e-3, 1e-3, 1e-3], [3.0, 3.0, 3.0, 3.0]]).bfloat16()
    r.stage("t0", ids, g1, keep=True)  # not kept as given: half precision is summed in float32
    r.stage("t1", ids, g2)
    sent = g1.clone()
    g1.zero_()  # the pusher's buffer moves on: the store holds its own copy
    r.apply_staged([("t0", 0.5), ("t1", 0.5)])
    want = torch.from_numpy(init_rows(spec, ids.numpy())).bfloat16()
    want.add_((0.5 * sent.float() + 0.5 * g2.float()).bfloat16(), alpha=-1.0)
    assert torch.equal(r.lookup(ids), want)

