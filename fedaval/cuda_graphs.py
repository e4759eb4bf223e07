"""``--cuda-graphs``: a client's feature extractor trained through CUDA graphs.

On a GPU, a small model at batch 32 is bound by kernel launches, not by the
GPU: ResNet-18 on CIFAR-10 launches some 400 kernels per training step, and
the GPU finishes each faster than Python and the driver issue the next
(docs/performance.md, "On a GPU": one plain loop at batch 32 reaches 0.19
of the same loop at batch 320; the whole step captured as one graph, 0.55).
A CUDA graph records the launches of one forward and backward once and
replays them with a single launch.

What is captured: ``model.features`` (the backbone, nearly all the kernels),
forward and backward, with :func:`torch.cuda.make_graphed_callables`, one
graph per client, at the client's training batch shape. Everything else of
a step stays eager, so it keeps working as before: the classifier and the
``fedaval_classify`` hook, the loss and every plugin's loss terms, Avalanche's
callbacks, the optimizer step. A batch of another shape (the last, partial
batch of an epoch), evaluation (the model in eval mode) and any call a plugin
makes to ``model.features`` itself run eagerly as without the option.

The graph reads and writes the very tensors it was captured with: the
client's parameters and buffers (BatchNorm's running statistics are updated
by the replay, as by an eager step). It is captured again when any of them is
replaced (a new object, address or ``requires_grad`` flag: offloading a client and
loading it back, a plugin freezing the backbone) or the batch shape changes;
capturing runs three warm-up steps, whose effect on the buffers and on the
device's random stream is undone. A graph is not state: checkpoints and
offloaded clients do not hold it, and a resumed run captures anew.

Memory: a graph keeps its step's activations (for ResNet-18 at batch 32 on
CIFAR-10 an estimated 100 to 300 MB, not measured). A client keeps its graph only while it
trains in consecutive rounds: one that idles next round lets it go
(``FederatedStrategy._after_training``) and captures again when it is next
sampled; so at most the clients of two consecutive rounds hold graphs. On
the Ray backend a client's state travels to a worker for each round, so its
graph is captured every round there.

Results: a replay runs the kernels the eager step runs, in the same order, so
with ``--deterministic`` a run gives the same results.json with and without
the option (``benchmarks/cuda_identity.py`` checked it on an H200 for FedAvg
with ResNet-18, FedProK with the CNN, GLDP and PFCL with the MLP). Without it,
results differ as two eager GPU runs do. Measured gain: ResNet-18 at batch 32,
10 clients a round, 1.67 to 1.82 times the samples per second of eager rounds
(docs/performance.md, "On a GPU", item 3).

Limits, each an error rather than a silent fallback: a CUDA device only; a
feature extractor with module hooks (Opacus's per-sample gradients, for one)
cannot be captured. A backbone whose forward branches in Python on anything
but its tensors (the task, the round) would be frozen at the capture's
branch: fedaval's built-in backbones do not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedaval.errors import FedavalUsageError

if TYPE_CHECKING:
    from collections.abc import Callable

WARMUP_STEPS = 3
"""Eager steps make_graphed_callables runs on a side stream before capturing."""


def check_device(enabled: bool, name: str, device: torch.device) -> None:
    """``--cuda-graphs`` needs the run on a CUDA device (``--device name`` resolved to ``device``)."""
    if enabled and device.type != "cuda":
        resolved = "" if name == str(device) else f" (the {device} here)"
        raise FedavalUsageError(
            f"--cuda-graphs needs a CUDA device; --device {name}{resolved} is not one: allowed with cuda, cuda:<index>, "
            "or auto on a machine with a GPU"
        )


class GraphedFeatures:
    """A client's ``model.features``, forward and backward replayed from CUDA
    graphs while the model trains; the module itself otherwise. Call it as the
    module: ``features = graphed(x)``."""

    def __init__(self, module: torch.nn.Module, make_graphed: Callable = torch.cuda.make_graphed_callables):
        if not isinstance(module, torch.nn.Module):  # a method's parameters would not be captured as inputs
            raise FedavalUsageError(
                f"--cuda-graphs needs the model's features to be a torch.nn.Module, not a {type(module).__name__}; "
                "run without --cuda-graphs"
            )
        self.module = module
        self._make_graphed = make_graphed  # tests pass a stand-in that runs on the CPU
        self._key: tuple | None = None
        self._graphed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self._tensors: list[torch.Tensor] | None = None  # the module's parameters and buffers (_signature)
        self._registrations = -1
        self.captures = 0
        _count_registrations()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module = self.module
        if not (module.training and torch.is_grad_enabled()):
            return module(x)
        key = self._signature(x)
        if key != self._key or self._graphed is None:
            if not self._full_batch(key):
                return module(x)  # a partial batch: eager, keep the graph of the full one
            self._capture(x)
            self._key = key
        graphed = self._graphed
        assert graphed is not None, "_capture sets it"
        # the replay writes its output into the same memory every step: a copy, so a plugin
        # that keeps a step's features (a prototype sum, a memory) keeps its own
        return graphed(x).clone()

    def _signature(self, x: torch.Tensor) -> tuple:
        """What a graph depends on: the batch's shape, dtype and
        ``requires_grad``, and each of the module's parameters and buffers:
        the object, its address and ``requires_grad``. Called every step: the
        module's tensors are listed again only after torch registered a
        parameter, buffer or submodule anywhere (a replaced tensor). For
        ResNet-18 the check took 151 us a step with the listing, 40 without
        (``timeit`` on the CPU machine, session 28)."""
        if self._tensors is None or self._registrations != _registrations():
            self._registrations = _registrations()
            self._tensors = [*self.module.parameters(), *self.module.buffers()]
        tensors = self._tensors
        return (
            tuple(x.shape),
            x.dtype,
            x.requires_grad,
            tuple(map(id, tensors)),  # a new Parameter on the same memory is not the graph's input
            tuple(t.data_ptr() for t in tensors),
            tuple(t.requires_grad for t in tensors),
        )

    def _full_batch(self, key: tuple) -> bool:
        """Capture at a new batch shape only if it is not smaller than the
        captured one: the epoch's last, partial batch runs eagerly."""
        if self._key is None or key[1:] != self._key[1:]:
            return True
        return key[0][0] >= self._key[0][0] or key[0][1:] != self._key[0][1:]

    def _capture(self, x: torch.Tensor) -> None:
        module = self.module
        hooked = [
            name
            for name, m in module.named_modules()
            if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks
        ]
        if hooked:
            raise FedavalUsageError(
                f"--cuda-graphs cannot capture a feature extractor with module hooks (on {hooked[0] or 'features'}); "
                "run without --cuda-graphs"
            )
        self._graphed = None  # the old graph's memory goes back to the pool before the new one is made
        buffers = [b.clone() for b in module.buffers()]
        rng = _rng_state(x.device)
        sample = x.detach().clone().requires_grad_(x.requires_grad)
        try:
            self._make_graphed(module, (sample,), num_warmup_iters=WARMUP_STEPS, allow_unused_input=True)
            # make_graphed_callables patches module.forward; take the graphed forward and give the
            # module its own back, so that evaluation and plugins calling model.features run eagerly
            self._graphed = module.forward
        finally:  # also when the capture fails: the module as it was
            vars(module).pop("forward", None)
            with torch.no_grad():  # the warm-up steps' BatchNorm updates, undone
                for live, saved in zip(module.buffers(), buffers):
                    live.copy_(saved)
            _set_rng_state(rng, x.device)
        self.captures += 1


_REGISTERED = [0]  # parameters, buffers and submodules torch registered since counting began


def _registrations() -> int:
    return _REGISTERED[0]


def _count_registrations() -> None:
    """Count every registration of a parameter, buffer or submodule in any
    module (``module.weight = Parameter(...)`` included), with torch's global
    registration hooks, added once per process by the first
    :class:`GraphedFeatures` made: a run without ``--cuda-graphs`` is never
    counted."""
    if _REGISTERED[0] > 0:
        return
    _REGISTERED[0] = 1

    def count(module, name, value):
        _REGISTERED[0] += 1

    from torch.nn.modules import module as modules

    modules.register_module_parameter_registration_hook(count)
    modules.register_module_buffer_registration_hook(count)
    modules.register_module_module_registration_hook(count)


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)
