"""TARGET's maths (Zhang et al., ICCV 2023): plain functions on tensors.

The hook glue is :mod:`fedaval.plugins.target`; every function here is
checked against hand-computed values in ``tests/test_target_math.py``.
"""

from __future__ import annotations

from collections.abc import Sequence

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


def forward_with_bn_loss(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(model(x), L_bn)``: the model's output and :func:`bn_statistics_loss`
    of the batch statistics of each BatchNorm layer's input against that
    layer's running statistics (read through forward hooks, removed after)."""
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
    return out, bn_statistics_loss(stats)  # type: ignore[arg-type]  # running_mean/var: Tensor buffers


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
    the run's normalised data. ``width`` channels in the first stage; the
    output is resized to ``shape`` = (C, H, W)."""

    def __init__(self, shape: Sequence[int], noise_dim: int = 64, width: int = 32):
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
            nn.BatchNorm2d(channels, affine=False),
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
