"""GLFC as a plugin: the code's compensated BCE (or the paper's compensated
CE) with an exemplar memory, distillation from the proxy's pick, entropy detection at task boundaries,
LeNet gradients up and the old model down, counted."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers import one_line_error

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.payload import payload_nbytes
from fedaval.plugins.glfc import GLFC, MEMORY, SETS, TEACHER, GLFCOptions
from fedaval.plugins.glfc_math import LeNet, compensated_bce

OPTIONS = {"inversion_steps": 3, "memory": "per-class", "memory_per_class": 4}


class Probe:
    """The run, the labels reaching each client's loss per task, and the
    global weights after every round."""

    name = "glfc-probe"

    def __init__(self):
        self.labels: dict[tuple[int, int], set[int]] = {}
        self.weights: dict[int, dict[str, torch.Tensor]] = {}

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.labels.setdefault((client.id, client.task), set()).update(batch.y.tolist())

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        self.weights[round] = {k: v.clone() for k, v in run.server.global_weights().items()}


class FirstRoundIsBest(GLFC):
    """The proxy scores the stage's first model best."""

    def proxy_accuracy(self, run, model):
        return 1.0 if not self.accuracies else 0.0


def glfc_run(tmp_path_factory, name, plugin, **options):
    from helpers import tiny_run_config

    probe = Probe()
    config = tiny_run_config(
        tmp_path_factory.mktemp(name) / "run",
        plugins=[plugin],
        plugin_options={"glfc": dict(OPTIONS, **options)},
        lr=0.1,
        local_epochs=2,  # digits' defaults: the global model learns each task (its entropy falls)
    )
    return run_training(config, extra_plugins=[probe]), probe


@pytest.fixture(scope="module")
def glfc(tmp_path_factory):
    return glfc_run(tmp_path_factory, "glfc", "fedaval.plugins.glfc:GLFC")


def metrics(results, round):
    return results["rounds"][round - 1]["plugin_metrics"]["glfc"]


def test_entropy_detection_fires_at_the_task_boundary(glfc):
    results, probe = glfc
    clients = len(probe.run.clients)
    assert metrics(results, 3)["glfc_detected_at_boundary"] == clients
    assert all(metrics(results, r)["glfc_detected"] == 0 for r in (1, 2, 4))
    assert metrics(results, 3)["glfc_mean_entropy_rise"] > 0.3
    assert all(metrics(results, r)["glfc_mean_entropy_rise"] == 0 for r in (1, 2, 4))


def test_bytes_up_include_one_lenet_gradient_per_new_class(glfc):
    results, probe = glfc
    run = probe.run
    lenet_bytes = sum(p.numel() * 4 for p in LeNet(run.data.input_shape, run.num_classes).parameters())
    up = {r["round"]: r["bytes_up"] for r in results["rounds"]}
    for first, later in ((1, 2), (3, 4)):
        task = first // 2
        new = [held(run, c, task) for c in run.clients]  # fcil-sync: a task's classes are all new
        assert up[first] - up[later] == sum(8 + n * (8 + lenet_bytes) for n in new)
    assert metrics(results, 1)["glfc_reconstructed"] == sum(held(run, c, 0) for c in run.clients)


def held(run, client, task):
    """How many classes of its task ``task`` the client holds samples of."""
    return len(set(run.data.train_y[client.tasks.indices[task]].tolist()))


def test_bytes_down_include_the_lenet_once_and_the_old_model_once_per_task(glfc):
    results, probe = glfc
    run = probe.run
    glfc_plugin = run.plugins.objects["glfc"]
    down = {r["round"]: r["bytes_down"] for r in results["rounds"]}
    clients = len(run.clients)
    assert down[1] - down[2] == clients * (8 + payload_nbytes(glfc_plugin.lenet))
    assert down[3] - down[4] == clients * (8 + payload_nbytes(glfc_plugin.old_state))


def test_the_proxys_pick_is_the_teacher_of_the_relation_distillation(glfc):
    results, probe = glfc
    run, plugin = probe.run, probe.run.plugins.objects["glfc"]
    picked = metrics(results, 2)["glfc_old_model_round"]
    assert picked in (1, 2) and plugin.old_round == metrics(results, 4)["glfc_old_model_round"] in (3, 4)
    for client in run.clients:
        task, teacher = client.stash[TEACHER]
        assert task == 1
        state = teacher.state_dict()
        assert all(torch.equal(state[k].cpu(), v.cpu()) for k, v in probe.weights[picked].items())
    for record in results["rounds"]:
        assert ("loss/glfc_relation" in record["losses"]) == (record["task"] >= 1)


def test_another_pick_changes_the_teacher(tmp_path_factory):
    results, probe = glfc_run(tmp_path_factory, "first", "test_glfc:FirstRoundIsBest")
    assert metrics(results, 2)["glfc_old_model_round"] == 1
    state = probe.run.clients[0].stash[TEACHER][1].state_dict()
    assert all(torch.equal(state[k], v) for k, v in probe.weights[1].items())
    assert not all(torch.equal(state[k], v) for k, v in probe.weights[2].items())


def test_the_memory_brings_old_classes_into_task_1_and_the_criterion_compensates(glfc):
    from fedaval.plugins.glfc_math import compensated_cross_entropy

    _, probe = glfc
    run, plugin = probe.run, probe.run.plugins.objects["glfc"]
    for client in run.clients:
        memory = client.stash[MEMORY]
        counts = [
            int((run.data.train_y[client.tasks.indices[t]] == c).sum()) for t in (0, 1) for c in client.tasks.classes[t]
        ]
        assert len(memory) == sum(min(4, n) for n in counts)  # 4 per class, all of a class with fewer
        assert set(client.tasks.classes[0]) <= probe.labels[(client.id, 1)]
    client = run.clients[0]
    old, new = client.tasks.classes[0][0], client.tasks.classes[1][0]
    logits, y = torch.randn(3, run.num_classes), torch.tensor([new, new, old])
    is_old = torch.tensor([False, False, True])
    # loss=code (the default), in task 1 with an old model: half the compensated BCE
    got = plugin.fedaval_client_criterion(run=run, client=client, logits=logits, y=y)
    assert got.item() == pytest.approx(0.5 * compensated_bce(logits, y, is_old).item())
    paper = GLFC(GLFCOptions(loss="paper"))
    got = paper.fedaval_client_criterion(run=run, client=client, logits=logits, y=y)
    assert got.item() == pytest.approx(compensated_cross_entropy(logits, y, is_old).item())
    assert (
        GLFC(GLFCOptions(loss="paper", compensation=False)).fedaval_client_criterion(
            run=run, client=client, logits=logits, y=y
        )
        is None
    )  # the core's cross-entropy
    got = GLFC(GLFCOptions(compensation=False)).fedaval_client_criterion(run=run, client=client, logits=logits, y=y)
    assert got.item() == pytest.approx(0.5 * compensated_bce(logits, y, None).item())
    # in its first task (no class of an earlier task, no old model) the code weighs every sample 1
    first = SimpleNamespace(task=0, tasks_started=[0], tasks=client.tasks, stash={})
    y0 = torch.tensor(client.tasks.classes[0][:2] * 2)
    logits0 = torch.randn(4, run.num_classes)
    got = plugin.fedaval_client_criterion(run=run, client=first, logits=logits0, y=y0)
    assert got.item() == pytest.approx(compensated_bce(logits0, y0, None).item())
    assert got.item() != pytest.approx(compensated_bce(logits0, y0, torch.zeros(4, dtype=torch.bool)).item())


def test_the_distillation_term_follows_the_loss_option(glfc):
    """loss=code: half the BCE towards the old model's sigmoids on the old
    classes; loss=paper: rd_weight x the KL among the old classes at T."""
    from fedaval.plugins.glfc_math import bce_distillation, relation_distillation
    from fedaval.strategy import Batch

    _, probe = glfc
    run, plugin = probe.run, probe.run.plugins.objects["glfc"]
    client = run.clients[0]
    teacher = client.stash[TEACHER][1]
    x = run.data.train_x[client.tasks.indices[1][:4]].to(run.device)
    y = run.data.train_y[client.tasks.indices[1][:4]].to(run.device)
    logits = torch.randn(4, run.num_classes)
    batch = Batch(x=x, y=y, features=logits, logits=logits, loss=torch.tensor(0.0))
    old = plugin.old_classes(run, 1)
    assert old == sorted(run.federation_task_classes()[0])
    with torch.no_grad():
        t_logits = teacher(x)
    got = plugin.fedaval_client_loss(run=run, client=client, batch=batch)["glfc_relation"]
    assert got.item() == pytest.approx(0.5 * bce_distillation(logits, t_logits, y, old).item())
    paper = GLFC(GLFCOptions(loss="paper", rd_weight=3.0, temperature=2.0))
    got = paper.fedaval_client_loss(run=run, client=client, batch=batch)["glfc_relation"]
    assert got.item() == pytest.approx(3.0 * relation_distillation(logits, t_logits, old, 2.0).item())


def test_the_codes_loss_keeps_the_first_task_better_than_the_papers(glfc, tmp_path_factory):
    """What made loss=code the default: the paper's KL among the old classes
    leaves the old classes' outputs free to fall below the new ones; the
    code's BCE keeps each at the old model's value (digits, same run)."""
    code, _ = glfc
    paper, _ = glfc_run(tmp_path_factory, "paper", "fedaval.plugins.glfc:GLFC", loss="paper")
    first = [r["final"]["accuracy_matrix"][-1][0] for r in (code, paper)]
    assert first[0] > first[1] + 0.1, first


def test_the_papers_options_are_refused_with_the_codes_loss(tmp_path):
    line = one_line_error(["train", "--plugins", "glfc", "-o", "glfc.rd_weight=2", "--out", str(tmp_path / "r")])
    assert line.startswith("fedaval: error: glfc.rd_weight applies to glfc.loss=paper only"), line
    assert not (tmp_path / "r" / "results.json").exists()


class SetsProbe:
    """After GLFC's task end: each client's exemplar sets, and the sets
    herding picks for the task's classes with the model as it is then."""

    name = "glfc-sets-probe"

    def __init__(self):
        self.sets: dict[tuple[int, int], dict] = {}
        self.herded: dict[tuple[int, int], dict] = {}

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run

    @hookimpl(trylast=True)
    def fedaval_client_task_end(self, run, client, task):
        from fedaval.plugins.ficarl_math import herd_classes, memory_quotas
        from fedaval.prototypes import extract_features
        from fedaval.streams import make_dataset

        indices = client.tasks.indices[task]
        features, labels = extract_features(client.model, make_dataset(run.data, "train", indices), run.device)
        quotas = memory_quotas(12, client.seen_classes())
        self.herded[client.id, task] = herd_classes(features, labels, indices, client.tasks.classes[task], quotas)
        self.sets[client.id, task] = dict(client.stash[SETS])


def test_the_default_memory_is_a_fixed_total_herded_and_cut_as_in_icarl(tmp_path_factory):
    """memory=total (GLFC's code): K exemplars per client split evenly over
    its seen classes; the task's classes herded, the old sets cut to their
    quota keeping the first ones."""
    from helpers import tiny_run_config

    from fedaval.plugins.ficarl_math import memory_quotas

    probe, sets = Probe(), SetsProbe()
    config = tiny_run_config(
        tmp_path_factory.mktemp("total") / "run",
        plugins=["glfc"],
        plugin_options={"glfc": {"inversion_steps": 3, "memory_size": 12}},
        scenario_options={"clients": 2, "tasks": 3},
        rounds_per_task=1,
    )
    run_training(config, extra_plugins=[probe, sets])
    run = sets.run
    for client in run.clients:
        seen: list[int] = []
        for task in range(3):
            seen += client.tasks.classes[task]
            got = sets.sets[client.id, task]
            quotas = memory_quotas(12, sorted(seen))
            held_ = {c: int((run.data.train_y[client.tasks.indices[task_of(client, c)]] == c).sum()) for c in seen}
            assert {c: len(idx) for c, idx in got.items()} == {
                c: min(q, held_[c]) for c, q in quotas.items() if held_[c]
            }
            for c, idx in got.items():
                assert (run.data.train_y[idx] == c).all() and set(idx) <= set(client.tasks.indices[task_of(client, c)])
                if c in client.tasks.classes[task]:
                    assert list(idx) == list(sets.herded[client.id, task][c])  # herded with the model of the task's end
                else:
                    assert list(idx) == list(sets.sets[client.id, task - 1][c][: len(idx)])  # cut: the first ones kept
        memory = client.stash[MEMORY]
        assert list(memory) == [i for c in sorted(got) for i in got[c]]
        assert set(client.tasks.classes[0]) | set(client.tasks.classes[1]) <= probe.labels[(client.id, 2)]


def task_of(client, c):
    return next(t for t, classes in enumerate(client.tasks.classes) if c in classes)


def test_bad_memory_option_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--plugins", "glfc", "-o", "glfc.memory=all", "--out", str(tmp_path / "r")])
    assert "glfc.memory" in line and "total|per-class|none" in line


def test_bad_teacher_option_is_a_one_line_error(tmp_path):
    line = one_line_error(
        ["train", "--plugins", "fedaval.plugins.glfc:GLFC", "-o", "glfc.teacher=worst", "--out", str(tmp_path / "r")]
    )
    assert "glfc.teacher" in line and "best|last" in line


@pytest.mark.filterwarnings("ignore:for .* copying from a non-meta parameter")
@pytest.mark.parametrize(("proxy_device", "expected"), [("cpu", "cpu"), ("run", "meta")])
def test_the_proxys_inversion_runs_where_proxy_device_says(monkeypatch, proxy_device, expected):
    """On a GPU shared by six full-scale runs the inversions of a task's
    first round took 75 to 142 s (session 26): by default they run on the
    CPU, whatever the run's device (here ``meta``, standing in for a GPU)."""
    from fedaval.plugins import glfc_math

    where = []

    def invert(lenet, gradient, label, shape, *args, **kwargs):
        where.append({next(lenet.parameters()).device.type, *(g.device.type for g in gradient)})
        return torch.zeros(*shape)

    monkeypatch.setattr(glfc_math, "invert_gradient", invert)
    plugin = GLFC(GLFCOptions(proxy_device=proxy_device))
    monkeypatch.setattr(plugin, "proxy_accuracy", lambda run, model: 0.5)
    plugin.lenet = LeNet((1, 8, 8), 4).state_dict()
    run = SimpleNamespace(
        device=torch.device("meta"),
        data=SimpleNamespace(input_shape=(1, 8, 8)),
        num_classes=4,
        config=SimpleNamespace(seed=0),
        server=SimpleNamespace(model=None, global_weights=lambda: {}),
    )
    gradient = [p.detach().clone() for p in LeNet((1, 8, 8), 4).parameters()]
    plugin.fedaval_server_fuse(run=run, uploads=[{"glfc_gradients": {2: gradient}}], round=1)
    assert where == [{expected}]
    assert plugin.reconstructed[0][1] == 2


def test_bad_proxy_device_option_is_a_one_line_error(tmp_path):
    line = one_line_error(["train", "--plugins", "glfc", "-o", "glfc.proxy_device=gpu", "--out", str(tmp_path / "r")])
    assert "glfc.proxy_device" in line and "cpu|run" in line
