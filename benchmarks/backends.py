"""Wall time per round: ``--backend local`` vs ``--backend ray``, 2 and 4 clients per round.

    python benchmarks/backends.py            # ~6 min on 2 free cores

One invocation runs the same federation (shared CIFAR-10 as an ImageFolder
subset, ``--model cnn``, 4 clients, about 1.5 s of local training per client
per round on one CPU thread) with 2 and with 4 clients sampled per round,
each on three set-ups:

* ``local, 1 thread``: the in-process backend, clients one after the other,
  torch on one thread;
* ``local, N threads``: the same with torch's intra-op threads on every core
  (the in-process default);
* ``ray``: a local Ray instance on every core, one worker per core (one torch
  thread each), clients spread over the workers; the driver keeps torch's
  default threads for fusion and evaluation.

Each set-up runs ``--repeats`` times, interleaved with the others so that
load from other work on the machine hits them alike; per set-up it reports the
best run's median wall time per round (``seconds`` in results.json; the
evaluation runs only at the end of each task, so the median is a training
round), the range over runs, the client half of the round, one client's
local-training time (where it ran), the first round (Ray: workers still
building their replicas), and what the Ray backend sent per client
(:attr:`RayBackend.traffic`). It also checks that Ray gives the results of
``local, 1 thread`` (same seed, one thread per client). The ratios compare
runs of one invocation.
Writes ``benchmarks/results/backends.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cifar_data import cifar_subset  # noqa: E402 - the shared CIFAR-10 subset, extracted once


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def close(a, b) -> bool:
    """Same structure and values, floats within 1e-6 (relative)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-6 * max(abs(a), abs(b)) + 1e-9
    return a == b


def comparable(results):
    """results.json without timings (``seconds*`` and FedProK's E, ``efficiency*``, measured in
    seconds), the run folder and the backend's options."""
    if isinstance(results, dict):
        return {
            k: comparable(v)
            for k, v in results.items()
            if not k.startswith(("seconds", "efficiency")) and k not in ("out", "backend", "client_gpus", "ray_address")
        }
    if isinstance(results, list):
        return [comparable(v) for v in results]
    return results


def one_run(args, root: Path, backend: str, threads: int, clients_per_round: int, folder: Path) -> dict:
    import torch

    from fedaval.backends import make_backend
    from fedaval.build import build_run
    from fedaval.config import RunConfig
    from fedaval.coordinator import train

    torch.set_num_threads(threads)
    config = RunConfig(
        dataset="imagefolder",
        data_root=str(root),
        model="cnn",
        scenario="fcil-sync",
        scenario_options={"clients": args.clients, "tasks": args.tasks},
        rounds_per_task=args.rounds_per_task,
        local_epochs=args.local_epochs,
        clients_per_round=clients_per_round,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=0.0,
        eval_every=10**6,
        device="cpu",
        seed=args.seed,
        backend=backend,
        out=str(folder),
    )
    start = time.perf_counter()
    run = build_run(config, out_dir=folder)
    backend = make_backend(run)
    build = time.perf_counter() - start
    results = train(run, backend=backend)
    rounds = results["rounds"]
    client_half = [r["seconds"] - r["seconds_fusion"] - r["seconds_eval"] for r in rounds]
    traffic = getattr(backend, "traffic", [])
    per_client = sum(t["clients"] for t in traffic) or 1
    return {
        "results": results,
        "build": build,
        "first": rounds[0]["seconds"],
        "round": median(r["seconds"] for r in rounds[1:]),
        "clients": median(client_half[1:]),
        "workers": getattr(backend, "workers", 1),
        "to_workers": sum(t["to_workers"] for t in traffic) / per_client,
        "from_workers": sum(t["from_workers"] for t in traffic) / per_client,
        "broadcast": median(t["broadcast"] for t in traffic),
        "bytes_up": median(r["bytes_up"] / len(r["clients"]) for r in rounds),
        "bytes_down": median(r["bytes_down"] / len(r["clients"]) for r in rounds),
        "accuracy": results["final"].get("accuracy"),
        "local_per_client": median(r["seconds_local"] / len(r["clients"]) for r in rounds[1:]),
        "driver": median(t["driver_seconds"] for t in traffic[1:]) if traffic else None,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-per-class", type=int, default=500)
    parser.add_argument("--test-per-class", type=int, default=100)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--tasks", type=int, default=2)
    parser.add_argument("--rounds-per-task", type=int, default=3)
    parser.add_argument("--local-epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cpus",
        type=int,
        default=os.cpu_count(),
        help="CPUs of the local Ray instance and threads of 'local, N threads'",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="runs of each set-up, interleaved; the best median counts"
    )
    parser.add_argument("--out", default=str(HERE / "results" / "backends.md"))
    args = parser.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)

    import ray
    import torch

    from fedaval.backends.ray import shutdown_workers

    root = cifar_subset(args.train_per_class, args.test_per_class)
    runs_dir = Path(tempfile.mkdtemp(prefix="backends-bench-"))
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    default_threads = torch.get_num_threads()
    setups = [
        ("local, 1 thread", "local", 1),
        (f"local, {args.cpus} threads", "local", args.cpus),
        ("ray", "ray", default_threads),
    ]
    measured: dict[tuple[int, str], list[dict]] = {}
    load_before = os.getloadavg()[0]
    try:
        for repeat in range(args.repeats):  # interleaved, so load from other work hits every set-up alike
            for per_round in (2, 4):
                for label, backend, threads in setups:
                    folder = runs_dir / f"{backend}-t{threads}-c{per_round}-r{repeat}"
                    m = one_run(args, root, backend, threads, per_round, folder)
                    measured.setdefault((per_round, label), []).append(m)
                    print(f"{per_round} clients/round, {label}, run {repeat + 1}: {m['round']:.2f} s/round", flush=True)
    finally:
        shutdown_workers()
        ray.shutdown()
    load_after = os.getloadavg()[0]

    def best(per_round, label):
        return min(measured[(per_round, label)], key=lambda m: m["round"])

    rows = []
    for per_round in (2, 4):
        base, threaded = best(per_round, setups[0][0]), best(per_round, setups[1][0])
        for label, _, _ in setups:
            runs = measured[(per_round, label)]
            m = best(per_round, label)
            same = all(close(comparable(base["results"]), comparable(r["results"])) for r in runs)
            rows.append((per_round, label, m, runs, base, threaded, same))

    def kib(n):
        return f"{n / 1024:.0f}"

    lines = [
        "# Wall time per round: in-process vs Ray backend (CPU)",
        "",
        f"Command: `python benchmarks/backends.py{' ' + ' '.join(given) if given else ''}`",
        f"Date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()}, {os.cpu_count()} CPU cores, "
        f"no GPU; Ray {ray.__version__}, torch {torch.__version__}. The machine was shared with another "
        f"engineer's work while this ran (1-minute load average {load_before:.1f} at the start, {load_after:.1f} at "
        "the end), so absolute seconds are indicative; the ratios compare runs of one invocation.",
        f"Setting: shared CIFAR-10 as ImageFolder, first {args.train_per_class} train / {args.test_per_class} test "
        f"images per class; `fcil-sync` ({args.clients} clients, {args.tasks} tasks), model `cnn`, "
        f"{args.rounds_per_task} rounds per task, {args.local_epochs} local epochs, batch {args.batch_size}, "
        f"lr {args.lr}, seed {args.seed}; evaluation at task ends only. Ray: a local instance with {args.cpus} CPUs, "
        "one worker (1 CPU, 1 torch thread) per parallel client, at most one per CPU.",
        "",
        f"Each set-up ran {args.repeats} times, interleaved with the others; s/round is the best (lowest) of its "
        "runs' median wall time per round over rounds 2 on (round 1 is the first-round column), with the range "
        "over runs. Client half: the best run's median round without fusion and evaluation. Train s/client: median "
        "local-training time of one client (measured where it trained: in-process, or on its worker). Driver s: "
        "median time per round the driver spent pickling and loading client states. Sent/back: what the Ray "
        "backend sent to a worker and got back per client round (the client's whole state each way; back "
        "includes the upload), beside the broadcast, which goes to the object store once per round. Same "
        "results: every run's results.json equal to `local, 1 thread` (floats within 1e-6).",
        "",
        "| clients/round | backend | workers | s/round | range over runs | client half s | train s/client | "
        f"speed-up vs local 1 thread | vs local {args.cpus} threads | first round s | driver s | KiB sent/client | "
        "KiB back/client | KiB broadcast | KiB up/client (results.json) | final acc % | same results |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for per_round, label, m, runs, base, threaded, same in rows:
        is_ray = label == "ray"
        spread = f"{min(r['round'] for r in runs):.2f}-{max(r['round'] for r in runs):.2f}"
        lines.append(
            f"| {per_round} | {label} | {m['workers'] if is_ray else '-'} | {m['round']:.2f} | {spread} | "
            f"{m['clients']:.2f} | {m['local_per_client']:.2f} | {base['round'] / m['round']:.2f} | "
            f"{threaded['round'] / m['round']:.2f} | {m['first']:.2f} | {m['driver']:.3f} | "
            if is_ray
            else f"| {per_round} | {label} | - | {m['round']:.2f} | {spread} | {m['clients']:.2f} | "
            f"{m['local_per_client']:.2f} | {base['round'] / m['round']:.2f} | {threaded['round'] / m['round']:.2f} | "
            f"{m['first']:.2f} | - | "
        )
        lines[-1] += (
            f"{kib(m['to_workers']) if is_ray else '-'} | {kib(m['from_workers']) if is_ray else '-'} | "
            f"{kib(m['broadcast']) if is_ray else '-'} | {kib(m['bytes_up'])} | {100 * m['accuracy']:.2f} | "
            f"{'yes' if same else 'no'} |"
        )
    lines.append("")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
