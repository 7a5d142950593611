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
    built = getattr(autocast_cases, builder)()
    if isinstance(built, tuple):
        return make_model_spec(*built, name=builder)
    return make_model_spec(built.model, built.example_inputs, built.loss_fn, name=builder)


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


def test_gpt2s_upcast_attention_is_marked_fp32() -> None:
    """transformers' own model: GPT-2's ``reorder_and_upcast_attn`` scores, through the helper."""
    graph = trace(_spec("gpt2_upcast_attention"))
    scores = [n for n in graph.graph_module.graph.nodes if n.target is torch.ops.aten.baddbmm.default]
    assert scores  # one per layer
    assert all(graph.nodes[n.name].full_precision for n in scores)
    assert not any(graph.nodes[n.name].full_precision for n in graph.graph_module.graph.nodes
                   if n.target is torch.ops.aten.addmm.default)  # the projections follow the plan


def test_the_program_computes_a_models_fp32_region_in_fp32_under_a_bf16_plan(tmp_path) -> None:
    options = PlanOptions(2, "cpu", precision="bf16")
    plans = {}
    cases = [(builder, "tp=2") for builder in (*BUILDERS, "gpt2_upcast_attention")]
    cases.append(("rotary_autocast_off", "pp=2,microbatches=2"))  # the pipeline's stage programs too
    for builder, manual in cases:
        plan = with_decisions(plan_manual(_spec(builder), options.planner_options(), parse_manual(manual)), options)
        assert plan.precision.name == "bf16"
        plans[f"{builder} {manual} bf16"] = (builder, plan)
    assert len(plans["rotary_autocast_off pp=2,microbatches=2 bf16"][1].stages) == 2
    write_check_cases(tmp_path, plans, {builder: "autocast_cases.py" for builder, _ in plans.values()})
    results = launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=300)
    assert_checks_passed(results, plans)
