"""FedAvg's rule against hand-computed values, and in a real run."""

from __future__ import annotations

import torch

from fedaval.api import run_training
from fedaval.plugins.fedavg import weighted_average


def test_weighted_average_by_hand():
    a = {"w": torch.tensor([1.0, 2.0]), "b": torch.tensor([0.0])}
    b = {"w": torch.tensor([3.0, 6.0]), "b": torch.tensor([4.0])}
    fused = weighted_average([a, b], [1, 3])
    assert torch.allclose(fused["w"], torch.tensor([2.5, 5.0]))  # (1*1 + 3*3)/4, (1*2 + 3*6)/4
    assert torch.allclose(fused["b"], torch.tensor([3.0]))


def test_key_missing_from_one_client_averages_over_the_others():
    fused = weighted_average([{"w": torch.tensor([2.0])}, {}], [1, 5])
    assert torch.allclose(fused["w"], torch.tensor([2.0]))


class CaptureFusion:
    """Records the uploads and the global weights after fusion."""

    name = "capture"

    def __init__(self):
        self.checks = []

    from fedaval import hookimpl

    @hookimpl
    def fedaval_server_fuse(self, run, uploads, round):
        expected = weighted_average([u.get("weights") for u in uploads], [u.num_samples for u in uploads])
        state = run.server.model.state_dict()
        self.checks.append(all(torch.allclose(state[k], v, atol=1e-6) for k, v in expected.items()))
        self.keys = set(uploads[0].get("weights"))


def test_global_model_is_the_sample_weighted_mean_of_uploads(tiny_config):
    probe = CaptureFusion()
    run_training(tiny_config(), extra_plugins=[probe])
    assert probe.checks and all(probe.checks)
    assert any(k.startswith("classifier.") for k in probe.keys)  # FedAvg shares everything


def test_payload_copies_are_exact_and_their_own():
    """``copies`` and ``copy_into`` (one ``_foreach_copy_`` for a state's tensors): the same values and
    layouts, in memory of their own."""
    import torch

    from fedaval.payload import copies, copy_into

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 3, 5, 5).to(memory_format=torch.channels_last))
    tensors = [weight, torch.randn(7), torch.arange(6, dtype=torch.int64)]
    made = copies(tensors)
    for original, copy in zip(tensors, made):
        assert torch.equal(original, copy) and copy.dtype == original.dtype and copy.stride() == original.stride()
        assert copy.data_ptr() != original.data_ptr() and not copy.requires_grad
    targets = [torch.zeros_like(t) for t in tensors]
    copy_into(targets, made)
    made[1].add_(1)  # the copies are their own: the targets and the originals keep their values
    assert all(torch.equal(t, o) for t, o in zip(targets, tensors))
    copy_into([weight], [torch.zeros_like(weight)])  # into a parameter that requires grad: no autograd error
    assert not weight.detach().any()
