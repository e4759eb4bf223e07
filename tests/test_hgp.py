"""HGP as a plugin: frozen backbone, prompts and classifier shared, class
Gaussians uploaded, server classifier re-balanced. Digits with a tiny ViT,
and the CIFAR-10 subset of tests/data with the pre-trained EfficientNet-Lite0."""

from __future__ import annotations

import warnings

import pytest
import torch

from fedaval import hookimpl
from fedaval.build import build_run
from fedaval.coordinator import run_round
from fedaval.errors import FedavalUsageError
from fedaval.plugins.fedavg import weighted_average
from fedaval.plugins.hgp import STATS, client_features

pytestmark = pytest.mark.slow  # whole trainings

TINY = {"vit_patch": 4, "vit_dim": 32, "vit_depth": 2, "vit_heads": 2, "vit_mlp_dim": 64, "prompt_length": 3}
PROMPTS_AND_HEAD = ["features.prompt_k", "features.prompt_v", "classifier.weight", "classifier.bias"]


class UploadProbe:
    """Records the uploads and the global classifier right after FedAvg,
    before HGP's re-balancing (``tryfirst``)."""

    def __init__(self):
        self.uploads = []
        self.after_fedavg = None

    @hookimpl(tryfirst=True)
    def fedaval_server_fuse(self, run, uploads, round):
        self.uploads = uploads
        self.after_fedavg = {k: v.clone() for k, v in run.server.model.classifier.state_dict().items()}


def make_run(tiny_config, probe=None, expect_warning=True, **hgp):
    config = tiny_config(plugins=["hgp"], plugin_options={"hgp": {**TINY, **hgp}}, rounds_per_task=1, lr=0.05)
    extra = [probe] if probe else []
    if expect_warning:
        with pytest.warns(UserWarning, match="randomly initialised"):
            return build_run(config, extra_plugins=extra)
    return build_run(config, extra_plugins=extra)


def play(run, rounds):
    for round in rounds:
        run.task = (round - 1) // run.config.rounds_per_task
        if round == run.rounds_of_task(run.task)[0]:
            run.server.begin_task(run.task)
        run_round(run, round)


def test_backbone_frozen_prompts_train_uploads_and_rebalancing(tiny_config):
    probe = UploadProbe()
    run = make_run(tiny_config, probe)
    client = run.clients[0]
    vit_before = {k: v.clone() for k, v in client.model.features.vit.state_dict().items()}
    prompts_before = client.model.features.prompt_k.detach().clone()
    assert client.shared_keys == PROMPTS_AND_HEAD
    assert run.server.shared_keys == PROMPTS_AND_HEAD

    play(run, [1])

    # the backbone did not move; the prompts did
    for key, value in client.model.features.vit.state_dict().items():
        assert torch.equal(value, vit_before[key]), key
    assert not torch.equal(client.model.features.prompt_k, prompts_before)
    assert not client.model.features.vit.training  # no dropout in the frozen part

    # uploads: prompts and classifier only, plus the class Gaussians of the task's classes
    up = next(u for u in probe.uploads if u.client_id == 0)
    assert sorted(up.get("weights")) == sorted(PROMPTS_AND_HEAD)
    gaussians = up.get("hgp_gaussians")
    assert sorted(gaussians) == sorted(client.tasks.classes[0])
    feats, labels = client_features(run, client)
    for c, g in gaussians.items():
        rows = feats[labels == c]
        assert g["count"] == len(rows) == int((torch.as_tensor(client.train_stream[0].dataset.targets) == c).sum())
        assert torch.allclose(g["mean"], rows.mean(0), atol=1e-5)
        expected = torch.cov(rows.T) if len(rows) > 1 else torch.zeros(32, 32)  # one sample: zero covariance
        assert torch.allclose(g["cov"], expected, atol=1e-4)
        assert g["cov"].shape == (32, 32)

    # the server's classifier was FedAvg-ed, then re-balanced (so it differs from the average)
    fedavg = weighted_average([u.get("weights") for u in probe.uploads], [u.num_samples for u in probe.uploads])
    assert torch.allclose(probe.after_fedavg["weight"], fedavg["classifier.weight"])
    assert not torch.allclose(run.server.model.classifier.weight, fedavg["classifier.weight"])
    # ... and reaches the clients with the next download
    assert torch.equal(run.server.download()["weights"]["classifier.weight"], run.server.model.classifier.weight)

    # the server remembers the Gaussians of earlier tasks' classes
    play(run, [2])
    seen = {c for k in run.clients for t in (0, 1) for c in k.tasks.classes[t]}
    hgp = run.plugins.objects["hgp"]
    assert set(hgp.memory) == seen
    # with stats_classes=task (the default) nothing is re-sent later, so no client keeps its Gaussians
    assert all(STATS not in k.stash for k in run.clients)
    assert set(probe.uploads[0].get("hgp_gaussians")) == set(run.clients[probe.uploads[0].client_id].tasks.classes[1])


def test_without_rebalancing_the_global_classifier_is_plain_fedavg_and_diag_is_uploaded(tiny_config):
    probe = UploadProbe()
    run = make_run(tiny_config, probe, rebalance=False, covariance="diag", stats_classes="seen")
    play(run, [1, 2])
    fedavg = weighted_average([u.get("weights") for u in probe.uploads], [u.num_samples for u in probe.uploads])
    assert torch.allclose(run.server.model.classifier.weight, fedavg["classifier.weight"])
    up = probe.uploads[0]
    gaussians = up.get("hgp_gaussians")
    client = run.clients[up.client_id]
    # stats_classes=seen: the client re-sends its task-0 classes too
    assert set(gaussians) == set(client.tasks.classes[0]) | set(client.tasks.classes[1])
    assert all(g["cov"].shape == (32,) for g in gaussians.values())


def test_weights_option_loads_a_checkpoint_without_warning(tiny_config, tmp_path):
    run = make_run(tiny_config)
    path = tmp_path / "vit.pt"
    state = run.server.model.features.vit.state_dict()
    state["heads.weight"] = torch.zeros(3, 32)  # a head in the checkpoint is ignored
    torch.save(state, path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(123)
        other = make_run(tiny_config, expect_warning=False, weights=str(path))
    assert not [w for w in caught if "randomly initialised" in str(w.message)]
    for key, value in other.server.model.features.vit.state_dict().items():
        assert torch.equal(value, state[key]), key
    with pytest.raises(FedavalUsageError, match="hgp.weights"):
        make_run(tiny_config, expect_warning=False, weights=str(tmp_path / "missing.pt"))
    # files that are not the backbone's weights: one-line errors, not tracebacks
    (tmp_path / "text.pt").write_text("root:x:0:0:root:/root:/bin/bash\n")
    torch.save([1, 2], tmp_path / "list.pt")
    torch.save({"other.weight": torch.zeros(2)}, tmp_path / "keys.pt")
    for name, message in [("text", "not a weights file"), ("list", "holds no state dict"), ("keys", "does not fit")]:
        with pytest.raises(FedavalUsageError, match=message) as info:
            make_run(tiny_config, expect_warning=False, weights=str(tmp_path / f"{name}.pt"))
        assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"covariance": "spherical"}, "hgp.covariance"),
        ({"vit_patch": 3}, "patch"),
        ({"vit_heads": 5}, "heads"),
        ({"synthetic_per_class": 0}, "hgp.synthetic_per_class"),
    ],
)
def test_bad_options_are_one_line_errors(tiny_config, options, message):
    with pytest.raises(FedavalUsageError, match=message) as info:
        make_run(tiny_config, expect_warning=False, **options)
    assert "\n" not in str(info.value)


def test_pretrained_efficientnet_backbone_on_cifar10(tiny_config, cifar10_root):
    from fedaval.plugins.hgp_backbones import (
        HALF,
        InputAdapter,
        efficientnet_lite0_weights,
    )

    # the adapter undoes the dataset normalisation and scales to [-1, 1]
    adapter = InputAdapter((0.5, 0.4, 0.3), (0.2, 0.2, 0.25), HALF, HALF, 4)
    pixels = torch.rand(2, 3, 4, 4)
    normalised = (pixels - torch.tensor([0.5, 0.4, 0.3]).view(1, 3, 1, 1)) / torch.tensor([0.2, 0.2, 0.25]).view(
        1, 3, 1, 1
    )
    assert torch.allclose(adapter(normalised), pixels * 2 - 1, atol=1e-6)

    probe = UploadProbe()
    config = tiny_config(
        plugins=["hgp"],
        dataset="imagefolder",
        data_root=str(cifar10_root),
        rounds_per_task=1,
        lr=0.05,
        augment="none",  # the feature cache serves un-augmented images only
        plugin_options={
            "hgp": {
                "backbone": "efficientnet-lite0",
                "image_size": 32,
                "covariance": "diag",
                "synthetic_per_class": 32,
                "rebalance_epochs": 1,
            }
        },
    )
    run = build_run(config, extra_plugins=[probe])
    model = run.clients[0].model
    cache = model.features
    net = cache.backbone.net
    # real ImageNet weights, frozen and shared by every model of the run
    packaged = torch.load(efficientnet_lite0_weights(), map_location="cpu", weights_only=True)
    assert torch.equal(net._conv_stem.weight.cpu(), packaged["_conv_stem.weight"])
    assert run.server.model.features is cache
    assert run.clients[0].shared_keys == ["classifier.weight", "classifier.bias"]
    before = {k: v.clone() for k, v in net.state_dict().items()}

    model.train()
    assert not net.training  # batch-norm statistics stay the ImageNet ones
    play(run, [1])
    for key, value in net.state_dict().items():
        assert torch.equal(value, before[key]), key
    up = probe.uploads[0]
    assert sorted(up.get("weights")) == ["classifier.bias", "classifier.weight"]
    assert all(g["mean"].shape == (1280,) for g in up.get("hgp_gaussians").values())
    assert cache.hits > 0  # the statistics pass re-used the training pass's features
    hits = cache.hits
    features = cache(run.clients[0].train_stream[0].dataset[0][0].unsqueeze(0))
    assert cache.hits == hits + 1 and features.shape == (1, 1280)


def test_augmentation_turns_the_feature_cache_off_and_says_so(tiny_config, cifar10_root, caplog):
    """With --augment standard every training image is new each epoch: a
    cache keyed on image bytes would only miss and grow (it grew to every
    augmented image of the run before), so HGP encodes without it."""
    from fedaval.plugins.hgp_backbones import FeatureCache

    config = tiny_config(
        plugins=["hgp"],
        dataset="imagefolder",
        data_root=str(cifar10_root),
        augment="standard",
        plugin_options={"hgp": {"backbone": "efficientnet-lite0", "image_size": 32, "covariance": "diag"}},
    )
    with caplog.at_level("WARNING", logger="fedaval"):
        run = build_run(config)
    assert not isinstance(run.clients[0].model.features, FeatureCache)
    assert "feature cache is off" in caplog.text


@pytest.mark.parametrize("exchange", [True, False])
def test_statistics_at_task_end_are_in_the_global_models_feature_space(tiny_config, exchange):
    """After a task's last fusion the server's Gaussians of that task's classes
    are those of the clients' data under the fused prompts (what the
    re-balanced classifier serves), not under each client's own prompts.
    Measured without the exchange (before): means 0.8 to 1.4% of their
    length away from the global model's class means after one round of
    local training; with it: equal."""
    from fedaval.plugins.hgp import model_features
    from fedaval.plugins.hgp_gaussian import class_gaussians
    from fedaval.streams import make_dataset

    run = make_run(tiny_config, stats_exchange=exchange)
    play(run, [1])
    hgp = run.plugins.objects["hgp"]
    gaps = []
    for client in run.clients:
        dataset = make_dataset(run.data, "train", client.tasks.indices[0])
        expected = class_gaussians(*model_features(run, run.server.model, dataset))
        for c, g in expected.items():
            stored = hgp.memory[c][client.id]
            assert stored.count == g.count
            gaps.append(float((stored.mean - g.mean).norm() / g.mean.norm()))
    if exchange:
        assert max(gaps) < 1e-5, gaps
        down, up = hgp.exchange_bytes
        assert down > 0 and up > 0
    else:
        assert min(gaps) > 1e-3, gaps


def test_with_seen_classes_the_exchange_statistics_are_what_clients_resend(tiny_config):
    """stats_classes=seen: the server rebuilds its memory every round from what
    clients re-send. After the task-end exchange the client keeps the
    exchange's Gaussians (under the fused prompts) and re-sends those; before
    session 20 it re-sent its own last upload's (under its local prompts), so
    from the next round on the exchange was undone for every earlier class."""
    from fedaval.plugins.hgp import model_features
    from fedaval.plugins.hgp_gaussian import class_gaussians
    from fedaval.streams import make_dataset

    run = make_run(tiny_config, stats_classes="seen")
    play(run, [1])
    expected = {}
    for client in run.clients:
        dataset = make_dataset(run.data, "train", client.tasks.indices[0])
        expected[client.id] = class_gaussians(*model_features(run, run.server.model, dataset))
    play(run, [2])  # task 1: the memory is rebuilt from the uploads
    hgp = run.plugins.objects["hgp"]
    checked = 0
    for client in run.clients:
        for c, g in expected[client.id].items():
            if c in client.tasks.classes[1]:
                continue  # re-measured by task 1's exchange
            stored = hgp.memory[c][client.id]
            assert stored.count == g.count
            assert torch.allclose(stored.mean, g.mean, atol=1e-6) and torch.allclose(stored.cov, g.cov, atol=1e-6)
            checked += 1
    assert checked


def test_the_feature_cache_keeps_fp32_features_whatever_autocast_is_on():
    """Under --precision bf16 (autocast) the frozen backbone's cached features
    are the fp32 ones, so HGP's statistics and a later fp32 pass read fp32."""
    from fedaval.plugins.hgp_backbones import FeatureCache

    torch.manual_seed(0)
    backbone = torch.nn.Linear(12, 8)
    backbone.feature_dim = 8
    x = torch.randn(5, 12)
    with torch.no_grad():
        exact = backbone(x)
    cache = FeatureCache(backbone)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under_bf16 = cache(x)
    assert under_bf16.dtype == torch.float32 and torch.equal(under_bf16, exact)
    again = cache(x)  # served from the cache, in fp32
    assert cache.hits == 5 and again.dtype == torch.float32 and torch.equal(again, exact)


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_offloaded_clients_share_the_frozen_backbone_when_they_come_back(tiny_config, tmp_path, where):
    """An offloaded client refers to the plugin's frozen backbone by name: it
    comes back sharing the one module, and its pickle holds no copy of it."""
    config = tiny_config(
        plugins=["hgp"],
        plugin_options={"hgp": {**TINY, "vit_dim": 64, "vit_depth": 4, "vit_mlp_dim": 256}},  # the backbone dominates
        scenario_options={"clients": 4, "tasks": 2},
        clients_per_round=1,
        offload_clients=where,
        out=str(tmp_path / "run"),
    )
    with pytest.warns(UserWarning, match="randomly initialised"):
        run = build_run(config, out_dir=tmp_path / "run")
    backbone = run.plugins.objects["hgp"]._backbone
    backbone_bytes = sum(t.numel() * t.element_size() for t in backbone.state_dict().values())
    client = run.clients[0]
    assert client.offloaded and client.stored_nbytes < backbone_bytes  # model, strategy and all, without it
    assert client.model.features.vit is backbone
    run.server.begin_task(0)
    play(run, [1])
    assert all(c.model.features.vit is backbone for c in run.clients)
