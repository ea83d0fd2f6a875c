"""The CTR example's data and torch model: the generator is what its docs say, the
signal is learnable, and single-process torch with a sparse table learns it."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from scipy.special import zeta
from torch import nn

import pdps
from pdps.core.errors import ConfigError
from pdps.examples import ctr
from pdps.ports.data import read_whole

MASK = (1 << 64) - 1


def splitmix64_int(x: int) -> int:
    """The docstring's splitmix64 on Python ints: an implementation independent of numpy's."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def unit_int(stream: int, f: int, r: int) -> float:
    return (splitmix64_int(stream * 2**40 + f * 2**32 + r) >> 11) * 2.0**-53


@pytest.fixture(scope="module")
def data():
    return ctr.split()


def test_same_seed_same_log_and_another_seed_another(data):
    again = ctr.make_clicks(ctr.TRAIN + ctr.HELD_OUT, ctr.DATA_SEED)
    train, held = data
    for name in ("cat", "cat_index", "dense", "click"):
        assert np.array_equal(np.concatenate([train[name], held[name]]), again[name]), name
    other = ctr.make_clicks(1000, ctr.DATA_SEED + 1)
    assert not np.array_equal(other["cat_index"], again["cat_index"][:1000])
    assert not np.array_equal(other["dense"], again["dense"][:1000])


def test_columns_have_the_documented_shapes_dtypes_and_ranges(data):
    train, held = data
    for part, n in ((train, ctr.TRAIN), (held, ctr.HELD_OUT)):
        assert part["cat"].shape == (n, 8) and part["cat"].dtype == np.int64
        assert part["cat_index"].shape == (n, 8) and part["cat_index"].dtype == np.int64
        assert part["dense"].shape == (n, 4) and part["dense"].dtype == np.float32
        assert part["click"].shape == (n,) and part["click"].dtype == np.float32
        assert set(np.unique(part["click"])) == {0.0, 1.0}
        feature, rank = np.divmod(part["cat_index"], ctr.VOCAB)
        assert np.array_equal(feature, np.broadcast_to(np.arange(8), (n, 8)))
        assert rank.min() == 0 and rank.max() == ctr.VOCAB - 1
    assert abs(float(train["dense"].mean())) < 0.02 and abs(float(train["dense"].std()) - 1) < 0.02


def test_ids_are_the_documented_hash_and_never_collide(data):
    train, _ = data
    feature, rank = np.divmod(train["cat_index"], ctr.VOCAB)
    assert np.array_equal(train["cat"], ctr.feature_ids(feature, rank))
    for i, f in ((0, 0), (17, 3), (19_999, 7)):
        expected = splitmix64_int(int(feature[i, f]) * 2**32 + int(rank[i, f]))
        assert int(train["cat"][i, f]) == (expected - 2**64 if expected >= 2**63 else expected)
    every = ctr.feature_ids(np.arange(8)[:, None], np.arange(ctr.VOCAB)[None, :]).ravel()
    assert len(np.unique(every)) == 8 * ctr.VOCAB  # 800,000 (feature, rank) pairs, 800,000 ids
    assert (every < 0).mean() == pytest.approx(0.5, abs=0.01)  # spread over all of int64
    assert np.abs(every).max() > 2**62


def test_ranks_follow_the_clipped_zipf_law(data):
    train, _ = data
    rank = train["cat_index"] % ctr.VOCAB  # 160,000 draws
    k = np.arange(1, ctr.VOCAB, dtype=np.float64)
    z = zeta(ctr.ZIPF_A)
    top = 1 / z  # P(rank 0) = 17.9%
    tail = 1 - (k**-ctr.ZIPF_A).sum() / z  # P(zipf >= 10^5): the last rank, 8.9%
    assert (rank == 0).mean() == pytest.approx(top, abs=0.005)
    assert (rank == 1).mean() == pytest.approx(top * 2**-ctr.ZIPF_A, abs=0.005)
    assert (rank == ctr.VOCAB - 1).mean() == pytest.approx(tail, abs=0.005)
    assert (rank < 100).mean() == pytest.approx((k[:100] ** -ctr.ZIPF_A).sum() / z, abs=0.01)


def test_clicks_are_drawn_as_documented():
    """Regenerate 50 samples from the docstring alone (Python ints for the hashes) and
    compare every column and the click probability."""
    n, seed = 50, 11
    data = ctr.make_clicks(n, seed)
    rng = np.random.default_rng(seed)
    rank = np.minimum(rng.zipf(1.2, size=(n, 8)), 100_000) - 1
    dense = rng.standard_normal((n, 4)).astype(np.float32)
    draw = rng.random(n)
    logit = np.empty(n)
    for i in range(n):
        r = [int(x) for x in rank[i]]
        w = 0.75 * (2 * unit_int(1, 0, r[0]) - 1)
        for f in range(1, 8):
            w += 0.75 * (2 * unit_int(1, f, r[f]) - 1)
        u = 0.5 * float(dense[i, 0])
        for c, d in zip((-0.5, 0.25, -0.25), dense[i, 1:]):
            u += c * float(d)
        v0, v1 = 2 * unit_int(2, 0, r[0]) - 1, 2 * unit_int(2, 1, r[1]) - 1
        logit[i] = -1.93 + w + u + 1.0 * v0 * v1
    p = 1 / (1 + np.exp(-logit))
    assert np.array_equal(data["cat_index"], np.arange(8) * 100_000 + rank)
    assert np.array_equal(data["dense"], dense)
    assert np.array_equal(ctr.click_logit(data), logit)  # bit for bit: the docs fix every rounding
    assert np.array_equal(data["click"], (draw < p).astype(np.float32))


def test_click_rate_and_the_bayes_auc(data):
    train, held = data
    assert train["click"].mean() == pytest.approx(0.25, abs=0.015)
    assert held["click"].mean() == pytest.approx(0.25, abs=0.02)
    assert ctr.click_probability(train).mean() == pytest.approx(train["click"].mean(), abs=0.01)
    ceiling = ctr.bayes_auc(held)
    print(f"Bayes AUC on the held-out split: {ceiling:.4f}")
    assert 0.78 <= ceiling <= 0.86


def test_prepare_writes_the_training_split_as_tasks(tmp_path, data):
    url, held = ctr.prepare(tmp_path.as_uri())
    assert url == tmp_path.as_uri() + "/train"
    assert ctr.dataset((tmp_path / "hook").as_uri()) == (tmp_path / "hook").as_uri() + "/train"
    source = pdps.open_data_source(url)
    tasks = source.tasks()
    assert len(tasks) == ctr.TRAIN // ctr.ROW_GROUP and {t.records for t in tasks} == {ctr.ROW_GROUP}
    read = [read_whole(source, t) for t in tasks]
    train, expected_held = data
    for name in ("cat", "cat_index", "dense", "click"):
        assert np.array_equal(np.concatenate([r[name] for r in read]), train[name]), name
        assert np.array_equal(held[name], expected_held[name]), name


@pytest.fixture
def one_thread():
    """Batches of 256 gain nothing from threads, and on a busy 2-core machine torch's
    spinning threads make the 2 passes 30x slower (5 s, not 0.2 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def fit_reference(model, train, *, table_rule: str, table_lr: float, dense_rule: str, dense_lr: float, passes: int = 2, batch_size: int = 256) -> float:
    """Single-process torch, in the data's order; the seconds it took."""
    table = [model.embedding.weight]
    dense = [p for name, p in model.named_parameters() if not name.startswith("embedding.")]
    optimizers = [getattr(torch.optim, table_rule)(table, lr=table_lr), getattr(torch.optim, dense_rule)(dense, lr=dense_lr)]
    tensors = ctr.as_tensors(train)
    start = time.perf_counter()
    for _ in range(passes):
        for lo in range(0, ctr.TRAIN, batch_size):
            batch = {k: v[lo : lo + batch_size] for k, v in tensors.items()}
            for opt in optimizers:
                opt.zero_grad()
            ctr.loss(model, batch).backward()
            for opt in optimizers:
                opt.step()
    return time.perf_counter() - start


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's Adagrad, on its own sparse tensors
@pytest.mark.parametrize(
    "rules",
    [
        {"table_rule": "Adagrad", "table_lr": 0.05, "dense_rule": "Adam", "dense_lr": 0.001},
        {"table_rule": "SparseAdam", "table_lr": 0.01, "dense_rule": "Adam", "dense_lr": 0.001},
        # what a pdps job with JOB_DEFAULTS applies: Adagrad on the MLP and, as its row rule, on the table
        {"table_rule": "Adagrad", "table_lr": ctr.JOB_DEFAULTS["lr"], "dense_rule": "Adagrad", "dense_lr": ctr.JOB_DEFAULTS["lr"]},
    ],
    ids=["adagrad+adam", "sparseadam+adam", "job-defaults"],
)
def test_the_reference_model_learns_the_clicks(data, rules, one_thread):
    train, held = data
    model = ctr.build_model()
    assert isinstance(model.embedding, nn.EmbeddingBag) and model.embedding.sparse and model.ids == "cat_index"
    before = ctr.auc(model, held)
    seconds = fit_reference(model, train, **rules)
    assert model.embedding.weight.grad.is_sparse  # the table was trained by sparse gradients
    after = ctr.evaluate(model, held)["auc"]
    print(f"{rules}: held-out AUC {before:.4f} -> {after:.4f} in {seconds:.2f}s (2 passes, batch 256); Bayes {ctr.bayes_auc(held):.4f}")
    assert after >= 0.70
    assert after < ctr.bayes_auc(held) + 0.01


def test_evaluate_takes_the_parameters_as_a_state_dict(data):
    _, held = data
    model = ctr.build_model(seed=3)
    params = {k: v.clone() for k, v in model.state_dict().items()}
    assert ctr.evaluate(params, held) == ctr.evaluate(model, held)
    assert ctr.evaluate(params, held) != ctr.evaluate(ctr.build_model(seed=4), held)


def test_the_model_takes_the_table_it_is_given():
    unbounded = nn.Embedding(64, ctr.DIM)  # stands in for a HashEmbedding: ids from "cat" (here folded to 64 rows)
    del unbounded.num_embeddings
    model = ctr.build_model(unbounded)
    assert model.ids == "cat"
    batch = {"cat": torch.arange(16).reshape(2, 8) % 64, "dense": torch.zeros(2, 4)}
    assert model(batch).shape == (2,)
    # the same MLP initial weights for the same seed, whatever the table
    assert torch.equal(ctr.build_model(seed=5).mlp[0].weight, ctr.build_model(unbounded, seed=5).mlp[0].weight)
    with pytest.raises(ConfigError, match="800000 rows"):
        ctr.build_model(nn.EmbeddingBag(1000, ctr.DIM, mode="sum", sparse=True))
    with pytest.raises(ConfigError, match="width 8"):
        ctr.build_model(nn.EmbeddingBag(800_000, 8, mode="sum", sparse=True))
