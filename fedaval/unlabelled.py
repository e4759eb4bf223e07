"""Unlabelled image data a method takes from another dataset (CFeD's
surrogate data, FEDIC's unlabelled distillation set): any dataset fedaval
loads, converted to the run's input shape and normalised as the run's data,
refused when it is the run's own data with classes its tasks use."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from fedaval.errors import FedavalUsageError, choice_error


def load_unlabelled(run, option: str, name: str, root: str, classes: Sequence[int], samples: int) -> torch.Tensor:
    """``samples`` training images of dataset ``name`` (of ``classes``, all
    when empty), drawn with the run's seed, in the run's input shape
    (:func:`to_input_shape`), normalised with the run's mean and std. Errors
    name the option (``option``, ``option_root``, ``option_classes``) in one
    line: an unknown dataset, a missing root, classes out of range, or the
    run's own dataset sharing classes with its tasks."""
    from fedaval.datasets import load_dataset

    if name not in run.datasets:
        raise choice_error(f"{option} dataset", name, sorted(run.datasets))
    path = Path(root).expanduser() if root else None
    if path is not None and not path.exists():
        raise FedavalUsageError(f"bad value {option}_root={root!r}: it does not exist")
    try:
        data = load_dataset(name, path, False, run.datasets)
    except FedavalUsageError as exc:
        raise FedavalUsageError(f"{option}={name!r}: {exc}".replace("--data-root", f"{option}_root")) from None
    classes = list(classes) or list(range(data.num_classes))
    bad = [c for c in classes if not 0 <= c < data.num_classes]
    if bad:
        raise FedavalUsageError(f"bad value {option}_classes={bad}; {name!r} has classes 0..{data.num_classes - 1}")
    run_root = Path(run.config.data_root).expanduser().resolve() if run.config.data_root else None
    if name == run.config.dataset and (path.resolve() if path else None) == run_root:
        used = {c for task in run.federation_task_classes() for c in task}
        shared = sorted(set(classes) & used)
        if shared:
            raise FedavalUsageError(
                f"{option}={name!r} is the run's own dataset and shares classes {shared} with its tasks; "
                f"choose another dataset, or {option}_classes outside the tasks' classes"
            )
    keep = torch.nonzero(torch.isin(data.train_y, torch.tensor(classes))).flatten()
    gen = torch.Generator().manual_seed(run.config.seed)
    keep = keep[torch.randperm(len(keep), generator=gen)[:samples]]
    images = data.train_x[keep]
    images = images.float() / 255.0 if images.dtype == torch.uint8 else images.float()
    x = to_input_shape(images, run.data.input_shape)
    mean = torch.tensor(run.data.mean, dtype=torch.float32).view(1, -1, 1, 1)
    std = torch.tensor(run.data.std, dtype=torch.float32).view(1, -1, 1, 1)
    return (x - mean) / std


def to_input_shape(images: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """Images ``[N, C, H, W]`` in [0, 1] to ``shape`` = (C', H', W'): RGB to
    grey by the channel mean, grey to RGB by repeating the channel, then a
    bilinear resize (antialiased when shrinking)."""
    c, h, w = shape
    x = images.float()
    if x.shape[1] != c:
        if c == 1:
            x = x.mean(dim=1, keepdim=True)
        elif x.shape[1] == 1:
            x = x.repeat(1, c, 1, 1)
        else:
            raise ValueError(f"cannot turn {x.shape[1]}-channel images into {c} channels")
    if tuple(x.shape[2:]) != (h, w):
        shrink = x.shape[2] > h or x.shape[3] > w
        x = F.interpolate(x, size=(h, w), mode="bilinear", align_corners=False, antialias=shrink)
    return x
