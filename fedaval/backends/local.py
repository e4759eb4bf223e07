"""The in-process backend, and what every backend shares: one client's round
(:func:`client_round`) and its result (:class:`ClientRound`). See
:mod:`fedaval.backends`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from fedaval.errors import FedavalUsageError
from fedaval.payload import FiniteCheck, Upload, merge_entries

if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run
    from fedaval.stacked import Stacks

__all__ = ["Backend", "ClientRound", "LocalBackend", "client_round", "check_losses", "settle"]


@dataclass
class ClientRound:
    """What one client's round produced: its upload and mean loss terms, or
    why it failed (``failure``, one line; ``error`` the exception where the
    backend has it).

    Until :func:`settle` reads them, ``losses`` may hold tensors on the
    device and ``pending`` the upload's queued finiteness check; a backend
    returns settled rounds only (floats, ``pending`` ``None``)."""

    client_id: int
    losses: dict[str, Any] = field(default_factory=dict)
    upload: Upload | None = None
    failure: str | None = None
    error: BaseException | None = None
    # the host's seconds in its receive, local training and upload; a GPU's work queued by them is
    # waited for once per round, in settle(), and that wait is counted in the round's last client
    seconds: float = 0.0
    pending: FiniteCheck | None = field(default=None, repr=False)


class Backend(Protocol):
    """What the coordinator asks of a backend each round."""

    def train_clients(
        self,
        run: Run,
        client_ids: list[int],
        download: dict[str, Any],
        round: int,
        extras: dict[int, dict[str, Any]] | None = None,
    ) -> list[ClientRound]:
        """Run round ``round`` on each client of ``client_ids`` (steps 2a-2c of
        :func:`fedaval.coordinator.run_round`); client ``k`` receives the
        broadcast ``download`` plus ``extras[k]``. Results in ``client_ids`` order."""


def check_losses(losses: dict[str, float]) -> None:
    import math

    for name, value in losses.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"{name} is {value}")


def client_round(
    run: Run,
    client: Client,
    download: dict[str, Any],
    round: int,
    extra: dict[str, Any] | None = None,
    settle_now: bool = True,
) -> ClientRound:
    """One client's part of a round, in its own random streams; a failure
    (an exception, a non-finite loss or upload) is caught and reported.
    ``extra``: this client's own download entries, on top of ``download``.

    Its loss terms and upload are checked once it has uploaded: with
    ``settle_now`` at once, else by the caller's :func:`settle` of the
    round's clients together. Either way a client whose loss terms are not
    finite has also run its upload hooks; its upload is dropped and the
    failure named is the loss term's, as it is checked first."""
    hook = run.hook
    start = time.perf_counter()  # the client's whole computation: receive, train, upload (FedProK's tau2)
    losses = None
    with client.rng_scope():
        try:
            assert run.now is not None, "a client round runs inside a round (run.enter_round)"
            client.task = run.now.task
            client.receive({**download, **extra} if extra else download)
            losses = hook.fedaval_client_train(run=run, client=client, round=round) or {}
            entries = merge_entries(
                hook.fedaval_client_upload(run=run, client=client), "upload", run.pm, "fedaval_client_upload"
            )
            check = FiniteCheck(entries, "upload")
        except FedavalUsageError:
            raise  # a plugin misused (a clashing loss-term name): the same in every client, not a client failure
        except Exception as exc:  # noqa: BLE001 - the coordinator applies the failure policy
            problem: BaseException = exc
            if losses is not None:  # trained: a non-finite loss term is named first, as settle() does
                try:
                    check_losses({name: float(value) for name, value in losses.items()})
                except FloatingPointError as loss_problem:
                    problem = loss_problem
            return _failed(ClientRound(client.id, seconds=time.perf_counter() - start), problem)
    result = ClientRound(
        client.id,
        losses=losses,
        upload=Upload(client.id, client.num_samples(), entries),
        seconds=time.perf_counter() - start,
        pending=check,
    )
    if settle_now:
        settle([result])
    return result


def _failed(result: ClientRound, exc: BaseException) -> ClientRound:
    result.failure = f"{type(exc).__name__}: {exc}".splitlines()[0] + raised_in_plugin(exc)
    result.error = exc
    result.losses, result.upload, result.pending = {}, None, None
    return result


def raised_in_plugin(exc: BaseException) -> str:
    """`` (raised at PATH:LINE in FUNCTION)`` for the innermost frame of
    ``exc``'s traceback in a plugin's code (a third party's or fedaval's own
    ``fedaval/plugins/``), where the one-line failure would otherwise name no
    plugin; ``""`` when the exception comes from elsewhere (the core's own
    messages say what they mean; torch's, pluggy's and Avalanche's frames are
    passed over)."""
    import os
    import sysconfig
    import traceback
    from pathlib import Path

    import avalanche
    import pluggy

    import fedaval

    core = Path(fedaval.__file__).parent
    libraries = [Path(sysconfig.get_paths()["stdlib"])] + [
        Path(m.__file__).parent for m in (torch, pluggy, avalanche) if m.__file__
    ]
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = Path(frame.filename)
        if any(path.is_relative_to(lib) for lib in libraries):
            continue
        if path.is_relative_to(core) and not path.is_relative_to(core / "plugins"):
            return ""  # the core raised it
        shown = os.path.join(*path.parts[-2:])
        return f" (raised at {shown}:{frame.lineno} in {frame.name})"
    return ""


def settle(results: list[ClientRound]) -> None:
    """Read what the clients' rounds left on their devices (loss terms held
    as tensors, the uploads' finiteness checks) in one transfer per device,
    and fail the clients whose loss terms or upload are not finite.

    On a GPU each read waits for every kernel queued before it. Read after
    each client, the GPU would finish that client's queued steps and then
    idle while the host uploads it and receives and sets up the next one;
    read once after all of them, the host queues the next client while the
    GPU still trains the last (docs/performance.md, "On a GPU", item 3)."""
    read = _DeviceReads()
    plan = []
    for result in results:
        if result.failure is not None or result.pending is None:
            continue
        losses = {
            name: read.add(value.detach()) if isinstance(value, torch.Tensor) else value
            for name, value in result.losses.items()
        }
        plan.append((result, losses, [read.add(flags) for flags in result.pending.flags]))
    read.read()
    for result, losses, flags in plan:
        pending = result.pending
        assert pending is not None, "planned above"
        values = {name: read.get(value)[0] if isinstance(value, tuple) else value for name, value in losses.items()}
        try:
            check_losses(values)
            pending.settle([read.get(f) for f in flags])
        except FloatingPointError as exc:
            _failed(result, exc)
            continue
        result.losses, result.pending = values, None


class _DeviceReads:
    """Tensors to read back, one transfer per device: :meth:`add` them (each
    flattened), :meth:`read` once, then :meth:`get` each as a list of floats."""

    def __init__(self):
        self._queued: dict[torch.device, list[torch.Tensor]] = {}
        self._sizes: dict[torch.device, int] = {}
        self._read: dict[torch.device, list[float]] = {}

    def add(self, tensor: torch.Tensor) -> tuple[torch.device, int, int]:
        device, offset = tensor.device, self._sizes.get(tensor.device, 0)
        self._queued.setdefault(device, []).append(tensor.reshape(-1).double())
        self._sizes[device] = offset + tensor.numel()
        return device, offset, tensor.numel()

    def read(self) -> None:
        self._read = {device: torch.cat(tensors).tolist() for device, tensors in self._queued.items()}

    def get(self, place: tuple[torch.device, int, int]) -> list[float]:
        device, offset, length = place
        return self._read[device][offset : offset + length]


class LocalBackend:
    """Every client in this process, one after the other, on ``--device``;
    with ``--client-streams K`` on K CUDA streams (:mod:`fedaval.cuda_streams`);
    with ``--stack-clients`` in lockstep, their steps computed together
    (:mod:`fedaval.stacked`)."""

    name = "local"
    stacks: Stacks | None = None  # --stack-clients: the client groups' stacks, kept from round to round

    def train_clients(
        self,
        run: Run,
        client_ids: list[int],
        download: dict[str, Any],
        round: int,
        extras: dict[int, dict[str, Any]] | None = None,
    ) -> list[ClientRound]:
        from fedaval.cuda_streams import ClientStreams

        extras = extras or {}
        if run.config.stack_clients:
            results = self._stacked(run, client_ids, download, round, extras)
        else:
            streams = ClientStreams(run.device, run.config.client_streams)  # --client-streams: one stream, or K
            results = []
            for index, k in enumerate(client_ids):
                with streams.client(index):
                    results.append(client_round(run, run.clients[k], download, round, extras.get(k), settle_now=False))
            streams.join()
        start = time.perf_counter()
        settle(results)  # the round's one wait for the device (see settle)
        if results:
            results[-1].seconds += time.perf_counter() - start
        return results

    def _stacked(
        self, run: Run, client_ids: list[int], download: dict[str, Any], round: int, extras: dict[int, dict[str, Any]]
    ) -> list[ClientRound]:
        """``--stack-clients``: the clients' rounds taking turns, their steps
        computed together (:mod:`fedaval.stacked`); the stacks kept from
        round to round, for the same clients' next steps together. Not yet
        settled."""
        from fedaval.stacked import Lockstep, Stacks

        if self.stacks is None:
            self.stacks = Stacks()
        lockstep = Lockstep(run.device, self.stacks, graphs=run.config.cuda_graphs)

        def work(k: int):
            return lambda: client_round(run, run.clients[k], download, round, extras.get(k), settle_now=False)

        results = lockstep.run([work(k) for k in client_ids])
        for result, seconds in zip(results, lockstep.seconds):
            result.seconds = seconds  # its own turns and its share of the stacked steps, not the round's span
        return results
