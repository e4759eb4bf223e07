"""Prototype maths shared by the prototype methods: class means of features,
moving averages of ``{class: prototype}`` sets, and nearest-prototype
prediction.

A *prototype set* is a plain ``dict[int, torch.Tensor]`` (class id ->
1-d feature vector). Everything here is a pure function on tensors; the
methods (GLDP, FedProK, PFCL...) keep the sets and call these.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch

PrototypeSet = dict[int, torch.Tensor]


def class_means(features: torch.Tensor, labels: torch.Tensor) -> tuple[PrototypeSet, dict[int, int]]:
    """Mean feature of each class present in ``labels`` and its sample count:
    ``C^n = 1/|D_n| sum_{x in D_n} f(x)`` (GLDP Eq. 6, FedProK's mu_{k,c},
    PFCL's p_{c,i}). Gradients flow through the means when ``features``
    requires them (the in-batch prototypes of a loss)."""
    means: PrototypeSet = {}
    counts: dict[int, int] = {}
    for c in torch.unique(labels).tolist():
        mask = labels == c
        means[int(c)] = features[mask].mean(dim=0)
        counts[int(c)] = int(mask.sum())
    return means, counts


@functools.lru_cache(maxsize=64)
def class_index(classes: tuple[int, ...], device: str) -> torch.Tensor:
    """``classes`` as a long tensor on ``device`` (``str(tensor.device)``),
    made once per list and device: a Python list copied to a GPU waits for
    it, and the prototype methods index with the same few class lists
    minibatch after minibatch. The tensor is shared: do not change it."""
    return torch.tensor(classes, dtype=torch.long, device=device)


@functools.lru_cache(maxsize=64)
def class_mask(classes: tuple[int, ...], width: int, device: str, inside: bool = True) -> torch.Tensor:
    """A boolean mask over ``width`` class columns on ``device``: ``inside``
    at ``classes``, ``not inside`` elsewhere. Made once per list, width and
    device (built per minibatch, its index assignment copied the fill value
    to a GPU and waited: TARGET's mask, session 14). Shared: do not change it."""
    mask = torch.full((width,), not inside, dtype=torch.bool, device=device)
    return mask.index_fill_(0, class_index(classes, device), inside)


def taught_scores(logits: torch.Tensor, classes: list[int]) -> torch.Tensor:
    """``logits`` with every column outside ``classes`` set to ``-inf``: a
    linear head whose outputs are only those of the classes taught so far
    (iCaRL's growing output layer). ``classes`` empty: ``logits`` unchanged."""
    if not classes:
        return logits
    untaught = class_mask(tuple(classes), logits.shape[1], str(logits.device), inside=False)
    return logits.masked_fill(untaught, float("-inf"))


def ema_update(old: Mapping[int, torch.Tensor], new: Mapping[int, torch.Tensor], beta: float) -> PrototypeSet:
    """``beta * old[c] + (1 - beta) * new[c]`` for a class in both sets; a class
    only in ``new`` is added as it is; a class only in ``old`` is kept (GLDP
    Eq. 9 and 11). Returns a new dict; the inputs are not changed."""
    out: PrototypeSet = {c: p.detach().clone() for c, p in old.items()}
    for c, p in new.items():
        p = p.detach()
        out[c] = beta * out[c] + (1 - beta) * p if c in out else p.clone()
    return out


def mean_over_holders(sets: Iterable[Mapping[int, torch.Tensor]]) -> PrototypeSet:
    """Per class, the plain mean over the sets that hold it:
    ``1/|N_n| sum_{i in N_n} C_i^n`` (the inner term of GLDP Eq. 11; PFCL's
    global prototype)."""
    sums: dict[int, torch.Tensor] = {}
    holders: dict[int, int] = {}
    for prototypes in sets:
        for c, p in prototypes.items():
            p = p.detach().to(torch.float64)
            sums[c] = sums[c] + p if c in sums else p.clone()
            holders[c] = holders.get(c, 0) + 1
    return {c: (sums[c] / holders[c]).to(torch.float32) for c in sums}


def nearest_prototype_scores(
    features: torch.Tensor, prototypes: Mapping[int, torch.Tensor], num_classes: int
) -> torch.Tensor:
    """Class scores ``-||f(x) - C^n||_2`` (``N x num_classes``) whose argmax is
    the nearest prototype, ``argmin_n ||f(x) - C^n||_2`` (GLDP Eq. 13). A class
    without a prototype scores ``-inf`` and is never predicted. ``prototypes``
    must not be empty."""
    if not prototypes:
        raise ValueError("nearest-prototype prediction needs at least one prototype")
    classes = sorted(prototypes)
    bank = torch.stack([prototypes[c].to(features.device, features.dtype) for c in classes])
    distances = torch.cdist(features, bank)
    scores = torch.full((features.shape[0], num_classes), float("-inf"), device=features.device, dtype=features.dtype)
    scores[:, class_index(tuple(classes), str(features.device))] = -distances
    return scores


def dataset_batches(dataset, device, batch_size: int = 256, run=None) -> Iterable[Any]:
    """``dataset``'s samples in order, in minibatches of ``[x, y, ...]``.

    With ``run``, a dataset of the run's own (a client's task data) is read
    on the run's device data path, as evaluation reads it
    (:class:`fedaval.device_data.EvalBatches`: the same minibatches, bit for
    bit, and the same one draw from the global random stream as a
    ``DataLoader``), instead of sample by sample through a ``DataLoader``
    and a copy to the device per minibatch; other datasets take the
    ``DataLoader``."""
    if run is not None and torch.device(device) == run.device:
        from fedaval.device_data import eval_batches

        batches = eval_batches(run, dataset, batch_size)
        if batches is not None:
            return batches
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=False)


def dataset_samples(dataset, device, run=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Every sample of ``dataset`` (its evaluation view: no augmentation), in
    order, as ``(images, labels)`` on ``device`` (:func:`dataset_batches`)."""
    images, labels = [], []
    for batch in dataset_batches(dataset, device, run=run):
        images.append(batch[0].to(device))
        labels.append(torch.as_tensor(batch[1]).to(device))
    if not images:
        return torch.zeros(0, device=device), torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(images), torch.cat(labels)


@torch.no_grad()
def extract_features(model, dataset, device, batch_size: int = 256, run=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.features`` of every sample of ``dataset``, in order, with the
    model in eval mode (BatchNorm running statistics, no dropout; its modes
    are restored afterwards). Returns ``(features, labels)`` on ``device``:
    the one feature-extraction loop of the prototype methods. With ``run``,
    the run's own data is read on its device data path (:func:`dataset_batches`)."""
    from fedaval.models import in_mode

    feats, labels = [], []
    with in_mode(model, training=False):
        for batch in dataset_batches(dataset, device, batch_size, run):
            x, y = batch[0].to(device), torch.as_tensor(batch[1]).to(device)
            feats.append(model.features(x))
            labels.append(y)
    if not feats:
        return torch.zeros(0, device=device), torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat(feats), torch.cat(labels)
