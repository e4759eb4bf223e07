"""Avalanche's accuracy, forgetting and BWT plugin metrics, experience and
stream, as one plugin metric that computes each minibatch's accuracy once.

``accuracy_metrics(experience=True, stream=True)``,
``forgetting_metrics(experience=True, stream=True)`` and
``bwt_metrics(experience=True, stream=True)`` are six plugin metrics, and each
keeps its own accuracy of every evaluated minibatch, its own forgetting table
and its own callbacks. A federated run evaluates the server and every
trained client after every round, on every seen experience, so those six
passes were most of what a small round costs beyond its training
(``docs/performance.md``). :class:`AccuracyForgettingBWT` is built from the
same Avalanche pieces (``Mean``, ``Forgetting``, ``get_metric_name``,
``MetricValue``) and emits the same names, values (the same float
arithmetic, so bit for bit) and order as the six; ``tests/test_metrics.py``
checks that against Avalanche's metrics on a multi-stage run.
"""

from __future__ import annotations

from typing import Any

import torch
from avalanche.evaluation.metric_definitions import PluginMetric
from avalanche.evaluation.metric_results import MetricValue
from avalanche.evaluation.metric_utils import get_metric_name, phase_and_task, stream_type
from avalanche.evaluation.metrics import Mean
from avalanche.evaluation.metrics.forgetting_bwt import Forgetting

from fedaval.object_cache import ObjectCache

#: The experience metrics' names, in the order they are emitted.
EXPERIENCE_METRICS = ("Top1_Acc_Exp", "ExperienceForgetting", "ExperienceBWT")


class AccuracyForgettingBWT(PluginMetric[None]):
    """``Top1_Acc_Exp``, ``ExperienceForgetting``, ``ExperienceBWT`` after each
    evaluated experience and ``Top1_Acc_Stream``, ``StreamForgetting``,
    ``StreamBWT`` after each ``eval()`` call, as Avalanche's plugin metrics
    of those names compute them:

    - an accuracy is the mean of the minibatches' accuracies weighted by their
      sizes (Avalanche's ``Accuracy``, one ``Mean`` update per minibatch);
    - an experience's forgetting is its accuracy when it was last evaluated
      while it was the experience in training (``before_training_exp``)
      minus its accuracy now, and is only emitted once both exist; BWT is
      its negation;
    - the stream values average the experience values of this ``eval()``
      call (accuracy over all its samples; forgetting and BWT over the
      experiences that have one; 0.0 when none has)."""

    def __init__(self):
        super().__init__()
        self.forgetting = Forgetting()
        self.train_exp_id: int | None = None
        self._exp_accuracy = Mean()
        self._stream_accuracy = Mean()
        self._stream_forgetting = Mean()
        self._stream_bwt = Mean()

    def reset(self) -> None:
        self.forgetting.reset()

    def result(self) -> None:
        return None

    def before_training_exp(self, strategy: Any) -> None:
        self.train_exp_id = strategy.experience.current_experience

    def before_eval(self, strategy: Any) -> None:
        # The experience's accuracy is reset here and after each experience
        # (after_eval_exp), not in before_eval_exp: one callback less per
        # evaluated experience, for the same values.
        self.forgetting.reset_last()
        for mean in (self._exp_accuracy, self._stream_accuracy, self._stream_forgetting, self._stream_bwt):
            mean.reset()

    @torch.no_grad()
    def after_eval_iteration(self, strategy: Any) -> None:
        # Avalanche's Accuracy.update: predicted classes by torch.max, a float
        # count of matches, and the minibatch's accuracy weighted by its size.
        true_positives = float(torch.sum(torch.eq(torch.max(strategy.mb_output, 1)[1], strategy.mb_y)))
        self.update_minibatch(true_positives, len(strategy.mb_y))

    def update_minibatch(self, true_positives: float, total: int) -> None:
        """Count one evaluated minibatch of ``total`` samples, ``true_positives``
        of them predicted right (``fedaval.one_pass_eval`` gives the counts of
        a whole evaluation at once)."""
        accuracy = true_positives / total
        self._exp_accuracy.update(accuracy, total)
        self._stream_accuracy.update(accuracy, total)

    def after_eval_exp(self, strategy: Any) -> list[MetricValue]:
        exp, accuracy_name, forgetting_name, bwt_name = self._experience_names(strategy)
        accuracy = self._exp_accuracy.result()
        self._exp_accuracy.reset()
        self.forgetting.update(exp, accuracy, initial=self.train_exp_id == exp)
        x = strategy.clock.train_iterations
        values = [MetricValue(self, accuracy_name, accuracy, x)]
        forgetting = self.forgetting.result_key(exp)
        if forgetting is not None:
            bwt = -1 * forgetting
            values.append(MetricValue(self, forgetting_name, forgetting, x))
            values.append(MetricValue(self, bwt_name, bwt, x))
            self._stream_forgetting.update(forgetting, weight=1)
            self._stream_bwt.update(bwt, weight=1)
        return values

    def _experience_names(self, strategy: Any) -> tuple[int, str, str, str]:
        """The evaluated experience's id and its three metric names, as
        ``get_metric_name`` makes them (about 16 us each): kept per experience
        object. ``fedaval.evaluation.MetricsEvaluator`` passes the same logging
        view of an experience at every evaluation, so they are made once per
        experience and run (:class:`fedaval.object_cache.ObjectCache`), never
        pickled. An experience object's id, stream, task labels and the phase
        (evaluation) do not change while it is kept."""
        return ObjectCache.of(self, "_names").get(
            strategy.experience,
            lambda experience: (
                experience.current_experience,
                *(get_metric_name(name, strategy, add_experience=True) for name in EXPERIENCE_METRICS),
            ),
        )

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_names", None)
        return state

    def after_eval(self, strategy: Any) -> list[MetricValue]:
        phase, _ = phase_and_task(strategy)
        stream = stream_type(strategy.experience)
        x = strategy.clock.train_iterations
        return [
            MetricValue(self, get_metric_name("Top1_Acc_Stream", strategy), self._stream_accuracy.result(), x),
            MetricValue(self, f"StreamForgetting/{phase}_phase/{stream}_stream", self._stream_forgetting.result(), x),
            MetricValue(self, f"StreamBWT/{phase}_phase/{stream}_stream", self._stream_bwt.result(), x),
        ]

    def __str__(self) -> str:
        return "AccuracyForgettingBWT"
