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


def test_a_cache_that_cannot_be_written_is_a_warning_and_the_data_still_loads(
    tmp_path, cifar10_root, monkeypatch, caplog
):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("FEDAVAL_CACHE", str(tmp_path / "a-file"))
    with caplog.at_level("WARNING", logger="fedaval"):
        data = load_dataset("imagefolder", cifar10_root)
    assert len(data.train_x) == 300
    assert any("cannot cache the decoded images" in r.getMessage() for r in caplog.records)


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


def test_cache_name_is_the_hash_of_os_walks_listing(tmp_path, cifar10_root):
    """The fingerprint visits files as ``os.walk(followlinks=True)`` did, so
    caches written before it was rewritten keep their names: files by name,
    then sub-folders by name, links followed, paths relative to the root."""
    import hashlib
    import os

    from fedaval.datasets import _fingerprint

    root = tmp_path / "tree"
    shutil.copytree(cifar10_root / "test" / "cat", root / "b")
    (root / "a" / "z").mkdir(parents=True)
    (root / "a" / "z" / "deep.txt").write_text("1")
    (root / "a" / "y.txt").write_text("22")
    (root / "top.txt").write_text("333")
    (root / "linked").symlink_to(root / "a")  # a linked folder is walked
    (root / "b" / "link.jpg").symlink_to(cifar10_root / "test" / "dog" / "0000.jpg")  # a linked file: its target's stat

    digest = hashlib.sha1()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        dirnames.sort()
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            digest.update(f"{os.path.relpath(path, root)}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    assert _fingerprint(root) == digest.hexdigest()
    (root / "a" / "z" / "deep.txt").write_text("changed")
    assert _fingerprint(root) != digest.hexdigest()


def test_normalisation_is_computed_once_and_kept_in_the_cache(tmp_path, cifar10_root, monkeypatch):
    """An image folder's per-channel mean and std are computed when the cache
    is written, and read back with it (computing them copies the images twice
    as floats); a cache written without them gets them once."""
    from fedaval import datasets

    root = tmp_path / "cifar"
    shutil.copytree(cifar10_root, root)
    first = load_dataset("imagefolder", root)
    pixels = first.train_x.float()
    assert first.mean == tuple((pixels.mean(dim=(0, 2, 3)) / 255).tolist())
    assert first.std == tuple((pixels.std(dim=(0, 2, 3)) / 255).tolist())
    calls = []
    real = datasets._channel_statistics
    monkeypatch.setattr(datasets, "_channel_statistics", lambda data: calls.append(1) or real(data))
    again = load_dataset("imagefolder", root)
    assert (again.mean, again.std) == (first.mean, first.std) and not calls
    # a cache from before: the tensors only
    path = datasets._cache_path("imagefolder", root)
    old = torch.load(path, weights_only=True)
    torch.save({k: v for k, v in old.items() if k not in ("mean", "std")}, path)
    upgraded = load_dataset("imagefolder", root)
    assert (upgraded.mean, upgraded.std) == (first.mean, first.std) and len(calls) == 1
    assert "mean" in torch.load(path, weights_only=True)
    assert load_dataset("imagefolder", root).mean == first.mean and len(calls) == 1


def test_runs_building_the_same_cache_at_once_both_finish(tmp_path, cifar10_root, monkeypatch):
    """Runs started side by side (one per seed) decode the same new folder
    together and both write its cache. Here the second run writes it while
    the first is writing. With one temporary name for every writer, the
    first then found its file renamed away (FileNotFoundError: a run of
    ``benchmarks/reproduce.py --jobs 2`` failed so); each writer now has its
    own, and the cache holds one complete copy."""
    from fedaval import datasets

    root = tmp_path / "cifar"
    shutil.copytree(cifar10_root, root)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FEDAVAL_CACHE", str(cache))
    real_save, saves, other = torch.save, [], []

    def save(obj, f, *args, **kwargs):
        saves.append(1)
        if len(saves) == 1:  # the first run is writing: the other one loads, and writes, meanwhile
            other.append(load_dataset("imagefolder", root))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    first = load_dataset("imagefolder", root)
    assert len(saves) == 2 and torch.equal(first.train_x, other[0].train_x)
    path = datasets._cache_path("imagefolder", root)
    assert [p.name for p in cache.iterdir()] == [path.name]  # no temporary file left
    assert torch.equal(torch.load(path, weights_only=True)["train_x"], first.train_x)
