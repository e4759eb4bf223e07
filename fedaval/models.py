"""Models, always seen as a feature extractor followed by a classifier.

Prototype methods need the features; personalised methods keep the head
local. :class:`SplitModel` makes that split explicit, and
:func:`split_model` turns a usual torchvision-style model (last layer
``fc``, ``classifier`` or ``head``) into one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from fedaval.errors import choice_error


@contextmanager
def in_mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    """``model`` in train (``training``) or eval mode for the block, every
    module's own mode restored afterwards (a module frozen in eval mode stays so)."""
    modes = [(m, m.training) for m in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for m, mode in modes:
            m.train(mode)


def is_on(model: nn.Module, device: torch.device | str) -> bool:
    """Whether ``model`` has a parameter or buffer and all of them are on
    ``device`` (``cuda`` meaning the current CUDA device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device == device for t in tensors)


class SplitModel(nn.Module):
    """``classifier(features(x))``. ``feature_dim`` is the width of the features."""

    def __init__(self, features: nn.Module, classifier: nn.Module, feature_dim: int):
        super().__init__()
        self.features = features
        self.classifier = classifier
        self.feature_dim = feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))

    def to(self, *args, **kwargs):
        """``nn.Module.to``, returning at once when it is a move to the device
        every parameter and buffer is already on: that walk over every module
        and tensor changes nothing then, and costs about 0.16 ms for ``cnn``
        against about 0.1 ms for the check (Avalanche's ``train()`` moves the
        model at every local round)."""
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        if device is not None and dtype is None and memory_format is None and is_on(self, device):
            return self
        return super().to(*args, **kwargs)

    def classifier_keys(self) -> list[str]:
        """state_dict keys of the classifier (the personal head of FedRep/GLDP)."""
        return ["classifier." + k for k in self.classifier.state_dict()]


def split_model(model: nn.Module) -> SplitModel:
    """Split ``model`` at its last linear layer (attribute ``fc``,
    ``classifier`` or ``head``); a :class:`SplitModel` is returned as it is."""
    if isinstance(model, SplitModel):
        return model

    def body_without(attr: str, replacement: nn.Module) -> nn.Module:
        body = copy.copy(model)  # shares the layers' parameters, not the module table
        body._modules = dict(model._modules)
        setattr(body, attr, replacement)
        return body

    for attr in ("fc", "classifier", "head"):
        layer = getattr(model, attr, None)
        if isinstance(layer, nn.Sequential) and len(layer) and isinstance(layer[-1], nn.Linear):
            body = body_without(attr, nn.Sequential(*list(layer)[:-1]))
            return SplitModel(body, layer[-1], layer[-1].in_features)
        if isinstance(layer, nn.Linear):
            return SplitModel(body_without(attr, nn.Identity()), layer, layer.in_features)
    raise ValueError(f"cannot split a {type(model).__name__}: it has no last linear layer named fc, classifier or head")


def mlp(input_shape, num_classes: int, hidden: int = 128, feature_dim: int = 64) -> SplitModel:
    """Two hidden layers; the default for ``digits``."""
    in_dim = 1
    for d in input_shape:
        in_dim *= d
    features = nn.Sequential(
        nn.Flatten(), nn.Linear(in_dim, hidden), nn.ReLU(), nn.Linear(hidden, feature_dim), nn.ReLU()
    )
    return SplitModel(features, nn.Linear(feature_dim, num_classes), feature_dim)


def cnn(input_shape, num_classes: int, width: int = 32, feature_dim: int = 128) -> SplitModel:
    """A small convolutional net for any image size (global average pooling)."""
    channels = input_shape[0]
    features = nn.Sequential(
        nn.Conv2d(channels, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.BatchNorm2d(2 * width),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(2 * width, feature_dim, 3, padding=1),
        nn.BatchNorm2d(feature_dim),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
    )
    return SplitModel(features, nn.Linear(feature_dim, num_classes), feature_dim)


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


def cifar_resnet(input_shape, num_classes: int, blocks: tuple[int, int, int, int]) -> SplitModel:
    """A ResNet of basic blocks with the CIFAR stem (3x3 conv, stride 1, no
    max-pool), the usual choice for 32x32 images (the papers name ResNet-18/34
    but not the stem: fedaval's reading, docs/reproduction.md); ``blocks`` per stage of 64, 128, 256, 512
    channels; 512-d features."""
    layers: list[nn.Module] = [nn.Conv2d(input_shape[0], 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU()]
    cin = 64
    for (cout, stride), n in zip([(64, 1), (128, 2), (256, 2), (512, 2)], blocks):
        layers += [_BasicBlock(cin, cout, stride)] + [_BasicBlock(cout, cout, 1) for _ in range(n - 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    return SplitModel(nn.Sequential(*layers), nn.Linear(512, num_classes), 512)


def resnet18(input_shape, num_classes: int) -> SplitModel:
    """ResNet-18 (2, 2, 2, 2 blocks) with the CIFAR stem: GLDP's and FedProK's backbone."""
    return cifar_resnet(input_shape, num_classes, (2, 2, 2, 2))


def resnet34(input_shape, num_classes: int) -> SplitModel:
    """ResNet-34 (3, 4, 6, 3 blocks) with the CIFAR stem: PFCL's backbone
    (the paper counts 21M weights)."""
    return cifar_resnet(input_shape, num_classes, (3, 4, 6, 3))


MODELS: dict[str, Callable[..., SplitModel]] = {"mlp": mlp, "cnn": cnn, "resnet18": resnet18, "resnet34": resnet34}


def build_model(name: str, input_shape, num_classes: int, registry: dict | None = None) -> SplitModel:
    """Model ``name`` of ``registry`` (a run's ``models``; default: the
    built-in :data:`MODELS`); ``auto`` is ``mlp`` for 8x8 inputs, else ``cnn``."""
    registry = MODELS if registry is None else registry
    if name == "auto":
        name = "mlp" if input_shape[-1] <= 8 else "cnn"
    if name not in registry:
        raise choice_error("model", name, ["auto"] + sorted(registry))
    return registry[name](input_shape, num_classes)
