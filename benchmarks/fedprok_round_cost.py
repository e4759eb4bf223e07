"""FedProK's local training time per round against FedAvg's, on the same work.

    python benchmarks/fedprok_round_cost.py                                   # CPU, the cnn
    python benchmarks/fedprok_round_cost.py --device cuda --model resnet18 --cuda-graphs

FedProK Table 1's shape (configs/repro-fedprok-table1.toml: 3 clients, 5
tasks, alpha 1) on the CIFAR-10 subset of benchmarks/cifar_data.py, a few
rounds per task, no evaluation. From task 1 on, FedProK's clients translate
their old classes' features in every minibatch and then fit the classifier
to convergence on the round's features (full-batch L-BFGS since session 14,
20 epochs of minibatch SGD before; its plugin's readings 3 and 8), which
FedAvg does not. Printed per method: the clients' local training seconds per
round (``seconds_local``), median over the rounds of tasks 1 to 4, and
FedProK's ratio to FedAvg, both runs in this one invocation. At full scale on
a GPU a FedProK round took some 25 times FedAvg's before its translation
stopped waiting for the GPU in every minibatch (docs/reproduction.md, "At
the papers' scale"). ``PYTHONPATH`` chooses which fedaval is timed (an older checkout
gives the before number). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--train-per-class", type=int, default=500, help="CIFAR-10 training images per class")
    parser.add_argument("--rounds-per-task", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    args = parser.parse_args(argv)
    if args.cuda_graphs and not args.device.startswith("cuda"):
        parser.error("--cuda-graphs needs --device cuda")
    torch.set_num_threads(args.threads)

    from cifar_data import cifar_subset
    from timed_rounds import timed_rounds

    import fedaval
    from fedaval.config import RunConfig

    root = cifar_subset(args.train_per_class, 10)
    print(f"fedaval from {Path(fedaval.__file__).parent}; device {args.device}, model {args.model}")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    local: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="fedaval-fedprok-cost-") as tmp:
        for method in ("fedavg", "fedprok"):
            config = RunConfig(
                plugins=[method],
                scenario="fcil-sync",
                scenario_options={"clients": 3, "tasks": 5, "alpha": 1.0},
                dataset="imagefolder",
                data_root=str(root),
                model=args.model,
                rounds_per_task=args.rounds_per_task,
                local_epochs=1,
                batch_size=32,
                lr=0.01,
                momentum=0.9,
                seed=42,
                device=args.device,
                cuda_graphs=args.cuda_graphs,
                eval_every=10**6,
                out=str(Path(tmp) / method),
            )
            timed = timed_rounds(config)
            later = [r["seconds_local"] for r in timed.records if r["task"] >= 1]
            local[method] = statistics.median(later)
            print(f"{method}: {local[method]:.3f} s of local training per round (median of {len(later)} rounds)")
    print(f"ratio fedprok / fedavg: {local['fedprok'] / local['fedavg']:.2f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
