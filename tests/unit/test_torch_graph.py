"""Update rules traced from torch optimizers and run from their graph on pserver shards."""

from __future__ import annotations

import json

import pytest
import torch

from pdps.adapters.torch_compute import TorchShard
from pdps.adapters.torch_graph import GraphOptimizer, conversion_stats, convert, graph_rule
from pdps.core.errors import BadGraph, ConfigError
from tests.unit.test_torch_compute import make_model, shard_and_grads, train_pdps


class ClippedSGD(torch.optim.Optimizer):
    """Global-norm clipping inside step: not element-wise."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                norm = p.grad.norm()  # the line the refusal names
                p.add_(p.grad / torch.clamp(norm, min=1.0), alpha=-group["lr"])


class AtanSGD(torch.optim.Optimizer):
    """Element-wise, but atan is not on the allowlist."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(torch.atan(p.grad), alpha=group["lr"])


class ItemSGD(torch.optim.Optimizer):
    """Reads a value into Python to branch on it."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad.max().item() > 0:
                    p.sub_(p.grad, alpha=group["lr"])


def params(dtype=torch.float64):
    return [torch.zeros(3, dtype=dtype, requires_grad=True)]


def test_global_norm_clipping_is_refused_naming_the_operator_and_the_line():
    with pytest.raises(BadGraph) as info:
        convert(ClippedSGD(params()))
    msg = str(info.value)
    assert "linalg_vector_norm" in msg and "reduces over the whole tensor" in msg
    assert "test_torch_graph.py" in msg and "norm = p.grad.norm()" in msg
    assert info.value.operator == "aten.linalg_vector_norm.default"


def test_an_operator_outside_the_allowlist_is_refused_naming_it_and_the_line():
    with pytest.raises(BadGraph, match=r"aten\.atan\.default at File .*test_torch_graph\.py.*torch\.atan\(p\.grad\)"):
        convert(AtanSGD(params()))


def test_reading_values_into_python_is_refused():
    with pytest.raises(ConfigError, match="ItemSGD"):
        convert(ItemSGD(params()))


def test_parameter_groups_with_different_hyper_parameters_are_refused():
    a, b = params(), params()
    opt = torch.optim.Adam([{"params": a, "lr": 0.1}, {"params": b, "lr": 0.2}])
    with pytest.raises(ConfigError, match="one group"):
        convert(opt)


def test_conversions_are_cached_by_class_hyper_parameters_and_dtype():
    before = conversion_stats()
    one = convert(torch.optim.Adam(params(), lr=0.0123))
    two = convert(torch.optim.Adam(params(), lr=0.0123))
    after = conversion_stats()
    assert one == two and one is not two
    assert after["traced"] == before["traced"] + 1 and after["hits"] == before["hits"] + 1
    convert(torch.optim.Adam(params(torch.float32), lr=0.0123))
    assert conversion_stats()["traced"] == before["traced"] + 2  # another dtype: traced again


def test_the_rule_is_json_and_names_no_code():
    name, args = graph_rule(torch.optim.AdamW(params(), lr=0.01, weight_decay=0.1))
    assert name == "graph"
    text = json.dumps(args)
    assert json.loads(text) == args
    ops = {n["op"] for p in ("first", "step") for n in args["graph"][p]["nodes"]}
    assert ops and all(op.count(".") == 1 for op in ops)


@pytest.mark.parametrize(
    ("name", "kwargs", "torch_kwargs"),
    [
        ("Adam", {"lr": 0.05, "betas": [0.8, 0.95]}, {"lr": 0.05, "betas": (0.8, 0.95)}),
        ("AdamW", {"lr": 0.05, "weight_decay": 0.1}, {"lr": 0.05, "weight_decay": 0.1}),
        ("Adam", {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
    ],
)
@pytest.mark.parametrize("pservers", [1, 2])
def test_adam_and_adamw_through_the_graph_equal_the_named_path(name, kwargs, torch_kwargs, pservers):
    graph = graph_rule(getattr(torch.optim, name)(make_model().parameters(), **torch_kwargs))
    named = train_pdps(name, kwargs, steps=5, pservers=pservers)
    got = train_pdps(*graph, steps=5, pservers=pservers)
    assert not torch.equal(got, train_pdps(name, kwargs, steps=0, pservers=1))
    torch.testing.assert_close(got, named, atol=1e-10, rtol=0)


def test_a_graph_shard_checkpoints_and_restores_like_a_named_one():
    name, args = graph_rule(torch.optim.Adam(make_model().parameters(), lr=0.05))
    shard, blocks, grads = shard_and_grads(name, args)
    for _ in range(3):
        shard.apply(grads)
    state = {k: v.clone() for k, v in shard.state_dict().items()}
    assert {"values", "state.step", "state.exp_avg", "state.exp_avg_sq"} <= set(state)
    restored = TorchShard(blocks, name, args)
    restored.load_state_dict(state)
    moved = TorchShard(blocks, name, args)
    moved.import_blocks({k: v.clone() for k, v in shard.export_blocks().items()})
    for _ in range(2):
        for s in (shard, restored, moved):
            s.apply(grads)
    assert torch.equal(restored.values, shard.values) and torch.equal(moved.values, shard.values)


def test_a_rule_for_another_dtype_or_a_broken_one_is_refused_when_the_shard_is_built():
    name, args = graph_rule(torch.optim.Adam(make_model().parameters(), lr=0.05))
    with pytest.raises(BadGraph, match="traced for float64"):
        GraphOptimizer(params(torch.float32), args["graph"])
    broken = json.loads(json.dumps(args["graph"]))
    broken["step"]["nodes"][0]["args"].append(3)  # an argument too many: the probe step finds it
    with pytest.raises(BadGraph, match="failed"):
        GraphOptimizer(params(), broken)


def test_a_step_updates_parameter_and_state_in_place_and_never_the_gradient():
    w = torch.randn(5, dtype=torch.float64)
    opt = GraphOptimizer([w], graph_rule(torch.optim.Adam(params(), lr=0.05))[1]["graph"])
    w.grad = torch.randn(5, dtype=torch.float64)
    grad = w.grad.clone()
    opt.step()  # first: makes the state
    ptrs = {k: v.data_ptr() for k, v in opt.state[w].items()}
    before = w.data_ptr()
    opt.step()
    assert w.data_ptr() == before and torch.equal(w.grad, grad)
    assert {k: v.data_ptr() for k, v in opt.state[w].items() if v.dim()} == {k: p for k, p in ptrs.items() if opt.state[w][k].dim()}


def test_running_a_program_leaves_inputs_that_are_not_writable_alone():
    from pdps.adapters.torch_graph import checked, run_rule

    rule = checked(graph_rule(torch.optim.Adam(params(), lr=0.05))[1]["graph"])
    p, g = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    first = run_rule(rule, p, g)
    kept = [t.clone() for t in (p, g, *first[1:])]
    run_rule(rule, p, g, first[1:])
    assert all(torch.equal(a, b) for a, b in zip(kept, (p, g, *first[1:])))


def test_a_hand_written_rule_runs_as_torch_sgd_with_momentum():
    """The checker's sample rule, written by hand (no tracing): its step writes its result
    into the second argument (the dead momentum buffer) and the parameter in place."""
    from tests.unit.test_updategraph import sgd_momentum

    a = torch.randn(6, dtype=torch.float64)
    b = a.clone()
    ref = torch.optim.SGD([a], lr=0.1, momentum=0.9)
    opt = GraphOptimizer([b], sgd_momentum())
    for k in range(4):
        g = torch.randn(6, dtype=torch.float64, generator=torch.Generator().manual_seed(k))
        a.grad, b.grad = g.clone(), g.clone()
        ref.step()
        opt.step()
        torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
        torch.testing.assert_close(opt.state[b]["buf"], ref.state[a]["momentum_buffer"], rtol=0, atol=1e-12)


def test_a_refused_rule_reaches_the_user_as_bad_graph_with_a_short_message():
    """What simulate, a pserver and Session.remote check (the compute port's check) raises
    the rule's own BadGraph, not a ConfigError quoting the ~10 KB rule."""
    from pdps.registry import open_compute

    _, args = graph_rule(torch.optim.Adam(make_model().parameters(), lr=0.05))
    broken = json.loads(json.dumps(args["graph"]))
    broken["step"]["nodes"][0]["args"].append(3)  # refused by the probe step
    other_dtype = dict(args["graph"], dtype="float32")  # refused by the output check
    outside = json.loads(json.dumps(args["graph"]))
    outside["step"]["nodes"][0]["op"] = "atan.default"  # refused by the checker
    compute = open_compute("torch", device="cpu")
    for graph in (broken, other_dtype, outside):
        with pytest.raises(BadGraph) as err:
            compute.check_optimizer("graph", {"graph": graph})
        assert type(err.value) is BadGraph
        assert len(str(err.value)) < 1000 and "'nodes'" not in str(err.value)
    with pytest.raises(ConfigError, match="takes no argument 'lr'") as err:
        compute.check_optimizer("graph", {**args, "lr": 0.1})
    assert "'nodes'" not in str(err.value) and "sha256" in str(err.value)


def test_a_job_registered_again_with_another_rule_names_the_rules_by_digest():
    from pdps.core.job import JobConfig
    from pdps.core.updategraph import digest
    from pdps.registry import open_store
    from pdps.roles.master import publish_job

    rules = [graph_rule(torch.optim.Adam(make_model().parameters(), lr=lr))[1] for lr in (1e-3, 2e-3)]
    store = open_store("memory://")
    publish_job(store, JobConfig(name="j", dataset="d", optimizer="graph", optimizer_args=rules[0]))
    publish_job(store, JobConfig(name="j", dataset="d", optimizer="graph", optimizer_args=rules[0]))  # the same rule: accepted
    with pytest.raises(ConfigError, match="already exists with other settings") as err:
        publish_job(store, JobConfig(name="j", dataset="d", optimizer="graph", optimizer_args=rules[1]))
    text = str(err.value)
    assert len(text) < 1000 and "'nodes'" not in text
    assert all(digest(r["graph"])[:12] in text for r in rules) and "lr=0.002" in text


def test_a_job_config_refusing_a_rule_shows_it_by_digest():
    from pdps.core.job import JobConfig

    _, args = graph_rule(torch.optim.Adam(make_model().parameters(), lr=0.05))
    graph = dict(args["graph"], state=tuple(args["graph"]["state"]))  # a tuple does not survive JSON as itself
    with pytest.raises(ConfigError, match="optimizer_args must be JSON-safe") as err:
        JobConfig(dataset="d", optimizer="graph", optimizer_args={"graph": graph})
    assert len(str(err.value)) < 1000 and "sha256" in str(err.value)
