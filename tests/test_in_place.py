"""An op that writes into its first input (``copy_`` into a slice, ``fill_``, ``masked_fill_``:
transformers' ``shift_right``) reads that input in its producer's placement and returns it so,
whatever else the plan shards: redistributed, the write would land on a copy."""

from __future__ import annotations

import torch

from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.mesh_plan import writes_first_input
from autoplan.planner.options import PlanOptions
from autoplan.trace.tracer import trace


class ShiftRight(torch.nn.Module):
    """Decoder inputs built as T5 builds them, then a data-parallel-friendly MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == -100, 0)
        return self.mlp(self.embed(shifted))


def test_writes_first_input_knows_in_place_ops() -> None:
    graph = trace(make_model_spec(ShiftRight(), (torch.randint(0, 64, (16, 8)),),
                                  lambda out, ids: out.float().pow(2).mean()))
    writers = sorted(str(n.target) for n in graph.graph_module.graph.nodes if writes_first_input(n))
    assert writers == ["aten.copy_.default", "aten.fill_.Tensor", "aten.masked_fill_.Scalar"]


def test_in_place_op_keeps_its_producers_placement() -> None:
    spec = make_model_spec(ShiftRight(), (torch.randint(0, 64, (64, 8)),),
                           lambda out, ids: out.float().pow(2).mean())
    # the search's own plan (a native rival runs the model itself, whatever its nodes' placements)
    plan = plan_model(spec, PlanOptions(2, "cpu", pipeline=False, native_rivals=False))
    graph = trace(spec)
    placed = {node.name: node for node in plan.nodes}
    assert any(p != ["R"] for node in plan.nodes for p in node.outputs), "the plan should shard something"
    checked = 0
    for node in graph.graph_module.graph.nodes:
        if not writes_first_input(node):
            continue
        producer = node.args[0].name
        assert placed[node.name].inputs[0] == placed[producer].outputs[0], node.name
        assert placed[node.name].outputs[0] == placed[node.name].inputs[0], node.name
        checked += 1
    assert checked == 3


class CopyThenUse(torch.nn.Module):
    """An in-place op whose result a single-input op reads (it follows the in-place op, which
    itself then follows its producer): the grouping composes the two."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buffer = x.new_zeros(x.shape)
        written = buffer.copy_(self.lin(x))
        return torch.tanh(written)


def test_followers_of_an_in_place_op_follow_its_producer_too() -> None:
    spec = make_model_spec(CopyThenUse(), (torch.randn(32, 16),), lambda out, x: out.pow(2).mean())
    plan = plan_model(spec, PlanOptions(2, "cpu", pipeline=False))
    placed = {node.name: node for node in plan.nodes}
    assert placed["copy_"].inputs[0] == placed["new_zeros"].outputs[0]
    assert placed["tanh"].inputs[0] == placed["copy_"].outputs[0]
