"""GLDP: Global-Local Dynamic Prototypes for spatio-temporal heterogeneous FL
(papers/gldp-sthfl.txt, section 4; the setting is ``--scenario sthfl``).

* Personalised model (Eq. 3-5): ``model.features`` (mu) is shared and
  averaged over the sampled clients with equal weights; ``model.classifier``
  (nu) never leaves the client. Each round trains the base for ``t`` local
  epochs, then the head for ``s`` (:mod:`fedaval.plugins.personal`; with
  ``--local-epochs`` E: t + s must equal E when both are given, default
  t = max(1, round(E/3)) and s = E - t so that t < s as in the paper, and
  with E = 1 base and head train together: there is no split then, and
  the run says so with a warning at start-up).
* Prototypes (Eq. 6), every round (Algorithm 1, lines 14-18): after its
  local epochs each sampled client computes C_i^n, the mean base feature of
  each class n of its current-task data (eval mode), and uploads them with
  that round's base weights.
* Local prototype set (Eq. 9): ``C^_i^n <- beta C^_i^n + (1-beta) C_i^n``
  after every local round the client is sampled in, a new class added as it
  is. A reading between the paper's two: Algorithm 1's line 15 sits in the
  local-epoch loop (every epoch), Eq. 9's stage index (m) and the project's
  digest ("EMA over stages") move the set once per stage. So beta compounds
  over the client's rounds: a class's prototype from an earlier stage keeps
  beta^r of its weight after r more of them. The once-per-stage reading (L_LP
  against the earlier stages' set) was set aside in issue 18: it leaves L_LP
  exactly 0 in every M = 1 run, which the paper's "pre-stage and post-stage"
  account of L_LP (Table 4) may well mean (docs/methods.md, GLDP item 3).
  ``local_update=epoch`` and ``=stage`` run the other two readings.
* Global prototype set (Eq. 11), on the server, every round (Algorithm 1,
  lines 5-6): ``C~^n <- beta C~^n + (1-beta) mean_{i in N_n} C_i^n``, N_n =
  the clients of the round that uploaded class n; a class new to the set is
  added as the mean. The set is broadcast as the download entry
  ``gldp_prototypes``. So L_GP and L_LP act from the second round of the
  first stage on, in M = 1 runs too, and the global model predicts with
  prototypes from the first round's fusion on.
* Loss (Eq. 12): CE + lambda L_LP + (1 - lambda) L_GP, see
  :func:`local_relation_loss` and :func:`global_relation_loss` for the
  readings of Eq. 7/8 and 10. Logged as ``gldp_lp`` and ``gldp_gp``.
* Prediction (Eq. 13): nearest prototype of the base feature. Training uses
  the linear head (CE); evaluation uses the global set (GLDP-GP,
  ``predict=global``) or the client's local set (GLDP-LP, ``predict=local``);
  the global model always uses the global set. Reading: evaluation uses the
  latest global set (the one the next broadcast carries), for every client
  at every evaluation: a client not sampled since its last evaluation is
  scored again with the set that moved since (``fedaval_client_evaluation_stale``;
  before, it kept a result scored with an older set). Both variants'
  A_loc are also reported at the end of every stage as ``gldp_a_loc_gp``
  and ``gldp_a_loc_lp``, whichever ``predict`` is; with ``predict=global``
  the first equals the core's ``a_loc`` there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from fedaval import hookimpl
from fedaval.evaluation import client_accuracy_on
from fedaval.options import option, unit_interval
from fedaval.plugin import Plugin
from fedaval.plugins.gldp_math import (
    RelationPlan,
    class_frequency_weights,
    global_relation_loss,
    local_relation_loss,
    relation_plan,
)
from fedaval.plugins.personal import PersonalHead, resolve_phases
from fedaval.prototypes import (
    PrototypeSet,
    class_means,
    ema_update,
    extract_features,
    mean_over_holders,
    nearest_prototype_scores,
)
from fedaval.stash import StashKey

ENTRY = "gldp_prototypes"
LOCAL = StashKey[PrototypeSet]("gldp.local")  # C^_i: the local set (Eq. 9, after every local round)
RECEIVED = StashKey[PrototypeSet]("gldp.received")  # the global set last received
WEIGHTS = StashKey[dict]("gldp.weights")  # T_i^n / T_i of the current task
PLAN = StashKey[RelationPlan]("gldp.plan")  # the losses' constant side this round, while the client trains


def _at_least_zero(value) -> str | None:
    return None if value is None or value >= 0 else "must be >= 0"


@dataclass
class GLDPOptions:
    lam: float = option(0.5, "lambda of Eq. 12: weight of L_LP; L_GP gets 1 - lambda", unit_interval)
    beta: float = option(0.5, "moving-average weight of the old prototype (Eq. 9 and 11)", unit_interval)
    t: int | None = option(
        None, "local epochs of the shared base per round (default: max(1, round(E/3)))", _at_least_zero
    )
    s: int | None = option(
        None, "local epochs of the personal head per round, after the base (default: E - t)", _at_least_zero
    )
    predict: Literal["global", "local"] = option(
        "global", "prototypes for evaluating the client models: global (GLDP-GP) or local (GLDP-LP)"
    )
    local_update: Literal["round", "epoch", "stage"] = option(
        "round",
        "when the local set C^_i moves (Eq. 9): after each local round the client is sampled in; after each "
        "local epoch (Algorithm 1, line 15); or once a stage, at the client's last round of it (Eq. 9's index m)",
    )


class GLDP(PersonalHead, Plugin):
    """GLDP: personal head + global/local prototype relations + nearest-prototype prediction."""

    name = "gldp"
    description = "GLDP: personal head, global-local dynamic prototypes, nearest-prototype prediction (STHFL)"
    Options = GLDPOptions
    phase_order = ("base", "head")

    def __init__(self, options=None):
        super().__init__(options)
        self.global_set: PrototypeSet = {}  # C~ now (what is broadcast)
        self.global_set_round = 0  # the round whose fusion last changed it
        self.eval_cache: dict[int, tuple[int, torch.Tensor, torch.Tensor]] = {}  # test features

    # --- set-up --------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        o = self.options
        self.phases = resolve_phases(
            run.config.local_epochs,
            o.t,
            o.s,
            default_first=lambda e: max(1, round(e / 3)),
            names=("t", "s"),
            owner=self.name,
        )
        if self.phases is None:
            import logging

            logging.getLogger("fedaval").warning(
                "gldp: --local-epochs 1 leaves no base/head split (t + s = 1): base and head train together "
                "every epoch; pass --local-epochs 2 or more for t base epochs then s head epochs (paper: t + s = 30)"
            )

    # --- client --------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        client.stash[RECEIVED] = dict(download.get(ENTRY) or {})
        client.stash.pop(PLAN, None)

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        client.stash[WEIGHTS] = class_frequency_weights(run.data.train_y[client.tasks.indices[task]])
        client.stash.pop(PLAN, None)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        plan = client.stash.get(PLAN)
        if plan is None:  # the local set, the received global set and the weights stay put while it trains
            plan = client.stash[PLAN] = relation_plan(
                client.stash.get(LOCAL, {}),
                client.stash.get(RECEIVED, {}),
                client.stash.get(WEIGHTS, {}),
                run.num_classes,
                batch.features.shape[1],
                batch.features.device,
            )
        lam = self.options.lam
        l_lp = local_relation_loss(batch.features, batch.y, plan)
        l_gp = global_relation_loss(batch.features, batch.y, plan)
        zero = batch.features.new_zeros(())
        return {
            "gldp_lp": zero if l_lp is None else lam * l_lp,
            "gldp_gp": zero if l_gp is None else (1 - lam) * l_gp,
        }

    @hookimpl(specname="fedaval_client_epoch_start")
    def update_local_set_per_epoch(self, run, client, epoch):
        """``local_update=epoch``: Algorithm 1, line 15, inside the epoch
        loop: the epoch just done moves the local set (the last epoch's move
        is made at the upload)."""
        if self.options.local_update == "epoch" and epoch > 0:
            self.fold_into_local_set(run, client, self.current_prototypes(run, client))

    @hookimpl
    def fedaval_client_upload(self, run, client):
        """Algorithm 1, lines 14 and 18: this round's prototypes C_i (Eq. 6)
        are uploaded and, per ``local_update``, folded into the local set
        (Eq. 9): every round (the default), after the last epoch (``epoch``),
        or at the client's last round of the stage (``stage``)."""
        prototypes = self.current_prototypes(run, client)
        if not prototypes:
            return None
        if self.options.local_update != "stage" or client.strategy.task_ends:
            self.fold_into_local_set(run, client, prototypes)
        return {ENTRY: prototypes}

    def current_prototypes(self, run, client) -> PrototypeSet | None:
        """Eq. 6 with the client's base now: the mean base feature of each
        class of its current-task data (``None`` without data for the task)."""
        exp = client.train_stream[client.task]
        if exp is None:
            return None
        features, labels = base_features(client.model, exp.dataset, run.device, run=run)
        return class_means(features, labels)[0]

    def fold_into_local_set(self, run, client, prototypes: PrototypeSet) -> None:
        """Eq. 9 on the client's local set; the losses' plan is made again."""
        client.stash.pop(PLAN, None)  # the local set changes now
        client.stash[LOCAL] = ema_update(client.stash.get(LOCAL, {}), prototypes, self.options.beta)

    # --- server --------------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        """Algorithm 1, lines 5-6: Eq. 11 with this round's uploads."""
        sets = [u.get(ENTRY) for u in uploads if u.get(ENTRY)]
        if sets:
            self.global_set = ema_update(self.global_set, mean_over_holders(sets), self.options.beta)
            self.global_set_round = round
        return {ENTRY: self.global_set} if self.global_set else None

    # --- prediction and evaluation -------------------------------------------
    def prototypes_for(self, client, predict: str) -> PrototypeSet:
        """The set ``client``'s model predicts with (``None``: the global model)."""
        if client is None or predict == "global":
            return self.global_set
        return client.stash.get(LOCAL, {})

    @hookimpl
    def fedaval_client_evaluation_stale(self, run, client):
        """GLDP-GP: a client's A_loc is scored with the latest global set, so a
        client not sampled since its last evaluation is scored again once the
        set has moved (its base and head have not); GLDP-LP's local set only
        moves when the client trains."""
        return self.options.predict == "global" and self.global_set_round > client.evaluated_at

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        if training:
            return None  # CE on the linear head
        prototypes = self.prototypes_for(client, self.options.predict)
        if not prototypes:
            return None
        return nearest_prototype_scores(features, prototypes, run.num_classes)

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        """A_loc of both GLDP-GP and GLDP-LP (each client's base on the test
        data of its seen classes, weighed as ``--client-test`` says), from one run. A client's test features are
        recomputed only after it trained again; the prototypes are the latest.
        Computed at the end of each stage only (one more pass over each
        client's test data)."""
        if not run.now.task_ends:
            return None
        accs: dict[str, list[float]] = {"global": [], "local": []}
        for client in run.clients:
            if not client.tasks_started:
                continue
            cached = self.eval_cache.get(client.id)
            if cached is None or cached[0] < client.trained_at:
                exps = client.seen_test_experiences()
                if not exps:
                    continue
                feats, labels = zip(*(base_features(client.model, e.dataset, run.device, run=run) for e in exps))
                cached = self.eval_cache[client.id] = (client.trained_at, torch.cat(feats), torch.cat(labels))
            _, feats, labels = cached
            for predict, values in accs.items():
                prototypes = self.prototypes_for(client, predict)
                if prototypes:
                    pred = nearest_prototype_scores(feats, prototypes, run.num_classes).argmax(dim=1)
                    accuracy = client_accuracy_on(run, client, pred, labels)
                    if accuracy is not None:
                        values.append(accuracy)
        keys = {"global": "gldp_a_loc_gp", "local": "gldp_a_loc_lp"}
        return {keys[p]: sum(v) / len(v) for p, v in accs.items() if v}


def base_features(model, dataset, device, run=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``model.features`` of every sample of ``dataset`` (eval mode), on the CPU,
    with the labels (``run``: as :func:`fedaval.prototypes.extract_features` takes it)."""
    features, labels = extract_features(model, dataset, device, run=run)
    return features.cpu(), labels.cpu()
