"""GLFC's maths against values worked out by hand (fedaval.plugins.glfc_math)."""

from __future__ import annotations

import math

import pytest
import torch

from fedaval.plugins.glfc_math import (
    LeNet,
    bce_distillation,
    compensated_bce,
    compensated_cross_entropy,
    compensation_weights,
    entropy_rise,
    gradient_distance,
    gradient_measures,
    invert_gradient,
    mean_entropy,
    nearest_to_mean,
    pick_best,
    prototype_gradient,
    relation_distillation,
)

L3 = math.log(3.0)
# A and B are new-class samples, C an old-class one (label 0 in every row)
LOGITS = torch.tensor([[0.0, 0.0], [L3, 0.0], [0.0, L3]])  # p_y = 1/2, 3/4, 1/4
Y = torch.tensor([0, 0, 0])
OLD = torch.tensor([False, False, True])


def test_gradient_measures_are_one_minus_the_true_class_probability():
    assert gradient_measures(LOGITS, Y).tolist() == pytest.approx([0.5, 0.25, 0.75])


def test_compensation_weights_normalise_each_group_by_its_mean():
    # new: G = 1/2, 1/4, mean 3/8 -> 4/3, 2/3; old: G = 3/4 alone -> 1
    assert compensation_weights(LOGITS, Y, OLD).tolist() == pytest.approx([4 / 3, 2 / 3, 1.0])
    # all new: mean of (1/2, 1/4, 3/4) = 1/2 -> 1, 1/2, 3/2
    assert compensation_weights(LOGITS, Y, torch.zeros(3, dtype=torch.bool)).tolist() == pytest.approx([1, 0.5, 1.5])


def test_compensated_cross_entropy_by_hand():
    ce = [math.log(2), math.log(4 / 3), math.log(4)]
    expected = (4 / 3 * ce[0] + 2 / 3 * ce[1] + 1.0 * ce[2]) / 3
    assert compensated_cross_entropy(LOGITS, Y, OLD).item() == pytest.approx(expected)
    logits = LOGITS.clone().requires_grad_(True)
    compensated_cross_entropy(logits, Y, OLD).backward()  # weights are constants: d/dlogit = w_i (p - onehot) / b
    assert logits.grad[0].tolist() == pytest.approx([4 / 3 * (0.5 - 1) / 3, 4 / 3 * 0.5 / 3])


def softplus(z: float) -> float:
    return math.log1p(math.exp(z))


def test_the_codes_loss_is_a_compensated_bce_on_the_sigmoid_summed_over_the_outputs():
    # sigmoid(z_y): 1/2, 3/4, 1/2 -> G = 1/2, 1/4, 1/2; new (A, B): mean 3/8 -> 4/3, 2/3; old (C) -> 1
    assert gradient_measures(LOGITS, Y, sigmoid=True).tolist() == pytest.approx([0.5, 0.25, 0.5])
    assert compensation_weights(LOGITS, Y, OLD, sigmoid=True).tolist() == pytest.approx([4 / 3, 2 / 3, 1.0])
    # BCE(z, 1) = softplus(-z), BCE(z, 0) = softplus(z), summed over both outputs
    bce = [softplus(-z0) + softplus(z1) for z0, z1 in LOGITS.tolist()]
    expected = (4 / 3 * bce[0] + 2 / 3 * bce[1] + 1.0 * bce[2]) / 3
    assert compensated_bce(LOGITS, Y, OLD).item() == pytest.approx(expected)
    assert compensated_bce(LOGITS, Y, None).item() == pytest.approx(sum(bce) / 3)  # no old class: weights 1


def test_the_codes_distillation_targets_the_old_models_sigmoids_on_the_old_classes():
    student = torch.tensor([[0.0, 1.0, -1.0]])
    teacher = torch.tensor([[L3, 5.0, -2.0]])  # old classes 0 and 2: targets 3/4 and sigmoid(-2)
    y = torch.tensor([1])  # a new-class sample: target 1 on output 1

    def bce(z, t):
        return t * softplus(-z) + (1 - t) * softplus(z)

    s2 = 1 / (1 + math.exp(2))
    expected = bce(0.0, 0.75) + bce(1.0, 1.0) + bce(-1.0, s2)
    assert bce_distillation(student, teacher, y, [0, 2]).item() == pytest.approx(expected)
    # the teacher's entry replaces the label's on an old class (an exemplar of class 0)
    expected_old = bce(0.0, 0.75) + bce(1.0, 0.0) + bce(-1.0, s2)
    assert bce_distillation(student, teacher, torch.tensor([0]), [0, 2]).item() == pytest.approx(expected_old)


def test_relation_distillation_is_the_kl_over_the_old_classes_only():
    teacher = torch.tensor([[L3, 5.0, 0.0]])  # over classes 0 and 2: (3/4, 1/4); class 1 is ignored
    student = torch.tensor([[0.0, -1.0, 0.0]])  # (1/2, 1/2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert relation_distillation(student, teacher, [0, 2], 1.0).item() == pytest.approx(kl)
    assert relation_distillation(2 * student, 2 * teacher, [0, 2], 2.0).item() == pytest.approx(kl)


def test_entropy_and_its_rise():
    assert mean_entropy(torch.tensor([[0.0, 0.0], [100.0, 0.0]])) == pytest.approx(math.log(2) / 2)
    assert not entropy_rise(None, 5.0, 0.3)
    assert entropy_rise(1.0, 1.5, 0.3) and not entropy_rise(1.0, 1.2, 0.3) and not entropy_rise(1.0, 0.5, 0.3)


def test_nearest_to_mean_and_pick_best():
    features = torch.tensor([[0.0], [1.0], [5.0]])  # mean 2: distances 2, 1, 3
    assert nearest_to_mean(features, 2).tolist() == [1, 0]
    assert nearest_to_mean(features, 9).tolist() == [1, 0, 2]
    assert pick_best([0.5, 0.7, 0.7, 0.6]) == 2
    assert pick_best([0.9, 0.1]) == 0


def test_lenet_gradient_and_its_inversion_recovers_the_image():
    torch.manual_seed(0)
    lenet = LeNet((1, 8, 8), 10)
    x = torch.randn(1, 8, 8)
    gradient = [g.detach() for g in prototype_gradient(lenet, x, 3)]
    assert [g.shape for g in gradient] == [p.shape for p in lenet.parameters()]
    assert gradient_distance(gradient, gradient).item() == 0
    image = invert_gradient(lenet, gradient, 3, (1, 8, 8), steps=20)
    assert ((image - x) ** 2).mean().item() < 1e-3
    rough = invert_gradient(lenet, gradient, 3, (1, 8, 8), steps=1)
    assert ((rough - x) ** 2).mean().item() > ((image - x) ** 2).mean().item()
