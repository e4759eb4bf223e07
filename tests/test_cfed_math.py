"""CFeD's maths against values worked out by hand."""

from __future__ import annotations

import math

import torch

from fedaval.plugins.cfed_math import (
    distil,
    distillation_loss,
    ensemble_logits,
    reviewer_count,
    soft_cross_entropy,
    split_clients,
)
from fedaval.unlabelled import to_input_shape

T = torch.tensor
LN3 = math.log(3.0)


def test_distillation_loss_by_hand():
    student, teacher = T([[0.0, 0.0]]), T([[LN3, 0.0]])
    # T = 1: p_t = (3/4, 1/4), p_s = (1/2, 1/2): KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert math.isclose(distillation_loss(student, teacher, None, 1.0).item(), expected, rel_tol=1e-6)
    # T = 2: p_t = (sqrt3, 1) / (sqrt3 + 1), scaled by T^2 = 4
    s3 = math.sqrt(3.0)
    p = (s3 / (s3 + 1), 1 / (s3 + 1))
    expected2 = 4 * (p[0] * math.log(2 * p[0]) + p[1] * math.log(2 * p[1]))
    assert math.isclose(distillation_loss(student, teacher, None, 2.0).item(), expected2, rel_tol=1e-6)
    # restricted to the old classes 0, 1: the third column is ignored
    wide_s, wide_t = T([[0.0, 0.0, 100.0]]), T([[LN3, 0.0, -100.0]])
    assert math.isclose(distillation_loss(wide_s, wide_t, [0, 1], 1.0).item(), expected, rel_tol=1e-6)
    # equal scores up to a shift: zero
    assert abs(distillation_loss(T([[1.0, 2.0]]), T([[3.0, 4.0]]), None, 2.0).item()) < 1e-6


def test_soft_cross_entropy_by_hand():
    student, teacher = T([[0.0, 0.0]]), T([[LN3, 0.0]])
    # T = 1: p_t = (3/4, 1/4), log p_s = (ln 1/2, ln 1/2): -(3/4 + 1/4) ln(1/2) = ln 2, with no T^2 factor
    assert math.isclose(soft_cross_entropy(student, teacher, None, 1.0).item(), math.log(2), rel_tol=1e-6)
    # it is KL / T^2 plus the teacher's entropy: the same gradient as distillation_loss / T^2
    s3 = math.sqrt(3.0)
    p = (s3 / (s3 + 1), 1 / (s3 + 1))
    entropy = -(p[0] * math.log(p[0]) + p[1] * math.log(p[1]))
    value = soft_cross_entropy(student, teacher, None, 2.0).item()
    assert math.isclose(value, distillation_loss(student, teacher, None, 2.0).item() / 4 + entropy, rel_tol=1e-6)
    a = T([[0.3, -1.0, 2.0]]).requires_grad_(True)
    b = T([[1.0, 0.5, -0.5]])
    (g_soft,) = torch.autograd.grad(soft_cross_entropy(a, b, None, 2.0), a)
    (g_kl,) = torch.autograd.grad(distillation_loss(a, b, None, 2.0), a)
    assert torch.allclose(4 * g_soft, g_kl, atol=1e-6)
    # over all columns by default; restricted to classes [0, 1] the third is ignored
    wide_s, wide_t = T([[0.0, 0.0, 100.0]]), T([[LN3, 0.0, -100.0]])
    assert math.isclose(soft_cross_entropy(wide_s, wide_t, [0, 1], 1.0).item(), math.log(2), rel_tol=1e-6)
    assert soft_cross_entropy(wide_s, wide_t, None, 1.0).item() > 100


def test_ensemble_is_the_mean_of_logits():
    assert ensemble_logits([T([[1.0, 2.0]]), T([[3.0, 6.0]])]).tolist() == [[2.0, 4.0]]


def test_reviewer_count_leaves_at_least_one_learner():
    assert reviewer_count(3, 0.3) == 1  # round(0.9)
    assert reviewer_count(4, 0.5) == 2
    assert reviewer_count(2, 0.5) == 1  # round(1.0)
    assert reviewer_count(4, 1.0) == 3
    assert reviewer_count(5, 0.0) == 0
    assert reviewer_count(1, 0.9) == 0


def test_split_clients_is_a_seeded_partition():
    ids = [0, 2, 5, 7, 9]
    learners, reviewers = split_clients(ids, 0.4, torch.Generator().manual_seed(3))
    assert len(reviewers) == 2 and sorted(learners + reviewers) == ids and not set(learners) & set(reviewers)
    assert split_clients(ids, 0.4, torch.Generator().manual_seed(3)) == (learners, reviewers)
    draws = {tuple(split_clients(ids, 0.4, torch.Generator().manual_seed(s))[1]) for s in range(20)}
    assert len(draws) > 1  # the split is random, not always the same clients


def test_to_input_shape_converts_channels_and_size():
    rgb = torch.stack([torch.full((4, 4), v) for v in (0.3, 0.6, 0.9)]).unsqueeze(0)  # [1, 3, 4, 4]
    grey = to_input_shape(rgb, (1, 2, 2))
    assert grey.shape == (1, 1, 2, 2) and torch.allclose(grey, torch.full((1, 1, 2, 2), 0.6))
    up = to_input_shape(T([[[[0.0, 1.0], [1.0, 0.0]]]]), (3, 2, 2))
    assert up.shape == (1, 3, 2, 2) and torch.equal(up[0, 2], T([[0.0, 1.0], [1.0, 0.0]]))


def test_distil_moves_the_student_towards_the_teacher():
    torch.manual_seed(0)
    teacher, student = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    x = torch.randn(64, 4)
    with torch.no_grad():
        target = teacher(x)
        before = distillation_loss(student(x), target, None, 2.0).item()
    weight = student.weight.detach().clone()
    distil(student, x, target, None, 2.0, epochs=20, lr=0.5, batch_size=16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        after = distillation_loss(student(x), target, None, 2.0).item()
    assert not torch.equal(weight, student.weight) and after < 0.5 * before
