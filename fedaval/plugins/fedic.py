"""FEDIC: calibrated ensemble distillation (Shang et al., ICME 2022, "FEDIC:
Federated Learning on Non-IID and Long-Tailed Data via Calibrated
Distillation"); one of GLDP's baselines for long-tailed federated learning
(``--scenario sthfl``).

The method, as read here (no paper file is in the repository; this is our
reading of the paper):

* Clients train as in FedAvg and upload their weights and, as the upload
  entry ``fedic_counts``, the sample count of each class in their current
  task's data (``K`` numbers, counted in ``bytes_up``).
* Proxy set on the server: a small class-balanced set of
  ``proxy_per_class`` training samples of each class. ``proxy=held-out``
  (default): drawn (seeded by ``--seed``) from the training samples that no
  client holds, so the server's data are disjoint from the clients' (GLDP's
  ``sthfl`` scenario uses a long-tailed fraction of the data and leaves the
  rest unused); ``proxy=train``: drawn from the whole training set, which may
  overlap the clients' data (for scenarios that hand out every sample).
  Every class the federation will see must have ``proxy_per_class``
  samples, otherwise the run stops before training with one line naming the
  missing classes. At stage t the proxy set holds the classes the
  federation has seen up to stage t. Its labels are used only to fit the
  calibration gate; the distillation uses its images unlabelled.
* Ensemble: the client models of the round (rebuilt on the server from their
  uploaded weights) and their mean logits on the proxy images.
* Calibration: logit adjustment of the ensemble, ``z - tau log(pi)``, with
  ``pi`` the class distribution of the round's uploads (sum of the clients'
  counts, additive ``smoothing``, so classes nobody holds now, those of
  earlier stages, get a large finite boost). Reading of the calibration
  gating network: a single linear unit on the FedAvg global model's
  features gives a per-sample weight ``g`` in [0, 1] and the teacher is
  ``z - g tau log(pi)``; the unit is fitted on the labelled proxy set
  (cross-entropy of the teacher, ``gate_steps`` SGD steps of ``gate_lr``).
  ``calibration=full``: g = 1 (plain logit adjustment); ``none``: g = 0
  (the raw ensemble, an ablation).
* Distillation: the FedAvg global model is trained for ``distill_steps`` SGD
  steps (``distill_lr``, minibatches of ``distill_batch`` proxy images) on
  ``T^2 KL(softmax(teacher/T) || softmax(student/T))``, ``T =
  temperature``. The distilled model is the global model: it is evaluated
  and it is the next round's broadcast.

Round metrics (``plugin_metrics.fedic``): the gate's mean value, the
distillation loss of the first and last step, and the proxy-set accuracy of
the raw and calibrated ensembles (``fedic_proxy_acc_ensemble``,
``fedic_proxy_acc_calibrated``).

Needs a global model whose classifier is shared (not ``fedrep``, ``gldp``,
``pfcl``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import at_least_one, non_negative, option, positive
from fedaval.plugin import Plugin
from fedaval.plugins.creff import require_shared_head
from fedaval.plugins.fedic_math import (
    calibrated_logits,
    class_prior,
    distil,
    ensemble_logits,
    gate_values,
    train_gate,
)
from fedaval.streams import make_dataset

ENTRY = "fedic_counts"


@dataclass
class FEDICOptions:
    proxy: Literal["held-out", "train"] = option(
        "held-out", "where the server's proxy set comes from: training samples no client holds, or any training samples"
    )
    proxy_per_class: int = option(5, "proxy samples per class on the server", at_least_one)
    tau: float = option(1.0, "logit-adjustment strength tau", non_negative)
    smoothing: float = option(1.0, "additive smoothing of the class counts behind the prior", positive)
    calibration: Literal["gated", "full", "none"] = option(
        "gated", "gated: learned gate on the logit adjustment; full: gate = 1; none: raw ensemble"
    )
    gate_steps: int = option(100, "SGD steps fitting the calibration gate per round", non_negative)
    gate_lr: float = option(0.1, "learning rate of the calibration gate", positive)
    temperature: float = option(2.0, "distillation temperature T", positive)
    distill_steps: int = option(100, "SGD steps of distillation into the global model per round", non_negative)
    distill_lr: float = option(0.01, "learning rate of the distillation", positive)
    distill_batch: int = option(32, "minibatch size of the distillation", at_least_one)


class FEDIC(Plugin):
    """FEDIC: FedAvg + ensemble of client models, logit-adjusted with a gate, distilled into the global model."""

    name = "fedic"
    description = "FEDIC: calibrated (logit-adjusted, gated) ensemble distilled into the global model on proxy data"
    Options = FEDICOptions

    def __init__(self, options=None):
        super().__init__(options)
        self.proxy: dict[int, np.ndarray] = {}  # class -> training indices of the server's proxy set
        self.metrics: dict[str, float] = {}

    # --- proxy set -------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        if not self.proxy:  # a resumed run keeps its proxy set
            self.proxy = proxy_indices(run, self.options.proxy, self.options.proxy_per_class)

    @hookimpl
    def fedaval_server_task_start(self, run, task):
        if task == 0:
            require_shared_head(run, self.name)

    def proxy_data(self, run) -> tuple[torch.Tensor, torch.Tensor]:
        """Images (normalised as the run's data) and labels of the proxy set
        for the classes the federation has seen so far."""
        seen = run.federation_seen_classes()
        idx = np.concatenate([self.proxy[c] for c in seen])
        dataset = make_dataset(run.data, "train", idx)
        x, y = next(iter(torch.utils.data.DataLoader(dataset, batch_size=len(idx))))[:2]
        return x.to(run.device), torch.as_tensor(y).to(run.device)

    # --- client ------------------------------------------------------------------
    @hookimpl
    def fedaval_client_upload(self, run, client):
        if not client.has_task(client.task):
            return None
        labels = run.data.train_y[client.tasks.indices[client.task]]
        return {ENTRY: torch.bincount(labels, minlength=run.num_classes).to(torch.int32)}

    # --- server --------------------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        """Ensemble, calibrate, distil into the (FedAvg) global model."""
        uploads = [u for u in uploads if u.get("weights") and u.get(ENTRY) is not None]
        if not uploads:
            return None
        o = self.options
        x, y = self.proxy_data(run)
        server = run.server.model
        logits = torch.stack([client_logits(server, u.get("weights"), x) for u in uploads])
        ensemble = ensemble_logits(logits)
        prior = class_prior(torch.stack([u.get(ENTRY) for u in uploads]).sum(dim=0), o.smoothing).to(run.device)
        with torch.no_grad():
            server_mode = server.training
            server.eval()
            features = server.features(x)
            server.train(server_mode)
        if o.calibration == "gated":
            w, b, _ = train_gate(features, ensemble, prior, y, o.tau, o.gate_steps, o.gate_lr)
            gate = gate_values(features, w, b)
        else:
            gate = torch.full((len(x),), 1.0 if o.calibration == "full" else 0.0, device=x.device)
        teacher = calibrated_logits(ensemble, prior, o.tau, gate).detach()
        generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + 7919 * round) % (2**63))
        losses = distil(server, x, teacher, o.temperature, o.distill_steps, o.distill_lr, o.distill_batch, generator)
        self.metrics = {
            "fedic_gate_mean": float(gate.mean()),
            "fedic_proxy_acc_ensemble": float((ensemble.argmax(1) == y).float().mean()),
            "fedic_proxy_acc_calibrated": float((teacher.argmax(1) == y).float().mean()),
        }
        if losses:
            self.metrics.update(fedic_distill_loss_first=losses[0], fedic_distill_loss_last=losses[-1])
        return None

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return dict(self.metrics) or None


@torch.no_grad()
def client_logits(server_model: torch.nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits on ``x`` of a client model rebuilt from its uploaded weights
    (the server's model with those entries replaced), in eval mode."""
    model = copy.deepcopy(server_model)
    state = model.state_dict()
    for key, value in weights.items():
        state[key].copy_(value)
    model.eval()
    return model(x)


def proxy_indices(run, source: str, per_class: int) -> dict[int, np.ndarray]:
    """The server's proxy set: ``per_class`` training indices of each class
    the federation will see, drawn with ``--seed`` from the samples no client
    holds (``held-out``) or from all (``train``). A one-line error names the
    classes that lack samples."""
    labels = run.data.train_y.numpy()
    pool = np.ones(len(labels), dtype=bool)
    if source == "held-out":
        for client in run.partition.clients:
            for idx in client.indices:
                pool[idx] = False
    classes = sorted({c for t in run.federation_task_classes() for c in t})
    rng = np.random.default_rng(run.config.seed)
    out, missing = {}, []
    for c in classes:
        candidates = np.flatnonzero(pool & (labels == c))
        if len(candidates) < per_class:
            missing.append(f"{c} ({len(candidates)})")
            continue
        out[c] = np.sort(rng.choice(candidates, size=per_class, replace=False))
    if missing:
        where = "training samples no client holds" if source == "held-out" else "training samples"
        raise FedavalUsageError(
            f"fedic's proxy set lacks classes {', '.join(missing)}: fewer than proxy_per_class={per_class} {where}; "
            "lower fedic.proxy_per_class or use -o fedic.proxy=train"
        )
    return out
