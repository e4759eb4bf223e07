"""Running a job from Python: what ``fedaval train`` calls."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedaval.config import RunConfig, config_changes
from fedaval.errors import NO_ROOM, DiskFull, FedavalUsageError, RunFailure

if TYPE_CHECKING:
    from fedaval.coordinator import TimeLimit


def run_training(
    settings: dict[str, Any] | RunConfig,
    extra_plugins: Sequence[Any] = (),
    show_progress: bool = False,
    echo: Callable[[str], None] | None = None,
    time_limit: TimeLimit | None = None,
) -> dict[str, Any]:
    """Build a :class:`~fedaval.run.Run` from ``settings`` (the CLI's options
    or a :class:`RunConfig`), train it, and return results.json's content.

    ``extra_plugins`` are plugin objects registered after ``settings.plugins``
    (tests use it to add probes). The run folder is ``settings.out``, or a new
    folder under ``runs/``; an existing folder that holds results is refused,
    so earlier results are never overwritten. ``time_limit``: ``--time-limit``
    (:class:`fedaval.coordinator.TimeLimit`)."""
    from fedaval.atomic import atomic_write_json
    from fedaval.build import build_run

    config = check_settings(settings)
    assert config.out is not None, "check_settings chooses the run folder"
    out_dir = Path(config.out)
    new = _outermost_missing(out_dir)
    try:
        run = build_run(config, extra_plugins=extra_plugins, out_dir=out_dir)
    except BaseException:
        if new is not None:
            _remove_empty_folders(new)  # a refused run leaves no folder behind; any file in it stays
        raise
    try:
        atomic_write_json(out_dir / "config.json", config.to_dict())
    except OSError as exc:
        failure = DiskFull if exc.errno in NO_ROOM else RunFailure
        raise failure(f"cannot write {out_dir / 'config.json'} ({exc.strerror}); nothing was trained") from None
    results = _train(run, None, show_progress, time_limit)
    if echo is not None:
        echo(format_summary(results, out_dir))
    return results


def check_settings(settings: dict[str, Any] | RunConfig) -> RunConfig:
    """The :class:`RunConfig` of ``settings``, validated, with its run folder
    chosen (``out``) and checked, without importing torch: ``fedaval train``
    checks every seed's settings this way before the first run starts."""
    config = settings if isinstance(settings, RunConfig) else RunConfig(**settings)
    config.validate()
    _check_names(config)
    if config.out is not None and not str(config.out).strip():
        raise FedavalUsageError(
            "--out '' names no folder; give a folder for the run, or leave --out out for one under runs/"
        )
    out_dir = Path(config.out) if config.out else default_out_dir(config)
    check_out_dir(out_dir)
    config.out = str(out_dir)
    return config


def _outermost_missing(path: Path) -> Path | None:
    """The outermost folder of ``path`` (itself included) that does not exist
    yet: the one a run creates with its run folder. ``None`` if ``path`` exists."""
    missing = None
    for folder in (path, *path.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _remove_empty_folders(top: Path) -> None:
    """Remove ``top`` and the folders under it, deepest first, if they hold no
    file: what :func:`run_training` created for a run that was refused while
    it was being built (a plugin's set-up raising, say). A folder with any
    file in it is left as it is."""
    import os

    if not top.is_dir():
        return
    for folder, _, _ in os.walk(top, topdown=False):
        try:
            os.rmdir(folder)
        except OSError:
            pass  # not empty: something was written, keep it


def _check_names(config: RunConfig) -> None:
    """Unknown scenario and plugin names, from the registries alone (the
    entry points are listed, not imported). A scenario that is not built in
    may come from a third-party plugin (``fedaval_register_scenarios``): it is
    checked here only when every named plugin is one of fedaval's own, and
    otherwise once the plugins are loaded."""
    from fedaval.plugin_manager import SPEC_FACTORIES, installed_plugins, resolve_plugin
    from fedaval.scenarios import SCENARIOS, get_scenario

    installed = installed_plugins()
    for spec in config.plugins:
        if ":" not in spec and spec not in installed:
            resolve_plugin(spec)  # raises the standard 'unknown plugin' error, importing nothing
    own = all(
        spec.partition(":")[0] in SPEC_FACTORIES or (spec in installed and installed[spec].value.startswith("fedaval."))
        for spec in config.plugins
    )
    if own or config.scenario in SCENARIOS:
        get_scenario(config.scenario)


def default_out_dir(config: RunConfig) -> Path:
    """``runs/<time>-<plugins>-<scenario>-<dataset>-s<seed>``, with characters
    other than letters, digits and ``._+-`` (the ``:`` of ``avalanche:EWCPlugin``
    or ``package.module:Class``) replaced by ``_``."""
    import re
    from datetime import datetime

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    methods = "+".join(config.plugins) or "fedavg"
    name = f"{stamp}-{methods}-{config.scenario}-{config.dataset}-s{config.seed}"
    return Path("runs") / re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def check_out_dir(out_dir: Path) -> None:
    """One-line errors for a run folder that cannot take a new run: one that
    already holds results.json, a file, a path under a file, or a folder
    (or its nearest existing parent) that cannot be written."""
    where = f"--out {str(out_dir)!r}"
    try:
        _check_out_dir(out_dir, where)
    except OSError as exc:  # a name too long for the file system, say
        raise FedavalUsageError(f"{where} cannot be used ({exc.strerror})") from None


def _check_out_dir(out_dir: Path, where: str) -> None:
    import os

    if out_dir.exists() and not out_dir.is_dir():
        raise FedavalUsageError(f"{where} is a file, not a folder; give a folder for the run")
    if (out_dir / "results.json").exists():
        raise FedavalUsageError(
            f"{where} already holds a run (results.json); choose another folder, or continue it with --resume"
        )
    existing = out_dir.absolute()
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise FedavalUsageError(f"{where} is under {str(existing)!r}, which is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise FedavalUsageError(f"{where}: {str(existing)!r} is not writable (read-only file system or no permission)")


def resume_training(
    run_dir: str | Path,
    extra_plugins: Sequence[Any] = (),
    show_progress: bool = False,
    echo: Callable[[str], None] | None = None,
    time_limit: TimeLimit | None = None,
) -> dict[str, Any]:
    """Continue the run in ``run_dir`` from its newest checkpoint (``fedaval
    train --resume``) and return its results.

    The run is rebuilt from ``run_dir/config.json`` (same seed: same data,
    partition and schedule), the checkpoint is loaded over it, and training
    goes on from the round after the checkpoint's. ``extra_plugins`` must be
    the ones the run was started with."""
    import json

    from fedaval import checkpoint
    from fedaval.build import build_run
    from fedaval.config import RunConfig
    from fedaval.evaluation import purge_from

    out_dir = Path(run_dir)
    where = f"--resume {str(out_dir)!r}"
    if not out_dir.is_dir():
        raise FedavalUsageError(f"{where}: no such folder")
    try:
        settings = json.loads((out_dir / "config.json").read_text())
    except FileNotFoundError:
        raise FedavalUsageError(f"{where} is not a fedaval run folder (no config.json)") from None
    except (OSError, ValueError) as exc:
        raise FedavalUsageError(f"{where}: config.json cannot be read ({exc})") from None
    if not isinstance(settings, dict) or "plugins" not in settings or "scenario" not in settings:
        raise FedavalUsageError(f"{where}: config.json is not a fedaval run configuration")
    if not checkpoint.saved(out_dir):
        raise FedavalUsageError(
            f"{where} has no checkpoint in {checkpoint.FOLDER}/ (it stopped before its first checkpoint, "
            "or ran with --checkpoint-every 0)"
        )
    check_unchanged(where, settings, out_dir)
    config = RunConfig.from_dict(settings)
    config.out = str(out_dir)
    run = build_run(config, extra_plugins=extra_plugins, out_dir=out_dir)
    round, results = checkpoint.restore_latest(run)
    purge_from(run, round + 1)
    if echo is not None:
        done = "already complete" if round >= run.total_rounds else f"resuming at round {round + 1}"
        echo(f"{out_dir}: checkpoint of round {round} of {run.total_rounds} loaded; {done}")
    results = _train(run, results, show_progress, time_limit)
    if echo is not None:
        echo(format_summary(results, out_dir))
    return results


def check_unchanged(where: str, settings: dict[str, Any], out_dir: Path) -> None:
    """A one-line error when ``config.json`` no longer says what the run was
    started with (results.json's ``config``, written beside it at the start):
    the checkpoint holds state built from the first, and results.json would
    report the first while training went on with the second."""
    import json

    try:
        recorded = json.loads((out_dir / "results.json").read_text()).get("config")
    except (OSError, ValueError, AttributeError):
        return  # no readable results.json: nothing to compare with
    if not isinstance(recorded, dict):
        return
    shown = config_changes(recorded, settings)
    if shown:
        raise FedavalUsageError(
            f"{where}: config.json differs from the configuration the run was started with ({shown}); "
            "--resume continues a run as it was started: put config.json back, or start a new run"
        )


def _train(
    run: Any, results: dict[str, Any] | None, show_progress: bool, time_limit: TimeLimit | None = None
) -> dict[str, Any]:
    """:func:`fedaval.coordinator.train` on the run's ``--backend``, with an
    optional progress bar."""
    from fedaval.backends import make_backend
    from fedaval.coordinator import train

    backend = make_backend(run)
    bar = None
    if show_progress:
        from tqdm import tqdm

        done = len(results["rounds"]) if results else 0
        bar = tqdm(total=run.total_rounds, initial=done, unit="round", dynamic_ncols=True)
        # within a round: how many of its clients have trained (a round can take minutes)
        run.on_client = lambda round, trained, sampled: bar.set_postfix_str(
            f"round {round}: {trained}/{sampled} clients"
        )

    def on_round(record: dict[str, Any]) -> None:
        if bar is None:
            return
        bar.set_description(f"task {record['task'] + 1}/{run.num_tasks}")
        acc = record.get("global_accuracy")
        if acc is not None:
            bar.set_postfix(acc=f"{acc:.3f}")
        bar.update(1)

    try:
        return train(run, on_round=on_round, results=results, backend=backend, time_limit=time_limit)
    finally:
        if bar is not None:
            bar.close()


def format_summary(results: dict[str, Any], out_dir: Path) -> str:
    final = results["final"] or {}

    def pct(value):
        return "n/a" if value is None else f"{100 * value:.2f}%"

    lines = [
        f"plugins: {', '.join(results['plugins'])}   scenario: {results['config']['scenario']}"
        f"   dataset: {results['config']['dataset']}   tasks: {results['scenario']['num_tasks']}"
        f"   rounds: {final.get('rounds')}",
        (
            f"final global accuracy: {pct(final.get('accuracy'))}   average accuracy: {pct(final.get('average_accuracy'))}"
            f"   forgetting: {pct(final.get('forgetting'))}   mean client accuracy: {pct(final.get('mean_client_accuracy'))}"
            if final.get("federation_model", "global") == "global"
            else f"federation model: the clients' models   final mean client accuracy: "
            f"{pct(final.get('mean_client_accuracy'))}   average over stages: {pct(final.get('average_client_accuracy'))}"
        ),
        f"bytes up: {final.get('bytes_up', 0):,}   bytes down: {final.get('bytes_down', 0):,}"
        f"   seconds: {final.get('seconds', 0):.1f}   E: {final.get('efficiency') or 0:.3f} s/round"
        f"   failed clients: {final.get('failed_clients', 0)}",
        f"run folder: {out_dir}  (tensorboard --logdir {out_dir / 'tb'})",
    ]
    for name, block in (results.get("privacy") or {}).items():  # a defence that accounts a guarantee
        if isinstance(block, dict) and "epsilon" in block:
            eps = block["epsilon"]
            said = "none (no noise)" if eps is None else f"epsilon {eps:.4g} at delta {block.get('delta')}"
            lines.insert(-1, f"privacy ({name}): {said}")
    return "\n".join(lines)
