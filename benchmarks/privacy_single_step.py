"""docs/privacy.md's single-step example: inverting gradients on a one-step,
one-image FedAvg update of fedaval's MLP (a real CIFAR-10 image from
tests/data/cifar10), without and with DP (update clipped to its own norm,
noise multipliers 0.01, 0.1 and 1). The setting of tests/test_attack_math.py.

    PYTHONPATH=. python benchmarks/privacy_single_step.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from fedaval.attack_math import image_metrics, invert_update, save_grid, single_step_upload
from fedaval.datasets import load_dataset
from fedaval.plugins.dp_math import clip_and_noise


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    data = load_dataset("imagefolder", Path(__file__).resolve().parent.parent / "tests" / "data" / "cifar10")
    model, x01, y, received, uploaded = single_step_upload(data)
    names = list(uploaded)
    update = [uploaded[n] - received[n] for n in names]
    clip = math.sqrt(sum(float((u**2).sum()) for u in update))
    rows, recs = {}, [x01]
    for z in (None, 0.01, 0.1, 1.0):
        sent = uploaded
        if z is not None:
            torch.manual_seed(1)
            noisy, _ = clip_and_noise(update, clip=clip, noise_multiplier=z)
            sent = {n: received[n] + u for n, u in zip(names, noisy)}
        rec = invert_update(model, received, sent, y, data.input_shape, data.mean, data.std, iterations=100)
        rows["none" if z is None else f"z={z}"] = image_metrics(x01, rec)
        recs.append(rec)
    save_grid(x01.expand(len(recs) - 1, -1, -1, -1), torch.cat(recs[1:]), out / "privacy-single-step.png")
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
