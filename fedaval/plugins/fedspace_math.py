"""FedSpace's maths on plain tensors (Shenaj, Toldo, Rigon, Zanuttigh,
"Asynchronous Federated Continual Learning", CVPR Workshops 2023), as its
authors' released code computes it (LTTM/FedSpace; read, not copied), which
builds on PASS (Zhu et al., "Prototype Augmentation and Self-Supervision for
Incremental Learning", CVPR 2021). No hooks here: :mod:`fedaval.plugins.fedspace`
is the glue.

Class ``c`` with rotation ``k`` (0, 90, 180, 270 degrees) is output unit
``4 c + k`` of the classifier (PASS's self-supervised label augmentation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedaval.prototypes import class_means

ROTATIONS = 4


def rotated_copies(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The images ``x`` [B, C, H, W] turned by 90, 180 and 270 degrees, with
    their labels ``4 y + k``: ``([3B, C, H, W], [3B])``, rotation by rotation."""
    xs = torch.cat([torch.rot90(x, k, (2, 3)) for k in range(1, ROTATIONS)])
    ys = torch.cat([ROTATIONS * y + k for k in range(1, ROTATIONS)])
    return xs, ys


def output_units(classes: list[int], rotation: bool) -> list[int]:
    """The classifier's units of ``classes``: ``4 c + k`` for every rotation
    ``k`` with ``rotation``, else ``c``; sorted (the code's ``mask``)."""
    if not rotation:
        return sorted(classes)
    return sorted(ROTATIONS * c + k for c in classes for k in range(ROTATIONS))


def masked_cross_entropy_sum(
    logits: torch.Tensor, targets: torch.Tensor, units: torch.Tensor, position: torch.Tensor, temperature: float
) -> torch.Tensor:
    """``sum_i CE(logits_i[units] / T, target_i)``: the cross-entropy over the
    output units ``units`` only (sorted), a target unit ``u`` being class
    ``position[u]`` among them (``position`` maps every unit to its index in
    ``units``). Summed over the rows, so that parts of one minibatch add up
    to the code's mean over the whole."""
    return F.cross_entropy(logits[:, units] / temperature, position[targets], reduction="sum")


def unit_positions(units: list[int], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(units, position)`` tensors for :func:`masked_cross_entropy_sum`;
    a unit outside ``units`` maps to -1."""
    position = torch.full((width,), -1, dtype=torch.long)
    position[torch.tensor(units, dtype=torch.long)] = torch.arange(len(units))
    return torch.tensor(units, dtype=torch.long, device=device), position.to(device)


def class_prototypes(features: torch.Tensor, labels: torch.Tensor, classes: list[int]) -> dict[int, torch.Tensor]:
    """The code's prototypes of ``classes`` (a client's current task): each
    class's mean feature (:func:`fedaval.prototypes.class_means`, in float64),
    zeros for a class with no sample here."""
    means, _ = class_means(features.detach().to(torch.float64), labels)
    return {c: means[c].float() if c in means else features.new_zeros(features.shape[1]) for c in classes}


def client_radius(features: torch.Tensor, labels: torch.Tensor, classes: list[int]) -> float:
    """The code's one radius of a client, ``sqrt(mean_c trace(Cov_c) / D)``
    over ``classes``, ``Cov_c`` the unbiased covariance of class ``c``'s
    features (numpy's ``cov``); a class with fewer than two samples here
    counts as 0 (numpy gives NaN, which the code sets to 0)."""
    dim = features.shape[1]
    terms = []
    for c in classes:
        f = features[labels == c].detach().to(torch.float64)
        n = len(f)
        terms.append(float((f - f.mean(0)).pow(2).sum() / ((n - 1) * dim)) if n > 1 else 0.0)
    return float(torch.tensor(terms, dtype=torch.float64).mean().sqrt()) if terms else 0.0


def aggregate_prototypes(
    uploads: list[tuple[int, dict[int, torch.Tensor]]], old: dict[int, torch.Tensor] | None, ema: float
) -> dict[int, torch.Tensor]:
    """The server's prototypes of one round (the code's ``_aggregate_proto``).

    ``uploads``: ``(n_k, {class: prototype})`` per client, ``n_k`` its sample
    count. A class uploaded this round gets the mean of the non-zero
    prototypes sent for it, weighted by ``n_k`` (``sum_k w_k mu_k / sum_k w_k``,
    ``w_k = n_k / N``, ``N`` the round's total; zeros when every one sent was
    zero); a class also in ``old`` then becomes ``ema * that + (1 - ema) *
    old``. Classes nobody uploaded this round are not in the result (the
    code rebuilds its dictionary from the round's uploads)."""
    total = sum(n for n, _ in uploads)
    classes = sorted({c for _, protos in uploads for c in protos})
    if not classes:
        return {}
    dim = next(mu.shape[0] for _, protos in uploads for mu in protos.values())
    out = {}
    for c in classes:
        acc: torch.Tensor | None = None
        weights = 0.0
        for n, protos in uploads:
            mu = protos.get(c)
            if mu is None or not bool(mu.any()):
                continue
            w = n / total
            term = mu.detach().to(torch.float64) * w
            acc = term if acc is None else acc + term
            weights += w
        mean = torch.zeros(dim, dtype=torch.float64) if acc is None else acc
        if 0 < weights < 1:
            mean = mean / weights
        if old is not None and c in old:
            mean = ema * mean + (1 - ema) * old[c].to(torch.float64)
        out[c] = mean.float()
    return out


def aggregate_radius(uploads: list[tuple[int, float]]) -> float:
    """The server's radius: the clients' radii weighted by their sample counts."""
    total = sum(n for n, _ in uploads)
    return sum(n / total * r for n, r in uploads) if total else 0.0


def noisy_prototypes(
    prototypes: torch.Tensor, radius: float, classes: torch.Tensor, count: int, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PASS's prototype augmentation: ``count`` features ``mu_c + r e``,
    ``e ~ N(0, I)``, each of a class drawn uniformly from ``classes`` (rows
    of ``prototypes`` [K, D]); one radius for all. Returns ``(features,
    classes)``."""
    k, dim = prototypes.shape
    pick = torch.randint(k, (count,), generator=generator, device=prototypes.device)
    noise = torch.randn(count, dim, generator=generator, device=prototypes.device, dtype=prototypes.dtype)
    return prototypes[pick] + radius * noise, classes[pick]


def representation_loss(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The code's representation loss on ``features`` [N, D] (the minibatch's
    unrotated features and the noisy prototypes, L2-normalised here) with
    ``labels``: a supervised contrastive loss whose anchors are the samples
    of the classes in ``anchors`` (the client's current classes) with at
    least one other sample of their class:

        sum_i -1 / (N_c - 1) sum_{j != i, y_j = y_i} (s_ij - log sum_j' exp(s~_ij')) / N

    ``s_ij = f_i . f_j / T``; ``s~`` is ``s`` with its diagonal set to 0 (the
    code zeroes the self-similarity and keeps it in the normaliser). Written
    without per-class indexing (nothing waits for the GPU)."""
    f = F.normalize(features, p=2.0, dim=1)
    n = len(f)
    sims = f @ f.T / temperature
    eye = torch.eye(n, dtype=torch.bool, device=f.device)
    norm = torch.logsumexp(sims.masked_fill(eye, 0.0), dim=1, keepdim=True)
    same = (labels.unsqueeze(0) == labels.unsqueeze(1)) & ~eye
    others = same.sum(1)
    is_anchor = torch.isin(labels, anchors) & (others > 0)
    per_anchor = -((sims - norm) * same).sum(1) / others.clamp(min=1)
    return (per_anchor * is_anchor).sum() / n
