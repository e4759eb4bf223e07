"""Which clients stay live between rounds (``--offload-clients``).

With 100 clients and 10 sampled per round (GLDP's setting), keeping every
client's model, optimizer state, Avalanche strategy and evaluator live costs
100 times one client. Instead, a client that will not train in the next round
is offloaded (:meth:`fedaval.client.Client.offload`): its state becomes one
pickle, in memory (``cpu``) or in ``RUN_DIR/clients/`` (``disk``), and is
loaded back the moment something reads it. Live objects also hold what a
pickle drops (gradients, autograd and Python overhead), so the memory a run
needs grows by about one client's pickle per client.

``auto`` keeps every client live when all train every round (each would be
loaded back every round for nothing), and also when ``--clients-per-round``
samples fewer but every client kept live fits comfortably in memory: then an
offload would save little (live clients take about 1.23 times their stored
state, docs/performance.md) and cost a pickle and an unpickle per sampled
client and round. "Fits" is read as: ``LIVE_FACTOR`` times the first client's
stored state (measured once, by offloading it), times the number of clients,
is at most ``MEMORY_SHARE`` of the memory available on the run's device when
the run is built (CUDA: free device memory; CPU: the host's ``MemAvailable``).
``LIVE_FACTOR`` leaves room for what clients gain by training (gradients, a
teacher model, an exemplar memory: a trained PFCL client stores twice an
untrained one). Otherwise ``auto`` offloads to memory (``cpu``). The choice is
made once per run (``Run.offload_auto``) and changes no result, only time and
memory (``tests/test_offload.py``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run


#: ``auto``: all clients live may take this share of the available memory ...
MEMORY_SHARE = 0.5
#: ... counting each live client as this many times its stored state.
LIVE_FACTOR = 4.0


def policy(run: Run) -> str:
    """``none``, ``cpu`` or ``disk`` for this run."""
    choice = run.config.offload_clients
    if choice != "auto":
        return choice
    chosen = getattr(run, "offload_auto", None)  # None: not chosen yet (or a run saved before it was kept)
    if chosen is None:
        chosen = run.offload_auto = auto_policy(run)
    return chosen


def auto_policy(run: Run) -> str:
    """What ``auto`` means for ``run`` (the module's docstring); needs its first client built."""
    sampled, total = run.config.clients_per_round, len(run.partition.clients)
    if not 0 < sampled < total:
        return "none"
    first = run.clients[0]
    measured = not first.offloaded
    stored = first.offload() if measured else first.stored_nbytes
    chosen = "none" if LIVE_FACTOR * stored * total <= MEMORY_SHARE * available_memory(run.device) else "cpu"
    if measured and chosen == "none":  # offloaded only to be measured; with "cpu" it stays offloaded
        first.materialise()
    return chosen


def available_memory(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the host's ``MemAvailable``
    (``/proc/meminfo``; elsewhere the free physical pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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
