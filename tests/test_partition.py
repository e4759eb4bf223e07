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
    part = P.sthfl(
        targets, 10, num_clients=6, classes_per_task=3, num_tasks=2, imbalance=10, rng=np.random.default_rng(1)
    )
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


def new_class_per_stage(part) -> list[bool]:
    """For every client-stage: does it bring a class new to its client?"""
    flags = []
    for client in part.clients:
        seen = set()
        for classes in client.classes:
            flags.append(bool(set(classes) - seen))
            seen |= set(classes)
    return flags


def test_sthfl_gldp_cifar10_setting():
    """[20,4,5], IF 50 on CIFAR-10-like labels (5000 per class). Before: about
    20% of client-stages brought no new class, 40% of the long-tailed set was
    cut away and the effective IF fell to about 44 (10 seeds)."""
    targets = balanced_targets(10, 5000)
    for seed in range(3):
        part = P.sthfl(targets, 10, 20, 4, 5, 50, np.random.default_rng(seed))
        assert all(new_class_per_stage(part))
        totals = {sum(len(i) for i in c.indices) for c in part.clients}
        assert totals == {part.summary["samples_per_client"]}
        used = part.all_indices()
        long_tail = P.long_tail_counts(5000, 10, 50).sum()
        assert part.summary["data_fraction_used"] == pytest.approx(len(used) / long_tail)
        assert part.summary["data_fraction_used"] > 0.99
        per_class = np.bincount(targets[used], minlength=10)
        assert part.summary["effective_imbalance"] == pytest.approx(per_class.max() / per_class.min())
        assert part.summary["effective_imbalance"] == pytest.approx(50, rel=0.01)


def test_sthfl_keeps_each_slot_near_its_classs_even_share():
    """[20,4,5], IF 50: every (client, stage, class) slot holds between 0.1
    and 2.5 times its class's even share (the class's samples over the
    slots that drew it), and no stage holds most of its client's data.
    Before (an unconstrained maximum flow): 0.01 to 40 times, client-stages
    of 4 samples (one of each class) beside stages of 683 of the client's 699."""
    targets = balanced_targets(10, 5000)
    for seed in range(3):
        part = P.sthfl(targets, 10, 20, 4, 5, 50, np.random.default_rng(seed))
        kept = P.long_tailed(targets, 10, 50, np.random.default_rng(seed))
        slots = np.zeros(10)
        for client in part.clients:
            for classes in client.classes:
                slots[classes] += 1
        even = np.array([len(k) for k in kept]) / slots
        quota = part.summary["samples_per_client"]
        for client in part.clients:
            for classes, idx in zip(client.classes, client.indices):
                counts = np.bincount(targets[idx], minlength=10)[classes]
                assert np.all(counts >= 0.1 * even[classes]) and np.all(counts <= 2.5 * even[classes])
                assert 10 <= len(idx) <= 0.6 * quota


def test_sthfl_needs_room_for_a_new_class_per_stage():
    with pytest.raises(FedavalUsageError, match="need 6 classes; the dataset has 5"):
        P.sthfl(balanced_targets(5, 100), 5, 2, 2, 5, 1, np.random.default_rng(0))


def test_equal_totals_by_hand():
    """Client 0 drew classes {0, 1}, client 1 drew {1}; classes have 10 and 4
    samples; class 1 has two slots (one per client), each needs a sample.
    Client 1 can get at most 4 - 1 = 3 (client 0's slot keeps one), so Q = 3:
    client 1 takes all 3 left of class 1, client 0 one of class 1 (its slot)
    and two of class 0."""
    quota, extra = P.equal_totals([2, 1], [{0, 1}, {1}], np.array([1, 2]), np.array([10, 4]))
    assert quota == 3
    assert extra.tolist() == [[1, 0], [0, 2]]  # beyond the one sample per slot


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


def held_classes(part):
    return [set(c for task in client.classes for c in task) for client in part.clients]


@pytest.mark.parametrize("consensus, common, unique", [(0.2, 10, 40), (0.5, 25, 25)])
def test_fcil_async_consensus_is_a_fraction_of_each_clients_classes(consensus, common, unique):
    """FedProK: 50 classes per client, gamma 0.2 -> 10 common + 40 unique; 0.5 -> 25 + 25."""
    targets = balanced_targets(100, 5)  # CIFAR-100-like labels
    part = P.fcil_async(
        targets,
        100,
        num_clients=2,
        num_tasks=5,
        consensus=consensus,
        rng=np.random.default_rng(0),
        classes_per_client=50,
    )
    assert_disjoint(part)
    held = held_classes(part)
    assert [len(h) for h in held] == [50, 50]
    assert len(set.intersection(*held)) == common
    assert [len(h - set.intersection(*held)) for h in held] == [unique, unique]
    assert all(len(task) == 10 for client in part.clients for task in client.classes)
    used = set.union(*held)
    assert len(part.all_indices()) == int(np.isin(targets, list(used)).sum())  # every sample of a used class once


def test_fcil_async_default_uses_as_many_classes_as_possible():
    """classes_per_client=0: the largest m with round(gamma*m) + clients*(m - round(gamma*m)) <= C."""
    targets = balanced_targets(100, 5)
    part = P.fcil_async(targets, 100, num_clients=3, num_tasks=5, consensus=0.5, rng=np.random.default_rng(0))
    held = held_classes(part)
    # m = 50: 25 common + 3 x 25 unique = 100 classes (m = 51: 26 + 3 x 25 = 101)
    assert [len(h) for h in held] == [50, 50, 50] and len(set.intersection(*held)) == 25
    assert len(part.all_indices()) == len(targets)


def test_fcil_async_consensus_fraction():
    targets = balanced_targets(10, 20)
    part = P.fcil_async(targets, 10, num_clients=3, num_tasks=2, consensus=0.5, rng=np.random.default_rng(0))
    assert_disjoint(part)
    held = held_classes(part)
    common = set.intersection(*held)
    # m = 4: 2 common + 3 x 2 unique = 8 of 10 classes (m = 5: 3 + 3 x 2 = 9, m = 6: 3 + 3 x 3 = 12 > 10)
    assert [len(h) for h in held] == [5, 5, 5] and len(common) == 3
    for c in set.union(*held) - common:
        assert sum(c in h for h in held) == 1  # every other class on exactly one client


def test_fcil_async_paper_setting_too_big_for_the_dataset():
    """FedProK's 3 clients x 50 classes at gamma 0.2 need 10 + 3 x 40 = 130 classes."""
    with pytest.raises(FedavalUsageError, match="needs 130 classes, the dataset has 100; allowed 1..38"):
        P.fcil_async(balanced_targets(100, 2), 100, 3, 5, 0.2, np.random.default_rng(0), classes_per_client=50)


@pytest.mark.parametrize("tasks", P.FCL_RANDOM_TASKS)
def test_fcl_random_lengths_and_sharing(tasks):
    targets = balanced_targets(10, 30)
    part = P.fcl_random(
        targets,
        10,
        num_clients=6,
        classes_per_task=2,
        min_tasks=1,
        max_tasks=4,
        rng=np.random.default_rng(2),
        tasks=tasks,
    )
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


def test_fcl_random_shared_tasks_are_fixed_units_dealt_to_the_clients():
    """PFCL, Section 5.2: the dataset is cut into tasks, and each client gets
    a random sequence of them; 11 classes at 3 a task make 3 tasks, one class
    unused."""
    targets = balanced_targets(11, 12)
    part = P.fcl_random(targets, 11, 8, 3, 2, 3, np.random.default_rng(0), tasks="shared")
    units = {frozenset(task) for client in part.clients for task in client.classes}
    assert len(units) == 3 and all(len(u) == 3 for u in units)
    assert len(set().union(*units)) == 9  # the units are disjoint
    for client in part.clients:
        assert len({frozenset(t) for t in client.classes}) == client.num_tasks  # no task twice
    orders = {tuple(frozenset(t) for t in client.classes) for client in part.clients}
    assert len(orders) > 1  # clients hold them in different orders
    own = P.fcl_random(targets, 11, 8, 3, 2, 3, np.random.default_rng(0), tasks="own")
    assert len({frozenset(task) for client in own.clients for task in client.classes}) > 3


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


def test_sthfl_warns_when_equal_totals_move_the_setting_off_the_requested_imbalance(caplog):
    """Digits-sized classes, the default ``[10,2,3]`` at IF 10: some seeds'
    equal totals leave much of the long tail unused or the effective IF far
    from 10; those, and only those, say so."""
    warned = []
    for seed in range(12):
        caplog.clear()
        with caplog.at_level("WARNING", logger="fedaval"):
            part = P.sthfl(balanced_targets(10, 180), 10, 10, 2, 3, 10.0, np.random.default_rng(seed))
        off = part.summary["data_fraction_used"] < 0.9 or abs(part.summary["effective_imbalance"] - 10) > 1
        said = [r.getMessage() for r in caplog.records if "effective imbalance factor" in r.getMessage()]
        assert bool(said) == off, (seed, part.summary, said)
        warned.append(off)
    assert any(warned) and not all(warned)


def test_clients_the_scenario_leaves_without_data_are_warned_about(tiny_config, caplog):
    """More clients than a Dirichlet split can feed (alpha 0.01 gives each of
    digits' 10 classes to about one client): the empty ones never train, and
    the run says so instead of leaving them out silently."""
    from fedaval.build import build_run

    with caplog.at_level("WARNING", logger="fedaval"):
        run = build_run(tiny_config(scenario_options={"clients": 30, "tasks": 2, "alpha": 0.01}))
    empty = [k for k, c in enumerate(run.partition.clients) if not any(len(i) for i in c.indices)]
    said = [r.getMessage() for r in caplog.records if "no training sample in any task" in r.getMessage()]
    assert empty and len(said) == 1
    assert said[0].startswith(f"{len(empty)} of the 30 clients of fcil-sync have no training sample in any task")
    assert not set(empty) & {k for ids in run.schedule for k in ids}  # never sampled
    caplog.clear()
    with caplog.at_level("WARNING", logger="fedaval"):
        build_run(tiny_config(scenario_options={"clients": 3, "tasks": 2}))
    assert not [r for r in caplog.records if "no training sample" in r.getMessage()]
