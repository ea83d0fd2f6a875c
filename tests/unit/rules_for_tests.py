"""Optimizer rules that tests name by import path (``tests.unit.rules_for_tests:SignSGD``)."""

from __future__ import annotations

import torch


class SignSGD(torch.optim.Optimizer):
    """Element-wise: each element moves by ``-lr * sign(grad)``."""

    pdps_elementwise = True

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class NormalisedSGD(torch.optim.Optimizer):
    """Not element-wise (divides by the whole tensor's norm), and says nothing."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm().clamp_min(1e-12), alpha=-group["lr"])


class NotAnOptimizer:
    pdps_elementwise = True
