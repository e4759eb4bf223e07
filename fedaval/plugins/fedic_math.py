"""FEDIC's maths (Shang et al., ICME 2022, "FEDIC: Federated Learning on
Non-IID and Long-Tailed Data via Calibrated Distillation"), plain functions
on tensors. The hook glue is :mod:`fedaval.plugins.fedic`.

No paper file is in the repository: the steps are named after the paper's
description (ensemble of client models, logit-adjustment calibration with a
calibration gating network, distillation with temperature), not by equation
number. :class:`CalibratedEnsemble` and :func:`adam_steps` are the teacher as
the authors' code builds it (shangxinyi/FEDIC, ``main.py``; read, not
copied); the logit-adjustment functions are the earlier reading of the paper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedaval.models import in_mode


def class_prior(counts: torch.Tensor, smoothing: float) -> torch.Tensor:
    """The class distribution ``pi`` behind the logit adjustment, from class
    sample counts with additive smoothing: ``(n_c + a) / (sum_c n_c + a K)``
    (``a = smoothing``; a class nobody holds gets a small, finite prior)."""
    counts = counts.to(torch.float64)
    return ((counts + smoothing) / (counts.sum() + smoothing * counts.numel())).to(torch.float32)


def logit_adjust(logits: torch.Tensor, prior: torch.Tensor, tau: float) -> torch.Tensor:
    """Post-hoc logit adjustment (Menon et al. 2021), FEDIC's calibration:
    ``z_c - tau * log(pi_c)``: classes frequent in training lose score, rare
    ones gain, so the argmax targets the balanced error."""
    return logits - tau * torch.log(prior.to(logits.device, logits.dtype))


def ensemble_logits(client_logits: torch.Tensor) -> torch.Tensor:
    """The ensemble of the client models: the mean of their logits
    ``[M, N, K] -> [N, K]`` (reading: unweighted mean over the round's
    clients)."""
    return client_logits.mean(dim=0)


def calibrated_logits(ensemble: torch.Tensor, prior: torch.Tensor, tau: float, gate: torch.Tensor) -> torch.Tensor:
    """The calibrated teacher: ``(1 - g) z + g LA(z) = z - g tau log(pi)``
    per sample, ``gate`` g in [0, 1] (``[N]``) from the calibration gating
    network (g = 1: full logit adjustment; g = 0: the raw ensemble)."""
    return ensemble - gate[:, None] * tau * torch.log(prior.to(ensemble.device, ensemble.dtype))


def gate_values(features: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The calibration gating network: ``sigmoid(h(x) . w + b)`` per sample,
    ``h(x)`` the global model's features (reading: a single linear unit)."""
    return torch.sigmoid(features @ weight + bias)


def train_gate(
    features: torch.Tensor,
    ensemble: torch.Tensor,
    prior: torch.Tensor,
    labels: torch.Tensor,
    tau: float,
    steps: int,
    lr: float,
) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """Fit the gate on the labelled, class-balanced proxy set: ``steps``
    full-batch SGD steps (learning rate ``lr``) on the cross-entropy of the
    calibrated teacher, from ``w = 0, b = 0`` (g = 1/2 everywhere). Returns
    ``(w, b, losses)`` with the loss before each step and after the last."""
    features, ensemble = features.detach(), ensemble.detach()
    w = torch.zeros(features.shape[1], device=features.device, requires_grad=True)
    b = torch.zeros((), device=features.device, requires_grad=True)
    optimizer = torch.optim.SGD([w, b], lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.cross_entropy(calibrated_logits(ensemble, prior, tau, gate_values(features, w, b)), labels)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        losses.append(
            float(F.cross_entropy(calibrated_logits(ensemble, prior, tau, gate_values(features, w, b)), labels))
        )
    return w.detach(), b.detach(), losses


def distillation_loss(student: torch.Tensor, teacher: torch.Tensor, temperature: float) -> torch.Tensor:
    """``T^2 KL(softmax(teacher / T) || softmax(student / T))``, averaged over
    the samples (Hinton et al.'s distillation with temperature T)."""
    log_q = F.log_softmax(student / temperature, dim=-1)
    p = F.softmax(teacher.detach() / temperature, dim=-1)
    return F.kl_div(log_q, p, reduction="batchmean") * temperature**2


def distil(
    model: torch.nn.Module,
    x: torch.Tensor,
    teacher: torch.Tensor,
    temperature: float,
    steps: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
    forward=None,
) -> list[float]:
    """Distil ``teacher`` (logits on the unlabelled ``x``) into ``model``:
    ``steps`` SGD steps (learning rate ``lr``) on :func:`distillation_loss`,
    each on a minibatch of ``batch_size`` samples drawn from ``generator``.
    ``forward(model, x)`` gives the student's logits (default ``model(x)``).
    The model is trained in train mode and its modes are restored. Returns the
    loss of each step."""
    forward = forward or (lambda m, inputs: m(inputs))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    with in_mode(model, training=True):
        for _ in range(steps):
            idx = torch.randperm(len(x), generator=generator)[:batch_size].to(x.device)
            loss = distillation_loss(forward(model, x[idx]), teacher[idx], temperature)
            losses.append(float(loss.detach()))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return losses


class CalibratedEnsemble(nn.Module):
    """FEDIC's calibrated ensemble as its code builds it (its
    ``Ensemble_highway``): from M client models' features ``[M, N, d]`` and
    logits ``[M, N, K]`` and a fine-tuned global model's logits ``[N, K]``:

    * each client's per-sample weight ``sigmoid(z_k s + b)`` (``s`` ``[K, 1]``
      initialised at ones, ``b`` at zero), normalised over the clients to sum
      to 1; the weighted sum of the clients' logits;
    * calibrated per class: ``* logit_scale + logit_bias`` (ones, zeros);
    * a carry gate ``g = sigmoid(w . mean_k h_k + c)`` on the clients' mean
      features mixes it with the fine-tuned model's logits:
      ``g * calibrated + (1 - g) * fine-tuned``.

    ``gate_init``: the gate's ``(w [1, d], c [1])`` (the code: PyTorch's default
    initialisation of a linear layer)."""

    def __init__(self, num_classes: int, gate_init: tuple[torch.Tensor, torch.Tensor]):
        super().__init__()
        self.client_scale = nn.Parameter(torch.ones(num_classes, 1))
        self.client_bias = nn.Parameter(torch.zeros(1))
        self.logit_scale = nn.Parameter(torch.ones(num_classes))
        self.logit_bias = nn.Parameter(torch.zeros(num_classes))
        self.gate = nn.Linear(gate_init[0].shape[1], 1)
        with torch.no_grad():
            self.gate.weight.copy_(gate_init[0])
            self.gate.bias.copy_(gate_init[1])

    def client_weights(self, logits: torch.Tensor) -> torch.Tensor:
        """Each client's weight per sample, ``[M, N, 1]``, summing to 1 over M:
        ``sigmoid(a_k) / sum_j sigmoid(a_j)``, computed as a softmax of
        ``log sigmoid(a_k)`` (the same value; the plain quotient is 0 / 0 once
        every client's ``a`` is below about -88, where float32's sigmoid is 0)."""
        return torch.softmax(F.logsigmoid(logits @ self.client_scale + self.client_bias), dim=0)

    def carry(self, features: torch.Tensor) -> torch.Tensor:
        """The carry gate per sample, ``[N, 1]``."""
        return torch.sigmoid(self.gate(features.mean(dim=0)))

    def forward(self, features: torch.Tensor, logits: torch.Tensor, finetuned: torch.Tensor) -> torch.Tensor:
        calibrated = (self.client_weights(logits) * logits).sum(dim=0) * self.logit_scale + self.logit_bias
        carry = self.carry(features)
        return carry * calibrated + (1 - carry) * finetuned


def adam_steps(
    params: list[torch.Tensor],
    state: dict[str, Any] | None,
    lr: float,
    weight_decay: float,
    steps: int,
    loss: Callable[[], torch.Tensor],
) -> tuple[dict[str, Any], list[float]]:
    """``steps`` steps of Adam (``lr``, L2 ``weight_decay`` as PyTorch's Adam
    adds it) on ``loss()`` over ``params``, starting from the optimizer
    ``state`` a previous call returned (``None``: a new optimizer): FEDIC's
    code keeps each of its three server optimizers across rounds. Returns the
    new state and the loss of each step."""
    optimizer = torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if state is not None:
        optimizer.load_state_dict(state)
    losses = []
    for _ in range(steps):
        value = loss()
        losses.append(float(value.detach()))
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    return optimizer.state_dict(), losses
