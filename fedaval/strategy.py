"""Avalanche, stretched over federated rounds.

Avalanche calls ``before_training_exp``/``after_training_exp`` around every
``strategy.train(experience)`` call, and its plugins do their end-of-task work
there (LwF's teacher snapshot, EWC's importances, the replay buffer update,
the clock's experience counter). In federated learning one task spans many
rounds, and a client trains once per round. Avalanche has no notion of
"this train() call continues the same experience", so:

* :class:`FederatedStrategy` runs Avalanche's experience set-up (dataset
  adaptation, dataloader, model adaptation, optimizer, the plugins'
  ``before_training_exp``) only when ``task_begins`` is set, and keeps the
  dataloader for the following rounds of the task; it runs the
  ``after_training_exp`` callbacks only when ``task_ends`` is set. Every
  other callback (per epoch, per iteration, ``before_backward``...) runs every
  round as usual. To every Avalanche plugin a task therefore looks like one
  long experience, as in centralised continual learning.
* Avalanche calls the plugins' ``before_training``/``after_training`` once per
  ``train()`` call, which centrally means once per experience, and its
  training plugins do per-experience work there (RWalk starts its path
  scores afresh; FromScratchTraining keeps the initial weights). So the
  ``before_training`` callbacks that Avalanche's training plugins define (code
  in ``avalanche.training.plugins``, the evaluator excepted) run only in the
  client's first round of a task (with the experience set-up), and their
  ``after_training`` only in its last (after ``after_training_exp``), as
  Avalanche would order them around one experience. Those fedaval defines
  (:class:`HookBridge`, the evaluation's ``PredictionRecorder``, fedaval's
  subclasses of Avalanche's plugins in :mod:`fedaval.plugins.avalanche_fixes`)
  and the evaluator's run every round: their work is per round.
* A plugin that replaces ``strategy.model`` (GDumb resets it to a copy of
  the initial model at each experience) would leave the client training an
  object it never uploads nor receives into: the client's model is
  ``client.model``. The strategy adopts the replacement where it sees one
  (after the ``before_train_dataset_adaptation`` callbacks, where GDumb
  replaces it, after the rest of the experience set-up, and after every
  round): its weights are
  copied into ``client.model``, which becomes ``strategy.model`` again, and
  the optimizer is made over it as Avalanche makes it over a replaced model
  (:meth:`FederatedStrategy._adopt_replaced_model`).
* Its data loaders take the device data path when they can
  (:mod:`fedaval.device_data`): same minibatches, built without per-sample work.
* :class:`HookBridge`, one Avalanche plugin per client, turns Avalanche's
  callbacks into fedaval hook calls, so method authors never write Avalanche
  callbacks for federated behaviour.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from avalanche.core import SupervisedPlugin
from avalanche.models.dynamic_modules import DynamicModule, avalanche_model_adaptation
from avalanche.training.templates import SupervisedTemplate

from fedaval.cuda_graphs import GraphedFeatures, GraphedStep
from fedaval.device_data import device_batches, eval_batches
from fedaval.errors import FedavalUsageError
from fedaval.models import is_on
from fedaval.object_cache import ObjectCache
from fedaval.plugin import CORE_LOSS_TERMS

AVALANCHE_TRAINING_PLUGINS = "avalanche.training.plugins."


def _check_constructors_once() -> None:
    """Make Avalanche check a strategy class's constructor once.

    Every strategy construction makes Avalanche check its keyword argument
    names against the ``__init__`` signatures of every class in the
    strategy's MRO (``avalanche.training.templates.base._check_mispelled_kwargs``),
    and check each of those ``__init__`` methods for positional parameters
    (``_warn_init_has_positional_args``): an ``inspect.signature`` per class
    per construction for each, about 2.3 ms of each of fedaval's client
    constructions (a cross-device run builds 1000 clients). Signatures do not
    change while a process runs, so a class and set of argument names that
    passed the check once passes again without it, and an ``__init__``
    checked once (and warned about, if it must be) is not checked again; any
    other combination is checked, and refused, as before."""
    from avalanche.training.templates import base

    check = base._check_mispelled_kwargs
    if getattr(check, "fedaval_memoised", False):
        return
    passed: set[tuple[type, frozenset[str]]] = set()

    def check_once(cls: type, kwargs: dict[str, Any]) -> None:
        key = (cls, frozenset(kwargs))
        if key not in passed:
            check(cls, kwargs)
            passed.add(key)

    warn = base._warn_init_has_positional_args
    warned: set[Any] = set()

    def warn_once(init_method: Any, class_name: str) -> None:
        if init_method not in warned:
            warn(init_method, class_name)
            warned.add(init_method)

    check_once.fedaval_memoised = True  # type: ignore[attr-defined]
    base._check_mispelled_kwargs = check_once
    base._warn_init_has_positional_args = warn_once


_check_constructors_once()


def count_modules(model: torch.nn.Module) -> int:
    """The number of ``model.named_modules()`` (each module once)."""
    return sum(1 for _ in model.modules())


def loss_term_clash(name: str, seen: set[str]) -> FedavalUsageError:
    """The one-line error for a plugin's local-loss term whose name is taken
    (a plugin declaring its ``loss_terms`` gets it at load time instead)."""
    if name in CORE_LOSS_TERMS:
        return FedavalUsageError(
            f"a plugin returns the local-loss term {name!r}, a name the core uses for its own terms "
            f"({', '.join(CORE_LOSS_TERMS)}); rename the term"
        )
    return FedavalUsageError(f"two plugins return the local-loss term {name!r}; each term needs its own name")


if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run


@dataclass
class Batch:
    """One training minibatch as local-loss hooks see it."""

    x: torch.Tensor
    y: torch.Tensor
    features: torch.Tensor
    logits: torch.Tensor
    loss: torch.Tensor


class FederatedStrategy(SupervisedTemplate):
    """A ``SupervisedTemplate`` whose experience may span several ``train()``
    calls (rounds), and whose forward pass goes through the model's split and
    the ``fedaval_classify`` hook.

    ``client`` is the :class:`~fedaval.client.Client` whose strategy this is,
    or ``None`` for the server's global model. A client's training loss is
    ``fedaval_client_criterion`` (the core's cross-entropy by default)."""

    model: Any  # Avalanche's (a plugin may replace it: _adopt_replaced_model)

    def __init__(self, *, run: Run, client: Client | None, **kwargs: Any):
        super().__init__(**kwargs)
        self.run = run
        self.client = client
        self.task_begins = True
        self.task_ends = True
        self._eval_model_as_is = False
        self.mb_features: torch.Tensor | None = None
        self._task_data: tuple[Any, Any] | None = None
        self._graphed: GraphedFeatures | None = None  # --cuda-graphs (fedaval.cuda_graphs); not pickled
        self._graphed_step: GraphedStep | None = None  # --cuda-graph-scope step; not pickled

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_graphed"] = None  # a CUDA graph is not state: captured anew where the strategy is loaded
        state["_graphed_step"] = None
        return state

    def forward(self):
        with self._precision():
            features = self._features()
            self.mb_features = features
            logits = self.run.hook.fedaval_classify(
                run=self.run, client=self.client, model=self.model, features=features, training=self.is_training
            )
            if logits is None:
                return self.model.classifier(features)
            if not self.is_training and tuple(logits.shape) != (features.shape[0], self.run.num_classes):
                from fedaval.errors import PluginError, implementers

                raise PluginError(  # argmax over other columns would give accuracies of other classes, silently
                    f"fedaval_classify returned scores of shape {tuple(logits.shape)} in evaluation; expected "
                    f"{(features.shape[0], self.run.num_classes)}, one column per class of the dataset "
                    f"(implemented by {implementers(self.run.pm, 'fedaval_classify')})"
                )
            return logits

    def _precision(self):
        """``--precision``'s autocast while a client trains (:func:`fedaval.training.autocast`); none otherwise."""
        if self.client is None or not self.is_training or self.run.config.precision == "fp32":
            return nullcontext()
        from fedaval.training import autocast

        return autocast(self.run.config, self.device)

    def _features(self) -> torch.Tensor:
        """``model.features`` of the minibatch; while a client trains, through
        ``torch.compile`` with ``--compile`` or a CUDA graph with ``--cuda-graphs``
        (the features scope; the step scope captures this call in its step)."""
        config = self.run.config
        if self.client is None or not self.is_training:
            return self.model.features(self.mb_x)
        if config.compile != "off":
            from fedaval.training import compiled_backbone

            return compiled_backbone(config, self.model.features, self.mb_x)
        if not config.cuda_graphs or config.cuda_graph_scope != "features":
            return self.model.features(self.mb_x)
        graphed = getattr(self, "_graphed", None)  # a strategy pickled before the option has none
        if graphed is None or graphed.module is not self.model.features:
            graphed = self._graphed = GraphedFeatures(self.model.features)
        return graphed(self.mb_x)

    def _before_training(self, **kwargs):
        """The round's optimizer policy and learning rate (:mod:`fedaval.training`)."""
        if self.client is not None:
            from fedaval.training import round_lr

            run = self.run
            if run.config.optimizer_state == "reset":  # no momentum carried over from the last round's weights
                graphed = getattr(self, "_graphed_step", None)
                if graphed is not None:
                    graphed.reset_optimizer_state(self.optimizer)  # its graphs update the momentum buffers in place
                else:
                    self.optimizer.state.clear()
            lr = round_lr(run.config, run.round, run.total_rounds)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self._trigger_plugins("before_training", self.task_begins or self._task_data is None, **kwargs)

    def _after_training(self, **kwargs):
        self._trigger_plugins("after_training", self.task_ends, **kwargs)
        self._adopt_replaced_model()
        if self.client is not None and self.run.config.stack_clients:
            from fedaval import stacked

            stacked.active().release(self)  # its tensors its own again, before its upload
        if not self._trains_next_round():
            # --cuda-graphs: a graph holds its activations' memory; a client that idles next
            # round lets it go and captures anew when it trains again
            self._graphed = self._graphed_step = None

    def _trigger_plugins(self, event: str, task_edge: bool, **kwargs: Any) -> None:
        """Avalanche's ``trigger_plugins(self, event)`` for ``before_training``
        or ``after_training``, without the callbacks of Avalanche's training
        plugins unless ``task_edge`` (the client's first round of a task, for
        ``before_training``; its last, for ``after_training``): see the module
        docstring."""
        for plugin in self.plugins:
            callback = getattr(plugin, event, None)
            if callback is not None and (task_edge or not self._once_per_task(plugin, event)):
                callback(self, **kwargs)

    def _once_per_task(self, plugin: Any, event: str) -> bool:
        """Whether ``plugin``'s ``event`` callback is Avalanche's training
        plugins' code, which expects one call per experience."""
        defined_in = getattr(getattr(type(plugin), event, None), "__module__", None) or ""
        return plugin is not self.evaluator and defined_in.startswith(AVALANCHE_TRAINING_PLUGINS)

    def _adopt_replaced_model(self) -> None:
        """Make ``client.model`` the model trained again if a plugin replaced
        ``self.model`` (module docstring): the replacement's weights are
        copied into it (its parameters stay the objects the client receives
        into and uploads from) and the optimizer is made over it as
        Avalanche's ``check_model_and_optimizer`` makes it over a replaced
        model (the replaced parameters' optimizer state empty). A replacement
        of other weights than the client's model has is a
        :class:`~fedaval.errors.PluginError` naming the client's Avalanche
        plugins."""
        if self.client is None or self.model is self.client.model:
            return
        own = self.client.model
        mine, theirs = own.state_dict(), self.model.state_dict()
        differ = sorted(set(mine) ^ set(theirs)) or [k for k in mine if mine[k].shape != theirs[k].shape]
        if differ:
            from fedaval.errors import PluginError

            names = ", ".join(type(p).__name__ for p in self.plugins if self._is_method_plugin(p))
            raise PluginError(
                f"an Avalanche plugin of client {self.client.id} ({names}) replaced its model by one whose weights "
                f"do not fit the client's model, which fedaval federates ({', '.join(differ[:3])}"
                f"{', ...' if len(differ) > 3 else ''} differ)"
            )
        own.load_state_dict(theirs)
        self.model = own
        self.make_optimizer()

    def _is_method_plugin(self, plugin: Any) -> bool:
        """Whether ``plugin`` came from a method (not the bridge, the evaluator, the clock or Avalanche's templates)."""
        module = type(plugin).__module__
        return (
            plugin is not self.evaluator
            and plugin is not self.clock
            and not isinstance(plugin, HookBridge)
            and not module.startswith("avalanche.training.templates")
        )

    def _trains_next_round(self) -> bool:
        run = self.run
        return run.round < len(run.schedule) and self.client is not None and self.client.id in run.schedule[run.round]

    def training_epoch(self, **kwargs):
        """Avalanche's (``SGDUpdate.training_epoch``); with ``--cuda-graph-scope
        step`` each iteration's work from ``zero_grad`` to the optimizer step
        is one graph replay (:class:`fedaval.cuda_graphs.GraphedStep`), with
        ``--stack-clients`` one share of the round's clients' stacked step
        (:meth:`fedaval.stacked.Lockstep.step`), and the callbacks between
        them run after it, in their order, with the step's output and loss:
        the loop below is Avalanche's with that one change. The run allows
        it only where no plugin acts inside a step
        (``fedaval.cuda_graphs.check_step_hooks``, and the strategy's
        Avalanche plugins when the run is built)."""
        step = self._whole_step()
        if step is None:
            return super().training_epoch(**kwargs)
        for self.mbatch in self.dataloader:  # noqa: B020 (Avalanche's loop sets its minibatch so)
            if self._stop_training:
                break
            self._unpack_minibatch()
            self._before_training_iteration(**kwargs)
            self.mb_features, self.mb_output, self.loss = step(self, self.mb_x, self.mb_y)
            self._before_forward(**kwargs)
            self._after_forward(**kwargs)
            self._before_backward(**kwargs)
            self._after_backward(**kwargs)
            self._before_update(**kwargs)
            self._after_update(**kwargs)
            self._after_training_iteration(**kwargs)

    def _whole_step(self):
        """What computes a client's whole training step, ``step(strategy, x,
        y) -> (features, logits, loss)``, or ``None`` for Avalanche's own."""
        config = self.run.config
        if self.client is None:
            return None
        if config.stack_clients:
            from fedaval import stacked

            return stacked.active().step
        if not config.cuda_graphs or config.cuda_graph_scope != "step":
            return None
        graphed = getattr(self, "_graphed_step", None)
        if graphed is None:
            graphed = self._graphed_step = GraphedStep(self)
        return graphed.step

    def _unpack_minibatch(self):
        super()._unpack_minibatch()
        if self.is_training and self.client is not None and self.run.augment == "standard":
            from fedaval.training import standard_augment

            self.mbatch[0] = standard_augment(self.mbatch[0], self.run.black)
        if self.is_training and self.client is not None and self.run.config.channels_last and self.mb_x.dim() == 4:
            self.mbatch[0] = self.mbatch[0].contiguous(memory_format=torch.channels_last)  # --channels-last

    def criterion(self):
        if self.is_training and self.client is not None:
            with self._precision():
                return self.run.hook.fedaval_client_criterion(
                    run=self.run, client=self.client, logits=self.mb_output, y=self.mb_y
                )
        return super().criterion()

    def make_train_dataloader(self, **kwargs):
        super().make_train_dataloader(**kwargs)
        self.dataloader = device_batches(self.run, self.dataloader, self.adapted_dataset) or self.dataloader

    @torch.no_grad()
    def eval(self, exp_list, **kwargs):
        """Avalanche's ``eval``, done in one pass over all the experiences when
        nothing in this strategy needs Avalanche's per-experience template
        (:mod:`fedaval.one_pass_eval`): the same metrics, predictions, clock
        and random streams, without the template's per-experience and
        per-minibatch work, which grew with every stage's new experience."""
        from fedaval import one_pass_eval

        one_pass = type(self) is FederatedStrategy  # a subclass may change any step of the template
        if one_pass and isinstance(exp_list, list) and not kwargs and one_pass_eval.applies(self, exp_list):
            metrics = one_pass_eval.evaluate(self, exp_list)
            if metrics is not None:
                return metrics
        return super().eval(exp_list, **kwargs)

    def _before_eval(self, **kwargs):
        super()._before_eval(**kwargs)
        self._eval_model_as_is = self._needs_no_adaptation(self.model)

    def _load_train_state(self, prev_state):
        """Avalanche's (``BaseTemplate`` and ``BaseSGDTemplate``), with the
        modules' train/eval modes of before ``eval()`` restored by one
        ``model.train(mode)`` when they were all the same and the model has
        the same modules: Avalanche calls ``train(mode)`` on every module in
        turn, and each call walks that module's whole subtree (about 0.05 ms
        of a 0.35 ms evaluation of the digits MLP; more for deeper models).
        Mixed modes, or a model that gained modules, go through Avalanche's."""
        modes = prev_state["model_training_mode"]
        mode = next(iter(modes.values()), None)
        if mode is None or any(m is not mode for m in modes.values()) or count_modules(self.model) != len(modes):
            super()._load_train_state(prev_state)
            return
        self.experience = prev_state["experience"]
        self.is_training = prev_state["is_training"]
        self.model.train(mode)
        self.adapted_dataset = prev_state["adapted_dataset"]
        self.dataloader = prev_state["dataloader"]

    def model_adaptation(self, model=None):
        """Avalanche's, without its walk over every module per evaluated
        experience (adapting dynamic modules, then ``model.to(device)``) when
        the model has no dynamic module and every parameter and buffer is on
        the device: checked once per ``eval()`` call instead, in
        ``_before_eval``. Each walk costs about as much as evaluating a small
        experience."""
        if self.is_training:
            return super().model_adaptation(model)
        model = self.model if model is None else model
        if model is self.model and self._eval_model_as_is:
            return model
        avalanche_model_adaptation(model, self.experience)
        return model if is_on(model, self.device) else model.to(self.device)

    def _needs_no_adaptation(self, model: torch.nn.Module) -> bool:
        return not any(isinstance(m, DynamicModule) for m in model.modules()) and is_on(model, self.device)

    def eval_dataset_adaptation(self, **kwargs):
        """Avalanche's (``adapted_dataset`` is the experience's dataset in its
        eval view), with the view made once per experience and run rather than
        at every evaluation: ``dataset.eval()`` clones the Avalanche dataset and
        its transform groups, about 30 us, and the server and every client
        evaluate every seen experience after every round. The views are kept
        in ``run.eval_views`` (never in a checkpoint), by experience, and
        reused while the experience still holds the same dataset object."""
        dataset = self.experience.dataset
        _, self.adapted_dataset = ObjectCache.of(self.run, "eval_views").get(
            self.experience, lambda _: (dataset, dataset.eval()), valid=lambda kept: kept[0] is dataset
        )

    def make_eval_dataloader(self, **kwargs):
        batches = None if kwargs else eval_batches(self.run, self.adapted_dataset, self.eval_mb_size)
        if batches is not None:  # the device data path, without making Avalanche's loader
            self.dataloader = batches
            return
        super().make_eval_dataloader(**kwargs)
        self.dataloader = device_batches(self.run, self.dataloader, self.adapted_dataset) or self.dataloader

    def make_optimizer(self, reset_optimizer_state=False, remove_params=False, verbose_optimizer=False, **kwargs):
        """Avalanche's (``update_optimizer``: the optimizer given the model's
        new and grown parameters), done without its parameter-group tree when
        the optimizer already holds every parameter of the model by its name
        of last time: then Avalanche's would change nothing but reset the
        state if asked to, and building the tree (twice per task start:
        ``check_model_and_optimizer``) cost about 1.5 ms of every cross-device
        ``cnn`` client's first round (0.1 ms without it). A model that grew (a dynamic module, a new
        parameter) goes through Avalanche's as before."""
        params = dict(self.model.named_parameters())
        if verbose_optimizer or not self._optimizer_holds(params, remove_params):
            super().make_optimizer(
                reset_optimizer_state=reset_optimizer_state,
                remove_params=remove_params,
                verbose_optimizer=verbose_optimizer,
                **kwargs,
            )
            return
        if reset_optimizer_state:
            self.optimizer.state = defaultdict(dict)
        self.optimized_param_id = params

    def _optimizer_holds(self, params: dict[str, torch.nn.Parameter], remove_params: bool) -> bool:
        """Whether ``update_optimizer`` would find every parameter of ``params``
        in the optimizer under its last name, with nothing new or changed
        (and, with ``remove_params``, nothing to remove)."""
        optimized = self.optimized_param_id or {}
        held = [p for group in self.optimizer.param_groups for p in group["params"]]
        held_ids = {id(p) for p in held}
        if len(held_ids) != len(held):
            return False
        for name, param in params.items():
            if optimized.get(name, param) is not param or id(param) not in held_ids:
                return False
        return not remove_params or len(held) == len(params)

    def _before_train_dataset_adaptation(self, **kwargs):
        super()._before_train_dataset_adaptation(**kwargs)
        self._adopt_replaced_model()  # GDumb's reset: before the experience's other callbacks see the model

    def _before_training_exp(self, **kwargs):
        if self.task_begins or self._task_data is None:
            super()._before_training_exp(**kwargs)
            self._adopt_replaced_model()  # before the round trains it
            self._task_data = (self.adapted_dataset, self.dataloader)
        else:  # a later round of the same task: same data, same optimizer
            self.adapted_dataset, self.dataloader = self._task_data

    def _after_training_exp(self, **kwargs):
        if self.task_ends:
            super()._after_training_exp(**kwargs)
            self._task_data = None


class HookBridge(SupervisedPlugin):
    """Calls fedaval hooks from a client's Avalanche strategy callbacks, and
    adds the collected local-loss terms to the loss. Keeps per-round means of
    every term (as tensors, to avoid a device sync per minibatch)."""

    fedaval_reads_inside_steps = True
    """Inside a step it only reads, and calls ``fedaval_client_loss``, which
    ``--cuda-graph-scope step`` allows no plugin to implement
    (:func:`fedaval.cuda_graphs.check_scope`)."""

    def __init__(self, run: Run, client: Client):
        super().__init__()
        self.run = run
        self.client = client
        self.epoch = 0
        self._sums: dict[str, torch.Tensor] = {}
        self._steps = 0

    # set-up/tear-down of one local round (one strategy.train() call)
    def before_training(self, strategy, **kwargs):
        self.epoch = 0
        self._sums = {}
        self._steps = 0

    def before_training_exp(self, strategy, **kwargs):
        self.run.hook.fedaval_client_task_start(run=self.run, client=self.client, task=self.client.task)

    def before_training_epoch(self, strategy, **kwargs):
        self.run.hook.fedaval_client_epoch_start(run=self.run, client=self.client, epoch=self.epoch)

    def after_training_epoch(self, strategy, **kwargs):
        self.epoch += 1

    def before_backward(self, strategy, **kwargs):
        batch = Batch(strategy.mb_x, strategy.mb_y, strategy.mb_features, strategy.mb_output, strategy.loss)
        self._add("loss/classification", strategy.loss)
        results = self.run.hook.fedaval_client_loss(run=self.run, client=self.client, batch=batch)
        seen: set[str] = set()
        for terms in results:
            for name, term in (terms or {}).items():
                if name in CORE_LOSS_TERMS or name in seen:
                    raise loss_term_clash(name, seen)
                seen.add(name)
                strategy.loss = strategy.loss + term
                self._add("loss/" + name, term)

    def after_backward(self, strategy, **kwargs):
        self._add("loss/total", strategy.loss)
        self._steps += 1

    def after_update(self, strategy, **kwargs):
        batch = Batch(strategy.mb_x, strategy.mb_y, strategy.mb_features, strategy.mb_output, strategy.loss)
        self.run.hook.fedaval_client_step(run=self.run, client=self.client, batch=batch)

    def after_training_exp(self, strategy, **kwargs):
        self.run.hook.fedaval_client_task_end(run=self.run, client=self.client, task=self.client.task)

    def _add(self, name: str, value: torch.Tensor) -> None:
        value = value.detach()
        if name in self._sums:
            self._sums[name] += value
        else:
            self._sums[name] = value.clone()

    def round_losses(self) -> dict[str, torch.Tensor]:
        """Mean of each loss term over the minibatches of the last round, as
        0-d float64 tensors on the device, not read: the backend reads every
        client's of a round at once (:func:`fedaval.backends.local.settle`).
        In float64 the float32 sum divides exactly as ``float(total) / steps``."""
        steps = max(self._steps, 1)
        return {name: total.double() / steps for name, total in self._sums.items()}
