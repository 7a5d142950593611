"""The planner's front door: model in, :class:`Plan` out.

trace → classes of repeated layers → for each candidate mesh: strategies, costs, ILP →
keep the cheapest plan that fits the memory budget; the other meshes become alternatives.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autoplan.cost_models import ClusterSpec, OptimizerSpec, load_cluster
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.assemble import (
    node_plans,
    placements,
    predict,
    single_stage,
    solver_stats,
)
from autoplan.cost_models.step_costs import CostContext
from autoplan.trace.graph import TracedGraph
from autoplan.planner.mesh_plan import IntraOpResult, StorageRule, emit_warnings, plan_intra_op
from autoplan.trace.repeated import NodeClasses, find_classes
from autoplan.load import ModelSpec, make_model_spec
from autoplan.planner.meshes import candidate_meshes, mesh_label
from autoplan.plan_schema import Alternative, Plan
from autoplan.trace.tracer import trace
from autoplan.solvers import explain, format_bytes


@dataclass(frozen=True)
class PlannerOptions:
    """How to plan: the cluster, the meshes to try, the memory budget and the solver."""

    devices: int
    cluster: ClusterSpec
    mesh: tuple[int, ...] | None = None  # pin one logical mesh; None tries them all
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    solver: str = "highs"
    time_limit_s: float | None = None
    pick: Callable[[int, list[str]], int] | None = None  # replaces the ILP: group, choice names -> index
    allow_storage: StorageRule | None = None  # restricts the specs of parameters, buffers and inputs
    remat: bool = False  # cost activation checkpointing (the emitted program does not checkpoint yet)

    @property
    def memory_budget(self) -> float:
        return self.cluster.device.memory_bytes


@dataclass
class MeshOutcome:
    mesh: tuple[int, ...]
    result: IntraOpResult | None
    ctx: CostContext | None
    error: str = ""
    least_memory: float | None = None


def _solve_mesh(graph: TracedGraph, classes: NodeClasses, mesh: tuple[int, ...], options: PlannerOptions
                ) -> MeshOutcome:
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device, options.optimizer,
                      remat=options.remat)
    try:
        result = plan_intra_op(graph, classes, mesh, ctx, options.memory_budget, options.solver,
                               options.time_limit_s, options.pick, options.allow_storage)
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
    outcomes = [_solve_mesh(graph, classes, mesh, options) for mesh in meshes]
    feasible = [o for o in outcomes if o.result is not None]
    if not feasible:
        least = min(o.least_memory for o in outcomes if o.least_memory is not None)
        raise MemoryInfeasibleError(
            f"no plan fits {format_bytes(options.memory_budget)} per device on "
            f"{', '.join(mesh_label(m) for m in meshes)}: the least any plan needs is {format_bytes(least)}; "
            f"give more memory (--memory-per-device) or more devices", least)
    predictions = {o.mesh: predict(graph, classes, o.result, o.ctx) for o in feasible}
    best = min(feasible, key=lambda o: predictions[o.mesh][0].step_time_s)
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
    )


def plan_spec(spec: ModelSpec, options: PlannerOptions, timings: dict[str, float] | None = None) -> tuple[Plan, TracedGraph]:
    timings = dict(timings or {})
    start = time.perf_counter()
    graph = trace(spec)
    timings["trace"] = time.perf_counter() - start
    return plan_traced(graph, options, spec.name, timings), graph


def plan(model: torch.nn.Module | Callable[[], torch.nn.Module], example_inputs: Any, devices: int = 8,
         cluster: str | ClusterSpec = "h100", mesh: tuple[int, ...] | None = None,
         loss_fn: Callable[..., torch.Tensor] | None = None, memory_per_device: float | None = None,
         devices_per_node: int | None = None, optimizer: OptimizerSpec | None = None, solver: str = "highs",
         time_limit_s: float | None = None) -> Plan:
    """Plan ``model`` (an nn.Module, on any device including ``meta``) for ``devices`` devices.

    ``example_inputs`` is one global batch (a tensor or a tuple of tensors); ``loss_fn(output,
    *inputs)`` returns the scalar loss (default: ``output.loss`` if present, else the mean of
    the first output). ``cluster`` is a preset name, a TOML file, or a :class:`ClusterSpec`.
    """
    spec = make_model_spec(model, example_inputs, loss_fn)
    options = make_options(devices, cluster, mesh, memory_per_device, devices_per_node, optimizer, solver,
                           time_limit_s)
    return plan_spec(spec, options)[0]


def make_options(devices: int, cluster: str | ClusterSpec = "h100", mesh: tuple[int, ...] | None = None,
                 memory_per_device: float | None = None, devices_per_node: int | None = None,
                 optimizer: OptimizerSpec | None = None, solver: str = "highs",
                 time_limit_s: float | None = None) -> PlannerOptions:
    if devices < 1:
        raise AutoplanError(f"--devices must be at least 1, got {devices}")
    spec = cluster if isinstance(cluster, ClusterSpec) else load_cluster(cluster)
    spec = spec.with_overrides(devices_per_node=devices_per_node, memory_per_device=memory_per_device)
    if mesh is not None and devices % math.prod(mesh):
        raise AutoplanError(f"mesh {mesh_label(mesh)} holds {math.prod(mesh)} devices, which does not divide "
                            f"{devices} devices: make them agree")
    return PlannerOptions(devices, spec, tuple(mesh) if mesh else None, optimizer or OptimizerSpec(), solver,
                          time_limit_s)
