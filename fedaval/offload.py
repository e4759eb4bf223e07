"""Which clients stay live between rounds (``--offload-clients``).

With 100 clients and 10 sampled per round (GLDP's setting), keeping every
client's model, optimizer state, Avalanche strategy and evaluator live costs
100 times one client. Instead, a client that will not train in the next round
is offloaded (:meth:`fedaval.client.Client.offload`): its state becomes one
pickle, in memory (``cpu``) or in ``RUN_DIR/clients/`` (``disk``), and is
loaded back the moment something reads it. Live objects also hold what a
pickle drops (gradients, autograd and Python overhead), so the memory a run
needs grows by about one client's pickle per client.

``auto`` offloads to memory when ``--clients-per-round`` samples fewer than
all clients, and keeps every client live otherwise (each would be loaded back
every round for nothing).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run


def policy(run: Run) -> str:
    """``none``, ``cpu`` or ``disk`` for this run."""
    choice = run.config.offload_clients
    if choice != "auto":
        return choice
    sampled = run.config.clients_per_round
    return "cpu" if 0 < sampled < len(run.partition.clients) else "none"


def folder(run: Run) -> Path:
    """Where ``disk`` puts offloaded clients: ``RUN_DIR/clients``, or a
    temporary folder removed with the run when it has no folder."""
    if run.out_dir is not None:
        return run.out_dir / "clients"
    path = run.offload_folder
    if path is None:
        path = run.offload_folder = Path(tempfile.mkdtemp(prefix="fedaval-clients-"))
        weakref.finalize(run, shutil.rmtree, str(path), True)
    return path


def offload(run: Run, client: Client) -> int:
    """Offload ``client`` as the run's policy says; bytes stored (0: kept live)."""
    where = policy(run)
    if where == "none" or client.offloaded:
        return 0
    return client.offload(folder(run) if where == "disk" else None)


def offload_idle(run: Run, round: int) -> None:
    """After round ``round``: offload the live clients not sampled in the next one."""
    if policy(run) == "none":
        return
    upcoming = set(run.schedule[round]) if round < len(run.schedule) else set()
    for client in run.clients:
        if client.id not in upcoming:
            offload(run, client)
