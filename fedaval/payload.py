"""What crosses the network: uploads, downloads, and their size in bytes."""

from __future__ import annotations

import math
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
    raise TypeError(f"cannot count the bytes of a {type(obj).__name__} in a payload")


def check_finite(payload: Any, what: str) -> None:
    """Raise ``FloatingPointError`` if any tensor or number in ``payload`` is NaN or infinite."""
    if isinstance(payload, torch.Tensor):
        if payload.is_floating_point() and not bool(torch.isfinite(payload).all()):
            raise FloatingPointError(f"{what} holds non-finite values")
    elif isinstance(payload, float):
        if not math.isfinite(payload):
            raise FloatingPointError(f"{what} holds {payload}")
    elif isinstance(payload, dict):
        for key, value in payload.items():
            check_finite(value, f"{what}[{key!r}]")
    elif isinstance(payload, (list, tuple)):
        for i, value in enumerate(payload):
            check_finite(value, f"{what}[{i}]")


def merge_entries(results: list[dict[str, Any] | None], what: str) -> dict[str, Any]:
    """Merge hook results ``[{entry: value}, ...]``; an entry named twice is a bug in a plugin."""
    merged: dict[str, Any] = {}
    for result in results:
        if not result:
            continue
        for key, value in result.items():
            if key in merged:
                raise RuntimeError(f"two plugins return the {what} entry {key!r}")
            merged[key] = value
    return merged
