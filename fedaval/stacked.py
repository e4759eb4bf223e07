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
  updates the stacked tensors, which are then copied back. A client with
  fewer minibatches finishes earlier; its epoch's smaller last batch is
  stepped in a group of its own shape;
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

What it needs, each refused with a one-line error otherwise: the in-process
backend; SGD (the update is PyTorch's SGD on stacked tensors); no plugin
implementing a hook that acts inside a step (``fedaval_classify``,
``fedaval_client_criterion``, ``fedaval_client_loss``: the step's forward
and loss are the core's) and no Avalanche plugin overriding a callback
inside a step (as ``--cuda-graph-scope step``,
:func:`fedaval.cuda_graphs.check_step_plugins`); and, in this first
version, neither ``--cuda-graphs``, ``--compile`` nor ``--client-streams``
(the stacked step runs eagerly). Plugins' other hooks (receive, upload,
Avalanche's callbacks outside a step) run in each client's turn, so their
calls for different clients interleave within a round: a plugin must keep
a client's state on the client (as fedaval's plugins do), not in a
variable shared by all of them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fedaval.errors import FedavalUsageError

if TYPE_CHECKING:
    from fedaval.config import RunConfig
    from fedaval.run import Run

STACKED_WORDS = ("--stack-clients computes each step of a round's clients at once", "run without it")
"""How the refusals of a plugin acting inside a step begin and end (:func:`fedaval.cuda_graphs.check_step_hooks`)."""

_active: Lockstep | None = None
"""The round's lockstep while the in-process backend runs its clients (:func:`active`)."""


def check(config: RunConfig, run: Run) -> None:
    """What ``--stack-clients`` needs of the run (see the module): one-line errors."""
    if not config.stack_clients:
        return
    if config.backend != "local":
        raise FedavalUsageError(
            f"--stack-clients needs --backend local (the clients of one process), not --backend {config.backend}"
        )
    if config.optimizer != "sgd":
        raise FedavalUsageError(
            f"--stack-clients needs --optimizer sgd, not {config.optimizer} (its update is PyTorch's SGD on the "
            "stacked parameters); run without --stack-clients"
        )
    for option, used in (
        ("--cuda-graphs", config.cuda_graphs),
        (f"--compile {config.compile}", config.compile != "off"),
        (f"--client-streams {config.client_streams}", config.client_streams != 1),
    ):
        if used:
            raise FedavalUsageError(
                f"--stack-clients runs its stacked steps eagerly; it does not combine with {option}"
            )
    from fedaval.cuda_graphs import check_step_hooks

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

    def __init__(self, device: torch.device):
        from fedaval.client import current_streams

        self.device = device
        self.outside = current_streams(device)  # the global streams whenever no client runs
        self.seconds: list[float] = []
        self.steps = 0  # stacked computations made
        self._cond = threading.Condition()
        self._turn: int | None = 0
        self._live: list[int] = []
        self._waiting: dict[int, tuple[Any, torch.Tensor, torch.Tensor]] = {}
        self._streams: dict[int, dict[str, Any]] = {}
        self._outcomes: dict[int, Any] = {}
        self._slots: dict[int, int] = {}  # thread ident -> slot
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
        if self._error is not None:
            raise self._error
        return results

    def step(self, strategy, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``strategy``'s training step on ``(x, y)``, computed with the other
        waiting clients' steps: the parameters updated; returns the step's
        features, logits and loss (of shape ``[1]``, as Avalanche's), detached."""
        from fedaval.client import swap_streams

        slot = self._slots[threading.get_ident()]
        with self._cond:
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
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread's current device is the first GPU
        try:
            with self._cond:
                self._wait_turn(slot)
            results[slot] = work()
        except _Abort:
            pass
        except BaseException as exc:  # not the client's own failure (client_round reports those)
            self._stop(exc)
        finally:
            with self._cond:
                if slot in self._live:
                    self._live.remove(slot)
                    if self._error is None:
                        self._pass_turn(slot)

    def _wait_turn(self, slot: int) -> None:
        while self._turn != slot and self._error is None:
            self._cond.wait()
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
        self._cond.notify_all()

    def _stop(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    # --- the stacked step ---------------------------------------------------
    def _compute(self) -> None:
        """Every waiting client's step, one stacked computation per group."""
        groups: dict[tuple, list[int]] = {}
        for slot, (strategy, x, y) in self._waiting.items():
            groups.setdefault(_group_key(strategy, x, y), []).append(slot)
        for slots in groups.values():
            start = time.perf_counter()
            outputs: list[Any]
            try:
                outputs = stacked_step([self._waiting[s] for s in slots])
            except FedavalUsageError as exc:
                self._error = exc  # the same in every round: stops the run
                return
            except Exception as exc:  # noqa: BLE001 - each client of the group failed this step
                outputs = [exc] * len(slots)
            self.steps += 1
            share = (time.perf_counter() - start) / len(slots)
            for slot, output in zip(slots, outputs):
                self._outcomes[slot] = output
                self.seconds[slot] += share
        self._waiting.clear()
        self._since = time.perf_counter()


def _group_key(strategy, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """What clients stepped as one computation must share."""
    model, optimizer = strategy.model, strategy.optimizer
    return (
        tuple(x.shape),
        x.dtype,
        tuple(y.shape),
        y.dtype,
        type(model),
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in model.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in model.named_buffers()),
        tuple(tuple((k, v) for k, v in sorted(g.items()) if k != "params") for g in optimizer.param_groups),
        tuple(len(g["params"]) for g in optimizer.param_groups),
        model.training,
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


def stacked_step(entries: list[tuple[Any, torch.Tensor, torch.Tensor]]) -> list[tuple]:
    """One SGD step of each ``(strategy, x, y)`` of ``entries`` (clients with
    the same :func:`_group_key`), computed as one: see the module. Returns
    each client's ``(features, logits, loss)``, detached."""
    from torch.func import functional_call, vmap
    from torch.optim.sgd import sgd

    strategies = [entry[0] for entry in entries]
    first = strategies[0]
    models = [s.model for s in strategies]
    named = [dict(m.named_parameters()) for m in models]
    buffers_of = [dict(m.named_buffers()) for m in models]
    with torch.no_grad():
        params = {f"model.{n}": torch.stack([p[n] for p in named]) for n in named[0]}
        buffers = {f"model.{n}": torch.stack([b[n] for b in buffers_of]) for n in buffers_of[0]}
    trained = [n for n, p in named[0].items() if p.requires_grad]
    for n in trained:
        params[f"model.{n}"].requires_grad_(True)
    split = _Split(first.model)

    def one(p: dict, b: dict, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return functional_call(split, (p, b), (x,))

    xs = torch.stack([entry[1] for entry in entries])
    try:
        with first._precision():
            features, logits = vmap(one, randomness="error")(params, buffers, xs)
    except RuntimeError as exc:
        if "randomness" not in str(exc):
            raise
        raise FedavalUsageError(
            f"--stack-clients: the model {type(first.model).__name__} draws random numbers in training "
            "(dropout), which one computation for all clients cannot draw from each client's stream; run without it"
        ) from None
    losses = []
    for k, strategy in enumerate(strategies):
        strategy.mb_output = logits[k]
        losses.append(strategy._make_empty_loss() + strategy.criterion())
    torch.stack(losses).sum().backward()
    _sgd_update(strategies, named, params, trained, sgd)
    with torch.no_grad():
        copies_to = [named[k][n] for n in trained for k in range(len(models))]
        copies_from = [t for n in trained for t in params[f"model.{n}"].detach().unbind(0)]
        for n in buffers_of[0]:
            copies_to += [b[n] for b in buffers_of]
            copies_from += list(buffers[f"model.{n}"].unbind(0))
        torch._foreach_copy_(copies_to, copies_from)
    for n in trained:
        stacked_grad = params[f"model.{n}"].grad
        if stacked_grad is None:  # not in the loss: no gradient, as after an eager step
            continue
        for k, grad in enumerate(stacked_grad.unbind(0)):
            named[k][n].grad = grad  # as after an eager step; cloned when the client's training ends
    return [(features[k].detach(), logits[k].detach(), losses[k].detach()) for k in range(len(models))]


def _sgd_update(strategies, named, params, trained, sgd) -> None:
    """PyTorch's SGD step, per parameter group, on the stacked parameters and
    momentum buffers (elementwise: each client's own update); the clients'
    momentum buffers updated."""
    name_of = {id(p): n for n, p in named[0].items()}
    for group in strategies[0].optimizer.param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        names = [n for n in names if n in trained and params[f"model.{n}"].grad is not None]
        if not names:
            continue
        buffers: list[torch.Tensor | None] = []
        for n in names:
            held = [s.optimizer.state.get(named[k][n], {}).get("momentum_buffer") for k, s in enumerate(strategies)]
            if all(b is None for b in held):
                buffers.append(None)  # SGD's first step: the buffer is the gradient
            else:
                buffers.append(
                    torch.stack([torch.zeros_like(named[k][n]) if b is None else b for k, b in enumerate(held)])
                )
        with torch.no_grad():
            sgd(
                [params[f"model.{n}"] for n in names],
                [params[f"model.{n}"].grad for n in names],
                buffers,
                weight_decay=group["weight_decay"],
                momentum=group["momentum"],
                lr=group["lr"],
                dampening=group["dampening"],
                nesterov=group["nesterov"],
                maximize=group["maximize"],
            )
        if group["momentum"] == 0:
            continue
        for n, stacked in zip(names, buffers):
            assert stacked is not None, "SGD with momentum made every buffer"
            for k, strategy in enumerate(strategies):
                state = strategy.optimizer.state[named[k][n]]
                held = state.get("momentum_buffer")
                if held is None:
                    state["momentum_buffer"] = stacked[k].clone()
                else:
                    held.copy_(stacked[k])
