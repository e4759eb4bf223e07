"""What each way of keeping a GPU busy with small batches could give, in plain PyTorch loops.

    python benchmarks/gpu_ceilings.py --device cuda          # ResNet-18 on the shared CIFAR-10 subset
    python benchmarks/gpu_ceilings.py --device cpu --model cnn --steps 20 --processes 2

The GPU issue's item 3 asks fedaval's round (10 clients at batch 32) to reach
half of what the GPU does at batch 320. Before building a technique into
fedaval, this measures what each could reach at best: plain training loops
of the same model, same SGD, on the same images already on the device, no
framework. Samples per second over ``--steps`` timed steps after warm-up
steps (cuDNN autotuning, the allocator), each against the batch-320 loop:

* ``batch 320``: the limit (the issue's reference), and in bf16 autocast;
* ``batch 32``: one loop, what clients trained one after another reach at best;
* ``batch 32, bf16``: ``torch.autocast(dtype=torch.bfloat16)`` around forward and loss;
* ``batch 32, channels-last``: model and inputs in ``torch.channels_last``;
* ``batch 32, CUDA graph``: the whole step (forward, backward, SGD step)
  captured once and replayed (``torch.cuda.graph``; the GPU only); and with
  the forward and loss in bf16 autocast (the GPU's work per step then bounds
  it);
* ``batch 32, torch.compile`` (``--compile BACKEND``, e.g. ``inductor``): the
  model compiled (``torch.compile``), the loss and SGD step eager; on the GPU
  also the compiled model's whole step as one CUDA graph, in fp32 and bf16:
  fused kernels, fewer of them, and less GPU work per step than the graphed
  eager model's. Compiling costs time (ResNet-18's forward and backward,
  again for bf16), so these lines are asked for;
* ``batch 32, model graphed``: only the model's forward and backward
  captured (``torch.cuda.make_graphed_callables``), loss and SGD step eager:
  where a graph fits inside Avalanche's loop (the GPU only);
* ``batch 32, model graphed, a wait every 16 steps``: the same, the host
  waiting for the GPU after every ``--wait-every`` steps, as a framework that
  reads each client's loss after its round does (the GPU only);
* ``batch 32 x N models, one vmapped step``: N models of the same
  architecture trained as one computation (``--stacked``): their parameters
  and buffers stacked (``torch.func.stack_module_state``), each step one
  ``torch.func.vmap`` over ``functional_call``, each model on a minibatch of
  its own, SGD with momentum on the stacked tensors (elementwise, so each
  model's own SGD); eagerly and, on the GPU, the whole step as one CUDA
  graph. What batching identical clients into one computation (the issue's
  third way) could give; the first step is checked against each model
  stepped alone (largest parameter difference printed);
* ``batch 32 x K streams``: K models in one process, each on a CUDA stream
  of its own (``--streams``; the GPU only), one host thread issuing
  ``--stream-steps`` steps of one model, then as many of the next (a
  client's round at a time, as a backend would issue clients one after
  another without waiting), eagerly and with each model's whole step as one
  CUDA graph. Kernels of one process's streams can run side by side on the
  GPU, which processes' contexts without MPS do not: whether clients on
  streams pass the one graphed loop's bound, its GPU work at batch 32;
* ``batch 32 x K processes``: K processes training their own model at once
  on the one device (``--processes``), total samples over the wall time from
  a common start to the last one's end; and with each process's model
  graphed (``--graphed-processes``; the GPU only): whether worker processes
  sharing the GPU would take graphed clients past the host's bound.

Not a test: nothing is asserted. Each line prints as it is measured.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from round_throughput import spawned, sync  # noqa: E402 - this folder


def whole_step_graph(device: torch.device, step, static_x: torch.Tensor, static_y: torch.Tensor, warmup: int):
    """``step(x, y)`` (the gradients set to None, then forward, backward and
    the SGD step) captured whole as one CUDA graph, the pattern of PyTorch's
    CUDA semantics notes: warm-up steps on a side stream, then the capture.
    Returns a step that copies its batch into the static inputs and replays."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 3)):
            step(static_x, static_y)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(static_x, static_y)

    def replay(x: torch.Tensor, y: torch.Tensor) -> None:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()

    return replay


class Loop:
    """One model, its SGD and ``data``'s training images on ``device``."""

    def __init__(
        self,
        data,
        model_name: str,
        device: torch.device,
        seed: int = 0,
        channels_last: bool = False,
        compile: str | None = None,
    ):
        from fedaval.models import build_model

        torch.manual_seed(seed)
        self.device = device
        self.format = torch.channels_last if channels_last else torch.contiguous_format
        model = build_model(model_name, data.input_shape, data.num_classes).to(device)
        self.model = model.to(memory_format=self.format)
        self.model.train()
        self.forward = torch.compile(self.model, backend=compile) if compile else self.model
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
        std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
        images = data.train_x.to(device)
        scale = 255.0 if images.dtype == torch.uint8 else 1.0
        self.images = ((images.float() / scale - mean) / std).contiguous(memory_format=self.format)
        self.labels = data.train_y.to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def batches(self, batch: int, steps: int):
        """``steps`` random minibatches of ``batch`` images (indexing on the device)."""
        n = len(self.labels)
        for _ in range(steps):
            index = torch.randint(n, (batch,), device=self.device, generator=self.generator)
            yield self.images[index], self.labels[index]

    def step(self, x: torch.Tensor, y: torch.Tensor, bf16: bool = False, model=None) -> None:
        """One SGD step on ``(x, y)``, through ``model`` (default: the model, compiled if asked)."""
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            loss = self.loss_fn((model or self.forward)(x), y)
        loss.backward()
        self.optimizer.step()

    def timed(self, batch: int, steps: int, warmup: int, step) -> float:
        """Samples per second of ``step(x, y)`` over ``steps`` minibatches,
        after ``warmup`` untimed ones; the device synchronised around the timing."""
        for x, y in self.batches(batch, warmup):
            step(x, y)
        sync(self.device)
        start = time.perf_counter()
        for x, y in self.batches(batch, steps):
            step(x, y)
        sync(self.device)
        return batch * steps / (time.perf_counter() - start)

    def rate(self, batch: int, steps: int, warmup: int, bf16: bool = False) -> float:
        """Samples per second of eager steps."""
        return self.timed(batch, steps, warmup, lambda x, y: self.step(x, y, bf16))

    def graph_rate(self, batch: int, steps: int, warmup: int, bf16: bool = False) -> float:
        """Samples per second of a captured whole step, replayed (:func:`whole_step_graph`)."""
        replay = whole_step_graph(
            self.device,
            lambda x, y: self.step(x, y, bf16),
            self.images[:batch].clone(),
            self.labels[:batch].clone(),
            warmup,
        )
        return self.timed(batch, steps, warmup, replay)

    def graphed_model_rate(self, batch: int, steps: int, warmup: int, wait_every: int = 0) -> float:
        """Samples per second with only the model's forward and backward
        captured (``torch.cuda.make_graphed_callables``), the loss and the SGD
        step eager: where a graph could sit inside Avalanche's training loop,
        whose plugins add loss terms and run callbacks between those steps.

        ``wait_every`` > 0: the host waits for the GPU after every that many
        steps (reads the loss back, as a framework reading a client's round
        losses after its few minibatches does; fedaval did after each client
        until session 28)."""
        graphed = torch.cuda.make_graphed_callables(self.model, (self.images[:batch].clone(),))
        count = 0

        def step(x: torch.Tensor, y: torch.Tensor) -> None:
            nonlocal count
            self.step(x, y, model=graphed)
            count += 1
            if wait_every and count % wait_every == 0:
                sync(self.device)

        return self.timed(batch, steps, warmup, step)


class Stacked:
    """``clients`` models of one architecture (each :class:`Loop`'s, seeds 0
    to clients - 1) trained as one computation: stacked parameters and
    buffers, one ``torch.func.vmap`` of ``functional_call`` a step, each model
    on its own minibatch. The loss is the sum over the models of each one's
    mean cross-entropy, so each model's gradient is the one its own loop
    would compute; BatchNorm's running statistics are stacked buffers,
    updated per model as in its own loop."""

    def __init__(self, data, model_name: str, device: torch.device, clients: int, batch: int):
        from torch.func import functional_call, stack_module_state, vmap

        self.loops = [Loop(data, model_name, device, seed=k) for k in range(clients)]
        self.device, self.clients, self.batch = device, clients, batch
        self.params, self.buffers = stack_module_state([loop.model for loop in self.loops])
        base = copy.deepcopy(self.loops[0].model).to("meta")

        def one(params, buffers, x):
            return functional_call(base, (params, buffers), (x,))

        self.forward = vmap(one)
        self.optimizer = torch.optim.SGD(self.params.values(), lr=0.01, momentum=0.9)
        self.loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
        self.images, self.labels = self.loops[0].images, self.loops[0].labels
        self.generator = torch.Generator(device=device).manual_seed(0)

    def draw(self) -> tuple[torch.Tensor, torch.Tensor]:
        """A minibatch of ``batch`` images for each model: ``[clients, batch, ...]``."""
        index = torch.randint(
            len(self.labels), (self.clients, self.batch), device=self.device, generator=self.generator
        )
        return self.images[index], self.labels[index]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        out = self.forward(self.params, self.buffers, x)
        (self.loss_fn(out.flatten(0, 1), y.flatten()) / self.batch).backward()
        self.optimizer.step()

    def check(self) -> float:
        """One stacked step against each model's own step on the same
        minibatch: the largest difference of any parameter afterwards."""
        x, y = self.draw()
        before = {k: v.detach().clone() for k, v in self.params.items()}
        self.step(x, y)
        worst = 0.0
        for k, loop in enumerate(self.loops):
            loop.step(x[k], y[k])
            for name, value in loop.model.named_parameters():
                worst = max(worst, float((value.detach() - self.params[name][k].detach()).abs().max()))
        with torch.no_grad():  # back to where the timing starts: the models' own state no longer matters
            for name, value in self.params.items():
                value.copy_(before[name])
        return worst

    def rate(self, steps: int, warmup: int, graph: bool = False) -> float:
        """Samples per second over ``steps`` stacked steps after ``warmup``;
        ``graph``: the whole step captured once and replayed (the GPU only)."""
        step = self.step
        if graph:
            step = whole_step_graph(self.device, self.step, *(t.clone() for t in self.draw()), warmup)
        for _ in range(warmup):
            step(*self.draw())
        sync(self.device)
        start = time.perf_counter()
        for _ in range(steps):
            step(*self.draw())
        sync(self.device)
        return self.clients * self.batch * steps / (time.perf_counter() - start)


def one_process(rank: int, args, graphed: bool, barrier, results) -> None:
    """A child of the K-process measurement: its own model, trained at
    ``--batch`` from a common start (the barrier); with ``graphed``, its
    model's forward and backward through a CUDA graph."""
    from fedaval.datasets import load_dataset

    torch.set_num_threads(1)
    device = torch.device(args.device)
    loop = Loop(load_dataset("imagefolder", args.data_root, False), args.model, device, seed=rank)
    model = torch.cuda.make_graphed_callables(loop.model, (loop.images[: args.batch].clone(),)) if graphed else None
    for x, y in loop.batches(args.batch, args.warmup):
        loop.step(x, y, model=model)
    sync(device)
    barrier.wait()
    start = time.monotonic()
    for x, y in loop.batches(args.batch, args.steps):
        loop.step(x, y, model=model)
    sync(device)
    results.put((rank, start, time.monotonic()))


def processes_rate(args, k: int, graphed: bool = False) -> float:
    """Samples per second of ``k`` processes training at once."""
    spans = spawned(one_process, k, args, graphed)
    start = min(s for _, s, _ in spans)
    end = max(e for _, _, e in spans)
    return k * args.batch * args.steps / (end - start)


def streams_rate(data, model_name: str, device: torch.device, k: int, args, graphed: bool) -> float:
    """Samples per second of ``k`` models (:class:`Loop`, seeds 0 to k - 1)
    each on a CUDA stream of its own, a host thread issuing
    ``args.stream_steps`` steps of one model on its stream, then of the
    next; eager steps, or each model's whole step as one CUDA graph."""
    loops = [Loop(data, model_name, device, seed=i) for i in range(k)]
    streams = [torch.cuda.Stream(device) for _ in loops]
    batch = args.batch
    steps = []
    for loop in loops:
        if graphed:
            x, y = loop.images[:batch].clone(), loop.labels[:batch].clone()
            steps.append(whole_step_graph(device, loop.step, x, y, args.warmup))
        else:
            steps.append(loop.step)
    current = torch.cuda.current_stream(device)

    def run(turns: int) -> None:
        for stream in streams:
            stream.wait_stream(current)
        for _ in range(turns):
            for loop, step, stream in zip(loops, steps, streams):
                with torch.cuda.stream(stream):
                    for x, y in loop.batches(batch, args.stream_steps):
                        step(x, y)
        for stream in streams:
            current.wait_stream(stream)

    run(1)  # warm-up: every model's first steps, cuDNN's choices
    sync(device)
    turns = max(args.steps // args.stream_steps, 1)
    start = time.perf_counter()
    run(turns)
    sync(device)
    return k * turns * args.stream_steps * batch / (time.perf_counter() - start)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--batch", type=int, default=32, help="a client's batch")
    parser.add_argument("--limit-batch", type=int, default=320)
    parser.add_argument("--steps", type=int, default=100, help="timed steps of each loop")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--processes", default="2,4,10", help="K of the K-process lines (comma-separated)")
    parser.add_argument(
        "--graphed-processes",
        default="2,4",
        help="K of the K-process lines with each process's model graphed (the GPU only; empty: none)",
    )
    parser.add_argument(
        "--wait-every",
        type=int,
        default=16,
        help="the model-graphed loop once more, the host waiting for the GPU every that many steps "
        "(16: one client's round of 500 images at batch 32; 0: no such line)",
    )
    parser.add_argument(
        "--stacked",
        type=int,
        default=10,
        help="N of the line of N models trained as one vmapped step (10: item 3's clients a round; 0: no such line)",
    )
    parser.add_argument(
        "--compile",
        default="",
        metavar="BACKEND",
        help="the lines of the model compiled by torch.compile with this backend (inductor: fedaval's "
        "--compile inductor; aot_eager: no code generated); empty (default): none",
    )
    parser.add_argument(
        "--streams",
        default="2,4,10",
        help="K of the lines of K models on K CUDA streams in one process (comma-separated; the GPU only)",
    )
    parser.add_argument(
        "--stream-steps",
        type=int,
        default=16,
        help="steps of one model issued on its stream before the next model's (16: a client's round of 500 "
        "images at batch 32)",
    )
    parser.add_argument("--train-per-class", type=int, default=500)
    parser.add_argument("--data-root", default=None, help="an image folder (default: the shared CIFAR-10 subset)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.data_root is None:
        from cifar_data import cifar_subset

        args.data_root = str(cifar_subset(args.train_per_class, 10))
    from fedaval.datasets import load_dataset

    data = load_dataset("imagefolder", args.data_root, False)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(
        f"device: {device} ({name}); {args.model}; {args.steps} timed steps after {args.warmup}; "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        flush=True,
    )

    loop = Loop(data, args.model, device)
    limit = loop.rate(args.limit_batch, max(args.steps // 5, 5), args.warmup)

    def line(label: str, rate: float) -> None:
        print(f"{label:<32} {rate:>10,.0f} samples/s   {rate / limit:6.3f} x the limit", flush=True)

    def attempt(label: str, measure) -> None:
        """``line(label, measure())``, or a line saying why it failed: a capture or a process that
        fails is a line, not the end."""
        try:
            rate = measure()
        except Exception as exc:  # noqa: BLE001 - a measurement that fails is a line, not the end
            print(f"{label}: failed: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        else:
            line(label, rate)

    line(f"batch {args.limit_batch} (the limit)", limit)
    line(
        f"batch {args.limit_batch}, bf16",
        Loop(data, args.model, device).rate(args.limit_batch, max(args.steps // 5, 5), args.warmup, bf16=True),
    )
    line(f"batch {args.batch}", Loop(data, args.model, device).rate(args.batch, args.steps, args.warmup))
    line(
        f"batch {args.batch}, bf16",
        Loop(data, args.model, device).rate(args.batch, args.steps, args.warmup, bf16=True),
    )
    line(
        f"batch {args.batch}, channels-last",
        Loop(data, args.model, device, channels_last=True).rate(args.batch, args.steps, args.warmup),
    )
    if device.type == "cuda":
        graphs = {
            "CUDA graph": "graph_rate",  # the whole step
            "model graphed": "graphed_model_rate",  # forward and backward only
        }
        for label, method in graphs.items():
            attempt(
                f"batch {args.batch}, {label}",
                lambda method=method: getattr(Loop(data, args.model, device), method)(
                    args.batch, args.steps, args.warmup
                ),
            )
        attempt(
            f"batch {args.batch}, CUDA graph, bf16",
            lambda: Loop(data, args.model, device).graph_rate(args.batch, args.steps, args.warmup, bf16=True),
        )
        if args.wait_every:
            attempt(
                f"batch {args.batch}, model graphed, a wait every {args.wait_every} steps",
                lambda: Loop(data, args.model, device).graphed_model_rate(
                    args.batch, args.steps, args.warmup, wait_every=args.wait_every
                ),
            )
    if args.compile:
        compiled = f"batch {args.batch}, torch.compile {args.compile}"
        attempt(
            compiled,
            lambda: Loop(data, args.model, device, compile=args.compile).rate(args.batch, args.steps, args.warmup),
        )
        for bf16 in (False, True) if device.type == "cuda" else ():
            attempt(
                f"{compiled}, CUDA graph" + (", bf16" if bf16 else ""),
                lambda bf16=bf16: Loop(data, args.model, device, compile=args.compile).graph_rate(
                    args.batch, args.steps, args.warmup, bf16=bf16
                ),
            )
    if args.stacked:
        label = f"batch {args.batch} x {args.stacked} models, one vmapped step"
        try:
            stacked = Stacked(data, args.model, device, args.stacked, args.batch)
            print(f"{label}: first step against each model's own, largest difference {stacked.check():.2e}", flush=True)
        except Exception as exc:  # noqa: BLE001 - a measurement that fails is a line, not the end
            print(f"{label}: failed: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
        else:
            attempt(label, lambda: stacked.rate(args.steps, args.warmup))
            if device.type == "cuda":
                attempt(f"{label}, CUDA graph", lambda: stacked.rate(args.steps, args.warmup, graph=True))
            del stacked
    del loop
    for k in [int(k) for k in args.streams.split(",") if k] if device.type == "cuda" else []:
        for graphed in (False, True):
            attempt(
                f"batch {args.batch} x {k} streams" + (", CUDA graphs" if graphed else ""),
                lambda k=k, graphed=graphed: streams_rate(data, args.model, device, k, args, graphed),
            )
            torch.cuda.empty_cache()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for k in [int(k) for k in args.processes.split(",") if k]:
        line(f"batch {args.batch} x {k} processes", processes_rate(args, k))
    for k in [int(k) for k in args.graphed_processes.split(",") if k] if device.type == "cuda" else []:
        attempt(f"batch {args.batch} x {k} processes, model graphed", lambda k=k: processes_rate(args, k, graphed=True))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
