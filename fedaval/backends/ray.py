"""``--backend ray``: clients' rounds run in parallel on a Ray cluster.

Design. The driver (the ``fedaval train`` process) keeps every client and
all plugin state, exactly as the in-process backend does; Ray workers hold no
client between rounds. Each round, for every sampled client, the driver sends
the client's whole state (:mod:`fedaval.backends.transfer`) and the round's
broadcast to a free worker, which runs the client's part of the round
(receive, local training, upload: every client-side hook) and sends the
client's state back with its upload. Server fusion, ``fedaval_round_metrics``,
the evaluation of the global model and of the clients, results.json,
TensorBoard and checkpoints stay on the driver, on the same objects as
in-process. So:

* the same seed gives the same results as ``--backend local`` (each client
  draws from its own random streams, whichever process runs it);
* server-side code that reads client state (GLDP's per-client metrics read
  the client models and local prototypes; ``a_glo`` reads each client's seen
  classes) sees what it would see in-process;
* checkpoints are the in-process ones and ``--resume`` works unchanged, on
  either backend;
* any worker can run any client (the driver hands clients to workers as they
  free up, so unequal clients balance), and a worker that dies loses nothing:
  its client fails for that round (``--on-client-failure``) and a new worker
  takes its place.

The cost is traffic: a client's state goes to its worker and back every
round it is sampled, beside the broadcast and the upload (``docs/ray.md``
has the measured sizes; :attr:`RayBackend.traffic` counts them). Clients'
evaluation runs on the driver, one after the other, as in-process: GLDP's
evaluation reads the server's newest prototypes, which only the driver has.

A plugin's per-client state must live in ``client.stash`` (the rule in
:mod:`fedaval.hookspecs`), since the client is what travels; a client hook
that changes a plugin's own attributes stops the run with a one-line error
naming the attribute (:func:`fedaval.backends.worker.unsynced_change`)
rather than let it differ silently from in-process.

Workers. One Ray actor per parallel client slot, each asking for 1 CPU and
``--client-gpus`` of a GPU: as many as the widest round samples, at most as
many as the cluster's CPUs (and its GPUs divided by ``--client-gpus``). Each
builds a replica of the run from its configuration (:class:`Worker`). The
actors of a process are kept from run to run (``--seeds``, benchmarks, tests)
and rebuilt for each run's configuration; :func:`shutdown_workers` ends them.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import socket
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import ray

from fedaval.backends import transfer
from fedaval.backends.local import ClientRound
from fedaval.backends.worker import Worker
from fedaval.errors import FedavalUsageError, RunFailure

if TYPE_CHECKING:
    from fedaval.run import Run

__all__ = ["RayBackend", "shutdown_workers", "connect", "worker_count"]

log = logging.getLogger("fedaval")

START_TIMEOUT_S = 600
"""How long the first round waits for the workers to build their run replicas
(a cluster without free CPUs never schedules them)."""

WORKER_THREADS = 1
"""torch threads of each worker: one CPU each (``num_cpus=1``)."""

ENV_PASSED = ("FEDAVAL_CACHE",)
"""Environment variables of the driver that workers take over (each run)."""


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (``--ray-address``), or start a
    local Ray instance when ``address`` is ``None``. A process already
    connected to Ray (``ray.init`` called before) keeps its connection.

    Raises a one-line :class:`FedavalUsageError` when nothing answers at
    ``address``: checked with a plain TCP connection first, because Ray
    itself retries an unreachable address for minutes."""
    if address is not None and address not in ("auto", "local"):
        problem = unreachable(address)
        if problem:
            raise FedavalUsageError(
                f"bad value --ray-address {address!r}: {problem}; give the address `ray start --head` printed "
                "(host:port, e.g. 10.0.0.1:6379), auto (this machine's cluster), "
                "or leave it out to start a local Ray instance"
            )
    if ray.is_initialized():
        return
    try:
        ray.init(
            address=address or "local",
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.WARNING,
        )
    except (ConnectionError, RuntimeError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if address is None:
            raise FedavalUsageError(f"--backend ray: Ray cannot start a local instance ({first})") from None
        raise FedavalUsageError(
            f"bad value --ray-address {address!r}: Ray cannot join a cluster there ({first}); if the cluster uses "
            "token authentication, set RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN or ~/.ray/auth_token)"
        ) from None


def unreachable(address: str, timeout: float = 5.0) -> str | None:
    """Why a TCP connection to ``address`` (``host:port`` or
    ``ray://host:port``) fails, or ``None`` when it connects."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        return "expected host:port"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return None
    except OSError as exc:
        return f"nothing answers there ({exc.strerror or type(exc).__name__})"


def worker_count(widest_round: int, cpus: float, gpus: float, client_gpus: float) -> int:
    """Workers for a run whose widest round samples ``widest_round`` clients,
    on a cluster of ``cpus`` CPUs and ``gpus`` GPUs, each worker taking 1 CPU
    and ``client_gpus`` of a GPU. At least 1."""
    slots = int(cpus)
    if client_gpus > 0:
        slots = min(slots, int(math.floor(gpus / client_gpus + 1e-9)))
    return max(1, min(widest_round, slots))


def check_resources(run: Run, resources: dict[str, float]) -> None:
    """One-line errors for ``--client-gpus`` and ``--device`` a cluster cannot meet."""
    share = run.config.client_gpus
    gpus = resources.get("GPU", 0.0)
    if resources.get("CPU", 0.0) < 1:
        raise FedavalUsageError("--backend ray: the Ray cluster has no CPU; each client's worker needs 1")
    if share > 0 and gpus <= 0:
        raise FedavalUsageError(
            f"bad value --client-gpus {share}: the Ray cluster has no GPU; use --client-gpus 0 (clients on CPU)"
        )
    if share > gpus:
        raise FedavalUsageError(
            f"bad value --client-gpus {share}: the Ray cluster has {gpus:g} GPU(s); allowed: 0 to {gpus:g}"
        )
    on_cuda = run.device.type == "cuda"
    if on_cuda and share == 0:
        raise FedavalUsageError(
            f"--backend ray: --device {run.config.device} puts the driver on {run.device} but --client-gpus is 0 "
            "(clients on CPU); give --client-gpus (e.g. 0.25) or --device cpu, so clients and server share a device type"
        )
    if share > 0 and not on_cuda:
        raise FedavalUsageError(
            f"bad value --client-gpus {share} with --device {run.config.device} (the driver on {run.device}): "
            "clients and server must share a device type; use --device cuda or --client-gpus 0"
        )


def extra_plugin_objects(run: Run) -> list[Any]:
    """The plugin objects passed to ``build_run(extra_plugins=...)``: registered
    after the named plugins and the core's, which a replica makes itself."""
    from fedaval.core import CorePlugin
    from fedaval.plugin_manager import DEFAULT_PLUGINS

    named = len(list(DEFAULT_PLUGINS) + [s for s in run.config.plugins if s not in DEFAULT_PLUGINS])
    objects = list(run.plugins.objects.values())[named:]
    return [p for p in objects if not isinstance(p, CorePlugin)]


@dataclass(eq=False)
class _Slot:
    actor: Any
    owner: int = -1  # the RayBackend whose run the actor's replica is built from
    ready: Any = None  # ObjectRef of the replica's build


@dataclass
class _Pool:
    """This process's worker actors, kept from run to run (one run uses them at a time)."""

    slots: list[_Slot] = field(default_factory=list)
    key: tuple = ()  # (Ray job, GPU share): actors made for another are ended


_POOL = _Pool()
_TOKENS = itertools.count(1)  # tells runs apart in the pool


def shutdown_workers() -> None:
    """End this process's worker actors (they end with the process anyway)."""
    for slot in _POOL.slots:
        try:
            ray.kill(slot.actor)
        except Exception:  # noqa: BLE001 - already gone, or Ray shut down
            pass
    _POOL.slots = []


_ACTOR_CLASS = None


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        _ACTOR_CLASS = ray.remote(Worker)
    return _ACTOR_CLASS


class RayBackend:
    """Sampled clients' rounds on Ray workers, the rest on the driver (see the module docstring).

    ``traffic`` holds, per round, the bytes of the broadcast sent once to the
    object store, of the client states sent to workers and of what came back
    (states, uploads and losses), and the seconds the driver spent pickling
    and loading them (``driver_seconds``)."""

    name = "ray"
    client_threads = WORKER_THREADS  # what results.json records as the clients' torch threads

    def __init__(self, run: Run):
        config = run.config
        connect(config.ray_address)
        resources = ray.cluster_resources()
        check_resources(run, resources)
        widest = max((len(r) for r in run.schedule), default=1)
        self.workers = worker_count(widest, resources.get("CPU", 0), resources.get("GPU", 0), config.client_gpus)
        self.client_gpus = config.client_gpus
        self.settings = config.to_dict()
        self.extra_plugins = extra_plugin_objects(run)
        self.device = "cuda" if config.client_gpus > 0 else "cpu"
        self.traffic: list[dict[str, float]] = []
        self._token = next(_TOKENS)
        self._slots = self._acquire()  # replicas build while the driver builds its run
        log.info(
            "--backend ray: %d worker(s), each 1 CPU%s, on a cluster of %g CPU(s) and %g GPU(s)",
            self.workers,
            f" and {self.client_gpus:g} GPU" if self.client_gpus else "",
            resources.get("CPU", 0),
            resources.get("GPU", 0),
        )

    # --- workers ----------------------------------------------------------
    def _acquire(self) -> list[_Slot]:
        """This run's workers: the pool's actors, made or ended to number
        ``self.workers``, each rebuilt for this run unless it already is."""
        key = (ray.get_runtime_context().get_job_id(), self.client_gpus)
        if _POOL.key != key:
            shutdown_workers()
            _POOL.key = key
        actor_class = _actor_class()
        while len(_POOL.slots) < self.workers:
            actor = actor_class.options(num_cpus=1, num_gpus=self.client_gpus, max_restarts=0).remote(
                threads=WORKER_THREADS
            )
            _POOL.slots.append(_Slot(actor))
        for slot in _POOL.slots[self.workers :]:
            ray.kill(slot.actor)
        del _POOL.slots[self.workers :]
        env = {name: os.environ[name] for name in ENV_PASSED if name in os.environ}
        for slot in _POOL.slots:
            if slot.owner != self._token:
                try:
                    slot.ready = slot.actor.reset.remote(self.settings, self.extra_plugins, self.device, env)
                except Exception as exc:  # noqa: BLE001 - an extra plugin object Ray cannot pickle
                    raise FedavalUsageError(
                        f"--backend ray: a plugin object cannot be sent to the Ray workers: {exc}"
                    ) from None
                slot.owner = self._token
        return list(_POOL.slots)

    def _ready_workers(self) -> list[_Slot]:
        """The workers, once their replicas are built; a one-line
        :class:`RunFailure` if one cannot build it (data missing on its
        machine, a plugin it cannot import)."""
        if (
            any(slot not in _POOL.slots or slot.owner != self._token for slot in self._slots)
            or len(self._slots) < self.workers
        ):
            self._slots = self._acquire()  # another run used the pool, or a worker died
        waiting = [slot.ready for slot in self._slots if slot.ready is not None]
        if waiting:
            done, pending = ray.wait(waiting, num_returns=len(waiting), timeout=START_TIMEOUT_S)
            if pending:
                raise RunFailure(
                    f"--backend ray: {len(pending)} of {len(waiting)} Ray workers did not start within "
                    f"{START_TIMEOUT_S} s; does the cluster have {self.workers} free CPU(s)"
                    + (f" and {self.client_gpus * self.workers:g} free GPU(s)" if self.client_gpus else "")
                    + "? (`ray status` shows it)"
                )
            for slot in self._slots:
                if slot.ready is None:
                    continue
                try:
                    ray.get(slot.ready)
                except ray.exceptions.RayError as exc:
                    self._forget(slot)
                    raise RunFailure(f"--backend ray: a Ray worker cannot build the run: {_last_line(exc)}") from exc
                slot.ready = None
        return self._slots

    def _forget(self, slot: _Slot) -> None:
        if slot in _POOL.slots:
            _POOL.slots.remove(slot)
        try:
            ray.kill(slot.actor)
        except Exception:  # noqa: BLE001
            pass

    def close(self) -> None:
        """End the workers now rather than at the next run or the process's end."""
        if any(slot.owner == self._token for slot in _POOL.slots):
            shutdown_workers()

    # --- the Backend protocol ---------------------------------------------
    def train_clients(
        self,
        run: Run,
        client_ids: list[int],
        download: dict[str, Any],
        round: int,
        extras: dict[int, dict[str, Any]] | None = None,
    ) -> list[ClientRound]:
        """Hand the sampled clients to the workers as they free up; results in ``client_ids`` order."""
        slots = list(self._ready_workers())
        start = time.perf_counter()
        broadcast = transfer.dumps(run, download)
        broadcast_ref = ray.put(broadcast)
        download_key = (self._token, round)
        traffic: dict[str, float] = {
            "round": round,
            "clients": len(client_ids),
            "broadcast": len(broadcast),
            "to_workers": 0,
            "from_workers": 0,
            "driver_seconds": time.perf_counter() - start,
        }
        queue = list(client_ids)
        running: dict[Any, tuple[_Slot, int]] = {}
        results: dict[int, ClientRound] = {}
        problem = None
        while queue or running:
            if not slots and not running:  # every worker died this round
                for k in queue:
                    results[k] = ClientRound(k, failure="no Ray worker is left this round")
                break
            while queue and slots:
                slot, k = slots.pop(0), queue.pop(0)
                start = time.perf_counter()
                client = run.clients[k]
                if getattr(client, "offloaded", False):  # --offload-clients: live again, as in-process
                    client.materialise()
                sent = transfer.dumps(run, {"client": client, "extra": (extras or {}).get(k)})
                traffic["to_workers"] += len(sent)
                traffic["driver_seconds"] += time.perf_counter() - start
                ref = slot.actor.train.remote(k, sent, download_key, broadcast_ref, round, run.task)
                running[ref] = (slot, k)
            done, _ = ray.wait(list(running), num_returns=1)
            slot, k = running.pop(done[0])
            try:
                back = ray.get(done[0])
            except ray.exceptions.RayActorError as exc:  # the worker process died: the client's round is lost
                self._forget(slot)
                results[k] = ClientRound(k, failure=f"its Ray worker died: {_last_line(exc)}", error=exc)
                continue
            except ray.exceptions.RayError as exc:  # a bug, not a client failure
                raise RunFailure(f"--backend ray: client {k}'s round failed on its worker: {_last_line(exc)}") from exc
            slots.append(slot)
            start = time.perf_counter()
            traffic["from_workers"] += len(back)
            results[k], issue = self._take_back(run, k, back)
            traffic["driver_seconds"] += time.perf_counter() - start
            problem = problem or issue
        self.traffic.append(traffic)
        if problem:
            raise RunFailure(problem)
        return [results[k] for k in client_ids]

    def _take_back(self, run: Run, k: int, data: bytes) -> tuple[ClientRound, str | None]:
        """Load what a worker sent back into the driver's run: the client (its
        round's result carries its local-training seconds) and its loggers' records."""
        back = transfer.loads(run, data)
        if "client" in back:
            run.clients[k] = back["client"]
            loggers = transfer.shared_names(run)
            for name, records in back["logs"].items():
                for metric, value, x_plot in records:
                    loggers[name].log_single_metric(metric, value, x_plot)
        return back["round"], back.get("problem")


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__
