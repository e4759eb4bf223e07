"""FedSpace (Shenaj, Toldo, Rigon, Zanuttigh, "Asynchronous Federated
Continual Learning", CVPR Workshops 2023). The maths is in
:mod:`fedaval.plugins.fedspace_math`; this module is the hook glue.

FedSpace's setting is asynchronous FCL: every client learns its own sequence
of tasks, in its own order and at its own pace, so at any round the clients
are on different classes. Its answer is a shared prototype space: clients send
the server a prototype and a radius per class they have learned, the server
averages them, and every client keeps the classes known to the federation
(its own earlier ones and other clients') alive in its classifier by training
it on noisy samples drawn around their prototypes (PASS's prototype
augmentation). Model weights are FedAvg-ed (the default fusion).

What happens:

* **Upload** (client, ``fedaval_client_task_end`` + ``fedaval_client_upload``):
  when a client finishes a task it computes, with its model in eval mode on
  the task's training samples, each class's prototype (mean feature), radius
  and sample count (:func:`~fedaval.plugins.fedspace_math.prototypes_and_radii`)
  and uploads them with that round's weights (``fedspace_prototypes``,
  ``fedspace_radii``, ``fedspace_counts``: bytes counted from these tensors).
* **Server** (``fedaval_server_fuse``): the uploads of a round are averaged
  per class, weighted by counts (:func:`~fedaval.plugins.fedspace_math.fuse_banks`);
  the result replaces the bank's entry of each uploaded class (newer
  prototypes live in the newer feature space); other classes keep theirs.
* **Download** (``fedaval_server_download``): a client whose copy of the bank
  is out of date gets the whole bank (prototypes and radii) with its next
  download; a client whose copy is current gets nothing more, so the bytes
  down count the bank once per change per client.
* **Client loss** (``fedaval_client_loss``): in every minibatch, ``B`` pseudo
  features (``B`` = the minibatch size, as PASS) ``mu_c + r_c * N(0, I)`` of
  classes drawn uniformly from the bank's classes that are not in the client's
  current task (:func:`~fedaval.plugins.fedspace_math.pseudo_features`), fed
  to the classifier with cross-entropy, times ``weight``:
  ``fedspace_pseudo_ce``. The noise comes from the client's own random
  stream (a run is reproducible, and does not depend on the clients' order).

Readings chosen (the paper is a workshop paper with few details; what we
read, from the paper's Section 4 and PASS, each pinned by a test in
``tests/test_fedspace.py``):

1. *Radius*: one per class, ``r_c = sqrt(trace(Cov_c) / D)`` (PASS's
   formula, applied per class instead of PASS's single radius averaged over
   classes). The server's radius of a class is the square root of the
   count-weighted mean of the clients' ``r^2`` (their variances; the spread
   between the clients' prototypes is not added).
2. *When prototypes go up*: once per task, at the client's last round of it
   (PASS saves prototypes after each task), not every round.
3. *Which classes are augmented*: every class in the bank the client has,
   except its current task's classes: its own earlier classes and classes only
   other clients have learned.
4. *Pseudo-feature loss*: a plain cross-entropy over the pseudo features on
   the classifier's logits (PASS divides the logits by a temperature of 0.1
   and weights the term by 10; our ``weight`` defaults to 1 and there is no
   temperature, as the real samples' cross-entropy has none here).
5. *Left out*: the fractal pre-training of the feature extractor (optional in
   the paper; a run starts from the model's random initialisation), FedSpace's
   representation loss and any feature distillation (PASS's KD on features):
   only the prototype exchange and the prototype augmentation are here.
6. *Asynchrony*: fedaval's scenarios give each client its own task order
   (``fcil-async``: own class order per client; ``fcl-random``: own sequence of
   own length, so clients finish at different stages) and, with
   ``--clients-per-round`` below the number of clients, each client's first
   and last round of a task are the rounds it is sampled in. Task boundaries
   still fall on the federation's stages; the method itself assumes nothing
   about them (the bank changes whenever any client finishes a task).

Every scenario runs (sthfl, fcil-sync, fcil-async, fcl-random); fcil-async
and fcl-random are the asynchronous ones FedSpace was made for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedaval import hookimpl
from fedaval.options import non_negative, option
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

BANK = StashKey[dict]("fedspace.bank")  # the bank as last received: {class: (prototype, radius)}
PENDING = StashKey[dict]("fedspace.pending")  # this task's {class: (prototype, radius, count)}, to upload

PROTOTYPES, RADII, COUNTS = "fedspace_prototypes", "fedspace_radii", "fedspace_counts"
PSEUDO_CE = "fedspace_pseudo_ce"


class FedSpace(Plugin):
    """Client: prototypes and radii at each task's end, pseudo features of the
    bank's other classes in every minibatch. Server: count-weighted prototype
    averaging, the bank sent to clients whose copy is out of date.

    Server state: ``bank`` ({class: (prototype, radius, count)}),
    ``version`` (bumped when the bank changes) and ``sent`` (client id -> the
    version it last received)."""

    name = "fedspace"
    description = "FedSpace: prototype + radius uploads, server averaging, pseudo features of old classes"
    loss_terms = (PSEUDO_CE,)

    @dataclass
    class Options:
        weight: float = option(1.0, "weight of the pseudo-feature cross-entropy (0: no augmentation)", non_negative)

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.bank: dict[int, tuple[Any, Any, int]] = {}
        self.version = 0
        self.sent: dict[int, int] = {}

    # --- client --------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if PROTOTYPES in download:
            radii = download[RADII]
            client.stash[BANK] = {
                int(c): (mu.to(run.device), radii[c].to(run.device)) for c, mu in download[PROTOTYPES].items()
            }

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        import torch

        from fedaval.plugins.fedspace_math import pseudo_feature_loss, pseudo_features

        bank = client.stash.get(BANK)
        if not bank or self.options.weight == 0:
            return None
        current = set(client.tasks.classes[client.task])
        old = [c for c in sorted(bank) if c not in current]
        if not old:
            return None
        protos = torch.stack([bank[c][0] for c in old]).to(batch.features)
        radii = torch.stack([bank[c][1] for c in old]).to(batch.features)
        pseudo, labels = pseudo_features(protos, radii, old, len(batch.y))
        logits = client.model.classifier(pseudo)
        return {PSEUDO_CE: self.options.weight * pseudo_feature_loss(logits, labels)}

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        """Reading 2: the task's prototypes and radii, with the model as the task ends."""
        from fedaval.plugins.fedspace_math import prototypes_and_radii
        from fedaval.prototypes import extract_features

        exp = client.train_stream[task]
        if exp is None:
            return
        features, labels = extract_features(client.model, exp.dataset, run.device, run=run)
        client.stash[PENDING] = prototypes_and_radii(features, labels)

    @hookimpl
    def fedaval_client_upload(self, run, client):
        pending = client.stash.pop(PENDING, None)
        if not pending:
            return None
        return {
            PROTOTYPES: {c: mu.detach().cpu() for c, (mu, _, _) in pending.items()},
            RADII: {c: r.detach().cpu() for c, (_, r, _) in pending.items()},
            COUNTS: {c: n for c, (_, _, n) in pending.items()},
        }

    # --- server --------------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.plugins.fedspace_math import fuse_banks

        banks = [
            {c: (mu, u.get(RADII)[c], int(u.get(COUNTS)[c])) for c, mu in u.get(PROTOTYPES).items()}
            for u in uploads
            if u.get(PROTOTYPES)
        ]
        if banks:
            self.bank.update(fuse_banks(banks))
            self.version += 1
        return None

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        """The bank, to a client whose copy is older than the bank."""
        if not self.bank or self.sent.get(client.id) == self.version:
            return None
        self.sent[client.id] = self.version
        return {
            PROTOTYPES: {c: mu for c, (mu, _, _) in self.bank.items()},
            RADII: {c: r for c, (_, r, _) in self.bank.items()},
        }

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"fedspace_bank_classes": len(self.bank)}
