"""The host's time per training step: fedaval against a plain loop, with a model that computes next to nothing.

    python benchmarks/step_host.py                                   # the CPU, one torch thread
    python benchmarks/step_host.py --device cuda --cuda-graphs       # on a GPU: what bounds a graphed round

The model is a linear layer and 30 scale-and-shift layers on 8-wide
features: 62 parameter tensors in its backbone, as many as ResNet-18's, and
almost no arithmetic. A training step's time is then the host's work:
Python, PyTorch's dispatch and kernel launches, autograd's bookkeeping and
the optimizer's per-parameter work, and, on fedaval's side, Avalanche's loop
and callbacks and fedaval's hooks. With ``--cuda-graphs`` a ResNet-18 step
on a GPU is bound by exactly that work (docs/performance.md, "On a GPU",
item 3): this benchmark measures it apart from the model.

* **fedaval**: FedAvg on digits (or ``--dataset cifar``: the CIFAR-10
  subset, ``--train-per-class`` images a class, split evenly by Dirichlet
  alpha 1e6), fcil-sync with ``--clients`` clients and one task, every client every round, ``--local-epochs`` 5 at batch 32, SGD
  with momentum 0.9, no augmentation, evaluation at the last round only, no
  checkpoint; per step, the median over rounds 2 to R-1 of the clients'
  local training seconds (their ``train()`` calls, receiving and uploading
  included, so a client's per-round costs are spread over its steps: about
  70 a round here) divided by their minibatches (the first round pays for
  set-up, the last evaluates); and, per client round, what of those seconds
  falls outside the span from its first epoch's start to its last step's
  end (receiving, the strategy's set-up and tear-down, uploading): with
  ``--cuda-graphs`` a client of a few minibatches pays it once a round;
* **plain**: the same model, optimizer and batch size in a loop of
  ``--plain-steps`` steps over the same images on the same device (indices
  drawn on the device, no synchronisation in the loop); with
  ``--cuda-graphs`` its backbone is graphed as fedaval's is (forward and
  backward, ``torch.cuda.make_graphed_callables``; the classifier, loss and
  optimizer eager). Until session 29 it stayed eager there, so GPU session
  29's difference (-2,005 us a step) compared a graphed backbone with an
  eager one. With ``--cuda-graph-scope step`` both sides capture the whole
  step, SGD update included (fedaval's ``GraphedStep``, the plain loop
  through ``gpu_ceilings.whole_step_graph``).

With ``--stack-clients`` fedaval's side trains each round's clients in
lockstep (:mod:`fedaval.stacked`), one vmapped step for all of them: its
time per step is the round's local seconds over all clients' steps, the
host's work per client's step (the clients' turns interleave, so no client
round has a span of its own to print). With ``--null-graphs`` too, the
stacked step is a replay that does nothing: what is left is the host's work
around it, per client's step (its minibatch, Avalanche's loop, the turns).

The two alternate ``--repeats`` times in this one process; printed: the
median microseconds per step of each, their difference (fedaval's own host
work per step) and the load average. ``--layers 0`` leaves the linear layer
alone (on the CPU, a stand-in for a backbone replayed from a graph: the
step's other work is what is left). ``--count-ops`` then counts each side's
ATen operations per step, untimed (fedaval's in its first client's second
round), and those of them that run a kernel on a GPU unless a graph
replays them, by the file that ran them (``op_count.py``). Not a test:
nothing is asserted.

    python benchmarks/step_host.py --layers 0 --repeats 3 --count-ops   # session 30's numbers
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from op_count import OpCount  # noqa: E402

from fedaval import hookimpl  # noqa: E402

LAYERS = 30  # scale-and-shift layers: 2 parameters each, with the linear layer's 2: 62


class ScaleShift(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


def many_small_parameters(input_shape, num_classes: int, width: int = 8, layers: int = LAYERS):
    from fedaval.models import SplitModel

    inputs = math.prod(input_shape)
    backbone = nn.Sequential(nn.Flatten(), nn.Linear(inputs, width), *[ScaleShift(width) for _ in range(layers)])
    return SplitModel(backbone, nn.Linear(width, num_classes), width)


class ModelPlugin:
    """Gives every client and the server :func:`many_small_parameters`, as a third-party model plugin would."""

    name = "step-host-model"

    def __init__(self, layers: int = LAYERS):
        self.layers = layers

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        return many_small_parameters(run.data.input_shape, run.num_classes, layers=self.layers)


class SpanPlugin:
    """Records, per round, each client's span from its first epoch's start to
    its last step's end: what of its round is minibatches."""

    name = "step-host-span"

    def __init__(self):
        self.first: float | None = None
        self.last: float | None = None
        self.spans: dict[int, list[float]] = {}

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            self.first = time.perf_counter()

    @hookimpl
    def fedaval_client_step(self, run, client, batch):
        self.last = time.perf_counter()

    @hookimpl
    def fedaval_client_upload(self, run, client):
        assert self.first is not None and self.last is not None, "a client trains before it uploads"
        self.spans.setdefault(run.round, []).append(self.last - self.first)
        return {}


def fedaval_config(args, out: Path):
    """The fedaval side's run."""
    from fedaval.api import check_settings
    from fedaval.config import RunConfig

    return check_settings(
        RunConfig(
            plugins=["fedavg"],
            scenario="fcil-sync",
            scenario_options={
                "clients": args.clients,
                "tasks": 1,
                **({"alpha": 1e6} if args.dataset == "cifar" else {}),
            },
            dataset="digits" if args.dataset == "digits" else "imagefolder",
            data_root=data_root(args),
            rounds_per_task=args.rounds,
            local_epochs=args.local_epochs,
            batch_size=args.batch_size,
            lr=0.01,
            momentum=0.9,
            augment="none",
            eval_every=args.rounds,
            checkpoint_every=0,
            device=args.device,
            cuda_graphs=args.cuda_graphs or args.null_graphs,
            cuda_graph_scope="step" if args.null_graphs else args.cuda_graph_scope,
            stack_clients=args.stack_clients,
            seed=0,
            out=str(out),
        )
    )


def data_root(args) -> str | None:
    """``--dataset cifar``: the shared CIFAR-10 subset of ``--train-per-class`` images a class."""
    if args.dataset == "digits":
        return None
    from cifar_data import cifar_subset

    return str(cifar_subset(args.train_per_class, 10))


def null_capture(step):
    """A stand-in for ``cuda_capture`` whose replay does nothing: the step
    runs once, for its outputs' static tensors (``--null-graphs``)."""
    outputs = tuple(out.detach().clone() for out in step())
    return (lambda: None), outputs


@contextlib.contextmanager
def null_graphs(on: bool):
    """``--null-graphs``: fedaval's ``--cuda-graph-scope step`` on any
    device, each client's graph stood in by :func:`null_capture`."""
    if not on:
        yield
        return
    from fedaval import cuda_graphs, stacked, strategy

    made = cuda_graphs.GraphedStep
    with (
        mock.patch.object(cuda_graphs, "check_device", lambda *args: None),
        mock.patch.object(strategy, "GraphedStep", lambda strat: made(strat, capture=null_capture)),
        mock.patch.object(stacked, "capture", null_capture),  # with --stack-clients: the stacked step's graph
    ):
        yield


def fedaval_step_seconds(args, out: Path) -> tuple[float, float]:
    """fedaval's seconds per step, and per client round its host's seconds
    outside the span of its minibatches (receiving, the strategy's set-up
    and tear-down, uploading)."""
    from timed_rounds import timed_rounds

    spans = SpanPlugin()
    with null_graphs(args.null_graphs):
        timed = timed_rounds(fedaval_config(args, out), extra_plugins=[ModelPlugin(args.layers), spans])
    samples = timed.results["scenario"]["client_task_samples"]  # one task, every client every round
    steps = args.local_epochs * sum(math.ceil(client[0] / args.batch_size) for client in samples)
    records = timed.records[1:-1]  # the first round sets up, the last evaluates
    if not records:
        raise SystemExit("--rounds must be at least 3 (the first and the last round are not timed)")
    per_step = statistics.median(r["seconds_local"] for r in records) / steps
    if args.stack_clients:  # the clients' turns interleave: no client has a span of its own
        return per_step, math.nan
    outside = [(r["seconds_local"] - sum(spans.spans[r["round"]])) / len(r["clients"]) for r in records]
    return per_step, statistics.median(outside)


def plain_loop(args, device: torch.device):
    """The plain side: ``steps(n)`` runs n training steps."""
    from fedaval.datasets import load_dataset

    data = load_dataset("digits" if args.dataset == "digits" else "imagefolder", data_root(args), False)
    model = many_small_parameters(data.input_shape, data.num_classes, layers=args.layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    loss_fn = nn.CrossEntropyLoss()
    images, labels = data.train_x.to(device), data.train_y.to(device)
    if not images.is_floating_point():  # an image folder's bytes: once as floats (fedaval scales per minibatch)
        images = images.float() / 255
    batch = images[: args.batch_size].clone(), labels[: args.batch_size].clone()  # a graph's static inputs
    if args.cuda_graphs and args.cuda_graph_scope == "features":  # as GraphedFeatures: the backbone's passes
        model.features = torch.cuda.make_graphed_callables(model.features, (batch[0],))

    def eager_step(x: torch.Tensor, y: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        optimizer.step()

    step = eager_step
    if args.null_graphs:  # the whole step a replay that does nothing: the batch's copy into its static tensors

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            batch[0].copy_(x)
            batch[1].copy_(y)

    if args.cuda_graphs and args.cuda_graph_scope == "step":  # as GraphedStep: the whole step, one graph
        from gpu_ceilings import whole_step_graph

        step = whole_step_graph(device, eager_step, *batch, warmup=3)

    def steps(n: int) -> None:
        for _ in range(n):
            index = torch.randint(0, len(labels), (args.batch_size,), device=device)
            step(images[index], labels[index])

    return steps


def plain_step_seconds(args, device: torch.device) -> float:
    from round_throughput import sync

    steps = plain_loop(args, device)
    steps(20)  # warm-up
    sync(device)
    start = time.perf_counter()
    steps(args.plain_steps)
    sync(device)
    return (time.perf_counter() - start) / args.plain_steps


class CountPlugin:
    """Counts the operations of the first client's second round, from its
    first epoch's start to its upload (the graphs, if any, captured in the
    first round), and its steps."""

    name = "step-host-count"

    def __init__(self):
        self.mode: OpCount | None = None
        self.counts: OpCount | None = None
        self.steps = 0

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if run.round == 2 and self.counts is None and self.mode is None:
            self.mode = OpCount()
            self.mode.__enter__()

    @hookimpl
    def fedaval_client_step(self, run, client, batch):
        if self.mode is not None:
            self.steps += 1

    @hookimpl
    def fedaval_client_upload(self, run, client):
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.counts, self.mode = self.mode, None
        return {}


def count_ops(args, device: torch.device) -> None:
    """``--count-ops``: ATen operations per step, fedaval's by file, and the plain loop's."""
    from timed_rounds import timed_rounds

    counter = CountPlugin()
    with tempfile.TemporaryDirectory(prefix="fedaval-step-host-") as tmp:
        with null_graphs(args.null_graphs):
            timed_rounds(fedaval_config(args, Path(tmp) / "run"), extra_plugins=[ModelPlugin(args.layers), counter])
    assert counter.counts is not None and counter.steps, "--rounds is at least 3: round 2 was counted"
    counts = counter.counts
    print(f"ATen operations, fedaval ({counter.steps} steps): {counts.summary(counter.steps, 'step')}")
    steps = plain_loop(args, device)
    steps(20)  # the graphs' capture, if any
    plain = OpCount()
    with plain:
        steps(50)
    print(f"ATen operations, plain (50 steps): {plain.summary(50, 'step')}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:i")
    parser.add_argument("--cuda-graphs", action="store_true", help="fedaval's side with --cuda-graphs (CUDA only)")
    parser.add_argument(
        "--cuda-graph-scope",
        choices=["features", "step"],
        default="features",
        help="with --cuda-graphs: what both sides capture (the backbone, or the whole step with the SGD update)",
    )
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument(
        "--dataset",
        choices=["digits", "cifar"],
        default="digits",
        help="digits (clients of unequal data), or the CIFAR-10 subset split evenly (Dirichlet alpha 1e6), as in "
        "item 3's setting: with --stack-clients every step of a round is one group",
    )
    parser.add_argument("--train-per-class", type=int, default=100, help="with --dataset cifar: images a class")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--local-epochs", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of fedaval's run (the first and last untimed)")
    parser.add_argument("--plain-steps", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    parser.add_argument(
        "--layers",
        type=int,
        default=LAYERS,
        help="scale-and-shift layers in the backbone (30: 62 parameter tensors, as ResNet-18's; 0: the linear "
        "layer alone, on the CPU a stand-in for a backbone replayed from a graph)",
    )
    parser.add_argument(
        "--null-graphs",
        action="store_true",
        help="both sides' whole step stood in by a graph replay that does nothing, on any device: the host's "
        "work per step around a replay (fedaval with --cuda-graph-scope step); not with --cuda-graphs",
    )
    parser.add_argument(
        "--stack-clients",
        action="store_true",
        help="fedaval's side with --stack-clients: a round's clients in lockstep, each step of all of them one "
        "vmapped computation; its time per step is then per client's step (no per-client span: n/a)",
    )
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="then count each side's ATen operations per step (fedaval's by file), untimed",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from fedaval.build import resolve_device

    device = resolve_device(args.device)
    args.device = str(device)
    if args.cuda_graphs and args.null_graphs:
        parser.error("--null-graphs stands in for the graphs: not with --cuda-graphs")
    if args.stack_clients and args.count_ops:
        parser.error("--stack-clients is not counted: not with --count-ops")
    if args.cuda_graphs and device.type != "cuda":
        parser.error(f"--cuda-graphs needs a CUDA device; --device is {device}")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"device: {device} ({name}); load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"model: a linear layer and {args.layers} scale-and-shift layers ({2 + 2 * args.layers} backbone "
        f"parameters); {args.dataset}, "
        f"{args.clients} clients, batch {args.batch_size}; fedaval"
        + (f" --cuda-graphs --cuda-graph-scope {args.cuda_graph_scope}" if args.cuda_graphs else "")
        + (
            " --cuda-graph-scope step, every graph a replay that does nothing (--null-graphs)"
            if args.null_graphs
            else ""
        )
        + (" --stack-clients (its time per step: per client's step)" if args.stack_clients else ""),
        flush=True,
    )
    fedaval_us, plain_us, outside_ms = [], [], []
    for repeat in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="fedaval-step-host-") as tmp:
            step, outside = fedaval_step_seconds(args, Path(tmp) / "run")
        fedaval_us.append(step * 1e6)
        outside_ms.append(outside * 1e3)
        plain_us.append(plain_step_seconds(args, device) * 1e6)
        print(
            f"repeat {repeat}: fedaval {fedaval_us[-1]:.0f} us/step, plain {plain_us[-1]:.0f} us/step; "
            f"a client round outside its minibatches {outside_ms[-1]:.2f} ms",
            flush=True,
        )
    fedaval, plain = statistics.median(fedaval_us), statistics.median(plain_us)
    print(
        f"median: fedaval {fedaval:.0f} us/step, plain {plain:.0f} us/step; fedaval's own host work "
        f"{fedaval - plain:.0f} us/step (ratio {fedaval / plain:.2f}); a client round outside its "
        f"minibatches {statistics.median(outside_ms):.2f} ms"
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if args.count_ops:
        count_ops(args, device)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
