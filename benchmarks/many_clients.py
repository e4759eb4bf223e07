"""Seconds per round of the cross-device shape: many small clients, a few sampled per round.

    python benchmarks/many_clients.py                      # 200 clients of ~50 images, 20 per round, 20 rounds
    python benchmarks/many_clients.py --profile 25         # also cProfile's 25 costliest functions
    PYTHONPATH=/work/main python benchmarks/many_clients.py   # another checkout's fedaval

FedAvg with the ``cnn`` model on a shared CIFAR-10 subset (``--train-per-class``
images per class, so 10 x train-per-class / clients images per client),
fcil-sync with ``--clients`` clients and 2 tasks, batch 10, one local epoch,
``--per-round`` clients sampled per round, ``--offload-clients cpu`` (what
``auto`` picked here until session 7; it now keeps these small clients live), evaluation after every round, checkpoints on the default
schedule. On this shape a client's own training is a few minibatches, so what
a round costs beyond them (Avalanche's ``train()``/``eval()`` set-up, the
evaluator's callbacks, data loaders, offloading the clients' state) is most of it.

Printed: the build time, the median seconds per round (wall time from the end
of one round's writes to the end of the next's) and its breakdown from the
rounds' records (``seconds_local``: the sampled clients' rounds, offloading
back in included; ``seconds_fusion``; ``seconds_eval``: evaluation and
offloading the idle clients; the rest: results, checkpoint, TensorBoard), the
mean of each over the rounds, and the final accuracies (equal across
checkouts when the code computes the same). Not a test: nothing is asserted.
The repository root is put on ``sys.path`` only when ``PYTHONPATH`` is unset,
so ``PYTHONPATH=<checkout>`` times that checkout's fedaval with this script.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(HERE.parent))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--per-round", type=int, default=20, help="clients sampled per round")
    parser.add_argument("--rounds-per-task", type=int, default=10, help="rounds per task (2 tasks)")
    parser.add_argument("--train-per-class", type=int, default=1000, help="CIFAR-10 training images per class")
    parser.add_argument("--test-per-class", type=int, default=20, help="CIFAR-10 test images per class")
    parser.add_argument("--batch-size", type=int, default=10)
    parser.add_argument("--offload-clients", default="cpu")
    parser.add_argument("--data-path", default="auto")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print cProfile's N costliest functions")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from cifar_data import cifar_subset
    from timed_rounds import timed_rounds

    import fedaval
    from fedaval.api import check_settings
    from fedaval.config import RunConfig

    root = cifar_subset(args.train_per_class, args.test_per_class)
    print(f"fedaval from {Path(fedaval.__file__).parent}", flush=True)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory(prefix="fedaval-many-clients-") as tmp:
        config = check_settings(
            RunConfig(
                plugins=["fedavg"],
                scenario="fcil-sync",
                scenario_options={"clients": args.clients, "tasks": 2},
                dataset="imagefolder",
                data_root=str(root),
                model="cnn",
                rounds_per_task=args.rounds_per_task,
                clients_per_round=args.per_round,
                batch_size=args.batch_size,
                offload_clients=args.offload_clients,
                data_path=args.data_path,
                device="cpu",
                seed=0,
                out=str(Path(tmp) / "run"),
            )
        )
        profiler = cProfile.Profile() if args.profile else None
        timed = timed_rounds(config, profiler)
        build_s, total, results, walls, records = (
            timed.build_s,
            timed.total_s,
            timed.results,
            timed.walls,
            timed.records,
        )

    phases = {
        "local training (sampled clients)": [r["seconds_local"] for r in records],
        "fusion": [r["seconds_fusion"] for r in records],
        "evaluation + offloading idle": [r["seconds_eval"] for r in records],
        "results + checkpoint + TensorBoard": [w - r["seconds"] for w, r in zip(walls, records)],
    }
    final = results["final"]
    print(
        f"FedAvg, cnn, imagefolder CIFAR-10 {args.train_per_class}/{args.test_per_class} per class, "
        f"fcil-sync {args.clients} clients x 2 tasks x {args.rounds_per_task} rounds, {args.per_round} per round, "
        f"batch {args.batch_size}, offload {args.offload_clients}, data path {args.data_path}, "
        f"torch threads {args.threads}"
    )
    print(f"build {build_s:.2f} s; training {total:.2f} s for {len(walls)} rounds")
    print(f"seconds per round: median {statistics.median(walls):.3f}, mean {statistics.mean(walls):.3f}")
    for name, values in phases.items():
        print(f"  {name:<36} median {statistics.median(values):.3f} s, mean {statistics.mean(values):.3f} s")
    print(f"final accuracy {final['accuracy']!r}, mean client accuracy {final['mean_client_accuracy']!r}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    if profiler is not None:
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(args.profile)
        print(stream.getvalue())
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.profile)
        print(stream.getvalue())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
