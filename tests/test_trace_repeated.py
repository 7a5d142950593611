"""Repeated blocks: copies of a block are found and their nodes paired in order."""

from __future__ import annotations

import torch

from autoplan.load import make_model_spec
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import block_of, find_classes
from autoplan.trace.tracer import trace


class _Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.cat([x, -x], dim=-1))  # a list of nodes among the arguments


class _Stack(torch.nn.Module):
    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_block_of_names_the_repeated_prefix() -> None:
    assert block_of("transformer.h.3.attn.c_attn") == ("transformer.h", 3)
    assert block_of("lm_head") is None


def test_blocks_whose_ops_take_lists_of_nodes_are_found() -> None:
    tg = trace(make_model_spec(_Stack(), torch.randn(4, 8)))
    classes = find_classes(tg)
    assert classes.blocks == ["blocks.0", "blocks.1", "blocks.2"]
    cats = [n.name for n in tg.nodes.values() if n.target == "aten.cat.default"]
    assert len(cats) == 3 and len({classes.class_of[c] for c in cats}) == 1
    linears = [n for n in tg.nodes.values() if n.target == "aten.linear.default"]
    assert len({classes.class_of[n.name] for n in linears}) == 1
    # corresponding weights are one class; the representative is block 0's
    weights = [name for name, fqn in tg.param_names.items() if fqn.endswith("lin.weight")]
    (cls,) = {classes.class_of[w] for w in weights}
    assert tg.param_names[classes.representative(cls)] == "blocks.0.lin.weight"
    assert [layer.name for layer in make_layers(tg, classes)] == ["blocks.0", "blocks.1", "blocks.2"]


def test_blocks_that_differ_are_not_paired() -> None:
    model = _Stack()
    model.blocks[1].lin = torch.nn.Linear(16, 8, bias=False)  # one copy lacks the bias
    tg = trace(make_model_spec(model, torch.randn(4, 8)))
    classes = find_classes(tg)
    assert classes.blocks == ["blocks.0", "blocks.1", "blocks.2"]  # blocks 0 and 2 still pair
    linears = [n.name for n in tg.nodes.values() if n.target == "aten.linear.default"]
    assert classes.class_of[linears[0]] == classes.class_of[linears[2]] != classes.class_of[linears[1]]
