"""Where the time goes on pfl_overhead.py's cross-device shape: each side's
build, checkpoints, local training and evaluation (benchmark only; pfl in its
own environment, as for ``pfl_overhead.py``).

    /work/pfl-venv/bin/python benchmarks/pfl_phases.py --rounds 8 --repeats 3

Each side runs in a fresh interpreter, after an untimed one-round run there,
as ``pfl_overhead.py`` times it, with a few of its functions wrapped in
timers: fedaval's ``build_run``, ``checkpoint.Schedule.save`` (what training
waits for), ``Client.train_round``, ``Client.evaluate`` and
``coordinator.evaluate`` (all evaluation of the round); pfl's
``FederatedAveraging.train_one_user`` (local training) and the benchmark's
``evaluate_client`` and global evaluation callback. The wrappers add a few
microseconds a call.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from checkpoint_cost import child_result

HERE = Path(__file__).resolve().parent

CHILD = r"""
import copy, json, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
import torch
torch.set_num_threads(1)
import overhead, pfl_overhead as P

side, rounds, pfl_memory = sys.argv[1], int(sys.argv[2]), sys.argv[4]
work = overhead.cross_device_work(1000, rounds)
tmp = Path(tempfile.mkdtemp())
warm = copy.copy(work)
warm.rounds_per_task = 1
P.time_side(side, warm, tmp, "warm-up", pfl_memory)
seconds = {}

def timed(owner, name, label):
    function = getattr(owner, name)
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return function(*a, **k)
        finally:
            seconds[label] = seconds.get(label, 0.0) + time.perf_counter() - start
    setattr(owner, name, wrapper)

if side == "fedaval":
    import fedaval.api
    from fedaval import build, checkpoint, client, coordinator
    timed(build, "build_run", "build")
    fedaval.api.build_run = build.build_run
    timed(checkpoint.Schedule, "save", "checkpoints")
    timed(client.Client, "train_round", "local training")
    timed(client.Client, "evaluate", "client evaluation")
    timed(coordinator, "evaluate", "all evaluation")
else:
    import pfl.algorithm.federated_averaging as fedavg
    timed(fedavg.FederatedAveraging, "train_one_user", "local training")
    timed(P, "evaluate_client", "client evaluation")
    timed(P.GlobalEvaluation, "after_central_iteration", "global evaluation")
total, _ = P.time_side(side, work, tmp, "timed", pfl_memory)
print("RESULT " + json.dumps({"total": total, **seconds}))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating which goes first")
    parser.add_argument(
        "--pfl-host-memory",
        default="release",
        choices=("release", "keep"),
        help="the pfl side's malloc policy, as in pfl_overhead.py (keep: the frameworks alone)",
    )
    args = parser.parse_args(argv)
    results: dict[str, list[dict]] = {"fedaval": [], "pfl": []}
    for repeat in range(args.repeats):
        for side in ("fedaval", "pfl") if repeat % 2 == 0 else ("pfl", "fedaval"):
            results[side].append(
                child_result(CHILD, [side, str(args.rounds), str(HERE), args.pfl_host_memory], f"the {side} run")
            )
            print(side, {k: round(v, 2) for k, v in results[side][-1].items()}, flush=True)
    print(
        f"\ncross-device shape, {args.rounds} rounds, median seconds of {args.repeats} runs per side; "
        f"pfl's host memory: {args.pfl_host_memory}"
    )
    labels = ["total", "build", "checkpoints", "local training", "client evaluation", "all evaluation"]
    labels += ["global evaluation"]
    print("| side | " + " | ".join(labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for side, runs in results.items():
        cells = [f"{statistics.median(r[k] for r in runs):.2f}" if k in runs[0] else "" for k in labels]
        print(f"| {side} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
