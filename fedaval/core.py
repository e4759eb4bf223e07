"""The core's own hook implementations: defaults a method may override.

Registered in every run next to the plugins, all ``trylast`` except the
timing wrapper, so any plugin that implements the same hook wins.
"""

from __future__ import annotations

import time

from fedaval import hookimpl


class CorePlugin:
    """Default model (``--model``), federation model (``"global"``) and
    local training (one Avalanche ``train()`` call per round), and the
    wall-clock of each client's training."""

    name = "core"

    @hookimpl(trylast=True)
    def fedaval_make_model(self, run, client_id):
        from fedaval.models import build_model

        return build_model(run.config.model, run.data.input_shape, run.num_classes)

    @hookimpl(trylast=True)
    def fedaval_federation_model(self, run):
        return "global"

    @hookimpl(trylast=True)
    def fedaval_local_train(self, run, client, round):
        task = run.task
        rounds = [r for r in run.rounds_of_task(task) if client.id in run.schedule[r - 1]]
        return client.train_round(round, task, begins=round == rounds[0], ends=round == rounds[-1])


class LocalTrainTimer:
    """Times every client's local training (a ``wrapper=True`` hook), for the
    ``seconds_local`` figure of each round."""

    name = "timer"

    def __init__(self):
        self.seconds = 0.0

    @hookimpl(wrapper=True)
    def fedaval_local_train(self, run, client, round):
        start = time.perf_counter()
        try:
            return (yield)
        finally:
            self.seconds += time.perf_counter() - start
