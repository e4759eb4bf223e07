"""Client-level differential privacy for any method: ``--plugins fedavg,dp``,
``--plugins fedprok,dp``. The maths is in :mod:`fedaval.plugins.dp_math`.

What a client sends is privatised as one vector (DP-FedAvg, McMahan et al.
2018): its weight *update* (the ``"weights"`` entry minus the weights it
received this round) together with every other floating-point payload of
its upload (prototypes, class statistics) is clipped to L2 norm ``clip``
and every coordinate gets Gaussian noise of standard deviation
``noise * clip``. The server then fuses as usual (``received + noisy
update`` for the weights). The privacy spent is accounted each round with
Opacus's RDP accountant at the round's sampling rate ``q`` = clients
scheduled / clients eligible in the stage (those with data for it: in
``fcl-random`` and with ``--clients-per-round``, a stage some clients sit
out samples its few eligible ones at a higher rate), and reported as epsilon
at ``delta``: the round metric ``dp.epsilon`` and results.json's
``privacy.dp`` block (one epsilon per round; ``null`` without noise, where
there is no guarantee). A plugin whose server reads clients' data outside
the uploads (``fedaval_server_reads_client_data``: HGP's statistics
exchange) is refused, since the noise cannot reach that data.

Readings chosen (the issue leaves them open):

1. *Where the noise is added*: on each client, before the upload leaves it
   (the honest-but-curious server sees only noisy uploads), not on the
   server's sum. Each upload is then itself a Gaussian mechanism with noise
   multiplier ``z``; the server's average of ``m`` such uploads carries
   more noise than DP-FedAvg's central mechanism with the same ``z``, so the
   accounted epsilon (central DP-FedAvg's: one sampled Gaussian mechanism
   per round, sensitivity ``clip``, add/remove-one-client adjacency) is an
   upper bound for the aggregate.
2. *Sampling*: Opacus's accountant assumes Poisson sampling of clients at
   rate ``q``; fedaval samples a fixed number per round. The same
   approximation is made by TensorFlow Federated's DP-FedAvg tutorials.
   With ``--client-sampling task`` a task's rounds all train the clients
   drawn at its start, so its rounds are not independently subsampled and
   no amplification is claimed: every round is accounted at ``q = 1``.
3. *One joint vector*: weights update and prototypes share one clip norm
   (so the mechanism's sensitivity is ``clip`` whatever the method uploads).
4. *What is not protected*: integer payloads (FedProK's per-class sample
   counts, ``num_samples``, FedNova's step counts, the keys of a
   prototype upload, which say what classes a client holds) and booleans
   pass unchanged (Python floats, GLFC's entropy signal, are noised as
   floating-point payloads); BatchNorm running statistics
   (floating buffers, not parameters) are sent unchanged by default
   (``dp.buffers=keep``; noise would make running variances negative) or
   withheld (``dp.buffers=drop``: the global model keeps its own). Neither is
   covered by the epsilon reported.
5. *Reproducibility*: the noise is drawn inside the client's round from its
   own random streams (``client.rng_scope``), so a run is the same on every
   backend and in any client order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError
from fedaval.options import non_negative, option, positive
from fedaval.plugin import Plugin
from fedaval.stash import StashKey

RECEIVED = StashKey[dict]("dp.received")  # the shared weights the client received this round
DOWNLOAD = StashKey[dict]("dp.download")  # what it received, for fedaval_client_upload_reference


def _open_unit(value: float) -> str | None:
    return None if 0 < value < 1 else "must be in (0, 1)"


@dataclass
class DPOptions:
    clip: float = option(1.0, "L2 norm every client's upload (update + prototypes) is clipped to", positive)
    noise: float = option(1.0, "noise multiplier z: Gaussian noise std = z * clip per coordinate", non_negative)
    delta: float = option(1e-5, "delta at which epsilon is reported", _open_unit)
    buffers: Literal["keep", "drop"] = option(
        "keep", "BatchNorm running statistics: keep (sent unprotected) or drop (not sent)"
    )


class DP(Plugin):
    """Clip + Gaussian noise on every upload, RDP accounting on the server.

    State: in each client's stash ``RECEIVED`` (the round's received shared
    weights) and ``DOWNLOAD`` (the round's download), both dropped once the
    upload is made; on the plugin (server),
    ``history`` the accountant's ``[noise multiplier, sample rate, rounds]``
    and ``epsilons`` the epsilon after each round."""

    name = "dp"
    description = "client-level differential privacy: clip + Gaussian noise on uploads, RDP accountant (any method)"
    Options = DPOptions

    def __init__(self, options: Any = None):
        super().__init__(options)
        self.history: list[list[float]] = []
        self.epsilons: list[float] = []

    @hookimpl
    def fedaval_setup(self, run):
        try:
            import opacus.accountants  # noqa: F401
        except ImportError as exc:
            raise FedavalUsageError(f"--plugins dp needs opacus (pip install 'fedaval[privacy]'): {exc}") from None
        clients = len(run.partition.clients)
        if self.options.delta >= 1 / clients:
            import logging

            logging.getLogger("fedaval").warning(
                "dp.delta=%g is not below 1/N = %.3g for N = %d clients: with client-level DP a mechanism that "
                "publishes one client's data whole meets delta = 1/N; take delta well below it",
                self.options.delta,
                1 / clients,
                clients,
            )
        if self.options.buffers == "drop":
            import torch

            with torch.random.fork_rng(devices=[]):  # the run's models start as they would without this look
                model = run.model(None)
            keys = run.hook.fedaval_shared_keys(run=run, model=model) or []
            if not buffer_keys(model, dict.fromkeys(keys)):
                import logging

                logging.getLogger("fedaval").warning(
                    "dp.buffers=drop: the model shares no buffers (no BatchNorm statistics), so nothing is withheld"
                )
        outside = [answer for answer in run.hook.fedaval_server_reads_client_data(run=run) if answer]
        if outside:
            raise FedavalUsageError(
                f"--plugins dp cannot protect what the server reads outside the uploads: {'; '.join(outside)}"
            )

    # --- client -------------------------------------------------------------
    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        client.stash[RECEIVED] = client.shared_state()
        client.stash[DOWNLOAD] = download  # the round's tensors, shared by its clients: no copy

    @hookimpl(wrapper=True)
    def fedaval_client_upload(self, run, client):
        """Privatise the merged upload of every plugin (this wrapper sees the
        list of their results and returns it transformed)."""
        results = yield
        received = client.stash.pop(RECEIVED, None) or {}
        download = client.stash.pop(DOWNLOAD, None) or {}
        frozen = {name for name, p in client.model.named_parameters() if not p.requires_grad and name in received}
        upload = {key: value for result in results if result for key, value in result.items()}
        references: dict = {}
        for answer in run.hook.fedaval_client_upload_reference(
            run=run, client=client, upload=upload, download=download
        ):
            references.update(answer or {})
        return privatise(results, received, self.options, buffer_keys(client.model, received), frozen, references)

    # --- server -------------------------------------------------------------
    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        from fedaval.plugins.dp_math import epsilon, sample_rate

        eligible = sum(1 for client in run.clients if client.has_task(run.now.task))
        q = sample_rate(len(run.schedule[round - 1]), eligible) if run.config.client_sampling == "round" else 1.0
        z = self.options.noise
        if self.history and self.history[-1][0] == z and self.history[-1][1] == q:
            self.history[-1][2] += 1
        else:
            self.history.append([z, q, 1])
        self.epsilons.append(epsilon([tuple(h) for h in self.history], self.options.delta))
        return None

    @hookimpl
    def fedaval_round_metrics(self, run, round):
        return {"epsilon": finite_or_none(self.epsilons[-1]) if self.epsilons else 0.0}

    def privacy_results(self, run) -> dict[str, Any]:
        """results.json's ``privacy.dp`` block (:func:`fedaval.privacy.privacy_results`)."""
        return {
            "clip": self.options.clip,
            "noise_multiplier": self.options.noise,
            "delta": self.options.delta,
            "buffers": self.options.buffers,
            "accountant": "opacus.accountants.RDPAccountant",
            "sample_rate": self.history[-1][1] if self.history else None,
            "accountant_history": [list(h) for h in self.history],
            "epsilon": finite_or_none(self.epsilons[-1]) if self.epsilons else 0.0,
            "epsilon_by_round": [finite_or_none(e) for e in self.epsilons],
            "guarantee": self.options.noise > 0,
        }


def finite_or_none(value: float) -> float | None:
    """``value``, or ``None`` for an infinite epsilon (no noise, no
    guarantee): strict JSON has no infinity."""
    return None if value == float("inf") else value


def buffer_keys(model, shared: dict) -> set[str]:
    """Shared keys that are not parameters (BatchNorm running statistics)."""
    params = {name for name, _ in model.named_parameters()}
    return {key for key in shared if key not in params}


def privatise(
    results: list,
    received: dict,
    options: DPOptions,
    buffers: set[str],
    frozen: frozenset[str] | set[str] = frozenset(),
    references: dict | None = None,
) -> list:
    """Reading 1-4 of the module docstring on the plugins' upload results
    (``[{entry: payload}, ...]``): the ``"weights"`` entry becomes
    ``received + noisy(update)``; every other floating payload is noised in
    place; all of them share one clip. A ``frozen`` parameter (not trained
    by the client: FedProK's extractor after its first task) whose value is
    exactly the received one is sent as received, unnoised: its update is 0
    whatever the client's data, so leaving it out of the vector costs no
    privacy (it adds 0 to the norm), and noising it only wrecked a weight
    no one trains (until session 34). An entry with a ``references`` payload
    (``fedaval_client_upload_reference``: absolute values of received state,
    FedWeIT's sparse base) is privatised as its difference from the
    reference, which is added back after the noise."""
    import torch

    from fedaval.plugins.dp_math import clip_and_noise, float_tensors, replace_float_tensors

    references = references or {}
    prepared = []
    for result in results:
        if not result:
            prepared.append(result)
            continue
        entries = dict(result)
        for key in entries.keys() & references.keys():
            entries[key] = shifted(entries[key], references[key], -1, key)
        weights = entries.get("weights")
        if weights:
            kept = {k: v for k, v in weights.items() if k in buffers}
            still = {k: v for k, v in weights.items() if k in frozen and torch.equal(v, received[k].to(v.device))}
            update = {
                k: (v - received[k].to(v.device)) if k in received else v
                for k, v in weights.items()
                if k not in buffers and k not in still
            }
            entries["weights"] = update
            entries["__dp_buffers__"] = kept
            entries["__dp_frozen__"] = still
        prepared.append(entries)
    aside = ("__dp_buffers__", "__dp_frozen__")
    protected = [t for r in prepared if r for key, value in r.items() if key not in aside for t in float_tensors(value)]
    noisy, _ = clip_and_noise(protected, options.clip, options.noise)
    stream = iter(noisy)
    out = []
    for entries in prepared:
        if not entries:
            out.append(entries)
            continue
        kept = entries.pop("__dp_buffers__", None)
        still = entries.pop("__dp_frozen__", {})
        entries = {key: replace_float_tensors(value, stream) for key, value in entries.items()}
        for key in entries.keys() & references.keys():
            entries[key] = shifted(entries[key], references[key], 1, key)
        if kept is not None:
            weights = {k: (v + received[k].to(v.device)) if k in received else v for k, v in entries["weights"].items()}
            weights.update(still)
            if options.buffers == "keep":
                weights.update(kept)
            entries["weights"] = weights
        out.append(entries)
    return out


def shifted(payload, reference, sign: int, entry: str):
    """``payload`` with ``sign x`` each floating-point tensor of ``reference``
    added to the one at the same place (:func:`float_tensors` order)."""
    from fedaval.plugins.dp_math import float_tensors, replace_float_tensors

    values, refs = list(float_tensors(payload)), list(float_tensors(reference))
    if len(values) != len(refs) or any(v.shape != r.shape for v, r in zip(values, refs)):
        raise ValueError(f"fedaval_client_upload_reference: the reference of {entry!r} does not match its payload")
    return replace_float_tensors(payload, iter(v + sign * r.to(v.device, v.dtype) for v, r in zip(values, refs)))
