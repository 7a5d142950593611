"""A funnel of MLP blocks: two wide blocks, a projection down, two narrow blocks, a projection up.

Layers of different shapes want different shardings: on 8 devices in 2 pipeline stages of 4,
the planner runs the first wide block tensor-parallel on a 1-D mesh of 4, and the rest on a
2×2 mesh (the second wide block data-parallel × tensor-parallel, the narrow ones
data-parallel) — each stage gets its own logical mesh:

    autoplan examples/funnel.py --devices 8 --stages 2 --microbatches 2 --cluster cpu --run --check
"""

from __future__ import annotations

import torch
import torch.nn as nn
from mlp import MLPBlock


class Funnel(nn.Module):
    def __init__(self, wide: int, narrow: int) -> None:
        super().__init__()
        self.wide = nn.ModuleList(MLPBlock(wide) for _ in range(2))
        self.down = nn.Linear(wide, narrow)
        self.narrow = nn.ModuleList(MLPBlock(narrow) for _ in range(2))
        self.up = nn.Linear(narrow, wide)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.wide:
            x = block(x)
        x = self.down(x)
        for block in self.narrow:
            x = block(x)
        return self.up(x)


def build(wide: int = 256, narrow: int = 32, batch: int = 64, seq: int = 16,
          device: str | torch.device = "cpu") -> tuple[Funnel, tuple[torch.Tensor]]:
    """A Funnel and its example input ``(batch, seq, wide)`` float32."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Funnel(wide, narrow)
        x = torch.randn(batch, seq, wide)
    return model, (x,)


def loss_fn(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A regression loss toward the input (deterministic, needs no labels)."""
    return ((output - x) ** 2).mean()


model, example_inputs = build()
