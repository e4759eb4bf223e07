"""CFeD's maths (Ma, Xie, Wang, Chen, Shou, IJCAI 2022): the distillation
loss on surrogate data, the ensemble the server distils and the division of
clients into learners and reviewers (the surrogate data's conversion to the
model's input shape is :mod:`fedaval.unlabelled`). Plain functions on tensors, tested
against hand-computed values in ``tests/test_cfed_math.py``; the hook glue is
:mod:`fedaval.plugins.cfed`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from fedaval.prototypes import class_index


def distillation_loss(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, classes: Sequence[int] | None, temperature: float
) -> torch.Tensor:
    """Knowledge distillation (Hinton et al. 2015, as CFeD's Eq. for L_KD):
    ``T^2 * mean_batch KL(softmax(t/T) || softmax(s/T))`` over the columns
    ``classes`` (all columns when ``None``). Zero when the student's scores
    equal the teacher's on those classes (up to a constant shift)."""
    if classes is not None:
        cols = class_index(tuple(classes), str(student_logits.device))
        student_logits, teacher_logits = student_logits[:, cols], teacher_logits[:, cols]
    log_s = F.log_softmax(student_logits / temperature, dim=1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=1)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=1)
    return temperature**2 * kl.mean()


def soft_cross_entropy(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, classes: Sequence[int] | None, temperature: float
) -> torch.Tensor:
    """The clients' distillation in CFeD's code (its ``DistillationLoss``
    without the weight): ``-mean_batch sum_k softmax(t/T)_k log softmax(s/T)_k``
    over the columns ``classes`` (all columns when ``None``), with no ``T^2``
    factor. It is ``KL(softmax(t/T) || softmax(s/T))`` plus the teacher's
    entropy, a constant for the student: the same gradient as
    :func:`distillation_loss` divided by ``T^2``."""
    if classes is not None:
        cols = class_index(tuple(classes), str(student_logits.device))
        student_logits, teacher_logits = student_logits[:, cols], teacher_logits[:, cols]
    log_s = F.log_softmax(student_logits / temperature, dim=1)
    return -(F.softmax(teacher_logits / temperature, dim=1) * log_s).sum(dim=1).mean()


def ensemble_logits(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """The ensemble's scores: the mean of the clients' logits."""
    return torch.stack(list(logits)).mean(dim=0)


def reviewer_count(sampled: int, fraction: float) -> int:
    """How many of ``sampled`` clients review old tasks: ``round(fraction *
    sampled)`` (halves up), at most ``sampled - 1`` so that at least one
    client learns the new task."""
    if sampled <= 1:
        return 0
    return max(0, min(sampled - 1, math.floor(fraction * sampled + 0.5)))


def split_clients(ids: Sequence[int], fraction: float, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """CFeD's client division: a random ``reviewer_count`` of ``ids`` review
    old tasks, the others learn the new task. Returns ``(learners,
    reviewers)``, each sorted."""
    ids = list(ids)
    n = reviewer_count(len(ids), fraction)
    order = torch.randperm(len(ids), generator=generator).tolist()
    reviewers = sorted(ids[i] for i in order[:n])
    learners = sorted(i for i in ids if i not in reviewers)
    return learners, reviewers


@contextmanager
def batchnorm_frozen(model: torch.nn.Module) -> Iterator[None]:
    """BatchNorm layers of ``model`` in eval mode while the block runs (their
    running statistics stay those of the real data, not the surrogate's)."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    for m in norms:
        m.eval()
    try:
        yield
    finally:
        for m in norms:
            m.train()


def distil(
    student: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    classes: Sequence[int] | None,
    temperature: float,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> float:
    """Train ``student`` by SGD to match ``targets`` (teacher logits of
    ``inputs``) with :func:`distillation_loss`, ``epochs`` passes over
    ``inputs`` in random minibatches. Returns the mean loss of the last
    epoch (``nan`` when nothing ran)."""
    opt = torch.optim.SGD(student.parameters(), lr=lr)
    was_training = student.training
    student.train()
    last = float("nan")
    with batchnorm_frozen(student):
        for _ in range(epochs):
            total, count = 0.0, 0
            order = torch.randperm(len(inputs), generator=generator)
            for start in range(0, len(inputs), batch_size):
                idx = order[start : start + batch_size].to(inputs.device)
                if len(idx) < 2:  # keep minibatches comparable; a lone sample adds little
                    continue
                loss = distillation_loss(student(inputs[idx]), targets[idx], classes, temperature)
                opt.zero_grad()
                loss.backward()
                opt.step()
                total += loss.item() * len(idx)
                count += len(idx)
            last = total / max(count, 1)
    student.train(was_training)
    return last
