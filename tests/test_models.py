"""Models split into feature extractor and classifier."""

from __future__ import annotations

import pytest
import torch
import torchvision

from fedaval.models import SplitModel, build_model, split_model


@pytest.mark.parametrize("name, shape, dim", [("mlp", (1, 8, 8), 64), ("cnn", (3, 32, 32), 128), ("resnet18", (3, 32, 32), 512)])
def test_models_expose_features_and_classifier(name, shape, dim):
    model = build_model(name, shape, 10)
    x = torch.randn(2, *shape)
    features = model.features(x)
    assert features.shape == (2, dim) == (2, model.feature_dim)
    assert torch.allclose(model(x), model.classifier(features))
    assert model.classifier_keys() == ["classifier.weight", "classifier.bias"]


def test_resnet18_has_the_cifar_stem():
    model = build_model("resnet18", (3, 32, 32), 10)
    stem = model.features[0]
    assert stem.kernel_size == (3, 3) and stem.stride == (1, 1)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.features.modules())


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
