"""--precision bf16: each client's training forward and base loss under autocast to bfloat16; evaluation,
the weights and the optimizer in float32 (fedaval/training.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import one_line_error, strip_timing

from fedaval import hookimpl


class Dtypes:
    """Records the dtypes a step's loss hooks see, and those the classifier sees in evaluation."""

    name = "dtypes"

    def __init__(self):
        self.training: set[tuple[torch.dtype, torch.dtype, torch.dtype]] = set()
        self.evaluation: set[torch.dtype] = set()
        self.weights: set[torch.dtype] = set()

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.training.add((batch.features.dtype, batch.logits.dtype, batch.loss.dtype))
        self.weights.update(p.dtype for p in client.model.parameters())
        return {}

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        if not training:
            self.evaluation.add(features.dtype)
        return None


@pytest.mark.parametrize("model", ["mlp", "cnn"])
def test_bf16_trains_in_bfloat16_and_evaluates_in_float32(tiny_config, tmp_path, model):
    from fedaval.api import run_training

    fp32, bf16 = Dtypes(), Dtypes()
    results = {}
    for precision, probe in (("fp32", fp32), ("bf16", bf16)):
        config = tiny_config(out=str(tmp_path / precision), model=model, precision=precision)
        results[precision] = strip_timing(run_training(config, extra_plugins=[probe]))
    assert fp32.training == {(torch.float32, torch.float32, torch.float32)}
    # features and logits from bfloat16 products; the cross-entropy in float32 (autocast's policy)
    assert bf16.training == {(torch.bfloat16, torch.bfloat16, torch.float32)}
    assert bf16.evaluation == fp32.evaluation == {torch.float32} and bf16.weights == {torch.float32}
    # it is on: the losses differ from float32's in their last digits, and the model still learns
    losses = {p: results[p]["rounds"][-1]["losses"]["loss/classification"] for p in results}
    assert losses["bf16"] != losses["fp32"] and losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)
    accuracy = {p: results[p]["final"]["accuracy"] for p in results}
    assert accuracy["bf16"] == pytest.approx(accuracy["fp32"], abs=0.1)


def test_bad_precision_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--precision", "fp16", "--out", str(tmp_path / "run")])
    assert line == "fedaval: error: bad value --precision fp16; must be one of fp32, bf16"
    assert not (tmp_path / "run").exists()
