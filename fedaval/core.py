"""The core's own hook implementations: defaults a method may override.

Registered in every run next to the plugins, all ``trylast``, so any plugin
that implements the same hook wins.
"""

from __future__ import annotations

import torch.nn.functional as F

from fedaval import hookimpl


class CorePlugin:
    """The built-in scenarios, datasets and models (:mod:`fedaval.registries`),
    default model (``--model``), federation model (``"global"``), local
    training (one Avalanche ``train()`` call per round) with the
    cross-entropy as its base loss, and a client's evaluation (Avalanche's
    metrics on its seen classes)."""

    name = "core"

    @hookimpl
    def fedaval_register_scenarios(self, register):
        from fedaval.scenarios import SCENARIOS

        for name, spec in SCENARIOS.items():
            register(name, spec)

    @hookimpl
    def fedaval_register_datasets(self, register):
        from fedaval.datasets import DATASETS

        for name, loader in DATASETS.items():
            register(name, loader)

    @hookimpl
    def fedaval_register_models(self, register):
        from fedaval.models import MODELS

        for name, factory in MODELS.items():
            register(name, factory)

    @hookimpl(trylast=True)
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import build_model

        return build_model(run.config.model, run.data.input_shape, run.num_classes, run.models)

    @hookimpl(trylast=True)
    def fedaval_federation_model(self, run):
        return "global"

    @hookimpl(trylast=True)
    def fedaval_client_train(self, run, client, round):
        """The client's own first and last round of the task are those of the
        stage's rounds it is sampled in; a client that failed before training
        in its first one (in its receive, say) begins the task in the next."""
        now = run.now
        rounds = [r for r in range(now.first_round, now.last_round + 1) if client.id in run.schedule[r - 1]]
        begins = round == rounds[0] or now.task not in client.tasks_started
        return client.train_round(round, now.task, begins=begins, ends=round == rounds[-1])

    @hookimpl(trylast=True)
    def fedaval_client_criterion(self, run, client, logits, y):
        return F.cross_entropy(logits, y)

    @hookimpl(trylast=True)
    def fedaval_client_evaluate(self, run, client):
        return client.evaluate()
