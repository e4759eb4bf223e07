"""Partitioners: who holds which training samples, task by task.

Plain functions on numpy arrays, one per setting of ``shared/methods.md``.
Each returns a :class:`Partition`: for every client, a list of tasks, each a
set of training-sample indices and the classes it teaches. Inputs are checked
here so that an impossible setting fails with a one-line message before any
training starts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedaval.errors import FedavalUsageError


@dataclass
class ClientTasks:
    """One client's stream: ``indices[t]`` are its training samples of task
    ``t``, ``classes[t]`` the classes task ``t`` teaches it (sorted)."""

    indices: list[np.ndarray]
    classes: list[list[int]]

    @property
    def num_tasks(self) -> int:
        return len(self.indices)


@dataclass
class Partition:
    clients: list[ClientTasks]

    @property
    def num_tasks(self) -> int:
        """Stages of the federation: the longest client stream."""
        return max(c.num_tasks for c in self.clients)

    def all_indices(self) -> np.ndarray:
        parts = [idx for c in self.clients for idx in c.indices]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise FedavalUsageError(message)


def _check_clients(num_clients: int) -> None:
    _require(num_clients >= 1, f"bad number of clients {num_clients}; must be >= 1")


def class_order(num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """A random order of the classes, drawn from the run's seed."""
    return rng.permutation(num_classes)


def _indices_by_class(targets: np.ndarray, num_classes: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Indices of each class, shuffled."""
    return [rng.permutation(np.flatnonzero(targets == c)) for c in range(num_classes)]


def _split_evenly(indices: np.ndarray, parts: int) -> list[np.ndarray]:
    """Split into ``parts`` disjoint chunks whose sizes differ by at most one."""
    return [np.asarray(chunk, dtype=np.int64) for chunk in np.array_split(indices, parts)]


def long_tail_counts(max_count: int, num_classes: int, imbalance: float) -> np.ndarray:
    """Samples per class rank c under the exponential long-tail profile of
    Cao et al. (LDAM, 2019), used by GLDP: n_c = n_max * IF^(-c/(C-1)).

    The largest class keeps ``max_count``; the smallest gets
    ``max_count / imbalance`` (rounded down, at least 1)."""
    if num_classes == 1:
        return np.array([max_count])
    ranks = np.arange(num_classes)
    counts = np.floor(max_count * imbalance ** (-ranks / (num_classes - 1)) + 1e-9).astype(np.int64)
    return np.maximum(counts, 1)


def _largest_remainder(weights: np.ndarray, total: int) -> np.ndarray:
    """Integers proportional to ``weights`` that sum exactly to ``total``."""
    if total == 0 or weights.sum() == 0:
        return np.zeros_like(weights, dtype=np.int64)
    raw = weights / weights.sum() * total
    base = np.floor(raw).astype(np.int64)
    remainder = total - base.sum()
    order = np.argsort(-(raw - base), kind="stable")
    base[order[:remainder]] += 1
    return base


def sthfl(
    targets: np.ndarray,
    num_classes: int,
    num_clients: int,
    classes_per_task: int,
    num_tasks: int,
    imbalance: float,
    rng: np.random.Generator,
) -> Partition:
    """GLDP's spatio-temporal heterogeneous setting ``[N, S, M]``.

    1. The training set is made long-tailed: classes, in a seeded random
       order, keep n_c = n_max * IF^(-rank/(C-1)) samples (``long_tail_counts``).
    2. Every client draws S distinct classes for each of its M stages; stages
       of one client may repeat classes (the paper allows overlap).
    3. Each class's kept samples are split evenly, without overlap, over the
       (client, stage) slots that drew it.
    4. Every client is cut down to the same number of samples Q (the smallest
       client total), keeping the proportions of its slots (largest remainder).

    Reading of "every client gets the same number of samples but different
    classes": equal totals per client, exactly; stage sizes follow the
    long-tailed class sizes. Samples not needed are not used.
    """
    _check_clients(num_clients)
    _require(
        1 <= classes_per_task <= num_classes,
        f"bad classes per task {classes_per_task}; the dataset has {num_classes} classes, allowed 1..{num_classes}",
    )
    _require(num_tasks >= 1, f"bad number of tasks {num_tasks}; must be >= 1")
    _require(imbalance >= 1, f"bad imbalance factor {imbalance}; must be >= 1")
    by_class = _indices_by_class(targets, num_classes, rng)
    order = class_order(num_classes, rng)
    max_count = min(len(by_class[c]) for c in range(num_classes))
    counts = long_tail_counts(max_count, num_classes, imbalance)
    kept = [None] * num_classes
    for rank, c in enumerate(order):
        kept[c] = by_class[c][: counts[rank]]

    draws = [
        [sorted(rng.choice(num_classes, size=classes_per_task, replace=False).tolist()) for _ in range(num_tasks)]
        for _ in range(num_clients)
    ]
    slots_of_class: dict[int, list[tuple[int, int]]] = {c: [] for c in range(num_classes)}
    for k in range(num_clients):
        for t in range(num_tasks):
            for c in draws[k][t]:
                slots_of_class[c].append((k, t))
    pieces: dict[tuple[int, int, int], np.ndarray] = {}
    for c, slots in slots_of_class.items():
        if not slots:
            continue
        _require(
            len(kept[c]) >= len(slots),
            f"imbalance factor {imbalance} leaves class {c} with {len(kept[c])} samples for {len(slots)} "
            f"client stages; lower the imbalance or the number of clients",
        )
        for (k, t), chunk in zip(slots, _split_evenly(kept[c], len(slots))):
            pieces[(k, t, c)] = chunk

    totals = [sum(len(pieces[(k, t, c)]) for t in range(num_tasks) for c in draws[k][t]) for k in range(num_clients)]
    quota = min(totals)
    clients = []
    for k in range(num_clients):
        keys = [(k, t, c) for t in range(num_tasks) for c in draws[k][t]]
        sizes = _largest_remainder(np.array([len(pieces[key]) for key in keys], dtype=float), quota)
        # every drawn class keeps at least one sample where the quota allows
        per_task: list[list[np.ndarray]] = [[] for _ in range(num_tasks)]
        for key, size in zip(keys, sizes):
            per_task[key[1]].append(pieces[key][:size])
        clients.append(
            ClientTasks(
                indices=[np.concatenate(parts).astype(np.int64) for parts in per_task],
                classes=draws[k],
            )
        )
    return Partition(clients)


def task_splits(order: np.ndarray, num_tasks: int) -> list[list[int]]:
    """Cut a class order into ``num_tasks`` consecutive groups of (nearly) equal size."""
    return [sorted(int(c) for c in chunk) for chunk in np.array_split(order, num_tasks)]


def fcil_sync(
    targets: np.ndarray,
    num_classes: int,
    num_clients: int,
    num_tasks: int,
    alpha: float,
    rng: np.random.Generator,
) -> Partition:
    """FedProK's synchronous FCIL: one class order for everybody, cut into T
    tasks; the samples of each class are split over the clients in
    proportions drawn from Dirichlet(alpha, ..., alpha). Every sample is used
    exactly once. A client may receive no sample of a class (small alpha)."""
    _check_clients(num_clients)
    _require(
        1 <= num_tasks <= num_classes,
        f"bad number of tasks {num_tasks}; the dataset has {num_classes} classes, allowed 1..{num_classes}",
    )
    _require(alpha > 0, f"bad Dirichlet alpha {alpha}; must be > 0")
    by_class = _indices_by_class(targets, num_classes, rng)
    groups = task_splits(class_order(num_classes, rng), num_tasks)
    share: dict[int, list[np.ndarray]] = {}
    for c in range(num_classes):
        proportions = rng.dirichlet(np.full(num_clients, alpha))
        sizes = _largest_remainder(proportions, len(by_class[c]))
        share[c] = np.split(by_class[c], np.cumsum(sizes)[:-1])
    clients = [
        ClientTasks(
            indices=[np.concatenate([share[c][k] for c in group]).astype(np.int64) for group in groups],
            classes=[list(group) for group in groups],
        )
        for k in range(num_clients)
    ]
    return Partition(clients)


def consensus_split(classes_per_client: int, consensus: float) -> tuple[int, int]:
    """``(common, unique)`` classes of one client: common = round(gamma * m)
    (halves rounded up), unique = m - common."""
    common = int(math.floor(consensus * classes_per_client + 0.5 + 1e-9))
    return common, classes_per_client - common


def fcil_async_classes_needed(classes_per_client: int, num_clients: int, consensus: float) -> int:
    """Dataset classes a setting uses: the common ones once, every client's unique ones."""
    common, unique = consensus_split(classes_per_client, consensus)
    return common + num_clients * unique


def fcil_async_max_classes_per_client(num_classes: int, num_clients: int, consensus: float) -> int:
    """The largest m with common + clients * unique <= C (0 if none)."""
    for m in range(num_classes, 0, -1):
        if fcil_async_classes_needed(m, num_clients, consensus) <= num_classes:
            return m
    return 0


def fcil_async(
    targets: np.ndarray,
    num_classes: int,
    num_clients: int,
    num_tasks: int,
    consensus: float,
    rng: np.random.Generator,
    classes_per_client: int = 0,
) -> Partition:
    """FedProK's asynchronous FCIL with consensus rate gamma.

    Reading (FedProK, Section 3.1 and 5.1: "if each client's local task
    sequence comprises samples of 50 classes, with 25 common classes and 25
    unique classes, the consensus rate gamma in this case is 0.5"; "10 or 25
    classes are common on all clients while the rest of 40 or 25 classes are
    unique on one client"): gamma is the fraction of *one client's* classes
    that every client holds. With m classes per client, common =
    round(gamma * m) classes are on every client (their samples split evenly
    over the clients) and unique = m - common classes belong to that client
    alone (all their samples). The setting uses common + clients * unique
    dataset classes; the others are left out.

    ``classes_per_client`` is m; 0 (the default) takes the largest m the
    dataset allows, so that as many classes as possible are used (on
    CIFAR-100 with 2 clients, gamma 0.2: m = 55, 11 common + 2 x 44 unique =
    99 classes). The paper's CIFAR-100 figures (m = 50, 3 clients, gamma 0.2:
    10 + 3 x 40 = 130 classes) do not fit in 100 classes; with 2 clients they
    do (90 classes). Each client orders its own classes at random and cuts
    them into T tasks. Every sample of a used class is used exactly once."""
    _check_clients(num_clients)
    _require(0 <= consensus <= 1, f"bad consensus rate {consensus}; must be in [0, 1]")
    _require(num_tasks >= 1, f"bad number of tasks {num_tasks}; must be >= 1")
    largest = fcil_async_max_classes_per_client(num_classes, num_clients, consensus)
    _require(
        largest >= 1,
        f"bad scenario: {num_clients} clients with consensus {consensus} need more than the dataset's "
        f"{num_classes} classes; lower the number of clients",
    )
    if classes_per_client == 0:
        classes_per_client = largest
    _require(
        1 <= classes_per_client <= largest,
        f"bad classes per client {classes_per_client}; with {num_clients} clients and consensus {consensus} "
        f"it needs {fcil_async_classes_needed(classes_per_client, num_clients, consensus)} classes, the dataset "
        f"has {num_classes}; allowed 1..{largest} (0: {largest})",
    )
    _require(
        num_tasks <= classes_per_client,
        f"bad number of tasks {num_tasks}; with consensus {consensus} a client holds only {classes_per_client} "
        f"classes, allowed 1..{classes_per_client}",
    )
    num_shared, num_unique = consensus_split(classes_per_client, consensus)
    by_class = _indices_by_class(targets, num_classes, rng)
    order = class_order(num_classes, rng)
    shared = order[:num_shared]
    owned: list[list[int]] = [
        [int(c) for c in shared] + [int(c) for c in order[num_shared + k * num_unique : num_shared + (k + 1) * num_unique]]
        for k in range(num_clients)
    ]
    shared_pieces = {int(c): _split_evenly(by_class[c], num_clients) for c in shared}
    clients = []
    for k in range(num_clients):
        mine = rng.permutation(owned[k])
        groups = task_splits(mine, num_tasks)
        tasks = []
        for group in groups:
            parts = [shared_pieces[c][k] if c in shared_pieces else by_class[c] for c in group]
            tasks.append(np.concatenate(parts).astype(np.int64))
        clients.append(ClientTasks(indices=tasks, classes=groups))
    return Partition(clients)


def fcl_random(
    targets: np.ndarray,
    num_classes: int,
    num_clients: int,
    classes_per_task: int,
    min_tasks: int,
    max_tasks: int,
    rng: np.random.Generator,
) -> Partition:
    """PFCL's setting: every client draws its own number of tasks L_k in
    [min_tasks, max_tasks] and a random sequence of L_k * S distinct classes,
    cut into tasks of S classes. Clients may share classes; the samples of a
    class are split evenly, without overlap, over the clients that hold it, so
    no sample is on two clients and every sample of a held class is used."""
    _check_clients(num_clients)
    _require(classes_per_task >= 1, f"bad classes per task {classes_per_task}; must be >= 1")
    _require(1 <= min_tasks <= max_tasks, f"bad task range {min_tasks}..{max_tasks}; need 1 <= min_tasks <= max_tasks")
    _require(
        classes_per_task * max_tasks <= num_classes,
        f"bad scenario: {max_tasks} tasks x {classes_per_task} classes per task needs "
        f"{classes_per_task * max_tasks} classes; the dataset has {num_classes}",
    )
    by_class = _indices_by_class(targets, num_classes, rng)
    sequences = []
    for _ in range(num_clients):
        length = int(rng.integers(min_tasks, max_tasks + 1))
        sequences.append(rng.choice(num_classes, size=length * classes_per_task, replace=False))
    holders: dict[int, list[int]] = {c: [] for c in range(num_classes)}
    for k, seq in enumerate(sequences):
        for c in seq:
            holders[int(c)].append(k)
    pieces = {
        (k, c): chunk
        for c, ks in holders.items()
        if ks
        for k, chunk in zip(ks, _split_evenly(by_class[c], len(ks)))
    }
    clients = []
    for k, seq in enumerate(sequences):
        groups = [sorted(int(c) for c in seq[i : i + classes_per_task]) for i in range(0, len(seq), classes_per_task)]
        tasks = [np.concatenate([pieces[(k, c)] for c in group]).astype(np.int64) for group in groups]
        clients.append(ClientTasks(indices=tasks, classes=groups))
    return Partition(clients)
