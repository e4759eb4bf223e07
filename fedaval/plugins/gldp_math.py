"""GLDP's equations (``shared/papers/gldp-sthfl.txt``, Sec. 4: Eqs. 7-10) as
plain functions on tensors, tested against hand-computed values in
``tests/test_gldp.py``; the hook glue is :mod:`fedaval.plugins.gldp`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedaval.prototypes import PrototypeSet


def prototype_distribution(points: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """``softmax_k(-||x - C^k||_2)`` over the prototypes (rows of ``bank``) for
    each row ``x`` of ``points``: the class distribution of GLDP's
    nearest-prototype predictor (Eq. 13), as log-probabilities [N, K]."""
    return F.log_softmax(-torch.cdist(points, bank), dim=-1)


def local_relation_loss(features: torch.Tensor, labels: torch.Tensor, old: PrototypeSet) -> torch.Tensor | None:
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
    KL(P^{y} || p(x))``. Distances between features are O(1) and more, so
    the term carries weight (the earlier reading, a KL between softmaxes over
    feature dimensions of two mean features, was about 1e-3 on digits).
    ``None`` when no sample's class has an old prototype."""
    if not old:
        return None
    classes = sorted(old)
    index = {c: i for i, c in enumerate(classes)}
    rows = [i for i, y in enumerate(labels.tolist()) if y in index]
    if not rows:
        return None
    bank = torch.stack([old[c].to(features.device, features.dtype) for c in classes])
    rows_t = torch.tensor(rows, device=features.device)
    targets = torch.tensor([index[int(labels[i])] for i in rows], device=features.device)
    log_p_old = prototype_distribution(bank, bank)[targets]
    log_q = prototype_distribution(features[rows_t], bank)
    return F.kl_div(log_q, log_p_old, reduction="batchmean", log_target=True)


def global_relation_loss(
    current: PrototypeSet, global_set: PrototypeSet, weights: dict[int, float]
) -> torch.Tensor | None:
    """L_GP, GLDP Eq. 10: ``sum_n (T_i^n / T_i) * MSE(C_i^n, C~^n)`` pulls the
    local prototypes towards the global ones (anti long-tail).

    Reading: C_i^n is the mean feature of the minibatch's class-n samples
    (differentiable), the sum runs over the minibatch's classes that have a
    global prototype, ``weights[n] = T_i^n / T_i`` with T counted over the
    client's whole current-task data, and MSE is the mean over feature
    dimensions of the squared difference. ``None`` when no class has a
    global prototype."""
    classes = [c for c in current if c in global_set]
    if not classes:
        return None
    terms = [
        weights.get(c, 0.0) * F.mse_loss(current[c], global_set[c].to(current[c].device, current[c].dtype))
        for c in classes
    ]
    return torch.stack(terms).sum()


def class_frequency_weights(labels: torch.Tensor) -> dict[int, float]:
    """``T_i^n / T_i`` of GLDP Eq. 10 for each class n in ``labels``."""
    classes, counts = torch.unique(labels, return_counts=True)
    total = float(counts.sum())
    return {int(c): float(n) / total for c, n in zip(classes.tolist(), counts.tolist())}
