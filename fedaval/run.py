"""A run: configuration, plugins, data, scenario, server and clients."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedaval import core, offload
from fedaval.api import default_out_dir  # noqa: F401  (its old home)
from fedaval.backends import make_backend
from fedaval.client import Client
from fedaval.config import RunConfig
from fedaval.datasets import ImageData, load_dataset
from fedaval.errors import FedavalUsageError
from fedaval.models import split_model
from fedaval.options import build_options
from fedaval.plugin_manager import get_plugin_manager, load_plugins
from fedaval.scenarios import get_scenario
from fedaval.scenarios.partition import Partition
from fedaval.server import Server
from fedaval.streams import new_classes


def resolve_device(name: str) -> torch.device:
    """``auto`` (CUDA when present), ``cpu``, ``cuda`` or ``cuda:i``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            raise FedavalUsageError(f"--device {name}: no CUDA device is available; use auto or cpu")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise FedavalUsageError(
                f"--device {name}: only {torch.cuda.device_count()} CUDA device(s); allowed cuda:0..cuda:{torch.cuda.device_count() - 1}"
            )
        return torch.device(name)
    raise FedavalUsageError(f"bad value --device {name!r}; allowed: auto, cpu, cuda, cuda:<index>")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class Run:
    """Everything a hook may want: ``config``, ``data``, ``partition``,
    ``num_classes``, ``num_tasks``, ``device``, ``server``, ``clients``, and
    where the run is (``task``, 0-based; ``round``, 1-based; 0 before the first).

    Build with :meth:`create`; run with :func:`fedaval.coordinator.train`."""

    def __init__(self, config: RunConfig, extra_plugins: list[Any] = (), out_dir: Path | None = None):
        config.validate()
        self.config = config
        self.pm = get_plugin_manager()
        self.hook = self.pm.hook
        self.round = 0
        self.task = 0
        self.out_dir = out_dir
        self.loggers: dict[str, Any] = {}  # owner tag -> its TensorBoard logger
        self.device = resolve_device(config.device)

        spec = get_scenario(config.scenario)
        raw = {name: dict(values) for name, values in config.plugin_options.items()}
        scenario_values = {**raw.pop(spec.name, {}), **config.scenario_options}
        self.scenario_options = build_options(spec.Options, scenario_values, owner=spec.name)
        self.timer = core.LocalTrainTimer()
        self.plugins = load_plugins(self.pm, config.plugins, raw, extra=[core.CorePlugin(), self.timer, *extra_plugins])
        unused = sorted(set(raw) - set(self.plugins.objects))
        if unused:
            raise FedavalUsageError(
                f"options given for {', '.join(unused)}, which is neither a loaded plugin nor the scenario "
                f"{spec.name!r}; loaded: {', '.join(self.plugins.names)}"
            )

        seed_everything(config.seed)
        self.data: ImageData = load_dataset(config.dataset, config.data_root, config.download)
        self.num_classes = self.data.num_classes
        rng = np.random.default_rng(config.seed)
        self.partition: Partition = spec.build(self.scenario_options, self.data.train_y.numpy(), self.num_classes, rng)
        self.num_tasks = self.partition.num_tasks
        if config.clients_per_round > len(self.partition.clients):
            raise FedavalUsageError(
                f"bad value --clients-per-round {config.clients_per_round}; the scenario has "
                f"{len(self.partition.clients)} clients, so it must be in [0, {len(self.partition.clients)}] (0: all)"
            )
        self.schedule = make_schedule(self.partition, config.rounds_per_task, config.clients_per_round, rng)

        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
        self.backend = make_backend(self)
        self.hook.fedaval_setup(run=self)
        seed_everything(config.seed)  # models start the same whatever the plugins drew
        self.server = Server(self, self._model(None), self.federation_task_classes())
        self.clients = []
        for k, tasks in enumerate(self.partition.clients):
            self.clients.append(Client(self, k, tasks, self._model(k).to(self.device)))
            offload.offload(self, self.clients[-1])  # per --offload-clients, before the next one is built

    def _model(self, client_id: int | None):
        model = self.hook.fedaval_make_model(run=self, client_id=client_id)
        return split_model(model)

    def federation_task_classes(self) -> list[list[int]]:
        """Classes taught at each stage by any client."""
        return [
            sorted({c for client in self.partition.clients if t < client.num_tasks for c in client.classes[t]})
            for t in range(self.num_tasks)
        ]

    def federation_new_classes(self) -> list[list[int]]:
        return new_classes(self.federation_task_classes())

    def rounds_of_task(self, task: int) -> range:
        """Global round numbers (1-based) of stage ``task``."""
        r = self.config.rounds_per_task
        return range(task * r + 1, (task + 1) * r + 1)

    @property
    def total_rounds(self) -> int:
        return self.num_tasks * self.config.rounds_per_task


def make_schedule(
    partition: Partition, rounds_per_task: int, clients_per_round: int, rng: np.random.Generator
) -> list[list[int]]:
    """Clients sampled in each round (index 0 is round 1), drawn up front from
    the seed, so every client knows its first and last round of each task.

    In stage ``t`` only clients that have data for task ``t`` are eligible
    (clients whose stream is shorter sit the later stages out);
    ``clients_per_round`` of them are drawn without replacement (0: all)."""
    schedule = []
    for task in range(partition.num_tasks):
        eligible = [
            k for k, c in enumerate(partition.clients) if task < c.num_tasks and len(c.indices[task]) > 0
        ]
        for _ in range(rounds_per_task):
            if clients_per_round == 0 or clients_per_round >= len(eligible):
                chosen = eligible
            else:
                chosen = sorted(int(k) for k in rng.choice(eligible, size=clients_per_round, replace=False))
            schedule.append(list(chosen))
    return schedule
