"""On a GPU, a training round queues its minibatches without waiting for the GPU.

A host-device synchronisation per minibatch (a blocking copy, an ``.item()``)
makes the host wait for every queued kernel before it issues the next step,
so the host's Python work and the GPU's kernels take turns instead of
overlapping: with ``--cuda-graphs`` it cost a third of the round
(docs/performance.md, "On a GPU"). Runs with FEDAVAL_TEST_DEVICE=cuda only:
``torch.cuda.set_sync_debug_mode`` reports each synchronising call."""

from __future__ import annotations

import warnings
from contextlib import contextmanager

import pytest
import torch
from helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(
    not TEST_DEVICE.startswith("cuda"), reason="counts CUDA synchronisations (FEDAVAL_TEST_DEVICE=cuda)"
)

GRAPHS = {
    "no-graphs": {},
    "graphs": dict(cuda_graphs=True),
    "step-graphs": dict(cuda_graphs=True, cuda_graph_scope="step"),
}
"""The runs' --cuda-graphs settings: none, the backbone, the whole step."""


@contextmanager
def counting_synchronisations():
    """Within the block, every synchronising call CUDA reports; yields the
    list they are appended to (their places, ``file:line``) when it ends."""
    places: list[str] = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield places
    finally:
        torch.cuda.set_sync_debug_mode("default")
    places += [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]


def synchronisations(run, round: int) -> tuple[int, list[str]]:
    """Round ``round`` of ``run`` (its stage begun first when it is the
    stage's first round, as :func:`fedaval.coordinator.train` does), and the
    synchronisations CUDA reports in it: their number and places."""
    from fedaval.coordinator import run_round

    now = run.enter_round(round)
    if round == run.rounds_of_task(now.task)[0]:
        run.server.begin_task(now.task)
        run.hook.fedaval_server_task_start(run=run, task=now.task)
    with counting_synchronisations() as syncs:
        run_round(run, round)
    return len(syncs), sorted(set(syncs))


@pytest.mark.parametrize("model", ["auto", "cnn"])
@pytest.mark.parametrize("graphs", GRAPHS)
@pytest.mark.parametrize("augment", ["none", "standard"])
def test_a_round_does_not_synchronise_per_minibatch(tiny_config, model, graphs, augment):
    """``augment=standard`` (CIFAR's default): its padding value was kept on the CPU and copied to the
    GPU, with a wait, in every minibatch."""
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    # batch 8: some 40 minibatches per client and round; no evaluation in round 2
    run = build_run(tiny_config(model=model, batch_size=8, eval_every=10, augment=augment, **GRAPHS[graphs]))
    run.server.begin_task(0)
    run_round(run, 1)  # CUDA's and the graphs' set-up
    syncs, places = synchronisations(run, 2)
    minibatches = sum(client.bridge._steps for client in run.clients)
    assert minibatches >= 60
    # measured on an H200: 108 syncs for 79 minibatches with a blocking copy of each minibatch's
    # positions, 23 without it (each client's round had some: the finite check of its upload, its
    # loss means, the data's first copy to the device; since session 28 the clients' loss means and
    # checks are read once a round, test_the_clients_of_a_round_wait_for_the_gpu_once_not_once_each)
    assert syncs < minibatches / 2, f"{syncs} syncs for {minibatches} minibatches, at {places}"


@pytest.mark.parametrize("plugin", ["fedprok", "gldp", "apfl", "target", "ficarl", "fedspace", "glfc", "fedlwf"])
def test_a_methods_round_does_not_synchronise_per_minibatch(tiny_config, tmp_path, plugin):
    """FedProK's feature translation (Eq. 8), in the local minibatches (and,
    until session 14, in the minibatches of its classifier fit); GLDP's relation losses (Eqs. 7/8
    and 10); APFL's personal step (its alpha on the CPU: a copy back per
    parameter tensor); TARGET's, FediCaRL's and FedSpace's class lists
    copied to the GPU; GLFC's compensation weights (each group's mean read
    back, about six waits a minibatch until session 25; in GPU session 26,
    beside six full-scale runs, this case had not finished in 240 s: its
    round's task end herded and its proxy inverted on the shared GPU, both
    since changed); FedLwF's distillation (Avalanche's picked the old classes with a Python list,
    copied twice a minibatch; fedaval.plugins.lwf_distillation, session 28). FedEWC is not here: its
    importances, computed at every task end (each round here) through Avalanche's own loader, wait
    once a minibatch of that pass, which this count cannot tell from its penalty's (made without a
    wait since session 28, fedaval.plugins.ewc_penalty; its operations are counted on the CPU). (PFCL's loss still waits a few times per minibatch:
    its sync-free form moves the float rounding, and waits for its table's
    re-run; see its docstring.)
    Each waited for the GPU several times per minibatch: at full scale (ResNet-18,
    CIFAR-10, four runs sharing an H200) a FedProK round took 53 to 66 s
    against FedAvg's 1.8 to 2.7 s (docs/reproduction.md).

    Counted in a task-1 round at two batch sizes: what a method waits for
    once per client and round (prototypes, its plan, the upload) is the same
    at both; a wait per minibatch grows with their number. Session 13
    measured FedProK's round at batch 8 on an H200 (with the final round's
    evaluation, in an earlier form of this test): 142 syncs for 80 local and
    1,600 classifier-fit minibatches, against some 30,000 before. Session
    14 ran this form on an H100: FedProK, GLDP, APFL, FediCaRL and FedSpace
    passed; TARGET waited once per minibatch (its class mask, since made once
    per class list)."""
    from fedaval.build import build_run

    counts = {}
    for batch_size in (8, 4):
        config = tiny_config(
            plugins=[plugin],
            model="cnn" if plugin == "target" else "auto",  # TARGET's generator matches BatchNorm statistics
            # FedProK's classifier fit (reading 8) is full-batch L-BFGS since session 14, which waits
            # some 45 times an iteration on a GPU; since session 21 it runs on the CPU (fedprok.fit_device),
            # so its waits are once per client and round (the features' copy), whatever the iterations.
            # Until then this test ran FedProK without the fit.
            scenario_options={"clients": 2, "tasks": 3},
            rounds_per_task=1,
            batch_size=batch_size,
            eval_every=10,
            out=tmp_path / f"batch{batch_size}",
        )
        run = build_run(config)
        synchronisations(run, 1)  # task 0
        syncs, places = synchronisations(run, 2)  # task 1: old classes to keep
        counts[batch_size] = (syncs, sum(client.bridge._steps for client in run.clients), places)
    (syncs_8, minibatches_8, _), (syncs_4, minibatches_4, places) = counts[8], counts[4]
    assert minibatches_4 - minibatches_8 >= 40
    assert syncs_4 - syncs_8 < (minibatches_4 - minibatches_8) / 4, (
        f"{syncs_8} syncs for {minibatches_8} minibatches, {syncs_4} for {minibatches_4}, at {places}"
    )


def test_herding_waits_for_the_gpu_once_not_once_a_step():
    """FediCaRL's and GLFC's herding at a task's end: Avalanche's loop read
    every step's choice back (GPU session 26: GLFC's task ends took 85 to
    206 s on an H200 shared by six runs); ``herding_order`` keeps its
    choices on the GPU and copies the order back once."""
    from fedaval.plugins.ficarl_math import herding_order

    features = torch.randn(400, 64, device="cuda")
    torch.cuda.synchronize()
    with counting_synchronisations() as syncs:
        order = herding_order(features, 50)
    assert len(order) == 50
    assert len(syncs) <= 2, syncs


@pytest.mark.parametrize("graphs", GRAPHS)
def test_the_clients_of_a_round_wait_for_the_gpu_once_not_once_each(tiny_config, graphs):
    """Each client's loss terms and upload check were read right after it
    (three waits a client): the GPU then idled while the host received, set
    up and uploaded the next client, which with ``--cuda-graphs`` and a few
    minibatches a client is a large share of the round (docs/performance.md,
    item 3). Now the clients' part of a round (``train_clients``) reads them
    all at once, after the last client. A round of task 0 after its first
    (the clients' data already on the GPU), 4 clients."""
    from fedaval.backends import LocalBackend
    from fedaval.build import build_run
    from fedaval.coordinator import client_extras, run_round

    run = build_run(tiny_config(scenario_options={"clients": 4, "tasks": 2}, eval_every=10, **GRAPHS[graphs]))
    run.server.begin_task(0)
    run_round(run, 1)
    run.enter_round(2)
    download = run.server.download()
    sampled = run.schedule[1]
    extras = {k: client_extras(run, k, download) for k in sampled}
    torch.cuda.synchronize()
    with counting_synchronisations() as syncs:
        results = LocalBackend().train_clients(run, sampled, download, 2, extras)
    assert len(results) == 4 and all(r.failure is None for r in results)
    assert len(syncs) <= 2, syncs
