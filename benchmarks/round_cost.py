"""fedaval's fixed cost per round, and whether it grows with the rounds done.

    python benchmarks/round_cost.py                        # digits, 5 tasks x 100 rounds = 500 rounds
    python benchmarks/round_cost.py --rounds-per-task 200  # 1000 rounds

The digits workload (3 clients, the MLP, FedAvg, fcil-sync with 5 tasks) with
every default left on: results.json and the per-round records, TensorBoard
events, a checkpoint on the default schedule, evaluation after every round.
A round's *wall* time is measured from the end of the previous round (after
its results and checkpoint were written) to the end of this one, so it holds
everything the coordinator does for the round; its *fixed cost* is that wall
time minus the seconds the clients spent in local training
(``seconds_local``). Printed: the medians over rounds 6-15 ("round ~10") and
over the last 10 rounds ("round ~N"), each with its breakdown (local training,
fusion + evaluation inside ``run_round``, and what follows it: results,
checkpoint, TensorBoard), then the fixed cost's median per 10% of the run, so
growth is visible. Each breakdown also gives the models' forward passes in
evaluation (:class:`EvaluationForward`) and the fixed cost less them: each stage
adds one test experience that the server and every client evaluate, work that
grows with the stages whatever the framework, so the second figure is what
the framework itself adds per round. Not a test: nothing is asserted. The machine's load
(``os.getloadavg``) is printed before and after, since the machine may be
shared.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds-per-task", type=int, default=100)
    parser.add_argument("--tasks", type=int, default=5)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--checkpoint-every", default=None, help="N or auto (default: the run's default)")
    parser.add_argument("--out", default=None, help="run folder (default: a temporary one)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from timed_rounds import timed_rounds

    from fedaval.api import check_settings
    from fedaval.config import RunConfig

    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedaval-round-cost-") as tmp:
        settings = dict(
            plugins=["fedavg"],
            scenario="fcil-sync",
            scenario_options={"clients": args.clients, "tasks": args.tasks},
            dataset="digits",
            model="mlp",
            rounds_per_task=args.rounds_per_task,
            device="cpu",
            seed=0,
            out=args.out or str(Path(tmp) / "run"),
        )
        if args.checkpoint_every is not None:
            settings["checkpoint_every"] = args.checkpoint_every
        config = check_settings(RunConfig(**settings))
        forward = EvaluationForward()
        with forward.timing():
            timed = timed_rounds(config)
        build_s, total, walls, records = timed.build_s, timed.total_s, timed.walls, timed.records
        folder = Path(config.out)
        sizes = {p.name: p.stat().st_size for p in folder.iterdir() if p.is_file()}
    n = len(walls)
    local = [r["seconds_local"] for r in records]
    inside = [r["seconds"] - r["seconds_local"] for r in records]  # fusion, evaluation, offloading
    after = [w - r["seconds"] for w, r in zip(walls, records)]  # results, checkpoint, TensorBoard
    fixed = [w - s for w, s in zip(walls, local)]
    evaluation_forward = forward.per_round[:n]
    beyond = [f - e for f, e in zip(fixed, evaluation_forward)]  # less the models' forward passes in evaluation

    def window(lo: int, hi: int) -> str:
        med = lambda xs: 1000 * statistics.median(xs[lo:hi])  # noqa: E731
        return (
            f"rounds {lo + 1}-{hi}: wall {med(walls):7.2f} ms  local training {med(local):6.2f} ms  "
            f"fixed {med(fixed):7.2f} ms  (fusion+evaluation {med(inside):6.2f} ms, "
            f"results+checkpoint+TensorBoard {med(after):6.2f} ms; evaluation forward passes "
            f"{med(evaluation_forward):6.2f} ms, fixed less them {med(beyond):6.2f} ms)"
        )

    print(
        f"digits, mlp, FedAvg, fcil-sync {args.clients} clients x {args.tasks} tasks x {args.rounds_per_task} "
        f"rounds = {n} rounds; checkpoint_every={config.checkpoint_every}; torch threads {args.threads}"
    )
    print(
        f"build {build_s:.2f} s, training {total:.2f} s ({1000 * total / n:.2f} ms per round), "
        f"files: {', '.join(f'{k} {v:,} B' for k, v in sorted(sizes.items()))}"
    )
    print("median per round, round ~10:  " + window(5, 15))
    print(f"median per round, round ~{n}: " + window(n - 10, n))
    tenth = max(n // 10, 1)
    print(
        "fixed cost per round, median per tenth of the run (ms): "
        + " ".join(f"{1000 * statistics.median(fixed[i : i + tenth]):.1f}" for i in range(0, n - tenth + 1, tenth))
    )
    print(
        "fixed cost less the evaluation forward passes, median per tenth of the run (ms): "
        + " ".join(f"{1000 * statistics.median(beyond[i : i + tenth]):.1f}" for i in range(0, n - tenth + 1, tenth))
    )
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0


class EvaluationForward:
    """Seconds spent in the models' forward passes during evaluation
    (``FederatedStrategy.forward`` outside training: the server's and the
    clients'), summed per round: the work that grows with the test
    experiences seen, which a plain loop evaluating the same models on the
    same experiences does too. The timer adds about a microsecond per
    evaluated minibatch."""

    def __init__(self) -> None:
        self.per_round: list[float] = []
        self._seconds = 0.0

    @contextmanager
    def timing(self):
        import fedaval.coordinator as coordinator
        from fedaval.strategy import FederatedStrategy

        forward, run_round = FederatedStrategy.forward, coordinator.run_round

        def timed_forward(strategy):
            if strategy.is_training:
                return forward(strategy)
            start = time.perf_counter()
            try:
                return forward(strategy)
            finally:
                self._seconds += time.perf_counter() - start

        def timed_round(*args, **kwargs):
            self._seconds = 0.0
            try:
                return run_round(*args, **kwargs)
            finally:
                self.per_round.append(self._seconds)

        FederatedStrategy.forward, coordinator.run_round = timed_forward, timed_round
        try:
            yield self
        finally:
            FederatedStrategy.forward, coordinator.run_round = forward, run_round


if __name__ == "__main__":
    raise SystemExit(main())
