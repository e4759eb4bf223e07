"""FedAvg (McMahan et al., 2017): sample-weighted averaging of the shared weights.

Registered in every run as the default: every hook here is ``trylast``, so a
method that shares fewer keys, uploads differently or fuses differently
overrides it by implementing the same hook.
"""

from __future__ import annotations

import torch

from fedaval import hookimpl
from fedaval.plugin import Plugin


def weighted_average(states, weights):
    """sum_k w_k * state_k / sum_k w_k, key by key, over the states that have
    the key (McMahan et al. 2017, Algorithm 1). Returns float tensors in the
    dtype of the first state."""
    keys: list[str] = []
    for state in states:
        keys += [k for k in state if k not in keys]
    fused = {}
    for key in keys:
        pairs = [(state[key], w) for state, w in zip(states, weights) if key in state]
        total = float(sum(w for _, w in pairs))
        if total <= 0:
            continue
        acc = torch.zeros_like(pairs[0][0], dtype=torch.float64)
        for tensor, w in pairs:
            acc += tensor.to(torch.float64) * (w / total)
        fused[key] = acc.to(pairs[0][0].dtype)
    return fused


class FedAvg(Plugin):
    """FedAvg: share every floating-point weight, average by sample count."""

    name = "fedavg"
    description = "FedAvg: upload all floating-point weights, sample-weighted average (the default fusion)"

    @hookimpl(trylast=True)
    def fedaval_shared_keys(self, run, model):
        return [key for key, value in model.state_dict().items() if value.is_floating_point()]

    @hookimpl(trylast=True)
    def fedaval_client_upload(self, run, client):
        return {"weights": client.shared_state()}

    @hookimpl(trylast=True)
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        with_weights = [u for u in uploads if u.get("weights")]
        if not with_weights:
            return None
        return weighted_average([u.get("weights") for u in with_weights], [u.num_samples for u in with_weights])
