"""FedSpace's maths on plain tensors (Shenaj, Toldo, Rigon, Zanuttigh,
"Asynchronous Federated Continual Learning", CVPR Workshops 2023), whose
prototype augmentation follows PASS (Zhu et al., "Prototype Augmentation and
Self-Supervision for Incremental Learning", CVPR 2021). No hooks here:
:mod:`fedaval.plugins.fedspace` is the glue.

A *bank* is ``dict[int, tuple[Tensor, Tensor, int]]``: class id -> (prototype
``[D]``, radius (a 0-d tensor), sample count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedaval.prototypes import class_index

Bank = dict[int, tuple[torch.Tensor, torch.Tensor, int]]


def prototypes_and_radii(features: torch.Tensor, labels: torch.Tensor) -> Bank:
    """Per class ``c`` of ``labels``: the prototype ``mu_c = mean f(x)``, the
    radius ``r_c = sqrt(trace(Cov_c) / D)`` and the count ``n_c``.

    ``Cov_c`` is the unbiased covariance of the class's features (``n_c - 1``
    in the denominator, numpy's ``cov`` as PASS computes it), so
    ``r_c^2 = sum_i ||f(x_i) - mu_c||^2 / ((n_c - 1) D)``: the mean variance
    per feature dimension, and ``mu_c + r_c * N(0, I)`` has the class's total
    variance. PASS keeps one radius for all classes (the square root of the
    mean of the per-class ``trace(Cov)/D``), and so does FedSpace's released
    code (one per client, computed once); the per-class radius is our
    reading (docs/methods.md, "The baselines against their authors' code").
    A class with one sample has radius 0."""
    bank: Bank = {}
    dim = features.shape[1]
    for c in torch.unique(labels).tolist():
        f = features[labels == c].detach().to(torch.float64)
        mu = f.mean(0)
        n = len(f)
        spread = (f - mu).pow(2).sum() / ((n - 1) * dim) if n > 1 else f.new_zeros(())
        bank[int(c)] = (mu.float(), spread.sqrt().float(), n)
    return bank


def fuse_banks(uploads: list[Bank]) -> Bank:
    """The server's prototype averaging, per class over the clients that
    uploaded it, weighted by their counts ``n_k``:
    ``mu = sum_k n_k mu_k / N``, ``r = sqrt(sum_k n_k r_k^2 / N)`` (the
    count-weighted mean of the squared radii, i.e. of the clients' per-dimension
    variances), ``N = sum_k n_k``. Classes with zero total count are left out."""
    sums: dict[int, list] = {}
    for bank in uploads:
        for c, (mu, r, n) in bank.items():
            if n <= 0:
                continue
            mu64, r64 = mu.detach().to(torch.float64), r.detach().to(torch.float64)
            if c in sums:
                acc = sums[c]
                acc[0] = acc[0] + n * mu64
                acc[1] = acc[1] + n * r64**2
                acc[2] += n
            else:
                sums[c] = [n * mu64, n * r64**2, n]
    return {c: ((m / n).float(), (v / n).sqrt().float(), n) for c, (m, v, n) in sums.items()}


def pseudo_features(
    prototypes: torch.Tensor, radii: torch.Tensor, classes: list[int], count: int, generator=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PASS's prototype augmentation: ``count`` pseudo features
    ``mu_c + r_c * e``, ``e ~ N(0, I)``, the class ``c`` of each drawn
    uniformly from ``classes`` (rows of ``prototypes`` ``[K, D]`` and
    ``radii`` ``[K]``). Random numbers come from ``generator`` (``None``: the
    global stream of the prototypes' device, a client's own stream while it
    trains). Returns ``(features [count, D], labels [count])``."""
    k, dim = prototypes.shape
    pick = torch.randint(k, (count,), generator=generator, device=prototypes.device)
    noise = torch.randn(count, dim, generator=generator, device=prototypes.device, dtype=prototypes.dtype)
    labels = class_index(tuple(classes), str(prototypes.device))[pick]
    return prototypes[pick] + radii[pick].unsqueeze(1) * noise, labels


def pseudo_feature_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the classifier's scores of the pseudo features,
    averaged over them (PASS's ``loss_protoAug`` without its temperature)."""
    return F.cross_entropy(logits, labels)
