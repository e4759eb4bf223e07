"""Datasets, loaded once into memory as tensors.

``digits`` is scikit-learn's bundled copy (no download, the default). The
torchvision datasets read ``--data-root`` and download only with
``--download``. ``imagefolder`` reads any ``train/<class>/`` and
``test/<class>/`` tree; ``tiny-imagenet`` the standard ``tiny-imagenet-200/``
layout. Decoded image folders are cached as tensors under
``$FEDAVAL_CACHE`` (default ``~/.cache/fedaval``) so a second run skips JPEG
decoding.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from fedaval.atomic import atomic_file
from fedaval.errors import FedavalUsageError, choice_error


@dataclass
class ImageData:
    """A dataset in memory: images ``[N, C, H, W]`` (uint8 0..255, or float
    already in [0, 1]) and int64 labels, for train and test."""

    name: str
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    class_names: list[str]
    mean: tuple[float, ...]
    std: tuple[float, ...]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]


class TensorImageDataset(Dataset):
    """Samples ``(normalised float image, label)`` of an :class:`ImageData`
    split, restricted to ``indices``. ``targets`` is what Avalanche reads.

    It refers to the split's tensors rather than copying its samples, so every
    client's datasets share one copy of the data (and checkpoints, which write
    the run's data tensors as references, hold only the indices).
    :meth:`batch` builds a whole minibatch at once, bit for bit what stacking
    ``__getitem__`` gives, for the device data path (:mod:`fedaval.device_data`)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, indices, mean, std):
        self.images = images
        self.labels = labels
        self.index = torch.as_tensor(np.asarray(indices, dtype=np.int64))
        self._positions = self.index.tolist()
        self.targets = labels[self.index].tolist()
        self._scale = 255.0 if images.dtype == torch.uint8 else 1.0
        self._mean = torch.tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self._std = torch.tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def __getstate__(self):
        # the Python lists are rebuilt from the index tensor: pickling them
        # (checkpoints, offloaded clients) would cost a call per sample; device
        # copies are remade on first use
        return {k: v for k, v in vars(self).items() if k not in ("_positions", "targets", "_device_copies")}

    def __setstate__(self, state):
        vars(self).update(state)
        self._positions = self.index.tolist()
        self.targets = self.labels[self.index].tolist()

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, i):
        j = self._positions[i]
        # out of place: for float images .float() is the stored tensor itself
        x = (self.images[j].float() / self._scale - self._mean) / self._std
        return x, self.labels[j]

    def batch(self, positions: torch.Tensor, images: torch.Tensor, labels: torch.Tensor):
        """Samples ``positions`` (of this dataset) normalised, from ``images`` and
        ``labels``: the split's tensors or their copies on another device."""
        index, mean, std = self._on_device(images.device)
        index = index[positions.to(images.device)]
        return (images[index].float() / self._scale - mean) / std, labels[index]

    def _on_device(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The index, mean and std on ``device``, copied there once."""
        cache = self.__dict__.setdefault("_device_copies", {})
        if device not in cache:
            cache[device] = (self.index.to(device), self._mean.to(device), self._std.to(device))
        return cache[device]


def _digits(root: Path | None, download: bool) -> ImageData:
    if root is not None or download:  # read nowhere: given for another dataset, they would be silently ignored
        given = f"--data-root {str(root)!r}" if root is not None else "--download"
        raise FedavalUsageError(
            f"{given} is not read by the dataset digits (built in, from scikit-learn); drop it or choose a dataset "
            "that reads one (mnist, fashion-mnist, cifar10, cifar100, tiny-imagenet, imagefolder)"
        )
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    x = torch.tensor(bunch.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    # A fixed, stratified 70/30 split: part of the dataset, not of the run's seed.
    tr, te = train_test_split(np.arange(len(y)), test_size=0.3, random_state=0, stratify=bunch.target)
    return ImageData("digits", x[tr], y[tr], x[te], y[te], [str(i) for i in range(10)], mean=(0.305,), std=(0.380,))


def _need_root(root: Path | None, name: str) -> Path:
    if root is None:
        raise FedavalUsageError(f"dataset {name!r} needs --data-root (a folder holding it, or one to download into)")
    return root


def _torchvision(name: str, cls_name: str, mean, std) -> Callable[[Path | None, bool], ImageData]:
    def load(root: Path | None, download: bool) -> ImageData:
        import torchvision

        root = _need_root(root, name)
        cls = getattr(torchvision.datasets, cls_name)
        try:
            train = cls(str(root), train=True, download=download)
            test = cls(str(root), train=False, download=download)
        except RuntimeError as exc:
            raise FedavalUsageError(
                f"dataset {name!r} not found or corrupt under --data-root {str(root)!r} ({exc}); "
                f"pass --download to fetch it"
            ) from None

        def tensors(ds):
            data = ds.data
            data = torch.as_tensor(np.asarray(data))
            data = data.unsqueeze(1) if data.ndim == 3 else data.permute(0, 3, 1, 2)
            return data.contiguous(), torch.as_tensor(np.asarray(ds.targets), dtype=torch.int64)

        tx, ty = tensors(train)
        vx, vy = tensors(test)
        return ImageData(name, tx, ty, vx, vy, list(train.classes), mean, std)

    return load


CACHE_FORMAT = 2


def _cache_path(kind: str, root: Path) -> Path:
    """Where the decoded tensors of ``root`` are cached: named by a hash of
    what is read (:func:`_fingerprint`), so an added, removed, replaced or
    edited image or annotation file gives a new cache entry."""
    cache = Path(os.environ.get("FEDAVAL_CACHE", Path.home() / ".cache" / "fedaval"))
    stamp = f"{CACHE_FORMAT}:{kind}:{root.resolve()}:{_fingerprint(root)}"
    return cache / f"{kind}-{hashlib.sha1(stamp.encode()).hexdigest()[:16]}.pt"


def _fingerprint(root: Path) -> str:
    """A hash of every file under ``root``: relative path, size and
    modification time (nanoseconds). A folder's own modification time is not
    enough: it does not change when a file inside a sub-folder is added or
    edited (Tiny-ImageNet's ``val/val_annotations.txt``).

    The files are visited in ``os.walk(root, followlinks=True)``'s order
    (a folder's files by name, then its sub-folders by name; links followed),
    so the hash, and every cache named by it, is the one ``os.walk`` with
    ``os.path.relpath`` gave; :func:`os.scandir` and the relative path built as
    it goes save that walk's ``os.path`` work per file (a folder that cannot
    be listed is skipped, as ``os.walk`` skips it)."""
    digest = hashlib.sha1()

    def visit(folder: str, relative: str) -> None:
        files: list[os.DirEntry[str]] = []
        folders: list[os.DirEntry[str]] = []
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    (folders if is_dir else files).append(entry)
        except OSError:
            return
        for entry in sorted(files, key=lambda e: e.name):
            st = entry.stat()
            digest.update(f"{relative}{entry.name}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
        for entry in sorted(folders, key=lambda e: e.name):
            visit(entry.path, f"{relative}{entry.name}/")

    visit(str(root), "")
    return digest.hexdigest()


def _decode(paths: list[str], size: tuple[int, int] | None) -> torch.Tensor:
    from PIL import Image
    from tqdm import tqdm

    out = None
    # a progress bar on a terminal only (disable=None), for folders that take a while (Tiny-ImageNet: ~40 s)
    shown = tqdm(paths, desc="decoding images", unit="image", leave=False, disable=None if len(paths) >= 2000 else True)
    for i, path in enumerate(shown):
        try:
            with Image.open(path) as source:
                img = source.convert("RGB")
                if size is None:
                    size = img.size
                if img.size != size:
                    img = img.resize(size)
                arr = np.array(img, dtype=np.uint8)  # a writable copy: torch.from_numpy warns on read-only arrays
        except OSError as exc:
            raise FedavalUsageError(f"cannot read image {path!r}: {exc}") from None
        if out is None:
            out = torch.empty((len(paths), 3, arr.shape[0], arr.shape[1]), dtype=torch.uint8)
        out[i] = torch.from_numpy(arr).permute(2, 0, 1)
    if out is None:
        raise FedavalUsageError("no images found")
    return out


def _load_cached(
    kind: str,
    root: Path,
    build: Callable[[], dict],
    derived: tuple[tuple[str, ...], Callable[[dict], dict]] | None = None,
) -> dict:
    """The decoded tensors of ``root``: from the cache, or ``build()`` then
    cached. ``derived = (keys, derive)``: ``derive(data)`` gives the entries
    ``keys``, computed from the tensors (an image folder's normalisation),
    stored in the cache too, and added to a cache written before they were
    (which is then rewritten, once)."""
    path = _cache_path(kind, root)
    data = None
    if path.exists():
        try:
            data = torch.load(path, weights_only=True)
        except Exception:  # a torn or stale cache is rebuilt
            data = None
    if data is not None and (derived is None or all(key in data for key in derived[0])):
        return data
    if data is None:
        data = build()
    if derived is not None:
        data.update(derived[1](data))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(path, shared=True) as fh:  # runs side by side may build the same cache
            torch.save(data, fh)
    except OSError as exc:  # a cache is a saving, not a need: the run goes on with the decoded data
        import logging

        logging.getLogger("fedaval").warning(
            "cannot cache the decoded images in %s (%s): the next run decodes them again; "
            "FEDAVAL_CACHE names a writable folder",
            path.parent,
            exc.strerror or exc,
        )
    return data


def _imagefolder(root: Path | None, download: bool) -> ImageData:
    root = _need_root(root, "imagefolder")
    for split in ("train", "test"):
        if not (root / split).is_dir():
            raise FedavalUsageError(
                f"--data-root {str(root)!r} has no {split}/ folder; imagefolder expects train/<class>/ and test/<class>/"
            )
    classes = sorted(p.name for p in (root / "train").iterdir() if p.is_dir())
    if not classes:
        raise FedavalUsageError(f"--data-root {str(root)!r}: train/ holds no class folders")

    def build() -> dict:
        from torchvision.datasets import ImageFolder

        result = {}
        size = None
        for split in ("train", "test"):
            folder = ImageFolder(str(root / split))
            if folder.classes != classes:
                raise FedavalUsageError(
                    f"--data-root {str(root)!r}: test/ classes {folder.classes} differ from train/ classes {classes}"
                )
            x = _decode([p for p, _ in folder.samples], size)
            size = (x.shape[3], x.shape[2])
            result[split + "_x"] = x
            result[split + "_y"] = torch.tensor(folder.targets, dtype=torch.int64)
        return result

    data = _load_cached("imagefolder", root, build, derived=(("mean", "std"), _channel_statistics))
    return ImageData(
        "imagefolder",
        data["train_x"],
        data["train_y"],
        data["test_x"],
        data["test_y"],
        classes,
        tuple(data["mean"]),
        tuple(data["std"]),
    )


def _channel_statistics(data: dict) -> dict:
    """The training images' per-channel mean and standard deviation in [0, 1]
    (the normalisation of an image folder), computed from the uint8 pixels in
    float32 as they always were. Kept in the decoded cache: computing them
    makes two float copies of the images (1.2 GB for CIFAR-10's 50,000), at
    every load until they were kept (docs/performance.md, "pfl")."""
    pixels = data["train_x"].float()
    return {
        "mean": (pixels.mean(dim=(0, 2, 3)) / 255).tolist(),
        "std": (pixels.std(dim=(0, 2, 3)) / 255).tolist(),
    }


def _tiny_imagenet(root: Path | None, download: bool) -> ImageData:
    root = _need_root(root, "tiny-imagenet")
    base = root / "tiny-imagenet-200" if (root / "tiny-imagenet-200").is_dir() else root
    if not (base / "wnids.txt").is_file() or not (base / "val" / "val_annotations.txt").is_file():
        raise FedavalUsageError(
            f"--data-root {str(root)!r} is not a tiny-imagenet-200 folder (needs wnids.txt, train/, val/val_annotations.txt)"
        )
    wnids = (base / "wnids.txt").read_text().split()
    index = {w: i for i, w in enumerate(wnids)}

    def build() -> dict:
        train_paths, train_y = [], []
        for w in wnids:
            for p in sorted((base / "train" / w / "images").glob("*.JPEG")):
                train_paths.append(str(p))
                train_y.append(index[w])
        val_paths, val_y = [], []
        for line in (base / "val" / "val_annotations.txt").read_text().splitlines():
            parts = line.split("\t")
            if len(parts) >= 2:
                val_paths.append(str(base / "val" / "images" / parts[0]))
                val_y.append(index[parts[1]])
        return {
            "train_x": _decode(train_paths, (64, 64)),
            "train_y": torch.tensor(train_y),
            "test_x": _decode(val_paths, (64, 64)),
            "test_y": torch.tensor(val_y),
        }

    data = _load_cached("tiny-imagenet", base, build)
    return ImageData(
        "tiny-imagenet",
        data["train_x"],
        data["train_y"],
        data["test_x"],
        data["test_y"],
        wnids,
        mean=(0.480, 0.448, 0.398),
        std=(0.277, 0.269, 0.282),
    )


DATASETS: dict[str, Callable[[Path | None, bool], ImageData]] = {
    "digits": _digits,
    "mnist": _torchvision("mnist", "MNIST", (0.1307,), (0.3081,)),
    "fashion-mnist": _torchvision("fashion-mnist", "FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": _torchvision("cifar10", "CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": _torchvision("cifar100", "CIFAR100", (0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "tiny-imagenet": _tiny_imagenet,
    "imagefolder": _imagefolder,
}


def load_dataset(
    name: str, root: str | Path | None = None, download: bool = False, registry: dict | None = None
) -> ImageData:
    """Load dataset ``name`` of ``registry`` (a run's ``datasets``; default:
    the built-in :data:`DATASETS`); a missing or unreadable root is a
    one-line error."""
    registry = DATASETS if registry is None else registry
    if name not in registry:
        raise choice_error("dataset", name, sorted(registry))
    path = Path(root).expanduser() if root else None
    if path is not None and not path.exists() and not download:
        raise FedavalUsageError(f"--data-root {str(path)!r} does not exist")
    return registry[name](path, download)
