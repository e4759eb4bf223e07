"""The full ordered list of hook calls for a 2-client, 2-task, 2-round run."""

from __future__ import annotations

from fedaval import hookimpl
from fedaval.api import run_training


class Recorder:
    """Implements every hook and records each call; returns nothing, so the
    defaults still do the work."""

    name = "recorder"

    def __init__(self):
        self.calls: list[str] = []
        self._stage = ""

    def _add(self, token: str) -> None:
        if self.calls and self.calls[-1] == token and token.startswith(("batch", "classify(eval")):
            return  # collapse a run of minibatches / evaluation batches into one entry
        self.calls.append(token)

    @staticmethod
    def _owner(client):
        return None if client is None else client.id

    @hookimpl
    def fedaval_register_scenarios(self, register):
        self._add("register_scenarios")

    @hookimpl
    def fedaval_register_datasets(self, register):
        self._add("register_datasets")

    @hookimpl
    def fedaval_register_models(self, register):
        self._add("register_models")

    @hookimpl
    def fedaval_setup(self, run):
        self._add("setup")

    @hookimpl
    def fedaval_server_reads_client_data(self, run):
        return None  # asked by plugins that protect uploads (dp), not by the core

    @hookimpl
    def fedaval_client_upload_reference(self, run, client, upload, download):
        return None  # asked by plugins that privatise uploads (dp), not by the core

    @hookimpl
    def fedaval_make_model(self, run, client_id):
        self._add(f"make_model({client_id})")

    @hookimpl
    def fedaval_shared_keys(self, run, model):
        self._add("shared_keys")

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        self._add(f"avalanche_plugins({client.id})")

    @hookimpl
    def fedaval_server_task_start(self, run, task):
        assert run.now.task == task and run.now.task_begins
        self._add(f"server_task_start(t{task})")

    @hookimpl
    def fedaval_server_download(self, run, client, download):
        self._add(f"download({client.id})")

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        assert client.task == run.now.task, "receive before client.task is the round's task"
        self._add(f"receive({client.id})")

    @hookimpl
    def fedaval_client_train_data(self, run, client, task):
        self._add(f"train_data({client.id},t{task})")

    @hookimpl
    def fedaval_client_train(self, run, client, round):
        self._add(f"local_train({client.id},r{round})")

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        self._add(f"task_start({client.id},t{task})")

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        self._add(f"epoch_start({client.id},e{epoch})")

    @hookimpl
    def fedaval_classify(self, run, client, model, features, training):
        if training:
            self._stage = "classified"
        else:
            self._add(f"classify(eval,{self._owner(client)})")

    @hookimpl
    def fedaval_client_criterion(self, run, client, logits, y):
        assert self._stage == "classified", "criterion before the batch was classified"
        self._stage = "criterion"

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        assert self._stage == "criterion", "local loss before the base loss"
        self._stage = "loss"

    @hookimpl
    def fedaval_client_step(self, run, client, batch):
        assert self._stage == "loss", "step hook before the loss hook"
        self._stage = "stepped"
        self._add(f"batches({client.id})")

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        self._add(f"task_end({client.id},t{task})")

    @hookimpl
    def fedaval_client_upload(self, run, client):
        self._add(f"upload({client.id})")

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        self._add("fuse_weights")

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        self._add(f"server_fuse(r{round})")

    @hookimpl
    def fedaval_server_task_end(self, run, task):
        assert run.now.task_ends
        self._add(f"server_task_end(t{task})")

    @hookimpl(wrapper=True)
    def fedaval_client_evaluate(self, run, client):
        self._add(f"evaluate({client.id})")
        result = yield
        assert isinstance(result, dict) and result
        return result

    @hookimpl
    def fedaval_client_evaluation_stale(self, run, client):
        self._add(f"stale({client.id})")  # asked only for a client not trained since it was evaluated: never here

    @hookimpl
    def fedaval_federation_model(self, run):
        return None  # the core's "global" decides

    @hookimpl
    def fedaval_teardown(self, run):
        self._add("teardown")

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        self._add(f"round_metrics(r{round})")


def expected_round(round: int, task: int, first: bool, last: bool) -> list[str]:
    calls = [f"server_task_start(t{task})"] if first else []
    calls += ["download(0)", "download(1)"]
    for c in (0, 1):
        calls += [f"receive({c})", f"local_train({c},r{round})"]
        if first:
            calls += [f"train_data({c},t{task})", f"task_start({c},t{task})"]
        calls += [f"epoch_start({c},e0)", f"batches({c})"]
        if last:
            calls.append(f"task_end({c},t{task})")
        calls.append(f"upload({c})")
    calls += ["fuse_weights", f"server_fuse(r{round})"]
    if last:
        calls.append(f"server_task_end(t{task})")
    # evaluation: Avalanche on the global model (its predictions also give A_glo
    # and stability/plasticity: no second pass), then each client's
    calls += ["classify(eval,None)", "evaluate(0)", "classify(eval,0)", "evaluate(1)", "classify(eval,1)"]
    calls.append(f"round_metrics(r{round})")
    return calls


def test_full_hook_order(tiny_config):
    recorder = Recorder()
    run_training(tiny_config(), extra_plugins=[recorder])
    expected = [
        "register_scenarios",
        "register_datasets",
        "register_models",
        "setup",
        "make_model(None)",
        "shared_keys",
        "make_model(0)",
        "shared_keys",
        "avalanche_plugins(0)",
        "make_model(1)",
        "shared_keys",
        "avalanche_plugins(1)",
    ]
    expected += expected_round(1, 0, first=True, last=False)
    expected += expected_round(2, 0, first=False, last=True)
    expected += expected_round(3, 1, first=True, last=False)
    expected += expected_round(4, 1, first=False, last=True)
    expected.append("teardown")
    assert recorder.calls == expected
    # end-of-task work: exactly once per task per client
    assert sum(c.startswith("task_end(0,") for c in recorder.calls) == 2
    assert sum(c.startswith("task_start(1,") for c in recorder.calls) == 2
