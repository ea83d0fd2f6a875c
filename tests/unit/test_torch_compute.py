"""The torch compute adapter: optimizer rules, the flat-buffer replica, pserver shards."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch import nn

from pdps.adapters.torch_compute import ELEMENTWISE, REFUSED, TorchCompute, TorchReplica, TorchShard
from pdps.core.errors import ConfigError, GradientRejected, NotReady, UnknownSchemeError
from pdps.core.slots import Layout, SlotMap, cut_blocks
from pdps.ports.compute import Compute, ThreadedCompute
from pdps.registry import open_compute

# Arguments that make every rule do something visible in a few steps; lists where
# torch takes tuples, as they arrive from a JSON job config.
RULES = {
    "SGD": {"lr": 0.1},
    "SGD-momentum": {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 0.05, "betas": [0.8, 0.95], "amsgrad": True},
    "AdamW": {"lr": 0.05, "weight_decay": 0.1},
    "Adagrad": {"lr": 0.1, "lr_decay": 0.01},
    "RMSprop": {"lr": 0.01, "momentum": 0.5, "centered": True},
    "Adadelta": {"lr": 1.0},
    "Adamax": {"lr": 0.05},
    "NAdam": {"lr": 0.05},
    "RAdam": {"lr": 0.05},
    "Rprop": {"lr": 0.05, "etas": [0.4, 1.3], "step_sizes": [1e-6, 1.0]},
    "ASGD": {"lr": 0.05, "t0": 1.0},
    "tests.unit.rules_for_tests:SignSGD": {"lr": 0.01},
}


def rule(key: str) -> tuple[str, dict]:
    return key.split("-")[0], RULES[key]


def make_model(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 4)).to(dtype)


def batch(step: int, dtype: torch.dtype = torch.float64, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=g, dtype=dtype)
    y = torch.randn(8, 4, generator=g, dtype=dtype)
    return x.to(device), y.to(device)


def loss_of(model: nn.Module, step: int, dtype: torch.dtype = torch.float64, device: str = "cpu") -> torch.Tensor:
    x, y = batch(step, dtype, device)
    return nn.functional.mse_loss(model(x), y)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_reference(name: str, kwargs: dict, steps: int, device: str = "cpu", dtype=torch.float64, **extra) -> torch.Tensor:
    """torch.optim on the model's own parameters: the result pdps must reproduce."""
    model = make_model(dtype=dtype).to(device)
    if ":" in name:
        from tests.unit import rules_for_tests

        cls = getattr(rules_for_tests, name.split(":")[1])
    else:
        cls = getattr(torch.optim, name)
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    opt = cls(model.parameters(), **args, **extra)
    for step in range(steps):
        opt.zero_grad()
        loss_of(model, step, dtype, device).backward()
        opt.step()
    return flat(model)


def train_pdps(name: str, kwargs: dict, steps: int, pservers: int, device: str = "cpu", dtype=torch.float64) -> torch.Tensor:
    """One trainer, ``pservers`` shards: push every block's gradient, step, pull."""
    compute = TorchCompute(device)
    replica = compute.replica(make_model(dtype=dtype))
    layout = Layout.build(replica.specs, SlotMap.initial(pservers, num_slots=16), min_block=16)
    shards = [compute.shard(layout.blocks_of(i), name, kwargs) for i in range(pservers)]
    if pservers > 1:
        assert sum(1 for s in shards if s.blocks) >= 2, "the layout should spread blocks over several pservers"
    for s in shards:
        s.initialize(replica.values(s.blocks), "t0")
    for step in range(steps):
        replica.zero_grad()
        loss_of(replica.module, step, dtype, device).backward()
        for s in shards:
            grads = replica.grads(s.blocks)
            s.check(grads, "t0")
            s.apply(grads)
        for s in shards:
            replica.load(s.blocks, s.views())
    return replica.flat_params.clone()


# --- optimizers ---------------------------------------------------------------------------


class TestOptimizerRules:
    compute = TorchCompute("cpu")

    def test_is_a_compute_port(self):
        assert isinstance(self.compute, Compute)

    def test_is_chosen_through_the_registry(self):
        compute = open_compute("torch", device="cpu")
        assert isinstance(compute, TorchCompute) and compute.device == "cpu"
        assert isinstance(open_compute("torch://"), Compute)
        with pytest.raises(UnknownSchemeError, match=r"unknown compute scheme 'jax' in 'jax://'; known schemes: torch://"):
            open_compute("jax")

    @pytest.mark.parametrize("name", ELEMENTWISE)
    def test_elementwise_rules_are_allowed(self, name):
        self.compute.check_optimizer(name, {})

    @pytest.mark.parametrize(
        ("name", "reason"),
        [("LBFGS", "closure"), ("SparseAdam", "sparse"), ("Adafactor", "whole matrix"), ("Muon", "whole weight matrix")],
    )
    def test_whole_tensor_rules_are_refused_with_a_reason(self, name, reason):
        assert name in REFUSED
        with pytest.raises(ConfigError, match=reason):
            self.compute.check_optimizer(name, {})
        with pytest.raises(ConfigError, match=reason):
            self.compute.check_optimizer(f"torch.optim.{name}", {})

    def test_unknown_name_lists_the_allowed_rules(self):
        with pytest.raises(ConfigError) as e:
            self.compute.check_optimizer("Lion", {})
        for name in ELEMENTWISE:
            assert name in str(e.value)
        assert "pdps_elementwise" in str(e.value)

    def test_near_miss_gets_a_hint(self):
        with pytest.raises(ConfigError, match="did you mean 'AdamW'"):
            self.compute.check_optimizer("adamw", {})

    @pytest.mark.parametrize("path", ["tests.unit.rules_for_tests:SignSGD", "tests.unit.rules_for_tests.SignSGD", "torch.optim:Adam"])
    def test_rule_by_import_path(self, path):
        self.compute.check_optimizer(path, {"lr": 0.5})

    def test_user_rule_must_declare_elementwise(self):
        with pytest.raises(ConfigError, match="pdps_elementwise = True") as e:
            self.compute.check_optimizer("tests.unit.rules_for_tests:NormalisedSGD", {})
        assert "independently" in str(e.value)

    def test_user_rule_must_be_an_optimizer(self):
        with pytest.raises(ConfigError, match="not a torch.optim.Optimizer subclass"):
            self.compute.check_optimizer("tests.unit.rules_for_tests:NotAnOptimizer", {})

    @pytest.mark.parametrize("path", ["no_such_module_xyz:Rule", "tests.unit.rules_for_tests:Missing"])
    def test_user_rule_must_import(self, path):
        with pytest.raises(ConfigError, match="cannot import"):
            self.compute.check_optimizer(path, {})

    @pytest.mark.parametrize(
        ("kwargs", "key"),
        [
            ({"lr": float("nan")}, "lr"),
            ({"lr": float("inf")}, "lr"),
            ({"lr": torch.tensor(0.1)}, "lr"),
            ({"lr": 0.1, "betas": (0.9, object())}, "betas"),
            ({"weight_decay": {1: 0.5}}, "weight_decay"),
        ],
    )
    def test_json_unsafe_arguments_are_refused(self, kwargs, key):
        with pytest.raises(ConfigError, match=f"'{key}'.*JSON-safe"):
            self.compute.check_optimizer("Adam", kwargs)

    def test_differentiable_is_refused(self):
        with pytest.raises(ConfigError, match="'differentiable'.*autograd"):
            self.compute.check_optimizer("Adam", {"differentiable": True})

    @pytest.mark.parametrize(
        ("name", "kwargs", "message"),
        [
            ("SGD", {"lr": -1.0}, "Invalid learning rate"),
            ("Adam", {"bogus": 1}, "bogus"),
            ("SGD", {"lr": 0.1, "nesterov": True}, "Nesterov"),
            ("Adam", {"betas": [0.9, 1.5]}, "beta"),
        ],
    )
    def test_arguments_the_rule_refuses(self, name, kwargs, message):
        with pytest.raises(ConfigError, match=message) as e:
            self.compute.check_optimizer(name, kwargs)
        assert repr(name) in str(e.value)

    def test_json_lists_work_for_tuple_arguments(self):
        blocks = cut_blocks(TorchReplica(make_model(), "cpu").specs)
        shard = self.compute.shard(blocks, "Adam", {"betas": [0.8, 0.9]})
        assert shard.optimizer.param_groups[0]["betas"] == (0.8, 0.9)

    def test_foreach_is_chosen_unless_the_user_chose(self):
        blocks = cut_blocks(TorchReplica(make_model(), "cpu").specs)
        assert self.compute.shard(blocks, "Adam", {}).optimizer.defaults["foreach"] is True
        assert self.compute.shard(blocks, "Adam", {"foreach": False}).optimizer.defaults["foreach"] is False

    def test_shard_refuses_what_check_refuses(self):
        blocks = cut_blocks(TorchReplica(make_model(), "cpu").specs)
        with pytest.raises(ConfigError, match="closure"):
            self.compute.shard(blocks, "LBFGS", {})
        with pytest.raises(ConfigError, match="lr"):
            TorchShard(blocks, "SGD", {"lr": -1.0})


# --- replica -----------------------------------------------------------------------------


class TestReplica:
    def test_params_are_views_of_the_flat_buffer_with_values_kept(self):
        model = make_model()
        before = flat(model).clone()
        replica = TorchReplica(model, "cpu")
        assert torch.equal(replica.flat_params, before)
        assert replica.numel == before.numel() == 114
        assert [s.name for s in replica.specs] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert {s.dtype for s in replica.specs} == {"float64"}
        replica.flat_params.fill_(0.25)
        assert all(bool((p == 0.25).all()) for p in model.parameters())

    def test_backward_accumulates_into_the_flat_grad_buffer(self):
        reference = make_model()
        replica = TorchReplica(make_model(), "cpu")
        for step in (0, 1):
            loss_of(reference, step).backward()
            loss_of(replica.module, step).backward()
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        torch.testing.assert_close(replica.flat_grads, expected, rtol=1e-13, atol=0)
        blocks = cut_blocks(replica.specs, min_block=16)
        got = torch.cat([g.reshape(-1) for g in replica.grads(blocks)])
        assert torch.equal(got, replica.flat_grads)
        assert all(g._base is replica.flat_grads for g in replica.grads(blocks))

    def test_zero_grad_zeroes_the_buffer_and_keeps_the_binding(self):
        replica = TorchReplica(make_model(), "cpu")
        loss_of(replica.module, 0).backward()
        assert replica.flat_grads.abs().sum() > 0
        replica.module.zero_grad(set_to_none=True)
        replica.zero_grad()
        assert not replica.flat_grads.any()
        loss_of(replica.module, 0).backward()
        assert replica.flat_grads.abs().sum() > 0  # autograd wrote into the buffer again

    def test_ensure_bound_after_set_to_none_keeps_new_gradients(self):
        reference = make_model()
        loss_of(reference, 3).backward()
        replica = TorchReplica(make_model(), "cpu")
        loss_of(replica.module, 0).backward()
        replica.module.zero_grad(set_to_none=True)
        loss_of(replica.module, 3).backward()  # autograd allocates fresh .grad tensors
        grads = replica.grads(cut_blocks(replica.specs))
        expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
        assert torch.equal(torch.cat([g.reshape(-1) for g in grads]), expected)
        for p, g in zip(replica.module.parameters(), grads):
            assert p.grad.data_ptr() == g.data_ptr()

    def test_ensure_bound_after_set_to_none_alone_means_zero(self):
        replica = TorchReplica(make_model(), "cpu")
        loss_of(replica.module, 0).backward()
        replica.module.zero_grad(set_to_none=True)
        assert not torch.cat([g.reshape(-1) for g in replica.grads(cut_blocks(replica.specs))]).any()

    def test_ensure_bound_after_the_module_replaced_its_data(self):
        replica = TorchReplica(make_model(), "cpu")
        first = next(replica.module.parameters())
        first.data = torch.full_like(first, 7.0)
        values = replica.values(cut_blocks(replica.specs))
        assert bool((values[0] == 7.0).all())
        assert first.data_ptr() == replica.flat_params.data_ptr()

    def test_load_copies_into_the_model(self):
        replica = TorchReplica(make_model(), "cpu")
        blocks = cut_blocks(replica.specs, min_block=16)
        new = [torch.full(b.shape, float(i), dtype=torch.float32) for i, b in enumerate(blocks)]
        replica.load(blocks, new)
        for b, t in zip(blocks, new):
            assert torch.equal(replica.flat_params[b.offset : b.offset + b.numel], t.reshape(-1).double())
        new[0].fill_(-1.0)  # a copy, not an alias
        assert not bool((replica.flat_params[: blocks[0].numel] == -1.0).any())
        out = replica.module(torch.zeros(1, 6, dtype=torch.float64))
        assert out.shape == (1, 4)

    def test_load_refuses_a_wrong_shape_before_writing(self):
        replica = TorchReplica(make_model(), "cpu")
        blocks = cut_blocks(replica.specs)
        before = replica.flat_params.clone()
        bad = [torch.zeros(b.shape, dtype=torch.float64) for b in blocks]
        bad[-1] = torch.zeros(3, dtype=torch.float64)
        with pytest.raises(ConfigError, match=r"2\.bias"):
            replica.load(blocks, bad)
        assert torch.equal(replica.flat_params, before)

    def test_blocks_of_another_model_are_refused(self):
        replica = TorchReplica(make_model(), "cpu")
        other = cut_blocks(TorchReplica(nn.Linear(3, 3).double(), "cpu").specs)
        with pytest.raises(ConfigError, match="does not belong"):
            replica.grads(other)

    def test_mixed_dtypes_are_refused_naming_the_parameter(self):
        model = make_model()
        model[2].bias.data = model[2].bias.data.float()
        with pytest.raises(ConfigError, match=r"'2\.bias' is float32"):
            TorchReplica(model, "cpu")

    def test_mixed_devices_are_refused_naming_the_parameter(self):
        model = make_model()
        model[2].weight = nn.Parameter(torch.empty(4, 10, dtype=torch.float64, device="meta"))
        with pytest.raises(ConfigError, match=r"'2\.weight' is on meta"):
            TorchReplica(model, "cpu")

    def test_tied_parameters_are_bound_once(self):
        a, b = nn.Linear(4, 4), nn.Linear(4, 4)
        b.weight = a.weight
        replica = TorchReplica(nn.Sequential(a, b).double(), "cpu")
        assert [s.name for s in replica.specs] == ["0.weight", "0.bias", "1.bias"]
        assert replica.module[1].weight.data_ptr() == replica.flat_params.data_ptr()


# --- shard -------------------------------------------------------------------------------


def shard_and_grads(name="SGD", kwargs=None, min_block=16):
    replica = TorchReplica(make_model(), "cpu")
    blocks = cut_blocks(replica.specs, min_block=min_block)
    shard = TorchShard(blocks, name, kwargs or {"lr": 0.1})
    shard.initialize(replica.values(blocks), "t0")
    loss_of(replica.module, 0).backward()
    return shard, blocks, [g.clone() for g in replica.grads(blocks)]


class TestShard:
    @pytest.mark.parametrize("key", list(RULES))
    def test_one_shard_of_all_blocks_matches_torch_optim(self, key):
        name, kwargs = rule(key)
        # the shard runs torch's foreach kernels; so does the reference, and they agree bit for bit
        expected = train_reference(name, kwargs, steps=4, **({} if ":" in name else {"foreach": True}))
        got = train_pdps(name, kwargs, steps=4, pservers=1)
        assert not torch.equal(got, flat(make_model()))  # the rule did move the model
        assert torch.equal(got, expected)

    @pytest.mark.parametrize("key", list(RULES))
    @pytest.mark.parametrize("pservers", [2, 3])
    def test_split_shards_give_exactly_the_same_model(self, key, pservers):
        name, kwargs = rule(key)
        assert torch.equal(train_pdps(name, kwargs, 4, pservers), train_pdps(name, kwargs, 4, 1))

    def test_views_are_shaped_like_blocks_and_alias_the_shard(self):
        shard, blocks, _ = shard_and_grads()
        views = shard.views()
        assert [tuple(v.shape) for v in views] == [b.shape for b in blocks]
        assert all(v._base is shard.values for v in views)

    def test_not_ready_before_initialize(self):
        blocks = cut_blocks(TorchReplica(make_model(), "cpu").specs)
        shard = TorchShard(blocks, "SGD", {"lr": 0.1})
        assert shard.initialized is False
        with pytest.raises(NotReady):
            shard.apply([torch.zeros(b.shape, dtype=torch.float64) for b in blocks])
        with pytest.raises(NotReady):
            shard.views()

    def test_a_pserver_with_no_blocks_works(self):
        shard = TorchShard([], "Adam", {"lr": 0.1})
        shard.initialize([], "t0")
        shard.check([], "t0")
        shard.stage("t0", [])
        shard.apply_staged([("t0", 1.0)])
        shard.apply([])
        assert shard.views() == [] and shard.numel == 0
        with pytest.raises(GradientRejected, match="got 1 tensors"):
            shard.check([torch.zeros(1)], "t0")

    def test_blocks_of_one_shard_share_a_dtype(self):
        specs = TorchReplica(make_model(), "cpu").specs
        blocks = cut_blocks(specs) + cut_blocks([type(specs[0])("x", (2,), "float32")])
        with pytest.raises(ConfigError, match="share a dtype"):
            TorchShard(blocks, "SGD", {"lr": 0.1})

    @pytest.mark.parametrize(
        ("corrupt", "message"),
        [
            (lambda gs: gs.__setitem__(2, torch.zeros(3, dtype=torch.float64)), r"has shape \(3,\) but the block is \(4, 6\)"),
            (lambda gs: gs.__setitem__(2, gs[2].float()), "has dtype float32 but the block is float64"),
            (lambda gs: gs[2].view(-1).__setitem__(5, float("nan")), "not finite: 1 NaN and 0 infinite"),
            (lambda gs: gs[2].view(-1).__setitem__(0, float("-inf")), "not finite: 0 NaN and 1 infinite"),
        ],
        ids=["shape", "dtype", "nan", "inf"],
    )
    def test_check_rejects_naming_parameter_and_trainer(self, corrupt, message):
        shard, blocks, grads = shard_and_grads()
        assert blocks[2].describe() == "0.weight[6:10]"
        corrupt(grads)
        before = [v.clone() for v in shard.views()]
        with pytest.raises(GradientRejected, match=message) as e:
            shard.check(grads, "t1")
        assert "0.weight[6:10]" in str(e.value) and "trainer 't1'" in str(e.value)
        assert all(torch.equal(a, b) for a, b in zip(before, shard.views()))

    def test_check_rejects_a_wrong_count(self):
        shard, blocks, grads = shard_and_grads()
        with pytest.raises(GradientRejected, match=f"trainer 't2'.*got {len(blocks) - 1} tensors.*{len(blocks)} blocks"):
            shard.check(grads[:-1], "t2")

    def test_check_accepts_a_good_push(self):
        shard, _, grads = shard_and_grads()
        shard.check(grads, "t1")

    def test_rejected_initial_values_change_nothing(self):
        blocks = cut_blocks(TorchReplica(make_model(), "cpu").specs)
        shard = TorchShard(blocks, "SGD", {"lr": 0.1})
        bad = [torch.ones(b.shape, dtype=torch.float64) for b in blocks]
        bad[-1][0] = float("nan")
        with pytest.raises(GradientRejected, match=r"initial value for 2\.bias\[0:4\] from trainer 't0'"):
            shard.initialize(bad, "t0")
        assert shard.initialized is False
        assert not shard.values.any()

    def test_apply_staged_is_the_weighted_mean_of_what_the_round_names(self):
        shard, blocks, g1 = shard_and_grads("SGD", {"lr": 1.0})
        g2 = [torch.randn(b.shape, dtype=torch.float64) for b in blocks]
        g3 = [torch.randn(b.shape, dtype=torch.float64) for b in blocks]
        twin = TorchShard(blocks, "SGD", {"lr": 1.0})
        twin.initialize(shard.views(), "t0")
        shard.stage("a", g1)
        shard.stage("b", g2)
        shard.stage("dead", g3)  # staged, but the round's record does not name it
        for g in g1 + g2:
            g.mul_(-7)  # staging copied: the trainer's buffer may change at once
        shard.apply_staged([("a", 3 / 8), ("b", 5 / 8)])
        mean = [(3.0 * a + 5.0 * b) / -56 for a, b in zip(g1, g2)]  # the staged (original) values
        torch.testing.assert_close(shard.values.grad, torch.cat([m.reshape(-1) for m in mean]), rtol=1e-13, atol=0)
        twin.apply(mean)
        torch.testing.assert_close(shard.values, twin.values, rtol=1e-13, atol=0)
        assert shard.staged() == set()  # the round is over: nothing stays staged
        with pytest.raises(KeyError, match="dead"):
            shard.apply_staged([("dead", 1.0)])
        # a new round holds only its own contributions, in reused buffers
        buffers = {k: v[0].data_ptr() for k, v in shard._staged.items()}
        before = shard.values.clone()
        shard.stage("b", g2)
        shard.apply_staged([("b", 1.0)])
        torch.testing.assert_close(shard.values, before - torch.cat([g.reshape(-1) for g in g2]), rtol=1e-15, atol=0)
        assert shard._staged["b"][0].data_ptr() == buffers["b"]
        shard.unstage("b", forget=True)
        assert "b" not in shard._staged

    @pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
    def test_apply_staged_step_steps_one_keys_staged_blocks_only(self, dtype):
        """An async step staged in pieces: applying it is one step of those blocks with
        those gradients (as :meth:`apply` of them); another trainer's pieces stay staged."""
        blocks = cut_blocks(TorchReplica(make_model(dtype=dtype), "cpu").specs, min_block=4)
        shard, twin = TorchShard(blocks, "Adam", {"lr": 0.1}), TorchShard(blocks, "Adam", {"lr": 0.1})
        start = [torch.randn(b.shape).to(dtype) for b in blocks]
        shard.initialize(start, "t0")
        twin.initialize(start, "t0")
        grads = [torch.randn(b.shape).to(dtype) for b in blocks]
        assert shard.apply_staged_step("a") is False  # nothing staged: nothing moves
        shard.stage("a", [grads[2]], [2])
        shard.stage("a", [grads[0]], [0])
        shard.stage("b", [grads[1]], [1])
        pushed = grads[0].clone()
        grads[0].zero_()  # staging copied: the trainer may zero its buffer at once
        assert shard.apply_staged_step("a") is True
        twin.apply([pushed, grads[2]], [0, 2])
        assert torch.equal(shard.values, twin.values)
        assert torch.equal(shard.views()[1], start[1])  # b's block: not a's step
        assert shard.apply_staged_step("a") is False  # a step is applied once
        assert shard.apply_staged_step("b") is True
        twin.apply([grads[1]], [1])
        assert torch.equal(shard.values, twin.values)

    def test_kept_gradients_are_staged_without_a_copy_and_apply_as_copied_ones(self):
        """``keep``: the caller gives the tensors away, the shard holds them (no copy,
        no buffer), and the round applies exactly what copies would have."""
        shard, blocks, g1 = shard_and_grads("SGD", {"lr": 1.0})
        g2 = [torch.randn(b.shape, dtype=torch.float64) for b in blocks]
        twin = TorchShard(blocks, "SGD", {"lr": 1.0})
        twin.initialize(shard.views(), "t0")
        shard.stage("a", g1, keep=True)
        shard.stage("b", g2[:1], [0], keep=True)  # a kept piece and a copied one make one key
        shard.stage("b", g2[1:], list(range(1, len(blocks))))
        assert "a" not in shard._staged  # nothing copied: no buffer of its own
        assert shard.staged_step("a")[1][0] is g1[0]
        twin.stage("a", g1)
        twin.stage("b", g2)
        shard.apply_staged([("a", 3 / 8), ("b", 5 / 8)])
        twin.apply_staged([("a", 3 / 8), ("b", 5 / 8)])
        assert torch.equal(shard.values, twin.values)
        assert shard.staged() == set() and shard.staged_step("a") == ([], [])  # nothing held after the round

    def test_half_precision_gradients_are_copied_even_when_kept(self):
        blocks = cut_blocks(TorchReplica(make_model(dtype=torch.bfloat16), "cpu").specs)
        shard = TorchShard(blocks, "SGD", {"lr": 1.0})
        shard.initialize([torch.zeros(b.shape, dtype=torch.bfloat16) for b in blocks], "t0")
        grads = [torch.ones(b.shape, dtype=torch.bfloat16) for b in blocks]
        shard.stage("a", grads, keep=True)
        assert shard.staged_step("a")[1][0].dtype == torch.float32  # summed in float32, as always

    def test_a_forwarded_gradient_skips_only_the_finiteness_check(self):
        shard, blocks, grads = shard_and_grads()
        grads[0][0] = float("nan")
        shard.check(grads, "t0", finite=False)  # checked already by the pserver that forwarded it
        with pytest.raises(GradientRejected, match="not finite"):
            shard.check(grads, "t0")
        with pytest.raises(GradientRejected, match="shape"):
            shard.check([g.reshape(-1) for g in grads], "t0", finite=False)

    def test_apply_staged_reuses_one_gradient_buffer(self):
        shard, _, grads = shard_and_grads()
        buffer = shard.values.grad
        for _ in range(2):
            shard.stage("t", grads)
            shard.apply_staged([("t", 1.0)])
            shard.apply(grads)
        assert shard.values.grad is buffer

    def test_half_precision_sums_staged_gradients_in_float32(self):
        blocks = cut_blocks(TorchReplica(make_model(dtype=torch.bfloat16), "cpu").specs)
        shard = TorchShard(blocks, "SGD", {"lr": 1.0})
        shard.initialize([torch.zeros(b.shape, dtype=torch.bfloat16) for b in blocks], "t0")
        tiny = [torch.full(b.shape, 1e-2, dtype=torch.bfloat16) for b in blocks]
        for i in range(100):  # 1 + 1e-2 * n rounds away in bfloat16 without a float32 sum
            shard.stage(f"t{i}", tiny)
        shard.stage("one", [torch.ones(b.shape, dtype=torch.bfloat16) for b in blocks])
        shard.apply_staged([("one", 1.0)] + [(f"t{i}", 1.0) for i in range(100)])
        torch.testing.assert_close(shard.values.float(), torch.full((shard.numel,), -2.0), rtol=1e-2, atol=0)

    @pytest.mark.parametrize("key", ["SGD-momentum", "Adam", "NAdam", "ASGD", "Rprop", "Adagrad"])
    def test_state_dict_roundtrip_continues_exactly(self, key):
        name, kwargs = rule(key)
        shard, blocks, grads = shard_and_grads(name, kwargs)
        for _ in range(3):
            shard.apply(grads)
        state = shard.state_dict()
        assert "values" in state and any(k.startswith("state.") for k in state)
        assert all(isinstance(v, torch.Tensor) and v.dim() <= 1 for v in state.values())
        saved = {k: v.clone() for k, v in state.items()}  # as read back from a checkpoint file
        untouched = {k: v.clone() for k, v in saved.items()}
        restored = TorchShard(blocks, name, kwargs)
        restored.load_state_dict(saved)
        assert restored.initialized
        for _ in range(3):
            shard.apply(grads)
            restored.apply(grads)
        assert torch.equal(restored.values, shard.values)
        assert all(torch.equal(saved[k], untouched[k]) for k in saved)  # loading copied, never aliased
        for k, v in shard.state_dict().items():
            assert torch.equal(restored.state_dict()[k], v), k

    def test_snapshot_is_a_copy_of_every_block_with_the_counters(self):
        shard, _, grads = shard_and_grads("Adam", {"lr": 0.05})
        shard.apply(grads)
        before = {k: v.clone() for k, v in shard.export_blocks().items()}
        snap = shard.snapshot({"pdps.version": 7})
        shard.apply(grads)  # the shard steps on while the snapshot is written
        assert set(snap) == set(before) | {"pdps.version"}
        assert all(torch.equal(snap[k], v) for k, v in before.items())
        values = [k for k in before if k.endswith("/values")]
        assert len(values) == len(shard.blocks) and any(k.endswith("/state.exp_avg") for k in before)
        assert not any(torch.equal(snap[k], v) for k, v in shard.export_blocks().items() if k.endswith("/values"))
        version = snap["pdps.version"]
        assert version.dim() == 0 and version.dtype == torch.int64 and int(version) == 7

    def test_load_state_dict_refuses_a_foreign_checkpoint(self):
        shard, blocks, _ = shard_and_grads()
        with pytest.raises(ConfigError, match="checkpoint values"):
            shard.load_state_dict({"values": torch.zeros(3, dtype=torch.float64)})
        with pytest.raises(ConfigError, match="unexpected entry"):
            shard.load_state_dict({"values": shard.values.clone(), "junk": torch.zeros(1)})


# --- on a GPU ------------------------------------------------------------------------------


@pytest.mark.gpu
class TestOnCuda:
    def test_default_device_is_cuda(self):
        assert TorchCompute().device.startswith("cuda")

    def test_replica_binds_on_cuda(self):
        replica = TorchCompute("cuda").replica(make_model(dtype=torch.float32))
        assert replica.flat_params.is_cuda and replica.flat_grads.is_cuda
        loss_of(replica.module, 0, torch.float32, "cuda").backward()
        assert replica.flat_grads.abs().sum() > 0
        assert all(p.grad.data_ptr() == g.data_ptr() for p, g in zip(replica.module.parameters(), replica.grads(cut_blocks(replica.specs))))

    @pytest.mark.parametrize("key", ["SGD-momentum", "Adam", "AdamW", "RMSprop"])
    def test_shard_matches_torch_optim_and_splits_exactly(self, key):
        name, kwargs = rule(key)
        one = train_pdps(name, kwargs, 4, 1, "cuda", torch.float32)
        assert torch.equal(train_pdps(name, kwargs, 4, 3, "cuda", torch.float32), one)
        shard = TorchCompute("cuda").shard(cut_blocks(TorchReplica(make_model(), "cpu").specs), name, kwargs)
        extra = {"fused": True} if shard.optimizer_args.get("fused") else {"foreach": True}
        expected = train_reference(name, kwargs, 4, "cuda", torch.float32, **extra)
        torch.testing.assert_close(one, expected, rtol=1e-5, atol=1e-6)

    def test_cpu_pushes_into_a_cuda_shard(self):
        replica = TorchReplica(make_model(), "cpu")
        blocks = cut_blocks(replica.specs, min_block=16)
        shard = TorchCompute("cuda").shard(blocks, "Adam", {"lr": 0.01})
        assert shard.values.is_cuda
        shard.initialize(replica.values(blocks), "t0")
        loss_of(replica.module, 0).backward()
        grads = replica.grads(blocks)
        shard.check(grads, "t0")
        shard.stage("a", grads)  # a sync round of two trainers with the same gradient: its mean
        shard.stage("b", grads)
        shard.apply_staged([("a", 0.5), ("b", 0.5)])
        bad = [g.clone() for g in grads]
        bad[1].view(-1)[0] = float("nan")
        with pytest.raises(GradientRejected, match=r"0\.weight\[3:6\] from trainer 't9'"):
            shard.check(bad, "t9")
        reference = TorchShard(blocks, "Adam", {"lr": 0.01})
        reference.initialize(replica.values(blocks), "t0")
        reference.apply(grads)
        torch.testing.assert_close(shard.values.cpu(), reference.values, rtol=1e-12, atol=1e-14)

    def test_state_dict_roundtrip_on_cuda(self):
        replica = TorchReplica(make_model(dtype=torch.float32), "cuda")
        blocks = cut_blocks(replica.specs)
        shard = TorchShard(blocks, "Adam", {"lr": 0.01}, "cuda")
        shard.initialize(replica.values(blocks), "t0")
        grads = [torch.randn(b.shape, device="cuda") for b in blocks]
        shard.apply(grads)
        saved = {k: v.cpu() for k, v in shard.state_dict().items()}
        restored = TorchShard(blocks, "Adam", {"lr": 0.01}, "cuda")
        restored.load_state_dict(saved)
        shard.apply(grads)
        restored.apply(grads)
        assert torch.equal(restored.values, shard.values)


def test_tensors_of_columns_share_their_memory_on_the_cpu():
    columns = {"x": np.arange(6, dtype=np.float32).reshape(3, 2), "y": np.array([1, 0, 1], dtype=np.int64)}
    out = TorchCompute("cpu").tensors(columns)
    assert set(out) == {"x", "y"} and out["x"].dtype == torch.float32 and out["y"].dtype == torch.int64
    assert torch.equal(out["x"], torch.arange(6, dtype=torch.float32).reshape(3, 2))
    columns["y"][0] = 5  # no copy
    assert int(out["y"][0]) == 5


def test_frozen_parameters_stay_local():
    from torch import nn

    from pdps.adapters.torch_compute import TorchReplica

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)
    replica = TorchReplica(model, "cpu")
    assert [s.name for s in replica.specs] == ["0.bias", "1.weight", "1.bias"]
    assert replica.numel == 4 + 8 + 2


def test_check_accepts_finite_values_whose_sum_overflows():
    """The fast path sums each block; an overflowing sum of finite values must still pass."""
    from pdps.adapters.torch_compute import TorchShard
    from pdps.core.slots import ParamSpec, cut_blocks

    blocks = cut_blocks([ParamSpec("w", (4,), "float32")], min_block=1024)
    shard = TorchShard(blocks, "SGD", {"lr": 0.1})
    big = torch.full((4,), torch.finfo(torch.float32).max)
    shard.initialize([torch.zeros(4)], "t0")
    shard.check([big], "t0")  # every element is finite though the sum is inf
    with pytest.raises(GradientRejected, match="1 NaN"):
        shard.check([torch.tensor([1.0, float("nan"), 2.0, 3.0])], "t0")


def test_replica_check_finite_names_the_parameter():
    from torch import nn

    from pdps.adapters.torch_compute import TorchReplica

    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    replica = TorchReplica(model, "cpu")
    replica.check_finite("t1")  # zeros
    replica.flat_grads.fill_(torch.finfo(torch.float32).max)  # finite, but the sum overflows
    replica.check_finite("t1")
    model[1].weight.grad[0, 0] = float("inf")
    with pytest.raises(GradientRejected, match=r"1\.weight on trainer 't1' holds 0 NaN and 1 infinite"):
        replica.check_finite("t1")


class TestShardPieces:
    """Pushes of some blocks only: a trainer pushing each slot while backward runs."""

    def test_apply_of_some_blocks_moves_only_those_and_equals_one_whole_step(self):
        shard, blocks, grads = shard_and_grads("Adam", {"lr": 0.1})
        whole = TorchShard(blocks, "Adam", {"lr": 0.1})
        whole.initialize(shard.views(), "t0")
        before = [v.clone() for v in shard.views()]
        first = list(range(0, len(blocks), 2))
        rest = [i for i in range(len(blocks)) if i not in first]
        shard.apply([grads[i] for i in first], first)
        for i, (v, b) in enumerate(zip(shard.views(), before)):
            assert torch.equal(v, b) != (i in first), i  # only the pushed blocks moved
        shard.apply([grads[i] for i in rest], rest)
        whole.apply(grads)
        assert torch.equal(shard.values, whole.values)  # two pieces make one step, Adam state included
        state, twin = shard.state_dict(), whole.state_dict()
        assert state.keys() == twin.keys()
        for key in state:
            assert torch.equal(state[key], twin[key]), key

    def test_state_dict_round_trips_through_per_block_state(self):
        shard, blocks, grads = shard_and_grads("Adam", {"lr": 0.1})
        shard.apply(grads)
        copy = TorchShard(blocks, "Adam", {"lr": 0.1})
        copy.load_state_dict({k: v.clone() for k, v in shard.state_dict().items()})
        shard.apply(grads)
        copy.apply(grads)
        assert torch.equal(shard.values, copy.values)
        assert torch.equal(shard.state_dict()["state.exp_avg_sq"], copy.state_dict()["state.exp_avg_sq"])

    def test_applied_gradients_are_used_in_place_and_not_kept(self):
        shard, blocks, grads = shard_and_grads("SGD", {"lr": 1.0})
        before = shard.values.clone()
        shard.apply(grads)
        torch.testing.assert_close(shard.values, before - torch.cat([g.reshape(-1) for g in grads]), rtol=0, atol=0)
        assert all(v.grad is None for v in shard.views())  # no reference to the sender's tensors stays

    def test_a_key_is_staged_once_every_block_is(self):
        shard, blocks, grads = shard_and_grads("SGD", {"lr": 1.0})
        half = list(range(len(blocks) // 2))
        rest = list(range(len(blocks) // 2, len(blocks)))
        shard.stage("t", [grads[i] for i in half], half)
        assert shard.staged() == set()
        with pytest.raises(KeyError):
            shard.apply_staged([("t", 1.0)])
        shard.stage("t", [grads[i] for i in rest], rest)
        assert shard.staged() == {"t"}
        twin = TorchShard(blocks, "SGD", {"lr": 1.0})
        twin.initialize(shard.views(), "t0")
        shard.apply_staged([("t", 1.0)])
        twin.apply(grads)
        assert torch.equal(shard.values, twin.values)
        shard.stage("t", [grads[i] for i in half], half)  # a new round starts from nothing staged
        assert shard.staged() == set()


def test_threads_is_a_declared_capability():
    compute = TorchCompute("cpu")
    assert isinstance(compute, ThreadedCompute) and compute.threads == torch.get_num_threads()


def test_an_s3_dataset_names_both_extras_it_needs():
    """An s3:// dataset needs pyarrow (pdps[parquet]) and s3fs (pdps[s3]): the hint of an
    unknown scheme names both, as operations.md's storage table says of s3://."""
    from pdps.registry import open_data_source

    with pytest.raises(UnknownSchemeError) as caught:
        open_data_source("nosuch://x")
    assert "s3:// (pip install 'pdps[parquet,s3]')" in str(caught.value)
