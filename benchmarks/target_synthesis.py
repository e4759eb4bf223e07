"""How much of its classes TARGET's synthetic set carries: from a run's checkpoint (its global model
as the teacher, every class it has learned), make a synthetic set with ``synthesis=code`` (TARGET's
released code's way, at one or more generator widths) and ``synthesis=paper`` (the earlier reading,
with its former defaults), then score the teacher on the images kept: its cross-entropy against the
labels they were made for, and how often its prediction is that label (chance: 1 / classes).

    python benchmarks/target_synthesis.py RUN_DIR [--checkpoint round-000025.ckpt] [--widths 32,128]
        [--size 768] [--threads 1]

RUN_DIR is a TARGET run folder with checkpoints (``fedaval train ... -p target``). Session 27's
numbers are in docs/methods.md ("TARGET's synthetic set") with the command that made them.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from fedaval.build import build_run
from fedaval.checkpoint import restore
from fedaval.config import RunConfig
from fedaval.plugins.target import PAPER_DEFAULTS, TargetOptions, make_synthetic_set
from fedaval.plugins.target_math import restricted_cross_entropy
from fedaval.prototypes import class_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--checkpoint", default=None, help="a file in RUN_DIR/checkpoints (default: the newest)")
    parser.add_argument("--widths", default="32,128", help="generator widths for synthesis=code")
    parser.add_argument("--size", type=int, default=768, help="images per synthetic set")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    config = RunConfig.from_dict(json.loads((args.run_dir / "config.json").read_text()))
    folder = sorted((args.run_dir / "checkpoints").glob("*.ckpt"))
    path = args.run_dir / "checkpoints" / args.checkpoint if args.checkpoint else folder[-1]
    with tempfile.TemporaryDirectory() as out:
        config.out = out
        run = build_run(config, out_dir=Path(out))
        restore(run, path)
    teacher = copy.deepcopy(run.server.model).eval()
    classes = run.federation_seen_classes()
    cpu = torch.device("cpu")
    print(
        f"{args.run_dir.name}, {path.name} (task {run.task}): teacher over {len(classes)} classes, {args.size} images"
    )
    print("| synthesis | generator width | steps x batches | seconds | teacher CE | teacher agrees with the label |")
    print("|---|---:|---|---:|---:|---:|")
    code = TargetOptions(synthetic_size=args.size)  # synthesis=code's defaults, the code's settings
    paper = replace(code, synthesis="paper", **{**PAPER_DEFAULTS, "synthetic_size": args.size})
    settings = [(f"code | {width}", replace(code, generator_width=width)) for width in map(int, args.widths.split(","))]
    settings.append((f"paper (its former defaults) | {paper.generator_width}", paper))
    for label, options in settings:
        batch = options.generator_batch if options.synthesis == "code" else options.synthetic_batch
        torch.manual_seed(0)
        began = time.perf_counter()
        images, labels, _ = make_synthetic_set(options, teacher, classes, run.data, cpu, lambda: run.model(None))
        took = time.perf_counter() - began
        with torch.no_grad():
            logits = teacher(images)
        ce = restricted_cross_entropy(logits, labels, classes).item()
        cols = class_index(tuple(classes), "cpu")
        agree = (cols[logits[:, cols].argmax(1)] == labels).float()  # the teacher's class among ``classes``
        steps = f"{options.generator_steps} x {-(-args.size // batch)} of {batch}"
        print(f"| {label} | {steps} | {took:.0f} | {ce:.3f} | {agree.mean().item():.3f} |")


if __name__ == "__main__":
    main()
