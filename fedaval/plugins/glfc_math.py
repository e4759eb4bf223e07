"""GLFC's maths (Dong et al., CVPR 2022): plain functions on tensors.

The hook glue is :mod:`fedaval.plugins.glfc`; every function here is
checked against hand-computed values in ``tests/test_glfc_math.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fedaval.prototypes import class_index

# ---------------------------------------------------------------------------
# class-aware gradient compensation (GLFC Sec. 3.2, Eqs. 2-3)
# ---------------------------------------------------------------------------


def gradient_measures(logits: torch.Tensor, y: torch.Tensor, sigmoid: bool = False) -> torch.Tensor:
    """``G_i = |dCE_i / d logit_{y_i}| = |p_{y_i}(x_i) - 1|``: the size of
    sample ``i``'s gradient at its own class's output (detached), ``p`` the
    softmax, or with ``sigmoid`` the output's own sigmoid (the gradient of
    the binary cross-entropy GLFC's code trains with)."""
    z = logits.detach()
    p = torch.sigmoid(z) if sigmoid else F.softmax(z, dim=1)
    return (p.gather(1, y[:, None]).squeeze(1) - 1).abs()


def compensation_weights(
    logits: torch.Tensor, y: torch.Tensor, is_old: torch.Tensor, sigmoid: bool = False
) -> torch.Tensor:
    """GLFC Eq. 3's per-sample weights: ``G_i / mean_G_new`` for a sample of a
    new class, ``G_i / mean_G_old`` for one of an old class, where the means
    run over the minibatch's samples of that group. Each group's weights
    then average 1: neither group dominates the gradient by its size, and
    within a group, samples with larger gradients weigh more. A group whose
    gradients are all 0 gets weight 0.

    Computed with masks over the whole minibatch, so on a GPU nothing waits
    for it (until session 25 each group's ``any``, selection and mean were
    read back, about six waits a minibatch; the tables with GLFC rows were
    re-run with this form, whose float rounding differs)."""
    g = gradient_measures(logits, y, sigmoid)
    w = torch.zeros_like(g)
    for group in (is_old, ~is_old):
        mask = group.to(g.dtype)
        mean = (g * mask).sum() / mask.sum().clamp(min=1)
        safe = torch.where(mean > 0, mean, torch.ones_like(mean))
        w = w + torch.where(group & (mean > 0), g / safe, torch.zeros_like(g))
    return w


def compensated_cross_entropy(logits: torch.Tensor, y: torch.Tensor, is_old: torch.Tensor) -> torch.Tensor:
    """GLFC's ``L_GC = 1/b sum_i w_i CE(logits_i, y_i)`` with
    :func:`compensation_weights` ``w_i`` (no gradient through the weights)."""
    w = compensation_weights(logits, y, is_old)
    return (w * F.cross_entropy(logits, y, reduction="none")).mean()


def compensated_bce(logits: torch.Tensor, y: torch.Tensor, is_old: torch.Tensor | None) -> torch.Tensor:
    """GLFC's code's ``L_GC``: ``1/b sum_i w_i sum_c BCE(z_ic, [c = y_i])``, the
    binary cross-entropy of every output against the one-hot label, weighted
    per sample by :func:`compensation_weights` on the sigmoid (``is_old``
    ``None``: every ``w_i = 1``, as the code before any old class).

    Two readings, where the code's head and learning rate differ from a fixed
    head at a table's shared learning rate: the code's head grows, with an
    output per class taught so far; fedaval's is fixed, so the outputs of
    classes not taught yet take part with target 0 (which keeps them below
    the taught ones when the head's argmax is read, as an output that does
    not exist would be). And the code averages over the outputs as well as
    the samples and trains at lr 2.0; here the outputs are summed, as
    FediCaRL's iCaRL loss is (the code's mean at lr 2.0 is this sum at lr
    2.0 / outputs), so the learning rate keeps its meaning next to the
    softmax cross-entropy of the other methods."""
    target = F.one_hot(y, logits.shape[1]).to(logits.dtype)
    per_output = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    if is_old is not None:
        per_output = compensation_weights(logits, y, is_old, sigmoid=True)[:, None] * per_output
    return per_output.sum() / len(y)


def bce_distillation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, y: torch.Tensor, old_classes: Sequence[int]
) -> torch.Tensor:
    """GLFC's code's distillation from the old model: the binary
    cross-entropy of every output against the one-hot label with the old
    classes' entries replaced by the old model's sigmoid outputs, summed over
    the outputs and averaged over the samples as :func:`compensated_bce`
    (no sample weights)."""
    cols = class_index(tuple(old_classes), str(student_logits.device))
    target = F.one_hot(y, student_logits.shape[1]).to(student_logits.dtype)
    target[:, cols] = torch.sigmoid(teacher_logits[:, cols].detach())
    return F.binary_cross_entropy_with_logits(student_logits, target, reduction="sum") / len(y)


# ---------------------------------------------------------------------------
# class-semantic relation distillation (GLFC Sec. 3.2, Eq. 4)
# ---------------------------------------------------------------------------


def relation_distillation(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    old_classes: Sequence[int],
    temperature: float,
) -> torch.Tensor:
    """``L_RD = 1/b sum_i KL(softmax(t_i[old]/T) || softmax(s_i[old]/T))``:
    the current model keeps the old model's relations between the old
    classes (``old_classes``, columns of both logits; their index tensor is
    made once per list and device, not copied to the GPU per minibatch)."""
    cols = class_index(tuple(old_classes), str(student_logits.device))
    log_s = F.log_softmax(student_logits[:, cols] / temperature, dim=1)
    log_t = F.log_softmax(teacher_logits[:, cols] / temperature, dim=1)
    return (log_t.exp() * (log_t - log_s)).sum(dim=1).mean()


# ---------------------------------------------------------------------------
# task-transition detection (GLFC Sec. 3.3)
# ---------------------------------------------------------------------------


def mean_entropy(logits: torch.Tensor) -> float:
    """``H = 1/n sum_i -sum_c p_ic log p_ic`` (natural log) of the softmax of
    ``logits``."""
    log_p = F.log_softmax(logits.detach(), dim=1)
    return float(-(log_p.exp() * log_p).sum(dim=1).mean())


def entropy_rise(previous: float | None, current: float, threshold: float) -> bool:
    """A new task is detected when the mean entropy rises by more than
    ``threshold`` nats over the previous round's (never on the first round
    a client has, ``previous`` is ``None``)."""
    return previous is not None and current - previous > threshold


# ---------------------------------------------------------------------------
# the proxy server: prototype gradients and their inversion (GLFC Sec. 3.4)
# ---------------------------------------------------------------------------


class LeNet(nn.Module):
    """The gradient-encoding network (DLG's LeNet, as GLFC uses): three 5x5
    convolutions with sigmoid activations (differentiable twice, which the
    inversion needs) and a linear classifier, for any (C, H, W). Weights
    are drawn uniformly from [-0.5, 0.5] as DLG does: with PyTorch's default
    (smaller) initialisation the gradients carry too little of the image
    for the inversion to recover it."""

    def __init__(self, shape: Sequence[int], num_classes: int, width: int = 12):
        super().__init__()
        channels, height, w = shape
        self.body = nn.Sequential(
            nn.Conv2d(channels, width, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(width, width, 5, padding=2, stride=2),
            nn.Sigmoid(),
            nn.Conv2d(width, width, 5, padding=2, stride=1),
            nn.Sigmoid(),
            nn.Flatten(),
        )
        with torch.no_grad():
            flat = self.body(torch.zeros(1, channels, height, w)).shape[1]
        self.fc = nn.Linear(flat, num_classes)
        with torch.no_grad():
            for p in self.parameters():
                p.uniform_(-0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.body(x))


def prototype_gradient(lenet: nn.Module, x: torch.Tensor, label: int, create_graph: bool = False) -> list[torch.Tensor]:
    """``dCE(lenet(x), label) / d theta`` for one image ``x`` [C, H, W]: what
    a client sends the proxy server per new class."""
    out = lenet(x[None])
    loss = F.cross_entropy(out, torch.tensor([label], device=x.device))
    return list(torch.autograd.grad(loss, list(lenet.parameters()), create_graph=create_graph))


def gradient_distance(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j ||a_j - b_j||^2``: DLG's matching loss between two gradients."""
    total = torch.zeros((), device=a[0].device) if len(a) else torch.zeros(())
    for x, y in zip(a, b):
        total = total + ((x - y) ** 2).sum()
    return total


def invert_gradient(
    lenet: nn.Module,
    gradient: Sequence[torch.Tensor],
    label: int,
    shape: Sequence[int],
    steps: int,
    lr: float = 1.0,
    seed: int = 0,
) -> torch.Tensor:
    """The proxy server's reconstruction (DLG with the label known, as in
    iDLG): start from noise (``seed``), minimise :func:`gradient_distance`
    between the gradient of the image and ``gradient`` with L-BFGS, ``steps``
    optimiser steps. Returns the image [C, H, W], detached."""
    device = gradient[0].device
    g = torch.Generator(device="cpu").manual_seed(seed)
    dummy = torch.randn(1, *shape, generator=g).to(device).requires_grad_(True)
    target = [t.detach() for t in gradient]
    opt = torch.optim.LBFGS([dummy], lr=lr, max_iter=4, history_size=20)

    def closure():
        opt.zero_grad()
        loss = gradient_distance(prototype_gradient(lenet, dummy[0], label, create_graph=True), target)
        loss.backward()
        return loss

    for _ in range(steps):
        opt.step(closure)
        if not bool(torch.isfinite(dummy).all()):  # L-BFGS diverged: start again from smaller noise
            with torch.no_grad():
                dummy.copy_(torch.randn(1, *shape, generator=g).to(device) * 0.1)
            opt = torch.optim.LBFGS([dummy], lr=lr * 0.5, max_iter=4, history_size=20)
    return dummy.detach()[0]


def nearest_to_mean(features: torch.Tensor, k: int = 1) -> torch.Tensor:
    """Indices of the ``k`` rows of ``features`` nearest (Euclidean) to their
    mean, nearest first: a class's representative sample (``k = 1``) and
    its exemplars."""
    d = (features - features.mean(dim=0, keepdim=True)).norm(dim=1)
    return torch.argsort(d, stable=True)[: min(k, len(d))]


def pick_best(accuracies: Sequence[float]) -> int:
    """Index of the highest accuracy; ties go to the latest (the model
    trained longest)."""
    best = 0
    for i, a in enumerate(accuracies):
        if a >= accuracies[best]:
            best = i
    return best
