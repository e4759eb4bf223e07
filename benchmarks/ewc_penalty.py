"""FedEWC's penalty a minibatch: Avalanche's EWCPlugin against fedaval's FusedEWCPlugin.

    python benchmarks/ewc_penalty.py                      # ResNet-18, 4 past tasks, the CPU
    python benchmarks/ewc_penalty.py --device cuda        # on a GPU, where each operation is a launch

A client at its fifth task (``--experiences`` past tasks, FedEWC's
``separate`` mode) adds the EWC penalty to every minibatch's loss. This times
the penalty alone, forward and backward, for ``--model`` (ResNet-18: 62
parameter tensors, CIFAR-10's shapes), with the anchors and importances
drawn at random: the median over ``--repeats`` blocks of ``--steps`` calls,
alternating the two plugins, with the device synchronised around each
block, and the operations each dispatches in one call (on a GPU, about one
kernel launch each). Printed: both, their ratio, the largest relative
difference of the two penalties and of their gradients. Not a test: nothing
is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from op_count import OpCount  # noqa: E402 - this folder
from round_throughput import sync  # noqa: E402


def plugins(model: torch.nn.Module, experiences: int):
    """Avalanche's plugin and fedaval's, with the same random anchors and importances."""
    from avalanche.training.plugins import EWCPlugin
    from avalanche.training.utils import ParamData

    from fedaval.plugins.ewc_penalty import FusedEWCPlugin

    pair = EWCPlugin(ewc_lambda=1.0), FusedEWCPlugin(ewc_lambda=1.0)
    for experience in range(experiences):
        for name, param in model.named_parameters():
            anchor = param.detach() + 0.01 * torch.randn_like(param)
            importance = torch.rand_like(param) * 1e-3
            for plugin in pair:
                plugin.saved_params[experience][name] = ParamData(name, init_tensor=anchor.clone())
                plugin.importances[experience][name] = ParamData(name, init_tensor=importance.clone())
    return pair


def penalty_step(plugin, model, experiences: int, device: torch.device) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    strategy = SimpleNamespace(
        clock=SimpleNamespace(train_exp_counter=experiences), model=model, device=device, loss=0.0
    )
    plugin.before_backward(strategy)
    strategy.loss.backward()
    return strategy.loss.detach()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--experiences", type=int, default=4, help="past tasks (a client at task 5: 4)")
    parser.add_argument("--steps", type=int, default=20, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from fedaval.models import build_model

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = build_model(args.model, (3, 32, 32), 10).to(device)
    tensors = len(list(model.parameters()))
    pair = plugins(model, args.experiences)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU, {args.threads} thread(s)"
    print(f"device: {device} ({name}); load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{args.model}: {tensors} parameter tensors; {args.experiences} past tasks (separate mode)")

    values, grads, ops = [], [], []
    for plugin in pair:
        penalty_step(plugin, model, args.experiences, device)  # warm-up
        with OpCount() as counter:
            values.append(penalty_step(plugin, model, args.experiences, device))
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        ops.append(counter.total())
    seconds: list[list[float]] = [[], []]
    for _ in range(args.repeats):
        for i, plugin in enumerate(pair):
            sync(device)
            start = time.perf_counter()
            for _ in range(args.steps):
                penalty_step(plugin, model, args.experiences, device)
            sync(device)
            seconds[i].append((time.perf_counter() - start) / args.steps)
    ms = [statistics.median(s) * 1e3 for s in seconds]
    value_diff = abs(float(values[1]) - float(values[0])) / abs(float(values[0]))
    grad_diff = max(float((b - a).abs().max() / a.abs().max().clamp_min(1e-30)) for a, b in zip(*grads))
    print(f"Avalanche's EWCPlugin: {ms[0]:.2f} ms a call (penalty forward and backward), {ops[0]} operations")
    print(f"fedaval's FusedEWCPlugin: {ms[1]:.2f} ms a call, {ops[1]} operations")
    print(f"ratio Avalanche / fused: {ms[0] / ms[1]:.2f} (time), {ops[0] / ops[1]:.1f} (operations)")
    print(f"largest relative difference: penalty {value_diff:.1e}, gradients {grad_diff:.1e}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
