"""Samples per second of a fedaval round against what the device does for the model when kept busy.

    python benchmarks/round_throughput.py --device cuda              # ResNet-18, 10 clients x batch 32 vs batch 320
    python benchmarks/round_throughput.py --model cnn --rounds 3     # the CPU, the small CNN
    python benchmarks/round_throughput.py --device cuda --cuda-graphs both   # before and after, one invocation

The GPU issue's item 3: local training of a small model at batch 32 leaves
most of a GPU idle when clients train one after another. Two numbers, measured
in one invocation on the same device, one torch thread on the CPU:

* **fedaval**: FedAvg on the shared CIFAR-10 subset (``--train-per-class``
  images per class, split evenly over ``--clients`` clients by fcil-sync with
  one task and Dirichlet alpha 1e6), every client sampled every round, one
  local epoch at ``--batch-size`` 32, ``--augment none``, evaluation at the
  last round only, no checkpoint before it. Rounds after the first (which pays
  for cuDNN's autotuning and the allocator's growth) are timed; per round,
  the samples trained divided by the clients' local training seconds
  (``seconds_local``: the clients' ``train()`` calls, what the clients do to
  receive and upload included) and by the whole round's wall time (fusion
  included; evaluation excluded, since it only happens at the last round,
  which is not counted).
* **limit**: one plain PyTorch loop training the same model on the same
  images at batch ``--limit-batch`` (320: the 10 clients' minibatches
  stacked) with the same SGD, after one untimed warm-up epoch; samples per
  second over ``--limit-epochs`` epochs, with ``torch.cuda.synchronize()``
  around the timing on a GPU. It is what the hardware does for this model when
  it is kept busy, not work identical to fedaval's (a batch of 320 is one step
  where fedaval's clients take ten).

With ``--processes K`` fedaval's side is K fedaval runs at once, each in a
process of its own on the same device, each with ``--clients`` / K clients
and ``--train-per-class`` / K images per class (so every client still
trains the same 500 images a round): what a backend running a round's
clients in K worker processes on one GPU could reach at best (no transfer
of the clients' state, no scheduling). The rate is every process's samples
of its timed rounds over the span from the first one's start to the last
one's end (the processes wait for each other before their first round).
Each run fuses only its own clients: a measure of speed, not a federation.

With ``--cuda-graphs on`` (or ``both``: without, then with, in this one
invocation) fedaval's rounds run with ``--cuda-graphs``
(:mod:`fedaval.cuda_graphs`), with ``step`` with ``--cuda-graph-scope step``
as well (the whole step, SGD update included, one graph), and ``all`` runs
the three (``off+step``: without and with the step's); the first round also
pays for each client's captures, and is not timed.

With ``--client-streams K`` (or several, ``1,2,5``: each run in this
invocation) fedaval's rounds issue their clients on K CUDA streams
(:mod:`fedaval.cuda_streams`): kernels of several clients may run at once.

With ``--stack-clients on`` (or ``off,on``: without, then with, in this
invocation) fedaval's rounds run with ``--stack-clients``
(:mod:`fedaval.stacked`): the round's clients in lockstep, each training
step of all of them one ``torch.func.vmap`` computation.

With ``--compile BACKEND`` (or several, ``off,inductor``: each run in this
invocation, with each ``--cuda-graphs`` run) fedaval's rounds run with ``--compile`` (each
client's backbone through ``torch.compile``; with graphs, the step scope
only); the first round also pays for the compilation (one compiled function
for every client and both batch sizes), and is not timed.

Printed: both rates, their ratio (fedaval / limit; the issue's goal on the
GPU is at least 0.5), the device and the load average before and after.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

GRAPHS: dict[str, list[str | None]] = {
    "off": [None],
    "on": ["features"],
    "step": ["step"],
    "both": [None, "features"],
    "all": [None, "features", "step"],
    "off+step": [None, "step"],  # the two --compile allows
}
"""``--cuda-graphs``' values: the runs made, each without graphs (None) or with this ``--cuda-graph-scope``."""

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def limit_rate(data, model_name: str, batch: int, epochs: int, lr: float, device: torch.device) -> float:
    """Samples per second of a plain loop over ``data``'s training images at ``batch``."""
    from fedaval.models import build_model

    torch.manual_seed(0)
    model = build_model(model_name, data.input_shape, data.num_classes).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
    images, labels = data.train_x.to(device), data.train_y.to(device)
    scale = 255.0 if images.dtype == torch.uint8 else 1.0

    def epoch() -> int:
        order = torch.randperm(len(labels), device=device)
        for start in range(0, len(order), batch):
            index = order[start : start + batch]
            x = (images[index].float() / scale - mean) / std
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(x), labels[index]).backward()
            optimizer.step()
        return len(order)

    model.train()
    epoch()  # warm-up: cuDNN autotuning, the allocator
    sync(device)
    start = time.perf_counter()
    samples = sum(epoch() for _ in range(epochs))
    sync(device)
    return samples / (time.perf_counter() - start)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TorchProfile:
    """``--profile``: the torch profiler over fedaval's training (CPU, and the
    GPU's kernels on CUDA), in the ``enable``/``disable`` shape that
    :func:`timed_rounds.timed_rounds` drives."""

    def __init__(self, device: torch.device):
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.device = device
        self.profile = profile(activities=activities)

    def enable(self) -> None:
        self.profile.start()

    def disable(self) -> None:
        self.profile.stop()

    def print_tables(self, rows: int = 25) -> None:
        averages = self.profile.key_averages()
        print(f"torch profiler, all rounds, by self CPU time (top {rows}):")
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
        if self.device.type == "cuda":
            print(f"by self device time (top {rows}):")
            print(averages.table(sort_by="self_device_time_total", row_limit=rows))
        print(flush=True)


def fedaval_config(args, root: str, out: Path, graphs: str | None, clients: int):
    """The FedAvg run of the benchmark's fedaval side, ``clients`` clients on
    the images in ``root``; ``graphs``: None, or ``--cuda-graphs`` with this
    ``--cuda-graph-scope``."""
    from fedaval.api import check_settings
    from fedaval.config import RunConfig

    return check_settings(
        RunConfig(
            plugins=["fedavg"],
            scenario="fcil-sync",
            scenario_options={"clients": clients, "tasks": 1, "alpha": 1e6},
            dataset="imagefolder",
            data_root=root,
            model=args.model,
            rounds_per_task=args.rounds,
            local_epochs=1,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=0.9,
            augment="none",
            eval_every=args.rounds,
            checkpoint_every=str(args.rounds),
            device=args.device,
            cuda_graphs=graphs is not None,
            cuda_graph_scope=graphs or "features",
            precision=args.precision,
            channels_last=args.channels_last,
            compile=args.compile,
            client_streams=args.client_streams,
            stack_clients=args.stack_clients == "on",
            seed=0,
            out=str(out),
        )
    )


def fedaval_rates(args, root: str, out: Path, graphs: str | None = None) -> tuple[float, float, int]:
    """Median samples per second of the timed rounds: over local training, over
    the round's wall time; and the samples trained per round."""
    from timed_rounds import timed_rounds

    config = fedaval_config(args, root, out, graphs, args.clients)
    if args.profile == "torch":
        profile = TorchProfile(torch.device(args.device))
    elif args.profile == "python":
        import cProfile

        profile = cProfile.Profile()
    else:
        profile = None
    timed = timed_rounds(config, profile)
    if isinstance(profile, TorchProfile):
        profile.print_tables()
    elif profile is not None:
        import pstats

        print("cProfile of all rounds, by own time:")
        pstats.Stats(profile).sort_stats("tottime").print_stats(30)
        print("the same, by cumulative time (what each function's calls hold, its callees included):")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
    samples = sum(sum(c) for c in timed.results["scenario"]["client_task_samples"])  # one task, everyone trains
    # rounds 2 .. last-1: the first pays for warm-up, the last evaluates
    middle = list(zip(timed.walls, timed.records))[1:-1]
    if not middle:
        raise SystemExit("--rounds must be at least 3 (the first and the last round are not timed)")
    local = statistics.median(samples / r["seconds_local"] for _, r in middle)
    wall = statistics.median(samples / w for w, _ in middle)
    return local, wall, samples


def one_process(rank: int, args, graphs: str | None, barrier, results) -> None:
    """A child of ``--processes``: its own fedaval run (``--clients`` / K
    clients on ``--train-per-class`` / K images per class), its timed rounds'
    span and samples put on ``results``."""
    from cifar_data import cifar_subset
    from timed_rounds import timed_rounds

    torch.set_num_threads(args.threads)
    k = args.processes
    root = str(cifar_subset(args.train_per_class // k, 10))
    with tempfile.TemporaryDirectory(prefix=f"fedaval-throughput-{rank}-") as tmp:
        config = fedaval_config(args, root, Path(tmp) / "run", graphs, args.clients // k)
        timed = timed_rounds(config, before_training=barrier.wait)
    samples = sum(sum(c) for c in timed.results["scenario"]["client_task_samples"])
    ends = [timed.started + sum(timed.walls[: i + 1]) for i in range(len(timed.walls))]
    # rounds 2 .. last-1, as in one process: from the end of round 1 to the end of the last but one
    results.put((rank, ends[0], ends[-2], samples * (len(ends) - 2)))


def spawned(target, k: int, *args) -> list:
    """Run ``target(rank, *args, barrier, results)`` in ``k`` spawned
    processes, which wait for each other at ``barrier`` before their timed
    work and each put one item on ``results``; those items, in arrival order.
    A process that exits with an error stops the others and raises."""
    import queue

    context = torch.multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(k), context.Queue()
    children = [context.Process(target=target, args=(rank, *args, barrier, results)) for rank in range(k)]
    for child in children:
        child.start()
    items: list = []
    while len(items) < k:
        try:
            items.append(results.get(timeout=5))
        except queue.Empty:
            failed = [child.exitcode for child in children if child.exitcode not in (None, 0)]
            if failed:  # the others would wait at the barrier for ever
                for child in children:
                    child.kill()
                raise RuntimeError(f"a measuring process exited with {failed[0]}") from None
    for child in children:
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"a measuring process exited with {child.exitcode}")
    return items


def processes_rate(args, graphs: str | None) -> tuple[float, int]:
    """``--processes``: samples per second of K fedaval runs at once (their
    timed rounds over the span from the first one's start to the last one's
    end), and the samples each round trains in all."""
    spans = spawned(one_process, args.processes, args, graphs)
    start, end = min(s for _, s, _, _ in spans), max(e for _, _, e, _ in spans)
    return sum(n for *_, n in spans) / (end - start), sum(n for *_, n in spans) // (args.rounds - 2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:i")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--clients", type=int, default=10, help="clients, all sampled every round")
    parser.add_argument("--batch-size", type=int, default=32, help="the clients' local batch")
    parser.add_argument("--limit-batch", type=int, default=320, help="the plain loop's batch")
    parser.add_argument("--rounds", type=int, default=5, help="rounds (the first and the last are not timed)")
    parser.add_argument("--limit-epochs", type=int, default=3)
    parser.add_argument("--train-per-class", type=int, default=500, help="CIFAR-10 training images per class")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--data-root", default=None, help="an image folder (default: the shared CIFAR-10 subset)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument(
        "--cuda-graphs",
        choices=list(GRAPHS),
        default="off",
        help="fedaval's rounds without --cuda-graphs, with it (on: the backbone; step: --cuda-graph-scope step), "
        "or several in this invocation (both: off and on; all: off, on and step); CUDA only",
    )
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="fp32",
        help="fedaval's --precision (the limit loop stays fp32: what the hardware does for this model as it is)",
    )
    parser.add_argument(
        "--channels-last",
        action="store_true",
        help="fedaval's --channels-last (the limit loop stays in the default order)",
    )
    parser.add_argument(
        "--compile",
        default="off",
        help="fedaval's --compile (off, inductor, aot_eager; with --cuda-graphs only step or off+step), or "
        "several comma-separated, each run in this invocation (off,inductor: before and after); the limit "
        "loop stays eager",
    )
    parser.add_argument(
        "--client-streams",
        default="1",
        help="fedaval's --client-streams K (a round's clients on K CUDA streams), or several comma-separated, "
        "each run in this invocation (1,5: before and after); CUDA only",
    )
    parser.add_argument(
        "--stack-clients",
        default="off",
        help="fedaval's --stack-clients (off, on: a round's clients in lockstep, each step of all of them one "
        "vmapped computation), or off,on: before and after in this invocation; not with graphs, compile or streams",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="fedaval's side as K runs at once in K processes, --clients / K clients each (a divisor of --clients "
        "and of --train-per-class)",
    )
    parser.add_argument(
        "--profile",
        choices=["torch", "python"],
        default=None,
        help="print the torch profiler's tables (torch) or cProfile's (python) of fedaval's rounds "
        "(slows them; no limit loop, no ratio)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from fedaval.build import resolve_device
    from fedaval.datasets import load_dataset

    device = resolve_device(args.device)
    args.device = str(device)
    if args.processes < 1 or args.clients % args.processes or args.train_per_class % args.processes:
        parser.error(f"--processes {args.processes} must divide --clients {args.clients} and --train-per-class")
    if args.processes > 1 and (args.profile or args.data_root is not None):
        parser.error("--processes takes neither --profile nor --data-root (each process makes its own subset)")
    compiles = args.compile.split(",")
    stacks = args.stack_clients.split(",")
    if not set(stacks) <= {"off", "on"}:
        parser.error(f"--stack-clients {args.stack_clients}: off, on, or off,on")
    if "on" in stacks and (compiles != ["off"] or "features" in GRAPHS[args.cuda_graphs]):
        parser.error(
            f"--stack-clients {args.stack_clients} takes --compile off and --cuda-graphs off, step or off+step"
        )
    try:
        client_streams = [int(k) for k in args.client_streams.split(",")]
    except ValueError:
        parser.error(f"--client-streams {args.client_streams}: comma-separated integers")
    if client_streams != [1] and device.type != "cuda":
        parser.error(f"--client-streams {args.client_streams} needs a CUDA device; --device is {device}")
    if compiles != ["off"] and "features" in GRAPHS[args.cuda_graphs]:
        parser.error(f"--compile {args.compile} takes --cuda-graphs off, step or off+step, not {args.cuda_graphs}")
    if args.cuda_graphs != "off" and device.type != "cuda":
        parser.error(f"--cuda-graphs {args.cuda_graphs} needs a CUDA device; --device is {device}")
    if args.data_root is None:
        from cifar_data import cifar_subset

        root = str(cifar_subset(args.train_per_class, 10))
    else:
        root = args.data_root
    data = load_dataset("imagefolder", root, False)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"device: {device} ({name}); load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"setting: {args.model}, {len(data.train_y)} CIFAR-10 training images, {args.clients} clients x batch "
        f"{args.batch_size}, all sampled, {args.rounds} rounds (rounds 2 to {args.rounds - 1} timed); "
        f"limit: one loop at batch {args.limit_batch}"
        + (
            f"; fedaval as {args.processes} runs at once, {args.clients // args.processes} clients each"
            if args.processes > 1
            else ""
        ),
        flush=True,
    )
    rates = {}
    runs = [(c, k, g, st) for c in compiles for k in client_streams for g in GRAPHS[args.cuda_graphs] for st in stacks]
    for args.compile, args.client_streams, graphs, args.stack_clients in runs:
        label = (
            "fedaval"
            + {None: "", "features": " --cuda-graphs", "step": " --cuda-graphs --cuda-graph-scope step"}[graphs]
            + ("" if args.precision == "fp32" else f" --precision {args.precision}")
            + (" --channels-last" if args.channels_last else "")
            + ("" if args.compile == "off" else f" --compile {args.compile}")
            + ("" if args.client_streams == 1 else f" --client-streams {args.client_streams}")
            + (" --stack-clients" if args.stack_clients == "on" else "")
        )
        if args.processes > 1:
            label += f" in {args.processes} processes"
            rate, samples = processes_rate(args, graphs)
            rates[label] = (rate, rate, samples)
            print(f"{label}: {samples} samples a round in all; {rate:,.0f} samples/s over the timed rounds' span")
            continue
        with tempfile.TemporaryDirectory(prefix="fedaval-throughput-") as tmp:
            local, wall, samples = rates[label] = fedaval_rates(args, root, Path(tmp) / "run", graphs)
        print(f"{label}: {samples} samples a round; {local:,.0f} samples/s in local training, {wall:,.0f} per round")
    if args.profile:  # profiled rounds are slower: no ratio
        return 0
    limit = limit_rate(data, args.model, args.limit_batch, args.limit_epochs, args.lr, device)
    print(f"limit (batch {args.limit_batch}): {limit:,.0f} samples/s")
    for label, (local, wall, _) in rates.items():
        if args.processes > 1:  # one rate: the processes' rounds, fusion and writes included
            print(f"ratio {label} / limit: {local / limit:.3f} (whole rounds)")
            continue
        print(f"ratio {label} / limit: {local / limit:.3f} (local training), {wall / limit:.3f} (whole round)")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
