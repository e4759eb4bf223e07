"""Evaluation of every seen experience in one pass (fedaval.one_pass_eval)
gives what Avalanche's per-experience template gives."""

from __future__ import annotations

import pytest
import torch
from avalanche.core import SupervisedPlugin
from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin
from avalanche.training.plugins.clock import Clock
from helpers import strip_timing

from fedaval import hookimpl, one_pass_eval
from fedaval.api import run_training
from fedaval.build import build_run
from fedaval.strategy import FederatedStrategy


def template_only(monkeypatch):
    monkeypatch.setattr(one_pass_eval, "applies", lambda strategy, experiences: False)


@pytest.mark.parametrize("plugins", [["fedavg"], ["gldp"], ["fedprok"]])
def test_one_pass_gives_the_template_results(tiny_config, monkeypatch, plugins):
    """results.json (every accuracy, forgetting and BWT of the server and the
    clients, A_glo/stability/plasticity from the recorded predictions) and
    every later round (the random streams) are the same, over 3 stages."""
    config = dict(plugins=plugins, scenario_options={"clients": 2, "tasks": 3})
    passes = []
    original = one_pass_eval.evaluate
    monkeypatch.setattr(one_pass_eval, "evaluate", lambda s, e: passes.append(len(e)) or original(s, e))
    one_pass = run_training(tiny_config(out=tiny_config().out + "-one", **config))
    assert max(passes) == 3  # the one pass ran, over every seen experience
    template_only(monkeypatch)
    template = run_training(tiny_config(out=tiny_config().out + "-template", **config))
    assert strip_timing(one_pass) == strip_timing(template)


def test_one_pass_keeps_the_clock_and_the_metrics_last_values(tiny_config, monkeypatch):
    """The evaluator's last metrics (what ``eval`` returns), the clock's
    iteration count and the predictions recorded are those of the template."""

    def evaluated(use_template: bool):
        if use_template:
            template_only(monkeypatch)
        run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))
        for task in range(3):
            run.server.begin_task(task)
        torch.manual_seed(5)
        metrics = run.server.evaluate()
        return metrics, run.server.strategy.clock.total_iterations, run.server.predictions.predictions(), torch.rand(1)

    one = evaluated(False)
    template = evaluated(True)
    assert len([k for k in one[0] if "Top1_Acc_Exp" in k]) == 3
    assert one[0] == template[0]
    assert one[1] == template[1] > 0
    assert all(torch.equal(a, b) for a, b in zip(one[2], template[2], strict=True))
    assert torch.equal(one[3], template[3])  # the same random numbers drawn


def test_one_pass_minibatches_run_across_experiences(tiny_config):
    """All seen experiences' samples go through the model in minibatches of
    ``eval_mb_size`` (the template makes one minibatch per experience here)."""
    run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))
    for task in range(3):
        run.server.begin_task(task)
    sizes = []
    strategy = run.server.strategy
    forward = strategy.forward
    strategy.forward = lambda: sizes.append(len(strategy.mb_y)) or forward()
    strategy.eval_mb_size = 100
    run.server.evaluate()
    total = sum(len(run.server.test_stream[t].dataset) for t in range(3))
    assert sizes == [100] * (total // 100) + ([total % 100] if total % 100 else [])


class EvalCallbackPlugin(SupervisedPlugin):
    def __init__(self):
        super().__init__()
        self.iterations = 0

    def after_eval_iteration(self, strategy, **kwargs):
        self.iterations += 1


class AttachEvalCallback:
    name = "attach_eval_callback"

    def __init__(self):
        self.plugins: list[EvalCallbackPlugin] = []

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        self.plugins.append(EvalCallbackPlugin())
        return [self.plugins[-1]]


def test_a_plugin_with_an_evaluation_callback_gets_the_template(tiny_config):
    """An Avalanche plugin that acts per evaluated minibatch is called per
    minibatch, as in Avalanche: its client is evaluated by the template."""
    probe = AttachEvalCallback()
    run_training(tiny_config(), extra_plugins=[probe])
    assert all(plugin.iterations > 0 for plugin in probe.plugins)


def test_which_plugins_act_per_experience():
    assert not one_pass_eval.acts_per_experience(SupervisedPlugin)
    assert not one_pass_eval.acts_per_experience(LwFPlugin)
    assert not one_pass_eval.acts_per_experience(EWCPlugin)
    assert not one_pass_eval.acts_per_experience(ReplayPlugin)
    assert one_pass_eval.acts_per_experience(Clock)  # counts evaluation iterations: the one pass adds them
    assert one_pass_eval.acts_per_experience(EvalCallbackPlugin)


def test_a_subclass_of_the_strategy_gets_the_template(tiny_config, monkeypatch):
    passes = []
    original = one_pass_eval.evaluate
    monkeypatch.setattr(one_pass_eval, "evaluate", lambda s, e: passes.append(type(s)) or original(s, e))
    run = build_run(tiny_config())
    run.server.begin_task(0)
    assert run.server.evaluate() and passes == [FederatedStrategy]

    class Custom(FederatedStrategy):
        pass

    run.server.strategy.__class__ = Custom
    assert run.server.evaluate() and passes == [FederatedStrategy]


@pytest.mark.parametrize("model, shape", [("mlp", (1, 8, 8)), ("cnn", (3, 32, 32))])
def test_scores_do_not_depend_on_the_minibatch(model, shape):
    """What the one pass relies on, on the CPU: a sample's logits in eval mode
    are the same bits whatever else is in its minibatch."""
    from fedaval.models import build_model

    torch.manual_seed(0)
    net = build_model(model, shape, 10).eval()
    experiences = [torch.randn(n, *shape) for n in (72, 75, 300)]
    with torch.no_grad():
        separate = torch.cat([net.classifier(net.features(x)) for x in experiences])
        merged = torch.cat([net.classifier(net.features(x)) for x in torch.cat(experiences).split(256)])
    assert torch.equal(separate, merged)


def test_joined_minibatches_are_kept_for_the_latest_sources(tiny_config):
    """The joined test minibatches are made once per evaluated set of
    experiences; those of a set that has since grown by a task are dropped."""
    run = build_run(tiny_config(scenario_options={"clients": 2, "tasks": 3}))

    def joined_keys():
        return [key for key in run.test_batches if isinstance(key[0], tuple)]

    run.server.begin_task(0)
    run.server.evaluate()
    first = run.test_batches[joined_keys()[0]]
    run.server.evaluate()
    assert run.test_batches[joined_keys()[0]] is first  # reused, not made again
    run.server.begin_task(1)
    run.server.evaluate()
    assert [len(sources) for sources, _ in joined_keys()] == [2]


def test_a_logger_with_a_per_minibatch_callback_gets_the_template(tiny_config):
    """A logger that acts per evaluated minibatch (Avalanche's interactive
    progress bar does) keeps getting the callback: the template evaluates."""
    run = build_run(tiny_config())
    run.server.begin_task(0)
    strategy = run.server.strategy
    assert one_pass_eval.applies(strategy, [run.server.test_stream[0]])

    class ProgressLogger:
        def __init__(self):
            self.iterations = 0

        def log_metrics(self, values):
            pass

        def after_eval_iteration(self, strategy, metric_values, **kwargs):
            self.iterations += 1

    logger = ProgressLogger()
    strategy.evaluator.loggers.append(logger)
    assert not one_pass_eval.applies(strategy, [run.server.test_stream[0]])
    run.server.evaluate()
    assert logger.iterations > 0


def test_eval_restores_each_modules_mode(tiny_config):
    """After ``eval()`` every module is back in its mode of before: all in
    training mode (restored by one ``model.train``), or mixed (a frozen part
    in eval mode), restored module by module."""
    run = build_run(tiny_config())
    run.server.begin_task(0)
    model = run.server.model
    model.train()
    run.server.evaluate()
    assert all(m.training for m in model.modules())
    frozen = next(m for m in model.features.modules() if m is not model.features)
    frozen.eval()
    run.server.evaluate()
    assert {name: m.training for name, m in model.named_modules()} == {
        name: m is not frozen for name, m in model.named_modules()
    }
    model.eval()
    run.server.evaluate()
    assert not any(m.training for m in model.modules())
