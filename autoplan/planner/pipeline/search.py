"""The stage search: for every microbatch count, sub-mesh and logical mesh, Alpa's stage DP over
layer ranges; the best pipelines searched again with their stage-internal boundaries costed."""

from __future__ import annotations

import math
import time

from autoplan.cost_models import collective_time
from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.planner.api import PlannerOptions
from autoplan.planner.meshes import candidate_meshes
from autoplan.planner.pipeline.candidates import PipelineCandidate, PipelineOptions
from autoplan.planner.pipeline.range_costs import (LayerCosts, RangeTable, cut_bytes, layer_costs, layer_inputs,
    link_between_stages, tied_layers)
from autoplan.planner.pipeline.schedules import INTERLEAVE, INTERLEAVED, activations_in_flight, pipeline_time
from autoplan.solvers.inter_op import (InterOpInfeasibleError, InterOpProblem, StageCost, SubMesh,
    candidate_submeshes, solve_inter_op)
from autoplan.trace.batch_coupling import batch_couplings, microbatch_split_refusal
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer, make_layers
from autoplan.trace.microbatch import batch_size, microbatch_inputs
from autoplan.trace.repeated import find_classes
from autoplan.trace.tracer import trace

MICROBATCH_CANDIDATES = 3  # the largest counts (smallest bubbles) the search tries, besides 1
REFINED = 3  # the best pipelines of the search are searched again with stage-internal boundaries costed


def search_submesh(graph: TracedGraph, layers: list[Layer], options: PlannerOptions, popts: PipelineOptions,
                    schedule: str, microbatches: int, submesh: SubMesh, meshes: list[tuple[int, ...]],
                    boundaries: bool = False, costs: dict[tuple[int, ...], LayerCosts] | None = None,
                    tied_meshes: list[tuple[int, ...]] | None = None) -> list[PipelineCandidate]:
    """The best pipelines on one sub-mesh shape, each stage on the fastest of ``meshes`` (its
    logical mesh) that fits; ``boundaries`` adds the correction of every boundary inside a
    stage (:meth:`LayerCosts.boundary`). Stages holding a tied parameter share one logical
    mesh: with several meshes, the DP runs once for each mesh those stages may take (each of
    ``tied_meshes``, default all), and each run's best is a candidate."""
    stages = options.devices // submesh.size
    # interleaved: the exact plans count each of a rank's INTERLEAVE chunks as a stage
    in_flight = activations_in_flight(schedule, microbatches, stages * (INTERLEAVE if schedule in INTERLEAVED else 1))
    if costs is None:
        costs = {}
    for mesh in meshes:
        if mesh not in costs:
            costs[mesh] = layer_costs(options, mesh, microbatches, in_flight)
    reads = layer_inputs(graph, layers)
    tables = {mesh: RangeTable(graph, layers, costs[mesh], boundaries, reads) for mesh in meshes}
    link = link_between_stages(options, submesh)
    boundary = cut_bytes(graph, layers)
    budget = options.memory_budget
    tied = tied_layers(graph, layers)

    def stage_cost(start: int, end: int, allowed: list[tuple[int, ...]]) -> StageCost:
        send = 2 * collective_time("send_recv", boundary[end], 2, link) if end < len(layers) else 0.0
        best, best_rank = None, None
        for mesh in allowed:
            seconds, memory = tables[mesh].cost(start, end, budget)
            fits = budget is None or memory <= budget
            rank = (not fits, seconds if fits else memory)  # the fastest that fits, else the leanest
            if best_rank is None or rank < best_rank:
                best, best_rank = StageCost(seconds / microbatches + send, memory, logical_mesh=mesh), rank
        assert best is not None
        return best

    nodes, per_node = cluster_shape(options)
    problem = InterOpProblem(len(layers), nodes, per_node, microbatches, budget, pinned_stages=stages,
                             submeshes=(submesh,))
    found = []
    for tied_mesh in ((tied_meshes or meshes) if tied and len(meshes) > 1 else [None]):
        def cost_fn(start: int, end: int, candidate: SubMesh, tied_mesh: tuple[int, ...] | None = tied_mesh
                    ) -> StageCost:
            if candidate != submesh:
                return StageCost(0.0, 0.0, feasible=False)
            holds_tied = tied_mesh is not None and any(start <= i < end for i in tied)
            return stage_cost(start, end, [tied_mesh] if holds_tied else meshes)

        try:
            solution = solve_inter_op(problem, cost_fn)
        except InterOpInfeasibleError:
            continue
        latencies = [s.cost.latency_s for s in solution.stages]
        found.append(PipelineCandidate(microbatches, submesh, [s.cost.logical_mesh for s in solution.stages],
                                [(s.start, s.end) for s in solution.stages],
                                pipeline_time(latencies, microbatches, "1f1b" if schedule in INTERLEAVED else schedule),
                                graph, layers, schedule, costs, boundaries, tied_mesh=tied_mesh))
    return found


def cluster_shape(options: PlannerOptions) -> tuple[int, int]:
    """(nodes, devices per node) of the devices planned for."""
    per_node = min(options.cluster.devices_per_node, options.devices)
    if options.devices % per_node:
        raise AutoplanError(f"{options.devices} devices do not fill nodes of {per_node}: use a multiple of "
                            f"{per_node} devices or set --devices-per-node")
    return options.devices // per_node, per_node


def submeshes(options: PlannerOptions, popts: PipelineOptions, num_layers: int) -> list[SubMesh]:
    nodes, per_node = cluster_shape(options)
    out = []
    for sm in candidate_submeshes(nodes, per_node):
        if options.devices % sm.size:
            continue
        stages = options.devices // sm.size
        if stages > num_layers or (popts.stages is not None and stages != popts.stages):
            continue
        out.append(sm)
    return out


def stage_meshes(options: PlannerOptions, submesh: SubMesh) -> list[tuple[int, ...]]:
    """Logical meshes of a sub-mesh: a pinned one, or (size,) and the 2-D shapes whose inner
    axis stays inside a node."""
    if options.mesh is not None:
        return [options.mesh] if math.prod(options.mesh) == submesh.size else []
    return [m for m in candidate_meshes(submesh.size) if len(m) == 1 or m[1] <= submesh.devices]


def microbatch_candidates(spec: ModelSpec, popts: PipelineOptions) -> list[int]:
    if popts.microbatches is not None:
        return [popts.microbatches]
    batch = batch_size(spec.example_inputs)
    found = [batch // size for size in (1, 2, 4, 8, 16, 32, 64) if batch % size == 0 and 1 < batch // size <= 512]
    return sorted(set(found[:MICROBATCH_CANDIDATES]) | {1})


def trace_microbatch(spec: ModelSpec, microbatches: int) -> TracedGraph:
    return trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, microbatches)))


def search_pipelines(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions,
                     ) -> tuple[list[PipelineCandidate], float]:
    """Every feasible pipeline candidate (best per microbatch count and sub-mesh), and the
    seconds spent tracing."""
    schedules = [popts.schedule] if popts.schedule else ["1f1b"]
    candidates: list[PipelineCandidate] = []
    trace_s = 0.0
    refusal: str | None = None
    for microbatches in microbatch_candidates(spec, popts):
        if refusal is not None and microbatches > 1:
            continue  # cutting this batch into microbatches would change what the model computes
        start = time.perf_counter()
        graph = trace_microbatch(spec, microbatches)
        trace_s += time.perf_counter() - start
        refusal = microbatch_split_refusal(batch_couplings(graph))
        if refusal is not None and microbatches > 1:
            raise AutoplanError(f"{microbatches} microbatches would change what the model computes: {refusal}; "
                                f"use one microbatch (--microbatches 1)")
        layers = make_layers(graph, find_classes(graph), popts.layers)
        if popts.stages and popts.stages > len(layers):
            raise AutoplanError(f"--stages {popts.stages} needs at least {popts.stages} layers and the model cuts into "
                                f"{len(layers)} ({', '.join(layer.name for layer in layers)}): choose at most "
                                f"{len(layers)} stages, or cut finer with --layers")
        for schedule in schedules:
            for submesh in submeshes(options, popts, len(layers)):
                if (microbatches == 1) != (submesh.size == options.devices) and popts.microbatches is None:
                    continue  # one microbatch only without a pipeline; a pipeline only with several
                meshes = stage_meshes(options, submesh)
                if not meshes:
                    continue
                # interleaved chunks are cut after the search, so they share one logical mesh
                for group in [[m] for m in meshes] if schedule in INTERLEAVED else [meshes]:
                    candidates += search_submesh(graph, layers, options, popts, schedule, microbatches, submesh,
                                                  group)
    return refine(candidates, options, popts), trace_s


def refine(candidates: list[PipelineCandidate], options: PlannerOptions, popts: PipelineOptions) -> list[PipelineCandidate]:
    """Search the ``REFINED`` best pipelines again with the boundaries inside their stages
    costed (two ILPs more per distinct pair of adjacent layers, so not for every sub-mesh);
    best first."""
    candidates = sorted(candidates, key=lambda c: c.step_time_s)
    for i, c in enumerate(candidates[:REFINED]):
        again = search_submesh(c.graph, c.layers, options, popts, c.schedule, c.microbatches, c.submesh,
                                list(c.costs or {}), boundaries=True, costs=c.costs,
                                tied_meshes=[c.tied_mesh] if c.tied_mesh else None)
        if again:
            candidates[i] = again[0]
    return sorted(candidates, key=lambda c: c.step_time_s)
