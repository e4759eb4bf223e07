"""Coordinator overhead: `fedaval train` against a plain PyTorch loop doing
the same FedAvg work, in one invocation.

    python benchmarks/overhead.py                       # CIFAR-10 subset, cnn (the default)
    python benchmarks/overhead.py --dataset digits      # the worst case: a model too small to hide anything

Same work on both sides: the same partition and client sampling (fedaval's
scenario function, the run's seed), the same initial model, the same
minibatches in the same order (each client's own random stream, drawn the way
fedaval's data loaders draw it), no augmentation (fedaval's ``--augment none``;
its default, ``auto``, crops and flips CIFAR-10 and small image folders), the
same number of optimiser steps, FedAvg
with the same weights, and the same evaluation after every round (the global
model on the test samples of every class seen so far, each client trained
since its last evaluation on its seen classes). The benchmark checks the work
was the same: both final global models must agree (max |difference| printed).

fedaval's side is `fedaval.api.run_training` (what `fedaval train` calls),
with everything a run does by default: rounds.jsonl after every round, results.json on its schedule,
TensorBoard events, a checkpoint after every round. Interpreter start-up and
imports are not timed on either side; data loading is timed on both.
Both sides run in this one process, so from fedaval's first run on both have
its ``--host-memory keep`` (freed host memory kept for reuse): the ratio
compares the frameworks alone; ``benchmarks/host_memory.py`` measures that
policy, and ``pfl_overhead.py`` gives each run a process of its own.

Prints the median wall time of each over ``--repeats`` alternating repeats and
their ratio, then where each side's seconds go (:data:`PHASES`: outside the
rounds, local training, fusion, evaluation, the rest of the rounds; medians
over the repeats, and their difference per round); ``--write`` puts the first
table in benchmarks/results/overhead.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from cifar_data import cifar_subset  # noqa: E402 - this folder, see cifar_data.py
from torch import nn

HERE = Path(__file__).resolve().parent


def run_config(args, out: Path):
    from fedaval.config import RunConfig

    return RunConfig(
        plugins=["fedavg"],
        scenario="fcil-sync",
        scenario_options={"clients": args.clients, "tasks": args.tasks, "alpha": args.alpha},
        dataset=args.dataset,
        data_root=args.data_root,
        model=args.model,
        rounds_per_task=args.rounds_per_task,
        clients_per_round=args.clients_per_round,
        local_epochs=args.local_epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=0.0,  # the plain loop's SGD has no momentum
        augment="none",  # nor augmentation (--augment auto is crop+flip on CIFAR-10 and image folders)
        host_memory=getattr(args, "host_memory", "keep"),  # benchmarks/host_memory.py sets it
        device=args.device,
        seed=args.seed,
        out=str(out),
    )


CROSS_DEVICE_ALPHA = 1e6  # fcil-sync's Dirichlet shares all but equal: every client gets the same images per class
# pfl_overhead.py's cross-device shape: its --cd-* options' defaults
CROSS_DEVICE = {"cd_clients": 1000, "cd_images": 50, "cd_per_round": 50, "cd_rounds": 200, "cd_batch": 10}
CROSS_DEVICE["cd_test_per_class"] = 10


def shape_work(args, shape: str) -> argparse.Namespace:
    """The work options of one of ``pfl_overhead.py``'s shapes (``run_config``
    and its ``time_pfl`` read them; :func:`cross_device_work` gives the
    cross-device one), its data subset made."""
    work = copy.copy(args)
    work.device = "cpu"
    if shape == "long-task":
        work.tasks, work.rounds_per_task = 1, args.long_rounds
    elif shape == "cross-device":
        work.clients, work.clients_per_round, work.tasks = args.cd_clients, args.cd_per_round, 1
        work.rounds_per_task, work.batch_size, work.alpha = args.cd_rounds, args.cd_batch, CROSS_DEVICE_ALPHA
        if args.dataset == "imagefolder" and args.data_root is None:
            total = args.cd_clients * args.cd_images
            if total % 10 or total > 50_000:
                raise SystemExit(f"--cd-clients x --cd-images = {total} must be a multiple of 10, at most 50000")
            work.train_per_class, work.test_per_class = total // 10, args.cd_test_per_class
    work.data_text = work.dataset
    if args.dataset == "imagefolder" and args.data_root is None:
        work.data_root = str(cifar_subset(work.train_per_class, work.test_per_class))
        work.data_text = (
            f"shared CIFAR-10, first {work.train_per_class} train / {work.test_per_class} test images per class"
        )
    return work


def cross_device_work(clients: int, rounds: int) -> argparse.Namespace:
    """The cross-device shape's work (:data:`CROSS_DEVICE`) with ``clients``
    clients (at most 50 sampled a round) and ``rounds`` rounds, for the
    benchmarks that take it apart (checkpoint_cost.py, build_cost.py, pfl_phases.py)."""
    parser = argparse.ArgumentParser()
    add_work_arguments(parser)
    args = parser.parse_args([])
    vars(args).update(CROSS_DEVICE)
    args.cd_clients, args.cd_per_round, args.cd_rounds = clients, min(args.cd_per_round, clients), rounds
    return shape_work(args, "cross-device")


# --- fedaval ----------------------------------------------------------------
PHASES = ("outside the rounds", "local training", "fusion", "evaluation", "rest of the rounds")
"""Where a run's seconds go, printed beside the ratio. fedaval's side reads
them from its rounds.jsonl (``seconds_local``, ``seconds_fusion``,
``seconds_eval``, and what else its rounds' ``seconds`` hold); outside the
rounds are building the run, each round's writes (rounds.jsonl, results.json
on its schedule, TensorBoard) and checkpoint snapshots, and finishing. The
plain loop takes the time at the same boundaries: set-up (outside the
rounds); receiving, training and uploading; the average; the evaluation. On a
GPU neither side waits at a boundary it would not wait at anyway, so kernels
queued in one phase may run in the next."""


def fedaval_phases(out: Path, seconds: float) -> dict[str, float]:
    """:data:`PHASES` of the fedaval run in ``out`` that took ``seconds`` in all."""
    records = [json.loads(line) for line in (out / "rounds.jsonl").read_text().splitlines() if line]
    local, fusion, evaluation = (
        sum(r[key] for r in records) for key in ("seconds_local", "seconds_fusion", "seconds_eval")
    )
    rounds = sum(r["seconds"] for r in records)
    return {
        "outside the rounds": seconds - rounds,
        "local training": local,
        "fusion": fusion,
        "evaluation": evaluation,
        "rest of the rounds": rounds - local - fusion - evaluation,
    }


class Laps:
    """The plain loop's :data:`PHASES`: each :meth:`lap` adds the time since the last one to a phase."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self.last
        self.last = now


def time_fedaval(args, out: Path, phases: dict[str, float] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """fedaval's seconds and final global model; ``phases``, when given, is
    filled with :func:`fedaval_phases`."""
    from fedaval import hookimpl
    from fedaval.api import run_training

    class Keep:
        """Keeps the run, to read its final global model."""

        @hookimpl
        def fedaval_setup(self, run):
            self.run = run

    keep = Keep()
    start = time.perf_counter()
    run_training(run_config(args, out), extra_plugins=[keep])
    seconds = time.perf_counter() - start
    if phases is not None:
        phases.update(fedaval_phases(out, seconds))
    return seconds, {k: v.detach().cpu().clone() for k, v in keep.run.server.model.state_dict().items()}


# --- the plain loop ------------------------------------------------------------
def draw(generator: torch.Generator) -> int:
    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


def shuffled(n: int, generator: torch.Generator) -> torch.Tensor:
    """One epoch's order, drawn as a shuffling torch DataLoader draws it: its
    iterator's base seed, then its RandomSampler's seed and permutation."""
    draw(generator)
    return torch.randperm(n, generator=torch.Generator().manual_seed(draw(generator)))


def normalise(x: torch.Tensor, mean, std) -> torch.Tensor:
    scale = 255.0 if x.dtype == torch.uint8 else 1.0
    mean = torch.tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    return (x.float() / scale - mean) / std


@torch.no_grad()
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor, data, batch: int = 256) -> float:
    model.eval()
    correct = 0
    for i in range(0, len(y), batch):
        correct += int((model(normalise(x[i : i + batch], data.mean, data.std)).argmax(1) == y[i : i + batch]).sum())
    return correct / max(len(y), 1)


def time_plain(args, phases: dict[str, float] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """The plain loop's seconds and final global model; ``phases``, when
    given, is filled with its :data:`PHASES`."""
    from fedaval.build import make_schedule
    from fedaval.datasets import load_dataset
    from fedaval.models import build_model
    from fedaval.scenarios.partition import fcil_sync

    start = time.perf_counter()
    laps = Laps()
    device = torch.device(
        "cpu"
        if args.device == "auto" and not torch.cuda.is_available()
        else "cuda"
        if args.device == "auto"
        else args.device
    )
    data = load_dataset(args.dataset, args.data_root, False)
    rng = np.random.default_rng(args.seed)
    partition = fcil_sync(data.train_y.numpy(), data.num_classes, args.clients, args.tasks, args.alpha, rng)
    schedule = make_schedule(partition, args.rounds_per_task, args.clients_per_round, rng)
    train_x, train_y = data.train_x.to(device), data.train_y.to(device)
    test_x, test_y = data.test_x.to(device), data.test_y.to(device)

    torch.manual_seed(args.seed)
    server = build_model(args.model, data.input_shape, data.num_classes).to(device)
    shared = [k for k, v in server.state_dict().items() if v.is_floating_point()]
    clients = []
    for k, tasks in enumerate(partition.clients):
        model = build_model(args.model, data.input_shape, data.num_classes).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.0, weight_decay=1e-4)
        client_seed = int(np.random.SeedSequence([args.seed, k]).generate_state(1)[0])
        clients.append(
            {
                "model": model,
                "optimizer": optimizer,
                "rng": torch.Generator().manual_seed(client_seed),
                "tasks": tasks,
                "seen": [],
                "trained": False,
            }
        )
    loss_fn = nn.CrossEntropyLoss()
    seen_global: list[int] = []
    laps.lap("outside the rounds")
    for task in range(partition.num_tasks):
        seen_global += [
            c for c in sorted({c for cl in partition.clients for c in cl.classes[task]}) if c not in seen_global
        ]
        for round in range(task * args.rounds_per_task + 1, (task + 1) * args.rounds_per_task + 1):
            global_state = {k: v.clone() for k, v in server.state_dict().items() if k in shared}
            uploads, weights = [], []
            for k in schedule[round - 1]:
                client = clients[k]
                model, optimizer, generator = client["model"], client["optimizer"], client["rng"]
                model.load_state_dict(global_state, strict=False)
                index = torch.as_tensor(client["tasks"].indices[task], device=device)
                if task not in client["seen"]:
                    client["seen"].append(task)
                model.train()
                for _ in range(args.local_epochs):
                    order = index[shuffled(len(index), generator).to(device)]
                    for i in range(0, len(order), args.batch_size):
                        batch = order[i : i + args.batch_size]
                        optimizer.zero_grad()
                        loss = loss_fn(model(normalise(train_x[batch], data.mean, data.std)), train_y[batch])
                        loss.backward()
                        optimizer.step()
                client["trained"] = True
                uploads.append({key: v.detach().clone() for key, v in model.state_dict().items() if key in shared})
                weights.append(len(index))
            laps.lap("local training")
            fused = {}
            for key in shared:  # sample-weighted average, accumulated in float64
                acc = torch.zeros_like(uploads[0][key], dtype=torch.float64)
                for upload, w in zip(uploads, weights):
                    acc += upload[key].to(torch.float64) * (w / sum(weights))
                fused[key] = acc.to(uploads[0][key].dtype)
            server.load_state_dict(fused, strict=False)
            laps.lap("fusion")
            # evaluation: the global model on every class seen, each freshly trained client on its own
            mask = torch.isin(test_y, torch.tensor(seen_global, device=device))
            accuracy(server, test_x[mask], test_y[mask], data)
            for client in clients:
                if client["trained"]:
                    classes = sorted({c for t in client["seen"] for c in client["tasks"].classes[t]})
                    for _t in sorted(client["seen"]):  # one pass per seen task, drawn like an eval loader
                        draw(client["rng"])
                    mask = torch.isin(test_y, torch.tensor(classes, device=device))
                    accuracy(client["model"], test_x[mask], test_y[mask], data)
                    client["trained"] = False
            laps.lap("evaluation")
    seconds = time.perf_counter() - start
    laps.lap("outside the rounds")
    state = {k: v.detach().cpu().clone() for k, v in server.state_dict().items()}
    if phases is not None:
        phases.update(laps.seconds)
    return seconds, state


def add_work_arguments(parser: argparse.ArgumentParser) -> None:
    """The options that define the FedAvg work (shared with flower_overhead.py)."""
    parser.add_argument("--dataset", default="imagefolder", help="imagefolder (shared CIFAR-10 subset) or digits")
    parser.add_argument("--data-root", default=None)
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--model", default="auto")
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument(
        "--alpha", type=float, default=1.0, help="fcil-sync's Dirichlet alpha (very large: equal shares)"
    )
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--clients-per-round", type=int, default=0, help="clients sampled per round (0: all)")
    parser.add_argument("--local-epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)


def resolve_data_root(args) -> None:
    """The shared CIFAR-10 subset when ``--dataset imagefolder`` has no ``--data-root``."""
    if args.dataset == "imagefolder" and args.data_root is None:
        args.data_root = str(cifar_subset(args.train_per_class, args.test_per_class))


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest |a - b| over the floating-point entries of two state dicts."""
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in b if b[k].is_floating_point())


def count_ops(args, out: Path) -> None:
    """``--count-ops``: each side's ATen operations a round (everything it
    does, divided by the rounds), by the file that ran them: on a GPU each
    is a kernel launch or more, which the host pays for whatever the work."""
    from op_count import OpCount

    rounds = args.tasks * args.rounds_per_task
    with OpCount() as fedaval_ops:
        time_fedaval(args, out)
    with OpCount() as plain_ops:
        time_plain(args)
    print(f"\nATen operations (each side's whole run over its {rounds} rounds, untimed; kernels: on a GPU):")
    for side, ops in (("fedaval", fedaval_ops), ("plain", plain_ops)):
        print(f"{side}: {ops.summary(rounds, 'round')}")
    more = (fedaval_ops.total_launches() - plain_ops.total_launches()) / rounds
    print(f"fedaval - plain: {more:,.1f} kernels a round")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_work_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--write", action="store_true", help="write benchmarks/results/overhead.md")
    parser.add_argument(
        "--profile", action="store_true", help="then one more fedaval run under cProfile: its top functions by own time"
    )
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="then one more run of each side, untimed, counting its ATen operations a round, by file",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    resolve_data_root(args)

    times = {"fedaval": [], "plain": []}
    phases: dict[str, list[dict[str, float]]] = {"fedaval": [], "plain": []}  # one dict per run
    difference = 0.0
    with tempfile.TemporaryDirectory(prefix="fedaval-overhead-") as tmp:
        time_plain(args)  # warm-up: decoded-image cache, allocator, lazy imports
        for repeat in range(args.repeats):
            for side in ("fedaval", "plain") if repeat % 2 == 0 else ("plain", "fedaval"):
                if side == "fedaval":
                    phases["fedaval"].append({})
                    seconds, state = time_fedaval(args, Path(tmp) / f"run{repeat}", phases["fedaval"][-1])
                    fedaval_state = state
                else:
                    phases["plain"].append({})
                    seconds, plain_state = time_plain(args, phases["plain"][-1])
                times[side].append(seconds)
            difference = max(difference, max_difference(fedaval_state, plain_state))
        if args.profile:  # where fedaval's side spends what the plain loop does not
            import cProfile
            import pstats

            profile = cProfile.Profile()
            profile.enable()
            time_fedaval(args, Path(tmp) / "profiled")
            profile.disable()
            print("cProfile of one more fedaval run, by own time:")
            pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        if args.count_ops:
            count_ops(args, Path(tmp) / "counted")
    fed, plain = statistics.median(times["fedaval"]), statistics.median(times["plain"])
    command = "python benchmarks/overhead.py" + (
        "" if not (argv or sys.argv[1:]) else " " + " ".join(argv or sys.argv[1:])
    )
    rows = [
        "| side | median s | all repeats s |",
        "|---|---|---|",
        f"| fedaval train | {fed:.3f} | {' '.join(f'{t:.3f}' for t in times['fedaval'])} |",
        f"| plain PyTorch loop | {plain:.3f} | {' '.join(f'{t:.3f}' for t in times['plain'])} |",
    ]
    summary = (
        f"ratio fedaval / plain: {fed / plain:.3f}   "
        f"max |global weight difference|: {difference:.2e} (the same work: identical data order and steps)"
    )
    print("\n".join(rows))
    print(summary)
    rounds = args.tasks * args.rounds_per_task
    print(f"\nwhere the seconds go (median of {args.repeats} runs each; PHASES in benchmarks/overhead.py):")
    print("| phase | fedaval s | plain s | fedaval - plain, ms a round |")
    print("|---|---|---|---|")
    for phase in PHASES:
        fed_part, plain_part = (statistics.median(run[phase] for run in phases[side]) for side in ("fedaval", "plain"))
        print(f"| {phase} | {fed_part:.3f} | {plain_part:.3f} | {(fed_part - plain_part) * 1000 / rounds:.1f} |")
    if args.write:
        setting = (
            f"{args.dataset} ({'shared CIFAR-10, first ' + str(args.train_per_class) + ' train / ' + str(args.test_per_class) + ' test images per class' if args.dataset == 'imagefolder' else 'built in'}), "
            f"model {args.model}, fcil-sync {args.clients} clients x {args.tasks} tasks, {args.rounds_per_task} rounds per task, "
            f"{args.local_epochs} local epoch(s), batch {args.batch_size}, device {args.device}, {args.threads} torch thread(s), seed {args.seed}"
        )
        text = (
            f"\n## {args.dataset}, {args.model}, {args.device}\n\nCommand: `{command}`\n"
            f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; machine: {platform.machine()}, "
            f"{os.cpu_count()} cores (shared with other jobs){'; GPU: ' + torch.cuda.get_device_name() if args.device.startswith('cuda') else ''}\n"
            f"Setting: {setting}.\n\n" + "\n".join(rows) + f"\n\n{summary}\n"
        )
        path = HERE / "results" / "overhead.md"
        header = "# Coordinator overhead: fedaval train vs a plain PyTorch loop\n\nWritten by `benchmarks/overhead.py --write`; one section per configuration.\n"
        old = path.read_text() if path.exists() else header
        path.write_text(old + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
