"""Exact stage plans: one intra-op ILP per stage of a found pipeline, a pipeline rank's memory
shared by its stages."""

from __future__ import annotations

from dataclasses import replace

from autoplan.cost_models.step_costs import CostContext
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import PlannerOptions
from autoplan.planner.mesh_plan import IntraOpResult, StorageRule, plan_intra_op
from autoplan.planner.meshes import mesh_label
from autoplan.planner.pipeline.candidates import PipelineCandidate, candidate_lighter
from autoplan.planner.pipeline.range_costs import (RangeTable, layer_inputs, small_whole, whole_below,
    whole_crossings)
from autoplan.planner.pipeline.schedules import activations_in_flight
from autoplan.planner.recompute import regions, saved_outputs
from autoplan.sharding import ShardingSpec
from autoplan.solvers import format_bytes
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.trace.repeated import find_classes
from autoplan.trace.subgraph import extract

BUDGET_RETRIES = 2  # times a rank's stages are planned again when one's memory share proves too small
RERANK_MARGIN = 0.05  # of those, the ones within 5% of the search's best are planned exactly; the fastest wins
SECOND_ROUND = 3  # then up to this many more whose estimates come within SECOND_ROUND_MARGIN of the fastest exact plan
SECOND_ROUND_MARGIN = 0.15  # the estimates of whole-batch plans recomputing every layer run high
TRIMMED_MARGIN = 0.5  # and the best that recomputes nothing, within 50%, where all of those recompute
WHOLE_BATCH_MARGIN = 0.5  # and the best whole batch on one stage, within 50%, where the best accumulates


def stage_results(candidate: PipelineCandidate, options: PlannerOptions, schedule: str
                   ) -> list[tuple[TracedGraph, IntraOpResult, CostContext]]:
    """One exact intra-op ILP per stage; a stage equal to one already solved (the same layers,
    in the same place of the pipeline, the same budget) takes its answer, renamed. A parameter
    that several stages read (a tied weight) is stored as the first of them chose, so that its
    copies' gradients sum shard by shard and no stage redistributes it.

    A pipeline rank holding several stages (interleaved) splits its memory among them
    (:func:`split_budget`); where a stage's share proves smaller than the least it needs (the
    search's estimate can be low: a tied weight pinned to the first stage's placement), the
    rank's stages are planned again with that stage's least need, up to ``BUDGET_RETRIES``
    times."""
    stages, ranks = len(candidate.cuts), candidate.ranks
    solved: dict[tuple, tuple[TracedGraph, IntraOpResult]] = {}
    stored: dict[str, ShardingSpec] = {}  # FQN -> spec chosen by the first stage holding it
    results: dict[int, tuple[TracedGraph, IntraOpResult, CostContext]] = {}
    below = whole_below(options)
    least, fast = stage_needs(candidate, options.optimizer.mixed_precision, below)
    whole = whole_crossings(candidate.graph, candidate.layers, candidate.cuts, candidate.meshes)
    for rank in range(ranks):
        mine = list(range(rank, stages, ranks))
        for attempt in range(BUDGET_RETRIES + 1):
            kept = dict(stored)
            budgets = split_budget(options.memory_budget, least, fast, ranks)
            needed = sum(least[t] for t in mine)
            if options.memory_budget is not None and len(mine) > 1 and needed > options.memory_budget:
                raise MemoryInfeasibleError(
                    f"the {len(mine)} stages of pipeline rank {rank} need at least {format_bytes(needed)} per device "
                    f"together, more than {format_bytes(options.memory_budget)}: give more memory or use 1f1b", needed)
            try:
                for s in mine:
                    results[s] = plan_stage(candidate, s, budgets[s], options, schedule, solved, stored, whole, below)
                break
            except MemoryInfeasibleError as e:
                stored.clear()
                stored.update(kept)
                if attempt == BUDGET_RETRIES or len(mine) == 1 or e.least_memory_bytes <= least[s]:
                    raise
                least[s] = e.least_memory_bytes
    return [results[s] for s in range(stages)]


def plan_stage(candidate: PipelineCandidate, index: int, budget: float | None, options: PlannerOptions, schedule: str,
                solved: dict[tuple, tuple[TracedGraph, IntraOpResult]], stored: dict[str, ShardingSpec],
                whole: frozenset[str] = frozenset(), below: float = 0.0
                ) -> tuple[TracedGraph, IntraOpResult, CostContext]:
    """The exact ILP of one stage under ``budget``; records the placements of the parameters it
    stores first in ``stored``. The values in ``whole``, and those smaller than ``below``
    bytes, cross the pipeline's boundaries whole
    (:func:`~autoplan.planner.pipeline.range_costs.whole_crossings`, :func:`whole_below`)."""
    stages = len(candidate.cuts)
    (start, end), mesh = candidate.cuts[index], candidate.meshes[index]

    def allowed(info: NodeInfo, spec: ShardingSpec) -> bool:
        if info.fqn in stored:
            return spec == stored[info.fqn]
        return options.allow_storage is None or options.allow_storage(info, spec)

    # the parameters an earlier stage stored keep their placements; the options' other rules hold
    rule = options.allow_storage
    allow_storage = StorageRule(allowed) if rule is None else replace(rule, allowed=allowed)

    nodes = [n for layer in candidate.layers[start:end] for n in layer.nodes]
    sub = candidate.graph
    if stages > 1:
        sub = extract(candidate.graph, nodes)
        sub = small_whole(replace(sub, whole_values=whole & set(sub.nodes)), below)
    recomputed = tuple(i - start for i in range(start, end) if i in candidate.recomputed)
    selective = tuple(i for i in recomputed if start + i in candidate.selective)
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device,
                      options.optimizer, microbatches=candidate.microbatches, one_stage=stages == 1,
                      activations_in_flight=activations_in_flight(schedule, candidate.microbatches, stages),
                      recompute_regions=regions(candidate.layers[start + i] for i in recomputed),
                      recompute_saved=saved_outputs(sub, (candidate.layers[start + i] for i in selective),
                                                     candidate_lighter(candidate, options.recompute)))
    pinned = tuple(sorted((fqn, stored[fqn]) for fqn in {info.fqn for info in sub.nodes.values()}
                          if fqn in stored))
    if any(len(spec) != len(mesh) for _, spec in pinned):
        raise AutoplanError(f"a tied parameter is stored on another logical mesh than {mesh_label(mesh)}: "
                            "the stages holding it must share one")
    key = (tuple(layer.signature for layer in candidate.layers[start:end]), start == 0,
           end == len(candidate.layers), pinned, mesh, budget, recomputed, selective,
           tuple(i for i, name in enumerate(sub.nodes) if name in sub.whole_values))  # by position: renamed alike
    result = renamed(*solved[key], sub) if key in solved else None
    if result is None:
        result = plan_intra_op(sub, find_classes(sub), mesh, ctx, budget,
                               options.solver, options.time_limit_s, allow_storage=allow_storage,
                               canonical=options.canonical, pins=options.pins)
        solved[key] = (sub, result)
    for name, strategy in result.chosen.items():
        info = sub.nodes[name]
        if info.kind == "parameter" and info.fqn:
            stored.setdefault(info.fqn, strategy.output_spec)
    return sub, result, ctx


def stage_needs(candidate: PipelineCandidate, mixed_precision: bool = False, below: float = 0.0
                ) -> tuple[list[float], list[float]]:
    """Each stage's least memory and its fastest plans' memory, by the search's layer costs (by
    layer count, least 0, where they are not at hand). A candidate whose lighter layers are
    recomputed in a mode the search did not cost (:attr:`PipelineCandidate.lighter`) is counted
    as recomputing them fully: less than it needs, which the rank's retries correct."""
    least, fast = [], []
    reads: dict[tuple[int, ...], list[dict[str, tuple[int, float]]]] = {}  # by mesh
    for (start, end), mesh in zip(candidate.cuts, candidate.meshes):
        if candidate.costs and mesh in candidate.costs:
            if mesh not in reads:
                reads[mesh] = layer_inputs(candidate.graph, candidate.layers, mixed_precision, mesh, below)
            table = RangeTable(candidate.graph, candidate.layers, candidate.costs[mesh], False, reads[mesh])
            costed = candidate.selective if candidate.lighter is None else frozenset()
            least.append(table.least_memory(start, end, candidate.recomputed, costed))
            fast.append(max(least[-1], table.cost(start, end, None)[1]))
        else:
            least.append(0.0)
            fast.append(float(end - start))
    return least, fast


def split_budget(budget: float | None, least: list[float], fast: list[float], ranks: int) -> list[float | None]:
    """Each stage's share of the device memory (stage ``s`` on rank ``s % ranks``): all of it
    where a rank holds one stage; where it holds several, each gets its least need plus a share
    of what the rank's budget leaves, in proportion to what its fastest plans need beyond that."""
    stages = len(least)
    if budget is None or ranks == stages:
        return [budget] * stages
    out: list[float | None] = []
    for s in range(stages):
        mine = range(s % ranks, stages, ranks)
        spare = budget - sum(least[t] for t in mine)
        extra = sum(fast[t] - least[t] for t in mine)
        out.append(least[s] + max(0.0, spare) * ((fast[s] - least[s]) / extra if extra > 0 else 1.0 / len(mine)))
    return out


def renamed(graph: TracedGraph, result: IntraOpResult, other: TracedGraph) -> IntraOpResult | None:
    """``result`` (for ``graph``) for ``other``, a graph of the same nodes under other names;
    None if the two differ anywhere."""
    names, others = list(graph.nodes), list(other.nodes)
    if len(names) != len(others) or any(
            (a.kind, a.target, a.shape, a.dtype) != (b.kind, b.target, b.shape, b.dtype)
            for a, b in zip(graph.nodes.values(), other.nodes.values())):
        return None
    to = dict(zip(names, others))
    return replace(result, chosen={to[k]: v for k, v in result.chosen.items()},
                   node_costs={to[k]: v for k, v in result.node_costs.items()},
                   input_names={to[k]: [to[x] for x in v] for k, v in result.input_names.items()},
                   needs_grad={to[k]: v for k, v in result.needs_grad.items()})
