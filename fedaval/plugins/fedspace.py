"""FedSpace (Shenaj, Toldo, Rigon, Zanuttigh, "Asynchronous Federated
Continual Learning", CVPR Workshops 2023), as its authors' released code runs
it (LTTM/FedSpace, ``configs/*/fedspace.txt``; read, not copied). The maths
is in :mod:`fedaval.plugins.fedspace_math`; this module is the hook glue.

FedSpace's setting is asynchronous FCL: every client learns its own sequence
of tasks, so at any round the clients are on different classes. Clients
send the server prototypes of the classes they are learning; the server
averages them into a shared prototype space, and each client trains its
classifier also on noisy samples drawn around the prototypes of classes it
is not learning now (PASS's prototype augmentation), with PASS's rotation
self-supervision and a contrastive representation loss. Until session 23
fedaval's FedSpace was read from the paper and PASS alone (per-class radii,
prototypes once per task into a growing bank, weight 1, no temperature, no
rotations, plain FedAvg); session 22 set it against the code
(docs/methods.md, "The baselines against their authors' code") and this is
the code's algorithm, each part an option:

* **Model and rotations** (``rotation``, default on). The classifier has
  ``4 C`` outputs: unit ``4 c + k`` is class ``c`` turned by ``k`` times 90
  degrees. In local training every image also goes through the model
  turned by 90, 180 and 270 degrees, labelled ``4 y + k`` (the code stacks
  the four into one minibatch of ``4 B``; here the ``3 B`` turned copies
  are a second forward pass, ``fedspace_rotation_ce``, so BatchNorm sees
  the ``B`` originals and the ``3 B`` copies as two minibatches). The class
  scores, in evaluation, are the unturned units ``4 c``.
* **Masked, tempered cross-entropy** (``mask``, ``temperature``). The
  cross-entropy of the real samples is over the units of the classes the
  client has seen (its tasks so far, all rotations), logits divided by
  ``temperature`` (0.1). The mean is over the ``4 B`` samples, as in the
  code: the core's ``classification`` term is the ``B`` originals' share
  (a quarter of their mean), ``fedspace_rotation_ce`` the rest. In
  evaluation the scores of classes the federation has not met yet (classes
  of later stages) are masked out, as the code's tests mask them.
* **Prototypes** (client, ``fedaval_client_upload``): every round, after
  local training, with the model in eval mode, on the current task's
  training data (the code's loader applies its training augmentation; here
  the unaugmented images): the mean feature of each class of the client's
  current task (zeros for a class it has no sample of), and one radius per
  client, ``sqrt(mean_c trace(Cov_c) / D)`` over those classes, computed at
  the client's first upload only and kept for the whole run (the code
  computes it while its local prototype list is empty). The client merges
  them into its own list (its *local* prototypes).
* **Server** (``fedaval_server_fuse``): from the second round on (the code's
  ``aggr_proto_after_round=1``), the round's prototypes, per class
  uploaded, weighted by the clients' sample counts (zero prototypes left
  out), then an EMA with the previous global value of the class
  (``proto_ema`` of the new, 0.1). Classes nobody uploaded this round leave
  the global list (the code rebuilds it from the round's uploads each
  round); ``keep_bank`` keeps them instead. The radius is the clients'
  radii weighted by their counts. Both are sent to every client whose copy
  is older.
* **Weights** (``fedaval_server_fuse_weights``): ``server_mix`` (0.5) times
  FedAvg's sample-weighted mean plus the rest times the previous global
  weights (the code's ``aggregate_with_global_model``, ``global_weight``
  0.5); floating-point entries only (a BatchNorm counter takes the mean).
* **Prototype augmentation** (``weight``, 1e-2, ``fedspace_pseudo_ce``): per
  minibatch ``B`` features ``mu_c + r e``, ``e ~ N(0, I)``, ``c`` drawn
  uniformly among the non-zero prototypes of the client's list (the global
  one once received, its local one before) that are not of its current
  task, labelled ``4 c``, the classifier's logits over all its units divided
  by ``temperature``, cross-entropy.
* **Representation loss** (``repr_weight``, 1e-2, ``fedspace_repr``): a
  supervised contrastive loss (temperature ``repr_temperature``, 1) on the
  minibatch's unturned features and ``B`` noisy prototypes of every class
  of the list, the anchors being the samples of the current task's classes
  (:func:`~fedaval.plugins.fedspace_math.representation_loss`).

The noise comes from the client's own random stream (a run is
reproducible and does not depend on the clients' order). The run's
optimizer is used (the code trains with Adam at 1e-3, weight decay 2e-4;
FedProK's comparison gives every method the same optimizer); the fractal
pre-training of the code is left out (as released, it never steps its
optimizer).

**What this means in a synchronous scenario** (FedProK's Table 1,
``fcil-sync``): every client is on the same task, and the global list a
client receives holds the classes uploaded the round before: from a task's
second round on, the current task's only, so the prototype augmentation has
no class to draw (it draws the last task's classes in a task's first
round): FedSpace is then FedAvg with
the rotations, the masked cross-entropy at temperature 0.1, the
representation loss and the server's mixing. ``keep_bank`` is the reading
under which old classes keep being augmented. In the asynchronous scenarios
(``fcil-async``, ``fcl-random``) other clients' current classes are in the
list, as the code intends.

Every scenario runs (sthfl, fcil-sync, fcil-async, fcl-random).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaval import hookimpl
from fedaval.options import non_negative, option, positive, refuse_unread, unit_interval
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

LOCAL = StashKey[dict]("fedspace.local")  # the client's own list: {"protos": {class: mean}, "radius": float | None}
GLOBAL = StashKey[tuple]("fedspace.global")  # the server's list as last received: ({class: mean}, radius)
PLAN = StashKey[dict]("fedspace.plan")  # this round's tensors (classes, prototypes, output units)

PROTOTYPES, RADIUS = "fedspace_prototypes", "fedspace_radius"
ROTATION_CE, PSEUDO_CE, REPR = "fedspace_rotation_ce", "fedspace_pseudo_ce", "fedspace_repr"
FIRST_SERVER_ROUND = 2  # the code's aggr_proto_after_round=1 (0-based round index)


class FedSpace(Plugin):
    """Client: rotations, masked tempered cross-entropy, prototype
    augmentation, representation loss; prototypes and a radius every round.
    Server: prototypes averaged with an EMA, weights mixed with the previous
    global ones.

    Server state: ``protos`` ({class: prototype}), ``radius``, ``version``
    (bumped when they change) and ``sent`` (client id -> the version it last
    received)."""

    name = "fedspace"
    description = "FedSpace (its released code): rotations, prototype augmentation, representation loss, EMA prototypes"
    loss_terms = (ROTATION_CE, PSEUDO_CE, REPR)

    @dataclass
    class Options:
        weight: float = option(1e-2, "weight of the prototype augmentation (the code's lambda_proto_aug)", non_negative)
        repr_weight: float = option(1e-2, "weight of the representation loss (lambda_repr_loss)", non_negative)
        temperature: float = option(0.1, "logits divided by this in both cross-entropies (temp)", positive)
        repr_temperature: float = option(1.0, "temperature of the representation loss (repr_loss_temp)", positive)
        rotation: bool = option(True, "rotation self-supervision: 4 C outputs, each image also turned 3 times")
        mask: bool = option(True, "cross-entropy over the units of the client's seen classes only (mask_model)")
        server_mix: float = option(
            0.5, "new global weights: this times FedAvg's mean + the rest times the old (global_weight)", unit_interval
        )
        proto_ema: float = option(
            0.1, "global prototype: this times the round's mean + the rest times the old", unit_interval
        )
        keep_bank: bool = option(
            False, "keep classes nobody uploaded this round in the global list (the code drops them)"
        )

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.protos: dict[int, Any] | None = None
        self.radius = 0.0
        self.version = 0
        self.sent: dict[int, int] = {}

    # --- model and evaluation ---------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        o = self.options
        refuse_unread("fedspace", o, [(("repr_temperature",), o.repr_weight == 0, "repr_weight=0")])

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import build_model
        from fedaval.plugins.fedspace_math import ROTATIONS

        if not self.options.rotation:
            return None
        return build_model(run.config.model, run.data.input_shape, ROTATIONS * run.num_classes, run.models)

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        """Evaluation: the unturned units, classes the federation has not met masked out."""
        from fedaval.plugins.fedspace_math import ROTATIONS
        from fedaval.prototypes import taught_scores

        if training:
            return None
        logits = model.classifier(features)
        if self.options.rotation:
            logits = logits[:, ::ROTATIONS]
        return taught_scores(logits, run.federation_seen_classes())

    # --- client ------------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if PROTOTYPES in download:
            client.stash[GLOBAL] = (dict(download[PROTOTYPES]), float(download[RADIUS]))

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            client.stash[PLAN] = self.plan(run, client)

    def plan(self, run, client) -> dict[str, Any]:
        """The round's tensors: the output units of the cross-entropy, the
        classes and prototypes to augment (not the current task's) and those of
        the representation loss (all), the radius."""
        import torch

        from fedaval.plugins.fedspace_math import ROTATIONS, output_units, unit_positions

        current = list(client.tasks.classes[client.task])
        width = (ROTATIONS if self.options.rotation else 1) * run.num_classes
        if self.options.mask:  # the classes of the tasks the client has begun, this one included
            units = output_units(client.seen_classes(), self.options.rotation)
        else:
            units = list(range(width))
        units_t, position = unit_positions(units, width, run.device)
        received = client.stash.get(GLOBAL)
        local = client.stash.get(LOCAL) or {"protos": {}, "radius": None}
        protos, radius = received if received and received[0] else (local["protos"], local["radius"] or 0.0)
        known = [c for c in sorted(protos) if bool(protos[c].any())]
        old = [c for c in known if c not in current]

        def stack(classes):
            if not classes:
                return None, None
            rows = torch.stack([protos[c] for c in classes]).to(run.device)
            return torch.tensor(classes, dtype=torch.long, device=run.device), rows

        return {
            "units": units_t,
            "position": position,
            "current": torch.tensor(current, dtype=torch.long, device=run.device),
            "old": stack(old),
            "known": stack(known),
            "radius": float(radius),
        }

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        """The originals' share of the masked, tempered cross-entropy (a
        quarter of their mean with rotations: the code's mean is over 4 B)."""
        from fedaval.plugins.fedspace_math import ROTATIONS, masked_cross_entropy_sum

        plan = client.stash[PLAN]
        scale = ROTATIONS if self.options.rotation else 1
        targets = scale * y
        return masked_cross_entropy_sum(logits, targets, plan["units"], plan["position"], self.options.temperature) / (
            scale * len(y)
        )

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        import torch
        import torch.nn.functional as F

        from fedaval.plugins.fedspace_math import (
            ROTATIONS,
            masked_cross_entropy_sum,
            noisy_prototypes,
            representation_loss,
            rotated_copies,
        )

        plan = client.stash[PLAN]
        model, size, opts = client.model, len(batch.y), self.options
        terms = {}
        if opts.rotation:
            x, y = rotated_copies(batch.x, batch.y)
            logits = model.classifier(model.features(x))
            ce = masked_cross_entropy_sum(logits, y, plan["units"], plan["position"], opts.temperature)
            terms[ROTATION_CE] = ce / (ROTATIONS * size)
        radius = plan["radius"]
        if opts.weight and plan["old"][0] is not None and radius:
            classes, rows = plan["old"]
            feats, labels = noisy_prototypes(rows.to(batch.features), radius, classes, size)
            targets = labels * (ROTATIONS if opts.rotation else 1)
            terms[PSEUDO_CE] = opts.weight * F.cross_entropy(model.classifier(feats) / opts.temperature, targets)
        if opts.repr_weight and plan["known"][0] is not None and radius:
            classes, rows = plan["known"]
            feats, labels = noisy_prototypes(rows.to(batch.features), radius, classes, size)
            both = torch.cat([batch.features.flatten(1), feats])
            loss = representation_loss(both, torch.cat([batch.y, labels]), plan["current"], opts.repr_temperature)
            terms[REPR] = opts.repr_weight * loss
        return terms or None

    @hookimpl
    def fedaval_client_upload(self, run, client):
        """After local training: the current task's prototypes, and the
        client's radius (computed once, at its first upload)."""
        import torch

        from fedaval.plugins.fedspace_math import class_prototypes, client_radius
        from fedaval.prototypes import extract_features

        client.stash.pop(PLAN, None)
        exp = client.train_stream[client.task]
        if exp is None:
            return None
        features, labels = extract_features(client.model, exp.dataset, run.device, run=run)
        features, labels = features.flatten(1).cpu(), labels.cpu()
        current = list(client.tasks.classes[client.task])
        protos = class_prototypes(features, labels, current)
        local = client.stash.get(LOCAL) or {"protos": {}, "radius": None}
        if local["radius"] is None:
            local["radius"] = client_radius(features, labels, current)
        local["protos"] = {**local["protos"], **protos}
        client.stash[LOCAL] = local
        return {PROTOTYPES: protos, RADIUS: torch.tensor(local["radius"])}

    # --- server ------------------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.plugins.fedspace_math import aggregate_prototypes, aggregate_radius

        sent = [u for u in uploads if u.get(PROTOTYPES) is not None]
        if round < FIRST_SERVER_ROUND or not sent:
            return None
        fused = aggregate_prototypes(
            [(u.num_samples, u.get(PROTOTYPES)) for u in sent], self.protos, self.options.proto_ema
        )
        if self.options.keep_bank and self.protos:
            fused = {**self.protos, **fused}
        self.protos = fused
        self.radius = aggregate_radius([(u.num_samples, float(u.get(RADIUS))) for u in sent])
        self.version += 1
        return None

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        """The code's aggregate_with_global_model: server_mix x FedAvg's mean + the rest x the old weights."""
        from fedaval.plugins.fedavg import weighted_average

        with_weights = [u for u in uploads if u.get("weights")]
        if not with_weights:
            return None
        mean = weighted_average([u.get("weights") for u in with_weights], [u.num_samples for u in with_weights])
        mix = self.options.server_mix
        if mix == 1.0:
            return mean
        for key, value in mean.items():
            old = global_weights.get(key)
            if old is not None and value.is_floating_point():
                mean[key] = (mix * value.double() + (1 - mix) * old.to(value.device).double()).to(value.dtype)
        return mean

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        """The global prototypes and radius, to a client whose copy is older."""
        if self.protos is None or self.sent.get(client.id) == self.version:
            return None
        import torch

        self.sent[client.id] = self.version
        return {PROTOTYPES: self.protos, RADIUS: torch.tensor(self.radius)}

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"fedspace_global_classes": len(self.protos or {}), "fedspace_radius": self.radius}
