"""FedProK's equations (``shared/papers/fedprok.txt``, Sec. 5) as plain
functions on tensors, tested against hand-computed values in
``tests/test_fedprok.py``; the hook glue is :mod:`fedaval.plugins.fedprok`."""

from __future__ import annotations

import torch


def class_prototypes(features: torch.Tensor, labels: torch.Tensor) -> dict[int, tuple[torch.Tensor, int]]:
    """FedProK Eq. 5: ``{c: (mean of the features of class c, count)}`` for
    every class present in ``labels`` (:func:`fedaval.prototypes.class_means`)."""
    from fedaval.prototypes import class_means

    means, counts = class_means(features, labels)
    return {c: (means[c], counts[c]) for c in sorted(means)}


def nearest_classes(old_protos: torch.Tensor, new_protos: torch.Tensor) -> torch.Tensor:
    """FedProK Eqs. 6-7: for each row ``p`` of ``old_protos`` [P, D], the index
    of the row of ``new_protos`` [N, D] with the largest cosine similarity
    ``mu_p . mu_n / (|mu_p| |mu_n|)`` (reading 1: the paper's argmin of a
    similarity is read as the nearest class). Returns [P] int64 indices; ties
    go to the lowest index. A zero prototype has similarity 0 to everything."""
    old = torch.nn.functional.normalize(old_protos, dim=1)
    new = torch.nn.functional.normalize(new_protos, dim=1)
    return (old @ new.T).argmax(dim=1)


def translate_features(
    features: torch.Tensor,
    labels: torch.Tensor,
    old_classes: list[int],
    old_protos: torch.Tensor,
    new_classes: list[int],
    new_protos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedProK Eq. 8 (FeTrIL): pseudo features of the previous classes.

    For each old class ``p`` (row of ``old_protos``), its base class ``n`` is
    :func:`nearest_classes`; every sample of ``features`` labelled ``n`` gives
    one pseudo feature ``f(x_n) + mu_p - mu_n`` labelled ``p``. Returns
    ``(pseudo features [M, D], labels [M])``, old classes in the given order,
    samples in batch order; ``M = 0`` when no base class is in ``labels``."""
    base = nearest_classes(old_protos, new_protos)
    parts, targets = [], []
    for i, p in enumerate(old_classes):
        j = int(base[i])
        mask = labels == new_classes[j]
        if not bool(mask.any()):
            continue
        parts.append(features[mask] + (old_protos[i] - new_protos[j]))
        targets.append(torch.full((int(mask.sum()),), p, dtype=torch.long, device=features.device))
    if not parts:
        return features.new_zeros((0, features.shape[1])), torch.zeros(0, dtype=torch.long, device=features.device)
    return torch.cat(parts), torch.cat(targets)


def pseudo_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, batch_size: int) -> torch.Tensor:
    """Reading 3: ``sum_i CE(logits_i, labels_i) / batch_size``, so a pseudo
    feature weighs as much as a real sample of the minibatch."""
    return torch.nn.functional.cross_entropy(logits, labels, reduction="sum") / max(batch_size, 1)


def fuse_prototypes(
    uploads: list[tuple[dict[int, torch.Tensor], dict[int, int]]],
    anchor: dict[int, torch.Tensor],
    beta: float,
) -> dict[int, torch.Tensor]:
    """FedProK Eq. 9, for the classes in ``uploads`` (one ``(prototypes,
    counts)`` pair per client).

    ``m_c = sum_k |D_kc| / |D_c| * mu_kc`` over the clients that uploaded
    ``c`` (``|D_c|`` = their total count). A class in ``anchor`` (known to the
    federation before the current task; value ``mu_c^{t-1}``) becomes
    ``beta * m_c + (1 - beta) * anchor[c]``; any other class becomes ``m_c``.
    Returns only the uploaded classes; classes with zero total count are left
    out."""
    sums: dict[int, torch.Tensor] = {}
    totals: dict[int, int] = {}
    for protos, counts in uploads:
        for c, mu in protos.items():
            n = int(counts.get(c, 0))
            if n <= 0:
                continue
            term = mu.to(torch.float64) * n
            sums[c] = sums[c] + term if c in sums else term
            totals[c] = totals.get(c, 0) + n
    fused = {}
    for c, total in totals.items():
        mean = sums[c] / total
        if c in anchor:
            mean = beta * mean + (1 - beta) * anchor[c].to(torch.float64)
        fused[c] = mean.to(torch.float32)
    return fused


# ---------------------------------------------------------------------------
# the plugin: hook glue
# ---------------------------------------------------------------------------
