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
(:meth:`fedaval.client.Client.offload`).
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
    shared.update(extra or {})
    return shared


class RunPickler(pickle.Pickler):
    """Writes the objects of ``shared`` (name -> object) as references."""

    def __init__(self, file: IO[bytes], shared: dict[str, Any]):
        super().__init__(file, protocol=PROTOCOL)
        self._names = {id(obj): name for name, obj in shared.items()}

    def persistent_id(self, obj: Any) -> str | None:
        return self._names.get(id(obj))


class RunUnpickler(pickle.Unpickler):
    """Resolves references against ``shared``; ``missing(name)`` supplies one
    it lacks (else an ``UnpicklingError``)."""

    def __init__(self, file: IO[bytes], shared: dict[str, Any], missing: Callable[[str], Any] | None = None):
        super().__init__(file)
        self._shared = shared
        self._missing = missing

    def persistent_load(self, name: str) -> Any:
        if name in self._shared:
            return self._shared[name]
        if self._missing is not None:
            return self._missing(name)
        raise pickle.UnpicklingError(f"saved state refers to {name!r}, which this run does not have")


def dump(run: Run, obj: Any, file: IO[bytes], extra: dict[str, Any] | None = None) -> None:
    """Pickle ``obj`` to ``file``, writing ``run``'s shared objects (and
    ``extra``) as references.

    Raises ``TypeError`` naming the object that cannot be pickled (a plugin
    holding an open file or a lambda, say)."""
    try:
        RunPickler(file, shared_objects(run, extra)).dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"cannot save the run's state: {exc}") from exc


def load(run: Run, file: IO[bytes], extra: dict[str, Any] | None = None) -> Any:
    """Unpickle what :func:`dump` wrote, resolving references against ``run`` (and ``extra``)."""
    return RunUnpickler(file, shared_objects(run, extra)).load()


def dumps(run: Run, obj: Any, extra: dict[str, Any] | None = None) -> bytes:
    buffer = io.BytesIO()
    dump(run, obj, buffer, extra)
    return buffer.getvalue()


def loads(run: Run, data: bytes, extra: dict[str, Any] | None = None) -> Any:
    return load(run, io.BytesIO(data), extra)
