"""FedEWC's client plugin: Avalanche's ``EWCPlugin``, its penalty in a few batched operations.

Avalanche's ``EWCPlugin.before_backward`` adds, for every past experience
and every parameter tensor, ``(importance * (current - saved) ** 2).sum()`` to
the loss: some eleven operations forward and backward per parameter tensor
and experience. For ResNet-18 (62 parameter tensors) at a client's
fifth task that is 2,735 operations a minibatch, each a kernel launch on a
GPU, where a ResNet-18 step is itself a few hundred (GPU session 23:
FedEWC's full-scale rounds took 14 s against FedAvg's 3). Here the penalty
is one autograd function (:class:`EWCPenalty`) whose forward takes three
``torch._foreach_*`` calls per experience over all the tensors at once and
one sum per tensor, and whose backward a few ``torch._foreach_*`` calls
(autograd through ``_foreach_*`` calls would run their backward tensor by
tensor): ``benchmarks/ewc_penalty.py`` counts and times both. Everything
else, the importances, the anchor weights, their expansion when a parameter
grows, the two modes, is Avalanche's plugin unchanged.

The value is the same sum: each tensor's sum is Avalanche's, bit for bit,
and only the sum of those is added up in another order. The gradient is its
exact derivative, ``2 * importance * (current - saved)`` summed over the
experiences, rounded in another order than autograd's. So a run's results
differ from Avalanche's loop in the last bits of float32
(``tests/test_avalanche_plugins.py`` compares both, values and gradients).
"""

from __future__ import annotations

import torch
from avalanche.training.plugins import EWCPlugin

__all__ = ["EWCPenalty", "FusedEWCPlugin"]


class EWCPenalty(torch.autograd.Function):
    """``sum over e, p of (weights[e][p] * (params[p] - anchors[e][p]) ** 2).sum()``,
    its forward and backward batched over the parameter tensors ``params``."""

    @staticmethod
    def forward(ctx, anchors: list[list[torch.Tensor]], weights: list[list[torch.Tensor]], *params: torch.Tensor):
        ctx.anchors, ctx.weights = anchors, weights
        ctx.save_for_backward(*params)
        total = torch.zeros((), dtype=params[0].dtype, device=params[0].device)
        for anchor, weight in zip(anchors, weights):
            differences = torch._foreach_sub(params, anchor)
            torch._foreach_mul_(differences, differences)
            torch._foreach_mul_(differences, weight)
            # each tensor's sum as Avalanche takes it (a batched L1 norm, torch._foreach_norm, added
            # ResNet-18's 11 million terms 5e-4 off in float32)
            total = total + torch.stack([d.sum() for d in differences]).sum()
        return total

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        params = ctx.saved_tensors
        grads: list[torch.Tensor] | None = None
        for anchor, weight in zip(ctx.anchors, ctx.weights):
            differences = torch._foreach_sub(params, anchor)
            torch._foreach_mul_(differences, weight)
            if grads is None:
                grads = list(differences)
            else:
                torch._foreach_add_(grads, differences)
        assert grads is not None, "at least one experience"
        torch._foreach_mul_(grads, 2 * grad_output)
        return (None, None, *grads)


class FusedEWCPlugin(EWCPlugin):
    """``EWCPlugin`` whose penalty is :class:`EWCPenalty` (see the module docstring)."""

    def before_backward(self, strategy, **kwargs):
        exp_counter = strategy.clock.train_exp_counter
        if exp_counter == 0:
            return
        experiences = range(exp_counter) if self.mode == "separate" else [exp_counter - 1]
        named = list(strategy.model.named_parameters())
        params = dict(named)
        # experiences that anchor the same parameters share one EWCPenalty (usually all of them)
        groups: dict[tuple[str, ...], tuple[list, list]] = {}
        for experience in experiences:
            saved, importances = self.saved_params[experience], self.importances[experience]
            # new parameters do not count; Avalanche pads a grown parameter's anchor and importance
            names = tuple(name for name, _ in named if name in saved)
            if not names:
                continue
            anchors, weights = groups.setdefault(names, ([], []))
            anchors.append([saved[name].expand(params[name].shape) for name in names])
            weights.append([importances[name].expand(params[name].shape) for name in names])
        penalty = torch.zeros((), device=strategy.device)
        for names, (anchors, weights) in groups.items():
            penalty = penalty + EWCPenalty.apply(anchors, weights, *[params[name] for name in names])
        strategy.loss += self.ewc_lambda * penalty
