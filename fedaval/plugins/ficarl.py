"""FediCaRL: iCaRL (Rebuffi et al., CVPR 2017) on every client, FedAvg of the
weights; the baseline FedProK's Table 1 calls FediCaRL (exemplar memory 500).
The maths is in :mod:`fedaval.plugins.ficarl_math`; this module is the hook
glue.

What happens, per client (iCaRL's Algorithms 1-5, stretched over federated
rounds: a task spans many rounds, end-of-task work runs once, at the client's
last round of the task):

* **Training data** (Algorithm 3): the task's samples plus the client's
  exemplar memory, added through ``fedaval_client_train_data`` as indices into
  ``run.data.train_x`` (minibatches stay on the device data path).
* **Loss** (Algorithm 3): iCaRL's sigmoid/binary cross-entropy, per output.
  Outputs of the classes new to the client in this task (and of earlier
  classes when there is no teacher) take one-hot targets: the base loss
  (``fedaval_client_criterion``, logged as ``loss/classification``). Outputs of
  the client's old classes take the previous model's sigmoid outputs as
  targets: ``ficarl_distillation`` (logged as ``loss/ficarl_distillation``),
  present from the client's second task on.
* **Memory** (Algorithms 4-5): at the end of each task (``fedaval_client_task_end``)
  the fixed memory of K exemplars (``memory_size``, 500 by default as in
  FedProK) is split evenly over the classes the client has seen
  (:func:`~fedaval.plugins.ficarl_math.memory_quotas`); the sets of old classes
  are cut to their new quota (herding keeps them in order of choice, so the
  cut keeps the first ones) and each class of the task gets a new set chosen
  by herding (:func:`~fedaval.plugins.ficarl_math.herding_order`, Avalanche's
  ``HerdingSelectionStrategy``'s greedy step, stopped at the quota) on the
  normalised features of the client's model at that moment.
* **Classification** (Algorithm 1): the client's evaluation is
  nearest-mean-of-exemplars; the class means are computed with the client's
  model just before each evaluation (a ``wrapper=True``
  ``fedaval_client_evaluate``). Training uses the linear head (the sigmoid
  outputs above).
* **Server**: FedAvg of all weights (the default fusion), nothing else.

Readings chosen (each pinned by a test in ``tests/test_ficarl.py``):

1. *The previous model* ("teacher") is the model the client holds when it
   starts a new task, i.e. the global model just received at its first round
   of the task (the federation's model after the previous stage), frozen.
   The client's "old classes" are the classes of its earlier tasks that are
   not in the current task; a class that comes back in a later task is
   trained with one-hot targets again (sthfl).
2. *Normalisation of the loss*: iCaRL sums the binary cross-entropies over
   classes and samples; here the per-sample sum over classes is averaged over
   the minibatch, so the learning rate keeps its meaning (Avalanche's
   ``ICaRLLossPlugin`` averages over classes too: ours is its value times the
   number of outputs, when every output takes part; a test checks this).
   Only the outputs of classes the client has seen take part: the outputs of
   classes other clients hold are not pushed to zero by a client that never
   saw them.
3. *Memory quota*: K // (seen classes) each, the remainder one each to the
   lowest class ids (Avalanche's class-balanced split), so the memory holds
   exactly K exemplars when the client has that many samples (else all of
   them). The memory is the client's own: exemplars are real samples of its
   earlier tasks.
4. *Herding features*: the model's ``features`` output, L2-normalised, with
   the model in eval mode (BatchNorm running statistics). iCaRL also averages
   over horizontally flipped images when it computes the class means; we do
   not (no flip for digits).
5. *NME before a class has exemplars*: at an evaluation in the middle of a
   task (``--eval-every``) the task's classes have no exemplars yet; their
   mean is then taken over all the client's training samples of the class
   (what the exemplar mean approximates, iCaRL Section 2.1).
6. *Global model*: the server's model has no exemplars; it is evaluated with
   its linear head (the FedAvg of the clients' heads, trained with the
   sigmoid loss), over the classes the federation has been taught so far
   (the stages up to the current one). iCaRL's output layer grows with the
   classes; fedaval's head has an output per dataset class from the start,
   and the sigmoid loss never trains the outputs of classes not yet taught,
   so without the restriction they would win the argmax by chance. Clients
   upload weights only: no class means leave a client (they would be in each
   client's own feature space, not the global model's). A client evaluated
   with ``nme=false`` uses its head over its own seen classes, likewise.

Options: ``memory_size`` (K), ``distillation`` (false: no distillation, the
old-class outputs take one-hot targets too) and ``nme`` (false: clients are
evaluated with their linear head). Every scenario fits (sthfl, fcil-sync,
fcil-async, fcl-random): iCaRL needs only tasks of classes.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from fedaval import hookimpl
from fedaval.options import option, positive
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

MEMORY = StashKey[dict]("ficarl.memory")  # {class: training-set indices, in herding order}
TEACHER = StashKey[tuple]("ficarl.teacher")  # (frozen previous model, its old classes)
MEANS = StashKey[dict]("ficarl.means")  # {class: exemplar mean}, during an evaluation only

DISTILLATION = "ficarl_distillation"


class FediCaRL(Plugin):
    """iCaRL on every client (herded memory, sigmoid loss with distillation,
    nearest-mean-of-exemplars evaluation); FedAvg on the server."""

    name = "ficarl"
    description = "FediCaRL: iCaRL on every client (herding memory, distillation, NME), FedAvg of weights"
    loss_terms = (DISTILLATION,)

    @dataclass
    class Options:
        memory_size: int = option(
            500, "K: exemplars per client, split evenly over its seen classes (FedProK: 500)", positive
        )
        distillation: bool = option(True, "distil the previous model's old-class outputs (false: ablation)")
        nme: bool = option(True, "clients classify by nearest mean of exemplars (false: linear head)")

    # --- client: training ----------------------------------------------------
    @hookimpl
    def fedaval_client_train_data(self, run, client, task):
        """Algorithm 3: the task's samples plus every exemplar of the memory."""
        import numpy as np

        memory = client.stash.get(MEMORY)
        if not memory:
            return None
        return np.concatenate([memory[c] for c in sorted(memory)]).astype(np.int64)

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        """Reading 1: freeze the model as received at the task's first round."""
        old = self.old_classes(client, task)
        if not self.options.distillation or not old:
            client.stash.pop(TEACHER, None)
            return
        teacher = copy.deepcopy(client.model).eval()
        for p in teacher.parameters():
            p.requires_grad_(False)
        client.stash[TEACHER] = (teacher, old)

    @staticmethod
    def old_classes(client, task: int) -> list[int]:
        current = set(client.tasks.classes[task])
        earlier = {c for t in client.tasks_started if t != task for c in client.tasks.classes[t]}
        return sorted(earlier - current)

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        from fedaval.plugins.ficarl_math import classification_loss

        teacher = client.stash.get(TEACHER)
        distilled = set(teacher[1]) if teacher is not None else set()
        new = [c for c in client.seen_classes() if c not in distilled]
        return classification_loss(logits, y, new)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        import torch

        from fedaval.plugins.ficarl_math import distillation_loss

        teacher = client.stash.get(TEACHER)
        if teacher is None:
            return None
        model, old = teacher
        with torch.no_grad():
            teacher_logits = model.classifier(model.features(batch.x))
        return {DISTILLATION: distillation_loss(batch.logits, teacher_logits, old)}

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        """Algorithms 4-5: cut the old sets to their quota, herd the task's classes."""
        from fedaval.plugins.ficarl_math import cut_sets, herd_classes, memory_quotas

        quotas = memory_quotas(self.options.memory_size, client.seen_classes())
        memory = dict(client.stash.get(MEMORY) or {})
        indices = client.tasks.indices[task]
        if len(indices):
            features, labels = self._features(run, client, indices)
            memory.update(herd_classes(features, labels, indices, client.tasks.classes[task], quotas))
        client.stash[MEMORY] = cut_sets(memory, quotas)

    # --- client: evaluation --------------------------------------------------
    @hookimpl(wrapper=True)
    def fedaval_client_evaluate(self, run, client):
        """Algorithm 1: the class means with the model as it is now, for the
        evaluation that follows."""
        if self.options.nme:
            client.stash[MEANS] = self.class_means(run, client)
        try:
            return (yield)
        finally:
            client.stash.pop(MEANS, None)

    def class_means(self, run, client) -> dict[int, Any]:
        """Exemplar means of the memory's classes; a seen class without
        exemplars (mid-task) uses all of the current task's samples (reading 5)."""
        import numpy as np
        import torch

        from fedaval.plugins.ficarl_math import exemplar_means

        memory = client.stash.get(MEMORY) or {}
        parts = [memory[c] for c in sorted(memory)]
        own = np.asarray(client.tasks.indices[client.task], dtype=np.int64)
        labels_own = run.data.train_y[torch.as_tensor(own)]
        missing = [c for c in client.seen_classes() if c not in memory]
        keep = torch.isin(labels_own, torch.as_tensor(missing, dtype=labels_own.dtype)).numpy() if missing else None
        if keep is not None and keep.any():
            parts.append(own[keep])
        if not parts:
            return {}
        features, labels = self._features(run, client, np.concatenate(parts))
        return exemplar_means(features, labels)

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        """Training: the linear head (``None``). Evaluation: a client by
        nearest mean of exemplars; the global model (and a client with
        ``nme=false``) by its linear head over the classes taught so far
        (reading 6)."""
        if training:
            return None
        from fedaval.prototypes import taught_scores

        if client is None:
            return taught_scores(model.classifier(features), run.federation_seen_classes())
        means = client.stash.get(MEANS)
        if self.options.nme and means:
            from fedaval.plugins.ficarl_math import nme_scores

            return nme_scores(features, means, run.num_classes)
        return taught_scores(model.classifier(features), client.seen_classes())

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        """``ficarl_memory``: mean exemplars held by the clients sampled this round."""
        memories = [run.clients[k].stash.get(MEMORY) for k in run.schedule[round - 1]]
        sizes = [sum(len(v) for v in m.values()) for m in memories if m]
        return {"ficarl_memory": sum(sizes) / len(sizes)} if sizes else None

    # --- helpers -------------------------------------------------------------
    @staticmethod
    def _features(run, client, indices):
        from fedaval.prototypes import extract_features
        from fedaval.streams import make_dataset

        return extract_features(client.model, make_dataset(run.data, "train", indices), run.device)
