"""Avalanche's metrics for the global model and every client, in TensorBoard
and results.json.

Metric keys are Avalanche's (``Top1_Acc_Stream/eval_phase/test_stream``)
with the owner appended (``.../global``, ``.../client003``), so TensorBoard
groups one metric's curves for the server and every client together. The
x axis is the federated round (1-based).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from avalanche.core import SupervisedPlugin
from avalanche.evaluation.metrics import accuracy_metrics, bwt_metrics, forgetting_metrics
from avalanche.logging import TensorboardLogger
from avalanche.training.plugins import EvaluationPlugin

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
        super().__init__(tb_log_dir=str(run.out_dir / "tb"))

    def _make_writer(self, tb_log_dir, filename_suffix):
        return run_writer(self.run)

    def log_single_metric(self, name, value, x_plot):
        super().log_single_metric(f"{name}/{self.owner_tag}", value, self.run.round)


def run_writer(run: Run):
    """The run's ``SummaryWriter`` (created on first use, closed with the run)."""
    import weakref

    from torch.utils.tensorboard import SummaryWriter

    writer = run.tb_writer
    if writer is None:
        writer = run.tb_writer = SummaryWriter(str(run.out_dir / "tb"))
        weakref.finalize(run, SummaryWriter.close, writer)
    return writer


def client_accuracies(run: Run, round: int) -> dict[int, float | None]:
    """Each started client's stream accuracy on its seen classes. Clients
    trained since their last evaluation are evaluated now (inside
    ``fedaval_client_evaluate``, in their own random streams); the others keep
    their last result. Runs on the driver whatever the backend: evaluation
    reads server state (GLDP's newest prototypes) that only the driver has."""
    accuracies = {}
    for client in run.clients:
        if not client.tasks_started:
            continue
        if client.trained_at > client.evaluated_at:
            with client.rng_scope():
                client.last_eval = run.hook.fedaval_client_evaluate(run=run, client=client) or {}
            client.evaluated_at = round
        if client.last_eval:
            accuracies[client.id] = scalar(client.last_eval, STREAM_ACC)
    return accuracies


def make_evaluator(run: Run, owner_tag: str) -> EvaluationPlugin:
    """Accuracy, forgetting and BWT per experience and over the stream."""
    loggers = [RoundTensorboardLogger(run, owner_tag)] if run.out_dir is not None else []
    if loggers:
        run.loggers[owner_tag] = loggers[0]  # saved state refers to it by name (fedaval.state)
    return EvaluationPlugin(
        accuracy_metrics(experience=True, stream=True),
        forgetting_metrics(experience=True, stream=True),
        bwt_metrics(experience=True, stream=True),
        loggers=loggers,
        strict_checks=False,
    )


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
        self._predicted.append(strategy.mb_output.argmax(dim=1))
        self._labels.append(strategy.mb_y)

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


def summarise(rounds: list[dict[str, Any]], matrix: list[list[float | None]]) -> dict[str, Any]:
    """The ``final`` block of results.json.

    * ``accuracy``: global accuracy on all classes seen, after the last round;
    * ``average_accuracy``: mean over tasks of that accuracy at each task's end
      (average incremental accuracy);
    * ``forgetting``: Avalanche's stream forgetting at the end (mean over past
      tasks of best-at-the-time minus final accuracy);
    * totals of bytes and seconds."""
    evaluated = [r for r in rounds if r.get("global_accuracy") is not None]
    task_ends = [r for r in evaluated if r.get("task_end")]
    last = evaluated[-1] if evaluated else {}
    return {
        "accuracy": last.get("global_accuracy"),
        "average_accuracy": (
            sum(r["global_accuracy"] for r in task_ends) / len(task_ends) if task_ends else None
        ),
        "forgetting": last.get("forgetting"),
        "bwt": last.get("bwt"),
        "mean_client_accuracy": last.get("mean_client_accuracy"),
        "a_glo": last.get("a_glo"),
        "a_loc": last.get("a_loc"),
        "utility": last.get("utility"),
        "stability": last.get("stability"),
        "plasticity": last.get("plasticity"),
        "accuracy_matrix": matrix,
        "bytes_up": sum(r["bytes_up"] for r in rounds),
        "bytes_down": sum(r["bytes_down"] for r in rounds),
        "seconds": sum(r["seconds"] for r in rounds),
        "rounds": len(rounds),
        "failed_clients": sum(len(r.get("failed_clients", [])) for r in rounds),
    }
