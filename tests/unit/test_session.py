"""pdps.Session.local: targets, one update per optimizer eval, refusals, the conversion cache."""

from __future__ import annotations

import pytest
import torch

import pdps
from pdps.adapters.torch_graph import conversion_stats


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def mse(model, feed):
    return torch.nn.functional.mse_loss(model(feed["x"]), feed["y"])


def feed(n: int = 8, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, 3, generator=g, dtype=torch.float64), "y": torch.randn(n, 1, generator=g, dtype=torch.float64)}


def values(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_loss_alone_changes_nothing_and_is_the_loss():
    model = make_model()
    loss, opt = pdps.Loss(model, mse), torch.optim.Adam(model.parameters(), lr=0.1)
    before = values(model)
    with pdps.Session.local() as session:
        session.eval([loss, opt], feed())  # the rule's state exists now
        after_step = values(model)
        (value,) = session.eval(targets=[loss], feed=feed())
        (again,) = session.eval(targets=[loss], feed=feed())
    assert value == again == pytest.approx(mse(model, feed()).item(), abs=1e-15)
    assert all(torch.equal(a, b) for a, b in zip(after_step, values(model)))
    assert not all(torch.equal(a, b) for a, b in zip(before, after_step))
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_target_applies_exactly_one_torch_step():
    model, twin = make_model(), make_model()
    loss, opt = pdps.Loss(model, mse), torch.optim.Adam(model.parameters(), lr=0.05)
    reference = torch.optim.Adam(twin.parameters(), lr=0.05)
    with pdps.Session.local() as session:
        session.eval([loss], feed(seed=7))  # a local session takes its optimizer after a loss-only eval
        for i in range(3):
            targets = [loss, opt] if i == 0 else [opt]  # the loss named once is the one minimized
            got = session.eval(targets, feed(seed=i))
            assert got[-1] is None
            reference.zero_grad()
            mse(twin, feed(seed=i)).backward()
            reference.step()
            for a, b in zip(values(model), values(twin)):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    assert opt.state == {}  # the graph rule ran, not the optimizer's own step


def test_refusals_name_the_argument():
    model = make_model()
    loss, opt = pdps.Loss(model, mse), torch.optim.SGD(model.parameters(), lr=0.1)
    session = pdps.Session.local()
    with pytest.raises(pdps.ConfigError, match="targets"):
        session.eval([], feed())
    with pytest.raises(pdps.ConfigError, match="targets"):
        session.eval(["loss"], feed())
    with pytest.raises(pdps.ConfigError, match="targets: the optimizer minimizes a pdps.Loss"):
        session.eval([opt], feed())
    with pytest.raises(pdps.ConfigError, match="model.parameters"):
        session.eval([loss, torch.optim.SGD(make_model().parameters(), lr=0.1)], feed())
    with pytest.raises(pdps.ConfigError, match=r"feed\['x'\] must be a tensor"):
        session.eval([loss], {"x": [1.0, 2.0]})
    with pytest.raises(pdps.ConfigError, match="same number of samples"):
        session.eval([loss], {"x": torch.zeros(4, 3, dtype=torch.float64), "y": torch.zeros(3, 1, dtype=torch.float64)})
    session.eval([loss, opt], feed())
    with pytest.raises(pdps.ConfigError, match="one program"):
        session.eval([pdps.Loss(model, mse)], feed())
    with pytest.raises(pdps.ConfigError, match="one optimizer"):
        session.eval([loss, torch.optim.SGD(model.parameters(), lr=0.1)], feed())
    with pytest.raises(pdps.ConfigError, match="0-d floating tensor"):
        pdps.Session.local().eval([pdps.Loss(model, lambda m, f: m(f["x"]))], feed())
    with pytest.raises(pdps.ConfigError, match="torch.nn.Module"):
        pdps.Loss("model", mse)
    with pytest.raises(pdps.ConfigError, match="trainers must be"):
        pdps.Session.remote(trainers=0)
    with pytest.raises(pdps.ConfigError, match="optimizer is set by the session"):
        pdps.Session.remote(optimizer="Adam")
    with pytest.raises(pdps.ConfigError, match="has no scheme"):
        pdps.Session.remote(transport=object())
    session.close()
    session.close()  # idempotent
    with pytest.raises(pdps.ConfigError, match="closed"):
        session.eval([loss], feed())


def test_the_same_program_is_converted_once():
    before = conversion_stats()
    for _ in range(2):
        model = make_model()
        opt = torch.optim.Adam(model.parameters(), lr=0.0123, betas=(0.8, 0.95))  # hyper-parameters no other test uses
        with pdps.Session.local() as session:
            session.eval([pdps.Loss(model, mse), opt], feed())
            session.eval([opt], feed())
    after = conversion_stats()
    assert after["traced"] - before["traced"] == 1
    assert after["hits"] - before["hits"] == 1
