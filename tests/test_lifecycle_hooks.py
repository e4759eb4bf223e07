"""The round-lifecycle seams, each shown to take effect in a real (tiny) run."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.errors import RunFailure


class OnlyCurrentClasses:
    """A criterion restricted to the classes of the client's current task
    (TARGET's reading); records the loss it returns."""

    name = "only-current"

    def __init__(self):
        self.masked = 0

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        classes = torch.as_tensor(client.tasks.classes[client.task], device=logits.device)
        mask = torch.full_like(logits, float("-inf"))
        mask[:, classes] = 0
        self.masked += 1
        return torch.nn.functional.cross_entropy(logits + mask, y)


def test_fedaval_client_criterion_replaces_the_base_loss(tiny_config, tmp_path):
    plain = run_training(tiny_config(out=str(tmp_path / "a")))
    plugin = OnlyCurrentClasses()
    masked = run_training(tiny_config(out=str(tmp_path / "b")), extra_plugins=[plugin])
    assert plugin.masked > 0
    # the masked cross-entropy is over fewer classes: lower than the full one at the same start
    first = lambda r: r["rounds"][0]["losses"]["loss/classification"]  # noqa: E731
    assert first(masked) < first(plain)


class Steps:
    name = "steps"

    def __init__(self):
        self.steps: dict[tuple[int, int], int] = {}

    @hookimpl
    def fedaval_client_step(self, run, client, batch):
        key = (run.round, client.id)
        self.steps[key] = self.steps.get(key, 0) + 1


def test_fedaval_client_step_runs_once_per_optimizer_step(tiny_config):
    probe = Steps()
    run_training(tiny_config(local_epochs=2), extra_plugins=[probe])
    # digits, 2 clients x 5 classes: client k's task has n samples -> ceil(n / 32) steps per epoch
    assert probe.steps and all(v % 2 == 0 and v >= 2 for v in probe.steps.values())


class PerClient:
    """Sends each client its own id; checks it arrived."""

    name = "per-client"

    def __init__(self):
        self.got: list[tuple[int, int]] = []

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        assert "weights" in download
        return {"for_client": torch.full((10,), float(client.id))}

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        self.got.append((client.id, int(download["for_client"][0])))


def test_fedaval_server_download_reaches_only_its_client_and_is_counted(tiny_config, tmp_path):
    plain = run_training(tiny_config(out=str(tmp_path / "a")))
    probe = PerClient()
    sent = run_training(tiny_config(out=str(tmp_path / "b")), extra_plugins=[probe])
    assert probe.got and all(k == v for k, v in probe.got)
    for a, b in zip(plain["rounds"], sent["rounds"]):  # 10 float32 + 8 for the entry's key, per client
        assert b["bytes_down"] - a["bytes_down"] == len(b["clients"]) * (40 + 8)


class ExtraData:
    """Adds training data: indices of other classes (a memory), or a dataset."""

    name = "extra-data"

    def __init__(self, kind):
        self.kind = kind
        self.labels: set[int] = set()

    @hookimpl
    def fedaval_client_train_data(self, run, client, task):
        if task == 0:
            return None
        if self.kind == "indices":
            return np.flatnonzero(run.data.train_y.numpy() == 9)[:20]
        x = torch.zeros(12, *run.data.input_shape)
        return torch.utils.data.TensorDataset(x, torch.full((12,), 9, dtype=torch.long))

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        if client.task == 1:
            self.labels.update(batch.y.tolist())


@pytest.mark.parametrize("kind", ["indices", "dataset"])
def test_fedaval_client_train_data_reaches_the_loss(tiny_config, kind):
    probe = ExtraData(kind)
    run_training(tiny_config(scenario_options={"clients": 2, "tasks": 2}), extra_plugins=[probe])
    assert 9 in probe.labels  # the extra class-9 samples reach the loss in task 1
    assert len(probe.labels) > 1


class Stages:
    name = "stages"

    def __init__(self):
        self.events: list[tuple[str, int, int]] = []

    @hookimpl
    def fedaval_server_task_start(self, run, task):
        self.events.append(("start", task, run.now.round))

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        self.events.append(("end", task, run.now.round))

    @hookimpl
    def fedaval_teardown(self, run):
        self.events.append(("teardown", -1, run.round))


def test_server_stage_hooks_and_teardown(tiny_config):
    probe = Stages()
    run_training(tiny_config(rounds_per_task=3), extra_plugins=[probe])
    assert probe.events == [("start", 0, 1), ("end", 0, 3), ("start", 1, 4), ("end", 1, 6), ("teardown", -1, 6)]


class Breaks(Stages):
    name = "breaks"

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        if round == 2:
            raise RunFailure("stop here")


def test_teardown_runs_when_the_run_fails(tiny_config):
    probe = Breaks()
    with pytest.raises(RunFailure):
        run_training(tiny_config(), extra_plugins=[probe])
    assert probe.events[-1] == ("teardown", -1, 2)


class TaskStarts:
    name = "task-starts"

    def __init__(self):
        self.starts: list[tuple[int, int, int]] = []

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        self.starts.append((run.round, client.id, task))


def test_fedaval_client_task_start_is_each_clients_first_sampled_round_of_a_task(tiny_config):
    probe = TaskStarts()
    config = tiny_config(rounds_per_task=4, clients_per_round=1, scenario_options={"clients": 3, "tasks": 2})
    run_training(config, extra_plugins=[probe])
    seen: dict[tuple[int, int], int] = {}
    for round, client, task in probe.starts:
        assert (client, task) not in seen  # once per client and task
        seen[(client, task)] = round
        assert (round - 1) // 4 == task


@pytest.mark.parametrize("sampling", ["round", "task"])
def test_client_sampling_draws_clients_every_round_or_once_per_task(tiny_config, sampling):
    """``--client-sampling task`` trains the same drawn clients in each round of
    a task (PFCL's Algorithm 1); ``round`` draws afresh, and the seed gives
    this scenario a round whose draw differs from its task's first."""
    results = run_training(
        tiny_config(
            rounds_per_task=4,
            clients_per_round=2,
            client_sampling=sampling,
            scenario_options={"clients": 5, "tasks": 2},
        )
    )
    drawn = [r["clients"] for r in results["rounds"]]
    assert all(len(c) == 2 for c in drawn)
    per_task = [drawn[t * 4 : (t + 1) * 4] for t in range(2)]
    same = all(rounds == [rounds[0]] * 4 for rounds in per_task)
    assert same == (sampling == "task")


def test_a_bad_client_sampling_is_a_one_line_error(tiny_config):
    from fedaval.errors import FedavalUsageError

    with pytest.raises(FedavalUsageError, match=r"bad value --client-sampling stage; must be one of round, task"):
        run_training(tiny_config(client_sampling="stage"))


class SkipsClientOne:
    """Replaces local training for client 1 (a firstresult override)."""

    name = "skips-one"

    @hookimpl(tryfirst=True)
    def fedaval_client_train(self, run, client, round):
        if client.id == 1:
            return {"loss/skipped": 0.0}
        return None


def test_fedaval_client_train_can_replace_local_training(tiny_config):
    results = run_training(tiny_config(), extra_plugins=[SkipsClientOne()])
    assert all("loss/skipped" in r["losses"] and "loss/classification" in r["losses"] for r in results["rounds"])


class HeadOnly:
    """Shares only the classifier: the feature extractor never leaves the client."""

    name = "head-only"

    @hookimpl
    def fedaval_shared_keys(self, run, model):
        return [k for k in model.state_dict() if k.startswith("classifier.")]

    @hookimpl
    def fedaval_client_upload(self, run, client):
        assert all(k.startswith("classifier.") for k in client.shared_state())


def test_fedaval_shared_keys_limits_what_is_uploaded(tiny_config, tmp_path):
    full = run_training(tiny_config(out=str(tmp_path / "a")))
    head = run_training(tiny_config(out=str(tmp_path / "b")), extra_plugins=[HeadOnly()])
    assert head["rounds"][0]["bytes_up"] < full["rounds"][0]["bytes_up"] / 2
