"""fedaval's ``--host-memory keep`` (the default) against ``release``: the
same fedaval run, each in an interpreter of its own, alternating.

    python benchmarks/host_memory.py                     # CIFAR-10 subset, cnn, 5 tasks x 3 rounds
    python benchmarks/host_memory.py --dataset digits    # the MLP on digits: small tensors

The work is ``overhead.py``'s fedaval side (``overhead.time_fedaval``, same
options). Each timed run has a process of its own, since the policy belongs to
the process (fedaval/host_memory.py), after an untimed one-round run there
(lazy imports, first allocations). Printed per policy: the median wall time,
the kernel (system) CPU time and minor page faults of the timed run, and the
process's peak resident memory; then the ratio keep / release. Not a test:
nothing is asserted.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import overhead  # noqa: E402
import torch  # noqa: E402

POLICIES = ("keep", "release")


def child(args) -> int:
    """One timed run under ``args.host_memory``, as a JSON line."""
    torch.set_num_threads(args.threads)
    overhead.resolve_data_root(args)
    with tempfile.TemporaryDirectory(prefix="fedaval-host-memory-") as tmp:
        warm = copy.copy(args)
        warm.tasks, warm.rounds_per_task = 1, 1
        overhead.time_fedaval(warm, Path(tmp) / "warm-up")
        before = resource.getrusage(resource.RUSAGE_SELF)
        seconds, _ = overhead.time_fedaval(args, Path(tmp) / "timed")
        after = resource.getrusage(resource.RUSAGE_SELF)
    print(
        json.dumps(
            {
                "wall": seconds,
                "system": after.ru_stime - before.ru_stime,
                "faults": after.ru_minflt - before.ru_minflt,
                "peak_mb": after.ru_maxrss / 1024,
            }
        )
    )
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    overhead.add_work_arguments(parser)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--child", dest="host_memory", choices=POLICIES, default=None, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.host_memory is not None:
        return child(args)
    overhead.resolve_data_root(args)  # made once, before the children read it
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    runs: dict[str, list[dict]] = {p: [] for p in POLICIES}
    for repeat in range(args.repeats):
        for policy in POLICIES if repeat % 2 == 0 else POLICIES[::-1]:
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), *argv, "--child", policy],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            runs[policy].append(json.loads(out.strip().splitlines()[-1]))
            print(f"repeat {repeat}, {policy}: {runs[policy][-1]}", flush=True)
    print("| --host-memory | wall s (median; all) | kernel CPU s | minor page faults | peak resident MB |")
    print("|---|---|---|---|---|")
    median = {}
    for policy, rs in runs.items():
        median[policy] = statistics.median(r["wall"] for r in rs)
        walls = " ".join(f"{r['wall']:.2f}" for r in rs)
        print(
            f"| {policy} | {median[policy]:.2f} ({walls}) "
            f"| {statistics.median(r['system'] for r in rs):.2f} | {statistics.median(r['faults'] for r in rs):,.0f} "
            f"| {statistics.median(r['peak_mb'] for r in rs):,.0f} |"
        )
    print(f"ratio keep / release: {median['keep'] / median['release']:.3f}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
