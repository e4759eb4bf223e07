"""Hook specifications: everything a method plugin can do.

A method is a class whose methods are marked with :data:`fedaval.hookimpl`
and carry the names below. One plugin object owns both halves of its method
(client and server) and the state that goes with them.

Arguments are passed by name; an implementation may accept any subset of them.
``run`` is the :class:`fedaval.run.Run` of the job (config, scenario, device,
server, clients); ``client`` is a :class:`fedaval.client.Client`.

Names follow one rule: ``fedaval_<side>_<event>``, where the side is
``client`` (runs on a client, inside its own random streams) or ``server``
(runs on the server, once per round or task); hooks of neither side are
run-wide set-up, evaluation or teardown (``fedaval_setup``,
``fedaval_classify``, ``fedaval_round_metrics``...).

The order in which the hooks are called during one round is documented once,
in :func:`fedaval.coordinator.run_round`. Where the run is (round, task, first
and last round of the task) is ``run.now``, a :class:`fedaval.run.RoundInfo`
the coordinator computes once per round.

Registration is strict: an implementation whose name starts with
``fedaval_`` but matches no spec below is an error naming it and the closest
spec (:func:`fedaval.plugin_manager.check_hook_names`).

Per-client state of a plugin lives on the client, in ``client.stash`` (typed
keys the plugin owns, :class:`fedaval.stash.StashKey`), never in a plugin
attribute keyed by client id: the client then carries its method state
wherever it goes (offloaded to memory or disk, sent to a Ray worker, saved in a
checkpoint). A plugin's own attributes hold the server's state and are
changed by server hooks only.

What a plugin reads besides the arguments (the run, client and upload
objects, the stash, options, checkpointed state, what is logged, what a
wrong return value does) is in docs/plugins.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pluggy

from fedaval import PROJECT_NAME

if TYPE_CHECKING:  # pragma: no cover - type hints only
    import torch
    from torch import nn

    from fedaval.client import Batch, Client
    from fedaval.payload import Upload
    from fedaval.run import Run

hookspec = pluggy.HookspecMarker(PROJECT_NAME)


# ---------------------------------------------------------------------------
# set-up: once per run
# ---------------------------------------------------------------------------


@hookspec
def fedaval_setup(run: Run) -> None:
    """Called once, after every plugin is registered and the scenario is built,
    before any model exists. Plugins read ``run.config``, ``run.scenario`` and
    ``run.num_classes`` here and prepare their state. Return value ignored."""


@hookspec
def fedaval_server_reads_client_data(run: Run) -> str | None:
    """What this plugin's server side reads of the clients' data outside
    their uploads, in words that name the option turning it off (a
    simulation shortcut: HGP's statistics exchange computes every client's
    class statistics on the server); ``None`` when nothing. Asked once, at
    set-up, by plugins that protect the uploads: ``dp`` refuses to run when
    any plugin answers, since its noise cannot reach that data. Every plugin
    is called; the answers are collected."""


@hookspec(firstresult=True)
def fedaval_make_model(run: Run, client_id: int | None) -> nn.Module | None:
    """Build the model of client ``client_id`` (``None``: the server's global
    model). Called once per client at set-up, never again: client models live
    for the whole run.

    Return a :class:`fedaval.models.SplitModel` (a feature extractor and a
    classifier), any ``nn.Module`` that :func:`fedaval.models.split_model`
    can split, or ``None`` to defer. Stops at the first non-None result; the
    core's default (``--model``) is registered ``trylast``. Clients of one run
    may get different architectures (methods that average no weights allow it).
    """


@hookspec(firstresult=True)
def fedaval_shared_keys(run: Run, model: nn.Module) -> list[str] | None:
    """Which entries of ``model.state_dict()`` are shared with the server: the
    client uploads them and loads them back from the download. Everything else
    (a personalised head, say) never leaves the client.

    Stops at the first non-None result. FedAvg's default (``trylast``) shares
    every floating-point entry. Return ``[]`` for a method that averages no
    weights at all (prototypes only).
    """


@hookspec
def fedaval_register_scenarios(register: Callable[[str, Any], None]) -> None:
    """Add scenarios: call ``register(name, spec)`` with a
    :class:`fedaval.scenarios.ScenarioSpec` for each. Called once per run,
    right after the plugins are loaded and before ``--scenario`` is looked up;
    the core registers the built-ins this way. Every plugin is called; a name
    registered twice is an error naming both plugins."""


@hookspec
def fedaval_register_datasets(register: Callable[[str, Any], None]) -> None:
    """Add datasets: call ``register(name, loader)`` where
    ``loader(root: Path | None, download: bool)`` returns a
    :class:`fedaval.datasets.ImageData` (``root`` is ``--data-root``). Called
    once per run, after the plugins are loaded and before ``--dataset`` is
    looked up; the core registers the built-ins this way. Every plugin is
    called; a name registered twice is an error naming both plugins."""


@hookspec
def fedaval_register_models(register: Callable[[str, Any], None]) -> None:
    """Add models: call ``register(name, factory)`` where
    ``factory(input_shape, num_classes)`` returns a
    :class:`fedaval.models.SplitModel` (or a model
    :func:`fedaval.models.split_model` can split). Called once per run, after
    the plugins are loaded; ``--model`` names one. The core registers the
    built-ins this way. Every plugin is called; a name registered twice is an
    error naming both plugins."""


@hookspec
def fedaval_teardown(run: Run) -> None:
    """Called once when the run stops (finished, failed or interrupted),
    after the last results are written. Release files, threads and caches
    here. Every plugin is called; return value ignored."""


@hookspec
def fedaval_client_avalanche_plugins(run: Run, client: Client) -> list[Any] | None:
    """Avalanche training plugins (``SupervisedPlugin`` instances) to attach to
    ``client``'s strategy. Called once per client at set-up; all results are
    concatenated. Attached plugins see one Avalanche experience per *task*:
    their ``before_training_exp`` runs at the task's first round and their
    ``after_training_exp`` at its last (see :mod:`fedaval.strategy`)."""


# ---------------------------------------------------------------------------
# client round: on every sampled client, in the order of the client list
# ---------------------------------------------------------------------------


@hookspec
def fedaval_server_task_start(run: Run, task: int) -> None:
    """The federation starts stage ``task`` (0-based): called on the server
    once, before the stage's first round (``run.now`` is that round). Anchor
    what the stage's fusion needs (FedProK's prototype anchor). Every plugin
    is called."""


@hookspec
def fedaval_server_download(run: Run, client: Client, download: dict[str, Any]) -> dict[str, Any] | None:
    """Entries only ``client`` receives this round, on top of the broadcast
    ``download`` (which must not be modified): a method that sends each client
    something different (FedWeIT's knowledge base, a personalised model)
    returns them here. Called on the server for each sampled client before it
    trains; entries are merged into that client's download (one plugin per
    entry name) and their bytes are counted for that client."""


@hookspec
def fedaval_client_receive(run: Run, client: Client, download: dict[str, Any]) -> None:
    """The server's broadcast reaches ``client`` before its local training.
    ``client.task`` is already this round's task (at a task boundary: the
    new one).

    The core has already loaded ``download["weights"]`` (if any) into the
    client's shared keys; plugins take the other entries they put there in
    :func:`fedaval_server_fuse` (global prototypes, say). Every plugin is
    called; return value ignored."""


@hookspec
def fedaval_client_task_start(run: Run, client: Client, task: int) -> None:
    """``client`` starts task ``task`` (0-based): called once per task, at the
    first round the client trains on it, after Avalanche has built the task's
    dataloader and optimizer. Every plugin is called."""


@hookspec
def fedaval_client_train_data(run: Run, client: Client, task: int) -> Any:
    """Extra training data for ``client``'s task ``task``, added to the task's
    own samples for every round of the task: an exemplar memory, synthetic
    data. Called once per task, when the client starts it, before
    ``fedaval_client_task_start``.

    Return a 1-D integer array of indices into the run's training set
    (``run.data.train_x``; an exemplar memory of real samples: minibatches
    stay on the device data path), a ``torch.utils.data.Dataset`` yielding
    ``(x, y)`` with ``x`` normalised as the run's data (synthetic images: the
    task then takes the loader path), or ``None``. Every plugin is called;
    all results are added."""


@hookspec
def fedaval_client_epoch_start(run: Run, client: Client, epoch: int) -> None:
    """Before local epoch ``epoch`` (0-based, restarts every round) of
    ``client``. Methods that alternate what is trained (shared body, then
    personal head) switch ``requires_grad`` here. Every plugin is called."""


@hookspec(firstresult=True)
def fedaval_classify(
    run: Run, client: Client | None, model: nn.Module, features: torch.Tensor, training: bool
) -> torch.Tensor | None:
    """Turn ``features`` (output of ``model.features``) into class scores of
    ``client``'s model (``None``: the server's global model), in training
    (``training=True``, scores feed the cross-entropy) and evaluation.

    Stops at the first non-None result; ``None`` everywhere means
    ``model.classifier(features)``. Nearest-prototype and prototype-distance
    classifiers live here. In evaluation the scores are ``[N,
    run.num_classes]``, one column per class of the dataset (another shape
    stops the run with a :class:`~fedaval.errors.PluginError`); in training
    they are whatever the criterion reads.

    A sample's scores must depend on that sample's features alone: in
    evaluation a minibatch may hold the samples of several seen experiences
    (:mod:`fedaval.one_pass_eval`)."""


@hookspec(firstresult=True)
def fedaval_client_criterion(run: Run, client: Client, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
    """The base classification loss of one minibatch of ``client``'s local
    training (``batch.loss`` in :func:`fedaval_client_loss`). Stops at the
    first non-None result; the core's cross-entropy over all classes is
    registered ``trylast``. A method that re-weights the cross-entropy (GLFC)
    or restricts it to the current classes (TARGET) implements this."""


@hookspec
def fedaval_client_loss(run: Run, client: Client, batch: Batch) -> dict[str, torch.Tensor] | None:
    """Extra loss terms for one minibatch of ``client``'s local training.

    ``batch`` holds ``x``, ``y``, ``features`` (the model's features of ``x``,
    already computed), ``logits`` and ``loss`` (the classification loss).
    Return ``{name: scalar tensor}``, weights already applied. Every plugin is
    called; all terms are summed into the loss, and each is logged under its
    name (a name may come from one plugin only). Do not modify ``batch``."""


@hookspec
def fedaval_client_step(run: Run, client: Client, batch: Batch) -> None:
    """After each optimizer step of ``client``'s local training (``batch`` is
    the minibatch just used; ``batch.loss`` is then the total loss). Step
    counters (FedNova's tau) and per-step side updates go here. Every plugin
    is called."""


@hookspec
def fedaval_client_task_end(run: Run, client: Client, task: int) -> None:
    """``client`` finished task ``task``: called once per task, after the last
    round in which the client trains on it and before that round's upload.
    Prototype consolidation, teacher snapshots and memory updates go here.
    Every plugin is called."""


@hookspec(firstresult=True)
def fedaval_client_train(run: Run, client: Client, round: int) -> dict[str, float | torch.Tensor] | None:
    """Run ``client``'s local training for global round ``round`` (1-based).

    The core's implementation (``trylast``) calls the client's Avalanche
    strategy once. Returns the mean of every loss term over the round, each a
    float or a one-element tensor: the core's are tensors left on the device,
    read with every client's of the round at once
    (:func:`fedaval.backends.local.settle`), so the host need not wait for a
    GPU between clients. A
    ``wrapper=True`` implementation can time or guard the call. Stops at the
    first non-None result."""


# ---------------------------------------------------------------------------
# upload: after local training, on every sampled client
# ---------------------------------------------------------------------------


@hookspec
def fedaval_client_upload(run: Run, client: Client) -> dict[str, Any] | None:
    """What ``client`` sends to the server after local training, as
    ``{entry: payload}`` where payloads are tensors, numbers or nested dicts
    and lists of them. All plugins' entries are merged into one upload (an
    entry name may come from one plugin only); the bytes sent are counted from
    these tensors. FedAvg contributes ``"weights"`` (the shared keys)."""


@hookspec
def fedaval_client_upload_reference(
    run: Run, client: Client, upload: dict[str, Any], download: dict[str, Any]
) -> dict[str, Any] | None:
    """For upload entries whose floating-point values are *absolute* values of
    state the client received this round (weights a method sends its own way,
    not through ``"weights"``), the values it received, in the entry's
    structure: ``{entry: reference}``, each floating-point tensor of
    ``reference`` the shape of the one at the same place in ``upload[entry]``
    (integer parts, such as the indices of sparse rows, are not read).
    ``download`` is what the client received. A privacy plugin (``dp``) then
    clips and noises the client's update, value minus reference, and adds
    the reference back, as it does for ``"weights"``; an entry without a
    reference is privatised as it is (a prototype, a class statistic).
    Called only by plugins that need it, after ``fedaval_client_upload``;
    FedWeIT answers for its sparse base."""


# ---------------------------------------------------------------------------
# server fusion: once per round, on the server
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def fedaval_server_fuse_weights(
    run: Run, uploads: list[Upload], global_weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """Combine the uploaded ``"weights"`` into new global weights.

    ``global_weights`` is the current global state of the shared keys. Return
    the new values of (some of) those keys, each a tensor of its key's shape
    (a key the global model lacks, or another shape, stops the run with a
    :class:`~fedaval.errors.PluginError`). Stops at the first non-None
    result; FedAvg's sample-weighted mean is registered ``trylast``, so a
    method overrides it by implementing this hook."""


@hookspec
def fedaval_server_task_end(run: Run, task: int) -> None:
    """Stage ``task`` ends: called on the server once, after the fusion of the
    stage's last round and before that round's evaluation. End-of-stage
    steps (GLDP's final prototype step, a generator trained on the global
    model) go here. Every plugin is called."""


@hookspec
def fedaval_server_fuse(run: Run, uploads: list[Upload], round: int) -> dict[str, Any] | None:
    """Fuse everything except the weights (prototypes, class statistics), after
    the fused weights are loaded into ``run.server.model``. May also change
    the global model (re-train its classifier, say). Return entries to add to
    the broadcast that every client receives next round. Every plugin is
    called; entries are merged (one plugin per entry name)."""


# ---------------------------------------------------------------------------
# evaluation: after a round's evaluation
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def fedaval_client_evaluate(run: Run, client: Client) -> dict[str, Any] | None:
    """Around the evaluation of ``client``'s model (Avalanche metrics on its
    seen classes). The core's implementation runs the evaluation; a
    ``wrapper=True`` implementation swaps in another model for its duration
    (APFL's mixture) and restores the client's afterwards. Returns the
    Avalanche metrics dict."""


@hookspec
def fedaval_client_evaluation_stale(run: Run, client: Client) -> bool | None:
    """Whether ``client``'s last evaluation result no longer holds although
    the client has not trained since. The core evaluates a started client
    again when it trained since its last evaluation (``client.trained_at >
    client.evaluated_at``) or when any plugin returns ``True`` here; other
    clients keep their last result. Return ``True`` when the client's
    evaluation reads state that has changed since ``client.evaluated_at``
    (GLDP-GP's clients predict with the server's newest global prototypes).
    Asked before each evaluation for every started client not trained since
    its last one; every plugin is called, and ``True`` from any wins. Such an
    extra evaluation leaves no trace in the client's random streams (the core
    puts them back), so the run's training is the same with or without it."""


@hookspec
def fedaval_round_metrics(run: Run, round: int) -> dict[str, float] | None:
    """Extra scalar metrics for round ``round``, recorded in results.json and
    TensorBoard next to the core's. Every plugin is called; dicts are merged."""


# ---------------------------------------------------------------------------
# run-wide: what the federation's model is (read by the evaluation)
# ---------------------------------------------------------------------------


@hookspec(firstresult=True)
def fedaval_federation_model(run: Run) -> str | None:
    """What the federation learns: ``"global"`` (a global model on the
    server, the default) or ``"clients"`` (the clients' own models, for
    methods that average no weights and never train the server's model,
    PFCL's prototypes-only federation say).

    With ``"clients"`` the server's model is not evaluated: every
    global-model figure in results.json, TensorBoard and ``fedaval report``
    (``global_accuracy``, ``average_accuracy``, ``a_glo``, ``forgetting``,
    ``bwt``, stability, plasticity, utility, the accuracy matrix) is ``None``
    and the method is judged by its clients' accuracy
    (``mean_client_accuracy`` per evaluated round, ``average_client_accuracy``
    over the stages' ends). Called at set-up and at every evaluation. Stops at
    the first non-None result; the core's default (``trylast``) is
    ``"global"``."""
