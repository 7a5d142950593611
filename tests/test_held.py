"""Parameters gathered once per step and held through its microbatches (FSDP under a pipeline,
``reshard_after_forward=False``, as torchtitan composes FSDP2 with pipelining).

The held strategy and its costs (the stored shard, a bf16 copy, one all-gather and one
reduce-scatter per step however many microbatches run); the search taking it under a budget
where microbatches run in bf16; ``--manual fsdp=`` under a pipeline asking for it; and its
programs passing ``--check`` on 4 gloo processes (fp32 and bf16, a tied weight on two pipeline
ranks, torch's interleaved zero-bubble schedule, gradient accumulation as the search plans it)
with every gather and reduce-scatter counted."""

from __future__ import annotations

import sys

import pytest

from autoplan.cost_models import LinkSpec, OptimizerSpec, load_cluster
from autoplan.cost_models.step_costs import CostContext, storage_cost
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from autoplan.sharding import R, S
from autoplan.strategies.candidates import sharded_state_strategies, storage_strategies
from autoplan.trace.graph import NodeInfo
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
import fsdp_cases  # noqa: E402
from test_fsdp import _h100_without_overlap, _held, _spec  # noqa: E402


def _manual(name: str, text: str, devices: int, precision: str = "fp32") -> Plan:
    spec = make_model_spec(*fsdp_cases.nanogpt4(), name=name) if name == "nanogpt4" else _spec(name)
    options = PlanOptions(devices, "cpu", precision=precision)
    return with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)), options)


def test_a_held_parameter_keeps_its_shard_and_a_bf16_copy_and_gathers_it_once() -> None:
    weight = NodeInfo("w", "parameter", "", (64, 32), "float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    replicated = next(s for s in storage_strategies(weight.shape, (4,)) if s.output_spec == (R,))
    assert not any(v.held for v in sharded_state_strategies(replicated, weight.shape, (4,), gradients=True))
    held = next(v for v in sharded_state_strategies(replicated, weight.shape, (4,), True, held=True) if v.held)
    zero1 = next(v for v in sharded_state_strategies(replicated, weight.shape, (4,), True) if v.grad_spec is None)
    assert (held.output_spec, held.state_spec, held.grad_spec) == ((R,), (S(0),), None)
    ctx = CostContext((4,), (LinkSpec(1e9, 0.0),), load_cluster("h100").device,
                      OptimizerSpec("adamw", mixed_precision=True))
    elements = 64 * 32
    one = storage_cost(weight, (R,), ctx, True, zero1.grad_spec, zero1.state_spec)
    kept = storage_cost(weight, (R,), ctx, True, held.grad_spec, held.state_spec, held=True)
    assert one.memory.params == elements * (4 + 2)  # the fp32 parameter and autocast's bf16 copy
    assert kept.memory.params == elements / 4 * 4 + elements * 2  # the fp32 shard and the held bf16 copy
    assert kept.memory.grads == one.memory.grads == elements * 4  # accumulated whole, in fp32
    assert kept.memory.optimizer == one.memory.optimizer == elements / 4 * 8
    assert kept.comm_s == pytest.approx(one.comm_s / 2)  # the step's all-gather moves bf16, ZeRO-1's fp32
    assert kept.optimizer_s == one.optimizer_s


def _gpt_node(microbatches: int, budget: float | None, cluster: str = "h100") -> Plan:
    import gpt

    model, inputs = gpt.build(hidden=2048, layers=4, heads=16, seq=1024, vocab=32000, batch=64, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name="gpt")
    return plan_model(spec, PlanOptions(8, cluster, stages=1, microbatches=microbatches, mesh=(8,), recompute="none",
                                        precision="bf16", plan_only=True, memory_per_device=budget))


def test_a_budget_under_accumulated_microbatches_holds_parameters_gathered_through_the_step(tmp_path) -> None:
    """Four accumulated microbatches in bf16 on a data-parallel node whose collectives never run
    beside compute (where they may, sharded storage is searched without a budget: below): without
    a budget the weights are replicated; under one that replicated Adam state exceeds, the large
    weights are stored sharded and held gathered through the step (one all-gather and one
    reduce-scatter each per step), which keeps less and moves fewer bytes than ZeRO-1 under
    bf16. On H100s, where sharded storage is among the choices from the start, the plan holds
    them without a budget, and is no slower."""
    cluster = _h100_without_overlap(tmp_path)
    free = _gpt_node(4, None, cluster)
    assert not any(s.held for s in free.storage.values())
    on_gpus = _gpt_node(4, None)
    assert any(s.held for s in on_gpus.storage.values())
    assert on_gpus.predicted.step_time_s <= free.predicted.step_time_s
    tight = free.predicted.memory_bytes.peak_with_transient - 0.5 * free.predicted.memory_bytes.optimizer
    plan = _gpt_node(4, tight, cluster)
    assert plan.predicted.memory_bytes.peak_with_transient <= tight
    held = {name for name, s in plan.storage.items() if s.held}
    assert any(name.startswith("h.") and name.endswith(".weight") for name in held), held
    assert _held(plan)
    assert "held gathered through the step" in summary_text(plan)


def test_manual_fsdp_under_a_pipeline_holds_and_interleaves_over_its_ranks() -> None:
    plan = _manual("llama", "fsdp=2,pp=2,microbatches=4", 4)
    assert _held(plan) and "held gathered through the step" in summary_text(plan)
    accumulated = _manual("llama", "fsdp=2,microbatches=4", 2)  # no pipeline: gathered per microbatch
    assert not any(s.held for s in accumulated.storage.values())
    interleaved = _manual("nanogpt4", "fsdp=2,pp=2,microbatches=4,schedule=interleaved1f1b", 4)
    assert len(interleaved.stages) == 4 and sorted({tuple(s.devices) for s in interleaved.stages}) == [(0, 1), (2, 3)]


def _searched_nanogpt() -> Plan:
    """The search's plan of nanoGPT, two microbatches accumulated in bf16 on 4 devices, under a
    budget that replicated Adam state exceeds: it holds some parameters through the step."""
    spec = make_model_spec(*fsdp_cases.nanogpt(), name="nanogpt")

    def planned(budget: float | None) -> Plan:
        return plan_model(spec, PlanOptions(4, "cpu", stages=1, microbatches=2, mesh=(4,), recompute="none",
                                            precision="bf16", memory_per_device=budget))

    free = planned(None).predicted.memory_bytes
    return planned(free.peak_with_transient - 0.5 * free.optimizer)


def test_held_programs_pass_check(tmp_path) -> None:
    searched = _searched_nanogpt()
    assert any(s.held for s in searched.storage.values()) and searched.precision.compute_dtype == "bfloat16"
    cases = {"nanogpt 2 stages x fsdp held": ("nanogpt", "fsdp=2,pp=2,microbatches=4", "fp32"),
             "llama 2 stages x fsdp held bf16": ("llama", "fsdp=2,pp=2,microbatches=2,ac=full", "bf16"),
             "nanogpt interleaved zero bubble x fsdp held": (
                 "nanogpt4", "fsdp=2,pp=2,microbatches=4,schedule=interleavedzerobubble", "fp32")}
    plans = {label: (model, _manual(model, text, 4, precision)) for label, (model, text, precision) in cases.items()}
    for label, (_, plan) in plans.items():
        assert _held(plan), label
    plans["nanogpt 2 microbatches accumulated, searched, bf16"] = ("nanogpt", searched)
    write_check_cases(tmp_path, plans, {"nanogpt": "fsdp_cases.py", "nanogpt4": "fsdp_cases.py"})
    assert_checks_passed(launch_worker(ROOT / "tests" / "check_worker.py", 4, tmp_path, timeout=600), plans)


def _accumulated_llama(recompute: str) -> Plan:
    """The search's plan of a Llama on 2 devices, two microbatches accumulated in bf16, under a
    budget that replicated Adam state exceeds: data parallel, some weights held through the step."""
    spec = make_model_spec(*fsdp_cases.llama_accumulated(), name="llama")

    def planned(budget: float | None) -> Plan:
        return plan_model(spec, PlanOptions(2, "cpu", stages=1, microbatches=2, mesh=(2,), recompute=recompute,
                                            precision="bf16", memory_per_device=budget))

    free = planned(None).predicted.memory_bytes
    return planned(free.peak_with_transient - 0.5 * free.optimizer)


def test_held_weights_of_accumulated_microbatches_run_on_fsdp2(tmp_path) -> None:
    """A data-parallel plan that holds weights gathered through its microbatches runs on FSDP2
    (``reshard_after_forward=False``, neither resharded nor reduced but after the last
    microbatch's backward): ``--check`` passes, and the executed collectives (one gather and one
    reduce-scatter per group a step) are the plan's."""
    plans = {"llama held accumulated bf16": ("llama_accumulated", _accumulated_llama("none")),
             "llama held accumulated checkpointed bf16": ("llama_accumulated", _accumulated_llama("all"))}
    for label, (_, plan) in plans.items():
        assert _held(plan) and plan.inputs["input_ids"] == ["S(0)"], label
    write_check_cases(tmp_path, plans, {"llama_accumulated": "fsdp_cases.py"})
    results = launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=600)
    assert_checks_passed(results, plans)
    for found in results.values():
        for label in plans:
            assert "held gathered through the microbatches" in found[label]["description"], found[label]["description"]
