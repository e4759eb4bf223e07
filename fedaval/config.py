"""The resolved configuration of a run (written to ``config.json``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from fedaval.errors import FedavalUsageError

FAILURE_POLICIES = ("drop", "fail")
DATA_PATHS = ("auto", "device", "loader")
OFFLOAD_POLICIES = ("auto", "none", "cpu", "disk")
HOST_MEMORY = ("keep", "release")  # fedaval/host_memory.py
CHECKPOINT_WRITERS = ("auto", "thread")  # fedaval/checkpoint.py: Schedule, can_fork
BACKENDS = ("local", "ray")
OPTIMIZERS = ("sgd", "adam")  # fedaval/training.py: make_optimizer
OPTIMIZER_STATES = ("reset", "keep")
LR_SCHEDULES = ("constant", "cosine", "exp")
AUGMENTS = ("auto", "none", "standard")
CUDA_GRAPH_SCOPES = ("features", "step")  # what --cuda-graphs captures (fedaval.cuda_graphs)
CLIENT_SAMPLINGS = ("round", "task")  # when --clients-per-round draws its clients (fedaval.build.make_schedule)
CLIENT_TESTS = ("test", "train")  # how a client's accuracy weighs its classes (fedaval.evaluation.client_accuracy_on)
PRECISIONS = ("fp32", "bf16")  # local training's forward and loss (fedaval.training.autocast)
COMPILE_BACKENDS = ("off", "inductor", "aot_eager")  # --compile (fedaval.training.compiled_features)
MAX_CLIENT_STREAMS = 64  # --client-streams (fedaval.cuda_streams)
FLOAT32_MAX = 3.4028234663852886e38  # torch's optimizers take --lr and --weight-decay as float32 scalars

TRAINING_DEFAULTS: dict[str, dict[str, Any]] = {
    # digits (8x8, the MLP), measured, not guessed: lr 0.01 x 1 epoch left FedAvg
    # at 51% on its first fcil-sync task; lr 0.05 x 2 epochs learns every task to
    # >= 92%. lr 0.1 x 2 epochs did too, but cut GLDP's README run (sthfl) from
    # 71.7% (lr 0.01) to 45.0% final global accuracy; lr 0.05 gives it 66.7%.
    "digits": {"lr": 0.05, "momentum": 0.0, "local_epochs": 2},
}
"""Per dataset, the values ``--lr``, ``--momentum`` and ``--local-epochs``
take when not given; any other dataset gets :data:`GENERIC_DEFAULTS`."""

GENERIC_DEFAULTS: dict[str, Any] = {"lr": 0.01, "momentum": 0.9, "local_epochs": 1}
"""SGD as the papers train their CIFAR ResNets: lr 0.01, momentum 0.9."""

ADAM_DEFAULTS: dict[str, Any] = {"lr": 1e-3, "momentum": 0.0}
"""With ``--optimizer adam``, on every dataset: PyTorch's (and Kingma and
Ba's) learning rate, which FedWeIT's and FedSpace's released code train
with; momentum is SGD's and does not apply (Adam keeps its own moments)."""


def config_changes(before: dict[str, Any], after: dict[str, Any]) -> str:
    """``key old -> new`` for (up to three of) the settings that differ
    between two configuration dicts, ``out`` (where the run folder is)
    excepted; ``""`` when they agree."""
    changed = sorted(k for k in set(before) | set(after) if k != "out" and before.get(k) != after.get(k))
    return ", ".join(f"{k} {before.get(k)!r} -> {after.get(k)!r}" for k in changed[:3])


@dataclass
class RunConfig:
    """Everything that defines a run. Plugin and scenario options are kept raw
    here (as the user gave them) and validated by their owners."""

    plugins: list[str] = field(default_factory=lambda: ["fedavg"])
    plugin_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    scenario: str = "fcil-sync"
    scenario_options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "digits"
    data_root: str | None = None
    download: bool = False
    model: str = "auto"
    rounds_per_task: int = 3
    local_epochs: int | None = None  # None: per dataset (TRAINING_DEFAULTS)
    clients_per_round: int = 0
    client_sampling: str = "round"
    batch_size: int = 32
    lr: float | None = None  # None: per dataset
    momentum: float | None = None  # None: per dataset
    weight_decay: float = 1e-4
    optimizer: str = "sgd"
    optimizer_state: str = "reset"
    lr_schedule: str = "constant"
    lr_min: float = 1e-4
    augment: str = "auto"
    deterministic: bool = False
    cuda_graphs: bool = False
    cuda_graph_scope: str = "features"
    precision: str = "fp32"
    channels_last: bool = False
    compile: str = "off"
    client_streams: int = 1
    stack_clients: bool = False
    eval_every: int = 1
    client_test: str = "test"
    utility_lambda: float = 0.5
    link_mbps: float = 100.0
    device: str = "auto"
    seed: int = 0
    out: str | None = None
    checkpoint_every: int | str = "auto"
    keep_checkpoints: int = 2
    checkpoint_writer: str = "auto"
    on_client_failure: str = "drop"
    data_path: str = "auto"
    offload_clients: str = "auto"
    host_memory: str = "keep"
    backend: str = "local"
    client_gpus: float = 0.0
    ray_address: str | None = None

    def fill_defaults(self) -> None:
        """Give ``lr``, ``momentum`` and ``local_epochs`` left unset their
        dataset's defaults (:data:`TRAINING_DEFAULTS`), or with ``--optimizer
        adam`` :data:`ADAM_DEFAULTS` for the first two."""
        defaults = TRAINING_DEFAULTS.get(self.dataset, GENERIC_DEFAULTS)
        if self.optimizer == "adam":
            defaults = {**defaults, **ADAM_DEFAULTS}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)

    def needs_local_backend(self, option: str) -> None:
        """``option`` runs a round's clients in this one process: with another
        ``--backend``, a one-line error."""
        if self.backend != "local":
            raise FedavalUsageError(
                f"{option} needs --backend local (the clients of one process), not --backend {self.backend}"
            )

    def validate(self) -> None:
        """Fill the per-dataset defaults, then one-line errors for values no run
        can use (NaN and infinite floats included: every comparison below is
        False for NaN)."""
        self.fill_defaults()
        if isinstance(self.checkpoint_every, str) and self.checkpoint_every.strip().isdigit():
            self.checkpoint_every = int(self.checkpoint_every)  # the CLI gives text
        assert self.lr is not None and self.momentum is not None and self.local_epochs is not None
        finite = {name: math.isfinite(getattr(self, name)) for name in ("lr", "weight_decay", "client_gpus", "lr_min")}
        checks = [
            ("--seed", self.seed, 0 <= self.seed < 2**32, "in [0, 2**32 - 1]"),
            ("--rounds-per-task", self.rounds_per_task, self.rounds_per_task >= 1, ">= 1"),
            ("--local-epochs", self.local_epochs, self.local_epochs >= 1, ">= 1"),
            ("--clients-per-round", self.clients_per_round, self.clients_per_round >= 0, ">= 0 (0: all)"),
            (
                "--client-sampling",
                self.client_sampling,
                self.client_sampling in CLIENT_SAMPLINGS,
                "one of " + ", ".join(CLIENT_SAMPLINGS),
            ),
            ("--batch-size", self.batch_size, self.batch_size >= 1, ">= 1"),
            (
                "--lr",
                self.lr,
                finite["lr"] and 0 < self.lr <= FLOAT32_MAX,
                "finite, > 0 and at most float32's largest, 3.4e38",
            ),
            ("--optimizer", self.optimizer, self.optimizer in OPTIMIZERS, "one of " + ", ".join(OPTIMIZERS)),
            ("--momentum", self.momentum, 0 <= self.momentum < 1, "in [0, 1)"),
            (
                "--momentum",
                self.momentum,
                self.optimizer != "adam" or self.momentum == 0,
                "0 with --optimizer adam (momentum is SGD's; Adam keeps its own moments)",
            ),
            (
                "--weight-decay",
                self.weight_decay,
                finite["weight_decay"] and 0 <= self.weight_decay <= FLOAT32_MAX,
                "finite, >= 0 and at most float32's largest, 3.4e38",
            ),
            ("--eval-every", self.eval_every, self.eval_every >= 1, ">= 1"),
            ("--utility-lambda", self.utility_lambda, 0 <= self.utility_lambda <= 1, "in [0, 1]"),
            ("--link-mbps", self.link_mbps, self.link_mbps > 0, "> 0 (Mbit/s)"),
            (
                "--checkpoint-every",
                self.checkpoint_every,
                self.checkpoint_every == "auto"
                or (isinstance(self.checkpoint_every, int) and self.checkpoint_every >= 0),
                "auto or an integer >= 0 (0: never)",
            ),
            ("--keep-checkpoints", self.keep_checkpoints, self.keep_checkpoints >= 1, ">= 1"),
            (
                "--checkpoint-writer",
                self.checkpoint_writer,
                self.checkpoint_writer in CHECKPOINT_WRITERS,
                "one of " + ", ".join(CHECKPOINT_WRITERS),
            ),
            (
                "--on-client-failure",
                self.on_client_failure,
                self.on_client_failure in FAILURE_POLICIES,
                "one of " + ", ".join(FAILURE_POLICIES),
            ),
            ("--data-path", self.data_path, self.data_path in DATA_PATHS, "one of " + ", ".join(DATA_PATHS)),
            (
                "--offload-clients",
                self.offload_clients,
                self.offload_clients in OFFLOAD_POLICIES,
                "one of " + ", ".join(OFFLOAD_POLICIES),
            ),
            (
                "--host-memory",
                self.host_memory,
                self.host_memory in HOST_MEMORY,
                "one of " + ", ".join(HOST_MEMORY),
            ),
            ("--backend", self.backend, self.backend in BACKENDS, "one of " + ", ".join(BACKENDS)),
            (
                "--client-gpus",
                self.client_gpus,
                finite["client_gpus"] and 0 <= self.client_gpus,
                "finite and >= 0 (a fraction of one GPU per client)",
            ),
            (
                "--optimizer-state",
                self.optimizer_state,
                self.optimizer_state in OPTIMIZER_STATES,
                "one of " + ", ".join(OPTIMIZER_STATES),
            ),
            ("--lr-schedule", self.lr_schedule, self.lr_schedule in LR_SCHEDULES, "one of " + ", ".join(LR_SCHEDULES)),
            ("--augment", self.augment, self.augment in AUGMENTS, "one of " + ", ".join(AUGMENTS)),
            ("--precision", self.precision, self.precision in PRECISIONS, "one of " + ", ".join(PRECISIONS)),
            ("--client-test", self.client_test, self.client_test in CLIENT_TESTS, "one of " + ", ".join(CLIENT_TESTS)),
            ("--compile", self.compile, self.compile in COMPILE_BACKENDS, "one of " + ", ".join(COMPILE_BACKENDS)),
            (
                "--client-streams",
                self.client_streams,
                isinstance(self.client_streams, int) and 1 <= self.client_streams <= MAX_CLIENT_STREAMS,
                f"an integer from 1 to {MAX_CLIENT_STREAMS}",
            ),
            (
                "--cuda-graph-scope",
                self.cuda_graph_scope,
                self.cuda_graph_scope in CUDA_GRAPH_SCOPES,
                "one of " + ", ".join(CUDA_GRAPH_SCOPES),
            ),
            (
                "--lr-min",
                self.lr_min,
                self.lr_schedule == "constant" or (finite["lr_min"] and 0 < self.lr_min <= self.lr),
                f"in (0, --lr {self.lr}] for --lr-schedule {self.lr_schedule}",
            ),
        ]
        defaults = RunConfig()
        unread = [  # (flag, value, set away from its default, the setting that leaves it unread)
            (
                "--lr-min",
                self.lr_min,
                self.lr_min != defaults.lr_min,
                self.lr_schedule == "constant",
                "--lr-schedule constant",
            ),
            (
                "--optimizer-state",
                self.optimizer_state,
                self.optimizer_state == "keep",
                self.optimizer == "sgd" and self.momentum == 0,
                "--momentum 0: SGD keeps no state without momentum",
            ),
            *(
                (
                    flag,
                    getattr(self, name),
                    getattr(self, name) != getattr(defaults, name),
                    self.checkpoint_every == 0,
                    "--checkpoint-every 0",
                )
                for flag, name in (
                    ("--keep-checkpoints", "keep_checkpoints"),
                    ("--checkpoint-writer", "checkpoint_writer"),
                )
            ),
        ]
        for flag, value, given, idle, setting in unread:
            if given and idle:
                raise FedavalUsageError(f"{flag} {value} is not read with {setting}; drop it or change that setting")
        if self.backend != "ray":  # read by the Ray backend only (fedaval.backends.ray_backend)
            checks.append(("--client-gpus", self.client_gpus, self.client_gpus == 0, "0 without --backend ray"))
            checks.append(("--ray-address", self.ray_address, self.ray_address is None, "unset without --backend ray"))
        for flag, value, ok, allowed in checks:
            if not ok:
                raise FedavalUsageError(f"bad value {flag} {value}; must be {allowed}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})
