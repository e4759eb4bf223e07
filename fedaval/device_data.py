"""The device data path: minibatches gathered from tensors on ``--device``.

Avalanche's data loaders build a minibatch sample by sample: an index goes
through its dataset layers, our ``TensorImageDataset.__getitem__`` normalises
one image, and a collate function stacks the results. For the small images of
continual-learning benchmarks that Python work costs more than the model's
forward and backward pass. When the dataset fits in device memory, fedaval
keeps one copy of it there (uint8 images as stored, so CIFAR-10 takes 150 MB)
and builds each minibatch with one gather and one normalisation on the device.

Same batches, bit for bit: :class:`DeviceBatches` takes each minibatch's
indices from the very sampler Avalanche's loader would use, created the same
way (so it draws the same random numbers: the DataLoader iterator's seed, the
shuffling sampler's), and ``TensorImageDataset.batch`` normalises exactly as
``__getitem__`` does. A run gives the same results.json with ``--data-path
device`` and ``--data-path loader``; only the time differs.

Used when the strategy's dataset is a client's or the server's own dataset
(no plugin replaced it or the dataloader: Avalanche's ReplayPlugin, for
instance, brings its own loader, which is then used as it is).

The copy is made once per run and device (:func:`device_tensors`); loaders
refer to it through the run, so checkpoints never hold it. Augmentation
(``--augment standard``) is applied after this, to the gathered minibatch on
the device (``fedaval.training.standard_augment``), on either path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from fedaval.datasets import TensorImageDataset

if TYPE_CHECKING:
    from fedaval.run import Run

# "auto" uses the device path when the whole dataset takes at most this share
# of the free memory of a CUDA device (on the CPU: of this many bytes).
CUDA_SHARE = 0.5
CPU_BYTES = 8 * 2**30


def dataset_nbytes(run: Run) -> int:
    data = run.data
    return sum(t.numel() * t.element_size() for t in (data.train_x, data.train_y, data.test_x, data.test_y))


def use_device_path(run: Run) -> bool:
    """``--data-path``: ``device``, ``loader``, or ``auto`` (device when the
    dataset fits: under half the free CUDA memory, or 8 GiB on the CPU).
    Decided once per run, at its first data loader."""
    if run.use_device_path is None:
        choice = run.config.data_path
        if choice != "auto":
            run.use_device_path = choice == "device"
        elif run.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(run.device)
            run.use_device_path = dataset_nbytes(run) <= CUDA_SHARE * free
        else:
            run.use_device_path = dataset_nbytes(run) <= CPU_BYTES
    return run.use_device_path


def device_tensors(run: Run, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The run's ``split`` ("train"/"test") images and labels on ``run.device``,
    copied once (on the CPU they are the loaded tensors themselves)."""
    cache = run.device_tensors
    if split not in cache:
        data = run.data
        x, y = (data.train_x, data.train_y) if split == "train" else (data.test_x, data.test_y)
        cache[split] = (x.to(run.device), y.to(run.device))
    return cache[split]


def tensor_source(dataset: Any) -> TensorImageDataset | None:
    """The :class:`TensorImageDataset` behind an Avalanche dataset made by
    :mod:`fedaval.streams` (through ``.train()``/``.eval()`` views), or ``None``
    when ``dataset`` is anything else (a plugin's concatenation, say)."""
    datasets = getattr(dataset, "_datasets", None)
    while datasets is not None and len(datasets) == 1:
        inner = datasets[0]
        if isinstance(inner, TensorImageDataset):
            return inner if len(inner) == len(dataset) else None
        datasets = getattr(inner, "_datasets", None)
    return None


def torch_loader(loader: Any) -> DataLoader | None:
    """The single-process torch ``DataLoader`` that ``loader`` iterates: itself,
    or the one an Avalanche loader makes per epoch; ``None`` for other loaders."""
    if hasattr(loader, "_get_loader"):  # Avalanche's (Single|Multi)DatasetDataLoader and subclasses
        return loader if loader.loader_kwargs.get("num_workers", 0) == 0 else None
    if type(loader) is DataLoader and loader.num_workers == 0:
        return loader
    return None


def device_batches(run: Run, loader: Any, dataset: Any) -> DeviceBatches | None:
    """``loader`` on the device data path, or ``None`` when it does not apply."""
    source = tensor_source(dataset)
    if source is None or torch_loader(loader) is None or not use_device_path(run):
        return None
    split = run_split(run, source)
    return None if split is None else DeviceBatches(run, loader, source, split)


def eval_batches(run: Run, dataset: Any, batch_size: int) -> EvalBatches | None:
    """An evaluation loader over ``dataset`` on the device data path, made
    without Avalanche's or torch's loader, or ``None`` when it does not apply."""
    found = device_source(run, dataset)
    return None if found is None else EvalBatches(run, *found, batch_size)


def device_source(run: Run, dataset: Any) -> tuple[TensorImageDataset, str] | None:
    """``dataset``'s :class:`TensorImageDataset` and the run's split it reads
    (``"train"``/``"test"``) when the device data path applies to it, else ``None``."""
    source = tensor_source(dataset)
    if source is None or not use_device_path(run):
        return None
    split = run_split(run, source)
    return None if split is None else (source, split)


def draw_loader_seed() -> None:
    """Draw the one random number a torch ``DataLoader`` iterator draws (its
    base seed, from the global generator): what evaluation without the
    loader draws in its place, so every random stream stays where it was."""
    torch.empty((), dtype=torch.int64).random_()


def run_split(run: Run, source: TensorImageDataset) -> str | None:
    """``"train"`` or ``"test"``: the run's split whose tensors ``source`` reads, if any."""
    if source.images is run.data.train_x:
        return "train"
    if source.images is run.data.test_x:
        return "test"
    return None


def minibatch(
    source: TensorImageDataset, positions: torch.Tensor, images: torch.Tensor, labels: torch.Tensor
) -> list[torch.Tensor]:
    """``[x, y, task_labels]`` of ``source``'s samples ``positions``, as Avalanche's loaders yield them.

    On a GPU, ``positions`` (from the sampler, on the host) go over through
    pinned memory without blocking: a plain copy from pageable memory waits
    for every kernel queued before it, so the host would stop at every
    minibatch until the GPU caught up, instead of queueing the next step
    while the GPU runs this one (tests/test_gpu_syncs.py)."""
    if images.device.type == "cuda" and positions.device.type == "cpu":
        positions = positions.pin_memory().to(images.device, non_blocking=True)
    x, y = source.batch(positions, images, labels)
    return [x, y, torch.zeros(len(positions), dtype=torch.int64, device=x.device)]


class EvalBatches:
    """The minibatches Avalanche's evaluation loader would give over
    ``source`` (in order, ``batch_size`` each, the last one shorter), built on
    the device as :class:`DeviceBatches` builds them, without making that
    loader: an Avalanche loader and a torch ``DataLoader`` per evaluated
    experience cost more than evaluating a small experience. Its iterator
    draws the one random number a torch ``DataLoader`` iterator draws (its
    base seed, from the global generator, since fedaval's evaluation loaders
    have none of their own), so every random stream stays where the loader
    path leaves it (``tests/test_device_data.py``)."""

    def __init__(self, run: Run, source: TensorImageDataset, split: str, batch_size: int):
        self.run = run
        self.source = source
        self.split = split
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.source) // self.batch_size)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        draw_loader_seed()
        for batch in self._batches():
            yield list(batch)  # a list of its own: Avalanche's unpacking assigns into it

    def _batches(self) -> list[list[torch.Tensor]]:
        """The minibatches; the test split's are kept in the run's
        ``test_batches`` (:data:`TEST_BATCH_CACHE_BYTES`) and reused."""
        cache = self.run.test_batches if self.split == "test" else None
        key = (self.source, self.batch_size)
        if cache is not None and key in cache:
            return cache[key]
        images, labels = device_tensors(self.run, self.split)
        total = len(self.source)
        batches = []
        for start in range(0, total, self.batch_size):
            positions = torch.arange(start, min(start + self.batch_size, total), device=images.device)
            batches.append(minibatch(self.source, positions, images, labels))
        if cache is not None:
            keep_if_room(cache, key, batches)
        return batches


def joined_test_batches(
    run: Run, sources: list[TensorImageDataset], batch_size: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(x, y)`` minibatches of ``batch_size`` (the last one shorter) of the
    test samples of ``sources``, one source after the other, so that a
    minibatch may hold samples of two (``fedaval.one_pass_eval``); built on
    the device as :class:`EvalBatches` builds its minibatches, and kept in
    the run's ``test_batches`` (:data:`TEST_BATCH_CACHE_BYTES`) by sources
    and batch size."""
    cache = run.test_batches
    key = (tuple(sources), batch_size)
    if key in cache:
        return cache[key]
    images, labels = device_tensors(run, "test")
    parts = [source.batch(torch.arange(len(source), device=images.device), images, labels) for source in sources]
    x = parts[0][0] if len(parts) == 1 else torch.cat([x for x, _ in parts])
    y = parts[0][1] if len(parts) == 1 else torch.cat([y for _, y in parts])
    batches = list(zip(x.split(batch_size), y.split(batch_size), strict=True))
    for kept in [k for k in cache if isinstance(k[0], tuple) and k[1] == batch_size and prefix_of(k[0], key[0])]:
        del cache[kept]  # the same evaluator's sources before its last task began: not evaluated again
    keep_if_room(cache, key, batches)
    return batches


def prefix_of(short: tuple[Any, ...], long: tuple[Any, ...]) -> bool:
    """Whether ``short`` is ``long`` without one or more last items."""
    return len(short) < len(long) and all(a is b for a, b in zip(short, long, strict=False))


#: Evaluation's minibatches of the test split are kept in the run
#: (``run.test_batches``, by dataset and batch size), up to this many bytes
#: in all, on the run's device, and never in a checkpoint. Every round
#: evaluates the server and the trained clients on the same test
#: experiences, and gathering and normalising a minibatch costs about what a
#: small model's forward pass does (docs/performance.md, "Fixed cost per
#: round"). Reused minibatches are why evaluation must not change its
#: minibatch's tensors in place (nothing in fedaval or Avalanche's evaluation does).
TEST_BATCH_CACHE_BYTES = 512 * 2**20


def batch_bytes(batches: Sequence[Sequence[torch.Tensor]]) -> int:
    return sum(t.nbytes for batch in batches for t in batch)


def keep_if_room(cache: dict[Any, Any], key: Any, batches: list[Any]) -> None:
    """Keep ``batches`` in ``cache`` under ``key`` if the cache stays within
    :data:`TEST_BATCH_CACHE_BYTES`."""
    if cached_bytes(cache) + batch_bytes(batches) <= TEST_BATCH_CACHE_BYTES:
        cache[key] = batches


def cached_bytes(cache: dict[Any, list[list[torch.Tensor]]]) -> int:
    return sum(batch_bytes(batches) for batches in cache.values())


class DeviceBatches:
    """Iterates like the Avalanche loader ``loader`` over ``source``, yielding
    ``[x, y, task_labels]`` built on the device from whole-minibatch indices."""

    def __init__(self, run: Run, loader: Any, source: TensorImageDataset, split: str):
        self.run = run
        self.loader = loader
        self.source = source
        self.split = split

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[list[torch.Tensor]]:
        images, labels = device_tensors(self.run, self.split)
        # Making the torch DataLoader's iterator draws the same random numbers as
        # the loader path does (its base seed, then the sampler's), and
        # _next_index() gives each minibatch's indices without fetching samples.
        loader = self.loader._get_loader() if hasattr(self.loader, "_get_loader") else self.loader
        batches = iter(loader)
        while True:
            try:
                positions = batches._next_index()
            except StopIteration:
                return
            yield minibatch(self.source, torch.as_tensor(positions, dtype=torch.int64), images, labels)
