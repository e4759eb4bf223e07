"""PFCL: prototype-based federated continual learning with distillation and
replay (Zhang, Yang, Yu, Hu, Jing, Sci Sin Inform 2024; ``shared/methods.md``
section 3). The maths is in :mod:`fedaval.plugins.pfcl_math`; this module is
the hook glue.

What happens, per client and round (the paper's Algorithm 2):

* the training set is the current task's data plus the client's exemplar
  memory (``fedaval_client_train_data`` adds the memory's indices, once per
  task, so minibatches stay on the device data path);
* the linear head is unused: ``fedaval_classify`` scores class k by
  -dis(f(x), p_k)/T over the client's *local* prototype library (Eq. 11), so
  the core's cross-entropy is L_C (Eq. 12) and evaluation is nearest
  prototype (Eq. 3);
* ``fedaval_client_loss`` adds alpha * L_D (Eqs. 6-8, against the previous
  task's frozen model) and beta * L_R (Eq. 5, towards the global prototypes);
* after training the client recomputes its prototypes (Eq. 2) on its data
  plus memory and uploads them - no weights (``fedaval_shared_keys`` is
  ``[]``, so FedAvg's upload is an empty dict);
* at the end of a task (``fedaval_client_task_end``) it re-selects the memory by
  distance to the class prototypes (Eq. 9) and freezes a copy of the model
  and its prototypes as the next task's distillation teacher.

The server averages each class's prototype over the clients that uploaded it
(Eq. 4), keeps every class ever learned, and broadcasts the library.

Readings where the paper is silent:

* Classes that have no prototype yet: when a client starts a task it
  computes the prototypes of every class of that task (and of its memory)
  with its current model before the first minibatch, so every training
  label has a prototype; they are recomputed after every round.
* A client classifies over its own local prototypes of the classes it has
  seen (not over other clients' classes); the global library only enters
  through L_R. The server's model is never trained (no weights are averaged),
  so PFCL declares its federation model to be the clients' models
  (``fedaval_federation_model`` returns ``"clients"``): the server is not
  evaluated, global-model figures are null, and PFCL's figures are the
  clients' mean accuracy per evaluated round (``mean_client_accuracy``), its
  mean over the stages' ends (``final.average_client_accuracy``) and its last
  value (``final.mean_client_accuracy``).
* The exemplar memory holds indices into the run's training set (exemplars
  are real samples of the client's own earlier tasks).
* Per-client state (local library, received library, memory, teacher) lives
  in ``client.stash``.
* L_R uses the minibatch's class means as the differentiable local
  prototypes (see :func:`~fedaval.plugins.pfcl_math.prototype_regulariser`).
* Prototypes are computed with the model in eval mode (BatchNorm running
  statistics), as it is used at test time.
* One temperature T (``temperature``, default 2, the paper's best of {1, 2,
  3, 5, 10}) divides the distances in the prototype classifier (Eq. 11) and
  in the distillation (Eqs. 7-8), as the paper writes one T for both.
* The paper gives no alpha, beta or memory size; the defaults here are ours.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import at_least_one, non_negative, option, positive, refuse_unread
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

LOCAL = StashKey[dict]("pfcl.local")  # {class: local prototype}
RECEIVED = StashKey[dict]("pfcl.received")  # the global library last received
MEMORY = StashKey[Any]("pfcl.memory")  # exemplars: indices into the run's training set
TEACHER = StashKey[tuple]("pfcl.teacher")  # (frozen model, {class: its prototype})
FRESH = StashKey[int]("pfcl.fresh")  # round whose prototypes are in LOCAL
# [sum, count] of the teacher's normalised entropy over the round's minibatches
TEACHER_ENTROPY = StashKey[list]("pfcl.teacher_entropy")

# the teacher's soft labels are called near uniform above this mean normalised entropy
FLAT = 0.99
# runs whose near-uniform teacher was said (once per run and process: a plugin attribute changed in a
# client's round would not come back from a Ray worker)
FLAT_SAID: weakref.WeakSet = weakref.WeakSet()


class PFCL(Plugin):
    """PFCL: prototype classifier, prototype-only federation, L_D, L_R, replay."""

    name = "pfcl"
    description = "PFCL: prototype-only federation, distance-softmax classifier, distillation and replay"

    @dataclass
    class Options:
        alpha: float = option(1.0, "weight of the distillation loss L_D (0: PFCL without L_D)", non_negative)
        beta: float = option(0.1, "weight of the prototype loss L_R (0: PFCL without L_R)", non_negative)
        temperature: float = option(
            2.0,
            "T of the prototype classifier (Eq. 11) and of the distillation (Eqs. 7-8): the paper's one T",
            positive,
        )
        memory: Literal["per-class", "total", "none"] = option(
            "per-class", "exemplar memory policy: fixed number per class, fixed total, or none"
        )
        memory_per_class: int = option(20, "exemplars per class (memory=per-class)", at_least_one)
        memory_size: int = option(200, "exemplars in all, shared by the seen classes (memory=total)", at_least_one)
        models: list[str] = option([], "backbones cycled over clients, e.g. mlp,cnn (empty: --model)")
        feature_dim: int = option(0, "feature size of every backbone (0: the model's default)", non_negative)

    def __init__(self, options=None):
        super().__init__(options)
        self.library: dict = {}  # server: class -> global prototype

    # --- set-up ---------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        from fedaval.models import MODELS

        o = self.options
        refuse_unread(
            "pfcl",
            o,
            [
                (("memory_size",), o.memory != "total", f"memory={o.memory}"),
                (("memory_per_class",), o.memory != "per-class", f"memory={o.memory}"),
            ],
        )
        if o.models and run.config.model != "auto":
            raise FedavalUsageError(
                f"--model {run.config.model} is not read when pfcl.models names the backbones "
                f"({','.join(o.models)}); drop one of them"
            )
        for name in self.options.models:
            if name not in MODELS:
                raise FedavalUsageError(f"bad value pfcl.models={name!r}; allowed: {', '.join(sorted(MODELS))}")
            if name.startswith("resnet") and self.options.feature_dim not in (0, 512):
                raise FedavalUsageError(f"bad value pfcl.feature_dim: {name} has 512-d features")
        if len(set(self.options.models)) > 1 and not self.options.feature_dim:
            raise FedavalUsageError(
                "pfcl.models mixes backbones: set pfcl.feature_dim so that all prototypes have one size"
            )

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        """Backbone ``models[client_id % len(models)]`` (the server gets the
        first), all with ``feature_dim`` features: no weights are averaged, so
        clients may differ (Section 3.1)."""
        from fedaval.models import MODELS, build_model

        names = self.options.models
        dim = self.options.feature_dim
        if not names and not dim:
            return None
        name = names[(client_id or 0) % len(names)] if names else run.config.model
        if name == "auto":
            name = "mlp" if run.data.input_shape[-1] <= 8 else "cnn"
        if not dim or name.startswith("resnet"):
            return build_model(name, run.data.input_shape, run.num_classes)
        return MODELS[name](run.data.input_shape, run.num_classes, feature_dim=dim)

    @hookimpl
    def fedaval_shared_keys(self, run, model):
        return []  # prototypes only: no weight goes up or down

    @hookimpl
    def fedaval_federation_model(self, run):
        """The server's model is never trained: PFCL is judged by its clients."""
        return "clients"

    # --- client round -----------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if "prototypes" in download:
            client.stash[RECEIVED] = {c: p.to(run.device) for c, p in download["prototypes"].items()}

    @hookimpl
    def fedaval_client_train_data(self, run, client, task):
        """Algorithm 2: the task's data plus the exemplar memory."""
        return client.stash.get(MEMORY)

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        """Give the task's classes (and the memory's) prototypes before the first minibatch."""
        client.stash.setdefault(LOCAL, dict).update(self._prototypes(run, client, task))

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        from fedaval.plugins.pfcl_math import library_logits

        library = self.library if client is None else client.stash.get(LOCAL, {})
        return library_logits(features, library, run.num_classes, self.options.temperature)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        from fedaval.plugins.pfcl_math import (
            distillation_from,
            normalised_entropy,
            prototype_regulariser,
            stack_library,
            teacher_soft_labels,
        )

        terms = {}
        teacher = client.stash.get(TEACHER)
        if self.options.alpha > 0 and teacher is not None:
            model, old = teacher
            classes, teacher_protos = stack_library(old)
            local = client.stash[LOCAL]
            student_protos = torch.stack([local[c] for c in classes])
            with torch.no_grad():
                teacher_features = model.features(batch.x)
                target = teacher_soft_labels(teacher_features, teacher_protos, self.options.temperature)
                flatness = normalised_entropy(target)
            sums = client.stash.setdefault(TEACHER_ENTROPY, lambda: [0.0, 0])
            sums[:] = [sums[0] + flatness, sums[1] + 1]  # not read here: no wait for the GPU
            terms["pfcl_distillation"] = self.options.alpha * distillation_from(
                target, batch.features, student_protos, self.options.temperature
            )
        received = client.stash.get(RECEIVED)
        if self.options.beta > 0 and received:
            terms["pfcl_prototype"] = self.options.beta * prototype_regulariser(batch.features, batch.y, received)
        return terms

    @hookimpl(wrapper=True)
    def fedaval_client_train(self, run, client, round):
        """The round's mean normalised entropy of the teacher's soft labels
        (``pfcl/teacher_entropy``, 1 = uniform; only in rounds where L_D acts):
        how much L_D can pass on (:func:`~fedaval.plugins.pfcl_math.normalised_entropy`)."""
        losses = yield
        sums = client.stash.pop(TEACHER_ENTROPY, None)
        if losses is not None and sums is not None:
            losses = {**losses, "pfcl/teacher_entropy": sums[0] / sums[1]}
        return losses

    def warn_if_flat(self, run, client, task: int) -> None:
        """Once per run: a warning when the teacher's soft labels were near
        uniform in a task's last round (L_D then does almost nothing). One read
        of the round's sum, at the task's end."""
        sums = client.stash.get(TEACHER_ENTROPY)
        if sums is None or run in FLAT_SAID:
            return
        flatness = float(sums[0] / sums[1])
        if flatness >= FLAT:
            import logging

            FLAT_SAID.add(run)
            logging.getLogger("fedaval").warning(
                "pfcl: the teacher's soft labels were near uniform in task %d of client %d (normalised entropy "
                "%.3f; 1 = uniform): L_D passes almost nothing on, because the prototypes lie close together "
                "against pfcl.temperature=%g (the paper's T for its ResNet-34's features); see "
                "pfcl/teacher_entropy in results.json and docs/methods.md",
                task,
                client.id,
                flatness,
                self.options.temperature,
            )

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        """Algorithm 2, lines 9-12: prototypes, then memory by Eq. (9), then
        freeze the teacher."""
        from fedaval.plugins.pfcl_math import memory_quota, select_exemplars

        self.warn_if_flat(run, client, task)

        indices, y, features = self._features(run, client, task)
        self._set_local(run, client, features, y)
        library = client.stash[LOCAL]
        quota = memory_quota(self.options.memory, len(library), self.options.memory_per_class, self.options.memory_size)
        keep = select_exemplars(features, y, library, quota)
        if len(keep):
            client.stash[MEMORY] = indices[keep.cpu().numpy()]
        else:
            client.stash.pop(MEMORY, None)
        frozen = copy.deepcopy(client.model).eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        client.stash[TEACHER] = (frozen, {c: p.clone() for c, p in library.items()})

    # --- upload and fusion ------------------------------------------------------
    @hookimpl
    def fedaval_client_upload(self, run, client):
        """Algorithm 2, line 8: the local prototypes (Eq. 2) of every class the
        client has learned, recomputed on its task data plus memory."""
        if client.stash.get(FRESH) != run.round:
            client.stash.setdefault(LOCAL, dict).update(self._prototypes(run, client, client.task))
            client.stash[FRESH] = run.round
        return {"prototypes": {c: p.detach().clone() for c, p in client.stash[LOCAL].items()}}

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.plugins.pfcl_math import fuse_prototypes, update_library

        fused = fuse_prototypes([u.get("prototypes") for u in uploads if u.get("prototypes")])
        self.library = update_library(self.library, fused)
        return {"prototypes": self.library}

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"pfcl_library_classes": len(self.library)}

    # --- helpers ------------------------------------------------------------------
    def _features(self, run, client, task):
        """Training-set indices, labels and eval-mode features of the task's
        data plus memory."""
        import numpy as np

        from fedaval.prototypes import extract_features
        from fedaval.streams import make_dataset

        memory = client.stash.get(MEMORY)
        indices = np.asarray(client.tasks.indices[task], dtype=np.int64)
        if memory is not None:
            indices = np.concatenate([indices, memory])
        features, y = extract_features(client.model, make_dataset(run.data, "train", indices), run.device)
        return indices, y, features

    def _prototypes(self, run, client, task):
        from fedaval.plugins.pfcl_math import class_means

        _, y, features = self._features(run, client, task)
        return class_means(features, y)

    def _set_local(self, run, client, features, y):
        from fedaval.plugins.pfcl_math import class_means

        client.stash.setdefault(LOCAL, dict).update(class_means(features, y))
        client.stash[FRESH] = run.round
