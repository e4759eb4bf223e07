"""FEDIC: calibrated ensemble distillation (Shang et al., ICME 2022, "FEDIC:
Federated Learning on Non-IID and Long-Tailed Data via Calibrated
Distillation"); one of GLDP's baselines for long-tailed federated learning
(``--scenario sthfl``).

The method, as its authors' code runs it (``teacher=code``, the default;
shangxinyi/FEDIC, ``main.py`` and ``options.py``, read, not copied; no paper
file is in the repository), with the code's values as defaults:

* Clients train as in FedAvg and upload their weights (and the class counts
  of their current task's data, ``fedic_counts``, ``K`` numbers counted in
  ``bytes_up``, which only ``teacher=logit-adjust`` reads).
* Labelled proxy set on the server: ``proxy_per_class`` (100: the code holds
  out 1,000 CIFAR-10 training images) training samples of each class.
  ``proxy=held-out`` (default): drawn (seeded by ``--seed``) from the
  training samples no client holds (GLDP's ``sthfl`` scenario uses a
  long-tailed fraction of the data and leaves the rest unused);
  ``proxy=train``: from the whole training set, which may overlap the
  clients' data (under a long tail the head class keeps every image). Every
  class the federation will see must have ``proxy_per_class`` samples,
  otherwise the run stops before training with one line naming the missing
  classes. At stage t the proxy set holds the classes the federation has
  seen up to stage t.
* Unlabelled distillation data (the code: CIFAR-100's training images):
  ``-o fedic.unlabelled=NAME -o fedic.unlabelled_root=PATH``, any dataset
  fedaval loads, ``unlabelled_samples`` of its training images converted to
  the run's input shape and normalised as its data
  (:func:`fedaval.unlabelled.load_unlabelled`; the run's own dataset is
  refused unless ``unlabelled_classes`` lie outside its tasks' classes).
  Without one (the default, ``unlabelled=""``) the proxy set's images, their
  labels unread, are the unlabelled data.
* Server, each round, after FedAvg (three phases of ``steps`` (100) Adam
  steps at ``server_lr`` (1e-3), each optimizer kept across rounds as the
  code keeps it; minibatches of ``labelled_batch`` (20) proxy samples and
  ``unlabelled_batch`` (128) unlabelled images, drawn without replacement
  from a generator seeded by ``--seed`` and the round):

  1. a copy of the FedAvg model is fine-tuned on the proxy set
     (cross-entropy, weight decay ``server_weight_decay``, 2e-4), in train mode;
  2. the calibrated ensemble
     (:class:`~fedaval.plugins.fedic_math.CalibratedEnsemble`, kept across
     rounds) is fitted on the proxy set (cross-entropy of its output): per
     sample learned client weights, a per-class scale and bias, and a gate
     on the clients' mean features mixing it with the fine-tuned copy's
     logits; the client models (rebuilt from the uploads) and the copy in
     eval mode;
  3. the FedAvg model is distilled: ``soft_weight`` (0.5) times
     ``KL(softmax(teacher / T) || softmax(student / T))`` (batch mean, no
     ``T^2``; ``T = temperature``, 2) on an unlabelled minibatch, the teacher
     being the calibrated ensemble, plus ``1 - soft_weight`` times the
     cross-entropy on a proxy minibatch, weight decay 2e-4, in train mode.

  The distilled model is the global model: it is evaluated and it is the
  next round's broadcast.

``teacher=logit-adjust`` is the earlier reading of the paper: the teacher is
the clients' mean logits ``z - g tau log(pi)``, ``pi`` the class distribution
of the round's uploaded counts (additive ``smoothing``) and ``g`` a single
linear unit on the FedAvg model's features fitted on the labelled proxy set
(``gate_steps`` SGD steps of ``gate_lr``; ``calibration=full``: g = 1,
``none``: g = 0), distilled for ``distill_steps`` SGD steps (``distill_lr``,
minibatches of ``distill_batch`` proxy images, unlabelled) on ``T^2`` KL; it
was run with ``proxy_per_class=5``.

Round metrics (``plugin_metrics.fedic``): the distillation loss of the first
and last step, the proxy-set accuracy of the raw (mean) and calibrated
ensembles (``fedic_proxy_acc_ensemble``, ``fedic_proxy_acc_calibrated``),
and the gate's mean value (``teacher=code``: the carry gate on the proxy set;
``logit-adjust``: g).

Needs a global model whose classifier is shared (not ``fedrep``, ``gldp``,
``pfcl``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.models import SplitModel, in_mode
from fedaval.options import at_least_one, changed, non_negative, option, positive, refuse_unread, unit_interval
from fedaval.plugin import Plugin
from fedaval.plugins.creff import fresh_linear, require_shared_head
from fedaval.plugins.fedic_math import (
    CalibratedEnsemble,
    adam_steps,
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
    teacher: Literal["code", "logit-adjust"] = option(
        "code",
        "the teacher: the authors' code's calibrated ensemble, or the paper's logit adjustment (earlier reading)",
    )
    proxy: Literal["held-out", "train"] = option(
        "held-out", "where the server's proxy set comes from: training samples no client holds, or any training samples"
    )
    proxy_per_class: int = option(100, "labelled proxy samples per class on the server", at_least_one)
    unlabelled: str = option("", "unlabelled distillation dataset (a dataset name; empty: the proxy images)")
    unlabelled_root: str = option("", "data root of the unlabelled dataset (when it needs one)")
    unlabelled_classes: list[int] = option([], "use only these classes of the unlabelled dataset (empty: all)")
    unlabelled_samples: int = option(10_000, "unlabelled training images drawn", at_least_one)
    steps: int = option(100, "Adam steps of each server phase: fine-tuning, calibration, distillation", non_negative)
    server_lr: float = option(1e-3, "Adam learning rate of the server phases", positive)
    server_weight_decay: float = option(2e-4, "weight decay of the fine-tuning and the distillation", non_negative)
    labelled_batch: int = option(20, "proxy samples per server step", at_least_one)
    unlabelled_batch: int = option(128, "unlabelled images per distillation step", at_least_one)
    soft_weight: float = option(
        0.5, "weight of the soft (KL) term; 1 - it weighs the proxy cross-entropy", unit_interval
    )
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
        self.unlabelled_x: torch.Tensor | None = None  # rebuilt in fedaval_setup, never checkpointed
        self.calibration: dict[str, torch.Tensor] | None = None  # CalibratedEnsemble's state, kept across rounds
        self.optimizers: dict[str, dict] = {}  # the server phases' Adam states, kept across rounds
        self.metrics: dict[str, float] = {}

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "unlabelled_x"}

    # --- proxy set -------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.unlabelled import load_unlabelled

        o = self.options
        refuse_other_teachers_options(o)
        refuse_unread(
            "fedic",
            o,
            [
                (
                    ("gate_steps", "gate_lr"),
                    o.teacher == "logit-adjust" and o.calibration != "gated",
                    f"calibration={o.calibration}",
                ),
                (("unlabelled_root", "unlabelled_classes", "unlabelled_samples"), not o.unlabelled, "unlabelled=''"),
            ],
        )
        if o.teacher == "code" and o.unlabelled:
            self.unlabelled_x = load_unlabelled(
                run, "fedic.unlabelled", o.unlabelled, o.unlabelled_root, o.unlabelled_classes, o.unlabelled_samples
            )
        if not self.proxy:  # a resumed run keeps its proxy set
            self.proxy = proxy_indices(run, o.proxy, o.proxy_per_class)

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
        if self.options.teacher == "code":
            self.code_teacher(run, [u.get("weights") for u in uploads], round)
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

    def code_teacher(self, run, weights: list[dict[str, torch.Tensor]], round: int) -> None:
        """The server's three phases of the authors' code (module docstring):
        fine-tune a copy of the FedAvg model, fit the calibrated ensemble,
        distil it into the FedAvg model."""
        o = self.options
        x, y = self.proxy_data(run)
        pool = x if self.unlabelled_x is None else self.unlabelled_x.to(run.device)
        server = run.server.model
        clients = [client_model(server, w) for w in weights]
        finetuned = copy.deepcopy(server)
        generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + 7919 * round) % (2**63))

        def labelled() -> tuple[torch.Tensor, torch.Tensor]:
            idx = torch.randperm(len(x), generator=generator)[: o.labelled_batch].to(x.device)
            return x[idx], y[idx]

        def teacher_view(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            with torch.no_grad():
                features = torch.stack([m.features(images) for m in clients])
                logits = torch.stack([m.classifier(f) for m, f in zip(clients, features)])
                return features, logits, finetuned(images)

        def finetune_loss() -> torch.Tensor:
            images, labels = labelled()
            return F.cross_entropy(finetuned(images), labels)

        def phase(name: str, params: list[torch.Tensor], weight_decay: float, loss) -> list[float]:
            """``o.steps`` Adam steps on ``loss``, the phase's optimizer state kept across rounds."""
            self.optimizers[name], losses = adam_steps(
                params, self.optimizers.get(name), o.server_lr, weight_decay, o.steps, loss
            )
            return losses

        with in_mode(finetuned, training=True):
            phase("finetune", list(finetuned.parameters()), o.server_weight_decay, finetune_loss)
        finetuned.eval()
        ensemble = self.calibrated_ensemble(run, server)

        def calibration_loss() -> torch.Tensor:
            images, labels = labelled()
            return F.cross_entropy(ensemble(*teacher_view(images)), labels)

        phase("calibration", list(ensemble.parameters()), 0.0, calibration_loss)
        self.calibration = {k: v.detach().clone() for k, v in ensemble.state_dict().items()}

        def distillation_loss() -> torch.Tensor:
            idx = torch.randperm(len(pool), generator=generator)[: o.unlabelled_batch].to(pool.device)
            with torch.no_grad():
                target = ensemble(*teacher_view(pool[idx]))
            soft = F.kl_div(
                F.log_softmax(server(pool[idx]) / o.temperature, dim=1),
                F.softmax(target / o.temperature, dim=1),
                reduction="batchmean",
            )
            images, labels = labelled()
            return o.soft_weight * soft + (1 - o.soft_weight) * F.cross_entropy(server(images), labels)

        with in_mode(server, training=True):
            losses = phase("distil", list(server.parameters()), o.server_weight_decay, distillation_loss)
        with torch.no_grad():
            features, logits, tuned = teacher_view(x)
            calibrated = ensemble(features, logits, tuned)
            self.metrics = {
                "fedic_gate_mean": float(ensemble.carry(features).mean()),
                "fedic_proxy_acc_ensemble": float((logits.mean(0).argmax(1) == y).float().mean()),
                "fedic_proxy_acc_calibrated": float((calibrated.argmax(1) == y).float().mean()),
            }
        if losses:
            self.metrics.update(fedic_distill_loss_first=losses[0], fedic_distill_loss_last=losses[-1])

    def calibrated_ensemble(self, run, server) -> CalibratedEnsemble:
        """The calibrated ensemble as last round left it (new: its gate
        drawn like a fresh linear layer from a generator seeded by ``--seed``)."""
        generator = torch.Generator().manual_seed((run.config.seed * 1_000_003 + 31) % (2**63))
        gate = fresh_linear(server.feature_dim, 1, generator, run.device)
        ensemble = CalibratedEnsemble(run.num_classes, gate).to(run.device)
        if self.calibration is not None:
            ensemble.load_state_dict(self.calibration)
        return ensemble

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return dict(self.metrics) or None


LOGIT_ADJUST_ONLY = (
    "tau",
    "smoothing",
    "calibration",
    "gate_steps",
    "gate_lr",
    "distill_steps",
    "distill_lr",
    "distill_batch",
)
CODE_ONLY = (
    "unlabelled",
    "unlabelled_root",
    "unlabelled_classes",
    "unlabelled_samples",
    "steps",
    "server_lr",
    "server_weight_decay",
    "labelled_batch",
    "unlabelled_batch",
    "soft_weight",
)


def refuse_other_teachers_options(options: FEDICOptions) -> None:
    """An option of the other teacher, set to other than its default, would
    do nothing: a one-line error names it."""
    unused = changed(options, LOGIT_ADJUST_ONLY if options.teacher == "code" else CODE_ONLY)
    if unused:
        owner = "logit-adjust" if options.teacher == "code" else "code"
        raise FedavalUsageError(
            f"fedic.{unused[0]} applies to fedic.teacher={owner} only, but fedic.teacher={options.teacher}; "
            f"drop it or set -o fedic.teacher={owner}"
        )


@torch.no_grad()
def client_model(server_model: SplitModel, weights: dict[str, torch.Tensor]) -> SplitModel:
    """A client model rebuilt from its uploaded weights (the server's model
    with those entries replaced), in eval mode."""
    model = copy.deepcopy(server_model)
    state = model.state_dict()
    for key, value in weights.items():
        state[key].copy_(value)
    return model.eval()


@torch.no_grad()
def client_logits(server_model: SplitModel, weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Logits on ``x`` of a client model rebuilt from its uploaded weights."""
    return client_model(server_model, weights)(x)


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
