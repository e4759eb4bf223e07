"""On a GPU, a training round queues its minibatches without waiting for the GPU.

A host-device synchronisation per minibatch (a blocking copy, an ``.item()``)
makes the host wait for every queued kernel before it issues the next step,
so the host's Python work and the GPU's kernels take turns instead of
overlapping: with ``--cuda-graphs`` it cost a third of the round
(docs/performance.md, "On a GPU"). Runs with FEDAVAL_TEST_DEVICE=cuda only:
``torch.cuda.set_sync_debug_mode`` reports each synchronising call."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import TEST_DEVICE

pytestmark = pytest.mark.skipif(
    not TEST_DEVICE.startswith("cuda"), reason="counts CUDA synchronisations (FEDAVAL_TEST_DEVICE=cuda)"
)


@pytest.mark.parametrize("model", ["auto", "cnn"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_round_does_not_synchronise_per_minibatch(tiny_config, model, cuda_graphs):
    from fedaval.build import build_run
    from fedaval.coordinator import run_round

    # batch 8: some 40 minibatches per client and round; no evaluation in round 2
    run = build_run(tiny_config(model=model, batch_size=8, eval_every=10, cuda_graphs=cuda_graphs))
    run.server.begin_task(0)
    run_round(run, 1)  # CUDA's and the graphs' set-up
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_round(run, 2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    minibatches = sum(client.bridge._steps for client in run.clients)
    assert minibatches >= 60
    places = sorted({f"{w.filename}:{w.lineno}" for w in syncs})
    # measured on an H200: 108 syncs for 79 minibatches with a blocking copy of each minibatch's
    # positions, 23 without it (each client's round has some: the finite check of its upload, its
    # loss means, the data's first copy to the device)
    assert len(syncs) < minibatches / 2, f"{len(syncs)} syncs for {minibatches} minibatches, at {places}"
