"""Turn the intra-op pass's choices into a :class:`Plan`: placements, the collectives the
program will run per step, and the predicted step time and memory."""

from __future__ import annotations

import math

from autoplan.cost_models import CollectiveStep
from autoplan.cost_models.step_costs import (CostContext, MemoryParts, count_reduction_steps,
                                             edge_steps, gradient_reductions, model_flops_utilization, regather_runs,
                                             resharded_itemsize, sharded_state_steps, state_gather_itemsize,
                                             step_reduction_spec, steps_seconds, value_itemsize)
from autoplan.cost_models.gather_overlap import HiddenGathers, hidden_gathers
from autoplan.cost_models.backward_overlap import backward_windows, hidden_in_backward
from autoplan.cost_models.transient_memory import backward_transient
from autoplan.plan_schema import (HELD_SUFFIX, MemoryEstimate, NodePlan, ParamStorage, PlannedCollective, Prediction,
    PrefetchedGather, SolverStats, StagePlan)
from autoplan.planner.memory_savings import recompute_saved, sharding_saved
from autoplan.planner.mesh_plan import IntraOpResult, parameter_kept, regathered, with_parameter_edges
from autoplan.sharding import deferred_axes, spec_to_json
from autoplan.trace.graph import TracedGraph
from autoplan.trace.repeated import NodeClasses
from autoplan.trace.subgraph import model_outputs


def _add(bucket: dict[tuple, PlannedCollective], kind: str, phase: str, axis: int, nbytes: float, where: str,
         tensor: str, bucketed: bool = False, times: int = 1) -> None:
    key = (kind, phase, axis, nbytes, where, tensor, bucketed)
    if key in bucket:
        bucket[key].count += times
    else:
        bucket[key] = PlannedCollective(kind, phase, axis, nbytes, times, where, tensor, bucketed)


def _shown(graph: TracedGraph, name: str) -> str:
    """A node as a person knows it: a parameter or buffer by its name in the model
    (``transformer.h.0.attn.c_attn.weight``), any other node by its graph name."""
    return graph.nodes[name].fqn or name


def read_as_stored_alike(graph: TracedGraph, result: IntraOpResult, mesh_shape: tuple[int, ...]) -> set[str]:
    """The parameters every consumer of ``result`` reads as stored, each leaving the gradient
    partial on the same mesh axes: those whose reduction the program defers to the end of the
    backward, a ZeRO-1 one to the optimizer step (:func:`autoplan.sharding.deferred_axes`, the
    rule the program applies to the plan's node plans). A ZeRO-1 parameter read otherwise has
    its gradient reduced on its edges, into the parameter, as plain storage's."""
    uses: dict[str, list[tuple[list[str] | None, tuple[int, ...]]]] = {}
    for name, strategy in result.chosen.items():
        inputs = [] if graph.nodes[name].target == "getitem" else result.input_names[name]
        for pos, inp in enumerate(inputs):
            dst = strategy.input_specs[pos] if pos < len(strategy.input_specs) else None
            if dst is not None and graph.nodes[inp].kind == "parameter":  # as node_plans records the edge
                uses.setdefault(inp, []).append((spec_to_json(dst), tuple(sorted(strategy.partial_axes(pos)))))
    return {inp for inp, used in uses.items()
            if deferred_axes(used, spec_to_json(result.chosen[inp].output_spec), mesh_shape) is not None}


def planned_collectives(graph: TracedGraph, classes: NodeClasses, result: IntraOpResult,
                        ctx: CostContext) -> tuple[list[PlannedCollective], float]:
    """Every collective of one training step, aggregated over repeated layers, and the
    seconds they take."""
    bucket: dict[tuple, PlannedCollective] = {}
    seconds = 0.0
    fx_nodes = graph.fx_nodes
    reduced_once: set[str] = set()  # ZeRO-1 parameters whose gradient's reduction is listed
    deferred = read_as_stored_alike(graph, result, ctx.mesh_shape)
    for name, strategy in result.chosen.items():
        where_v = _shown(graph, classes.representative(classes.class_of[name]))
        info_v = graph.nodes[name]
        zero = strategy.state_spec is not None
        copy_b = state_gather_itemsize(info_v, ctx, strategy.held)
        for step in sharded_state_steps(strategy.output_spec, strategy.state_spec, info_v.shape or (),
                                        copy_b, ctx) if zero else []:  # ZeRO-1/2: the shards gathered
            seconds += steps_seconds([step], ctx)
            if strategy.held:  # once per step, before the first microbatch
                _add(bucket, step.kind, "forward", step.mesh_axis, step.nbytes, f"{where_v} {HELD_SUFFIX}",
                     "parameter")
            else:
                _add(bucket, step.kind, "optimizer", step.mesh_axis, step.nbytes, f"{where_v} (optimizer state)",
                     "parameter")
        if result.needs_grad.get(name):
            again = [("backward", f"{where_v} (recomputed)")] if ctx.recomputes(name) else []
            for step in count_reduction_steps(graph.nodes[name], strategy):
                for phase, where in [("forward", where_v), *again]:
                    seconds += steps_seconds([step], ctx) * ctx.microbatches
                    _add(bucket, step.kind, phase, step.mesh_axis, step.nbytes, where, "loss count",
                         times=ctx.microbatches)
        inputs = [] if graph.nodes[name].target == "getitem" else result.input_names[name]
        for pos, inp in enumerate(inputs):
            dst = strategy.input_specs[pos] if pos < len(strategy.input_specs) else None
            src_strategy = result.chosen[inp]
            if dst is None or not src_strategy.output_specs:
                continue
            info = graph.nodes[inp]
            itemsize = value_itemsize(info, ctx.optimizer.mixed_precision)
            step_src = step_reduction_spec(src_strategy.output_spec, src_strategy.grad_spec, src_strategy.state_spec) \
                if inp in deferred else None
            forward, backward = edge_steps(src_strategy.output_spec, dst, info.shape or (), itemsize,
                                           result.needs_grad[inp], ctx, strategy.partial_axes(pos),
                                           strategy.whole_grad_axes, src_strategy.grad_spec,
                                           resharded_itemsize(info, ctx.optimizer.mixed_precision), step_src)
            where = f"{_shown(graph, classes.representative(classes.class_of[inp]))} -> {where_v}"
            moved = "parameter" if info.kind == "parameter" else "activation"
            seconds += steps_seconds(forward, ctx) * ctx.microbatches
            for step in forward:
                _add(bucket, step.kind, "forward", step.mesh_axis, step.nbytes, where, moved, times=ctx.microbatches)
            recomputed = ctx.region_of(name) is not None
            kept = moved == "parameter" and forward and result.needs_grad[inp] and \
                parameter_kept(fx_nodes, result.needs_grad, name, inp, ctx)
            if regather_runs(moved == "parameter", recomputed, kept):  # the forward's resharding again
                seconds += steps_seconds(forward, ctx) * ctx.microbatches
                for step in forward:
                    _add(bucket, step.kind, "backward", step.mesh_axis, step.nbytes,
                         f"{where} ({'recomputed' if recomputed else 're-gathered'})", moved, times=ctx.microbatches)
            if moved == "parameter" and src_strategy.output_spec == dst and step_src is not None:
                # ZeRO-1: the accumulated gradient reduce-scattered into the optimizer state's
                # shard once per step, before the optimizer step, one collective per parameter
                if inp not in reduced_once:  # a held one's after the last microbatch, in the step
                    reduced_once.add(inp)
                    seconds += steps_seconds(backward, ctx)
                    for step in backward:
                        _add(bucket, step.kind, "backward" if src_strategy.held else "optimizer", step.mesh_axis,
                             step.nbytes, f"{_shown(graph, classes.representative(classes.class_of[inp]))} (gradient)",
                             "gradient")
            elif moved == "parameter" and src_strategy.output_spec == dst:  # read as stored: reduced once per
                times = gradient_reductions(src_strategy.grad_spec, dst, ctx)  # step in buckets (ZeRO-2: per
                seconds += steps_seconds(backward, ctx, bucketed=True) * times  # microbatch)
                for step in backward:
                    _add(bucket, step.kind, "backward", step.mesh_axis, step.nbytes, where, "gradient", bucketed=True,
                         times=times)
            else:  # through the edge's resharding, every microbatch
                seconds += steps_seconds(backward, ctx) * ctx.microbatches
                for step in backward:
                    _add(bucket, step.kind, "backward", step.mesh_axis, step.nbytes, where,
                         "gradient" if moved == "parameter" else "activation", times=ctx.microbatches)
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    return sorted(bucket.values(), key=lambda c: (order[c.phase], c.where, c.kind)), seconds


def predict(graph: TracedGraph, classes: NodeClasses, result: IntraOpResult, ctx: CostContext
            ) -> tuple[Prediction, list[PlannedCollective]]:
    """Predicted step time (compute, communication by kind) and memory of a result."""
    ctx = with_parameter_edges(ctx, graph)
    collectives, _ = planned_collectives(graph, classes, result, ctx)
    by_kind: dict[str, float] = {}
    comm = 0.0
    for c in collectives:
        t = c.count * steps_seconds([CollectiveStep(c.kind, c.mesh_axis, c.bytes)], ctx, bucketed=c.bucketed)
        by_kind[c.kind] = by_kind.get(c.kind, 0.0) + t
        comm += t
    compute = sum(cost.compute_s + cost.optimizer_s for cost in result.node_costs.values())
    hidden = _hidden(graph, result, ctx).seconds + _hidden_in_backward(graph, result, ctx)
    memory = MemoryParts()
    for cost in result.node_costs.values():
        memory = memory + cost.memory
    transient = backward_transient(graph.nodes, result.chosen, result.input_names, result.needs_grad,
                                   model_outputs(graph), ctx)
    estimate = MemoryEstimate(memory.params, memory.grads, memory.optimizer, memory.activations, memory.total,
                              transient, sharding_saved(graph, result, ctx), recompute_saved(graph, result, ctx))
    step = compute + comm - hidden
    mfu = model_flops_utilization(graph.nodes.values(), ctx.microbatches, step, math.prod(ctx.mesh_shape),
                                  ctx.device, ctx.optimizer.mixed_precision)
    return Prediction(step, compute, comm, estimate, by_kind, hidden_s=hidden, mfu=mfu), collectives


def _hidden_in_backward(graph: TracedGraph, result: IntraOpResult, ctx: CostContext) -> float:
    """The seconds the plan's collectives hide beside the backward, as its ILP's rows cost them."""
    fx_nodes, needs_grad = graph.fx_nodes, result.needs_grad
    return hidden_in_backward(graph, backward_windows(graph, result.input_names), result.chosen, result.node_costs,
                              needs_grad, lambda op, param: regathered(fx_nodes, needs_grad, op, param, ctx), ctx)


def _hidden(graph: TracedGraph, result: IntraOpResult, ctx: CostContext) -> HiddenGathers:
    return hidden_gathers(graph, result.input_names, result.chosen,
                          {name: cost.forward_s for name, cost in result.node_costs.items()}, ctx)


def prefetched_gathers(graph: TracedGraph, result: IntraOpResult, ctx: CostContext) -> list[PrefetchedGather]:
    """The gathers the program issues a block ahead, as the prediction hides them."""
    return [PrefetchedGather(at, [(op, pos) for op, pos in reads]) for at, reads in _hidden(graph, result, ctx).issued]


def node_plans(graph: TracedGraph, result: IntraOpResult) -> list[NodePlan]:
    return [NodePlan(name, graph.nodes[name].target, strategy.name, graph.nodes[name].module,
                     [spec_to_json(s) if s is not None else None for s in strategy.input_specs],
                     [spec_to_json(s) for s in strategy.output_specs],
                     [sorted(strategy.partial_axes(pos)) for pos in range(len(strategy.input_specs))])
            for name, strategy in result.chosen.items() if graph.nodes[name].kind == "op"]


def placements(graph: TracedGraph, result: IntraOpResult, kinds: tuple[str, ...]) -> dict[str, list[str]]:
    """Stored spec of every parameter/buffer (by FQN) or user input (by name)."""
    out: dict[str, list[str]] = {}
    for name, strategy in result.chosen.items():
        info = graph.nodes[name]
        if info.kind in kinds:
            out[info.fqn or name] = spec_to_json(strategy.output_spec)
    for alias, used in graph.tied.items():  # a tied weight is one parameter: report the used name's spec
        if alias in out and used in out:
            out[alias] = out[used]
    return out


def sharded_storage(graph: TracedGraph, result: IntraOpResult) -> dict[str, ParamStorage]:
    """The parameters (by FQN, tied names too) whose chosen storage shards the gradient or the
    optimizer state unlike the parameter (ZeRO-1/2), or the parameter itself held through the
    step."""
    out: dict[str, ParamStorage] = {}
    for name, strategy in result.chosen.items():
        info = graph.nodes[name]
        if info.kind == "parameter" and strategy.state_spec is not None:
            param = spec_to_json(strategy.output_spec)
            grad = spec_to_json(strategy.grad_spec) if strategy.grad_spec is not None else param
            out[info.fqn or name] = ParamStorage(param, grad, spec_to_json(strategy.state_spec), strategy.held)
    for alias, used in graph.tied.items():
        if used in out:
            out[alias] = out[used]
    return out


def solver_stats(result: IntraOpResult) -> SolverStats:
    s = result.solution
    return SolverStats(s.solver, s.status, s.gap, s.num_variables, s.num_constraints,
                       len(result.problem.costs), result.num_nodes, s.solve_time_s)


def single_stage(graph: TracedGraph, devices: int, mesh: tuple[int, ...], classes: NodeClasses) -> list[StagePlan]:
    ops = [name for name, info in graph.nodes.items() if info.kind == "op"]
    params = [info.fqn for info in graph.nodes.values() if info.kind in ("parameter", "buffer") and info.fqn]
    return [StagePlan(layers=list(classes.blocks) or ["all"], devices=list(range(devices)), mesh=list(mesh),
                      nodes=ops, params=params)]
