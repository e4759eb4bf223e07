"""Avalanche's end-of-task work happens once per task, though a task spans many rounds."""

from __future__ import annotations

from avalanche.training.plugins import EWCPlugin, LwFPlugin, ReplayPlugin

from fedaval import hookimpl
from fedaval.api import run_training


class AttachAvalanche:
    """Attaches real Avalanche plugins to every client and watches them."""

    name = "attach"

    def __init__(self):
        self.ewc, self.lwf, self.replay = {}, {}, {}
        self.old_class_batches = {}  # (client, round) -> minibatches holding a task-0 class

    @hookimpl
    def fedaval_client_avalanche_plugins(self, run, client):
        self.ewc[client.id] = EWCPlugin(ewc_lambda=1.0)
        self.lwf[client.id] = LwFPlugin()
        self.replay[client.id] = ReplayPlugin(mem_size=20)
        return [self.ewc[client.id], self.lwf[client.id], self.replay[client.id]]

    @hookimpl
    def fedaval_client_loss(self, run, client, batch):
        old = set(client.tasks.classes[0])
        if run.task == 1 and any(int(y) in old for y in batch.y):
            key = (client.id, run.round)
            self.old_class_batches[key] = self.old_class_batches.get(key, 0) + 1


def test_avalanche_plugins_see_one_experience_per_task(tiny_config):
    probe = AttachAvalanche()
    run_training(tiny_config(rounds_per_task=3), extra_plugins=[probe])
    for k in (0, 1):
        # EWC keyed its importances by the experience counter: one entry per task, not per round
        assert sorted(probe.ewc[k].importances) == [0, 1]
        # LwF snapshot taken (once per task: its counter of seen experiences)
        assert probe.lwf[k].lwf.prev_model is not None
        # the replay buffer was filled at the end of task 0 and of task 1
        assert len(probe.replay[k].storage_policy.buffer) == 20
        # and the replay dataloader served old classes in EVERY round of task 1, not only its first
        assert all(probe.old_class_batches.get((k, r), 0) > 0 for r in (4, 5, 6))


class CountTaskEnds:
    name = "count"

    def __init__(self):
        self.clock_counters = []

    @hookimpl
    def fedaval_client_task_end(self, run, client, task):
        self.clock_counters.append((client.id, task, client.strategy.clock.train_exp_counter))


def test_avalanche_clock_counts_tasks_not_rounds(tiny_config):
    probe = CountTaskEnds()
    run_training(tiny_config(rounds_per_task=3), extra_plugins=[probe])
    # task_end runs before Avalanche's clock ticks: counter == number of tasks finished before
    assert probe.clock_counters == [(0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)]


def test_the_federations_classes_per_stage_are_computed_once_per_partition(tiny_config):
    """Methods read them in every minibatch: walked over every client's tasks once, then copied."""
    import copy

    from fedaval.build import build_run

    run = build_run(tiny_config())
    first = run.federation_task_classes()
    assert first == [
        sorted({c for client in run.partition.clients if t < client.num_tasks for c in client.classes[t]})
        for t in range(run.num_tasks)
    ]
    first[0].append(99)  # a caller's change stays the caller's
    run.partition.clients[0].classes[0] = [99]  # not walked again for the same partition
    assert run.federation_task_classes() != first and 99 not in run.federation_task_classes()[0]
    run.partition = copy.deepcopy(run.partition)  # another partition: walked again
    assert 99 in run.federation_task_classes()[0]
