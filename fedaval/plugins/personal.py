"""A personalised head: the shared base (``model.features``) is averaged by
the server, the head (``model.classifier``) never leaves the client, and
each round's local epochs train one part at a time.

Shared by FedRep (Collins et al. 2021: head first, then body) and GLDP
(base first, then head, Eq. 3-5 of the GLDP paper). The rules are plain
functions; :class:`PersonalHead` is the hook glue a method mixes in.

Local epochs per round. The number of local epochs is the core's
``--local-epochs`` E, the same knob for every method (so comparisons with
FedAvg at equal local work stay fair). A method's two phase lengths are
resolved against it by :func:`resolve_phases`: both given -> they must sum
to E; one given -> the other is E minus it; none given -> the method's
default split of E; with E = 1 and nothing given, no split is possible and
base and head train together in that one epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from fedaval import hookimpl
from fedaval.errors import FedavalUsageError

Part = Literal["base", "head", "all"]


def personal_shared_keys(model) -> list[str]:
    """Floating-point ``state_dict`` entries outside the classifier: what a
    personalised-head method uploads and averages (GLDP Eq. 5, FedRep's
    representation). Integer buffers (BatchNorm's batch counter) stay local,
    as in FedAvg's default."""
    head = set(model.classifier_keys())
    return [k for k, v in model.state_dict().items() if v.is_floating_point() and k not in head]


def resolve_phases(
    local_epochs: int,
    first: int | None,
    second: int | None,
    default_first: Callable[[int], int],
    names: tuple[str, str],
    owner: str,
) -> tuple[int, int] | None:
    """Epochs of the first and second phase of a round of ``local_epochs``
    epochs (see the module docstring for the rule). ``default_first(E)`` is
    the method's default length of the first phase for E >= 2. Returns
    ``None`` for "no split: train everything every epoch" (E = 1, nothing
    given). Raises a one-line :class:`FedavalUsageError` when the given
    lengths do not fit E; ``names`` are the option names, ``owner`` the
    plugin name, for that message."""
    if first is not None and first < 0 or second is not None and second < 0:
        raise FedavalUsageError(f"{owner}.{names[0]} and {owner}.{names[1]} must be >= 0")
    if first is not None and second is not None:
        if first + second == 0:
            raise FedavalUsageError(
                f"{owner}.{names[0]}=0 + {owner}.{names[1]}=0 local epochs per round train nothing; "
                f"give them a sum of --local-epochs {local_epochs}"
            )
        if first + second != local_epochs:
            raise FedavalUsageError(
                f"{owner}.{names[0]}={first} + {owner}.{names[1]}={second} local epochs per round, "
                f"but --local-epochs is {local_epochs}; pass --local-epochs {first + second}"
            )
        return first, second
    if first is None and second is None:
        if local_epochs == 1:
            return None
        first = default_first(local_epochs)
    if first is None:
        assert second is not None
        first = local_epochs - second
    if not 0 <= first <= local_epochs:
        given = f"{names[0]}={first}" if second is None else f"{names[1]}={second}"
        raise FedavalUsageError(f"{owner}.{given} does not fit in --local-epochs {local_epochs}")
    return first, local_epochs - first


def part_of_epoch(epoch: int, phases: tuple[int, int] | None, order: tuple[Part, Part]) -> Part:
    """Which part local epoch ``epoch`` (0-based, within the round) trains:
    ``order[0]`` for the first ``phases[0]`` epochs, then ``order[1]``;
    ``"all"`` when ``phases`` is ``None``."""
    if phases is None:
        return "all"
    return order[0] if epoch < phases[0] else order[1]


def set_trainable(model, part: Part) -> None:
    """Train only ``part`` of a split model: the other part gets
    ``requires_grad=False`` (no gradient, so SGD and its weight decay leave it
    alone) and eval mode (its BatchNorm statistics do not move either)."""
    for module, on in ((model.features, part in ("base", "all")), (model.classifier, part in ("head", "all"))):
        module.train(on)
        for p in module.parameters():
            p.requires_grad_(on)


def uniform_average(states: list[dict]) -> dict:
    """``1/|N_k| sum_i mu_i`` key by key: the plain mean over the sampled
    clients of GLDP Eq. 5 and FedRep's server update (no sample weights)."""
    from fedaval.plugins.fedavg import weighted_average

    return weighted_average(states, [1.0] * len(states))


class PersonalHead:
    """Hook glue for a personalised head. Subclasses set ``phase_order`` and
    ``self.phases`` (from :func:`resolve_phases`, in ``fedaval_setup``)."""

    phase_order: tuple[Part, Part] = ("base", "head")
    phases: tuple[int, int] | None = None

    @hookimpl
    def fedaval_shared_keys(self, run, model):
        return personal_shared_keys(model)

    @hookimpl
    def fedaval_server_fuse_weights(self, run, uploads, global_weights):
        states = [u.get("weights") for u in uploads if u.get("weights")]
        return uniform_average(states) if states else None

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        set_trainable(client.model, part_of_epoch(epoch, self.phases, self.phase_order))

    @hookimpl(specname="fedaval_client_task_end", tryfirst=True)
    def restore_trainable_at_task_end(self, run, client, task):
        """Everything trainable again once the task's last round is done, so
        end-of-task work (this method's or another plugin's, e.g. importance
        estimates) sees the whole model; the next round's first epoch sets
        the phase again."""
        set_trainable(client.model, "all")
