"""What a checkpoint costs with many live clients: the seconds it keeps
training waiting, the seconds its background write takes, and a restore.

    python benchmarks/checkpoint_cost.py                               # this checkout, 1000 cnn clients
    python benchmarks/checkpoint_cost.py --checkout /tmp/old --checkout .   # two checkouts, alternating

The run is the cross-device shape of ``pfl_overhead.py`` (the shared CIFAR-10
subset, 1000 clients of 50 images, ``cnn``, 50 sampled per round, every
client kept live), built and trained for one round by
``fedaval.api.run_training``; then ``--repeats`` checkpoints of it are taken:
``fedaval.checkpoint.snapshot`` (what training waits for: the run's objects
pickled), ``_write_snapshot`` (the file, written in the background during
training) and ``restore`` into a fresh build. Where the checkout has forked
checkpoints (session 19), each repeat also takes the same checkpoint forked
(``save_in_background(..., fork=True)``: what training waits for is the
fork; then the child's pickling and writing, waited for) and checks that its
file is the in-process one, byte for byte. Each checkout runs in a fresh
interpreter with ``PYTHONPATH`` set to it (one torch thread), alternating,
so that the ratios come from one invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# What every child of :func:`in_checkout` starts with: the checkout's fedaval
# (checked), one torch thread, and ``work``: pfl_overhead.py's cross-device
# shape, one round, with ``options["clients"]`` clients.
PREAMBLE = r"""
import json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import torch, fedaval
assert Path(fedaval.__file__).parent.parent == Path(sys.argv[3]), fedaval.__file__
torch.set_num_threads(1)
import overhead

options = json.loads(sys.argv[1])
work = overhead.cross_device_work(options["clients"], 1)
"""

CHILD = (
    PREAMBLE
    + r"""
from fedaval import checkpoint, hookimpl
from fedaval.api import run_training
from fedaval.build import build_run

class Keep:
    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

keep = Keep()
with tempfile.TemporaryDirectory() as out:
    config = overhead.run_config(work, Path(out) / "run")
    run_training(config, extra_plugins=[keep])
    run = keep.run
    forks = hasattr(checkpoint, "_ForkedWriter")
    times = {"snapshot": [], "write": [], "restore": []} | ({"fork": [], "forked write": []} if forks else {})
    same = []
    for _ in range(options["repeats"]):
        start = time.perf_counter()
        path, content = checkpoint.snapshot(run, {"rounds": []})
        times["snapshot"].append(time.perf_counter() - start)
        start = time.perf_counter()
        checkpoint._write_snapshot(path, content, 1)
        times["write"].append(time.perf_counter() - start)
        del content
        if forks:
            written = path.read_bytes()
            path.unlink()
            start = time.perf_counter()
            checkpoint.save_in_background(run, {"rounds": []}, fork=True)
            times["fork"].append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoint.wait(run)
            times["forked write"].append(time.perf_counter() - start)
            same.append(path.read_bytes() == written)
            del written
    if same and not all(same):
        raise SystemExit("a forked checkpoint differs from the one written in the process")
    size = path.stat().st_size
    fresh = build_run(config, out_dir=Path(out) / "run")
    start = time.perf_counter()
    checkpoint.restore(fresh, path)
    times["restore"].append(time.perf_counter() - start)
print("RESULT " + json.dumps({"times": times, "bytes": size}))
"""
)


def in_checkout(code: str, checkout: Path, options: dict) -> dict:
    """``code`` (a ``CHILD``: ``argv`` = options as JSON, this folder, the
    checkout) in a fresh interpreter on ``checkout``'s fedaval."""
    env = dict(os.environ, PYTHONPATH=str(checkout))
    # cwd: ``-c`` puts the working directory first on sys.path
    return child_result(
        code, [json.dumps(options), str(HERE), str(checkout)], f"the run in {checkout}", cwd=checkout, env=env
    )


def alternating(code: str, argv: list[str] | None, repeats_help: str) -> tuple[argparse.Namespace, dict]:
    """Parse ``--checkout``, ``--clients``, ``--repeats``, ``--rounds``; run
    ``code`` ``--rounds`` times per checkout, alternating the checkouts'
    order, printing each result's times; return the arguments and each
    checkout's results."""
    parser = argparse.ArgumentParser(description=sys.modules["__main__"].__doc__.splitlines()[0])
    parser.add_argument(
        "--checkout", action="append", type=Path, help="a fedaval checkout (repeatable; default: this one)"
    )
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3, help=repeats_help)
    parser.add_argument("--rounds", type=int, default=2, help="processes per checkout, alternating")
    args = parser.parse_args(argv)
    checkouts = [c.resolve() for c in (args.checkout or [HERE.parent])]
    results: dict[Path, list[dict]] = {c: [] for c in checkouts}
    for repeat in range(args.rounds):
        for checkout in checkouts if repeat % 2 == 0 else checkouts[::-1]:
            result = in_checkout(code, checkout, {"clients": args.clients, "repeats": args.repeats})
            results[checkout].append(result)
            print(f"{checkout}: " + json.dumps(result["times"]), flush=True)
    return args, results


def child_result(code: str, args: list[str], what: str, **run_options) -> dict:
    """Run ``code`` in a fresh interpreter (``python -c code *args``); the JSON
    object on its last ``RESULT`` line. A failed run ends the benchmark,
    with ``what`` and the end of its standard error."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, check=False, **run_options
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> int:
    args, results = alternating(CHILD, argv, "checkpoints per process")
    print(f"\n{args.clients} live cnn clients; medians over {args.rounds} processes x {args.repeats} checkpoints")
    print(
        "| checkout | snapshot (training waits) s | write (background) s | restore s | file MB "
        "| forked: fork (training waits) s | forked: child's pickle and write s |"
    )
    print("|---|---|---|---|---|---|---|")
    for checkout, runs in results.items():
        median = {
            k: statistics.median(t for r in runs for t in r["times"][k]) if k in runs[0]["times"] else None
            for k in ("snapshot", "write", "restore", "fork", "forked write")
        }
        forked = " | ".join(
            "not in this checkout" if v is None else f"{v:.3f}" for v in (median["fork"], median["forked write"])
        )
        print(
            f"| {checkout} | {median['snapshot']:.2f} | {median['write']:.2f} | {median['restore']:.2f} "
            f"| {runs[-1]['bytes'] / 1e6:.0f} | {forked} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
