"""pdps.nn on one trainer, no job: which modules become tables, what is refused, and
that a table's stand-in computes exactly what torch computes on the whole table."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pdps.core.errors import ConfigError
from pdps.nn import HashEmbedding, RemoteTable, TableOptions, TableRows, bind, init_rows, replace_tables, tables_of


class Two(nn.Module):
    def __init__(self, first: nn.Module, second: nn.Module) -> None:
        super().__init__()
        self.a, self.b = first, second


def test_sparse_tables_are_found_and_dense_or_frozen_ones_stay_parameters():
    frozen = nn.Embedding(10, 4, sparse=True)
    frozen.weight.requires_grad_(False)
    model = nn.ModuleDict({
        "bag": nn.EmbeddingBag(100, 8, sparse=True), "emb": nn.Embedding(50, 4, sparse=True, padding_idx=0),
        "hash": HashEmbedding(6, mode="sum"), "dense": nn.Embedding(10, 4), "frozen": frozen,
    })  # fmt: skip
    found = {name: spec for name, _, spec in tables_of(model)}
    assert sorted(found) == ["bag.weight", "emb.weight", "hash.weight"]
    assert (found["bag.weight"].num_rows, found["bag.weight"].dim, found["bag.weight"].init.kind) == (100, 8, "normal")
    assert found["emb.weight"].padding_idx == 0
    assert found["hash.weight"].num_rows is None and found["hash.weight"].init.kind == "uniform"


@pytest.mark.parametrize(
    "module,says",
    [
        (nn.Embedding(10, 4, sparse=True, max_norm=1.0), "max_norm"),
        (nn.EmbeddingBag(10, 4, sparse=True, mode="max"), "mode='max'"),
        (nn.Embedding(10, 4, sparse=True, scale_grad_by_freq=True), "scale_grad_by_freq"),
    ],
)
def test_tables_pdps_cannot_serve_are_refused_by_name(module, says):
    with pytest.raises(ConfigError, match=says):
        tables_of(Two(module, nn.Linear(1, 1)))


def test_a_tied_table_and_options_for_no_table_are_refused():
    shared = nn.Embedding(10, 4, sparse=True)
    other = nn.Embedding(10, 4, sparse=True)
    other.weight = shared.weight
    with pytest.raises(ConfigError, match="shares its weight"):
        tables_of(Two(shared, other))
    tied = Two(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 10, bias=False))
    tied.b.weight = tied.a.weight
    with pytest.raises(ConfigError, match="table 'a.weight' shares its weight with parameter 'b.weight'"):
        tables_of(tied)
    with pytest.raises(ConfigError, match=r"table options name \['c.weight'\]"):
        tables_of(Two(nn.Embedding(10, 4, sparse=True), nn.Linear(1, 1)), {"c.weight": TableOptions()})


def test_options_reach_the_spec():
    found = tables_of(Two(nn.Embedding(10, 4, sparse=True), nn.Linear(1, 1)), {"a.weight": TableOptions(init=("zeros",), admit_after=2, capacity=8, floor=2)})
    spec = found[0][2]
    assert (spec.init.kind, spec.admit_after, spec.capacity, spec.floor) == ("zeros", 2, 8, 2)


def test_an_unattached_hash_embedding_says_what_to_do():
    with pytest.raises(ConfigError, match="lives on the pservers"):
        HashEmbedding(4)(torch.tensor([1, 2]))


def compact_like_torch(make, call):
    """The stand-in over a compact table pulled from a full one, against torch on the full
    table: the same output, and the same gradient rows for the ids used."""
    torch.manual_seed(0)
    full = make().double()
    model = Two(full, nn.Identity())
    spec = tables_of(model)[0][2]
    weight = full.weight.detach().clone()
    looked_up = []

    def rows(table: RemoteTable, unique: torch.Tensor) -> torch.Tensor:
        r = weight[unique].clone().requires_grad_()
        looked_up.append((unique, r))
        return r

    reference = make().double()
    with torch.no_grad():
        reference.weight.copy_(weight)
    want = call(reference)
    want.pow(2).sum().backward()
    replace_tables(model, tables_of(model), rows)
    got = call(model.a)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    (unique, r), = looked_up
    dense = reference.weight.grad.to_dense() if reference.weight.grad.is_sparse else reference.weight.grad
    torch.testing.assert_close(r.grad, dense[unique], rtol=0, atol=1e-12)
    untouched = torch.ones(dense.shape[0], dtype=torch.bool)
    untouched[unique] = False
    assert not dense[untouched].any()
    assert spec.dtype == "float64"


@pytest.mark.parametrize(
    "make,call",
    [
        (lambda: nn.Embedding(20, 3, sparse=True, padding_idx=2), lambda m: m(torch.tensor([[1, 2, 5], [5, 5, 2]]))),
        (lambda: nn.EmbeddingBag(20, 3, mode="mean", sparse=True), lambda m: m(torch.tensor([4, 9, 9, 1, 4]), torch.tensor([0, 2, 2]))),
        (lambda: nn.EmbeddingBag(20, 3, mode="sum", sparse=True),
         lambda m: m(torch.tensor([4, 9, 9, 1]), torch.tensor([0, 3]), per_sample_weights=torch.tensor([0.5, 2.0, -1.0, 3.0], dtype=torch.float64))),
        (lambda: nn.EmbeddingBag(20, 3, mode="sum", sparse=True, padding_idx=9), lambda m: m(torch.tensor([[4, 9], [9, 9]]))),
    ],
    ids=["padding", "mean-with-an-empty-bag", "per-sample-weights", "bag-padding"],
)
def test_the_stand_in_computes_what_torch_computes_on_the_whole_table(make, call):
    compact_like_torch(make, call)


def test_out_of_range_and_float_ids_are_refused_before_any_pull():
    model = Two(nn.Embedding(10, 2, sparse=True), nn.Identity())
    asked = []
    replace_tables(model, tables_of(model), lambda table, unique: asked.append(unique) or torch.zeros(len(unique), 2))
    with pytest.raises(IndexError, match="index out of range in self: table 'a.weight' has 10 rows, got id 10"):
        model.a(torch.tensor([3, 10]))
    with pytest.raises(ConfigError, match="int64"):
        model.a(torch.tensor([1.0]))
    with pytest.raises(TypeError, match="not a bag"):  # as nn.Embedding, which takes neither
        model.a(torch.tensor([1, 2]), torch.tensor([0]))
    with pytest.raises(TypeError, match="not a bag"):
        model.a(torch.tensor([1, 2]), per_sample_weights=torch.ones(2))
    assert asked == []


def test_table_rows_give_stored_rows_and_the_init_value_for_any_other_id():
    spec = tables_of(Two(HashEmbedding(3), nn.Identity()))[0][2]
    ids = torch.tensor([-5, 7, 1 << 40])
    values = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    rows = TableRows(spec, ids, values)
    got = rows.lookup(torch.tensor([7, 8, -5]))
    assert torch.equal(got[0], values[1]) and torch.equal(got[2], values[0])
    assert torch.equal(got[1], init_rows(spec, torch.tensor([8]))[0])
    bound = 1 / 3**0.5
    assert bool((got[1].abs() <= bound).all())


def test_bind_makes_a_model_read_fetched_rows():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = HashEmbedding(2, mode="sum")
            self.out = nn.Linear(2, 1)

    spec = tables_of(M())[0][2]
    rows = TableRows(spec, torch.tensor([3]), torch.tensor([[1.0, 2.0]]))
    model = bind(M(), {"emb.weight": rows, "out.weight": torch.tensor([[1.0, 1.0]]), "out.bias": torch.tensor([0.5])})
    with torch.no_grad():
        assert float(model.out(model.emb(torch.tensor([[3]])))) == 3.5
    with pytest.raises(ConfigError, match="no fetched rows"):
        bind(M(), {})


def test_an_export_of_a_model_with_tables_is_refused_before_anything_is_written():
    import pdps.exports

    spec = tables_of(Two(HashEmbedding(3), nn.Identity()))[0][2]
    rows = TableRows(spec, torch.tensor([1]), torch.ones(1, 3))
    with pytest.raises(ConfigError, match=r"sparse tables \['a.weight'\]: exporting a table's rows is not built yet"):
        pdps.exports.publish("memory://refused-export", {"a.weight": rows, "b": torch.ones(2)})
    assert pdps.exports.latest("memory://refused-export") is None
