"""The federated baselines side by side on digits, scaled down.

FedAvg, FedProx, FedNova, APFL, the Avalanche hybrids (FedEWC, FedLwF,
FedReplay: random experience replay) and the FCL baselines that run on the
MLP (FediCaRL, GLFC, FedSpace, FedWeIT, CReFF, FEDIC) on the same partitions and seeds, in FedProK's synchronous and
asynchronous FCIL settings: 3 clients, 5 tasks of 2 digit classes (sync,
Dirichlet alpha 0.5) or 3 tasks per client (async, consensus 0.5), 3 rounds
per task, 2 local epochs, the default MLP, 2 CPU cores. FedNova's step
normalisation matters because the Dirichlet split gives clients different
sample counts and hence different local step counts.

    python benchmarks/baselines.py [--seeds 0 1] [--rounds-per-task 3]

Writes benchmarks/results/baselines.md.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from fedaval.api import run_training
from fedaval.config import RunConfig

RESULTS = Path(__file__).resolve().parent / "results"

METHODS = {
    "FedAvg": (["fedavg"], {}),
    "FedProx mu=0.01": (["fedprox"], {"fedprox": {"mu": 0.01}}),
    "FedNova": (["fednova"], {}),
    "APFL": (["apfl"], {}),
    "FedEWC": (["fedewc"], {"fedewc": {"ewc_lambda": 10.0}}),
    "FedLwF": (["fedlwf"], {}),
    "FedReplay (random replay) mem=500": (["fedreplay"], {"fedreplay": {"mem_size": 500}}),
    "FediCaRL mem=500": (["ficarl"], {"ficarl": {"memory_size": 500}}),
    "GLFC": (["glfc"], {}),
    "FedSpace": (["fedspace"], {}),
    "FedWeIT": (["fedweit"], {}),
    "CReFF": (["creff"], {}),
    "FEDIC (proxy from the training set)": (["fedic"], {"fedic": {"proxy": "train"}}),
}
# FEDIC's server proxy set is held-out training data by default; fcil-sync on digits gives every
# training sample to a client, so here it is drawn from the training set (proxy=train).
# Not here: TARGET (its generator matches BatchNorm statistics; the digits MLP has none) and
# CFeD (it needs a surrogate dataset besides the task data).
SCENARIOS = {
    "fcil-sync": {"clients": 3, "tasks": 5, "alpha": 0.5},
    "fcil-async": {"clients": 3, "tasks": 3, "consensus": 0.5},
}


def pct(values):
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    mean = sum(values) / len(values)
    spread = (max(values) - min(values)) / 2 if len(values) > 1 else 0.0
    return f"{100 * mean:.1f} ± {100 * spread:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--rounds-per-task", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []
    for scenario, scenario_options in SCENARIOS.items():
        lines += [
            f"\n### {scenario} {scenario_options}\n",
            "| method | final acc % | avg incremental acc % | forgetting % | A_loc % | MB up | s/run |",
            "|---|---|---|---|---|---|---|",
        ]
        for label, (plugins, options) in METHODS.items():
            rows = []
            for seed in args.seeds:
                config = RunConfig(
                    plugins=plugins,
                    plugin_options=options,
                    scenario=scenario,
                    scenario_options=scenario_options,
                    dataset="digits",
                    rounds_per_task=args.rounds_per_task,
                    local_epochs=2,
                    batch_size=32,
                    lr=0.05,
                    eval_every=10_000,
                    device="cpu",
                    seed=seed,
                    out=tempfile.mkdtemp() + "/run",
                )
                start = time.perf_counter()
                final = run_training(config)["final"]
                rows.append((final, time.perf_counter() - start))
            finals = [f for f, _ in rows]
            lines.append(
                f"| {label} | {pct(f['accuracy'] for f in finals)} | {pct(f['average_accuracy'] for f in finals)}"
                f" | {pct(f['forgetting'] for f in finals)} | {pct(f['mean_client_accuracy'] for f in finals)}"
                f" | {finals[0]['bytes_up'] / 1e6:.2f} | {sum(s for _, s in rows) / len(rows):.1f} |"
            )
            print(lines[-1], flush=True)
    header = [
        "# Baselines on digits (scaled down)",
        "",
        f"Command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()}, "
        f"{torch.get_num_threads()} torch thread, 2 CPU cores, no GPU; seeds {args.seeds} (mean ± half range).",
        "Settings: digits (sklearn 8x8), default MLP, 3 clients, rounds per task "
        f"{args.rounds_per_task}, 2 local epochs, batch 32, lr 0.05, all clients every round.",
    ]
    text = "\n".join(header + lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "baselines.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
