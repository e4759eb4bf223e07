"""A run's state (:class:`Run`) and where it is (:class:`RoundInfo`).

:func:`fedaval.build.build_run` builds a run; :func:`fedaval.coordinator.train`
runs it. This module builds nothing and imports no other part of fedaval at
run time, so every module may refer to a run without an import loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from fedaval.client import Client
    from fedaval.config import RunConfig
    from fedaval.datasets import ImageData
    from fedaval.plugin_manager import LoadedPlugins
    from fedaval.scenarios.partition import Partition
    from fedaval.server import Server


@dataclass(frozen=True)
class RoundInfo:
    """Where the federation is: global round ``round`` (1-based) of stage
    ``task`` (0-based), whose rounds run from ``first_round`` to
    ``last_round``. Computed once per round by the coordinator
    (``run.now``); a client's own first and last round of a task may differ
    when clients are sampled (see ``fedaval.core``)."""

    round: int
    task: int
    first_round: int
    last_round: int

    @property
    def task_begins(self) -> bool:
        return self.round == self.first_round

    @property
    def task_ends(self) -> bool:
        return self.round == self.last_round


class Run:
    """A run's state: plain attributes, built by :func:`fedaval.build.build_run`
    and then the first argument of every hook. Nothing here builds anything.

    Set when built:

    * ``config`` (:class:`~fedaval.config.RunConfig`, defaults filled),
      ``out_dir`` (the run folder, or ``None``), ``device``;
    * ``pm`` and ``hook``: the run's plugin manager and its hook relay;
      ``plugins`` (:class:`~fedaval.plugin_manager.LoadedPlugins`: names and
      objects, in registration order);
    * ``data`` (:class:`~fedaval.datasets.ImageData`), ``num_classes``,
      ``augment`` (``--augment`` resolved: ``standard`` or ``none``) and
      ``black`` (the normalised black pixel, augmentation's padding);
    * ``scenarios``, ``datasets``, ``models``: what ``--scenario``,
      ``--dataset`` and ``--model`` may name (the built-ins and what the
      plugins registered, :mod:`fedaval.registries`);
    * ``scenario_options``, ``partition`` (each client's tasks, classes and
      sample indices), ``num_tasks``, ``schedule`` (the clients sampled in
      each round, index 0 is round 1);
    * ``server`` (:class:`~fedaval.server.Server`) and ``clients`` (one
      :class:`~fedaval.client.Client` per partition client, by id);
    * ``loggers``: owner tag -> its TensorBoard logger.

    Where the run is: ``now`` (a :class:`RoundInfo`; ``None`` before the first
    round), ``round`` (1-based; 0 before the first) and ``task`` (0-based).

    Caches the core fills on first use: ``tb_writer`` (the run's one
    ``SummaryWriter``), ``tb_scalars`` (scalars waiting to go out as one event,
    :func:`fedaval.evaluation.add_scalar`), ``device_tensors`` (the dataset's copies on
    ``device``), ``use_device_path`` (``--data-path`` decided), ``test_batches``
    (evaluation's minibatches of the test split, :data:`fedaval.device_data.TEST_BATCH_CACHE_BYTES`),
    ``eval_views`` (each evaluated experience's dataset in its eval view,
    :meth:`fedaval.strategy.FederatedStrategy.eval_dataset_adaptation`), and
    ``offload_folder`` (where ``--offload-clients disk`` writes when the run
    has no folder), ``offload_auto`` (what ``--offload-clients auto`` chose); ``test_experiences`` (the clients' test experiences, one
    per task and set of new classes, by name: :func:`fedaval.streams.shared_test_stream`); ``on_client`` (a progress callback the API sets:
    ``on_client(round, clients trained, clients sampled)``); ``checkpoint_writer``
    (the thread writing the newest checkpoint, :func:`fedaval.checkpoint.wait`); ``task_classes``
    (:meth:`federation_task_classes` with the partition it was computed from)."""

    config: RunConfig
    out_dir: Path | None
    device: torch.device
    pm: Any
    hook: Any
    plugins: LoadedPlugins
    data: ImageData
    num_classes: int
    augment: str
    black: torch.Tensor
    scenarios: dict[str, Any]
    datasets: dict[str, Any]
    models: dict[str, Any]
    scenario_options: Any
    partition: Partition
    num_tasks: int
    schedule: list[list[int]]
    server: Server
    clients: list[Client]

    def __init__(self, config: RunConfig, out_dir: Path | None = None):
        self.config = config
        self.out_dir = out_dir
        self.round = 0
        self.task = 0
        self.now: RoundInfo | None = None
        self.loggers: dict[str, Any] = {}
        self.tb_writer: Any = None
        self.tb_scalars: tuple[int, list[Any]] | None = None  # (step, its Summary.Values) not yet written
        self.device_tensors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.use_device_path: bool | None = None
        self.test_batches: dict[Any, Any] = {}  # fedaval.device_data.TEST_BATCH_CACHE_BYTES
        # experience -> (its dataset, the dataset's eval view): an ObjectCache made by
        # FederatedStrategy.eval_dataset_adaptation on first use
        self.eval_views: Any = None
        self.offload_folder: Path | None = None
        self.offload_auto: str | None = None  # what --offload-clients auto chose (fedaval.offload.policy)
        self.test_experiences: dict[str, Any] = {}  # name -> the clients' shared test experience (or None)
        self.on_client: Any = None  # progress within a round: on_client(round, trained, sampled)
        self.checkpoint_writer: Any = None  # the checkpoint being written in the background (fedaval.checkpoint)
        self.task_classes: tuple[Any, list[list[int]]] | None = None  # (partition, its classes per stage)

    def model(self, client_id: int | None):
        """Client ``client_id``'s model (``None``: the server's), from ``fedaval_make_model``, split."""
        from fedaval.models import split_model

        model = split_model(self.hook.fedaval_make_model(run=self, client_id=client_id))
        if self.config.channels_last:  # --channels-last (fedaval.training): the 4-D weights; .to(device) keeps it
            import torch

            model = model.to(memory_format=torch.channels_last)
        return model

    def federation_task_classes(self) -> list[list[int]]:
        """Classes taught at each stage by any client (a copy: callers may
        change it). Computed once per partition: methods ask for it in every
        minibatch (GLFC's, TARGET's and CFeD's old classes), and with many
        clients the walk over every client's tasks is not free."""
        cached = self.task_classes
        if cached is None or cached[0] is not self.partition:
            classes = [
                sorted({c for client in self.partition.clients if t < client.num_tasks for c in client.classes[t]})
                for t in range(self.num_tasks)
            ]
            self.task_classes = cached = (self.partition, classes)
        return [list(c) for c in cached[1]]

    def federation_seen_classes(self) -> list[int]:
        """Classes taught by any client at the stages up to the current one, sorted."""
        return sorted({c for classes in self.federation_task_classes()[: self.task + 1] for c in classes})

    def federation_new_classes(self) -> list[list[int]]:
        from fedaval.streams import new_classes

        return new_classes(self.federation_task_classes())

    def rounds_of_task(self, task: int) -> range:
        """Global round numbers (1-based) of stage ``task``."""
        r = self.config.rounds_per_task
        return range(task * r + 1, (task + 1) * r + 1)

    def round_info(self, round: int) -> RoundInfo:
        """The :class:`RoundInfo` of global round ``round`` (1-based)."""
        task = (round - 1) // self.config.rounds_per_task
        rounds = self.rounds_of_task(task)
        return RoundInfo(round=round, task=task, first_round=rounds[0], last_round=rounds[-1])

    def enter_round(self, round: int) -> RoundInfo:
        """Make ``round`` the current round (``now``, ``round``, ``task``)."""
        self.now = self.round_info(round)
        self.round, self.task = round, self.now.task
        return self.now

    @property
    def total_rounds(self) -> int:
        return self.num_tasks * self.config.rounds_per_task
