"""FedRep (Collins, Hassani, Mokhtari, Shakkottai, ICML 2021, "Exploiting
shared representations for personalized federated learning"; a GLDP
baseline).

The body (``model.features``) is shared and averaged over the sampled
clients with equal weights (FedRep's Algorithm 1, line "phi = 1/n sum
phi_i"); the head (``model.classifier``) stays on the client. Each round a
client first trains its head with the body frozen, then the body with its
head frozen (Algorithm 1: tau_h head steps, then tau body steps).

Epochs: ``--local-epochs`` E per round; ``head_epochs`` + ``body_epochs``
must equal E when both are given; by default the body gets 1 epoch and the
head the other E - 1 (the paper trains the head for many epochs and the
representation for one); with E = 1 both train together (see
:mod:`fedaval.plugins.personal`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from fedaval import hookimpl
from fedaval.options import option
from fedaval.plugin import Plugin
from fedaval.plugins.personal import PersonalHead, resolve_phases


@dataclass
class FedRepOptions:
    head_epochs: Optional[int] = option(None, "local epochs of the head, first in each round (default: E - body_epochs)")
    body_epochs: Optional[int] = option(None, "local epochs of the shared body, after the head (default: 1)")


class FedRep(PersonalHead, Plugin):
    """FedRep: averaged body, local head trained first each round."""

    name = "fedrep"
    description = "FedRep: shared body averaged, personal head kept local and trained first each round"
    Options = FedRepOptions
    phase_order = ("head", "base")

    @hookimpl
    def fedaval_setup(self, run):
        o = self.options
        self.phases = resolve_phases(
            run.config.local_epochs, o.head_epochs, o.body_epochs,
            default_first=lambda e: e - 1, names=("head_epochs", "body_epochs"), owner=self.name,
        )
