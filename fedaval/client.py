"""A federated client: one Avalanche strategy over its own task stream.

The client's model, optimizer, Avalanche plugins (memories, teachers) and
evaluator are built once and live for the whole run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedaval.scenarios.partition import ClientTasks
from fedaval.strategy import Batch, FederatedStrategy, HookBridge

if TYPE_CHECKING:
    from fedaval.run import Run

__all__ = ["Client", "Batch"]


class Client:
    """Client ``id``: its model, strategy, task stream and test experiences.

    ``task`` is the task the client is on (or last trained); ``tasks_started``
    the tasks it has trained on so far. ``train_stream[t]`` and
    ``test_stream[t]`` are Avalanche experiences; ``test_stream[t]`` holds the
    test samples of the classes task ``t`` teaches this client for the first
    time, or is ``None`` when it teaches none."""

    def __init__(self, run: Run, client_id: int, tasks: ClientTasks, model: nn.Module):
        from fedaval.evaluation import make_evaluator
        from fedaval.streams import make_test_stream, make_train_stream

        self.run = run
        self.id = client_id
        self.tasks = tasks
        self.model = model
        self.task = 0
        self.tasks_started: list[int] = []
        self.train_stream = make_train_stream(run.data, tasks.indices)
        self.test_stream = make_test_stream(run.data, tasks.classes)
        self.shared_keys: list[str] = list(run.hook.fedaval_shared_keys(run=run, model=model))
        self.bridge = HookBridge(run, self)
        method_plugins = [p for result in run.hook.fedaval_avalanche_plugins(run=run, client=self) for p in (result or [])]
        config = run.config
        self.strategy = FederatedStrategy(
            run=run,
            owner=client_id,
            model=model,
            optimizer=torch.optim.SGD(
                model.parameters(), lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
            ),
            criterion=nn.CrossEntropyLoss(),
            train_mb_size=config.batch_size,
            train_epochs=config.local_epochs,
            eval_mb_size=256,
            device=run.device,
            plugins=[self.bridge, *method_plugins],
            evaluator=make_evaluator(run, f"client{client_id:03d}"),
            eval_every=-1,
        )
        self.last_eval: dict[str, Any] | None = None
        self.evaluated_at = -1  # round of the last evaluation
        self.trained_at = -1  # round of the last local training

    def num_samples(self, task: int | None = None) -> int:
        task = self.task if task is None else task
        return len(self.tasks.indices[task]) if task < self.tasks.num_tasks else 0

    def has_task(self, task: int) -> bool:
        return task < self.tasks.num_tasks and len(self.tasks.indices[task]) > 0

    def seen_classes(self) -> list[int]:
        return sorted({c for t in self.tasks_started for c in self.tasks.classes[t]})

    # --- the round --------------------------------------------------------
    def receive(self, download: dict[str, Any]) -> None:
        """Load the shared weights of the broadcast, then let plugins read the rest."""
        weights = download.get("weights") or {}
        if weights:
            state = self.model.state_dict()
            with torch.no_grad():
                for key in self.shared_keys:
                    if key in weights:
                        state[key].copy_(weights[key])
        self.run.hook.fedaval_client_receive(run=self.run, client=self, download=download)

    def train_round(self, round: int, task: int, begins: bool, ends: bool) -> dict[str, float]:
        """One local round: a single ``strategy.train()`` call on task ``task``."""
        self.task = task
        if begins and task not in self.tasks_started:
            self.tasks_started.append(task)
        self.strategy.task_begins = begins
        self.strategy.task_ends = ends
        self.strategy.train(self.train_stream[task], eval_streams=[])
        self.trained_at = round
        return self.bridge.round_losses()

    def shared_state(self) -> dict[str, torch.Tensor]:
        """The shared keys' current values (what FedAvg uploads)."""
        state = self.model.state_dict()
        return {key: state[key].detach().clone() for key in self.shared_keys}

    def evaluate(self) -> dict[str, Any]:
        """Avalanche metrics of this client's model on its seen test experiences."""
        exps = [self.test_stream[t] for t in sorted(self.tasks_started) if self.test_stream[t] is not None]
        if not exps:
            return {}
        self.last_eval = self.strategy.eval(exps)
        return self.last_eval
