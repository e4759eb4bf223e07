"""How far FedProK can go under fedaval's reading of its freezing: the
extractor of task 0, frozen, with the best linear classifier there is on it.

FedProK freezes the feature extractor "when new data arrives" (Sec. 5.1;
fedaval's reading 5: from task index 1 on, the fusion of task 0's last
round). From then on only the linear classifier learns, from real features
of the current task and translated features of the old ones. So no
classifier FedProK fits can beat the one fitted on the *real* features of
every class at once, on that same frozen extractor: a joint linear probe,
which is what this plugin measures. At task 0's end it takes the global
model's extractor, extracts the features of the whole training set (every
class of the dataset, all the clients' data pooled), fits a linear
classifier on them to convergence (``fedprok_math.fit_head``: full-batch
L-BFGS, the run's weight decay as the L2 term, at most 1,000 iterations,
from zero weights) and reports its accuracy on the whole test set, in
``plugin_metrics.probe`` of that round's rounds.jsonl record. The probe
draws nothing from any random stream (it reads the tensors in order, with
no DataLoader), so the run it sits in is the run without it.

Added to a table row as a third-party plugin (the row's FedProK run is
unchanged; ``-p`` on the command line replaces the config's plugins)::

    PYTHONPATH=benchmarks fedaval train --config configs/repro-fedprok-table1.toml \\
        -p fedprok -p fedprok_ceiling:LinearProbe --seeds 42 --out runs/ceiling
    python benchmarks/fedprok_ceiling.py runs/ceiling-s42 ...     # the table

The table: each run's final global accuracy (FedProK's number) beside the
probe's, with the probe's accuracy per task.

:class:`GapProbe` (``-p fedprok_ceiling:GapProbe``, the same way) splits
what is left between FedProK's global model and that ceiling, at the end of
every task from task 1 on: what the translated features cost against real
ones, and what fitting the classifier apart on each client and averaging it
costs (its docstring). ``python benchmarks/fedprok_ceiling.py RUNS`` prints
its table too, for the runs that have it.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch

from fedaval import hookimpl
from fedaval.datasets import TensorImageDataset
from fedaval.plugins.fedprok_math import Translation, fit_head, translate_features

BATCH = 500


def features_of(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, mean, std, device) -> torch.Tensor:
    """``model.features`` of ``images``, normalised by the run's own dataset
    class (:meth:`fedaval.datasets.TensorImageDataset.batch`), in eval mode,
    in order (no DataLoader: nothing is drawn from a random stream)."""
    dataset = TensorImageDataset(images, labels, range(len(images)), mean, std)
    model.eval()
    out = []
    with torch.no_grad():
        for i in range(0, len(images), BATCH):
            x, _ = dataset.batch(torch.arange(i, min(i + BATCH, len(images))), images, labels)
            out.append(model.features(x.to(device)).flatten(1).cpu())
    return torch.cat(out)


def no_translation(width: int) -> Translation:
    """A plan that translates nothing: ``fit_head`` on it is plain L2-regularised
    multinomial logistic regression on the real features."""
    return Translation(
        targets=torch.zeros(0, dtype=torch.long),
        shifts=torch.zeros(0, width),
        bases=torch.tensor([-1]),
        slots=torch.tensor([[-1]]),
    )


def probe(
    model: torch.nn.Module, data, tasks: list[list[int]], l2: float, device, max_steps: int = 1000
) -> dict[str, float]:
    """The joint linear probe of ``model``'s extractor on ``data``
    (:class:`fedaval.datasets.ImageData`): test accuracy overall and on each
    task's classes (``tasks``: the classes new at each task), the fit's
    iterations."""
    extractor = copy.deepcopy(model).to(device)
    train = features_of(extractor, data.train_x, data.train_y, data.mean, data.std, device)
    test = features_of(extractor, data.test_x, data.test_y, data.mean, data.std, device)
    head, steps = fit(train, data.train_y, data.num_classes, l2, max_steps)
    with torch.no_grad():
        right = head(test).argmax(1) == data.test_y
    metrics = {"accuracy": right.float().mean().item(), "steps": float(steps)}
    for t, classes in enumerate(tasks):
        metrics[f"task_{t}"] = right[torch.isin(data.test_y, torch.tensor(classes))].float().mean().item()
    return metrics


class LinearProbe:
    """At task 0's end: the joint linear probe of the global model's extractor
    (the extractor FedProK freezes), reported in ``plugin_metrics.probe``."""

    name = "probe"

    def __init__(self) -> None:
        self.result: dict[str, float] | None = None

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        if task == 0:
            tasks = run.federation_new_classes()
            self.result = probe(run.server.model, run.data, tasks, run.config.weight_decay, run.device)

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        result, self.result = self.result, None
        return result


def accuracy(head: torch.nn.Module, features: torch.Tensor, labels: torch.Tensor) -> float:
    with torch.no_grad():
        return (head(features).argmax(1) == labels).float().mean().item()


def pooled_set(
    parts: list[tuple[torch.Tensor, torch.Tensor, Translation | None]],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Every client's real current-task features with their labels, and
    their Eq. 8 translations by the client's own plan, in one set: the
    union of the clients' balanced sets (reading 8), each pseudo feature one
    sample, as in each client's own fit. Returns (features, labels, the
    number of real ones): :func:`fit_head` divides the cross-entropy's sum
    by the real features' number, so :func:`fit` is given it too."""
    features, labels = [], []
    for real, y, plan in parts:
        features.append(real)
        labels.append(y)
        if plan is not None:
            pseudo, targets, valid = translate_features(real, y, plan)
            features.append(pseudo[valid])
            labels.append(targets[valid])
    return torch.cat(features), torch.cat(labels), sum(len(y) for _, y, _ in parts)


def fit(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    l2: float,
    max_steps: int = 1000,
    per: int | None = None,
):
    """An L2-regularised multinomial logistic regression on ``features``,
    from zero weights, to convergence (:func:`fit_head` with no
    translation): ``sum CE / per + l2 / 2 |params|^2``, ``per`` the number
    of samples unless given. (``fit_head`` divides by the number of samples;
    the same minimum with ``per`` is its objective with ``l2 * per / N``.)"""
    head = torch.nn.Linear(features.shape[1], num_classes).to(features.device)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    if per is not None:
        l2 = l2 * per / max(len(labels), 1)
    plan = no_translation(features.shape[1]).to(features.device)
    _, steps = fit_head(head, features, labels, plan, l2, max_steps)
    return head, steps


class GapProbe:
    """Where FedProK's global model falls short of the frozen extractor's
    ceiling, at the end of every task from task 1 on (the extractor frozen),
    in ``plugin_metrics.gap`` of that round's record. All on the seen
    classes' test set, with the global model's (frozen) extractor:

    * ``global``: the global model, whose head is the mean of the clients'
      last fits (``weighting=uniform``; with ``samples`` their
      sample-weighted mean);
    * ``client_<k>``: client ``k``'s own last fit (its head before fusion);
    * ``pooled``: one head fit to convergence on the union of every client's
      balanced set (its real current-task features and their translations by
      its own plan): FedProK's objective as one centralised fit, with nothing
      averaged;
    * ``ceiling``: one head fit on the *real* training features of every seen
      class (the joint probe of :class:`LinearProbe`, at this task).

    So ``ceiling - pooled`` is what the translated features cost against real
    ones, and ``pooled - global`` what fitting apart and averaging the heads
    costs. Like :class:`LinearProbe` it draws from no random stream: the run
    it sits in is the run without it."""

    name = "gap"
    #: L-BFGS iterations at most for its two fits, from zero weights: on ResNet-18's features 1,000
    #: did not reach convergence (the CPU-scale run of session 27 stopped at the cap at task 1's end)
    max_steps = 5000

    def __init__(self) -> None:
        self.result: dict[str, float] | None = None

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        if task < 1:
            return
        from fedaval.plugins.fedprok import FITTED
        from fedaval.prototypes import extract_features

        fedprok = run.plugins.objects["fedprok"]
        model = copy.deepcopy(run.server.model)  # features_of leaves it in eval mode
        seen = torch.tensor(run.federation_seen_classes())
        l2 = run.config.weight_decay
        keep = torch.isin(run.data.test_y, seen)
        test_y = run.data.test_y[keep]
        test = features_of(model, run.data.test_x[keep], test_y, run.data.mean, run.data.std, run.device)
        test, test_y = test.to(run.device), test_y.to(run.device)  # the fits run on the run's device
        metrics = {"global": accuracy(model.classifier, test, test_y)}
        parts = []
        for client in run.clients:
            exp = client.train_stream[task] if client.has_task(task) else None
            if exp is None:
                continue
            real, y = extract_features(client.model, exp.dataset, run.device, run=run)
            plan = fedprok.plan(client)
            parts.append((real, y, plan))
            fitted = client.stash.get(FITTED)
            if fitted is not None and fitted[0] == task:
                head = copy.deepcopy(model.classifier)
                head.load_state_dict(fitted[1])
                metrics[f"client_{client.id}"] = accuracy(head, test, test_y)
        features, labels, real = pooled_set(parts)
        head, steps = fit(features, labels, run.num_classes, l2, self.max_steps, per=real)
        metrics["pooled"], metrics["pooled_steps"] = accuracy(head, test, test_y), float(steps)
        where = torch.isin(run.data.train_y, seen)
        train_y = run.data.train_y[where]
        train = features_of(model, run.data.train_x[where], train_y, run.data.mean, run.data.std, run.device)
        head, steps = fit(train.to(run.device), train_y.to(run.device), run.num_classes, l2, self.max_steps)
        metrics["ceiling"], metrics["ceiling_steps"] = accuracy(head, test, test_y), float(steps)
        self.result = metrics

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        result, self.result = self.result, None
        return result


def records(folder: str, key: str) -> list[tuple[dict, dict]]:
    """(record, its ``plugin_metrics[key]``) of each round of the run in
    ``folder`` that has one."""
    rounds = [json.loads(line) for line in Path(folder, "rounds.jsonl").read_text().splitlines() if line]
    return [(r, r["plugin_metrics"][key]) for r in rounds if r.get("plugin_metrics", {}).get(key)]


def summarise(folders: list[str]) -> str:
    """The table of the runs in ``folders`` (each holding rounds.jsonl and
    results.json of a run with the probe)."""
    lines = [
        "| run | final acc | joint linear probe, task-0 extractor | probe per task | L-BFGS iterations |",
        "|---|---:|---:|---|---:|",
    ]
    for folder in folders:
        probed = [p for _, p in records(folder, "probe")]
        if not probed:
            lines.append(f"| {folder} | | no probe recorded | | |")
            continue
        p = probed[0]
        final = json.loads(Path(folder, "results.json").read_text()).get("final", {}).get("accuracy")
        per_task = [p[k] for k in sorted((k for k in p if k.startswith("task_")), key=lambda k: int(k[5:]))]
        lines.append(
            f"| {Path(folder).name} | {'n/a' if final is None else f'{100 * final:.2f}'} | "
            f"{100 * p['accuracy']:.2f} | {' / '.join(f'{100 * a:.1f}' for a in per_task)} | {int(p['steps'])} |"
        )
    return "\n".join(lines)


def summarise_gap(folders: list[str]) -> str:
    """The table of :class:`GapProbe`'s records in ``folders``: at each
    task's end, the ceiling, the pooled fit, the global model and the mean
    of the clients' own fits (test accuracy on the seen classes, %), and the
    gap's two parts."""
    lines = [
        "| run | task | ceiling | pooled fit | global model | clients' own fits (mean) "
        "| translation (ceiling - pooled) | averaging (pooled - global) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for folder in folders:
        for record, gap in records(folder, "gap"):
            clients = [v for k, v in gap.items() if k.startswith("client_")]
            own = f"{100 * sum(clients) / len(clients):.2f}" if clients else "n/a"
            lines.append(
                f"| {Path(folder).name} | {record['task']} | {100 * gap['ceiling']:.2f} | {100 * gap['pooled']:.2f} "
                f"| {100 * gap['global']:.2f} | {own} | {100 * (gap['ceiling'] - gap['pooled']):+.2f} "
                f"| {100 * (gap['pooled'] - gap['global']):+.2f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    runs = sys.argv[1:]
    gapped = [f for f in runs if records(f, "gap")]
    print(summarise([f for f in runs if f not in gapped or records(f, "probe")]))
    if gapped:
        print()
        print(summarise_gap(gapped))
