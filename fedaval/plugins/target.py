"""TARGET: federated class-continual learning via exemplar-free distillation
(Zhang, Shen, Shen, Xu, Zhang; ICCV 2023). The maths is in
:mod:`fedaval.plugins.target_math`; this module is the hook glue. No paper
file is in the repository: the readings below are from the paper and its
description of the method, written down so they can be checked.

What happens:

* **Clients, every task** (``fedaval_client_criterion``): cross-entropy on
  the current task, restricted to the current task's classes (the softmax
  runs over the federation's classes of the current stage plus the client's
  own current classes, so labels always have a column); ``-o
  target.ce=all`` uses the core's cross-entropy over every class instead.
* **Clients, from task 1 on** (``fedaval_client_loss``, term ``target_kd``):
  ``kd_weight * KL(softmax(teacher/T) || softmax(student/T))`` over the
  classes the teacher has learned (every class of the earlier stages), on a
  minibatch of ``synthetic_batch`` images drawn at random (client's random
  stream) from the synthetic set at every local step. The teacher is the
  global model at the end of the previous task. Reading: synthetic images
  are drawn *inside the loss hook*, not added to the task's data through
  ``fedaval_client_train_data`` - they carry no labels the client would
  trust (TARGET trains on them with distillation only, never with
  cross-entropy), and a separate draw keeps the real minibatches on the
  device data path.
* **Server, end of each task but the last** (``fedaval_server_task_end``):
  a small generator (:class:`~fedaval.plugins.target_math.Generator`) is
  trained against the global model and ``synthetic_size`` images are made.
  ``synthesis=code`` (the default since session 27) does it as TARGET's
  released code does on CIFAR
  (:func:`~fedaval.plugins.target_math.synthesize_as_code`, which says how):
  2,560 images in batches of 256, each batch 10 steps of a copy of a
  generator meta-learned across the batches (first-order MAML) on
  ``ce_weight L_ce + bn_weight L_bn`` (0.5 and 10, the BatchNorm statistics
  blended over batches with momentum 0.9, the images randomly cropped and
  flipped before the teacher sees them), keeping each batch's lowest-loss
  step; no adversarial term (the code's CIFAR settings would start it after
  20 batches of 10). ``synthesis=paper`` is the reading written from the
  paper before (until session 26 the only one): one generator trained on
  ``L_ce + bn_weight L_bn + adv_weight L_adv`` with the adversarial
  diversity term against a student that distils the global model at the
  same time (:func:`~fedaval.plugins.target_math.synthesize`); its
  defaults then were :data:`PAPER_DEFAULTS` (``synthetic_size=256
  generator_steps=50 lr_generator=0.01 bn_weight=1 noise_dim=64
  generator_width=32``).
* **Download** (``fedaval_server_download``): each client gets the synthetic
  images (float32, ``synthetic_size x C x H x W``, labels not sent) once per
  task, the first round it is sampled in the task; their bytes are counted
  as that client's download. A client sampled in the stage's first round
  takes the teacher from the weights it receives then (they *are* the
  previous task's global model, no extra bytes); a client first sampled
  later in the stage receives the teacher's weights as well (entry
  ``target_teacher``, counted).

Readings chosen where the paper is open:

1. *Student of the adversarial term* (``synthesis=paper``): a freshly
   initialised copy of the global model's architecture, distilling the
   global model on the synthetic batches as the generator trains (a copy of
   the global model itself would agree with it everywhere and make the term
   zero).
2. *Synthetic set*: made batch by batch with per-batch optimised noise (as
   TARGET's code, after Fast-DataFree), not a pool of every intermediate
   batch. Made once per task end, from a new generator each task (the code
   makes a new synthesiser each task). With ``synthesis=code`` the images
   are kept as the clients' inputs (normalised); the code's clients crop
   and flip them again, fedaval's do not (the synthetic minibatch is drawn
   inside the loss hook, above).
3. *KD without ``T^2``* (TARGET's code); the distilled classes are those of
   every earlier stage. Its weight ``kd_weight`` is 25, TARGET's code's
   (``--kd 25``: ``loss_ce + kd * loss_kd``, the same soft cross-entropy
   at T = 2); until session 22 it was 1. On the CPU-scale FedProK Table 1
   25 keeps more of the old tasks and learns the new ones less (seed 42:
   task 0 at 62% after task 1, task 2 at 9% after its own task); the final
   accuracy is the same within the spread (23.65 ± 2.51% over 3 seeds,
   against 23.37 ± 3.45% with 1; docs/reproduction.md).
4. *BatchNorm is required*: ``L_bn`` needs BatchNorm layers; a model without
   any (``--model mlp``, the digits default) is refused with a one-line
   error at set-up: use ``--model cnn`` or ``resnet18``.
5. *The head grows* (see ``fedaval_classify``): TARGET's network (PyCIL's)
   adds output units as tasks come; fedaval's head has every class from
   the start. The scores of classes the federation has not reached yet
   (later stages) are masked out (``-1e9``) in training and evaluation, as
   if their units did not exist. Without this the restricted
   cross-entropy never pushes those random columns down and they win the
   argmax: the global model scored 0.0 on the CIFAR-10 subset's first
   task before the mask.

Every scenario is supported: the server's stages are the task boundaries;
in fcil-async and fcl-random a client's "current classes" are its own task's
classes plus the stage's, and the teacher's classes are every class the
federation learned in earlier stages.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import at_least_one, non_negative, option, positive, refuse_unread, unit_interval
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

SYNTHETIC_KEY = "target_synthetic"
TEACHER_KEY = "target_teacher"
TEACHER = StashKey[tuple]("target.teacher")  # (task, frozen model): the previous task's global model
SYNTHETIC = StashKey[tuple]("target.synthetic")  # (task, images on the run's device)


@dataclass
class TargetOptions:
    ce: Literal["current", "all"] = option(
        "current", "local cross-entropy over the current task's classes, or all classes"
    )
    kd_weight: float = option(
        25.0, "weight of the distillation term on synthetic data (TARGET's code: 25)", non_negative
    )
    temperature: float = option(2.0, "distillation temperature T", positive)
    synthesis: Literal["code", "paper"] = option(
        "code",
        "how the server makes the synthetic set: its code's way on CIFAR (meta-learned generator, best step kept, "
        "no adversary) or the paper's reading (one generator, an adversarial student)",
    )
    synthetic_size: int = option(2560, "synthetic images made at each task end and sent to the clients", at_least_one)
    synthetic_batch: int = option(
        32, "synthetic images per local step (with synthesis=paper also per generator batch)", at_least_one
    )
    generator_batch: int = option(256, "images per generator batch (synthesis=code)", at_least_one)
    generator_steps: int = option(10, "generator steps per synthetic batch", at_least_one)
    generator_width: int = option(128, "channels of the generator's first stage (the code's 2 x ngf)", at_least_one)
    noise_dim: int = option(256, "generator noise dimension", at_least_one)
    lr_generator: float = option(2e-3, "generator Adam learning rate (synthesis=paper: the noise's too)", positive)
    lr_noise: float = option(1e-2, "noise Adam learning rate (synthesis=code)", positive)
    ce_weight: float = option(
        0.5, "weight of the teacher's cross-entropy in the generator loss (synthesis=code)", non_negative
    )
    bn_weight: float = option(10.0, "weight of the BatchNorm-statistics loss", non_negative)
    bn_momentum: float = option(
        0.9, "momentum of the BatchNorm statistics over batches (synthesis=code)", unit_interval
    )
    lr_student: float = option(1e-2, "student SGD learning rate (adversarial term, synthesis=paper)", positive)
    adv_weight: float = option(1.0, "weight of the adversarial (diversity) loss (synthesis=paper)", non_negative)


#: options one synthesis reads and the other does not (a one-line error when set for the other)
PAPER_ONLY = ("lr_student", "adv_weight")
CODE_ONLY = ("generator_batch", "lr_noise", "ce_weight", "bn_momentum")

#: ``synthesis=paper``'s defaults until session 27, when the options' defaults became the code's
PAPER_DEFAULTS: dict[str, Any] = {
    "synthetic_size": 256,
    "generator_steps": 50,
    "lr_generator": 1e-2,
    "bn_weight": 1.0,
    "noise_dim": 64,
    "generator_width": 32,
}


def make_synthetic_set(options: TargetOptions, teacher, classes, data, device, new_student):
    """The synthetic set ``options`` ask for, made against ``teacher`` (the
    global model, on ``device``) over ``classes``: ``synthesis=code``
    (:func:`~fedaval.plugins.target_math.synthesize_as_code`, a sigmoid
    generator normalised like ``data``) or ``paper``
    (:func:`~fedaval.plugins.target_math.synthesize`, against a fresh
    student from ``new_student()``). ``data``: the run's
    :class:`~fedaval.datasets.ImageData` (its input shape, mean and std).
    Returns ``(images, labels, the generator's last loss terms)``."""
    from fedaval.plugins.target_math import Generator, synthesize, synthesize_as_code

    o = options
    if o.synthesis == "code":
        output = "sigmoid"  # pixels in [0, 1], normalised like the run's data
        generator = Generator(data.input_shape, o.noise_dim, o.generator_width, output).to(device)
        return synthesize_as_code(
            teacher,
            generator,
            classes,
            steps=o.generator_steps,
            batch_size=o.generator_batch,
            size=o.synthetic_size,
            lr_generator=o.lr_generator,
            lr_noise=o.lr_noise,
            ce_weight=o.ce_weight,
            bn_weight=o.bn_weight,
            bn_momentum=o.bn_momentum,
            mean=data.mean,
            std=data.std,
            device=device,
        )
    student = new_student().to(device)
    generator = Generator(data.input_shape, o.noise_dim, o.generator_width).to(device)
    return synthesize(
        teacher,
        student,
        generator,
        classes,
        steps=o.generator_steps,
        batch_size=o.synthetic_batch,
        size=o.synthetic_size,
        lr_generator=o.lr_generator,
        lr_student=o.lr_student,
        bn_weight=o.bn_weight,
        adv_weight=o.adv_weight,
        temperature=o.temperature,
        device=device,
    )


def torch_mask(logits, learned):
    """True in the columns of ``logits`` whose class is not in ``learned``
    (one shared mask per class list: :func:`fedaval.prototypes.class_mask`)."""
    from fedaval.prototypes import class_mask

    return class_mask(tuple(learned), logits.shape[1], str(logits.device), inside=False)


class Target(Plugin):
    """Client: current-task CE plus KD from the previous global model on
    synthetic data. Server: a data-free generator trained on the global model
    at each task end; the synthetic set goes to the clients.

    Server state: ``synthetic`` (images on the CPU, or ``None``) and
    ``synthetic_task`` (the task they are for), ``teacher_weights`` (the
    global model's shared weights when they were made), ``delivered``
    (client id -> the last task whose set the server sent it: the server's
    own record of what it sent), ``last_losses`` (the generator's last loss
    terms). Client state: ``TEACHER`` and ``SYNTHETIC`` in the stash."""

    name = "target"
    description = "TARGET: current-task CE + KD on server-made synthetic data (data-free generator, BN statistics)"
    Options = TargetOptions
    loss_terms = ("target_kd",)

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.synthetic = None
        self.synthetic_task = -1
        self.teacher_weights: dict[str, Any] | None = None
        self.delivered: dict[int, int] = {}
        self.last_losses: dict[str, float] = {}

    # --- set-up ---------------------------------------------------------------
    @hookimpl
    def fedaval_setup(self, run):
        import torch
        from torch import nn

        o = self.options
        refuse_unread(
            "target", o, [(PAPER_ONLY if o.synthesis == "code" else CODE_ONLY, True, f"synthesis={o.synthesis}")]
        )
        with torch.random.fork_rng(devices=[]):  # the run's models start as they would without TARGET
            model = run.model(None)
        if not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()):
            raise FedavalUsageError(
                f"target needs a model with BatchNorm layers (its generator matches their statistics); "
                f"the model of --model {run.config.model} has none: use --model cnn or resnet18"
            )

    # --- client -----------------------------------------------------------------
    def current_classes(self, run, client) -> list[int]:
        task = client.task
        stage = run.federation_task_classes()[task] if task < run.num_tasks else []
        return sorted(set(stage) | set(client.tasks.classes[task]))

    def old_classes(self, run, task: int) -> list[int]:
        return sorted({c for t in range(task) for c in run.federation_task_classes()[t]})

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        """Reading 5: the head has only the classes learned so far."""
        logits = model.classifier(features)
        learned = self.old_classes(run, run.task + 1)
        mask = torch_mask(logits, learned)
        return logits.masked_fill(mask, -1e9)

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        if self.options.ce != "current":
            return None
        from fedaval.plugins.target_math import restricted_cross_entropy

        return restricted_cross_entropy(logits, y, self.current_classes(run, client))

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        task = client.task
        if task < 1:
            return
        if SYNTHETIC_KEY in download:
            client.stash[SYNTHETIC] = (task, download[SYNTHETIC_KEY].to(run.device))
        teacher = client.stash.get(TEACHER)
        if teacher is not None and teacher[0] == task:
            return
        if TEACHER_KEY in download:
            frozen = copy.deepcopy(client.model)
            state = frozen.state_dict()
            for key, value in download[TEACHER_KEY].items():
                state[key].copy_(value)
        elif run.now.task_begins:  # the weights just received are the previous task's global model
            frozen = copy.deepcopy(client.model)
        else:
            return
        frozen.eval()
        for p in frozen.parameters():
            p.requires_grad_(False)
        client.stash[TEACHER] = (task, frozen)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        task = client.task
        teacher, synthetic = client.stash.get(TEACHER), client.stash.get(SYNTHETIC)
        if task < 1 or self.options.kd_weight == 0 or teacher is None or synthetic is None:
            return None
        if teacher[0] != task or synthetic[0] != task:
            return None
        import torch

        from fedaval.plugins.target_math import kd_kl
        from fedaval.prototypes import class_index

        images = synthetic[1]
        pick = torch.randint(len(images), (min(self.options.synthetic_batch, len(images)),), device=images.device)
        x = images[pick]
        cols = class_index(tuple(self.old_classes(run, task)), str(x.device))
        with torch.no_grad():
            t_logits = teacher[1](x)[:, cols]
        s_logits = client.model.classifier(client.model.features(x))[:, cols]
        return {"target_kd": self.options.kd_weight * kd_kl(s_logits, t_logits, self.options.temperature)}

    # --- server -----------------------------------------------------------------
    @hookimpl
    def fedaval_server_task_end(self, run, task):
        if task + 1 >= run.num_tasks:
            return
        import torch

        teacher = copy.deepcopy(run.server.model).to(run.device)
        classes = self.old_classes(run, task + 1)
        images, _, self.last_losses = make_synthetic_set(
            self.options, teacher, classes, run.data, run.device, lambda: run.model(None)
        )
        self.synthetic = images.to(torch.float32)
        self.synthetic_task = task + 1
        self.teacher_weights = {k: v.detach().cpu().clone() for k, v in run.server.global_weights().items()}

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        task = run.task
        if self.synthetic is None or self.synthetic_task != task or self.delivered.get(client.id) == task:
            return None
        self.delivered[client.id] = task
        entries = {SYNTHETIC_KEY: self.synthetic}
        if not run.now.task_begins:
            entries[TEACHER_KEY] = self.teacher_weights
        return entries

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        if not run.now.task_ends or not self.last_losses or self.synthetic_task != run.task + 1:
            return None
        return {
            "target_synthetic_images": len(self.synthetic),
            **{f"target_generator_{k}": v for k, v in self.last_losses.items()},
        }
