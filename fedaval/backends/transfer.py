"""What a client's round sends between the driver and a worker process.

The Ray backend (:mod:`fedaval.backends.ray`) keeps every client on the
driver, as the in-process backend does, and sends a client's whole state to
a worker for its round and back (see that module for why). The state of
client ``k`` is the :class:`~fedaval.client.Client` object: model,
optimizer, Avalanche strategy and plugins, evaluator, random streams, and the
plugins' per-client state in ``client.stash`` (the rule in
:mod:`fedaval.hookspecs`). It is pickled as one object, so what its parts
share (an Avalanche plugin held by the strategy and by the stash) stays one
object. As in :mod:`fedaval.state`, the run's shared objects (the run, its
data tensors, the plugin objects, the TensorBoard loggers) are written as
references and resolved against the receiving process's run, built from the
same configuration; so are the plugins' ``nn.Module`` attributes (HGP's frozen
backbone), which are built the same way on both sides. Tensors on a CUDA
device are re-created on the receiving run's device, so a driver on ``cuda:1``
and a worker whose one GPU is ``cuda:0`` understand each other.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fedaval import state

if TYPE_CHECKING:
    from fedaval.run import Run

__all__ = ["dumps", "loads", "shared_names"]


def shared_names(run: Run, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`fedaval.state.shared_objects`, each plugin's ``nn.Module``
    attributes (:func:`fedaval.state.plugin_modules`), and ``extra``."""
    return state.shared_objects(run, {**state.plugin_modules(run), **(extra or {})})


class _RelocatingPickler(state.RunPickler):
    """Writes a CUDA tensor as its CPU copy, re-created on the receiver's device."""

    def __init__(self, file, shared: dict[str, Any], run: Run):
        super().__init__(file, shared)
        self._run = run

    def reducer_override(self, obj: Any) -> Any:
        import torch

        reference = super().reducer_override(obj)  # the run's shared objects stay references
        if reference is not NotImplemented:
            return reference
        if isinstance(obj, torch.Tensor) and obj.device.type == "cuda":
            is_parameter = isinstance(obj, torch.nn.Parameter)
            return _on_receiver_device, (obj.detach().cpu(), obj.requires_grad, is_parameter, self._run)
        return NotImplemented


def _on_receiver_device(data, requires_grad: bool, is_parameter: bool, run: Run):
    """Rebuild a tensor written by :class:`_RelocatingPickler` on ``run.device``
    (``run`` is the receiving run: it is written as a reference)."""
    import torch

    tensor = data.to(run.device)
    if is_parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def dumps(run: Run, obj: Any, extra: dict[str, Any] | None = None) -> bytes:
    """Pickle ``obj`` for another process holding a run of the same
    configuration; ``extra`` names more objects to write as references.

    Raises ``TypeError`` naming what cannot be pickled."""
    buffer = io.BytesIO()
    shared = shared_names(run, extra)
    pickler = _RelocatingPickler(buffer, shared, run) if run.device.type == "cuda" else state.RunPickler(buffer, shared)
    try:
        pickler.dump(obj)
    except (pickle.PicklingError, TypeError, AttributeError) as exc:
        raise TypeError(f"cannot send the client's state: {exc}") from exc
    return buffer.getvalue()


def loads(
    run: Run, data: bytes, extra: dict[str, Any] | None = None, missing: Callable[[str], Any] | None = None
) -> Any:
    """Unpickle what :func:`dumps` wrote, resolving references against ``run``
    and ``extra``; ``missing(name)`` supplies a reference neither has (else
    it is an ``UnpicklingError``)."""
    return state.RunUnpickler(io.BytesIO(data), shared_names(run, extra), missing).load()
