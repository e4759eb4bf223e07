"""FedSpace: prototype/radius maths and the server's averaging against
hand-computed values, the bank sent only to out-of-date clients, and a
fcil-async digits run: uploads counted from their tensors, the pseudo-feature
loss from the stage after the first, drawn from the client's own random
stream (reproducible)."""

from __future__ import annotations

import math

import pytest
import torch

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.payload import Upload, payload_nbytes
from fedaval.plugins.fedspace import BANK, COUNTS, PROTOTYPES, RADII, FedSpace
from fedaval.plugins.fedspace_math import (
    fuse_banks,
    prototypes_and_radii,
    pseudo_feature_loss,
    pseudo_features,
)

T = torch.tensor
PLUGIN = "fedaval.plugins.fedspace:FedSpace"


# --- the maths --------------------------------------------------------------


def test_prototypes_and_radii_by_hand():
    features = T([[0.0, 0.0], [2.0, 0.0], [0.0, 2.0], [2.0, 2.0], [5.0, 5.0]])
    bank = prototypes_and_radii(features, T([0, 0, 0, 0, 1]))
    mu, r, n = bank[0]
    assert torch.equal(mu, T([1.0, 1.0])) and n == 4
    # sum of squared distances 4 x 2 = 8; r^2 = 8 / ((4 - 1) * 2) = 4/3 = trace(np.cov) / D
    assert r.item() == pytest.approx(math.sqrt(4 / 3))
    assert torch.equal(bank[1][0], T([5.0, 5.0])) and bank[1][1].item() == 0.0 and bank[1][2] == 1


def test_server_averaging_weighted_by_counts_by_hand():
    a = {0: (T([0.0, 0.0]), T(1.0), 1), 2: (T([1.0, 1.0]), T(0.5), 0)}
    b = {0: (T([4.0, 0.0]), T(2.0), 3), 1: (T([7.0, 7.0]), T(3.0), 2)}
    fused = fuse_banks([a, b])
    # class 0: mu = (1*[0,0] + 3*[4,0]) / 4 = [3, 0]; r = sqrt((1*1 + 3*4) / 4) = sqrt(13)/2
    assert torch.allclose(fused[0][0], T([3.0, 0.0])) and fused[0][2] == 4
    assert fused[0][1].item() == pytest.approx(math.sqrt(13) / 2)
    assert torch.allclose(fused[1][0], T([7.0, 7.0])) and fused[1][1].item() == pytest.approx(3.0)
    assert 2 not in fused  # no samples behind it


def test_pseudo_features_are_prototype_plus_radius_times_gaussian():
    protos, radii = T([[1.0, 0.0, 0.0], [0.0, 10.0, 0.0]]), T([0.5, 0.0])
    feats, labels = pseudo_features(protos, radii, [3, 8], 6, torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)  # the same draws by hand: classes first, then the noise
    pick = torch.randint(2, (6,), generator=g)
    noise = torch.randn(6, 3, generator=g)
    assert labels.tolist() == [[3, 8][i] for i in pick.tolist()]
    assert torch.allclose(feats, protos[pick] + radii[pick].unsqueeze(1) * noise)
    assert torch.equal(feats[labels == 8], T([[0.0, 10.0, 0.0]]).expand(int((labels == 8).sum()), 3))
    many, _ = pseudo_features(protos[:1], radii[:1], [3], 20000, torch.Generator().manual_seed(1))
    assert torch.allclose(many.mean(0), protos[0], atol=0.02)
    assert torch.allclose(many.std(0), T([0.5, 0.5, 0.5]), atol=0.02)


def test_pseudo_feature_loss_is_cross_entropy_by_hand():
    assert pseudo_feature_loss(T([[0.0, math.log(3.0)]]), T([1])).item() == pytest.approx(math.log(4 / 3))


def test_server_fuses_uploads_and_sends_the_bank_to_out_of_date_clients_only():
    plugin = FedSpace()
    client0, client1 = (type("C", (), {"id": k})() for k in (0, 1))
    assert plugin.fedaval_server_download(run=None, client=client0, download={}) is None  # empty bank
    uploads = [
        Upload(0, 10, {PROTOTYPES: {0: T([0.0, 0.0])}, RADII: {0: T(1.0)}, COUNTS: {0: 1}}),
        Upload(1, 10, {PROTOTYPES: {0: T([4.0, 0.0])}, RADII: {0: T(2.0)}, COUNTS: {0: 3}}),
        Upload(2, 10, {"weights": {}}),  # a client that finished no task this round
    ]
    plugin.fedaval_server_fuse(run=None, uploads=uploads, round=1)
    sent = plugin.fedaval_server_download(run=None, client=client0, download={})
    assert torch.allclose(sent[PROTOTYPES][0], T([3.0, 0.0]))
    assert sent[RADII][0].item() == pytest.approx(math.sqrt(13) / 2)
    assert plugin.fedaval_server_download(run=None, client=client0, download={}) is None  # up to date
    assert plugin.fedaval_server_download(run=None, client=client1, download={}) is not None
    # a later upload of class 0 replaces it (newer feature space); class 5 joins
    plugin.fedaval_server_fuse(
        run=None,
        uploads=[
            Upload(
                1,
                10,
                {PROTOTYPES: {0: T([1.0, 1.0]), 5: T([2.0, 2.0])}, RADII: {0: T(0.0), 5: T(1.0)}, COUNTS: {0: 2, 5: 2}},
            )
        ],
        round=2,
    )
    sent = plugin.fedaval_server_download(run=None, client=client0, download={})
    assert sorted(sent[PROTOTYPES]) == [0, 5] and torch.equal(sent[PROTOTYPES][0], T([1.0, 1.0]))


# --- a fcil-async digits run -------------------------------------------------------


class Probe:
    """Records the uploads' FedSpace entries and, around every FedSpace loss
    term, the global random state just before it was drawn."""

    name = "fedspace-probe"

    def __init__(self):
        self.uploads: dict[int, list[Upload]] = {}
        self.draws: list[tuple] = []

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        self.uploads[round] = list(uploads)

    @hookimpl(wrapper=True)
    def fedaval_client_loss(self, run, client, batch):
        from fedaval.client import rng_state, set_rng_state

        state = rng_state(run.device)  # the draw comes from the stream of the features' device
        results = yield
        term = next((r["fedspace_pseudo_ce"] for r in results if r and "fedspace_pseudo_ce" in r), None)
        if term is not None and len(self.draws) < 3:  # replay the draw from the state it started at
            bank = client.stash[BANK]
            old = [c for c in sorted(bank) if c not in client.tasks.classes[client.task]]
            outside = rng_state(run.device)
            set_rng_state(state, run.device)
            pseudo, labels = pseudo_features(
                torch.stack([bank[c][0] for c in old]).to(batch.features),
                torch.stack([bank[c][1] for c in old]).to(batch.features),
                old,
                len(batch.y),
            )
            set_rng_state(outside, run.device)
            expected = pseudo_feature_loss(client.model.classifier(pseudo), labels)
            self.draws.append((client.id, term.item(), expected.item()))
        return results


def fcil_async_config(tiny_config, **overrides):
    return tiny_config(
        plugins=[PLUGIN],
        scenario="fcil-async",
        scenario_options={"clients": 2, "tasks": 3},
        rounds_per_task=1,
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
        rounds_per_task=1,
    )
    return run_training(config, extra_plugins=[probe]), probe


def test_uploads_are_each_task_classes_and_counted_in_bytes(fedspace_run):
    results, probe = fedspace_run
    run = probe.run
    for record in results["rounds"]:
        uploads = probe.uploads[record["round"]]
        assert record["bytes_up"] == sum(u.nbytes for u in uploads)
        for u in uploads:
            client = run.clients[u.client_id]
            classes = client.tasks.classes[record["task"]]
            assert sorted(u.get(PROTOTYPES)) == sorted(u.get(RADII)) == sorted(classes)
            counts = u.get(COUNTS)
            y = run.data.train_y[torch.as_tensor(client.tasks.indices[record["task"]])]
            assert counts == {c: int((y == c).sum()) for c in classes}
            entries = {k: u.get(k) for k in (PROTOTYPES, RADII, COUNTS)}
            # 8 (key) + 4 * D per prototype, 8 + 4 per 0-d radius, 8 + 8 per count, 3 x 8 for the entry names
            dim = next(iter(u.get(PROTOTYPES).values())).numel()
            assert payload_nbytes(entries) == 3 * 8 + len(classes) * (8 + 4 * dim + 8 + 4 + 16)
    assert results["rounds"][-1]["plugin_metrics"]["fedspace"]["fedspace_bank_classes"] == len(
        {c for client in run.clients for t in client.tasks.classes for c in t}
    )


def test_bank_reaches_clients_only_when_it_changed(fedspace_run):
    results, probe = fedspace_run
    bank_bytes = [r["bytes_down"] for r in results["rounds"]]
    assert bank_bytes[0] < bank_bytes[1]  # round 2 carries the bank fused in round 1
    plugin = probe.run.plugins.objects["fedspace"]
    assert plugin.sent == {0: plugin.version - 1, 1: plugin.version - 1}  # last round's fusion not sent yet


def test_pseudo_feature_loss_from_the_second_stage_drawn_from_the_client_stream(fedspace_run, tiny_config):
    results, probe = fedspace_run
    for record in results["rounds"]:
        term = record["losses"].get("loss/fedspace_pseudo_ce")
        assert (term is None) if record["task"] == 0 else (term > 0)
    assert probe.draws and all(got == pytest.approx(want, rel=1e-5) for _, got, want in probe.draws)
    again = run_training(fcil_async_config(tiny_config, out=probe.run.out_dir.parent / "again"))
    assert [r["losses"] for r in again["rounds"]] == [r["losses"] for r in results["rounds"]]


def test_weight_zero_switches_the_augmentation_off(tiny_config):
    results = run_training(fcil_async_config(tiny_config, plugin_options={"fedspace": {"weight": 0.0}}))
    assert not any("loss/fedspace_pseudo_ce" in r["losses"] for r in results["rounds"])


@pytest.mark.parametrize(
    "scenario,options",
    [
        ("fcl-random", {"clients": 3, "min_tasks": 2, "max_tasks": 3}),
        ("fcil-sync", {"clients": 2, "tasks": 2}),
        ("sthfl", {"clients": 3, "tasks": 2}),
    ],
)
def test_runs_in_the_other_scenarios(tiny_config, scenario, options):
    results = run_training(
        tiny_config(plugins=[PLUGIN], scenario=scenario, scenario_options=options, rounds_per_task=1)
    )
    assert results["status"]["state"] == "complete"
    assert any("loss/fedspace_pseudo_ce" in r["losses"] for r in results["rounds"] if r["task"] > 0)


def test_bad_weight_is_a_one_line_error(tmp_path):
    from helpers import one_line_error

    line = one_line_error(["train", "--plugins", PLUGIN, "-o", "fedspace.weight=-1", "--out", str(tmp_path / "r")])
    assert "fedspace.weight" in line
