"""GLDP vs FedAvg (and FedRep with --fedrep) on CIFAR-10 in the STHFL setting, scaled down.

Paper (GLDP, Table 2 / Fig. 3): CIFAR-10 [20,4,5], IF=50, ResNet-18, 50
rounds of t+s=30 local epochs: A_glo FedAvg 59.94 vs GLDP-GP 65.22. Here:
[10,4,3], IF=50, 200 test images per class, the small ``cnn``, a few rounds of 3 local epochs (GLDP:
t=1 base epoch, s=2 head epochs), 2 CPU cores. One invocation runs every
method on the same partition and seed and prints A_glo / A_loc (the core's
metrics) side by side; GLDP's A_loc is given for both prototype sets
(GLDP-GP: global prototypes, GLDP-LP: the client's local prototypes) from
the same run.

    python benchmarks/gldp_vs_fedavg.py [--data-root /tmp/cifar10-full] [--rounds-per-task 3] [--fedrep]

Writes benchmarks/results/gldp_vs_fedavg.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import shutil
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

from fedaval.api import run_training
from fedaval.config import RunConfig

RESULTS = Path(__file__).resolve().parent / "results"


def settings(args, plugins, options=None) -> RunConfig:
    return RunConfig(
        plugins=plugins,
        plugin_options=options or {},
        scenario="sthfl",
        scenario_options={
            "clients": args.clients,
            "classes_per_task": 4,
            "tasks": args.tasks,
            "imbalance": 50.0,
        },
        dataset="imagefolder",
        data_root=args.data_root,
        model="cnn",
        rounds_per_task=args.rounds_per_task,
        local_epochs=3,
        clients_per_round=args.clients_per_round,
        batch_size=32,
        lr=0.01,
        momentum=0.0,
        eval_every=10_000,  # evaluate at the end of each stage only
        device="cpu",
        seed=args.seed,
    )


def test_subset(root: Path, per_class: int) -> Path:
    """``root`` with its test split cut to the first ``per_class`` images of each
    class (symlinks; the train split is the same folder), made once next to it.
    Evaluating 10 personalised models on their classes dominates the run time
    otherwise."""
    if per_class <= 0:
        return root
    subset = root.with_name(f"{root.name}-test{per_class}")
    if (subset / "test").is_dir():
        return subset
    tmp = Path(tempfile.mkdtemp(dir=root.parent, prefix=subset.name + ".tmp"))
    (tmp / "train").symlink_to((root / "train").resolve())
    for class_dir in sorted((root / "test").iterdir()):
        (tmp / "test" / class_dir.name).mkdir(parents=True)
        for image in sorted(class_dir.iterdir())[:per_class]:
            (tmp / "test" / class_dir.name / image.name).symlink_to(image.resolve())
    try:
        tmp.rename(subset)
    except OSError:  # made meanwhile by another process
        shutil.rmtree(tmp)
    return subset


def pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-root", default="/tmp/cifar10-full")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--tasks", type=int, default=3)
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--clients-per-round", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--test-per-class", type=int, default=200, help="test images per class (0: all 1000)")
    parser.add_argument("--fedrep", action="store_true", help="also run FedRep")
    args = parser.parse_args()

    torch.set_num_threads(1)  # 2 shared cores: one thread per process runs far faster than two contending
    args.data_root = str(test_subset(Path(args.data_root), args.test_per_class))
    methods = [
        ("FedAvg", ["fedavg"], {}),
        ("GLDP", ["gldp"], {"gldp": {"t": 1, "s": 2, "predict": "global"}}),
    ]
    if args.fedrep:
        methods.insert(1, ("FedRep", ["fedrep"], {}))
    rows, raw = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, plugins, options in methods:
            config = settings(args, plugins, options)
            config.out = str(Path(tmp) / label)
            start = time.perf_counter()
            results = run_training(config)
            seconds = time.perf_counter() - start
            last = [r for r in results["rounds"] if r.get("a_glo") is not None][-1]
            stages = [r for r in results["rounds"] if r.get("task_end")]
            raw[label] = {"final": last, "stages": stages, "seconds": seconds}
            if label == "GLDP":
                rows.append(("GLDP-GP", last["a_glo"], last["plugin_metrics"]["gldp"].get("gldp_a_loc_gp"), seconds))
                rows.append(("GLDP-LP", last["a_glo"], last["plugin_metrics"]["gldp"].get("gldp_a_loc_lp"), None))
            else:
                rows.append((label, last["a_glo"], last["a_loc"], seconds))
            print(
                f"{label}: A_glo per stage {[pct(r['a_glo']) for r in stages]}, "
                f"A_loc per stage {[pct(r['a_loc']) for r in stages]}  ({seconds:.0f} s)",
                flush=True,
            )

    scale = (
        f"[{args.clients},4,{args.tasks}], IF=50, test images per class: {args.test_per_class or 1000}, cnn, {args.rounds_per_task} rounds/stage, "
        f"3 local epochs (GLDP t=1, s=2), batch 32, lr 0.01, wd 1e-4, "
        f"clients/round={args.clients_per_round or 'all'}, seed {args.seed}"
    )
    table = ["| method | A_glo (%) | A_loc (%) | seconds |", "|---|---|---|---|"]
    for label, a_glo, a_loc, seconds in rows:
        table.append(f"| {label} | {pct(a_glo)} | {pct(a_loc)} | {'' if seconds is None else f'{seconds:.0f}'} |")
    command = "python benchmarks/gldp_vs_fedavg.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = "\n".join(
        [
            "# GLDP vs FedAvg, CIFAR-10 STHFL (scaled down)",
            "",
            f"Command: `{command.strip()}`",
            f"Date: {datetime.now(UTC):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, 2 CPU cores, no GPU",
            f"Setting: {scale}",
            "",
            *table,
            "",
            "A_glo: global model (GLDP: nearest global prototype) on each client's seen classes, mean over clients.",
            "A_loc: each client's personalised model on its seen classes, mean over clients; after the last round.",
            "GLDP-GP / GLDP-LP share one run (same training); they differ in the prototypes used for prediction.",
            "Paper, full scale ([20,4,5], ResNet-18, 50 rounds x 30 epochs): A_glo FedAvg 59.94, GLDP-GP 65.22.",
        ]
    )
    print()
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gldp_vs_fedavg.md").write_text(text + "\n")
    (RESULTS / "gldp_vs_fedavg.json").write_text(json.dumps(raw, indent=1, default=str))


if __name__ == "__main__":
    main()
