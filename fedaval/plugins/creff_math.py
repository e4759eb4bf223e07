"""CReFF's maths (Shang et al., IJCAI 2022), plain functions on tensors.

The classifier is linear, ``z = F W^T + b`` (``W``: classes x feature_dim).
A gradient set is ``{class: G}``: ``G`` is the gradient of the mean
cross-entropy of one class's samples with respect to the classifier's weight
matrix (``[K, d]``) or, when the bias is matched too (the official code's
distance), with respect to ``[W | b]`` (``[K, d + 1]``: the bias's gradient
is the last column). The hook glue is :mod:`fedaval.plugins.creff`; the
server's per-class mean of the clients' gradients is
:func:`fedaval.prototypes.mean_over_holders`.

No paper file is in the repository: the steps are named after the paper's
description (client gradients on real features, gradient matching of the
federated features, classifier re-training), not by equation number, and
their details follow the official code (shangxinyi/CReFF-FL, read, not
copied), docs/methods.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

GradientSet = dict[int, torch.Tensor]


def per_class_gradients(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    with_bias: bool = False,
) -> GradientSet:
    """A client's real-feature gradients: for each class c in ``labels``, the
    classifier gradient of the mean cross-entropy of its class-c samples
    (CReFF's gradient of client k for class c; with ``with_bias``, ``[K, d + 1]``
    with the bias's gradient last), detached."""
    out: GradientSet = {}
    for c in torch.unique(labels).tolist():
        mask = labels == c
        label = torch.tensor([c], device=labels.device)
        out[int(c)] = class_gradients_closed_form(features[mask][None], label, weight, bias, with_bias)[0].detach()
    return out


def matching_distance(
    synthetic: torch.Tensor, real: torch.Tensor, with_bias: bool = False, eps: float = 1e-6
) -> torch.Tensor:
    """Gradient-matching distance between classifier gradients (CReFF's
    matching distance, the one of dataset condensation, Zhao et al. 2021):
    ``sum_j (1 - cos(synthetic_j, real_j))`` over the rows j (one per output
    class) of the weight gradients, ``[..., K, d]``. With ``with_bias`` the
    last column is the bias's gradient, compared as one more vector of the
    class (``1 - cos`` of the two ``[K]`` bias gradients), as the official
    code's distance does."""
    if with_bias:
        return matching_distance(synthetic[..., :-1], real[..., :-1]) + matching_distance(
            synthetic[..., -1], real[..., -1]
        )
    dots = (synthetic * real).sum(dim=-1)
    norms = synthetic.norm(dim=-1) * real.norm(dim=-1)
    return (1 - dots / (norms + eps)).sum()


def class_gradients_closed_form(
    features: torch.Tensor,
    classes: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    with_bias: bool = False,
) -> torch.Tensor:
    """The classifier gradients of many classes at once, in closed form:
    ``features`` is ``[C, m, d]`` (m features of each of C classes),
    ``classes`` their C labels; returns ``[C, K, d]`` with
    ``G_c = (softmax(F_c W^T + b) - onehot(c))^T F_c / m``, the gradient of the
    mean cross-entropy of class c's features (what autograd gives,
    vectorised); with ``with_bias``, ``[C, K, d + 1]``, the bias's gradient
    (the mean of the residual ``softmax - onehot``) as the last column.
    Differentiable in ``features``."""
    logits = features @ weight.detach().T
    if bias is not None:
        logits = logits + bias.detach()
    residual = logits.softmax(dim=-1) - F.one_hot(classes, weight.shape[0]).to(features.dtype)[:, None, :]
    grad = torch.einsum("cmk,cmd->ckd", residual, features) / features.shape[1]
    if with_bias:
        grad = torch.cat([grad, residual.mean(dim=1)[..., None]], dim=-1)
    return grad


def matching_loss(
    features: Mapping[int, torch.Tensor],
    real: Mapping[int, torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """``sum_c D(g_syn^c, g_real^c)`` over the classes with both federated
    features and an aggregated real gradient, where ``g_syn^c`` is the
    classifier gradient of the mean cross-entropy of class c's federated
    features (differentiable in them). Every class has the same number of
    federated features. The real gradients' width says whether the bias is
    matched: ``d + 1`` columns, with the bias's gradient last."""
    classes = sorted(set(features) & set(real))
    if not classes:
        return torch.zeros(())
    feats = torch.stack([features[c] for c in classes])
    labels = torch.tensor(classes, dtype=torch.long, device=feats.device)
    target = torch.stack([real[c].to(feats.device, feats.dtype) for c in classes])
    with_bias = target.shape[-1] == feats.shape[-1] + 1
    synthetic = class_gradients_closed_form(feats, labels, weight, bias, with_bias)
    return matching_distance(synthetic, target, with_bias)


AUGMENTATIONS = ("color", "crop", "cutout", "flip", "scale", "rotate")


def siamese_augment(x: torch.Tensor, kind: str | None = None) -> torch.Tensor:
    """One random augmentation of the batch ``x`` ([B, C, H, W], normalised),
    with the same parameters for every image: the differentiable Siamese
    augmentation (DSA, Zhao and Bilen, ICML 2021) that CReFF's code applies to
    each batch of real images it takes a gradient on (its strategy
    ``color_crop_cutout_flip_scale_rotate``, one of the six drawn per batch).
    Written here from DSA's description and parameters, in plain tensor
    operations (the gradient is taken with respect to the classifier only, so
    nothing needs to be differentiable):

    * ``color``: brightness ``x + (u - 0.5)``, then saturation
      ``(x - mean_channels) 2u + mean_channels``, then contrast
      ``(x - mean_image) (u + 0.5) + mean_image``;
    * ``crop``: a translation by up to ``round(H / 8)`` pixels each way,
      zero filled (zero is the normalised mean colour);
    * ``cutout``: a ``round(H / 2) x round(W / 2)`` square of zeros at a random
      centre, clipped by the border;
    * ``flip``: a horizontal flip with probability 1/2;
    * ``scale``: each axis scaled by a factor in ``[1 / 1.2, 1.2]``;
    * ``rotate``: a rotation by up to 15 degrees each way (bilinear, zero filled).

    ``kind`` forces one of :data:`AUGMENTATIONS` (drawn uniformly when
    ``None``). Draws come from the global random stream (a client's own
    inside its round)."""
    if kind is None:
        kind = AUGMENTATIONS[int(torch.randint(len(AUGMENTATIONS), ()))]
    _, _, h, w = x.shape
    if kind == "color":
        x = x + (torch.rand(()) - 0.5)
        channels = x.mean(dim=1, keepdim=True)
        x = (x - channels) * (2 * torch.rand(())) + channels
        image = x.mean(dim=(1, 2, 3), keepdim=True)
        return (x - image) * (torch.rand(()) + 0.5) + image
    if kind == "crop":
        sh, sw = int(h / 8 + 0.5), int(w / 8 + 0.5)
        dy, dx = int(torch.randint(-sh, sh + 1, ())), int(torch.randint(-sw, sw + 1, ()))
        padded = F.pad(x, (sw, sw, sh, sh))
        return padded[:, :, sh + dy : sh + dy + h, sw + dx : sw + dx + w]
    if kind == "cutout":
        ch, cw = int(h / 2 + 0.5), int(w / 2 + 0.5)
        cy, cx = int(torch.randint(h + 1 - ch % 2, ())), int(torch.randint(w + 1 - cw % 2, ()))
        top, left = max(cy - ch // 2, 0), max(cx - cw // 2, 0)
        out = x.clone()
        out[:, :, top : cy - ch // 2 + ch, left : cx - cw // 2 + cw] = 0
        return out
    if kind == "flip":
        return x.flip(3) if float(torch.rand(())) < 0.5 else x
    if kind == "scale":
        sy, sx = (float(torch.rand(())) * (1.2 - 1 / 1.2) + 1 / 1.2 for _ in range(2))
        theta = torch.tensor([[sx, 0.0, 0.0], [0.0, sy, 0.0]])
    elif kind == "rotate":
        angle = (float(torch.rand(())) - 0.5) * 2 * math.radians(15)
        theta = torch.tensor([[math.cos(angle), -math.sin(angle), 0.0], [math.sin(angle), math.cos(angle), 0.0]])
    else:
        raise ValueError(f"unknown augmentation {kind!r}; one of {', '.join(AUGMENTATIONS)}")
    theta = theta.to(x.device, x.dtype)[None].expand(x.shape[0], 2, 3)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, align_corners=False)


def update_federated_features(
    features: Mapping[int, torch.Tensor],
    real: Mapping[int, torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    steps: int,
    lr: float,
) -> tuple[dict[int, torch.Tensor], list[float]]:
    """Optimise the federated features of the classes in ``real`` so the
    gradients they induce on the classifier ``(weight, bias)`` match the real
    ones (CReFF's federated-feature update): ``steps`` steps of plain SGD with learning rate ``lr``
    on :func:`matching_loss`. Returns the new features (classes without a real
    gradient this round unchanged) and the loss before each step and after
    the last."""
    params = {c: f.detach().clone().requires_grad_(c in real) for c, f in features.items()}
    trained = [p for c, p in params.items() if c in real]
    losses: list[float] = []
    if not trained:
        return {c: p.detach() for c, p in params.items()}, losses
    optimizer = torch.optim.SGD(trained, lr=lr)
    for _ in range(steps):
        loss = matching_loss(params, real, weight, bias)
        losses.append(float(loss.detach()))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    losses.append(float(matching_loss(params, real, weight, bias).detach()))
    return {c: p.detach() for c, p in params.items()}, losses


def retrain_classifier(
    features: Mapping[int, torch.Tensor],
    weight: torch.Tensor,
    bias: torch.Tensor,
    epochs: int,
    lr: float,
    batch_size: int,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Classifier re-training on the federated features (CReFF's
    classifier re-training):
    starting from ``(weight, bias)``, ``epochs`` epochs of minibatch SGD
    (learning rate ``lr``, minibatches of ``batch_size`` drawn in the order of
    ``generator``) on the cross-entropy of every class's federated features.
    Every class has the same number of features, so the training set is
    balanced. Returns the new ``(weight, bias)``, detached."""
    classes = sorted(features)
    x = torch.cat([features[c].detach() for c in classes])
    y = torch.cat([torch.full((features[c].shape[0],), c, dtype=torch.long) for c in classes]).to(x.device)
    w = weight.detach().clone().requires_grad_(True)
    b = bias.detach().clone().requires_grad_(True)
    optimizer = torch.optim.SGD([w, b], lr=lr)
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator).to(x.device)
        for start in range(0, len(y), batch_size):
            idx = order[start : start + batch_size]
            loss = F.cross_entropy(F.linear(x[idx], w, b), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return w.detach(), b.detach()
