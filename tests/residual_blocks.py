"""A stack of residual MLP blocks (an ``nn.ModuleList``) with a mean-squared loss: the
smallest model with repeated blocks that data-parallel plans can shard (FSDP), recompute
(activation checkpointing) and average exactly (a plain mean loss)."""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class ResidualBlocks(nn.Module):
    def __init__(self, features: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Linear(features, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.head = nn.Linear(hidden, features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build(features: int = 16, hidden: int = 32, layers: int = 3, batch: int = 8, seq: int = 4
          ) -> tuple[ResidualBlocks, tuple[torch.Tensor]]:
    torch.manual_seed(0)
    return ResidualBlocks(features, hidden, layers), (torch.randn(batch, seq, features),)


def loss_fn(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((output - x) ** 2).mean()
