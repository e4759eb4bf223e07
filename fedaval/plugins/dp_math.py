"""Client-level differential privacy: the maths of :mod:`fedaval.plugins.dp`,
plain functions on tensors.

* :func:`clip_and_noise`: the Gaussian mechanism of DP-FedAvg (McMahan, Ramage,
  Talwar, Zhang, "Learning Differentially Private Recurrent Language Models",
  ICLR 2018, Algorithm 1 with the flat clipping of its Eq. "pi(Delta, S)"):
  the client's whole upload, seen as one vector ``v``, is scaled to
  ``v * min(1, C / ||v||_2)`` and every coordinate gets independent
  ``N(0, (z C)^2)`` noise, ``z`` the noise multiplier.
* :func:`epsilon`: the privacy spent, by Opacus's Renyi-DP accountant
  (:class:`opacus.accountants.RDPAccountant`: the RDP of the sampled Gaussian
  mechanism, Mironov, Talwar, Zhang 2019, converted to (epsilon, delta) by
  Balle et al. 2020, Theorem 21).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def float_tensors(payload: Any) -> Iterator[torch.Tensor]:
    """Every floating-point tensor in ``payload`` (nested dicts, lists,
    tuples), in a fixed order (dict insertion order, list order); a Python
    ``float`` is one too (a float64 scalar tensor)."""
    if isinstance(payload, torch.Tensor):
        if payload.is_floating_point():
            yield payload
    elif isinstance(payload, float):
        yield torch.tensor(payload, dtype=torch.float64)
    elif isinstance(payload, dict):
        for value in payload.values():
            yield from float_tensors(value)
    elif isinstance(payload, (list, tuple)):
        for value in payload:
            yield from float_tensors(value)


def replace_float_tensors(payload: Any, new: Iterator[torch.Tensor]) -> Any:
    """A copy of ``payload`` with its floating-point tensors replaced, in
    :func:`float_tensors` order, by the tensors ``new`` yields; everything
    else (integers, booleans, integer tensors) is kept."""
    if isinstance(payload, torch.Tensor):
        return next(new) if payload.is_floating_point() else payload
    if isinstance(payload, float):
        return float(next(new))
    if isinstance(payload, dict):
        return {key: replace_float_tensors(value, new) for key, value in payload.items()}
    if isinstance(payload, (list, tuple)):
        return type(payload)(replace_float_tensors(value, new) for value in payload)
    return payload


def global_norm(tensors: list[torch.Tensor]) -> float:
    """``||v||_2`` of the concatenation of ``tensors`` (computed in float64)."""
    if not tensors:
        return 0.0
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total = total + (t.detach().to(torch.float64) ** 2).sum().cpu()
    return float(torch.sqrt(total))


def clip_and_noise(
    tensors: list[torch.Tensor], clip: float, noise_multiplier: float
) -> tuple[list[torch.Tensor], float]:
    """The Gaussian mechanism on one client's upload.

    ``tensors`` together are one vector ``v``; returns ``(v * min(1, clip /
    ||v||) + N(0, (noise_multiplier * clip)^2 I)`` split back into tensors of
    the same shapes and dtypes, ``||v||`` before clipping)``. The noise is
    drawn with ``torch.randn`` from the current global stream of each
    tensor's device (inside a client's round: the client's own stream), one
    tensor after the other in the given order."""
    norm = global_norm(tensors)
    scale = min(1.0, clip / norm) if norm > 0 else 1.0
    std = noise_multiplier * clip
    out = []
    for t in tensors:
        clipped = t.detach() * scale
        if std > 0:
            clipped = clipped + torch.randn(t.shape, device=t.device, dtype=t.dtype) * std
        out.append(clipped)
    return out, norm


def sample_rate(sampled: int, eligible: int) -> float:
    """The accountant's ``q`` for a round: the fraction of the clients that
    could be sampled (``eligible``) that were (``sampled``; 0 means all)."""
    if eligible <= 0:
        return 1.0
    per_round = sampled if 0 < sampled < eligible else eligible
    return per_round / eligible


def epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at ``delta`` after the rounds in ``history``, a list of
    ``(noise_multiplier, sample_rate, rounds)`` (Opacus's RDP accountant
    history). ``inf`` without noise; ``0.0`` before any round."""
    if not history:
        return 0.0
    if any(z <= 0 for z, _, _ in history):
        return float("inf")
    import warnings

    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(float(z), float(q), int(n)) for z, q, n in history]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha": a large epsilon, still a bound
        return float(accountant.get_epsilon(delta))
