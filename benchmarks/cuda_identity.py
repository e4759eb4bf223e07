"""On a GPU: the same seed gives the same results.json, and a checkpoint taken there resumes there.

    python benchmarks/cuda_identity.py                  # --device cuda, the settings below
    python benchmarks/cuda_identity.py --device cpu     # the same checks on the CPU (the test suite has them too)

The GPU issue's item 1. For each setting (a method, a scenario, a dataset and a
model; ``--settings`` picks some), in this one process:

* **twice with --deterministic**: two whole runs with the same seed; their
  results.json must be equal apart from the timing fields (``seconds*``,
  ``efficiency*``) and the run folder;
* **resumed**: the first run's checkpoint of each round in ``--resume-rounds``
  is restored into a freshly built run (as ``fedaval train --resume`` does),
  which trains to the end; its results.json must equal the whole run's;
* **with --cuda-graphs** (on a CUDA device): a run with each client's
  backbone replayed from CUDA graphs (:mod:`fedaval.cuda_graphs`), still
  with --deterministic; its results.json must equal the whole run's (the
  ``cuda_graphs`` field of the config aside);
* **twice without --deterministic** (``--nondeterministic``, first setting
  only): whether cuDNN's and the atomics' nondeterminism shows in the results;
  reported, not required.

Prints one line per check (``same`` or the first differing field) and exits 1
if a required check failed. Not a test: a benchmark-side check for a machine
the test suite's CPU runs do not reach.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))


def settings(data_root: str) -> dict[str, dict]:
    """The settings checked: what each exercises is in its comment."""
    cifar = dict(dataset="imagefolder", data_root=data_root)
    return {
        # ResNet-18 (BatchNorm, cuDNN convolutions), augmentation on the device data path
        "fedavg-resnet18": dict(
            plugins=["fedavg"],
            model="resnet18",
            augment="standard",
            scenario_options={"clients": 3, "tasks": 2},
            **cifar,
        ),
        # the README's job: prototypes, long-tailed sthfl
        "gldp-sthfl": dict(plugins=["gldp"], scenario="sthfl", dataset="digits"),
        # a frozen teacher, an exemplar memory, a swapped dataloader
        "pfcl-random": dict(plugins=["pfcl"], scenario="fcl-random", scenario_options={"clients": 2}, dataset="digits"),
        # knowledge-enhanced prototypes, the cnn on CIFAR-10
        "fedprok-cnn": dict(plugins=["fedprok"], model="cnn", scenario_options={"clients": 3, "tasks": 2}, **cifar),
    }


def first_difference(a, b, path: str = "") -> str | None:
    """The first field where ``a`` and ``b`` differ, or ``None``."""
    if type(a) is not type(b):
        return f"{path or '/'}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, dict):
        for key in sorted(a.keys() | b.keys(), key=str):
            if key not in a or key not in b:
                return f"{path}/{key}: only in one"
            found = first_difference(a[key], b[key], f"{path}/{key}")
            if found:
                return found
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}/{i}")
            if found:
                return found
        return None
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--settings", default="", help="comma-separated names (default: all)")
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--resume-rounds", default="2,4", help="checkpoints to resume from")
    parser.add_argument("--nondeterministic", action="store_true", help="also two runs without --deterministic")
    parser.add_argument("--data-root", default=None, help="an image folder (default: the shared CIFAR-10 subset)")
    args = parser.parse_args(argv)
    # cuBLAS reads this when it starts: before the first CUDA call of the process
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    from backends import comparable as strip_timing  # results.json without timings and the run folder

    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.config import RunConfig
    from fedaval.coordinator import train

    if args.data_root is None:
        from cifar_data import cifar_subset

        args.data_root = str(cifar_subset(50, 20))
    chosen = settings(args.data_root)
    if args.settings:
        unknown = set(args.settings.split(",")) - chosen.keys()
        if unknown:
            parser.error(f"unknown settings {sorted(unknown)}; known: {', '.join(chosen)}")
        chosen = {name: chosen[name] for name in args.settings.split(",")}
    resume_rounds = [int(r) for r in args.resume_rounds.split(",") if r]

    failed = 0

    def report(name: str, check: str, a, b, required: bool = True) -> None:
        nonlocal failed
        difference = first_difference(a, b)
        failed += bool(difference) and required
        verdict = "same" if difference is None else f"DIFFERENT at {difference}"
        print(f"{name}: {check}: {verdict}{'' if required else ' (reported, not required)'}", flush=True)

    with tempfile.TemporaryDirectory(prefix="fedaval-cuda-identity-") as tmp:
        for index, (name, overrides) in enumerate(chosen.items()):

            def config(
                label: str, deterministic: bool = True, cuda_graphs: bool = False, name=name, overrides=overrides
            ) -> RunConfig:
                return RunConfig(
                    rounds_per_task=args.rounds_per_task,
                    device=args.device,
                    seed=0,
                    deterministic=deterministic,
                    cuda_graphs=cuda_graphs,
                    checkpoint_every=1,
                    keep_checkpoints=100,
                    out=str(Path(tmp) / name / label),
                    **overrides,
                )

            whole = strip_timing(run_training(config("a")))
            report(name, "twice with --deterministic", whole, strip_timing(run_training(config("b"))))
            for round in resume_rounds:
                run = build_run(config(f"resumed-{round}"), out_dir=Path(tmp) / name / f"resumed-{round}")
                results = checkpoint.restore(run, checkpoint.path_for(Path(tmp) / name / "a", round))
                report(name, f"resumed from round {round}", whole, strip_timing(train(run, results=results)))
            if args.device.startswith("cuda"):
                graphed = strip_timing(run_training(config("graphs", cuda_graphs=True)))
                graphed["config"]["cuda_graphs"] = False
                report(name, "with --cuda-graphs", whole, graphed)
            if args.nondeterministic and index == 0:
                first = strip_timing(run_training(config("c", deterministic=False)))
                second = strip_timing(run_training(config("d", deterministic=False)))
                report(name, "twice without --deterministic", first, second, required=False)
            final = whole.get("final") or {}
            shown = {k: final.get(k) for k in ("accuracy", "average_accuracy", "forgetting", "mean_client_accuracy")}
            print(f"{name}: final {shown}", flush=True)
    print(f"device {args.device}: {'all required checks passed' if not failed else f'{failed} check(s) FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
