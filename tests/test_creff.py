"""CReFF: the maths against hand-computed values (per-class classifier
gradients, the matching distance, gradient matching, balanced re-training),
then a real digits run: the gradients are uploaded and counted, the global
evaluation uses the re-trained classifier, the broadcast stays FedAvg's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import FedavalUsageError
from fedaval.plugins.creff import ENTRY, CReFF
from fedaval.plugins.creff_math import (
    class_gradients_closed_form,
    classifier_gradient,
    matching_distance,
    matching_loss,
    per_class_gradients,
    retrain_classifier,
    update_federated_features,
)
from fedaval.prototypes import mean_over_holders

PLUGIN = "fedaval.plugins.creff:CReFF"


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# --- maths -------------------------------------------------------------------


def test_classifier_gradient_by_hand():
    # W = 0, b = 0: softmax is uniform (1/2, 1/2). One sample f = (1, 2) of class 0:
    # dL/dW = (p - onehot)^T f = [[-1/2 * 1, -1/2 * 2], [1/2 * 1, 1/2 * 2]]
    g = classifier_gradient(t([1, 2]), torch.tensor([0]), torch.zeros(2, 2), torch.zeros(2))
    assert torch.allclose(g, t([-0.5, -1.0], [0.5, 1.0]))
    # two samples of class 1, f = (2, 0) and (0, 4): the mean of the two gradients
    g = classifier_gradient(t([2, 0], [0, 4]), torch.tensor([1, 1]), torch.zeros(2, 2), torch.zeros(2))
    assert torch.allclose(g, t([0.5, 1.0], [-0.5, -1.0]))


def test_classifier_gradient_with_weights_by_hand():
    # W = [[ln 3, 0], [0, 0]], f = (1, 0): logits (ln 3, 0), softmax (3/4, 1/4); class 0:
    # dL/dW = [[(3/4 - 1) * 1, 0], [1/4 * 1, 0]]
    w = torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])
    g = classifier_gradient(t([1, 0]), torch.tensor([0]), w, torch.zeros(2))
    assert torch.allclose(g, t([-0.25, 0.0], [0.25, 0.0]))


def test_per_class_gradients_split_the_classes():
    feats = t([1, 2], [2, 0], [0, 4])
    labels = torch.tensor([0, 1, 1])
    grads = per_class_gradients(feats, labels, torch.zeros(2, 2), torch.zeros(2))
    assert set(grads) == {0, 1}
    assert torch.allclose(grads[0], t([-0.5, -1.0], [0.5, 1.0]))
    assert torch.allclose(grads[1], t([0.5, 1.0], [-0.5, -1.0]))
    assert not grads[0].requires_grad


def test_server_mean_over_holders():
    out = mean_over_holders([{0: t([2, 2]), 1: t([1, 1])}, {0: t([4, 0])}])
    assert torch.allclose(out[0], t([3, 1])) and torch.allclose(out[1], t([1, 1]))


def test_matching_distance_by_hand():
    real = t([1, 0], [0, 2])
    assert float(matching_distance(real, real)) == pytest.approx(0.0, abs=1e-5)
    # row 0 orthogonal (1 - 0), row 1 opposite (1 - (-1)) -> 1 + 2
    assert float(matching_distance(t([0, 3], [0, -1]), real)) == pytest.approx(3.0, abs=1e-5)
    # scale does not matter: cosine
    assert float(matching_distance(5 * real, real)) == pytest.approx(0.0, abs=1e-5)


def test_gradient_matching_moves_the_features_and_lowers_the_loss():
    torch.manual_seed(0)
    w, b = torch.randn(3, 4), torch.zeros(3)
    real_feats = torch.rand(20, 4) + t([2, 0, 0, 0])  # class 0's real features lie along axis 0
    real = per_class_gradients(real_feats, torch.zeros(20, dtype=torch.long), w, b)
    start = {0: torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), 2: torch.ones(5, 4)}
    new, losses = update_federated_features(start, real, w, b, steps=50, lr=0.1)
    assert losses[-1] < losses[0] * 0.5
    assert float(matching_loss(new, real, w, b)) == pytest.approx(losses[-1], rel=1e-4)
    assert not torch.equal(new[0], start[0])
    assert torch.equal(new[2], start[2])  # no real gradient for class 2: unchanged


def test_retrained_classifier_loses_the_head_bias():
    # a classifier biased to class 0 (the head): it predicts 0 for everything
    w = torch.zeros(2, 2)
    b = torch.tensor([3.0, 0.0])
    feats = {0: t([1, 0]).repeat(10, 1), 1: t([0, 1]).repeat(10, 1)}  # balanced federated features
    gen = torch.Generator().manual_seed(0)
    w2, b2 = retrain_classifier(feats, w, b, epochs=30, lr=0.5, batch_size=4, generator=gen)
    assert float(b2[0] - b2[1]) < float(b[0] - b[1])  # the head's bias shrinks
    x = t([1, 0], [0, 1])
    assert F.linear(x, w, b).argmax(1).tolist() == [0, 0]
    assert F.linear(x, w2, b2).argmax(1).tolist() == [0, 1]
    assert torch.equal(b, torch.tensor([3.0, 0.0]))  # the input is not changed


# --- a real run ----------------------------------------------------------------

STHFL = dict(scenario="sthfl", scenario_options={"clients": 3, "classes_per_task": 3, "tasks": 2, "imbalance": 4.0})
SMALL = {"features_per_class": 10, "match_steps": 10, "retrain_epochs": 5, "retrain_batch": 16}


class Probe:
    """Records what goes up and down, and the server's evaluation scores."""

    name = "probe"

    def __init__(self):
        self.gradient_bytes = []
        self.downloads = []
        self.fused = []
        self.global_scores = []
        self.run = None

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.downloads.append((run.round, download["weights"]["classifier.weight"].clone()))

    @hookimpl(trylast=True)
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.payload import payload_nbytes

        self.gradient_bytes.append(sum(payload_nbytes({ENTRY: u.get(ENTRY)}) for u in uploads if u.get(ENTRY)))
        self.fused.append((round, run.server.model.classifier.weight.detach().clone()))

    @hookimpl(hookwrapper=True)
    def fedaval_classify(self, run, client, model, features, training):
        outcome = yield
        if client is None and not training:
            self.global_scores.append((features.detach(), outcome.get_result()))


@pytest.fixture(scope="module")
def creff_run(tmp_path_factory):
    from fedaval.config import RunConfig

    probe = Probe()
    config = RunConfig(
        plugins=[PLUGIN],
        plugin_options={"creff": SMALL},
        dataset="digits",
        rounds_per_task=2,
        local_epochs=1,
        device="cpu",
        seed=0,
        out=str(tmp_path_factory.mktemp("creff") / "run"),
        **STHFL,
    )
    results = run_training(config, extra_plugins=[probe])
    return results, probe


def test_gradients_are_uploaded_and_counted(creff_run):
    results, probe = creff_run
    plugin = probe.run.plugins.objects["creff"]
    assert all(n > 0 for n in probe.gradient_bytes)
    # 3 clients, one 3-class task each: 3 gradients of 10 x 64 floats (+8 bytes per key) per client
    w = probe.run.server.model.classifier.weight
    per_class = w.numel() * 4 + 8
    assert probe.gradient_bytes[0] == 3 * (3 * per_class + 8)
    without = results["rounds"][0]["bytes_up"] - probe.gradient_bytes[0]
    assert without > 0  # the weights, counted apart
    assert set(plugin.features) == {c for t in results["scenario"]["federation_task_classes"] for c in t}
    assert all(f.shape == (10, w.shape[1]) for f in plugin.features.values())


def test_matching_lowers_the_loss_every_round(creff_run):
    results, _ = creff_run
    for r in results["rounds"]:
        m = r["plugin_metrics"]["creff"]
        assert m["creff_match_loss_after"] < m["creff_match_loss_before"]


def test_global_evaluation_uses_the_retrained_classifier(creff_run):
    results, probe = creff_run
    plugin = probe.run.plugins.objects["creff"]
    feats, scores = probe.global_scores[-1]
    w, b = plugin.retrained
    assert torch.allclose(scores, F.linear(feats, w, b))
    assert not torch.allclose(w, probe.run.server.model.classifier.weight)
    last = results["rounds"][-1]
    assert "creff_accuracy_fedavg_head" in last["plugin_metrics"]["creff"], last["plugin_metrics"]
    assert last["global_accuracy"] != last["plugin_metrics"]["creff"]["creff_accuracy_fedavg_head"]


def test_the_broadcast_is_fedavg_not_the_retrained_classifier(creff_run):
    _, probe = creff_run
    fused = dict(probe.fused)
    for round, sent in probe.downloads:
        if round > 1:
            assert torch.equal(sent, fused[round - 1])


def test_refused_with_a_personal_head(tiny_config):
    with pytest.raises(FedavalUsageError, match="creff needs the classifier shared"):
        run_training(tiny_config(plugins=["fedrep", PLUGIN], plugin_options={"creff": SMALL}))


class ClientsOnly:
    """A method whose federation's model is the clients' (as PFCL's)."""

    name = "clients_only"

    @hookimpl
    def fedaval_federation_model(self, run):
        return "clients"


def test_refused_without_a_global_model(tiny_config):
    with pytest.raises(FedavalUsageError, match="creff works on the global model, but the other plugins train no"):
        run_training(tiny_config(plugins=[PLUGIN], plugin_options={"creff": SMALL}), extra_plugins=[ClientsOnly()])


def test_options_are_checked():
    from fedaval.options import build_options

    with pytest.raises(FedavalUsageError, match="creff.retrain_init"):
        build_options(CReFF.Options, {"retrain_init": "zero"}, "creff")
    with pytest.raises(FedavalUsageError, match="creff.features_per_class"):
        build_options(CReFF.Options, {"features_per_class": 0}, "creff")


def test_closed_form_gradients_equal_autograd():
    torch.manual_seed(3)
    feats, w, b = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    classes = torch.tensor([2, 0])
    closed = class_gradients_closed_form(feats, classes, w, b)
    for i, c in enumerate(classes.tolist()):
        auto = classifier_gradient(feats[i], torch.full((5,), c), w, b)
        assert torch.allclose(closed[i], auto, atol=1e-6)
