"""The stage search: for every microbatch count, sub-mesh and logical mesh, Alpa's stage DP over
layer ranges; the best pipelines searched again with their stage-internal boundaries costed."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

from autoplan.cost_models import LinkSpec, collective_time
from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.planner.api import PlannerOptions
from autoplan.planner.meshes import candidate_meshes
from autoplan.planner.pins import PinKind
from autoplan.planner.pipeline.candidates import PipelineCandidate, PipelineOptions
from autoplan.planner.pipeline.range_costs import (LayerCosts, RangeTable, cut_bytes, layer_costs, layer_inputs,
    link_between_stages, tied_layers, whole_below, whole_crossings)
from autoplan.planner.pipeline.schedules import (INTERLEAVE, INTERLEAVED, Schedule, activations_in_flight,
    ranks_time)
from autoplan.planner.recompute import RecomputeMode, RecomputePolicy, recomputable
from autoplan.planner.workers import TaskPool
from autoplan.solvers.inter_op import (InterOpInfeasibleError, InterOpProblem, StageCost, SubMesh,
    candidate_submeshes, solve_inter_op)
from autoplan.trace.batch_coupling import batch_couplings, microbatch_split_refusal
from autoplan.trace.deepen import deepened_trace, repeated_stacks
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer, make_layers
from autoplan.trace.microbatch import batch_size, microbatch_inputs
from autoplan.trace.repeated import find_classes
from autoplan.trace.rescale import BatchSizeGraphs
from autoplan.trace.tracer import describe, trace

MICROBATCH_CANDIDATES = 3  # the largest counts (smallest bubbles) the search tries, besides 1
PIPELINE_FILL = 4  # a pipeline of S stages is also searched with the fewest microbatches of at least 4·S
INTERLEAVED_RIVALS = 3  # the best 1F1B pipelines searched again interleaved, where no schedule is pinned
REFINED = 3  # the best pipelines of the search are searched again with stage-internal boundaries costed
REFINED_DEPTH_MARGIN = 1.0  # and the best of every other depth estimated within this share over the best
BoundaryCorrections = dict[tuple[str, str], float]  # LayerCosts.pairs
PairRecomputation = dict[tuple[str, str, RecomputeMode], float]  # LayerCosts.recompute_in_pair


def search_submesh(graph: TracedGraph, layers: list[Layer], options: PlannerOptions, popts: PipelineOptions,
                    schedule: str, microbatches: int, submesh: SubMesh, meshes: list[tuple[int, ...]],
                    boundaries: bool = False, costs: dict[tuple[int, ...], LayerCosts] | None = None,
                    tied_meshes: list[tuple[int, ...]] | None = None) -> list[PipelineCandidate]:
    """The best pipelines on one sub-mesh shape, each stage on the fastest of ``meshes`` (its
    logical mesh) that fits; ``boundaries`` adds the correction of every boundary inside a
    stage (:meth:`LayerCosts.boundary`). Stages holding a tied parameter share one logical
    mesh: with several meshes, the DP runs once for each mesh those stages may take (each of
    ``tied_meshes``, default all), and each run's best is a candidate. One stage on all the
    devices has a candidate per logical mesh: its estimates err by mesh (a 1-D mesh across
    nodes recomputing every layer, estimated faster than HSDP on its 2-D one, is slower
    planned exactly), so the exact plans settle between them."""
    stages = options.devices // submesh.size
    # interleaved: the exact plans count each of a rank's INTERLEAVE chunks as a stage
    in_flight = activations_in_flight(schedule, microbatches, stages * (INTERLEAVE if schedule in INTERLEAVED else 1))
    if costs is None:
        costs = {}
    for mesh in meshes:
        if mesh not in costs:
            costs[mesh] = layer_costs(options, mesh, microbatches, in_flight, stages)
    # what each layer receives and each cut sends, as values cross between stages of a mesh
    below = whole_below(options)  # smaller values cross whole
    reads = {mesh: layer_inputs(graph, layers, options.optimizer.mixed_precision, mesh, below) for mesh in meshes}
    may_recompute = recomputable(graph, layers)
    link = link_between_stages(options, submesh)
    boundary = {mesh: cut_bytes(graph, layers, mesh, below=below) for mesh in meshes}
    budget = options.memory_budget
    tied = tied_layers(graph, layers)
    nodes, per_node = cluster_shape(options)
    layer_stages = options.pins.layer_stages(graph, layers) if options.pins else ()
    if not stage_pins_fit(len(layers), stages, layer_stages):
        return []  # this many stages cannot hold the stage pins (e.g. too many after the last pinned layer)
    problem = InterOpProblem(len(layers), nodes, per_node, microbatches, budget, pinned_stages=stages,
                             submeshes=(submesh,), layer_stages=layer_stages)
    found: list[PipelineCandidate] = []
    # with recomputation chosen under memory, the DP also runs without it: its estimates of
    # trimmed ranges run high where those of recomputed ranges do not (see _trimmed_rival)
    policies = [RecomputePolicy.NONE, RecomputePolicy.AUTO] if options.recompute == RecomputePolicy.AUTO \
        else [options.recompute]
    for policy in policies:
        tables = {mesh: RangeTable(graph, layers, costs[mesh], boundaries, reads[mesh], policy, may_recompute)
                  for mesh in meshes}

        def stage_cost(start: int, end: int, allowed: list[tuple[int, ...]],
                       tables: dict[tuple[int, ...], RangeTable] = tables) -> StageCost:
            best, best_rank = None, None
            for mesh in allowed:  # (the next stage on the same logical mesh: values cross as shards)
                send = 2 * collective_time("send_recv", boundary[mesh][end], 2, link) if end < len(layers) else 0.0
                seconds, memory = tables[mesh].cost(start, end, budget)
                latency = seconds / microbatches + send
                fits = budget is None or memory <= budget
                rank = (not fits, latency if fits else memory)  # the fastest that fits, else the leanest
                if best_rank is None or rank < best_rank:
                    best, best_rank = StageCost(latency, memory, logical_mesh=mesh), rank
            assert best is not None
            return best

        # each run pins the meshes some stages may take: one stage, each mesh in turn; the stages
        # holding a tied parameter, each mesh they may share; else none (every stage its fastest)
        per_mesh = stages == 1 and len(meshes) > 1
        runs: list[list[tuple[int, ...]] | None] = [[m] for m in meshes] if per_mesh else \
            [[m] for m in (tied_meshes or meshes)] if tied and len(meshes) > 1 else [None]
        for pinned in runs:
            def cost_fn(start: int, end: int, candidate: SubMesh, pinned: list[tuple[int, ...]] | None = pinned,
                        stage_cost=stage_cost) -> StageCost:
                if candidate != submesh:
                    return StageCost(0.0, 0.0, feasible=False)
                held = pinned is not None and (per_mesh or any(start <= i < end for i in tied))
                return stage_cost(start, end, pinned if held else meshes)

            try:
                solution = solve_inter_op(problem, cost_fn)
            except InterOpInfeasibleError:
                continue
            ranges = [tables[s.cost.logical_mesh].plan(s.start, s.end, budget) for s in solution.stages]
            recomputed = frozenset().union(*(r.recomputed for r in ranges))
            selective = frozenset().union(*(r.selective for r in ranges))
            cuts = [(s.start, s.end) for s in solution.stages]
            logical = [s.cost.logical_mesh for s in solution.stages]
            latencies = whole_sends(graph, layers, cuts, logical, [s.cost.latency_s for s in solution.stages],
                                    boundary, link, below)
            if any(c.cuts == cuts and c.meshes == logical and c.recomputed == recomputed and c.selective == selective
                   for c in found):
                continue  # the run without recomputation found it too
            step = ranks_time(latencies, microbatches, schedule)
            # the tied parameter's mesh: the pinned one, or one stage's only mesh
            one_stage_mesh = per_mesh or (len(meshes) == 1 and len(cuts) == 1)
            shared = None if not tied else logical[0] if one_stage_mesh else pinned[0] if pinned else None
            found.append(PipelineCandidate(microbatches, submesh, logical, cuts, step, graph, layers, schedule, costs,
                                           boundaries, recomputed, selective, tied_mesh=shared))
    return found


def whole_sends(graph: TracedGraph, layers: list[Layer], cuts: list[tuple[int, int]],
                meshes: list[tuple[int, ...]], latencies: list[float], boundary: dict[tuple[int, ...], list[float]],
                link: LinkSpec, below: float) -> list[float]:
    """``latencies`` (per microbatch) with each stage's send costed as the exact plan costs it
    where values cross whole, on their way between stages on different logical meshes
    (:func:`whole_crossings`; :func:`~autoplan.planner.pipeline.assemble.assemble_pipeline`):
    the DP knows a stage's mesh, not its neighbours', and costed every value as leaving in
    shards of the sender's mesh (``boundary``). (What the receiving stage's layers read is left
    as they were costed: received as shards.)"""
    whole = whole_crossings(graph, layers, cuts, meshes)
    if not whole:
        return latencies
    crossing: dict[tuple[int, ...], list[float]] = {}
    out = list(latencies)
    for k, ((_, end), mesh) in enumerate(zip(cuts, meshes)):
        if end < len(layers):
            if mesh not in crossing:
                crossing[mesh] = cut_bytes(graph, layers, mesh, whole, below)
            out[k] += 2 * (collective_time("send_recv", crossing[mesh][end], 2, link)
                           - collective_time("send_recv", boundary[mesh][end], 2, link))
    return out


def stage_pins_fit(num_layers: int, stages: int, layer_stages: tuple[tuple[int, int], ...]) -> bool:
    """Whether a pipeline of ``stages`` stages over ``num_layers`` layers can obey the stage pins."""
    if not layer_stages:
        return True
    try:
        InterOpProblem(num_layers, 1, 1, 1, pinned_stages=stages, layer_stages=layer_stages)
    except ValueError:
        return False
    return True


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
        if options.pins and stages < options.pins.least_stages:
            continue  # a stage pin names a later stage
        out.append(sm)
    return out


def pinned_layers(graph: TracedGraph, popts: PipelineOptions, options: PlannerOptions) -> list[Layer]:
    """The graph's layers, their signatures telling apart layers pinned differently."""
    layers = make_layers(graph, find_classes(graph), popts.layers)
    return options.pins.sign_layers(graph, layers) if options.pins else layers


def stage_meshes(options: PlannerOptions, submesh: SubMesh) -> list[tuple[int, ...]]:
    """Logical meshes of a sub-mesh: a pinned one, or (size,) and the 2-D shapes whose inner
    axis stays inside a node."""
    if options.mesh is not None:
        meshes = [options.mesh] if math.prod(options.mesh) == submesh.size else []
    else:
        meshes = [m for m in candidate_meshes(submesh.size) if len(m) == 1 or m[1] <= submesh.devices]
    return [m for m in meshes if options.pins is None or options.pins.mesh_allowed(m)]


def microbatch_candidates(spec: ModelSpec, popts: PipelineOptions) -> list[int]:
    if popts.microbatches is not None:
        return [popts.microbatches]
    batch = batch_size(spec.example_inputs)
    found = [batch // size for size in (1, 2, 4, 8, 16, 32, 64) if batch % size == 0 and 1 < batch // size <= 512]
    return sorted(set(found[:MICROBATCH_CANDIDATES]) | {1})


def trace_microbatch(spec: ModelSpec, microbatches: int) -> TracedGraph:
    return trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, microbatches)))


def microbatch_graphs(spec: ModelSpec) -> BatchSizeGraphs:
    """The model's graphs by microbatch size: traced, written from traces of the first blocks
    of its repeated stack (:mod:`autoplan.trace.deepen`), or rescaled from two traces
    (:mod:`autoplan.trace.rescale`)."""
    batch = batch_size(spec.example_inputs)
    stacks = repeated_stacks(spec.module)
    deepen = None if not stacks else \
        (lambda size: deepened_trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, batch // size)), stacks))
    return BatchSizeGraphs(lambda size: trace_microbatch(spec, batch // size),
                           lambda gm, exported: describe(gm, exported, spec.module), deepen)


def search_pipelines(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions,
                     ) -> tuple[list[PipelineCandidate], BatchSizeGraphs]:
    """Every feasible pipeline candidate (best per microbatch count and sub-mesh), and the
    graphs searched (some rescaled rather than traced). The sub-mesh searches run in up to
    ``options.jobs`` processes (:mod:`autoplan.planner.workers`): the whole batch's as soon as
    its graph is traced, each other where a process is free once its graph is written (the
    longest first), the rest together once every graph is; the answer does not depend on
    their number, nor on which started first."""
    graphs = microbatch_graphs(spec)
    batch = batch_size(spec.example_inputs)
    tasks: list[SearchTask] = []
    pool = search_pool(tasks, options)
    later: list[SearchTask] = []
    accumulating: list[SearchTask] = []  # searched if the whole batch does not fit one stage
    whole_batch: list[int] = []  # the pool's indices of the one-stage searches of the whole batch

    started: dict[int, int] = {}  # id(task) -> its index in the pool

    def submit(found: list[SearchTask]) -> list[int]:
        """Submit ``found``, the longest first (so that the processes end together); their indices."""
        indices = []
        for task in sorted(found, key=lambda t: -t.weight):
            tasks.append(task)  # before submitting: a finished task's answer is matched to it
            started[id(task)] = pool.submit(partial(task.run, options, popts))
            indices.append(started[id(task)])
        return indices

    def fill(waiting: list[SearchTask]) -> None:
        """Start the longest of ``waiting`` not started where a process is free (while the next
        graph is written); the rest start together later, the longest first."""
        for task in sorted(waiting, key=lambda t: -t.weight):
            if pool.free_places() == 0:
                return
            if id(task) not in started:
                submit([task])

    refusal: str | None = None
    counts = microbatch_candidates(spec, popts)
    for microbatches in counts:
        if refusal is not None and microbatches > 1:
            continue  # cutting this batch into microbatches would change what the model computes
        if microbatches > 1:
            graphs.base(batch // counts[-1])  # the second base: the smallest microbatch, often the best
        graph = graphs.get(batch // microbatches)
        refusal = microbatch_split_refusal(batch_couplings(graph))
        if refusal is not None and microbatches > 1:
            raise AutoplanError(f"{microbatches} microbatches would change what the model computes: {refusal}; "
                                f"use one microbatch (--microbatches 1)")
        layers = pinned_layers(graph, popts, options)
        if popts.stages and popts.stages > len(layers):
            raise AutoplanError(f"--stages {popts.stages} needs at least {popts.stages} layers and the model cuts into "
                                f"{len(layers)} ({', '.join(layer.name for layer in layers)}): choose at most "
                                f"{len(layers)} stages, or cut finer with --layers")
        found = count_tasks(graph, layers, microbatches, options, popts)
        if microbatches == 1:  # searched while the other microbatch sizes are traced
            whole_batch = submit(found)
        else:
            later += found
            fill(later)
            accumulating += accumulation_tasks(graph, layers, microbatches, options, popts)
    if refusal is None:
        for microbatches, depths in filling_counts(batch, options, popts, len(layers), counts).items():
            graph = graphs.get(batch // microbatches)
            later += count_tasks(graph, pinned_layers(graph, popts, options), microbatches, options, popts, depths)
            fill(later)
    plainly = [c for i in whole_batch for c in pool.answer(i) if options.recompute != "auto" or not c.recomputed]
    if refusal is None and not plainly:
        later += accumulating  # the whole batch does not fit one stage without recomputation
    submit([t for t in later if id(t) not in started])
    answers = pool.results()
    # in the order of one process (the whole batch's, then the longest first), whatever started early
    found = [c for i in whole_batch + [started[id(t)] for t in sorted(later, key=lambda t: -t.weight)]
             for c in answers[i]]
    rivals = interleaved_tasks(found, options, popts)
    again = search_pool(rivals, options)
    for task in rivals:
        again.submit(partial(task.run, options, popts))
    found += [c for cs in again.results() for c in cs]
    return refine(found, options, popts), graphs


def interleaved_tasks(found: list[PipelineCandidate], options: PlannerOptions, popts: PipelineOptions
                      ) -> list[SearchTask]:
    """Where no schedule is pinned, the ``INTERLEAVED_RIVALS`` best 1F1B pipelines of several
    stages on one logical mesh (distinct in microbatches, sub-mesh and mesh) searched again
    under the interleaved 1F1B schedule: its bubble is a chunk's, half a rank's, and each rank
    keeps about half as many microbatches' activations again in flight
    (:func:`~autoplan.planner.pipeline.schedules.activations_in_flight`), so it wins where the
    bubble weighs more than memory (Llama 3.1 405B on 512 H100s, torchtitan's recipe). Its
    chunks are cut after the search (:func:`~autoplan.planner.pipeline.candidates.interleave`),
    on the mesh of the rank, so only pipelines whose stages share one mesh, with at least
    ``INTERLEAVE`` layers per stage, are searched so; and none where stage pins place layers
    (the chunks are cut evenly, whatever the pins say)."""
    if popts.schedule is not None or (options.pins and options.pins.of_kind(PinKind.STAGE)):
        return []
    tasks: list[SearchTask] = []
    seen: set[tuple] = set()
    for c in sorted(found, key=lambda c: c.step_time_s):
        if len(tasks) >= INTERLEAVED_RIVALS:
            break
        key = (c.microbatches, c.submesh, c.meshes[0])
        if len(c.cuts) < 2 or len(set(c.meshes)) > 1 or len(c.layers) < INTERLEAVE * len(c.cuts) or key in seen:
            continue
        seen.add(key)
        tasks.append(SearchTask(c.graph, c.layers, Schedule.INTERLEAVED_1F1B, c.microbatches, c.submesh,
                                [c.meshes[0]]))
    return tasks


def accumulation_tasks(graph: TracedGraph, layers: list[Layer], microbatches: int, options: PlannerOptions,
                       popts: PipelineOptions) -> list[SearchTask]:
    """Gradient accumulation: one stage on all the devices, its microbatches one after the
    other, so that one microbatch's activations are alive at a time. Searched only where the
    whole batch in one stage does not fit without recomputing layers: it computes as much, and
    communicates at least as much (each microbatch pays the latencies the whole batch pays
    once), so the whole batch is never slower; recomputation, which computes a forward more,
    it may beat."""
    if popts.stages not in (None, 1) or microbatches < 2 or (options.pins and options.pins.least_stages > 1):
        return []
    whole = SubMesh(*cluster_shape(options))
    meshes = stage_meshes(options, whole)
    # interleaving needs stages to interleave
    return [SearchTask(graph, layers, schedule, microbatches, whole, meshes)
            for schedule in searched_schedules(popts) if schedule not in INTERLEAVED and meshes]


def searched_schedules(popts: PipelineOptions) -> list[str]:
    """The schedules searched: the pinned one, else 1F1B."""
    return [popts.schedule] if popts.schedule else ["1f1b"]


def filling_counts(batch: int, options: PlannerOptions, popts: PipelineOptions, num_layers: int,
                   searched: list[int]) -> dict[int, set[int]]:
    """Microbatch counts beyond ``searched`` (:func:`microbatch_candidates`: the largest, whose
    microbatches are smallest), each with the stage counts it is searched for: for a pipeline
    of ``S`` stages, the fewest microbatches, at least ``PIPELINE_FILL·S``, that divide the
    batch (its bubble at most about a quarter of the step's work). Larger microbatches keep
    a stage's devices busy where small ones cannot be split among them: Llama 3.1 405B's block
    on an 8x8 stage takes 1.01 s per step in 32 microbatches of 8 sequences, 2.24 s in 64 of 4."""
    if popts.microbatches is not None:
        return {}
    out: dict[int, set[int]] = {}
    for submesh in submeshes(options, popts, num_layers):
        stages = options.devices // submesh.size
        if stages < 2:
            continue
        count = next((c for c in range(PIPELINE_FILL * stages, min(batch, 512) + 1) if batch % c == 0), None)
        if count is not None and count not in searched:
            out.setdefault(count, set()).add(stages)
    return out


def count_tasks(graph: TracedGraph, layers: list[Layer], microbatches: int, options: PlannerOptions,
                popts: PipelineOptions, depths: set[int] | None = None) -> list[SearchTask]:
    """The sub-mesh searches of one microbatch count (of the pipelines of ``depths`` stages
    only, where given)."""
    found: list[SearchTask] = []
    for schedule in searched_schedules(popts):
        for submesh in submeshes(options, popts, len(layers)):
            if depths is not None and options.devices // submesh.size not in depths:
                continue
            if microbatches > 1 and submesh.size == options.devices:
                continue  # several microbatches in one stage: gradient accumulation, searched after
            if microbatches == 1 and submesh.size < options.devices and popts.microbatches is None:
                continue  # a pipeline only with several microbatches, unless pinned
            meshes = stage_meshes(options, submesh)
            # interleaved chunks are cut after the search, so they share one logical mesh
            for group in ([[m] for m in meshes] if schedule in INTERLEAVED else [meshes]) if meshes else []:
                found.append(SearchTask(graph, layers, schedule, microbatches, submesh, group))
    return found


@dataclass(frozen=True)
class SearchTask:
    """One sub-mesh's stage search at one microbatch count (:func:`search_submesh`)."""

    graph: TracedGraph
    layers: list[Layer]
    schedule: str
    microbatches: int
    submesh: SubMesh
    meshes: list[tuple[int, ...]]
    boundaries: bool = False
    costs: dict[tuple[int, ...], LayerCosts] | None = None
    tied_meshes: list[tuple[int, ...]] | None = None

    def run(self, options: PlannerOptions, popts: PipelineOptions) -> list[PipelineCandidate]:
        return search_submesh(self.graph, self.layers, options, popts, self.schedule, self.microbatches,
                              self.submesh, self.meshes, self.boundaries, self.costs, self.tied_meshes)

    @property
    def weight(self) -> float:
        """A guess at the task's share of the work (its ILPs grow with the mesh)."""
        return sum(1 + math.log2(math.prod(mesh)) for mesh in self.meshes)


def search_pool(tasks: list[SearchTask], options: PlannerOptions) -> TaskPool[list[PipelineCandidate]]:
    """A pool for ``tasks`` (the list the caller appends each task to as it submits it)."""
    return TaskPool(options.jobs, pack=_portable,
                    unpack=lambda i, found: [_restored(c, tasks[i], options) for c in found])


def _portable(candidates: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """``candidates`` to send from a search process: without the graph and layers (the parent
    has them), the options (they may hold functions) or the edge-cost memo."""
    packed: dict[int, dict[tuple[int, ...], LayerCosts]] = {}
    out = []
    for c in candidates:
        costs = None
        if c.costs is not None:
            if id(c.costs) not in packed:
                packed[id(c.costs)] = {mesh: lc.portable() for mesh, lc in c.costs.items()}
            costs = packed[id(c.costs)]
        out.append(replace(c, graph=None, layers=[], costs=costs))
    return out


def _restored(candidate: PipelineCandidate, searched: SearchTask | PipelineCandidate, options: PlannerOptions
              ) -> PipelineCandidate:
    """A candidate from a search process, with its graph, layers (those ``searched``) and
    options back."""
    for lc in (candidate.costs or {}).values():
        lc.restore(options)
    return replace(candidate, graph=searched.graph, layers=searched.layers)


def refine(candidates: list[PipelineCandidate], options: PlannerOptions, popts: PipelineOptions
           ) -> list[PipelineCandidate]:
    """Search the ``REFINED`` best pipelines again with the boundaries inside their stages
    costed (two ILPs more per distinct pair of adjacent layers, so not for every sub-mesh),
    and the best of every other pipeline depth (stage count) estimated within
    ``REFINED_DEPTH_MARGIN`` of the best (at most twice its seconds: the corrections seen are
    a share of a stage's seconds, a quarter for the GPT-2 case below, not a multiple); best
    first. Uncorrected, every
    boundary inside a stage costs as if the value handed on crossed a stage boundary there.
    When values crossed whole, that overestimated a deep stage of a data-parallel mesh most:
    the one-stage plans lost to pipelines on that error alone (GPT-2 124M on 8 H100s, bf16:
    one stage on 2x4 estimated 5.62 ms uncorrected, planned at 4.23 ms). The pairs' ILPs run first, spread over the
    processes (one task per logical mesh of each searched sub-mesh); then the searches again,
    one task per pipeline."""
    candidates = sorted(candidates, key=lambda c: c.step_time_s)
    picked = list(range(min(REFINED, len(candidates))))
    depths = {len(candidates[i].cuts) for i in picked}
    for i, c in enumerate(candidates):
        if len(c.cuts) not in depths and c.step_time_s <= candidates[0].step_time_s * (1 + REFINED_DEPTH_MARGIN):
            depths.add(len(c.cuts))
            picked.append(i)
    best = [candidates[i] for i in picked]
    tables: dict[int, tuple[LayerCosts, PipelineCandidate]] = {}
    for c in best:  # the tables of the meshes each is searched on again
        for mesh in searched_meshes(c) if c.costs else []:
            tables.setdefault(id(c.costs[mesh]), (c.costs[mesh], c))
    pool: TaskPool[tuple[BoundaryCorrections, PairRecomputation]] = TaskPool(options.jobs)
    for mesh_costs, c in tables.values():
        pool.submit(partial(_boundary_costs, mesh_costs, c))
    for (mesh_costs, _), (pairs, recompute_in_pair) in zip(tables.values(), pool.results()):
        mesh_costs.pairs.update(pairs)
        mesh_costs.recompute_in_pair.update(recompute_in_pair)
    searches: TaskPool[list[PipelineCandidate]] = TaskPool(
        options.jobs, pack=_portable, unpack=lambda k, found: [_restored(f, best[k], options) for f in found])
    for c in best:
        searches.submit(partial(search_submesh, c.graph, c.layers, options, popts, c.schedule, c.microbatches,
                                c.submesh, searched_meshes(c), boundaries=True, costs=c.costs,
                                tied_meshes=[c.tied_mesh] if c.tied_mesh else None))
    for i, again in zip(picked, searches.results()):
        if again:
            candidates[i] = again[0]
    unique = {(c.microbatches, c.submesh, tuple(c.meshes), tuple(c.cuts), c.recomputed, c.selective, c.schedule,
               c.tied_mesh): c
              for c in sorted(candidates, key=lambda c: c.step_time_s, reverse=True)}  # the fastest of equals kept
    return sorted(unique.values(), key=lambda c: c.step_time_s)


def searched_meshes(candidate: PipelineCandidate) -> list[tuple[int, ...]]:
    """The logical meshes to search ``candidate``'s sub-mesh on again: its own where it is one
    stage (one candidate per mesh, :func:`search_submesh`), else every mesh it was searched on."""
    return list(candidate.meshes) if len(candidate.cuts) == 1 else list(candidate.costs or {})


def _boundary_costs(costs: LayerCosts, candidate: PipelineCandidate
                    ) -> tuple[BoundaryCorrections, PairRecomputation]:
    """The boundary corrections of every pair of adjacent layers of ``candidate``'s graph on
    ``costs``' logical mesh, and the seconds recomputing the second layer of each adds in the
    pair's plan (:meth:`LayerCosts.boundary`)."""
    layers = candidate.layers
    for first, second in zip(layers, layers[1:]):
        costs.boundary(candidate.graph, first, second)
    return costs.pairs, costs.recompute_in_pair


def traced_twin(candidate: PipelineCandidate, graphs: BatchSizeGraphs, batch: int, options: PlannerOptions,
                popts: PipelineOptions) -> PipelineCandidate | None:
    """``candidate`` on the traced graph of its microbatch where that graph is the one it was
    found on (the same hash and layers: its plans stand), tracing the microbatch where it was
    rescaled; None where the trace differs."""
    if graphs.is_traced(candidate.graph):
        return candidate
    graph = graphs.trace(batch // candidate.microbatches)
    layers = pinned_layers(graph, popts, options)
    if graph.graph_hash == candidate.graph.graph_hash and \
            [layer.nodes for layer in layers] == [layer.nodes for layer in candidate.layers]:
        return replace(candidate, graph=graph, layers=layers)
    return None


def on_traced_graph(candidate: PipelineCandidate, graphs: BatchSizeGraphs, batch: int, options: PlannerOptions,
                    popts: PipelineOptions) -> PipelineCandidate | None:
    """``candidate`` on the traced graph of its microbatch, so that the plan made from it is
    the plan of the program that runs: found on a rescaled graph, the microbatch is traced;
    where the trace is the rescaled graph, the search's answer stands (:func:`traced_twin`),
    else its sub-mesh is searched again on the trace (None if nothing fits there)."""
    twin = traced_twin(candidate, graphs, batch, options, popts)
    if twin is not None:
        return twin
    graph = graphs.trace(batch // candidate.microbatches)
    layers = pinned_layers(graph, popts, options)
    again = search_submesh(graph, layers, options, popts, candidate.schedule, candidate.microbatches,
                           candidate.submesh, searched_meshes(candidate), boundaries=True,
                           tied_meshes=[candidate.tied_mesh] if candidate.tied_mesh else None)
    return min(again, key=lambda c: c.step_time_s) if again else None
