"""GLDP's equations (``shared/papers/gldp-sthfl.txt``, Sec. 4: Eqs. 7-10) as
plain functions on tensors, tested against hand-computed values in
``tests/test_gldp.py``; the hook glue is :mod:`fedaval.plugins.gldp`."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fedaval.prototypes import PrototypeSet


def prototype_distribution(points: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """``softmax_k(-||x - C^k||_2)`` over the prototypes (rows of ``bank``) for
    each row ``x`` of ``points``: the class distribution of GLDP's
    nearest-prototype predictor (Eq. 13), as log-probabilities [N, K]."""
    return F.log_softmax(-torch.cdist(points, bank), dim=-1)


@dataclass(frozen=True)
class RelationPlan:
    """The constant side of GLDP's two relation losses for one client round,
    on the device, laid out by class id so that a minibatch's losses need no
    host-device synchronisation (looking up each sample's class in Python
    waited for the GPU some 45 times per minibatch).

    ``bank`` [K, D]: the client's old local prototypes ``C^_i`` (classes in
    order), ``log_p_old`` [K, K]: ``prototype_distribution(bank, bank)``,
    ``row_of`` [C]: each class's row in ``bank`` (-1: none); ``bank`` and
    ``log_p_old`` are None without old prototypes. ``global_bank`` [C, D]: the
    global prototypes ``C~`` (zeros where none), ``global_weight`` [C]:
    ``T_i^n / T_i`` for the classes with a global prototype, 0 for the
    others; ``has_global``: whether any class has one."""

    bank: torch.Tensor | None
    log_p_old: torch.Tensor | None
    row_of: torch.Tensor
    global_bank: torch.Tensor
    global_weight: torch.Tensor
    has_global: bool


def relation_plan(
    old: PrototypeSet,
    global_set: PrototypeSet,
    weights: dict[int, float],
    num_classes: int,
    dim: int,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
) -> RelationPlan:
    """The :class:`RelationPlan` of a round: ``old`` the client's local set,
    ``global_set`` the global set it received, ``weights`` its current task's
    class frequencies (:func:`class_frequency_weights`), features of width
    ``dim``."""
    row_of = [-1] * num_classes
    bank = log_p_old = None
    if old:
        classes = sorted(old)
        for i, c in enumerate(classes):
            row_of[c] = i
        bank = torch.stack([old[c].detach().to(device, dtype) for c in classes])
        log_p_old = prototype_distribution(bank, bank)
    global_bank = torch.zeros(num_classes, dim, device=device, dtype=dtype)
    global_weight = torch.zeros(num_classes, device=device, dtype=dtype)
    for c, proto in global_set.items():
        global_bank[c] = proto.detach().to(device, dtype)
        global_weight[c] = weights.get(c, 0.0)
    return RelationPlan(
        bank=bank,
        log_p_old=log_p_old,
        row_of=torch.tensor(row_of, dtype=torch.long, device=device),
        global_bank=global_bank,
        global_weight=global_weight,
        has_global=bool(global_set),
    )


def local_relation_loss(features: torch.Tensor, labels: torch.Tensor, plan: RelationPlan) -> torch.Tensor | None:
    """L_LP, GLDP Eq. 7/8: keeps a class's features where the earlier rounds
    and stages left them (anti-forgetting).

    Reading (the paper writes KL(C^_i^n || p_i^n(x)), a prototype against a
    "prediction probability"): both sides are class distributions of the
    nearest-prototype predictor over the client's old local prototypes
    ``C^_i`` (constant). The old side is where the stored prototype of the
    sample's class sits among them, ``P^n = softmax_k(-||C^_i^n -
    C^_i^k||)``; the current side is where the sample's feature sits,
    ``p(x) = softmax_k(-||f(x) - C^_i^k||)`` (differentiable). ``L_LP =
    mean over the minibatch samples whose class has an old prototype of
    KL(P^{y} || p(x))``; 0 when no sample's class has one. Distances between
    features are O(1) and more, so the term carries weight (the earlier
    reading, a KL between softmaxes over feature dimensions of two mean
    features, was about 1e-3 on digits). ``None`` when the client has no old
    prototype."""
    if plan.bank is None or plan.log_p_old is None:
        return None
    row = plan.row_of[labels]
    held = row >= 0
    log_p = plan.log_p_old[row.clamp(min=0)]
    log_q = prototype_distribution(features, plan.bank.to(features.dtype))
    kl = (log_p.exp() * (log_p - log_q)).sum(dim=1)
    return torch.where(held, kl, kl.new_zeros(())).sum() / held.sum().clamp(min=1)


def global_relation_loss(features: torch.Tensor, labels: torch.Tensor, plan: RelationPlan) -> torch.Tensor | None:
    """L_GP, GLDP Eq. 10: ``sum_n (T_i^n / T_i) * MSE(C_i^n, C~^n)`` pulls the
    local prototypes towards the global ones (anti long-tail).

    Reading: C_i^n is the mean feature of the minibatch's class-n samples
    (differentiable), the sum runs over the minibatch's classes that have a
    global prototype, ``weights[n] = T_i^n / T_i`` with T counted over the
    client's whole current-task data, and MSE is the mean over feature
    dimensions of the squared difference. ``None`` when no class has a
    global prototype."""
    if not plan.has_global:
        return None
    classes = torch.arange(len(plan.row_of), device=labels.device)
    members = (labels.unsqueeze(1) == classes.unsqueeze(0)).to(features.dtype)  # [B, C]
    counts = members.sum(dim=0)
    means = members.T @ features / counts.clamp(min=1).unsqueeze(1)  # [C, D]: C_i^n of the classes present
    mse = (means - plan.global_bank.to(features.dtype)).pow(2).mean(dim=1)
    return (mse * plan.global_weight * (counts > 0)).sum()


def class_frequency_weights(labels: torch.Tensor) -> dict[int, float]:
    """``T_i^n / T_i`` of GLDP Eq. 10 for each class n in ``labels``."""
    classes, counts = torch.unique(labels, return_counts=True)
    total = float(counts.sum())
    return {int(c): float(n) / total for c, n in zip(classes.tolist(), counts.tolist())}
