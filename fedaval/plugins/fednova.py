"""FedNova (Wang et al., NeurIPS 2020): normalised averaging, so that clients
taking more local steps do not drag the global model towards their objective.

Client k, starting from the global ``x``, takes ``tau_k`` local SGD steps and
ends at ``x_k``. Its normalised update is ``d_k = (x - x_k) / ||a_k||_1``
(Wang et al. 2020, Eq. 6-7), where for plain SGD ``a_k = [1, ..., 1]`` so
``||a_k||_1 = tau_k``; with momentum rho,
``||a_k||_1 = (tau_k - rho (1 - rho^tau_k) / (1 - rho)) / (1 - rho)``
(Wang et al. 2020, Section 5 / Appendix: local momentum). The server takes
``x <- x - tau_eff * sum_k p_k d_k`` with ``p_k = n_k / sum_j n_j`` and
``tau_eff = sum_k p_k ||a_k||_1`` (the paper's default choice, Eq. 8).

Readings chosen:

* ``tau_k`` is the number of optimizer steps the client took this round
  (``fedaval_client_step`` calls), reset when the client receives the
  broadcast, kept in ``client.stash`` and uploaded as ``"fednova_steps"``.
* ``momentum`` is the run's ``--momentum`` (0 by default: plain SGD).
* Only trainable parameters are normalised; other shared floating-point
  entries (BatchNorm running statistics) are not moved by gradient steps and
  get FedAvg's sample-weighted mean.
* A client that took no step is left out of the fusion.
"""

from __future__ import annotations

import torch

from fedaval import hookimpl
from fedaval.plugin import Plugin
from fedaval.plugins.fedavg import weighted_average
from fedaval.stash import StashKey

STEPS = StashKey[int]("fednova.steps")


def local_step_norm(tau: int, momentum: float = 0.0) -> float:
    """``||a_k||_1`` for ``tau`` local SGD steps with momentum ``momentum``:
    ``tau`` for plain SGD (Wang et al. 2020, Section 5)."""
    if momentum == 0:
        return float(tau)
    rho = momentum
    return (tau - rho * (1 - rho**tau) / (1 - rho)) / (1 - rho)


def fednova_fuse(global_weights, local_weights, num_samples, step_norms):
    """FedNova's update of every key of ``global_weights`` (Wang et al. 2020, Eq. 6-8):

    ``x - tau_eff * sum_k p_k (x - x_k) / a_k``, ``p_k = n_k / sum n``,
    ``tau_eff = sum_k p_k a_k``, with ``a_k = step_norms[k]``. Equals FedAvg
    when every ``a_k`` is the same."""
    total = float(sum(num_samples))
    p = [n / total for n in num_samples]
    tau_eff = sum(pk * ak for pk, ak in zip(p, step_norms))
    fused = {}
    for key, x in global_weights.items():
        direction = torch.zeros_like(x, dtype=torch.float64)
        for local, pk, ak in zip(local_weights, p, step_norms):
            direction += (x.to(torch.float64) - local[key].to(torch.float64)) * (pk / ak)
        fused[key] = (x.to(torch.float64) - tau_eff * direction).to(x.dtype)
    return fused


class FedNova(Plugin):
    """FedNova: normalised averaging of the clients' updates by local step count."""

    name = "fednova"
    description = "FedNova: each client's update divided by its local steps, rescaled by tau_eff (normalised averaging)"

    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.training import require_sgd

        require_sgd(run.config, "fednova", "its normalisation a_k counts local SGD steps with --momentum")

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        client.stash[STEPS] = 0

    @hookimpl
    def fedaval_client_step(self, run, client, batch):
        client.stash[STEPS] = client.stash.get(STEPS, 0) + 1

    @hookimpl
    def fedaval_client_upload(self, run, client):
        return {"fednova_steps": client.stash.get(STEPS, 0)}

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        used = [u for u in uploads if u.get("weights") and u.get("fednova_steps", 0) > 0 and u.num_samples > 0]
        if not used:
            return None
        params = {name for name, _ in run.server.model.named_parameters()}
        trained = {k: v for k, v in global_weights.items() if k in params}
        norms = [local_step_norm(u.get("fednova_steps"), run.config.momentum) for u in used]
        fused = fednova_fuse(trained, [u.get("weights") for u in used], [u.num_samples for u in used], norms)
        others = weighted_average(
            [{k: v for k, v in u.get("weights").items() if k not in params} for u in used],
            [u.num_samples for u in used],
        )
        return {**others, **fused}
