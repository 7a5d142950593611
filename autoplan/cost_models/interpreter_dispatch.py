"""The host time of autoplan's DTensor interpreter, which the solvers' costs leave out.

The solvers charge every op pass (a forward, or one of the ``BACKWARD_FACTOR`` passes of its
backward) :attr:`DeviceSpec.op_overhead_s` of dispatch: what the programs PyTorch runs itself pay
(FSDP2, DDP, ``parallelize_module``, stages cut by ``torch.distributed.pipelining``; ``autoplan
calibrate`` measures it eagerly). Which program runs a plan is known only once the plan is
chosen (:mod:`autoplan.codegen.program_choice`). A plan that no native form matches runs on the
DTensor interpreter, which dispatches each op pass from Python through DTensor's sharding
propagation and the planned redistributions: :attr:`DeviceSpec.interpreter_op_overhead_s` per
op pass (``autoplan calibrate`` measured 196 us on an H100's host and 137 us on an H200's, against
39 and 30 us eagerly). That host time is stated beside the prediction, for the busiest rank::

    passes   = (1 + BACKWARD_FACTOR) · microbatches · Σ ops of the stages the rank runs
    dispatch = passes · interpreter_op_overhead_s
    expected = max(step, dispatch)                                  host dispatching ahead (GPUs)
             = step + passes · (interpreter_op_overhead_s − op_overhead_s)   host and device in turn (CPUs)

On a GPU ``expected`` is a lower bound (an op whose kernel is shorter than its dispatch waits
for the host; the bound assumes the waits and the kernels never add up); on a CPU it is what the
cost model predicts with the interpreter's dispatch in place of the eager one.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from autoplan.calibrate.fit import costed_ops
from autoplan.cost_models.compute import BACKWARD_FACTOR
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.plan_schema import Plan
from autoplan.trace.graph import TracedGraph

__all__ = ["InterpreterDispatch", "interpreter_dispatch", "op_passes_per_rank"]


@dataclass(frozen=True)
class InterpreterDispatch:
    """The interpreter's host time per step on the busiest rank (``dispatch_s``, over
    ``op_passes`` op passes) and the step time expected with it (``expected_step_s``)."""

    op_passes: int
    dispatch_s: float
    expected_step_s: float


def op_passes_per_rank(plan: Plan, graph: TracedGraph) -> int:
    """The op passes of one training step on the busiest rank of ``plan`` (``graph``: the trace
    the plan was planned on, one microbatch's where it has several): every costed op (a
    ``getitem`` costs nothing) of the stages the rank runs, forward and backward, per microbatch."""
    costed = {info.name for info in costed_ops(graph)}
    per_rank: Counter[int] = Counter()
    for stage in plan.stages:
        ops = len(costed & set(stage.nodes)) if stage.nodes else len(costed)
        for rank in stage.devices:
            per_rank[rank] += ops
    busiest = max(per_rank.values(), default=len(costed))
    return round((1 + BACKWARD_FACTOR) * plan.microbatches * busiest)


def interpreter_dispatch(plan: Plan, graph: TracedGraph, device: DeviceSpec) -> InterpreterDispatch | None:
    """The interpreter's host time for ``plan`` (module docstring); None where the device gives
    no interpreter figure."""
    if device.interpreter_op_overhead_s <= 0:
        return None
    passes = op_passes_per_rank(plan, graph)
    dispatch = passes * device.interpreter_op_overhead_s
    step = plan.predicted.step_time_s
    if device.overlapped_dispatch:
        expected = max(step, dispatch)
    else:
        expected = step + passes * max(0.0, device.interpreter_op_overhead_s - device.op_overhead_s)
    return InterpreterDispatch(passes, dispatch, expected)
