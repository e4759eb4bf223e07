"""docs/privacy.md's table: FedAvg, FedProK and PFCL on a CIFAR-10 subset,
without DP and with the dp plugin at two noise multipliers, each attacked by
the attack plugin (honest-but-curious server), scaled for the CPU.

    PYTHONPATH=. [METHODS=fedavg,pfcl] python benchmarks/privacy_table.py OUT_DIR [options]

The defaults are docs/privacy.md's table (session 5): 200 training / 50 test
images per class, fcil-sync with 2 clients x 2 tasks, 3 rounds per task,
the attack on rounds 3 and 6 on both clients, 300 iterations each, so every
P and PSNR cell is a mean over 4 attacked uploads. Session 3's smaller table
was ``--train 50 --test 10 --rounds-per-task 2 --attack-every 4
--attack-clients 1 --iterations 100``.

Writes OUT_DIR/<method>-<dp>/ runs (a finished run is read, not re-run) and
prints a Markdown table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cifar_data import cifar_subset  # noqa: E402

METHODS = ["fedavg", "fedprok", "pfcl"]
NOISE = [None, 0.1, 1.0]  # None: no dp plugin
CLIP = 1.0


def settings(root: Path, method: str, noise, out: Path, args: argparse.Namespace) -> dict:
    # import paths: work before the entry points "dp" and "attack" are installed
    plugins = [method] + (["fedaval.plugins.dp:DP"] if noise is not None else []) + ["fedaval.plugins.attack:Attack"]
    attack = {"every": args.attack_every, "clients": args.attack_clients, "iterations": args.iterations, "images": 1}
    options = {"attack": attack}
    if noise is not None:
        options["dp"] = {"clip": CLIP, "noise": noise}
    return dict(
        plugins=plugins,
        plugin_options=options,
        dataset="imagefolder",
        data_root=str(root),
        scenario="fcil-sync",
        scenario_options={"clients": 2, "tasks": 2},
        rounds_per_task=args.rounds_per_task,
        local_epochs=1,
        batch_size=32,
        device="cpu",
        seed=0,
        out=str(out),
    )


def row(results: dict, method: str, noise) -> str:
    from fedaval.config import RunConfig  # noqa: F401

    rounds = results["rounds"]
    acc = rounds[-1]["global_accuracy"]
    acc = rounds[-1]["mean_client_accuracy"] if acc is None else acc
    mean = results["privacy"]["attack"]["mean"]
    eps = results["privacy"].get("dp", {}).get("epsilon")
    cells = []
    for kind in ("weights", "prototypes"):
        m = mean.get(kind)
        guess = f"; guess {1e3 * m['p_guess']:.1f}" if m and "p_guess" in m else ""  # runs before session 34 lack it
        cells.append("-" if m is None else f"{1e3 * m['p']:.1f} / {m['psnr']:.1f} ({m['ssim']:.2f}){guess}")
    dp = "none" if noise is None else f"z={noise}, C={CLIP}"
    return f"| {method} | {dp} | {'-' if eps is None else f'{eps:.3g}'} | {cells[0]} | {cells[1]} | {100 * acc:.1f} |"


def main() -> None:
    import torch

    from fedaval.api import run_training

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", type=int, default=200, help="training images per class")
    parser.add_argument("--test", type=int, default=50, help="test images per class")
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--attack-every", type=int, default=3)
    parser.add_argument("--attack-clients", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = args.out
    root = cifar_subset(args.train, args.test)
    lines = [
        "| method | DP | epsilon (delta 1e-5) | weights attack: P x1e-3 / PSNR dB (SSIM); guess P | "
        "prototype attack: P x1e-3 / PSNR dB (SSIM); guess P | accuracy % |",
        "|---|---|---|---|---|---|",
    ]
    import os

    methods = os.environ.get("METHODS", ",".join(METHODS)).split(",")  # split the work over processes
    for method in methods:
        for noise in NOISE:
            run_dir = out / f"{method}-{'nodp' if noise is None else f'z{noise}'}"
            if (run_dir / "results.json").exists():
                results = json.loads((run_dir / "results.json").read_text())
            else:
                results = run_training(settings(root, method, noise, run_dir, args))
            lines.append(row(results, method, noise))
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
