"""CReFF: classifier re-training with federated features (Shang et al.,
IJCAI 2022, "Federated Learning on Heterogeneous and Long-Tailed Data via
Classifier Re-Training with Federated Features"); one of GLDP's baselines
for long-tailed federated learning (``--scenario sthfl``).

The method, as its authors' code runs it (shangxinyi/CReFF-FL, ``main.py``
and ``options.py``, read, not copied; no paper file is in the repository).
Each part that differs from a plainer reading of the paper is an option,
with the code's value as default (docs/methods.md, "The baselines against
their authors' code"):

* Clients train as in FedAvg and upload their weights (the core's FedAvg
  fusion of every shared key, the classifier included).
* **The classifier the gradients are taken on** (``match_head``). The server
  sends each sampled client, beside the FedAvg model it trains from, the
  classifier it re-trained last round (``retrained``; in the first round a
  fresh linear layer, PyTorch's default initialisation from a generator
  seeded by ``--seed``), as the entry ``creff_head`` (its bytes counted in
  ``bytes_down``). ``global``: the FedAvg classifier just broadcast (nothing
  extra is sent).
* **Real-feature gradients.** Each sampled client puts its current task's
  images (their evaluation view) through the received extractor in eval
  mode (BatchNorm running statistics) and, per class it holds, takes the
  gradient of the mean cross-entropy of a batch of that class with respect
  to that classifier: ``real_draws`` times (10) a batch of ``real_batch``
  (32) images drawn without replacement (all of them when the class has
  fewer; ``real_batch=0``: all of the class's images, in order), each batch
  augmented (``augment=dsa``: one of DSA's six augmentations, the same for
  the whole batch, :func:`~fedaval.plugins.creff_math.siamese_augment`;
  ``none``: as they are); the gradients are averaged over the draws. With
  ``match_bias`` (on, as in the code) a class's gradient is taken with
  respect to ``[W | b]`` (the bias's gradient one more column), else ``W``
  alone. The draws come from the client's own random stream. They go up as
  the upload entry ``creff_gradients`` (``{class: gradient}``), so their
  bytes are counted in ``bytes_up``.
* Server: the gradients of a class are averaged over the clients that sent
  one (plain mean, unweighted). The server keeps ``features_per_class``
  learnable federated features per class (dimension = the model's feature
  width), created the first time a class's gradient arrives (the code makes
  every class's at the start: in a class-incremental run the classes arrive
  over time), drawn from N(0, 1) with a generator seeded by ``--seed`` and
  the class. Each round they are optimised for ``match_steps`` steps of SGD
  (``feature_lr``) so that the gradient they induce on the same classifier
  the clients used matches the aggregated real gradient: distance ``sum_c
  sum_j (1 - cos(g_syn^c_j, g_real^c_j))`` over the rows j of the weight
  gradient, plus with ``match_bias`` ``1 - cos`` of the class's two bias
  gradients (dataset condensation's distance). Classes with no gradient this
  round keep their features.
* Classifier re-training: a new linear layer (``retrain_init=fresh``, the
  code's: PyTorch's default initialisation from a generator seeded by
  ``--seed`` and the round; ``global``: a copy of this round's FedAvg
  classifier) is trained for ``retrain_epochs`` epochs of SGD (``retrain_lr``,
  minibatches of ``retrain_batch``) on the federated features of every class
  that has them, the same number per class: a balanced classifier.
* Which model is which: the re-trained classifier is the global model's
  classifier for evaluation and inference (through ``fedaval_classify`` for
  the server's model) and, with ``match_head=retrained``, the classifier of
  the next round's gradients and matching. It is *not* trained from: the next
  broadcast is the FedAvg model and clients train from it, as in the
  official code. The clients' own models are evaluated as they are.
* Defaults: the code's, ``features_per_class=100``, ``match_steps=100``,
  ``feature_lr=0.1``, ``retrain_epochs=300``, ``retrain_lr=0.01``,
  ``retrain_batch=32``, ``real_draws=10``, ``real_batch=32``. The earlier
  reading (gradients on the FedAvg classifier, of the weight only, each
  class's images once without augmentation, re-training from the FedAvg
  classifier) is ``-o creff.match_head=global -o creff.match_bias=false -o
  creff.real_draws=1 -o creff.real_batch=0 -o creff.augment=none -o
  creff.retrain_init=global``. The code's local training (lr 0.1, 10 epochs,
  crops and flips) is the run's own setting (``--lr``, ``--local-epochs``,
  ``--augment``): a comparison gives every method the same.

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
from fedaval.models import SplitModel, in_mode
from fedaval.options import at_least_one, non_negative, option, positive
from fedaval.plugin import Plugin
from fedaval.plugins.creff_math import (
    GradientSet,
    per_class_gradients,
    retrain_classifier,
    siamese_augment,
    update_federated_features,
)
from fedaval.prototypes import dataset_samples, extract_features, mean_over_holders
from fedaval.stash import StashKey

ENTRY = "creff_gradients"
HEAD = "creff_head"  # the classifier the clients take their gradients on (match_head=retrained)
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
        "fresh", "re-training starts from a new seeded linear layer (fresh) or a copy of the FedAvg classifier (global)"
    )
    match_head: Literal["retrained", "global"] = option(
        "retrained", "classifier of the real gradients and the matching: last round's re-trained one or FedAvg's"
    )
    match_bias: bool = option(True, "match the bias's gradient too (one more 1 - cos per class)")
    real_draws: int = option(10, "batches per class a client takes a gradient on, averaged", at_least_one)
    real_batch: int = option(32, "images per batch (0: all of the class's images, in order)", non_negative)
    augment: Literal["dsa", "none"] = option("dsa", "augmentation of each real batch: DSA's (Siamese) or none")


class CReFF(Plugin):
    """CReFF: FedAvg + real-feature gradients + federated features + re-trained balanced classifier."""

    name = "creff"
    description = "CReFF: federated features matched to clients' classifier gradients, balanced classifier re-training"
    Options = CReFFOptions

    def __init__(self, options=None):
        super().__init__(options)
        self.features: dict[int, torch.Tensor] = {}  # federated features per class
        self.sent: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (round, W, b): the gradients' classifier
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
        """Real-feature gradients with the extractor just received, on the
        classifier the server sent (``match_head=retrained``) or the FedAvg one."""
        client.stash.pop(PENDING, None)
        if not client.has_task(client.task):
            return
        o = self.options
        if HEAD in download:
            weight, bias = (t.to(run.device) for t in download[HEAD])
        else:
            weight, bias = client.model.classifier.weight.detach(), client.model.classifier.bias.detach()
        images, labels = dataset_samples(client.train_stream[client.task].dataset, run.device, run=run)
        grads = real_gradients(
            client.model, images, labels, weight, bias, o.real_draws, o.real_batch, o.augment == "dsa", o.match_bias
        )
        client.stash[PENDING] = {c: g.cpu() for c, g in grads.items()}

    @hookimpl
    def fedaval_client_upload(self, run, client):
        grads = client.stash.pop(PENDING, None)
        return {ENTRY: grads} if grads else None

    # --- server --------------------------------------------------------------------
    @hookimpl
    def fedaval_server_download(self, run, client, download):
        """The classifier the clients compute their gradients with: kept for
        the matching and, unless it is the broadcast's own, sent."""
        if self.sent is None or self.sent[0] != run.round:
            if self.options.match_head == "global":
                weight, bias = download["weights"][WEIGHT], download["weights"][BIAS]
            elif self.retrained is not None:
                weight, bias = self.retrained
            else:
                head = run.server.model.classifier
                generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + 104_729) % (2**63))
                weight, bias = fresh_linear(head.in_features, head.out_features, generator, run.device)
            self.sent = (run.round, weight.detach().clone(), bias.detach().clone())
        return {HEAD: self.sent[1:]} if self.options.match_head == "retrained" else None

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


@torch.no_grad()
def real_gradients(
    model: SplitModel,
    images: torch.Tensor,
    labels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    draws: int,
    batch: int,
    augment: bool,
    with_bias: bool,
) -> GradientSet:
    """A client's real-feature gradients on the classifier ``(weight, bias)``:
    for each class of ``labels``, the mean over ``draws`` batches of its
    images (``batch`` drawn without replacement, all when fewer; ``batch=0``:
    all, in order; each batch through :func:`siamese_augment` when
    ``augment``) of the gradient of the batch's mean cross-entropy, the
    features being ``model.features`` in eval mode
    (:func:`~fedaval.plugins.creff_math.per_class_gradients`)."""
    members = {c: (labels == c).nonzero().flatten() for c in sorted(set(labels.tolist()))}
    total: GradientSet = {}
    with in_mode(model, training=False):
        for _ in range(draws):
            picked = [
                idx if batch == 0 else idx[torch.randperm(len(idx))[:batch].to(idx.device)] for idx in members.values()
            ]
            x = [images[idx] for idx in picked]
            if augment:
                x = [siamese_augment(part) for part in x]
            features = torch.cat([model.features(part).flatten(1) for part in torch.cat(x).split(256)])
            for c, g in per_class_gradients(features, labels[torch.cat(picked)], weight, bias, with_bias).items():
                total[c] = total[c] + g / draws if c in total else g / draws
    return total


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
