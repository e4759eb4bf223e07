"""CFeD: continual federated learning based on knowledge distillation (Ma,
Xie, Wang, Chen, Shou, IJCAI 2022). The maths is in
:mod:`fedaval.plugins.cfed_math`; this module is the hook glue.

What happens, as the authors' released federated code runs it (lianziqt/CFeD,
``train_eval_fed.py``, ``update.py``, ``loss.py``; read, not copied), each
difference from the paper's description an option with the code's value as
default:

* an unlabelled *surrogate* dataset (``cfed.surrogate``, a dataset fedaval
  loads, with ``cfed.surrogate_root``) is loaded once, converted to the run's
  input shape and normalised as the run's data (``fedaval_setup``); its
  labels are never read;
* from the second task on, the sampled clients of each round are divided at
  random (CFeD's client division): a ``review_fraction`` of them (0.4: the
  code trains 60% learners and 40% reviewers) *review* old tasks, the rest
  *learn* the new task (``fedaval_server_download`` tells each client its
  role);
* the old model is the global model at the end of the previous task (a
  client takes it from the weights it receives in its first round of the
  task; a client that joins the task later is sent it);
* a learner's loss is the cross-entropy on its task data (the code's
  learners use nothing else; ``kd_weight`` > 0 adds that weight times the
  distillation below, the paper's L_KD, as ``cfed_kd``); a reviewer's is only
  ``review_weight`` (0.1, the code's) times the distillation of the old model
  on surrogate minibatches (``cfed_review``: its cross-entropy is zero,
  ``fedaval_client_criterion``), for as many steps as a learner;
* the client-side distillation is the code's soft cross-entropy at
  ``temperature`` (2), with no ``T^2`` factor
  (:func:`~fedaval.plugins.cfed_math.soft_cross_entropy`), over every class's
  logit (``distil_classes=all``, the code's) or the old classes' only
  (``old``);
* the server averages the weights (FedAvg). ``server_epochs`` > 0 then
  distils the ensemble of the uploaded client models (mean logits) on its
  surrogate data into the global model, over every class the federation has
  seen, with Hinton's ``T^2``-scaled KL (``fedaval_server_fuse``, the paper's
  server distillation); 0, the default, as in every configuration of the
  code (``server_distillation = False``), turns it off.

The reading fedaval had before it followed the code (from the paper) is
``-o cfed.review_fraction=0.3 -o cfed.kd_weight=4 -o cfed.review_weight=4 -o
cfed.distil_classes=old -o cfed.server_epochs=1``: the same gradients
(``T^2`` = 4 times the soft cross-entropy is ``T^2`` KL plus a constant).

Readings and choices:

* Surrogate data: any dataset fedaval loads, converted to the model's input
  shape (grey <-> RGB, bilinear resize: ``to_input_shape``) and normalised
  with the run's mean and std. It must not be the tasks' own data: the same
  dataset (same name and root) is refused unless ``surrogate_classes`` are
  all outside the classes of the run's tasks.
* The pool (``surrogate_samples`` training images, drawn with the run's seed)
  is cut into disjoint shards, one per client and one for the server (the
  paper gives every client and the server its own surrogate data).
* The split is redrawn every round from the run's seed and the round; at
  least one sampled client learns (``reviewer_count``). The code draws its
  learners (60% of its per-round count) and reviewers (40%) independently,
  so a client may do both in one round; in fedaval a client trains once a
  round, so the sampled clients are split. In the first task there is
  nothing to review: everyone learns.
* A reviewer takes as many steps as its task data has minibatches, each on
  a surrogate minibatch of the same size drawn from its shard (the code: an
  epoch over its surrogate shard); its surrogate forward passes keep
  BatchNorm statistics frozen (real data's). The run's optimizer is used
  (the code trains with Adam; a comparison gives every method the same).
* The paper's learning rates and epochs for the server distillation are not
  ours to copy (other models and data): defaults are ours.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import changed, non_negative, option, positive, unit_interval
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

TEACHER = StashKey[tuple]("cfed.teacher")  # (frozen old model, old classes) of the client's current task
REVIEW = StashKey[bool]("cfed.review")  # this round the client reviews old tasks
PENDING_TEACHER = StashKey[dict]("cfed.pending_teacher")  # old model's weights sent to a late joiner


def _at_least_two(value: int) -> str | None:
    return None if value >= 2 else "must be >= 2"


class CFeD(Plugin):
    """CFeD: clients learn or review (distillation on surrogate data); the server distils the client ensemble."""

    name = "cfed"
    description = (
        "CFeD: surrogate-data distillation, clients split into learners and reviewers, server ensemble distillation"
    )
    loss_terms = ("cfed_kd", "cfed_review")

    @dataclass
    class Options:
        surrogate: str = option("", "unlabelled surrogate dataset (a dataset name: digits, imagefolder, cifar10, ...)")
        surrogate_root: str = option("", "data root of the surrogate dataset (when it needs one)")
        surrogate_classes: list[int] = option([], "use only these classes of the surrogate dataset (empty: all)")
        surrogate_samples: int = option(
            1000, "surrogate training images drawn (the pool shared out in shards)", _at_least_two
        )
        review_fraction: float = option(
            0.4, "fraction of a round's sampled clients that review old tasks", unit_interval
        )
        review_weight: float = option(0.1, "weight of the reviewers' distillation on surrogate data", non_negative)
        kd_weight: float = option(0.0, "weight of the learners' distillation on surrogate data (0: off)", non_negative)
        distil_classes: Literal["all", "old"] = option(
            "all", "logits the clients' distillation covers: every class's or the old classes'"
        )
        temperature: float = option(2.0, "distillation temperature T", positive)
        server_epochs: int = option(0, "epochs of server-side ensemble distillation per round (0: off)", non_negative)
        server_lr: float = option(0.01, "learning rate of the server-side distillation", positive)
        server_batch_size: int = option(64, "minibatch of the server-side distillation", _at_least_two)

    def __init__(self, options=None):
        super().__init__(options)
        self.surrogate = None  # [M, *input_shape], normalised; rebuilt in fedaval_setup, never checkpointed
        self.shards = 0
        self.teacher: dict | None = None  # server: the global model's state at the end of the last stage
        self.split: tuple[int, list[int], list[int]] | None = None  # (round, learners, reviewers)
        self.generator = None
        self.server_loss: float | None = None

    def state_dict(self):
        return {k: v for k, v in super().state_dict().items() if k != "surrogate"}

    # --- set-up -----------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        import torch

        o = self.options
        unused = changed(o, ("server_lr", "server_batch_size"))
        if o.server_epochs == 0 and unused:
            raise FedavalUsageError(
                f"cfed.{unused[0]} applies to the server distillation, which is off (cfed.server_epochs=0, as in "
                "CFeD's code); add -o cfed.server_epochs=N or drop it"
            )
        if run.hook.fedaval_federation_model(run=run) == "clients":
            others = [n for n in run.plugins.names if n not in ("cfed", "fedavg", "core")]
            raise FedavalUsageError(
                f"cfed distils into the global model, but the loaded plugins ({', '.join(others)}) make the "
                "federation's model the clients' own; run cfed without them"
            )
        self.surrogate = load_surrogate(run, self.options)
        self.shards = len(run.partition.clients) + 1
        if len(self.surrogate) < 2 * self.shards:
            raise FedavalUsageError(
                f"cfed.surrogate={self.options.surrogate!r} gives {len(self.surrogate)} images, fewer than 2 for each "
                f"of the {self.shards - 1} clients and the server; raise cfed.surrogate_samples or use more data"
            )
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(run.config.seed)

    def shard(self, index: int):
        """Client ``index``'s surrogate shard (``index = -1``: the server's)."""
        index = self.shards - 1 if index < 0 else index
        return self.surrogate[index :: self.shards]

    # --- server -------------------------------------------------------------------
    @hookimpl
    def fedaval_server_task_start(self, run, task):
        """CFeD distils into an averaged global model: refuse methods that share no weights
        (those that say so at set-up are refused in ``fedaval_setup``, before any output)."""
        if task == 0 and not run.server.shared_keys:
            others = [n for n in run.plugins.names if n not in ("cfed", "fedavg", "core")]
            raise FedavalUsageError(
                f"cfed distils into the global model, but the loaded plugins ({', '.join(others) or 'none'}) "
                "share no weights with the server; run cfed without them"
            )

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        """The client's role this round and, for a client that starts a task
        after its first round, the old model."""
        import torch

        if run.now.task == 0 or self.teacher is None:
            return None
        if self.split is None or self.split[0] != run.round:
            from fedaval.plugins.cfed_math import split_clients

            gen = torch.Generator().manual_seed(run.config.seed * 1_000_003 + run.round)
            learners, reviewers = split_clients(run.schedule[run.round - 1], self.options.review_fraction, gen)
            self.split = (run.round, learners, reviewers)
        out = {"cfed_review": int(client.id in self.split[2])}
        if run.now.task not in client.tasks_started and run.round != run.now.first_round:
            out["cfed_teacher"] = self.teacher
        return out

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        """Distil the ensemble of the uploaded client models into the global model."""
        import torch

        from fedaval.plugins.cfed_math import distil, ensemble_logits

        with_weights = [u for u in uploads if u.get("weights")]
        if self.options.server_epochs == 0 or not with_weights:
            return None
        x = self.shard(-1).to(run.device)
        scratch = copy.deepcopy(run.server.model).eval()
        logits = []
        with torch.no_grad():
            for u in with_weights:
                scratch.load_state_dict(u.get("weights"), strict=False)
                logits.append(scratch(x))
        seen = run.federation_seen_classes()
        self.server_loss = distil(
            run.server.model,
            x,
            ensemble_logits(logits),
            seen,
            self.options.temperature,
            self.options.server_epochs,
            self.options.server_lr,
            self.options.server_batch_size,
            self.generator,
        )
        return None

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        self.teacher = {k: v.detach().clone() for k, v in run.server.model.state_dict().items()}

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        metrics = {}
        if self.split is not None and self.split[0] == round:
            metrics["cfed_reviewers"] = float(len(self.split[2]))
        if self.server_loss is not None:
            metrics["cfed_server_kd_loss"] = self.server_loss
        return metrics

    # --- client -------------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        client.stash[REVIEW] = bool(download.get("cfed_review", 0))
        if "cfed_teacher" in download:
            client.stash[PENDING_TEACHER] = download["cfed_teacher"]

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        """The old model: what the client received in the task's first round
        (the global model at the previous stage's end), or what was sent."""
        pending = client.stash.pop(PENDING_TEACHER, None)
        if task == 0:
            client.stash.pop(TEACHER, None)
            return
        teacher = copy.deepcopy(client.model).eval()
        if pending is not None:
            teacher.load_state_dict(pending, strict=False)
        for p in teacher.parameters():
            p.requires_grad_(False)
        old = sorted({c for t in range(task) for c in run.federation_task_classes()[t]})
        client.stash[TEACHER] = (teacher, old)

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        """A reviewer does not learn its task data this round: no cross-entropy."""
        if client.stash.get(REVIEW) and client.stash.get(TEACHER) is not None:
            return logits.sum() * 0.0
        return None

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        import torch

        from fedaval.plugins.cfed_math import batchnorm_frozen, soft_cross_entropy

        teacher = client.stash.get(TEACHER)
        if teacher is None:
            return None
        review = bool(client.stash.get(REVIEW))
        weight = self.options.review_weight if review else self.options.kd_weight
        if weight == 0:
            return None
        model, old = teacher
        pool = self.shard(client.id)
        pick = torch.randint(len(pool), (len(batch.x),))
        xs = pool[pick].to(batch.x.device)
        with torch.no_grad():
            target = model(xs)
        with batchnorm_frozen(client.model):
            student = client.model(xs)
        classes = old if self.options.distil_classes == "old" else None
        loss = soft_cross_entropy(student, target, classes, self.options.temperature)
        return {"cfed_review" if review else "cfed_kd": weight * loss}


def load_surrogate(run, options):
    """The surrogate pool: ``surrogate_samples`` training images of the
    surrogate dataset (of ``surrogate_classes``), in the run's input shape,
    normalised as the run's data (:func:`fedaval.unlabelled.load_unlabelled`).
    One-line errors: none named, unknown, missing root, or the run's own data."""
    from fedaval.unlabelled import load_unlabelled

    if not options.surrogate:
        raise FedavalUsageError(
            "cfed needs an unlabelled surrogate dataset: -o cfed.surrogate=NAME (-o cfed.surrogate_root=PATH); "
            f"datasets: {', '.join(sorted(run.datasets))}"
        )
    return load_unlabelled(
        run,
        "cfed.surrogate",
        options.surrogate,
        options.surrogate_root,
        options.surrogate_classes,
        options.surrogate_samples,
    )
