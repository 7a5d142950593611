"""The inter-op pass: layers, schedules, the stage search, manual plans and the timeline."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import gpt
import pytest

from autoplan.errors import AutoplanError
from autoplan.sharding import R, S
from autoplan.planner.api import make_options
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import find_classes
from autoplan.load import make_model_spec
from autoplan.planner.manual import cost_manual, parse_manual
from autoplan.planner.pipeline import (
    PipelineOptions,
    activations_in_flight,
    normalize_schedule,
    pipeline_time,
    plan_pipeline,
)
from autoplan.reports.timeline import chrome_trace, simulate, write_timeline
from autoplan.trace.tracer import trace
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def small_gpt():
    model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=32, vocab=256, batch=8, device="meta")
    return make_model_spec(model, inputs, gpt.loss_fn, name="gpt")


def test_layers_follow_the_repeated_blocks(small_gpt) -> None:
    graph = trace(small_gpt)
    layers = make_layers(graph, find_classes(graph))
    assert [layer.name for layer in layers] == ["h.0", "h.1", "h.2", "h.3"]
    assert layers[1].signature == layers[2].signature != layers[0].signature  # embedding joins h.0
    ops = [n for n, info in graph.nodes.items() if info.kind == "op"]
    assert [n for layer in layers for n in layer.nodes] == ops  # contiguous, complete, in order
    merged = make_layers(graph, find_classes(graph), 2)
    assert [layer.name for layer in merged] == ["h.0..h.1", "h.2..h.3"]
    with pytest.raises(AutoplanError, match="--layers 9"):
        make_layers(graph, find_classes(graph), 9)


def test_clustering_balances_flops_without_blocks() -> None:
    import resnet

    model, inputs = resnet.build()
    graph = trace(make_model_spec(model, inputs, resnet.loss_fn))
    layers = make_layers(graph, find_classes(graph), 3)
    assert len(layers) == 3 and all(layer.nodes for layer in layers)
    total = sum(layer.flops for layer in layers)
    assert max(layer.flops for layer in layers) < 0.75 * total


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_simulated_timeline_matches_the_bubble_formula(schedule: str) -> None:
    latencies, microbatches = [1.0, 1.0, 1.0, 1.0], 6
    slots = simulate(latencies, microbatches, schedule)
    assert len(slots) == 2 * len(latencies) * microbatches
    end = max(s.end_s for s in slots)
    assert end == pytest.approx(pipeline_time(latencies, microbatches, schedule))  # (B + S - 1) t
    busy = sum(s.end_s - s.start_s for s in slots)
    bubble = 1 - busy / (end * len(latencies))
    assert bubble == pytest.approx((4 - 1) / (4 - 1 + 6))  # (D-1)/(D-1+N)


def test_schedule_memory_and_names() -> None:
    assert activations_in_flight("gpipe", 16, 4) == 16
    assert activations_in_flight("1f1b", 16, 4) == 4
    # interleaved, 8 ranks of 2 chunks: at most 8 + 14 + 1 = 23 chunk-forwards on a rank, 12 a chunk
    assert activations_in_flight("interleaved1f1b", 32, 16) == 12
    assert activations_in_flight("interleaved1f1b", 4, 16) == 4
    assert normalize_schedule("Interleaved1F1B") == "interleaved1f1b"
    assert normalize_schedule("GPipe") == "gpipe"
    with pytest.raises(AutoplanError, match="unknown schedule"):
        normalize_schedule("zigzag")
    assert pipeline_time([1.0] * 4, 8, "interleaved1f1b") < pipeline_time([2.0] * 2, 8, "1f1b")
    assert pipeline_time([1.0] * 4, 8, "interleavedzerobubble") < pipeline_time([1.0] * 4, 8, "interleaved1f1b")
    assert normalize_schedule("ScheduleInterleavedZeroBubble") == "interleavedzerobubble"


def test_timeline_files(tmp_path: Path) -> None:
    paths = write_timeline([0.5, 0.7], 3, "1f1b", tmp_path)
    trace_json = json.loads(paths[0].read_text())
    events = [e for e in trace_json["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 12 and {e["tid"] for e in events} == {0, 1}
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert chrome_trace(simulate([1.0], 1, "gpipe"))["traceEvents"][1]["dur"] == pytest.approx(1e6 / 3)


def test_pinned_pipeline_on_two_devices(small_gpt) -> None:
    plan = plan_pipeline(small_gpt, make_options(2, "cpu"), PipelineOptions(stages=2, microbatches=4))
    assert len(plan.stages) == 2 and plan.microbatches == 4 and plan.schedule == "1f1b"
    assert [s.devices for s in plan.stages] == [[0], [1]]
    layers = [layer for stage in plan.stages for layer in stage.layers]
    assert layers == ["h.0", "h.1", "h.2", "h.3"]
    between = [c for c in plan.collectives if c.mesh_axis == -1]
    assert {c.kind for c in between} == {"send_recv", "all_reduce", "broadcast"}
    # the tied embedding/head weight lives on both stages: its copies' gradients are summed once a step
    tied = [c for c in between if c.kind == "all_reduce"]
    assert len(tied) == 1 and tied[0].stages == [0, 1] and tied[0].count == 1 and tied[0].tensor == "gradient"
    assert [c.where for c in between if c.kind == "broadcast"] == ["loss -> every rank"]
    assert all(c.stages == [0, 1] for c in between if c.kind == "send_recv")
    assert all(c.stages in ([0], [1]) for c in plan.collectives if c.mesh_axis >= 0)
    assert plan.predicted.bubble_s > 0


def test_manual_plans_are_costed_or_explained(small_gpt) -> None:
    options = make_options(4, "cpu")
    ok = cost_manual(small_gpt, options, parse_manual("dp=2,tp=2"))
    assert ok.predicted is not None and ok.predicted.step_time_s > 0
    piped = cost_manual(small_gpt, options, parse_manual("dp=2,pp=2,microbatches=2"))
    assert piped.predicted is not None
    bad = cost_manual(small_gpt, options, parse_manual("dp=3"))
    assert bad.predicted is None and "infeasible" in bad.reason
    with pytest.raises(AutoplanError, match="write it like"):
        parse_manual("dp2")
    checkpointed = cost_manual(small_gpt, options, parse_manual("dp=2,tp=2,ac=full"))
    assert checkpointed.name.endswith(",ac=full")
    assert checkpointed.predicted.compute_s > ok.predicted.compute_s
    assert checkpointed.predicted.memory_bytes.activations < ok.predicted.memory_bytes.activations
    # selective: the matrix products' outputs kept, the cheap ops recomputed: between the two
    selective = cost_manual(small_gpt, options, parse_manual("dp=2,tp=2,ac=selective"))
    assert selective.name.endswith(",ac=selective")
    assert ok.predicted.compute_s < selective.predicted.compute_s < checkpointed.predicted.compute_s
    assert checkpointed.predicted.memory_bytes.activations < selective.predicted.memory_bytes.activations \
        < ok.predicted.memory_bytes.activations
    # torchtitan's per-op policy: every other matrix product's output kept, between selective and full
    per_op = cost_manual(small_gpt, options, parse_manual("dp=2,tp=2,ac=op"))
    assert per_op.name.endswith(",ac=op")
    assert selective.predicted.compute_s < per_op.predicted.compute_s < checkpointed.predicted.compute_s
    assert checkpointed.predicted.memory_bytes.activations < per_op.predicted.memory_bytes.activations \
        < selective.predicted.memory_bytes.activations
    with pytest.raises(AutoplanError, match="ac=selective.*ac=op"):
        parse_manual("dp=2,ac=some")
    # more stages than the model has layers: one line that names the layers and the fix
    deep = cost_manual(small_gpt, make_options(8, "cpu"), parse_manual("pp=8,microbatches=8"))
    assert deep.predicted is None and "\n" not in deep.reason
    assert "model cuts into 4 (h.0, h.1, h.2, h.3): choose pp=4 or fewer" in deep.reason


def test_cli_shows_manual_plans_and_writes_a_timeline(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "autoplan.cli", str(ROOT / "examples" / "gpt.py"), "--devices", "2",
                             "--cluster", "cpu", "--stages", "2", "--microbatches", "2", "--manual", "dp=2",
                             "--out", str(tmp_path)], capture_output=True, text=True, timeout=backstop(300))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "manual dp=2,tp=1,pp=1,microbatches=1" in result.stdout
    assert (tmp_path / "timeline.json").is_file() and (tmp_path / "timeline.png").is_file()
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert len(plan["stages"]) == 2 and any(a["name"].startswith("manual") for a in plan["alternatives"])


GPT4 = '''
import sys
sys.path.insert(0, {examples!r})
import gpt
model, example_inputs = gpt.build(hidden=32, layers=4, heads=2, seq=16, vocab=64, batch=8)
loss_fn = gpt.loss_fn
'''


def _run_check(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan.cli", *args, "--cluster", "cpu", "--run", "--check",
                           "--steps", "2", "--out", str(cwd / "out")], capture_output=True, text=True,
                          timeout=backstop(600), cwd=cwd)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble"])
def test_every_schedule_passes_check_on_two_processes(schedule: str, tmp_path: Path) -> None:
    model_file = tmp_path / "gpt4.py"
    model_file.write_text(GPT4.format(examples=str(ROOT / "examples")))
    result = _run_check([str(model_file), "--devices", "2", "--stages", "2", "--microbatches", "4", "--schedule",
                         schedule], tmp_path)
    assert result.returncode == 0 and "check: PASSED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["schedule"] == schedule
    assert len(plan["stages"]) == (4 if schedule.startswith("interleaved") else 2)


def test_gpt2_two_stages_by_two_way_sharding_passes_check(tmp_path: Path) -> None:
    result = _run_check([str(ROOT / "examples" / "gpt2.py"), "--devices", "4", "--stages", "2", "--mesh", "2",
                         "--microbatches", "2", "--memory-per-device", "2.9MB", "--recompute", "none"], tmp_path)
    assert result.returncode == 0 and "check: PASSED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert len(plan["stages"]) == 2 and plan["mesh"] == [2]
    assert any("S(" in p for spec in plan["params"].values() for p in spec)  # sharded inside the stages
    # data-parallel gradients are summed in buckets after the schedule: fewer all-reduces run than
    # the plan lists one by one (the check's planned column counts buckets, as they ran)
    for stage, ranks in ((0, (0, 1)), (1, (2, 3))):
        listed = sum(c["count"] for c in plan["collectives"]
                     if c["bucketed"] and c["kind"] == "all_reduce" and c["stages"] == [stage])
        for rank in ranks:
            ran = int(re.search(rf"step, rank {rank} all_reduce +(\d+) +(\d+)", result.stdout).group(2))
            assert listed >= 4 and ran <= 2 < listed, (stage, rank, listed, ran)  # a bucket and the tied weight


def test_boundary_correction_brings_a_range_to_its_own_ilp() -> None:
    """Apart, each layer hands its values on replicated; the boundary correction (the ILP of
    two adjacent layers) lets a stage keep them sharded. On a tensor-parallel mesh the
    correction is a saving, and the corrected sum over three layers is closer to the three
    layers' own ILP than the plain sum, and not below it."""
    from autoplan.cost_models.step_costs import CostContext
    from autoplan.planner.mesh_plan import plan_intra_op
    from autoplan.planner.pipeline import LayerCosts
    from autoplan.planner.pipeline.range_costs import FAST, RangeTable
    from autoplan.trace.subgraph import extract

    model, inputs = gpt.build(hidden=256, layers=4, heads=4, seq=64, vocab=512, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    layers = make_layers(graph, find_classes(graph))
    options = make_options(4, "h100")
    mesh = (4,)
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device, options.optimizer)
    costs = LayerCosts(options, ctx)
    a, b, c = layers[1], layers[2], layers[3]
    apart = sum(costs.cost(graph, layer)[0] for layer in (a, b, c))
    corrected = apart + costs.boundary(graph, a, b) + costs.boundary(graph, b, c)
    sub = extract(graph, [n for layer in (a, b, c) for n in layer.nodes])
    exact = plan_intra_op(sub, find_classes(sub), mesh, ctx, None).solution.objective
    assert costs.boundary(graph, a, b) <= 1e-12
    assert abs(corrected - exact) < abs(apart - exact)
    assert exact <= corrected + 1e-12

    # layers far dearer apart than together (as Llama 3.1 405B's on 128 devices): a correction
    # saves at most half of the two, so a range of them never costs less than nothing
    fresh = LayerCosts(options, ctx)
    fresh.cache.update({(layer.signature, FAST): (10.0, 0.0) for layer in layers})
    assert fresh.boundary(graph, b, c) == pytest.approx(-10.0)
    table = RangeTable(graph, layers, fresh, boundaries=True)
    fastest = [table._range(FAST, start, end)[0] + table.joins[end - 1] - table.joins[start]
               for start in range(len(layers)) for end in range(start + 1, len(layers) + 1)]
    assert min(fastest) >= 0


def test_recomputing_a_layer_inside_a_stage_is_costed_in_its_pairs_plan() -> None:
    """Alone, a Llama block receives its input replicated, and its fastest plan on a mesh across
    nodes computes its first ops on the whole batch before it shards them; recomputing it
    inside a stage, after the block before it, runs the block as the pair's plan runs it: for
    less, and for more than nothing."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from autoplan.cost_models.step_costs import CostContext
    from autoplan.planner.options import PlanOptions
    from autoplan.planner.pipeline import LayerCosts
    from autoplan.planner.recompute import RecomputeMode

    config = LlamaConfig(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=8,
                         intermediate_size=7168, vocab_size=32000, max_position_embeddings=2048)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (64, 2048))
    graph = trace(make_model_spec(model, {"input_ids": ids, "labels": ids}, name="llama"))
    first, second = make_layers(graph, find_classes(graph))[1:3]
    assert first.signature == second.signature  # two decoder blocks
    options = PlanOptions(32, "h100", precision="bf16", plan_only=True).planner_options()
    mesh = (4, 8)
    costs = LayerCosts(options, CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device,
                                            options.optimizer))
    costs.boundary(graph, first, second)
    alone = costs.recompute_seconds(graph, second, RecomputeMode.FULL)
    assert alone == costs.recomputed(graph, second)[0] - costs.cost(graph, second)[0]
    assert 0 < costs.recompute_seconds(graph, second, RecomputeMode.FULL, before=first) < alone


def test_stage_boundaries_are_costed_as_the_pipeline_runs_them() -> None:
    """A value received from the stage before arrives as the program sends it: sharded as
    ``boundary_spec`` lays it out on the stage's mesh, or whole where its way passes a stage on
    another logical mesh; what a stage hands on leaves alike; the model's outputs other than the loss
    leave no stage (a pipelined step returns only the loss)."""
    from dataclasses import replace

    import mlp

    from autoplan.cost_models.step_costs import CostContext
    from autoplan.planner.mesh_plan import plan_intra_op
    from autoplan.trace.subgraph import boundary_values, extract, loss_name

    model, inputs = mlp.build(hidden=256, batch=8, seq=64, device="meta")
    graph = trace(make_model_spec(model, inputs, mlp.loss_fn, name="mlp"))
    ops = [n for n, info in graph.nodes.items() if info.kind == "op"]
    second = ops[1:]  # everything after the first linear
    reads, produced = boundary_values(graph, second)
    assert produced == [loss_name(graph)]  # the model's output (also a graph output) stays inside
    assert ops[0] in reads
    sub = extract(graph, second)
    assert sub.nodes[ops[0]].kind == "activation"
    cluster = make_options(2, "cpu").cluster
    ctx = CostContext((2,), cluster.mesh_links((2,)), cluster.device, make_options(2, "cpu").optimizer)
    result = plan_intra_op(sub, find_classes(sub), (2,), ctx, None)
    assert result.chosen[ops[0]].output_spec == (S(0),)  # [8, 64, 1024]: the batch over the 2 ranks
    whole = replace(sub, whole_values=frozenset([ops[0]]))
    result = plan_intra_op(whole, find_classes(whole), (2,), ctx, None)
    assert result.chosen[ops[0]].output_spec == (R,)
    first = extract(graph, ops[:1])  # hands its output on: it leaves sharded, unless it crosses whole
    output = next(n for n, info in first.nodes.items() if info.kind == "output")
    assert plan_intra_op(first, find_classes(first), (2,), ctx, None).chosen[output].input_specs == ((S(0),),)
    apart = replace(first, whole_values=frozenset([ops[0]]))
    assert plan_intra_op(apart, find_classes(apart), (2,), ctx, None).chosen[output].input_specs == ((R,),)
    # (that the program runs the stages so, the per-rank collective counts of
    # test_gpt2_two_stages_by_two_way_sharding_passes_check show)


def _synthetic_stage_search(model_spec, prefer: dict[int, tuple[int, ...]], monkeypatch):
    """The stage search of a 2-stage pipeline on 8 devices, stages of 4, with layer costs
    replaced: layer i takes 1 s on the mesh ``prefer[i]`` and 2 s on any other."""
    from autoplan.planner.pipeline import range_costs, search
    from autoplan.solvers.inter_op import SubMesh

    graph = trace(model_spec)
    layers = make_layers(graph, find_classes(graph), None)
    index = {layer.signature + layer.name: i for i, layer in enumerate(layers)}

    def cost(self, graph_, layer, mode=range_costs.FAST):
        i = index[layer.signature + layer.name]
        return (1.0 if self.ctx.mesh_shape == prefer[i] else 2.0), 1e7  # bytes: more than any received value

    monkeypatch.setattr(range_costs.LayerCosts, "cost", cost)
    monkeypatch.setattr(range_costs.LayerCosts, "transient", lambda self, graph_, layer, mode=None: 0.0)
    options = make_options(8, "cpu")
    meshes = [(4,), (2, 2)]
    def best(meshes_: list[tuple[int, ...]]):
        found = search.search_submesh(graph, layers, options, PipelineOptions(stages=2), "1f1b", 2,
                                       SubMesh(1, 4), meshes_)
        return min(found, key=lambda c: c.step_time_s)

    return layers, best(meshes), [best([m]) for m in meshes]


def test_each_stage_gets_its_own_logical_mesh(monkeypatch) -> None:
    """Layers that run faster on (4,) and layers that run faster on (2, 2): the search puts
    them in different stages, each on its faster mesh, and beats every one-mesh pipeline."""
    from pipeline_worker import build_mlp, mlp_loss

    model, inputs = build_mlp()
    spec = make_model_spec(model, inputs, mlp_loss, name="mlp")
    layers, found, uniform = _synthetic_stage_search(spec, {0: (4,), 1: (4,), 2: (2, 2), 3: (2, 2)}, monkeypatch)
    assert len(layers) == 4
    assert found.cuts == [(0, 2), (2, 4)] and found.meshes == [(4,), (2, 2)]
    assert all(found.step_time_s < u.step_time_s for u in uniform)


def test_stages_holding_a_tied_weight_share_a_logical_mesh(small_gpt, monkeypatch) -> None:
    """nanoGPT's embedding (first layer) and head (last layer) share a weight: even where the
    two layers would each run faster on another mesh, their stages get one mesh, the faster
    pipeline of the two the shared mesh allows."""
    from autoplan.planner.pipeline import tied_layers

    graph = trace(small_gpt)
    layers = make_layers(graph, find_classes(graph), None)
    tied = tied_layers(graph, layers)
    assert tied == {0, len(layers) - 1}
    prefer = {i: (4,) for i in range(len(layers))}
    prefer[len(layers) - 1] = (2, 2)
    _, found, uniform = _synthetic_stage_search(small_gpt, prefer, monkeypatch)
    assert len(set(found.meshes)) == 1
    assert found.step_time_s == min(u.step_time_s for u in uniform)


def test_a_range_that_only_fits_trimmed_is_costed_within_the_budget() -> None:
    """Where a range's fastest plans do not fit the budget together, each layer is trimmed to
    its share: the range then fits, and is never costed below its own ILP under that budget
    (the trimmed layers together are one of the plans that ILP weighs)."""
    from autoplan.planner.mesh_plan import plan_intra_op
    from autoplan.planner.pipeline import LEAN, layer_costs, RangeTable
    from autoplan.trace.subgraph import extract

    model, inputs = gpt.build(hidden=256, layers=4, heads=4, seq=64, vocab=512, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    layers = make_layers(graph, find_classes(graph))
    table = RangeTable(graph, layers, layer_costs(make_options(4, "h100"), (4,), 1, 1), boundaries=False)
    start, end = 1, len(layers)
    fastest = table.cost(start, end, None)
    least = sum(table.costs.cost(graph, layer, LEAN)[1] for layer in layers[start:end])
    sub = extract(graph, [n for layer in layers[start:end] for n in layer.nodes])
    for budget in (least + (fastest[1] - least) * f for f in (0.25, 0.5, 0.75)):
        seconds, memory = table.cost(start, end, budget)
        exact = plan_intra_op(sub, find_classes(sub), (4,), table.costs.ctx, budget).solution.objective
        assert memory <= budget
        assert exact <= seconds + 1e-12


@pytest.mark.parametrize("boundaries", [False, True])
def test_ranges_of_equal_blocks_share_their_plans(boundaries: bool) -> None:
    """A range of a stack of equal blocks is planned once for every range like it (the same
    layers in order, the same layer before it, the same values received, the same budget):
    every range's shared plan equals its own (:meth:`RangeTable._plan`), its recomputed layers
    moved along, under budgets from none to one that only recomputation and trimming meet,
    for every recomputation policy; and fewer plans are made than ranges asked for."""
    from autoplan.planner.pipeline import layer_costs, RangeTable
    from autoplan.planner.recompute import RecomputePolicy

    model, inputs = gpt.build(hidden=256, layers=6, heads=4, seq=64, vocab=512, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    layers = make_layers(graph, find_classes(graph))
    assert len({layer.signature for layer in layers}) < len(layers) - 2
    costs = layer_costs(make_options(4, "h100"), (2, 2), 4, 2)
    recomputed = 0
    for policy in RecomputePolicy:
        shared = RangeTable(graph, layers, costs, boundaries, policy=policy)
        alone = RangeTable(graph, layers, costs, boundaries, policy=policy)
        whole = shared.cost(0, len(layers), None)[1]
        for budget in [None] + [whole * f for f in (0.1, 0.3, 0.6)]:
            for start in range(len(layers)):
                for end in range(start + 1, len(layers) + 1):
                    got, own = shared.plan(start, end, budget), alone._plan(start, end, budget)
                    assert (got.recomputed, got.selective) == (own.recomputed, own.selective), (policy, start, end)
                    assert got.seconds == pytest.approx(own.seconds, rel=1e-9)
                    assert got.memory == pytest.approx(own.memory, rel=1e-9)
                    recomputed += bool(own.recomputed) and start > 1
        assert len(shared.twins) < len(shared.plans)
    assert recomputed > 0  # shifted plans that recompute layers were compared


@pytest.mark.parametrize("mesh", [(64,), (8, 8)])
def test_no_range_is_estimated_to_fit_in_nothing(mesh) -> None:
    """On a large mesh the bytes that recomputing the fastest plans frees can outweigh a trimmed
    plan's own: where the estimate would fall below nothing it is the training state of the
    range's parameters (parameter, gradient, optimizer state) sharded over every device, so no
    range fits in one byte and none is estimated below zero."""
    from autoplan.planner.pipeline import layer_costs, RangeTable

    model, inputs = gpt.build(hidden=256, layers=4, heads=4, seq=64, vocab=512, batch=64, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    layers = make_layers(graph, find_classes(graph))
    table = RangeTable(graph, layers, layer_costs(make_options(64, "h100"), mesh, 1, 1), boundaries=False)
    per_element = table.costs.ctx.optimizer.bytes_per_param(4)
    state = sum(p.numel() for p in model.parameters()) * per_element / 64
    assert table.state_floor(0, len(layers)) == pytest.approx(state)
    least = table.least_memory(0, len(layers))
    for budget in (1.0, least / 10, least / 2, least):
        seconds, memory = table.cost(0, len(layers), budget)
        assert memory > 0 and seconds > 0
    assert table.cost(0, len(layers), 1.0)[1] >= state


def test_close_pipelines_are_planned_exactly_and_the_fastest_wins(small_gpt, monkeypatch) -> None:
    """With every pipeline of the search close enough to be planned exactly, the plan returned
    is the fastest exact plan, and the others are listed with their exact figures."""
    from autoplan.planner import pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "RERANK_MARGIN", 100.0)  # the REFINED best
    plan = plan_pipeline(small_gpt, make_options(4, "cpu"))
    exact = [a for a in plan.alternatives if a.predicted is not None]
    assert len(exact) >= 2
    assert all("planned exactly" in a.reason for a in exact)
    assert all(plan.predicted.step_time_s <= a.predicted.step_time_s for a in exact)


def test_the_best_whole_batch_is_planned_exactly_where_the_best_accumulates() -> None:
    """The search's estimate of a whole batch recomputing its layers runs high: where the best
    candidate accumulates microbatches on one stage, the best whole-batch candidate on one
    stage is planned exactly beside it, within a margin; a pipeline at the top, or a whole batch
    already among the close ones, or one beyond the margin, adds nothing."""
    from autoplan.planner.pipeline import PipelineCandidate, _whole_batch_rival
    from autoplan.planner.pipeline.exact import WHOLE_BATCH_MARGIN
    from autoplan.solvers.inter_op import SubMesh

    def candidate(microbatches: int, stages: int, seconds: float) -> PipelineCandidate:
        cuts = [(i, i + 1) for i in range(stages)]
        return PipelineCandidate(microbatches, SubMesh(4, 8), [(4, 8)] * stages, cuts, seconds, None, [])

    accumulated, whole, pipeline = candidate(16, 1, 2.5), candidate(1, 1, 2.9), candidate(8, 2, 2.6)
    candidates = [accumulated, pipeline, whole]
    assert _whole_batch_rival(candidates, [accumulated]) == [whole]
    assert _whole_batch_rival(candidates, [accumulated, whole]) == []
    assert _whole_batch_rival([pipeline, accumulated, whole], [pipeline]) == []
    far = candidate(1, 1, 2.5 * (1 + WHOLE_BATCH_MARGIN) * 1.01)
    assert _whole_batch_rival([accumulated, far], [accumulated]) == []


def test_stages_on_their_own_logical_meshes_pass_check(tmp_path: Path) -> None:
    """examples/funnel.py on 8 processes, 2 stages of 4: the planner gives the first stage (a
    wide block, tensor-parallel) a 1-D mesh and the second a 2×2 mesh (data- × tensor-parallel),
    and the emitted program matches the single device and runs the planned collectives."""
    result = _run_check([str(ROOT / "examples" / "funnel.py"), "--devices", "8", "--stages", "2",
                         "--microbatches", "2"], tmp_path)
    assert result.returncode == 0 and "check: PASSED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    assert "stage meshes 4, 2x2" in result.stdout
    # the summary's stage table: layers, devices and logical mesh of each stage
    assert re.search(r"^  0 +wide\.0 +0-3 +4 ", result.stdout, re.M)
    assert re.search(r"^  1 +wide\.1, narrow\.0, narrow\.1 +4-7 +2x2 ", result.stdout, re.M)
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert [s["mesh"] for s in plan["stages"]] == [[4], [2, 2]]
    assert plan["params"]["wide.0.up.weight"] == ["S(0)"]
    assert plan["params"]["wide.1.up.weight"] == ["R", "S(0)"]


def test_a_range_counts_received_values_as_its_own_ilp_does(small_gpt) -> None:
    """Apart, each layer keeps what it receives from an earlier layer; a range keeps only what
    it receives from before it. On one device (one plan per layer) the search's memory of
    every layer range is then the range's own ILP's, byte for byte; before, every boundary
    inside the range counted its activation twice. A weight two layers of the range read (the
    tied embedding and head) is still counted by both: more than the range needs, never less."""
    from autoplan.planner.mesh_plan import plan_intra_op
    from autoplan.planner.pipeline import layer_costs, RangeTable, tied_layers
    from autoplan.trace.subgraph import extract

    graph = trace(small_gpt)
    layers = make_layers(graph, find_classes(graph))
    table = RangeTable(graph, layers, layer_costs(make_options(1, "h100"), (1,), 4, 2), boundaries=False)
    checked = 0
    for start in range(len(layers)):
        for end in range(start + 1, len(layers) + 1):
            sub = extract(graph, [n for layer in layers[start:end] for n in layer.nodes])
            exact = plan_intra_op(sub, find_classes(sub), (1,), table.costs.ctx, None).solution.memory
            kept = table.cost(start, end, None)[1] - table.transient(start, end)  # its peak less its transient
            if tied_layers(graph, layers) <= set(range(start, end)):
                assert kept > exact
            else:
                assert kept == pytest.approx(exact, rel=1e-9), (start, end)
            checked += table.counted_apart(start, end) > 0
    assert checked >= len(layers) - 1  # ranges of two or more layers had something to subtract


@pytest.mark.parametrize("budget", [2.7e6, 2.4e6])
def test_interleaved_stages_share_their_ranks_memory(small_gpt, budget: float) -> None:
    """With the interleaved schedule a pipeline rank holds two stages: together they fit the
    device's memory (each stage alone got all of it before), and the plan's memory is the
    fullest rank's. Without a budget the ranks need more than either budget here."""
    popts = PipelineOptions(stages=2, microbatches=4, schedule="interleaved1f1b")

    def per_rank(plan) -> list[float]:
        return [sum(s.memory_bytes for s in plan.stages[rank::2]) for rank in range(2)]

    free = plan_pipeline(small_gpt, make_options(4, "cpu"), popts)
    assert min(per_rank(free)) > budget
    plan = plan_pipeline(small_gpt, make_options(4, "cpu", memory_per_device=budget), popts)
    assert len(plan.stages) == 4 and all(s.memory_bytes > 0 for s in plan.stages)
    assert max(per_rank(plan)) <= budget
    assert plan.predicted.memory_bytes.peak == pytest.approx(max(per_rank(plan)))

def test_an_interleaved_steps_parts_are_its_busiest_ranks(small_gpt) -> None:
    """Interleaved, a pipeline rank runs two stages: the step's compute and communication are
    that rank's (both of its stages'), and the bubble is what the schedule adds to its work, not
    the second stage's work counted as waiting."""
    from autoplan.planner.pipeline.schedules import busiest_rank, rank_stages

    assert rank_stages(4, "interleaved1f1b") == [[0, 2], [1, 3]] and rank_stages(2, "1f1b") == [[0], [1]]
    assert busiest_rank([1.0, 3.0, 3.5, 1.0], "interleaved1f1b") == [0, 2]
    assert busiest_rank([1.0, 3.0, 2.5, 1.0], "1f1b") == [1]
    popts = PipelineOptions(stages=2, microbatches=4, schedule="interleaved1f1b")
    plan = plan_pipeline(small_gpt, make_options(4, "cpu"), popts)
    p, latencies = plan.predicted, [s.latency_s for s in plan.stages]
    busy = max(sum(latencies[rank::2]) for rank in range(2))
    assert p.bubble_s == pytest.approx(pipeline_time(latencies, 4, "interleaved1f1b") - 4 * busy)
    assert p.bubble_s < p.step_time_s / 2
    assert p.compute_s + p.comm_s + p.bubble_s == pytest.approx(p.step_time_s, rel=1e-6)



def test_a_ranks_memory_is_split_among_its_stages() -> None:
    """Stage s on rank s % 2: each stage gets its least need plus a share of what is left in
    proportion to what its fastest plans need beyond that; a rank's shares add up to the
    budget. One stage per rank: each gets the whole budget."""
    from autoplan.planner.pipeline import split_budget

    least, fast = [1.0, 2.0, 3.0, 2.0], [5.0, 2.0, 5.0, 6.0]
    shares = split_budget(10.0, least, fast, ranks=2)
    assert shares[0] + shares[2] == pytest.approx(10.0) and shares[1] + shares[3] == pytest.approx(10.0)
    assert all(share >= need for share, need in zip(shares, least))
    assert shares[0] == pytest.approx(1.0 + 6.0 * 4.0 / 6.0)  # rank 0: 6 left, needs beyond least 4 and 2
    assert shares[1] == pytest.approx(2.0)  # rank 1: stage 1 needs no more than its least
    assert split_budget(10.0, least, fast, ranks=4) == [10.0] * 4
    assert split_budget(None, least, fast, ranks=2) == [None] * 4


def test_pinned_microbatches_are_kept_with_or_without_a_pipeline() -> None:
    """Pinned microbatches hold whether the search then pipelines or accumulates gradients in
    one stage (tests/test_accumulation.py runs that program); the program is the pipeline one."""
    import mlp

    from autoplan.load import make_model_spec
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.options import PlanOptions

    model, inputs = mlp.build()
    spec = make_model_spec(model, inputs, mlp.loss_fn)
    for options in (PlanOptions(2, "cpu", microbatches=2), PlanOptions(2, "cpu", microbatches=2, stages=1)):
        plan = plan_model(spec, options)
        assert plan.microbatches == 2 and plan.schedule != "none"
    assert len(plan.stages) == 1
