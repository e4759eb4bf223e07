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
round trains; :func:`wait` joins it (before the next checkpoint and when the
run stops) and raises its error, if any (a full disk), there. A rewrite of
results.json does not wait for it; it raises the error of one that has ended
with one (:func:`raise_if_failed`).

Where pickling the run's objects keeps training waiting for long (many live
clients: 1000 ``cnn`` clients took 0.7 to 0.95 s on the 2-core machine), the
run's later checkpoints are pickled and written by a forked copy of the
process instead (:class:`Schedule`, :func:`can_fork`): ``fork`` takes a
copy-on-write snapshot of the whole process in about 30 to 40 ms for that
run, and training goes on while the child pickles and writes what the run
held at the fork. The file is the same, byte for byte, as the one written in
the process. What the checkpoint holds that plugin code computes (each
plugin's ``state_dict()``) and the random generators' states are taken in
the process, before the fork: Python's ``random`` reseeds itself in a forked
child, and a plugin's ``state_dict()`` may cache what it computes.
"""

from __future__ import annotations

import errno
import gc
import io
import os
import pickle
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from fedaval import state
from fedaval.atomic import atomic_file
from fedaval.errors import FedavalUsageError, RunFailure
from fedaval.random_streams import rng_state, set_rng_state

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
#: A checkpoint that kept training waiting this long (pickling the run's objects in the
#: process) makes the run's later ones forked (:func:`can_fork`): forking a process of
#: 1.4 GB took 30 to 40 ms on the 2-core machine, one of 0.8 GB (digits) about 20 ms,
#: where digits' in-process pickling takes 2 to 3 ms.
FORK_ABOVE_SECONDS = 0.2


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
      machine in session 17: one checkpoint per 75 s; forked, below, the wait
      is about 0.05 s and the interval the minute). Rounds longer than the interval are
      checkpointed every round, as with ``1``; short rounds (digits:
      milliseconds) do not pay for pickling the run's objects every round.
      The price: a run stopped mid-stage resumes from up to that interval
      (plus one round) back. Which rounds are checkpointed depends on the
      clock, but what a resumed run computes does not: it is bit-identical to
      an uninterrupted run from any checkpoint.

    On either schedule, once a checkpoint has kept training waiting for
    :data:`FORK_ABOVE_SECONDS` or longer, the run's later checkpoints are
    written by a forked child (:func:`can_fork` says where a run may fork):
    training then waits only for the fork.
    """

    def __init__(self, run: Run):
        self.every = run.config.checkpoint_every
        self.last = time.perf_counter()
        self.cost = 0.0  # seconds the last checkpoint kept training waiting
        self.fork = False  # the run's checkpoints are written by a forked child from now on

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
        path = save_in_background(run, results, fork=self.fork)
        self.cost = time.perf_counter() - start
        if not self.fork and self.cost >= FORK_ABOVE_SECONDS and can_fork(run):
            self.fork = True
        return path


def can_fork(run: Run) -> bool:
    """Whether ``run``'s checkpoints may be written by a forked child: not
    with ``--checkpoint-writer thread``; on
    Linux, with the clients in this process (``--backend local``), on the CPU,
    with CUDA not initialised in the process (a forked child cannot use it),
    and with no client offloaded to disk (the child would read an offloaded
    client's file while the next round rewrites it). Elsewhere every
    checkpoint is pickled in the process."""
    import torch

    from fedaval import offload

    return (
        run.config.checkpoint_writer == "auto"
        and sys.platform.startswith("linux")
        and run.config.backend == "local"
        and run.device.type == "cpu"
        and not torch.cuda.is_initialized()
        and offload.policy(run) != "disk"
    )


def run_objects(run: Run) -> dict[str, Any]:
    """What a checkpoint holds of the run besides its results: the clients,
    the server, each plugin's state and the random generators' states."""
    return {
        "clients": run.clients,
        "server": run.server,
        "plugins": {name: plugin_state(obj) for name, obj in run.plugins.objects.items()},
        "rng": rng_state(run.device),
    }


def snapshot(
    run: Run, results: dict[str, Any], objects: dict[str, Any] | None = None, copy: bool = True
) -> tuple[Path, dict[str, Any]]:
    """The checkpoint of round ``run.round`` as plain data: the run's objects
    (``objects``, else :func:`run_objects`) already pickled (bytes, with the
    run's references), their tensors' storages (:class:`fedaval.state.KeptStorages`;
    with ``copy``, copies of them: the next round changes them), and a shallow copy of
    ``results`` (its round and task records are never changed once added)."""
    objects = run_objects(run) if objects is None else objects
    buffer = io.BytesIO()
    storages = state.KeptStorages(copy=copy)
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

    def done(self) -> bool:
        return not self.is_alive()


class _ForkedWriter:
    """A forked child pickling and writing the checkpoint of the round the
    process was in when it forked; :meth:`join` waits for it, and ``error`` is
    what stopped it (an ``OSError`` such as a full disk, raised again in the
    process by :func:`wait`), or a :class:`~fedaval.errors.RunFailure` when it
    was killed.

    The child blocks SIGINT and SIGTERM (a Ctrl-C reaches the whole process
    group): a stopped run still gets the checkpoint it was writing, as the
    background thread's did. It turns the cyclic garbage collector off (a
    collection would write to every object's page, copying the process) and
    leaves with ``os._exit``, so nothing of the process's (atexit handlers,
    buffered output, TensorBoard's writer) runs twice."""

    def __init__(self, run: Run, results: dict[str, Any]):
        assert run.out_dir is not None, "only a run with a folder is checkpointed"
        objects = run_objects(run)  # in this process: plugin code and the generators' states
        self.path = path_for(run.out_dir, run.round)
        self.error: BaseException | None = None
        self._status: int | None = None  # the child's wait status, once it has ended
        keep = run.config.keep_checkpoints
        self._read_end, write_end = os.pipe()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            with warnings.catch_warnings():
                # Python 3.12 warns of fork in a process with threads (TensorBoard's writer,
                # torch's): the child only pickles and writes, taking none of their locks
                warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
                try:
                    self.pid: int | None = os.fork()
                except OSError:  # no memory or process left for it: the caller writes in the process
                    os.close(self._read_end)
                    raise
            if self.pid == 0:  # the child (CPython clears a signal pending at the fork)
                code = 1
                try:
                    code = _child_writes(
                        write_end, lambda: _write_snapshot(*snapshot(run, results, objects, copy=False), keep)
                    )
                finally:
                    os._exit(code)  # whatever happens, never back into the run's own code
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # the process's Ctrl-C, if one came, lands now
            os.close(write_end)

    def done(self) -> bool:
        """Whether the child has ended (without waiting for it)."""
        if self.pid is not None and self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # SIGCHLD ignored: reaped by the kernel; join() reads the pipe
                return True
            if pid != 0:
                self._status = status
        return self.pid is None or self._status is not None

    def join(self) -> None:
        if self.pid is None:
            return
        with os.fdopen(self._read_end, "rb", closefd=False) as pipe:
            report = pipe.read()  # until the child exits
        if self._status is None:
            try:
                self._status = os.waitpid(self.pid, 0)[1]
            except ChildProcessError:  # SIGCHLD ignored, so no exit status: the file tells
                self._status = 0 if self.path.exists() else 256
        os.close(self._read_end)
        self.pid = None
        code = os.waitstatus_to_exitcode(self._status)
        if report:
            try:
                self.error = pickle.loads(report)
            except Exception:  # noqa: BLE001 - an error that does not unpickle is still an error
                self.error = RunFailure(f"writing checkpoint {self.path}: {report[:200]!r}")
        elif code != 0:
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            self.error = RunFailure(f"the process writing checkpoint {self.path} {how}; it was not written")


def _child_writes(report_to: int, write: Any) -> int:
    """In the forked child: ``write()``, any error pickled to ``report_to``;
    the child's exit status (0: written)."""
    try:
        gc.disable()
        write()
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported to the process, which raises it
        try:
            report = pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            report = pickle.dumps(OSError(errno.EIO, f"{type(exc).__name__}: {exc}"))
        try:
            os.write(report_to, report)
        except OSError:
            pass
        return 1


def save_in_background(run: Run, results: dict[str, Any], fork: bool = False) -> Path:
    """:func:`save`, with the run's objects pickled now and the file written
    by a background thread (:func:`wait` joins it); with ``fork``, both by a
    forked child (:class:`_ForkedWriter`; only where :func:`can_fork`)."""
    wait(run)
    if fork:
        try:
            writer: Any = _ForkedWriter(run, results)
        except OSError as exc:
            import logging

            logging.getLogger("fedaval").warning("cannot fork to write a checkpoint (%s); writing it here", exc)
        else:
            run.checkpoint_writer = writer
            return writer.path
    path, content = snapshot(run, results)
    writer = _Writer(path, content, run.config.keep_checkpoints)
    run.checkpoint_writer = writer
    writer.start()
    return path


def raise_if_failed(run: Run) -> None:
    """Raise the error of the checkpoint written in the background if it has
    ended with one; one still being written is not waited for."""
    writer = getattr(run, "checkpoint_writer", None)
    if writer is not None and writer.done():
        wait(run)


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
            results = restore(run, path)
        except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ImportError) as exc:
            logging.getLogger("fedaval").warning("checkpoint %s cannot be read (%s); trying an older one", path, exc)
            errors.append(f"{path.name}: {exc}")
            continue
        check_same_run(run, path, results)
        return round, results
    raise FedavalUsageError(
        f"--resume {str(run.out_dir)!r}: no readable checkpoint in {FOLDER}/ ({'; '.join(errors) or 'none saved'})"
    )


def check_same_run(run: Run, path: Path, results: dict[str, Any]) -> None:
    """A one-line error when checkpoint ``path`` was written by a run of
    another configuration (one copied in from another run folder: a FedProx
    run's state resumed as FedAvg, say); the run folder's place (``out``)
    may differ."""
    from fedaval.config import RunConfig, config_changes

    recorded = results.get("config") if isinstance(results, dict) else None
    if not isinstance(recorded, dict):
        return
    shown = config_changes(RunConfig.from_dict(recorded).to_dict(), run.config.to_dict())
    if shown:
        raise FedavalUsageError(
            f"{path} was written by a run of another configuration ({shown}); it cannot be resumed here"
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
