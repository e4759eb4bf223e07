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

``--cuda-graph-scope step`` (:class:`GraphedStep`) captures the whole
training step instead: the forward, the core's cross-entropy, the backward
and the SGD update, one graph per client and batch shape (the full batch and
the epoch's last, smaller one, so no step runs eagerly). With the backbone
alone graphed, fedaval's step on an H200 took 3.7 ms of host time with a
backbone that computes nothing, more than the 2.8 ms of GPU work of a
ResNet-18 step (docs/performance.md, item 3): the host, not the GPU, bounds
it. With the step graphed, what is left of the host's work per step is
Avalanche's loop and callbacks, the graphs' check, two input copies, the
replay and three output copies (the eager classifier, loss, backward and
optimizer kernels, and the launches of the backbone's gradient copies, go
into the graph). A step's plugins must then
act outside it: the run is refused, with a one-line error, when a plugin
implements ``fedaval_classify``, ``fedaval_client_criterion`` or
``fedaval_client_loss``, when a client's Avalanche plugin overrides a
callback between a step's start and its update (unless its class sets
``fedaval_reads_inside_steps``), and with ``--optimizer adam``. Tested on the
CPU through a stand-in capture (the same results as without graphs, for
momentum kept or reset, a learning-rate schedule, plain SGD, offloaded
clients, ``--precision bf16`` and ``--channels-last``, and resumed from a
checkpoint); not yet run on a GPU.
"""

from __future__ import annotations

from operator import attrgetter
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
        self._tensors = ModuleTensors(module)
        self.captures = 0

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
        ``requires_grad``, and each of the module's parameters and buffers
        (:func:`tensor_signature`). Called every step."""
        return (tuple(x.shape), x.dtype, x.requires_grad, tensor_signature(self._tensors()))

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


class ModuleTensors:
    """A module's parameters and buffers, listed again only after torch
    registered a parameter, buffer or submodule anywhere (a replaced tensor):
    the graphs check them every step, and for ResNet-18 the check took 151 us
    a step with the listing, 40 without (``timeit`` on the CPU machine,
    session 28). Call it for the list."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self._tensors: list[torch.Tensor] = []
        self._registrations = -1
        _count_registrations()

    def __call__(self) -> list[torch.Tensor]:
        if self._registrations != _registrations():
            self._registrations = _registrations()
            self._tensors = [*self.module.parameters(), *self.module.buffers()]
        return self._tensors


_REGISTERED = [0]  # parameters, buffers and submodules torch registered since counting began


def _registrations() -> int:
    return _REGISTERED[0]


def _count_registrations() -> None:
    """Count every registration of a parameter, buffer or submodule in any
    module (``module.weight = Parameter(...)`` included), with torch's global
    registration hooks, added once per process by the first
    :class:`ModuleTensors` made (a graph's): a run without ``--cuda-graphs``
    is never counted."""
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


# --- --cuda-graph-scope step: the whole training step as one graph ------------------------------

STEP_HOOKS = ("fedaval_classify", "fedaval_client_criterion", "fedaval_client_loss")
"""The fedaval hooks that act inside a training step; with the step captured only the core's may be."""

STEP_SCOPE_WORDS = ("--cuda-graph-scope step captures the whole training step", "use --cuda-graph-scope features")
"""How the refusals of a plugin acting inside a step begin and end, for the step scope."""

STACKED_WORDS = ("--stack-clients computes each step of a round's clients at once", "run without it")
"""The same for ``--stack-clients`` (:mod:`fedaval.stacked`)."""

MID_STEP_CALLBACKS = ("before_forward", "after_forward", "before_backward", "after_backward", "before_update")
"""Avalanche's callbacks between a step's start and its optimizer update."""

MAX_STEP_GRAPHS = 2
"""Graphs a client keeps, one per batch shape: the full batch and the epoch's last, smaller one."""


def check_scope(config, run) -> None:
    """``--cuda-graph-scope``'s value and what ``step`` needs of the run:
    ``--cuda-graphs``, SGD, and no plugin implementing a hook that acts
    inside a step (:data:`STEP_HOOKS`: a captured step would call it once,
    at the capture, and bake its result in). One-line errors."""
    scope = config.cuda_graph_scope
    if scope == "features":
        return
    if not config.cuda_graphs:
        raise FedavalUsageError(f"--cuda-graph-scope {scope} needs --cuda-graphs (it says what the graphs capture)")
    if config.optimizer != "sgd":
        raise FedavalUsageError(
            f"--cuda-graph-scope step needs --optimizer sgd, not {config.optimizer} (Adam's step count would be "
            "captured as a constant); use --cuda-graph-scope features"
        )
    check_step_hooks(run, *STEP_SCOPE_WORDS)


def check_step_hooks(run, what: str, instead: str) -> None:
    """No plugin but the core implements a hook of :data:`STEP_HOOKS`: for
    the options that compute a client's step as a whole (``what`` says how,
    ``instead`` what to do), a one-line error naming the plugin otherwise."""
    from fedaval.core import CorePlugin

    for hook in STEP_HOOKS:
        for impl in getattr(run.hook, hook).get_hookimpls():
            if not isinstance(impl.plugin, CorePlugin):
                raise FedavalUsageError(f"{what}, and plugin {impl.plugin_name!r} acts inside it ({hook}); {instead}")


def check_step_plugins(config, strategy) -> None:
    """With ``--cuda-graph-scope step`` or ``--stack-clients``, a client's
    Avalanche plugins must leave its steps alone, checked as the run is
    built. Both run Avalanche's callbacks between a step's start and its
    update after the step, in their order: right for plugins that only read
    there (Avalanche's evaluator and its metrics, and any plugin whose class
    sets ``fedaval_reads_inside_steps = True``, as fedaval's ``HookBridge``
    does); another plugin that overrides one of them may change the step, so
    it is refused."""
    if config.cuda_graphs and config.cuda_graph_scope == "step":
        what, instead = STEP_SCOPE_WORDS
    elif config.stack_clients:
        what, instead = STACKED_WORDS
    else:
        return
    from avalanche.core import BaseSGDPlugin
    from avalanche.training.plugins import EvaluationPlugin

    for plugin in strategy.plugins:
        if isinstance(plugin, EvaluationPlugin) or getattr(plugin, "fedaval_reads_inside_steps", False):
            continue
        changed = [cb for cb in MID_STEP_CALLBACKS if getattr(type(plugin), cb) is not getattr(BaseSGDPlugin, cb)]
        if changed:
            raise FedavalUsageError(
                f"{what}, and the Avalanche plugin {type(plugin).__name__} acts inside it ({changed[0]}); {instead}"
            )


def tensor_signature(tensors: list[torch.Tensor]) -> tuple:
    """What a graph captured with ``tensors`` depends on: each one's object,
    address and ``requires_grad`` (a new Parameter on the old memory is not
    the graph's input)."""
    return (
        tuple(map(id, tensors)),
        tuple(map(torch.Tensor.data_ptr, tensors)),  # map over the C methods: a third faster than a generator
        tuple(map(_REQUIRES_GRAD, tensors)),
    )


_REQUIRES_GRAD = attrgetter("requires_grad")


def cuda_capture(step: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
    """``step`` captured as one CUDA graph (not run): its replay and its outputs' static tensors."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph.replay, outputs


class _StepGraph:
    """One captured step: its static inputs, outputs, and the gradients its backward writes."""

    def __init__(self, x, y, replay, outputs, params):
        self.x, self.y, self.replay = x, y, replay
        features, logits, loss, *grads = outputs
        # detached: the same memory, without the capture's autograd graph (a step hands out copies)
        self.features, self.logits, self.loss = features.detach(), logits.detach(), loss.detach()
        self.params, self.grads = params, grads


class GraphedStep:
    """A client's whole training step (forward, the core's loss, backward,
    the SGD update) replayed from one CUDA graph per batch shape
    (``--cuda-graph-scope step``). :meth:`step` does what Avalanche's
    iteration does between ``optimizer.zero_grad()`` and
    ``optimizer_step()``.

    The graph reads and writes the client's parameters, buffers and momentum
    buffers in place, so it is captured again when any of them is replaced,
    when a parameter's ``requires_grad`` changes, or when the optimizer's
    hyperparameters change (a learning-rate schedule: every round). Capturing
    runs :data:`WARMUP_STEPS` forward and backward passes on a side stream
    (no update), whose effect on BatchNorm's statistics, the gradients and
    the device's random stream is undone. The momentum buffers must exist
    at the capture, since the graph updates them in place: a parameter
    without one gets zeros, which the first update turns into its gradient
    exactly as SGD's first step does (``0 * momentum + g = g``; only the sign
    of a zero may differ). For the same reason ``--optimizer-state reset``
    zeroes them in place at a round's start (:meth:`reset_optimizer_state`)
    instead of dropping them."""

    def __init__(self, strategy, capture: Callable = cuda_capture):
        # the strategy is not kept (it holds this object); its plugins were checked as the run was built
        self._capture_step = capture  # tests pass a stand-in that runs on the CPU
        self._graphs: dict[tuple, _StepGraph] = {}
        self._key: tuple | None = None
        self._buffers: list[torch.Tensor] = []  # the momentum buffers the graphs update
        self._tensors = ModuleTensors(strategy.model)
        self.captures = 0
        self.replays = 0

    def step(self, strategy, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One training step of ``strategy`` on ``(x, y)``: the parameters
        updated; returns the step's features, logits and loss (the loss
        before the update, of shape ``[1]`` as Avalanche's), each the
        caller's own copy, detached (the step's backward is done)."""
        if self._signature(strategy) != self._key:
            self._graphs.clear()
        shape = (tuple(x.shape), x.dtype, tuple(y.shape), y.dtype)
        graph = self._graphs.get(shape)
        if graph is None:
            graph = self._capture(strategy, x, y)
            self._keep(shape, graph)
            self._key = self._signature(strategy)  # the capture made the momentum buffers
        graph.x.copy_(x)
        graph.y.copy_(y)
        graph.replay()
        self.replays += 1
        if graph.params and graph.params[0].grad is not graph.grads[0]:
            for p, g in zip(graph.params, graph.grads):
                p.grad = g  # as after an eager step: the step's gradients
        return graph.features.clone(), graph.logits.clone(), graph.loss.clone()

    def reset_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """``--optimizer-state reset`` at a round's start: the optimizer's
        state emptied, except the momentum buffers the graphs update, which
        are zeroed in place (the same first step, see the class)."""
        kept = {id(b) for b in self._buffers}
        for p in list(optimizer.state):
            buffer = optimizer.state[p].get("momentum_buffer")
            if buffer is None or id(buffer) not in kept or len(optimizer.state[p]) > 1:
                del optimizer.state[p]
        if self._buffers:
            torch._foreach_zero_(self._buffers)

    def _signature(self, strategy) -> tuple:
        """What the graphs depend on besides the batch's shape: the model's
        parameters and buffers (:func:`tensor_signature`), the optimizer's
        parameters, momentum buffers and hyperparameters, the model's mode.
        Called every step: about 35 us for ResNet-18 on the CPU machine."""
        model, optimizer = strategy.model, strategy.optimizer
        if self._tensors.module is not model:
            self._tensors = ModuleTensors(model)
        buffers = [s.get("momentum_buffer") for s in optimizer.state.values()]
        groups = optimizer.param_groups
        return (
            tensor_signature(self._tensors()),
            tuple(tuple(map(id, g["params"])) for g in groups),
            tuple(map(id, buffers)),
            tuple(b.data_ptr() if b is not None else 0 for b in buffers),
            tuple(tuple((k, v) for k, v in sorted(g.items()) if k != "params") for g in groups),
            model.training,
        )

    def _keep(self, shape: tuple, graph: _StepGraph) -> None:
        """Keep at most :data:`MAX_STEP_GRAPHS`: the largest batch's graph and the latest other one."""
        if len(self._graphs) >= MAX_STEP_GRAPHS:
            largest = max(self._graphs, key=lambda s: s[0][0])
            for other in [s for s in self._graphs if s != largest]:
                del self._graphs[other]
        self._graphs[shape] = graph

    @staticmethod
    def _forward_loss(strategy, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The strategy's own forward and criterion on ``(x, y)``, as its
        eager iteration computes them: loss = Avalanche's empty loss + the
        criterion."""
        saved = strategy.mbatch
        strategy.mbatch = [x, y, *saved[2:]]
        try:
            logits = strategy.forward()
            strategy.mb_output = logits
            loss = strategy._make_empty_loss() + strategy.criterion()
            return strategy.mb_features, logits, loss
        finally:
            strategy.mbatch = saved

    def _capture(self, strategy, x: torch.Tensor, y: torch.Tensor) -> _StepGraph:
        model, optimizer = strategy.model, strategy.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        saved_buffers = [b.clone() for b in model.buffers()]
        saved_grads = [p.grad for p in params]
        rng = _rng_state(x.device)
        static_x, static_y = x.detach().clone(), y.detach().clone()
        try:
            with _side_stream(x.device):
                for _ in range(WARMUP_STEPS):
                    for p in params:
                        p.grad = None
                    self._forward_loss(strategy, static_x, static_y)[2].backward()
            trained = [p for p in params if p.grad is not None]
            self._buffers = _momentum_buffers(optimizer, trained)
        finally:
            with torch.no_grad():  # the warm-up steps' BatchNorm updates, undone
                for live, saved in zip(model.buffers(), saved_buffers):
                    live.copy_(saved)
            for p, g in zip(params, saved_grads):
                p.grad = g
            _set_rng_state(rng, x.device)

        def step() -> tuple[torch.Tensor, ...]:
            for p in params:
                p.grad = None  # the backward writes each gradient afresh, as after zero_grad()
            features, logits, loss = self._forward_loss(strategy, static_x, static_y)
            loss.backward()
            grads = [p.grad for p in trained]
            optimizer.step()
            return (features, logits, loss, *grads)

        if x.device.type == "cuda":
            torch.cuda.synchronize(x.device)
        replay, outputs = self._capture_step(step)
        _set_rng_state(rng, x.device)
        self.captures += 1
        return _StepGraph(static_x, static_y, replay, outputs, trained)


def _momentum_buffers(optimizer: torch.optim.Optimizer, trained: list[torch.Tensor]) -> list[torch.Tensor]:
    """The momentum buffers of ``trained``'s parameters, zeros made for those without (see GraphedStep)."""
    buffers = []
    for group in optimizer.param_groups:
        if group["momentum"] == 0:
            continue
        held = {id(p) for p in group["params"]}
        for p in trained:
            if id(p) in held:
                state = optimizer.state[p]
                if state.get("momentum_buffer") is None:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                buffers.append(state["momentum_buffer"])
    return buffers


def _side_stream(device: torch.device):
    """The warm-up steps' stream: a side stream on a GPU (as before a capture), none on the CPU."""
    from contextlib import contextmanager, nullcontext

    if device.type != "cuda":
        return nullcontext()

    @contextmanager
    def side():
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            yield
        torch.cuda.current_stream(device).wait_stream(stream)

    return side()
