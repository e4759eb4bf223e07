"""Where clients run: the seam between the round loop and the clients.

The coordinator (:mod:`fedaval.coordinator`) owns the order of a round and
the server; a backend runs the client half of it, the hooks that run on a
client (receive, local training, upload) and the clients' evaluation, and
reports what each client produced. The in-process backend
(:class:`LocalBackend`) runs the sampled clients one after the other;
``--backend ray`` (:mod:`fedaval.backends.ray`) runs them in parallel on Ray
workers, the driver keeping every client's state between rounds.

Each client draws its random numbers (data order, augmentation, dropout,
plugins' draws) from its own streams (:meth:`fedaval.client.Client.rng_scope`),
seeded from the run's seed and its id. So what a client computes in a round
does not depend on which other clients ran before it, or where: the same
seed gives the same results whichever backend runs the clients.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from fedaval.errors import FedavalUsageError
from fedaval.payload import Upload, check_finite, merge_entries

if TYPE_CHECKING:
    from fedaval.client import Client
    from fedaval.run import Run

__all__ = ["Backend", "ClientRound", "LocalBackend", "client_round", "check_losses", "make_backend"]


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


class Backend(Protocol):
    """What the coordinator asks of a backend each round."""

    def train_clients(self, run: Run, client_ids: list[int], download: dict[str, Any], round: int) -> list[ClientRound]:
        """Run round ``round`` on each client of ``client_ids`` (steps 2a-2c of
        :func:`fedaval.coordinator.run_round`); results in ``client_ids`` order."""

    def client_accuracies(self, run: Run, round: int) -> dict[int, float | None]:
        """Each started client's stream accuracy on its seen classes, evaluating
        the clients trained since their last evaluation."""


def check_losses(losses: dict[str, float]) -> None:
    import math

    for name, value in losses.items():
        if not math.isfinite(value):
            raise FloatingPointError(f"{name} is {value}")


def client_round(run: Run, client: Client, download: dict[str, Any], round: int) -> ClientRound:
    """One client's part of a round, in its own random streams; a failure
    (an exception, a non-finite loss or upload) is caught and reported."""
    hook = run.hook
    with client.rng_scope():
        try:
            client.receive(download)
            losses = hook.fedaval_local_train(run=run, client=client, round=round) or {}
            check_losses(losses)
            entries = merge_entries(hook.fedaval_client_upload(run=run, client=client), "upload")
            check_finite(entries, "upload")
        except FedavalUsageError:
            raise  # a plugin misused (a clashing loss-term name): the same in every client, not a client failure
        except Exception as exc:  # noqa: BLE001 - the coordinator applies the failure policy
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            return ClientRound(client.id, failure=reason, error=exc)
    return ClientRound(client.id, losses=losses, upload=Upload(client.id, client.num_samples(), entries))


class LocalBackend:
    """Every client in this process, one after the other, on ``--device``."""

    name = "local"

    def train_clients(self, run: Run, client_ids: list[int], download: dict[str, Any], round: int) -> list[ClientRound]:
        return [client_round(run, run.clients[k], download, round) for k in client_ids]

    def client_accuracies(self, run: Run, round: int) -> dict[int, float | None]:
        from fedaval.evaluation import STREAM_ACC, scalar

        accuracies = {}
        for client in run.clients:
            if not client.tasks_started:
                continue
            if client.trained_at > client.evaluated_at:
                with client.rng_scope():
                    client.evaluate()
                client.evaluated_at = round
            if client.last_eval:
                accuracies[client.id] = scalar(client.last_eval, STREAM_ACC)
        return accuracies


def make_backend(run: Run) -> Backend:
    """The backend ``--backend`` names: ``local`` (in process) or ``ray``."""
    if run.config.backend == "local":
        return LocalBackend()
    if run.config.backend == "ray":
        from fedaval.errors import FedavalUsageError

        try:
            import ray  # noqa: F401
        except ImportError:
            raise FedavalUsageError(
                "--backend ray needs Ray, which is not installed; install it with: pip install 'fedaval[ray]'"
            ) from None
        from fedaval.backends.ray import RayBackend

        return RayBackend(run)
    raise AssertionError(run.config.backend)  # RunConfig.validate allows only the names above
