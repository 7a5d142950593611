"""The exported fx node of one op, for tests of sharding rules and strategies."""

from __future__ import annotations

import torch
from torch import fx


def op_node(fn, *inputs: torch.Tensor, target: str) -> fx.Node:
    """The first ``call_function`` node whose target names ``target`` in the export of
    ``fn(*inputs)``."""

    class Wrap(torch.nn.Module):
        def forward(self, *xs):
            return fn(*xs)

    ep = torch.export.export(Wrap(), inputs, strict=False)
    return next(n for n in ep.graph.nodes if n.op == "call_function" and target in str(n.target))
