"""PFCL's maths on plain tensors (Zhang, Yang, Yu, Hu, Jing, "Prototype-based
federated continual learning", Sci Sin Inform 2024; equation numbers are the
paper's). No hooks here: :mod:`fedaval.plugins.pfcl` is the glue.

A *library* is a ``dict[int, Tensor]`` from class id to its prototype
(a ``[D]`` vector).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from fedaval.prototypes import class_index

# Score given to classes that have no prototype: far below any real logit, so
# softmax gives them probability 0 and argmax never picks them (finite, so
# that 0 * score stays 0 in the cross-entropy's backward pass).
NO_PROTOTYPE = -1e9


def euclidean_distances(features: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """``[B, K]`` Euclidean distances dis(f(x_b), p_k) (the paper's ``dis``).

    The square root is taken of the squared distance clamped at 1e-12, so the
    gradient stays finite when a feature sits exactly on a prototype."""
    diff = features.unsqueeze(1) - prototypes.unsqueeze(0)
    return diff.pow(2).sum(-1).clamp_min(1e-12).sqrt()


def distance_logits(features: torch.Tensor, prototypes: torch.Tensor, temperature: float) -> torch.Tensor:
    """-dis(f(x), p_k) / T: the scores whose softmax is Eq. (8)/(11),
    p(y=k|x) = exp(-dis(f(x), p_k)/T) / sum_i exp(-dis(f(x), p_i)/T)."""
    return -euclidean_distances(features, prototypes) / temperature


def stack_library(library: dict[int, torch.Tensor]) -> tuple[list[int], torch.Tensor]:
    """Class ids (sorted) and the ``[K, D]`` matrix of their prototypes."""
    classes = sorted(library)
    return classes, torch.stack([library[c] for c in classes])


def library_logits(
    features: torch.Tensor, library: dict[int, torch.Tensor], num_classes: int, temperature: float
) -> torch.Tensor:
    """``[B, num_classes]`` class scores of the prototype classifier: -dis/T
    for the classes in ``library``, :data:`NO_PROTOTYPE` for the others. A
    cross-entropy on these scores is L_C, Eqs. (11)-(12); their argmax is the
    nearest prototype, Eq. (3)."""
    out = features.new_full((features.shape[0], num_classes), NO_PROTOTYPE)
    if not library:
        return out
    classes, protos = stack_library(library)
    index = class_index(tuple(classes), str(features.device))
    return out.index_copy(1, index, distance_logits(features, protos.to(features), temperature))


def class_means(features: torch.Tensor, labels: torch.Tensor) -> dict[int, torch.Tensor]:
    """Eq. (2): p_{c,i} = mean of f(x) over the samples of class i
    (:func:`fedaval.prototypes.class_means`, without the counts)."""
    from fedaval.prototypes import class_means as means_and_counts

    return means_and_counts(features, labels)[0]


def temperature_softmax(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. (7): q_i = exp(z_i/T) / sum_j exp(z_j/T)."""
    return torch.softmax(logits / temperature, dim=-1)


def teacher_soft_labels(
    teacher_features: torch.Tensor, teacher_prototypes: torch.Tensor, temperature: float
) -> torch.Tensor:
    """Eq. (8)'s soft labels ``[B, K]``: the frozen previous-task model's
    temperature softmax over its prototype distances,
    y_k = softmax_k(-dis(theta_old(x), p_k^old)/T)."""
    return torch.softmax(-euclidean_distances(teacher_features, teacher_prototypes) / temperature, dim=-1)


def distillation_loss(
    student_features: torch.Tensor,
    student_prototypes: torch.Tensor,
    teacher_features: torch.Tensor,
    teacher_prototypes: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    """L_D, Eqs. (6)-(8): -sum_i y_i log(y^_i), averaged over the batch, where
    the soft label y is :func:`teacher_soft_labels` and y^ the current
    model's temperature softmax over its own prototypes of the same classes
    (rows of the two prototype matrices are the same classes, in order).

    Reading: z_k = -dis(theta(x), p_k) in Eq. (7), so T divides the distance
    once (Eq. 8), and the classes are those the teacher knew."""
    target = teacher_soft_labels(teacher_features, teacher_prototypes, temperature)
    return distillation_from(target, student_features, student_prototypes, temperature)


def distillation_from(
    target: torch.Tensor, student_features: torch.Tensor, student_prototypes: torch.Tensor, temperature: float
) -> torch.Tensor:
    """:func:`distillation_loss` given the teacher's soft labels ``target``."""
    log_pred = F.log_softmax(-euclidean_distances(student_features, student_prototypes) / temperature, dim=-1)
    return -(target.detach() * log_pred).sum(-1).mean()


def normalised_entropy(probabilities: torch.Tensor) -> torch.Tensor:
    """Mean over the rows of H(p) / ln K (K = the number of columns): 1 for
    uniform rows, 0 for one-hot ones (and for K = 1). Of the teacher's soft
    labels it says how much L_D can pass on: near 1 the student is pulled
    towards a uniform guess, whatever the teacher learned, and L_D's
    gradient is nearly 0 (the distances between prototypes are small against
    T)."""
    k = probabilities.shape[-1]
    if k < 2:
        return probabilities.new_zeros(())
    entropy = -(probabilities * probabilities.clamp_min(1e-12).log()).sum(-1)
    return entropy.mean() / math.log(k)


def prototype_regulariser(
    features: torch.Tensor, labels: torch.Tensor, global_library: dict[int, torch.Tensor]
) -> torch.Tensor:
    """L_R, Eq. (5): sum_i dis(p_i, p-bar_i) over the classes i of the batch
    that have a global prototype p-bar_i.

    Reading: the local prototype p_i of Eq. (2) is a mean over the client's
    data, computed after training and so without gradient; inside a minibatch
    we use the batch's class-i mean feature as its differentiable estimate.
    Classes without a global prototype yet add nothing; so does a batch with
    none of them (the result is then a zero that still has a graph).

    On a GPU the per-class means wait for it a few times per class and
    minibatch (:func:`fedaval.prototypes.class_means`). A membership-matrix
    form would not, but it moves the float rounding, so it waits until
    PFCL's table is re-run with it."""
    total = features.sum() * 0.0
    for c, mean in class_means(features, labels).items():
        if c in global_library:
            target = global_library[c].to(features)
            total = total + (mean - target).pow(2).sum().clamp_min(1e-12).sqrt()
    return total


def fuse_prototypes(uploads: list[dict[int, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Eq. (4): p-bar_i = (1/|C_i|) sum_{c in C_i} p_{c,i}, a plain mean over
    the clients C_i that uploaded class i (not weighted by sample counts)."""
    sums: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    for library in uploads:
        for c, proto in library.items():
            sums[c] = sums[c] + proto if c in sums else proto.clone().float()
            counts[c] = counts.get(c, 0) + 1
    return {c: sums[c] / counts[c] for c in sums}


def update_library(library: dict[int, torch.Tensor], fused: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """The server's growing library: every class ever learned is kept; classes
    uploaded this round take their new fused value (Section 3.1)."""
    return {**library, **fused}


def memory_quota(policy: str, num_classes: int, per_class: int, total: int) -> int:
    """Exemplars kept per class (Section 3.3), the same for every class:
    ``per-class`` keeps ``per_class`` each (the memory grows with the classes);
    ``total`` shares a fixed ``total`` equally, ``total // num_classes`` each
    (the share shrinks as classes arrive); ``none`` keeps nothing."""
    if policy == "none" or num_classes == 0:
        return 0
    if policy == "per-class":
        return per_class
    if policy == "total":
        return total // num_classes
    raise ValueError(f"unknown memory policy {policy!r}")


def select_exemplars(
    features: torch.Tensor, labels: torch.Tensor, library: dict[int, torch.Tensor], quota: int
) -> torch.Tensor:
    """Indices (ascending) of the exemplars to keep: for every class in
    ``labels``, the ``quota`` samples whose features are nearest to the
    class's prototype, d_{x,i} = dis(p_i, theta(x)), Eq. (9). Ties go to the
    lower index. A class without a prototype in ``library`` keeps nothing."""
    keep = []
    for c in torch.unique(labels).tolist():
        if c not in library or quota <= 0:
            continue
        idx = torch.nonzero(labels == c).flatten()
        d = euclidean_distances(features[idx], library[c].to(features).unsqueeze(0)).flatten()
        order = torch.sort(d, stable=True).indices
        keep.append(idx[order[:quota]])
    if not keep:
        return torch.zeros(0, dtype=torch.long)
    return torch.sort(torch.cat(keep)).values
