"""Pipeline stages in torch (pdps.adapters.torch_pipeline): P stage runners in P threads
over an in-memory link train exactly as one process trains the whole model, under GPipe
and 1F1B, with microbatches of unequal sizes and shapes; their activation peaks are the
schedules' claims; split keeps the model's names and refuses bad cuts."""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict

import pytest
import torch
from torch import nn

from pdps.adapters.torch_pipeline import StageRunner, split
from pdps.core.errors import ConfigError, Timeout
from pdps.core.pipeline import gpipe, interleaved_1f1b, lower, one_f_one_b
from pdps.ports.link import Link
from tests.unit.fake_link import Mailboxes

JOIN_S = 20.0
LR = 0.1


def mse(out, target):
    return nn.functional.mse_loss(out, target)


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3)
    ).double()


def train_pipelined(stages, schedule, batches, loss_fn=mse, timeout=10.0):
    """Run every stage in its own thread for len(batches) SGD steps; each stage steps its
    own optimizer. Returns the last stage's losses and every runner."""
    P = len(stages)
    boxes = Mailboxes()
    runners = [StageRunner(m, s, P, boxes.link(s), loss_fn if s == P - 1 else None, timeout=timeout) for s, m in enumerate(stages)]
    losses, errors = [], []

    def work(s):
        runner, opt = runners[s], torch.optim.SGD(stages[s].parameters(), lr=LR)
        try:
            for inputs, targets in batches:
                opt.zero_grad()
                first = s == 0
                loss = runner.run(schedule[s], inputs if first else None, targets if first else None)
                opt.step()
                if s == P - 1:
                    losses.append(loss)
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,), daemon=True) for s in range(P)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a stage hung"
    if errors:
        raise errors[0]
    assert boxes.pending() == [], "messages left unreceived"
    return losses, runners, boxes


def train_whole(model, batches, microbatches, loss_fn=mse):
    """Single-process reference: per step the batch-mean loss of its microbatches."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for inputs, targets in batches:
        opt.zero_grad()
        xs = inputs if isinstance(inputs, list) else list(torch.tensor_split(inputs, microbatches))
        ys = targets if isinstance(targets, list) else list(torch.tensor_split(targets, microbatches))
        batch = sum(y.shape[0] for y in ys)
        loss = sum(loss_fn(model(x), y) * (y.shape[0] / batch) for x, y in zip(xs, ys))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def assert_same_parameters(stages, reference):
    ref = dict(reference.named_parameters())
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            torch.testing.assert_close(p, ref[name], atol=1e-10, rtol=0)
            seen.add(name)
    assert seen == set(ref)


@pytest.mark.parametrize("make", [gpipe, one_f_one_b], ids=["gpipe", "1f1b"])
def test_four_stages_train_exactly_like_one_process(make):
    P, M, K = 4, 4, 3
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(10, 5, generator=gen, dtype=torch.float64), torch.randn(10, 3, generator=gen, dtype=torch.float64)) for _ in range(K)]
    model = mlp()
    reference = copy.deepcopy(model)
    before = copy.deepcopy(model)
    stages = split(model, P)
    losses, runners, _ = train_pipelined(stages, make(P, M), batches)  # 10 rows in 4: sizes 3, 3, 2, 2
    expected = train_whole(reference, batches, M)
    assert_same_parameters(stages, reference)
    assert losses == pytest.approx(expected, abs=1e-12)
    moved = [(p - q).abs().max().item() for p, q in zip(model.parameters(), before.parameters())]
    assert min(moved) > 1e-4  # every parameter trained (no stage silently skipped)
    peaks = [r.peak_activations for r in runners]
    assert all(r.activations == 0 for r in runners)
    if make is gpipe:
        assert peaks == [M] * P
    else:
        assert peaks == [min(M, P - s) for s in range(P)]
        assert max(peaks) <= P


def test_1f1b_peaks_stay_at_the_stages_left_with_many_microbatches():
    P, M = 3, 7
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(9, 5, generator=gen, dtype=torch.float64), torch.randn(9, 3, generator=gen, dtype=torch.float64))]
    model = mlp(3)
    reference = copy.deepcopy(model)
    stages = split(model, P)
    _, one, _ = train_pipelined(stages, one_f_one_b(P, M), batches)
    assert [r.peak_activations for r in one] == [3, 2, 1]
    train_whole(reference, batches, M)
    assert_same_parameters(stages, reference)


class MeanOverTime(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def test_sequences_of_varying_length_per_microbatch_and_step():
    P, M, d = 3, 3, 4
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d), nn.Tanh(), MeanOverTime(), nn.Linear(d, 1)).double()
    reference = copy.deepcopy(model)
    batches = []
    for lengths in ([3, 7, 5], [9, 2, 4]):  # a new length for every microbatch of every step
        sizes = [2, 3, 1]
        xs = [torch.randn(b, T, d, generator=gen, dtype=torch.float64) for b, T in zip(sizes, lengths)]
        ys = [torch.randn(b, 1, generator=gen, dtype=torch.float64) for b in sizes]
        batches.append((xs, ys))
    stages = split(model, P, points=[2, 4])
    losses, _, boxes = train_pipelined(stages, one_f_one_b(P, M), batches)
    expected = train_whole(reference, batches, M)
    assert_same_parameters(stages, reference)
    assert losses == pytest.approx(expected, abs=1e-12)
    acts = {shapes[0] for src, dst, tag, shapes in boxes.sent if src == 0 and tag.endswith("/act")}
    assert acts == {(2, 3, d), (3, 7, d), (1, 5, d), (2, 9, d), (3, 2, d), (1, 4, d)}


class WithLengths(nn.Module):
    """Passes a non-floating tensor on beside the activation: it carries no gradient back."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, x):
        return torch.tanh(self.lin(x)), torch.full((x.shape[0],), 2, dtype=torch.int64)


class ScaleBy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 2).double()

    def forward(self, hk):
        h, k = hk
        return self.lin(h) * k[:, None]


def test_tuple_activations_with_a_non_floating_member():
    torch.manual_seed(6)
    model = nn.Sequential(WithLengths(), ScaleBy())
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(7)
    batches = [(torch.randn(5, 3, generator=gen, dtype=torch.float64), torch.randn(5, 2, generator=gen, dtype=torch.float64)) for _ in range(2)]
    stages = split(model, 2)
    train_pipelined(stages, one_f_one_b(2, 2), batches)
    train_whole(reference, batches, 2)
    assert_same_parameters(stages, reference)


def test_a_single_stage_is_plain_gradient_accumulation():
    gen = torch.Generator().manual_seed(8)
    batches = [(torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(7, 3, generator=gen, dtype=torch.float64))]
    model = mlp(9)
    reference = copy.deepcopy(model)
    losses, runners, boxes = train_pipelined(split(model, 1), gpipe(1, 3), batches)
    assert losses == pytest.approx(train_whole(reference, batches, 3), abs=1e-12)
    assert_same_parameters([model], reference)
    assert boxes.sent == []


def test_split_keeps_the_models_names_and_parameters():
    model = mlp()
    stages = split(model, 4)
    assert [list(s._modules) for s in stages] == [["0", "1"], ["2", "3"], ["4", "5"], ["6"]]
    assert [n for s in stages for n, _ in s.named_parameters()] == [n for n, _ in model.named_parameters()]
    assert all(p is q for p, q in zip((p for s in stages for p in s.parameters()), model.parameters()))
    assert set(stages[2].state_dict()) == {"4.weight", "4.bias"}
    x = torch.randn(2, 5, dtype=torch.float64)
    y = x
    for s in stages:
        y = s(y)
    torch.testing.assert_close(y, model(x))
    cut = split(model, 3, points=[1, 5])
    assert [list(s._modules) for s in cut] == [["0"], ["1", "2", "3", "4"], ["5", "6"]]
    named = nn.Sequential(OrderedDict(embed=nn.Linear(2, 2), act=nn.ReLU(), head=nn.Linear(2, 1)))
    assert [n for n, _ in split(named, 2)[1].named_parameters()] == ["head.weight", "head.bias"]


def test_split_balances_parameter_counts():
    model = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(1, 1), nn.Linear(1, 10))
    counts = [[sum(p.numel() for p in s.parameters()) for s in split(model, P)] for P in (2, 3)]
    assert counts == [[110, 35], [110, 13, 22]]  # 3 stages: the heaviest is 110 anyway, then the fewest children per stage


def test_split_refusals():
    model = mlp()
    with pytest.raises(ConfigError, match="7 children, fewer than the 8 stages"):
        split(model, 8)
    with pytest.raises(ConfigError, match="nn.Sequential"):
        split(nn.Linear(2, 2), 1)
    with pytest.raises(ConfigError, match="stages >= 1"):
        split(model, 0)
    with pytest.raises(ConfigError, match="3 stages need 2"):
        split(model, 3, points=[2])
    with pytest.raises(ConfigError, match="do not increase at index 1"):
        split(model, 3, points=[3, 3])
    with pytest.raises(ConfigError, match=r"points\[1\] is 7: a cut is a child index in \[1, 6\]"):
        split(model, 3, points=[2, 7])
    with pytest.raises(ConfigError, match=r"points\[0\] is 0"):
        split(model, 2, points=[0])
    shared = nn.Linear(3, 3)
    with pytest.raises(ConfigError, match="parameter '2.weight' of stage 1 is '0.weight' of stage 0"):
        split(nn.Sequential(shared, nn.Tanh(), shared), 2, points=[2])
    # a table would be pulled and never pushed by a stage: refused by name, whichever kind
    import pdps.nn

    for table in (nn.EmbeddingBag(10, 6, mode="sum", sparse=True), pdps.nn.HashEmbedding(6, mode="sum")):
        with pytest.raises(ConfigError, match=r"sparse tables \['0.weight'\]: a pipeline stage does not pull or push table rows"):
            split(nn.Sequential(table, nn.Linear(6, 1)), 2)
    split(nn.Sequential(nn.EmbeddingBag(10, 6, mode="sum"), nn.Linear(6, 1)), 2)  # a dense embedding is a layer like any


def test_runner_refusals_and_bounded_waits():
    boxes = Mailboxes()
    assert isinstance(boxes.link(0), Link)
    stages = split(mlp(), 2)
    with pytest.raises(ConfigError, match="needs a loss_fn"):
        StageRunner(stages[1], 1, 2, boxes.link(1))
    with pytest.raises(ConfigError, match="ranks .* name 3 ranks for 2 stages"):
        StageRunner(stages[0], 0, 2, boxes.link(0), ranks=(0, 1, 2))
    first = StageRunner(stages[0], 0, 2, boxes.link(0), timeout=0.2)
    x, y = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 3, dtype=torch.float64)
    with pytest.raises(ConfigError, match="3 rows, fewer than the 4 microbatches"):
        first.run(gpipe(2, 4)[0], x, y)
    with pytest.raises(ConfigError, match="one runner runs one stage"):
        first.run(gpipe(2, 2)[1], x, y)
    with pytest.raises(ConfigError, match="interleaved chunks"):
        first.run(interleaved_1f1b(2, 2, 2)[0], x, y)
    with pytest.raises(ConfigError, match="BACKWARD of microbatch 0 on stage 0 comes before FORWARD"):
        first.run(list(reversed(gpipe(2, 1)[0])), x, y)
    with pytest.raises(ConfigError, match="microbatch 0 holds 2 inputs and 3 targets"):
        first.run(gpipe(2, 1)[0], [x[:2]], [y])
    last = StageRunner(stages[1], 1, 2, boxes.link(1), mse, timeout=0.2)
    with pytest.raises(ConfigError, match="first stage takes the batch"):
        last.run(gpipe(2, 1)[1], x, y)
    with pytest.raises(ConfigError, match="SEND_ACT of microbatch 0 on stage 1 has no peer: stage 1 of 2"):  # nothing after the last stage
        last.run(lower(gpipe(3, 1))[1])
    with pytest.raises(Timeout, match="targets"):  # nobody sends: the wait ends
        last.run(lower(gpipe(2, 1))[1])
