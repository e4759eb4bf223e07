"""Saving a run's live objects (clients, server, plugin state) as bytes.

A client is much more than its ``state_dict``: its optimizer, the Avalanche
plugins' memories and teachers, the dataloader kept for the rest of a task,
the evaluator's metric history, method state on the client. Rather than asking
every plugin to describe its state, fedaval pickles the objects themselves,
like Avalanche's own ``save_checkpoint`` does, with one difference: objects
the run shares and can rebuild from its configuration (the run itself, its
dataset tensors, the plugin objects, the TensorBoard loggers) are written as
references (pickle's persistent ids) and resolved against the new run when
loaded. So a client's bytes hold the client's own state and index arrays,
never a copy of the dataset, and objects shared between a plugin and a client
stay one object after loading.

Used by checkpoints (:mod:`fedaval.checkpoint`) and offloaded clients
(:meth:`fedaval.client.Client.offload`). A client offloaded to memory is
pickled with ``keep`` (:class:`KeptStorages`): its tensors' storages are kept
as they are, by reference, instead of being serialised into the bytes (most of
the cost of pickling a small client); the pickle holds the rest of its state.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fedaval.run import Run

PROTOCOL = 5


def shared_objects(run: Run, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The objects of ``run`` that state refers to by name, never stores, plus
    ``extra`` (an offloaded client refers to itself this way)."""
    shared: dict[str, Any] = {"run": run, "run.pm": run.pm, "run.hook": run.hook, "run.data": run.data}
    for name in ("train_x", "train_y", "test_x", "test_y", "mean", "std"):
        value = getattr(run.data, name, None)
        if value is not None:
            shared[f"run.data.{name}"] = value
    for name, plugin in run.plugins.objects.items():
        shared[f"plugin.{name}"] = plugin
    for owner, logger in run.loggers.items():
        shared[f"logger.{owner}"] = logger
    for name, experience in run.test_experiences.items():  # clients' test experiences (fedaval.streams)
        if experience is not None:
            shared[name] = experience
    shared.update(extra or {})
    return shared


class KeptStorages:
    """The tensor storages an in-memory pickle refers to instead of holding
    their bytes (:func:`dumps` with ``keep``): the storages themselves, so
    keeping them copies nothing; a CUDA storage is kept as a CPU copy (an
    offloaded client frees its device memory) and goes back to its device
    when loaded, as pickling and unpickling it would.

    A :class:`KeptStorages` pickles (into a checkpoint, say) as one bytes
    object holding every storage's data, with each one's kind, dtype and
    device, and unpickles to equal storages on their devices."""

    def __init__(self) -> None:
        self.storages: list[Any] = []  # TypedStorage or UntypedStorage, on the CPU
        self.devices: list[str | None] = []  # where each goes back to when loaded; None: the CPU

    def keep(self, storage: Any) -> int:
        """Keep ``storage``; its index."""
        untyped = _untyped(storage)
        if untyped.device.type == "cpu":
            self.devices.append(None)
        else:
            self.devices.append(str(untyped.device))
            storage = _retyped(storage, untyped.cpu())
        self.storages.append(storage)
        return len(self.storages) - 1

    def get(self, index: int) -> Any:
        storage, device = self.storages[index], self.devices[index]
        return storage if device is None else _retyped(storage, _untyped(storage).to(device=device))

    @property
    def nbytes(self) -> int:
        return sum(_untyped(s).nbytes() for s in self.storages)

    def __len__(self) -> int:
        return len(self.storages)

    def __reduce__(self):
        import numpy as np
        import torch

        layout, chunks = [], []
        for storage, device in zip(self.storages, self.devices):
            untyped = _untyped(storage)
            typed = None if untyped is storage else str(storage.dtype).removeprefix("torch.")
            layout.append((typed, device, untyped.nbytes()))
            chunks.append(torch.empty(0, dtype=torch.uint8).set_(untyped).numpy())
        data = np.concatenate(chunks).tobytes() if chunks else b""
        return (_unpack_storages, (layout, data))


def _untyped(storage: Any) -> Any:
    """The ``UntypedStorage`` of a storage (torch's deprecated ``TypedStorage``
    API warns when used directly)."""
    return getattr(storage, "_untyped_storage", storage)


def _retyped(like: Any, untyped: Any) -> Any:
    """``untyped`` as the same kind of storage as ``like`` (typed: same dtype)."""
    import torch

    if like is _untyped(like):
        return untyped
    return torch.TypedStorage(wrap_storage=untyped, dtype=like.dtype, _internal=True)


def _unpack_storages(layout: list[tuple[str | None, str | None, int]], data: bytes) -> KeptStorages:
    """A :class:`KeptStorages` from what its ``__reduce__`` wrote."""
    import torch

    kept = KeptStorages()
    buffer = bytearray(data)
    offset = 0
    for typed, device, nbytes in layout:
        if nbytes:
            chunk = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=offset).clone()
        else:
            chunk = torch.empty(0, dtype=torch.uint8)
        offset += nbytes
        untyped = chunk.untyped_storage()
        if typed is None:
            kept.storages.append(untyped)
        else:
            kept.storages.append(torch.TypedStorage(wrap_storage=untyped, dtype=getattr(torch, typed), _internal=True))
        kept.devices.append(device)
    return kept


class RunPickler(pickle.Pickler):
    """Writes the objects of ``shared`` (name -> object) as references, and
    with ``keep`` every tensor storage as a reference into ``keep``."""

    def __init__(self, file: IO[bytes], shared: dict[str, Any], keep: KeptStorages | None = None):
        super().__init__(file, protocol=PROTOCOL)
        self._names = {id(obj): name for name, obj in shared.items()}
        self._keep = keep
        if keep is not None:
            import torch

            self._storage_types = (torch.TypedStorage, torch.UntypedStorage)

    def persistent_id(self, obj: Any) -> str | int | None:
        name = self._names.get(id(obj))
        if name is not None or self._keep is None:
            return name
        if type(obj) in self._storage_types and _untyped(obj).device.type in ("cpu", "cuda"):
            return self._keep.keep(obj)  # an int: names are strings
        return None


class RunUnpickler(pickle.Unpickler):
    """Resolves references against ``shared`` (and storage references against
    ``keep``); ``missing(name)`` supplies one it lacks (else an
    ``UnpicklingError``)."""

    def __init__(
        self,
        file: IO[bytes],
        shared: dict[str, Any],
        missing: Callable[[str], Any] | None = None,
        keep: KeptStorages | None = None,
    ):
        super().__init__(file)
        self._shared = shared
        self._missing = missing
        self._keep = keep

    def persistent_load(self, name: str | int) -> Any:
        if isinstance(name, int):
            if self._keep is None:
                raise pickle.UnpicklingError("saved state refers to kept tensor storages, which were not given")
            return self._keep.get(name)
        if name in self._shared:
            return self._shared[name]
        if self._missing is not None:
            return self._missing(name)
        raise pickle.UnpicklingError(f"saved state refers to {name!r}, which this run does not have")


def dump(
    run: Run, obj: Any, file: IO[bytes], extra: dict[str, Any] | None = None, keep: KeptStorages | None = None
) -> None:
    """Pickle ``obj`` to ``file``, writing ``run``'s shared objects (and
    ``extra``) as references; with ``keep``, tensor storages are kept there
    (by reference) instead of being written.

    Raises ``TypeError`` naming the object that cannot be pickled (a plugin
    holding an open file or a lambda, say)."""
    try:
        RunPickler(file, shared_objects(run, extra), keep).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"cannot save the run's state: {exc}") from exc


def load(run: Run, file: IO[bytes], extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> Any:
    """Unpickle what :func:`dump` wrote (with the same ``keep``), resolving
    references against ``run`` (and ``extra``)."""
    return RunUnpickler(file, shared_objects(run, extra), keep=keep).load()


def dumps(run: Run, obj: Any, extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> bytes:
    buffer = io.BytesIO()
    dump(run, obj, buffer, extra, keep)
    return buffer.getvalue()


def loads(run: Run, data: bytes, extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> Any:
    return load(run, io.BytesIO(data), extra, keep)
