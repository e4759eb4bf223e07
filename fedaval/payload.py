"""What crosses the network: uploads, downloads, and their size in bytes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Upload:
    """One client's upload in one round.

    ``num_samples`` is the size of the client's current task data (the
    FedAvg weight); ``entries`` are what the plugins' ``fedaval_client_upload``
    returned, merged."""

    client_id: int
    num_samples: int
    entries: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        return self.entries.get(key, default)

    @property
    def nbytes(self) -> int:
        return payload_nbytes(self.entries) + payload_nbytes(self.num_samples)


def payload_nbytes(obj: Any) -> int:
    """Bytes needed to send ``obj``: tensor storage for tensors (numel times
    element size), 8 per plain number, recursing into dicts, lists and
    tuples. Dict keys are counted as 8 bytes each (a class id or a short name)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (bool, int, float)):
        return 8
    if obj is None:
        return 0
    if isinstance(obj, str):
        return len(obj.encode())
    if isinstance(obj, dict):
        return sum(8 + payload_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(payload_nbytes(v) for v in obj)
    from fedaval.errors import PluginError

    raise PluginError(
        f"a payload holds a {type(obj).__name__}; payloads are tensors, numbers, strings, and dicts, lists and "
        "tuples of them"
    )


def copy_into(targets: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
    """``target.copy_(value)`` for each pair, as one ``torch._foreach_copy_``:
    on a GPU one launch per few dozen tensors of a device and dtype instead
    of one per tensor (a ResNet-18 state dict has 122), the same bytes."""
    if targets:
        with torch.no_grad():
            torch._foreach_copy_(list(targets), list(values))


def copies(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """A detached copy of each tensor (``tensor.detach().clone()``), made by
    :func:`copy_into` (under ``no_grad``) into fresh tensors of the same
    shape and layout."""
    fresh = [torch.empty_like(t, memory_format=torch.preserve_format) for t in tensors]
    copy_into(fresh, tensors)
    return fresh


def check_finite(payload: Any, what: str) -> None:
    """Raise ``FloatingPointError`` if any tensor or number in ``payload`` is
    NaN or infinite, naming the first such entry (``what[key][i]...``).

    The tensors' checks are queued on their devices and read back together,
    once per device: on a GPU, reading each tensor's answer on its own waits
    for the device once per tensor (a ResNet-18 upload has about 100). A
    tensor is finite when its largest absolute value is (NaN propagates
    through the maximum): one ``torch._foreach_norm(..., inf)`` per device
    and dtype instead of an ``isfinite`` and an ``all`` per tensor."""
    check = FiniteCheck(payload, what)
    check.settle([flags.tolist() for flags in check.flags])


class FiniteCheck:
    """:func:`check_finite` in two halves: made, it queues the tensors'
    checks on their devices (``flags``: per device, one bool per tensor,
    not read yet); :meth:`settle` takes what was read of them and raises as
    :func:`check_finite` does. Between the two the host does not wait for
    the device, so a caller can read many checks (and anything else on the
    device) in one transfer: the in-process backend reads every client's
    checks of a round at once (:func:`fedaval.backends.local.settle`)."""

    def __init__(self, payload: Any, what: str):
        entries: list[tuple[str, Any]] = []  # (path, a floating-point tensor or a float), in payload order

        def walk(value: Any, path: str) -> None:
            if isinstance(value, torch.Tensor):
                if value.is_floating_point():
                    entries.append((path, value))
            elif isinstance(value, float):
                entries.append((path, value))
            elif isinstance(value, dict):
                for key, item in value.items():
                    walk(item, f"{path}[{key!r}]")
            elif isinstance(value, (list, tuple)):
                for i, item in enumerate(value):
                    walk(item, f"{path}[{i}]")

        walk(payload, what)
        self.entries = entries
        groups: dict[torch.device, dict[torch.dtype, list[int]]] = {}
        for index, (_, value) in enumerate(entries):
            if isinstance(value, torch.Tensor) and value.numel():  # an empty tensor is finite
                groups.setdefault(value.device, {}).setdefault(value.dtype, []).append(index)
        self.indices: list[list[int]] = []  # per device, the entries its flags answer for
        self.flags: list[torch.Tensor] = []
        for by_dtype in groups.values():
            largest = [
                m.float()
                for same in by_dtype.values()
                for m in torch._foreach_norm([entries[i][1] for i in same], math.inf)
            ]
            self.indices.append([i for same in by_dtype.values() for i in same])
            self.flags.append(torch.isfinite(torch.stack(largest)))

    def settle(self, read: Sequence[Sequence[float]]) -> None:
        """Raise for the first non-finite entry, given ``read``: each of
        ``flags`` as a list (``flags[i].tolist()``, or its values as floats)."""
        finite = [math.isfinite(value) if isinstance(value, float) else True for _, value in self.entries]
        for indices, flags in zip(self.indices, read):
            for i, flag in zip(indices, flags):
                finite[i] = bool(flag)
        for (path, value), flag in zip(self.entries, finite):
            if not flag:
                raise FloatingPointError(f"{path} holds {value if isinstance(value, float) else 'non-finite values'}")


def merge_entries(results: list[dict[str, Any] | None], what: str, pm: Any, hook: str) -> dict[str, Any]:
    """Merge the results ``[{entry: value}, ...]`` of the plugin manager
    ``pm``'s ``hook``; a result that is not a dict, or an entry named twice,
    is a bug in a plugin (:class:`~fedaval.errors.PluginError`, naming the
    plugins that implement ``hook``: pluggy's results do not say which plugin
    returned which)."""
    from fedaval.errors import PluginError, implementers

    def by() -> str:
        return f" ({hook} is implemented by {implementers(pm, hook)})"

    merged: dict[str, Any] = {}
    for result in results:
        if not result:
            continue
        if not isinstance(result, dict):
            raise PluginError(
                f"a plugin's {what} hook returned a {type(result).__name__}; expected a dict of entries{by()}"
            )
        for key, value in result.items():
            if key in merged:
                raise PluginError(f"two plugins return the {what} entry {key!r}{by()}")
            merged[key] = value
    return merged
