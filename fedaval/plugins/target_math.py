"""TARGET's maths (Zhang et al., ICCV 2023): plain functions on tensors.

The hook glue is :mod:`fedaval.plugins.target`; every function here is
checked against hand-computed values in ``tests/test_target_math.py``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fedaval.prototypes import class_index


def restricted_cross_entropy(logits: torch.Tensor, y: torch.Tensor, classes: Sequence[int]) -> torch.Tensor:
    """Cross-entropy over the columns ``classes`` only (TARGET's local CE on
    the current task: the softmax runs over the task's classes, so old
    classes' outputs get no push-down from new data). Every label in ``y``
    must be one of ``classes``: on the CPU another label is a ValueError; on
    a GPU, where that check would wait for the GPU every minibatch, the
    cross-entropy's own device-side check stops the run."""
    cols = class_index(tuple(classes), str(logits.device))
    lookup = torch.full((logits.shape[1],), -1, dtype=torch.long, device=logits.device)
    lookup[cols] = torch.arange(len(cols), device=logits.device)
    targets = lookup[y]
    if targets.device.type == "cpu" and bool((targets < 0).any()):
        raise ValueError("a label is not one of the classes of the restricted cross-entropy")
    return F.cross_entropy(logits[:, cols], targets)


def kd_kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``KL(softmax(t / T) || softmax(s / T))``, summed over classes and
    averaged over samples (no ``T^2`` factor, as TARGET's code). The logits
    passed in are already restricted to the classes distilled (the old ones)."""
    log_s = F.log_softmax(student_logits / temperature, dim=1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=1)
    return (log_t.exp() * (log_t - log_s)).sum(dim=1).mean()


def bn_statistics_loss(stats: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """TARGET Eq. (BN loss, after DeepInversion): ``sum_l ||mu_l(x~) -
    mu_l||_2 + ||sigma^2_l(x~) - sigma^2_l||_2`` over the model's BatchNorm
    layers ``l``, where ``(batch mean, batch variance, running mean, running
    variance)`` are the four per-channel vectors of one layer."""
    total = None
    for mean, var, running_mean, running_var in stats:
        term = torch.linalg.vector_norm(mean - running_mean) + torch.linalg.vector_norm(var - running_var)
        total = term if total is None else total + term
    if total is None:
        raise ValueError("the BatchNorm-statistics loss needs at least one BatchNorm layer")
    return total


def batch_statistics(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and (biased) variance of a BatchNorm layer's input
    ``x`` ([N, C] or [N, C, ...]): what the BN loss compares with the
    layer's running statistics."""
    dims = [0] + list(range(2, x.dim()))
    return x.mean(dim=dims), x.var(dim=dims, unbiased=False)


def bn_layers(model: nn.Module) -> list[nn.Module]:
    """The model's BatchNorm layers, in module order."""
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def forward_with_bn_statistics(
    model: nn.Module, x: torch.Tensor
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """``(model(x), stats)``: the model's output and, for each of its
    BatchNorm layers in module order, ``(batch mean, batch variance, running
    mean, running variance)`` of the layer's input (read through forward
    hooks, removed after)."""
    layers = bn_layers(model)
    if not layers:
        raise ValueError("the model has no BatchNorm layer")
    inputs: dict[int, torch.Tensor] = {}
    handles = [m.register_forward_hook(lambda m, i, o, k=k: inputs.__setitem__(k, i[0])) for k, m in enumerate(layers)]
    try:
        out = model(x)
    finally:
        for h in handles:
            h.remove()
    stats = [(*batch_statistics(inputs[k]), m.running_mean, m.running_var) for k, m in enumerate(layers)]
    return out, stats  # type: ignore[return-value]  # running_mean/var: Tensor buffers


def forward_with_bn_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model(x), L_bn)``: the model's output and :func:`bn_statistics_loss`
    of the batch statistics of each BatchNorm layer's input against that
    layer's running statistics."""
    out, stats = forward_with_bn_statistics(model, x)
    return out, bn_statistics_loss(stats)


def blend_statistics(
    stats: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    earlier: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    momentum: float,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """TARGET's code's BatchNorm loss with momentum (its ``bn_mmt``, after
    Fast-DataFree): each layer's batch mean and variance are compared with
    the running statistics as ``(1 - momentum) * this batch's + momentum *
    earlier``, ``earlier`` the momentum average of the earlier batches' (one
    ``(mean, variance)`` per layer; ``None`` for the first batch: this
    batch's alone), so a batch also makes up for where the earlier ones
    missed. Returns ``stats`` with the blended mean and variance, for
    :func:`bn_statistics_loss`."""
    if earlier is None:
        return list(stats)
    return [
        ((1 - momentum) * mean + momentum * m0, (1 - momentum) * var + momentum * v0, rm, rv)
        for (mean, var, rm, rv), (m0, v0) in zip(stats, earlier, strict=True)
    ]


def update_momentum(
    stats: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    earlier: Sequence[tuple[torch.Tensor, torch.Tensor]] | None,
    momentum: float,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The momentum average after a batch whose last step had ``stats``
    (:func:`blend_statistics`): that batch's mean and variance for the
    first batch, else ``momentum * earlier + (1 - momentum) * this``."""
    now = [(mean.detach(), var.detach()) for mean, var, _, _ in stats]
    if earlier is None:
        return now
    return [
        (momentum * m0 + (1 - momentum) * m, momentum * v0 + (1 - momentum) * v)
        for (m, v), (m0, v0) in zip(now, earlier, strict=True)
    ]


def crop_and_flip(x: torch.Tensor, padding: int = 4) -> torch.Tensor:
    """Each image of ``x`` [N, C, H, W] zero-padded by ``padding`` pixels,
    cropped back to H x W at a random offset and flipped left-right with
    probability 1/2 (TARGET's code's augmentation of the generator's images
    before the teacher sees them: a random crop with padding 4 and a
    horizontal flip). Differentiable in ``x``: the generator learns through
    it."""
    n, _, h, w = x.shape
    padded = F.pad(x, (padding, padding, padding, padding))
    dy = torch.randint(2 * padding + 1, (n,), device=x.device)
    dx = torch.randint(2 * padding + 1, (n,), device=x.device)
    flip = torch.rand(n, device=x.device) < 0.5
    rows = dy[:, None] + torch.arange(h, device=x.device)  # [N, H]
    cols = dx[:, None] + torch.arange(w, device=x.device)  # [N, W]
    cols = torch.where(flip[:, None], cols.flip(1), cols)
    picked = padded[torch.arange(n, device=x.device)[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    return picked.permute(0, 3, 1, 2)  # advanced indexing puts the channels last


def adversarial_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """TARGET's adversarial (diversity) term, after DENSE: ``-mean_i w_i
    KL(softmax(t_i/T) || softmax(s_i/T))`` with ``w_i = 1`` where teacher and
    student agree on the class (argmax) and 0 elsewhere. Minimised by the
    generator, it pushes synthetic samples towards where the student still
    disagrees with the teacher, without leaving the teacher's decision."""
    log_s = F.log_softmax(student_logits / temperature, dim=1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=1)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=1)
    agree = (teacher_logits.argmax(dim=1) == student_logits.argmax(dim=1)).to(kl.dtype)
    return -(agree * kl).mean()


def generator_loss(
    ce: torch.Tensor, bn: torch.Tensor, adv: torch.Tensor, bn_weight: float, adv_weight: float
) -> torch.Tensor:
    """TARGET's generator objective: ``L_ce + lambda_bn L_bn + lambda_adv L_adv``."""
    return ce + bn_weight * bn + adv_weight * adv


class Generator(nn.Module):
    """A small DENSE-style generator: ``z`` -> linear -> two (upsample, 3x3
    conv, BatchNorm, LeakyReLU) stages -> 3x3 conv -> BatchNorm without
    affine parameters, so its images come out standardised per channel like
    the run's normalised data (``output="standardise"``), or a sigmoid, so
    they come out as pixels in [0, 1] to be normalised like the run's data
    (``output="sigmoid"``, TARGET's code's generator). ``width`` channels in
    the first stage (TARGET's code: ``2 * ngf``, 128), ``width // 2`` in the
    second; the output is resized to ``shape`` = (C, H, W)."""

    def __init__(self, shape: Sequence[int], noise_dim: int = 64, width: int = 32, output: str = "standardise"):
        super().__init__()
        channels, height, width_px = shape
        self.shape = (channels, height, width_px)
        self.noise_dim = noise_dim
        self.init = (max(1, -(-height // 4)), max(1, -(-width_px // 4)))
        self.width = width
        self.project = nn.Sequential(nn.Linear(noise_dim, width * self.init[0] * self.init[1]))
        self.body = nn.Sequential(
            nn.BatchNorm2d(width),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(width, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(width, width // 2, 3, padding=1, bias=False),
            nn.BatchNorm2d(width // 2),
            nn.LeakyReLU(0.2),
            nn.Conv2d(width // 2, channels, 3, padding=1),
            nn.Sigmoid() if output == "sigmoid" else nn.BatchNorm2d(channels, affine=False),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        x = self.project(z).view(z.shape[0], self.width, *self.init)
        x = self.body(x)
        if tuple(x.shape[-2:]) != self.shape[1:]:
            x = F.interpolate(x, size=self.shape[1:], mode="bilinear", align_corners=False)
        return x


def synthesize(
    teacher: nn.Module,
    student: nn.Module,
    generator: Generator,
    classes: Sequence[int],
    *,
    steps: int,
    batch_size: int,
    size: int,
    lr_generator: float,
    lr_student: float,
    bn_weight: float,
    adv_weight: float,
    temperature: float,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TARGET's server-side data-free step (Sec. 3.3, as its code does it,
    after Fast-DataFree): the synthetic set is made batch by batch; for each
    batch, labels ``y`` are drawn uniformly from ``classes`` (the classes the
    teacher has learned) and a fresh noise batch ``z`` is optimised *with*
    the generator's weights for ``steps`` steps on ``L_ce(teacher(G(z)), y) +
    bn_weight L_bn + adv_weight L_adv``; after each of those steps the
    ``student`` (the diversity term's adversary) takes one step distilling
    the teacher on the batch. The batch's last images join the set: the
    optimised ``z`` ties each image to its label, and the generator, kept
    from batch to batch, starts each batch from what it has learned.

    ``teacher`` (frozen, eval mode: its BatchNorm running statistics are
    the targets of ``L_bn``) and ``student`` see only ``classes``' columns.
    Returns ``(images [size, C, H, W], labels [size], the last step's loss
    terms)`` on the CPU."""
    cols = torch.as_tensor(list(classes), device=device, dtype=torch.long)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    opt_s = torch.optim.SGD(student.parameters(), lr=lr_student, momentum=0.9)
    generator.train()
    last_terms: dict[str, torch.Tensor] = {}
    images, labels = [], []
    for start in range(0, size, batch_size):
        n = min(batch_size, size - start)
        z = torch.randn(n, generator.noise_dim, device=device, requires_grad=True)
        y = torch.randint(len(cols), (n,), device=device)
        opt_g = torch.optim.Adam([z, *generator.parameters()], lr=lr_generator, betas=(0.5, 0.999))
        for _ in range(steps):
            x = generator(z)
            t_logits, bn = forward_with_bn_loss(teacher, x)
            t_logits = t_logits[:, cols]
            student.eval()
            s_logits = student(x)[:, cols]
            ce = F.cross_entropy(t_logits, y)
            adv = adversarial_loss(t_logits, s_logits, temperature)
            loss = generator_loss(ce, bn, adv, bn_weight, adv_weight)
            opt_g.zero_grad()
            loss.backward()
            opt_g.step()
            student.train()
            x = x.detach()
            kd = kd_kl(student(x)[:, cols], t_logits.detach(), temperature)
            opt_s.zero_grad()
            kd.backward()
            opt_s.step()
            terms = (("ce", ce), ("bn", bn), ("adv", adv), ("student_kd", kd))
            last_terms = {k: v.detach() for k, v in terms}  # read back once, after the loop: no wait per step
        with torch.no_grad():  # train mode: the batch statistics the images were optimised with
            images.append(generator(z).cpu())
        labels.append(cols[y].cpu())
    last = {k: float(v) for k, v in last_terms.items()}
    return torch.cat(images), torch.cat(labels), last


def keep_lower(
    best: torch.Tensor, best_loss: torch.Tensor, x: torch.Tensor, loss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images, loss)`` of the lower-loss one of the step kept so far
    (``best``, ``best_loss``) and this step (``x``, ``loss``), chosen on the
    device (no read-back); a tie keeps the earlier step, as the code's
    ``best_cost > loss``."""
    better = loss < best_loss
    return torch.where(better, x, best), torch.where(better, loss, best_loss)


def synthesize_as_code(
    teacher: nn.Module,
    generator: Generator,
    classes: Sequence[int],
    *,
    steps: int,
    batch_size: int,
    size: int,
    lr_generator: float,
    lr_noise: float,
    ce_weight: float,
    bn_weight: float,
    bn_momentum: float,
    mean: Sequence[float],
    std: Sequence[float],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """TARGET's server-side data-free step as its released code runs it on
    CIFAR (zj-jayzhang/Federated-Class-Continual-Learning, ``methods/target.py``,
    its CIFAR settings), written from reading that code:

    * the set is made in batches of ``batch_size`` (256) until ``size``
      (2,560: ten batches). For each batch, labels ``y`` uniform over
      ``classes``, fresh noise ``z``, and a copy of the generator; the copy
      and ``z`` take ``steps`` (10) Adam steps (``lr_generator`` 0.002,
      ``lr_noise`` 0.01 for ``z``, betas (0.5, 0.999)) on
      ``ce_weight * CE(teacher(aug(G(z))), y) + bn_weight * L_bn`` (0.5 and
      10), ``aug`` :func:`crop_and_flip` then the run's normalisation, ``G``
      ending in a sigmoid (pixels in [0, 1]);
    * ``L_bn`` compares each BatchNorm layer's batch statistics, blended with
      the earlier batches' by ``bn_momentum`` (0.9, :func:`blend_statistics`),
      with the teacher's running statistics;
    * the generator itself learns by first-order MAML: the copy's gradients
      of every step are summed into the generator's, which takes one Adam
      step per batch (lr ``steps * lr_generator``, as the code's meta
      optimiser), so each batch's copy starts from a generator that has
      learned from the batches before;
    * of a batch's ``steps`` images the set keeps those of the step with the
      lowest loss (the code's ``best_inputs``), normalised like the run's
      data: what the clients distil on;
    * no adversarial term and no student: the code's CIFAR settings start
      them after ``warmup = 20`` batches, and a task end makes 10.

    Returns ``(images [size, C, H, W] normalised, labels [size], the last
    step's loss terms)`` on the CPU. The best step is chosen on the device,
    without reading the loss back (no wait per step on a GPU)."""
    cols = torch.as_tensor(list(classes), device=device, dtype=torch.long)
    m = torch.as_tensor(mean, device=device, dtype=torch.float32).view(1, -1, 1, 1)
    s = torch.as_tensor(std, device=device, dtype=torch.float32).view(1, -1, 1, 1)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    generator.train()
    meta = torch.optim.Adam(generator.parameters(), lr=lr_generator * steps, betas=(0.5, 0.999))
    earlier: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    last_terms: dict[str, torch.Tensor] = {}
    images, labels = [], []
    for start in range(0, size, batch_size):
        n = min(batch_size, size - start)
        fast = copy.deepcopy(generator)
        z = torch.randn(n, generator.noise_dim, device=device, requires_grad=True)
        y = torch.randint(len(cols), (n,), device=device)
        groups: list[dict[str, Any]] = [{"params": list(fast.parameters())}, {"params": [z], "lr": lr_noise}]
        opt = torch.optim.Adam(groups, lr=lr_generator, betas=(0.5, 0.999))
        summed = [torch.zeros_like(p) for p in generator.parameters()]  # first-order MAML's meta-gradient
        best_loss = torch.full((), float("inf"), device=device)
        best = torch.zeros(n, *generator.shape, device=device)
        stats: list = []
        for _ in range(steps):
            x = fast(z)
            logits, stats = forward_with_bn_statistics(teacher, (crop_and_flip(x) - m) / s)
            ce = F.cross_entropy(logits[:, cols], y)
            bn = bn_statistics_loss(blend_statistics(stats, earlier, bn_momentum))
            loss = ce_weight * ce + bn_weight * bn
            with torch.no_grad():
                best, best_loss = keep_lower(best, best_loss, x, loss)
            opt.zero_grad()
            loss.backward()
            for total, q in zip(summed, fast.parameters(), strict=True):
                if q.grad is not None:
                    total.add_(q.grad)  # the copy's gradients, summed over the steps
            opt.step()
            last_terms = {"ce": ce.detach(), "bn": bn.detach()}
        for p, total in zip(generator.parameters(), summed, strict=True):
            p.grad = total
        meta.step()
        earlier = update_momentum(stats, earlier, bn_momentum)
        images.append(((best - m) / s).cpu())
        labels.append(cols[y].cpu())
    return torch.cat(images), torch.cat(labels), {k: float(v) for k, v in last_terms.items()}
