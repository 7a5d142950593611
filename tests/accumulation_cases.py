"""A model whose activations outweigh its weights (a long batch through a narrow MLP), for the
gradient-accumulation tests: ``build()`` returns ``(model, example_inputs, loss_fn)`` with its
own seed, so every process builds the same model."""

from __future__ import annotations

import torch
from torch import nn


class Narrow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


def loss_fn(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((output - x) ** 2).mean()


def build() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    torch.manual_seed(0)
    return Narrow(), (torch.randn(16, 512, 32),), loss_fn
