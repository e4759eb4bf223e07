"""Seconds of GLFC's (and FediCaRL's) once-a-task steps, at full scale's shapes.

    python benchmarks/glfc_task_steps.py                    # the CPU, 2 threads (a run's share)
    python benchmarks/glfc_task_steps.py --device cuda

At full scale (FedProK's Table 1: ResNet-18's 512-wide features, all of
CIFAR-10, 3 clients, 5 tasks of 2 classes) two steps of GLFC happen once a
task and took most of its time on an H200 shared by six runs (GPU session
26: a task's end 85 to 206 s, a task's first round 82 to 146 s, against 5
to 9 s for the other rounds):

* herding, at each task's end: per client and new class, the exemplars of a
  class's ~1,667 images, 250 of them with a memory of 500 over 2 classes.
  Timed here: Avalanche's ``HerdingSelectionStrategy`` loop (which orders
  every row, what fedaval called until session 26) against
  ``ficarl_math.herding_order`` (stopped at the quota), on the same features,
  with a check that the orders agree;
* the proxy's gradient inversion, in a task's first round: one LeNet
  gradient inverted per new class and client (6 a task), 20 L-BFGS steps.

Prints the median over ``--repeats`` after one warm-up. ``PYTHONPATH``
chooses which fedaval is timed. Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def timed(device: torch.device, repeats: int, work) -> float:
    """Median seconds of ``work()`` over ``repeats`` calls after a warm-up."""
    times = []
    for repeat in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        work()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if repeat:
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (gpu_session.sh gives each run 2)")
    parser.add_argument("--rows", type=int, default=1667, help="a client's images of one class")
    parser.add_argument("--dim", type=int, default=512, help="feature width (ResNet-18: 512)")
    parser.add_argument("--quota", type=int, default=250, help="exemplars of the class (500 over 2 classes)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from avalanche.training.storage_policy import HerdingSelectionStrategy

    from fedaval.plugins.ficarl_math import herding_order, normalise
    from fedaval.plugins.glfc_math import LeNet, invert_gradient, prototype_gradient

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"on {device}, {args.threads} threads")

    features = torch.randn(args.rows, args.dim, generator=torch.Generator().manual_seed(0)).relu().to(device)
    avalanche = object.__new__(HerdingSelectionStrategy)
    full = timed(
        device, args.repeats, lambda: avalanche.make_sorted_indices_from_features(normalise(features).double())
    )
    cut = timed(device, args.repeats, lambda: herding_order(features, args.quota))
    same = (
        herding_order(features, args.quota).tolist()
        == avalanche.make_sorted_indices_from_features(normalise(features).double())[: args.quota]
    )
    print(
        f"herding {args.rows} x {args.dim}, quota {args.quota}: Avalanche's loop {full:.3f} s, "
        f"herding_order {cut:.3f} s, ratio {full / cut:.1f}; same order: {same}"
    )

    lenet = LeNet((3, 32, 32), 10).to(device)
    gradient = [g.detach() for g in prototype_gradient(lenet, torch.randn(3, 32, 32, device=device), 3)]
    inversion = timed(device, args.repeats, lambda: invert_gradient(lenet, gradient, 3, (3, 32, 32), 20, 1.0, seed=1))
    print(
        f"gradient inversion (LeNet, 3x32x32, 20 L-BFGS steps): {inversion:.3f} s an image, {6 * inversion:.1f} s a task"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
