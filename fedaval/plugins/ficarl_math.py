"""FediCaRL's maths on plain tensors: iCaRL (Rebuffi, Kolesnikov, Sperl,
Lampert, "iCaRL: Incremental Classifier and Representation Learning", CVPR
2017; algorithm numbers are the paper's). No hooks here:
:mod:`fedaval.plugins.ficarl` is the glue.

Features are the model's ``features`` output; iCaRL works with them
L2-normalised (Section 2.1: "phi(x) ... normalized"), so every function that
compares features normalises them first (:func:`normalise`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from fedaval.prototypes import class_index


def normalise(features: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    return F.normalize(features, dim=-1)


def herding_order(features: torch.Tensor, count: int) -> torch.Tensor:
    """iCaRL Algorithm 4 (ConstructExemplarSet): the first ``count`` samples
    chosen by herding on the normalised features, in the order chosen:
    ``p_k = argmin_x || mu - (phi(x) + sum_{j<k} phi(p_j)) / k ||`` with
    ``mu`` the class mean, without repeats. Returns int64 row indices on the
    CPU; ``count`` larger than the rows keeps all rows.

    The greedy step is Avalanche's
    :class:`~avalanche.training.storage_policy.HerdingSelectionStrategy`
    (``make_sorted_indices_from_features``) operation for operation, so the
    order is its order's first ``count`` (tests/test_ficarl.py compares
    them). What a federated run needs that it lacks: it orders every row,
    ``count`` or not, and reads each step's choice back to the host. At full
    scale (ResNet-18 on all of CIFAR-10: 1,667 rows of 512 features a class
    and client, a quota of 250) that took 9.9 s a class on 2 CPU threads
    (``benchmarks/glfc_task_steps.py``; 0.9 s this way), and
    on an H200 shared by six runs GLFC's task ends took 85 to 206 s (GPU
    session 26). This loop stops after ``count`` steps and keeps its choices
    on the features' device (no wait for a GPU until the end)."""
    if len(features) == 0 or count <= 0:
        return torch.zeros(0, dtype=torch.long)
    phi = normalise(features).double()
    count = min(count, len(phi))
    center = phi.mean(dim=0)
    current_center = center * 0
    taken = torch.zeros(len(phi), dtype=torch.bool, device=phi.device)
    order = torch.empty(count, dtype=torch.long, device=phi.device)
    for i in range(count):
        candidate_centers = current_center * i / (i + 1) + phi / (i + 1)
        distances = pow(candidate_centers - center, 2).sum(dim=1).masked_fill_(taken, float("inf"))
        chosen = distances.argmin().view(1)
        order[i : i + 1] = chosen
        taken.index_fill_(0, chosen, True)
        current_center = candidate_centers.index_select(0, chosen)[0]
    return order.cpu()


def memory_quotas(memory_size: int, classes: list[int]) -> dict[int, int]:
    """iCaRL's fixed memory K shared by the classes seen (Algorithm 2,
    ``m = K / t``): ``{class: exemplars}``. K does not always divide evenly;
    the remainder goes one each to the lowest class ids, as Avalanche's
    class-balanced buffers do (``BalancedExemplarsBuffer.get_group_lengths``,
    called here), so the quotas always sum to K."""
    from avalanche.training.storage_policy import ClassBalancedBuffer

    classes = sorted(classes)
    if not classes:
        return {}
    lengths = ClassBalancedBuffer(max_size=memory_size).get_group_lengths(len(classes))
    return dict(zip(classes, lengths))


def herd_classes(
    features: torch.Tensor, labels: torch.Tensor, indices: np.ndarray, classes: list[int], quotas: dict[int, int]
) -> dict[int, np.ndarray]:
    """iCaRL Algorithm 4 for each class ``c`` in ``classes``: its
    ``quotas[c]`` exemplars chosen by :func:`herding_order` among the rows of
    ``features`` labelled ``c``, as ``{c: indices}`` in the order chosen
    (``indices``: the rows' indices into the training set)."""
    sets = {}
    for c in classes:
        rows = (labels == c).nonzero().flatten()
        order = herding_order(features[rows], quotas.get(c, 0)).to(rows.device)
        sets[c] = indices[rows[order].cpu().numpy()]
    return sets


def cut_sets(sets: dict[int, np.ndarray], quotas: dict[int, int]) -> dict[int, np.ndarray]:
    """iCaRL Algorithm 5 (ReduceExemplarSet): every set cut to its class's
    quota, keeping the first exemplars in herding order; empty sets dropped."""
    cut = {c: idx[: quotas.get(c, 0)] for c, idx in sets.items()}
    return {c: idx for c, idx in cut.items() if len(idx)}


def exemplar_means(features: torch.Tensor, labels: torch.Tensor) -> dict[int, torch.Tensor]:
    """iCaRL Algorithm 1: ``mu_y = normalise(1/|P_y| sum_{p in P_y} phi(p))``
    with ``phi`` normalised, for every class in ``labels``."""
    phi = normalise(features)
    return {int(c): normalise(phi[labels == c].mean(0)) for c in torch.unique(labels)}


def nme_scores(features: torch.Tensor, means: dict[int, torch.Tensor], num_classes: int) -> torch.Tensor:
    """iCaRL Algorithm 1, nearest-mean-of-exemplars: ``[B, num_classes]``
    scores ``-|| phi(x) - mu_y ||`` whose argmax is ``argmin_y || phi(x) -
    mu_y ||``; classes without a mean score ``-inf``."""
    from fedaval.prototypes import nearest_prototype_scores

    return nearest_prototype_scores(normalise(features), means, num_classes)


def _bce_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``-sum [t log sigmoid(g) + (1 - t) log(1 - sigmoid(g))]`` over the
    entries, divided by the number of rows (the minibatch mean of the
    per-sample sum over classes)."""
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="sum") / max(len(logits), 1)


def classification_loss(logits: torch.Tensor, labels: torch.Tensor, new_classes: list[int]) -> torch.Tensor:
    """The classification half of iCaRL's loss (Algorithm 3, first sum):
    ``-1/B sum_i sum_{y in new} [d_{y=y_i} log g_y(x_i) + d_{y!=y_i} log(1 - g_y(x_i))]``
    with ``g = sigmoid(logits)``: one binary cross-entropy per output of the
    ``new_classes`` (the client's seen classes that are not distilled).
    Outputs of other classes take no part."""
    if not new_classes:
        return logits.sum() * 0.0
    index = class_index(tuple(new_classes), str(logits.device))
    targets = (labels.unsqueeze(1) == index.unsqueeze(0)).to(logits.dtype)
    return _bce_sum(logits[:, index], targets)


def distillation_loss(logits: torch.Tensor, teacher_logits: torch.Tensor, old_classes: list[int]) -> torch.Tensor:
    """The distillation half of iCaRL's loss (Algorithm 3, second sum):
    ``-1/B sum_i sum_{y in old} [q_i^y log g_y(x_i) + (1 - q_i^y) log(1 - g_y(x_i))]``
    with ``q_i^y = sigmoid(teacher_logits)``, the previous model's output for
    old class ``y`` (a constant target)."""
    if not old_classes:
        return logits.sum() * 0.0
    index = class_index(tuple(old_classes), str(logits.device))
    targets = torch.sigmoid(teacher_logits[:, index]).detach()
    return _bce_sum(logits[:, index], targets)
