"""PFCL as a plugin: prototype-only communication, replay memory in the
training batches, heterogeneous backbones, on fcl-random over digits."""

from __future__ import annotations

from collections import Counter

import pytest

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import FedavalUsageError
from fedaval.plugin import Plugin
from fedaval.plugins.pfcl import LOCAL, MEMORY, TEACHER

SCENARIO = {"clients": 2, "classes_per_task": 2, "min_tasks": 2, "max_tasks": 2}


class LabelProbe:
    """Records, per (client, task), the labels of the minibatches that reach
    the loss, and keeps a handle on the PFCL plugin."""

    name = "label-probe"

    def __init__(self):
        self.labels: dict[tuple[int, int], Counter] = {}
        self.pfcl = None

    @hookimpl
    def fedaval_setup(self, run):
        self.pfcl = run.plugins.objects["pfcl"]
        self.run = run

    def stash(self, k, key):
        return self.run.clients[k].stash.get(key)

    def memory_labels(self, k):
        return self.run.data.train_y[self.stash(k, MEMORY)]

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.labels.setdefault((client.id, client.task), Counter()).update(batch.y.tolist())


class SameCNN(Plugin):
    """FedAvg's clients get PFCL's model: the small CNN with 32-d features."""

    name = "same-cnn"

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import cnn

        return cnn(run.data.input_shape, run.num_classes, feature_dim=32)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from fedaval.config import RunConfig

    def config(plugins, options, name):
        return RunConfig(
            plugins=plugins,
            plugin_options=options,
            scenario="fcl-random",
            scenario_options=dict(SCENARIO),
            dataset="digits",
            rounds_per_task=1,
            local_epochs=1,
            batch_size=32,
            device="cpu",
            seed=0,
            out=str(tmp_path_factory.mktemp(name) / "run"),
        )

    probe = LabelProbe()
    pfcl = run_training(
        config(["pfcl"], {"pfcl": {"models": "cnn", "feature_dim": 32, "memory": "total", "memory_size": 8}}, "pfcl"),
        extra_plugins=[probe],
    )
    fedavg = run_training(config(["fedavg"], {}, "fedavg"), extra_plugins=[SameCNN()])
    mixed_probe = LabelProbe()
    mixed = run_training(
        config(
            ["pfcl"],
            {"pfcl": {"models": "mlp,cnn", "feature_dim": 16, "memory": "per-class", "memory_per_class": 3}},
            "mixed",
        ),
        extra_plugins=[mixed_probe],
    )
    return {"pfcl": (pfcl, probe), "fedavg": fedavg, "mixed": (mixed, mixed_probe)}


def test_prototypes_only_bytes_per_round_at_least_100x_below_fedavg(runs):
    pfcl, _ = runs["pfcl"]
    fedavg = runs["fedavg"]
    assert [r["clients"] for r in pfcl["rounds"]] == [r["clients"] for r in fedavg["rounds"]]
    for p, f in zip(pfcl["rounds"], fedavg["rounds"]):
        assert f["bytes_up"] >= 100 * p["bytes_up"], (p["round"], p["bytes_up"], f["bytes_up"])
        if p["round"] > 1:  # round 1's download is empty for PFCL
            assert f["bytes_down"] >= 100 * p["bytes_down"], (p["round"], p["bytes_down"], f["bytes_down"])
    # what goes up is one 32-d float prototype (+ 8-byte class key) per learned class, plus the
    # entry names "weights" (an empty dict) and "prototypes" and the sample count: 3 x 8 bytes per client
    _, probe = runs["pfcl"]
    first = pfcl["rounds"][0]
    classes = sum(len(pfcl["scenario"]["client_task_classes"][k][0]) for k in first["clients"])
    assert first["bytes_up"] == classes * (32 * 4 + 8) + 24 * len(first["clients"])


def test_server_library_keeps_every_class_ever_learned(runs):
    pfcl, probe = runs["pfcl"]
    taught = set()
    for record in pfcl["rounds"]:
        for k in record["clients"]:
            taught.update(pfcl["scenario"]["client_task_classes"][k][record["task"]])
        assert record["plugin_metrics"]["pfcl"]["pfcl_library_classes"] == len(taught)
    assert sorted(probe.pfcl.library) == sorted(taught)


def test_memory_fixed_total_policy_and_replay_in_training_batches(runs):
    pfcl, probe = runs["pfcl"]
    task_classes = pfcl["scenario"]["client_task_classes"]
    for k, tasks in enumerate(task_classes):
        seen = sorted(c for t in tasks for c in t)
        y = probe.memory_labels(k)
        counts = Counter(y.tolist())
        assert sorted(counts) == seen
        assert set(counts.values()) == {8 // len(seen)}  # equal share of the fixed total
        # from the second task on, the old classes come back through the memory
        for t in range(1, len(tasks)):
            trained = set(probe.labels[(k, t)])
            old = {c for s in tasks[:t] for c in s}
            assert trained == set(tasks[t]) | old


def test_memory_per_class_policy_and_heterogeneous_backbones(runs):
    from torch import nn

    mixed, probe = runs["mixed"]
    task_classes = mixed["scenario"]["client_task_classes"]
    for k, tasks in enumerate(task_classes):
        y = probe.memory_labels(k)
        assert Counter(y.tolist()) == Counter({c: 3 for t in tasks for c in t})
        # exemplars are the client's own training samples
        assert set(probe.stash(k, MEMORY).tolist()) <= {
            int(i) for t in range(len(tasks)) for i in probe.run.partition.clients[k].indices[t]
        }
    # client 0 got the MLP, client 1 the CNN, both with 16-d prototypes
    libraries = [probe.stash(k, LOCAL) for k in (0, 1)]
    assert libraries[0] and all(p.shape == (16,) for lib in libraries for p in lib.values())
    assert mixed["final"] is not None
    # teachers are frozen snapshots, one per client that finished a task
    teachers = {k: probe.stash(k, TEACHER) for k in (0, 1)}
    assert all(t is not None for t in teachers.values())
    assert not any(p.requires_grad for model, _ in teachers.values() for p in model.parameters())
    # both backbones learn: every client's nearest-prototype accuracy is far above chance
    accuracy = mixed["rounds"][-1]["client_accuracy"]
    assert all(v > 0.6 for v in accuracy.values()), accuracy
    assert mixed["rounds"][-1]["bytes_up"] < 2000
    kinds = {k: any(isinstance(m, nn.Conv2d) for m in teachers[k][0].modules()) for k in (0, 1)}
    assert kinds == {0: False, 1: True}


def test_losses_logged_by_name(runs):
    pfcl, _ = runs["pfcl"]
    later = [r for r in pfcl["rounds"] if r["task"] >= 1]
    assert all("loss/pfcl_distillation" in r["losses"] for r in later)
    assert any("loss/pfcl_prototype" in r["losses"] for r in pfcl["rounds"])
    assert all("loss/pfcl_distillation" not in r["losses"] for r in pfcl["rounds"] if r["task"] == 0)


def test_bad_options_are_one_line_errors(tiny_config):
    with pytest.raises(FedavalUsageError, match="pfcl.models='transformer'"):
        run_training(tiny_config(plugins=["pfcl"], plugin_options={"pfcl": {"models": "transformer"}}))
    with pytest.raises(FedavalUsageError, match="unknown option pfcl.memroy"):
        run_training(tiny_config(plugins=["pfcl"], plugin_options={"pfcl": {"memroy": "none"}}))
    with pytest.raises(FedavalUsageError, match="pfcl.feature_dim"):
        run_training(tiny_config(plugins=["pfcl"], plugin_options={"pfcl": {"models": "mlp,cnn"}}))
    with pytest.raises(FedavalUsageError, match="pfcl.memory"):
        run_training(tiny_config(plugins=["pfcl"], plugin_options={"pfcl": {"memory": "all"}}))


def test_one_temperature_for_the_classifier_and_the_distillation():
    """The paper writes one T: the classifier's distances are divided by the
    same ``temperature`` as the distillation's (before: a separate
    ``classifier_temperature`` of 1.0, so T = 2 reached only L_D)."""
    from types import SimpleNamespace

    import torch

    from fedaval.options import build_options
    from fedaval.plugins.pfcl import PFCL
    from fedaval.plugins.pfcl_math import library_logits
    from fedaval.stash import Stash

    plugin = PFCL(build_options(PFCL.Options, {"temperature": "3"}, owner="pfcl"))
    client = SimpleNamespace(stash=Stash())
    client.stash[LOCAL] = {0: torch.tensor([0.0, 0.0]), 2: torch.tensor([3.0, 4.0])}
    features = torch.tensor([[0.0, 0.0]])
    logits = plugin.fedaval_classify(
        run=SimpleNamespace(num_classes=3), client=client, model=None, features=features, training=True
    )
    assert torch.allclose(logits, library_logits(features, client.stash[LOCAL], 3, 3.0))
    assert logits[0, 2].item() == pytest.approx(-5.0 / 3)
    assert PFCL().options.temperature == 2.0
    with pytest.raises(FedavalUsageError, match="classifier_temperature"):
        build_options(PFCL.Options, {"classifier_temperature": "1"}, owner="pfcl")


# --- how much L_D can pass on: the teacher's soft labels' entropy ---------------------


def test_normalised_entropy_is_one_for_uniform_and_zero_for_one_hot_labels():
    import math

    import torch

    from fedaval.plugins.pfcl_math import normalised_entropy, teacher_soft_labels

    assert normalised_entropy(torch.full((3, 4), 0.25)).item() == pytest.approx(1.0)
    assert normalised_entropy(torch.eye(4)).item() == pytest.approx(0.0, abs=1e-6)
    assert normalised_entropy(torch.ones(2, 1)).item() == 0.0
    two = torch.tensor([[0.9, 0.1]])
    assert normalised_entropy(two).item() == pytest.approx(-(0.9 * math.log(0.9) + 0.1 * math.log(0.1)) / math.log(2))
    # features and prototypes within 0.1 of each other: at T = 2 the soft labels are near uniform,
    # at T = 0.01 they are not
    torch.manual_seed(0)
    prototypes = 0.05 * torch.randn(5, 16)
    features = prototypes[torch.tensor([0, 1, 2, 3, 4, 0])] + 0.01 * torch.randn(6, 16)
    assert normalised_entropy(teacher_soft_labels(features, prototypes, 2.0)) > 0.99
    assert normalised_entropy(teacher_soft_labels(features, prototypes, 0.01)) < 0.5


@pytest.mark.parametrize("temperature, flat", [(2.0, True), (0.05, False)])
def test_the_teachers_entropy_is_reported_and_a_near_uniform_teacher_is_said(tiny_config, caplog, temperature, flat):
    """pfcl/teacher_entropy is in every round in which L_D acts (from the second
    task on); a near-uniform teacher (digits' small MLP features at the paper's
    T = 2) is said once, in a warning; a sharper T gives informative soft labels."""
    import logging

    config = tiny_config(
        plugins=["pfcl"],
        scenario_options={"clients": 2, "tasks": 3},
        plugin_options={"pfcl": {"temperature": temperature}},
    )
    with caplog.at_level(logging.WARNING, logger="fedaval"):
        results = run_training(config)
    entropies = [r["losses"].get("pfcl/teacher_entropy") for r in results["rounds"]]
    assert entropies[:2] == [None, None]  # task 0: no teacher yet
    assert all(e is not None and 0 < e <= 1 for e in entropies[2:])
    warnings = [m for m in caplog.messages if "teacher's soft labels were near uniform" in m]
    if flat:
        assert min(entropies[2:]) > 0.99 and len(warnings) == 1
    else:
        assert max(entropies[2:]) < 0.5 and not warnings
    off = run_training(tiny_config(plugins=["pfcl"], plugin_options={"pfcl": {"alpha": 0}}, out=config.out + "-nold"))
    assert all("pfcl/teacher_entropy" not in r["losses"] for r in off["rounds"])
