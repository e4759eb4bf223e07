"""Tiny-ImageNet-200 for the benchmarks, made once per size and race-safe,
like cifar_data.py. The full tree is not shipped: bring it as
../shared/datasets/README.md says (``fetch`` the repository
``seshuad/IMagenet``, then ``git archive``) and pass its folder.

* :func:`tiny_subset`: the first ``n`` training images of each class as a
  ``tiny-imagenet-200/`` tree of symlinks (every validation image,
  ``wnids.txt`` and ``val/val_annotations.txt`` kept), for
  ``--dataset tiny-imagenet`` at the original 64x64.
* :func:`tiny_folder`: a CPU-sized copy as an image folder
  (``train/<wnid>/``, ``test/<wnid>/``, for ``--dataset imagefolder``): the
  first ``n`` training and the first ``v`` validation images of each class
  (sorted by file name; validation classes from ``val_annotations.txt``),
  downsampled to ``size`` x ``size`` with PIL's box filter (area averaging,
  the filter of the downsampled-ImageNet variants) and stored as PNG, so no
  second lossy encoding is added. Class folders are the wnids, so the label
  order is ``wnids.txt`` sorted, the same classes as the original.

    python benchmarks/tiny_data.py <folder holding tiny-imagenet-200> 100           # tiny_subset
    python benchmarks/tiny_data.py <folder holding tiny-imagenet-200> 100 10 32     # tiny_folder
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def _base(full: Path) -> Path:
    return full / "tiny-imagenet-200" if (full / "tiny-imagenet-200").is_dir() else full


def _publish(tmp: Path, root: Path) -> Path:
    """Move a finished temporary tree to ``root`` (another process may have won the race)."""
    (tmp / "done").touch()
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def tiny_subset(full: Path, train_per_class: int) -> Path:
    """``<full>/tiny-imagenet-200`` cut to the first ``train_per_class``
    training images of each class (sorted by file name), under
    /tmp/tiny-imagenet-subset-<n>/tiny-imagenet-200."""
    base = _base(full)
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
    return _publish(tmp, root)


def tiny_folder(full: Path, train_per_class: int, val_per_class: int, size: int) -> Path:
    """An image folder of Tiny-ImageNet at ``size`` x ``size``: the first
    ``train_per_class`` training and ``val_per_class`` validation images of
    each class, under /tmp/tiny-imagenet-<n>-<v>-<size>px."""
    from PIL import Image

    base = _base(full)
    root = Path(f"/tmp/tiny-imagenet-{train_per_class}-{val_per_class}-{size}px")
    if (root / "done").exists():
        return root
    wnids = (base / "wnids.txt").read_text().split()
    val: dict[str, list[str]] = {w: [] for w in wnids}
    for line in (base / "val" / "val_annotations.txt").read_text().splitlines():
        parts = line.split("\t")
        if len(parts) >= 2:
            val[parts[1]].append(parts[0])
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="tiny-folder-"))
    for wnid in wnids:
        train = sorted((base / "train" / wnid / "images").glob("*.JPEG"))[:train_per_class]
        test = [base / "val" / "images" / name for name in sorted(val[wnid])[:val_per_class]]
        for split, files in (("train", train), ("test", test)):
            folder = tmp / split / wnid
            folder.mkdir(parents=True)
            for f in files:
                with Image.open(f) as img:
                    small = img.convert("RGB").resize((size, size), Image.Resampling.BOX)
                small.save(folder / (f.stem + ".png"))
    return _publish(tmp, root)


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5:
        print(tiny_folder(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    else:
        print(tiny_subset(Path(sys.argv[1]), int(sys.argv[2])))
