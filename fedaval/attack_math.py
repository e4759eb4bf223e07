"""What an honest-but-curious server can reconstruct from an upload, and how
close it gets: plain functions on tensors (the glue is
:mod:`fedaval.attack`).

* :func:`invert_update` - Geiping, Bauermeister, Droege, Moeller, "Inverting
  Gradients - How easy is it to break privacy in federated learning?"
  (NeurIPS 2020), through the ``breaching`` package (Geiping's own
  implementation, PyPI 0.1.2, runs with torch 2.x): cosine similarity
  between the candidate images' gradient and the uploaded update, a
  total-variation prior, signed Adam on the images, boxed to the valid
  pixel range. Chosen over a hand-written attack because it is the
  reference implementation of the paper; what it does not cover (prototype
  uploads) is :func:`invert_prototype`.
* :func:`invert_prototype` - for methods that upload class prototypes
  (FedProK, PFCL, GLDP, HGP): optimise an image whose feature is the
  uploaded prototype (Adam on the image; squared feature distance plus the
  same total-variation prior). Written here: breaching has no such attack.
* :func:`image_metrics` - MSE, PSNR and SSIM (torchmetrics) on images in
  [0, 1], and FedProK's privacy ``P = 1 - 1 / (1 + MSE)`` (FedProK, Eq. 2;
  larger is more private).

Readings chosen:

1. *Update as a gradient* (FedSGD reading): the server treats ``received -
   uploaded`` weights as the direction of one gradient step on the images it
   looks for. Exact for one local step; for many steps (FedAvg's epochs) it
   is the attack's approximation, as in Geiping et al. Sec. 5. The cosine
   objective makes the learning rate irrelevant.
2. *What the attacker knows*: the model it sent (white box), the labels of
   the images it reconstructs (Geiping et al. assume them too; they can be
   read off the last layer's update), and how many images it looks for.
3. *Which true image a reconstruction is compared with*: the client's
   training image of the same label closest to it in MSE (the attacker's
   best case, so P is a lower bound on privacy), see :func:`match_nearest`.
"""

from __future__ import annotations

import contextlib
import io
from typing import Any

import torch

P_HELP = "FedProK Eq. 2: P = 1 - 1/(1 + MSE), larger is more private"


def privacy_p(mse: float) -> float:
    """FedProK Eq. 2: ``P = 1 - 1 / (1 + MSE(true, reconstructed))``."""
    return 1.0 - 1.0 / (1.0 + mse)


def image_metrics(true: torch.Tensor, rec: torch.Tensor) -> dict[str, float]:
    """MSE, PSNR (dB), SSIM and P of reconstructions ``rec`` against ``true``
    (``[N, C, H, W]`` in [0, 1]), averaged over the N pairs (PSNR and SSIM
    per image, then averaged: torchmetrics' ``reduction="elementwise_mean"``
    over the batch)."""
    from torchmetrics.functional.image import peak_signal_noise_ratio, structural_similarity_index_measure

    true = true.detach().float().cpu().clamp(0, 1)
    rec = rec.detach().float().cpu().clamp(0, 1)
    mse = float(((true - rec) ** 2).mean())
    psnr = float(
        torch.stack([peak_signal_noise_ratio(r[None], t[None], data_range=1.0) for t, r in zip(true, rec)]).mean()
    )
    kernel = 11 if min(true.shape[-2:]) >= 11 else 3  # 8x8 digits: a 3x3 window
    ssim = float(structural_similarity_index_measure(rec, true, data_range=1.0, kernel_size=kernel))  # type: ignore[arg-type]
    return {"mse": mse, "psnr": psnr, "ssim": ssim, "p": privacy_p(mse)}


def match_nearest(
    rec: torch.Tensor, rec_labels: torch.Tensor, true: torch.Tensor, true_labels: torch.Tensor
) -> torch.Tensor:
    """Reading 3: for each reconstruction, the index of the true image of the
    same label (any label if none has it) with the smallest MSE."""
    out = []
    for r, y in zip(rec, rec_labels):
        same = (true_labels == y).nonzero().flatten()
        pool = same if len(same) else torch.arange(len(true))
        err = ((true[pool] - r[None]) ** 2).flatten(1).mean(1)
        out.append(int(pool[int(err.argmin())]))
    return torch.tensor(out, dtype=torch.long)


def denormalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    m = torch.tensor(mean, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    s = torch.tensor(std, dtype=x.dtype, device=x.device).view(1, -1, 1, 1)
    return (x * s + m).clamp(0, 1)


def total_variation(x: torch.Tensor) -> torch.Tensor:
    """Mean absolute difference of neighbouring pixels (Geiping et al.'s TV)."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (x[..., :, 1:] - x[..., :, :-1]).abs().mean()


def _breaching_config(iterations: int, tv: float, step_size: float):
    import breaching

    with contextlib.redirect_stdout(io.StringIO()):  # get_config prints the "use case" it composes
        cfg = breaching.get_config(overrides=["attack=invertinggradients"])
    attack = cfg.attack
    attack.optim.max_iterations = iterations
    attack.optim.callback = max(iterations, 1)
    attack.optim.step_size = step_size
    attack.regularization.total_variation.scale = tv
    return attack


def invert_update(
    model: torch.nn.Module,
    received: dict[str, torch.Tensor],
    uploaded: dict[str, torch.Tensor],
    labels: torch.Tensor,
    shape: tuple[int, int, int],
    mean,
    std,
    iterations: int = 300,
    tv: float = 0.2,
    step_size: float = 0.1,
    seed: int = 0,
) -> torch.Tensor:
    """Reconstruct ``len(labels)`` images from a weight upload (reading 1).

    ``model``'s architecture is used; its parameters are set to ``received``
    (the weights the server sent). The "gradient" matched is ``received -
    uploaded`` per parameter. Returns images in [0, 1], ``[N, C, H, W]``.
    The global random streams are left as they were (the attack draws from
    its own, seeded by ``seed``)."""
    import copy
    import logging

    import breaching
    from omegaconf import OmegaConf

    model = copy.deepcopy(model).cpu().float()
    names = [name for name, _ in model.named_parameters()]
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in received:
                p.copy_(received[name].detach().cpu())
    gradients = [
        (received[n].detach().cpu().float() - uploaded[n].detach().cpu().float())
        if n in received and n in uploaded
        else torch.zeros_like(p)
        for n, p in zip(names, model.parameters())
    ]
    metadata = OmegaConf.create(
        {"shape": list(shape), "mean": list(mean), "std": list(std), "modality": "vision", "classes": 0}
    )
    server_payload = [{"parameters": [p.detach() for p in model.parameters()], "buffers": None, "metadata": metadata}]
    shared = [
        {
            "gradients": gradients,
            "buffers": None,
            "metadata": {"num_data_points": len(labels), "labels": labels.cpu().long(), "local_hyperparams": None},
        }
    ]
    cfg = _breaching_config(iterations, tv, step_size)
    setup = {"dtype": torch.float, "device": torch.device("cpu")}
    logger = logging.getLogger("breaching")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            attacker = breaching.attacks.prepare_attack(model, torch.nn.CrossEntropyLoss(), cfg, setup)
            rec, _ = attacker.reconstruct(server_payload, shared, {}, dryrun=False)
    finally:
        logger.setLevel(level)
    return denormalise(rec["data"].detach(), mean, std)


def invert_prototype(
    features: torch.nn.Module,
    prototype: torch.Tensor,
    shape: tuple[int, int, int],
    mean,
    std,
    iterations: int = 300,
    tv: float = 0.05,
    lr: float = 0.1,
    seed: int = 0,
) -> torch.Tensor:
    """Reconstruct one image of a class from its uploaded prototype: minimise
    ``||f(x) - prototype||^2 / ||prototype||^2 + tv * TV(x)`` over ``x``
    (in the model's normalised input space, kept inside the image of [0, 1])
    with Adam, from Gaussian noise drawn from a generator seeded by ``seed``.
    ``features`` (the extractor the prototype came from) is used in eval mode
    and not changed. Returns ``[1, C, H, W]`` in [0, 1]."""
    import copy

    net = copy.deepcopy(features).cpu().float().eval()
    for p in net.parameters():
        p.requires_grad_(False)
    target = prototype.detach().cpu().float().flatten()
    scale = target.pow(2).sum().clamp_min(1e-12)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    lo, hi = -m / s, (1 - m) / s
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn((1, *shape), generator=gen) * 0.2).requires_grad_(True)
    opt = torch.optim.Adam([x], lr=lr)
    best, best_loss = x.detach().clone(), float("inf")
    for _ in range(iterations):
        opt.zero_grad()
        loss = (net(x).flatten() - target).pow(2).sum() / scale + tv * total_variation(x)
        loss.backward()
        opt.step()
        with torch.no_grad():
            x.copy_(torch.max(torch.min(x, hi), lo))
        if loss.item() < best_loss:
            best_loss, best = loss.item(), x.detach().clone()
    return denormalise(best, mean, std)


def single_step_upload(data: Any, index: int = 5, lr: float = 0.1, model_name: str = "mlp"):
    """The attack's easiest case: fedaval's ``model_name`` (seeded 0), one SGD
    step (``lr``) on training image ``index`` of ``data`` (an ImageData).
    Returns ``(model, image in [0, 1], label, received state, uploaded
    weights)``: what tests/test_attack_math.py and
    benchmarks/privacy_single_step.py attack."""
    from fedaval.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_classes)
    x01 = data.train_x[index : index + 1].float() / 255
    mean, std = torch.tensor(data.mean).view(1, -1, 1, 1), torch.tensor(data.std).view(1, -1, 1, 1)
    y = data.train_y[index : index + 1]
    received = {k: v.clone() for k, v in model.state_dict().items()}
    loss = torch.nn.functional.cross_entropy(model((x01 - mean) / std), y)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    uploaded = {n: p.detach() - lr * g for (n, p), g in zip(model.named_parameters(), grads)}
    return model, x01, y, received, uploaded


def save_grid(true: torch.Tensor, rec: torch.Tensor, path: Any) -> None:
    """A PNG: the true images on the first row, their reconstructions below."""
    from torchvision.utils import save_image

    pairs = torch.cat([true.detach().float().cpu(), rec.detach().float().cpu()])
    save_image(pairs, str(path), nrow=len(true), padding=2, pad_value=1.0)
