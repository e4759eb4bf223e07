"""Building a run: what ``fedaval train`` does before the first round.

:func:`build_run` validates the configuration, loads the plugins and the data,
partitions it into the scenario's client task streams, draws the schedule of
sampled clients, calls ``fedaval_setup``, and builds the server and every
client. The result is a :class:`fedaval.run.Run`, plain state. Where the
clients' rounds run (the backend, :func:`fedaval.backends.make_backend`) is
the caller's choice, passed to :func:`fedaval.coordinator.train`.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedaval import core, cuda_graphs, cuda_streams, host_memory, offload, registries, stacked, state
from fedaval.client import Client
from fedaval.config import RunConfig
from fedaval.datasets import load_dataset
from fedaval.errors import NO_ROOM, FedavalUsageError, choice_error
from fedaval.options import build_options
from fedaval.plugin_manager import get_plugin_manager, load_plugins
from fedaval.run import Run
from fedaval.scenarios.partition import Partition
from fedaval.server import Server
from fedaval.training import black, check_compile, check_precision, resolve_augment

log = logging.getLogger("fedaval")


def build_run(config: RunConfig, extra_plugins: Sequence[Any] = (), out_dir: Path | None = None) -> Run:
    """The :class:`Run` that ``config`` describes, ready for its first round.

    ``extra_plugins`` are plugin objects registered after ``config.plugins``
    (tests add probes this way); ``out_dir`` is the run folder (``None``: no
    results, checkpoints or TensorBoard are written)."""
    config.validate()
    run = Run(config, out_dir)
    run.device = resolve_device(config.device)
    cuda_graphs.check_device(config.cuda_graphs, config.device, run.device)
    check_precision(config, run.device)
    check_compile(config, run.device)
    cuda_streams.check(config, run.device)
    use_deterministic_algorithms(config.deterministic)
    host_memory.apply(config.host_memory)
    run.pm = get_plugin_manager()
    run.hook = run.pm.hook

    raw = {name: dict(values) for name, values in config.plugin_options.items()}
    scenario_values = {**raw.pop(config.scenario, {}), **config.scenario_options}
    run.plugins = load_plugins(run.pm, config.plugins, raw, extra=[core.CorePlugin(), *extra_plugins])
    cuda_graphs.check_scope(config, run)
    stacked.check(config, run)
    run.scenarios = registries.collect(run.pm, "scenarios")
    run.datasets = registries.collect(run.pm, "datasets")
    run.models = registries.collect(run.pm, "models")
    if config.model != "auto" and config.model not in run.models:  # checked even where a plugin builds the model
        raise choice_error("model", config.model, ["auto"] + sorted(run.models))
    spec = registries.lookup(run.scenarios, "scenario", config.scenario)
    run.scenario_options = build_options(spec.Options, scenario_values, owner=spec.name)
    unused = sorted(set(raw) - set(run.plugins.objects))
    if unused:
        raise FedavalUsageError(
            f"options given for {', '.join(unused)}, which is neither a loaded plugin nor the scenario "
            f"{spec.name!r}; loaded: {', '.join(run.plugins.names)}"
        )

    seed_everything(config.seed)
    run.data = load_dataset(config.dataset, config.data_root, config.download, run.datasets)
    run.num_classes = run.data.num_classes
    run.augment = config.augment = resolve_augment(config.augment, run.data)
    run.black = black(run.data).to(run.device)  # used every minibatch: a copy each time would wait for the GPU
    rng = np.random.default_rng(config.seed)
    run.partition = spec.build(run.scenario_options, run.data.train_y.numpy(), run.num_classes, rng)
    run.num_tasks = run.partition.num_tasks
    if config.clients_per_round > len(run.partition.clients):
        raise FedavalUsageError(
            f"bad value --clients-per-round {config.clients_per_round}; the scenario has "
            f"{len(run.partition.clients)} clients, so it must be in [0, {len(run.partition.clients)}] (0: all)"
        )
    warn_empty_clients(run.partition, config.scenario)
    run.schedule = make_schedule(
        run.partition, config.rounds_per_task, config.clients_per_round, rng, config.client_sampling
    )

    if out_dir is not None:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # /proc, a name too long for the file system, a full disk
            raise FedavalUsageError(f"--out {str(out_dir)!r} cannot be made ({exc.strerror})") from None
    run.hook.fedaval_setup(run=run)
    refuse_unread_run_options(run)
    seed_everything(config.seed)  # models start the same whatever the plugins drew
    run.server = Server(run, run.model(None), run.federation_task_classes())
    warn_idle_speed_options(run)
    run.clients = []
    with state.no_cyclic_gc():  # 1000 cnn clients are 3 million objects: collections on the way cost ~2 s
        for k, tasks in enumerate(run.partition.clients):
            run.clients.append(Client(run, k, tasks, run.model(k).to(run.device)))
            cuda_graphs.check_step_plugins(config, run.clients[-1].strategy)
            try:
                offload.offload(run, run.clients[-1])  # per --offload-clients, before the next one is built
            except OSError as exc:
                if exc.errno not in NO_ROOM:
                    raise
                raise FedavalUsageError(
                    f"--offload-clients {config.offload_clients}: no room to offload client {k} ({exc.strerror}); "
                    "nothing was trained"
                ) from None
    return run


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


def use_deterministic_algorithms(on: bool) -> None:
    """``--deterministic``: only deterministic kernels (an error names any
    operation that has none), cuDNN's deterministic convolutions without
    benchmarking, and the cuBLAS workspace setting CUDA needs for them. Off:
    torch's defaults (a GPU run may then differ in the last bits from one
    run to the next)."""
    import os

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    torch.backends.cudnn.benchmark = False


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def refuse_unread_run_options(run: Run) -> None:
    """A one-line error for a run option the loaded methods leave unread:
    ``--utility-lambda`` where the federation's model is the clients' (no
    global model, so no stability, plasticity or utility)."""
    config = run.config
    if config.utility_lambda != RunConfig().utility_lambda and run.hook.fedaval_federation_model(run=run) == "clients":
        raise FedavalUsageError(
            f"--utility-lambda {config.utility_lambda} is not read: the federation model of "
            f"{', '.join(config.plugins)} is the clients' models, with no global model whose utility it weighs"
        )


def warn_idle_speed_options(run: Run) -> None:
    """Warnings for options that cannot act in this run, though allowed in
    it: a learning-rate schedule over a single round (it changes the rate
    between rounds), ``--channels-last`` on a model without a convolution."""
    config = run.config
    if config.lr_schedule != "constant" and len(run.schedule) <= 1:
        log.warning(
            "--lr-schedule %s changes the learning rate between rounds; this run has %d round, so it trains at --lr",
            config.lr_schedule,
            len(run.schedule),
        )
    if config.channels_last and not any(p.dim() == 4 for p in run.server.model.parameters()):
        log.warning("--channels-last: the model (%s) has no convolution; nothing changes", config.model)


def warn_empty_clients(partition: Partition, scenario: str) -> None:
    """A warning when the scenario leaves clients without a training sample in
    any task (more clients than the dataset can feed, a small Dirichlet
    alpha): they are never sampled, so they train nothing and count in no
    client metric."""
    empty = [k for k, c in enumerate(partition.clients) if not any(len(i) for i in c.indices)]
    if empty:
        log.warning(
            "%d of the %d clients of %s have no training sample in any task (first: client %d): they never train",
            len(empty),
            len(partition.clients),
            scenario,
            empty[0],
        )


def make_schedule(
    partition: Partition,
    rounds_per_task: int,
    clients_per_round: int,
    rng: np.random.Generator,
    sampling: str = "round",
) -> list[list[int]]:
    """Clients sampled in each round (index 0 is round 1), drawn up front from
    the seed, so every client knows its first and last round of each task.

    In stage ``t`` only clients that have data for task ``t`` are eligible
    (clients whose stream is shorter sit the later stages out);
    ``clients_per_round`` of them are drawn without replacement (0: all),
    afresh every round (``sampling="round"``, FedAvg's client sampling) or
    once per task, the same clients in each of its rounds (``"task"``:
    PFCL's Algorithm 1 selects ``C_t`` before its round loop)."""
    schedule: list[list[int]] = []
    for task in range(partition.num_tasks):
        eligible = [k for k, c in enumerate(partition.clients) if task < c.num_tasks and len(c.indices[task]) > 0]
        for r in range(rounds_per_task):
            if clients_per_round == 0 or clients_per_round >= len(eligible):
                chosen = eligible
            elif sampling == "task" and r > 0:
                chosen = schedule[-1]
            else:
                chosen = sorted(int(k) for k in rng.choice(eligible, size=clients_per_round, replace=False))
            schedule.append(list(chosen))
    return schedule
