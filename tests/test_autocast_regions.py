"""A model's own ``torch.autocast`` regions are kept: traced, marked, costed and run as the
model runs them. Under a bf16 plan the program computes every op under autocast, so an fp32
region the model opens (Llama's rotary angles in transformers 5.17, GPT-2's upcast attention)
would compute in bf16 unless the program opens it too; measured on an H200, Llama 3.2 1B's
logits were then off by up to 5.3 (autoplan --check failed there)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch._higher_order_ops.wrap import wrap_with_autocast

from autoplan.cost_models.step_costs import compute_dtype, value_itemsize
from autoplan.load import make_model_spec
from autoplan.planner.front_door import with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.trace.tracer import trace
from autoplan.trace.wrapped_regions import autocast_region
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
import autocast_cases  # noqa: E402

BUILDERS = ("rotary_autocast_off", "rotary_hf_helper")


def _spec(builder: str):
    return make_model_spec(*getattr(autocast_cases, builder)(), name=builder)


@pytest.mark.parametrize("builder", BUILDERS)
def test_a_models_fp32_region_is_traced_as_plain_ops_marked_and_costed_in_fp32(builder: str) -> None:
    graph = trace(_spec(builder))
    nodes = list(graph.graph_module.graph.nodes)
    assert not any(n.target is wrap_with_autocast for n in nodes)  # inlined: plain ATen ops
    matmul = next(n for n in nodes if n.target is torch.ops.aten.matmul.default)
    region = autocast_region(matmul)
    assert region is not None and not region.enabled
    linear = next(n for n in nodes if n.target is torch.ops.aten.linear.default)
    assert autocast_region(linear) is None  # outside the region: the plan's precision
    info, linear_info = graph.nodes[matmul.name], graph.nodes[linear.name]
    assert info.full_precision and not linear_info.full_precision
    assert compute_dtype(info, mixed_precision=True) == "float32" and value_itemsize(info, True) == 4
    assert compute_dtype(linear_info, mixed_precision=True) == "bfloat16" and value_itemsize(linear_info, True) == 2


def test_the_program_computes_a_models_fp32_region_in_fp32_under_a_bf16_plan(tmp_path) -> None:
    options = PlanOptions(2, "cpu", precision="bf16")
    plans = {}
    for builder in BUILDERS:
        plan = with_decisions(plan_manual(_spec(builder), options.planner_options(), parse_manual("tp=2")), options)
        assert plan.precision.name == "bf16"
        plans[f"{builder} tp bf16"] = (builder, plan)
    write_check_cases(tmp_path, plans, {builder: "autocast_cases.py" for builder in BUILDERS})
    results = launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=300)
    assert_checks_passed(results, plans)
