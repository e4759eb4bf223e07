"""FedProx (Li et al., MLSys 2020): a proximal term keeps local training near
the global model.

Each client minimises ``F_k(w) + mu/2 * ||w - w^t||^2`` (Li et al. 2020,
Eq. 2), where ``w^t`` is the global model received this round. The term is a
``fedaval_client_loss`` term, computed over the client's *shared* parameters
(the weights it received; a local head is not pulled anywhere). Fusion is
FedAvg's, unchanged.
"""

from __future__ import annotations

import dataclasses

import torch

from fedaval import hookimpl
from fedaval.options import non_negative, option
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

ANCHOR = StashKey[dict]("fedprox.anchor")  # {parameter name: global value this round}


def proximal_term(params, anchor, mu: float):
    """``mu/2 * sum_j ||params[j] - anchor[j]||^2`` over the keys of ``anchor``
    (Li et al. 2020, Eq. 2). Its gradient w.r.t. ``params[j]`` is
    ``mu * (params[j] - anchor[j])``; ``anchor`` gets none."""
    total = None
    for key, ref in anchor.items():
        term = (params[key] - ref.detach()).pow(2).sum()
        total = term if total is None else total + term
    if total is None:
        return torch.zeros(())
    return 0.5 * mu * total


class FedProx(Plugin):
    """FedProx: FedAvg plus the proximal term ``mu/2 ||w - w_global||^2``."""

    name = "fedprox"
    description = "FedProx: local loss + mu/2 * ||w - w_global||^2 against this round's global weights"

    @dataclasses.dataclass
    class Options:
        mu: float = option(0.01, "weight of the proximal term (Li et al. try 0.001..1)", non_negative)

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        weights = download.get("weights") or {}
        names = {name for name, _ in client.model.named_parameters()}
        client.stash[ANCHOR] = {
            key: value.detach().clone().to(run.device)
            for key, value in weights.items()
            if key in names and key in client.shared_keys
        }

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        anchor = client.stash.get(ANCHOR)
        if not anchor:
            return None
        params = dict(client.model.named_parameters())
        return {"proximal": proximal_term(params, anchor, self.options.mu)}

    @hookimpl
    def fedaval_client_upload(self, run, client):
        client.stash.pop(ANCHOR, None)  # only needed during the round
        return None
