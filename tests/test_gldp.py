"""GLDP: prototype maths against hand-computed values, the personal-head
split in real digits runs (what is uploaded, what each epoch trains)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import FedavalUsageError
from fedaval.payload import Upload
from fedaval.plugins.gldp import (
    GLDP,
    LOCAL,
)
from fedaval.plugins.gldp_math import (
    class_frequency_weights,
    global_relation_loss,
    local_relation_loss,
    relation_plan,
)
from fedaval.plugins.personal import part_of_epoch, personal_shared_keys, resolve_phases
from fedaval.prototypes import (
    class_means,
    ema_update,
    mean_over_holders,
    nearest_prototype_scores,
)
from fedaval.stash import Stash


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


# --- prototype maths ---------------------------------------------------------


def test_class_means_and_counts():
    features = t([1, 2], [3, 4], [5, 6])
    means, counts = class_means(features, torch.tensor([0, 0, 2]))
    assert set(means) == {0, 2}
    assert torch.equal(means[0], t(2, 3)) and torch.equal(means[2], t(5, 6))
    assert counts == {0: 2, 2: 1}


def test_local_moving_average_eq9():
    old = {0: t(1, 1), 1: t(2, 2)}
    new = {0: t(3, 5), 2: t(7, 7)}
    out = ema_update(old, new, beta=0.5)
    assert torch.equal(out[0], t(2, 3))  # 0.5*old + 0.5*new
    assert torch.equal(out[1], t(2, 2))  # not seen this stage: kept
    assert torch.equal(out[2], t(7, 7))  # new class: added as is
    assert torch.equal(old[0], t(1, 1))  # inputs untouched
    assert torch.allclose(ema_update({0: t(4.0)}, {0: t(0.0)}, beta=0.75)[0], t(3.0))


def test_mean_over_holders():
    out = mean_over_holders([{0: t(1, 1), 1: t(0, 2)}, {0: t(3, 3)}])
    assert torch.equal(out[0], t(2, 2)) and torch.equal(out[1], t(0, 2))


def _server_round(plugin, round, uploads):
    run = SimpleNamespace()
    ups = [Upload(i, 10, {"gldp_prototypes": p}) for i, p in enumerate(uploads)]
    return plugin.fedaval_server_fuse(run=run, uploads=ups, round=round)["gldp_prototypes"]


def test_global_moving_average_eq11_every_round():
    plugin = GLDP()  # beta 0.5
    g = _server_round(plugin, 1, [{0: t(1, 1), 1: t(0, 2)}, {0: t(3, 3)}])
    assert torch.equal(g[0], t(2, 2)) and torch.equal(g[1], t(0, 2))  # new classes: plain mean, as is
    g = _server_round(plugin, 2, [{0: t(6, 6)}])  # Algorithm 1: one EMA step per round
    assert torch.equal(g[0], t(4, 4)) and torch.equal(g[1], t(0, 2))
    g = _server_round(plugin, 3, [{0: t(0, 0)}, {0: t(2, 2)}])  # 0.5 * 4 + 0.5 * mean(0, 2)
    assert torch.equal(g[0], t(2.5, 2.5))
    g = _server_round(plugin, 4, [])  # no upload: unchanged
    assert torch.equal(g[0], t(2.5, 2.5))


def test_class_frequency_weights():
    assert class_frequency_weights(torch.tensor([0, 0, 0, 1])) == {0: 0.75, 1: 0.25}


def plan(old=None, global_set=None, weights=None, num_classes=8):
    return relation_plan(old or {}, global_set or {}, weights or {}, num_classes, dim=2, device="cpu")


def test_global_relation_loss_eq10_weighted_mse():
    # the minibatch's class means: 0 -> (1, 1) (from (0, 0) and (2, 2)), 1 -> (0, 2), 3 -> (9, 9)
    features, labels = t([0, 0], [2, 2], [0, 2], [9, 9]), torch.tensor([0, 0, 1, 3])
    global_set = {0: t(0, 0), 1: t(0, 0), 2: t(5, 5)}
    # class 3 has no global prototype and class 2 no sample: left out; 0.75 * mean(1, 1) + 0.25 * mean(0, 4)
    loss = global_relation_loss(features, labels, plan(global_set=global_set, weights={0: 0.75, 1: 0.25, 3: 1.0}))
    assert loss.item() == pytest.approx(0.75 * 1 + 0.25 * 2)
    only_3 = global_relation_loss(t([1, 1]), torch.tensor([3]), plan(global_set=global_set, weights={3: 1.0}))
    assert only_3.item() == 0.0
    assert global_relation_loss(features, labels, plan(weights={0: 1.0})) is None  # no global prototype


def test_local_relation_loss_eq8_reading():
    # old prototypes of classes 0 and 7 at distance 1: P^0 = softmax(0, -1)
    old = {0: t(0.0, 0.0), 7: t(1.0, 0.0)}
    p0 = torch.softmax(t(0.0, -1.0), 0)
    # a class-0 sample at (2, 0): distances (2, 1) -> q = softmax(-2, -1)
    q = torch.softmax(t(-2.0, -1.0), 0)
    expected = float((p0 * (p0.log() - q.log())).sum())
    features, labels = t([2.0, 0.0], [5.0, 5.0]), torch.tensor([0, 5])  # class 5 has no old prototype
    assert local_relation_loss(features, labels, plan(old)).item() == pytest.approx(expected, rel=1e-5)
    # a sample on its old prototype costs nothing; mean over the samples with an old prototype
    two = local_relation_loss(t([2.0, 0.0], [0.0, 0.0]), torch.tensor([0, 0]), plan(old))
    assert two.item() == pytest.approx(expected / 2, rel=1e-5)
    assert local_relation_loss(features[1:], labels[1:], plan(old)).item() == 0.0  # no sample has one
    assert local_relation_loss(features, labels, plan()) is None  # no old prototype at all


def test_losses_are_differentiable_in_the_features():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0]], requires_grad=True)
    labels = torch.tensor([0, 0])
    both = plan(old={0: t(2, 0), 1: t(0, 2)}, global_set={0: t(0, 0)}, weights={0: 1.0})
    loss = global_relation_loss(features, labels, both) + local_relation_loss(features, labels, both)
    loss.backward()
    assert features.grad is not None and features.grad.abs().sum() > 0


def test_local_relation_loss_keeps_old_prototypes_in_place():
    """Old classes' features drift less with L_LP: a small base trained on
    new classes only (cross-entropy), with and without lambda * L_LP over the
    stored prototypes of every class; measured, the old classes' mean
    features move by far less with it (0.35 vs 0.64 of their length)."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    y = torch.tensor(digits.target)
    old_classes, new_classes = [0, 1, 2], [3, 4, 5]

    def base_and_head(seed):
        torch.manual_seed(seed)
        base = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16), torch.nn.ReLU())
        return base, torch.nn.Linear(16, 10)

    def train(base, head, classes, steps, stored=None, lam=0.0):
        opt = torch.optim.SGD([*base.parameters(), *head.parameters()], lr=0.1)
        mask = torch.isin(y, torch.tensor(classes))
        xs, ys = x[mask], y[mask]
        gen = torch.Generator().manual_seed(0)
        stored_plan = relation_plan(stored, {}, {}, 10, dim=16, device="cpu") if stored else None
        for _ in range(steps):
            idx = torch.randint(len(ys), (32,), generator=gen)
            f = base(xs[idx])
            loss = torch.nn.functional.cross_entropy(head(f), ys[idx])
            if stored_plan is not None:
                loss = loss + lam * local_relation_loss(f, ys[idx], stored_plan)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def means(base):
        with torch.no_grad():
            return class_means(base(x), y)[0]

    drift = {}
    for lam in (0.0, 0.5):
        base, head = base_and_head(0)
        train(base, head, old_classes, 300)
        stored = means(base)  # every class's prototype after the first stage
        # the second stage's data: the new classes plus one old class seen again (overlapping stages)
        train(base, head, new_classes + [0], 300, stored, lam)
        after = means(base)
        drift[lam] = sum(float((after[c] - stored[c]).norm() / stored[c].norm()) for c in old_classes) / 3
    assert drift[0.5] < 0.7 * drift[0.0], drift


def test_nearest_prototype_prediction_eq13():
    features = t([0, 0], [3, 3.5])
    scores = nearest_prototype_scores(features, {1: t(0, 1), 4: t(3, 3)}, num_classes=5)
    assert scores.shape == (2, 5)
    assert scores.argmax(dim=1).tolist() == [1, 4]
    assert scores[0, 1].item() == pytest.approx(-1.0) and scores[1, 4].item() == pytest.approx(-0.5)
    assert torch.isinf(scores[:, [0, 2, 3]]).all()  # no prototype: never predicted


def test_classify_uses_heads_in_training_and_the_chosen_prototypes_in_evaluation():
    run = SimpleNamespace(num_classes=3)
    features = t([0, 0])
    for predict, expected in (("global", 0), ("local", 2)):
        plugin = GLDP(GLDP.Options(predict=predict))
        plugin.global_set = {0: t(0, 0), 1: t(5, 5)}
        client = SimpleNamespace(id=7, stash=Stash())
        client.stash[LOCAL] = {2: t(0.1, 0)}
        assert plugin.fedaval_classify(run=run, client=client, model=None, features=features, training=True) is None
        got = plugin.fedaval_classify(run=run, client=client, model=None, features=features, training=False)
        assert got.argmax(dim=1).item() == expected
        glob = plugin.fedaval_classify(run=run, client=None, model=None, features=features, training=False)
        assert glob.argmax(dim=1).item() == 0  # the global model always uses the global set
    empty = SimpleNamespace(id=1, stash=Stash())
    assert GLDP().fedaval_classify(run=run, client=empty, model=None, features=features, training=False) is None


def test_phase_rule():
    third = lambda e: max(1, round(e / 3))  # noqa: E731
    assert resolve_phases(3, None, None, third, ("t", "s"), "gldp") == (1, 2)
    assert resolve_phases(30, None, None, third, ("t", "s"), "gldp") == (10, 20)
    assert resolve_phases(1, None, None, third, ("t", "s"), "gldp") is None
    assert resolve_phases(4, None, 1, third, ("t", "s"), "gldp") == (3, 1)
    assert resolve_phases(4, 1, 3, third, ("t", "s"), "gldp") == (1, 3)
    with pytest.raises(FedavalUsageError, match="pass --local-epochs 3"):
        resolve_phases(1, 1, 2, third, ("t", "s"), "gldp")
    with pytest.raises(FedavalUsageError, match="does not fit"):
        resolve_phases(2, 5, None, third, ("t", "s"), "gldp")
    with pytest.raises(FedavalUsageError, match="train nothing; give them a sum of --local-epochs 1"):
        resolve_phases(1, 0, 0, third, ("t", "s"), "gldp")  # not "pass --local-epochs 0", itself refused
    assert [part_of_epoch(e, (1, 2), ("base", "head")) for e in range(3)] == ["base", "head", "head"]
    assert part_of_epoch(0, None, ("base", "head")) == "all"


# --- real runs ------------------------------------------------------------------


class Probe:
    """Records uploads, what each local epoch changed, and the download a client
    sees right after the core loaded it."""

    name = "probe"

    def __init__(self):
        self.upload_keys: list[set[str]] = []
        self.prototype_uploads: list[tuple[int, int, set[int]]] = []  # (round, client, classes)
        self.snapshots: dict[tuple[int, int], list[dict[str, torch.Tensor]]] = {}
        self.received_ok: list[bool] = []
        self.server_heads: list[torch.Tensor] = []

    @hookimpl(trylast=True)  # after the method set the phase
    def fedaval_client_epoch_start(self, run, client, epoch):
        self.snapshots.setdefault((run.round, client.id), []).append(
            {k: v.detach().clone() for k, v in client.model.state_dict().items()}
        )

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        state = client.model.state_dict()
        weights = download["weights"]
        self.received_ok.append(
            set(weights) == set(client.shared_keys)
            and all(torch.equal(state[k], v) for k, v in weights.items())
            and not any(k.startswith("classifier.") for k in weights)
        )

    @hookimpl
    def fedaval_client_upload(self, run, client):
        self.snapshots[(run.round, client.id)].append(
            {k: v.detach().clone() for k, v in client.model.state_dict().items()}
        )

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        self.server_heads.append(run.server.model.classifier.weight.detach().clone())
        for u in uploads:
            self.upload_keys.append(set(u.get("weights")))
            if u.get("gldp_prototypes"):
                self.prototype_uploads.append((round, u.client_id, set(u.get("gldp_prototypes"))))


def changed(a, b, prefix):
    return any(not torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


STHFL = dict(scenario="sthfl", scenario_options={"clients": 3, "classes_per_task": 3, "tasks": 2, "imbalance": 2.0})


@pytest.fixture(scope="module")
def gldp_run(tmp_path_factory):
    from fedaval.config import RunConfig

    probe = Probe()
    plugin_holder = {}

    class Keep:
        name = "keep"

        @hookimpl
        def fedaval_setup(self, run):
            plugin_holder["gldp"] = run.plugins.objects["gldp"]
            plugin_holder["run"] = run

    config = RunConfig(
        plugins=["gldp"],
        plugin_options={"gldp": {"t": 1, "s": 2}},
        dataset="digits",
        rounds_per_task=2,
        local_epochs=3,
        device="cpu",
        seed=0,
        out=str(tmp_path_factory.mktemp("gldp") / "run"),
        **STHFL,
    )
    results = run_training(config, extra_plugins=[probe, Keep()])
    return results, probe, plugin_holder["gldp"], plugin_holder["run"]


def test_only_the_base_is_uploaded_and_averaged(gldp_run):
    results, probe, plugin, run = gldp_run
    model = run.clients[0].model
    assert probe.upload_keys and all(keys == set(personal_shared_keys(model)) for keys in probe.upload_keys)
    assert all(not any(k.startswith("classifier.") for k in keys) for keys in probe.upload_keys)
    assert all(probe.received_ok)
    # the server's head never moves; each client's base is the download, its head its own
    assert len(probe.server_heads) == 4 and all(torch.equal(h, probe.server_heads[0]) for h in probe.server_heads)


def test_base_epochs_then_head_epochs(gldp_run):
    _, probe, _, _ = gldp_run
    assert probe.snapshots
    for snaps in probe.snapshots.values():
        assert len(snaps) == 4  # 3 epoch starts + the upload
        assert changed(snaps[0], snaps[1], "features.") and not changed(snaps[0], snaps[1], "classifier.")
        for a, b in ((snaps[1], snaps[2]), (snaps[2], snaps[3])):
            assert changed(a, b, "classifier.") and not changed(a, b, "features.")


def test_prototypes_uploaded_every_round_and_kept_locally(gldp_run):
    results, probe, plugin, run = gldp_run
    classes = results["scenario"]["client_task_classes"]
    # Algorithm 1: every client uploads its prototypes every round (all clients train every round)
    assert sorted((r, k) for r, k, _ in probe.prototype_uploads) == [(r, k) for r in (1, 2, 3, 4) for k in range(3)]
    for r, k, sent in probe.prototype_uploads:
        assert sent == set(classes[k][(r - 1) // 2])  # the classes of that task only
    for k in range(3):
        assert set(run.clients[k].stash[LOCAL]) == set(classes[k][0]) | set(classes[k][1])
    assert set(plugin.global_set) == {c for k in range(3) for task in classes[k] for c in task}


def test_losses_and_metrics_are_recorded(gldp_run):
    results, *_ = gldp_run
    rounds = results["rounds"]
    assert all({"loss/gldp_lp", "loss/gldp_gp"} <= set(r["losses"]) for r in rounds)
    assert rounds[0]["losses"]["loss/gldp_gp"] == 0  # no prototype before the first fusion
    assert rounds[0]["losses"]["loss/gldp_lp"] == 0
    # measured before (prototypes moved once per stage): both exactly 0 through stage 0
    assert rounds[1]["losses"]["loss/gldp_gp"] > 0 and rounds[1]["losses"]["loss/gldp_lp"] > 0
    gldp = rounds[-1]["plugin_metrics"]["gldp"]
    assert 0 <= gldp["gldp_a_loc_gp"] <= 1 and 0 <= gldp["gldp_a_loc_lp"] <= 1


def test_epochs_that_do_not_add_up_are_a_usage_error(tiny_config):
    with pytest.raises(FedavalUsageError, match="pass --local-epochs 3"):
        run_training(tiny_config(plugins=["gldp"], plugin_options={"gldp": {"t": 1, "s": 2}}, local_epochs=1))


def test_one_stage_run_uses_both_terms_and_evaluates_with_prototypes(tiny_config):
    """M = 1 (the paper's Table 1 setting): before, L_GP and L_LP were 0 for the
    whole run and the global model evaluated with its untrained linear head
    until the stage's end."""
    calls = []

    class Watch:
        name = "watch"

        @hookimpl(tryfirst=True, wrapper=True)
        def fedaval_classify(self, run, client, model, features, training):
            scores = yield
            if client is None and not training:
                calls.append((run.round, scores is not None))
            return scores

    results = run_training(
        tiny_config(
            plugins=["gldp"],
            local_epochs=3,
            rounds_per_task=3,
            scenario="sthfl",
            scenario_options={"clients": 3, "classes_per_task": 3, "tasks": 1, "imbalance": 2.0},
        ),
        extra_plugins=[Watch()],
    )
    rounds = results["rounds"]
    assert all(r["losses"]["loss/gldp_gp"] > 0 and r["losses"]["loss/gldp_lp"] > 0 for r in rounds[1:])
    # the global model's mid-stage evaluations (rounds 1 and 2) are nearest-prototype ones
    assert {r for r, _ in calls} == {1, 2, 3} and all(proto for _, proto in calls)


def test_one_local_epoch_warns_that_base_and_head_are_not_split(tiny_config, caplog):
    import logging

    with caplog.at_level(logging.WARNING, logger="fedaval"):
        run_training(tiny_config(plugins=["gldp"], local_epochs=1, rounds_per_task=1))
    assert any("no base/head split" in r.getMessage() for r in caplog.records)


def test_gldp_gp_a_loc_uses_the_latest_global_set_for_idle_clients(tiny_config):
    """GLDP-GP scores every client with the latest global set. A client not
    sampled in a round keeps its base and head, but the set moved in that
    round's fusion: before session 20 it kept an A_loc scored with an older
    set, so the core's a_loc differed from gldp_a_loc_gp at the same stage end."""
    results = run_training(
        tiny_config(
            plugins=["gldp"],
            local_epochs=3,
            rounds_per_task=3,
            clients_per_round=2,
            scenario="sthfl",
            scenario_options={"clients": 4, "classes_per_task": 3, "tasks": 2, "imbalance": 2.0},
        )
    )
    ends = [r for r in results["rounds"] if r["task_end"]]
    assert len(ends) == 2
    started: set[int] = set()
    idle_checked = 0
    for r in results["rounds"]:
        sampled = set(r["clients"])
        idle_checked += r["task_end"] and bool(started - sampled)
        started |= sampled
        if r["task_end"]:
            assert r["a_loc"] == pytest.approx(r["plugin_metrics"]["gldp"]["gldp_a_loc_gp"], abs=1e-6)
    assert idle_checked  # some started client sat a stage's last round out: the case that was wrong


# --- when the local set moves: local_update = round | epoch | stage -------------------


class LocalSetProbe:
    """Per (round, client): the local set as the round begins, the prototypes
    uploaded, and the local set after the upload."""

    name = "local-set-probe"

    def __init__(self):
        self.before: dict[tuple[int, int], dict] = {}
        self.uploaded: dict[tuple[int, int], dict] = {}
        self.after: dict[tuple[int, int], dict] = {}

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.before[(run.round, client.id)] = {c: p.clone() for c, p in client.stash.get(LOCAL, {}).items()}

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        for u in uploads:
            self.uploaded[(round, u.client_id)] = dict(u.get("gldp_prototypes") or {})
            client = run.clients[u.client_id]
            self.after[(round, u.client_id)] = {c: p.clone() for c, p in client.stash.get(LOCAL, {}).items()}


def local_set_run(tmp_path, local_update, tasks):
    from fedaval.config import RunConfig

    probe = LocalSetProbe()
    config = RunConfig(
        plugins=["gldp"],
        plugin_options={"gldp": {"t": 1, "s": 2, "local_update": local_update}},
        dataset="digits",
        rounds_per_task=2,
        local_epochs=3,
        device="cpu",
        seed=0,
        out=str(tmp_path / local_update),
        scenario="sthfl",
        scenario_options={"clients": 3, "classes_per_task": 3, "tasks": tasks, "imbalance": 2.0},
    )
    return run_training(config, extra_plugins=[probe]), probe


def test_per_epoch_local_update_folds_each_epoch_in(tmp_path):
    """Algorithm 1's line 15 in the epoch loop: with t = 1 base epoch and s = 2
    head epochs the base (so C_i) moves in the first epoch only, and the three
    epochs fold the same C_i in three times: C^ = beta^3 old + (1 - beta^3) C_i
    for a class already in the set; per round it is folded in once."""
    beta = 0.5
    for mode, folds in (("epoch", 3), ("round", 1)):
        _, probe = local_set_run(tmp_path, mode, tasks=1)
        checked = 0
        for key, after in probe.after.items():
            before, uploaded = probe.before[key], probe.uploaded[key]
            for c, p in uploaded.items():
                if c in before:
                    expected = beta**folds * before[c] + (1 - beta**folds) * p
                    assert torch.allclose(after[c], expected, atol=1e-5), (mode, key, c)
                    checked += 1
        assert checked > 0


def test_per_stage_local_update_leaves_l_lp_zero_in_a_one_stage_run(tmp_path):
    """Eq. 9's stage index: the local set moves at the client's last round of a
    stage only, so within a stage L_LP relates to earlier stages' prototypes and
    in a run of one stage it is exactly 0 (the paper's "pre-stage and
    post-stage" relation); per round it acts from a client's second round on."""
    results, probe = local_set_run(tmp_path, "stage", tasks=1)
    assert all(r["losses"]["loss/gldp_lp"] == 0.0 for r in results["rounds"])
    assert all(bool(after) == (round == 2) for (round, _), after in probe.after.items())  # at the stage's end
    assert all(not before for before in probe.before.values())  # not before it
    per_round, _ = local_set_run(tmp_path, "round", tasks=1)
    assert any(r["losses"]["loss/gldp_lp"] > 0 for r in per_round["rounds"])
    two_stages, probe = local_set_run(tmp_path / "two", "stage", tasks=2)
    assert any(r["losses"]["loss/gldp_lp"] > 0 for r in two_stages["rounds"] if r["task"] == 1)
