"""What a plan's memory levers save per device, for the summary and the report's memory by kind.

- **Sharded storage** (ZeRO-1/2, ZeRO-3 / FSDP): every trained parameter whose storage is
  sharded unlike its first consumer's read (gathered at use), or whose gradient or optimizer
  state is sharded under it, is costed again stored as that consumer reads it, gradient and
  state alike (:func:`~autoplan.cost_models.step_costs.storage_cost`); the saving is the
  difference in its kept bytes (parameter, gradient, optimizer state, compute copy).
- **Activation checkpointing**: every op the plan recomputes, or keeps only for its region's
  recomputation, is costed again as a kept op (its output saved where the backward reads it,
  :func:`~autoplan.cost_models.step_costs.op_cost`); the saving is the difference in the
  activations it keeps.

Both use the plan's own strategies: they say what the lever saves in this plan, not what the
best plan without it would need.
"""

from __future__ import annotations

from autoplan.cost_models.step_costs import CostContext, op_cost, storage_cost
from autoplan.planner.mesh_plan import VIEW_OPS, IntraOpResult
from autoplan.sharding import ShardingSpec
from autoplan.strategies.index_maps import op_name
from autoplan.trace.graph import NodeKind, TracedGraph


def sharding_saved(graph: TracedGraph, result: IntraOpResult, ctx: CostContext) -> float:
    """Bytes per device the sharded storage of trained parameters saves (module docstring)."""
    reads: dict[str, ShardingSpec] = {}  # parameter -> its first consumer's read spec
    for consumer, inputs in result.input_names.items():
        specs = result.chosen[consumer].input_specs if consumer in result.chosen else ()
        for pos, source in enumerate(inputs):
            if source not in reads and pos < len(specs) and specs[pos] is not None:
                reads[source] = specs[pos]
    saved = 0.0
    for name, strategy in result.chosen.items():
        info = graph.nodes[name]
        if info.kind != NodeKind.PARAMETER or not result.needs_grad.get(name) or name not in reads:
            continue
        read = reads[name]
        if read == strategy.output_spec and strategy.state_spec is None and strategy.grad_spec is None:
            continue
        whole = storage_cost(info, read, ctx, True).memory.total
        saved += max(0.0, whole - result.node_costs[name].memory.total)
    return saved


def recompute_saved(graph: TracedGraph, result: IntraOpResult, ctx: CostContext) -> float:
    """Activation bytes per device the plan's checkpointing frees (module docstring)."""
    if not ctx.recompute_regions:
        return 0.0
    fx_nodes = graph.fx_nodes
    saved = 0.0
    for name in ctx.recompute_regions:
        strategy = result.chosen.get(name)
        if strategy is None or graph.nodes[name].kind != NodeKind.OP:
            continue
        needs_grad = result.needs_grad[name]
        inputs = result.input_names[name]
        saves = needs_grad and op_name(fx_nodes[name]) not in VIEW_OPS
        kept = op_cost(graph.nodes[name], strategy, [graph.nodes[i] for i in inputs],
                       [result.needs_grad[i] for i in inputs], needs_grad, saves, ctx)
        saved += max(0.0, kept.memory.activations - result.node_costs[name].memory.activations)
    return saved
