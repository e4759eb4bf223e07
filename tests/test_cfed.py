"""CFeD as a plugin: its authors' code (the defaults: learners only learn,
reviewers distil the old model on surrogate data over every logit, no server
distillation), the earlier reading through the options (learners distil too,
over the old classes, and the server distils the client ensemble), and the
surrogate option's one-line errors."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import one_line_error, tiny_run_config

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.plugins.cfed import REVIEW, TEACHER

pytestmark = pytest.mark.slow

CFED = "fedaval.plugins.cfed:CFeD"


class ClientProbe:
    name = "cfed-client-probe"

    def __init__(self):
        self.role = {}  # (client, round) -> reviews?
        self.ce = {}  # (client, round) -> classification losses of its minibatches
        self.teacher = {}  # (client, round) -> copy of the teacher's state

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run
        self.cfed = run.plugins.objects["cfed"]

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            self.role[(client.id, run.round)] = client.stash.get(REVIEW)
            teacher = client.stash.get(TEACHER)
            if teacher is not None:
                self.teacher[(client.id, run.round)] = copy.deepcopy(teacher[0].state_dict())

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        self.ce.setdefault((client.id, run.round), []).append(batch.loss.item())


class BeforeFuse:
    """The global model as FedAvg left it, before CFeD's server distillation."""

    name = "cfed-before-fuse"

    def __init__(self):
        self.state = {}

    @hookimpl(tryfirst=True)
    def fedaval_server_fuse(self, run, uploads, round):
        self.state[round] = copy.deepcopy(run.server.model.state_dict())


class AfterFuse:
    name = "cfed-after-fuse"

    def __init__(self):
        self.state = {}

    @hookimpl(trylast=True)
    def fedaval_server_fuse(self, run, uploads, round):
        self.state[round] = copy.deepcopy(run.server.model.state_dict())


# the reading before CFeD followed its authors' code (the paper's: learners distil too, over the old
# classes, and the server distils the client ensemble); the same gradients as then
EARLIER = {"review_fraction": 0.3, "kd_weight": 4.0, "review_weight": 4.0, "distil_classes": "old", "server_epochs": 1}


def cfed_training(tmp_path_factory, **options):
    from conftest import CIFAR10_SUBSET

    probes = ClientProbe(), BeforeFuse(), AfterFuse()
    config = tiny_run_config(
        tmp_path_factory.mktemp("cfed") / "run",
        plugins=[CFED],
        scenario_options={"clients": 3, "tasks": 2},
        plugin_options={
            "cfed": {
                "surrogate": "imagefolder",
                "surrogate_root": str(CIFAR10_SUBSET),
                "surrogate_samples": 200,
                **options,
            }
        },
    )
    return run_training(config, extra_plugins=list(probes)), probes


@pytest.fixture(scope="module")
def cfed_run(tmp_path_factory):
    return cfed_training(tmp_path_factory, **EARLIER)


@pytest.fixture(scope="module")
def code_run(tmp_path_factory):
    """CFeD with its defaults: its authors' code."""
    return cfed_training(tmp_path_factory)


def test_the_codes_learners_only_learn_and_the_server_only_averages(code_run):
    results, (probe, before, after) = code_run
    for round in (3, 4):
        reviewers = [k for k in range(3) if probe.role[(k, round)]]
        assert len(reviewers) == 1  # round(0.4 * 3)
        losses = results["rounds"][round - 1]["losses"]
        assert "loss/cfed_kd" not in losses and "loss/cfed_review" in losses
        for k in set(range(3)) - set(reviewers):
            assert all(v > 0.0 for v in probe.ce[(k, round)])
    assert results["rounds"][3]["losses"]["loss/cfed_review"] > 0
    for round in range(1, 5):  # no server distillation: the global model is FedAvg's
        assert all(torch.equal(v, after.state[round][k]) for k, v in before.state[round].items())
        assert "cfed_server_kd_loss" not in results["rounds"][round - 1].get("plugin_metrics", {}).get("cfed", {})


@pytest.mark.parametrize(("classes", "columns"), [("all", None), ("old", [0, 1])])
def test_a_reviewers_loss_is_the_weighted_soft_cross_entropy(classes, columns):
    """``fedaval_client_loss`` of a reviewer: ``review_weight`` times the code's
    soft cross-entropy between the old model and the client on a surrogate
    minibatch from the client's shard, over every logit or the old classes'."""
    from types import SimpleNamespace

    from fedaval.plugins.cfed import CFeD
    from fedaval.plugins.cfed_math import soft_cross_entropy

    plugin = CFeD(CFeD.Options(surrogate="digits", review_weight=0.1, distil_classes=classes))
    plugin.surrogate, plugin.shards = torch.randn(12, 4), 3
    torch.manual_seed(0)
    student, teacher = torch.nn.Linear(4, 5), torch.nn.Linear(4, 5)
    client = SimpleNamespace(id=1, model=student, stash={REVIEW: True, TEACHER: (teacher, [0, 1])})
    batch = SimpleNamespace(x=torch.zeros(3, 4))
    torch.manual_seed(9)
    out = plugin.fedaval_client_loss(run=None, client=client, batch=batch)
    torch.manual_seed(9)
    xs = plugin.shard(1)[torch.randint(4, (3,))]
    expected = 0.1 * soft_cross_entropy(student(xs), teacher(xs), columns, 2.0)
    assert set(out) == {"cfed_review"} and torch.allclose(out["cfed_review"], expected)
    client.stash[REVIEW] = False  # a learner: kd_weight 0, nothing
    assert plugin.fedaval_client_loss(run=None, client=client, batch=batch) is None


def test_clients_split_into_learners_and_reviewers_from_the_second_task(cfed_run):
    results, (probe, _, _) = cfed_run
    for round in (1, 2):  # first task: nothing to review
        assert all(not probe.role[(k, round)] for k in range(3))
        assert (
            "cfed" not in results["rounds"][round - 1]["plugin_metrics"]
            or "cfed_reviewers" not in results["rounds"][round - 1]["plugin_metrics"]["cfed"]
        )
        assert "loss/cfed_kd" not in results["rounds"][round - 1]["losses"]
    for round in (3, 4):
        reviewers = [k for k in range(3) if probe.role[(k, round)]]
        assert len(reviewers) == 1  # round(0.3 * 3)
        assert probe.cfed.split is not None
        assert results["rounds"][round - 1]["plugin_metrics"]["cfed"]["cfed_reviewers"] == 1.0
        for k in range(3):
            ce = probe.ce[(k, round)]
            if k in reviewers:
                assert all(v == 0.0 for v in ce)  # a reviewer does not learn its task data
            else:
                assert all(v > 0.0 for v in ce)
        assert "loss/cfed_kd" in results["rounds"][round - 1]["losses"]
        assert "loss/cfed_review" in results["rounds"][round - 1]["losses"]
    # in the task's first round the clients are the old model (nothing to distil yet); in its
    # second they have moved away, and both distillation terms pull them back
    assert results["rounds"][3]["losses"]["loss/cfed_review"] > 1e-6
    assert results["rounds"][3]["losses"]["loss/cfed_kd"] > 1e-6


def test_old_model_is_the_global_model_at_the_previous_stage_end(cfed_run):
    _, (probe, _, after) = cfed_run
    end_of_task0 = after.state[2]
    for k in range(3):
        teacher = probe.teacher[(k, 3)]
        for key, value in teacher.items():
            if value.is_floating_point():
                assert torch.equal(value, end_of_task0[key]), key
        assert (k, 1) not in probe.teacher  # no teacher in the first task


def test_server_distillation_changes_the_global_model(cfed_run):
    results, (_, before, after) = cfed_run
    for round in range(1, 5):
        changed = [k for k, v in before.state[round].items() if not torch.equal(v, after.state[round][k])]
        assert changed, round
        assert results["rounds"][round - 1]["plugin_metrics"]["cfed"]["cfed_server_kd_loss"] >= 0


def test_surrogate_missing_is_a_one_line_error():
    line = one_line_error(["train", "--plugins", CFED])
    assert "cfed needs an unlabelled surrogate dataset" in line and "cfed.surrogate=NAME" in line


def test_surrogate_sharing_the_tasks_classes_is_refused():
    line = one_line_error(["train", "--plugins", CFED, "-o", "cfed.surrogate=digits"])
    assert "shares classes" in line and "digits" in line


def test_surrogate_bad_root_or_name_is_a_one_line_error(tmp_path):
    line = one_line_error(
        [
            "train",
            "--plugins",
            CFED,
            "-o",
            "cfed.surrogate=imagefolder",
            "-o",
            f"cfed.surrogate_root={tmp_path / 'nowhere'}",
        ]
    )
    assert "cfed.surrogate_root" in line and "does not exist" in line
    line = one_line_error(["train", "--plugins", CFED, "-o", "cfed.surrogate=imagefolder"])
    assert "cfed.surrogate_root" in line
    line = one_line_error(["train", "--plugins", CFED, "-o", "cfed.surrogate=nosuchdata"])
    assert "nosuchdata" in line and "digits" in line


def test_same_dataset_is_allowed_with_classes_outside_the_tasks():
    """``surrogate_classes`` outside every task's classes make the run's own
    dataset a valid surrogate (a held-out class split); one shared class is refused."""
    from types import SimpleNamespace

    from fedaval.datasets import DATASETS, load_dataset
    from fedaval.errors import FedavalUsageError
    from fedaval.plugins.cfed import CFeD, load_surrogate

    data = load_dataset("digits")
    run = SimpleNamespace(
        datasets=DATASETS,
        data=data,
        config=SimpleNamespace(dataset="digits", data_root=None, seed=0),
        federation_task_classes=lambda: [[0, 1], [2, 3]],
    )
    options = CFeD.Options(surrogate="digits", surrogate_classes=[5, 6], surrogate_samples=50)
    pool = load_surrogate(run, options)
    assert pool.shape == (50, 1, 8, 8)
    held_out = torch.isin(data.train_y, torch.tensor([5, 6])).sum()
    assert held_out >= 50
    with pytest.raises(FedavalUsageError, match=r"shares classes \[3\]"):
        load_surrogate(run, CFeD.Options(surrogate="digits", surrogate_classes=[3, 5]))


def test_cfed_with_a_method_that_shares_no_weights_is_refused():
    line = one_line_error(
        [
            "train",
            "--plugins",
            f"{CFED},fedaval.plugins.fedweit:FedWeIT",
            "-o",
            "cfed.surrogate=imagefolder",
            "-o",
            "cfed.surrogate_root=tests/data/cifar10",
        ]
    )
    assert "cfed distils into the global model" in line and "fedweit" in line and "clients" in line


def test_server_options_with_the_server_distillation_off_are_refused():
    line = one_line_error(["train", "--plugins", CFED, "-o", "cfed.surrogate=imagefolder", "-o", "cfed.server_lr=0.1"])
    assert "cfed.server_lr applies to the server distillation, which is off" in line
