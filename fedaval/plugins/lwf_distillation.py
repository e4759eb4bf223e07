"""FedLwF's client plugin: Avalanche's ``LwFPlugin``, its old classes' columns picked on the device.

Avalanche's ``LearningWithoutForgetting._distillation_loss`` picks the old
classes' outputs of the current and the old model with a Python list
(``out[:, list(active_units)]``). On a GPU that list becomes a tensor on the
host, copied to the device and waited for, twice a minibatch (docs/performance.md,
"Waits for the GPU in the methods"). Here the list is made a tensor on the
device once per class set and device (:func:`fedaval.prototypes.class_index`,
the prototype methods' cache), and the columns are picked with
``index_select``: the same values, and with no class listed twice the same
gradients, bit for bit. Everything else is Avalanche's plugin unchanged.
"""

from __future__ import annotations

import torch
from avalanche.training import LearningWithoutForgetting
from avalanche.training.plugins import LwFPlugin

from fedaval.prototypes import class_index

__all__ = ["DeviceIndexLwF", "DeviceIndexLwFPlugin"]


class DeviceIndexLwF(LearningWithoutForgetting):
    """``LearningWithoutForgetting`` whose distillation picks the old classes with a device index."""

    def _distillation_loss(self, out, prev_out, active_units):
        index = class_index(tuple(active_units), str(out.device))  # Avalanche's order of the classes
        log_p = torch.log_softmax(out.index_select(1, index) / self.temperature, dim=1)
        q = torch.softmax(prev_out.index_select(1, index) / self.temperature, dim=1)
        return torch.nn.functional.kl_div(log_p, q, reduction="batchmean")


class DeviceIndexLwFPlugin(LwFPlugin):
    """``LwFPlugin`` whose distillation is :class:`DeviceIndexLwF`'s."""

    def __init__(self, alpha=1, temperature=2):
        super().__init__(alpha=alpha, temperature=temperature)
        self.lwf = DeviceIndexLwF(alpha, temperature)
