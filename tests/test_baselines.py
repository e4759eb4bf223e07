"""FedProx, FedNova and APFL: their defining rules against hand-computed
values, and the hook glue in tiny digits runs."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.plugins.apfl import ALPHA, APFL, PERSONAL, alpha_gradient, mix, personal_step
from fedaval.plugins.fedavg import weighted_average
from fedaval.plugins.fednova import fednova_fuse, local_step_norm
from fedaval.plugins.fedprox import proximal_term
from fedaval.stash import Stash

# --- FedProx ---------------------------------------------------------------


def test_proximal_term_value_and_gradient():
    w = torch.tensor([1.0, 2.0], requires_grad=True)
    b = torch.tensor([3.0], requires_grad=True)
    anchor = {"w": torch.tensor([0.0, 4.0]), "b": torch.tensor([3.0])}
    term = proximal_term({"w": w, "b": b}, anchor, mu=0.5)
    # 0.5/2 * ((1-0)^2 + (2-4)^2 + 0) = 0.25 * 5
    assert term.item() == pytest.approx(1.25)
    term.backward()
    # gradient mu * (w - w_global)
    assert w.grad.tolist() == pytest.approx([0.5, -1.0])
    assert b.grad.tolist() == pytest.approx([0.0])


def test_proximal_term_ignores_keys_not_in_anchor_and_mu_zero():
    w = torch.tensor([5.0], requires_grad=True)
    head = torch.tensor([7.0], requires_grad=True)
    assert proximal_term({"w": w, "head": head}, {"w": torch.tensor([5.0])}, mu=1.0).item() == 0.0
    assert proximal_term({"w": w}, {"w": torch.tensor([0.0])}, mu=0.0).item() == 0.0


# --- FedNova ---------------------------------------------------------------


def test_fednova_normalised_update_by_hand():
    x = {"w": torch.tensor([0.0])}
    # client 1: 1 step to -1 (d = 1); client 2: 4 steps to -2 (d = 0.5); equal samples
    fused = fednova_fuse(x, [{"w": torch.tensor([-1.0])}, {"w": torch.tensor([-2.0])}], [1, 1], [1.0, 4.0])
    # tau_eff = 0.5*1 + 0.5*4 = 2.5; sum p d = 0.75; x - 2.5*0.75
    assert fused["w"].item() == pytest.approx(-1.875)
    # FedAvg gives -1.5; FedNova moves by tau_eff along the mean normalised direction
    assert weighted_average([{"w": torch.tensor([-1.0])}, {"w": torch.tensor([-2.0])}], [1, 1])["w"].item() == -1.5


def test_fednova_sample_weights_by_hand():
    x = {"w": torch.tensor([1.0, 1.0])}
    locals_ = [{"w": torch.tensor([0.0, 1.0])}, {"w": torch.tensor([1.0, -1.0])}]
    fused = fednova_fuse(x, locals_, [3, 1], [2.0, 1.0])
    # p = (3/4, 1/4); d1 = (1, 0)/2, d2 = (0, 2)/1; tau_eff = 1.5 + 0.25 = 1.75
    # sum p d = (0.375, 0.5); x - 1.75 * that = (0.34375, 0.125)
    assert fused["w"].tolist() == pytest.approx([0.34375, 0.125])


def test_fednova_equals_fedavg_when_steps_equal():
    torch.manual_seed(0)
    x = {"a": torch.randn(3, 2), "b": torch.randn(4)}
    locals_ = [{k: v + torch.randn_like(v) for k, v in x.items()} for _ in range(3)]
    n = [5, 1, 7]
    nova = fednova_fuse(x, locals_, n, [6.0, 6.0, 6.0])
    avg = weighted_average(locals_, n)
    for key in x:
        assert torch.allclose(nova[key], avg[key], atol=1e-6)


def test_local_step_norm_plain_and_momentum():
    assert local_step_norm(7) == 7.0
    # tau = 2, rho = 0.5: coefficients of the two gradients are 1 + rho and 1
    assert local_step_norm(2, 0.5) == pytest.approx(2.5)
    assert local_step_norm(3, 0.5) == pytest.approx((1 + 0.5 + 0.25) + (1 + 0.5) + 1)


class UploadProbe:
    name = "upload-probe"

    def __init__(self):
        self.seen = []

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        for u in uploads:
            self.seen.append((u.client_id, u.num_samples, u.get("fednova_steps")))


def test_fednova_counts_one_step_per_minibatch(tiny_config):
    probe = UploadProbe()
    results = run_training(tiny_config(plugins=["fednova"], local_epochs=2, rounds_per_task=1), extra_plugins=[probe])
    assert probe.seen
    for _, n, steps in probe.seen:
        assert steps == 2 * math.ceil(n / 32)
    assert results["final"]["accuracy"] is not None


# --- APFL ------------------------------------------------------------------


def test_apfl_mixture_and_alpha_gradient_by_hand():
    v = {"w": torch.tensor([3.0, 0.0])}
    w = {"w": torch.tensor([1.0, 2.0])}
    assert mix(v, w, 0.25)["w"].tolist() == pytest.approx([1.5, 1.5])
    # <v - w, g> = (2)(1) + (-2)(0.5) = 1
    assert alpha_gradient(v, w, {"w": torch.tensor([1.0, 0.5])}) == pytest.approx(1.0)


def test_apfl_personal_step_by_hand():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)  # w = 1
    v = {"weight": torch.tensor([[3.0]], requires_grad=True)}
    x, y = torch.tensor([[1.0]]), torch.tensor([[0.0]])

    def loss_fn(out, target):
        return ((out - target) ** 2).sum()

    loss, alpha = personal_step(model, v, {}, 0.5, x, y, loss_fn, lr=0.1, alpha_lr=0.01)
    # v_bar = 0.5*3 + 0.5*1 = 2; loss = 4; g = dL/dv_bar = 2*2*1 = 4
    assert loss.item() == pytest.approx(4.0)
    # v <- 3 - 0.1 * alpha * g = 3 - 0.2; alpha <- 0.5 - 0.01 * (3 - 1) * 4
    assert v["weight"].item() == pytest.approx(2.8)
    assert float(alpha) == pytest.approx(0.42)
    assert model.weight.item() == 1.0 and model.weight.grad is None  # w untouched
    # alpha is clipped to [0, 1]
    _, alpha = personal_step(model, v, {}, 0.5, x, y, loss_fn, lr=0.1, alpha_lr=1.0)
    assert float(alpha) == 0.0
    _, fixed = personal_step(model, v, {}, 0.5, x, y, loss_fn, lr=0.1, alpha_lr=1.0, adaptive=False)
    assert float(fixed) == 0.5


def test_apfl_evaluation_uses_the_mixture_and_restores_w():
    model = nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    client = SimpleNamespace(id=0, model=model, stash=Stash())
    apfl = APFL()
    client.stash[PERSONAL] = ({"weight": torch.tensor([[3.0]], requires_grad=True)}, {})
    client.stash[ALPHA] = 0.25
    wrapper = apfl.fedaval_client_evaluate(run=None, client=client)
    next(wrapper)  # up to the evaluation
    assert model.weight.item() == pytest.approx(1.5)  # 0.25*3 + 0.75*1
    with pytest.raises(StopIteration) as done:
        wrapper.send({"accuracy": 1.0})
    assert done.value.value == {"accuracy": 1.0}
    assert model.weight.item() == 1.0


def _client_acc(results):
    return [r["client_accuracy"] for r in results["rounds"] if r.get("client_accuracy")]


def test_apfl_run_mixture_predicts_for_clients_and_leaves_w_alone(tiny_config, tmp_path):
    fedavg = run_training(tiny_config(out=str(tmp_path / "a"), rounds_per_task=1))
    apfl = run_training(
        tiny_config(
            out=str(tmp_path / "b"),
            rounds_per_task=1,
            plugins=["apfl"],
            plugin_options={"apfl": {"alpha": "1", "adaptive": "false"}},
        )
    )
    # the personal step never touches w: the global model is FedAvg's, bit for bit
    assert apfl["final"]["accuracy"] == fedavg["final"]["accuracy"]
    # ... but with alpha = 1 the purely personal model v predicts for each client
    assert _client_acc(apfl) != _client_acc(fedavg)
    assert "loss/apfl_personal" in apfl["rounds"][-1]["losses"]
    assert apfl["rounds"][-1]["plugin_metrics"]["apfl"]["apfl_mean_alpha"] == 1.0


def test_apfl_alpha_is_learnt(tiny_config):
    results = run_training(tiny_config(plugins=["apfl"], rounds_per_task=1, plugin_options={"apfl": {"alpha": "0.5"}}))
    alphas = [r["plugin_metrics"]["apfl"]["apfl_mean_alpha"] for r in results["rounds"]]
    assert all(0 <= a <= 1 for a in alphas) and alphas[-1] != 0.5
