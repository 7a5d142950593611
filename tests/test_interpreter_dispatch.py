"""The DTensor interpreter's host time beside a plan's prediction
(:mod:`autoplan.cost_models.interpreter_dispatch`): stated for the plans it runs, in the plan,
the summary and the report; never for PyTorch's own programs; carried by cluster files."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autoplan.calibrate.fit import costed_ops
from autoplan.codegen.program_choice import INTERPRETER_PROGRAM
from autoplan.cost_models.compute import BACKWARD_FACTOR
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.interpreter_dispatch import interpreter_dispatch, op_passes_per_rank
from autoplan.cost_models.presets import load_cluster
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan, StagePlan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.reports.report import summary_section
from autoplan.reports.summary import summary_text
from autoplan.trace.tracer import trace

import gpt2  # examples/, on the path (conftest.py)
import mlp


@pytest.fixture(scope="module")
def planned() -> dict[str, tuple[Plan, object]]:
    """Plans of a tiny GPT-2 and of the MLP on 2 and 4 CPU devices, with their traces (the plans
    the search found, whatever runs them)."""
    found = {}
    for name, module, kwargs in (("gpt2", gpt2, {}), ("mlp", mlp, {"hidden": 64, "seq": 16})):
        model, inputs = module.build(**kwargs)
        spec = make_model_spec(model, inputs, module.loss_fn, name=name)
        graph = trace(spec)
        for devices in (2, 4):
            found[f"{name}-{devices}"] = (plan_model(spec, PlanOptions(devices, "cpu", pipeline=False, native_rivals=False)), graph)
    return found


def _costed(graph) -> int:
    return len(costed_ops(graph))


def test_the_interpreters_plans_state_its_dispatch_and_native_ones_do_not(planned) -> None:
    per_op = load_cluster("cpu").device.interpreter_op_overhead_s
    for name, (plan, graph) in planned.items():
        text = summary_text(plan)
        if plan.program.startswith(INTERPRETER_PROGRAM):
            passes = round((1 + BACKWARD_FACTOR) * _costed(graph))
            assert plan.predicted.interpreter_dispatch_s == pytest.approx(passes * per_op), name
            # a CPU takes dispatch and compute in turn: the interpreter's dispatch replaces the eager one
            assert plan.predicted.interpreter_step_s == pytest.approx(plan.predicted.step_time_s + passes * per_op)
            assert f"({passes} op passes at {per_op * 1e6:.0f} us), not in the prediction" in text, name
        else:
            assert plan.program, name
            assert plan.predicted.interpreter_dispatch_s == 0 and plan.predicted.interpreter_step_s == 0, name
            assert "interpreter dispatch" not in text, name
        rows = {row[0]: row[1] for row in summary_section(plan).blocks[0].rows}  # the report's summary table
        assert ("interpreter dispatch" in rows) == bool(plan.predicted.interpreter_dispatch_s), name
        again = Plan.from_json(plan.to_json()).predicted
        assert (again.interpreter_dispatch_s, again.interpreter_step_s) == \
            (plan.predicted.interpreter_dispatch_s, plan.predicted.interpreter_step_s)


def test_a_gpu_host_dispatching_ahead_bounds_the_step_from_below(planned) -> None:
    plan, graph = planned["gpt2-2"]
    passes = op_passes_per_rank(plan, graph)
    assert passes == round((1 + BACKWARD_FACTOR) * _costed(graph))
    gpu = DeviceSpec("gpu", {"float32": 1e12}, 1e12, 80e9, op_overhead_s=30e-6, overlapped_dispatch=True,
                     interpreter_op_overhead_s=150e-6)
    found = interpreter_dispatch(plan, graph, gpu)
    assert found.dispatch_s == pytest.approx(passes * 150e-6)
    assert found.expected_step_s == pytest.approx(max(plan.predicted.step_time_s, passes * 150e-6))
    cpu = replace(gpu, overlapped_dispatch=False)  # in turn: only the excess over the eager dispatch is new
    assert interpreter_dispatch(plan, graph, cpu).expected_step_s == \
        pytest.approx(plan.predicted.step_time_s + passes * 120e-6)
    assert interpreter_dispatch(plan, graph, replace(gpu, interpreter_op_overhead_s=0.0)) is None


def test_the_busiest_rank_counts_its_stages_and_microbatches(planned) -> None:
    plan, graph = planned["gpt2-2"]
    ops = [info.name for info in costed_ops(graph)]
    first, second = ops[:10], ops[10:]
    two = replace(plan, microbatches=4, stages=[StagePlan(["a"], [0], [1], first), StagePlan(["b"], [1], [1], second)])
    assert op_passes_per_rank(two, graph) == round((1 + BACKWARD_FACTOR) * 4 * len(second))
    # interleaved: each rank runs two stages
    split = [ops[:5], ops[5:10], ops[10:20], ops[20:]]
    looped = replace(two, stages=[StagePlan([str(i)], [i % 2], [1], nodes) for i, nodes in enumerate(split)])
    busiest = max(len(split[0]) + len(split[2]), len(split[1]) + len(split[3]))
    assert op_passes_per_rank(looped, graph) == round((1 + BACKWARD_FACTOR) * 4 * busiest)


def test_cluster_files_carry_the_interpreters_figure(tmp_path) -> None:
    for name in ("h100", "h200", "cpu"):
        cluster = load_cluster(name)
        assert cluster.device.interpreter_op_overhead_s > cluster.device.op_overhead_s
        path = tmp_path / f"{name}.toml"
        path.write_text(cluster.to_toml())
        assert load_cluster(str(path)).device.interpreter_op_overhead_s == cluster.device.interpreter_op_overhead_s
    path = tmp_path / "own.toml"
    path.write_text('preset = "h100"\n[device]\ninterpreter_op_overhead_us = 80\n')
    assert load_cluster(str(path)).device.interpreter_op_overhead_s == pytest.approx(80e-6)
