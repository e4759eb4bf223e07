"""FedWeIT's maths (Yoon et al., ICML 2021): the decomposed weight, the
sparse payloads, the server's fusion of sparse bases, and the two
regularisers. Plain functions on tensors (tested against hand-computed
values in ``tests/test_fedweit_math.py``), plus the two decomposed layers and
:func:`decompose`, which turns the Linear and Conv2d layers of a fedaval model
into them. The hook glue is :mod:`fedaval.plugins.fedweit`.

Notation (paper, Section 3.2, Eq. 1): for client c at task t, each layer's
weight is

    theta_c^(t) = B_c * m_c^(t) + A_c^(t) + sum_j alpha_j^(t) A_j

with B_c the base shared with the server, m_c^(t) a vector mask over the
layer's output units (broadcast over the other dimensions), A_c^(t) the
task-adaptive parameters and A_j the knowledge base (other clients'
task-adaptive parameters) weighted by the learnable attention alpha^(t).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

Sparse = tuple[torch.Tensor, torch.Tensor]  # (flat int32 indices, values): what goes on the wire


def unit_view(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``vector`` (one value per output unit, dim 0 of ``like``) shaped to broadcast over ``like``."""
    return vector.reshape(-1, *([1] * (like.dim() - 1)))


def effective_weight(
    base: torch.Tensor,
    mask: torch.Tensor,
    adaptive: torch.Tensor,
    kb: torch.Tensor | None = None,
    alpha: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eq. (1): ``base * mask + adaptive + sum_j alpha_j kb_j``.

    ``mask`` has one entry per output unit (``base.shape[0]``); ``kb`` is
    ``[K, *base.shape]`` (K other clients' task-adaptive parameters) and
    ``alpha`` ``[K]``; both may be ``None`` or have K = 0."""
    theta = base * unit_view(mask, base) + adaptive
    if kb is not None and alpha is not None and kb.shape[0] > 0:
        theta = theta + torch.einsum("k,k...->...", alpha, kb)
    return theta


def top_fraction(values: torch.Tensor, fraction: float) -> Sparse:
    """The ``ceil(fraction * numel)`` entries of largest magnitude (at least
    one; ties by position): their flat indices (int32, sorted) and values."""
    flat = values.detach().reshape(-1)
    keep = max(1, min(flat.numel(), math.ceil(fraction * flat.numel())))
    idx = torch.topk(flat.abs(), keep, sorted=False).indices.sort().values
    return idx.to(torch.int32), flat[idx].clone()


def masked_base(base: torch.Tensor, mask: torch.Tensor, fraction: float) -> Sparse:
    """The sparse base a client uploads: the ``ceil(fraction * units)``
    output units of largest ``|mask|`` (their int32 indices, sorted) and the
    base's rows of those units (``[k, *base.shape[1:]]``). The mask decides
    *which* part of the base is sent; the values are the base's own (the
    official code's ``sw * hard_threshold``), so the server averages bases,
    not bases scaled by each client's mask. One index per unit, not per
    entry: the whole row of a kept unit is sent."""
    units, _ = top_fraction(mask, fraction)
    return units, base.detach()[units.to(torch.int64)].clone()


def unit_entries(payload: Sparse, shape: Sequence[int]) -> Sparse:
    """A :func:`masked_base` payload as flat entry indices (int64) and values,
    for :func:`fuse_sparse`."""
    units, rows = payload
    per_unit = math.prod(shape[1:])
    offsets = torch.arange(per_unit, dtype=torch.int64, device=rows.device)
    idx = (units.to(torch.int64).to(rows.device).unsqueeze(1) * per_unit + offsets).reshape(-1)
    return idx, rows.reshape(-1)


def to_dense(sparse: Sparse, shape: Sequence[int], dtype=torch.float32) -> torch.Tensor:
    """The dense tensor of ``shape`` with ``sparse``'s values, zeros elsewhere."""
    idx, val = sparse
    out = torch.zeros(math.prod(shape), dtype=dtype, device=val.device)
    out[idx.to(torch.int64)] = val.to(dtype)
    return out.reshape(*shape)


def fuse_sparse(previous: torch.Tensor, payloads: Sequence[Sparse], weights: Sequence[float]) -> torch.Tensor:
    """The server's new base (Algorithm 1, server side): each entry is the
    ``weights``-weighted mean of the values the clients sent for it; an entry
    no client sent keeps its ``previous`` value. (Reading: the mean is over the
    senders of each entry, as the official code normalises by the summed
    masks, so unsent entries do not pull the base towards zero.)"""
    total = torch.zeros(previous.numel(), dtype=torch.float64, device=previous.device)
    count = torch.zeros_like(total)
    for (idx, val), w in zip(payloads, weights):
        i = idx.to(torch.int64).to(previous.device)
        total.index_add_(0, i, val.to(torch.float64).to(previous.device) * float(w))
        count.index_add_(0, i, torch.full((i.numel(),), float(w), dtype=torch.float64, device=previous.device))
    sent = count > 0
    out = previous.detach().reshape(-1).to(torch.float64).clone()
    out[sent] = total[sent] / count[sent]
    return out.to(previous.dtype).reshape(previous.shape)


def l1_norm(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_l ||t_l||_1`` over the layers: Eq. (2)'s sparsity term of the
    masks or of the task-adaptive parameters (each weight is the caller's)."""
    return torch.stack([t.abs().sum() for t in tensors]).sum()


def above_threshold(values: torch.Tensor, threshold: float) -> Sparse:
    """The entries of magnitude above ``threshold`` (the official code's hard
    threshold on A before it is sent): their flat indices (int32, sorted) and
    values; none when no entry exceeds it."""
    flat = values.detach().reshape(-1)
    idx = torch.nonzero(flat.abs() > threshold).flatten()
    return idx.to(torch.int32), flat[idx].clone()


def retroactive_loss(
    base: torch.Tensor, past: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Eq. (2), third term, for one layer: ``sum_i ||B * m^(i) + R^(i) -
    theta^(i)||_2^2`` over the past tasks i, where ``past[i] = (m^(i),
    R^(i), theta^(i))``: task i's mask, the rest of its weight (A^(i) plus its
    knowledge-base part, frozen) and its effective weight stored at the end of
    task i. With the rest frozen this is ``||(B - B^(i)) * m^(i)||^2``: the
    paper's ``||Delta B * m^(i) + Delta A^(i)||^2`` with Delta A^(i) = 0."""
    terms = [((base * unit_view(m, base) + rest - theta) ** 2).sum() for m, rest, theta in past]
    if not terms:
        return base.new_zeros(())
    return torch.stack(terms).sum()


# ---------------------------------------------------------------------------
# decomposed layers
# ---------------------------------------------------------------------------


class _Decomposed(nn.Module):
    """Shared parts of the decomposed layers: ``base`` (B, shared), ``mask``
    (m, one per output unit), ``adaptive`` (A), ``alpha`` and the buffer
    ``kb`` (up to ``kb_size`` other clients' A's; ``kb_used`` of them in use).
    The bias is an ordinary local parameter (not decomposed, not shared)."""

    kb: torch.Tensor

    def _init_parts(self, weight: torch.Tensor, bias: torch.Tensor | None, kb_size: int) -> None:
        self.base = nn.Parameter(weight.detach().clone())
        self.mask = nn.Parameter(torch.ones(weight.shape[0]))
        self.adaptive = nn.Parameter(torch.zeros_like(weight))
        self.alpha = nn.Parameter(torch.zeros(kb_size))
        self.register_buffer("kb", torch.zeros(kb_size, *weight.shape))
        self.kb_used = 0
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone())

    def weight(self) -> torch.Tensor:
        k = self.kb_used
        return effective_weight(self.base, self.mask, self.adaptive, self.kb[:k], self.alpha[:k])

    @torch.no_grad()
    def start_task(self, kb: Sequence[torch.Tensor]) -> None:
        """A new task: mask back to ones, A to zeros, the knowledge base to
        ``kb`` (dense tensors of the base's shape, at most ``kb_size``) with
        uniform attention ``1/K`` (the parameter objects stay, so the
        optimizer keeps them)."""
        self.mask.fill_(1.0)
        self.adaptive.zero_()
        self.kb.zero_()
        self.alpha.zero_()
        entries = list(kb)[: self.kb.shape[0]]
        for j, a in enumerate(entries):
            self.kb[j].copy_(a)
        self.kb_used = len(entries)
        if entries:
            self.alpha[: len(entries)] = 1.0 / len(entries)


class DecomposedLinear(_Decomposed):
    def __init__(self, layer: nn.Linear, kb_size: int):
        super().__init__()
        self._init_parts(layer.weight, layer.bias, kb_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight(), self.bias)


class DecomposedConv2d(_Decomposed):
    def __init__(self, layer: nn.Conv2d, kb_size: int):
        super().__init__()
        if layer.padding_mode != "zeros":
            raise ValueError(
                f"fedweit decomposes zero-padded convolutions only, not padding_mode={layer.padding_mode!r}"
            )
        self._init_parts(layer.weight, layer.bias, kb_size)
        self.stride, self.padding = layer.stride, layer.padding
        self.dilation, self.groups = layer.dilation, layer.groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, self.weight(), self.bias, self.stride, self.padding, self.dilation, self.groups)


def decompose(model: nn.Module, kb_size: int) -> nn.Module:
    """Replace every ``nn.Linear`` and ``nn.Conv2d`` of ``model`` (in place)
    by its decomposed layer, B initialised to the layer's weight (so the
    model computes the same function until it trains). Returns ``model``."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, DecomposedLinear(child, kb_size))
        elif isinstance(child, nn.Conv2d):
            setattr(model, name, DecomposedConv2d(child, kb_size))
        else:
            decompose(child, kb_size)
    return model


def decomposed_layers(model: nn.Module) -> dict[str, _Decomposed]:
    """The decomposed layers of ``model`` by module name, in order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, _Decomposed)}
