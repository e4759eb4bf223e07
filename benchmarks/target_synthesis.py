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
from pathlib import Path

import torch
import torch.nn.functional as F

from fedaval.build import build_run
from fedaval.checkpoint import restore
from fedaval.config import RunConfig
from fedaval.plugins.target import TargetOptions
from fedaval.plugins.target_math import Generator, synthesize, synthesize_as_code


def teacher_scores(
    teacher: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, classes: list[int]
) -> tuple[float, float]:
    """(cross-entropy, agreement) of the teacher's outputs on ``classes`` against ``labels``."""
    cols = torch.tensor(classes)
    lookup = torch.full((int(cols.max()) + 1,), -1, dtype=torch.long)
    lookup[cols] = torch.arange(len(cols))
    with torch.no_grad():
        logits = teacher(images)[:, cols]
    target = lookup[labels]
    return F.cross_entropy(logits, target).item(), (logits.argmax(1) == target).float().mean().item()


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
    classes = sorted({c for stage in run.federation_task_classes()[: run.task + 1] for c in stage})
    cpu = torch.device("cpu")
    print(
        f"{args.run_dir.name}, {path.name} (task {run.task}): teacher over {len(classes)} classes, {args.size} images"
    )
    print("| synthesis | generator width | steps x batches | seconds | teacher CE | teacher agrees with the label |")
    print("|---|---:|---|---:|---:|---:|")
    o = TargetOptions()  # synthesis=code's defaults, the code's settings
    for width in [int(w) for w in args.widths.split(",")]:
        torch.manual_seed(0)
        generator = Generator(run.data.input_shape, o.noise_dim, width, "sigmoid")
        began = time.perf_counter()
        images, labels, _ = synthesize_as_code(
            teacher,
            generator,
            classes,
            steps=o.generator_steps,
            batch_size=o.generator_batch,
            size=args.size,
            lr_generator=o.lr_generator,
            lr_noise=o.lr_noise,
            ce_weight=o.ce_weight,
            bn_weight=o.bn_weight,
            bn_momentum=o.bn_momentum,
            mean=run.data.mean,
            std=run.data.std,
            device=cpu,
        )
        ce, agree = teacher_scores(teacher, images, labels, classes)
        took = time.perf_counter() - began
        batches = f"{o.generator_steps} x {-(-args.size // o.generator_batch)} of {o.generator_batch}"
        print(f"| code | {width} | {batches} | {took:.0f} | {ce:.3f} | {agree:.3f} |")
    torch.manual_seed(0)
    generator = Generator(run.data.input_shape, 64, 32)
    began = time.perf_counter()
    images, labels, _ = synthesize(
        teacher,
        run.model(None),
        generator,
        classes,
        steps=50,
        batch_size=32,
        size=args.size,
        lr_generator=1e-2,
        lr_student=1e-2,
        bn_weight=1.0,
        adv_weight=1.0,
        temperature=2.0,
        device=cpu,
    )
    ce, agree = teacher_scores(teacher, images, labels, classes)
    took = time.perf_counter() - began
    print(
        f"| paper (its former defaults) | 32 | 50 x {-(-args.size // 32)} of 32 | {took:.0f} | {ce:.3f} | {agree:.3f} |"
    )


if __name__ == "__main__":
    main()
