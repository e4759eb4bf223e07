"""``fedaval attack RUN_DIR --round R``: attack the uploads of round R of a
finished (or stopped) run.

Uploads are not stored, so the round is *replayed*: the run is rebuilt from
``config.json``, the checkpoint of round R - 1 is loaded over it (round 1
starts from the freshly built run), and round R runs again with the
:class:`fedaval.plugins.attack.Attack` plugin added. A run is reproducible
(every client trains and draws its DP noise in its own random streams), so
the replayed uploads are the ones the run sent. Nothing in the run folder is
changed except the PNG grids, written to ``RUN_DIR/privacy/``; the replay's
own files (TensorBoard, offloaded clients) go to a temporary folder. Keep the
checkpoints you want to attack with ``fedaval train --keep-checkpoints N``.
"""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

from fedaval.errors import FedavalUsageError


def attack_finished_run(
    run_dir: str | Path, round: int, clients: list[int] | None = None, **options: Any
) -> dict[str, Any]:
    """Replay round ``round`` of ``run_dir`` with the attack plugin; return
    the ``privacy`` block (``{"attack": {...}}``, plus ``"dp"`` if the run
    used it). ``options`` are the attack plugin's (``images``,
    ``iterations``, ``tv``, ``step_size``); ``clients`` the client ids
    attacked (``None``: every client sampled in that round)."""
    from fedaval.build import build_run
    from fedaval.config import RunConfig
    from fedaval.options import build_options
    from fedaval.plugins.attack import Attack, AttackOptions

    run_dir = Path(run_dir)
    where = f"fedaval attack {str(run_dir)!r}"
    try:
        settings = json.loads((run_dir / "config.json").read_text())
    except FileNotFoundError:
        raise FedavalUsageError(f"{where}: not a fedaval run folder (no config.json)") from None
    except (OSError, ValueError) as exc:
        raise FedavalUsageError(f"{where}: config.json cannot be read ({exc})") from None
    config = RunConfig.from_dict(settings)
    values = {key: value for key, value in options.items() if value is not None}
    values.update(rounds=[round], folder=str(run_dir / "privacy"))
    if clients:
        values["ids"] = list(clients)
    else:
        values["clients"] = 1 << 30  # every upload of the round
    plugin = Attack(build_options(AttackOptions, values, "attack"))
    # a run trained with the attack plugin is replayed with this one only
    config.plugins = [p for p in config.plugins if p != "attack" and p != "fedaval.plugins.attack:Attack"]
    config.plugin_options.pop("attack", None)
    with tempfile.TemporaryDirectory(prefix="fedaval-attack-") as scratch:  # the replay's own TensorBoard, offloads
        config.out = scratch
        run = build_run(config, extra_plugins=[plugin], out_dir=Path(scratch))
        try:
            return _replay(run, run_dir, round, clients)
        finally:  # close the replay's TensorBoard files before their folder goes
            for logger in run.loggers.values():
                writer = getattr(logger, "writer", None)
                if writer is not None:
                    writer.close()
            if run.tb_writer is not None:
                run.tb_writer.close()


def _replay(run, run_dir: Path, round: int, clients: list[int] | None) -> dict[str, Any]:
    from fedaval import checkpoint
    from fedaval.backends.local import LocalBackend
    from fedaval.coordinator import run_round
    from fedaval.privacy import privacy_results

    if not 1 <= round <= run.total_rounds:
        raise FedavalUsageError(f"bad value --round {round}; the run has rounds 1 to {run.total_rounds}")
    if round > 1:
        path = checkpoint.path_for(run_dir, round - 1)
        if not path.is_file():
            kept = sorted(r for r, _ in checkpoint.saved(run_dir))
            raise FedavalUsageError(
                f"--round {round} needs the checkpoint of round {round - 1}, which {run_dir} does not have "
                f"(kept: {', '.join(map(str, kept)) or 'none'}; train with --keep-checkpoints to keep more)"
            )
        try:
            checkpoint.restore(run, path)
        except (pickle.UnpicklingError, EOFError, OSError, AttributeError, ImportError) as exc:
            raise FedavalUsageError(f"{path} cannot be read ({type(exc).__name__}: {exc})") from None
    missing = sorted(set(clients or []) - set(run.schedule[round - 1]))
    if missing:
        raise FedavalUsageError(
            f"bad value --clients {','.join(map(str, missing))}: not sampled in round {round} "
            f"(sampled: {','.join(map(str, run.schedule[round - 1]))})"
        )
    now = run.enter_round(round)
    if round == now.first_round:
        run.server.begin_task(now.task)
        run.hook.fedaval_server_task_start(run=run, task=now.task)
    run_round(run, round, LocalBackend())
    run.hook.fedaval_teardown(run=run)
    return privacy_results(run) or {}
