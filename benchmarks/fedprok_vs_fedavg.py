"""FedProK vs FedAvg on CIFAR-10, synchronous FCIL (T=5, alpha=1, N=3), scaled
to a 2-core CPU: the paper's Table 1 column "CIFAR-10, T=5, alpha=1"
(FedAvg 18.45, Ours-w/oFT 17.73, Ours-w/oPKF 58.76, FedProK 64.34 with
ResNet-18 on the full data), here with the small ``cnn`` model on a per-class
subset of the shared CIFAR-10 (ImageFolder layout) and few rounds.

    python benchmarks/fedprok_vs_fedavg.py            # ~10 min on a busy 2-core machine

Runs FedAvg, FedProK and its two ablations (w/o feature translation, w/o
knowledge fusion) from one invocation, prints a table and writes it, with the
command, date and machine, to ``benchmarks/results/fedprok_vs_fedavg.md``
(run folders under ``benchmarks/results/fedprok_runs/``).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

from cifar_data import cifar_subset  # noqa: E402 - this folder, see cifar_data.py

HERE = Path(__file__).resolve().parent

METHODS = [
    ("FedAvg", ["fedavg"], {}),
    ("FedProK w/o FT", ["fedprok"], {"fedprok": {"translation": "false"}}),
    ("FedProK w/o PKF", ["fedprok"], {"fedprok": {"fusion": "false"}}),
    ("FedProK", ["fedprok"], {}),
]


def pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}"


def run_method(label, plugins, options, args, root, runs_dir) -> dict:
    """One method's run; returns its row of the table."""
    import torch

    torch.set_num_threads(args["threads"])
    from fedaval.api import run_training
    from fedaval.config import RunConfig

    config = RunConfig(
        plugins=plugins,
        plugin_options=options,
        scenario="fcil-sync",
        scenario_options={"clients": 3, "tasks": 5, "alpha": 1.0},
        dataset="imagefolder",
        data_root=root,
        model="cnn",
        rounds_per_task=args["rounds_per_task"],
        local_epochs=args["local_epochs"],
        batch_size=args["batch_size"],
        lr=args["lr"],
        momentum=args["momentum"],
        eval_every=args["rounds_per_task"],  # evaluate at task ends only
        device="cpu",
        seed=args["seed"],
        out=str(Path(runs_dir) / label.replace(" ", "_").replace("/", "")),
    )
    start = time.perf_counter()
    results = run_training(config)
    wall = time.perf_counter() - start
    final, rounds = results["final"], results["rounds"]
    task_ends = [r for r in rounds if r.get("task_end") and r["task"] >= 1 and r.get("utility") is not None]
    n = len(rounds)
    print(f"{label}: final accuracy {pct(final['accuracy'])}%  ({wall:.0f} s)", flush=True)
    return {
        "method": label,
        "accuracy": final["accuracy"],
        "average_accuracy": final["average_accuracy"],
        "stability": final.get("stability_last", final.get("stability")),  # the table's "final" columns
        "plasticity": final.get("plasticity_last", final.get("plasticity")),
        "utility": final.get("utility_last", final.get("utility")),
        "mean_utility": sum(r["utility"] for r in task_ends) / len(task_ends) if task_ends else None,
        "s_local": sum(r["seconds_local"] for r in rounds) / n,
        "s_fusion": sum(r["seconds_fusion"] for r in rounds) / n,
        "kb_up": sum(r["bytes_up"] for r in rounds) / n / 1024,
        "kb_down": sum(r["bytes_down"] for r in rounds) / n / 1024,
        "wall": wall,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-per-class", type=int, default=200)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--rounds-per-task", type=int, default=2, help="paper: a new task every 5 rounds")
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run")
    parser.add_argument("--jobs", type=int, default=4, help="runs in parallel (processes)")
    parser.add_argument("--out", default=str(HERE / "results"))
    args = parser.parse_args(argv)

    root = cifar_subset(args.train_per_class, args.test_per_class)
    out = Path(args.out)
    runs_dir = out / "fedprok_runs" / datetime.now().strftime("%Y%m%d-%H%M%S")
    jobs = [(label, plugins, options, vars(args), str(root), str(runs_dir)) for label, plugins, options in METHODS]
    if args.jobs > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            rows = list(pool.map(run_method, *zip(*jobs)))
    else:
        rows = [run_method(*job) for job in jobs]

    header = (
        "| method | final acc % | avg inc. acc % | stability % | plasticity % | U (final) % | U (mean over tasks 2-5) % "
        "| s/round local | s/round fusion | KiB up/round | KiB down/round | wall s |"
    )
    lines = [header, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['method']} | {pct(r['accuracy'])} | {pct(r['average_accuracy'])} | {pct(r['stability'])} "
            f"| {pct(r['plasticity'])} | {pct(r['utility'])} | {pct(r['mean_utility'])} | {r['s_local']:.2f} "
            f"| {r['s_fusion']:.4f} | {r['kb_up']:.0f} | {r['kb_down']:.0f} | {r['wall']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)

    command = "python benchmarks/fedprok_vs_fedavg.py" + (
        "" if argv is None and len(sys.argv) == 1 else " " + " ".join(sys.argv[1:] if argv is None else argv)
    )
    report = f"""# FedProK vs FedAvg: CIFAR-10, synchronous FCIL, T=5, alpha=1, N=3 (scaled)

Command: `{command}`
Date: {datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}; machine: {platform.machine()}, no GPU; {args.jobs} runs in parallel, {args.threads} torch thread(s) each
({os.cpu_count()} cores visible, shared with other jobs, so seconds are indicative only).

Setting: shared CIFAR-10 as ImageFolder, first {args.train_per_class} train / {args.test_per_class} test images per class;
`fcil-sync` (3 clients, 5 tasks of 2 classes, Dirichlet alpha=1), model `cnn` (3 conv layers, 128-d features),
{args.rounds_per_task} rounds per task ({5 * args.rounds_per_task} rounds), {args.local_epochs} local epochs, batch {args.batch_size},
SGD lr {args.lr} momentum {args.momentum}, seed {args.seed}. FedProK defaults: beta=0.5, frozen extractor from task 2 on.
U = 0.5 * stability + 0.5 * plasticity (global accuracy on earlier-task classes / current-task classes).

{table}

Paper (Table 1, ResNet-18, full CIFAR-10, 3 seeds): FedAvg 18.45, w/o FT 17.73, w/o PKF 58.76, FedProK 64.34.
Run folders: `{runs_dir.relative_to(HERE.parent) if runs_dir.is_relative_to(HERE.parent) else runs_dir}`.
"""
    out.mkdir(parents=True, exist_ok=True)
    (out / "fedprok_vs_fedavg.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
