"""Where clients run: the seam between the round loop and the clients.

The coordinator (:mod:`fedaval.coordinator`) owns the order of a round, the
server and the evaluation; a backend runs the client half of a round, the
hooks that run on a client (receive, local training, upload), and reports
what each client produced. The caller makes the backend (:func:`make_backend`)
and hands it to :func:`fedaval.coordinator.train`. The in-process backend
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

from typing import TYPE_CHECKING

from fedaval.backends.local import Backend, ClientRound, LocalBackend, check_losses, client_round

if TYPE_CHECKING:
    from fedaval.run import Run

__all__ = ["Backend", "ClientRound", "LocalBackend", "client_round", "check_losses", "make_backend"]


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
