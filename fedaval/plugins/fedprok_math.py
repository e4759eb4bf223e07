"""FedProK's equations (``shared/papers/fedprok.txt``, Sec. 5) as plain
functions on tensors, tested against hand-computed values in
``tests/test_fedprok.py``; the hook glue is :mod:`fedaval.plugins.fedprok`."""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class Translation:
    """FedProK Eq. 8 for one round, laid out so that a minibatch is translated
    without a host-device synchronisation (on a GPU the per-class masks of a
    direct translation cost four each per old class and minibatch, most of a
    round with the classifier fit of reading 8).

    ``targets`` [P]: the old classes; ``shifts`` [P, D]: ``mu_p - mu_n`` for
    each, ``n`` its base class (:func:`nearest_classes`); ``bases`` [N]: the
    current classes; ``slots`` [N, K]: row ``j`` lists the old classes (indices
    into ``targets``, in the given order) whose base class is ``bases[j]``,
    padded with -1 to the longest list's length ``K``."""

    targets: torch.Tensor
    shifts: torch.Tensor
    bases: torch.Tensor
    slots: torch.Tensor

    def to(self, device: torch.device) -> Translation:
        """The same plan on ``device``."""
        return Translation(*(t.to(device) for t in (self.targets, self.shifts, self.bases, self.slots)))


def plan_translation(
    old_classes: list[int], old_protos: torch.Tensor, new_classes: list[int], new_protos: torch.Tensor
) -> Translation:
    """The :class:`Translation` of the old classes ``old_classes`` (rows of
    ``old_protos`` [P, D]) onto the current ones (rows of ``new_protos``
    [N, D]); made once per round (it reads the base classes back to the host
    once)."""
    base = nearest_classes(old_protos, new_protos).tolist()
    groups = [[p for p, b in enumerate(base) if b == j] for j in range(len(new_classes))]
    width = max(len(g) for g in groups)
    device = old_protos.device
    return Translation(
        targets=torch.tensor(old_classes, dtype=torch.long, device=device),
        shifts=old_protos - new_protos[base],
        bases=torch.tensor(new_classes, dtype=torch.long, device=device),
        slots=torch.tensor([g + [-1] * (width - len(g)) for g in groups], dtype=torch.long, device=device),
    )


def translate_features(
    features: torch.Tensor, labels: torch.Tensor, plan: Translation
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FedProK Eq. 8 (FeTrIL): pseudo features of the previous classes.

    Every sample of ``features`` [B, D] whose label is the base class ``n`` of
    an old class ``p`` gives one pseudo feature ``f(x_n) + mu_p - mu_n``
    labelled ``p``. Shapes do not depend on the labels (so nothing waits for
    the GPU): returns ``(pseudo [B*K, D], targets [B*K], valid [B*K])``, for
    each sample in batch order its ``K`` slots of the plan in the old
    classes' order; ``valid`` marks the pseudo features that exist (the base
    class is the sample's label), the others are padding that
    :func:`pseudo_cross_entropy` leaves out."""
    slot = translation_slots(labels, plan)
    valid = slot >= 0
    slot = slot.clamp(min=0)
    pseudo = features.unsqueeze(1) + plan.shifts[slot]  # [B, K, D]
    return pseudo.flatten(0, 1), plan.targets[slot].flatten(), valid.flatten()


def translation_slots(labels: torch.Tensor, plan: Translation) -> torch.Tensor:
    """[B, K]: for each sample of ``labels`` [B], the old classes (indices
    into ``plan.targets``) that Eq. 8 translates it into, padded with -1 (a
    sample whose label is no base class has none)."""
    match = labels.unsqueeze(1) == plan.bases.unsqueeze(0)  # [B, N]: the sample's current class, if any
    slot = plan.slots[match.long().argmax(dim=1)]  # [B, K]
    return torch.where(match.any(dim=1, keepdim=True), slot, -1)


def pseudo_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, batch_size: int, valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Reading 3: ``sum_i CE(logits_i, labels_i) / batch_size`` over the
    pseudo features ``i`` (the rows where ``valid``, when given), so a pseudo
    feature weighs as much as a real sample of the minibatch."""
    ce = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    if valid is not None:
        ce = torch.where(valid, ce, ce.new_zeros(()))
    return ce.sum() / max(batch_size, 1)


def fit_head(
    head: torch.nn.Linear,
    features: torch.Tensor,
    labels: torch.Tensor,
    plan: Translation,
    l2: float,
    max_steps: int,
    weight: float = 1.0,
) -> tuple[float, int]:
    """Fit the linear classifier ``head`` to convergence on the balanced set
    of FedProK's reading 8: the real features ``features`` [N, D] with their
    ``labels`` and their translations by ``plan`` (Eq. 8), each pseudo
    feature weighing ``weight`` times a real one (reading 3: 1, the default;
    the option ``fedprok.weight``, as in the local epochs' ``pseudo_ce``).
    The objective is convex:

        (sum_i CE(head(f_i), y_i) + weight * sum_j CE(head(f^_j), p_j)) / N + l2 / 2 * |params|^2

    minimised by full-batch L-BFGS (strong Wolfe line search) for at most
    ``max_steps`` iterations, until the gradient or the change of the
    objective vanishes. Unlike SGD with a fixed learning rate, nothing in it
    depends on the features' scale (ResNet-18's features made a fixed step of
    0.1 with momentum diverge).

    The pseudo features are never made: the head is linear, so the logits of
    ``f_n + mu_p - mu_n`` are those of ``f_n`` plus ``W (mu_p - mu_n)``. An
    evaluation of the objective multiplies the real features [N, D] and the
    plan's shifts [P, D] by the weights, instead of the real and pseudo
    features (up to P / |new classes| times N rows more; at task 4 of
    CIFAR-10, five times as many rows in all), which bounded an iteration's
    time on the CPU (``benchmarks/fedprok_fit.py``). The same objective up to
    float rounding (until session 21 the pseudo features were made once per
    fit and multiplied in every evaluation). Returns (the objective's
    cross-entropy part at the end, the iterations taken)."""
    slot = translation_slots(labels, plan)
    rows, k = (slot >= 0).nonzero(as_tuple=True)  # the pseudo features, in translate_features' order
    old = slot[rows, k]
    truth = torch.cat([labels, plan.targets[old]])
    params = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_steps,
        history_size=20,
        tolerance_grad=1e-6,
        tolerance_change=1e-10,
        line_search_fn="strong_wolfe",
    )
    n = max(len(labels), 1)
    # per-sample weights only when they are not all 1: the same sum, in the same order, as before them
    weights = None
    if weight != 1.0:
        weights = torch.cat([features.new_ones(len(labels)), features.new_full((len(truth) - len(labels),), weight)])

    def logits() -> torch.Tensor:
        real = head(features)
        shifts = torch.nn.functional.linear(plan.shifts, head.weight)  # [P, C]: W (mu_p - mu_n)
        return torch.cat([real, real[rows] + shifts[old]])

    def cross_entropy() -> torch.Tensor:
        if weights is None:
            return torch.nn.functional.cross_entropy(logits(), truth, reduction="sum") / n
        return (torch.nn.functional.cross_entropy(logits(), truth, reduction="none") * weights).sum() / n

    def objective() -> torch.Tensor:
        optimizer.zero_grad()
        loss = cross_entropy()
        if l2:
            loss = loss + 0.5 * l2 * sum(p.pow(2).sum() for p in params)
        loss.backward()
        return loss

    optimizer.step(objective)
    steps = int(optimizer.state[params[0]].get("n_iter", 0)) if params else 0
    with torch.no_grad():
        end = cross_entropy()
    return float(end), steps


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
