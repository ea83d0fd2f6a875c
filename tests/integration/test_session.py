"""pdps.Session.remote: real pserver roles and trainer workers; equal to a local session."""

from __future__ import annotations

import pytest
import torch

import pdps
from pdps.adapters.grpc_transport import GrpcTransport
from tests.unit.test_session import feed, make_model, mse, values


class Lion(torch.optim.Optimizer):
    """A user-defined rule: defined here, run from its graph."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.99)):
        super().__init__(params, {"lr": lr, "betas": betas})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.add_(m.mul(b1).add(p.grad, alpha=1 - b1).sign(), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


def run(session: pdps.Session, make_optimizer, evals: int = 3) -> tuple[list[float], list[torch.Tensor]]:
    model = make_model()
    loss, opt = pdps.Loss(model, mse), make_optimizer(model.parameters())
    with session:
        got = [session.eval([loss, opt], feed(seed=i))[0] for i in range(evals)]
        before = values(model)
        got.append(session.eval([loss], feed(seed=9))[0])  # changes nothing
        assert all(torch.equal(a, b) for a, b in zip(before, values(model)))
        assert session.eval([opt], feed(seed=10)) == [None]  # the loss named before is the one minimized
        pservers = getattr(session._runtime, "_roles", [])
        assert all(ps.steps == evals + 1 for ps in pservers), [ps.steps for ps in pservers]  # one round per optimizer eval
    return got, values(model)


@pytest.mark.parametrize(
    "make_optimizer",
    [lambda ps: torch.optim.Adam(ps, lr=0.05), lambda ps: Lion(ps, lr=0.01)],
    ids=["Adam", "Lion"],
)
def test_remote_equals_local(make_optimizer):
    local = run(pdps.Session.local(), make_optimizer)
    remote = run(pdps.Session.remote(store="memory://", transport="inproc://", trainers=2, pservers=2, min_block=4), make_optimizer)
    assert local[0] == pytest.approx(remote[0], abs=1e-10, rel=0)
    for a, b in zip(local[1], remote[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    assert not all(torch.equal(a, b) for a, b in zip(local[1], values(make_model())))  # it trained


def test_remote_refuses_what_it_cannot_run():
    model = make_model()
    loss = pdps.Loss(model, mse)
    with pdps.Session.remote(trainers=3, pservers=1) as session:
        with pytest.raises(pdps.ConfigError, match="first eval"):
            session.eval([loss], feed())  # the job starts without an optimizer ...
            session.eval([torch.optim.SGD(model.parameters(), lr=0.1)], feed())  # ... and cannot take one later
        with pytest.raises(pdps.ConfigError, match="fewer than the session's 3 trainers"):
            session.eval([loss], feed(n=2))


def test_remote_over_etcd_and_grpc(etcd_store):
    transport = GrpcTransport(token="session-test")
    local = run(pdps.Session.local(), lambda ps: Lion(ps, lr=0.01), evals=2)
    remote = run(
        pdps.Session.remote(store=etcd_store, transport=transport, address="grpc://127.0.0.1:0", trainers=2, pservers=2, min_block=4),
        lambda ps: Lion(ps, lr=0.01),
        evals=2,
    )
    assert local[0] == pytest.approx(remote[0], abs=1e-10, rel=0)
    for a, b in zip(local[1], remote[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_a_trainer_that_fails_does_not_hang_the_others_and_fails_the_session():
    def picky(model, feed):
        if len(feed["x"]) == 3:  # 7 samples over 2 trainers: shares of 4 and 3
            raise ValueError("this share is refused")
        return mse(model, feed)

    model = make_model()
    loss, opt = pdps.Loss(model, picky), torch.optim.SGD(model.parameters(), lr=0.1)
    with pdps.Session.remote(trainers=2, pservers=1) as session:
        with pytest.raises(ValueError, match="this share is refused"):
            session.eval([loss, opt], feed(n=7))
        with pytest.raises(pdps.ConfigError, match="failed in an earlier eval"):
            session.eval([loss], feed())


@pytest.mark.parametrize("transport", ["grpc", GrpcTransport], ids=["scheme", "adapter"])
def test_remote_over_grpc_given_without_an_address(transport):
    """A gRPC transport named by its scheme alone (or given as an adapter) serves the
    pservers on 127.0.0.1 at free ports, as the docs say; it raised IndexError."""
    session = pdps.Session.remote(transport=transport if isinstance(transport, str) else transport(), trainers=2, pservers=2, min_block=4)
    assert session._runtime._address == "grpc://127.0.0.1:0"
    local = run(pdps.Session.local(), lambda ps: torch.optim.Adam(ps, lr=0.05), evals=2)
    remote = run(session, lambda ps: torch.optim.Adam(ps, lr=0.05), evals=2)
    assert local[0] == pytest.approx(remote[0], abs=1e-10, rel=0)
    for a, b in zip(local[1], remote[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)


def test_remote_refuses_one_fixed_port_for_several_pservers():
    with pytest.raises(pdps.ConfigError, match="names port 5000, but 2 roles serve"):
        pdps.Session.remote(transport="grpc://127.0.0.1:5000", pservers=2)
