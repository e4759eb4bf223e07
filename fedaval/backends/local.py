"""The in-process backend, and what every backend shares: one client's round
(:func:`client_round`) and its result (:class:`ClientRound`). See
:mod:`fedaval.backends`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedaval.errors import FedavalUsageError
from fedaval.payload import Upload, check_finite, merge_entries

if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run

__all__ = ["Backend", "ClientRound", "LocalBackend", "client_round", "check_losses"]


@dataclass
class ClientRound:
    """What one client's round produced: its upload and mean loss terms, or
    why it failed (``failure``, one line; ``error`` the exception where the
    backend has it)."""

    client_id: int
    losses: dict[str, float] = field(default_factory=dict)
    upload: Upload | None = None
    failure: str | None = None
    error: BaseException | None = None
    seconds: float = 0.0  # wall-clock of its local training (fedaval_client_train)


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
    run: Run, client: Client, download: dict[str, Any], round: int, extra: dict[str, Any] | None = None
) -> ClientRound:
    """One client's part of a round, in its own random streams; a failure
    (an exception, a non-finite loss or upload) is caught and reported.
    ``extra``: this client's own download entries, on top of ``download``."""
    hook = run.hook
    start = time.perf_counter()  # the client's whole computation: receive, train, upload (FedProK's tau2)
    with client.rng_scope():
        try:
            assert run.now is not None, "a client round runs inside a round (run.enter_round)"
            client.task = run.now.task
            client.receive({**download, **extra} if extra else download)
            losses = hook.fedaval_client_train(run=run, client=client, round=round) or {}
            check_losses(losses)
            entries = merge_entries(hook.fedaval_client_upload(run=run, client=client), "upload")
            check_finite(entries, "upload")
        except FedavalUsageError:
            raise  # a plugin misused (a clashing loss-term name): the same in every client, not a client failure
        except Exception as exc:  # noqa: BLE001 - the coordinator applies the failure policy
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return ClientRound(client.id, failure=reason, error=exc, seconds=time.perf_counter() - start)
    seconds = time.perf_counter() - start
    return ClientRound(
        client.id, losses=losses, upload=Upload(client.id, client.num_samples(), entries), seconds=seconds
    )


class LocalBackend:
    """Every client in this process, one after the other, on ``--device``."""

    name = "local"

    def train_clients(
        self,
        run: Run,
        client_ids: list[int],
        download: dict[str, Any],
        round: int,
        extras: dict[int, dict[str, Any]] | None = None,
    ) -> list[ClientRound]:
        extras = extras or {}
        return [client_round(run, run.clients[k], download, round, extras.get(k)) for k in client_ids]
