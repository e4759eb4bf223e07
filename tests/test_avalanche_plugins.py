"""Avalanche's plugins on every client: the named hybrids (FedEWC, FedLwF,
FedReplay) and the generic ``--plugins avalanche:ClassName`` path. The point
checked throughout: a task spanning several rounds looks like ONE Avalanche
experience (end-of-task work once per task, at the client's last round)."""

from __future__ import annotations

import functools
from collections import defaultdict

import pytest
import torch
from click.testing import CliRunner
from helpers import one_line_error

from fedaval import hookimpl
from fedaval.build import build_run
from fedaval.cli import cli
from fedaval.coordinator import train
from fedaval.errors import FedavalUsageError
from fedaval.plugin_manager import instantiate, resolve_plugin
from fedaval.plugins.avalanche_bridge import CHECKED, REFUSED, available_avalanche_plugins


def run_with(config, extra=()):
    run = build_run(config, extra_plugins=list(extra), out_dir=None)
    return run, train(run)


class BatchProbe:
    """Largest minibatch each client trained on, per round."""

    name = "batch-probe"

    def __init__(self):
        self.largest = defaultdict(int)

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        key = (client.id, run.round)
        self.largest[key] = max(self.largest[key], int(batch.x.shape[0]))


def count_calls(monkeypatch, cls, method):
    """Wrap ``cls.method``; returns {id(instance): [(round, train_exp_counter), ...]}."""
    calls = defaultdict(list)
    original = getattr(cls, method)

    @functools.wraps(original)  # its __module__ too: the strategy runs Avalanche's before_training once per task
    def wrapped(self, strategy, **kwargs):
        calls[id(self)].append((strategy.run.round, strategy.clock.train_exp_counter))
        return original(self, strategy, **kwargs)

    monkeypatch.setattr(cls, method, wrapped)
    return calls


# --- the generic path --------------------------------------------------------


def test_generic_mas_plugin_does_its_end_of_task_work_once_per_task(tiny_config, monkeypatch):
    from avalanche.training.plugins import MASPlugin

    after = count_calls(monkeypatch, MASPlugin, "after_training_exp")
    before = count_calls(monkeypatch, MASPlugin, "before_training_exp")
    config = tiny_config(
        plugins=["avalanche:MASPlugin"], plugin_options={"avalanche": {"lambda_reg": "2"}}, rounds_per_task=3
    )
    run, results = run_with(config)
    assert len(results["rounds"]) == 6
    bridge = run.plugins.objects["avalanche"]
    instances = [bridge.instance(client) for client in run.clients]
    assert len({id(p) for p in instances}) == 2  # one per client
    for plugin in instances:
        assert isinstance(plugin, MASPlugin) and plugin._lambda == 2.0
        # once per task, at the task's last round (3 and 6), experience counters 0 and 1
        assert after[id(plugin)] == [(3, 0), (6, 1)]
        assert before[id(plugin)] == [(1, 0), (4, 1)]
        assert plugin.importance is not None
    # MAS's penalty is active in the second task only
    for record in results["rounds"]:
        extra = record["losses"]["loss/total"] - record["losses"]["loss/classification"]
        assert (extra > 0) == (record["task"] == 1)


def test_rwalk_keeps_the_path_scores_of_every_round_of_a_task(tiny_config, monkeypatch):
    """Avalanche's before_training runs once per train() call, centrally once
    per experience; RWalk starts its path scores afresh there. Until session
    36 it ran every round, and only the scores of a task's last round reached
    the task's experience scores."""
    from avalanche.training.plugins import RWalkPlugin

    before = count_calls(monkeypatch, RWalkPlugin, "before_training")
    updates = defaultdict(list)  # id(plugin) -> [(round, id(checkpoint_scores))], one per score update
    folded = defaultdict(list)  # id(plugin) -> [(round, id(checkpoint_scores))] folded into the experience's scores
    update_score, after_exp = RWalkPlugin._update_score, RWalkPlugin.after_training_exp

    @functools.wraps(update_score)
    def record_update(self, strategy):
        update_score(self, strategy)
        updates[id(self)].append((strategy.run.round, id(self.checkpoint_scores)))

    @functools.wraps(after_exp)
    def record_fold(self, strategy, **kwargs):
        folded[id(self)].append((strategy.run.round, id(self.checkpoint_scores)))
        after_exp(self, strategy, **kwargs)

    monkeypatch.setattr(RWalkPlugin, "_update_score", record_update)
    monkeypatch.setattr(RWalkPlugin, "after_training_exp", record_fold)
    config = tiny_config(
        plugins=["avalanche:RWalkPlugin"], plugin_options={"avalanche": {"delta_t": "5"}}, rounds_per_task=3
    )
    run, _ = run_with(config)
    for client in run.clients:
        plugin = run.plugins.objects["avalanche"].instance(client)
        assert before[id(plugin)] == [(1, 0), (4, 1)]  # at each task's first round only
        for (end, scores), task_rounds in zip(folded[id(plugin)], ({1, 2, 3}, {4, 5, 6})):
            assert end == max(task_rounds)
            # every round's score updates went into the scores folded at the task's end
            assert {r for r, kept in updates[id(plugin)] if r in task_rounds and kept == scores} == task_rounds


def test_rwalk_with_few_steps_a_round_does_not_drop_a_client(tiny_config):
    """A client of 5 steps a round makes its only score checkpoint (every 10
    steps) in its second round; until session 36 the third round's
    before_training threw it away, the task's scores were all 0, its
    penalties 0/0 = NaN, and the client was left out of every round of the next task."""
    config = tiny_config(
        plugins=["avalanche:RWalkPlugin"],
        rounds_per_task=3,
        scenario_options={"clients": 3, "tasks": 2},
        clients_per_round=2,
    )
    run, results = run_with(config)
    assert run.schedule[:3] == [[1, 2]] * 3 and 1 in run.schedule[3]  # client 1 trains in task 2
    assert all(record["failed_clients"] == [] for record in results["rounds"])
    plugin = run.plugins.objects["avalanche"].instance(run.clients[1])
    assert all(torch.isfinite(p.data).all() for p in plugin.exp_penalties.values())


class ModelProbe:
    """At each client's task start (after Avalanche's experience set-up): the
    client's model's weights and whether the strategy trains that object; the
    global model after each round."""

    name = "model-probe"

    def __init__(self):
        self.task_starts = []  # (round, client id, weights, strategy.model is client.model)
        self.global_weights = []

    @hookimpl
    def fedaval_client_task_start(self, run, client, task):
        weights = {k: v.clone() for k, v in client.model.state_dict().items()}
        self.task_starts.append((run.round, client.id, weights, client.strategy.model is client.model))

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        self.global_weights.append(torch.cat([p.detach().flatten().clone() for p in run.server.model.parameters()]))


def test_gdumb_trains_and_uploads_the_clients_model_reset_at_each_task_start(tiny_config, monkeypatch):
    """GDumb replaces strategy.model by a copy of its initial model at each
    experience. Until session 36 the client then trained that copy and
    uploaded its own model, untouched: from task 2 on the global model never
    changed. Now the client's model takes the copy's weights and is trained."""
    from avalanche.training.plugins import GDumbPlugin

    buffer_updates = count_calls(monkeypatch, GDumbPlugin, "after_train_dataset_adaptation")
    probe = ModelProbe()
    config = tiny_config(
        plugins=["avalanche:GDumbPlugin"], rounds_per_task=3, scenario_options={"clients": 2, "tasks": 3}
    )
    run, _ = run_with(config, [probe])
    changes = [(b - a).abs().max().item() for a, b in zip(probe.global_weights, probe.global_weights[1:])]
    assert len(changes) == 8 and min(changes) > 0  # the global model moves in every round
    for client in run.clients:
        plugin = run.plugins.objects["avalanche"].instance(client)
        assert client.strategy.model is client.model
        optimized = {id(p) for group in client.strategy.optimizer.param_groups for p in group["params"]}
        assert optimized == {id(p) for p in client.model.parameters()}
        assert buffer_updates[id(plugin)] == [(1, 0), (4, 1), (7, 2)]  # the memory: once per task, at its start
        initial = plugin.init_model.state_dict()
        starts = [(r, weights, same) for r, c, weights, same in probe.task_starts if c == client.id]
        assert [r for r, _, _ in starts] == [1, 4, 7]
        for _, weights, same in starts:  # each task starts from GDumb's initial model, in the client's own object
            assert same and all(torch.equal(weights[k], initial[k]) for k in initial)


def test_a_plugin_replacing_the_model_by_another_architecture_stops_the_run_naming_it(tiny_config):
    from avalanche.core import SupervisedPlugin

    from fedaval.errors import RunFailure

    class Swap(SupervisedPlugin):
        def before_training_exp(self, strategy, **kwargs):
            strategy.model = torch.nn.Linear(2, 2)

    class Swapper:
        name = "swapper"

        @hookimpl
        def fedaval_client_avalanche_plugins(self, run, client):
            return [Swap()]

    with pytest.raises(RunFailure) as info:
        run_with(tiny_config(on_client_failure="fail"), [Swapper()])
    assert str(info.value).startswith(
        "client 0 failed in round 1: PluginError: an Avalanche plugin of client 0 (Swap) replaced its model by one "
        "whose weights do not fit the client's model, which fedaval federates ("
    )
    assert "\n" not in str(info.value)


def test_synaptic_intelligence_acts_on_the_cpu(tiny_config):
    """Avalanche's SynapticIntelligencePlugin keeps weights as
    ``param.detach().cpu().flatten()``, on the CPU a view of the parameter:
    every weight change it measured was 0, and until session 36
    ``avalanche:SynapticIntelligencePlugin`` gave FedAvg's results to the last digit."""
    from fedaval.plugins.avalanche_fixes import CopyingSynapticIntelligencePlugin

    _, fedavg = run_with(tiny_config())
    options = {"avalanche": {"si_lambda": "1000"}}  # Avalanche clips each importance to 0.001
    run, si = run_with(tiny_config(plugins=["avalanche:SynapticIntelligencePlugin"], plugin_options=options))
    for client in run.clients:
        plugin = run.plugins.objects["avalanche"].instance(client)
        assert isinstance(plugin, CopyingSynapticIntelligencePlugin)
        assert sum(v.data.abs().sum().item() for v in plugin.ewc_data[1].values()) > 0  # importances
    for record in si["rounds"]:  # its penalty: in the second task only
        extra = record["losses"]["loss/total"] - record["losses"]["loss/classification"]
        assert (extra > 0) == (record["task"] == 1)
    assert [r["global_accuracy"] for r in si["rounds"]] != [r["global_accuracy"] for r in fedavg["rounds"]]


def test_rwalk_gives_a_task_without_a_score_finite_penalties(tiny_config):
    """Client 3 trains the first task in one round of 2 steps, under
    delta_t=5 no score checkpoint: Avalanche divides its zero scores by their
    maximum, 0, and the NaN penalties dropped the client in every later round."""
    from fedaval.plugins.avalanche_fixes import FiniteRWalkPlugin

    config = tiny_config(
        plugins=["avalanche:RWalkPlugin"],
        plugin_options={"avalanche": {"delta_t": "5"}},
        rounds_per_task=3,
        scenario_options={"clients": 4, "tasks": 2},
        clients_per_round=2,
    )
    run, results = run_with(config)
    client = run.clients[3]
    assert [round for round, ids in enumerate(run.schedule[:3], 1) if 3 in ids] == [2] and 3 in run.schedule[5]
    plugin = run.plugins.objects["avalanche"].instance(client)
    assert isinstance(plugin, FiniteRWalkPlugin)
    assert all(torch.isfinite(p.data).all() for p in plugin.exp_penalties.values())
    assert all(record["failed_clients"] == [] for record in results["rounds"])


def test_generic_path_options_are_typed_from_the_constructor():
    name, cls = resolve_plugin("avalanche:SynapticIntelligencePlugin")
    assert name == "avalanche"
    plugin = instantiate(name, cls, {"si_lambda": "0.5", "eps": "1e-3"})
    assert plugin.options.si_lambda == 0.5 and plugin.options.eps == 0.001
    assert plugin.avalanche_kwargs()["device"] == "as_strategy"


@pytest.mark.parametrize(
    "spec, values, message",
    [
        ("avalanche:MASPlugin", {"lam": "1"}, "unknown option avalanche.lam; allowed: alpha, lambda_reg, verbose"),
        (
            "avalanche:MASPlugin",
            {"lambda_reg": "abc"},
            "bad value avalanche.lambda_reg='abc'; expected a finite number",
        ),
        ("avalanche:EWCPlugin", {}, "bad value avalanche.ewc_lambda=(required); required by the Avalanche"),
        # the unknown-class error lists the usable classes only (BiC is refused)
        ("avalanche:NoSuchPlugin", {}, "unknown Avalanche plugin 'NoSuchPlugin'; allowed: AGEMPlugin, EWCPlugin,"),
        # until session 36 each of these was accepted, then ended in a traceback or a late crash
        ("avalanche:EWCPlugin", {"ewc_lambda": "none"}, "bad value avalanche.ewc_lambda='none'; expected a finite"),
        ("avalanche:SynapticIntelligencePlugin", {"si_lambda": "none"}, "bad value avalanche.si_lambda='none';"),
        (
            "avalanche:EWCPlugin",
            {"ewc_lambda": "1", "mode": "foo"},
            "avalanche:EWCPlugin refuses its options (ewc_lambda=1, mode='foo'): Mode must be separate or online.",
        ),
        (
            "avalanche:EWCPlugin",
            {"ewc_lambda": "1", "mode": "online"},
            "avalanche:EWCPlugin refuses its options (ewc_lambda=1, mode='online'): You need to set `decay_factor`",
        ),
        ("avalanche:RWalkPlugin", {"delta_t": "0"}, "refuses its options (delta_t=0): `delta_t` must be at least 1."),
        ("avalanche:ReplayPlugin", {"mem_size": "-5"}, "bad value avalanche.mem_size=-5; must be >= 1"),
        (
            "avalanche:AGEMPlugin",
            {"patterns_per_experience": "5", "sample_size": "0"},
            "bad value avalanche.sample_size=0; must be >= 1",
        ),
        # accepted until session 34, failing in round 2 or running with a meaningless decay
        ("fedreplay", {"batch_size_mem": "-1"}, "bad value fedreplay.batch_size_mem=-1; must be >= 1"),
        ("fedewc", {"mode": "online", "decay_factor": "-1"}, "bad value fedewc.decay_factor=-1.0; must be in [0, 1]"),
    ],
)
def test_generic_path_errors_are_one_line(spec, values, message):
    with pytest.raises(FedavalUsageError) as info:
        name, cls = resolve_plugin(spec)
        instantiate(name, cls, values)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("class_name", sorted(REFUSED))
def test_classes_that_cannot_work_federated_are_refused_at_load_saying_why(class_name):
    with pytest.raises(FedavalUsageError) as info:
        resolve_plugin(f"avalanche:{class_name}")
    assert str(info.value) == f"avalanche:{class_name} cannot run in fedaval: {REFUSED[class_name]}"
    assert "\n" not in str(info.value)


def test_every_avalanche_training_plugin_is_checked_or_refused():
    assert sorted([*CHECKED, *REFUSED]) == available_avalanche_plugins()


def test_a_refused_class_is_a_one_line_usage_error_on_the_command_line(tmp_path):
    line = one_line_error(["train", "--plugins", "avalanche:LRSchedulerPlugin", "--out", str(tmp_path / "r")])
    assert line == (
        "fedaval: error: avalanche:LRSchedulerPlugin cannot run in fedaval: "
        "fedaval sets every round's learning rate; use --lr-schedule"
    )


def test_a_class_fedaval_has_not_checked_runs_with_a_warning(monkeypatch, caplog):
    from fedaval.plugins import avalanche_bridge

    monkeypatch.setattr(avalanche_bridge, "CHECKED", ("EWCPlugin",))
    name, cls = resolve_plugin("avalanche:MASPlugin")
    with caplog.at_level("WARNING", logger="fedaval"):
        instantiate(name, cls, {})
    assert "avalanche:MASPlugin has not been checked under federation (checked: EWCPlugin)" in caplog.text


def test_an_unannotated_int_default_takes_a_float_unless_it_counts():
    name, cls = resolve_plugin("avalanche:LwFPlugin")
    plugin = instantiate(name, cls, {"alpha": "0.5", "temperature": "1.5"})  # an int until session 36
    assert plugin.avalanche_kwargs() == {"alpha": 0.5, "temperature": 1.5}
    assert instantiate(name, cls, {"alpha": "2"}).avalanche_kwargs()["alpha"] == 2
    name, cls = resolve_plugin("avalanche:ReplayPlugin")
    with pytest.raises(FedavalUsageError, match=r"bad value avalanche.mem_size='2.5'; expected int"):
        instantiate(name, cls, {"mem_size": "2.5"})


def test_two_generic_plugins_are_refused_before_their_options_are_read():
    from fedaval.plugin_manager import get_plugin_manager, load_plugins

    with pytest.raises(FedavalUsageError) as info:  # was: unknown option avalanche.ewc_lambda (checked against MAS)
        load_plugins(
            get_plugin_manager(), ["avalanche:MASPlugin", "avalanche:EWCPlugin"], {"avalanche": {"ewc_lambda": "1"}}
        )
    assert str(info.value) == (
        "plugin name 'avalanche' is loaded twice (from 'avalanche:EWCPlugin'); one avalanche:<Class> plugin per run"
    )


def test_a_class_needing_an_object_argument_cannot_be_built():
    from fedaval.plugins.avalanche_bridge import constructor_options

    class NeedsAModel:
        def __init__(self, model, cwr_layer_name=None, decay_factor=None, scale=1):
            pass

    with pytest.raises(FedavalUsageError) as info:
        constructor_options(NeedsAModel)
    assert str(info.value) == (
        "avalanche:NeedsAModel cannot run in fedaval: its constructor needs 'model', an object a command line cannot give"
    )


def test_fedaval_plugins_lists_the_checked_avalanche_classes_with_their_options():
    result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0
    assert "avalanche:EWCPlugin  Avalanche's EWCPlugin on every client (generic bridge)" in result.output
    assert "-o avalanche.ewc_lambda=(required)  (a finite number)" in result.output
    assert "-o avalanche.mem_size=200  (int, >= 1)" in result.output
    assert "refused (docs/methods.md says why): avalanche:BiCPlugin," in result.output
    assert "avalanche:BiCPlugin  " not in result.output


def test_generic_path_cli_error(tmp_path):
    result = CliRunner().invoke(
        cli,
        [
            "train",
            "--plugins",
            "avalanche:MASPlugin",
            "-o",
            "avalanche.nope=1",
            "--out",
            str(tmp_path / "r"),
            "--device",
            "cpu",
        ],
    )
    assert result.exit_code == 2
    assert "unknown option avalanche.nope; allowed: alpha, lambda_reg, verbose" in result.output


def test_unknown_plugin_error_mentions_the_avalanche_form():
    with pytest.raises(FedavalUsageError, match=r"avalanche:<name>"):
        resolve_plugin("no-such-method")


# --- the named hybrids -------------------------------------------------------


def test_hybrids_act_once_per_task_and_replay_in_every_round(tiny_config, monkeypatch):
    from avalanche.training import LearningWithoutForgetting
    from avalanche.training.plugins import EWCPlugin, ReplayPlugin

    ewc_ends = count_calls(monkeypatch, EWCPlugin, "after_training_exp")
    replay_ends = count_calls(monkeypatch, ReplayPlugin, "after_training_exp")
    teachers = defaultdict(int)
    original = LearningWithoutForgetting.post_adapt

    def post_adapt(self, agent, exp):
        teachers[id(self)] += 1
        return original(self, agent, exp)

    monkeypatch.setattr(LearningWithoutForgetting, "post_adapt", post_adapt)
    probe = BatchProbe()
    config = tiny_config(
        plugins=["fedewc", "fedlwf", "fedreplay"], plugin_options={"fedreplay": {"mem_size": "40"}}, rounds_per_task=3
    )
    run, results = run_with(config, extra=[probe])
    for client in run.clients:
        ewc = run.plugins.objects["fedewc"].instance(client)
        lwf = run.plugins.objects["fedlwf"].instance(client)
        replay = run.plugins.objects["fedreplay"].instance(client)
        # EWC: importances once per task, keyed by the client's experience counter
        assert ewc_ends[id(ewc)] == [(3, 0), (6, 1)]
        assert sorted(ewc.importances) == [0, 1] and sorted(ewc.saved_params) == [0, 1]
        # LwF: one teacher snapshot per task
        assert teachers[id(lwf.lwf)] == 2 and lwf.lwf.expcount == 2 and lwf.lwf.prev_model is not None
        # replay: memory updated once per task, full after task 1
        assert replay_ends[id(replay)] == [(3, 0), (6, 1)]
        assert len(replay.storage_policy.buffer) == 40
        # the ReplayDataLoader (batch 32 + 32 from memory) in EVERY round of task 2, not only the first
        assert [probe.largest[(client.id, r)] for r in range(1, 7)] == [32, 32, 32, 64, 64, 64]
    assert results["final"]["accuracy"] is not None


def test_fedewc_online_mode_needs_a_decay_factor():
    name, cls = resolve_plugin("fedewc")
    with pytest.raises(FedavalUsageError, match="fedewc.decay_factor"):
        instantiate(name, cls, {"mode": "online"})
    assert instantiate(name, cls, {"mode": "online", "decay_factor": "0.9"}).avalanche_kwargs() == {
        "ewc_lambda": 1.0,
        "mode": "online",
        "decay_factor": 0.9,
    }


def ewc_pair(mode: str):
    """Avalanche's EWCPlugin and FedEWC's FusedEWCPlugin holding the same
    anchors and importances of two past experiences for a small CNN, with a
    grown classifier (its anchor and importance padded by both), some
    importances 0 and some parameters equal to their anchor."""
    import torch
    from avalanche.training.plugins import EWCPlugin
    from avalanche.training.utils import ParamData

    from fedaval.plugins.ewc_penalty import FusedEWCPlugin

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    kwargs = {"ewc_lambda": 3.0, "mode": mode, "decay_factor": 0.5 if mode == "online" else None}
    plugins = EWCPlugin(**kwargs), FusedEWCPlugin(**kwargs)
    for experience in (0, 1):
        for name, param in model.named_parameters():
            shape = (4, *param.shape[1:]) if name == "2.weight" else param.shape  # the classifier grew
            anchor = param.detach()[: shape[0]].clone() + 0.1 * torch.randn(shape)
            if name == "0.bias":
                anchor = param.detach().clone()  # no distance
            importance = torch.rand(shape) * (torch.rand(shape) > 0.3)  # some exactly 0
            for plugin in plugins:
                plugin.saved_params[experience][name] = ParamData(name, init_tensor=anchor.clone())
                plugin.importances[experience][name] = ParamData(name, init_tensor=importance.clone())
    return model, plugins


@pytest.mark.parametrize("mode", ["separate", "online"])
def test_fedewc_penalty_is_avalanches_in_batched_operations(mode, monkeypatch):
    """The same penalty and gradients as Avalanche's loop (to float32's
    last bits: the sum is added up in another order), in a few operations:
    Avalanche's loop dispatches some ten per parameter tensor and
    experience, each a kernel launch on a GPU (FedEWC's full-scale rounds:
    14 s against FedAvg's 3, docs/performance.md)."""
    from pathlib import Path
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from op_count import OpCount  # benchmarks/ewc_penalty.py counts them the same way

    model, plugins = ewc_pair(mode)
    values, grads, ops = [], [], []
    for plugin in plugins:
        for _ in range(2):  # the first call pads the grown classifier's anchors; the second is counted
            model.zero_grad(set_to_none=True)
            strategy = SimpleNamespace(
                clock=SimpleNamespace(train_exp_counter=2), model=model, device=torch.device("cpu"), loss=0.0
            )
            with OpCount() as counter:
                plugin.before_backward(strategy)
                strategy.loss.backward()
        values.append(strategy.loss.item())
        grads.append([p.grad.clone() for p in model.parameters()])
        ops.append(counter.total())
    assert values[0] > 0
    assert values[1] == pytest.approx(
        values[0], rel=1e-6
    )  # each tensor's sum is Avalanche's; their sum in another order
    for avalanche_grad, fused_grad in zip(*grads):
        torch.testing.assert_close(fused_grad, avalanche_grad, rtol=1e-5, atol=1e-7)
    tensors = len(list(model.parameters()))  # 4
    experiences = 2 if mode == "separate" else 1
    # Avalanche: some ten per tensor and experience (measured: 94 and 50); batched: one per tensor
    # and experience (its sum) and about ten per experience, and the gradients' accumulation into
    # .grad, per tensor (measured: 38 and 25)
    assert ops[0] >= 10 * tensors * experiences
    assert ops[1] <= (tensors + 14) * experiences + 2 * tensors


def test_fedewc_gives_each_client_the_batched_penalty(tiny_config):
    from fedaval.plugins.ewc_penalty import FusedEWCPlugin

    run = build_run(tiny_config(plugins=["fedewc"]), out_dir=None)
    assert all(type(run.plugins.objects["fedewc"].instance(c)) is FusedEWCPlugin for c in run.clients)


def test_fedlwf_distillation_is_avalanches_without_a_host_tensor_a_minibatch(tiny_config):
    """Avalanche picks the old classes' outputs with a Python list, which
    becomes a tensor on the host (``lift_fresh``), copied to a GPU with a
    wait, twice a minibatch. FedLwF's plugin picks them with an index made on
    the device once: the same loss and gradients, bit for bit."""
    import torch
    from avalanche.training import LearningWithoutForgetting
    from torch.utils._python_dispatch import TorchDispatchMode

    from fedaval.plugins.lwf_distillation import DeviceIndexLwF, DeviceIndexLwFPlugin

    class HostTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.made += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    teacher, x = torch.nn.Linear(6, 8), torch.randn(5, 6)
    results = []
    for cls in (LearningWithoutForgetting, DeviceIndexLwF):
        lwf = cls(alpha=1.5, temperature=2)
        lwf.prev_model = teacher
        lwf.prev_classes_by_task[0] = {0, 3, 5}
        for _ in range(2):  # the second minibatch is counted
            out = torch.randn(5, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()
            with HostTensors() as host:
                loss = lwf(x, out, None)
                loss.backward()
        results.append((loss.item(), out.grad, host.made))
    (avalanche_loss, avalanche_grad, avalanche_made), (loss, grad, made) = results
    assert loss == avalanche_loss and torch.equal(grad, avalanche_grad)
    assert avalanche_made == 2 and made == 0
    run = build_run(tiny_config(plugins=["fedlwf"]), out_dir=None)
    assert all(type(run.plugins.objects["fedlwf"].instance(c)) is DeviceIndexLwFPlugin for c in run.clients)


# --- every baseline in every scenario -------------------------------------------

SCENARIOS = {
    "sthfl": {"clients": 3, "classes_per_task": 2, "tasks": 2},
    "fcil-sync": {"clients": 2, "tasks": 2},
    "fcil-async": {"clients": 2, "tasks": 2},
    "fcl-random": {"clients": 3, "classes_per_task": 2, "min_tasks": 1, "max_tasks": 2},
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_baselines_run_in_every_scenario(tiny_config, scenario):
    plugins = ["fedprox", "fedewc", "fedlwf", "fedreplay"]
    config = tiny_config(
        plugins=plugins,
        scenario=scenario,
        scenario_options=SCENARIOS[scenario],
        rounds_per_task=1,
        plugin_options={"fedreplay": {"mem_size": "20"}},
    )
    run, results = run_with(config)
    assert results["plugins"][:5] == ["fedavg", *plugins]
    assert len(results["rounds"]) == run.num_tasks
    assert 0 <= results["final"]["accuracy"] <= 1
    assert all("loss/proximal" in r["losses"] for r in results["rounds"])
    for client in run.clients:
        trained = len(client.tasks_started)
        ewc = run.plugins.objects["fedewc"].instance(client)
        lwf = run.plugins.objects["fedlwf"].instance(client)
        replay = run.plugins.objects["fedreplay"].instance(client)
        assert sorted(ewc.importances) == list(range(trained))
        assert lwf.lwf.expcount == trained
        assert (len(replay.storage_policy.buffer) > 0) == (trained > 0)


def test_fedreplay_says_it_is_random_replay_not_fedicarl():
    from fedaval.plugins.avalanche_bridge import FedReplay

    assert "random experience replay" in FedReplay.description and "not FediCaRL" in FedReplay.description
