"""The intra-op planner: one traced graph on every candidate logical mesh.

trace → classes of repeated layers → for each candidate mesh: strategies, costs, ILP →
keep the cheapest plan that fits the memory budget; the other meshes become alternatives.
The front door that also searches pipelines is :mod:`autoplan.planner.front_door`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from autoplan.cost_models import ClusterSpec, OptimizerSpec
from autoplan.cost_models.backward_overlap import overlaps_regathers
from autoplan.cost_models.step_costs import CostContext
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Alternative, Plan
from autoplan.planner.assemble import (node_plans, placements, predict, prefetched_gathers, sharded_storage, single_stage,
    solver_stats)
from autoplan.planner.mesh_plan import IntraOpResult, emit_warnings, plan_intra_op
from autoplan.planner.meshes import candidate_meshes, mesh_label
from autoplan.planner.options import PlannerOptions, PlanOptions
from autoplan.planner.pins import PinKind
from autoplan.planner.recompute import (RecomputeMode, every_layer, lighter_mode, policy_mode, recomputable,
    recomputed_layers, regions, saved_outputs)
from autoplan.solvers import explain, format_bytes
from autoplan.trace.batch_coupling import coupling_plans
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer, make_layers
from autoplan.trace.repeated import NodeClasses, find_classes
from autoplan.trace.tracer import trace


@dataclass
class MeshOutcome:
    mesh: tuple[int, ...]
    result: IntraOpResult | None
    ctx: CostContext | None
    error: str = ""
    least_memory: float | None = None


def _solve_mesh(graph: TracedGraph, classes: NodeClasses, mesh: tuple[int, ...], options: PlannerOptions,
                canonical: bool = True, recomputed: Sequence[Layer] = (), selective: Sequence[Layer] = (),
                optimum: IntraOpResult | None = None) -> MeshOutcome:
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device, options.optimizer,
                      recompute_regions=regions(recomputed),
                      recompute_saved=saved_outputs(graph, selective, lighter_mode(options.recompute)))
    try:
        result = plan_intra_op(graph, classes, mesh, ctx, options.memory_budget, options.solver,
                               options.time_limit_s, options.pick, options.allow_storage, canonical, options.pins,
                               optimum=optimum)
    except MemoryInfeasibleError as e:
        return MeshOutcome(mesh, None, None, str(e), e.least_memory_bytes)
    return MeshOutcome(mesh, result, ctx)


def plan_traced(graph: TracedGraph, options: PlannerOptions, model_name: str = "",
                timings: dict[str, float] | None = None) -> Plan:
    """Plan an already traced graph."""
    timings = dict(timings or {})
    start = time.perf_counter()
    classes = find_classes(graph)
    if options.mesh and math.prod(options.mesh) != options.devices:
        raise AutoplanError(f"mesh {mesh_label(options.mesh)} holds {math.prod(options.mesh)} devices but devices is "
                            f"{options.devices}: make them agree (a smaller mesh is a pipeline stage's: pass --stages)")
    meshes = [options.mesh] if options.mesh else candidate_meshes(options.devices)
    if options.pins:  # the meshes on which the user's pins hold
        meshes = [m for m in meshes if options.pins.mesh_allowed(m)]
    recomputed: list[Layer] = []
    selective: list[Layer] = []
    pinned = options.pins.of_kind(PinKind.CHECKPOINT) if options.pins else []
    every = every_layer(options.recompute)
    if every or pinned:  # every layer that may be, or the pinned ones (fully)
        layers = make_layers(graph, classes)
        chosen = recomputable(graph, layers) if every else frozenset()
        fully = options.pins.checkpointed_layers(graph, layers) if pinned else frozenset()
        recomputed = [layers[i] for i in sorted(chosen | fully)]
        if policy_mode(options.recompute) != RecomputeMode.FULL:
            selective = [layers[i] for i in sorted(chosen - fully)]
    # each mesh's optimum decides the mesh; only the chosen mesh's ties are broken canonically
    outcomes = [_solve_mesh(graph, classes, mesh, options, options.canonical and len(meshes) == 1, recomputed,
                            selective) for mesh in meshes]
    feasible = [o for o in outcomes if o.result is not None]
    if not feasible:
        least = min(o.least_memory for o in outcomes if o.least_memory is not None)
        # a mesh's least is a lower bound: above the budget it is the reason; below it, the
        # backward's transients (peak rows) are what no plan fits
        need = (f"the least any plan needs is {format_bytes(least)}" if least > options.memory_budget else
                f"every plan needs more with the backward's transients (at least {format_bytes(least)})")
        raise MemoryInfeasibleError(
            f"no plan fits {format_bytes(options.memory_budget)} per device on "
            f"{', '.join(mesh_label(m) for m in meshes)}: {need}; "
            f"give more memory (--memory-per-device) or more devices", least)
    predictions = {o.mesh: predict(graph, classes, o.result, o.ctx) for o in feasible}
    best = min(feasible, key=lambda o: predictions[o.mesh][0].step_time_s)
    if options.canonical and len(meshes) > 1 and options.pick is None:
        canonical = _solve_mesh(graph, classes, best.mesh, options, recomputed=recomputed, selective=selective,
                                optimum=best.result)
        if canonical.result is not None:
            outcomes[outcomes.index(best)] = best = canonical
            feasible = [o for o in outcomes if o.result is not None]
            predictions[best.mesh] = predict(graph, classes, best.result, best.ctx)
    solve_s = sum(o.result.solution.solve_time_s for o in feasible)
    timings["solve"] = solve_s
    timings["strategies"] = time.perf_counter() - start - solve_s
    timings["total"] = sum(timings.get(k, 0.0) for k in ("load", "trace", "strategies", "solve"))
    alternatives = []
    for o in outcomes:
        if o is best:
            continue
        if o.result is None:
            alternatives.append(Alternative(f"mesh {mesh_label(o.mesh)}", list(o.mesh), None, f"infeasible: {o.error}"))
        else:
            alternatives.append(Alternative(f"mesh {mesh_label(o.mesh)}", list(o.mesh), predictions[o.mesh][0]))
    prediction, collectives = predictions[best.mesh]
    result = best.result
    emit_warnings(result.warnings)
    return Plan(
        graph_hash=graph.graph_hash,
        devices=options.devices,
        cluster=options.cluster.to_dict(),
        mesh=list(best.mesh),
        stages=single_stage(graph, options.devices, best.mesh, classes),
        microbatches=1,
        schedule="none",
        params=placements(graph, result, ("parameter", "buffer")),
        storage=sharded_storage(graph, result),
        inputs=placements(graph, result, ("input",)),
        nodes=node_plans(graph, result),
        collectives=collectives,
        predicted=prediction,
        alternatives=alternatives,
        solver=solver_stats(result),
        timings_s=timings,
        warnings=list(result.warnings),
        model=model_name,
        explanation=explain(result.problem, result.solution, top=8),
        batch_coupling=coupling_plans(graph, 1),
        recompute=recomputed_layers(recomputed, selective, lighter_mode(options.recompute)),
        prefetch=prefetched_gathers(graph, result, best.ctx),
        prefetch_regathers=overlaps_regathers(best.ctx),
    )


def plan_spec(spec: ModelSpec, options: PlannerOptions, timings: dict[str, float] | None = None) -> tuple[Plan, TracedGraph]:
    timings = dict(timings or {})
    start = time.perf_counter()
    graph = trace(spec)
    timings["trace"] = time.perf_counter() - start
    return plan_traced(graph, options, spec.name, timings), graph


def make_options(devices: int, cluster: str | ClusterSpec = "h100", mesh: tuple[int, ...] | None = None,
                 memory_per_device: float | str | None = None, devices_per_node: int | None = None,
                 optimizer: OptimizerSpec | None = None, solver: str = "highs",
                 time_limit_s: float | None = None) -> PlannerOptions:
    """The intra-op pass's options, validated as :class:`PlanOptions` validates them (for
    callers that run one pass by hand: benchmarks, tests)."""
    checked = PlanOptions(devices, cluster, mesh, memory_per_device, devices_per_node, solver=solver,
                          time_limit_s=time_limit_s, plan_only=True)
    return replace(checked.planner_options(), optimizer=optimizer or OptimizerSpec())
