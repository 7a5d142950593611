"""ZeRO-1 and ZeRO-2: a trained parameter's optimizer state (and reduced gradient) stored
sharded under a parameter the forward reads whole.

The strategies and their costs (the state's memory divided, one all-gather per step after the
optimizer, a reduce-scatter where ZeRO-2 stores the gradient sharded); ``--manual zero=`` and
its refusals; and programs that pass ``--check`` on 2 and 4 gloo processes (1-D and 2x2 meshes,
accumulated microbatches, a pipeline, checkpointing, bf16), with the optimizer step's
all-gathers counted beside the plan's."""

from __future__ import annotations

import sys

import pytest

from autoplan.cost_models import LinkSpec, OptimizerSpec, load_cluster
from autoplan.cost_models.step_costs import CostContext, edge_steps, storage_cost
from autoplan.errors import AutoplanError
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.sharding import P, R, S
from autoplan.strategies.candidates import sharded_state_strategies, storage_strategies
from autoplan.trace.graph import NodeInfo
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
from test_fsdp import _spec  # noqa: E402


def test_sharded_state_strategies_and_their_costs() -> None:
    weight = NodeInfo("w", "parameter", "", (64, 32), "float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    replicated = next(s for s in storage_strategies(weight.shape, (4,)) if s.output_spec == (R,))
    variants = sharded_state_strategies(replicated, weight.shape, (4,), gradients=True)
    zero1, zero2 = variants
    assert (zero1.state_spec, zero1.grad_spec) == ((S(0),), None)
    assert (zero2.state_spec, zero2.grad_spec) == ((S(0),), (S(0),))
    assert sharded_state_strategies(replicated, weight.shape, (4,), gradients=False) == [zero1]
    ctx = CostContext((4,), (LinkSpec(1e9, 1e-5),), load_cluster("h100").device, OptimizerSpec("adamw"))
    plain = storage_cost(weight, (R,), ctx, True)
    one = storage_cost(weight, (R,), ctx, True, zero1.grad_spec, zero1.state_spec)
    two = storage_cost(weight, (R,), ctx, True, zero2.grad_spec, zero2.state_spec)
    assert one.memory.optimizer == plain.memory.optimizer / 4 and one.memory.grads == plain.memory.grads
    assert two.memory.grads == plain.memory.grads / 4 and two.memory.params == plain.memory.params
    assert plain.comm_s == 0 < one.comm_s == two.comm_s  # the updated shards all-gathered once per step
    assert one.optimizer_s == pytest.approx(plain.optimizer_s / 4)
    # the backward reduces a partial gradient into the parameter (all-reduce) or, ZeRO-2, into its shard
    _, into_param = edge_steps((R,), (R,), weight.shape, 4, True, ctx, frozenset({0}))
    _, into_shard = edge_steps((R,), (R,), weight.shape, 4, True, ctx, frozenset({0}), grad_src=zero2.grad_spec)
    assert [s.kind for s in into_param] == ["all_reduce"] and [s.kind for s in into_shard] == ["reduce_scatter"]
    assert P not in zero2.grad_spec


def test_a_zero1_gradient_is_reduce_scattered_into_the_state_once_per_step() -> None:
    """ZeRO-1 keeps the gradient whole through the backward and reduce-scatters it into the
    optimizer state's shard once per step (whatever the microbatch count), parameter by
    parameter: with the optimizer phase's all-gather, the bytes of plain storage's all-reduce
    (a ring all-reduce is a reduce-scatter and an all-gather), so ZeRO-1's reduction and gather
    cost what plain storage's bucketed all-reduce costs plus one latency each; read in another
    placement than stored, the gradient goes back through that resharding as before."""
    from autoplan.cost_models.step_costs import edge_cost, sharded_state_steps, step_reduction_spec, steps_seconds

    weight = NodeInfo("w", "parameter", "", (64, 32), "float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    replicated = next(s for s in storage_strategies(weight.shape, (4,)) if s.output_spec == (R,))
    zero1, zero2 = sharded_state_strategies(replicated, weight.shape, (4,), gradients=True)
    state = step_reduction_spec(zero1.output_spec, zero1.grad_spec, zero1.state_spec)
    assert state == (S(0),)
    assert step_reduction_spec(zero2.output_spec, zero2.grad_spec, zero2.state_spec) is None  # its own grad_spec
    assert step_reduction_spec(replicated.output_spec, None, None) is None
    _, scattered = edge_steps((R,), (R,), weight.shape, 4, True, CostContext(
        (4,), (LinkSpec(1e9, 1e-5),), load_cluster("h100").device, OptimizerSpec("adamw")), frozenset({0}),
        step_src=state)
    assert [s.kind for s in scattered] == ["reduce_scatter"]
    for microbatches, latency in ((1, 0.0), (4, 0.0), (1, 1e-5), (4, 1e-5)):
        ctx = CostContext((4,), (LinkSpec(1e9, latency),), load_cluster("h100").device, OptimizerSpec("adamw"),
                          microbatches=microbatches, parameter_edges=100)
        plain = edge_cost((R,), (R,), weight.shape, 4, True, ctx, frozenset({0}), from_parameter=True)
        zero = edge_cost((R,), (R,), weight.shape, 4, True, ctx, frozenset({0}), from_parameter=True, step_src=state)
        gather = steps_seconds(sharded_state_steps((R,), state, weight.shape, 4, ctx), ctx)
        if latency:  # a latency each, where the bucketed all-reduce pays a share of one
            assert zero + gather > plain
        else:
            assert zero + gather == pytest.approx(plain, rel=1e-9)
        # read in another placement, back through the resharding every microbatch, into the parameter
        resharded = edge_cost((R,), (S(0),), weight.shape, 4, True, ctx, frozenset(), from_parameter=True,
                              step_src=state)
        assert resharded == edge_cost((R,), (S(0),), weight.shape, 4, True, ctx, frozenset(), from_parameter=True)


def test_accumulated_microbatches_reduce_a_zero2_gradient_each_time() -> None:
    """Under gradient accumulation a ZeRO-2 gradient is reduce-scattered after every
    microbatch (no whole gradient outlives one), a ZeRO-1 or replicated one once per step: the
    ZeRO-2 variant is among the choices whatever the microbatch count, its reduction costing
    ``microbatches`` times as much, its gradient memory divided as with one microbatch."""
    from autoplan.planner.mesh_plan import plan_intra_op
    from autoplan.trace.repeated import find_classes
    from autoplan.trace.tracer import trace
    from autoplan.cost_models.step_costs import edge_cost, gradient_reductions

    weight = NodeInfo("w", "parameter", "", (64, 32), "float32", 4, 0.0, 0.0, "", "", (), fqn="w")
    replicated = next(s for s in storage_strategies(weight.shape, (4,)) if s.output_spec == (R,))
    _, zero2 = sharded_state_strategies(replicated, weight.shape, (4,), gradients=True)
    costs = {}
    for microbatches in (1, 4):
        ctx = CostContext((4,), (LinkSpec(1e9, 1e-5),), load_cluster("h100").device, OptimizerSpec("adamw"),
                          microbatches=microbatches)
        assert gradient_reductions(zero2.grad_spec, (R,), ctx) == microbatches
        assert gradient_reductions(None, (R,), ctx) == 1
        costs[microbatches] = [edge_cost((R,), (R,), weight.shape, 4, True, ctx, frozenset({0}), from_parameter=True,
                                         grad_src=grad) for grad in (None, zero2.grad_spec)]
    assert costs[4][0] == costs[1][0]  # accumulated whole, reduced once
    assert costs[4][1] == pytest.approx(4 * costs[1][1])
    # the search offers ZeRO-2 with accumulated microbatches
    spec = _spec("nanogpt")
    graph = trace(spec)
    ctx = CostContext((2,), (LinkSpec(1e9, 1e-5),), load_cluster("h100").device, OptimizerSpec("adamw"),
                      microbatches=2)
    result = plan_intra_op(graph, find_classes(graph), (2,), ctx, None, gathered_storage=True)
    assert any("zero2@" in name for names in result.problem.choice_names for name in names)


def test_manual_zero_is_read_and_refused_in_one_line() -> None:
    assert parse_manual("dp=4,zero=2").zero == 2
    assert parse_manual("dp=2,zero=2,microbatches=4").microbatches == 4  # reduce-scattered every microbatch
    assert "zero=1" in parse_manual("dp=2,zero=1,microbatches=4").label
    assert parse_manual("dp=2,pp=2,schedule=gpipe").microbatches == 1  # GPipe runs one microbatch
    for text, needle in (("dp=2,zero=3", "zero=3 is fsdp="), ("zero=1", "give dp=2 or more"),
                         ("dp=2,pp=2", "needs at least one microbatch per stage")):
        with pytest.raises(AutoplanError, match=f"^[^\\n]*{needle}[^\\n]*$"):
            parse_manual(text)


def _manual(name: str, text: str, devices: int, precision: str = "fp32") -> Plan:
    options = PlanOptions(devices, "cpu", precision=precision)
    return with_decisions(plan_manual(_spec(name), options.planner_options(), parse_manual(text)), options)


@pytest.mark.parametrize("world", [2, 4])
def test_zero_programs_pass_check(world: int, tmp_path) -> None:
    cases = {
        2: {"nanogpt zero-1": ("nanogpt", "dp=2,zero=1", "fp32"),
            "llama zero-2 bf16": ("llama", "dp=2,zero=2", "bf16"),
            "nanogpt zero-1 accumulated": ("nanogpt", "dp=2,zero=1,microbatches=2", "fp32"),
            "nanogpt zero-2 accumulated, tied weights": ("nanogpt", "dp=2,zero=2,microbatches=4", "fp32")},
        4: {"gpt2 zero-2 x tp": ("gpt2", "dp=2,tp=2,zero=2", "fp32"),
            "llama 2 stages x zero-1 checkpointed": ("llama", "dp=2,pp=2,microbatches=2,zero=1,ac=full", "fp32"),
            "nanogpt 2 stages x zero-2, tied weights": ("nanogpt", "dp=2,pp=2,zero=2,schedule=gpipe", "fp32"),
            "llama 2 stages x zero-2, 4 microbatches, checkpointed": ("llama", "dp=2,pp=2,microbatches=4,zero=2,ac=full",
                                                                      "fp32")},
    }[world]
    plans = {label: (model, _manual(model, text, world, precision))
             for label, (model, text, precision) in cases.items()}
    for label, (_, plan) in plans.items():
        zero2 = "zero=2" in cases[label][1]
        sharded = [s for s in plan.storage.values() if s.optimizer_state != s.param]
        assert sharded and all((s.grad != s.param) == zero2 for s in sharded), label
        assert any(c.phase == "optimizer" and c.kind == "all_gather" for c in plan.collectives), label
        scattered = [c for c in plan.collectives if c.kind == "reduce_scatter" and c.tensor == "gradient"]
        assert scattered, label
        if zero2:  # a ZeRO-2 gradient is reduce-scattered after every microbatch, not once per step
            assert all(c.count % plan.microbatches == 0 for c in scattered if c.bucketed), label
        else:  # a ZeRO-1 gradient once per step, by the optimizer step, parameter by parameter
            assert all(c.phase == "optimizer" and not c.bucketed for c in scattered), label
            assert sum(c.count for c in scattered) <= len(sharded), label  # tied: one; positions: none
            assert not any(c.tensor == "gradient" and c.bucketed for c in plan.collectives), label
    # the interpreter's ZeRO: the optimizer step's all-gathers (FSDP2 runs Llama's ZeRO-2 natively:
    # tests/test_native.py)
    write_check_cases(tmp_path, plans, {"nanogpt": "fsdp_cases.py"}, frozenset(plans))
    results = launch_worker(ROOT / "tests" / "check_worker.py", world, tmp_path, timeout=600)
    assert_checks_passed(results, plans)
    for label in plans:
        assert "optimizer" in results[0][label]["text"] and "all_gather" in results[0][label]["text"], label
