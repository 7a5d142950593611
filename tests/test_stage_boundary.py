"""How values cross pipeline stage boundaries: as shards between stages of one logical mesh
(:func:`autoplan.sharding.boundary_spec`), whole on a way that passes a stage on another; what
each rank sends."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import gpt
import pytest

from autoplan.load import make_model_spec
from autoplan.sharding import R, S, boundary_shards, boundary_spec


@pytest.fixture(scope="module")
def small_gpt():
    from autoplan.trace.layers import make_layers
    from autoplan.trace.repeated import find_classes
    from autoplan.trace.tracer import trace

    model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=32, vocab=256, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    return graph, make_layers(graph, find_classes(graph))


@pytest.mark.parametrize("shape, mesh, spec", [
    ((8, 8192, 16384), (8, 8), (S(0), S(1))),  # the residual stream: batch and sequence
    ((1, 8192, 16384), (8, 8), (S(1), S(2))),  # one sequence per microbatch
    ((8, 1, 8192, 8192), (8, 8), (S(0), S(2))),  # a mask's broadcast dim is left alone
    ((6, 10), (4,), (R,)),  # no dim divides evenly
    ((4, 6), (1, 2), (R, S(0))),  # an axis of one device shards nothing
    ((), (2, 2), (R, R)),  # a scalar
])
def test_each_axis_shards_the_first_dim_it_divides(shape, mesh, spec) -> None:
    assert boundary_spec(shape, mesh) == spec
    assert boundary_shards(shape, mesh) == (mesh[0] if spec[0] != R else 1) * (
        mesh[1] if len(mesh) > 1 and spec[1] != R else 1)


def test_values_whose_way_passes_another_logical_mesh_cross_whole(small_gpt) -> None:
    """Three stages, the last on another logical mesh: what the last reads crosses whole on
    its whole way (the targets from the first stage on), what only the second reads crosses as
    shards."""
    from autoplan.planner.pipeline.range_costs import layer_index, whole_crossings

    graph, layers = small_gpt
    cuts, meshes = [(0, 2), (2, 3), (3, len(layers))], [(4,), (4,), (2, 2)]
    whole = whole_crossings(graph, layers, cuts, meshes)
    assert "targets" in whole and "idx" not in whole  # the loss reads the targets; idx only the embedding
    layer_of = layer_index(layers)
    crossing = {name for name, i in layer_of.items() if 0 <= i < 2 and any(
        layer_of.get(u.name, -1) == 2 for u in graph.fx_nodes[name].users)}
    third = {name for name, i in layer_of.items() if i < 3 and any(
        layer_of.get(u.name, -1) >= 3 for u in graph.fx_nodes[name].users)}
    assert crossing - third and not (crossing - third) & whole  # read in the second stage only: shards
    assert third and third <= whole
    assert whole_crossings(graph, layers, cuts, [(4,)] * 3) == frozenset()


def test_each_rank_sends_its_shard_of_every_cut(small_gpt) -> None:
    """The bytes a stage sends per rank are its shards of the values crossing the cut: half of
    them on a mesh of two, all of them to a stage on another logical mesh; what a layer receives
    from another layer is counted the same way."""
    from autoplan.planner.pipeline.range_costs import cut_bytes, layer_inputs

    graph, layers = small_gpt
    whole = cut_bytes(graph, layers)
    assert all(b > 0 for b in whole[1:-1])
    assert cut_bytes(graph, layers, (2,))[:-1] == pytest.approx([b / 2 for b in whole[:-1]])  # (the last: the loss)
    assert cut_bytes(graph, layers, (2,), frozenset(graph.nodes)) == pytest.approx(whole)
    halves = layer_inputs(graph, layers, mesh_shape=(2,))
    for mine, all_of_it in zip(halves, layer_inputs(graph, layers)):
        assert mine.keys() == all_of_it.keys()
        assert all(mine[k][1] == pytest.approx(all_of_it[k][1] / 2) for k in mine)


def test_values_smaller_than_a_latency_of_transfer_cross_whole(small_gpt) -> None:
    """A value the link between stages moves in less than its latency crosses whole: sharding it
    would save less than a latency and may cost the next stage an all-gather."""
    from autoplan.planner.api import make_options
    from autoplan.planner.pipeline.range_costs import cut_bytes, layer_inputs, whole_below

    graph, layers = small_gpt
    h100 = make_options(8, "h100").cluster.intra_node
    assert whole_below(make_options(8, "h100")) == pytest.approx(h100.latency * h100.bandwidth)
    whole = cut_bytes(graph, layers)
    assert cut_bytes(graph, layers, (2,), below=1e12) == pytest.approx(whole)
    assert cut_bytes(graph, layers, (2,), below=0.0)[1] == pytest.approx(whole[1] / 2)
    assert layer_inputs(graph, layers, mesh_shape=(2,), below=1e12) == layer_inputs(graph, layers)


def test_a_pipeline_plan_records_what_crosses_whole() -> None:
    """The plan names the values that cross whole, so the program needs no rule of its own:
    the small ones of a small model (all of them on the cpu preset); a plan written before the
    field reads as none."""
    from autoplan.plan_schema import Plan
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.options import PlanOptions

    model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=32, vocab=256, batch=8, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name="gpt")
    plan = plan_model(spec, PlanOptions(4, "cpu", stages=2, microbatches=2, plan_only=True))
    assert len(plan.stages) == 2 and plan.crossing_whole
    sends = [c for c in plan.collectives if c.kind == "send_recv"]
    assert sends and "targets" in plan.crossing_whole
    data = plan.to_dict()
    assert Plan.from_dict(data).crossing_whole == plan.crossing_whole
    del data["crossing_whole"]
    assert Plan.from_dict(data).crossing_whole == []


def test_a_rotary_table_crosses_whole_and_is_not_gathered_again() -> None:
    """Hugging Face Llama computes its rotary ``cos`` and ``sin`` once, before the blocks, from
    positions alone: the same for every sample (``batch_free``; a mask expanded to the batch is
    not). Every block of a later stage reads them beside its batch shards, so they cross whole;
    sharded on the sequence, as their shape alone would have them, the next stage gathered them
    in every block (Llama-7B's shape under ``--manual pp=2,fsdp=4``: 64 all-gathers a step)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoplan.planner.front_door import with_decisions
    from autoplan.planner.manual import parse_manual, plan_manual
    from autoplan.planner.options import PlanOptions
    from autoplan.trace.microbatch import microbatch_inputs
    from autoplan.trace.tracer import trace

    config = LlamaConfig(hidden_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         intermediate_size=1024, vocab_size=256, max_position_embeddings=4096)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 256, (4, 4096))
    spec = make_model_spec(model, {"input_ids": ids, "labels": ids}, None, name="llama")
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, 2)))
    tables = [name for name, info in graph.nodes.items() if info.batch_free and info.shape == (1, 4096, 128)]
    assert len(tables) >= 2, tables  # cos and sin (after their casts too)
    assert not any(info.batch_free for info in graph.nodes.values() if info.shape and info.shape[0] == 2)
    options = PlanOptions(4, "h100", plan_only=True)
    plan = with_decisions(plan_manual(spec, options.planner_options(), parse_manual("pp=2,fsdp=2,microbatches=2")),
                          options)
    assert len(plan.stages) == 2 and set(tables) & set(plan.crossing_whole)
    gathered = [c.where for c in plan.collectives if c.kind == "all_gather" and c.tensor == "activation"]
    assert not gathered, gathered
