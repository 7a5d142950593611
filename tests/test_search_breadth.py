"""The stage search's breadth: ranges that fit only with every layer recomputed and trimmed,
microbatch counts that fill a pipeline, and the interleaved schedule searched beside 1F1B."""

from __future__ import annotations

from dataclasses import replace

import gpt
import pytest

from autoplan.cost_models import collective_time
from autoplan.load import make_model_spec
from autoplan.planner.api import make_options
from autoplan.planner.mesh_plan import plan_intra_op
from autoplan.planner.pipeline import (PipelineOptions, RangeTable, layer_costs, pipeline_time, ranks_time)
from autoplan.planner.pipeline.range_costs import FAST, LEAN, cut_bytes, link_between_stages, whole_crossings
from autoplan.planner.pipeline.search import (INTERLEAVED_RIVALS, PIPELINE_FILL, filling_counts,
    interleaved_tasks, search_pipelines, whole_sends)
from autoplan.planner.pins import PinSet
from autoplan.planner.recompute import RecomputeMode, RecomputePolicy, regions
from autoplan.solvers import evaluate
from autoplan.solvers.inter_op import SubMesh
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import find_classes
from autoplan.trace.subgraph import extract
from autoplan.trace.tracer import trace


@pytest.fixture(scope="module")
def gpt_layers():
    model, inputs = gpt.build(hidden=256, layers=4, heads=4, seq=64, vocab=512, batch=8, device="meta")
    graph = trace(make_model_spec(model, inputs, gpt.loss_fn, name="gpt"))
    return graph, make_layers(graph, find_classes(graph))


@pytest.mark.parametrize("mesh", [(4,), (2, 2)])
def test_a_recomputed_problem_starts_at_the_fastest_plan_recomputed(gpt_layers, mesh) -> None:
    """Trimming a recomputed layer starts from its fastest plan's strategies, costed with the
    recomputation in the problem: exactly what recomputing that plan adds and frees
    (:meth:`LayerCosts.recomputed`), in either mode; from the fastest plan with gathered storage
    it starts no slower than that problem's fastest choices allow."""
    graph, layers = gpt_layers
    costs = layer_costs(make_options(4, "h100"), mesh, 4, 2)
    block = layers[1]
    for mode in RecomputeMode:
        problem, start = costs.recomputed_problem(graph, block, mode, FAST)
        seconds, memory = evaluate(problem, start)
        expected = costs.recomputed(graph, block, mode)
        assert seconds == pytest.approx(expected[0], rel=1e-9)
        assert memory == pytest.approx(expected[1], rel=1e-9)
        lean_problem, lean_start = costs.recomputed_problem(graph, block, mode, LEAN)
        assert lean_problem.num_groups == problem.num_groups
        assert evaluate(lean_problem, lean_start)[1] > 0


def test_every_layer_recomputed_and_trimmed_fits_and_is_never_below_its_own_ilp(gpt_layers) -> None:
    """Where recomputing every layer of a range does not fit, the layers' recomputed problems
    are trimmed together: the answer recomputes every layer, fits the room it was given, and
    is never estimated below the range's own ILP with those layers recomputed under the same
    budget (the trimmed layers together are one of the plans that ILP weighs)."""
    graph, layers = gpt_layers
    mesh = (2, 2)
    costs = layer_costs(make_options(4, "h100"), mesh, 4, 2)
    table = RangeTable(graph, layers, costs, False, policy=RecomputePolicy.AUTO)
    start, end = 1, len(layers) - 1
    every = list(range(start, end))
    recomputed = table._recomputed(start, end, None, every=True, mode=RecomputeMode.FULL)
    sub = extract(graph, [name for layer in layers[start:end] for name in layer.nodes])
    ctx = replace(costs.ctx, recompute_regions=regions(layers[start:end]))
    steps = table._recompute_steps(RecomputeMode.FULL)
    checked = 0
    for share in (0.6, 0.5):
        budget = recomputed.memory * share
        transient = table._transient_bound(start, end, RecomputeMode.FULL, frozenset(), every)
        room = budget - transient
        applied = {i: (RecomputeMode.FULL, steps[i][0], steps[i][1]) for i in every}
        plan = table._recomputed_trimmed(start, end, room, applied)
        if plan is None:
            continue
        checked += 1
        assert plan.recomputed == frozenset(every) and not plan.selective
        assert plan.memory <= room
        exact = plan_intra_op(sub, find_classes(sub), mesh, ctx, budget).solution.objective
        assert exact <= plan.seconds * (1 + 1e-9)
    assert checked


def test_an_interleaved_ranks_time_counts_its_work_as_two_chunks() -> None:
    """The stage search's stages are pipeline ranks; interleaved, each rank's work is two equal
    chunks, so its bubble is a chunk's: ``B·max t + (D − 1)·max t / 2``."""
    latencies, microbatches = [1.0, 2.0, 1.5], 8
    assert ranks_time(latencies, microbatches, "1f1b") == pipeline_time(latencies, microbatches, "1f1b")
    chunks = [0.5, 1.0, 0.75, 0.5, 1.0, 0.75]
    interleaved = ranks_time(latencies, microbatches, "interleaved1f1b")
    assert interleaved == pytest.approx(pipeline_time(chunks, microbatches, "interleaved1f1b"))
    assert interleaved == pytest.approx(microbatches * 2.0 + 2 * 1.0)
    assert interleaved < ranks_time(latencies, microbatches, "1f1b")


@pytest.mark.parametrize("batch, expected", [(64, {8: {2}}), (48, {8: {2}, 16: {4}})])
def test_a_pipeline_is_also_searched_with_microbatches_that_fill_it(batch: int, expected) -> None:
    """Beside the largest counts, a pipeline of S stages is searched with the fewest
    microbatches of at least 4·S that divide the batch (none where the batch is smaller)."""
    options = make_options(16, "h100")
    searched = [c for c in (batch, batch // 2, batch // 4) if c <= batch] + [1]
    found = filling_counts(batch, options, PipelineOptions(), 32, searched)
    assert found == expected
    for count, depths in found.items():
        assert batch % count == 0 and count not in searched
        assert all(count >= PIPELINE_FILL * stages for stages in depths)
    assert filling_counts(batch, options, PipelineOptions(microbatches=4), 32, searched) == {}


def test_the_best_1f1b_pipelines_are_searched_interleaved_too() -> None:
    """Where no schedule is pinned, the best 1F1B pipelines of several stages on one logical
    mesh are searched again interleaved; a pinned schedule is the only one searched, and stage
    pins leave no interleaved rivals."""
    model, inputs = gpt.build(hidden=64, layers=8, heads=4, seq=32, vocab=256, batch=8, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name="gpt")
    options = make_options(4, "h100")
    candidates, _ = search_pipelines(spec, options, PipelineOptions())
    interleaved = [c for c in candidates if c.schedule == "interleaved1f1b"]
    assert 0 < len({(c.microbatches, c.submesh, c.meshes[0]) for c in interleaved}) <= INTERLEAVED_RIVALS
    for c in interleaved:
        assert len(c.cuts) >= 2 and len(set(c.meshes)) == 1
        rival = [o for o in candidates if o.schedule == "1f1b" and
                 (o.microbatches, o.submesh, o.meshes[0]) == (c.microbatches, c.submesh, c.meshes[0])]
        assert rival  # searched again from a 1F1B pipeline of the same shape
    pinned, _ = search_pipelines(spec, options, PipelineOptions(schedule="1f1b"))
    assert {c.schedule for c in pinned} == {"1f1b"}
    assert interleaved_tasks(pinned, options, PipelineOptions())  # the 1F1B pipelines have rivals
    # stage pins place layers in stages; interleaved chunks are cut evenly, so none is searched
    staged = replace(options, pins=PinSet.read(["h.0=stage:0"]))
    assert interleaved_tasks(pinned, staged, PipelineOptions()) == []


def test_sends_between_stages_on_different_meshes_are_costed_whole(gpt_layers) -> None:
    """The stage DP costs a stage's send as shards of its own mesh; where the next stage sits on
    another logical mesh the values cross whole (as the exact plan sends them), and the
    candidate's latencies are corrected by the difference: more for the stage before the
    switch, nothing for a pipeline on one mesh."""
    graph, layers = gpt_layers
    options = make_options(8, "h100")
    link = link_between_stages(options, SubMesh(1, 4))
    below = 0.0  # (the tiny model's values are all below whole_below(options): all would cross whole)
    cuts = [(0, 2), (2, len(layers))]
    boundary = {mesh: cut_bytes(graph, layers, mesh, below=below) for mesh in [(2, 2), (4,)]}
    same = whole_sends(graph, layers, cuts, [(2, 2), (2, 2)], [1.0, 1.0], boundary, link, below)
    assert same == [1.0, 1.0]
    mixed = whole_sends(graph, layers, cuts, [(2, 2), (4,)], [1.0, 1.0], boundary, link, below)
    whole = cut_bytes(graph, layers, (2, 2), whole_crossings(graph, layers, cuts, [(2, 2), (4,)]), below)[2]
    assert whole > boundary[2, 2][2]  # the crossing value leaves whole, not as a quarter
    assert mixed[1] == 1.0
    assert mixed[0] == pytest.approx(1.0 + 2 * (collective_time("send_recv", whole, 2, link)
                                                - collective_time("send_recv", boundary[2, 2][2], 2, link)))
    assert mixed[0] > 1.0
