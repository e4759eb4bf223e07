"""A federated client: one Avalanche strategy over its own task stream.

The client's model, optimizer, Avalanche plugins (memories, teachers) and
evaluator are built once and live for the whole run.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedaval.atomic import atomic_file
from fedaval.payload import copies, copy_into
from fedaval.random_streams import client_rng, copy_streams, swap_streams
from fedaval.scenarios.partition import ClientTasks
from fedaval.stash import Stash
from fedaval.strategy import Batch, FederatedStrategy, HookBridge

if TYPE_CHECKING:
    from fedaval.run import Run
    from fedaval.state import KeptStorages

__all__ = ["Client", "Batch"]


class Client:
    """Client ``id``: its model, strategy, task stream and test experiences.

    ``task`` is the task the client is on (or last trained); ``tasks_started``
    the tasks it has trained on so far. ``train_stream[t]`` and
    ``test_stream[t]`` are Avalanche experiences; ``test_stream[t]`` holds the
    test samples of the classes task ``t`` teaches this client for the first
    time, or is ``None`` when it teaches none; clients with the same task and
    new classes share one test experience (``run.test_experiences``).

    ``stash`` holds the plugins' per-client state (:mod:`fedaval.stash`).

    A client not needed for a while can be *offloaded* (:meth:`offload`): its
    heavy parts (model, strategy with optimizer, Avalanche plugins and
    evaluator, streams, random streams, the plugins' stash) become one pickle held in memory or in
    a file, and come back the first time anything reads one of them, so code
    that uses ``client.model`` never needs to know. In memory, the pickle
    keeps the tensors' storages by reference (:class:`fedaval.state.KeptStorages`)
    rather than copying their bytes into it."""

    HEAVY = ("model", "strategy", "bridge", "train_stream", "test_stream", "rng", "stash", "_task_experience")

    def __init__(self, run: Run, client_id: int, tasks: ClientTasks, model: nn.Module):
        from fedaval.evaluation import PredictionRecorder, make_evaluator
        from fedaval.streams import make_train_stream, shared_test_stream
        from fedaval.training import make_optimizer

        self.run = run
        self.id = client_id
        self.tasks = tasks
        self.model = model
        self.task = 0
        self.tasks_started: list[int] = []
        self.stash = Stash()
        self._task_experience = None  # the current task's training experience (see train_round)
        self.train_stream = make_train_stream(run.data, tasks.indices)
        self.test_stream = shared_test_stream(run, tasks.classes)  # the run's objects, shared with other clients
        self.shared_keys: list[str] = list(run.hook.fedaval_shared_keys(run=run, model=model))
        self.bridge = HookBridge(run, self)
        method_plugins = [
            p for result in run.hook.fedaval_client_avalanche_plugins(run=run, client=self) for p in (result or [])
        ]
        config = run.config
        self.strategy = FederatedStrategy(
            run=run,
            client=self,
            model=model,
            optimizer=make_optimizer(model.parameters(), config),
            criterion=nn.CrossEntropyLoss(),
            train_mb_size=config.batch_size,
            train_epochs=config.local_epochs,
            eval_mb_size=256,
            device=run.device,
            plugins=[self.bridge, *method_plugins, *([PredictionRecorder()] if config.client_test == "train" else [])],
            evaluator=make_evaluator(run, f"client{client_id:03d}"),
            eval_every=-1,
        )
        self.last_eval: dict[str, Any] | None = None
        self.evaluated_at = -1  # round of the last evaluation
        self.trained_at = -1  # round of the last local training
        self.rng = client_rng(config.seed, client_id, run.device)
        # offloaded: (pickle, kept storages) in memory, a file, or (format of old checkpoints) the pickle alone
        self._offloaded: tuple[bytes, KeptStorages] | Path | bytes | None = None

    # --- offloading ---------------------------------------------------------
    @property
    def offloaded(self) -> bool:
        return self.__dict__.get("_offloaded") is not None

    def offload(self, folder: Path | None = None) -> int:
        """Replace the heavy parts by their pickle, kept in memory with their
        tensors' storages (by reference, not copied), or written whole to
        ``folder/client-NNNNNN.state`` when ``folder`` is given. Returns the
        bytes stored (pickle and storages).

        What the parts share with the run (its data, plugin objects) and the
        plugins' ``nn.Module`` attributes (HGP's frozen backbone, shared by
        every client's model) are written as references, not copied, so the
        loaded client shares them again. The modules are held as they were
        at the offload: a plugin that replaces its module later leaves the
        offloaded client the one it had, as a live client keeps it."""
        from fedaval import state

        if self.offloaded:
            return 0
        heavy = {k: self.__dict__[k] for k in self.HEAVY}
        keep = state.KeptStorages() if folder is None else None
        modules = state.plugin_modules(self.run)
        blob = state.dumps(self.run, heavy, extra={"client": self, **modules}, keep=keep)
        for key in self.HEAVY:
            del self.__dict__[key]
        self._offload_refs = modules  # the plugins' modules it shares, as they are now (they may be replaced)
        if keep is not None:
            self._offloaded = (blob, keep)
        else:
            assert folder is not None
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"client-{self.id:06d}.state"
            with atomic_file(path, sync=False) as fh:  # scratch state: the checkpoints are the durable copy
                fh.write(blob)
            self._offloaded = path
        return self.stored_nbytes

    def materialise(self) -> None:
        """Load the heavy parts back (on the device they were on)."""
        from fedaval import state

        where, self._offloaded = self._offloaded, None
        assert where is not None, "materialise() is for an offloaded client"
        keep = None
        if isinstance(where, tuple):
            blob, keep = where
        else:
            blob = where.read_bytes() if isinstance(where, Path) else where
        modules = self.__dict__.pop("_offload_refs", None) or {}  # none in checkpoints before session 34
        self.__dict__.update(state.loads(self.run, blob, extra={"client": self, **modules}, keep=keep))

    @property
    def stored_nbytes(self) -> int:
        """Bytes an offloaded client's state takes (its pickle and kept storages); 0 when live."""
        where = self.__dict__.get("_offloaded")
        if isinstance(where, tuple):
            return len(where[0]) + where[1].nbytes
        if isinstance(where, Path):
            return where.stat().st_size
        return 0 if where is None else len(where)

    def __getattr__(self, name: str) -> Any:
        # only called when ordinary lookup fails: an offloaded heavy part
        if name in Client.HEAVY and self.__dict__.get("_offloaded") is not None:
            self.materialise()
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # a checkpoint holds an offloaded client's pickle itself, not its file name; kept
        # storages pickle as their raw bytes (KeptStorages.__reduce_ex__)
        saved = dict(self.__dict__)
        if isinstance(saved.get("_offloaded"), Path):
            saved["_offloaded"] = saved["_offloaded"].read_bytes()
        return saved

    def num_samples(self, task: int | None = None) -> int:
        task = self.task if task is None else task
        return len(self.tasks.indices[task]) if task < self.tasks.num_tasks else 0

    def has_task(self, task: int) -> bool:
        return task < self.tasks.num_tasks and len(self.tasks.indices[task]) > 0

    def seen_classes(self) -> list[int]:
        return sorted({c for t in self.tasks_started for c in self.tasks.classes[t]})

    def train_class_mix(self) -> dict[int, int]:
        """Training samples of each class over the tasks this client has
        trained (``--client-test train`` weighs its test accuracy by them)."""
        import torch

        counts: dict[int, int] = {}
        for t in self.tasks_started:
            idx = torch.as_tensor(self.tasks.indices[t], dtype=torch.long)
            classes, sizes = torch.unique(self.run.data.train_y.cpu()[idx], return_counts=True)
            for c, n in zip(classes.tolist(), sizes.tolist()):
                counts[c] = counts.get(c, 0) + n
        return counts

    @contextmanager
    def rng_scope(self, keep_draws: bool = True) -> Iterator[None]:
        """Make this client's random streams the global ones (Python, NumPy,
        torch CPU and the run's CUDA device) while the block runs, then keep
        where they got to and put the run's back (:func:`swap_streams`).
        Whatever the client draws (data order, dropout, a plugin's sampling)
        is then independent of the other clients and of the order in which
        they run. With ``keep_draws=False`` the client's streams are put back
        as they were before the block: its draws leave no trace."""
        before = None if keep_draws else copy_streams(self.rng)
        outside = swap_streams(self.rng, self.run.device)
        try:
            yield
        finally:
            self.rng = swap_streams(outside, self.run.device)
            if before is not None:
                self.rng = before

    # --- the round --------------------------------------------------------
    def receive(self, download: dict[str, Any]) -> None:
        """Load the shared weights of the broadcast, then let plugins read the rest."""
        weights = download.get("weights") or {}
        if weights:
            state = self.model.state_dict()
            keys = [key for key in self.shared_keys if key in weights]
            copy_into([state[key] for key in keys], [weights[key] for key in keys])
        self.run.hook.fedaval_client_receive(run=self.run, client=self, download=download)

    def train_round(self, round: int, task: int, begins: bool, ends: bool) -> dict[str, torch.Tensor]:
        """One local round: a single ``strategy.train()`` call on task ``task``.

        At the client's first round of the task (``begins``) the task's
        training experience is made: its own samples plus what
        ``fedaval_client_train_data`` adds; later rounds of the task reuse it."""
        self.task = task
        if begins and task not in self.tasks_started:
            self.tasks_started.append(task)
        self.strategy.task_begins = begins
        self.strategy.task_ends = ends
        if begins or self._task_experience is None:
            self._task_experience = self.training_experience(task)
        self.strategy.train(self._task_experience, eval_streams=[])
        if ends:
            self._task_experience = None
        self.trained_at = round
        return self.bridge.round_losses()

    def training_experience(self, task: int):
        """Task ``task``'s experience with the plugins' extra training data
        (:func:`fedaval.hookspecs.fedaval_client_train_data`) added."""
        from fedaval.streams import with_extra_data

        own = self.train_stream[task]
        extras = [
            e for e in self.run.hook.fedaval_client_train_data(run=self.run, client=self, task=task) if e is not None
        ]
        return with_extra_data(self.run.data, own, self.tasks.indices[task], extras) if extras else own

    def shared_state(self) -> dict[str, torch.Tensor]:
        """The shared keys' current values (what FedAvg uploads)."""
        state = self.model.state_dict()
        return dict(zip(self.shared_keys, copies([state[key] for key in self.shared_keys])))

    def seen_test_experiences(self) -> list[Any]:
        """The test experiences of the classes this client has trained on
        (:meth:`seen_classes`): one per task it started, holding the classes
        that task taught it first *among the tasks it trained*. A task it
        never trained (not sampled in any of its stage's rounds) teaches it
        nothing, so a class that came first in such a task and again in a
        later one it trained is tested with the later one. ``test_stream``
        assigns each class to the first task of the client's whole list,
        trained or not: evaluated over the started tasks it left such a
        class out of the client's accuracy while ``a_glo`` counted it."""
        from fedaval.streams import shared_test_stream

        started = set(self.tasks_started)
        if all(t in started for t in range(max(started, default=-1) + 1)):
            stream = self.test_stream  # no task skipped: the same experiences
        else:
            trained = [classes if t in started else [] for t, classes in enumerate(self.tasks.classes)]
            stream = shared_test_stream(self.run, trained)
        return [stream[t] for t in sorted(started) if stream[t] is not None]

    def evaluate(self) -> dict[str, Any]:
        """Avalanche metrics of this client's model on its seen test
        experiences (:meth:`seen_test_experiences`; what the core's
        ``fedaval_client_evaluate`` runs)."""
        exps = self.seen_test_experiences()
        if not exps:
            return {}
        return self.strategy.eval(exps)
