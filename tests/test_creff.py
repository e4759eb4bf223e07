"""CReFF: the maths against hand-computed values (per-class classifier
gradients with and without the bias, the matching distance, gradient
matching, balanced re-training, DSA's Siamese augmentation, the drawn real
batches), then real digits runs: the gradients are uploaded and counted,
taken on last round's re-trained classifier (sent and counted), the global
evaluation uses the re-trained classifier, the broadcast stays FedAvg's; and
the earlier reading, still reachable through the options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import FedavalUsageError
from fedaval.plugins.creff import ENTRY, HEAD, CReFF, fresh_linear, real_gradients
from fedaval.plugins.creff_math import (
    AUGMENTATIONS,
    class_gradients_closed_form,
    matching_distance,
    matching_loss,
    per_class_gradients,
    retrain_classifier,
    siamese_augment,
    update_federated_features,
)
from fedaval.prototypes import mean_over_holders

PLUGIN = "fedaval.plugins.creff:CReFF"


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# --- maths -------------------------------------------------------------------


def classifier_gradient(features, labels, weight, bias):
    """The reference: ``dL/dW`` of the mean cross-entropy, by autograd."""
    weight = weight.detach().requires_grad_(True)
    (grad,) = torch.autograd.grad(F.cross_entropy(F.linear(features, weight, bias), labels), weight)
    return grad


def class_gradient(features, labels, weight, bias):
    """What a client computes for one class (:func:`per_class_gradients`, closed form)."""
    (grad,) = per_class_gradients(features, labels, weight, bias).values()
    return grad


def test_classifier_gradient_by_hand():
    # W = 0, b = 0: softmax is uniform (1/2, 1/2). One sample f = (1, 2) of class 0:
    # dL/dW = (p - onehot)^T f = [[-1/2 * 1, -1/2 * 2], [1/2 * 1, 1/2 * 2]]
    g = class_gradient(t([1, 2]), torch.tensor([0]), torch.zeros(2, 2), torch.zeros(2))
    assert torch.allclose(g, t([-0.5, -1.0], [0.5, 1.0]))
    # two samples of class 1, f = (2, 0) and (0, 4): the mean of the two gradients
    g = class_gradient(t([2, 0], [0, 4]), torch.tensor([1, 1]), torch.zeros(2, 2), torch.zeros(2))
    assert torch.allclose(g, t([0.5, 1.0], [-0.5, -1.0]))


def test_classifier_gradient_with_weights_by_hand():
    # W = [[ln 3, 0], [0, 0]], f = (1, 0): logits (ln 3, 0), softmax (3/4, 1/4); class 0:
    # dL/dW = [[(3/4 - 1) * 1, 0], [1/4 * 1, 0]]
    w = torch.tensor([[math.log(3), 0.0], [0.0, 0.0]])
    g = class_gradient(t([1, 0]), torch.tensor([0]), w, torch.zeros(2))
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


def test_bias_gradient_is_the_last_column_and_matches_autograd():
    torch.manual_seed(4)
    feats, w, b = torch.randn(6, 4), torch.randn(3, 4), torch.randn(3)
    labels = torch.tensor([0, 0, 2, 2, 2, 1])
    grads = per_class_gradients(feats, labels, w, b, with_bias=True)
    for c in (0, 1, 2):
        wv, bv = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        mask = labels == c
        loss = F.cross_entropy(F.linear(feats[mask], wv, bv), labels[mask])
        gw, gb = torch.autograd.grad(loss, [wv, bv])
        assert grads[c].shape == (3, 5)
        assert torch.allclose(grads[c][:, :-1], gw, atol=1e-6) and torch.allclose(grads[c][:, -1], gb, atol=1e-6)
    without = per_class_gradients(feats, labels, w, b)
    assert all(torch.allclose(without[c], grads[c][:, :-1]) for c in without)


def test_matching_distance_with_bias_by_hand():
    # weight rows: identical (0); the bias gradients (1, 0, ...) against (0, 1, ...): orthogonal (1)
    real = torch.cat([t([1, 0], [0, 2]), t([1], [0])], dim=1)
    synthetic = torch.cat([t([1, 0], [0, 2]), t([0], [1])], dim=1)
    assert float(matching_distance(synthetic, real, with_bias=True)) == pytest.approx(1.0, abs=1e-5)
    # read as a weight gradient of width 3, the same rows are not orthogonal
    assert float(matching_distance(synthetic, real)) != pytest.approx(1.0, abs=1e-3)
    # matching_loss reads the width: d + 1 columns match the bias too
    torch.manual_seed(5)
    feats, w, b = {0: torch.randn(4, 2)}, torch.randn(2, 2), torch.randn(2)
    target = {0: torch.randn(2, 3)}
    expected = matching_distance(
        class_gradients_closed_form(feats[0][None], torch.tensor([0]), w, b, True)[0], target[0], True
    )
    assert float(matching_loss(feats, target, w, b)) == pytest.approx(float(expected), rel=1e-6)


def images(n=4, seed=0):
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", AUGMENTATIONS)
def test_siamese_augment_gives_every_image_the_same_draw(kind):
    x = images()
    torch.manual_seed(11)
    together = siamese_augment(x, kind)
    for i in range(len(x)):
        torch.manual_seed(11)
        assert torch.allclose(siamese_augment(x[i : i + 1], kind)[0], together[i], atol=1e-6), kind
    assert together.shape == x.shape


def test_siamese_augment_kinds_do_what_they_say():
    x = images(2)
    seen = set()
    for seed in range(40):
        torch.manual_seed(seed)
        crop = siamese_augment(x, "crop")  # a zero-filled translation by at most 1 pixel (8 / 8)
        shifts = [(dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1)]
        padded = F.pad(x, (1, 1, 1, 1))
        seen |= {s for s in shifts if torch.equal(crop, padded[:, :, 1 + s[0] : 9 + s[0], 1 + s[1] : 9 + s[1]])}
        torch.manual_seed(seed)
        cut = siamese_augment(x, "cutout")  # a block of at most 4 x 4 zeros, the rest unchanged
        zeroed = (cut != x).any(dim=(0, 1))
        rows, cols = zeroed.any(1).nonzero().flatten(), zeroed.any(0).nonzero().flatten()
        assert 0 < len(rows) <= 4 and 0 < len(cols) <= 4
        assert zeroed[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1].all()
        assert (cut[:, :, zeroed] == 0).all()
        torch.manual_seed(seed)
        flip = siamese_augment(x, "flip")
        assert torch.equal(flip, x) or torch.equal(flip, x.flip(3))
    assert len(seen) == 9  # every shift of the range is drawn
    torch.manual_seed(0)
    colour = siamese_augment(x, "color")
    assert not torch.allclose(colour, x) and colour.shape == x.shape
    with pytest.raises(ValueError, match="unknown augmentation 'blur'"):
        siamese_augment(x, "blur")


def test_siamese_augment_draws_each_kind_from_the_global_stream():
    x = images(2)
    torch.manual_seed(3)
    first = [siamese_augment(x) for _ in range(60)]
    torch.manual_seed(3)
    again = [siamese_augment(x) for _ in range(60)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert len({tuple(a.flatten()[:8].tolist()) for a in first}) > 30  # not one fixed transform
    torch.manual_seed(3)
    kinds = [AUGMENTATIONS[int(torch.randint(len(AUGMENTATIONS), ()))] for _ in range(60)]
    assert set(kinds) == set(AUGMENTATIONS)


class Features(torch.nn.Module):
    """A model whose features are its flattened input through one linear map."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(3 * 8 * 8, 5)

    def features(self, x):
        return self.body(x.flatten(1))


def test_real_gradients_average_the_drawn_batches():
    torch.manual_seed(0)
    model, x = Features(), images(10, seed=2)
    y = torch.tensor([0, 1] * 5)
    w, b = torch.randn(3, 5), torch.randn(3)
    with torch.no_grad():
        feats = model.features(x)
    # batch 0, one draw, no augmentation: every image of the class once (the earlier reading)
    once = real_gradients(model, x, y, w, b, draws=1, batch=0, augment=False, with_bias=False)
    expected = per_class_gradients(feats, y, w, b)
    assert set(once) == {0, 1} and all(torch.allclose(once[c], expected[c], atol=1e-6) for c in once)
    # three draws of two images per class: the mean of the three batches' gradients, drawn in that order
    torch.manual_seed(7)
    got = real_gradients(model, x, y, w, b, draws=3, batch=2, augment=False, with_bias=True)
    torch.manual_seed(7)
    members = {c: (y == c).nonzero().flatten() for c in (0, 1)}
    total = {0: 0, 1: 0}
    for _ in range(3):
        for c, idx in members.items():
            pick = idx[torch.randperm(len(idx))[:2]]
            total[c] = total[c] + per_class_gradients(feats[pick], y[pick], w, b, True)[c] / 3
    assert all(torch.allclose(got[c], total[c], atol=1e-6) for c in (0, 1))
    assert not torch.allclose(got[0][:, :-1], once[0], atol=1e-3)
    assert model.training  # the model's mode is restored


def test_real_gradients_augment_each_batch():
    torch.manual_seed(0)
    model, x, y = Features(), images(6, seed=3), torch.tensor([0, 0, 0, 1, 1, 1])
    w, b = torch.randn(2, 5), torch.randn(2)
    torch.manual_seed(1)
    plain = real_gradients(model, x, y, w, b, draws=4, batch=3, augment=False, with_bias=True)
    torch.manual_seed(1)
    augmented = real_gradients(model, x, y, w, b, draws=4, batch=3, augment=True, with_bias=True)
    assert not torch.allclose(plain[0], augmented[0], atol=1e-4)


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
        self.heads = []
        self.retrained = {}
        self.fused = []
        self.global_scores = []
        self.run = None

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.downloads.append((run.round, download["weights"]["classifier.weight"].clone()))
        if HEAD in download:
            self.heads.append((run.round, client.id, tuple(t.clone() for t in download[HEAD])))

    @hookimpl(trylast=True)
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.payload import payload_nbytes

        self.gradient_bytes.append(sum(payload_nbytes({ENTRY: u.get(ENTRY)}) for u in uploads if u.get(ENTRY)))
        self.fused.append((round, run.server.model.classifier.weight.detach().clone()))
        self.retrained[round] = tuple(t.clone() for t in run.plugins.objects["creff"].retrained)

    @hookimpl(hookwrapper=True)
    def fedaval_classify(self, run, client, model, features, training):
        outcome = yield
        if client is None and not training:
            self.global_scores.append((features.detach(), outcome.get_result()))


def creff_training(tmp_path_factory, **options):
    from fedaval.config import RunConfig

    probe = Probe()
    config = RunConfig(
        plugins=[PLUGIN],
        plugin_options={"creff": {**SMALL, **options}},
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


@pytest.fixture(scope="module")
def creff_run(tmp_path_factory):
    return creff_training(tmp_path_factory)


@pytest.fixture(scope="module")
def earlier_reading_run(tmp_path_factory):
    """The reading before the authors' code was followed (CReFF's docstring)."""
    return creff_training(
        tmp_path_factory,
        match_head="global",
        match_bias=False,
        real_draws=1,
        real_batch=0,
        augment="none",
        retrain_init="global",
    )


def test_gradients_are_uploaded_and_counted(creff_run):
    results, probe = creff_run
    plugin = probe.run.plugins.objects["creff"]
    assert all(n > 0 for n in probe.gradient_bytes)
    # 3 clients, one 3-class task each: 3 gradients of 10 x (64 + 1) floats (+8 bytes per key) per client
    w = probe.run.server.model.classifier.weight
    per_class = (w.numel() + w.shape[0]) * 4 + 8
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


def test_gradients_are_taken_on_last_rounds_retrained_classifier(creff_run):
    results, probe = creff_run
    plugin = probe.run.plugins.objects["creff"]
    w = probe.run.server.model.classifier
    rounds = sorted({r for r, _, _ in probe.heads})
    assert rounds == [r["round"] for r in results["rounds"]]  # sent every round
    first = fresh_linear(w.in_features, w.out_features, torch.Generator().manual_seed(104_729), "cpu")
    for round, _, (weight, bias) in probe.heads:
        expected = first if round == 1 else probe.retrained[round - 1]
        assert torch.equal(weight, expected[0]) and torch.equal(bias, expected[1])
    assert torch.equal(plugin.sent[1], probe.retrained[rounds[-2]][0])  # the server matched on the same one
    # counted in bytes_down: the FedAvg model plus the head (+8 bytes for its key), per sampled client
    head = (w.weight.numel() + w.bias.numel()) * 4 + 8
    plain = sum(v.numel() * v.element_size() + 8 for v in probe.run.server.global_weights().values())
    assert results["rounds"][1]["bytes_down"] >= 3 * (plain + head)


def retrained_again(probe, results, fresh: bool) -> bool:
    """Whether the last round's re-training, done again from the FedAvg
    classifier (``fresh=False``) or from a fresh layer drawn from the round's
    generator, gives the plugin's re-trained classifier."""
    plugin = probe.run.plugins.objects["creff"]
    round, o = results["rounds"][-1]["round"], plugin.options
    generator = torch.Generator().manual_seed(7919 * round)  # seed 0
    head = probe.run.server.model.classifier
    if fresh:
        w0, b0 = fresh_linear(head.in_features, head.out_features, generator, "cpu")
    else:
        w0, b0 = dict(probe.fused)[round], head.bias.detach()
    w, b = retrain_classifier(plugin.features, w0, b0, o.retrain_epochs, o.retrain_lr, o.retrain_batch, generator)
    return torch.equal(w, plugin.retrained[0]) and torch.equal(b, plugin.retrained[1])


def test_the_retraining_starts_from_a_fresh_layer(creff_run):
    results, probe = creff_run
    assert retrained_again(probe, results, fresh=True)
    assert not retrained_again(probe, results, fresh=False)


def test_the_earlier_reading_takes_every_image_once_on_the_fedavg_classifier(earlier_reading_run):
    results, probe = earlier_reading_run
    assert probe.heads == []  # nothing sent beside the model
    per_class = probe.run.server.model.classifier.weight.numel() * 4 + 8
    assert probe.gradient_bytes[0] == 3 * (3 * per_class + 8)
    assert retrained_again(probe, results, fresh=False)  # from the FedAvg classifier
    for r in results["rounds"]:
        m = r["plugin_metrics"]["creff"]
        assert m["creff_match_loss_after"] < m["creff_match_loss_before"]


def test_the_readings_give_other_results(creff_run, earlier_reading_run):
    new, old = creff_run[0]["rounds"][-1], earlier_reading_run[0]["rounds"][-1]
    assert new["plugin_metrics"]["creff"] != old["plugin_metrics"]["creff"]


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
    for name, bad in (("match_head", "fedavg"), ("augment", "crop"), ("real_draws", 0), ("real_batch", -1)):
        with pytest.raises(FedavalUsageError, match=f"creff.{name}"):
            build_options(CReFF.Options, {name: bad}, "creff")


def test_closed_form_gradients_equal_autograd():
    torch.manual_seed(3)
    feats, w, b = torch.randn(2, 5, 4), torch.randn(3, 4), torch.randn(3)
    classes = torch.tensor([2, 0])
    closed = class_gradients_closed_form(feats, classes, w, b)
    for i, c in enumerate(classes.tolist()):
        auto = classifier_gradient(feats[i], torch.full((5,), c), w, b)
        assert torch.allclose(closed[i], auto, atol=1e-6)
