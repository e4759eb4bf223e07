"""Real loaders on real data: digits from scikit-learn, a CIFAR-10 subset (tests/data) as an image folder."""

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


def test_imagefolder_reads_the_cifar10_subset(cifar10_root):
    data = load_dataset("imagefolder", cifar10_root)
    assert data.class_names[:3] == ["airplane", "automobile", "bird"]
    assert data.train_x.shape == (300, 3, 32, 32) and data.train_x.dtype == torch.uint8
    assert data.test_x.shape == (60, 3, 32, 32)
    assert torch.bincount(data.train_y).tolist() == [30] * 10
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


def test_cache_follows_added_images_and_edited_files(tmp_path, cifar10_root):
    root = tmp_path / "cifar"
    shutil.copytree(cifar10_root, root)
    first = load_dataset("imagefolder", root)
    mtime = (root / "train").stat().st_mtime_ns
    for i in range(5):  # five more cats; train/'s own modification time does not change
        shutil.copy(root / "train" / "dog" / f"00{i:02d}.jpg", root / "train" / "cat" / f"extra{i}.jpg")
    assert (root / "train").stat().st_mtime_ns == mtime
    added = load_dataset("imagefolder", root)
    assert len(added.train_y) == len(first.train_y) + 5
    cat = added.class_names.index("cat")
    assert int((added.train_y == cat).sum()) == int((first.train_y == cat).sum()) + 5
    # an image replaced in place (same name, other content) is decoded again
    shutil.copy(root / "test" / "dog" / "0000.jpg", root / "test" / "cat" / "0000.jpg")
    replaced = load_dataset("imagefolder", root)
    assert not torch.equal(replaced.test_x, added.test_x)


def test_tiny_imagenet_cache_follows_an_edited_annotation_file(tmp_path, cifar10_root):
    base = tmp_path / "tiny-imagenet-200"
    wnids = ["n01", "n02"]
    (base / "val" / "images").mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    lines = []
    for wnid, cls in zip(wnids, ["cat", "dog"]):
        (base / "train" / wnid / "images").mkdir(parents=True)
        for i in range(3):
            shutil.copy(
                cifar10_root / "train" / cls / f"000{i}.jpg", base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG"
            )
        shutil.copy(cifar10_root / "test" / cls / "0000.jpg", base / "val" / "images" / f"val_{wnid}.JPEG")
        lines.append(f"val_{wnid}.JPEG\t{wnid}\t0\t0\t32\t32")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    assert load_dataset("tiny-imagenet", tmp_path).test_y.tolist() == [0, 1]
    (base / "val" / "val_annotations.txt").write_text(
        "\n".join(line.replace("\tn01", "\tn02") for line in lines) + "\n"
    )
    assert load_dataset("tiny-imagenet", tmp_path).test_y.tolist() == [1, 1]


def test_decoding_gives_no_numpy_warning(tmp_path, cifar10_root, monkeypatch):
    # torch warns once per process about a non-writable array, so check the arrays themselves
    real = torch.from_numpy
    seen = []

    def from_numpy(array):
        seen.append(array.flags.writeable)
        return real(array)

    monkeypatch.setattr(torch, "from_numpy", from_numpy)
    shutil.copytree(cifar10_root, tmp_path / "c")
    load_dataset("imagefolder", tmp_path / "c")
    assert seen and all(seen), "torch.from_numpy got a read-only array"
