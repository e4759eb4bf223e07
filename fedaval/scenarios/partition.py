"""Partitioners: who holds which training samples, task by task.

Plain functions on numpy arrays, one per setting of ``shared/methods.md``.
Each returns a :class:`Partition`: for every client, a list of tasks, each a
set of training-sample indices and the classes it teaches. Inputs are checked
here so that an impossible setting fails with a one-line message before any
training starts.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

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
    """``clients``: every client's stream; ``summary``: figures the
    partitioner reports about itself, copied into results.json's
    ``scenario`` block (sthfl: ``effective_imbalance``, ``data_fraction_used``)."""

    clients: list[ClientTasks]
    summary: dict = field(default_factory=dict)

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


def long_tailed(targets: np.ndarray, num_classes: int, imbalance: float, rng: np.random.Generator) -> list[np.ndarray]:
    """The long-tailed training set: for each class, the (shuffled) indices it
    keeps; classes in a seeded random order keep n_max * IF^(-rank/(C-1))."""
    by_class = _indices_by_class(targets, num_classes, rng)
    order = class_order(num_classes, rng)
    max_count = min(len(by_class[c]) for c in range(num_classes))
    counts = long_tail_counts(max_count, num_classes, imbalance)
    kept: list[np.ndarray] = [np.zeros(0, dtype=np.int64)] * num_classes
    for rank, c in enumerate(order):
        kept[c] = by_class[c][: counts[rank]]
    return kept


def draw_stage(rng: np.random.Generator, num_classes: int, seen: set[int], size: int, stages_after: int) -> list[int]:
    """The classes of one client-stage: ``size`` distinct classes, at least one
    not in ``seen`` (the client's earlier stages), and leaving at least
    ``stages_after`` unseen classes for the client's later stages. Drawn
    uniformly among the sets that qualify: first how many are new (weighted
    by how many sets have that many), then which."""
    unseen = np.array(sorted(set(range(num_classes)) - seen), dtype=np.int64)
    old = np.array(sorted(seen), dtype=np.int64)
    most_new = min(size, len(unseen), num_classes - stages_after - len(old))
    ks = list(range(max(1, size - len(old)), most_new + 1))
    weights = np.array([math.comb(len(unseen), k) * math.comb(len(old), size - k) for k in ks], dtype=float)
    k = ks[int(rng.choice(len(ks), p=weights / weights.sum()))]
    picked = rng.choice(unseen, size=k, replace=False).tolist() + rng.choice(old, size=size - k, replace=False).tolist()
    return sorted(int(c) for c in picked)


def _max_flow(
    extra_of_client: list[int], drawn: list[set[int]], room: np.ndarray, limit: np.ndarray | None = None
) -> tuple[int, np.ndarray]:
    """Integer max flow source -> client k (capacity ``extra_of_client[k]``)
    -> class c it drew (capacity ``limit[k, c]``, default unbounded) -> sink
    (capacity ``room[c]``). Returns the flow value and the (clients x
    classes) flow."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import maximum_flow

    n, c = len(extra_of_client), len(room)
    source, sink = 0, n + c + 1
    rows, cols, caps = [], [], []
    for k in range(n):
        edges = [(source, 1 + k, extra_of_client[k])] + [
            (1 + k, 1 + n + cls, int(room[cls]) if limit is None else int(min(limit[k, cls], room[cls])))
            for cls in drawn[k]
        ]
        for row, col, cap in edges:
            rows.append(row)
            cols.append(col)
            caps.append(cap)
    for cls in range(c):
        rows.append(1 + n + cls)
        cols.append(sink)
        caps.append(int(room[cls]))
    graph = csr_matrix((np.array(caps, dtype=np.int32), (rows, cols)), shape=(n + c + 2, n + c + 2))
    result = maximum_flow(graph, source, sink)
    flow = result.flow.toarray()[1 : n + 1, n + 1 : n + c + 1]
    return int(result.flow_value), np.maximum(flow, 0)


def equal_totals(
    slots_of_client: list[int],
    drawn: list[set[int]],
    slots_of_class: np.ndarray,
    available: np.ndarray,
    holdings: np.ndarray | None = None,
) -> tuple[int, np.ndarray]:
    """The largest equal total Q every client can get, and how many samples
    beyond one per slot each client takes of each class it drew
    (``extra[k, c]``), when every
    (client, stage, class) slot gets at least one sample and class c gives at
    most ``available[c]`` samples in all.

    Q is found as a maximum flow (binary search over Q, a flow that fills
    every client's Q is an assignment). Among the assignments with that Q,
    the one kept is the integer one nearest the even split: every class's
    samples divided evenly over the slots that drew it (``holdings[k, c]``:
    client k's slots of class c, default one), scaled per client to Q and
    capped per class by iterative proportional fitting, then made integer by
    a maximum flow whose client-class edges may exceed the fractional
    amounts by only a few samples. (An unconstrained maximum flow, used
    before, put whatever a client lacked on one class: a client-stage of 4
    samples beside one of 534, one sample of three of its four classes, on
    CIFAR-10 [20,4,5] at IF 50.)"""
    base = slots_of_class.astype(np.int64)
    room_full = available.astype(np.int64) - base

    def fill(q: int, room: np.ndarray):
        need = [q - s for s in slots_of_client]
        value, flow = _max_flow(need, drawn, room)
        return value == sum(need), flow

    lo = max(slots_of_client)
    hi = min(sum(int(available[c]) for c in d) for d in drawn)
    while lo < hi:  # largest q that fills
        mid = (lo + hi + 1) // 2
        if fill(mid, room_full)[0]:
            lo = mid
        else:
            hi = mid - 1
    quota = lo
    target = np.array([quota - s for s in slots_of_client], dtype=float)
    even = _even_extras(drawn, slots_of_client, slots_of_class, available, holdings)
    close = _scale_to_totals(even, target, room_full.astype(float))
    for slack in (1, 2, 4, 8, 16, None):  # the integer assignment nearest the fractional one that fills
        limit = None if slack is None else np.ceil(close).astype(np.int64) + slack
        value, flow = _max_flow([int(t) for t in target], drawn, room_full, limit)
        if value == int(target.sum()):
            return quota, flow.astype(np.int64)
    raise AssertionError("a quota that fills has an assignment")  # slack None is the search's own flow


def _even_extras(
    drawn: list[set[int]],
    slots_of_client: list[int],
    slots_of_class: np.ndarray,
    available: np.ndarray,
    holdings: np.ndarray | None,
) -> np.ndarray:
    """Every class's samples split evenly over the (client, stage) slots that
    drew it, as samples beyond the one per slot: (clients x classes)."""
    n, c = len(drawn), len(available)
    slots = np.zeros((n, c))
    for k, classes in enumerate(drawn):
        for cls in classes:
            slots[k, cls] = 1 if holdings is None else holdings[k, cls]
    share = available / np.maximum(slots_of_class, 1)
    return np.maximum(slots * share[None, :] - slots, 0.0)


def _scale_to_totals(x: np.ndarray, target: np.ndarray, room: np.ndarray, iterations: int = 2000) -> np.ndarray:
    """Iterative proportional fitting: scale each client's row to its
    ``target`` total, then cap each class's column at its ``room``, until
    the rows hold: the fractional assignment closest to ``x`` (in
    Kullback-Leibler divergence) with those totals."""
    x = x.copy()
    for _ in range(iterations):
        rows = x.sum(axis=1)
        x *= np.divide(target, rows, out=np.zeros_like(target), where=rows > 0)[:, None]
        cols = x.sum(axis=0)
        x *= np.minimum(1.0, np.divide(room, cols, out=np.ones_like(room), where=cols > 0))[None, :]
        if np.allclose(x.sum(axis=1), target, rtol=1e-6, atol=1e-6):
            break
    return x


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
    2. Every client draws S distinct classes for each of its M stages. A stage
       may repeat classes of the client's earlier stages (the paper allows
       overlap) but brings at least one class new to the client: the STHFL
       definition, temporal heterogeneity (b), "there exists y_i^(m),r not in
       the union over j < m of Y_i^(j), for y_i^(m),r in Y_i^(m)" (GLDP,
       Section 3); see :func:`draw_stage`. This needs S + M - 1 <= C.
    3. Every (client, stage, class) slot gets one sample; the rest are
       assigned so that every client holds the same number Q of samples
       ("each client is assigned the same number of training samples but with
       different class distributions"), with Q as large as the long-tailed
       set allows (:func:`equal_totals`, a maximum flow), as near as that Q
       allows to every class's samples split evenly over the slots that drew
       it, so a stage's classes keep their long-tailed proportions ("the data
       for each class is unbalanced in any stage tasks of clients", GLDP,
       Section 3). A client's samples of a class are split evenly over its
       stages that drew the class.

    ``summary`` reports ``samples_per_client`` (Q), ``data_fraction_used``
    (samples used / samples of the long-tailed set) and
    ``effective_imbalance`` (largest / smallest number of samples used of a
    class, over the classes used). When the equal totals leave more than
    ``FAR_OFF`` of the long-tailed set unused, or the effective IF is off the
    requested one by more than ``FAR_OFF`` of it, the run says so in a
    warning: the setting is then not quite the IF asked for.
    """
    _check_clients(num_clients)
    _require(
        1 <= classes_per_task <= num_classes,
        f"bad classes per task {classes_per_task}; the dataset has {num_classes} classes, allowed 1..{num_classes}",
    )
    _require(num_tasks >= 1, f"bad number of tasks {num_tasks}; must be >= 1")
    _require(imbalance >= 1, f"bad imbalance factor {imbalance}; must be >= 1")
    _require(
        classes_per_task + num_tasks - 1 <= num_classes,
        f"bad scenario: {num_tasks} stages of {classes_per_task} classes, each bringing a class new to the client, "
        f"need {classes_per_task + num_tasks - 1} classes; the dataset has {num_classes}",
    )
    kept = long_tailed(targets, num_classes, imbalance, rng)
    draws: list[list[list[int]]] = []
    for _ in range(num_clients):
        seen: set[int] = set()
        stages = []
        for t in range(num_tasks):
            stages.append(draw_stage(rng, num_classes, seen, classes_per_task, num_tasks - 1 - t))
            seen.update(stages[-1])
        draws.append(stages)
    slots_of_class = np.zeros(num_classes, dtype=np.int64)
    for k in range(num_clients):
        for t in range(num_tasks):
            for c in draws[k][t]:
                slots_of_class[c] += 1
    available = np.array([len(kept[c]) for c in range(num_classes)], dtype=np.int64)
    for c in range(num_classes):
        _require(
            available[c] >= slots_of_class[c],
            f"imbalance factor {imbalance} leaves class {c} with {available[c]} samples for {slots_of_class[c]} "
            f"client stages; lower the imbalance or the number of clients",
        )
    held = [sorted({c for stage in draws[k] for c in stage}) for k in range(num_clients)]
    holdings = np.zeros((num_clients, num_classes), dtype=np.int64)
    for k in range(num_clients):
        for stage in draws[k]:
            holdings[k, stage] += 1
    quota, extra = equal_totals(
        [num_tasks * classes_per_task] * num_clients, [set(d) for d in held], slots_of_class, available, holdings
    )
    taken = np.zeros(num_classes, dtype=np.int64)  # samples of each class handed out so far
    clients = []
    for k in range(num_clients):
        per_task: list[list[np.ndarray]] = [[] for _ in range(num_tasks)]
        for c in held[k]:
            holding = [t for t in range(num_tasks) if c in draws[k][t]]
            counts = 1 + np.array([len(chunk) for chunk in np.array_split(np.arange(extra[k, c]), len(holding))])
            for t, count in zip(holding, counts):
                per_task[t].append(kept[c][taken[c] : taken[c] + count])
                taken[c] += count
        clients.append(
            ClientTasks(
                indices=[np.concatenate(parts).astype(np.int64) for parts in per_task],
                classes=draws[k],
            )
        )
    used = taken[taken > 0]
    summary = {
        "samples_per_client": int(quota),
        "data_fraction_used": float(taken.sum() / sum(len(k) for k in kept)),
        "effective_imbalance": float(used.max() / used.min()),
    }
    if (
        summary["data_fraction_used"] < 1 - FAR_OFF
        or abs(summary["effective_imbalance"] - imbalance) > FAR_OFF * imbalance
    ):
        logging.getLogger("fedaval").warning(
            "sthfl: equal client totals use %.1f%% of the long-tailed set and give an effective imbalance factor of "
            "%.2f against the %g asked for (another seed, fewer clients or a lower imbalance come nearer)",
            100 * summary["data_fraction_used"],
            summary["effective_imbalance"],
            imbalance,
        )
    return Partition(clients, summary)


#: ``sthfl`` warns when it uses less than 1 - FAR_OFF of the long-tailed set or
#: its effective imbalance factor is off the requested one by more than this share.
FAR_OFF = 0.1


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

    Reading (FedProK, Section 3.2: "if each client's local task sequence
    comprises samples of 50 classes, with 25 common classes and 25 unique
    classes, the consensus rate gamma in this case is 0.5"; Section 6.1: "10
    or 25 classes are common on all clients while the rest of 40 or 25 classes are
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
    unique = order[num_shared:]
    owned: list[list[int]] = [
        [int(c) for c in shared] + [int(c) for c in unique[k * num_unique : (k + 1) * num_unique]]
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


#: ``fcl-random``'s ``tasks``: fixed tasks dealt to the clients (the paper's) or each client's own.
FCL_RANDOM_TASKS = ("shared", "own")


def fcl_random(
    targets: np.ndarray,
    num_classes: int,
    num_clients: int,
    classes_per_task: int,
    min_tasks: int,
    max_tasks: int,
    rng: np.random.Generator,
    tasks: str = "shared",
) -> Partition:
    """PFCL's setting: every client draws its own number of tasks L_k in
    [min_tasks, max_tasks] and a random sequence of L_k tasks of S classes.

    ``tasks="shared"`` (the paper's, Section 5.2: "本文将每个数据集分为若干个
    持续学习任务 ... 各客户端会随机获得一个包含若干任务的序列", the dataset is
    cut into continual-learning tasks and each client gets a random sequence
    of them): a seeded random class order is cut into C // S fixed tasks (the
    C mod S classes left over are not used), and each client's sequence is
    L_k distinct ones of them in a random order; two clients that hold a task
    hold all its classes. ``tasks="own"`` (fedaval's reading until session
    34): each client cuts its own random L_k * S distinct classes into tasks,
    so clients share classes but rarely a whole task.

    Either way, the samples of a class are split evenly, without overlap, over
    the clients that hold it, so no sample is on two clients and every sample
    of a held class is used."""
    _check_clients(num_clients)
    _require(classes_per_task >= 1, f"bad classes per task {classes_per_task}; must be >= 1")
    _require(1 <= min_tasks <= max_tasks, f"bad task range {min_tasks}..{max_tasks}; need 1 <= min_tasks <= max_tasks")
    _require(
        classes_per_task * max_tasks <= num_classes,
        f"bad scenario: {max_tasks} tasks x {classes_per_task} classes per task needs "
        f"{classes_per_task * max_tasks} classes; the dataset has {num_classes}",
    )
    _require(tasks in FCL_RANDOM_TASKS, f"bad tasks {tasks!r}; allowed: {', '.join(FCL_RANDOM_TASKS)}")
    by_class = _indices_by_class(targets, num_classes, rng)
    sequences = []
    if tasks == "shared":
        order = class_order(num_classes, rng)
        units = order[: num_classes // classes_per_task * classes_per_task].reshape(-1, classes_per_task)
        for _ in range(num_clients):
            length = int(rng.integers(min_tasks, max_tasks + 1))
            sequences.append(units[rng.choice(len(units), size=length, replace=False)].reshape(-1))
    else:
        for _ in range(num_clients):
            length = int(rng.integers(min_tasks, max_tasks + 1))
            sequences.append(rng.choice(num_classes, size=length * classes_per_task, replace=False))
    holders: dict[int, list[int]] = {c: [] for c in range(num_classes)}
    for k, seq in enumerate(sequences):
        for c in seq:
            holders[int(c)].append(k)
    pieces = {
        (k, c): chunk for c, ks in holders.items() if ks for k, chunk in zip(ks, _split_evenly(by_class[c], len(ks)))
    }
    clients = []
    for k, seq in enumerate(sequences):
        groups = [sorted(int(c) for c in seq[i : i + classes_per_task]) for i in range(0, len(seq), classes_per_task)]
        indices = [np.concatenate([pieces[(k, c)] for c in group]).astype(np.int64) for group in groups]
        clients.append(ClientTasks(indices=indices, classes=groups))
    return Partition(clients)
