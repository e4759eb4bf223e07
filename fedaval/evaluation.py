"""Avalanche's metrics for the global model and every client, in TensorBoard
and results.json.

Metric keys are Avalanche's (``Top1_Acc_Stream/eval_phase/test_stream``)
with the owner appended (``.../global``, ``.../client003``), so TensorBoard
groups one metric's curves for the server and every client together. The
x axis is the federated round (1-based).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
    and the federated round as the step."""

    def __init__(self, run: Run, owner_tag: str):
        super().__init__(tb_log_dir=str(run.out_dir / "tb"), filename_suffix="." + owner_tag)
        self.run = run
        self.owner_tag = owner_tag

    def log_single_metric(self, name, value, x_plot):
        super().log_single_metric(f"{name}/{self.owner_tag}", value, self.run.round)


def make_evaluator(run: Run, owner_tag: str) -> EvaluationPlugin:
    """Accuracy, forgetting and BWT per experience and over the stream."""
    loggers = [RoundTensorboardLogger(run, owner_tag)] if run.out_dir is not None else []
    return EvaluationPlugin(
        accuracy_metrics(experience=True, stream=True),
        forgetting_metrics(experience=True, stream=True),
        bwt_metrics(experience=True, stream=True),
        loggers=loggers,
        strict_checks=False,
    )


def predict(run: Run, model, owner: int | None, images, labels, batch_size: int = 512):
    """Predicted classes of ``model`` (through ``fedaval_classify``, as the
    strategies predict) for a whole split, plus the labels, on the CPU."""
    import torch

    from fedaval.datasets import TensorImageDataset

    dataset = TensorImageDataset(images, labels, range(len(labels)), run.data.mean, run.data.std)
    was_training = model.training
    model.eval()
    out = []
    with torch.no_grad():
        for start in range(0, len(dataset), batch_size):
            x = torch.stack([dataset[i][0] for i in range(start, min(start + batch_size, len(dataset)))])
            features = model.features(x.to(run.device))
            logits = run.hook.fedaval_classify(run=run, owner=owner, model=model, features=features, training=False)
            logits = model.classifier(features) if logits is None else logits
            out.append(logits.argmax(dim=1).cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


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


def atomic_write_json(path: Path, data: Any) -> None:
    """Write to a temporary file and rename, so a kill never leaves a torn file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=False)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


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
