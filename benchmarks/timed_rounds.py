"""One fedaval run built and trained in this process, timed per round, for
the benchmarks that read a round's cost (round_cost.py, many_clients.py,
round_throughput.py, step_host.py).

No ``sys.path`` changes here: the importing script decides which fedaval
is timed (many_clients.py honours ``PYTHONPATH``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class TimedRun:
    """``walls[i]``: wall seconds of round i+1, from the end of the previous
    round's writes (or the start of training) to the end of its own;
    ``records[i]``: that round's record as the coordinator reports it;
    ``started``: ``time.perf_counter()`` when training began (the system's
    monotonic clock, comparable between processes on one machine)."""

    build_s: float
    total_s: float
    results: dict[str, Any]
    walls: list[float] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0


def timed_rounds(config, profiler=None, extra_plugins=(), before_training=None) -> TimedRun:
    """Build ``config``'s run (with ``extra_plugins`` registered, as
    :func:`fedaval.build.build_run` takes them) and train it with its own
    backend, timing each round; ``profiler`` (a ``cProfile.Profile``) covers
    the training only; ``before_training()``, when given, is called between
    the two (processes started together wait for each other there)."""
    from fedaval.backends import make_backend
    from fedaval.build import build_run
    from fedaval.coordinator import train

    build_start = time.perf_counter()
    run = build_run(config, extra_plugins, out_dir=Path(config.out))
    build_s = time.perf_counter() - build_start
    if before_training is not None:
        before_training()
    walls: list[float] = []
    records: list[dict[str, Any]] = []
    last = time.perf_counter()

    def on_round(record):
        nonlocal last
        now = time.perf_counter()
        walls.append(now - last)
        records.append(record)
        last = now

    start = last = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    results = train(run, on_round=on_round, backend=make_backend(run))
    if profiler is not None:
        profiler.disable()
    return TimedRun(build_s, time.perf_counter() - start, results, walls, records, started=start)
