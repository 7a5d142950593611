"""A pipelined plan run with torch.distributed.pipelining equals the single device.

Three launches (gloo, CPU): 2 processes (2 stages or 4 virtual stages, stage mesh (1,)),
3 processes (3 stages, the tied nanoGPT embedding/head on the first and last rank only) and
4 processes (2 pipeline ranks × stage mesh (2,), parameters sharded inside each stage), each
running every case of its world size in tests/pipeline_worker.py. Every case compares the
global-batch loss and every gradient with the single-device model's (fp32, rtol 1e-4); some run
a second step and check that the gradients accumulate.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launcher import launch_worker, on_every_rank
from pipeline_worker import CASES, MODELS, STAGE_MESHES, split_plan

WORKER = Path(__file__).resolve().parent / "pipeline_worker.py"
WORLDS = sorted({case[0] for case in CASES.values()})


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[int, dict]]:
    return {world: launch_worker(WORKER, world, tmp_path_factory.mktemp(f"pipe{world}"), timeout=300)
            for world in WORLDS}


def _case(results, name: str) -> list[dict]:
    world = CASES[name][0]
    return on_every_rank([results[world][r][name] for r in range(world)], name)


@pytest.mark.parametrize("name", list(CASES))
def test_matches_single_device(results, name):
    per_rank = _case(results, name)
    for res in per_rank:
        assert res["loss_ok"] and res["loss_diff"] < 1e-5, f"loss differs by {res['loss_diff']}"
        assert not res["grads_missing"], f"no gradient for {res['grads_missing']}"
        assert not res["grads_bad"], f"gradients differ: {res['grads_bad']} (max {res['grad_diff']})"
        assert res["grad_diff"] < 1e-6
        if "accumulate_ok" in res:  # a second step without zero_grad: twice the gradient
            assert res["accumulate_ok"], f"accumulated gradients differ by {res['accumulate_diff']}"
            assert res["loss2_diff"] < 1e-5
            assert res["loss_after_sgd_ok"], f"loss after an SGD step differs by {res['loss_after_sgd_diff']}"
    # between them, the ranks hold (and checked) every parameter of the model, tied names included
    checked = set().union(*(res["grads_checked"] for res in per_rank))
    assert checked == set(per_rank[0]["model_parameters"])


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][1] == "gpt"])
def test_tied_weight_summed_across_stages(results, name):
    """nanoGPT's lm_head.weight is wte.weight: the first and the last stage each hold a copy and
    both copies carry the full gradient (checked against the reference under both names)."""
    per_rank = _case(results, name)
    first = [res for res in per_rank if 0 in res["stages_here"]]
    last_stage = max(s for res in per_rank for s in res["stages_here"])
    last = [res for res in per_rank if last_stage in res["stages_here"]]
    for res in first + last:
        assert {"wte.weight", "lm_head.weight"} <= set(res["grads_checked"])


def test_stages_are_sharded_inside(results):
    """The 4-process cases shard parameters on each stage's 2-device mesh (Megatron-style), and
    the data-parallel MLP shards its input, so its replicated weights' gradients are partial sums."""
    for name, case in CASES.items():
        if case[2] == 2 and case[1] != "mlp_dp":
            assert any(res["sharded"] for res in _case(results, name)), name
    for name in ("mlp_dp_k2_gpipe", "mlp_dp_k2_interleaved1f1b"):
        assert _case(results, name)[0]["inputs"]["x"] != ["R"]


def test_values_cross_as_shards_between_stages_of_one_mesh(results):
    """A stage after the first is handed its share of each value (1/k on a stage mesh of k
    devices: the microbatch's batch dim here), as the planner costs it; between stages on
    different logical meshes ((4,) and (2, 2)), whole values."""
    import math

    from autoplan.sharding import boundary_spec, local_shape

    checked = 0
    for name, case in CASES.items():
        mixed = name in STAGE_MESHES
        for res in _case(results, name):
            for stage, shapes in res["received"].items():
                values = res["values"][stage]
                if int(stage) == 0:  # the microbatch, whole
                    assert shapes == values
                    continue
                mesh = tuple(res["stage_meshes"][stage])
                want = [list(v) if mixed else list(local_shape(tuple(v), boundary_spec(tuple(v), mesh), mesh))
                        for v in values]
                assert shapes == want, (name, stage)
                if case[2] > 1 and not mixed:
                    assert all(math.prod(g) * case[2] == math.prod(v) for g, v in zip(shapes, values) if len(v) > 1)
                checked += 1
    assert checked > 0


def test_layout_boundaries():
    """Without processes: what crosses the stage boundaries of a 2-stage nanoGPT."""
    from autoplan.codegen.pipeline_layout import pipeline_layout, stage_ranks
    from autoplan.errors import AutoplanError
    from autoplan.planner.api import make_options, plan_traced
    from autoplan.load import make_model_spec
    from autoplan.trace.microbatch import microbatch_inputs
    from autoplan.trace.tracer import trace

    build, loss_fn, starts = MODELS["gpt"]
    model, inputs = build()
    graph = trace(make_model_spec(model, microbatch_inputs(inputs, 2), loss_fn))
    base = plan_traced(graph, make_options(1, "cpu", mesh=(1,)))
    plan = split_plan(base, graph, starts[2], 2, "1f1b")
    layout = pipeline_layout(graph, plan)
    assert [n.name for n in layout.inputs[0]] == ["idx", "targets"]
    crossing = [n.name for n in layout.inputs[1]]
    assert crossing[0] == "targets" and len(crossing) == 2  # the labels and the residual stream
    assert layout.outputs[0] == layout.inputs[1] and layout.outputs[1] == [layout.loss_node]
    assert layout.needs_grad[layout.inputs[1][1]] and not layout.needs_grad[layout.inputs[1][0]]
    # a value taken out of a multi-output op (q of the attention's split) still carries a gradient
    assert layout.needs_grad[graph.fx_node("getitem")] and not layout.needs_grad[graph.fx_node("arange")]
    tied = {n.name for s in (0, 1) for n in layout.param_nodes[s] if graph.param_names[n.name] == "lm_head.weight"}
    assert len(tied) == 1 and all(any(graph.param_names[n.name] == "lm_head.weight" for n in layout.param_nodes[s])
                                  for s in (0, 1))
    # stage → pipeline rank maps
    assert stage_ranks("gpipe", 2, 2) == [0, 1]
    assert stage_ranks("interleaved1f1b", 4, 2) == [0, 1, 0, 1]
    assert stage_ranks("zbvzerobubble", 4, 2) == [0, 1, 1, 0]
    with pytest.raises(AutoplanError):
        stage_ranks("1f1b", 4, 2)
    # a plan whose devices do not follow the schedule's map is refused
    wrong = split_plan(base, graph, starts[4], 4, "interleaved1f1b")
    wrong.stages[1].devices, wrong.stages[2].devices = wrong.stages[2].devices, wrong.stages[1].devices
    with pytest.raises(AutoplanError, match="pp rank"):
        pipeline_layout(graph, wrong)


def test_values_on_their_way_to_another_logical_mesh_cross_whole():
    """Without processes: three nanoGPT stages, the last on another logical mesh. The labels,
    read by the last stage, cross whole at both boundaries; the residual stream the second
    stage alone reads crosses as shards (the batch over the 4 ranks); what the second stage
    hands the third crosses whole."""
    from torch.distributed.tensor import Replicate, Shard

    from autoplan.codegen.pipeline_layout import pipeline_layout
    from autoplan.codegen.pipeline_program import StageCrossing
    from autoplan.planner.api import make_options, plan_traced
    from autoplan.load import make_model_spec
    from autoplan.trace.microbatch import microbatch_inputs
    from autoplan.trace.tracer import trace

    build, loss_fn, starts = MODELS["gpt"]
    model, inputs = build()
    graph = trace(make_model_spec(model, microbatch_inputs(inputs, 2), loss_fn))
    plan = split_plan(plan_traced(graph, make_options(1, "cpu", mesh=(1,))), graph, starts[3], 2, "1f1b", pp=3)
    layout = pipeline_layout(graph, plan)
    meshes = [(4,), (4,), (2, 2)]
    first, second = StageCrossing.of(layout, meshes, 0), StageCrossing.of(layout, meshes, 1)
    names = [n.name for n in layout.outputs[0]]
    assert names[0] == "targets" and first.outputs[0] == (Replicate(),) and second.inputs[0] == (Replicate(),)
    residual = [p for n, p in zip(layout.outputs[0], first.outputs) if n not in layout.inputs[2]]
    assert residual and all(p == (Shard(0),) for p in residual)
    assert second.outputs == [(Replicate(),)] * len(layout.outputs[1])
    assert StageCrossing.of(layout, meshes, 2).inputs == [(Replicate(), Replicate())] * len(layout.inputs[2])
    # what the plan names as crossing whole (small values) crosses whole on one mesh too
    named = frozenset(n.name for n in layout.outputs[0])
    assert StageCrossing.of(layout, [(4,)] * 3, 0, named).outputs == [(Replicate(),)] * len(layout.outputs[0])
    assert StageCrossing.of(layout, [(4,)] * 3, 0).outputs[len(names) - 1] == (Shard(0),)


def test_stages_on_different_logical_meshes(results):
    """Two stages of 4 devices, one on mesh (4,) and one on (2, 2): each rank's stage runs on
    its own stage's mesh, both stages hold sharded parameters (or, data-parallel, sum partial
    gradients on their own mesh's axes), and the values match the single device
    (test_matches_single_device)."""
    for name, meshes in STAGE_MESHES.items():
        per_rank = _case(results, name)
        k = CASES[name][2]
        for rank, res in enumerate(per_rank):
            stage = rank // k
            assert res["stage_meshes"] == {str(stage): list(meshes[stage])}
        for stage in range(len(meshes)):
            ranks = per_rank[stage * k:(stage + 1) * k]
            if CASES[name][1] == "mlp_dp":
                assert all(res["buckets"] >= len(meshes[stage]) for res in ranks), name
            else:
                assert all(res["sharded"] for res in ranks), name
