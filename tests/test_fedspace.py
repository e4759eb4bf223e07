"""FedSpace as its authors' code runs it: the maths against hand-computed
values and a per-class loop of the code's representation loss, the server's
prototype EMA and weight mixing, and digits runs in which every part takes
effect (rotations, the masked tempered cross-entropy, the prototype
augmentation, the representation loss), drawn from the clients' own random
streams (reproducible)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.payload import Upload
from fedaval.plugins.fedspace import GLOBAL, PROTOTYPES, RADIUS, FedSpace
from fedaval.plugins.fedspace_math import (
    aggregate_prototypes,
    aggregate_radius,
    class_prototypes,
    client_radius,
    masked_cross_entropy_sum,
    noisy_prototypes,
    output_units,
    representation_loss,
    rotated_copies,
    unit_positions,
)

T = torch.tensor
PLUGIN = "fedaval.plugins.fedspace:FedSpace"


# --- the maths --------------------------------------------------------------


def test_rotated_copies_turn_the_images_and_label_them_4y_plus_k():
    x = torch.arange(2 * 1 * 2 * 2, dtype=torch.float32).view(2, 1, 2, 2)
    xs, ys = rotated_copies(x, T([3, 5]))
    assert ys.tolist() == [13, 21, 14, 22, 15, 23]  # rotation by rotation: k = 1, 2, 3
    assert torch.equal(xs[0, 0], T([[1.0, 3.0], [0.0, 2.0]]))  # [[0, 1], [2, 3]] turned 90 degrees
    assert torch.equal(xs[2, 0], T([[3.0, 2.0], [1.0, 0.0]]))  # 180 degrees
    assert output_units([2, 0], rotation=True) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert output_units([2, 0], rotation=False) == [0, 2]


def test_masked_tempered_cross_entropy_by_hand():
    logits = T([[1.0, 50.0, 0.0, 2.0]])
    units, position = unit_positions([0, 3], 4, "cpu")
    # over units 0 and 3 only, logits / 0.5 = [2, 4]; target unit 3 is position 1
    got = masked_cross_entropy_sum(logits, T([3]), units, position, 0.5)
    assert got.item() == pytest.approx(-4 + math.log(math.exp(2) + math.exp(4)))
    two = masked_cross_entropy_sum(logits.repeat(2, 1), T([3, 3]), units, position, 0.5)
    assert two.item() == pytest.approx(2 * got.item())  # a sum, not a mean


def test_prototypes_and_the_one_radius_by_hand():
    features = T([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0], [5.0, 5.0]])
    labels = T([0, 0, 0, 0, 1])
    protos = class_prototypes(features, labels, [0, 1, 7])
    assert torch.equal(protos[0], T([1.0, 1.0])) and torch.equal(protos[1], T([5.0, 5.0]))
    assert torch.equal(protos[7], T([0.0, 0.0]))  # no sample: zeros, as the code
    # class 0: trace(np.cov) / D = (8 / 3) / 2 = 4/3; class 1 (one sample) and 7 (none) count 0
    assert client_radius(features, labels, [0, 1, 7]) == pytest.approx(math.sqrt((4 / 3) / 3))


def test_server_prototypes_weighted_by_samples_with_an_ema_by_hand():
    a = (1, {0: T([0.0, 2.0]), 2: T([1.0, 1.0])})
    b = (3, {0: T([4.0, 0.0]), 2: T([0.0, 0.0])})  # a zero prototype (no sample) is left out
    fused = aggregate_prototypes([a, b], None, 0.1)
    # class 0: weights 1/4 and 3/4 (sum 1): [3, 0.5]; class 2: only a's, 1/4 renormalised to 1
    assert torch.allclose(fused[0], T([3.0, 0.5]))
    assert torch.allclose(fused[2], T([1.0, 1.0]))
    old = {0: T([10.0, 10.0]), 5: T([9.0, 9.0])}
    later = aggregate_prototypes([(2, {0: T([0.0, 2.0])})], old, 0.1)
    assert torch.allclose(later[0], 0.1 * T([0.0, 2.0]) + 0.9 * T([10.0, 10.0]))
    assert 5 not in later  # nobody uploaded class 5 this round: the code drops it
    assert aggregate_radius([(1, 2.0), (3, 6.0)]) == pytest.approx(5.0)


def test_noisy_prototypes_are_prototype_plus_radius_times_gaussian():
    protos, classes = T([[1.0, 0.0, 0.0], [0.0, 10.0, 0.0]]), T([3, 8])
    feats, labels = noisy_prototypes(protos, 0.5, classes, 6, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # the same draws by hand: classes first, then the noise
    pick = torch.randint(2, (6,), generator=g)
    noise = torch.randn(6, 3, generator=g)
    assert labels.tolist() == classes[pick].tolist()
    assert torch.allclose(feats, protos[pick] + 0.5 * noise)


def code_representation_loss(features, labels, current, temperature):
    """The code's loop (LTTM/FedSpace, ``_compute_loss``), written out per class."""
    feat = F.normalize(features, p=2.0, dim=1)
    total = 0.0
    for c in current:
        nc = int((labels == c).sum())
        if nc <= 1:
            continue
        feat_c, feat_not_c = feat[labels == c], feat[labels != c]
        pos = feat_c @ feat_c.T / temperature
        pos[torch.eye(nc, dtype=torch.bool)] *= 0.0
        neg = feat_c @ feat_not_c.T / temperature
        loss = pos - torch.logsumexp(torch.cat([pos, neg], dim=1), dim=1).unsqueeze(1)
        total += -1 * loss[~torch.eye(nc, dtype=torch.bool)].sum() / (nc - 1)
    return total / len(labels)


def test_representation_loss_is_the_codes_loop():
    g = torch.Generator().manual_seed(3)
    features = torch.randn(12, 5, generator=g)
    labels = T([0, 1, 0, 2, 1, 0, 3, 3, 2, 4, 0, 1])
    for current, temperature in (([0, 1], 1.0), ([2, 4], 0.5), ([4], 1.0)):
        want = code_representation_loss(features, labels, current, temperature)
        got = representation_loss(features, labels, T(current), temperature)
        assert got.item() == pytest.approx(float(want), abs=1e-6)
    assert representation_loss(features, labels, T([4]), 1.0).item() == 0.0  # class 4 has one sample


# --- the server --------------------------------------------------------------


def test_server_mixes_fedavg_with_the_old_weights():
    plugin = FedSpace()
    uploads = [
        Upload(0, 1, {"weights": {"w": T([4.0]), "n": T(3)}}),
        Upload(1, 3, {"weights": {"w": T([0.0]), "n": T(3)}}),
    ]
    new = plugin.fedaval_server_fuse_weights(run=None, uploads=uploads, global_weights={"w": T([2.0]), "n": T(2)})
    # FedAvg: 1/4 * 4 + 3/4 * 0 = 1; mixed: 0.5 * 1 + 0.5 * 2 = 1.5; the counter is not mixed
    assert new["w"].item() == pytest.approx(1.5) and new["n"].item() == 3
    plugin.options.server_mix = 1.0
    assert (
        plugin.fedaval_server_fuse_weights(run=None, uploads=uploads, global_weights={"w": T([2.0])})["w"].item() == 1.0
    )


def test_server_averages_from_the_second_round_and_sends_to_clients_out_of_date():
    plugin = FedSpace()
    client0, client1 = (type("C", (), {"id": k})() for k in (0, 1))
    ups = [Upload(0, 10, {PROTOTYPES: {0: T([2.0, 0.0])}, RADIUS: T(1.0)})]
    plugin.fedaval_server_fuse(run=None, uploads=ups, round=1)
    assert plugin.protos is None and plugin.fedaval_server_download(run=None, client=client0, download={}) is None
    plugin.fedaval_server_fuse(run=None, uploads=ups, round=2)
    sent = plugin.fedaval_server_download(run=None, client=client0, download={})
    assert torch.equal(sent[PROTOTYPES][0], T([2.0, 0.0])) and sent[RADIUS].item() == 1.0
    assert plugin.fedaval_server_download(run=None, client=client0, download={}) is None  # up to date
    assert plugin.fedaval_server_download(run=None, client=client1, download={}) is not None
    plugin.fedaval_server_fuse(
        run=None, uploads=[Upload(1, 10, {PROTOTYPES: {5: T([1.0, 1.0])}, RADIUS: T(3.0)})], round=3
    )
    assert sorted(plugin.protos) == [5]  # class 0 not uploaded this round: dropped
    plugin.options.keep_bank = True
    plugin.fedaval_server_fuse(run=None, uploads=ups, round=4)
    assert sorted(plugin.protos) == [0, 5]
    assert torch.allclose(plugin.protos[0], T([2.0, 0.0]))  # not in the previous list: no EMA


# --- digits runs -------------------------------------------------------------------


class Probe:
    """Records each client's plan at its first minibatch of every round, and
    replays the prototype augmentation's draw from the state it started at."""

    name = "fedspace-probe"

    def __init__(self):
        self.plans: list[tuple] = []
        self.draws: list[tuple] = []

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl(wrapper=True)
    def fedaval_client_loss(self, run, client, batch):
        from fedaval.plugins.fedspace import PLAN
        from fedaval.random_streams import rng_state, set_rng_state

        state = rng_state(run.device)
        plan = client.stash[PLAN]
        self.plans.append((run.round, client.id, plan["old"][0], plan["known"][0], plan["units"].tolist()))
        results = yield
        term = next((r["fedspace_pseudo_ce"] for r in results if r and "fedspace_pseudo_ce" in r), None)
        if term is not None and len(self.draws) < 3:
            outside = rng_state(run.device)
            set_rng_state(state, run.device)
            classes, rows = plan["old"]
            feats, labels = noisy_prototypes(rows.to(batch.features), plan["radius"], classes, len(batch.y))
            set_rng_state(outside, run.device)
            logits = client.model.classifier(feats) / 0.1
            expected = 1e-2 * F.cross_entropy(logits, 4 * labels)
            self.draws.append((client.id, term.item(), expected.item()))
        return results


def async_config(tiny_config, **overrides):
    return tiny_config(
        plugins=[PLUGIN],
        scenario="fcil-async",
        scenario_options={"clients": 2, "tasks": 3},
        rounds_per_task=2,
        **overrides,
    )


@pytest.fixture(scope="module")
def fedspace_run(tmp_path_factory):
    from helpers import tiny_run_config

    probe = Probe()
    config = tiny_run_config(
        tmp_path_factory.mktemp("fedspace") / "run",
        plugins=[PLUGIN],
        scenario="fcil-async",
        scenario_options={"clients": 2, "tasks": 3},
        rounds_per_task=2,
    )
    return run_training(config, extra_plugins=[probe]), probe


def test_the_model_has_four_units_a_class_and_evaluation_reads_the_unturned_ones(fedspace_run):
    results, probe = fedspace_run
    run = probe.run
    model = run.server.model
    assert model.classifier.out_features == 4 * run.num_classes
    features = torch.randn(3, model.feature_dim)
    scores = run.hook.fedaval_classify(run=run, client=None, model=model, features=features, training=False)
    full = model.classifier(features)
    met = sorted({c for classes in run.federation_task_classes() for c in classes})
    assert scores.shape == (3, run.num_classes)
    assert torch.equal(scores[:, met], full[:, ::4][:, met])


def test_every_term_takes_effect_and_the_mask_is_the_seen_classes(fedspace_run):
    results, probe = fedspace_run
    run = probe.run
    losses = [r["losses"] for r in results["rounds"]]
    assert all(term["loss/fedspace_rotation_ce"] > 0 for term in losses)
    assert "loss/fedspace_repr" not in losses[0] and all(term["loss/fedspace_repr"] > 0 for term in losses[1:])
    assert any(term.get("loss/fedspace_pseudo_ce", 0) > 0 for term in losses)  # other clients' classes
    for round_, client_id, _, _, units in probe.plans:
        client = run.clients[client_id]
        task = run.round_info(round_).task
        seen = {c for t in range(task + 1) for c in client.tasks.classes[t]}
        assert units == sorted(4 * c + k for c in seen for k in range(4))
    # the augmented classes are never the client's current ones
    for round_, client_id, old, _, _ in probe.plans:
        if old is not None:
            current = set(run.clients[client_id].tasks.classes[run.round_info(round_).task])
            assert not current & set(old.tolist())
    assert probe.draws and all(got == pytest.approx(want, rel=1e-5) for _, got, want in probe.draws)


def test_a_run_is_reproducible(fedspace_run, tiny_config):
    results, probe = fedspace_run
    again = run_training(async_config(tiny_config, out=probe.run.out_dir.parent / "again"))
    assert [r["losses"] for r in again["rounds"]] == [r["losses"] for r in results["rounds"]]


def test_in_a_synchronous_scenario_old_classes_are_augmented_only_with_keep_bank(tiny_config, tmp_path):
    """The code's global list holds the round's uploaded classes only: with every
    client on the same task, the augmentation has a class to draw only in a
    task's first round (the list still of the last task's classes)."""

    def pseudo_rounds(**options):
        config = tiny_config(
            plugins=[PLUGIN],
            scenario="fcil-sync",
            scenario_options={"clients": 2, "tasks": 3},
            rounds_per_task=3,
            plugin_options={"fedspace": options},
            out=tmp_path / f"keep-{bool(options)}",
        )
        return [r["round"] for r in run_training(config)["rounds"] if "loss/fedspace_pseudo_ce" in r["losses"]]

    assert pseudo_rounds() == [4, 7]
    assert pseudo_rounds(keep_bank="true") == [4, 5, 6, 7, 8, 9]


def test_switching_parts_off(tiny_config):
    config = async_config(
        tiny_config,
        plugin_options={"fedspace": {"rotation": "false", "weight": 0.0, "repr_weight": 0.0, "server_mix": 1.0}},
    )
    results = run_training(config)
    assert all(set(r["losses"]) == {"loss/classification", "loss/total"} for r in results["rounds"])


class Received:
    name = "fedspace-received"

    def __init__(self):
        self.global_seen = False

    @hookimpl(trylast=True)
    def fedaval_client_receive(self, run, client, download):
        self.global_seen = self.global_seen or GLOBAL in client.stash


@pytest.mark.parametrize(
    "scenario,options",
    [
        ("fcl-random", {"clients": 3, "min_tasks": 2, "max_tasks": 3}),
        ("sthfl", {"clients": 3, "tasks": 2}),
    ],
)
def test_runs_in_the_other_scenarios(tiny_config, scenario, options):
    received = Received()
    results = run_training(
        tiny_config(plugins=[PLUGIN], scenario=scenario, scenario_options=options, rounds_per_task=2),
        extra_plugins=[received],
    )
    assert results["status"]["state"] == "complete" and received.global_seen


def test_bad_option_is_a_one_line_error(tmp_path):
    from helpers import one_line_error

    line = one_line_error(["train", "--plugins", PLUGIN, "-o", "fedspace.server_mix=2", "--out", str(tmp_path / "r")])
    assert "fedspace.server_mix" in line
