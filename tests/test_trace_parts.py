"""The tracer's parts: tensor leaves of model outputs, per-node FLOPs and bytes, and warnings
that must reach the user."""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from torch import fx

from autoplan.load import make_model_spec
from autoplan.trace.node_costs import FlopCountWarning, node_bytes, node_flops
from autoplan.trace.tracer import trace
from autoplan.trace.values import tensor_leaves

aten = torch.ops.aten


@dataclasses.dataclass
class _Output:
    logits: torch.Tensor
    extra: object


def test_tensor_leaves_walks_tuples_dicts_and_dataclasses() -> None:
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    output = {"first": a, "none": None, "rest": (b, [c, 7]), "out": _Output(d, "text")}
    assert [t.item() for t in tensor_leaves(output)] == [0.0, 1.0, 2.0, 3.0]
    assert list(tensor_leaves(3)) == []


def _linear_node(weight_val: object) -> fx.Node:
    """A lone ``aten.linear`` node with fake values x: [4, 8], weight: ``weight_val``."""
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    x.meta["val"] = torch.empty(4, 8, device="meta")
    w.meta["val"] = weight_val
    node = graph.call_function(aten.linear.default, (x, w))
    node.meta["val"] = torch.empty(4, 16, device="meta")
    return node


def test_linear_flops_and_bytes() -> None:
    node = _linear_node(torch.empty(16, 8, device="meta"))
    assert node_flops(node) == 2 * 4 * 16 * 8
    assert node_bytes(node) == 4 * (4 * 8 + 16 * 8 + 4 * 16)


def test_a_failing_flop_formula_warns_and_counts_zero() -> None:
    node = _linear_node(None)  # no fake value for the weight: the formula cannot read its shape
    with pytest.warns(FlopCountWarning) as caught:
        assert node_flops(node) == 0.0
    (message,) = [str(w.message) for w in caught]
    assert "aten.linear.default" in message and "counted as 0" in message and "\n" not in message


def test_ops_without_a_formula_count_zero_silently() -> None:
    graph = fx.Graph()
    x = graph.placeholder("x")
    x.meta["val"] = torch.empty(4, 8, device="meta")
    node = graph.call_function(aten.gelu.default, (x,))
    node.meta["val"] = torch.empty(4, 8, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert node_flops(node) == 0.0


class _Chatty(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        warnings.warn("this model warns while it runs", UserWarning)
        return self.lin(x)


def test_warnings_raised_while_tracing_reach_the_caller() -> None:
    with pytest.warns(UserWarning, match="this model warns while it runs"):
        tg = trace(make_model_spec(_Chatty(), torch.randn(2, 4)))
    assert any(n.target == "aten.linear.default" for n in tg.nodes.values())
