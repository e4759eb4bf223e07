"""Property tests over scenario parameters (hypothesis): every accepted
combination yields a valid partition with the counts its scenario promises;
every rejected one gets a one-line error naming the bad value."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedaval.errors import FedavalUsageError
from fedaval.options import build_options
from fedaval.scenarios import SCENARIOS

PROPERTY_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def labels(draw):
    """A label array: 1-12 classes with 1-25 samples each, shuffled."""
    counts = draw(st.lists(st.integers(1, 25), min_size=1, max_size=12))
    y = np.repeat(np.arange(len(counts)), counts)
    return np.random.default_rng(draw(st.integers(0, 2**16))).permutation(y), len(counts)


def build(name, values, targets, num_classes, seed):
    spec = SCENARIOS[name]
    options = build_options(spec.Options, values, owner=name)
    return options, spec.build(options, targets, num_classes, np.random.default_rng(seed))


def check_common(partition, targets, num_clients):
    """No sample twice; each task's samples are of that task's classes; class lists sorted."""
    assert len(partition.clients) == num_clients
    used = partition.all_indices()
    assert len(used) == len(np.unique(used)), "a sample is on two clients (or twice on one)"
    for client in partition.clients:
        assert len(client.indices) == len(client.classes)
        for idx, classes in zip(client.indices, client.classes):
            assert classes == sorted(classes) and len(set(classes)) == len(classes)
            assert set(np.unique(targets[idx]).tolist()) <= set(classes)


def class_samples(targets, classes):
    return int(np.isin(targets, list(classes)).sum())


def assert_one_line_error(exc, *values):
    message = str(exc)
    assert "\n" not in message and message
    assert any(str(v) in message for v in values), message


def run_or_error(name, values, data, seed):
    targets, num_classes = data
    try:
        options, partition = build(name, values, targets, num_classes, seed)
    except FedavalUsageError as exc:
        return targets, num_classes, None, None, exc
    return targets, num_classes, options, partition, None


seeds = st.integers(0, 2**16)


@PROPERTY_SETTINGS
@given(labels(), st.integers(-1, 6), st.integers(0, 14), st.integers(-1, 5), st.floats(0.5, 60), seeds)
def test_sthfl(data, clients, classes_per_task, tasks, imbalance, seed):
    from fedaval.scenarios.partition import long_tailed

    values = dict(clients=clients, classes_per_task=classes_per_task, tasks=tasks, imbalance=imbalance)
    targets, num_classes, options, partition, error = run_or_error("sthfl", values, data, seed)
    valid = (
        clients >= 1
        and tasks >= 1
        and 1 <= classes_per_task <= num_classes
        and imbalance >= 1
        and classes_per_task + tasks - 1 <= num_classes
    )
    if error is not None:
        # the one data-dependent refusal: too few samples of a class for the stages that drew it
        assert not valid or "imbalance factor" in str(error)
        assert_one_line_error(error, clients, classes_per_task, tasks, imbalance)
        return
    assert valid
    check_common(partition, targets, clients)
    totals = {sum(len(i) for i in c.indices) for c in partition.clients}
    assert len(totals) == 1, "sthfl promises the same number of samples on every client"
    for client in partition.clients:
        assert client.num_tasks == tasks
        assert all(len(classes) == classes_per_task for classes in client.classes)
        seen = set()
        for classes, idx in zip(client.classes, client.indices):
            assert set(classes) - seen, "every client-stage brings a class new to its client"
            assert set(np.unique(targets[idx]).tolist()) == set(classes), "every drawn class has samples"
            seen |= set(classes)
    # as much data as equal totals allow: at least what splitting every class
    # evenly over its slots and cutting to the smallest client gives (the old rule)
    kept = [len(k) for k in long_tailed(targets, num_classes, imbalance, np.random.default_rng(seed))]
    slots = np.zeros(num_classes, dtype=int)
    for client in partition.clients:
        for classes in client.classes:
            slots[classes] += 1
    even_split = min(
        sum(kept[c] // slots[c] for classes in client.classes for c in classes) for client in partition.clients
    )
    used = partition.all_indices()
    quota = totals.pop()
    assert quota == partition.summary["samples_per_client"] >= even_split
    assert partition.summary["data_fraction_used"] == len(used) / sum(kept)
    per_class = np.bincount(targets[used], minlength=num_classes)
    per_class = per_class[per_class > 0]
    assert partition.summary["effective_imbalance"] == per_class.max() / per_class.min()
    assert quota == largest_equal_total(partition, kept), "the largest equal total there is"


def largest_equal_total(partition, kept):
    """The largest Q by a linear programme (independent of the partitioner's
    max flow): every slot one sample, client k takes Q in all, class c gives
    at most kept[c]. Integer capacities make floor(LP optimum) the integer one."""
    from scipy.optimize import linprog

    drawn = [sorted({c for classes in client.classes for c in classes}) for client in partition.clients]
    slots = np.zeros(len(kept), dtype=int)
    for client in partition.clients:
        for classes in client.classes:
            slots[classes] += 1
    pairs = [(k, c) for k, classes in enumerate(drawn) for c in classes]
    n = len(pairs) + 1  # x_(k,c) extra samples, then Q
    a_eq = np.zeros((len(drawn), n))
    b_eq = np.zeros(len(drawn))
    for i, (k, _c) in enumerate(pairs):
        a_eq[k, i] = 1
    for k, client in enumerate(partition.clients):
        a_eq[k, -1] = -1
        b_eq[k] = -sum(len(classes) for classes in client.classes)
    a_ub = np.zeros((len(kept), n))
    for i, (_k, c) in enumerate(pairs):
        a_ub[c, i] = 1
    b_ub = np.array(kept) - slots
    cost = np.zeros(n)
    cost[-1] = -1
    result = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * n, method="highs")
    assert result.status == 0
    return int(np.floor(-result.fun + 1e-6))


@PROPERTY_SETTINGS
@given(labels(), st.integers(-1, 6), st.integers(-1, 14), st.floats(0.01, 10) | st.just(0.0), seeds)
def test_fcil_sync(data, clients, tasks, alpha, seed):
    values = dict(clients=clients, tasks=tasks, alpha=alpha)
    targets, num_classes, options, partition, error = run_or_error("fcil-sync", values, data, seed)
    valid = clients >= 1 and 1 <= tasks <= num_classes and alpha > 0
    if error is not None:
        assert not valid
        assert_one_line_error(error, clients, tasks, alpha)
        return
    assert valid
    check_common(partition, targets, clients)
    assert len(partition.all_indices()) == len(targets), "every sample is used"
    first = partition.clients[0].classes
    assert sorted(c for group in first for c in group) == list(range(num_classes))
    assert all(c.classes == first and c.num_tasks == tasks for c in partition.clients)


@PROPERTY_SETTINGS
@given(labels(), st.integers(-1, 6), st.integers(-1, 8), st.floats(-0.2, 1.2), st.integers(-1, 12), seeds)
def test_fcil_async(data, clients, tasks, consensus, classes_per_client, seed):
    from fedaval.scenarios.partition import consensus_split, fcil_async_max_classes_per_client

    values = dict(clients=clients, tasks=tasks, consensus=consensus, classes_per_client=classes_per_client)
    targets, num_classes, options, partition, error = run_or_error("fcil-async", values, data, seed)
    if error is not None:
        assert_one_line_error(error, clients, tasks, consensus, classes_per_client)
        return
    assert clients >= 1 and tasks >= 1 and 0 <= consensus <= 1 and classes_per_client >= 0
    check_common(partition, targets, clients)
    m = classes_per_client or fcil_async_max_classes_per_client(num_classes, clients, consensus)
    common, unique = consensus_split(m, consensus)
    held = [{c for group in client.classes for c in group} for client in partition.clients]
    assert all(len(h) == m for h in held), "every client holds m classes"
    shared = set.intersection(*held)
    if clients > 1:
        assert len(shared) == common, "gamma is the fraction of a client's classes held by every client"
        for h in held:
            assert all(sum(c in other for other in held) == 1 for c in h - shared)
    used = set.union(*held)
    assert len(used) == common + clients * unique <= num_classes
    if classes_per_client == 0:  # as many classes as the dataset allows
        bigger = consensus_split(m + 1, consensus)
        assert bigger[0] + clients * bigger[1] > num_classes
    assert len(partition.all_indices()) == class_samples(targets, used), "every sample of a used class is used"
    assert all(client.num_tasks == tasks for client in partition.clients)


@PROPERTY_SETTINGS
@given(labels(), st.integers(-1, 6), st.integers(-1, 4), st.integers(-1, 5), st.integers(-1, 5), seeds)
def test_fcl_random(data, clients, classes_per_task, min_tasks, max_tasks, seed):
    values = dict(clients=clients, classes_per_task=classes_per_task, min_tasks=min_tasks, max_tasks=max_tasks)
    targets, num_classes, options, partition, error = run_or_error("fcl-random", values, data, seed)
    valid = (
        clients >= 1
        and classes_per_task >= 1
        and 1 <= min_tasks <= max_tasks
        and classes_per_task * max_tasks <= num_classes
    )
    if error is not None:
        assert not valid
        assert_one_line_error(error, clients, classes_per_task, min_tasks, max_tasks, num_classes)
        return
    assert valid
    check_common(partition, targets, clients)
    held = set()
    for client in partition.clients:
        assert min_tasks <= client.num_tasks <= max_tasks
        assert all(len(classes) == classes_per_task for classes in client.classes)
        flat = [c for group in client.classes for c in group]
        assert len(flat) == len(set(flat)), "a client never meets a class twice"
        held.update(flat)
    assert len(partition.all_indices()) == class_samples(targets, held), "every sample of a held class is used"
