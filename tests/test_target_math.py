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
    blend_statistics,
    bn_statistics_loss,
    crop_and_flip,
    forward_with_bn_loss,
    generator_loss,
    kd_kl,
    keep_lower,
    restricted_cross_entropy,
    synthesize,
    synthesize_as_code,
    update_momentum,
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


def test_crop_and_flip_moves_pixels_and_passes_gradients():
    """Every output image is its input shifted by at most the padding (zeros
    coming in) and maybe mirrored; gradients reach the input."""
    torch.manual_seed(0)
    x = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6) + 1
    x.requires_grad_(True)
    out = crop_and_flip(x, padding=2)
    assert out.shape == x.shape
    padded = torch.nn.functional.pad(x.detach(), (2, 2, 2, 2))
    for i in range(2):
        found = [
            (dy, dx, flip)
            for dy in range(5)
            for dx in range(5)
            for flip in (False, True)
            if torch.equal(
                out[i].detach(),
                (padded[i, :, dy : dy + 6, dx : dx + 6].flip(-1) if flip else padded[i, :, dy : dy + 6, dx : dx + 6]),
            )
        ]
        assert found, i
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_bn_momentum_blends_the_earlier_batches_statistics():
    """blend_statistics and update_momentum against hand-computed values:
    the first batch alone, then 0.1 x this batch + 0.9 x the average."""
    rm, rv = torch.zeros(2), torch.ones(2)
    first = [(torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0]), rm, rv)]
    assert blend_statistics(first, None, 0.9) == first
    earlier = update_momentum(first, None, 0.9)
    assert torch.equal(earlier[0][0], torch.tensor([1.0, 2.0]))
    second = [(torch.tensor([11.0, 12.0]), torch.tensor([13.0, 14.0]), rm, rv)]
    ((mean, var, _, _),) = blend_statistics(second, earlier, 0.9)
    assert torch.allclose(mean, torch.tensor([2.0, 3.0])) and torch.allclose(var, torch.tensor([4.0, 5.0]))
    later = update_momentum(second, earlier, 0.9)
    assert torch.allclose(later[0][1], torch.tensor([4.0, 5.0]))


def test_synthesize_as_code_keeps_the_best_step_and_meta_learns_the_generator():
    """The code's synthesis: normalised images of the learned classes; the
    generator itself moves (its meta step) and more steps lower the loss; a
    batch's images are the generator's output at a step (before that step's
    update: with one step, its first output)."""
    torch.manual_seed(0)
    teacher = tiny_bn_model()
    teacher.train()
    with torch.no_grad():
        teacher(torch.randn(64, 1, 8, 8) * 3 + 1)
    generator = Generator((1, 8, 8), noise_dim=8, width=8, output="sigmoid")
    start = {k: v.clone() for k, v in generator.state_dict().items()}

    def run(steps, size=24, lr=0.05):
        torch.manual_seed(1)
        g = Generator((1, 8, 8), noise_dim=8, width=8, output="sigmoid")
        g.load_state_dict(start)
        out = synthesize_as_code(
            teacher,
            g,
            [0, 2],
            steps=steps,
            batch_size=8,
            size=size,
            lr_generator=lr,
            lr_noise=0.05,
            ce_weight=0.5,
            bn_weight=10.0,
            bn_momentum=0.9,
            mean=(0.5,),
            std=(0.25,),
            device=torch.device("cpu"),
        )
        return g, out

    g, (images, labels, first) = run(1)
    assert images.shape == (24, 1, 8, 8) and set(labels.tolist()) <= {0, 2}
    assert images.min() >= (0 - 0.5) / 0.25 - 1e-6 and images.max() <= (1 - 0.5) / 0.25 + 1e-6  # sigmoid, normalised
    assert any(not torch.equal(start[k], v) for k, v in g.state_dict().items())  # the meta step moved it
    _, (_, _, later) = run(20)
    assert later["bn"] < first["bn"]
    # one step: the kept images are the generator's first output (before its step), normalised
    g, (images, _, _) = run(1, size=8)
    torch.manual_seed(1)
    fresh = Generator((1, 8, 8), noise_dim=8, width=8, output="sigmoid")  # as run() makes it: the same draws
    fresh.load_state_dict(start)
    z = torch.randn(8, 8)
    with torch.no_grad():
        assert torch.allclose(images, (fresh.train()(z) - 0.5) / 0.25, atol=1e-6)


def test_keep_lower_keeps_the_lowest_loss_step():
    best, loss = torch.zeros(2, 3), torch.full((), float("inf"))
    best, loss = keep_lower(best, loss, torch.ones(2, 3), torch.tensor(5.0))
    best, loss = keep_lower(best, loss, torch.full((2, 3), 2.0), torch.tensor(7.0))  # worse: not kept
    assert torch.equal(best, torch.ones(2, 3)) and float(loss) == 5.0
    best, loss = keep_lower(best, loss, torch.full((2, 3), 3.0), torch.tensor(4.0))
    assert torch.equal(best, torch.full((2, 3), 3.0)) and float(loss) == 4.0
