"""Models split into feature extractor and classifier."""

from __future__ import annotations

import pytest
import torch
import torchvision

from fedaval.models import SplitModel, build_model, split_model


@pytest.mark.parametrize(
    "name, shape, dim",
    [("mlp", (1, 8, 8), 64), ("cnn", (3, 32, 32), 128), ("resnet18", (3, 32, 32), 512), ("resnet34", (3, 32, 32), 512)],
)
def test_models_expose_features_and_classifier(name, shape, dim):
    model = build_model(name, shape, 10)
    x = torch.randn(2, *shape)
    features = model.features(x)
    assert features.shape == (2, dim) == (2, model.feature_dim)
    assert torch.allclose(model(x), model.classifier(features))
    assert model.classifier_keys() == ["classifier.weight", "classifier.bias"]


@pytest.mark.parametrize("name", ["resnet18", "resnet34"])
def test_resnets_have_the_cifar_stem(name):
    model = build_model(name, (3, 32, 32), 10)
    stem = model.features[0]
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.features.modules())


def test_resnet34_has_34_layers_and_torchvisions_weight_count():
    """PFCL's backbone (``--model resnet34``): 3, 4, 6, 3 basic blocks, i.e. 33
    3x3 convolutions + the classifier; the same number of weights as
    torchvision's ResNet-34 less the 7x7 stem's extra taps (the paper: 21M)."""
    model = build_model("resnet34", (3, 32, 32), 100)
    convs = [m for m in model.features.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) == 33
    ours = sum(p.numel() for p in model.parameters())
    theirs = sum(p.numel() for p in torchvision.models.resnet34(num_classes=100).parameters())
    assert ours == theirs - 64 * 3 * (7 * 7 - 3 * 3)
    assert 21_000_000 < ours < 21_400_000


def test_split_any_torchvision_model_at_its_last_linear_layer():
    net = torchvision.models.resnet18(num_classes=7)
    net.eval()
    split = split_model(net)
    assert isinstance(split, SplitModel) and split.feature_dim == 512
    x = torch.randn(1, 3, 32, 32)
    assert torch.allclose(split(x), net(x), atol=1e-5)


def test_unsplittable_model_is_refused():
    with pytest.raises(ValueError, match="no last linear layer"):
        split_model(torch.nn.Sequential(torch.nn.Conv2d(1, 1, 1)))


def test_a_split_model_moved_where_it_already_is_skips_the_walk(monkeypatch):
    """``SplitModel.to`` returns at once for a move to the device all its
    tensors are on (Avalanche moves the model at every local round); a move
    elsewhere, a dtype change, or a model on another device takes
    ``nn.Module.to``, with the same results."""
    from fedaval.models import SplitModel, is_on

    walked = []
    original = torch.nn.Module._apply
    monkeypatch.setattr(torch.nn.Module, "_apply", lambda self, *a, **k: walked.append(self) or original(self, *a, **k))
    model = SplitModel(torch.nn.Linear(2, 3), torch.nn.Linear(3, 2), 3)
    weight = model.classifier.weight
    assert model.to("cpu") is model and model.to(torch.device("cpu")) is model and model.to(device="cpu") is model
    assert walked == [] and model.classifier.weight is weight
    assert model.to(torch.float64) is model and walked and model.classifier.weight.dtype == torch.float64
    walked.clear()
    on_meta = SplitModel(torch.nn.Linear(2, 3, device="meta"), torch.nn.Linear(3, 2, device="meta"), 3)
    assert not is_on(on_meta, "cpu") and is_on(on_meta, "meta")
    assert on_meta.to("meta") is on_meta and walked == []
    with pytest.raises(NotImplementedError):  # a move elsewhere is nn.Module's (which cannot copy out of meta)
        on_meta.to("cpu")
    assert walked
    on_meta.to_empty(device="cpu")  # nn.Module's own moves still work
    assert is_on(on_meta, "cpu")
