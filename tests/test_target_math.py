"""TARGET's maths against values worked out by hand (fedaval.plugins.target_math)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedaval.plugins.target_math import (
    Generator,
    adversarial_loss,
    batch_statistics,
    bn_statistics_loss,
    forward_with_bn_loss,
    generator_loss,
    kd_kl,
    restricted_cross_entropy,
    synthesize,
)


def test_restricted_cross_entropy_uses_only_the_given_columns():
    logits = torch.tensor([[1.0, 2.0, 0.0, 3.0]])
    # softmax over columns 1 and 3 only: -log(e^2 / (e^2 + e^3)) = log(1 + e)
    assert restricted_cross_entropy(logits, torch.tensor([1]), [1, 3]).item() == pytest.approx(math.log(1 + math.e))
    with pytest.raises(ValueError):
        restricted_cross_entropy(logits, torch.tensor([0]), [1, 3])


def test_kd_kl_by_hand():
    teacher = torch.tensor([[0.0, 0.0]])  # (1/2, 1/2)
    student = torch.tensor([[math.log(3.0), 0.0]])  # (3/4, 1/4)
    # KL(u || s) = 1/2 log(2/3) + 1/2 log 2 = 1/2 log(4/3)
    assert kd_kl(student, teacher, 1.0).item() == pytest.approx(0.5 * math.log(4 / 3))
    # T = 2 halves the logits: student 2 log 3 -> log 3, same distributions
    assert kd_kl(2 * student, teacher, 2.0).item() == pytest.approx(0.5 * math.log(4 / 3))


def test_bn_statistics_loss_by_hand():
    one = (torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0]), torch.tensor([2.0, 1.0]))
    # ||(0, 2)|| + ||(-1, 0)|| = 3
    assert bn_statistics_loss([one]).item() == pytest.approx(3.0)
    assert bn_statistics_loss([one, one]).item() == pytest.approx(6.0)
    with pytest.raises(ValueError):
        bn_statistics_loss([])


def test_batch_statistics_are_biased_per_channel():
    mean, var = batch_statistics(torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    assert mean.tolist() == [2.0, 4.0] and var.tolist() == [1.0, 4.0]
    images = torch.zeros(2, 1, 2, 2)
    images[1] = 2.0  # channel values: four 0s, four 2s
    mean, var = batch_statistics(images)
    assert mean.tolist() == [1.0] and var.tolist() == [1.0]


def test_bn_loss_of_a_tiny_model_by_hand():
    bn = nn.BatchNorm1d(2)
    bn.running_mean.copy_(torch.tensor([1.0, 0.0]))
    bn.running_var.copy_(torch.tensor([2.0, 1.0]))
    model = nn.Sequential(bn, nn.Linear(2, 2)).eval()
    out, loss = forward_with_bn_loss(model, torch.tensor([[1.0, 2.0], [3.0, 6.0]]))
    # batch mean (2, 4), variance (1, 4): ||(1, 4)|| + ||(-1, 3)||
    assert loss.item() == pytest.approx(math.sqrt(17) + math.sqrt(10))
    assert out.shape == (2, 2)
    with pytest.raises(ValueError):
        forward_with_bn_loss(nn.Linear(2, 2), torch.zeros(2, 2))


def test_adversarial_loss_counts_only_samples_where_teacher_and_student_agree():
    teacher = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(3.0)]])  # (3/4, 1/4), (1/4, 3/4)
    student = torch.zeros(2, 2)  # (1/2, 1/2), argmax 0: agrees with sample 0 only
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert adversarial_loss(teacher, student, 1.0).item() == pytest.approx(-kl / 2)


def test_generator_loss_weights():
    assert generator_loss(torch.tensor(1.0), torch.tensor(3.0), torch.tensor(-1.0), 2.0, 0.5).item() == 6.5


def tiny_bn_model(classes=3):
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, classes),
    )


def test_generator_shapes():
    for shape in [(1, 8, 8), (3, 32, 32), (3, 10, 6)]:
        out = Generator(shape, noise_dim=8, width=4)(torch.randn(5, 8))
        assert out.shape == (5, *shape)


def test_synthesize_makes_the_set_and_lowers_the_generator_loss():
    torch.manual_seed(0)
    teacher = tiny_bn_model()
    teacher.train()
    with torch.no_grad():  # running statistics far from what a fresh generator gives
        teacher(torch.randn(64, 1, 8, 8) * 3 + 1)
    generator = Generator((1, 8, 8), noise_dim=8, width=8)

    def run(steps):
        torch.manual_seed(1)
        g = Generator((1, 8, 8), noise_dim=8, width=8)
        g.load_state_dict(generator.state_dict())
        return synthesize(
            teacher,
            tiny_bn_model(),
            g,
            [0, 2],
            steps=steps,
            batch_size=8,
            size=12,
            lr_generator=0.05,
            lr_student=0.01,
            bn_weight=1.0,
            adv_weight=1.0,
            temperature=2.0,
            device=torch.device("cpu"),
        )

    images, labels, first = run(1)
    assert images.shape == (12, 1, 8, 8) and set(labels.tolist()) <= {0, 2}
    _, _, later = run(30)
    assert later["bn"] < first["bn"] and later["ce"] < first["ce"]
