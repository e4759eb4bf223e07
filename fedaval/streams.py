"""Avalanche datasets and streams for clients and the server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
from avalanche.benchmarks.scenarios.dataset_scenario import DatasetExperience
from avalanche.benchmarks.scenarios.generic_scenario import EagerCLStream
from avalanche.benchmarks.utils import _make_taskaware_classification_dataset

from fedaval.datasets import ImageData, TensorImageDataset

if TYPE_CHECKING:
    from fedaval.run import Run


def make_dataset(data: ImageData, split: str, indices: np.ndarray):
    """An Avalanche classification dataset over ``indices`` of a split."""
    images, labels = (data.train_x, data.train_y) if split == "train" else (data.test_x, data.test_y)
    return _make_taskaware_classification_dataset(
        TensorImageDataset(images, labels, indices, data.mean, data.std), task_labels=0
    )


def _stream(name: str, datasets: Sequence) -> list[DatasetExperience | None]:
    """Experiences numbered by task; ``None`` where a task has no data."""
    exps = [
        None if ds is None else DatasetExperience(dataset=ds, current_experience=t) for t, ds in enumerate(datasets)
    ]
    stream = EagerCLStream(name, [e for e in exps if e is not None], set_stream_info=False)
    for e in exps:
        if e is not None:
            e.origin_stream = stream
    return exps


def make_train_stream(data: ImageData, task_indices: list[np.ndarray]) -> list[DatasetExperience | None]:
    return _stream("train", [make_dataset(data, "train", idx) if len(idx) else None for idx in task_indices])


def new_classes(task_classes: Sequence[Sequence[int]]) -> list[list[int]]:
    """For each task, the classes not taught by an earlier task."""
    seen: set[int] = set()
    out = []
    for classes in task_classes:
        fresh = sorted(set(classes) - seen)
        seen.update(fresh)
        out.append(fresh)
    return out


def indices_of_classes(data: ImageData, classes: Sequence[int]) -> np.ndarray:
    y = data.test_y.numpy()
    return np.flatnonzero(np.isin(y, np.asarray(list(classes), dtype=np.int64)))


def make_test_stream(data: ImageData, task_classes: Sequence[Sequence[int]]) -> list[DatasetExperience | None]:
    """Test experience ``t`` = test samples of the classes first taught at task ``t``."""
    datasets = []
    for fresh in new_classes(task_classes):
        idx = indices_of_classes(data, fresh)
        datasets.append(make_dataset(data, "test", idx) if len(idx) else None)
    return _stream("test", datasets)


def shared_test_stream(run: Run, task_classes: Sequence[Sequence[int]]) -> list[DatasetExperience | None]:
    """:func:`make_test_stream` whose experiences are the run's: one object
    per task and set of new classes (``run.test_experiences``, by name), made
    by the first client that needs it and shared by every client with the
    same one. Test experiences are only read, so sharing changes no result;
    it saves building, keeping and pickling (offloading, checkpoints: they are
    written by name, :mod:`fedaval.state`) one copy per client."""
    exps = []
    for task, fresh in enumerate(new_classes(task_classes)):
        name = f"test_experience.{task}." + ",".join(str(c) for c in fresh)
        if name not in run.test_experiences:
            idx = indices_of_classes(run.data, fresh)
            exp = None
            if len(idx):
                exp = DatasetExperience(dataset=make_dataset(run.data, "test", idx), current_experience=task)
                exp.origin_stream = EagerCLStream("test", [exp], set_stream_info=False)
            run.test_experiences[name] = exp
        exps.append(run.test_experiences[name])
    return exps


def with_extra_data(data: ImageData, own: DatasetExperience | None, own_indices: np.ndarray, extras: Sequence):
    """A training experience of ``own``'s task whose dataset is its samples
    (``own_indices`` of the training split) followed by ``extras``
    (:func:`fedaval.hookspecs.fedaval_client_train_data` results, in plugin
    order): index arrays into the training split, or datasets of ``(x, y)``.

    When every extra is an index array the result is one dataset over the
    concatenated indices, so minibatches stay on the device data path;
    otherwise the datasets are concatenated (the loader path)."""
    import torch

    task = own.current_experience if own is not None else 0
    arrays = [np.asarray(e, dtype=np.int64) for e in extras if isinstance(e, np.ndarray) or torch.is_tensor(e)]
    datasets = [e for e in extras if not (isinstance(e, np.ndarray) or torch.is_tensor(e))]
    indices = np.concatenate([np.asarray(own_indices, dtype=np.int64), *(a.reshape(-1) for a in arrays)])
    dataset = make_dataset(data, "train", indices)
    for extra in datasets:
        targets = [int(extra[i][1]) for i in range(len(extra))]
        dataset = dataset.concat(_make_taskaware_classification_dataset(extra, targets=targets, task_labels=0))
    exp = DatasetExperience(dataset=dataset, current_experience=task)
    exp.origin_stream = own.origin_stream if own is not None else None
    return exp
