"""FedProK: federated prototypical feature knowledge transfer (``shared/papers/fedprok.txt``).

Two parts, one plugin:

* **Feature translation (client, Sec. 5.1, Eqs. 5-8, after FeTrIL, Petit et
  al. 2023).** Every round each client computes the prototype (mean feature,
  Eq. 5) and sample count of each class of its current task. From task index
  1 on (0-based; the paper's t > 1) the feature extractor is frozen, and for
  every previous class ``p`` in the client's prototype list the client picks
  the current class ``n`` whose prototype is most cosine-similar (Eqs. 6-7)
  and turns real features of class ``n`` into pseudo features of ``p``,
  ``f^(x_p) = f(x_n) + mu_p - mu_n`` (Eq. 8). The classifier is trained on
  the real current-task features (the core's cross-entropy) plus these pseudo
  features (the ``pseudo_ce`` local-loss term).
* **Prototypical knowledge fusion (server, Sec. 5.2, Eq. 9).** Clients upload
  their current-task prototypes with counts; the server keeps the global
  prototype list: a class new to the federation gets the count-weighted mean
  ``sum_k |D_kc|/|D_c| mu_kc``; a class already known before the current task
  gets ``beta * (that mean) + (1 - beta) * mu_c^{t-1}``. The list is sent back
  and overwrites the clients' lists before their next local training. Model
  weights are FedAvg-ed by the default FedAvg plugin (or with 1/K, reading 7).

Readings chosen where the paper is open (each pinned by a test in
``tests/test_fedprok.py``):

1. *Nearest class* (Eq. 7 writes argmin of a cosine *similarity*): the base
   class is the current class of **largest** cosine similarity
   (``nearest_classes``); ties go to the lowest class id.
2. *When prototypes are computed, and in which feature space*: every stored
   prototype lives in the feature space of the extractor that is frozen.
   With a frozen extractor (task index >= 1) the current-task prototypes
   are computed at the start of the round (Algorithm 1, line 4) and are the
   same after training. While the extractor trains (task 0, or
   ``freeze=false``) the prototypes uploaded are computed *after* local
   training, from the weights uploaded with them. The frozen extractor is
   the fusion of task 0's last round, which no client holds before task 1
   begins; so at its first round of a task each client re-measures its
   previous task's classes with the extractor it just received (when that
   task's extractor was still training: task 0, or every task without
   freezing), keeps them in its list and uploads them; the server replaces
   its stored prototypes of those classes (and Eq. 9's anchor) with their
   count-weighted mean. Measured on digits before this reading (prototypes
   of epoch 0 uploaded): task-0 prototypes lay 0.34 to 0.38 of their length
   from the frozen extractor's class means (the issue measured 0.96 to 1.13
   on CIFAR-10); after: below 1e-6. Eval mode throughout.
3. *Pseudo-feature loss*: each pseudo feature counts like one real sample, so
   the classifier sees the union of real and translated features with every
   class weighted alike (FeTrIL's balanced training set):
   ``pseudo_ce = weight * sum_i CE(g(f^_i), p_i) / B`` where ``B`` is the
   minibatch size and ``i`` runs over the pseudo features built from the
   minibatch (each old class ``p`` gets one pseudo feature per minibatch sample
   of its base class). Pseudo features are always detached: they train the
   classifier only (with a frozen extractor the features carry no gradient
   anyway).
4. *EMA anchor for known classes* (Eq. 9, ``mu_c^{t-1}``): the global
   prototype the class had when the current task began, not the previous
   round's value; classes whose first task is the current one are replaced by
   the weighted mean every round of that task.
5. *Freezing*: ``requires_grad=False`` on every parameter of
   ``model.features`` and the feature extractor in eval mode (BatchNorm
   statistics frozen too), from the first local epoch of task index 1 on.
   It bounds what FedProK can reach: the best linear classifier on the
   frozen extractor, fitted on every class's real features at once, scores
   48.18% (CPU-scale Table 1, mean of 3 seeds) and 49.47% (full scale, seed
   42), below the paper's 64.34 (``benchmarks/fedprok_ceiling.py``,
   docs/reproduction.md).
6. *"Previous" classes of a client*: the paper's union over i < t of C^i,
   the classes any client had at task i (Sec. 3.1 defines C^t as the union
   over the clients; Fig. 2: "the previous classes of the entire federated
   system"), less the client's current classes, looked up in its prototype
   list (the fused list with fusion; without fusion the client's own list,
   so only its own classes). Other clients' classes of the *current* task
   are not previous classes and are not translated. Until session 33 the
   union was of the client's own earlier classes: the same in fcil-sync,
   where every client's task is the whole class group, but in fcil-async
   classes only other clients had held were never translated.
7. *Weight fusion* (Algorithm 1, line 13 writes ``1/K sum_k theta_k``):
   ``-o fedprok.weighting=uniform`` averages the weights with 1/K;
   ``samples`` (the default) keeps FedAvg's sample-weighted mean, which the
   paper's baselines use and which Eq. 9 uses for the prototypes. The
   presets say which they use.
8. *Training the classifier* (Algorithm 1, line 9: "local training ... with
   pseudo features"; FeTrIL fits its classifier to convergence on the
   balanced set). With a frozen extractor, after the round's local epochs
   each client fits the classifier alone to convergence on features
   extracted once: the cross-entropy of its real current-task features plus
   that of their translations (reading 3), the run's weight decay as an L2
   term, by full-batch L-BFGS (``fit_head``; at most ``head_steps``
   iterations, 1000: on the CPU-scale Table 1, seed 42, a task's first fit
   converged in 371 iterations at task 1, 490 at task 2, 693 at task 3 and
   781 at task 4 (session 21, round means over the clients), the more old
   classes the more; stopped at 200, up to 7% of the balanced set's
   predictions differed from the converged fit's, session 14).
   Why a fit: the local epochs alone leave the classifier far from
   converged, and an under-trained linear head scores like a dot product
   with the class means, which favours the task-0 classes whose features the
   extractor was trained to make large (the README example's last accuracy
   row was [0.84, 0, 0, 0, 0] without it). Neither the loss weighting
   (``weight=0.2`` forgets every old class) nor the frozen extractor (a
   linear probe on the barely trained one reaches 0.95) was the cause. Why
   L-BFGS: the fit's first form, 20 epochs of SGD at lr 0.1 with the run's
   momentum, did not converge. On the CPU-scale Table 1 (features of norm
   about 6) a client's accuracy on its own balanced set after the fit moved
   up or down by up to 0.23 from one round to the next, and with ResNet-18
   at full scale the mean loss of its last epoch was 9 to 60 at task 4. A
   fixed step that suits one feature scale diverges at another; L-BFGS's
   line search does not depend on it. Measured on digits, the README example (3 clients, 5
   tasks, 3 rounds x 1 epoch, lr 0.01): new-task accuracy after tasks 1-4
   0.93, 0.98, 0.94, 0.94 and last row [0.86, 0.78, 0.90, 0.82, 0.94]
   (with the SGD fit: 0.81, 0.87, 0.59, 0.82 and [0.88, 0.79, 0.86, 0.83,
   0.82]). ``head_steps=0`` gives the paper's plain local training. The
   round's ``fedprok/head_fit_steps`` records the iterations the fit took
   (mean over clients); ``head_steps`` there means it stopped at the cap.
   The fit's objective is convex (weight decay > 0), so the head a client
   uploads is the fit's minimum wherever it starts: with a frozen extractor
   the local epochs only cost time (counted in E). A task's first fit starts
   from the head the local epochs left; the task's later fits start from the
   client's last fit (``FITTED`` in its stash), which is close to their
   minimum, since the frozen extractor's features change little within a
   task. Since session 21; a later fit then takes a few iterations instead
   of hundreds, the same minimum up to the fit's tolerance. ``weight``
   scales the pseudo features' cross-entropy in the fit as in the local
   epochs (until session 20 the fit ignored it, so the option changed
   nothing a client uploaded once its extractor was frozen). Where: on the
   CPU by default (``fit_device``), on a copy of the classifier whose
   fitted weights are copied back. PyTorch's L-BFGS reads scalars back from
   the device about 45 times an iteration (two per history entry in its
   two-loop recursion, more in the line search); on an H100 shared by six
   full-scale runs (session 21) an iteration took some 40 to 57 ms, a fit
   320 to 1,000 of them: most of the round. ``fit_device=run`` fits on the
   run's device. The fit does not make the pseudo features (``fit_head``:
   the head is linear).

Ablations (paper Table 1): ``-o fedprok.translation=false`` (w/o FT: no pseudo
features) and ``-o fedprok.fusion=false`` (w/o PKF: no prototype is uploaded
or fused; every client translates from its own prototypes only).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedaval import hookimpl
from fedaval.options import non_negative, option, refuse_unread, unit_interval
from fedaval.plugin import Plugin
from fedaval.plugins.fedprok_math import (
    Translation,
    class_prototypes,
    fit_head,
    fuse_prototypes,
    plan_translation,
    pseudo_cross_entropy,
    translate_features,
)
from fedaval.stash import StashKey

DOWNLOAD_KEY = "fedprok_prototypes"
UPLOAD_KEY = "fedprok_prototypes"
COUNTS_KEY = "fedprok_counts"
LIBRARY = StashKey[dict]("fedprok.library")  # class -> prototype: the client's prototype list
CURRENT = StashKey[dict]("fedprok.current")  # class -> (prototype, count) of the current task
REFRESH = StashKey[dict]("fedprok.refresh")  # class -> (prototype, count) of the previous task, re-measured
PLAN = StashKey[Translation]("fedprok.plan")  # this round's translation (Eq. 8), while the client trains
FITTED = StashKey[tuple]("fedprok.fitted")  # (task, classifier state): the client's last classifier fit
REFRESH_KEY = "fedprok_refreshed"
REFRESH_COUNTS_KEY = "fedprok_refreshed_counts"


@dataclass
class FedProKOptions:
    translation: bool = option(True, "feature translation on the clients (false: ablation w/o FT)")
    fusion: bool = option(True, "prototypical knowledge fusion on the server (false: ablation w/o PKF)")
    beta: float = option(0.5, "Eq. 9: weight of this round's mean for a class known before the task", unit_interval)
    freeze: bool = option(True, "freeze the feature extractor from task index 1 on (FeTrIL)")
    weight: float = option(
        1.0, "weight of the pseudo-feature cross-entropy (local epochs and the classifier fit)", non_negative
    )
    head_steps: int = option(
        1000,
        "with a frozen extractor: at most this many L-BFGS iterations fitting the classifier to convergence "
        "on the round's real and pseudo features after local training (FeTrIL's converged classifier; 0: off)",
        non_negative,
    )
    weighting: Literal["samples", "uniform"] = option(
        "samples", "FedAvg of the weights: by sample counts, or uniform 1/K (Algorithm 1, line 13)"
    )
    fit_device: Literal["cpu", "run"] = option(
        "cpu",
        "where the classifier fit runs: on the CPU (PyTorch's L-BFGS waits for a GPU some 45 times an "
        "iteration) or on the run's device",
    )


class FedProK(Plugin):
    """Client: prototypes, frozen extractor, translated pseudo features of old
    classes. Server: count-weighted prototype fusion with EMA for known classes.

    State: in each client's stash, ``LIBRARY`` its prototype list (class ->
    prototype, overwritten by the global list on receive), ``CURRENT`` its
    current-task prototypes and counts (class -> (prototype, count)) and
    ``REFRESH`` its previous task's prototypes re-measured with the extractor
    it now holds (reading 2); on the plugin (the server),
    ``global_prototypes`` the knowledge base, ``anchor`` the global list as
    it was when the current task began (set in ``fedaval_server_task_start``)
    and ``refreshed`` the count-weighted sums of this task's re-measured
    prototypes."""

    name = "fedprok"
    description = "FedProK: feature translation of old classes from prototypes + server prototype fusion"
    Options = FedProKOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.global_prototypes: dict[int, Any] = {}
        self.anchor: dict[int, Any] = {}
        self.refreshed: dict[int, tuple[Any, int]] = {}

    @hookimpl
    def fedaval_setup(self, run):
        o = self.options
        refuse_unread(
            "fedprok",
            o,
            [
                (("beta",), not o.fusion, "fusion=false"),
                (("weight", "head_steps"), not o.translation, "translation=false"),
                (("head_steps",), not o.freeze, "freeze=false"),
            ],
        )

    # --- client -----------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        fused = download.get(DOWNLOAD_KEY)
        if self.options.fusion and fused:
            library = client.stash.setdefault(LIBRARY, dict)
            for c, mu in fused.items():
                library[int(c)] = mu.detach().clone().to(run.device)

    def frozen(self, client) -> bool:
        return self.options.freeze and client.task >= 1

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        """Reading 2: the previous task's classes re-measured with the
        extractor just received, when that extractor is not the one the
        previous task's prototypes came from (task 0's extractor trains
        until its last fusion; every task's without freezing)."""
        client.stash.pop(REFRESH, None)
        previous = task - 1
        if previous < 0 or not client.has_task(previous) or (self.options.freeze and previous >= 1):
            return
        remeasured = self.compute_prototypes(run, client, previous)
        library = client.stash.setdefault(LIBRARY, dict)
        for c, (mu, _) in remeasured.items():
            library[c] = mu
        client.stash[REFRESH] = remeasured

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if self.frozen(client):
            for p in client.model.features.parameters():
                p.requires_grad_(False)
            client.model.features.eval()
        if epoch == 0:
            client.stash[CURRENT] = self.compute_prototypes(run, client)
            client.stash.pop(PLAN, None)
            if self.options.translation and client.task >= 1:
                plan = self.plan(client)
                if plan is not None:
                    client.stash[PLAN] = plan

    def plan(self, client) -> Translation | None:
        """Eq. 8's translation for this round: the client's previous classes
        (reading 6) that its prototype list holds, onto the current task's
        classes; None when either side is empty. Made once per round, when
        the current prototypes are (Algorithm 1, line 4): neither changes
        while the client trains."""
        current = client.stash.get(CURRENT) or {}
        library = client.stash.get(LIBRARY) or {}
        old = [c for c in self.previous_classes(client) if c in library and c not in current]
        if not old or not current:
            return None
        new = sorted(current)
        return plan_translation(
            old, torch.stack([library[c] for c in old]), new, torch.stack([current[c][0] for c in new])
        )

    def compute_prototypes(self, run, client, task: int | None = None) -> dict[int, tuple[Any, int]]:
        """Eq. 5 on the client's training data of ``task`` (default: the
        current one), extractor in eval mode; the model's train/eval modes
        are restored."""
        from fedaval.prototypes import extract_features

        exp = client.train_stream[client.task if task is None else task]
        if exp is None:
            return {}
        return class_prototypes(*extract_features(client.model, exp.dataset, run.device, run=run))

    def previous_classes(self, client) -> list[int]:
        """Reading 6: the paper's previous classes, the union over i < t of
        C^i, where C^i is the union of every client's classes of task i
        (Sec. 3.1), less the classes of the client's current task."""
        stages = client.run.federation_task_classes()
        now = set(client.tasks.classes[client.task]) if client.task < client.tasks.num_tasks else set()
        return sorted({c for t in range(min(client.task, len(stages))) for c in stages[t]} - now)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        plan = client.stash.get(PLAN)
        if plan is None:
            return None
        pseudo, labels, valid = translate_features(batch.features.detach(), batch.y, plan)
        logits = client.model.classifier(pseudo)
        return {"pseudo_ce": self.options.weight * pseudo_cross_entropy(logits, labels, len(batch.y), valid)}

    @hookimpl(wrapper=True)
    def fedaval_client_train(self, run, client, round):
        """Reading 8: after the round's local training, with a frozen
        extractor, the classifier is fit on the class-balanced set of the
        client's real current-task features and their translations."""
        losses = yield
        if self.frozen(client) and self.options.translation and self.options.head_steps:
            fit = self.fit_classifier(run, client)
            if fit is not None:
                losses = {**losses, **fit}
        return losses

    def fit_classifier(self, run, client) -> dict[str, float] | None:
        """Reading 8: the classifier alone fit to convergence
        (:func:`fit_head`: full-batch L-BFGS, at most ``head_steps``
        iterations, the run's weight decay as the L2 term) on the round's
        real current-task features, extracted once, and their translations.
        Returns the fit's cross-entropy at the end and its iterations."""
        from fedaval.prototypes import extract_features

        plan = client.stash.get(PLAN)
        exp = client.train_stream[client.task]
        if plan is None or exp is None:
            return None
        features, labels = extract_features(client.model, exp.dataset, run.device, run=run)
        where = torch.device("cpu") if self.options.fit_device == "cpu" else features.device
        head = client.model.classifier
        fitted = copy.deepcopy(head).to(where).train()
        last = client.stash.get(FITTED)
        if last is not None and last[0] == client.task:
            fitted.load_state_dict(last[1])
        loss, steps = fit_head(
            fitted,
            features.to(where),
            labels.to(where),
            plan.to(where),
            run.config.weight_decay,
            self.options.head_steps,
            self.options.weight,
        )
        head.load_state_dict(fitted.state_dict())  # copied into the client's own tensors, across devices
        client.stash[FITTED] = (client.task, fitted.state_dict())
        return {"loss/head_fit": loss, "fedprok/head_fit_steps": float(steps)}

    @hookimpl
    def fedaval_client_upload(self, run, client):
        client.stash.pop(PLAN, None)  # the round's; not kept between rounds
        if not self.frozen(client):  # reading 2: the prototypes of the weights uploaded with them
            client.stash[CURRENT] = self.compute_prototypes(run, client)
        current = client.stash.get(CURRENT) or {}
        library = client.stash.setdefault(LIBRARY, dict)
        for c, (mu, _) in current.items():
            library[c] = mu
        if not self.options.fusion:
            return None
        upload = {}
        if current:
            upload[UPLOAD_KEY] = {c: mu.detach().cpu() for c, (mu, _) in current.items()}
            upload[COUNTS_KEY] = {c: n for c, (_, n) in current.items()}
        refresh = client.stash.pop(REFRESH, None)
        if refresh:
            upload[REFRESH_KEY] = {c: mu.detach().cpu() for c, (mu, _) in refresh.items()}
            upload[REFRESH_COUNTS_KEY] = {c: n for c, (_, n) in refresh.items()}
        return upload or None

    # --- server -----------------------------------------------------------
    @hookimpl
    def fedaval_server_task_start(self, run, task):
        """Eq. 9's ``mu_c^{t-1}``: the global list as the task begins (reading 4)."""
        self.anchor = dict(self.global_prototypes)
        self.refreshed = {}

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        """Algorithm 1, line 13 (``weighting=uniform``): ``1/K sum_k theta_k``;
        ``samples`` leaves FedAvg's sample-weighted mean in place."""
        if self.options.weighting != "uniform":
            return None
        from fedaval.plugins.fedavg import weighted_average

        with_weights = [u for u in uploads if u.get("weights")]
        if not with_weights:
            return None
        return weighted_average([u.get("weights") for u in with_weights], [1.0] * len(with_weights))

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        if not self.options.fusion:
            return None
        self.fuse_refreshed(uploads)
        pairs = [(u.get(UPLOAD_KEY), u.get(COUNTS_KEY) or {}) for u in uploads if u.get(UPLOAD_KEY)]
        self.global_prototypes.update(fuse_prototypes(pairs, self.anchor, self.options.beta))
        if not self.global_prototypes:
            return None
        return {DOWNLOAD_KEY: dict(self.global_prototypes)}

    def fuse_refreshed(self, uploads) -> None:
        """Reading 2 on the server: re-measured prototypes replace the stored
        ones (and the EMA anchor), as the count-weighted mean of every
        re-measurement received in this task so far."""
        for u in uploads:
            protos, counts = u.get(REFRESH_KEY) or {}, u.get(REFRESH_COUNTS_KEY) or {}
            for c, mu in protos.items():
                n = int(counts.get(c, 0))
                if n <= 0:
                    continue
                total, count = self.refreshed.get(c, (torch.zeros_like(mu, dtype=torch.float64), 0))
                self.refreshed[c] = (total + mu.to(torch.float64) * n, count + n)
        for c, (total, count) in self.refreshed.items():
            mean = (total / count).to(torch.float32)
            self.global_prototypes[c] = mean
            if c in self.anchor:
                self.anchor[c] = mean
