"""A Megatron-style MLP block: ``up`` (Linear h→4h), GELU, ``down`` (Linear 4h→h).

The textbook tensor-parallel case: shard ``up`` by columns and ``down`` by rows, and the block
needs one all-reduce in the forward and one in the backward. ``build(hidden=4096)`` makes the
larger variant; ``device="meta"`` allocates nothing."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLPBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.act = nn.GELU()
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


def build(
    hidden: int = 1024, batch: int = 8, seq: int = 128, device: str | torch.device = "cpu"
) -> tuple[MLPBlock, tuple[torch.Tensor]]:
    """An MLPBlock and its example input ``(batch, seq, hidden)`` float32."""
    torch.manual_seed(0)
    with torch.device(device):
        model = MLPBlock(hidden)
        x = torch.randn(batch, seq, hidden)
    return model, (x,)


def loss_fn(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A regression loss toward the input (deterministic, needs no labels)."""
    return ((output - x) ** 2).mean()


model, example_inputs = build()
