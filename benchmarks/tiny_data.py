"""Tiny-ImageNet-200 for the benchmarks: per-class subsets of the training
images as ``tiny-imagenet-200/`` trees of symlinks (every validation image,
``wnids.txt`` and ``val/val_annotations.txt`` kept), made once per size and
race-safe, like cifar_data.py. The full tree is not shipped: bring it as
../shared/datasets/README.md says (``fetch`` the repository
``seshuad/IMagenet``, then ``git archive``) and pass its folder."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def tiny_subset(full: Path, train_per_class: int) -> Path:
    """``<full>/tiny-imagenet-200`` cut to the first ``train_per_class``
    training images of each class (sorted by file name), under
    /tmp/tiny-imagenet-subset-<n>/tiny-imagenet-200."""
    base = full / "tiny-imagenet-200" if (full / "tiny-imagenet-200").is_dir() else full
    root = Path(f"/tmp/tiny-imagenet-subset-{train_per_class}")
    if (root / "done").exists():
        return root
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="tiny-subset-"))
    out = tmp / "tiny-imagenet-200"
    out.mkdir()
    for name in ("wnids.txt", "words.txt", "val"):
        (out / name).symlink_to(base / name)
    for wnid in (base / "wnids.txt").read_text().split():
        images = out / "train" / wnid / "images"
        images.mkdir(parents=True)
        for f in sorted((base / "train" / wnid / "images").glob("*.JPEG"))[:train_per_class]:
            (images / f.name).symlink_to(f)
    (tmp / "done").touch()
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


if __name__ == "__main__":
    import sys

    print(tiny_subset(Path(sys.argv[1]), int(sys.argv[2])))
