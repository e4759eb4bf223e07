"""FedWeIT's maths against values worked out by hand."""

from __future__ import annotations

import torch

from fedaval.plugins.fedweit_math import (
    above_threshold,
    decompose,
    decomposed_layers,
    effective_weight,
    fuse_sparse,
    l1_norm,
    masked_base,
    retroactive_loss,
    to_dense,
    top_fraction,
    unit_entries,
)

T = torch.tensor


def test_effective_weight_is_base_times_mask_plus_adaptive_plus_attention_over_kb():
    base = T([[1.0, 2.0], [3.0, 4.0]])
    mask = T([2.0, 0.5])  # one per output unit (row)
    adaptive = T([[0.1, 0.0], [0.0, -1.0]])
    kb = T([[[1.0, 1.0], [1.0, 1.0]], [[0.0, 2.0], [0.0, 0.0]]])
    alpha = T([0.5, 1.0])
    # B*m = [[2,4],[1.5,2]]; +A = [[2.1,4],[1.5,1]]; +0.5*ones +1*[[0,2],[0,0]]
    expected = T([[2.6, 6.5], [2.0, 1.5]])
    assert torch.allclose(effective_weight(base, mask, adaptive, kb, alpha), expected)
    assert torch.allclose(effective_weight(base, mask, adaptive), T([[2.1, 4.0], [1.5, 1.0]]))
    assert torch.allclose(effective_weight(base, mask, adaptive, kb[:0], alpha[:0]), T([[2.1, 4.0], [1.5, 1.0]]))


def test_top_fraction_keeps_the_largest_magnitudes():
    idx, val = top_fraction(T([0.1, -5.0, 3.0, 0.2, -0.3]), 0.4)  # ceil(2.0) = 2 kept
    assert idx.dtype == torch.int32
    assert idx.tolist() == [1, 2] and val.tolist() == [-5.0, 3.0]
    idx, val = top_fraction(T([[0.1, -5.0], [3.0, 0.2]]), 0.01)  # at least one
    assert idx.tolist() == [1] and val.tolist() == [-5.0]
    idx, _ = top_fraction(T([1.0, 2.0, 3.0]), 1.0)
    assert idx.tolist() == [0, 1, 2]


def test_masked_base_sends_the_rows_of_the_units_with_the_largest_mask():
    base = T([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    units, rows = masked_base(base, T([0.1, -2.0, 1.0]), 0.5)  # ceil(1.5) = 2 units: 1 (|-2|) and 2 (|1|)
    assert units.dtype == torch.int32 and units.tolist() == [1, 2]
    assert rows.tolist() == [[3.0, 4.0], [5.0, 6.0]]
    idx, val = unit_entries((units, rows), base.shape)
    assert idx.tolist() == [2, 3, 4, 5] and val.tolist() == [3.0, 4.0, 5.0, 6.0]
    # bytes as sent: 2 int32 indices + 4 float32 values = 24 < 6 * 4 dense
    assert units.numel() * 4 + rows.numel() * 4 == 24


def test_to_dense():
    assert to_dense((T([0, 3], dtype=torch.int32), T([2.0, -1.0])), (2, 2)).tolist() == [[2.0, 0.0], [0.0, -1.0]]


def test_fuse_sparse_averages_each_entry_over_its_senders_and_keeps_the_rest():
    previous = T([0.0, 0.0, 0.0, 9.0])
    a = (T([0, 1], dtype=torch.int32), T([2.0, 4.0]))
    b = (T([1, 2], dtype=torch.int32), T([10.0, 6.0]))
    fused = fuse_sparse(previous, [a, b], [1.0, 3.0])
    # entry 0: only a -> 2; entry 1: (4*1 + 10*3)/4 = 8.5; entry 2: only b -> 6; entry 3: nobody -> 9
    assert fused.tolist() == [2.0, 8.5, 6.0, 9.0]


def test_l1_norm_sums_over_the_layers():
    assert l1_norm([T([1.0, -2.0]), T([[0.5, -0.5]])]).item() == 4.0


def test_above_threshold_keeps_the_entries_past_it():
    idx, val = above_threshold(T([[0.5, -5.0], [3.0, -0.001]]), 0.05)
    assert idx.dtype == torch.int32 and idx.tolist() == [0, 1, 2] and val.tolist() == [0.5, -5.0, 3.0]
    idx, val = above_threshold(T([0.001, -0.001]), 0.001)  # strictly above
    assert idx.numel() == 0 and val.numel() == 0


def test_retroactive_loss_by_hand():
    base = T([[1.0, 2.0], [3.0, 4.0]])
    # task 0: B*m = [[1,2],[6,8]], rest 0, stored [[1,2],[6,7]] -> squared gap 1
    first = (T([1.0, 2.0]), torch.zeros(2, 2), T([[1.0, 2.0], [6.0, 7.0]]))
    # task 1: B*m = [[0,0],[3,4]], rest ones -> [[1,1],[4,5]], stored the same -> 0
    second = (T([0.0, 1.0]), torch.ones(2, 2), T([[1.0, 1.0], [4.0, 5.0]]))
    assert retroactive_loss(base, [first, second]).item() == 1.0
    assert retroactive_loss(base, []).item() == 0.0
    # its gradient pulls the base back towards the stored weight: d/dB = 2 * (gap) * m
    b = base.clone().requires_grad_(True)
    retroactive_loss(b, [first]).backward()
    assert b.grad.tolist() == [[0.0, 0.0], [0.0, 4.0]]


def test_decomposed_model_starts_as_the_plain_model_and_trains_every_part():
    from fedaval.models import cnn, mlp

    torch.manual_seed(0)
    for make, x in ((mlp, torch.randn(4, 1, 8, 8)), (cnn, torch.randn(4, 3, 16, 16))):
        plain = make(tuple(x.shape[1:]), 5)
        plain.eval()
        expected = plain(x)
        model = decompose(plain, kb_size=2)
        layers = decomposed_layers(model)
        assert layers and not any(isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) for m in model.modules())
        assert torch.allclose(model(x), expected, atol=1e-6)
        first = next(iter(layers.values()))
        first.start_task([torch.ones_like(first.base), 2 * torch.ones_like(first.base)])
        assert first.kb_used == 2 and first.alpha.tolist() == [0.5, 0.5]
        model(x).sum().backward()
        for part in ("base", "mask", "adaptive", "alpha"):
            assert getattr(first, part).grad is not None and getattr(first, part).grad.abs().sum() > 0, part
