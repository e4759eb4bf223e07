"""Checkpoints after rounds, and resuming a run from the newest one.

A checkpoint is the whole state of a run after a completed round, in one file
``RUN_DIR/checkpoints/round-NNNNNN.ckpt``:

* every client object (model, optimizer, Avalanche strategy with its plugins'
  memories and teachers, the dataloader kept for the rest of a task, the
  evaluator's metric history), saved through :mod:`fedaval.state`;
* the server (global model, the next download's extras, its evaluator);
* each plugin's state (``state_dict()`` where the plugin has one, else its
  attributes);
* the run's random number generators (Python, NumPy, torch, the CUDA device);
* results.json's content so far.

The run's objects go into one pickle (so an object shared by a plugin and a
client is still shared after resuming), their tensors' storages beside it, each
written as its raw bytes (:class:`fedaval.state.KeptStorages`); the results,
plain data, are pickled beside them without the run's references, so their
cost stays that of plain ``pickle``. The run itself (configuration, dataset,
partition, schedule) is not stored: resuming rebuilds it from ``config.json``
with the same seed, then loads the checkpoint over it. A checkpoint is
therefore read by the fedaval version and plugins that wrote it; it is not an
archive format.

Files are written to a temporary name, synced and renamed, so a kill at any
moment leaves the previous complete checkpoint; the newest
``--keep-checkpoints`` are kept.

During training (:func:`save_in_background`) the run's objects are pickled to
bytes at the end of the round, with a copy of their tensors' storages (they
change in the next round), and the rest (writing the storages and the results,
syncing, renaming, pruning) happens in a background thread while the next
round trains; :func:`wait` joins it (before the next checkpoint, before
results.json is rewritten, and when the run stops) and raises its error, if
any (a full disk), there.
"""

from __future__ import annotations

import io
import pickle
import re
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fedaval import state
from fedaval.atomic import atomic_file
from fedaval.client import rng_state, set_rng_state
from fedaval.errors import FedavalUsageError

if TYPE_CHECKING:
    from fedaval.run import Run

FORMAT = 4  # still read: 1, one RunPickler pickle holding the results too; 2, the storages inside "state"; 3, typed kept storages
FOLDER = "checkpoints"
_NAME = re.compile(r"^round-(\d{6})\.ckpt$")


def path_for(out_dir: Path, round: int) -> Path:
    return out_dir / FOLDER / f"round-{round:06d}.ckpt"


def saved(out_dir: Path) -> list[tuple[int, Path]]:
    """``(round, path)`` of the checkpoints in a run folder, newest first."""
    folder = out_dir / FOLDER
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found, reverse=True)


#: ``--checkpoint-every auto``: at most one checkpoint per this many seconds
#: between stage ends ...
AUTO_SECONDS = 60.0
#: ... and per this many times the seconds the last checkpoint kept training waiting.
AUTO_COST_FACTOR = 50.0


class Schedule:
    """When a round's checkpoint is taken (``--checkpoint-every``).

    * ``N`` (an integer): after every N-th round and after the last round;
      ``0``: never.
    * ``auto`` (the default): after the last round of every stage, after the
      run's last round, and otherwise after the first round that ends at
      least :data:`AUTO_SECONDS` after the previous checkpoint began (or the
      start of training), and at least :data:`AUTO_COST_FACTOR` times as long
      as that checkpoint kept training waiting (pickling the run's objects,
      :meth:`save`). So checkpoints between stage ends stall training for at
      most about 2% of its time, however many clients a checkpoint holds
      (1000 live ``cnn`` clients took about 1.5 s to pickle on the 2-core
      machine in session 17: one checkpoint per 75 s). Rounds longer than the interval are
      checkpointed every round, as with ``1``; short rounds (digits:
      milliseconds) do not pay for pickling the run's objects every round.
      The price: a run stopped mid-stage resumes from up to that interval
      (plus one round) back. Which rounds are checkpointed depends on the
      clock, but what a resumed run computes does not: it is bit-identical to
      an uninterrupted run from any checkpoint.
    """

    def __init__(self, run: Run):
        self.every = run.config.checkpoint_every
        self.last = time.perf_counter()
        self.cost = 0.0  # seconds the last checkpoint kept training waiting

    def due(self, run: Run, round: int, task_end: bool) -> bool:
        if self.every == "auto":
            interval = max(AUTO_SECONDS, AUTO_COST_FACTOR * self.cost)
            due = task_end or round == run.total_rounds or time.perf_counter() - self.last >= interval
        else:
            every = int(self.every)
            due = every > 0 and (round % every == 0 or round == run.total_rounds)
        if due:
            self.last = time.perf_counter()
        return due

    def save(self, run: Run, results: dict[str, Any]) -> Path:
        """:func:`save_in_background`, timed for the next :meth:`due`."""
        start = time.perf_counter()
        path = save_in_background(run, results)
        self.cost = time.perf_counter() - start
        return path


def snapshot(run: Run, results: dict[str, Any]) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of round ``run.round`` as plain data: the run's objects
    already pickled (bytes, with the run's references), a copy of their
    tensors' storages (:class:`fedaval.state.KeptStorages`), and a shallow copy of
    ``results`` (its round and task records are never changed once added)."""
    objects = {
        "clients": run.clients,
        "server": run.server,
        "plugins": {name: plugin_state(obj) for name, obj in run.plugins.objects.items()},
        "rng": rng_state(run.device),
    }
    buffer = io.BytesIO()
    storages = state.KeptStorages(copy=True)
    state.dump(run, objects, buffer, keep=storages)
    results = dict(results, rounds=list(results.get("rounds", [])), tasks=list(results.get("tasks", [])))
    content = {
        "format": FORMAT,
        "round": run.round,
        "task": run.task,
        "state": buffer.getvalue(),
        "storages": storages,
        "results": results,
    }
    assert run.out_dir is not None, "only a run with a folder is checkpointed"
    return path_for(run.out_dir, run.round), content


def _write_snapshot(path: Path, content: dict[str, Any], keep: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as fh, state.no_cyclic_gc():  # a collection here would hold the GIL from training
        pickle.dump(content, fh, protocol=state.PROTOCOL)
    for _, old in saved(path.parent.parent)[keep:]:
        old.unlink(missing_ok=True)


def save(run: Run, results: dict[str, Any]) -> Path:
    """Write the checkpoint of round ``run.round`` atomically; prune old ones."""
    wait(run)
    path, content = snapshot(run, results)
    _write_snapshot(path, content, run.config.keep_checkpoints)
    return path


class _Writer(threading.Thread):
    def __init__(self, path: Path, content: dict[str, Any], keep: int):
        super().__init__(name=f"fedaval-checkpoint-{path.name}", daemon=True)
        self.args = (path, content, keep)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            _write_snapshot(*self.args)
        except BaseException as exc:  # noqa: BLE001 - raised in the main thread by wait()
            self.error = exc


def save_in_background(run: Run, results: dict[str, Any]) -> Path:
    """:func:`save`, with the run's objects pickled now and the file written
    by a background thread (:func:`wait` joins it)."""
    wait(run)
    path, content = snapshot(run, results)
    writer = _Writer(path, content, run.config.keep_checkpoints)
    run.checkpoint_writer = writer
    writer.start()
    return path


def wait(run: Run) -> None:
    """Join the checkpoint being written in the background, if any; raise its error."""
    writer = getattr(run, "checkpoint_writer", None)
    if writer is None:
        return
    writer.join()
    run.checkpoint_writer = None
    if writer.error is not None:
        raise writer.error


def restore(run: Run, path: Path) -> dict[str, Any]:
    """Load checkpoint ``path`` over a freshly built ``run``; return the results so far."""
    with open(path, "rb") as fh:
        content = state.load(run, fh)  # formats 2 to 4 hold no references here: this is plain pickle.load
    if not isinstance(content, dict) or content.get("format") not in range(1, FORMAT + 1):
        raise FedavalUsageError(f"{path} is not a fedaval checkpoint of format 1 to {FORMAT}")
    if content["format"] > 1:
        content = {**state.loads(run, content["state"], keep=content.get("storages")), **content}
    run.clients = content["clients"]
    run.server = content["server"]
    run.round = content["round"]
    run.task = content["task"]
    for name, saved_state in content["plugins"].items():
        if name in run.plugins.objects:
            load_plugin_state(run.plugins.objects[name], saved_state)
    set_rng_state(content["rng"], run.device)
    return content["results"]


def restore_latest(run: Run) -> tuple[int, dict[str, Any]]:
    """Restore the newest readable checkpoint of ``run.out_dir``: ``(round, results)``.

    A checkpoint that cannot be read (a disk error, a file copied in half) is
    skipped for the one before it, with a warning."""
    import logging

    errors = []
    assert run.out_dir is not None, "only a run with a folder is checkpointed"
    for round, path in saved(run.out_dir):
        try:
            return round, restore(run, path)
        except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ImportError) as exc:
            logging.getLogger("fedaval").warning("checkpoint %s cannot be read (%s); trying an older one", path, exc)
            errors.append(f"{path.name}: {exc}")
    raise FedavalUsageError(
        f"--resume {str(run.out_dir)!r}: no readable checkpoint in {FOLDER}/ ({'; '.join(errors) or 'none saved'})"
    )


def plugin_state(plugin: Any) -> dict[str, Any] | None:
    """What a checkpoint keeps of a plugin: its ``state_dict()``, else its attributes.

    A plugin registered as a module has no per-run state (``None``)."""
    if isinstance(plugin, ModuleType):
        return None
    if callable(getattr(plugin, "state_dict", None)):
        return plugin.state_dict()
    return dict(vars(plugin))


def load_plugin_state(plugin: Any, saved_state: dict[str, Any] | None) -> None:
    if saved_state is None:
        return
    if callable(getattr(plugin, "load_state_dict", None)):
        plugin.load_state_dict(saved_state)
    else:
        vars(plugin).update(saved_state)
