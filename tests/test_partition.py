"""Partitioners against their statistical promises and hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from fedaval.errors import FedavalUsageError
from fedaval.scenarios import partition as P


def balanced_targets(num_classes: int, per_class: int) -> np.ndarray:
    return np.repeat(np.arange(num_classes), per_class)


def assert_disjoint(part: P.Partition) -> None:
    everything = part.all_indices()
    assert len(everything) == len(np.unique(everything)), "a sample is on two clients or in two tasks"


def test_long_tail_counts_by_hand():
    # n_c = 100 * 4^(-c/2): 100, 50, 25
    assert P.long_tail_counts(100, 3, 4.0).tolist() == [100, 50, 25]
    assert P.long_tail_counts(100, 5, 1.0).tolist() == [100] * 5


def test_largest_remainder_sums_exactly():
    sizes = P._largest_remainder(np.array([1.0, 1.0, 1.0]), 10)
    assert sizes.tolist() == [4, 3, 3]


def test_sthfl_promises():
    targets = balanced_targets(10, 200)
    part = P.sthfl(targets, 10, num_clients=6, classes_per_task=3, num_tasks=2, imbalance=10, rng=np.random.default_rng(1))
    assert_disjoint(part)
    totals = [sum(len(i) for i in c.indices) for c in part.clients]
    assert len(set(totals)) == 1 and totals[0] > 0, totals  # equal samples per client
    for c in part.clients:
        assert c.num_tasks == 2
        for classes, idx in zip(c.classes, c.indices):
            assert len(classes) == 3 == len(set(classes))
            assert set(targets[idx]) <= set(classes)
    # the long-tailed pool: the most frequent class has IF times the rarest one
    counts = P.long_tail_counts(200, 10, 10)
    assert counts.max() / counts.min() == pytest.approx(10, rel=0.01)


def test_sthfl_same_seed_same_partition():
    targets = balanced_targets(10, 50)
    a = P.sthfl(targets, 10, 4, 2, 3, 5, np.random.default_rng(7))
    b = P.sthfl(targets, 10, 4, 2, 3, 5, np.random.default_rng(7))
    assert all(np.array_equal(x, y) for ca, cb in zip(a.clients, b.clients) for x, y in zip(ca.indices, cb.indices))


def test_fcil_sync_uses_every_sample_once_and_shares_class_order():
    targets = balanced_targets(10, 30)
    part = P.fcil_sync(targets, 10, num_clients=3, num_tasks=5, alpha=1.0, rng=np.random.default_rng(0))
    assert_disjoint(part)
    assert len(part.all_indices()) == len(targets)
    first = part.clients[0].classes
    assert all(c.classes == first for c in part.clients)
    assert sorted(c for task in first for c in task) == list(range(10))
    assert all(len(task) == 2 for task in first)


def test_fcil_sync_dirichlet_concentrates_with_small_alpha():
    targets = balanced_targets(4, 1000)
    def max_share(alpha):
        part = P.fcil_sync(targets, 4, 5, 1, alpha, np.random.default_rng(3))
        sizes = np.array([len(c.indices[0]) for c in part.clients])
        return sizes.max() / sizes.sum()
    assert max_share(0.05) > max_share(100.0)
    assert max_share(100.0) < 0.3  # near-uniform split over 5 clients


def test_fcil_async_consensus_fraction():
    targets = balanced_targets(10, 20)
    part = P.fcil_async(targets, 10, num_clients=3, num_tasks=2, consensus=0.4, rng=np.random.default_rng(0))
    assert_disjoint(part)
    assert len(part.all_indices()) == len(targets)
    held = [set(c for task in client.classes for c in task) for client in part.clients]
    common = set.intersection(*held)
    assert len(common) == 4  # round(0.4 * 10)
    for c in set(range(10)) - common:
        assert sum(c in h for h in held) == 1  # every other class on exactly one client


def test_fcl_random_lengths_and_sharing():
    targets = balanced_targets(10, 30)
    part = P.fcl_random(targets, 10, num_clients=6, classes_per_task=2, min_tasks=1, max_tasks=4, rng=np.random.default_rng(2))
    assert_disjoint(part)
    lengths = [c.num_tasks for c in part.clients]
    assert all(1 <= n <= 4 for n in lengths)
    held_by = {}
    for k, client in enumerate(part.clients):
        classes = [c for task in client.classes for c in task]
        assert len(classes) == len(set(classes))  # class-incremental: no class twice on a client
        for c in classes:
            held_by.setdefault(c, []).append(k)
    used = part.all_indices()
    held = np.isin(targets, list(held_by))
    assert len(used) == int(held.sum())  # every sample of a held class is used once


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda y: P.sthfl(y, 10, 3, 11, 2, 10, np.random.default_rng(0)), "classes per task 11"),
        (lambda y: P.fcil_async(y, 10, 3, 2, 1.5, np.random.default_rng(0)), "consensus rate 1.5"),
        (lambda y: P.fcil_sync(y, 10, 0, 2, 1.0, np.random.default_rng(0)), "number of clients 0"),
        (lambda y: P.fcil_sync(y, 10, 3, 11, 1.0, np.random.default_rng(0)), "number of tasks 11"),
        (lambda y: P.fcl_random(y, 10, 3, 4, 1, 3, np.random.default_rng(0)), "needs 12 classes"),
        (lambda y: P.sthfl(y, 10, 3, 2, 2, 0.5, np.random.default_rng(0)), "imbalance factor 0.5"),
    ],
)
def test_impossible_settings_are_one_line_errors(call, message):
    with pytest.raises(FedavalUsageError) as info:
        call(balanced_targets(10, 20))
    assert message in str(info.value)
    assert "\n" not in str(info.value)
