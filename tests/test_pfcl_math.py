"""PFCL's maths against numbers worked out by hand (Zhang et al. 2024)."""

from __future__ import annotations

import math

import pytest
import torch

from fedaval.plugins.pfcl_math import (
    NO_PROTOTYPE,
    class_means,
    distillation_loss,
    fuse_prototypes,
    library_logits,
    memory_quota,
    prototype_regulariser,
    select_exemplars,
    temperature_softmax,
    update_library,
)


def test_distance_softmax_eq_11():
    # f(x) = (0, 0); p_1 = (3, 4) at distance 5, p_4 = (0, 1) at distance 1; T = 2.
    features = torch.tensor([[0.0, 0.0]])
    library = {1: torch.tensor([3.0, 4.0]), 4: torch.tensor([0.0, 1.0])}
    logits = library_logits(features, library, num_classes=5, temperature=2.0)
    assert logits[0, 1].item() == pytest.approx(-2.5)
    assert logits[0, 4].item() == pytest.approx(-0.5)
    for c in (0, 2, 3):  # no prototype: never predicted, probability 0
        assert logits[0, c].item() == NO_PROTOTYPE
    p = torch.softmax(logits, -1)[0]
    # p(4|x) = e^-0.5 / (e^-0.5 + e^-2.5) = 1 / (1 + e^-2)
    assert p[4].item() == pytest.approx(1 / (1 + math.exp(-2.0)))
    assert p[1].item() == pytest.approx(math.exp(-2.0) / (1 + math.exp(-2.0)))
    assert p[[0, 2, 3]].sum().item() == 0.0
    assert logits.argmax(-1).item() == 4  # nearest prototype, Eq. (3)


def test_cross_entropy_on_distance_logits_is_l_c_and_has_finite_gradient():
    features = torch.tensor([[0.0, 0.0]], requires_grad=True)
    library = {0: torch.tensor([0.0, 0.0]), 1: torch.tensor([0.0, 2.0])}  # feature sits on p_0
    logits = library_logits(features, library, num_classes=3, temperature=1.0)
    loss = torch.nn.functional.cross_entropy(logits, torch.tensor([0]))
    # -log(e^0 / (e^0 + e^-2))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-2.0)), abs=1e-5)
    loss.backward()
    assert torch.isfinite(features.grad).all()


def test_temperature_softmax_eq_7():
    q = temperature_softmax(torch.tensor([2.0, 0.0]), 2.0)
    assert q[0].item() == pytest.approx(math.e / (math.e + 1))


def test_distillation_target_at_temperature_t():
    # Teacher: feature (0,0), old prototypes at distances 2 and 4 -> y = softmax(-1, -2) at T = 2.
    teacher_f = torch.tensor([[0.0, 0.0]])
    teacher_p = torch.tensor([[2.0, 0.0], [0.0, 4.0]])
    # Student: distances 1 and 1 -> y^ = (1/2, 1/2).
    student_f = torch.tensor([[0.0, 0.0]], requires_grad=True)
    student_p = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    loss = distillation_loss(student_f, student_p, teacher_f, teacher_p, temperature=2.0)
    y0 = 1 / (1 + math.exp(-1.0))
    # -(y0 log 1/2 + (1 - y0) log 1/2) = log 2 whatever y
    assert loss.item() == pytest.approx(math.log(2.0), abs=1e-6)
    # student distances 1 and 3 -> y^ = softmax(-0.5, -1.5) = (1/(1+e^-1), e^-1/(1+e^-1))
    student_p = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    loss = distillation_loss(student_f, student_p, teacher_f, teacher_p, temperature=2.0)
    yhat0 = 1 / (1 + math.exp(-1.0))
    expected = -(y0 * math.log(yhat0) + (1 - y0) * math.log(1 - yhat0))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    # the temperature divides the distance once: at T = 1 the target is softmax(-2, -4)
    loss_t1 = distillation_loss(student_f, student_p, teacher_f, teacher_p, temperature=1.0)
    y0_t1 = 1 / (1 + math.exp(-2.0))
    yhat0_t1 = 1 / (1 + math.exp(-2.0))
    expected_t1 = -(y0_t1 * math.log(yhat0_t1) + (1 - y0_t1) * math.log(1 - yhat0_t1))
    assert loss_t1.item() == pytest.approx(expected_t1, abs=1e-6)
    loss.backward()
    assert student_f.grad is not None


def test_prototype_regulariser_eq_5_uses_batch_class_means():
    features = torch.tensor([[0.0, 0.0], [2.0, 0.0], [5.0, 5.0], [9.0, 9.0]], requires_grad=True)
    labels = torch.tensor([0, 0, 1, 2])
    global_library = {0: torch.tensor([1.0, 3.0]), 1: torch.tensor([5.0, 6.0])}  # class 2 has none
    # class 0 mean (1, 0) -> distance 3; class 1 mean (5, 5) -> distance 1; class 2 skipped
    loss = prototype_regulariser(features, labels, global_library)
    assert loss.item() == pytest.approx(4.0)
    loss.backward()
    assert features.grad[3].abs().sum().item() == 0.0
    empty = prototype_regulariser(features, labels, {})
    assert empty.item() == 0.0 and empty.requires_grad


def test_server_averages_per_class_over_clients_that_have_it():
    a = {0: torch.tensor([1.0, 1.0]), 3: torch.tensor([4.0, 0.0])}
    b = {0: torch.tensor([3.0, 5.0])}
    c = {0: torch.tensor([2.0, 0.0]), 7: torch.tensor([0.0, 9.0])}
    fused = fuse_prototypes([a, b, c])
    assert torch.equal(fused[0], torch.tensor([2.0, 2.0]))  # (1+3+2)/3, (1+5+0)/3
    assert torch.equal(fused[3], torch.tensor([4.0, 0.0]))  # one holder: its own prototype
    assert torch.equal(fused[7], torch.tensor([0.0, 9.0]))
    # the library grows and keeps classes nobody uploaded this round
    library = update_library({5: torch.tensor([1.0, 2.0]), 0: torch.tensor([9.0, 9.0])}, fused)
    assert sorted(library) == [0, 3, 5, 7]
    assert torch.equal(library[5], torch.tensor([1.0, 2.0]))
    assert torch.equal(library[0], torch.tensor([2.0, 2.0]))


def test_class_means_eq_2():
    means = class_means(torch.tensor([[1.0], [3.0], [10.0]]), torch.tensor([4, 4, 1]))
    assert means[4].item() == 2.0 and means[1].item() == 10.0


def test_memory_quota_both_policies():
    assert memory_quota("per-class", 3, per_class=5, total=100) == 5
    assert memory_quota("per-class", 30, per_class=5, total=100) == 5  # grows with the classes
    assert memory_quota("total", 3, per_class=5, total=10) == 3  # 10 // 3, shrinks with the classes
    assert memory_quota("total", 5, per_class=5, total=10) == 2
    assert memory_quota("none", 5, per_class=5, total=10) == 0


def test_exemplars_nearest_to_their_class_prototype_eq_9():
    # 1-d features; class 0 prototype 0.0, class 1 prototype 10.0
    features = torch.tensor([[3.0], [-1.0], [0.5], [10.0], [14.0], [2.0], [9.0], [-0.5]])
    labels = torch.tensor([0, 0, 0, 1, 1, 0, 1, 0])
    library = {0: torch.tensor([0.0]), 1: torch.tensor([10.0])}
    # per-class policy, 2 each: class 0 distances 3, 1, .5, 2, .5 -> indices 2 and 7 (tie: lower index
    # first) ; class 1 distances 0, 4, 1 -> indices 3 and 6
    quota = memory_quota("per-class", len(library), per_class=2, total=0)
    assert select_exemplars(features, labels, library, quota).tolist() == [2, 3, 6, 7]
    # fixed-total policy, 3 in all over 2 classes -> 1 each: index 2 (tie with 7, lower first) and 3
    quota = memory_quota("total", len(library), per_class=0, total=3)
    assert select_exemplars(features, labels, library, quota).tolist() == [2, 3]
    # quota 4: class 0 drops its farthest sample (index 0, distance 3); class 1 (3 samples) keeps all
    assert select_exemplars(features, labels, library, 4).tolist() == [1, 2, 3, 4, 5, 6, 7]
