"""Real loaders on real data: digits from scikit-learn, the shared CIFAR-10 as an image folder."""

from __future__ import annotations

import shutil

import pytest
import torch

from fedaval.datasets import TensorImageDataset, load_dataset
from fedaval.errors import FedavalUsageError


def test_digits_split_is_fixed_and_stratified():
    data = load_dataset("digits")
    assert data.train_x.shape[1:] == (1, 8, 8) and data.num_classes == 10
    assert len(data.train_y) + len(data.test_y) == 1797
    assert set(data.test_y.tolist()) == set(range(10))
    again = load_dataset("digits")
    assert torch.equal(data.test_y, again.test_y)


def test_imagefolder_reads_the_shared_cifar10(cifar10_root):
    data = load_dataset("imagefolder", cifar10_root)
    assert data.class_names[:3] == ["airplane", "automobile", "bird"]
    assert data.train_x.shape == (1000, 3, 32, 32) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (500, 3, 32, 32)
    assert torch.bincount(data.train_y).tolist() == [100] * 10
    # normalised samples have roughly zero mean and unit spread over the training set
    ds = TensorImageDataset(data.train_x, data.train_y, range(200), data.mean, data.std)
    x = torch.stack([ds[i][0] for i in range(200)])
    assert abs(float(x.mean())) < 0.2 and 0.7 < float(x.std()) < 1.3
    # second load comes from the decoded cache and is identical
    assert torch.equal(load_dataset("imagefolder", cifar10_root).train_x, data.train_x)


def test_imagefolder_errors_name_the_problem(tmp_path, cifar10_root):
    with pytest.raises(FedavalUsageError, match="has no train/ folder"):
        load_dataset("imagefolder", tmp_path)
    broken = tmp_path / "broken"
    shutil.copytree(cifar10_root, broken)
    victim = next((broken / "train" / "cat").glob("*.jpg"))
    victim.write_bytes(b"not a jpeg")
    with pytest.raises(FedavalUsageError, match="cannot read image"):
        load_dataset("imagefolder", broken)


def test_missing_torchvision_dataset_says_how_to_get_it(tmp_path):
    with pytest.raises(FedavalUsageError, match="pass --download"):
        load_dataset("cifar10", tmp_path)
