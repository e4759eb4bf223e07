"""What a client's local training does besides the method: the optimizer,
its state policy, the learning-rate schedule and data augmentation.

All are plain functions of the run's configuration: the optimizer is made
once per client (:class:`fedaval.client.Client`), the rest applied by
:class:`fedaval.strategy.FederatedStrategy` once per round (optimizer state,
learning rate) or once per minibatch (augmentation).

* **Optimizer** (``--optimizer``). ``sgd`` (default): SGD with ``--momentum``
  and ``--weight-decay``, as the papers fedaval hosts train. ``adam``: Adam
  (PyTorch's, its betas and eps) with ``--weight-decay`` as an L2 term on the
  gradient (as SGD's, not AdamW's decoupled decay); ``--lr`` defaults to
  1e-3 and ``--momentum`` is refused. Methods whose update is SGD's by
  definition refuse it (FedNova's normalisation, APFL's personal step). With
  ``--optimizer-state reset`` Adam's moments and step count start afresh every
  round, as a momentum buffer does.

* **Optimizer state** (``--optimizer-state``). ``reset`` (default): every
  round starts with a fresh optimizer state (no momentum buffer), as the
  clients of FedAvg, FedProx and FedNova do (McMahan et al. 2017; FedNova's
  normalisation, Wang et al. 2020, assumes it); ``keep``: one state for the
  whole run, so momentum gathered on last round's weights is applied to the
  freshly received global weights (fedaval before this option; kept for
  comparison).
* **Learning rate** (``--lr-schedule``), per global round ``r`` of ``R``
  (constant within a round's local epochs): ``constant`` ``lr``; ``cosine``
  ``lr_min + (lr - lr_min) (1 + cos(pi (r - 1) / (R - 1))) / 2``; ``exp``
  ``lr (lr_min / lr)^((r - 1) / (R - 1))`` (PFCL decays 0.01 towards 1e-4
  over training). Both decays start at ``lr`` in round 1 and reach
  ``lr_min`` (``--lr-min``) in the last round.
* **Precision** (``--precision``). ``fp32`` (default). ``bf16``: each
  client's training forward (features, the ``fedaval_classify`` hook, the
  classifier) and its base loss run under ``torch.autocast`` to bfloat16
  (:func:`autocast`): matrix products and convolutions in bfloat16, the
  operations autocast keeps in float32 (the cross-entropy, normalisations)
  in float32, the weights, their gradients and the optimizer in float32. No
  loss scaling (bfloat16 has float32's range). A method's loss terms
  (``fedaval_client_loss``) get the step's bfloat16 features and logits and
  run outside autocast. Evaluation, the server and every method's own
  computations outside a training step (prototypes, fits) stay float32, so
  the printed accuracies are of the float32 model. Results are not the
  ``fp32`` run's: an opt-in speed setting (docs/performance.md, item 3).
* **Memory order** (``--channels-last``). Every model fedaval makes
  (``Run.model``: the clients', the server's, a method's extra copies) keeps
  its 4-D weights in channels-last order, and each client's training
  minibatches are made channels-last after augmentation. Convolutions then
  take cuDNN's NHWC kernels, faster with tensor cores (with ``--precision
  bf16`` above all); on the CPU they run too. The arithmetic is the same
  but the kernels sum in another order, so results are not bit for bit the
  default's. Evaluation's minibatches stay as they are built (cuDNN converts
  them).
* **Compilation** (``--compile``). ``off`` (default). ``inductor``: each
  client's training forward of ``model.features`` (the backbone, where nearly
  all of a step's work is) goes through ``torch.compile`` with PyTorch's
  code-generating backend (:func:`compiled_features`): elementwise operations
  fused into fewer kernels (Triton's on a GPU, C++ on the CPU), the backward
  made ahead of time. One compiled function serves every client (the
  module is an argument, its tensors the graph's inputs), compiled again
  when what it was compiled for changes: the training mode, grad mode,
  autocast, a parameter's ``requires_grad``, a batch of fewer than 16
  images (the batch size is a symbol from the first call, so a client's
  full and last batches share one graph). ``aot_eager``: the same capture
  and ahead-of-time backward, run by ATen's eager kernels without code
  generation (for checking: its results are the eager ones). The
  classifier, the methods' loss terms and hooks, the optimizer, evaluation
  and every call a method makes to ``model.features`` itself run eagerly.
  A backbone that does not compile as one graph is an error, never a
  silent fallback to eager, and so is running out of recompilations.
  Generated kernels sum in other orders, so ``inductor``'s results are not
  bit for bit the eager ones; with ``--cuda-graphs`` it needs
  ``--cuda-graph-scope step`` (the compiled backbone runs inside the
  captured step). An opt-in speed setting (docs/performance.md, item 3).
* **Augmentation** (``--augment``). ``standard``: the CIFAR recipe the papers
  train with, a random crop with 4-pixel zero padding (black, before
  normalisation) and a random horizontal flip, drawn per sample; done on the
  whole minibatch at once, on its device, after the minibatch is built (so
  the device data path and the loader path give the same batches and the
  same augmented images). Draws come from the global random streams, which
  inside a client's round are the client's own
  (:meth:`fedaval.client.Client.rng_scope`): the same on every backend and
  across a resume. ``auto`` is ``standard`` for CIFAR-10/100, Tiny-ImageNet
  and image folders of images of at most 64 pixels, ``none`` otherwise
  (digits, MNIST, Fashion-MNIST: flips would change what a digit is).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedaval.config import RunConfig
    from fedaval.datasets import ImageData

AUGMENTED_DATASETS = ("cifar10", "cifar100", "tiny-imagenet")
SMALL_IMAGE = 64
PADDING = 4
COMPILE_RECOMPILES = 64  # compiled_features' recompilation limit (dynamo's default: 8)


def make_optimizer(params, config: RunConfig) -> torch.optim.Optimizer:
    """A client's local optimizer over ``params`` (``--optimizer``)."""
    assert config.lr is not None and config.momentum is not None, "RunConfig.validate fills them"
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay)


def autocast(config: RunConfig, device: torch.device):
    """``--precision``'s context for a training forward or loss: autocast to
    bfloat16 with ``bf16``, nothing with ``fp32``. Autocast's weight cache is
    off, as CUDA graphs require (``--cuda-graphs``) and as a step that casts
    each weight once needs no cache for."""
    from contextlib import nullcontext

    if config.precision == "fp32":
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


def check_precision(config: RunConfig, device: torch.device) -> None:
    """``--precision bf16`` needs a device that computes in bfloat16: a one-line error on a GPU without it."""
    if config.precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        from fedaval.errors import FedavalUsageError

        raise FedavalUsageError(
            f"--precision bf16: {torch.cuda.get_device_name(device)} has no bfloat16 support; use --precision fp32"
        )


def _backbone_call(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return module(x)


@functools.cache
def compiled_features(backend: str):
    """``--compile``'s function ``(module, x) -> module(x)``, compiled once
    per process and backend and shared by every client: the module is an
    argument, so dynamo lifts its parameters and buffers as the graph's
    inputs and guards on its structure, not on which client's module it is.

    ``fullgraph``: a graph break is an error. The recompilation limit is
    raised to 64 (the variants a run meets: training and frozen backbones,
    grad modes, autocast, batch shapes) and hitting it is an error: past it
    dynamo would run the backbone eagerly without saying so."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILE_RECOMPILES)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(_backbone_call, backend=backend, fullgraph=True)


def compiled_backbone(config: RunConfig, module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)`` through :func:`compiled_features`; a backbone that does
    not compile as one graph, or one that used up its recompilations, is a
    one-line error naming the backbone.

    The batch dimension is compiled as a size from the first call on
    (``maybe_mark_dynamic``), not first for the full batch and then again
    for every size: a client's full and last batches run the same kernels
    whichever came first, so a run's results do not depend on which
    batches the process compiled for before (another run, a resume). A
    size the compiled graph cannot take (dynamo guards some operations on
    the size, a convolution on at least 16 rows) gets a graph of its own."""
    import torch._dynamo
    import torch._dynamo.exc as dynamo

    from fedaval.errors import FedavalUsageError

    torch._dynamo.maybe_mark_dynamic(x, 0)  # every batch size in one graph, from the first
    try:
        return compiled_features(config.compile)(module, x)
    except dynamo.FailOnRecompileLimitHit:
        raise FedavalUsageError(
            f"--compile {config.compile}: {type(module).__name__} was compiled "
            f"{torch._dynamo.config.recompile_limit} times "
            "(each new batch shape, mode or requires_grad needs one) and would run eagerly from here; "
            "use --compile off"
        ) from None
    except dynamo.Unsupported as error:
        reason = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise FedavalUsageError(
            f"--compile {config.compile}: {type(module).__name__} does not compile as one graph ({reason}); "
            "use --compile off"
        ) from None


def check_compile(config: RunConfig, device: torch.device) -> None:
    """``--compile``'s needs, one-line errors: with ``--cuda-graphs`` only
    the step scope (a backbone graphed alone is captured by
    ``make_graphed_callables``, which takes the module, not a compiled
    function), and ``inductor`` on a GPU needs Triton."""
    from fedaval.errors import FedavalUsageError

    if config.compile == "off":
        return
    if config.cuda_graphs and config.cuda_graph_scope != "step":
        raise FedavalUsageError(
            f"--compile {config.compile} with --cuda-graphs needs --cuda-graph-scope step "
            f"(not {config.cuda_graph_scope}): the compiled backbone runs inside the captured step"
        )
    if config.compile == "inductor" and device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise FedavalUsageError(
                "--compile inductor on a GPU needs Triton, which this Python does not have; use --compile off"
            )


def require_sgd(config: RunConfig, method: str, why: str) -> None:
    """A one-line error unless the run's local optimizer is SGD: for a
    method whose update is SGD's by definition (``why`` says how)."""
    if config.optimizer != "sgd":
        from fedaval.errors import FedavalUsageError

        raise FedavalUsageError(f"{method} needs --optimizer sgd ({why}), not --optimizer {config.optimizer}")


def resolve_augment(choice: str, data: ImageData) -> str:
    """``--augment``'s value for this dataset: ``auto`` becomes ``standard`` or ``none``."""
    if choice != "auto":
        return choice
    if data.name in AUGMENTED_DATASETS:
        return "standard"
    if data.name == "imagefolder" and max(data.input_shape[1:]) <= SMALL_IMAGE and data.input_shape[0] == 3:
        return "standard"
    return "none"


def round_lr(config: RunConfig, round: int, total_rounds: int) -> float:
    """The learning rate of global round ``round`` (1-based) of ``total_rounds``."""
    lr = config.lr
    assert lr is not None, "RunConfig.validate fills --lr"
    if config.lr_schedule == "constant" or total_rounds <= 1:
        return lr
    progress = (round - 1) / (total_rounds - 1)
    if config.lr_schedule == "cosine":
        return config.lr_min + (lr - config.lr_min) * (1 + math.cos(math.pi * progress)) / 2
    if config.lr_schedule == "exp":
        return lr * (config.lr_min / lr) ** progress
    raise AssertionError(config.lr_schedule)  # RunConfig.validate allows only the names above


def standard_augment(x: torch.Tensor, fill: torch.Tensor, padding: int = PADDING) -> torch.Tensor:
    """Random crop of ``x`` ([B, C, H, W], normalised) from its copy padded by
    ``padding`` pixels of value ``fill`` ([C]: black, normalised) on every
    side, then a random horizontal flip, independently per sample, in one
    batched operation. Offsets are drawn uniformly in ``[0, 2 * padding]``
    and flips with probability 1/2, from the global random stream of
    ``x``'s device."""
    b, c, h, w = x.shape
    padded = fill.to(x.device, x.dtype).view(1, c, 1, 1).expand(b, c, h + 2 * padding, w + 2 * padding).clone()
    padded[:, :, padding : padding + h, padding : padding + w] = x
    offsets = torch.randint(0, 2 * padding + 1, (b, 2), device=x.device)
    flips = torch.rand(b, device=x.device) < 0.5
    rows = offsets[:, 0:1] + torch.arange(h, device=x.device)  # [B, H]
    cols = offsets[:, 1:2] + torch.arange(w, device=x.device)  # [B, W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    batch = torch.arange(b, device=x.device)[:, None, None]
    out = padded.permute(0, 2, 3, 1)[batch, rows[:, :, None], cols[:, None, :]]  # [B, H, W, C]
    return out.permute(0, 3, 1, 2).contiguous()


def black(data: ImageData) -> torch.Tensor:
    """The normalised value of a black pixel, per channel: ``-mean / std``."""
    return -torch.tensor(data.mean, dtype=torch.float32) / torch.tensor(data.std, dtype=torch.float32)
