"""HGP's maths against hand-computed values: class Gaussians, mixture weights
and moments, sampling, re-balancing, and prefix attention."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedaval.plugins.hgp_backbones import prefix_attention
from fedaval.plugins.hgp_gaussian import (
    ClassGaussian,
    balanced_synthetic_set,
    class_gaussians,
    mixture_moments,
    mixture_weights,
    retrain_classifier,
    sample_mixture,
)

FEATURES = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 0.0], [7.0, 7.0]])
LABELS = torch.tensor([0, 0, 0, 1])


def test_class_gaussians_full_covariance_by_hand():
    stats = class_gaussians(FEATURES, LABELS, "full")
    assert sorted(stats) == [0, 1]
    g = stats[0]
    # mean (1+3+5)/3, (2+4+0)/3; centred rows (-2,0), (0,2), (2,-2); divide by n-1 = 2
    assert g.count == 3
    assert torch.allclose(g.mean, torch.tensor([3.0, 2.0]))
    assert torch.allclose(g.cov, torch.tensor([[4.0, -2.0], [-2.0, 4.0]]))
    assert torch.allclose(g.cov, torch.cov(FEATURES[:3].T))  # the unbiased reading
    # a single sample: its own mean, zero covariance
    assert stats[1].count == 1
    assert torch.allclose(stats[1].mean, torch.tensor([7.0, 7.0]))
    assert torch.equal(stats[1].cov, torch.zeros(2, 2))


def test_class_gaussians_diagonal_keeps_the_variances_only():
    g = class_gaussians(FEATURES, LABELS, "diag")[0]
    assert g.diagonal and g.cov.shape == (2,)
    assert torch.allclose(g.cov, torch.tensor([4.0, 4.0]))
    with pytest.raises(ValueError):
        class_gaussians(FEATURES, LABELS, "spherical")


def test_mixture_weights_are_sample_shares():
    assert torch.allclose(mixture_weights([30, 10]), torch.tensor([0.75, 0.25], dtype=torch.float64))
    assert torch.allclose(mixture_weights([5]), torch.tensor([1.0], dtype=torch.float64))
    with pytest.raises(ValueError):
        mixture_weights([0, 0])


def test_mixture_moments_by_hand():
    a = ClassGaussian(3, torch.tensor([0.0, 0.0]), torch.eye(2))
    b = ClassGaussian(1, torch.tensor([4.0, 0.0]), torch.tensor([2.0, 2.0]))  # diagonal
    mu, cov = mixture_moments([a, b])
    # pi = (.75, .25); mu = (1, 0)
    # E[xx^T] = .75 I + .25 (2I + [[16,0],[0,0]]) = [[5.25,0],[0,1.25]]; minus mu mu^T
    assert torch.allclose(mu, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert torch.allclose(cov, torch.tensor([[4.25, 0.0], [0.0, 1.25]], dtype=torch.float64))


def test_samples_match_the_mixture_mean_and_covariance():
    a = ClassGaussian(
        60, torch.tensor([1.0, -2.0, 0.5]), torch.tensor([[2.0, 0.8, 0.0], [0.8, 1.0, 0.3], [0.0, 0.3, 0.5]])
    )
    b = ClassGaussian(20, torch.tensor([-3.0, 1.0, 2.0]), torch.tensor([0.5, 0.2, 1.5]))
    mu, cov = mixture_moments([a, b])
    gen = torch.Generator().manual_seed(0)
    x = sample_mixture([a, b], 100_000, gen, jitter=0.0).double()
    assert x.shape == (100_000, 3)
    assert torch.allclose(x.mean(0), mu, atol=0.03)
    assert torch.allclose(torch.cov(x.T), cov, atol=0.06)

    # the component shares pi = (.75, .25), seen through P(x0 < -1) = sum_m pi_m Phi((-1 - mu_m0) / sigma_m0)
    def phi(z):
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    expected = 0.75 * phi((-1 - 1) / math.sqrt(2.0)) + 0.25 * phi((-1 + 3) / math.sqrt(0.5))
    assert abs(float((x[:, 0] < -1).double().mean()) - expected) < 0.01


def test_sampling_a_singular_covariance_stays_finite_and_on_its_subspace():
    # rank-1 covariance, as from 2 samples in 3 dimensions
    g = class_gaussians(torch.tensor([[0.0, 0.0, 0.0], [2.0, 2.0, 0.0]]), torch.tensor([0, 0]), "full")[0]
    x = sample_mixture([g], 20_000, torch.Generator().manual_seed(1), jitter=1e-6)
    assert torch.isfinite(x).all()
    assert torch.allclose(x.mean(0), g.mean, atol=0.05)
    assert float((x[:, 0] - x[:, 1]).abs().max()) < 0.05  # spread only along (1, 1, 0)


def test_balanced_synthetic_set_has_the_same_count_per_class():
    mixtures = {
        3: [ClassGaussian(500, torch.zeros(2), torch.ones(2))],
        7: [ClassGaussian(2, torch.ones(2), torch.ones(2)), ClassGaussian(1, -torch.ones(2), torch.ones(2))],
    }
    x, y = balanced_synthetic_set(mixtures, 40, torch.Generator().manual_seed(0))
    assert x.shape == (80, 2)
    assert torch.bincount(y).tolist()[3] == 40 and torch.bincount(y).tolist()[7] == 40


def test_retraining_on_balanced_synthetic_features_removes_a_classifier_bias():
    torch.manual_seed(0)
    mixtures = {
        0: [ClassGaussian(900, torch.tensor([2.0, 0.0]), torch.tensor([0.3, 0.3]))],
        1: [ClassGaussian(10, torch.tensor([-2.0, 0.0]), torch.tensor([0.3, 0.3]))],
    }
    clf = nn.Linear(2, 2)
    with torch.no_grad():  # a classifier biased to class 0, as after local training on class-0-heavy clients
        clf.weight.zero_()
        clf.bias.copy_(torch.tensor([10.0, 0.0]))
    gen = torch.Generator().manual_seed(0)
    test_x, test_y = balanced_synthetic_set(mixtures, 200, gen)
    assert float((clf(test_x).argmax(1) == test_y).float().mean()) == 0.5
    x, y = balanced_synthetic_set(mixtures, 256, gen)
    retrain_classifier(clf, x, y, epochs=10, lr=0.1, batch_size=128, generator=gen)
    pred = clf(test_x).argmax(1)
    assert float((pred[test_y == 1] == 1).float().mean()) > 0.95
    assert float((pred[test_y == 0] == 0).float().mean()) > 0.95


def test_prefix_attention_without_prompts_is_plain_attention():
    torch.manual_seed(0)
    attn = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(3, 5, 8)
    empty = torch.zeros(0, 8)
    expected, _ = attn(x, x, x, need_weights=False)
    assert torch.allclose(prefix_attention(x, attn, empty, empty), expected, atol=1e-6)


def test_prefix_attention_by_hand():
    # one head, D=2, identity projections: q = k = v = x
    attn = nn.MultiheadAttention(2, 1, batch_first=True)
    with torch.no_grad():
        attn.in_proj_weight.copy_(torch.cat([torch.eye(2)] * 3))
        attn.in_proj_bias.zero_()
        attn.out_proj.weight.copy_(torch.eye(2))
        attn.out_proj.bias.zero_()
    x = torch.tensor([[[1.0, 0.0]]])
    pk, pv = torch.tensor([[0.0, 0.0]]), torch.tensor([[2.0, 2.0]])
    # scores: prefix q.pk = 0, token q.x = 1; both / sqrt(2)
    w = torch.softmax(torch.tensor([0.0, 1.0 / math.sqrt(2)]), 0)
    expected = w[0] * torch.tensor([2.0, 2.0]) + w[1] * torch.tensor([1.0, 0.0])
    assert torch.allclose(prefix_attention(x, attn, pk, pv)[0, 0], expected, atol=1e-6)


def test_a_pickled_gaussian_leaves_its_cached_factor_behind():
    """The float64 factor is cached for sampling but not carried by a
    checkpoint, an offloaded client or a Ray transfer; it is made again."""
    import pickle

    from fedaval.plugins.hgp_gaussian import ClassGaussian

    g = ClassGaussian(count=5, mean=torch.zeros(4), cov=torch.eye(4) * 2.0)
    factor = g.scale(1e-4)
    assert g._scale_cache is not None
    copy = pickle.loads(pickle.dumps(g))
    assert not hasattr(copy, "_scale_cache")
    assert torch.equal(copy.cov, g.cov) and torch.allclose(copy.scale(1e-4), factor)
