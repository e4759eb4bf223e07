"""The shared CIFAR-10 for the benchmarks: the tarball in ../shared/datasets,
extracted once to /tmp/cifar10-full, and per-class subsets of it as
ImageFolder trees of symlinks (made once per size, race-safe, so parallel
benchmark processes share them). Import as ``from cifar_data import ...``
(``python benchmarks/<script>.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

TARBALL = Path(__file__).resolve().parent.parent.parent / "shared" / "datasets" / "cifar10-jpeg.tar.gz"
FULL = Path("/tmp/cifar10-full")


def cifar_full() -> Path:
    """The shared CIFAR-10, extracted once to /tmp/cifar10-full (race-safe)."""
    if (FULL / "test" / "truck").is_dir():
        return FULL
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="cifar10-extract-"))
    subprocess.run(["tar", "xzf", str(TARBALL), "-C", str(tmp)], check=True)
    try:
        os.rename(tmp, FULL)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return FULL


def cifar_subset(train_per_class: int, test_per_class: int) -> Path:
    """An ImageFolder of the first ``n`` images of every class (symlinks)."""
    full = cifar_full()
    root = Path(f"/tmp/cifar10-subset-{train_per_class}-{test_per_class}")
    if (root / "done").exists():
        return root
    tmp = Path(tempfile.mkdtemp(dir="/tmp", prefix="cifar10-subset-"))
    for split, n in (("train", train_per_class), ("test", test_per_class)):
        for cls in sorted(p.name for p in (full / split).iterdir()):
            (tmp / split / cls).mkdir(parents=True)
            for f in sorted((full / split / cls).iterdir())[:n]:
                (tmp / split / cls / f.name).symlink_to(f)
    (tmp / "done").touch()
    try:
        os.rename(tmp, root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return root
