"""The federated loop: tasks, rounds, sampled clients, fusion, evaluation."""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fedaval import checkpoint
from fedaval.atomic import atomic_write_json
from fedaval.backends.local import Backend, ClientRound, LocalBackend
from fedaval.errors import (
    NO_ROOM,
    DiskFull,
    FedavalUsageError,
    PluginError,
    RunFailure,
    RunInterrupted,
    RunStopped,
    implementers,
)
from fedaval.evaluation import (
    STREAM_ACC,
    STREAM_BWT,
    STREAM_FORGETTING,
    accuracy_on,
    add_scalar,
    backward_transfer,
    client_accuracies,
    client_accuracy_on,
    continual_utility,
    exp_acc_key,
    forgetting,
    mean_or_none,
    scalar,
    summarise,
    write_scalars,
)
from fedaval.offload import offload_idle
from fedaval.payload import Upload, merge_entries, payload_nbytes
from fedaval.privacy import privacy_results
from fedaval.run import Run


def run_round(run: Run, round: int, backend: Backend | None = None) -> dict[str, Any]:
    """One federated round. The order of hook calls, in one place:

    0. ``run.now`` is the round's :class:`~fedaval.run.RoundInfo`; at the
       first round of a stage, ``fedaval_server_task_start(run, task)`` (in
       :func:`train`, before this function)
    1. server: ``download = {"weights": shared global weights, **extras}``;
       per sampled client, ``fedaval_server_download(run, client, download)``
       adds that client's own entries
    2. for each client sampled this round (``backend`` runs them: in id
       order in this process by default; each client in its own random
       streams, see :mod:`fedaval.backends`):

       a. ``client.task`` becomes the round's task; the core loads
          ``download["weights"]`` into the client's shared keys;
          ``fedaval_client_receive(run, client, download)``
       b. ``fedaval_client_train(run, client, round)`` - the core's default runs
          the client's Avalanche strategy once, which calls, through
          :class:`fedaval.strategy.HookBridge`:

          - only in the client's first round of the task:
            ``fedaval_client_train_data(run, client, task)`` (before the
            task's data loader is made), then
            ``fedaval_client_task_start(run, client, task)``
          - per local epoch ``fedaval_client_epoch_start(run, client, epoch)``;
            per minibatch ``fedaval_classify(..., training=True)``,
            ``fedaval_client_criterion(run, client, logits, y)`` (the base
            loss), ``fedaval_client_loss(run, client, batch)`` (extra terms),
            the optimizer step, then ``fedaval_client_step(run, client, batch)``
          - ``fedaval_client_task_end(run, client, task)``: only in the client's last
            round of the task

       c. ``fedaval_client_upload(run, client)`` -> the client's :class:`Upload`

       A client whose steps a-c raise, or whose loss terms or upload are not
       finite, has failed: under ``--on-client-failure drop`` it is left out
       of this round's fusion (a warning names it; the round's
       ``failed_clients`` lists it); under ``fail`` the run stops.

    3. server: ``fedaval_server_fuse_weights(run, uploads, global_weights)`` (FedAvg by
       default), loaded into the global model; then
       ``fedaval_server_fuse(run, uploads, round)``, whose entries join the next
       download; at the last round of a stage, then
       ``fedaval_server_task_end(run, task)``
    4. on the evaluation schedule: the clients trained since their last
       evaluation (each inside ``fedaval_client_evaluate(run, client)``) and,
       unless ``fedaval_federation_model`` says the federation's model is the
       clients' models, the global model are evaluated with Avalanche's
       metrics (``fedaval_classify(..., training=False)``); then
       ``fedaval_round_metrics(run, round)``, each plugin's result kept under
       its name (the record's ``plugin_metrics``). Every round records its
       computation seconds (local training + fusion, no evaluation) and its
       communication seconds (bytes up + down at ``--link-mbps``).

    Rounds are numbered from 1. Set-up hooks (``fedaval_setup``,
    ``fedaval_make_model``, ``fedaval_shared_keys``,
    ``fedaval_client_avalanche_plugins``) run once, before round 1;
    ``fedaval_teardown(run)`` once when the run stops.
    """
    hook = run.hook
    backend = backend or LocalBackend()
    start = time.perf_counter()
    now = run.enter_round(round)
    sampled = run.schedule[round - 1]
    download = run.server.download()
    extras = {k: client_extras(run, k, download) for k in sampled}
    bytes_down = payload_nbytes(download) * len(sampled) + sum(payload_nbytes(e) for e in extras.values())
    uploads: list[Upload] = []
    losses: dict[str, list[float]] = {}
    failed: list[dict[str, Any]] = []
    seconds_local = 0.0
    on_client = run.on_client  # progress within a round (fedaval.api sets it)
    if on_client is not None:
        on_client(round, 0, len(sampled))
    for done, result in enumerate(backend.train_clients(run, sampled, download, round, extras), 1):
        seconds_local += result.seconds
        if on_client is not None:
            on_client(round, done, len(sampled))
        if result.failure is not None:
            failed.append(client_failed(run, result, round))
            continue
        for name, value in result.losses.items():
            losses.setdefault(name, []).append(value)
        assert result.upload is not None, "a client round that did not fail has an upload"
        uploads.append(result.upload)
    if sampled and len(failed) == len(sampled):
        raise RunFailure(f"all {len(sampled)} sampled clients failed in round {round}; first: {failed[0]['reason']}")
    fuse_start = time.perf_counter()
    run.server.fuse(uploads, round)
    task_end = now.task_ends
    if task_end:
        hook.fedaval_server_task_end(run=run, task=now.task)
    seconds_fusion = time.perf_counter() - fuse_start

    record: dict[str, Any] = {
        "task": now.task,
        "round": round,
        "task_end": task_end,
        "clients": list(sampled),
        "failed_clients": failed,
        "bytes_up": sum(u.nbytes for u in uploads),
        "bytes_down": bytes_down,
        "losses": {name: sum(v) / len(v) for name, v in losses.items()},
    }
    eval_start = time.perf_counter()
    if task_end or round % run.config.eval_every == 0 or round == run.total_rounds:
        record.update(evaluate(run, round))
        record["plugin_metrics"] = plugin_round_metrics(run, round)
    _write(run, lambda: offload_idle(run, round))  # --offload-clients disk writes into the run folder
    record["seconds_local"] = seconds_local
    record["seconds_fusion"] = seconds_fusion
    record["seconds_computation"] = seconds_local + seconds_fusion
    record["seconds_communication"] = communication_seconds(
        record["bytes_up"] + record["bytes_down"], run.config.link_mbps
    )
    record["seconds_eval"] = time.perf_counter() - eval_start
    record["seconds"] = time.perf_counter() - start
    return record


def client_extras(run: Run, client_id: int, download: dict[str, Any]) -> dict[str, Any]:
    """What ``fedaval_server_download`` adds to the broadcast for this client."""
    extra = merge_entries(
        run.hook.fedaval_server_download(run=run, client=run.clients[client_id], download=download),
        "download",
        run.pm,
        "fedaval_server_download",
    )
    clash = sorted(set(extra) & set(download))
    if clash:
        raise PluginError(
            f"fedaval_server_download may not replace broadcast entries: {', '.join(clash)} "
            f"(implemented by {implementers(run.pm, 'fedaval_server_download')})"
        )
    return extra


def communication_seconds(nbytes: int, link_mbps: float) -> float:
    """Seconds to send ``nbytes`` one after another over one link of
    ``link_mbps`` Mbit/s (10^6 bits per second): FedProK's tau1 of a round."""
    return nbytes * 8 / (link_mbps * 1e6)


FEDERATION_MODELS = ("global", "clients")


def federation_model(run: Run) -> str:
    """What the run's methods call the federation's model
    (``fedaval_federation_model``): ``"global"`` or ``"clients"``."""
    value = run.hook.fedaval_federation_model(run=run)
    if value not in FEDERATION_MODELS:
        raise FedavalUsageError(
            f"bad value {value!r} from fedaval_federation_model; allowed: {', '.join(FEDERATION_MODELS)}"
        )
    return value


#: Round keys that describe the global model; ``None`` when the federation's
#: model is the clients' models.
GLOBAL_MODEL_KEYS = (
    "global_accuracy",
    "global_task_accuracy",
    "avalanche_forgetting",
    "avalanche_bwt",
    "a_glo",
    "stability",
    "plasticity",
    "utility",
)


def plugin_round_metrics(run: Run, round: int) -> dict[str, dict[str, Any]]:
    """``fedaval_round_metrics`` of every plugin, under the plugin's name
    (``{"gldp": {"gldp_a_loc_gp": 0.8}}``), so a plugin cannot overwrite the
    core's keys (``global_accuracy``, ``bytes_up``) or another plugin's.

    The implementations are called one by one, in pluggy's order, to know
    whose result is whose (a plain hook call returns the results unnamed)."""
    caller = run.hook.fedaval_round_metrics
    kwargs = {"run": run, "round": round}
    out: dict[str, dict[str, Any]] = {}
    for impl in reversed(caller.get_hookimpls()):
        values = impl.function(*(kwargs[name] for name in impl.argnames))
        if values:
            out.setdefault(impl.plugin_name, {}).update(metric_values(impl.plugin_name, values))
    return out


def metric_values(plugin: str, values: Any) -> dict[str, Any]:
    """A plugin's round metrics as JSON numbers (a one-element tensor is read
    out); anything else is a :class:`~fedaval.errors.PluginError` naming the
    plugin, where it was a traceback in the JSON writer, or a string written
    to results.json that TensorBoard dropped."""
    import numbers

    import torch

    if not isinstance(values, dict):
        raise PluginError(
            f"plugin {plugin!r}: fedaval_round_metrics returned a {type(values).__name__}; expected a dict"
        )
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise PluginError(
                f"plugin {plugin!r}: fedaval_round_metrics returned {key!r} = {value!r:.40}; "
                "expected a number (or None)"
            )
        # a NumPy scalar as the JSON number it stands for
        out[key] = value if value is None else int(value) if isinstance(value, numbers.Integral) else float(value)
    return out


def evaluate(run: Run, round: int) -> dict[str, Any]:
    """The round's evaluation, for every method.

    The clients' models, each on its own seen classes (Avalanche's metrics;
    clients not trained since their last evaluation keep their last result):
    ``client_accuracy``, their mean ``mean_client_accuracy`` (= GLDP's
    ``a_loc``), and ``a_sel`` the same mean over the clients sampled this round.

    The global model, on every class the federation has seen - only when the
    federation's model is a global model (``fedaval_federation_model``
    returns ``"global"``, the default); otherwise these keys are ``None``
    and the server's model is not evaluated:

    * ``global_accuracy`` (Avalanche's stream accuracy) and
      ``global_task_accuracy`` (accuracy on each stage's new classes, the
      accuracy-matrix row); ``avalanche_forgetting`` / ``avalanche_bwt``:
      Avalanche's ``StreamForgetting`` / ``StreamBWT``;
    * ``a_glo`` (GLDP): mean over clients of the global model's accuracy on
      the classes that client has seen;
    * ``stability`` / ``plasticity`` (FedProK): global accuracy on the classes
      of earlier stages / of the current stage; ``utility`` = lambda *
      stability + (1 - lambda) * plasticity (``--utility-lambda``).

    ``forgetting`` and ``bwt`` are added by :func:`train`, from the accuracy
    matrix."""
    record: dict[str, Any] = dict.fromkeys(GLOBAL_MODEL_KEYS)
    if federation_model(run) == "global":  # the server first, then the clients
        metrics = run.server.evaluate()
        predicted, labels = run.server.predictions.predictions()  # from the evaluation above
        new = run.federation_new_classes()
        earlier = [c for t in range(run.task) for c in new[t]]
        stability = accuracy_on(predicted, labels, earlier)
        plasticity = accuracy_on(predicted, labels, new[run.task])
        record.update(
            global_accuracy=scalar(metrics, STREAM_ACC),
            global_task_accuracy=[scalar(metrics, exp_acc_key(t)) for t in range(run.task + 1)],
            avalanche_forgetting=scalar(metrics, STREAM_FORGETTING),
            avalanche_bwt=scalar(metrics, STREAM_BWT),
            a_glo=mean_or_none(client_accuracy_on(run, c, predicted, labels) for c in run.clients if c.tasks_started),
            stability=stability,
            plasticity=plasticity,
            utility=continual_utility(stability, plasticity, run.config.utility_lambda),
        )
    client_acc = client_accuracies(run, round)
    sampled = set(run.schedule[round - 1])
    record.update(
        client_accuracy={str(k): v for k, v in client_acc.items()},
        mean_client_accuracy=mean_or_none(client_acc.values()),
        a_loc=mean_or_none(client_acc.values()),
        a_sel=mean_or_none(v for k, v in client_acc.items() if k in sampled),
    )
    return record


def new_results(run: Run) -> dict[str, Any]:
    """results.json before the first round."""
    return {
        "config": run.config.to_dict(),
        "scenario": {
            "num_tasks": run.num_tasks,
            "federation_task_classes": run.federation_task_classes(),
            "client_task_classes": [c.classes for c in run.partition.clients],
            "client_task_samples": [[len(i) for i in c.indices] for c in run.partition.clients],
            **run.partition.summary,  # sthfl: samples_per_client, data_fraction_used, effective_imbalance
        },
        "plugins": run.plugins.names,
        "options": resolved_options(run),
        "fedaval_version": fedaval_version(),
        "fedaval_source": fedaval_source(),
        "federation_model": federation_model(run),
        "rounds": [],
        "tasks": [],
        "final": None,
    }


def note_threads(results: dict[str, Any], backend: Any) -> None:
    """Add the torch threads this process trains the clients with to
    results.json's ``torch_threads`` (one entry per count, in the order the
    run's processes met them; a resumed run may add one). On the CPU the
    thread count changes results: float sums split over other threads round
    otherwise, and training carries the difference on, as another seed
    would (docs/report.md); results.json did not say it before session 36."""
    import torch

    threads = getattr(backend, "client_threads", None) or torch.get_num_threads()
    counts = results.setdefault("torch_threads", [])
    if threads not in counts:
        counts.append(threads)


def resolved_options(run: Run) -> dict[str, dict[str, Any]]:
    """Every option of the run's plugins and its scenario as the run read it,
    defaults included (config.json keeps what was given): what
    ``fedaval report`` compares, so a default that changes between versions
    (``fcl-random.tasks`` in session 34) cannot make two settings look one."""
    import dataclasses

    owners = {name: getattr(obj, "options", None) for name, obj in run.plugins.objects.items()}
    owners[run.config.scenario] = run.scenario_options
    return {
        name: json.loads(json.dumps(dataclasses.asdict(options), default=str))
        for name, options in owners.items()
        if dataclasses.is_dataclass(options) and not isinstance(options, type)
    }


@functools.cache
def fedaval_version() -> str:
    """The installed package's version, and the commit of the source tree it
    runs from when that is a git checkout (``0.1.0+g5dd2c22``); asked once a
    process (``--seeds`` runs several)."""
    import subprocess
    from importlib.metadata import PackageNotFoundError, version
    from pathlib import Path

    try:
        text = version("fedaval")
    except PackageNotFoundError:
        text = "unknown"
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return f"{text}+g{commit}" if commit else text


@functools.cache
def fedaval_source() -> str:
    """A digest of the fedaval package's Python source (its files' paths and
    contents; 16 hex digits), asked once a process: two runs of the same
    code have the same digest whatever commit they were made at, so a
    report row whose runs span commits that changed only docs or tests is
    not called mixed (``fedaval_version`` names the commit)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


@dataclass(frozen=True)
class TimeLimit:
    """``--time-limit``: ``seconds`` counted from ``start`` (``time.monotonic()``
    when the command began, so that reading the data and building the clients
    count too, as they do for a batch scheduler's wall-clock limit).

    :func:`train` stops before a round that might not end in time: when the
    time left is less than the run's longest round so far (the records'
    ``seconds``, rounds before a resume included) plus what its last
    checkpoint kept training waiting. So a round is never cut off by the
    limit, at the price of stopping up to one longest round early; a run
    always trains at least its first round. The state after the last finished
    round is then checkpointed (when the schedule had not already), and
    ``--resume`` goes on from it with nothing lost."""

    seconds: float
    start: float

    def left(self) -> float:
        return self.start + self.seconds - time.monotonic()

    def reached(self, results: dict[str, Any], checkpoint_wait: float) -> bool:
        """Whether the next round should not start (never before any round ran)."""
        return bool(results["rounds"]) and self.left() < longest_round(results) + checkpoint_wait


def longest_round(results: dict[str, Any]) -> float:
    """The seconds of the longest round in ``results`` (at least one)."""
    return max(r["seconds"] for r in results["rounds"])


def train(
    run: Run,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    results: dict[str, Any] | None = None,
    backend: Backend | None = None,
    time_limit: TimeLimit | None = None,
) -> dict[str, Any]:
    """Run every task and round. With an output folder, after each round: its
    record is appended to ``rounds.jsonl`` (:data:`ROUNDS_FILE`), a checkpoint
    is taken on the ``--checkpoint-every`` schedule
    (:class:`fedaval.checkpoint.Schedule`; written in the
    background, :func:`fedaval.checkpoint.save_in_background`), and
    results.json is rewritten on its own schedule (:class:`ResultsSchedule`:
    after round 1, each stage's last round and the run's last round, and
    otherwise once enough time has passed), so an interrupted run keeps what
    it finished and can resume.

    results.json's ``status`` says how far the run got (:func:`set_status`):
    ``running`` while rounds remain, ``complete`` after the last one,
    ``failed`` or ``interrupted`` (Ctrl-C, SIGTERM) when it stopped early.
    A full disk while writing stops the run with a :class:`RunFailure`
    naming the resume command; the previous results.json and checkpoint stay.

    With ``time_limit`` (:class:`TimeLimit`) the run may stop between two
    rounds, its state checkpointed: :class:`RunStopped`, status ``stopped``.

    ``results`` (from :func:`fedaval.checkpoint.restore`) continues a run
    after the rounds it already holds. A run that is already complete gets
    its results.json rewritten from them (it may have been damaged).
    ``backend`` runs the clients' rounds (default: the one ``--backend``
    names, :func:`fedaval.backends.make_backend`)."""
    from fedaval.backends import make_backend

    results = new_results(run) if results is None else results
    backend = backend or make_backend(run)
    note_threads(results, backend)
    set_status(run, results, "running")
    restore_sigint = None
    try:
        if run.out_dir is not None:  # the rounds so far (a resumed run: those of its checkpoint)
            _write(run, lambda: rewrite_rounds(run.out_dir, results["rounds"]))
        _train_rounds(run, results, on_round, backend, time_limit)
        set_status(run, results, "complete")
        results["final"] = final_summary(results)
        out = run.out_dir
        if out is not None:
            _write(run, lambda: checkpoint.wait(run))
            _write(run, lambda: atomic_write_json(out / "results.json", results))
    except DiskFull:
        raise  # nothing more can be written; the last good files stay as they are
    except KeyboardInterrupt:
        restore_sigint = ignore_sigint()  # a second Ctrl-C would break off the writes below with a traceback
        _mark_stopped(run, results, "interrupted")
        raise RunInterrupted(interrupted_message(run, results)) from None
    except RunStopped:
        assert time_limit is not None, "only a time limit stops a run this way"
        _mark_stopped(run, results, "stopped")
        raise RunStopped(stopped_message(run, results, time_limit)) from None
    except BaseException:
        _mark_stopped(run, results, "failed")
        raise
    finally:
        try:
            _finish_writes(run)
        finally:
            try:
                run.hook.fedaval_teardown(run=run)
            finally:
                if restore_sigint is not None:
                    restore_sigint()
    return results


def ignore_sigint() -> Callable[[], None] | None:
    """Ignore Ctrl-C while an interrupted run writes where it stopped (and
    its plugins tear down); returns what puts the previous handler back
    (``None`` off the main thread, where signals cannot be set)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous)

    return restore


def _finish_writes(run: Run) -> None:
    """When the run stops: the background checkpoint written (its error, if
    any, was raised already or is logged), TensorBoard's events flushed."""
    try:
        checkpoint.wait(run)
    except OSError as exc:
        logging.getLogger("fedaval").warning("the newest checkpoint could not be written (%s)", exc)
    if run.tb_writer is not None:
        write_scalars(run)
        run.tb_writer.flush()


#: The per-round records, one JSON object per line, appended after each round.
ROUNDS_FILE = "rounds.jsonl"


def append_round(out_dir, record: dict[str, Any]) -> None:
    """Append one round's record to ``rounds.jsonl`` (flushed, not synced: a
    kill can leave at most an unfinished last line, which
    :func:`read_rounds` skips and a resume rewrites)."""
    with open(out_dir / ROUNDS_FILE, "a") as fh:
        fh.write(json.dumps(record) + "\n")


def rewrite_rounds(out_dir, rounds: list[dict[str, Any]]) -> None:
    """Replace ``rounds.jsonl`` by ``rounds`` (atomically): at the start of a
    run, or of a resumed one, whose file may hold rounds after its checkpoint."""
    from fedaval.atomic import atomic_file

    with atomic_file(out_dir / ROUNDS_FILE, "w") as fh:
        fh.writelines(json.dumps(record) + "\n" for record in rounds)


def read_rounds(out_dir) -> list[dict[str, Any]]:
    """The records of ``rounds.jsonl`` (an unfinished last line, left by a kill, is skipped)."""
    from pathlib import Path

    records = []
    with open(Path(out_dir) / ROUNDS_FILE) as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            records.append(json.loads(line))
    return records


class ResultsSchedule:
    """When results.json is rewritten during training: after round 1 (the
    folder then holds a run), after each stage's last round, after the run's
    last round, and otherwise when at least :attr:`SECONDS` have passed since
    the last rewrite, and at least :attr:`COST_FACTOR` times as long as that
    rewrite took (so rewriting a file that grows with the rounds costs at
    most about 1/COST_FACTOR of the run's time). ``rounds.jsonl`` has every
    round as soon as it is done; results.json is the summary, complete when
    the run stops."""

    SECONDS = 10.0
    COST_FACTOR = 20.0

    def __init__(self):
        self.last = time.perf_counter()
        self.cost = 0.0

    def due(self, run: Run, record: dict[str, Any]) -> bool:
        round = record["round"]
        if round == 1 or record["task_end"] or round == run.total_rounds:
            return True
        return time.perf_counter() - self.last >= max(self.SECONDS, self.COST_FACTOR * self.cost)

    def write(self, run: Run, results: dict[str, Any]) -> None:
        # a checkpoint that failed stops the run here; one still being written is not waited
        # for (results.json is often ahead of the newest checkpoint: a resume rewrites it)
        checkpoint.raise_if_failed(run)
        start = time.perf_counter()
        assert run.out_dir is not None, "only a run with a folder writes results.json"
        atomic_write_json(run.out_dir / "results.json", results)
        self.last = time.perf_counter()
        self.cost = self.last - start


def final_summary(results: dict[str, Any]) -> dict[str, Any]:
    """results.json's ``final`` block from its rounds and stages so far."""
    matrix = [t["accuracy"] for t in results["tasks"]]
    return summarise(results["rounds"], matrix, results.get("federation_model", "global"))


def _train_rounds(
    run: Run,
    results: dict[str, Any],
    on_round: Callable[[dict[str, Any]], None] | None,
    backend: Backend,
    time_limit: TimeLimit | None = None,
) -> None:
    """The rounds :func:`train` has left to run, appended to ``results``."""
    matrix: list[list[float | None] | None] = [t["accuracy"] for t in results["tasks"]]
    done = len(results["rounds"])
    schedule = ResultsSchedule()
    checkpoints = checkpoint.Schedule(run)
    checkpointed = done  # the round whose state the newest checkpoint holds (a resume: the one loaded)
    for task in range(run.num_tasks):
        rounds = [r for r in run.rounds_of_task(task) if r > done]
        for round in rounds:
            if time_limit is not None and time_limit.reached(results, checkpoints.cost):
                # nothing of the next round has run yet: the state is the last finished round's
                if run.out_dir is not None and checkpointed != round - 1:
                    _write(run, lambda: checkpoints.save(run, results))
                raise RunStopped
            if round == run.rounds_of_task(task)[0]:
                run.enter_round(round)
                run.server.begin_task(task)
                run.hook.fedaval_server_task_start(run=run, task=task)
            try:
                record = run_round(run, round, backend)
            except DiskFull:
                raise  # its message already says what is kept and how to go on
            except RunFailure as exc:
                raise type(exc)(f"{exc}{resume_hint(run)}") from exc  # of its own class: a PluginError stays one
            if "mean_client_accuracy" in record:  # evaluated: forgetting and BWT so far
                rows = [*matrix, record["global_task_accuracy"]]
                record["forgetting"] = forgetting(rows)
                record["bwt"] = backward_transfer(rows)
            results["rounds"].append(record)
            if record["task_end"]:
                row = record.get("global_task_accuracy")
                matrix.append(row)
                results["tasks"].append(
                    {
                        "task": task,
                        "accuracy": row,
                        "global_accuracy": record.get("global_accuracy"),
                        "mean_client_accuracy": record.get("mean_client_accuracy"),
                    }
                )
            privacy = privacy_results(run)
            if privacy is not None:
                results["privacy"] = privacy
            set_status(run, results, "running" if round < run.total_rounds else "complete")
            write_results = run.out_dir is not None and schedule.due(run, record)
            if write_results or record["task_end"]:  # the summary is only read there (O(rounds), not every round)
                results["final"] = final_summary(results)
            log_round(run, record, results["final"])
            if run.out_dir is not None:
                _write(run, lambda: append_round(run.out_dir, record))  # noqa: B023 - called at once
                if checkpoints.due(run, round, record["task_end"]):
                    _write(run, lambda: checkpoints.save(run, results))
                    checkpointed = round
                if write_results:
                    _write(run, lambda: schedule.write(run, results))
            if on_round is not None:
                on_round(record)


def set_status(run: Run, results: dict[str, Any], state: str) -> None:
    """results.json's ``status``: ``{"state": running | complete | failed |
    interrupted, "rounds_done": n, "rounds_total": N}``."""
    results["status"] = {"state": state, "rounds_done": len(results["rounds"]), "rounds_total": run.total_rounds}


def _mark_stopped(run: Run, results: dict[str, Any], state: str) -> None:
    """Record in results.json that the run stopped early, where one was
    written already (a folder whose first round never finished stays free for
    a new run). Best effort: a full disk keeps the last good file."""
    set_status(run, results, state)
    results["final"] = final_summary(results)
    target = None if run.out_dir is None else run.out_dir / "results.json"
    if target is not None and target.exists():
        try:
            checkpoint.wait(run)
        except OSError:
            pass
        try:
            atomic_write_json(target, results)
        except OSError:
            pass


def _write(run: Run, write: Callable[[], Any]) -> None:
    """Do one write of the run folder; a full disk (or quota) is a
    :class:`DiskFull` that says how to go on once there is space."""
    try:
        write()
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        try:
            checkpoint.wait(run)  # the checkpoint being written in the background, if any
        except OSError:
            pass
        latest = checkpoint.saved(run.out_dir) if run.out_dir is not None else []
        then = (
            f"the last good results.json and the checkpoint of round {latest[0][0]} are kept; free some space, "
            f"then continue with: fedaval train --resume {run.out_dir}"
            if latest
            else f"no checkpoint was saved yet, so the run cannot be resumed: free some space, remove {run.out_dir} "
            "(or give another --out) and start it again"
        )
        raise DiskFull(
            f"no space left on the device of {run.out_dir} after round {run.round} ({exc.strerror}); {then}"
        ) from None


def interrupted_message(run: Run, results: dict[str, Any]) -> str:
    _finish_writes(run)
    done = len(results["rounds"])
    where = f"interrupted in round {done + 1} of {run.total_rounds} ({done} complete)"
    if run.out_dir is None:
        return where
    latest = checkpoint.saved(run.out_dir)
    if not latest:
        return f"{where}; no checkpoint was saved yet, so the run starts over with a new --out"
    return (
        f"{where}; the run folder {run.out_dir} is intact (newest checkpoint: round {latest[0][0]}); "
        f"continue with: fedaval train --resume {run.out_dir}"
    )


def stopped_message(run: Run, results: dict[str, Any], time_limit: TimeLimit) -> str:
    _finish_writes(run)
    done = len(results["rounds"])
    where = (
        f"stopped after round {done} of {run.total_rounds} by --time-limit {time_limit.seconds:g}: "
        f"{max(time_limit.left(), 0):.1f} s left, the longest round took {longest_round(results):.1f} s"
    )
    if run.out_dir is None:
        return where
    return f"{where}; the run folder {run.out_dir} holds round {done}'s checkpoint; continue with: fedaval train --resume {run.out_dir}"


def client_failed(run: Run, result: ClientRound, round: int) -> dict[str, Any]:
    """Apply ``--on-client-failure`` to a failed client round: stop the run,
    or warn and return the entry for the round's ``failed_clients``."""
    if run.config.on_client_failure == "fail":
        raise RunFailure(f"client {result.client_id} failed in round {round}: {result.failure}") from result.error
    logging.getLogger("fedaval").warning(
        "round %d: client %d left out of fusion (--on-client-failure drop): %s", round, result.client_id, result.failure
    )
    return {"client": result.client_id, "reason": result.failure}


def resume_hint(run: Run) -> str:
    if run.out_dir is None:
        return ""
    _finish_writes(run)
    latest = checkpoint.saved(run.out_dir)
    if not latest:
        return "; no checkpoint was saved"
    return f"; resume from round {latest[0][0]} with: fedaval train --resume {run.out_dir}"


ROUND_SCALARS = (
    "bytes_up",
    "bytes_down",
    "seconds",
    "seconds_local",
    "seconds_fusion",
    "seconds_eval",
    "seconds_computation",
    "seconds_communication",
    "global_accuracy",
    "mean_client_accuracy",
    "forgetting",
    "bwt",
    "a_glo",
    "a_loc",
    "a_sel",
    "stability",
    "plasticity",
    "utility",
)


#: ``final`` figures logged at each stage's end: the running averages over the stages so far.
STAGE_SCALARS = ("average_accuracy", "average_client_accuracy")


def log_round(run: Run, record: dict[str, Any], final: dict[str, Any] | None = None) -> None:
    """Round-level figures to TensorBoard, next to Avalanche's metrics; at a
    stage's end also the averages over the stages so far (``final``)."""
    if run.out_dir is None:
        return
    step = record["round"]
    for key in ROUND_SCALARS:
        if record.get(key) is not None:
            add_scalar(run, f"Fed/{key}", record[key], step)
    for name, value in record["losses"].items():
        add_scalar(run, f"Fed/{name}", value, step)
    if record["task_end"] and final:
        for key in STAGE_SCALARS:
            if final.get(key) is not None:
                add_scalar(run, f"Fed/{key}", final[key], step)
    for plugin, values in record.get("plugin_metrics", {}).items():
        for name, value in values.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                add_scalar(run, f"Fed/{plugin}/{name}", value, step)
    write_scalars(run)  # the round's scalars, Avalanche's included, as one event
    # no flush per round: the writer's thread flushes every few seconds (run_writer), and train() when the run stops
