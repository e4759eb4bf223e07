"""CReFF's maths (Shang et al., IJCAI 2022), plain functions on tensors.

The classifier is linear, ``z = F W^T + b`` (``W``: classes x feature_dim).
A gradient set is ``{class: dL/dW}``, the gradient with respect to the
classifier's weight matrix of the mean cross-entropy of one class's samples
(the bias's gradient is not matched, see :func:`matching_distance`, so it is
neither computed for the upload nor sent). The hook glue is
:mod:`fedaval.plugins.creff`; the server's per-class mean of the clients'
gradients is :func:`fedaval.prototypes.mean_over_holders`.

No paper file is in the repository: the steps are named after the paper's
description (client gradients on real features, gradient matching of the
federated features, classifier re-training), not by equation number.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

GradientSet = dict[int, torch.Tensor]


def classifier_gradient(
    features: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    create_graph: bool = False,
) -> torch.Tensor:
    """``dL/dW`` of ``L = mean_i CE(W f_i + b, y_i)`` (a client's real-feature
    gradient of one class when every ``y_i`` is that class). In closed form it is
    ``(softmax(Z) - onehot(Y))^T F / n``; computed by autograd so that with
    ``create_graph=True`` it stays differentiable in ``features`` (the
    federated features are optimised through it)."""
    weight = weight.detach().requires_grad_(True)
    logits = F.linear(features, weight, None if bias is None else bias.detach())
    loss = F.cross_entropy(logits, labels)
    (grad,) = torch.autograd.grad(loss, weight, create_graph=create_graph)
    return grad


def per_class_gradients(
    features: torch.Tensor, labels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> GradientSet:
    """A client's real-feature gradients: for each class c in ``labels``, the
    classifier gradient of the mean cross-entropy of its class-c samples
    (CReFF's gradient
    of client k for class c), detached."""
    out: GradientSet = {}
    for c in torch.unique(labels).tolist():
        mask = labels == c
        out[int(c)] = classifier_gradient(features[mask], labels[mask], weight, bias).detach()
    return out


def matching_distance(synthetic: torch.Tensor, real: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Gradient-matching distance between two classifier weight gradients
    (CReFF's matching distance, the one of dataset condensation, Zhao et al. 2021):
    ``sum_j (1 - cos(synthetic_j, real_j))`` over the rows j (one per output
    class) of the weight gradient. Reading: the bias's gradient is not part of
    the distance; the official code's distance adds it as one more row (a
    known difference, docs/methods.md)."""
    dots = (synthetic * real).sum(dim=-1)
    norms = synthetic.norm(dim=-1) * real.norm(dim=-1)
    return (1 - dots / (norms + eps)).sum()


def class_gradients_closed_form(
    features: torch.Tensor, classes: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The classifier gradients of many classes at once, in closed form:
    ``features`` is ``[C, m, d]`` (m features of each of C classes),
    ``classes`` their C labels; returns ``[C, K, d]`` with
    ``G_c = (softmax(F_c W^T + b) - onehot(c))^T F_c / m``, the gradient of the
    mean cross-entropy of class c's features (:func:`classifier_gradient`,
    vectorised). Differentiable in ``features``."""
    logits = features @ weight.detach().T
    if bias is not None:
        logits = logits + bias.detach()
    residual = logits.softmax(dim=-1) - F.one_hot(classes, weight.shape[0]).to(features.dtype)[:, None, :]
    return torch.einsum("cmk,cmd->ckd", residual, features) / features.shape[1]


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
    federated features."""
    classes = sorted(set(features) & set(real))
    if not classes:
        return torch.zeros(())
    feats = torch.stack([features[c] for c in classes])
    labels = torch.tensor(classes, dtype=torch.long, device=feats.device)
    synthetic = class_gradients_closed_form(feats, labels, weight, bias)
    target = torch.stack([real[c].to(feats.device, feats.dtype) for c in classes])
    return matching_distance(synthetic, target)


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
