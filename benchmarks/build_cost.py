"""What building a run costs before its first round: loading an image folder from its decoded cache, and
building the cross-device run (1000 live clients) around it.

    python benchmarks/build_cost.py                                   # this checkout
    python benchmarks/build_cost.py --checkout /tmp/old --checkout .  # two checkouts, alternating

Two timings per process, after one untimed build (the decoded cache exists,
the files' metadata is in the page cache): ``load_dataset("imagefolder")``
of the folder ``pfl_overhead.py``'s cross-device shape trains on (the shared
CIFAR-10's 50,000 training and 10,000 test images), and
``fedaval.build.build_run`` of that shape (1000 ``cnn`` clients of 50
images, every client live; the load included). Each checkout runs in fresh
interpreters with ``PYTHONPATH`` set to it (one torch thread), alternating,
so that the ratios come from one invocation. Medians over ``--rounds``
processes per checkout x ``--repeats`` timings each.
"""

from __future__ import annotations

import statistics

from checkpoint_cost import PREAMBLE, alternating

CHILD = (
    PREAMBLE
    + r"""
from fedaval.build import build_run
from fedaval.datasets import load_dataset

times = {"load": [], "build": []}
with tempfile.TemporaryDirectory() as out:
    config = overhead.run_config(work, Path(out) / "run")
    build_run(config)  # untimed: the cache, the page cache, lazy imports
    for _ in range(options["repeats"]):
        start = time.perf_counter()
        load_dataset(work.dataset, work.data_root, False)
        times["load"].append(time.perf_counter() - start)
        start = time.perf_counter()
        build_run(config)
        times["build"].append(time.perf_counter() - start)
print("RESULT " + json.dumps({"times": times}))
"""
)


def main(argv: list[str] | None = None) -> int:
    args, results = alternating(CHILD, argv, "timings per process")
    print(f"\n{args.clients} live cnn clients; medians over {args.rounds} processes x {args.repeats} timings")
    print("| checkout | load_dataset s | build_run s (load included) |")
    print("|---|---|---|")
    for checkout, runs in results.items():
        load = statistics.median(t for r in runs for t in r["times"]["load"])
        build = statistics.median(t for r in runs for t in r["times"]["build"])
        print(f"| {checkout} | {load:.2f} | {build:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
