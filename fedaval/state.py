"""Saving a run's live objects (clients, server, plugin state) as bytes.

A client is much more than its ``state_dict``: its optimizer, the Avalanche
plugins' memories and teachers, the dataloader kept for the rest of a task,
the evaluator's metric history, method state on the client. Rather than asking
every plugin to describe its state, fedaval pickles the objects themselves,
like Avalanche's own ``save_checkpoint`` does, with one difference: objects
the run shares and can rebuild from its configuration (the run itself, its
dataset tensors, the plugin objects, the TensorBoard loggers) are written as
references (:class:`RunPickler`) and resolved against the new run when
loaded. So a client's bytes hold the client's own state and index arrays,
never a copy of the dataset, and objects shared between a plugin and a client
stay one object after loading.

Used by checkpoints (:mod:`fedaval.checkpoint`) and offloaded clients
(:meth:`fedaval.client.Client.offload`). A client offloaded to memory is
pickled with ``keep`` (:class:`KeptStorages`): its tensors' storages are kept
as they are, by reference, instead of being serialised into the bytes (most of
the cost of pickling a small client); the pickle holds the rest of its state.
A checkpoint pickles the run's objects with ``KeptStorages(copy=True)``: a copy
of every storage as it is at the end of the round (a memory copy, where torch's
own pickling of a storage runs ``torch.save`` once per storage: 28,700 storages
for 1000 live ``cnn`` clients), written to the file later, in the background.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterator
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


def plugin_objects(run: Run) -> Iterator[tuple[str, Any]]:
    """``(name, object)`` of every plugin object with attributes (modules have none)."""
    from types import ModuleType

    for name, plugin in run.plugins.objects.items():
        if not isinstance(plugin, ModuleType) and hasattr(plugin, "__dict__"):
            yield name, plugin


def plugin_modules(run: Run) -> dict[str, Any]:
    """Each plugin object's ``nn.Module`` attributes (HGP's frozen backbone),
    named ``plugin.<name>.<attribute>``, and their parameters and buffers
    (``...<attribute>/<parameter>``: an optimizer built over a model holds a
    frozen part's parameters too): what a client's state refers to instead of
    copying (an offloaded client, a Ray transfer)."""
    from torch import nn

    named: dict[str, Any] = {}
    for name, plugin in plugin_objects(run):
        for attr, value in vars(plugin).items():
            if isinstance(value, nn.Module):
                prefix = f"plugin.{name}.{attr}"
                named[prefix] = value
                named.update((f"{prefix}/{key}", tensor) for key, tensor in value.named_parameters())
                named.update((f"{prefix}/{key}", tensor) for key, tensor in value.named_buffers())
    return named


class KeptStorages:
    """The tensor storages an in-memory pickle refers to instead of holding
    their bytes (:func:`dumps` with ``keep``): the storages themselves, so
    keeping them copies nothing (with ``copy``, as a checkpoint keeps them:
    a copy of each as it is now); a CUDA storage is kept as a CPU copy (an
    offloaded client frees its device memory) and goes back to its device
    when loaded, as pickling and unpickling it would.

    A :class:`KeptStorages` pickles (into a checkpoint) as every storage's raw
    bytes, with each one's kind, dtype and device, and unpickles to equal
    storages on their devices."""

    def __init__(self, copy: bool = False) -> None:
        self.storages: list[Any] = []  # UntypedStorage on the CPU (TypedStorage in checkpoints of format 2 and 3)
        self.devices: list[str | None] = []  # where each goes back to when loaded; None: the CPU
        self.copy = copy  # keep a copy of each CPU storage as it is now (a checkpoint), not the storage
        self._index: dict[tuple[str, int, int], int] = {}

    def keep(self, storage: Any) -> int:
        """Keep ``storage`` (with ``copy``, a copy of it) as an untyped
        storage; its index. A storage kept twice (two tensors sharing it, of
        one dtype or two) is kept once, so it is shared again when loaded: the
        dtype goes with each reference (:class:`RunPickler`), not with the
        bytes."""
        untyped = _untyped(storage)
        key = (str(untyped.device), untyped.data_ptr(), untyped.nbytes())
        if key[2] and key in self._index:
            return self._index[key]
        if untyped.device.type == "cpu":
            self.devices.append(None)
            if self.copy:
                untyped = untyped.clone()
        else:
            self.devices.append(str(untyped.device))
            untyped = untyped.cpu()
        self.storages.append(untyped)
        self._index[key] = len(self.storages) - 1
        return len(self.storages) - 1

    def get(self, index: int) -> Any:
        storage, device = self.storages[index], self.devices[index]
        return storage if device is None else _retyped(storage, _untyped(storage).to(device=device))

    @property
    def nbytes(self) -> int:
        return sum(_untyped(s).nbytes() for s in self.storages)

    def __len__(self) -> int:
        return len(self.storages)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Each storage's bytes: with protocol 5 as a ``pickle.PickleBuffer``,
        which pickle writes from the storage's memory as it is, with no copy
        into a bytes object first (a checkpoint of 1000 ``cnn`` clients holds
        400 MB of them)."""
        import torch

        layout, chunks = [], []
        for storage, device in zip(self.storages, self.devices):
            untyped = _untyped(storage)
            typed = None if untyped is storage else str(storage.dtype).removeprefix("torch.")
            layout.append((typed, device, untyped.nbytes()))
            memory = torch.empty(0, dtype=torch.uint8).set_(untyped).numpy()
            chunks.append(pickle.PickleBuffer(memory.data) if protocol >= 5 else memory.tobytes())
        return (_unpack_buffers, (layout, chunks))


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


def _unpack_buffers(layout: list[tuple[str | None, str | None, int]], chunks: list[Any]) -> KeptStorages:
    """A :class:`KeptStorages` from what its ``__reduce_ex__`` wrote: each
    storage's bytes (``bytes`` or ``bytearray``), copied into a storage of its own."""
    import torch

    kept = KeptStorages()
    for (typed, device, nbytes), chunk in zip(layout, chunks, strict=True):
        if nbytes:  # writable memory for frombuffer (an in-band PickleBuffer loads as a bytearray)
            data = torch.frombuffer(chunk if isinstance(chunk, bytearray) else bytearray(chunk), dtype=torch.uint8)
            data = data.clone()  # a storage of its own (one over a bytearray cannot be resized)
        else:
            data = torch.empty(0, dtype=torch.uint8)
        untyped = data.untyped_storage()
        if typed is None:
            kept.storages.append(untyped)
        else:
            kept.storages.append(torch.TypedStorage(wrap_storage=untyped, dtype=getattr(torch, typed), _internal=True))
        kept.devices.append(device)
    return kept


def _unpack_storages(layout: list[tuple[str | None, str | None, int]], data: bytes) -> KeptStorages:
    """What ``KeptStorages.__reduce__`` wrote until session 10 (every
    storage's bytes in one ``bytes``; checkpoints of format 2 hold it)."""
    chunks, offset = [], 0
    view = memoryview(data)
    for _, _, nbytes in layout:
        chunks.append(view[offset : offset + nbytes])
        offset += nbytes
    return _unpack_buffers(layout, chunks)


class RunPickler(pickle.Pickler):
    """Writes the objects of ``shared`` (name -> object) as references, and
    with ``keep`` every tensor storage as a reference into ``keep``.

    A reference is written by ``reducer_override`` as a call of
    :func:`_shared` (or :func:`_kept`) that :class:`RunUnpickler` resolves.
    pickle offers ``reducer_override`` only objects other than exact ``int``,
    ``float``, ``str``, ``bytes``, ``tuple``, ``list``, ``dict``, ``set`` and
    ``frozenset`` (and ``None``, ``True``, ``False``), so such a shared value
    (the data's ``mean`` tuple) is written as a value; and the pickler's
    Python code runs for about a tenth of the objects that ``persistent_id``
    (until session 10) ran for: about 350,000 of the 3 million objects of
    1000 ``cnn`` clients. A plain ``OrderedDict`` (an ``nn.Module`` holds a
    dozen: its parameters, buffers, submodules and hooks) is written as its
    own reduction writes it, without the per-object ``copyreg._slotnames``
    call that reduction makes.

    With ``keep``, a plain tensor or parameter (dense, on the CPU or a CUDA
    device, no Python attributes, hooks, conjugate or negative bit: every
    tensor of fedaval's models, optimizers and Avalanche plugins) is written
    as one call of :func:`_kept_tensor` (its storage's index in ``keep``,
    offset, size, stride, dtype, ``requires_grad``) rather than through
    torch's ``__reduce_ex__``, which wraps the storage in three
    ``TypedStorage`` objects and checks a dozen tensor kinds on the way
    (about 45 us a tensor; a checkpoint of 1000 ``cnn`` clients holds 28,000
    tensors). What is loaded is what torch's own reduction loads: a tensor of
    that dtype, size and stride over the storage, ``requires_grad`` as it
    was, no gradient. Any other tensor takes torch's way."""

    def __init__(self, file: IO[bytes], shared: dict[str, Any], keep: KeptStorages | None = None):
        super().__init__(file, protocol=PROTOCOL)
        self._names = {id(obj): name for name, obj in shared.items()}
        self._keep = keep
        if keep is not None:
            import torch

            self._storage_types = (torch.TypedStorage, torch.UntypedStorage)
            self._tensor_types: dict[type, bool] = {torch.Tensor: False, torch.nn.Parameter: True}  # is a parameter
            self._strided = torch.strided

    def reducer_override(self, obj: Any) -> Any:
        name = self._names.get(id(obj))
        if name is not None:
            return _shared, (name,)
        kind = type(obj)
        if kind is OrderedDict and not obj.__dict__:
            # OrderedDict's own reduction, without its call of copyreg._slotnames, which cannot
            # cache its answer on a built-in type (about 2 us each; every nn.Module holds a dozen)
            return OrderedDict, (), None, None, iter(obj.items())
        if self._keep is not None:
            if kind in self._tensor_types:
                return self._reduce_tensor(obj, self._tensor_types[kind])
            if kind in self._storage_types and _untyped(obj).device.type in ("cpu", "cuda"):
                index = self._keep.keep(obj)
                if kind is self._storage_types[0]:  # a TypedStorage: its dtype goes with the reference
                    return _kept_typed, (index, str(obj.dtype).removeprefix("torch."))
                return _kept, (index,)
        return NotImplemented

    def _reduce_tensor(self, tensor: Any, parameter: bool) -> Any:
        if (
            tensor.layout != self._strided
            or tensor.device.type not in ("cpu", "cuda")
            or tensor.is_quantized
            or tensor.is_nested
            or tensor.is_conj()
            or tensor.is_neg()
            or tensor._backward_hooks
            or tensor.__dict__
        ):
            return NotImplemented  # torch's own reduction
        index = self._keep.keep(tensor.untyped_storage())  # type: ignore[union-attr]
        layout = (tensor.storage_offset(), tuple(tensor.size()), tensor.stride(), tensor.dtype)
        return _kept_tensor, (index, *layout, tensor.requires_grad, parameter)


def _shared(name: str) -> Any:
    """A reference :class:`RunPickler` wrote: only :class:`RunUnpickler` resolves it."""
    raise pickle.UnpicklingError(f"saved state refers to the run's {name!r}: load it with fedaval.state.load")


def _kept(index: int) -> Any:
    """A kept storage :class:`RunPickler` wrote: only :class:`RunUnpickler` resolves it."""
    raise pickle.UnpicklingError("saved state refers to kept tensor storages: load it with fedaval.state.load")


def _kept_typed(index: int, dtype: str) -> Any:
    """A kept storage of a ``TypedStorage``: only :class:`RunUnpickler` resolves it."""
    return _kept(index)


def _kept_tensor(index: int, *layout: Any) -> Any:
    """A tensor over a kept storage (:meth:`RunPickler._reduce_tensor`): only
    :class:`RunUnpickler` resolves it."""
    return _kept(index)


class RunUnpickler(pickle.Unpickler):
    """Resolves references against ``shared`` (and storage references against
    ``keep``); ``missing(name)`` supplies one it lacks (else an
    ``UnpicklingError``). Pickles written with ``persistent_id`` references
    (before session 10: checkpoints of format 1 and 2) are read too."""

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
        self._loaded: dict[int, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if module == __name__ and name in self._resolvers:
            return getattr(self, self._resolvers[name])
        return super().find_class(module, name)

    _resolvers = {
        "_shared": "_resolve",
        "_kept": "_resolve_kept",
        "_kept_typed": "_resolve_kept_typed",
        "_kept_tensor": "_resolve_kept_tensor",
    }

    def persistent_load(self, pid: str | int) -> Any:
        return self._resolve_kept(pid) if isinstance(pid, int) else self._resolve(pid)

    def _resolve_kept(self, index: int) -> Any:
        """Kept storage ``index``, on its device: loaded once, so tensors that
        shared a storage share it again (on a CUDA device too)."""
        if self._keep is None:
            raise pickle.UnpicklingError("saved state refers to kept tensor storages, which were not given")
        storage = self._loaded.get(index)
        if storage is None:
            storage = self._loaded[index] = self._keep.get(index)
        return storage

    def _resolve_kept_typed(self, index: int, dtype: str) -> Any:
        import torch

        untyped = _untyped(self._resolve_kept(index))
        return torch.TypedStorage(wrap_storage=untyped, dtype=getattr(torch, dtype), _internal=True)

    def _resolve_kept_tensor(
        self,
        index: int,
        offset: int,
        size: tuple[int, ...],
        stride: tuple[int, ...],
        dtype: Any,
        grad: bool,
        param: bool,
    ) -> Any:
        import torch

        untyped = _untyped(self._resolve_kept(index))
        tensor = torch.empty((0,), dtype=dtype, device=untyped.device).set_(untyped, offset, size, stride)
        if param:
            return torch.nn.Parameter(tensor, requires_grad=grad)
        tensor.requires_grad = grad
        return tensor

    def _resolve(self, name: str) -> Any:
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

    Raises :class:`~fedaval.errors.PluginError` naming the plugin and
    attribute that cannot be pickled (a plugin holding a lock, an open file
    or a lambda, say), or the client's Avalanche plugin that cannot be (one
    holding a ``DataLoader`` iterator), else ``TypeError`` naming the object;
    either on one line, whatever the pickler raised."""
    try:
        with no_cyclic_gc():
            RunPickler(file, shared_objects(run, extra), keep).dump(obj)
    except (MemoryError, OSError):
        raise  # no room, not an object that cannot be pickled
    except Exception as exc:  # noqa: BLE001 - any refusal (a DataLoader iterator raises NotImplementedError)
        from fedaval.errors import PluginError, one_line

        culprit = _unpicklable_plugin_attribute(obj) or _unpicklable_client_part(run, obj, extra)
        if culprit:  # a plugin's mistake: one line, not a traceback
            raise PluginError(f"cannot save the run's state: {one_line(exc)}{culprit}") from exc
        raise TypeError(f"cannot save the run's state: {one_line(exc)}") from exc


def _unpicklable_client_part(run: Run, obj: Any, extra: dict[str, Any] | None) -> str:
    """``"; client 3's Avalanche plugin AGEMPlugin holds it (...)"``: the first
    Avalanche plugin of a client's strategy, or entry of its stash, that
    cannot be pickled, when ``obj`` holds clients (a checkpoint's
    ``"clients"``, an offloaded client's parts); ``""`` otherwise."""
    if not isinstance(obj, dict):
        return ""
    parts = [(obj.get("strategy"), obj.get("stash"))] if "strategy" in obj else []
    parts += [(c.__dict__.get("strategy"), c.__dict__.get("stash")) for c in obj.get("clients") or []]
    shared = shared_objects(run, extra)

    def refused(value: Any) -> bool:
        try:
            RunPickler(io.BytesIO(), shared).dump(value)
        except Exception:  # noqa: BLE001 - any refusal names the part
            return True
        return False

    for strategy, stash in parts:
        if strategy is None:
            continue
        who = f"client {strategy.client.id}'s" if strategy.client is not None else "the server's"
        for plugin in strategy.plugins:
            if plugin is strategy.evaluator or type(plugin).__module__ == "fedaval.strategy":
                continue  # the evaluator, and the HookBridge (the client's link to the run's hooks)
            if refused(plugin):
                return (
                    f"; {who} Avalanche plugin {type(plugin).__name__} holds it (a client's Avalanche plugins "
                    "are saved with it, in checkpoints and offloaded clients)"
                )
        for key, value in getattr(stash, "_values", {}).items():
            if refused(value):
                return f"; {who} stash entry {key!r} holds it (a plugin's per-client state, saved with the client)"
    return ""


def _unpicklable_plugin_attribute(obj: Any) -> str:
    """``"; plugin 'x' holds it in attribute 'lock' (...)"``: the first plugin
    state entry a plain pickle refuses, when ``obj`` is a checkpoint's objects
    (its ``"plugins"``: name -> state dict); ``""`` otherwise. Plugin
    attributes are pickled into every checkpoint
    (:meth:`fedaval.plugin.Plugin.state_dict`)."""
    plugins = obj.get("plugins") if isinstance(obj, dict) else None
    for name, saved in (plugins or {}).items():
        for key, value in saved.items() if isinstance(saved, dict) else []:
            try:
                pickle.dumps(value)
            except Exception:  # noqa: BLE001 - any refusal names the attribute
                return (
                    f"; plugin {name!r} holds it in attribute {key!r} (plugin attributes are checkpointed: "
                    "leave it out of an overriding state_dict and rebuild it in fedaval_setup)"
                )
    return ""


def load(run: Run, file: IO[bytes], extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> Any:
    """Unpickle what :func:`dump` wrote (with the same ``keep``), resolving
    references against ``run`` (and ``extra``)."""
    with no_cyclic_gc():
        return RunUnpickler(file, shared_objects(run, extra), keep=keep).load()


@contextlib.contextmanager
def no_cyclic_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (if it was on).
    Pickling or unpickling a run's state allocates objects by the million,
    which sets off full collections over every live object: with 1000 live
    ``cnn`` clients (3 million objects) about 1 s of a 4 s checkpoint.
    Reference counting still frees what the block drops."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def dumps(run: Run, obj: Any, extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> bytes:
    buffer = io.BytesIO()
    dump(run, obj, buffer, extra, keep)
    return buffer.getvalue()


def loads(run: Run, data: bytes, extra: dict[str, Any] | None = None, keep: KeptStorages | None = None) -> Any:
    return load(run, io.BytesIO(data), extra, keep)
