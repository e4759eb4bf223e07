"""Run every row of a reproduction config (``configs/repro-*.toml``) for each
of its seeds (every row of the first seed first), then put the paper's numbers beside the measured ones.

    python benchmarks/reproduce.py configs/repro-fedprok-table1.toml --out-dir runs/t1 --jobs 2

Each row of the config's ``[paper.runs]`` table is one command,
``fedaval train --config CONFIG <row's arguments> --seed S --out
OUT_DIR/<row>-s<S> --quiet``, exactly the command docs/reproduction.md lists
for it, run once per seed of the file's ``seeds``. Runs go ``--jobs`` at a
time, each with one torch thread. A run folder whose results.json says
``complete`` is skipped; one that exists without it is continued with
``fedaval train --resume``, so the script can be stopped and started again.
Each run's output goes to ``OUT_DIR/<row>-s<S>.log``. At the end it runs
``fedaval report OUT_DIR/*-s* --paper CONFIG --out-dir OUT_DIR/report``.

``--keep DIR`` (e.g. ``benchmarks/results/reproduction/<config>/<batch>``)
copies each complete run's ``config.json`` and ``results.json`` (no
checkpoints, no TensorBoard events) to ``DIR/<row>-s<S>/`` and makes the
report from those copies into ``DIR``, so the committed report can be made
again, and extended with more seeds, from committed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "row"


def run_status(folder: Path) -> str | None:
    try:
        return json.loads((folder / "results.json").read_text())["status"]["state"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def commands(
    config: Path, out_dir: Path, rows: list[str] | None, only_seeds: list[int] | None = None
) -> list[tuple[str, list[str], Path]]:
    """The runs, seed by seed (every row of the first seed first)."""
    data = tomllib.loads(config.read_text())
    runs = data.get("paper", {}).get("runs", {})
    seeds = data.get("seeds", [0])
    seeds = [int(s) for s in (seeds.split(",") if isinstance(seeds, str) else seeds)]
    out = []
    for seed in seeds:
        if only_seeds and seed not in only_seeds:
            continue
        for name, arguments in runs.items():
            if rows and name not in rows:
                continue
            folder = out_dir / f"{slug(name)}-s{seed}"
            argv = ["--config", str(config), *shlex.split(arguments), "--seed", str(seed)]
            out.append((f"{name} s{seed}", argv, folder))
    return out


def fedaval() -> list[str]:
    return [sys.executable, "-m", "fedaval.cli"]


def running_elsewhere(lock: Path) -> bool:
    """Another reproduce.py is running this folder (its lock names a live process)."""
    try:
        os.kill(int(lock.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def run_one(label: str, argv: list[str], folder: Path) -> tuple[str, str, float]:
    state = run_status(folder)
    if state == "complete":
        return label, "already complete", 0.0
    lock = folder.with_suffix(".lock")
    if running_elsewhere(lock):
        return label, "running elsewhere", 0.0
    lock.write_text(str(os.getpid()))
    try:
        return _run(label, argv, folder)
    finally:
        lock.unlink(missing_ok=True)


def _run(label: str, argv: list[str], folder: Path) -> tuple[str, str, float]:
    if folder.exists() and (folder / "config.json").exists():
        cmd = [*fedaval(), "train", "--resume", str(folder), "--quiet"]
    else:
        cmd = [*fedaval(), "train", *argv, "--out", str(folder), "--quiet"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    start = time.time()
    with open(folder.with_suffix(".log"), "a") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        code = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    seconds = time.time() - start
    return label, "ok" if code == 0 else f"exit {code}", seconds


def keep(folder: Path, into: Path) -> Path:
    """Copy a complete run's ``config.json`` and ``results.json`` to ``into/<folder name>``."""
    target = into / folder.name
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "results.json"):
        shutil.copyfile(folder / name, target / name)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--rows", nargs="*", help="only these [paper.runs] rows (default: all)")
    parser.add_argument("--seeds", nargs="*", type=int, help="only these of the file's seeds (default: all)")
    parser.add_argument("--keep", type=Path, help="copy complete runs' config.json and results.json here")
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    todo = commands(args.config, args.out_dir, args.rows, args.seeds)
    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for label, outcome, seconds in pool.map(lambda job: run_one(*job), todo):
            print(f"{label:<40} {outcome:<18} {seconds:7.0f} s", flush=True)
            failed += not outcome.startswith(("ok", "already", "running elsewhere"))
    folders = sorted(str(f) for _, _, f in todo if run_status(f) == "complete")
    report_dir = args.out_dir / "report"
    if args.keep is not None:
        folders = [str(keep(Path(f), args.keep)) for f in folders]
        report_dir = args.keep
    if folders:
        report = [
            *fedaval(),
            "report",
            *folders,
            "--paper",
            str(args.config),
            "--out-dir",
            str(report_dir),
        ]
        subprocess.call(report)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
