"""FedWeIT as a plugin: decomposed model, sparse uploads counted as sent
(A above the code's threshold), retroactive term from the second task, a
knowledge base with the client's own A's (the code's) or others' only."""

from __future__ import annotations

import pytest
import torch
from helpers import one_line_error, tiny_run_config

from fedaval import hookimpl
from fedaval.api import run_training
from fedaval.plugins.fedweit import PAST
from fedaval.plugins.fedweit_math import decomposed_layers, to_dense

pytestmark = pytest.mark.slow

FEDWEIT = "fedaval.plugins.fedweit:FedWeIT"


class Probe:
    """Records what FedWeIT sends and what reaches the clients."""

    name = "fedweit-probe"

    def __init__(self):
        self.kb_received = {}  # (client, round) -> number of knowledge-base entries downloaded
        self.kb_in_model = {}  # (client, round) -> (kb_used, first layer's kb[0] copy, alpha copy)
        self.uploads = {}  # round -> list of upload entries
        self.base_before = {}

    @hookimpl
    def fedaval_setup(self, run):
        self.run = run
        self.fedweit = run.plugins.objects["fedweit"]

    @hookimpl
    def fedaval_client_receive(self, run, client, download):
        if "fedweit_kb" in download:
            self.kb_received[(client.id, run.round)] = len(download["fedweit_kb"])

    @hookimpl
    def fedaval_client_epoch_start(self, run, client, epoch):
        if epoch == 0:
            layer = next(iter(decomposed_layers(client.model).values()))
            self.kb_in_model[(client.id, run.round)] = (
                layer.kb_used,
                layer.kb[0].clone(),
                layer.alpha.detach().clone(),
                layer.base.detach().clone(),
            )

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        self.uploads[round] = [(u.client_id, dict(u.entries), u.nbytes) for u in uploads]
        self.base_before[round] = {k: v.clone() for k, v in self.fedweit.base.items()}


def fedweit_training(tmp_path_factory, **options):
    probe = Probe()
    config = tiny_run_config(
        tmp_path_factory.mktemp("fedweit") / "run", plugins=[FEDWEIT], plugin_options={"fedweit": options}
    )
    return run_training(config, extra_plugins=[probe]), probe


@pytest.fixture(scope="module")
def fedweit_run(tmp_path_factory):
    return fedweit_training(tmp_path_factory)


@pytest.fixture(scope="module")
def others_only_run(tmp_path_factory):
    """The reading before session 24: other clients' A's only, the top 30% of A, L1 on the masks too."""
    return fedweit_training(tmp_path_factory, kb_own=False, adaptive_upload="fraction", l1_mask=1e-3, kb_size=3)


def test_clients_are_judged_and_every_component_logs(fedweit_run):
    results, _ = fedweit_run
    assert results["federation_model"] == "clients"
    assert results["final"]["mean_client_accuracy"] is not None
    for record in results["rounds"]:
        assert record["losses"]["loss/fedweit_sparsity"] > 0
    # the retroactive term needs a past task: absent in task 0, present from task 1
    assert all("loss/fedweit_retro" not in r["losses"] for r in results["rounds"] if r["task"] == 0)
    assert all(r["losses"]["loss/fedweit_retro"] > 0 for r in results["rounds"] if r["task"] == 1)


def test_uploads_are_sparse_pairs_counted_as_sent_and_smaller_than_dense(fedweit_run):
    results, probe = fedweit_run
    layers = decomposed_layers(probe.run.clients[0].model)
    dense = sum(layer.base.numel() * layer.base.element_size() for layer in layers.values())
    for round, uploads in probe.uploads.items():
        for _, entries, nbytes in uploads:
            assert entries["weights"] == {}  # no dense FedAvg upload
            for units, rows in entries["fedweit_base"].values():
                assert units.dtype == torch.int32 and rows.dim() >= 2
            # the adaptive parameters go up at the task's last round only
            assert ("fedweit_adaptive" in entries) == (round in (2, 4))
            base_bytes = sum(u.numel() * 4 + r.numel() * 4 for u, r in entries["fedweit_base"].values())
            assert base_bytes < dense
            if "fedweit_adaptive" in entries:
                for idx, val in entries["fedweit_adaptive"].values():  # the code's hard threshold at lambda_1
                    assert idx.dtype == torch.int32 and idx.numel() == val.numel()
                    assert (val.abs() > 1e-3).all()
            if "fedweit_adaptive" not in entries:
                assert nbytes < dense  # a whole upload of a mid-task round, as the core counts it
        record = results["rounds"][round - 1]
        assert record["bytes_up"] == sum(n for _, _, n in uploads)


def test_server_fuses_the_sparse_bases_and_clients_load_them(fedweit_run):
    _, probe = fedweit_run
    fedweit = probe.fedweit
    name = next(iter(fedweit.base))
    assert not torch.equal(probe.base_before[1][name], probe.base_before[2][name])  # round 1's fusion moved it
    for k in (0, 1):  # what client k trains on in round 2 is the base fused in round 1
        assert torch.equal(probe.kb_in_model[(k, 2)][3], probe.base_before[2][name])


def test_the_knowledge_base_holds_every_clients_last_task_own_included(fedweit_run):
    _, probe = fedweit_run
    fedweit = probe.fedweit
    assert probe.kb_received[(0, 1)] == 0 and probe.kb_received[(1, 1)] == 0
    assert probe.kb_received[(0, 3)] == 2 and probe.kb_received[(1, 3)] == 2  # both clients' task-0 A's
    name = next(iter(fedweit.base))
    first = next(entry for _, task, entry in fedweit.kb if task == 0)
    for k in (0, 1):
        used, kb0, alpha, _ = probe.kb_in_model[(k, 3)]
        assert used == 2 and torch.allclose(alpha[:2].cpu(), torch.full((2,), 0.5))
        assert torch.equal(kb0.cpu(), to_dense(first[name], kb0.shape).cpu())  # in arrival order


def test_the_sparsity_term_is_on_a_alone_by_default(fedweit_run, others_only_run):
    new, old = fedweit_run[0]["rounds"][0]["losses"], others_only_run[0]["rounds"][0]["losses"]
    # the masks start at 1 (sum |m| = units), A at 0: the earlier reading's term starts far higher
    assert new["loss/fedweit_sparsity"] < old["loss/fedweit_sparsity"] / 10


def test_knowledge_base_of_other_clients_reaches_each_client_at_its_new_task(others_only_run):
    _, probe = others_only_run
    fedweit = probe.fedweit
    # round 1: nothing in the knowledge base yet; round 3 = first round of task 1: the other client's A
    assert probe.kb_received[(0, 1)] == 0 and probe.kb_received[(1, 1)] == 0
    assert probe.kb_received[(0, 3)] == 1 and probe.kb_received[(1, 3)] == 1
    assert (0, 2) not in probe.kb_received and (0, 4) not in probe.kb_received  # only when a task starts
    name = next(iter(fedweit.base))
    task0 = {cid: entry for cid, task, entry in fedweit.kb if task == 0}
    for k, other in ((0, 1), (1, 0)):
        used, kb0, alpha, _ = probe.kb_in_model[(k, 3)]
        assert used == 1 and torch.allclose(alpha[:1].cpu(), torch.ones(1))
        assert torch.equal(kb0.cpu(), to_dense(task0[other][name], kb0.shape).cpu())  # the other client's, not its own
        assert kb0.abs().sum() > 0
        assert probe.kb_in_model[(k, 1)][0] == 0


def test_past_tasks_are_stored_for_the_retroactive_term(fedweit_run):
    _, probe = fedweit_run
    past = probe.run.clients[0].stash[PAST]
    assert all(len(v) == 2 for v in past.values())  # one entry per finished task


def test_bad_fraction_is_a_one_line_error():
    line = one_line_error(["train", "--plugins", FEDWEIT, "-o", "fedweit.base_fraction=0"])
    assert "fedweit.base_fraction" in line and "(0, 1]" in line


def test_a_fraction_without_the_fraction_upload_is_refused():
    line = one_line_error(["train", "--plugins", FEDWEIT, "-o", "fedweit.adaptive_fraction=0.5"])
    assert "fedweit.adaptive_fraction applies to fedweit.adaptive_upload=fraction only" in line
