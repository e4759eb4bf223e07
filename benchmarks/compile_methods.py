"""Every method trained eagerly and with ``--compile``: the same results.json?

    python benchmarks/compile_methods.py                       # every plugin (22), --compile aot_eager, the CPU
    python benchmarks/compile_methods.py --compile inductor fedavg gldp

``--compile`` puts each client's training forward of the backbone through
``torch.compile`` (fedaval/training.py); a method's own calls, loss terms and
hooks stay eager. For each method, one small run (the digits, the CNN, 2
clients, 2 tasks of 3 rounds, SGD with momentum 0.9) eagerly and one
compiled, their results.json compared whole, timings and the option itself
left out. With ``aot_eager`` (dynamo's capture, eager kernels) any difference
is a method that the compiled backbone changes; with ``inductor`` the
generated kernels sum in other orders, and the largest difference of the
final accuracy is printed instead. Not a test: each line prints as it is
measured, a run that fails is a line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "tests"))

SUBSET = HERE.parent / "tests" / "data" / "cifar10"  # the suite's CIFAR-10 images (tests/conftest.py)
NEEDS = {  # what a method needs beyond the small run, as its tests give it
    "cfed": {
        "plugin_options": {
            "cfed": {"surrogate": "imagefolder", "surrogate_root": str(SUBSET), "surrogate_samples": 100}
        }
    },
    "fedic": {
        "plugin_options": {
            "fedic": {
                "proxy_per_class": 3,
                "steps": 20,
                "unlabelled": "imagefolder",
                "unlabelled_root": str(SUBSET),
                "unlabelled_samples": 150,
            }
        },
        "scenario": "sthfl",
        "scenario_options": {"clients": 3, "classes_per_task": 3, "tasks": 2, "imbalance": 4.0},
    },
    "gldp": {"local_epochs": 2},  # its base and head epochs
}


def results(method: str, compile: str, device: str) -> dict:
    from helpers import strip_timing, tiny_run_config

    from fedaval.api import run_training

    settings = {"scenario_options": {"clients": 2, "tasks": 2}, **NEEDS.get(method, {})}
    with tempfile.TemporaryDirectory() as tmp:
        config = tiny_run_config(
            Path(tmp) / "run", plugins=[method], model="cnn", compile=compile, momentum=0.9, device=device, **settings
        )
        out = strip_timing(run_training(config))
    out["config"].pop("compile")
    return out


def main(argv=None) -> int:
    from fedaval.plugin_manager import installed_plugins

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("methods", nargs="*", help="plugin names (default: every plugin installed)")
    parser.add_argument("--compile", default="aot_eager", help="the backend to compare with eager")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    names = args.methods or sorted(installed_plugins())
    for method in names:
        start = time.monotonic()
        try:
            eager, compiled = (results(method, c, args.device) for c in ("off", args.compile))
        except Exception as exc:  # noqa: BLE001 - a method that fails is a line, not the end
            print(f"{method}: failed: {type(exc).__name__}: {exc}".splitlines()[0], flush=True)
            continue
        verdict = "the same results.json" if eager == compiled else "DIFFERENT results.json"
        accuracies = [r["final"]["accuracy"] for r in (eager, compiled)]  # None: no global model (FedWeIT)
        key = "accuracy" if accuracies[0] is not None else "mean_client_accuracy"
        difference = abs(eager["final"][key] - compiled["final"][key])
        seconds = time.monotonic() - start
        print(f"{method:<10} {verdict}; final {key} differs by {difference:.4f} ({seconds:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
