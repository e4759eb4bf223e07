"""Seconds per iteration of FedProK's classifier fit (reading 8), at full scale's shapes.

    python benchmarks/fedprok_fit.py                      # the CPU, one thread per run of the table
    python benchmarks/fedprok_fit.py --device cuda

At full scale (FedProK's Table 1: ResNet-18's 512-wide features, all of
CIFAR-10, 3 clients, 5 tasks of 2 classes) a client fits its classifier
every round from task 1 on, on the features of its ~3,333 current-task
images and their translations into the old classes (Eq. 8): 2 old classes
at task 1, 8 at task 4, so up to four times as many translated features as
real ones. On an H100 shared by six runs (session 21) the fits took 320 to
1,000 L-BFGS iterations each and most of a round: 47 to 144 s against about
15 s for the rest. This times ``fit_head`` on features of those shapes
(random, with a weak class signal, so the fit does not converge before
``--steps``) and prints, per task, the milliseconds per iteration (median
over ``--repeats`` fits after one warm-up fit). ``PYTHONPATH`` chooses which
fedaval is timed (an older checkout gives the before number). Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (gpu_session.sh gives each run 2)")
    parser.add_argument("--samples", type=int, default=3333, help="a client's current-task images")
    parser.add_argument("--dim", type=int, default=512, help="feature width (ResNet-18: 512)")
    parser.add_argument("--steps", type=int, default=60, help="L-BFGS iterations per fit, at most")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from fedaval.plugins.fedprok_math import fit_head, plan_translation

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"fit_head on {device}, {args.threads} threads, {args.samples} samples x {args.dim} features")
    print("task | old classes | ms per iteration (median) | iterations")
    for task in (1, 2, 3, 4):
        g = torch.Generator().manual_seed(task)
        new, old = [2 * task, 2 * task + 1], list(range(2 * task))
        labels = torch.tensor(new).repeat_interleave(args.samples // 2 + 1)[: args.samples]
        centres = torch.randn(10, args.dim, generator=g)
        features = (torch.randn(args.samples, args.dim, generator=g) + 0.05 * centres[labels]).relu() * 3
        plan = plan_translation(old, centres[old], new, centres[new])
        features, labels = features.to(device), labels.to(device)
        # field by field, not Translation.to: older checkouts (the before number) lack it
        plan = type(plan)(*(t.to(device) for t in (plan.targets, plan.shifts, plan.bases, plan.slots)))
        times, steps = [], []
        for repeat in range(args.repeats + 1):
            head = torch.nn.Linear(args.dim, 10).to(device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            began = time.perf_counter()
            _, n = fit_head(head, features, labels, plan, 1e-4, args.steps)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if repeat:  # the first is a warm-up
                times.append((time.perf_counter() - began) / max(n, 1))
                steps.append(n)
        print(f"{task} | {len(old)} | {1000 * statistics.median(times):.2f} | {steps}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
