"""The maths of HGP's hierarchical generative prototypes, on plain tensors.

Salami et al., "Federated Class-Incremental Learning with Hierarchical
Generative Prototypes" (2024). Only the abstract and a summary are available
here (``papers/hgp-summary.txt``); the readings chosen where they leave things
open are stated in each function and pinned by ``tests/test_hgp_gaussian.py``.

Level 1 (client): per class ``c``, the Gaussian N(mu_{m,c}, Sigma_{m,c}) of
client ``m``'s features and its sample count n_{m,c}.
Level 2 (server): per class, the mixture sum_m pi_{m,c} N(mu_{m,c},
Sigma_{m,c}) with pi_{m,c} = n_{m,c} / sum_m' n_{m',c}; the summary phrases
the server step as the distribution closest to the clients' in a
pi-weighted divergence -- the pi-weighted mixture is that distribution's
natural reading (it is the minimiser of sum_m pi_m KL(G_m || Q) over all Q),
as the project's digest proposes, and it is what is sampled here. The
summary's own formula is garbled (it names the JSD but writes
sum_m pi_{m,c} KL(Q~_c || G), G unsubscripted); read literally, KL(Q || G_m)
over Gaussian Q is minimised by one narrower Gaussian (precision
sum_m pi_m Sigma_m^-1), a reading not implemented here. Synthetic features
are drawn class-balanced from the mixtures and the global classifier is
retrained on them ("classifier re-balancing").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

Covariance = Literal["full", "diag"]


@dataclass
class ClassGaussian:
    """One client's statistics for one class: ``count`` samples, their mean
    ``[D]`` and covariance (``[D, D]`` when full, ``[D]`` when diagonal)."""

    count: int
    mean: torch.Tensor
    cov: torch.Tensor

    @property
    def diagonal(self) -> bool:
        return self.cov.dim() == 1

    def scale(self, jitter: float) -> torch.Tensor:
        """:func:`_scale` of the covariance, computed once per object (the
        server re-samples the same Gaussians round after round)."""
        cached = getattr(self, "_scale_cache", None)
        if cached is None or cached[0] != jitter:
            cached = (jitter, _scale(self.cov, jitter))
            self._scale_cache = cached
        return cached[1]

    def __getstate__(self) -> dict:
        """Without the cached factor: a checkpoint, an offloaded client or a
        Ray transfer need not carry a float64 D x D matrix per Gaussian (4.7 MB
        at D = 768); it is computed again when first needed."""
        state = dict(self.__dict__)
        state.pop("_scale_cache", None)
        return state

    def to_payload(self) -> dict:
        return {"count": self.count, "mean": self.mean, "cov": self.cov}

    @classmethod
    def from_payload(cls, payload: dict) -> ClassGaussian:
        return cls(int(payload["count"]), payload["mean"], payload["cov"])


def class_gaussians(
    features: torch.Tensor, labels: torch.Tensor, covariance: Covariance = "full"
) -> dict[int, ClassGaussian]:
    """Per class present in ``labels``: count, mean and covariance of the rows
    of ``features`` ``[N, D]`` with that label (HGP, client side).

    Reading chosen: the unbiased covariance (divide by n - 1, as
    ``torch.cov``), zero for a class with a single sample; ``"diag"`` keeps
    only the per-dimension variances (D numbers instead of D^2 to upload).
    Computed in float64, returned in float32."""
    if covariance not in ("full", "diag"):
        raise ValueError(f"covariance must be full or diag, not {covariance!r}")
    out: dict[int, ClassGaussian] = {}
    feats = features.detach().to(torch.float64)
    for c in sorted(int(v) for v in labels.unique()):
        x = feats[labels == c]
        n = x.shape[0]
        mean = x.mean(0)
        centred = x - mean
        denom = max(n - 1, 1)
        if covariance == "full":
            cov = centred.T @ centred / denom
        else:
            cov = (centred**2).sum(0) / denom
        out[c] = ClassGaussian(n, mean.float(), cov.float())
    return out


def mixture_weights(counts: list[int] | torch.Tensor) -> torch.Tensor:
    """pi_{m,c} = n_{m,c} / sum_m n_{m,c}: each client's share of the class's
    samples (HGP's client-level weights of the class-level mixture)."""
    counts = torch.as_tensor(counts, dtype=torch.float64)
    total = counts.sum()
    if total <= 0:
        raise ValueError("a class mixture needs at least one sample")
    return counts / total


def _full(cov: torch.Tensor) -> torch.Tensor:
    return torch.diag(cov) if cov.dim() == 1 else cov


def mixture_moments(components: list[ClassGaussian]) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and (full) covariance of the mixture sum_m pi_m N(mu_m, Sigma_m):
    mu = sum_m pi_m mu_m, Sigma = sum_m pi_m (Sigma_m + mu_m mu_m^T) - mu mu^T
    (the law of total covariance). What the sampled features should match."""
    pi = mixture_weights([g.count for g in components])
    means = torch.stack([g.mean.to(torch.float64) for g in components])
    mu = (pi[:, None] * means).sum(0)
    second = sum(p * (_full(g.cov).to(torch.float64) + torch.outer(m, m)) for p, g, m in zip(pi, components, means))
    return mu, second - torch.outer(mu, mu)


def _scale(cov: torch.Tensor, jitter: float) -> torch.Tensor:
    """A square root of ``cov`` (``[D]`` std for diagonal, lower-triangular
    factor for full). Sample covariances of fewer points than dimensions are
    singular: ``jitter`` times the mean variance is added to the diagonal, and
    the factor is taken from the eigen-decomposition (clipped at zero) if
    Cholesky still fails."""
    cov = cov.to(torch.float64)
    if cov.dim() == 1:
        return cov.clamp_min(0).sqrt()
    d = cov.shape[0]
    reg = cov + jitter * max(float(cov.diagonal().mean()), 1e-12) * torch.eye(d, dtype=cov.dtype)
    factor, info = torch.linalg.cholesky_ex(reg)
    if int(info) == 0:
        return factor
    vals, vecs = torch.linalg.eigh(reg)
    return vecs * vals.clamp_min(0).sqrt()


def sample_mixture(
    components: list[ClassGaussian], num: int, generator: torch.Generator | None = None, jitter: float = 1e-4
) -> torch.Tensor:
    """``num`` draws ``[num, D]`` from sum_m pi_m N(mu_m, Sigma_m): the
    component of each draw is picked with probability pi_m (ancestral
    sampling), then x = mu_m + A_m z with A_m A_m^T = Sigma_m, z ~ N(0, I)."""
    pi = mixture_weights([g.count for g in components])
    which = torch.multinomial(pi, num, replacement=True, generator=generator)
    d = components[0].mean.shape[0]
    out = torch.empty(num, d, dtype=torch.float64)
    for m, g in enumerate(components):
        rows = (which == m).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        z = torch.randn(rows.numel(), d, dtype=torch.float64, generator=generator)
        scale = g.scale(jitter)
        noise = z * scale if scale.dim() == 1 else z @ scale.T
        out[rows] = g.mean.to(torch.float64) + noise
    return out.float()


def balanced_synthetic_set(
    mixtures: dict[int, list[ClassGaussian]],
    per_class: int,
    generator: torch.Generator | None = None,
    jitter: float = 1e-4,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``per_class`` synthetic features for every class in ``mixtures``
    (class id -> its clients' Gaussians): the class-balanced set HGP retrains
    the classifier on. Returns ``(features [K*per_class, D], labels)``."""
    xs, ys = [], []
    for c in sorted(mixtures):
        xs.append(sample_mixture(mixtures[c], per_class, generator, jitter))
        ys.append(torch.full((per_class,), c, dtype=torch.int64))
    return torch.cat(xs), torch.cat(ys)


def retrain_classifier(
    classifier: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    *,
    epochs: int,
    lr: float,
    batch_size: int = 64,
    generator: torch.Generator | None = None,
) -> float:
    """Classifier re-balancing: a few epochs of SGD (momentum 0.9) with
    cross-entropy on the synthetic features, starting from the current
    (FedAvg-ed) classifier. Returns the mean loss of the last epoch."""
    params = [p for p in classifier.parameters()]
    device = params[0].device
    optimizer = torch.optim.SGD(params, lr=lr, momentum=0.9)
    features, labels = features.to(device), labels.to(device)
    was_training = classifier.training
    classifier.train()
    last = 0.0
    for _ in range(epochs):
        order = torch.randperm(len(labels), generator=generator).to(device)
        total, steps = 0.0, 0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            loss = nn.functional.cross_entropy(classifier(features[idx]), labels[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach())
            steps += 1
        last = total / max(steps, 1)
    classifier.train(was_training)
    return last
