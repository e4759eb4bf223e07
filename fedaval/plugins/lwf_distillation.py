"""FedLwF's client plugin: Avalanche's ``LwFPlugin``, its old classes' columns picked on the device.

Avalanche's ``LearningWithoutForgetting._distillation_loss`` picks the old
classes' outputs of the current and the old model with a Python list
(``out[:, list(active_units)]``). On a GPU that list becomes a tensor on the
host, copied to the device and waited for, twice a minibatch (docs/performance.md,
"Waits for the GPU in the methods"). Here the list is made a tensor on the
device once per class set and device, and the columns are picked with
``index_select``: the same values, and with no class listed twice the same
gradients, bit for bit. Everything else is Avalanche's plugin unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from avalanche.training import LearningWithoutForgetting
from avalanche.training.plugins import LwFPlugin

__all__ = ["DeviceIndexLwF", "DeviceIndexLwFPlugin"]


class DeviceIndexLwF(LearningWithoutForgetting):
    """``LearningWithoutForgetting`` whose distillation picks the old classes with a device index."""

    def _distillation_loss(self, out, prev_out, active_units):
        index = self._index(list(active_units), out.device)  # Avalanche's order of the classes
        log_p = torch.log_softmax(out.index_select(1, index) / self.temperature, dim=1)
        q = torch.softmax(prev_out.index_select(1, index) / self.temperature, dim=1)
        return torch.nn.functional.kl_div(log_p, q, reduction="batchmean")

    def _index(self, units: list[int], device: torch.device) -> torch.Tensor:
        """``units`` as a tensor on ``device``, made once per class list and device."""
        cache: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = self.__dict__.setdefault("_indices", {})
        key = (tuple(units), device)
        if key not in cache:
            cache.clear()  # the class set of an earlier task: not used again
            cache[key] = torch.tensor(units, dtype=torch.long, device=device)
        return cache[key]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(vars(self))
        state.pop("_indices", None)  # remade where the plugin is loaded
        return state


class DeviceIndexLwFPlugin(LwFPlugin):
    """``LwFPlugin`` whose distillation is :class:`DeviceIndexLwF`'s."""

    def __init__(self, alpha=1, temperature=2):
        super().__init__(alpha=alpha, temperature=temperature)
        self.lwf = DeviceIndexLwF(alpha, temperature)
