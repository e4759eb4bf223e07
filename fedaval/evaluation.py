"""Avalanche's metrics for the global model and every client, in TensorBoard
and results.json.

Metric keys are Avalanche's (``Top1_Acc_Stream/eval_phase/test_stream``)
with the owner appended (``.../global``, ``.../client003``), so TensorBoard
groups one metric's curves for the server and every client together. The
x axis is the federated round (1-based).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from avalanche.core import SupervisedPlugin
from avalanche.logging import TensorboardLogger
from avalanche.training.plugins import EvaluationPlugin

from fedaval.object_cache import ObjectCache

if TYPE_CHECKING:
    from fedaval.run import Run

STREAM_ACC = "Top1_Acc_Stream/eval_phase/test_stream"
STREAM_FORGETTING = "StreamForgetting/eval_phase/test_stream"
STREAM_BWT = "StreamBWT/eval_phase/test_stream"


def exp_acc_key(task: int) -> str:
    return f"Top1_Acc_Exp/eval_phase/test_stream/Exp{task:03d}"


class RoundTensorboardLogger(TensorboardLogger):
    """Avalanche's TensorBoard logger, with the owner appended to every tag
    and the federated round as the step. All owners of a run write through
    one ``SummaryWriter`` (:func:`run_writer`): one events file and one
    writer thread per run, not per client."""

    def __init__(self, run: Run, owner_tag: str):
        self.run = run
        self.owner_tag = owner_tag
        assert run.out_dir is not None, "only a run with a folder logs to TensorBoard"
        super().__init__(tb_log_dir=str(run.out_dir / "tb"))

    def _make_writer(self, tb_log_dir, filename_suffix):
        return run_writer(self.run)

    def log_single_metric(self, name, value, x_plot):
        if type(value) in (float, int):  # the accuracies, forgetting, BWT: into the round's one event
            add_scalar(self.run, f"{name}/{self.owner_tag}", value, self.run.round)
        else:
            super().log_single_metric(f"{name}/{self.owner_tag}", value, self.run.round)


#: How often TensorBoard's events reach the file while a run trains.
FLUSH_SECONDS = 10


def run_writer(run: Run):
    """The run's ``SummaryWriter`` (created on first use, closed with the run)."""
    import weakref

    from torch.utils.tensorboard import SummaryWriter

    writer = run.tb_writer
    assert run.out_dir is not None, "only a run with a folder logs to TensorBoard"
    if writer is None:  # its thread flushes the events every FLUSH_SECONDS (and the run when it stops)
        writer = run.tb_writer = SummaryWriter(str(run.out_dir / "tb"), flush_secs=FLUSH_SECONDS)
        weakref.finalize(run, SummaryWriter.close, writer)
    return writer


def purge_from(run: Run, step: int) -> None:
    """Tell TensorBoard to drop what earlier processes of this run logged at
    ``step`` and after (what ``SummaryWriter(purge_step=step)`` writes): a
    resumed run logs the rounds after its checkpoint again, and a run
    interrupted later than its newest checkpoint had logged some of them."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    writer = run_writer(run)._get_file_writer()
    writer.add_event(Event(step=step, file_version="brain.Event:2"))
    writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))


def add_scalar(run: Run, tag: str, value: float, step: int) -> None:
    """Log scalar ``tag`` at ``step`` (the round). A round's scalars, the server's
    and every client's Avalanche metrics and the round's own figures, about
    20 to 80 of them, go to the events file as one event (:func:`write_scalars`)
    instead of one event each: ``SummaryWriter.add_scalar`` costs about 0.08 ms
    a call here, most of a digits round's fixed cost after evaluation. What
    TensorBoard shows is the same: each tag's value at its step."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    if run.tb_scalars is not None and run.tb_scalars[0] != step:
        write_scalars(run)
    if run.tb_scalars is None:
        run.tb_scalars = (step, [])
    run.tb_scalars[1].append(Summary.Value(tag=tag, simple_value=float(value)))


def write_scalars(run: Run) -> None:
    """Hand the scalars :func:`add_scalar` collected to the run's writer, as one
    event (its thread writes it; the run flushes the writer when it stops)."""
    if run.tb_scalars is None:
        return
    from tensorboard.compat.proto.summary_pb2 import Summary

    step, values = run.tb_scalars
    run.tb_scalars = None
    # SummaryWriter.add_scalar makes one Summary per value and passes it to this same file writer
    run_writer(run)._get_file_writer().add_summary(Summary(value=values), step)


def client_accuracies(run: Run, round: int) -> dict[int, float | None]:
    """Each started client's stream accuracy on its seen classes. Clients
    trained since their last evaluation, or whose last result a plugin calls
    stale (``fedaval_client_evaluation_stale``), are evaluated now (inside
    ``fedaval_client_evaluate``, in their own random streams; for a stale one
    the streams are put back afterwards, so that the extra evaluation leaves
    the run's training as it was); the others keep their last result. Runs
    on the driver whatever the backend: evaluation reads server state
    (GLDP's newest prototypes) that only the driver has."""
    accuracies = {}
    stale_hook = run.hook.fedaval_client_evaluation_stale
    ask = bool(stale_hook.get_hookimpls())  # 1000 clients a round: no hook call when nothing implements it
    for client in run.clients:
        if not client.tasks_started:
            continue
        trained = client.trained_at > client.evaluated_at
        if trained or (ask and any(stale_hook(run=run, client=client))):
            # an extra look at an idle client leaves no trace in its random streams (evaluation
            # draws a loader seed from them), so its training goes on as it would have without it
            with client.rng_scope(keep_draws=trained):
                client.last_eval = run.hook.fedaval_client_evaluate(run=run, client=client) or {}
            if client.last_eval and run.config.client_test == "train":
                predicted, labels = client_predictions(client)
                client.last_eval = {
                    **client.last_eval,
                    MIX_ACCURACY: client_accuracy_on(run, client, predicted, labels),
                }
            client.evaluated_at = round
        if client.last_eval:
            accuracies[client.id] = client.last_eval.get(MIX_ACCURACY, scalar(client.last_eval, STREAM_ACC))
    return accuracies


#: ``client.last_eval``'s key for the accuracy ``--client-test train`` reads (its own class mix).
MIX_ACCURACY = "fedaval/client_mix_accuracy"


def client_predictions(client: Any):
    """``(predicted, labels)`` of the client's last evaluation, from the
    :class:`PredictionRecorder` its strategy has with ``--client-test
    train``, which is then emptied (an idle client keeps no predictions)."""
    recorder = next(p for p in client.strategy.plugins if isinstance(p, PredictionRecorder))
    predicted, labels = recorder.predictions()
    recorder.before_eval(client.strategy)
    return predicted, labels


def evaluation_metrics() -> list[Any]:
    """The plugin metrics every evaluator computes: accuracy, forgetting and
    BWT per experience and over the stream, as Avalanche's
    ``accuracy_metrics``, ``forgetting_metrics`` and ``bwt_metrics``
    (experience and stream) compute them, in one pass
    (:class:`fedaval.metrics.AccuracyForgettingBWT`)."""
    from fedaval.metrics import AccuracyForgettingBWT

    return [AccuracyForgettingBWT()]


def make_evaluator(run: Run, owner_tag: str) -> EvaluationPlugin:
    """:func:`evaluation_metrics` in a :class:`MetricsEvaluator`.

    Only the last values are kept (``collect_all=False``): the history is in
    results.json and TensorBoard, and a history kept in the evaluator would
    make every checkpoint and offloaded client grow with the rounds done."""
    loggers = [RoundTensorboardLogger(run, owner_tag)] if run.out_dir is not None else []
    if loggers:
        run.loggers[owner_tag] = loggers[0]  # saved state refers to it by name (fedaval.state)
    return MetricsEvaluator(
        *evaluation_metrics(),
        loggers=loggers,
        collect_all=False,
        strict_checks=False,
    )


#: The callbacks of Avalanche's supervised strategies.
CALLBACKS = tuple(name for name in dir(SupervisedPlugin) if name.startswith(("before_", "after_")))


def metric_acts_on(metric: Any, callback: str) -> bool:
    """Whether Avalanche metric ``metric`` does anything in ``callback``:
    ``PluginMetric``'s own callbacks do nothing, and ``GenericPluginMetric``'s
    act only in the phase of the metric's mode (training callbacks for
    ``mode="train"``, evaluation ones for ``"eval"``); any other definition
    (a subclass's override) counts as acting."""
    from avalanche.evaluation.metric_definitions import GenericPluginMetric, PluginMetric

    owner = next((cls for cls in type(metric).__mro__ if callback in vars(cls)), None)
    if owner is None:
        return hasattr(metric, callback)
    if owner is PluginMetric:
        return False
    if owner is GenericPluginMetric:
        return getattr(metric, "_mode", None) == ("eval" if "eval" in callback else "train")
    return True


class MetricsEvaluator(EvaluationPlugin):
    """Avalanche's ``EvaluationPlugin``, calling its metrics and loggers only
    in the callbacks where one of them does something (:attr:`callbacks`).

    Avalanche's evaluator answers every ``before_*``/``after_*`` callback by
    calling each metric's method (a no-op for most of them: accuracy,
    forgetting and BWT on the test stream only act in evaluation callbacks)
    and every logger, after swapping ``strategy.experience`` for a logging
    copy; per training minibatch that is seven callbacks. The others are
    skipped here; what is computed and logged is the same. In evaluation the
    logging copy of each experience is made once and reused
    (:meth:`logging_view`)."""

    def __init__(self, *metrics: Any, **kwargs: Any):
        super().__init__(*metrics, **kwargs)
        self.callbacks = frozenset(
            name
            for name in CALLBACKS
            if any(metric_acts_on(m, name) for m in self.metrics) or any(hasattr(lg, name) for lg in self.loggers)
        )

    # Plain attribute lookup: EvaluationPlugin's __getattribute__ makes a
    # forwarding closure for every callback, through an AttributeError, on
    # every call; here the callbacks are methods and __getattr__ covers the rest.
    __getattribute__ = object.__getattribute__

    _metric_values: list[Any]  # EvaluationPlugin's: the values published since the loggers last got them

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("before_", "after_")):  # a callback CALLBACKS lacks: forward it, as Avalanche does
            return lambda strategy, **kwargs: self._update_metrics_and_loggers(strategy, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_logging_views", None)  # a cache of views of the run's experiences
        return state

    def _update_metrics_and_loggers(self, strategy: Any, callback: str) -> list[Any] | None:
        """Avalanche's ``EvaluationPlugin._update_metrics_and_loggers`` (the
        metrics' results published, the loggers called, ``strategy.experience``
        a logging view meanwhile), with the logging view of an evaluated
        experience made once and reused (:meth:`logging_view`)."""
        original_experience = strategy.experience
        if original_experience is not None:
            strategy.experience = self.logging_view(original_experience, strategy)
        try:
            if not self._active:
                return []
            for metric in self.metrics:
                if hasattr(metric, callback):
                    metric_result = getattr(metric, callback)(strategy)
                    if isinstance(metric_result, Sequence):
                        for mval in metric_result:
                            self.publish_metric_value(mval)
                    elif metric_result is not None:
                        self.publish_metric_value(metric_result)
            for logger in self.loggers:
                logger.log_metrics(self._metric_values)
                if hasattr(logger, callback):
                    getattr(logger, callback)(strategy, self._metric_values)
            self._metric_values = []
        finally:
            strategy.experience = original_experience
        return None

    def logging_view(self, experience: Any, strategy: Any) -> Any:
        """``experience.logging()``: Avalanche makes this copy of the experience
        in every callback (about 14 us; two per evaluated experience). In
        evaluation the copy of each experience is kept and reused for as long
        as the experience's attributes are the same objects as when it was
        made (an experience given a new attribute value gets a new view;
        :class:`fedaval.object_cache.ObjectCache`), never pickled.
        In training a new copy is made every time, as Avalanche does."""
        if strategy.is_training:
            return experience.logging()
        _, view = ObjectCache.of(self, "_logging_views").get(
            experience,
            lambda exp: (dict(vars(exp)), exp.logging()),
            valid=lambda kept: same_attributes(experience, kept[0]),
        )
        return view


def same_attributes(obj: Any, attributes: dict[str, Any]) -> bool:
    """Whether ``obj``'s instance attributes are the very objects in ``attributes``."""
    current = vars(obj)
    return len(current) == len(attributes) and all(
        current.get(name, _MISSING) is value for name, value in attributes.items()
    )


_MISSING = object()


def _evaluator_callback(name: str):
    def callback(self: MetricsEvaluator, strategy: Any, **kwargs: Any) -> None:
        if name in self.callbacks:
            self._update_metrics_and_loggers(strategy, name)

    callback.__name__ = callback.__qualname__ = name
    return callback


for _name in CALLBACKS:
    if _name not in vars(EvaluationPlugin):  # its before_eval also checks the stream (strict_checks)
        setattr(MetricsEvaluator, _name, _evaluator_callback(_name))


class PredictionRecorder(SupervisedPlugin):
    """Keeps the predicted classes and labels of the last ``eval()`` call of a
    strategy, so figures computed from predictions (A_glo, stability,
    plasticity) need no second pass over the test data."""

    def __init__(self):
        super().__init__()
        self._predicted: list = []
        self._labels: list = []

    def before_eval(self, strategy, **kwargs):
        self._predicted, self._labels = [], []

    def after_eval_iteration(self, strategy, **kwargs):
        self.record(strategy.mb_output.argmax(dim=1), strategy.mb_y)

    def record(self, predicted, labels) -> None:
        """Keep ``predicted`` classes and ``labels`` of evaluated samples
        (``fedaval.one_pass_eval`` gives those of a whole evaluation at once)."""
        self._predicted.append(predicted)
        self._labels.append(labels)

    def predictions(self):
        """``(predicted, labels)`` of the last evaluation, on the CPU."""
        import torch

        if not self._labels:
            return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
        return torch.cat(self._predicted).cpu(), torch.cat(self._labels).cpu()


def accuracy_on(predicted, labels, classes) -> float | None:
    """Accuracy over the samples whose label is in ``classes`` (None if there are none)."""
    import torch

    if not classes:
        return None
    mask = torch.isin(labels, torch.as_tensor(sorted(classes), dtype=labels.dtype))
    if not bool(mask.any()):
        return None
    return float((predicted[mask] == labels[mask]).float().mean())


def class_mix_accuracy(predicted, labels, weights: dict[int, float]) -> float | None:
    """``sum_c w_c acc_c / sum_c w_c`` over the classes of ``weights`` that
    have samples in ``labels``, ``acc_c`` the accuracy on class ``c``'s
    samples: the expected accuracy on test data whose classes come in the
    proportions ``weights`` (None if no class has a sample)."""
    total = weighted = 0.0
    for c, w in weights.items():
        mask = labels == c
        if w > 0 and bool(mask.any()):
            weighted += w * float((predicted[mask] == c).float().mean())
            total += w
    return weighted / total if total else None


def client_accuracy_on(run: Run, client: Any, predicted, labels) -> float | None:
    """``client``'s accuracy from predictions on test samples, as
    ``--client-test`` reads it: ``test``, the accuracy over the samples of
    the classes it has seen (the test split's class mix); ``train``, each
    seen class's accuracy weighted by the client's share of training samples
    of that class over the stages it trained (:meth:`Client.train_class_mix`)."""
    if run.config.client_test == "train":
        return class_mix_accuracy(predicted, labels, client.train_class_mix())
    return accuracy_on(predicted, labels, client.seen_classes())


def mean_or_none(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def continual_utility(stability: float | None, plasticity: float | None, lam: float) -> float | None:
    """FedProK's U = lambda * A_prev + (1 - lambda) * A_cur; None before there is a previous task."""
    if stability is None or plasticity is None:
        return None
    return lam * stability + (1 - lam) * plasticity


def scalar(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def forgetting(matrix: list[list[float | None] | None]) -> float | None:
    """Average forgetting (the "forgetting measure" of Chaudhry et al.,
    "Riemannian Walk for Incremental Learning", ECCV 2018) from an accuracy
    matrix: ``matrix[l][j]`` is the accuracy on the
    classes of stage j after stage l (rows grow by one column per stage;
    ``None`` where stage j brought no class new to the federation). With T
    the last row,

        f_j = max over l < T of a[l][j]  -  a[T][j],     F = mean over j < T of f_j,

    over the columns j that have a value in the last row and in an earlier
    one. ``None`` with fewer than two rows or no such column."""
    rows = [r for r in matrix if r is not None]
    if len(rows) < 2:
        return None
    last = rows[-1]
    drops = []
    for j in range(len(last) - 1):
        earlier = [v for r in rows[:-1] if j < len(r) and (v := r[j]) is not None]
        final = last[j]
        if final is not None and earlier:
            drops.append(max(earlier) - final)
    return mean_or_none(drops)


def backward_transfer(matrix: list[list[float | None] | None]) -> float | None:
    """Backward transfer (Lopez-Paz and Ranzato, "Gradient Episodic Memory
    for Continual Learning", NeurIPS 2017): BWT = mean over j < T of a[T][j] - a[j][j], over the
    columns with both values (``None`` entries, see :func:`forgetting`, are
    skipped). Negative: forgetting. ``None`` when no column qualifies."""
    rows = [r for r in matrix if r is not None]
    if len(rows) < 2:
        return None
    last = rows[-1]
    changes = []
    for j in range(min(len(last) - 1, len(rows) - 1)):
        final, then = last[j], rows[j][j] if j < len(rows[j]) else None
        if final is not None and then is not None:
            changes.append(final - then)
    return mean_or_none(changes)


def _mean_of(rounds: list[dict[str, Any]], key: str) -> float | None:
    return mean_or_none(r.get(key) for r in rounds)


def summarise(
    rounds: list[dict[str, Any]], matrix: list[list[float | None] | None], federation_model: str = "global"
) -> dict[str, Any]:
    """The ``final`` block of results.json. Global-model figures are ``None``
    for a method whose federation model is its clients' models
    (``federation_model == "clients"``, see
    :func:`fedaval.hookspecs.fedaval_federation_model`).

    * ``accuracy``: global model's accuracy on every class seen, after the
      last evaluated round;
    * ``average_accuracy``: mean over stages of that accuracy at each stage's
      end (average incremental accuracy, Rebuffi et al. 2017);
    * ``forgetting`` / ``bwt``: :func:`forgetting` and
      :func:`backward_transfer` of ``accuracy_matrix``;
      ``avalanche_forgetting`` / ``avalanche_bwt``: Avalanche's
      ``StreamForgetting`` / ``StreamBWT`` at the last evaluation;
    * ``mean_client_accuracy``: mean of the clients' own accuracies after the
      last evaluated round; ``average_client_accuracy``: its mean over the
      stages' ends;
    * ``a_glo``, ``a_loc``: at the last evaluated round (GLDP);
    * ``utility``, ``stability``, ``plasticity``: means over the stages' ends
      where U is defined (a previous stage exists), FedProK's reading (Sec. 4:
      stability and plasticity are "averaged accuracy ... during the entire
      training", each taken "after the completion of training on task t");
      until session 20 the mean was over every evaluated round, mid-stage
      ones too; ``*_last``: the last evaluated round's values;
    * ``efficiency``: FedProK's E = (tau1 + tau2) / R, seconds per round:
      ``efficiency_computation`` (clients' local training plus fusion, no
      evaluation) plus ``efficiency_communication`` (bytes sent at
      ``--link-mbps``);
    * totals of bytes and seconds (``seconds`` includes evaluation)."""
    evaluated = [r for r in rounds if "mean_client_accuracy" in r]
    task_ends = [r for r in evaluated if r.get("task_end")]
    last = evaluated[-1] if evaluated else {}
    with_utility = [r for r in task_ends if r.get("utility") is not None]
    own_matrix = None if all(row is None for row in matrix) else matrix
    compute = _mean_of(rounds, "seconds_computation")
    communication = _mean_of(rounds, "seconds_communication")
    return {
        "federation_model": federation_model,
        "accuracy": last.get("global_accuracy"),
        "average_accuracy": mean_or_none(r.get("global_accuracy") for r in task_ends),
        "forgetting": forgetting(matrix),
        "bwt": backward_transfer(matrix),
        "avalanche_forgetting": last.get("avalanche_forgetting"),
        "avalanche_bwt": last.get("avalanche_bwt"),
        "mean_client_accuracy": last.get("mean_client_accuracy"),
        "average_client_accuracy": mean_or_none(r.get("mean_client_accuracy") for r in task_ends),
        "a_glo": last.get("a_glo"),
        "a_loc": last.get("a_loc"),
        "utility": _mean_of(with_utility, "utility"),
        "stability": _mean_of(with_utility, "stability"),
        "plasticity": _mean_of(with_utility, "plasticity"),
        "utility_last": last.get("utility"),
        "stability_last": last.get("stability"),
        "plasticity_last": last.get("plasticity"),
        "accuracy_matrix": own_matrix,
        "efficiency": None if compute is None or communication is None else compute + communication,
        "efficiency_computation": compute,
        "efficiency_communication": communication,
        "bytes_up": sum(r["bytes_up"] for r in rounds),
        "bytes_down": sum(r["bytes_down"] for r in rounds),
        "seconds": sum(r["seconds"] for r in rounds),
        "rounds": len(rounds),
        "failed_clients": sum(len(r.get("failed_clients", [])) for r in rounds),
    }
