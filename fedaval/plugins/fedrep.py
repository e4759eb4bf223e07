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

The global model (A_glo, ``global_accuracy``). FedRep has no global head:
the server only averages bodies. GLDP's Table 2 nonetheless reports a FedRep
A_glo (62.68 on CIFAR-10 [20,4,5]), i.e. a global model with a head.
Reading: after each round's fusion the server's head is the plain mean of
the heads of the clients that trained in the round (``global_head=mean``),
set on the server's model for evaluation only: it is read from the clients'
models in the simulation, never uploaded (no bytes are counted) and never
sent (the head is not a shared key). ``global_head=none`` keeps the server's
untrained head (A_glo near chance, by construction).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from fedaval import hookimpl
from fedaval.options import option
from fedaval.plugin import Plugin
from fedaval.plugins.personal import PersonalHead, resolve_phases, uniform_average


@dataclass
class FedRepOptions:
    head_epochs: int | None = option(None, "local epochs of the head, first in each round (default: E - body_epochs)")
    body_epochs: int | None = option(None, "local epochs of the shared body, after the head (default: 1)")
    global_head: Literal["mean", "none"] = option(
        "mean",
        "the server's head for evaluating the global model: mean of the round's client heads (never "
        "sent), or none (untrained)",
    )


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
            run.config.local_epochs,
            o.head_epochs,
            o.body_epochs,
            default_first=lambda e: e - 1,
            names=("head_epochs", "body_epochs"),
            owner=self.name,
        )

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        """The global model's head for evaluation (see the module docstring)."""
        if self.options.global_head != "mean":
            return
        heads = [run.clients[u.client_id].model.classifier.state_dict() for u in uploads]
        if heads:
            run.server.model.classifier.load_state_dict(uniform_average(heads))
