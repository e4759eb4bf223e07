"""Evaluation of every seen experience in one pass, with Avalanche's metrics.

Avalanche's ``eval(experiences)`` evaluates the experiences one by one: per
experience its dataset adaptation, a data loader, model adaptation and the
``before_eval_exp``/``after_eval_exp`` callbacks, and per minibatch four
callbacks and the loss. A federated run evaluates the server and every
trained client on every seen experience after every round, so each stage
adds one experience to every evaluation, and on a small workload that
per-experience work was most of what grew (docs/performance.md, "Fixed cost
per round"). :func:`evaluate` does the same evaluation in one pass when
nothing in the strategy needs the per-experience template:

- the samples of all the experiences, one experience after the other, go
  through the model in minibatches of ``eval_mb_size``, which may now hold
  samples of two experiences (:func:`fedaval.device_data.joined_test_batches`,
  kept in the run). Each sample's scores do not depend on the others in its
  minibatch: evaluation runs the model in eval mode, and ``fedaval_classify``
  scores samples one by one. On the CPU the logits are the same bits either
  way (``tests/test_one_pass_eval.py``); on a GPU a kernel picked for another
  minibatch size may round differently, which changes a prediction only
  where two classes' scores are equal to the last bits;
- the loss the template computes for every evaluated minibatch, which no
  metric or plugin here reads, is not computed;
- each experience's metrics (:class:`fedaval.metrics.AccuracyForgettingBWT`)
  get the counts of correct predictions of the minibatches the template
  would have made, in its order, so every accuracy, forgetting and BWT value
  is computed with the same float arithmetic, and the evaluator publishes and
  logs them in ``after_eval_exp`` per experience as before;
- Avalanche's clock counts the evaluation iterations the template would have
  counted, and :class:`fedaval.evaluation.PredictionRecorder` gets the same
  predictions in the same order;
- the random numbers the template's loaders draw (one per experience) are
  drawn, so every random stream stays where it was.

``before_eval`` and ``after_eval`` are called as usual. The one pass is taken
only when every one of those conditions can be checked (:func:`applies`):
the strategy is a :class:`~fedaval.strategy.FederatedStrategy` itself, on the
device data path, its evaluator's metrics are
:class:`~fedaval.metrics.AccuracyForgettingBWT` only, and no other
plugin does anything in a per-experience or per-minibatch evaluation callback.
Anything else (an Avalanche plugin with an evaluation callback, a method's
subclass of the strategy) is evaluated by Avalanche's template, as before, and
so is a model with an Avalanche dynamic module (found by the one check of the
model that evaluation makes anyway): it is adapted to each experience.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from avalanche.models.dynamic_modules import DynamicModule
from avalanche.training.plugins.clock import Clock

from fedaval.datasets import TensorImageDataset
from fedaval.device_data import device_source, draw_loader_seed, joined_test_batches
from fedaval.evaluation import MetricsEvaluator, PredictionRecorder
from fedaval.metrics import AccuracyForgettingBWT

if TYPE_CHECKING:
    from fedaval.strategy import FederatedStrategy

#: The callbacks Avalanche's template calls per evaluated experience or minibatch.
PER_EXPERIENCE = (
    "before_eval_exp",
    "before_eval_dataset_adaptation",
    "after_eval_dataset_adaptation",
    "before_eval_iteration",
    "before_eval_forward",
    "after_eval_forward",
    "after_eval_iteration",
    "after_eval_exp",
)

#: What the evaluator may do in those callbacks for the one pass to stand in:
#: its AccuracyForgettingBWT metrics, fed by :func:`evaluate`.
EVALUATOR_HANDLED = frozenset({"after_eval_iteration", "after_eval_exp"})


def applies(strategy: FederatedStrategy, experiences: list[Any]) -> bool:
    """Whether :func:`evaluate` does exactly what Avalanche's template would
    (module docstring) for ``strategy``, a ``FederatedStrategy`` itself, not a
    subclass (``FederatedStrategy.eval`` checks that)."""
    if not experiences:
        return False
    for plugin in strategy.plugins:
        if plugin is strategy.evaluator:
            if not evaluator_handled(plugin):
                return False
        elif type(plugin) not in (Clock, PredictionRecorder) and acts_per_experience(type(plugin)):
            return False
    return True


def evaluator_handled(evaluator: Any) -> bool:
    """Whether the evaluator's per-experience and per-minibatch work is its
    metrics' (fed by :func:`evaluate`) and its loggers' ``after_eval_exp``."""
    return (
        type(evaluator) is MetricsEvaluator
        and all(type(metric) is AccuracyForgettingBWT for metric in evaluator.metrics)
        and evaluator.callbacks.intersection(PER_EXPERIENCE) <= EVALUATOR_HANDLED
        and not any(hasattr(logger, name) for logger in evaluator.loggers for name in LOGGER_SKIPPED)
    )


#: Callbacks a logger of the evaluator would not get in the one pass.
LOGGER_SKIPPED = tuple(name for name in PER_EXPERIENCE if name != "after_eval_exp")


_ACTS: dict[type, bool] = {}


def acts_per_experience(cls: type) -> bool:
    """Whether plugin class ``cls`` defines any :data:`PER_EXPERIENCE`
    callback other than Avalanche's do-nothing ones (``avalanche.core``'s
    plugin base classes). Kept per class."""
    if cls not in _ACTS:
        _ACTS[cls] = any(
            owner is not None and owner.__module__ != "avalanche.core"
            for owner in (next((c for c in cls.__mro__ if name in vars(c)), None) for name in PER_EXPERIENCE)
        )
    return _ACTS[cls]


def evaluate(strategy: FederatedStrategy, experiences: list[Any]) -> dict[str, Any] | None:
    """Avalanche's ``eval(experiences)`` in one pass (module docstring): the
    evaluator's last metrics, as ``eval`` returns them; ``None``, with nothing
    evaluated, when an experience is off the device data path or empty."""
    saved = strategy._save_train_state()
    sources = []
    for exp in experiences:
        source = experience_source(strategy, exp)
        if source is None or not len(source):
            strategy._load_train_state(saved)
            return None
        sources.append(source)
    strategy.experience, strategy.adapted_dataset = saved["experience"], saved["adapted_dataset"]
    if not strategy._distributed_check:
        strategy._check_distributed_training_compatibility()
        strategy._distributed_check = True
    strategy.is_training = False
    strategy.model.eval()
    strategy.current_eval_stream = experiences
    strategy._before_eval()
    if not strategy._eval_model_as_is:
        if any(isinstance(m, DynamicModule) for m in strategy.model.modules()):
            return template_eval(strategy, experiences, saved)  # adapted to each experience
        strategy.experience = experiences[0]  # only off the device: moved there, once
        strategy.model = strategy.model_adaptation()
    for _ in experiences:  # what each experience's loader iterator draws
        draw_loader_seed()
    predicted, labels = predictions(strategy, joined_test_batches(strategy.run, sources, strategy.eval_mb_size))
    size = strategy.eval_mb_size
    sizes = [[min(size, len(source) - start) for start in range(0, len(source), size)] for source in sources]
    correct = minibatch_correct(predicted, labels, [n for exp_sizes in sizes for n in exp_sizes])
    strategy.clock.total_iterations += len(correct)
    for plugin in strategy.plugins:
        if isinstance(plugin, PredictionRecorder):
            plugin.record(predicted, labels)
    position = 0
    for strategy.experience, exp_sizes in zip(experiences, sizes, strict=True):
        for total in exp_sizes:
            for metric in strategy.evaluator.metrics:
                metric.update_minibatch(correct[position], total)
            position += 1
        strategy.evaluator.after_eval_exp(strategy)
    strategy._after_eval()
    strategy._eval_cleanup()
    strategy._load_train_state(saved)
    return strategy.evaluator.get_last_metrics()


def template_eval(strategy: FederatedStrategy, experiences: list[Any], saved: dict[str, Any]) -> dict[str, Any]:
    """The rest of Avalanche's ``eval`` after ``before_eval``
    (``BaseTemplate.eval``): experience by experience, through the template."""
    for strategy.experience in experiences:
        strategy._before_eval_exp()
        strategy._eval_exp()
        strategy._after_eval_exp()
    strategy._after_eval()
    strategy._eval_cleanup()
    strategy._load_train_state(saved)
    return strategy.evaluator.get_last_metrics()


def experience_source(strategy: FederatedStrategy, experience: Any) -> TensorImageDataset | None:
    """The run's test samples ``experience`` evaluates (its eval view's,
    :func:`fedaval.device_data.tensor_source`), or ``None`` off the device
    data path: what Avalanche's template would evaluate the experience on."""
    strategy.experience = experience
    strategy.eval_dataset_adaptation()
    found = device_source(strategy.run, strategy.adapted_dataset)
    return None if found is None or found[1] != "test" else found[0]


def predictions(
    strategy: FederatedStrategy, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted classes (``torch.max`` over the scores, as Avalanche's
    accuracy takes them) and labels of every sample of ``batches``, in order."""
    predicted, labels = [], []
    for xs, ys in batches:
        strategy.mbatch = [xs, ys, torch.zeros(len(ys), dtype=torch.int64, device=ys.device)]
        strategy._unpack_minibatch()
        strategy.mb_output = strategy.forward()
        predicted.append(torch.max(strategy.mb_output, 1)[1])
        labels.append(strategy.mb_y)
    return torch.cat(predicted), torch.cat(labels)


def minibatch_correct(predicted: torch.Tensor, labels: torch.Tensor, sizes: list[int]) -> list[float]:
    """The number of correct predictions in each run of ``sizes`` samples,
    as floats (Avalanche's accuracy takes ``float(torch.sum(...))``), read
    from the device at once."""
    ends = torch.tensor(sizes).cumsum(0) - 1
    counts = torch.eq(predicted, labels).cumsum(0, dtype=torch.int64)[ends.to(predicted.device)].tolist()
    return [float(n - before) for n, before in zip(counts, [0, *counts[:-1]], strict=True)]
