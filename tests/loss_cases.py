"""Small models trained with each loss of ``torch.nn.functional`` people train with, and a
BatchNorm conv net: builders for tests/test_losses.py. Each builder returns ``(model,
example_inputs, loss_fn)`` with its own seed, so every process builds the same model."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8


class TwoLayers(nn.Module):
    """Two linear layers (two pipeline layers); the targets pass through unused."""

    def __init__(self, out: int = 4) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, out)

    def forward(self, x: torch.Tensor, *targets: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def _case(out: int, targets: Callable[[], tuple[torch.Tensor, ...]], loss_fn: Callable[..., torch.Tensor]):
    torch.manual_seed(0)
    model = TwoLayers(out)
    return model, (torch.randn(BATCH, 16), *targets()), loss_fn


def cross_entropy():
    """ignore_index (three ignored targets, unevenly spread) and label smoothing: a mean over
    a count that depends on the targets."""
    labels = torch.tensor([0, 1, -100, 3, -100, -100, 2, 1])
    return _case(5, lambda: (labels,),
                 lambda out, x, y: F.cross_entropy(out, y, ignore_index=-100, label_smoothing=0.1))


def nll():
    """ignore_index's default (-100): one target of the first half ignored, two of the second."""
    labels = torch.tensor([4, -100, 0, 3, -100, -100, 0, 1])
    return _case(5, lambda: (labels,), lambda out, x, y: F.nll_loss(F.log_softmax(out, -1), y))


def mse():
    return _case(4, lambda: (torch.randn(BATCH, 4),), lambda out, x, y: F.mse_loss(out, y))


def l1():
    return _case(4, lambda: (torch.randn(BATCH, 4),), lambda out, x, y: F.l1_loss(out, y))


def smooth_l1():
    return _case(4, lambda: (torch.randn(BATCH, 4),), lambda out, x, y: F.smooth_l1_loss(out, y, beta=0.5))


def huber():
    return _case(4, lambda: (torch.randn(BATCH, 4),), lambda out, x, y: F.huber_loss(out, y, delta=0.5))


def bce_with_logits():
    return _case(4, lambda: (torch.rand(BATCH, 4),), lambda out, x, y: F.binary_cross_entropy_with_logits(out, y))


def kl_div():
    return _case(4, lambda: (torch.softmax(torch.randn(BATCH, 4), -1),),
                 lambda out, x, y: F.kl_div(F.log_softmax(out, -1), y, reduction="batchmean"))


def cosine_embedding():
    return _case(4, lambda: (torch.randn(BATCH, 4), torch.tensor([1, -1] * (BATCH // 2))),
                 lambda out, x, y, sign: F.cosine_embedding_loss(out, y, sign))


LOSSES = ("cross_entropy", "nll", "mse", "l1", "smooth_l1", "huber", "bce_with_logits", "kl_div", "cosine_embedding")


class ConvBatchNorm(nn.Module):
    """A residual conv block with BatchNorm (training mode: statistics over the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1, bias=False)  # BatchNorm follows: no bias, as in ResNets
        self.norm = nn.BatchNorm2d(8)
        self.conv = nn.Conv2d(8, 8, 3, padding=1, bias=False)
        self.norm2 = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm(self.stem(images)))
        h = torch.relu(h + self.norm2(self.conv(h)))
        return self.head(h.mean((2, 3)))


def batch_norm():
    torch.manual_seed(0)
    return (ConvBatchNorm(), (torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))),
            lambda out, images, labels: F.cross_entropy(out, labels))
