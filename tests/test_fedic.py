"""FEDIC: the maths against hand-computed values (the code's calibrated
ensemble, Adam kept across calls; the earlier reading's prior, logit
adjustment, gate, distillation loss), calibration moves a skewed ensemble
toward balance, distillation changes the global model in real digits runs of
both teachers (the code's with unlabelled data from another dataset), and
the one-line errors of the proxy and unlabelled sets."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import one_line_error

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import FedavalUsageError
from fedaval.plugins.fedic import ENTRY
from fedaval.plugins.fedic_math import (
    CalibratedEnsemble,
    adam_steps,
    calibrated_logits,
    class_prior,
    distil,
    distillation_loss,
    ensemble_logits,
    gate_values,
    logit_adjust,
    train_gate,
)

PLUGIN = "fedaval.plugins.fedic:FEDIC"


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


# --- maths -------------------------------------------------------------------


def test_class_prior_by_hand():
    # counts (6, 2, 0), smoothing 1: (7, 3, 1) / 11
    prior = class_prior(torch.tensor([6, 2, 0]), smoothing=1.0)
    assert torch.allclose(prior, torch.tensor([7 / 11, 3 / 11, 1 / 11]))


def test_logit_adjust_by_hand():
    prior = torch.tensor([0.5, 0.25, 0.25])
    out = logit_adjust(torch.tensor([[1.0, 0.0, 0.0]]), prior, tau=1.0)
    assert torch.allclose(out, torch.tensor([[1 + math.log(2), math.log(4), math.log(4)]]))
    # tau scales the adjustment; tau = 0 is the identity
    out2 = logit_adjust(torch.tensor([[1.0, 0.0, 0.0]]), prior, tau=2.0)
    assert torch.allclose(out2, torch.tensor([[1 + 2 * math.log(2), 2 * math.log(4), 2 * math.log(4)]]))
    assert torch.equal(logit_adjust(torch.ones(1, 3), prior, tau=0.0), torch.ones(1, 3))


def test_ensemble_and_gated_calibration_by_hand():
    logits = torch.stack([t([2.0, 0.0]), t([0.0, 2.0])])  # two clients, one sample
    ens = ensemble_logits(logits)
    assert torch.allclose(ens, t([1.0, 1.0]))
    prior = torch.tensor([0.8, 0.2])
    full = calibrated_logits(ens, prior, 1.0, torch.ones(1))
    assert torch.allclose(full, logit_adjust(ens, prior, 1.0))
    assert torch.allclose(calibrated_logits(ens, prior, 1.0, torch.zeros(1)), ens)
    half = calibrated_logits(ens, prior, 1.0, torch.tensor([0.5]))
    assert torch.allclose(half, ens - 0.5 * torch.log(prior))
    # gate: sigmoid(h . w + b); h = (1, 2), w = (1, -1), b = 1 -> sigmoid(0) = 1/2
    assert torch.allclose(gate_values(t([1.0, 2.0]), torch.tensor([1.0, -1.0]), torch.tensor(1.0)), torch.tensor([0.5]))


def test_calibration_moves_a_skewed_ensemble_toward_balance():
    # a head-biased ensemble on balanced samples: class 0 (the head, prior 0.7) wins everywhere
    labels = torch.arange(10) % 2
    ens = (
        torch.stack([torch.full((10,), 1.0), torch.zeros(10)], dim=1)
        + 0.6 * torch.nn.functional.one_hot(labels).float()
    )
    prior = torch.tensor([0.7, 0.3])  # -log: 0.357, 1.204
    raw = ens.argmax(1)
    adjusted = logit_adjust(ens, prior, 1.0).argmax(1)
    assert raw.tolist() == [0] * 10
    assert adjusted.tolist() == labels.tolist()  # (1.6, 0) -> (1.96, 1.20); (1.0, 0.6) -> (1.36, 1.80)
    # the gate learns to use the adjustment where it helps
    feats = torch.ones(10, 3)
    w, b, losses = train_gate(feats, ens, prior, labels, 1.0, steps=50, lr=1.0)
    assert losses[-1] < losses[0]
    assert float(gate_values(feats, w, b).mean()) > 0.5


def test_distillation_loss_by_hand():
    # equal logits: KL = 0
    assert float(distillation_loss(t([1.0, 2.0]), t([1.0, 2.0]), 2.0)) == pytest.approx(0.0, abs=1e-6)
    # student uniform, teacher (ln 3, 0) at T = 1: p = (3/4, 1/4), KL = 3/4 ln(3/2) + 1/4 ln(1/2)
    kl = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert float(distillation_loss(t([0.0, 0.0]), t([math.log(3), 0.0]), 1.0)) == pytest.approx(kl, rel=1e-5)
    # T = 2 on doubled logits: same probabilities, times T^2 = 4
    assert float(distillation_loss(t([0.0, 0.0]), t([2 * math.log(3), 0.0]), 2.0)) == pytest.approx(4 * kl, rel=1e-5)


def test_distil_pulls_the_student_to_the_teacher():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x = torch.randn(16, 3)
    teacher = torch.stack([x[:, 0] * 3, -x[:, 0] * 3], dim=1)
    before = float(distillation_loss(model(x), teacher, 2.0))
    losses = distil(model, x, teacher, 2.0, steps=200, lr=0.5, batch_size=8, generator=torch.Generator().manual_seed(0))
    assert len(losses) == 200
    assert float(distillation_loss(model(x), teacher, 2.0)) < before / 2


def test_calibrated_ensemble_by_hand():
    # two clients, two classes, at initialisation: client weights sigmoid(z_k . 1) normalised over the
    # clients, scale 1 and bias 0 per class, a carry gate of w = 0, c = 0 (1/2)
    ensemble = CalibratedEnsemble(2, (torch.zeros(1, 3), torch.zeros(1)))
    logits = t([[2.0, 0.0]], [[0.0, -2.0]])  # [M=2, N=1, K=2]
    features = torch.randn(2, 1, 3)
    w = torch.sigmoid(torch.tensor([2.0, -2.0]))
    w = w / w.sum()
    mixed = w[0] * torch.tensor([2.0, 0.0]) + w[1] * torch.tensor([0.0, -2.0])
    finetuned = t([4.0, 4.0])
    out = ensemble(features, logits, finetuned)
    assert torch.allclose(out, 0.5 * mixed + 0.5 * finetuned)
    assert torch.allclose(ensemble.client_weights(logits).sum(0), torch.ones(1, 1))
    # a gate that carries everything: the calibrated ensemble, scaled and shifted per class
    gated = CalibratedEnsemble(2, (torch.zeros(1, 3), torch.tensor([50.0])))
    with torch.no_grad():
        gated.logit_scale.copy_(torch.tensor([2.0, 1.0]))
        gated.logit_bias.copy_(torch.tensor([0.0, 1.0]))
    assert torch.allclose(
        gated(features, logits, finetuned), mixed * torch.tensor([2.0, 1.0]) + torch.tensor([0.0, 1.0])
    )


def test_client_weights_stay_finite_where_every_sigmoid_underflows():
    ensemble = CalibratedEnsemble(2, (torch.zeros(1, 3), torch.zeros(1)))
    logits = t([[-60.0, -60.0]], [[-55.0, -55.0]])  # [M=2, N=1, K=2]; a = -120 and -110: sigmoid(a) is 0 in float32
    assert float(torch.sigmoid(torch.tensor(-120.0))) == 0.0
    weights = ensemble.client_weights(logits)
    assert torch.isfinite(weights).all() and torch.allclose(weights.sum(0), torch.ones(1, 1))
    # sigmoid(a) ~ exp(a) there: the weights are the softmax of a, the second client's e^10 times the first's
    assert weights.shape == (2, 1, 1)
    assert torch.allclose(weights.flatten(), torch.softmax(torch.tensor([-120.0, -110.0]), 0))


def test_adam_steps_continue_from_the_kept_state():
    def run(splits):
        p = torch.nn.Parameter(torch.tensor([3.0, -1.0]))
        state = None
        for n in splits:
            state, losses = adam_steps([p], state, 0.1, 0.01, n, lambda: ((p - 1) ** 2).sum())
        return p.detach(), state, losses

    whole, state, _ = run([6])
    parts, part_state, losses = run([2, 4])
    assert torch.equal(whole, parts) and len(losses) == 4
    assert int(part_state["state"][0]["step"]) == 6
    fresh, _, _ = run([2])
    p = torch.nn.Parameter(fresh.clone())
    adam_steps([p], None, 0.1, 0.01, 4, lambda: ((p - 1) ** 2).sum())
    assert not torch.equal(p.detach(), whole)  # restarting Adam is another path


# --- real runs -----------------------------------------------------------------

STHFL = dict(scenario="sthfl", scenario_options={"clients": 3, "classes_per_task": 3, "tasks": 2, "imbalance": 4.0})
SMALL = {"proxy_per_class": 3, "steps": 20}
LOGIT_ADJUST_SMALL = {"proxy_per_class": 3, "gate_steps": 20, "distill_steps": 20}


class Probe:
    """The global model right after FedAvg (before FEDIC) and what is broadcast."""

    name = "probe"

    def __init__(self):
        self.after_fedavg = {}
        self.downloads = []
        self.count_entries = []
        self.run = None

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl(tryfirst=True)
    def fedaval_server_fuse(self, run, uploads, round):
        self.after_fedavg[round] = {k: v.clone() for k, v in run.server.model.state_dict().items()}
        self.count_entries.append([u.get(ENTRY) for u in uploads])

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.downloads.append((run.round, {k: v.clone() for k, v in download["weights"].items()}))


def fedic_training(tmp_path_factory, **options):
    from fedaval.config import RunConfig

    probe = Probe()
    small = LOGIT_ADJUST_SMALL if options.get("teacher") == "logit-adjust" else SMALL
    config = RunConfig(
        plugins=[PLUGIN],
        plugin_options={"fedic": {**small, **options}},
        dataset="digits",
        rounds_per_task=2,
        local_epochs=1,
        device="cpu",
        seed=0,
        out=str(tmp_path_factory.mktemp("fedic") / "run"),
        **STHFL,
    )
    return run_training(config, extra_plugins=[probe]), probe


@pytest.fixture(scope="module")
def fedic_run(tmp_path_factory):
    """The authors' code's teacher, distilling on another dataset's images (CIFAR-10, grey 8x8)."""
    from conftest import CIFAR10_SUBSET

    return fedic_training(
        tmp_path_factory, unlabelled="imagefolder", unlabelled_root=str(CIFAR10_SUBSET), unlabelled_samples=150
    )


@pytest.fixture(scope="module")
def earlier_run(tmp_path_factory):
    return fedic_training(tmp_path_factory, teacher="logit-adjust")


@pytest.fixture(params=["fedic_run", "earlier_run"])
def either_run(request):
    return request.getfixturevalue(request.param)


def test_the_code_teachers_phases_keep_their_state_across_rounds(fedic_run):
    results, probe = fedic_run
    plugin = probe.run.plugins.objects["fedic"]
    fused = len(probe.after_fedavg)
    assert fused == len(results["rounds"])
    for phase in ("finetune", "calibration", "distil"):
        assert int(plugin.optimizers[phase]["state"][0]["step"]) == 20 * fused, phase
    assert not torch.equal(plugin.calibration["client_scale"], torch.ones_like(plugin.calibration["client_scale"]))
    assert plugin.unlabelled_x.shape == (150, 1, 8, 8)
    metrics = results["rounds"][-1]["plugin_metrics"]["fedic"]
    assert 0 <= metrics["fedic_proxy_acc_calibrated"] <= 1 and 0 <= metrics["fedic_proxy_acc_ensemble"] <= 1


def test_the_unlabelled_images_are_what_is_distilled_on(fedic_run, tmp_path_factory):
    proxy_only, _ = fedic_training(tmp_path_factory)  # no unlabelled dataset: the proxy images
    with_other, _ = fedic_run
    assert proxy_only["rounds"][0]["plugin_metrics"]["fedic"] != with_other["rounds"][0]["plugin_metrics"]["fedic"]


def test_the_other_teachers_options_are_refused(tmp_path):
    line = one_line_error(["train", "--plugins", PLUGIN, "-o", "fedic.tau=2", "--out", str(tmp_path / "a")])
    assert "fedic.tau applies to fedic.teacher=logit-adjust only" in line
    line = one_line_error(
        [
            "train",
            "--plugins",
            PLUGIN,
            "-o",
            "fedic.teacher=logit-adjust",
            "-o",
            "fedic.steps=5",
            "--out",
            str(tmp_path),
        ]
    )
    assert "fedic.steps applies to fedic.teacher=code only" in line


def test_a_bad_unlabelled_dataset_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--plugins", PLUGIN, "-o", "fedic.unlabelled=nosuchdata", "--out", str(tmp_path)])
    assert "fedic.unlabelled" in line and "nosuchdata" in line and "digits" in line


def test_counts_are_uploaded(fedic_run):
    results, probe = fedic_run
    run = probe.run
    for entries in probe.count_entries:
        assert len(entries) == 3 and all(e is not None and e.shape == (run.num_classes,) for e in entries)
    first = probe.count_entries[0]
    assert [int(e.sum()) for e in first] == [len(c.tasks.indices[0]) for c in run.clients]


def test_distillation_changes_the_global_model_and_is_broadcast(either_run):
    results, probe = either_run
    for round, sent in probe.downloads:
        if round == 1:
            continue
        fedavg = probe.after_fedavg[round - 1]
        assert any(not torch.equal(sent[k], fedavg[k]) for k in sent)  # distilled, not plain FedAvg
    metrics = results["rounds"][-1]["plugin_metrics"]["fedic"]
    assert metrics["fedic_distill_loss_last"] < metrics["fedic_distill_loss_first"]
    assert 0.0 < metrics["fedic_gate_mean"] < 1.0


def test_proxy_set_is_balanced_and_held_out(fedic_run):
    _, probe = fedic_run
    run = probe.run
    plugin = run.plugins.objects["fedic"]
    held = {int(i) for c in run.partition.clients for idx in c.indices for i in idx}
    assert all(len(v) == 3 for v in plugin.proxy.values())
    assert all(int(run.data.train_y[i]) == c for c, v in plugin.proxy.items() for i in v)
    assert not held & {int(i) for v in plugin.proxy.values() for i in v}


def test_proxy_missing_classes_is_a_one_line_error(tmp_path):
    # fcil-sync hands out every training sample: nothing is held out
    line = one_line_error(
        [
            "train",
            "--plugins",
            PLUGIN,
            "--scenario",
            "fcil-sync",
            "-o",
            "fcil-sync.clients=2",
            "-o",
            "fcil-sync.tasks=2",
            "--rounds-per-task",
            "1",
            "--out",
            str(tmp_path / "run"),
        ]
    )
    assert "fedic's proxy set lacks classes" in line and "fedic.proxy=train" in line


def test_refused_with_a_personal_head(tiny_config):
    with pytest.raises(FedavalUsageError, match="fedic needs the classifier shared"):
        run_training(tiny_config(plugins=["fedrep", PLUGIN], plugin_options={"fedic": {**SMALL, "proxy": "train"}}))


def test_a_resumed_run_keeps_the_teachers_state(tiny_config, tmp_path):
    """The calibrated ensemble and the three Adam states are checkpointed: a
    run resumed mid-task ends as the whole run does."""
    from helpers import strip_timing

    from fedaval import checkpoint
    from fedaval.build import build_run
    from fedaval.coordinator import train

    options = {"fedic": {"proxy": "train", "proxy_per_class": 3, "steps": 5}}
    config = tiny_config(
        plugins=[PLUGIN], plugin_options=options, out=str(tmp_path / "whole"), rounds_per_task=3, keep_checkpoints=100
    )
    whole = strip_timing(run_training(config))
    run = build_run(config, out_dir=tmp_path / "resumed")
    results = checkpoint.restore(run, checkpoint.path_for(tmp_path / "whole", 4))
    assert run.plugins.objects["fedic"].optimizers["distil"]["state"][0]["step"] == 5 * 4
    assert strip_timing(train(run, results=results)) == whole
