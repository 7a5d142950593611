"""Tiny plain-PyTorch models for the zoo (see :mod:`zoo`): sequence models built on
``nn.TransformerEncoder``, ``nn.MultiheadAttention`` and ``nn.LSTM``, and stand-ins for
torchvision architectures (ResNet, MobileNetV3, ConvNeXt, EfficientNet; torchvision itself is
not installed here) on 8×3×16×16 images with 10 classes. Inputs are ``(x, labels)`` tuples; each
model's ``forward(x, labels)`` returns logits and ``loss_fn(logits, x, labels)`` is the
cross-entropy."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from zoo import BATCH, SEQ, VOCAB, ZooCase  # import this module through zoo

HIDDEN, HEADS, CLASSES = 64, 4, 10


class Supervised(nn.Module):
    """``net`` called on ``x``; the labels are the loss's (an input the model passes by)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def cross_entropy(logits: torch.Tensor, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def _case(name: str, build: Callable[[], nn.Module], x: torch.Tensor, labels: torch.Tensor) -> ZooCase:
    torch.manual_seed(0)
    return ZooCase(name, "plain", Supervised(build()), (x, labels), cross_entropy)


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token labels."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _images() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1)), torch.arange(BATCH) % CLASSES


class TransformerLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, HIDDEN))
        layer = nn.TransformerEncoderLayer(HIDDEN, HEADS, 2 * HIDDEN, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        return self.head(self.encoder(self.embed(ids) + self.pos, mask=mask, is_causal=True))


class AttentionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(HIDDEN), nn.LayerNorm(HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class AttentionLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.Sequential(AttentionBlock(), AttentionBlock())
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.lstm = nn.LSTM(HIDDEN, HIDDEN, num_layers=2, batch_first=True)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(self.embed(ids))[0])


def conv_bn(c_in: int, c_out: int, k: int = 3, stride: int = 1, groups: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]


class ResidualBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*conv_bn(c_in, c_out, 3, stride), nn.ReLU(), *conv_bn(c_out, c_out))
        self.shortcut = nn.Sequential(*conv_bn(c_in, c_out, 1, stride)) if stride > 1 or c_in != c_out else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.shortcut(x))


def head(channels: int) -> list[nn.Module]:
    return [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, CLASSES)]


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeezed: int, gate: type[nn.Module]) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act, self.gate = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1), nn.ReLU(), gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate(self.fc2(self.act(self.fc1(F.adaptive_avg_pool2d(x, 1)))))


class InvertedResidual(nn.Module):
    """MobileNetV3 / EfficientNet (MBConv) block: expand 1x1, depthwise kxk, squeeze-excitation, project."""

    def __init__(self, c_in: int, c_out: int, expand: int, stride: int, act: type[nn.Module], gate: type[nn.Module]) -> None:
        super().__init__()
        mid = c_in * expand
        self.residual = stride == 1 and c_in == c_out
        self.body = nn.Sequential(*conv_bn(c_in, mid, 1), act(), *conv_bn(mid, mid, 3, stride, groups=mid), act(),
                                  SqueezeExcite(mid, max(4, mid // 4), gate), *conv_bn(mid, c_out, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x) if self.residual else self.body(x)


class ConvNeXtBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.dwconv = nn.Conv2d(dim, dim, 7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim)
        self.pwconv1, self.act, self.pwconv2 = nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)
        self.gamma = nn.Parameter(1e-6 * torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.dwconv(x).permute(0, 2, 3, 1)
        y = self.gamma * self.pwconv2(self.act(self.pwconv1(self.norm(y))))
        return x + y.permute(0, 3, 1, 2)


def resnet() -> nn.Module:
    return nn.Sequential(*conv_bn(3, 16), nn.ReLU(), ResidualBlock(16, 16, 1), ResidualBlock(16, 32, 2), *head(32))


def mobilenet() -> nn.Module:
    return nn.Sequential(*conv_bn(3, 16, 3, 2), nn.Hardswish(),
                         InvertedResidual(16, 16, 2, 1, nn.ReLU, nn.Hardsigmoid),
                         InvertedResidual(16, 24, 3, 2, nn.Hardswish, nn.Hardsigmoid),
                         *conv_bn(24, 64, 1), nn.Hardswish(), *head(64))


def convnext() -> nn.Module:
    stem = [nn.Conv2d(3, 32, 4, 4), nn.GroupNorm(1, 32)]  # patchify stem; channels-first norm
    return nn.Sequential(*stem, ConvNeXtBlock(32), ConvNeXtBlock(32), *head(32))


def efficientnet() -> nn.Module:
    return nn.Sequential(*conv_bn(3, 16, 3, 2), nn.SiLU(),
                         InvertedResidual(16, 16, 1, 1, nn.SiLU, nn.Sigmoid),
                         InvertedResidual(16, 24, 4, 2, nn.SiLU, nn.Sigmoid),
                         *conv_bn(24, 64, 1), nn.SiLU(), *head(64))


TORCH_CASES: dict[str, Callable[[], ZooCase]] = {
    "torch_transformer": lambda: _case("torch_transformer", TransformerLM, *_tokens()),
    "torch_mha": lambda: _case("torch_mha", AttentionLM, *_tokens()),
    "torch_lstm": lambda: _case("torch_lstm", LSTMLM, *_tokens()),
    "resnet": lambda: _case("resnet", resnet, *_images()),
    "mobilenet_v3": lambda: _case("mobilenet_v3", mobilenet, *_images()),
    "convnext": lambda: _case("convnext", convnext, *_images()),
    "efficientnet": lambda: _case("efficientnet", efficientnet, *_images()),
}
