"""FediCaRL: iCaRL's maths against hand-computed values, and a digits run
showing each component take effect (herded memory through the training data,
constant memory size, distillation from the client's second task on against
the model it received, nearest-mean-of-exemplars client evaluation, the
global model's head over the taught classes)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.plugins.ficarl import MEMORY, TEACHER
from fedaval.plugins.ficarl_math import (
    classification_loss,
    distillation_loss,
    exemplar_means,
    herding_order,
    memory_quotas,
    nme_scores,
)
from fedaval.prototypes import taught_scores

T = torch.tensor
PLUGIN = "fedaval.plugins.ficarl:FediCaRL"


# --- the maths --------------------------------------------------------------

# four unit vectors, class mean (0.55, 0.25)
POINTS = T([[1.0, 0.0], [0.6, 0.8], [0.6, -0.8], [0.0, 1.0]])


def test_herding_order_by_hand():
    # step 1: |p - mu|^2 = .265, .305, 1.105, .865 -> p0
    # step 2: |(p0 + p)/2 - mu|^2 = .085 (p1), .485 (p2), .065 (p3) -> p3
    # step 3: |(p0 + p3 + p)/3 - mu|^2 = .1228 (p1), .0339 (p2) -> p2; then p1
    assert herding_order(POINTS, 4).tolist() == [0, 3, 2, 1]
    assert herding_order(POINTS, 2).tolist() == [0, 3]
    assert herding_order(POINTS * 5, 2).tolist() == [0, 3]  # features are normalised first
    assert herding_order(POINTS, 9).tolist() == [0, 3, 2, 1]  # a quota above the class keeps all
    assert herding_order(POINTS[:0], 3).tolist() == []


@pytest.mark.parametrize("count", [1, 7, 40, 300])
def test_herding_order_is_avalanches_order_cut_to_the_quota(count):
    """The loop is Avalanche's step for step (ties included: every row below
    is there twice), stopped after ``count`` steps."""
    from avalanche.training.storage_policy import HerdingSelectionStrategy

    from fedaval.plugins.ficarl_math import normalise

    g = torch.Generator().manual_seed(count)
    features = torch.randn(60, 16, generator=g).repeat(2, 1)
    reference = object.__new__(HerdingSelectionStrategy).make_sorted_indices_from_features(normalise(features).double())
    assert herding_order(features, count).tolist() == reference[:count]


def test_herding_takes_as_many_steps_as_the_quota():
    """Avalanche's loop orders every row: 1,667 steps a class at full scale
    for a quota of 250 (GPU session 26: GLFC's task ends took 85 to 206 s
    on a shared H200). Counted as the argmin calls of the greedy step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Argmins(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket == torch.ops.aten.argmin:
                Argmins.calls += 1
            return func(*args, **(kwargs or {}))

    with Argmins():
        order = herding_order(torch.randn(500, 8), 12)
    assert len(order) == 12 and len(set(order.tolist())) == 12
    assert Argmins.calls == 12


def test_herded_mean_is_closer_to_the_class_mean_than_random_subsets():
    mean = POINTS.mean(0)
    herded = POINTS[herding_order(POINTS, 2)].mean(0)  # (0.5, 0.5): error^2 .065
    # the two nearest to the mean (p0, p1) give (0.8, 0.4): error^2 .085
    assert (herded - mean).pow(2).sum().item() == pytest.approx(0.065)
    assert (POINTS[[0, 1]].mean(0) - mean).pow(2).sum().item() == pytest.approx(0.085)
    # on 200 random unit vectors, the 10 herded beat every one of 200 random subsets of 10
    g = torch.Generator().manual_seed(0)
    phi = torch.nn.functional.normalize(torch.randn(200, 8, generator=g) + 1.0, dim=1)
    target = phi.mean(0)
    herded_error = (phi[herding_order(phi, 10)].mean(0) - target).norm()
    random_errors = torch.stack(
        [(phi[torch.randperm(200, generator=g)[:10]].mean(0) - target).norm() for _ in range(200)]
    )
    assert herded_error < random_errors.min()


def test_memory_quotas_split_k_evenly_remainder_to_lowest_classes():
    assert memory_quotas(500, [3, 1, 2]) == {1: 167, 2: 167, 3: 166}
    assert memory_quotas(10, [0, 1, 2, 3]) == {0: 3, 1: 3, 2: 2, 3: 2}
    assert sum(memory_quotas(500, list(range(7))).values()) == 500
    assert memory_quotas(500, []) == {}


def test_exemplar_means_and_nearest_mean_by_hand():
    features = T([[3.0, 4.0], [0.0, 2.0], [2.0, 0.0]])
    means = exemplar_means(features, T([0, 0, 1]))
    # class 0: normalised (0.6, 0.8) and (0, 1) -> mean (0.3, 0.9) -> normalised (1, 3)/sqrt(10)
    assert torch.allclose(means[0], T([1.0, 3.0]) / math.sqrt(10))
    assert torch.allclose(means[1], T([1.0, 0.0]))
    scores = nme_scores(T([[0.0, 5.0], [1.0, 0.1]]), means, 3)
    # x = (0, 5) -> (0, 1): |(0,1) - mu0| = sqrt(0.1 + (1 - 3/sqrt(10))^2), |(0,1) - mu1| = sqrt(2)
    d0 = math.sqrt(0.1 + (1 - 3 / math.sqrt(10)) ** 2)
    assert scores[0, 0].item() == pytest.approx(-d0, abs=1e-6)
    assert scores[0, 1].item() == pytest.approx(-math.sqrt(2), abs=1e-6)
    assert scores[:, 2].tolist() == [-math.inf, -math.inf]  # no exemplars: never predicted
    assert scores.argmax(1).tolist() == [0, 1]


def test_sigmoid_losses_by_hand():
    logits = T([[0.0, math.log(3.0)]])
    # class 0 target 0: -log(1 - 1/2) = ln 2; class 1 target 1: -log(3/4)
    assert classification_loss(logits, T([1]), [0, 1]).item() == pytest.approx(math.log(2) + math.log(4 / 3))
    assert classification_loss(logits.repeat(2, 1), T([1, 1]), [0, 1]).item() == pytest.approx(math.log(8 / 3))
    assert classification_loss(logits, T([1]), [1]).item() == pytest.approx(math.log(4 / 3))  # only listed outputs
    # teacher says sigmoid = 3/4 for old class 0; student 1/2: -(3/4 ln 1/2 + 1/4 ln 1/2) = ln 2
    assert distillation_loss(T([[0.0, 5.0]]), T([[math.log(3.0), -7.0]]), [0]).item() == pytest.approx(math.log(2))
    assert distillation_loss(logits, logits, []).item() == 0.0


def test_losses_add_up_to_avalanche_icarl_loss_times_outputs():
    from avalanche.training.losses import ICaRLLossPlugin

    g = torch.Generator().manual_seed(1)
    logits, teacher = torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)
    labels = T([2, 3, 4, 2])
    avalanche = ICaRLLossPlugin()
    avalanche.old_classes, avalanche.old_logits = [0, 1], teacher
    expected = 5 * avalanche(logits, labels)  # Avalanche averages over the 5 outputs too
    ours = classification_loss(logits, labels, [2, 3, 4]) + distillation_loss(logits, teacher, [0, 1])
    assert ours.item() == pytest.approx(expected.item(), rel=1e-5)


def test_taught_scores_mask_untaught_outputs():
    out = taught_scores(T([[5.0, 1.0, 2.0]]), [1, 2])
    assert out.tolist() == [[-math.inf, 1.0, 2.0]]
    assert taught_scores(T([[5.0, 1.0]]), []).tolist() == [[5.0, 1.0]]


# --- a digits run -------------------------------------------------------------

K = 12


class Probe:
    """Records what the clients train on, the weights each receives, the
    model and memory at each task's end."""

    name = "ficarl-probe"

    def __init__(self):
        self.labels: dict[tuple[int, int], list[int]] = {}
        self.received: dict[tuple[int, int], dict] = {}
        self.at_end: dict[tuple[int, int], tuple] = {}
        self.memory: dict[tuple[int, int], dict] = {}

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.received[(client.id, run.round)] = {k: v.clone() for k, v in download["weights"].items()}

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        if run.round == run.now.first_round:  # one round per task below: every batch of the task
            self.labels.setdefault((client.id, client.task), []).extend(batch.y.tolist())

    @hookimpl(tryfirst=True)
    def fedaval_client_task_end(self, run, client, task):
        self.at_end[(client.id, task)] = copy.deepcopy(client.model.state_dict())

    @hookimpl(trylast=True)
    def fedaval_client_upload(self, run, client):
        if run.now.task_ends:
            self.memory[(client.id, client.task)] = {c: v.copy() for c, v in client.stash[MEMORY].items()}


@pytest.fixture(scope="module")
def ficarl_run(tmp_path_factory):
    from helpers import tiny_run_config

    probe = Probe()
    config = tiny_run_config(
        tmp_path_factory.mktemp("ficarl") / "run",
        plugins=[PLUGIN],
        plugin_options={"ficarl": {"memory_size": K}},
        scenario_options={"clients": 2, "tasks": 3, "alpha": 100.0},
        rounds_per_task=1,
        lr=0.1,
    )
    results = run_training(config, extra_plugins=[probe])
    return results, probe


def test_memory_is_herded_constant_and_split_over_seen_classes(ficarl_run):
    from fedaval.prototypes import extract_features
    from fedaval.streams import make_dataset

    results, probe = ficarl_run
    run = probe.run
    for (k, task), memory in probe.memory.items():
        client = run.clients[k]
        seen = sorted({c for t in range(task + 1) for c in client.tasks.classes[t]})
        quotas = memory_quotas(K, seen)
        assert sorted(memory) == seen
        assert {c: len(v) for c, v in memory.items()} == quotas  # K // classes each (alpha 100: enough samples)
        assert sum(len(v) for v in memory.values()) == K  # the size stays K, task after task
        # the task's classes: herding on the features of the model as the task ended
        model = copy.deepcopy(client.model)
        model.load_state_dict(probe.at_end[(k, task)])
        idx = client.tasks.indices[task]
        features, labels = extract_features(model, make_dataset(run.data, "train", idx), run.device)
        for c in client.tasks.classes[task]:
            rows = (labels == c).nonzero().flatten()
            assert memory[c].tolist() == idx[rows[herding_order(features[rows], quotas[c])].cpu().numpy()].tolist()
        # old classes keep the first of their earlier exemplars
        if task:
            before = probe.memory[(k, task - 1)]
            for c in before:
                if c not in client.tasks.classes[task]:
                    assert memory[c].tolist() == before[c][: quotas[c]].tolist()
    rounds = results["rounds"]
    assert [r["plugin_metrics"]["ficarl"]["ficarl_memory"] for r in rounds] == [K] * len(rounds)


def test_memory_reaches_the_training_batches(ficarl_run):
    _, probe = ficarl_run
    run = probe.run
    for (k, task), labels in probe.labels.items():
        client = run.clients[k]
        current = set(client.tasks.classes[task])
        old = [y for y in labels if y not in current]
        if task == 0:
            assert not old
        else:  # one local epoch: every exemplar of the previous task's memory, once
            memory = probe.memory[(k, task - 1)]
            expected = sorted(int(run.data.train_y[i]) for c in memory for i in memory[c] if c not in current)
            assert sorted(old) == expected


def test_distillation_from_the_second_task_against_the_received_model(ficarl_run):
    results, probe = ficarl_run
    for record in results["rounds"]:
        term = record["losses"].get("loss/ficarl_distillation")
        assert (term is None) if record["task"] == 0 else (term > 0)
    run = probe.run
    last = run.num_tasks - 1
    for client in run.clients:
        teacher, old = client.stash[TEACHER]
        assert old == sorted(
            {c for t in range(last) for c in client.tasks.classes[t]} - set(client.tasks.classes[last])
        )
        received = probe.received[(client.id, run.rounds_of_task(last)[0])]
        state = teacher.state_dict()
        assert all(torch.equal(state[key], value) for key, value in received.items())
        assert not any(p.requires_grad for p in teacher.parameters())


def test_clients_evaluated_by_nearest_mean_global_by_taught_head(ficarl_run):
    from fedaval.evaluation import STREAM_ACC, scalar
    from fedaval.prototypes import extract_features
    from fedaval.streams import make_dataset

    results, probe = ficarl_run
    run = probe.run
    for client in run.clients:
        memory = client.stash[MEMORY]
        idx = np.concatenate([memory[c] for c in sorted(memory)])
        feats, labels = extract_features(client.model, make_dataset(run.data, "train", idx), run.device)
        means = exemplar_means(feats, labels)
        correct = by_head = total = 0
        for t in client.tasks_started:
            exp = client.test_stream[t]
            if exp is None:
                continue
            f, y = extract_features(client.model, exp.dataset, run.device)
            correct += int((nme_scores(f, means, run.num_classes).argmax(1) == y).sum())
            by_head += int((client.model.classifier(f).argmax(1) == y).sum())
            total += len(y)
        nme, head = correct / total, by_head / total
        assert scalar(client.last_eval, STREAM_ACC) == pytest.approx(nme)
        assert nme != pytest.approx(head)  # the head's argmax over all outputs gives another figure
    taught = sorted({c for t in run.federation_task_classes() for c in t})
    correct = total = 0
    for exp in run.server.test_stream:
        if exp is None:
            continue
        f, y = extract_features(run.server.model, exp.dataset, run.device)
        correct += int((taught_scores(run.server.model.classifier(f), taught).argmax(1) == y).sum())
        total += len(y)
    assert results["rounds"][-1]["global_accuracy"] == pytest.approx(correct / total)


@pytest.mark.parametrize(
    "scenario,options",
    [
        ("fcil-async", {"clients": 2, "tasks": 2}),
        ("fcl-random", {"clients": 2, "min_tasks": 2, "max_tasks": 2}),
        ("sthfl", {"clients": 3, "tasks": 2}),
    ],
)
def test_runs_in_the_other_scenarios(tiny_config, scenario, options):
    results = run_training(
        tiny_config(
            plugins=[PLUGIN],
            plugin_options={"ficarl": {"memory_size": 20}},
            scenario=scenario,
            scenario_options=options,
            rounds_per_task=1,
        )
    )
    assert results["status"]["state"] == "complete"
    assert any("loss/ficarl_distillation" in r["losses"] for r in results["rounds"] if r["task"] > 0)


def test_bad_memory_size_is_a_one_line_error(tmp_path):
    from helpers import one_line_error

    line = one_line_error(["train", "--plugins", PLUGIN, "-o", "ficarl.memory_size=0", "--out", str(tmp_path / "r")])
    assert "ficarl.memory_size" in line


def test_ablations_switch_off_distillation_and_nme(tiny_config):
    from fedaval.evaluation import STREAM_ACC, scalar
    from fedaval.prototypes import extract_features

    probe = Probe()
    results = run_training(
        tiny_config(
            plugins=[PLUGIN],
            plugin_options={"ficarl": {"memory_size": 20, "distillation": False, "nme": False}},
            rounds_per_task=1,
        ),
        extra_plugins=[probe],
    )
    assert not any("loss/ficarl_distillation" in r["losses"] for r in results["rounds"])
    run = probe.run
    for client in run.clients:
        assert TEACHER not in client.stash
        correct = total = 0
        for t in client.tasks_started:  # the linear head over the client's seen classes
            f, y = extract_features(client.model, client.test_stream[t].dataset, run.device)
            correct += int((taught_scores(client.model.classifier(f), client.seen_classes()).argmax(1) == y).sum())
            total += len(y)
        assert scalar(client.last_eval, STREAM_ACC) == pytest.approx(correct / total)
