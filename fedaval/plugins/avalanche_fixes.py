"""Avalanche training plugins with what a federated run needs changed.

``--plugins avalanche:<Class>`` gives each client one of these instead of
Avalanche's class where one is listed in
:data:`fedaval.plugins.avalanche_bridge.VARIANTS`: Avalanche's plugin
unchanged but for the lines each docstring names.

* :class:`CopyingSynapticIntelligencePlugin`: Avalanche's
  ``SynapticIntelligencePlugin`` stores the weights it compares as
  ``param.detach().cpu().flatten()`` (``extract_weights``). On a CUDA device
  ``.cpu()`` copies; on the CPU it returns the parameter itself, so the
  "old" weights are a view of the weights being trained, every weight change
  it measures is 0 and every importance 0: a bug of Avalanche's (0.6.0),
  centralised runs on the CPU included, which made
  ``avalanche:SynapticIntelligencePlugin`` FedAvg to the last digit.
* :class:`FiniteRWalkPlugin`: Avalanche's ``RWalkPlugin`` scales each task's
  scores by their maximum, and its importances by theirs; a task of fewer
  than ``delta_t`` steps (a small client, or one sampled in few of the
  task's rounds) has no score checkpoint, every score 0, and the penalties
  are 0/0 = NaN: the client's loss is NaN ever after and the run leaves it
  out of every round. A maximum of 0 makes that term 0 here (no score, no
  penalty from it); every other value is Avalanche's.
* :class:`RoundAGEMPlugin`, :class:`RoundMIRPlugin`, :class:`RoundRARPlugin`:
  these keep a live iterator over their memory between ``train()`` calls
  (AGEM's ``buffer_dliter``, MIR's ``replay_loader``, a generator cycling a
  ``DataLoader``, RAR's ``iter_replay``). An iterator cannot be pickled, so a
  checkpoint or an offloaded client cannot hold it; and what it would yield
  after a resume cannot be made the uninterrupted run's. So each round starts
  a fresh iterator over the same memory (its ``before_training``, which
  fedaval runs every round: :mod:`fedaval.strategy`), drawn with the client's
  random streams, and the pickled plugin holds none. Centrally the iterator
  runs on through an experience; here it starts anew in each of a task's
  rounds: the memory minibatches are drawn the same way (at random), only
  not continuing the last round's pass.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from avalanche.training.plugins import AGEMPlugin, MIRPlugin, RARPlugin, RWalkPlugin, SynapticIntelligencePlugin
from avalanche.training.plugins.mir import cycle

__all__ = [
    "CopyingSynapticIntelligencePlugin",
    "FiniteRWalkPlugin",
    "RoundAGEMPlugin",
    "RoundMIRPlugin",
    "RoundRARPlugin",
]


class CopyingSynapticIntelligencePlugin(SynapticIntelligencePlugin):
    """``SynapticIntelligencePlugin`` whose stored weights are copies where
    Avalanche's are views of the parameters (a model on the CPU; see the
    module docstring): the anchor weights of each task's start
    (``ewc_data[0]``) and the weights before each step (``old_theta``).
    The other stored tensors are read as soon as they are taken."""

    def before_training_exp(self, strategy, **kwargs):
        super().before_training_exp(strategy, **kwargs)
        _own_copies(strategy, self.ewc_data[0])

    def before_training_iteration(self, strategy, **kwargs):
        super().before_training_iteration(strategy, **kwargs)
        _own_copies(strategy, self.syn_data["old_theta"])


def _own_copies(strategy: Any, stored: dict[str, Any]) -> None:
    """Give each of ``stored`` (``ParamData`` by name) its own memory where
    ``.cpu()`` made none: when the model is on the CPU."""
    if torch.device(strategy.device).type != "cpu":
        return
    for data in stored.values():
        data.data = data.data.clone()


class FiniteRWalkPlugin(RWalkPlugin):
    """``RWalkPlugin`` whose penalties are finite when a task gave no score
    or no importance (module docstring): Avalanche's
    ``imp / max_imp + relu(score) / max_score`` (Eq. 8 of the RWalk paper,
    each term scaled to [0, 1]) with a term whose maximum is 0 taken as 0."""

    @torch.no_grad()
    def after_training_exp(self, strategy, *args, **kwargs):
        super().after_training_exp(strategy, *args, **kwargs)
        assert self.exp_scores is not None and self.exp_importance is not None and self.exp_penalties is not None
        max_score = max(x.data.max() for x in self.exp_scores.values())
        max_imp = max(x.data.max() for x in self.exp_importance.values())
        if max_score != 0 and max_imp != 0:
            return  # Avalanche's penalties, finite
        for name, penalty in self.exp_penalties.items():
            imp, score = self.exp_importance[name].data, self.exp_scores[name]
            term_imp = imp / max_imp if max_imp != 0 else torch.zeros_like(imp)
            relu = F.relu(score.expand(imp.shape))
            penalty.data = term_imp + (relu / max_score if max_score != 0 else torch.zeros_like(relu))


class RoundAGEMPlugin(AGEMPlugin):
    """``AGEMPlugin`` whose memory iterator starts anew every round and is
    not pickled (module docstring)."""

    def before_training(self, strategy, **kwargs):
        super().before_training(strategy, **kwargs)
        if self.buffer_dataloader is not None:
            self.buffer_dliter = iter(self.buffer_dataloader)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["buffer_dliter"] = iter([])  # Avalanche's placeholder; before_training makes the round's
        return state


class RoundMIRPlugin(MIRPlugin):
    """``MIRPlugin`` whose memory loader starts anew every round and is not
    pickled (module docstring). The ``DataLoader`` it cycles (over the memory
    without the classes of the task's last minibatch) is kept as
    ``replay_source``."""

    def after_training_exp(self, strategy, **kwargs):
        super().after_training_exp(strategy, **kwargs)
        self.replay_source = (
            None if self.replay_loader is None else inspect.getgeneratorlocals(self.replay_loader)["loader"]
        )

    def before_training(self, strategy, **kwargs):
        super().before_training(strategy, **kwargs)
        source = getattr(self, "replay_source", None)
        self.replay_loader = None if source is None else cycle(source)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["replay_loader"] = None  # before_training makes the round's from replay_source
        return state


class RoundRARPlugin(RARPlugin):
    """``RARPlugin`` whose memory iterator starts anew every round and is not
    pickled (module docstring): Avalanche's ``get_buffer_batch`` makes one from
    ``replay_loader`` when there is none."""

    def before_training(self, strategy, **kwargs):
        super().before_training(strategy, **kwargs)
        self.__dict__.pop("iter_replay", None)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("iter_replay", None)
        return state
