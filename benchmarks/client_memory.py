"""Peak memory against the number of clients, 10 sampled per round.

    python benchmarks/client_memory.py            # 10, 50, 100 clients; shared CIFAR-10 subset, ResNet-18
    python benchmarks/client_memory.py --write    # also benchmarks/results/client_memory.md
    python benchmarks/client_memory.py --plugins pfcl --offload cpu --write   # PFCL: teachers and memories too

Each configuration runs in a fresh process (`fedaval.api.run_training`, as
`fedaval train` does) and reports its peak resident memory (``ru_maxrss``).
The growth per added client, (peak(N2) - peak(N1)) / (N2 - N1), is compared
with the size of one client's stored state: the pickle an offloaded client
keeps (model, optimizer state, Avalanche strategy, streams), averaged over the
clients. With ``--offload-clients cpu`` (what ``auto`` picks when fewer than
all clients train each round) the growth should be close to that size; the
``none`` rows show what keeping every client live costs.

ResNet-18 (45 MB of weights per client) makes one client's state large
against the run's transient memory (a training round's activations, the
allocator's slack: tens of MB that vary from run to run), so the growth can
be read off three runs. Checkpoints are off here: they are written, not held.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

CHILD = r"""
import json, resource, sys, tempfile, torch
torch.set_num_threads(1)
from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.config import RunConfig
settings = json.loads(sys.argv[1])

class Sizes:
    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

sizes = Sizes()
with tempfile.TemporaryDirectory() as out:
    run_training(RunConfig(out=out + "/run", **settings), extra_plugins=[sizes])
    clients = sizes.run.clients
    for c in clients:
        c.offload()  # measure every client's stored state the same way
    stored = sum(c.stored_nbytes for c in clients) / len(clients)
print(json.dumps({"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "client_state": stored}))
"""


def measure(settings: dict) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings)],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    if result.returncode != 0:
        raise SystemExit(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from cifar_data import cifar_subset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,50,100")
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--dataset", default="imagefolder", help="imagefolder (shared CIFAR-10 subset) or digits")
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--train-per-class", type=int, default=300)
    parser.add_argument("--test-per-class", type=int, default=20)
    parser.add_argument("--offload", default="cpu,none")
    parser.add_argument(
        "--plugins", default="fedavg", help="methods, comma-separated (their per-client state counts too)"
    )
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    root = cifar_subset(args.train_per_class, args.test_per_class) if args.dataset == "imagefolder" else None
    counts = [int(n) for n in args.clients.split(",")]
    rows, summaries = [], []
    for where in args.offload.split(","):
        peaks = {}
        for n in counts:
            settings = dict(
                plugins=args.plugins.split(","),
                dataset=args.dataset,
                data_root=root and str(root),
                model=args.model,
                scenario="fcil-sync",
                scenario_options={"clients": n, "tasks": 2},
                rounds_per_task=2,
                clients_per_round=args.per_round,
                offload_clients=where,
                device="cpu",
                seed=0,
                checkpoint_every=0,
                lr=0.01,
                momentum=0.0,
            )
            m = measure(settings)
            peaks[n] = m
            rows.append(f"| {where} | {n} | {m['peak_rss'] / 2**20:.1f} | {m['client_state'] / 2**20:.3f} |")
            print(rows[-1], flush=True)
        first, last = counts[0], counts[-1]
        growth = (peaks[last]["peak_rss"] - peaks[first]["peak_rss"]) / (last - first)
        state = sum(p["client_state"] for p in peaks.values()) / len(peaks)
        summaries.append(
            f"- `--offload-clients {where}`: peak grows by {growth / 2**20:.3f} MiB per added client "
            f"({first} -> {last} clients) = {growth / state:.2f} x one client's stored state "
            f"({state / 2**20:.3f} MiB)"
        )
        print(summaries[-1], flush=True)
    command = "python benchmarks/client_memory.py" + (
        " " + " ".join(argv or sys.argv[1:]) if (argv or sys.argv[1:]) else ""
    )
    table = "\n".join(
        ["| offload | clients | peak RSS MiB | one client's stored state MiB |", "|---|---|---|---|", *rows]
    )
    if args.write:
        name = "client_memory.md" if args.plugins == "fedavg" else f"client_memory_{args.plugins.replace(',', '+')}.md"
        (HERE / "results" / name).write_text(
            f"# Peak memory against the number of clients\n\nCommand: `{command}`\n"
            f"Date: {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; machine: {platform.machine()}, "
            f"{os.cpu_count()} cores, CPU only, one process per row.\n"
            f"Setting: shared CIFAR-10 subset ({args.train_per_class} train / {args.test_per_class} test images per class), "
            f"plugins {args.plugins}, model {args.model}, fcil-sync with N clients x 2 tasks, 2 rounds per task, {args.per_round} clients sampled per round, "
            f"no checkpoints.\n\n"
            f"{table}\n\n" + "\n".join(summaries) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
