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


class Layouts:
    """Records whether a step's minibatch and the client's convolution weights are channels-last."""

    name = "layouts"

    def __init__(self):
        self.inputs: set[bool] = set()
        self.weights: set[bool] = set()

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.inputs.add(batch.x.is_contiguous(memory_format=torch.channels_last))
        self.weights.update(
            p.is_contiguous(memory_format=torch.channels_last) for p in client.model.parameters() if p.dim() == 4
        )
        return {}


def test_channels_last_keeps_weights_and_minibatches_channels_last(tiny_config, tmp_path, cifar10_root):
    """--channels-last: the convolutions' weights and the training minibatches in NHWC order (CIFAR-10's
    3 channels: with one, both orders are the same); the same maths in another order, so the model
    learns as in the default order."""
    from fedaval.api import run_training

    default, nhwc = Layouts(), Layouts()
    results = {}
    for channels_last, probe in ((False, default), (True, nhwc)):
        config = tiny_config(
            out=str(tmp_path / str(channels_last)),
            dataset="imagefolder",
            data_root=str(cifar10_root),
            model="cnn",
            channels_last=channels_last,
        )
        results[channels_last] = strip_timing(run_training(config, extra_plugins=[probe]))
    assert nhwc.weights == {True} and False in default.weights  # a 1x1 or one-channel weight is both
    assert nhwc.inputs == {True} and default.inputs == {False}
    accuracy = {k: r["final"]["accuracy"] for k, r in results.items()}
    assert accuracy[True] == pytest.approx(accuracy[False], abs=0.1)


def test_a_channels_last_run_resumes_to_the_whole_runs_results(tiny_config, tmp_path, cifar10_root):
    """Checkpoints keep the weights' and momentum buffers' NHWC strides: resumed from any round, the
    run ends as the whole run."""
    from fedaval import checkpoint
    from fedaval.api import run_training
    from fedaval.build import build_run
    from fedaval.coordinator import train

    config = tiny_config(
        out=str(tmp_path / "whole"),
        dataset="imagefolder",
        data_root=str(cifar10_root),
        model="cnn",
        channels_last=True,
        momentum=0.9,
        keep_checkpoints=100,
    )
    whole = strip_timing(run_training(config))
    for round in (1, 3):
        run = build_run(config, out_dir=tmp_path / f"resumed{round}")
        weights = [p for p in run.clients[0].model.parameters() if p.dim() == 4]
        assert weights and all(p.is_contiguous(memory_format=torch.channels_last) for p in weights)
        results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", round))
        assert strip_timing(train(run, results=results)) == whole


def test_bf16_on_a_gpu_without_bfloat16_is_a_one_line_error(monkeypatch):
    """A GPU that cannot compute in bfloat16 refuses --precision bf16 before any training (stood in here:
    the check asks torch whether the device has bfloat16)."""
    from fedaval.config import RunConfig
    from fedaval.errors import FedavalUsageError
    from fedaval.training import check_precision

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    gpu = torch.device("cuda")
    with pytest.raises(FedavalUsageError) as error:
        check_precision(RunConfig(precision="bf16"), gpu)
    assert str(error.value) == "--precision bf16: Tesla V100 has no bfloat16 support; use --precision fp32"
    check_precision(RunConfig(precision="fp32"), gpu)  # fp32 asks nothing
    check_precision(RunConfig(precision="bf16"), torch.device("cpu"))  # the CPU computes in bfloat16
