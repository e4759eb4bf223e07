"""``--stack-clients``: a round's clients trained in lockstep, each step of
all of them one computation (``torch.func.vmap``).

The GPU issue's item 3 names three ways to keep a GPU busy with small
clients; this is the third: "identical clients batched into one computation
with ``torch.func``". A round of 10 ResNet-18 clients at batch 32 launches
ten steps' kernels one after another, each too small to fill the GPU; here
their ten steps are one step over 10 x 32 images, each client's images
going through its own parameters: the host launches one step's kernels for
the round's clients, not one per client (docs/performance.md, item 3).

How a round runs (:class:`Lockstep`, used by the in-process backend):

* each client's round (receive, local training, upload:
  :func:`fedaval.backends.local.client_round`) runs in a thread of its
  own, but never two at once: the threads take turns in the round's client
  order. A client runs until its next training step (Avalanche's loop, its
  callbacks and its minibatch, all its own), leaves that step's minibatch,
  and hands the turn to the next client. When every client still training
  waits at a step, the last one computes all their steps at once and the
  turn goes back to the first;
* the clients' steps are grouped by what must match for one computation
  (the batch's shape, the model's parameters and buffers, the optimizer's
  hyperparameters); within a group each client's parameters, BatchNorm
  statistics and momentum buffers are stacked, the forward runs once under
  ``torch.func.vmap`` over ``functional_call`` (each client on its own
  minibatch and parameters), each client's loss is its own strategy's
  criterion, the backward runs once on their sum (so each client's gradient
  is its own), and PyTorch's SGD (``torch.optim.sgd.sgd``, elementwise)
  updates the stacked tensors. Each client's own tensors are views of its
  rows of the stack (:class:`_Stack`), so a step copies nothing in or out;
  a client's tensors are copied out again when its training ends, before
  its upload, with its last step's gradients. The in-process backend keeps
  the stacks from round to round (:class:`Stacks`): the same clients
  stepping together again have their values copied into the same memory.
  A client with fewer minibatches finishes earlier; an epoch's smaller last
  batches step in groups of their own shape (clients of unequal data), each
  a stack of its own;
* each client's random streams are its own, as in sequential rounds:
  they are swapped out while it waits at a step and back in when it goes
  on, so every draw (data order, augmentation, a plugin's sampling) comes
  from the client's stream in the order it would one client after another.
  The stacked step itself draws nothing: a model with random operations in
  training (dropout) is a one-line error (vmap's ``randomness="error"``).

What is the same as clients trained one after another: each client's data
order, augmentation and random draws, its loss, gradient, SGD update and
BatchNorm statistics, up to the last bits of floating point. What is not
bit for bit: vmap runs a batched convolution as one grouped convolution,
whose sums run in another order, so a parameter differs from the sequential
one's by about 1e-6 after a step (tests/test_stacked.py measures it), and
with ``--deterministic`` a run's results.json equals another stacked run's,
not a sequential run's. A client's ``seconds`` (the host's time for its
round) is its own turns plus its share of the stacked steps.

With ``--cuda-graphs --cuda-graph-scope step`` a stack's whole step
(forward, losses, backward, update) is captured as one CUDA graph per batch
shape and learning rate, and replayed: one launch for the round's clients'
step. Capturing happens once per stack, shape and learning rate (every
round with a schedule), so it pays where the same clients step together
round after round with equal data (the GPU issue's item 3); clients of
unequal data step in changing groups and capture again and again.

What it needs, each refused with a one-line error otherwise: the in-process
backend; SGD (the update is PyTorch's SGD on stacked tensors); no plugin
implementing a hook that acts inside a step (``fedaval_classify``,
``fedaval_client_criterion``, ``fedaval_client_loss``: the step's forward
and loss are the core's) and no Avalanche plugin overriding a callback
inside a step (as ``--cuda-graph-scope step``,
:func:`fedaval.cuda_graphs.check_step_plugins`); neither ``--compile`` nor
``--client-streams``; with ``--cuda-graphs``, ``--cuda-graph-scope step``.
Plugins' other hooks (receive, upload, Avalanche's callbacks outside a
step) run in each client's turn, so their calls for different clients
interleave within a round: a plugin must keep a client's state on the
client (as fedaval's plugins do), not in a variable shared by all of them.
A parameter's ``.grad`` between a client's steps is the stack's (set on the
client when its training ends), and a client's momentum buffers are its
rows of the stack from the group's first step: a plugin that replaces
them within a round is seen only if it clears the optimizer's state.

Not yet run on a GPU: whether one vmapped step of 10 clients (a grouped
convolution per layer) keeps the GPU busier than 10 steps of one is the
GPU session's measurement (``benchmarks/round_throughput.py
--stack-clients off,on``; the plain loops' ceiling ``gpu_ceilings.py
--stacked 10``). On this CPU it is not faster (docs/performance.md).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fedaval.cuda_graphs import _REQUIRES_GRAD, MAX_STEP_GRAPHS  # a stack keeps as many as a client does
from fedaval.errors import FedavalUsageError

if TYPE_CHECKING:
    from fedaval.config import RunConfig
    from fedaval.run import Run

_active: Lockstep | None = None
"""The round's lockstep while the in-process backend runs its clients (:func:`active`)."""


def check(config: RunConfig, run: Run) -> None:
    """What ``--stack-clients`` needs of the run (see the module): one-line errors."""
    if not config.stack_clients:
        return
    config.needs_local_backend("--stack-clients")
    if config.optimizer != "sgd":
        raise FedavalUsageError(
            f"--stack-clients needs --optimizer sgd, not {config.optimizer} (its update is PyTorch's SGD on the "
            "stacked parameters); run without --stack-clients"
        )
    if config.cuda_graphs and config.cuda_graph_scope != "step":
        raise FedavalUsageError(
            "--stack-clients with --cuda-graphs captures the whole stacked step (forward, backward and update); "
            "give --cuda-graph-scope step"
        )
    for option, used in (
        (f"--compile {config.compile}", config.compile != "off"),
        (f"--client-streams {config.client_streams}", config.client_streams != 1),
    ):
        if used:
            raise FedavalUsageError(f"--stack-clients does not combine with {option}; run without one of them")
    from fedaval.cuda_graphs import STACKED_WORDS, check_step_hooks

    check_step_hooks(run, *STACKED_WORDS)


def active() -> Lockstep:
    """The lockstep of the round being trained (a client trains only inside one with ``--stack-clients``)."""
    if _active is None:
        raise RuntimeError("--stack-clients: a client trains outside the in-process backend's round")
    return _active


class _Abort(BaseException):
    """Raised in a client's thread when the round stopped (another thread's error, an interrupt)."""


class Lockstep:
    """A round's clients taking turns, their training steps computed together
    (see the module). :meth:`run` runs the clients' rounds; each client's
    strategy calls :meth:`step` for each of its training steps."""

    def __init__(self, device: torch.device, stacks: Stacks | None = None, graphs: bool = False):
        from fedaval.random_streams import current_streams

        self.device = device
        self.graphs = graphs  # --cuda-graphs: each stack's step replayed from a CUDA graph
        self.stacks = Stacks() if stacks is None else stacks
        if device.type == "cuda":
            self._cuda_index = torch.cuda.current_device() if device.index is None else device.index
        self.outside = current_streams(device)  # the global streams whenever no client runs
        self.seconds: list[float] = []
        self._lock = threading.RLock()  # guards the turns; each thread waits on a condition of its own:
        self._wake: list[threading.Condition] = []  # waking all at each turn cost ~0.3 ms a client's step
        self._turn: int | None = 0
        self._live: list[int] = []
        self._waiting: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._streams: dict[int, dict[str, Any]] = {}
        self._outcomes: dict[int, Any] = {}
        self._slots: dict[int, int] = {}  # thread ident -> slot
        self._structures: dict[Any, tuple] = {}  # strategy -> (its model's structure, its parameters)
        self._members: dict[Any, _Stack] = {}  # strategy -> the stack its tensors are views of
        self._since = 0.0
        self._error: BaseException | None = None

    def run(self, rounds: list[Callable[[], Any]]) -> list[Any]:
        """Each of ``rounds`` (a client's round) in a thread of its own, one
        at a time in turn; their results in order. An error that is not the
        client's own (a misused plugin, an interrupt) stops every thread and
        is raised here."""
        global _active
        count = len(rounds)
        self.seconds = [0.0] * count
        self._live = list(range(count))
        self._wake = [threading.Condition(self._lock) for _ in range(count)]
        results: list[Any] = [None] * count
        threads = [
            threading.Thread(target=self._client, args=(slot, work, results), name=f"fedaval-client-{slot}")
            for slot, work in enumerate(rounds)
        ]
        _active = self
        self._since = time.perf_counter()
        try:
            for thread in threads:
                thread.start()
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.1)  # a timeout, so that Ctrl-C reaches this thread
        except BaseException as exc:
            self._stop(exc)
            for thread in threads:
                thread.join()
            raise
        finally:
            _active = None
            self._release_all()  # clients that failed mid-training
        if self._error is not None:
            raise self._error
        return results

    def step(self, strategy, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``strategy``'s training step on ``(x, y)``, computed with the other
        waiting clients' steps: the parameters updated; returns the step's
        features, logits and loss (of shape ``[1]``, as Avalanche's), detached."""
        from fedaval.random_streams import swap_streams

        slot = self._slots[threading.get_ident()]
        with self._lock:
            self._waiting[slot] = (strategy, x, y)
            self._streams[slot] = swap_streams(self.outside, self.device)
            self._pass_turn(slot)
            self._wait_turn(slot)
            swap_streams(self._streams.pop(slot), self.device)
            outcome = self._outcomes.pop(slot)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    # --- turns --------------------------------------------------------------
    def _client(self, slot: int, work: Callable[[], Any], results: list[Any]) -> None:
        self._slots[threading.get_ident()] = slot
        if self.device.type == "cuda":  # a new thread's current device is the first GPU, not the caller's
            torch.cuda.set_device(self._cuda_index)
        try:
            with self._lock:
                self._wait_turn(slot)
            results[slot] = work()
        except _Abort:
            pass
        except BaseException as exc:  # not the client's own failure (client_round reports those)
            self._stop(exc)
        finally:
            with self._lock:
                if slot in self._live:
                    self._live.remove(slot)
                    if self._error is None:
                        self._pass_turn(slot)

    def _wait_turn(self, slot: int) -> None:
        while self._turn != slot and self._error is None:
            self._wake[slot].wait()
        if self._error is not None:
            raise _Abort
        self._since = time.perf_counter()

    def _pass_turn(self, slot: int) -> None:
        """The thread of ``slot`` stops running (at a step, or done): the turn
        goes to the next client in order; after the last one, the waiting
        clients' steps are computed and the turn goes back to the first."""
        now = time.perf_counter()
        self.seconds[slot] += now - self._since
        later = [s for s in self._live if s > slot]
        if later:
            self._turn = later[0]
        else:
            if self._waiting:
                self._compute()
            self._turn = self._live[0] if self._live else None
        if self._turn is not None:
            self._wake[self._turn].notify()

    def _stop(self, exc: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = exc
            for wake in self._wake:
                wake.notify()

    # --- the stacked step ---------------------------------------------------
    def release(self, strategy) -> None:
        """``strategy``'s client has finished training: its tensors become its
        own again (copies of its rows of the stack), and its parameters get
        its last step's gradients, as after an eager step."""
        stack = self._members.pop(strategy, None)
        if stack is not None:
            stack.release(strategy)

    def _release_all(self) -> None:
        for strategy in list(self._members):
            self.release(strategy)

    def _compute(self) -> None:
        """Every waiting client's step, one stacked computation per group."""
        groups: dict[tuple, list[int]] = {}
        for slot, (strategy, x, y) in self._waiting.items():
            groups.setdefault(self._key(strategy, x, y), []).append(slot)
        for key, slots in groups.items():
            start = time.perf_counter()
            entries = [self._waiting[s] for s in slots]
            outputs: list[Any]
            try:
                outputs = self._stack(tuple(slots), [entry[0] for entry in entries]).step(entries, key)
            except FedavalUsageError as exc:
                self._stop(exc)  # the same in every round: stops the run
                return
            except Exception as exc:  # noqa: BLE001 - each client of the group failed this step
                outputs = [exc] * len(slots)
            share = (time.perf_counter() - start) / len(slots)
            for slot, output in zip(slots, outputs):
                self._outcomes[slot] = output
                self.seconds[slot] += share
        self._waiting.clear()
        self._since = time.perf_counter()

    def _key(self, strategy, x: torch.Tensor, y: torch.Tensor) -> tuple:
        """What clients stepped as one computation must share: the batch's
        shape, the model's structure (made once a round: a model changes its
        parameters between rounds, not within one), which parameters train,
        the optimizer's hyperparameters, the model's mode."""
        model, optimizer = strategy.model, strategy.optimizer
        known = self._structures.get(strategy)
        if known is None:
            known = self._structures[strategy] = (_structure(model), list(model.parameters()))
        structure, params = known
        return (
            tuple(x.shape),
            x.dtype,
            tuple(y.shape),
            y.dtype,
            structure,
            tuple(map(_REQUIRES_GRAD, params)),
            _hyperparameters(optimizer),
            model.training,
        )

    def _stack(self, slots: tuple[int, ...], strategies: list) -> _Stack:
        """The stack of these clients (:class:`Stacks`), their current
        values in it and their tensors its views."""
        structure = self._structures[strategies[0]][0]
        stack = self.stacks.get(tuple(s.client.id for s in strategies), structure, strategies)
        if not stack.valid(strategies, [self._structures[s][1] for s in strategies]):
            stack.adopt(strategies)
        for strategy in strategies:
            self._members[strategy] = stack
        stack.graphed = self.graphs
        return stack


MAX_STACKS = 4
"""Stacks the in-process backend keeps (:class:`Stacks`)."""


class Stacks:
    """The stacks of a run's client groups, kept by the in-process backend
    from round to round, so that the same clients stepping together again
    (every round in item 3's setting) reuse the stack's memory and its CUDA
    graphs: their values are copied in (:meth:`_Stack.adopt`), nothing is
    allocated or captured again. At most :data:`MAX_STACKS`, the least
    recently used forgotten first (sampled clients make a new group nearly
    every round; an epoch's last, smaller batches may step in groups of
    their own)."""

    def __init__(self):
        self._kept: dict[tuple, _Stack] = {}

    def get(self, ids: tuple[int, ...], structure: tuple, strategies: list) -> _Stack:
        key = (ids, structure)
        stack = self._kept.pop(key, None)
        if stack is None:
            stack = _Stack(strategies)
        self._kept[key] = stack  # the most recently used last
        while len(self._kept) > MAX_STACKS:
            self._kept.pop(next(iter(self._kept)))
        return stack


def _hyperparameters(optimizer: torch.optim.Optimizer) -> tuple:
    """What SGD's update depends on, per parameter group (a scheduler may change the learning rate between steps)."""
    return tuple(
        (g["lr"], g["momentum"], g["weight_decay"], g["dampening"], g["nesterov"], g["maximize"])
        for g in optimizer.param_groups
    )


def _structure(model: torch.nn.Module) -> tuple:
    return (
        type(model),
        tuple((name, tuple(p.shape), p.dtype) for name, p in model.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()),
    )


class _Split(torch.nn.Module):
    """A model's features and logits, as the strategy's forward computes them
    when no plugin implements ``fedaval_classify`` (the run checked it)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model: Any = self.model
        features = model.features(x)
        return features, model.classifier(features)


class _Stack:
    """Clients' parameters, buffers and momentum buffers stacked along a
    first dimension, one row per client, each client's own tensors views of
    its rows (:meth:`adopt`): a stacked SGD step updates every client's
    tensors in place, with no copy in or out. The stack is valid while every
    client tensor is still its view (:meth:`valid`); a client leaves it with
    :meth:`release`, which copies its tensors out; the stack's memory stays,
    for the same clients to be adopted again.

    Momentum: a row whose client has no momentum buffer gets zeros, and the
    client's buffer becomes that row. SGD's first step from zeros, ``0 *
    momentum + g``, is the gradient, as its first step from no buffer
    (fedaval's dampening is 0; only the sign of a zero may differ). Before
    the first client has one, the stack holds none and the first step makes
    them as SGD does.

    With ``graphed`` (``--cuda-graphs``) the whole step is replayed from one
    CUDA graph per batch shape (at most :data:`MAX_STEP_GRAPHS`), captured
    as :class:`fedaval.cuda_graphs.GraphedStep` captures a client's: warm-up
    forward and backward passes whose effect is undone, the momentum
    buffers made first (the graph updates them in place), and the stack's
    values put back after the capture."""

    def __init__(self, strategies: list):
        models = [s.model for s in strategies]
        self.param_keys = [f"model.{n}" for n, _ in models[0].named_parameters()]
        self.buffer_keys = [f"model.{n}" for n, _ in models[0].named_buffers()]
        with torch.no_grad():  # stacked as the clients' tensors are laid out (channels-last weights: rows in NHWC)
            self.params = [torch.stack(rows) for rows in zip(*(m.parameters() for m in models))]
            self.buffers = [torch.stack(rows) for rows in zip(*(m.buffers() for m in models))]
        self.momenta: list[torch.Tensor | None] = [None] * len(self.params)
        self.graphed = False
        self._graphs: dict[tuple, _StackGraph] = {}
        self.strategies: list = []
        self._tensors: list[torch.Tensor] = []
        self._pointers: tuple = ()
        self.adopt(strategies)

    # --- the clients' tensors as views ------------------------------------------
    def adopt(self, strategies: list) -> None:
        """The clients' current values copied into the stack and their
        tensors made views of its rows (their momentum buffers too: zeros
        where a client has none, when the stack holds momentum buffers)."""
        self.strategies = list(strategies)
        self.client_params = [list(s.model.parameters()) for s in strategies]
        self.client_buffers = [list(s.model.buffers()) for s in strategies]
        self._split = _Split(strategies[0].model)
        self._index = {id(p): i for i, p in enumerate(self.client_params[0])}
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        zeros: list[torch.Tensor] = []
        for k in range(len(strategies)):
            rows += [stacked[k] for stacked in (*self.params, *self.buffers)]
            values += [*self.client_params[k], *self.client_buffers[k]]
        for i in range(len(self.params)):
            held = [self._momentum_of(k, i) for k in range(len(strategies))]
            if self.momenta[i] is None and any(b is not None for b in held):
                self.momenta[i] = torch.zeros_like(self.params[i])
                self._graphs.clear()  # captured without this buffer
            momenta = self.momenta[i]
            if momenta is not None:
                for k, b in enumerate(held):
                    if b is None:
                        zeros.append(momenta[k])
                    else:
                        rows.append(momenta[k])
                        values.append(b)
        with torch.no_grad():
            # a client still a view of this stack's row is there already (copying a tensor onto itself
            # in one foreach call is not allowed)
            pairs = [(row, value) for row, value in zip(rows, values) if row.data_ptr() != value.data_ptr()]
            if pairs:
                torch._foreach_copy_([row for row, _ in pairs], [value for _, value in pairs])
            if zeros:
                torch._foreach_zero_(zeros)
            for k in range(len(strategies)):
                for p, stacked in zip(self.client_params[k], self.params):
                    p.data = stacked[k]
                for b, stacked in zip(self.client_buffers[k], self.buffers):
                    b.data = stacked[k]
        for i, momenta in enumerate(self.momenta):
            if momenta is not None:
                self._point_momenta(i, momenta)
        self._tensors = [t for k in range(len(strategies)) for t in (*self.client_params[k], *self.client_buffers[k])]
        self._pointers = self.pointers()

    def _momentum_of(self, k: int, i: int) -> torch.Tensor | None:
        state = self.strategies[k].optimizer.state.get(self.client_params[k][i])
        return None if state is None else state.get("momentum_buffer")

    def _point_momenta(self, i: int, stacked: torch.Tensor) -> None:
        for k, strategy in enumerate(self.strategies):
            strategy.optimizer.state[self.client_params[k][i]]["momentum_buffer"] = stacked[k]

    def pointers(self) -> tuple:
        """Where every client tensor's memory is (the stack's rows while it
        is valid), and how many parameters each client's optimizer holds
        state for (a state cleared drops the momentum rows). Each step:
        about 0.1 ms for 10 clients of 62 parameter tensors on the CPU."""
        return (
            tuple(map(torch.Tensor.data_ptr, self._tensors)),
            tuple(len(s.optimizer.state) for s in self.strategies),
        )

    def valid(self, strategies: list, params: list[list[torch.Tensor]]) -> bool:
        """Whether ``strategies``, with these parameters, are the stack's
        clients and their tensors still its rows' views."""
        if len(strategies) != len(self.strategies) or any(a is not b for a, b in zip(strategies, self.strategies)):
            return False
        for mine, known in zip(params, self.client_params):  # a client's new parameter objects
            if len(mine) != len(known) or any(a is not b for a, b in zip(mine, known)):
                return False
        return self.pointers() == self._pointers

    def release(self, strategy) -> None:
        """``strategy``'s tensors copied out of the stack (which is then no
        longer valid for it), its parameters given their last step's gradients."""
        k = next(k for k, s in enumerate(self.strategies) if s is strategy)
        state = strategy.optimizer.state
        with torch.no_grad():
            for i, (p, stacked) in enumerate(zip(self.client_params[k], self.params)):
                p.data = p.data.clone()
                if stacked.grad is not None:
                    p.grad = stacked.grad[k].clone()
                momentum = self._momentum_of(k, i)
                if momentum is not None:
                    state[p]["momentum_buffer"] = momentum.clone()
            for b in self.client_buffers[k]:
                b.data = b.data.clone()

    # --- the step ---------------------------------------------------------------
    def step(self, entries: list[tuple[Any, torch.Tensor, torch.Tensor]], key: tuple) -> list[tuple]:
        """One SGD step of each client on its ``(x, y)`` (in the stack's
        order): see the module. ``key``: the group's (:meth:`Lockstep._key`),
        what a graph of the step depends on besides the stack. Returns each
        client's ``(features, logits, loss)``, detached."""
        flags = tuple(map(_REQUIRES_GRAD, self.client_params[0]))
        for stacked, flag in zip(self.params, flags):
            if stacked.requires_grad != flag:
                stacked.requires_grad_(flag)
        if not self.graphed:
            for stacked in self.params:
                stacked.grad = None  # as zero_grad(set_to_none=True)
            xs, ys = torch.stack([e[1] for e in entries]), torch.stack([e[2] for e in entries])
            features, logits, losses = self._forward(xs, ys)
            losses.sum().backward()
            self._update()
            features, logits, losses = features.detach(), logits.detach(), losses.detach()
        else:
            features, logits, losses = self._replay(entries, key)
        return [(features[k], logits[k], losses[k : k + 1]) for k in range(len(entries))]

    def _forward(self, xs: torch.Tensor, ys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every client's features and logits (one vmapped forward through
        its own rows) and its loss (its own strategy's: Avalanche's empty
        loss plus the criterion, on its rows of ``xs`` and ``ys``)."""
        from torch.func import functional_call, vmap

        strategies, split = self.strategies, self._split

        def one(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return functional_call(split, (p, b), (x,))

        params, buffers = dict(zip(self.param_keys, self.params)), dict(zip(self.buffer_keys, self.buffers))
        try:
            with strategies[0]._precision():
                features, logits = vmap(one, randomness="error")(params, buffers, xs)
        except RuntimeError as exc:
            if "randomness" not in str(exc):
                raise
            raise FedavalUsageError(
                f"--stack-clients: the model {type(strategies[0].model).__name__} draws random numbers in "
                "training (dropout), which one computation for all clients cannot draw from each client's "
                "stream; run without it"
            ) from None
        losses = []
        for k, strategy in enumerate(strategies):
            saved = strategy.mbatch
            strategy.mbatch = [xs[k], ys[k], *saved[2:]]  # the criterion reads the step's labels (mb_y)
            strategy.mb_output = logits[k]
            try:
                losses.append(strategy._make_empty_loss() + strategy.criterion())
            finally:
                strategy.mbatch = saved
        return features, logits, torch.cat(losses)

    def _update(self) -> None:
        """PyTorch's SGD step (``torch.optim.sgd.sgd``), per parameter group
        of the first client's optimizer (every client's has the same
        hyperparameters: the group key), on the stacked parameters and
        momentum buffers: elementwise, so each client's own update."""
        from torch.optim.sgd import sgd

        for group in self.strategies[0].optimizer.param_groups:
            rows = [self._index[id(p)] for p in group["params"]]
            rows = [i for i in rows if self.params[i].grad is not None]
            if not rows:
                continue
            momenta = [self.momenta[i] for i in rows]
            with torch.no_grad():
                sgd(
                    [self.params[i] for i in rows],
                    [self.params[i].grad for i in rows],  # type: ignore[misc]  # not None: filtered above
                    momenta,
                    weight_decay=group["weight_decay"],
                    momentum=group["momentum"],
                    lr=group["lr"],
                    dampening=group["dampening"],
                    nesterov=group["nesterov"],
                    maximize=group["maximize"],
                )
            if group["momentum"] == 0:
                continue
            for i, stacked in zip(rows, momenta):
                if self.momenta[i] is None and stacked is not None:  # made by this first step
                    self.momenta[i] = stacked
                    self._point_momenta(i, stacked)
                    self._pointers = self.pointers()

    # --- the step as one CUDA graph (--cuda-graphs) -----------------------------------
    def _replay(self, entries: list, key: tuple) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(entries)
            if len(self._graphs) >= MAX_STEP_GRAPHS:
                largest = max(self._graphs, key=lambda k: k[0][0])
                self._graphs = {largest: self._graphs[largest]}
            self._graphs[key] = graph
        torch.stack([e[1] for e in entries], out=graph.xs)
        torch.stack([e[2] for e in entries], out=graph.ys)
        graph.replay()
        for stacked, grad in zip(graph.trained, graph.grads):
            stacked.grad = grad  # the step's gradients, as after an eager step
        # the caller's own copies: the next replay writes the static outputs again
        return graph.features.clone(), graph.logits.clone(), graph.losses.clone()

    def _capture(self, entries: list) -> _StackGraph:
        from fedaval.cuda_graphs import WARMUP_STEPS, _rng_state, _set_rng_state, _side_stream

        device = self.params[0].device
        for group in self.strategies[0].optimizer.param_groups:  # the graph updates them in place
            if group["momentum"] != 0:
                for p in group["params"]:
                    i = self._index[id(p)]
                    if self.momenta[i] is None:
                        made = self.momenta[i] = torch.zeros_like(self.params[i])
                        self._point_momenta(i, made)
        self._pointers = self.pointers()
        xs, ys = torch.stack([e[1] for e in entries]), torch.stack([e[2] for e in entries])
        kept = [*self.params, *self.buffers, *(m for m in self.momenta if m is not None)]
        with torch.no_grad():
            saved = [t.detach().clone() for t in kept]
        rng = _rng_state(device)

        def step() -> tuple[torch.Tensor, ...]:
            for stacked in self.params:
                stacked.grad = None  # the backward writes each gradient afresh, as after zero_grad()
            features, logits, losses = self._forward(xs, ys)
            losses.sum().backward()
            grads = [t.grad for t in self.params if t.grad is not None]
            self._update()
            return (features, logits, losses, *grads)

        try:
            with _side_stream(device):
                for _ in range(WARMUP_STEPS):
                    for stacked in self.params:
                        stacked.grad = None
                    self._forward(xs, ys)[2].sum().backward()
            trained = [t for t in self.params if t.grad is not None]
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            replay, outputs = capture(step)
        except FedavalUsageError:
            raise
        except Exception as exc:  # noqa: BLE001 - a capture that fails fails the same in every round
            raise FedavalUsageError(
                f"--stack-clients with --cuda-graphs: capturing the stacked step failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); run without --cuda-graphs"
            ) from None
        finally:
            with torch.no_grad():  # the warm-up's BatchNorm updates, and a stand-in capture's step, undone
                for t, value in zip(kept, saved):
                    t.copy_(value)
            _set_rng_state(rng, device)
        features, logits, losses, *grads = outputs
        return _StackGraph(xs, ys, replay, features, logits, losses, trained, grads)


class _StackGraph:
    """One captured stacked step: its static inputs and outputs, the stacked
    parameters it trains and the gradients its backward writes for them."""

    def __init__(self, xs, ys, replay, features, logits, losses, trained, grads):
        self.xs, self.ys, self.replay = xs, ys, replay
        self.features, self.logits, self.losses = features.detach(), logits.detach(), losses.detach()
        self.trained, self.grads = trained, grads


def capture(step: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[Callable[[], None], tuple[torch.Tensor, ...]]:
    """``step`` captured as one CUDA graph (:func:`fedaval.cuda_graphs.cuda_capture`); tests stand in for it."""
    from fedaval.cuda_graphs import cuda_capture

    return cuda_capture(step)
