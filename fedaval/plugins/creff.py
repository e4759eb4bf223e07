"""CReFF: classifier re-training with federated features (Shang et al.,
IJCAI 2022, "Federated Learning on Heterogeneous and Long-Tailed Data via
Classifier Re-Training with Federated Features"); one of GLDP's baselines
for long-tailed federated learning (``--scenario sthfl``).

The method, as read here (no paper file is in the repository; this is our
reading of the paper and of its official code's defaults):

* Clients train as in FedAvg and upload their weights (the core's FedAvg
  fusion of every shared key, the classifier included).
* Real-feature gradients: each sampled client, with the global model it has
  just received (before training), extracts the features of its current
  task's data (``model.features`` in eval mode: BatchNorm running
  statistics) and computes, per class it holds, the gradient with respect
  to the global classifier's weight matrix of the mean cross-entropy of that
  class's samples (:func:`~fedaval.plugins.creff_math.per_class_gradients`).
  Reading: all of the class's samples of the client's current task (the
  official code draws a batch of 32 per class; the paper writes the mean
  over the class's local data). They go up as the upload entry
  ``creff_gradients`` (``{class: dL/dW}``), so their bytes are counted in
  ``bytes_up``. The bias's gradient is neither matched nor sent (the
  matching distance ignores it, see below).
* Server: the gradients of a class are averaged over the clients that sent
  one (plain mean, unweighted). The server keeps ``features_per_class``
  learnable federated features per class (dimension = the model's feature
  width), created the first time a class's gradient arrives, drawn from
  N(0, 1) with a generator seeded by ``--seed`` and the class. Each round
  they are optimised for ``match_steps`` steps of SGD (``feature_lr``) so
  that the gradient they induce on the classifier the clients used (the one
  broadcast at the start of the round) matches the aggregated real gradient:
  distance ``sum_c sum_j (1 - cos(g_syn^c_j, g_real^c_j))`` over the rows j
  of the weight gradient (dataset condensation's distance; the official code,
  shangxinyi/CReFF-FL, adds the bias gradient's ``1 - cos`` as one more term
  per class: not here, see docs/methods.md, "The baselines against their
  authors' code"). Classes with no gradient this round keep their
  features.
* Classifier re-training: a copy of this round's FedAvg global classifier
  (``retrain_init=global``; ``fresh``: a new linear layer with PyTorch's
  default initialisation from a seeded generator, as the official code
  does) is trained for ``retrain_epochs`` epochs of SGD (``retrain_lr``,
  minibatches of ``retrain_batch``) on the federated features of every
  class that has them, the same number per class: a balanced classifier.
* Which model is which: the re-trained classifier is the global model's
  classifier for evaluation and inference (through ``fedaval_classify`` for
  the server's model). It is *not* sent back for training: the next
  broadcast is the FedAvg model and clients train from it, as in the official
  code. The official code does use the re-trained classifier once more:
  clients compute their real gradients, and the server matches the features,
  on the previous round's re-trained classifier (a fresh layer in round 1),
  where fedaval uses the FedAvg classifier just broadcast (a known
  difference, docs/methods.md). The clients' own models are evaluated as
  they are.
* Defaults: ``features_per_class=100``, ``match_steps=100``,
  ``feature_lr=0.1``, ``retrain_epochs=300``, ``retrain_lr=0.01``,
  ``retrain_batch=32`` as we recall the paper's settings; small runs may use
  fewer steps.

Round metrics (``plugin_metrics.creff``): the matching loss before and after
the round's feature update (``creff_match_loss_before``/``_after``) and, at
evaluation rounds, the global accuracy with the FedAvg classifier instead of
the re-trained one (``creff_accuracy_fedavg_head``), so the re-training's
effect is visible beside ``global_accuracy``.

Needs a global model with a linear classifier shared with the server (every
scenario, any ``--model``); refused with methods that keep the classifier
personal (``fedrep``, ``gldp``) or train no global model (``pfcl``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import at_least_one, non_negative, option, positive
from fedaval.plugin import Plugin
from fedaval.plugins.creff_math import per_class_gradients, retrain_classifier, update_federated_features
from fedaval.prototypes import extract_features, mean_over_holders
from fedaval.stash import StashKey

ENTRY = "creff_gradients"
WEIGHT, BIAS = "classifier.weight", "classifier.bias"
PENDING = StashKey[dict]("creff.gradients")  # this round's real-feature gradients, to upload


@dataclass
class CReFFOptions:
    features_per_class: int = option(100, "federated features per class on the server", at_least_one)
    match_steps: int = option(100, "SGD steps of gradient matching per round", non_negative)
    feature_lr: float = option(0.1, "learning rate of the federated features", positive)
    retrain_epochs: int = option(
        300, "epochs of classifier re-training on the federated features per round", non_negative
    )
    retrain_lr: float = option(0.01, "learning rate of the classifier re-training", positive)
    retrain_batch: int = option(32, "minibatch size of the classifier re-training", at_least_one)
    retrain_init: Literal["global", "fresh"] = option(
        "global", "re-training starts from a copy of the FedAvg classifier (global) or a new seeded one (fresh)"
    )


class CReFF(Plugin):
    """CReFF: FedAvg + real-feature gradients + federated features + re-trained balanced classifier."""

    name = "creff"
    description = "CReFF: federated features matched to clients' classifier gradients, balanced classifier re-training"
    Options = CReFFOptions

    def __init__(self, options=None):
        super().__init__(options)
        self.features: dict[int, torch.Tensor] = {}  # federated features per class
        self.sent: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (round, W, b) broadcast this round
        self.retrained: tuple[torch.Tensor, torch.Tensor] | None = None  # the re-trained classifier
        self.losses: tuple[float, float] | None = None  # matching loss before/after this round's update

    # --- checks ------------------------------------------------------------------
    @hookimpl
    def fedaval_server_task_start(self, run, task):
        if task > 0 or self.sent is not None:
            return
        require_shared_head(run, self.name)

    # --- client --------------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        """Real-feature gradients with the global model just received."""
        client.stash.pop(PENDING, None)
        if not client.has_task(client.task):
            return
        features, labels = extract_features(client.model, client.train_stream[client.task].dataset, run.device, run=run)
        head = client.model.classifier
        grads = per_class_gradients(features, labels, head.weight, head.bias)
        client.stash[PENDING] = {c: g.cpu() for c, g in grads.items()}

    @hookimpl
    def fedaval_client_upload(self, run, client):
        grads = client.stash.pop(PENDING, None)
        return {ENTRY: grads} if grads else None

    # --- server --------------------------------------------------------------------
    @hookimpl
    def fedaval_server_download(self, run, client, download):
        """Keep the classifier the clients compute their gradients with."""
        if self.sent is None or self.sent[0] != run.round:
            weights = download["weights"]
            self.sent = (run.round, weights[WEIGHT].detach().clone(), weights[BIAS].detach().clone())
        return None

    def initial_features(self, run, c: int, dim: int) -> torch.Tensor:
        """Class c's federated features: N(0, 1), seeded by ``--seed`` and c."""
        generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + c) % (2**63))
        return torch.randn(self.options.features_per_class, dim, generator=generator).to(run.device)

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        real = mean_over_holders([u.get(ENTRY) for u in uploads if u.get(ENTRY)])
        if not real or self.sent is None:
            return None
        o = self.options
        _, weight, bias = self.sent
        weight, bias = weight.to(run.device), bias.to(run.device)
        real = {c: g.to(run.device) for c, g in real.items()}
        for c in sorted(real):
            if c not in self.features:
                self.features[c] = self.initial_features(run, c, weight.shape[1])
        self.features, losses = update_federated_features(
            self.features, real, weight, bias, o.match_steps, o.feature_lr
        )
        self.losses = (losses[0], losses[-1]) if losses else None
        head = run.server.model.classifier
        generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + 7919 * round) % (2**63))
        if o.retrain_init == "global":
            w0, b0 = head.weight.detach(), head.bias.detach()
        else:
            w0, b0 = fresh_linear(head.in_features, head.out_features, generator, run.device)
        self.retrained = retrain_classifier(
            self.features, w0, b0, o.retrain_epochs, o.retrain_lr, o.retrain_batch, generator
        )
        return None

    # --- evaluation ----------------------------------------------------------------
    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        """The global model predicts with the re-trained classifier."""
        if client is not None or training or self.retrained is None:
            return None
        weight, bias = self.retrained
        return F.linear(features, weight.to(features.device, features.dtype), bias.to(features.device, features.dtype))

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        out: dict[str, float] = {}
        if self.losses is not None:
            out["creff_match_loss_before"], out["creff_match_loss_after"] = self.losses
        server = run.server
        exps = [server.test_stream[t] for t in server.tasks_started if server.test_stream[t] is not None]
        if exps and self.retrained is not None:
            correct = total = 0
            for exp in exps:
                feats, labels = extract_features(server.model, exp.dataset, run.device, run=run)
                with torch.no_grad():
                    correct += int((server.model.classifier(feats).argmax(dim=1) == labels).sum())
                total += len(labels)
            out["creff_accuracy_fedavg_head"] = correct / total
        return out or None


def fresh_linear(
    in_features: int, out_features: int, generator: torch.Generator, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """A new linear layer's ``(weight, bias)`` with PyTorch's default
    initialisation (both uniform in ``[-1/sqrt(in), 1/sqrt(in)]``), drawn
    from ``generator``."""
    bound = 1 / math.sqrt(in_features)
    weight = (torch.rand(out_features, in_features, generator=generator) * 2 - 1) * bound
    bias = (torch.rand(out_features, generator=generator) * 2 - 1) * bound
    return weight.to(device), bias.to(device)


def require_shared_head(run, owner: str) -> None:
    """Refuse a run without a global model whose linear classifier is
    shared with the server (what CReFF and FEDIC work on), in one line."""
    if run.hook.fedaval_federation_model(run=run) != "global":
        raise FedavalUsageError(f"{owner} works on the global model, but the other plugins train no global model")
    if not isinstance(run.server.model.classifier, nn.Linear):
        raise FedavalUsageError(
            f"{owner} needs a linear classifier; the model's is a {type(run.server.model.classifier).__name__}"
        )
    missing = [k for k in (WEIGHT, BIAS) if k not in run.server.shared_keys]
    if missing:
        raise FedavalUsageError(
            f"{owner} needs the classifier shared with the server, but {', '.join(missing)} is kept on the clients "
            f"(a personal-head method such as fedrep or gldp); use {owner} without it"
        )
