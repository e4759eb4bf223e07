"""TARGET as a plugin: BatchNorm required, synthetic data made at the task
end, sent to the clients (counted as bytes down), and distilled on in the
next task's local loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import one_line_error

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.plugins.target import SYNTHETIC, SYNTHETIC_KEY, TEACHER, TEACHER_KEY, Target
from fedaval.stash import StashKey

RECORDER = StashKey("target-probe.recorder")

TARGET = "fedaval.plugins.target:Target"
OPTIONS = {"generator_steps": 2, "synthetic_size": 16, "synthetic_batch": 8, "generator_width": 4, "noise_dim": 8}


class TinyCNN:
    """The small CNN (BatchNorm inside), narrow enough for a test."""

    name = "tiny-cnn"

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import cnn

        return cnn(run.data.input_shape, run.num_classes, width=4, feature_dim=8)


class InputRecorder:
    """A forward pre-hook on a client's feature extractor that records its
    training-mode inputs per task (picklable, for the run's checkpoints)."""

    def __init__(self):
        self.task = 0
        self.inputs: dict[int, list[torch.Tensor]] = {}

    def __call__(self, module, args):
        if module.training:
            self.inputs.setdefault(self.task, []).append(args[0].detach().clone())


class Probe:
    """Keeps the run and, per client task, the inputs of every forward pass
    of the client's feature extractor during its local training."""

    name = "target-probe"

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        if task == 0:
            recorder = InputRecorder()
            client.model.features.register_forward_pre_hook(recorder)
            client.stash[RECORDER] = recorder
        client.stash[RECORDER].task = task

    def inputs(self, client, task):
        return client.stash[RECORDER].inputs[task]


@pytest.fixture(scope="module")
def target_run(tmp_path_factory):
    from helpers import tiny_run_config

    probe = Probe()
    config = tiny_run_config(
        tmp_path_factory.mktemp("target") / "run",
        plugins=[TARGET],
        plugin_options={"target": dict(OPTIONS)},
        offload_clients="none",
    )
    results = run_training(config, extra_plugins=[TinyCNN(), probe])
    return results, probe


def test_a_model_without_batchnorm_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--plugins", TARGET, "--dataset", "digits", "--out", str(tmp_path / "r")])
    assert "BatchNorm" in line and "--model cnn" in line


@pytest.mark.parametrize(
    "synthesis, option", [("code", "adv_weight=0.5"), ("code", "lr_student=0.1"), ("paper", "lr_noise=0.1")]
)
def test_an_option_the_chosen_synthesis_does_not_read_is_a_one_line_error(tmp_path, synthesis, option):
    args = ["train", "--plugins", TARGET, "--model", "cnn", "--out", str(tmp_path / "r")]
    line = one_line_error([*args, "-o", f"target.synthesis={synthesis}", "-o", f"target.{option}"])
    assert f"target.{option.split('=')[0]} is not read with target.synthesis={synthesis}" in line


def test_the_distillation_weight_is_targets_code_by_default():
    from fedaval.plugins.target import TargetOptions

    assert TargetOptions().kd_weight == 25.0  # TARGET's code: --kd 25 (reading 3)


def test_the_synthesis_is_targets_code_s_on_cifar_by_default():
    """methods/target.py's CIFAR settings: 10 batches of 256, 10 steps, lr 0.002 (noise 0.01),
    oh 0.5, bn 10 with momentum 0.9, nz 256, ngf 64 (a first stage of 128 channels)."""
    from fedaval.plugins.target import TargetOptions

    o = TargetOptions()
    assert (o.synthesis, o.synthetic_size, o.generator_batch, o.generator_steps) == ("code", 2560, 256, 10)
    assert (o.lr_generator, o.lr_noise, o.ce_weight, o.bn_weight, o.bn_momentum) == (2e-3, 1e-2, 0.5, 10.0, 0.9)
    assert (o.noise_dim, o.generator_width) == (256, 128)


def test_kd_term_from_task_1_on_only(target_run):
    results, _ = target_run
    for record in results["rounds"]:
        assert ("loss/target_kd" in record["losses"]) == (record["task"] >= 1)
        if record["task"] >= 1:
            assert record["losses"]["loss/target_kd"] > 0


def test_synthetic_images_reach_the_clients_loss_in_task_1(target_run):
    _, probe = target_run
    run = probe.run
    plugin = run.plugins.objects["target"]
    assert plugin.synthetic.shape == (16, 1, 8, 8) and plugin.synthetic_task == 1
    for client in run.clients:
        task, images = client.stash[SYNTHETIC]
        assert task == 1 and torch.equal(images.cpu(), plugin.synthetic)
        assert client.stash[TEACHER][0] == 1
        rows = {tuple(img.flatten().tolist()) for img in plugin.synthetic}
        seen = [tuple(x.flatten().tolist()) for batch in probe.inputs(client, 1) for x in batch]
        assert any(r in rows for r in seen)  # the student's forward pass saw synthetic images
        seen0 = [tuple(x.flatten().tolist()) for batch in probe.inputs(client, 0) for x in batch]
        assert not any(r in rows for r in seen0)


def test_bytes_down_include_the_synthetic_set_once_per_client_and_task(target_run):
    results, probe = target_run
    down = {r["round"]: r["bytes_down"] for r in results["rounds"]}
    synthetic_bytes = 16 * 1 * 8 * 8 * 4  # float32 images, no labels
    clients = len(probe.run.clients)
    assert down[3] - down[2] == clients * (synthetic_bytes + 8)  # + 8 for the entry's name
    assert down[4] == down[2]
    metrics = results["rounds"][1]["plugin_metrics"]["target"]
    assert metrics["target_synthetic_images"] == 16 and {"target_generator_bn", "target_generator_ce"} <= set(metrics)
    assert "target_generator_adv" not in metrics  # the code's synthesis has no adversary


def test_the_paper_s_synthesis_is_still_there_with_its_adversary(tmp_path):
    """``synthesis=paper``: one generator against an adversarial student (the reading before
    session 27), its loss terms reported."""
    from helpers import tiny_run_config

    config = tiny_run_config(
        tmp_path / "run",
        plugins=[TARGET],
        plugin_options={"target": {**OPTIONS, "synthesis": "paper"}},
        offload_clients="none",
    )
    results = run_training(config, extra_plugins=[TinyCNN()])
    metrics = results["rounds"][1]["plugin_metrics"]["target"]
    assert {"target_generator_adv", "target_generator_student_kd"} <= set(metrics)


def test_the_criterion_is_the_cross_entropy_of_the_current_classes(target_run):
    from fedaval.plugins.target_math import restricted_cross_entropy

    _, probe = target_run
    run, plugin = probe.run, probe.run.plugins.objects["target"]
    client = run.clients[0]
    current = sorted(set(run.federation_task_classes()[1]) | set(client.tasks.classes[1]))
    logits = torch.randn(4, run.num_classes)
    y = torch.tensor([current[0]] * 4)
    got = plugin.fedaval_client_criterion(run=run, client=client, logits=logits, y=y)
    assert got.item() == pytest.approx(restricted_cross_entropy(logits, y, current).item())
    assert got.item() < torch.nn.functional.cross_entropy(logits, y).item() + 1e-9
    plugin.options.ce = "all"
    try:
        assert plugin.fedaval_client_criterion(run=run, client=client, logits=logits, y=y) is None
    finally:
        plugin.options.ce = "current"


def test_a_client_first_sampled_late_in_the_task_gets_the_teacher_weights():
    plugin = Target()
    plugin.synthetic, plugin.synthetic_task, plugin.teacher_weights = torch.zeros(2, 1, 8, 8), 1, {"w": torch.ones(3)}

    def run(begins):
        return SimpleNamespace(task=1, now=SimpleNamespace(task_begins=begins))

    first = plugin.fedaval_server_download(run=run(True), client=SimpleNamespace(id=0), download={})
    assert set(first) == {SYNTHETIC_KEY}
    late = plugin.fedaval_server_download(run=run(False), client=SimpleNamespace(id=1), download={})
    assert set(late) == {SYNTHETIC_KEY, TEACHER_KEY}
    assert plugin.fedaval_server_download(run=run(False), client=SimpleNamespace(id=1), download={}) is None


def test_scores_of_classes_not_reached_yet_are_masked():
    plugin = Target()
    model = SimpleNamespace(classifier=torch.nn.Linear(2, 4))
    run = SimpleNamespace(task=0, federation_task_classes=lambda: [[0, 2], [1, 3]])
    logits = plugin.fedaval_classify(run=run, client=None, model=model, features=torch.randn(5, 2), training=False)
    assert (logits[:, [1, 3]] == -1e9).all() and (logits[:, [0, 2]] > -1e9).all()
    run.task = 1
    logits = plugin.fedaval_classify(run=run, client=None, model=model, features=torch.randn(5, 2), training=False)
    assert (logits > -1e9).all()


def test_the_mask_of_a_class_list_is_made_once():
    """Made per minibatch, its index assignment waited for the GPU each time
    (tests/test_gpu_syncs.py on an H100, session 14): one mask per class list,
    width and device, reused; another list gets its own."""
    from fedaval.plugins.target import torch_mask

    logits = torch.zeros(3, 6)
    first = torch_mask(logits, [0, 4])
    assert torch_mask(logits, [0, 4]) is first
    assert first.tolist() == [False, True, True, True, False, True]
    assert torch_mask(logits, [0, 1, 4]).tolist() == [False, False, True, True, False, True]
    assert torch_mask(torch.zeros(3, 8), [0, 4]).shape == (8,)
