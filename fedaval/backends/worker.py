"""A worker process of the Ray backend: runs clients' rounds on state sent by the driver.

A :class:`Worker` holds a replica of the run, built from the run's
configuration (the in-process backend inside, no run folder): the same
dataset, partition, schedule and plugins, so the references in a client's
sent state (:mod:`fedaval.backends.transfer`) resolve to the same things.
The replica's own clients are dropped once it is built: a worker holds a
client (with its stash) only while it runs that client's round; the
replica's plugins stay as built. Plain Python, no Ray here:
:mod:`fedaval.backends.ray` makes it a Ray actor, and tests drive it directly.
"""

from __future__ import annotations

import gc
import os
import pickle
import socket
import traceback
from types import SimpleNamespace
from typing import Any

from avalanche.logging import BaseLogger

from fedaval import state
from fedaval.backends import transfer
from fedaval.backends.local import ClientRound, client_round


class RemoteClientError(Exception):
    """A client's exception on a worker, carried back as its formatted
    traceback (the exception object itself may not pickle)."""


class RecordingLogger(BaseLogger):
    """Stands in on a worker for one of the driver's TensorBoard loggers (same
    reference name): records what would be logged, for the driver to log."""

    def __init__(self):
        super().__init__()
        self.records: list[tuple[str, Any, int]] = []

    def log_single_metric(self, name, value, x_plot):
        self.records.append((name, value, x_plot))

    def take(self) -> list[tuple[str, Any, int]]:
        records, self.records = self.records, []
        return records


class VacantClient:
    """A worker's place for client ``id`` while no round of it runs."""

    def __init__(self, client_id: int):
        self.id = client_id
        self.strategy = SimpleNamespace(evaluator=SimpleNamespace(loggers=[]))


def watch_plugins(run) -> dict[tuple[str, str], Any]:
    """What of the plugins a client's hooks must leave alone (the rule in
    :mod:`fedaval.hookspecs`: per-client state lives in ``client.stash``):
    each attribute's value, with the identities of a container's items, to
    see one grow or change."""
    seen: dict[tuple[str, str], Any] = {}
    for name, plugin in state.plugin_objects(run):
        for attr, value in vars(plugin).items():
            if isinstance(value, dict):
                seen[(name, attr)] = (value, {k: id(v) for k, v in value.items()})
            elif isinstance(value, (list, set)):
                seen[(name, attr)] = (value, [id(v) for v in value])
            else:
                seen[(name, attr)] = (value, None)
    return seen


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - tensors, arrays: a new object is a change
        return False


def unsynced_change(run, client_id: int, before: dict[tuple[str, str], Any]) -> str | None:
    """One line naming a plugin attribute that client ``client_id``'s round
    changed, or ``None``.

    Only the client (with its stash) goes back to the driver; a change to a
    plugin's own attributes would be lost, and the run would silently differ
    from the in-process backend, so the backend stops the run instead."""
    after = watch_plugins(run)
    for key in sorted(before.keys() | after.keys()):
        old, new = before.get(key), after.get(key)
        if old is not None and new is not None and _same(old[0], new[0]) and old[1] == new[1]:
            continue
        name, attr = key
        return (
            f"--backend ray: plugin {name!r} changed its attribute {attr!r} during client {client_id}'s round; "
            "a Ray worker sends back only the client, so per-client state belongs in client.stash "
            "(see fedaval/hookspecs.py); run this method with --backend local"
        )
    return None


class Worker:
    """One worker process: a run replica, and clients' rounds on demand."""

    def __init__(self, threads: int = 1):
        import torch

        torch.set_num_threads(max(1, threads))
        self.run: Any = None  # the replica (a fedaval.run.Run) once reset() built it
        self.stand_ins: dict[str, RecordingLogger] = {}
        self._download: tuple[Any, Any] = (None, None)

    def reset(self, settings: dict[str, Any], extra_plugins: list[Any], device: str, env: dict[str, str]) -> str:
        """Build the replica of the run that ``settings`` (``RunConfig.to_dict()``)
        describes, on ``device``, with ``extra_plugins`` registered after the
        named ones and the driver's environment variables ``env``. Returns
        ``host:pid``, for messages."""
        from fedaval.build import build_run
        from fedaval.config import RunConfig

        os.environ.update(env)
        self.run = None
        gc.collect()
        config = RunConfig.from_dict(settings)
        config.backend, config.out, config.device, config.ray_address = "local", None, device, None
        if hasattr(config, "offload_clients"):
            config.offload_clients = "none"  # its own clients are dropped below
        run = build_run(config, extra_plugins=extra_plugins, out_dir=None)
        run.clients = [VacantClient(c.id) for c in run.clients]  # type: ignore[misc]
        self.run = run
        self.stand_ins = {}
        self._download = (None, None)
        gc.collect()
        return f"{socket.gethostname()}:{os.getpid()}"

    def _stand_in(self, name: str) -> RecordingLogger:
        """A reference to one of the driver's loggers, which a worker has not:
        a :class:`RecordingLogger` under the same name."""
        if not name.startswith("logger."):
            raise pickle.UnpicklingError(f"sent state refers to {name!r}, which this worker's run does not have")
        return self.stand_ins.setdefault(name, RecordingLogger())

    def _loads(self, data: bytes) -> Any:
        return transfer.loads(self.run, data, self.stand_ins, self._stand_in)

    def download(self, key: Any, data: bytes) -> dict[str, Any]:
        """The round's broadcast, decoded once per round (``key``) and shared
        by the clients this worker runs in it, as in one process."""
        if self._download[0] != key:
            self._download = (key, self._loads(data))
        return self._download[1]

    def train(
        self, client_id: int, client_state: bytes, download_key: Any, download: bytes, round: int, task: int
    ) -> bytes:
        """Run round ``round`` of client ``client_id`` from ``client_state``
        (:func:`fedaval.backends.transfer.dumps` of ``{"client", "extra"}``
        on the driver: the client and its own download entries); return the
        client after the round, with its
        :class:`ClientRound`, its local-training seconds, what its loggers
        recorded and ``problem`` (see :func:`unsynced_change`)."""
        run = self.run
        run.enter_round(round)
        broadcast = self.download(download_key, download)
        sent = self._loads(client_state)
        client = sent["client"]
        run.clients[client_id] = client
        before = watch_plugins(run)
        try:
            result = client_round(run, client, broadcast, round, sent.get("extra"))
            if result.error is not None:
                text = "".join(traceback.format_exception(result.error)).rstrip()
                result.error = RemoteClientError(f"on Ray worker {socket.gethostname()}:{os.getpid()}:\n{text}")
            back = {
                "round": result,
                "client": client,
                "logs": {name: logger.take() for name, logger in self.stand_ins.items() if logger.records},
                "problem": unsynced_change(run, client_id, before),
            }
            try:
                return transfer.dumps(run, back, self.stand_ins)
            except TypeError as exc:
                problem = f"--backend ray: client {client_id}'s state cannot be sent back from its worker: {exc}"
                return transfer.dumps(run, {"round": ClientRound(client_id, failure=problem), "problem": problem})
        finally:
            run.clients[client_id] = VacantClient(client_id)
