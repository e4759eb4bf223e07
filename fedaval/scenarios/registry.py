"""The named settings (``--scenario``), their options and partitioners.

Options are set like plugin options, prefixed by the scenario's name:
``--scenario sthfl -o sthfl.clients=20 -o sthfl.imbalance=50``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from fedaval.errors import choice_error
from fedaval.options import option, positive, unit_interval
from fedaval.scenarios import partition
from fedaval.scenarios.partition import Partition


def _at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def _non_negative_int(value: int) -> str | None:
    return None if value >= 0 else "must be >= 0"


@dataclass
class SthflOptions:
    clients: int = option(10, "N: number of clients", _at_least_one)
    classes_per_task: int = option(2, "S: classes per client per stage", _at_least_one)
    tasks: int = option(3, "M: stages (tasks) per client", _at_least_one)
    imbalance: float = option(10.0, "IF: long-tail imbalance factor (largest / smallest class)", positive)


@dataclass
class FcilSyncOptions:
    clients: int = option(3, "number of clients", _at_least_one)
    tasks: int = option(5, "T: tasks, one shared class order cut into T groups", _at_least_one)
    alpha: float = option(1.0, "Dirichlet concentration for splitting each class over clients", positive)


@dataclass
class FcilAsyncOptions:
    clients: int = option(3, "number of clients", _at_least_one)
    tasks: int = option(3, "T: tasks per client", _at_least_one)
    consensus: float = option(
        0.5, "gamma: fraction of a client's classes that every client holds (FedProK)", unit_interval
    )
    classes_per_client: int = option(
        0,
        "m: classes per client, round(gamma*m) common + the rest unique (0: the most the dataset allows)",
        _non_negative_int,
    )


@dataclass
class FclRandomOptions:
    clients: int = option(5, "number of clients", _at_least_one)
    classes_per_task: int = option(2, "classes per task", _at_least_one)
    min_tasks: int = option(2, "shortest client task sequence", _at_least_one)
    max_tasks: int = option(4, "longest client task sequence", _at_least_one)
    tasks: Literal["shared", "own"] = option(
        "shared",
        "shared: the dataset cut into fixed tasks, each client a random sequence of them (PFCL's); "
        "own: each client its own random class groups (fedaval's reading until session 34)",
    )


@dataclass(frozen=True)
class ScenarioSpec:
    name: str
    description: str
    Options: type
    build: Callable[[Any, np.ndarray, int, np.random.Generator], Partition]
    paper: str


SCENARIOS: dict[str, ScenarioSpec] = {
    spec.name: spec
    for spec in [
        ScenarioSpec(
            "sthfl",
            "spatio-temporal heterogeneous FL [N,S,M]: long-tailed data, equal samples per client",
            SthflOptions,
            lambda o, y, c, rng: partition.sthfl(y, c, o.clients, o.classes_per_task, o.tasks, o.imbalance, rng),
            "GLDP",
        ),
        ScenarioSpec(
            "fcil-sync",
            "synchronous FCIL: shared class order, each class split over clients by Dirichlet(alpha)",
            FcilSyncOptions,
            lambda o, y, c, rng: partition.fcil_sync(y, c, o.clients, o.tasks, o.alpha, rng),
            "FedProK",
        ),
        ScenarioSpec(
            "fcil-async",
            "asynchronous FCIL: a fraction gamma of each client's classes on every client, the rest unique to it",
            FcilAsyncOptions,
            lambda o, y, c, rng: partition.fcil_async(y, c, o.clients, o.tasks, o.consensus, rng, o.classes_per_client),
            "FedProK",
        ),
        ScenarioSpec(
            "fcl-random",
            "random per-client task sequences of different lengths, clients may share classes",
            FclRandomOptions,
            lambda o, y, c, rng: partition.fcl_random(
                y, c, o.clients, o.classes_per_task, o.min_tasks, o.max_tasks, rng, o.tasks
            ),
            "PFCL",
        ),
    ]
}


def get_scenario(name: str) -> ScenarioSpec:
    if name not in SCENARIOS:
        raise choice_error("scenario", name, sorted(SCENARIOS))
    return SCENARIOS[name]
