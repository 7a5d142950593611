"""The inter-op pass: pipeline stages, sub-meshes, microbatches and the schedule.

Layers. For every candidate microbatch count ``B`` the model is traced for one microbatch and
cut into layers (:mod:`autoplan.trace.layers`). For every sub-mesh shape ``(n, m)`` (a
slice of a node or whole nodes) and every logical mesh of it, each distinct layer is costed
by the intra-op ILP once (layers with equal ops and shapes share the answer).

Ranges (:class:`_RangeTable`). A stage's cost is the sum of its layers' costs plus sending its
boundary activations (and receiving their gradients) over the link to the next stage:

- apart, every layer hands its values on replicated, as if a stage boundary followed it; the
  ``REFINED`` best pipelines are searched again with each boundary inside a stage corrected
  by what planning the two layers that meet there together changes (the ILP of the pair, once
  per distinct pair; usually a saving, as the value may stay sharded). For a stage of two
  layers that is the stage's own ILP; in a longer one, boundaries interact through the layers
  between them, which the sum misses: over every range of Alpa's GPT-1.3B it is within 0.01%
  of the range's own ILP (``benchmarks/range_costs.py``), for three small latency-bound
  layers on H100s 16% above it;
- memory counts what a layer receives from another layer of the stage as the stage's ILP does
  (:meth:`_RangeTable.counted_apart`);
- where the layers' fastest plans do not fit the budget together, they are trimmed together
  until they fit, each step freeing memory where it costs the least time per byte
  (:func:`autoplan.solvers.trim_memory_together`: a quick estimate); where not even the
  least-memory plans fit, the stage is absent.

Stages. The stage DP (:func:`autoplan.solvers.inter_op.solve_inter_op`, Alpa's recurrence)
cuts the layers into stages that all get the same sub-mesh shape (torch's pipeline stages
pair rank i of one stage with rank i of the next), each stage on the logical mesh of that
shape where its layers run fastest within the budget. Stages holding a tied weight share one
logical mesh, so that its copies are stored alike; the DP runs once for each mesh they may
take. Interleaved schedules cut their chunks after the search, so their stages share one
logical mesh.

Exact plans. The best (``B``, sub-mesh, stages and their logical meshes), and each other of
the ``REFINED`` best that the search puts within ``RERANK_MARGIN`` of it, is then planned
exactly: one intra-op ILP per stage over all its nodes, under the memory budget; the fastest
exact plan wins, and the others are listed as alternatives with their exact figures. (The
search's estimates run 1–9% above the exact plans, not by the same factor for every pipeline:
near ties are settled exactly.)

Stage latency (per microbatch) is the stage's per-step ILP objective divided by ``B``: compute
and activation traffic run once per microbatch, gradient reductions and the optimizer step
once per step (amortised). A stage receives its inputs whole and sends their gradients back
whole; it hands on only what later stages read (and the loss). After the schedule, once per
step: the gradients of a weight held by stages on several pipeline ranks (a tied embedding)
are summed among them (all stages store it as the first chose), and the loss is broadcast to
every rank; both are added to the step time. Schedules (:data:`SCHEDULES`):

- ``gpipe``: step = Σ t_i + (B − 1)·max t_i; every stage keeps all ``B`` microbatches'
  activations;
- ``1f1b``: the same step time; a stage keeps at most ``min(B, S)`` microbatches' activations
  (stage ``s`` of torch's ``Schedule1F1B`` keeps ``min(B, S − s)``: every stage is counted as
  the first, more than later stages need, never less);
- ``interleaved1f1b``: ``v = 2`` chunks per pipeline rank; the bubble shrinks to
  ``(D − 1)·max t / v`` (``D`` ranks); each chunk keeps ``min(B, v·D)`` microbatches'
  activations (torch's schedule keeps at most ``(v − 1)·D + 2(D − 1)`` chunk-forwards on a rank,
  at most ``2D − 2`` of them in one chunk), and a rank's chunks share its memory;
- ``interleavedzerobubble``: as interleaved, with the weight-gradient half of each backward
  scheduled into the bubble, which leaves about a third of it.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

from autoplan.cost_models import ALL_REDUCE, BROADCAST, LinkSpec, collective_time
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import PlannerOptions
from autoplan.planner.assemble import node_plans, placements, predict, solver_stats
from autoplan.cost_models.step_costs import CostContext, is_floating
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.planner.mesh_plan import IntraOpResult, emit_warnings, plan_intra_op
from autoplan.trace.layers import Layer, make_layers
from autoplan.trace.repeated import find_classes
from autoplan.load import ModelSpec, make_model_spec
from autoplan.planner.meshes import candidate_meshes, mesh_label
from autoplan.trace.microbatch import batch_size, microbatch_inputs
from autoplan.plan_schema import (
    Alternative,
    MemoryEstimate,
    Plan,
    PlannedCollective,
    Prediction,
    StagePlan,
)
from autoplan.trace.subgraph import extract, loss_name
from autoplan.trace.tracer import trace
from autoplan.sharding import ShardingSpec, local_shape, spec_from_json
from autoplan.solvers import (
    evaluate,
    format_bytes,
    format_seconds,
    trim_memory_together,
)
from autoplan.solvers.inter_op import (
    InterOpInfeasibleError,
    InterOpProblem,
    StageCost,
    SubMesh,
    candidate_submeshes,
    solve_inter_op,
)
from autoplan.solvers.intra_op import IntraOpProblem

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "interleavedzerobubble")
INTERLEAVED = frozenset({"interleaved1f1b", "interleavedzerobubble"})
MICROBATCH_CANDIDATES = 3  # the largest counts (smallest bubbles) the search tries, besides 1
FAST, LEAN = "fast", "lean"  # how a layer is costed in the stage search (_LayerCosts.cost)
REFINED = 3  # the best pipelines of the search are searched again with stage-internal boundaries costed
BUDGET_RETRIES = 2  # times a rank's stages are planned again when one's memory share proves too small
RERANK_MARGIN = 0.05  # of those, the ones within 5% of the search's best are planned exactly; the fastest wins
INTERLEAVE = 2  # chunks per pipeline rank in the interleaved schedules
ZERO_BUBBLE_LEFT = 1.0 / 3.0  # share of the interleaved bubble zero-bubble scheduling leaves (the forward's)
_SCHEDULE_ALIASES = {"gpipe": "gpipe", "schedulegpipe": "gpipe", "1f1b": "1f1b", "schedule1f1b": "1f1b",
                     "interleaved1f1b": "interleaved1f1b", "scheduleinterleaved1f1b": "interleaved1f1b",
                     "interleavedzerobubble": "interleavedzerobubble",
                     "scheduleinterleavedzerobubble": "interleavedzerobubble"}


def normalize_schedule(name: str) -> str:
    """torch's schedule names, any case: ``GPipe``, ``1F1B``, ``Interleaved1F1B``."""
    key = name.replace("_", "").replace("-", "").lower()
    if key not in _SCHEDULE_ALIASES:
        raise AutoplanError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}")
    return _SCHEDULE_ALIASES[key]


@dataclass(frozen=True)
class PipelineOptions:
    """What the user pins; ``None`` lets the planner choose."""

    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    layers: int | None = None


def activations_in_flight(schedule: str, microbatches: int, stages: int) -> int:
    return microbatches if schedule == "gpipe" else min(microbatches, stages)


def pipeline_time(latencies: list[float], microbatches: int, schedule: str) -> float:
    """Step time of a pipeline whose stages take ``latencies`` per microbatch."""
    if schedule in INTERLEAVED and len(latencies) >= INTERLEAVE:
        ranks = len(latencies) // INTERLEAVE
        per_rank = [sum(latencies[r::ranks]) for r in range(ranks)]
        # zero bubble: the weight-gradient half of each backward fills the warm-up and drain
        bubble = (ranks - 1) * max(latencies) * (ZERO_BUBBLE_LEFT if schedule == "interleavedzerobubble" else 1.0)
        return microbatches * max(per_rank) + bubble
    return sum(latencies) + (microbatches - 1) * max(latencies)


@dataclass
class _Candidate:
    """One pipeline found by the DP: its stages' layer ranges and its predicted step time."""

    microbatches: int
    submesh: SubMesh
    meshes: list[tuple[int, ...]]  # the logical mesh of each stage
    cuts: list[tuple[int, int]]
    step_time_s: float
    graph: TracedGraph
    layers: list[Layer]
    schedule: str = "1f1b"
    costs: dict[tuple[int, ...], _LayerCosts] | None = None  # the layer ILPs per logical mesh, for a second search
    boundaries: bool = False  # whether the search costed the boundaries inside stages

    @property
    def ranks(self) -> int:
        """Pipeline ranks: one per stage, or one per ``INTERLEAVE`` chunks when interleaved."""
        return len(self.cuts) // INTERLEAVE if self.interleaved else len(self.cuts)

    interleaved: bool = False
    tied_mesh: tuple[int, ...] | None = None  # the logical mesh of the stages holding a tied weight, if pinned


def interleave(candidate: _Candidate) -> _Candidate:
    """The interleaved form of a pipeline: its layers cut evenly into ``INTERLEAVE`` chunks per
    pipeline rank; chunk ``c`` runs on rank ``c % ranks`` (torch's interleaved placement)."""
    ranks, layers = len(candidate.cuts), len(candidate.layers)
    chunks = INTERLEAVE * ranks
    if layers < chunks:
        raise AutoplanError(f"the interleaved schedule needs at least {chunks} layers for {ranks} pipeline ranks; "
                            f"the model has {layers}: use 1f1b or fewer stages")
    bounds = [round(i * layers / chunks) for i in range(chunks + 1)]
    if len(set(candidate.meshes)) > 1:
        raise AutoplanError("an interleaved pipeline needs one logical mesh for all its stages")
    return replace(candidate, cuts=list(zip(bounds, bounds[1:])), meshes=candidate.meshes[:1] * chunks,
                   interleaved=True)


@dataclass
class _LayerCosts:
    """Per-layer ILP costs on one logical mesh, cached by the layer's signature."""

    options: PlannerOptions
    ctx: CostContext
    cache: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    problems: dict[str, IntraOpProblem] = field(default_factory=dict)
    fast_choices: dict[str, list[int]] = field(default_factory=dict)
    trims: dict[tuple, tuple[float, float] | None] = field(default_factory=dict)
    pairs: dict[tuple[str, str], float] = field(default_factory=dict)  # boundary corrections

    def cost(self, graph: TracedGraph, layer: Layer, mode: str = FAST) -> tuple[float, float]:
        """(seconds per step, bytes per device) of one layer, by ``mode``: its fastest plan
        (``FAST``, its own ILP) or its least-memory plan (``LEAN``)."""
        key = (layer.signature, mode)
        if key not in self.cache:
            if mode == LEAN:  # the least-memory choice of every group (cheapest among equals): no ILP
                self.cost(graph, layer)
                problem = self.problems[layer.signature]
                choices = [min(range(len(m)), key=lambda i, m=m, c=c: (m[i], c[i]))
                           for m, c in zip(problem.memory, problem.costs)]
                self.cache[key] = evaluate(problem, choices)
            else:
                sub = extract(graph, list(layer.nodes))
                result = plan_intra_op(sub, find_classes(sub), self.ctx.mesh_shape, self.ctx, None,
                                       self.options.solver, self.options.time_limit_s,
                                       allow_storage=self.options.allow_storage)
                self.problems[layer.signature] = result.problem
                self.fast_choices[layer.signature] = result.solution.choices
                self.cache[key] = (result.solution.objective, result.solution.memory)
        return self.cache[key]

    def trimmed(self, graph: TracedGraph, layers: list[Layer], budget: float) -> tuple[float, float] | None:
        """(seconds, bytes) of ``layers``' fastest plans trimmed together until they fit
        ``budget`` bytes (:func:`autoplan.solvers.trim_memory_together`, a greedy estimate, no
        ILP: each step frees memory where it costs the least time per byte, in any layer; equal
        layers switch alike, as their classes do in the ILP). None if even their least-memory
        plans do not fit."""
        counts = collections.Counter(layer.signature for layer in layers)
        key = (tuple(sorted(counts.items())), budget)
        if key not in self.trims:
            for layer in layers:
                self.cost(graph, layer)
            signatures = sorted(counts)
            problems = [self.problems[sig] for sig in signatures]
            choices = trim_memory_together(problems, [counts[sig] for sig in signatures],
                                           [self.fast_choices[sig] for sig in signatures], budget)
            total = None
            if choices is not None:
                total = (0.0, 0.0)
                for sig, problem, chosen in zip(signatures, problems, choices):
                    seconds, memory = evaluate(problem, chosen)
                    total = _add(total, (counts[sig] * seconds, counts[sig] * memory))
            self.trims[key] = total
        return self.trims[key]

    def boundary(self, graph: TracedGraph, first: Layer, second: Layer) -> float:
        """Seconds that planning two adjacent layers together adds to planning them apart (their
        fastest plans). Apart, every value the first layer hands on must leave it replicated (it
        could be a stage boundary); together, it may stay sharded: the correction is usually a
        saving. Memory is not corrected: apart, the handed-on value counts in both layers, which
        errs on the safe side (the pair's own plan may differ from both layers', so a memory
        correction taken from it can err on the unsafe side)."""
        key = (first.signature, second.signature)
        if key not in self.pairs:
            sub = extract(graph, list(first.nodes) + list(second.nodes))
            result = plan_intra_op(sub, find_classes(sub), self.ctx.mesh_shape, self.ctx, None,
                                   self.options.solver, self.options.time_limit_s,
                                   allow_storage=self.options.allow_storage)
            self.pairs[key] = result.solution.objective - self.cost(graph, first)[0] - self.cost(graph, second)[0]
        return self.pairs[key]


def _link_between_stages(options: PlannerOptions, submesh: SubMesh) -> LinkSpec:
    cluster = options.cluster
    return cluster.intra_node if submesh.nodes == 1 and submesh.devices < cluster.devices_per_node else \
        cluster.inter_node


def cut_bytes(graph: TracedGraph, layers: list[Layer]) -> list[float]:
    """``out[c]``: bytes of the values that layers before ``c`` hand to layers at or after it
    (one microbatch), for every cut 0..len(layers). A value produced in layer i and last read
    in layer j (or, the loss, by the graph's output) crosses the cuts i+1..j."""
    layer_of = _layer_index(layers)
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    loss = loss_name(graph)
    diff = [0.0] * (len(layers) + 2)
    for name, i in layer_of.items():
        last = max((layer_of.get(user.name, len(layers)) for user in fx_nodes[name].users
                    if user.op != "output" or name == loss), default=i)
        info = graph.nodes[name]
        if last > i and info.shape is not None:
            nbytes = math.prod(info.shape) * info.itemsize
            diff[i + 1] += nbytes
            diff[last + 1] -= nbytes
    return list(itertools.accumulate(diff))[:len(layers) + 1]


def _layer_index(layers: list[Layer]) -> dict[str, int]:
    """Node name -> the index of the layer holding it."""
    return {name: i for i, layer in enumerate(layers) for name in layer.nodes}


def tied_layers(graph: TracedGraph, layers: list[Layer]) -> set[int]:
    """The layers that read a parameter another layer also reads (a tied embedding and head):
    the stages holding them must store it alike, so they share a logical mesh."""
    layer_of = _layer_index(layers)
    out: set[int] = set()
    for node in graph.graph_module.graph.nodes:
        info = graph.nodes.get(node.name)
        if info is None or info.kind != "parameter":
            continue
        readers = {layer_of[user.name] for user in node.users if user.name in layer_of}
        if len(readers) > 1:
            out |= readers
    return out


def _layer_costs(options: PlannerOptions, mesh: tuple[int, ...], microbatches: int, in_flight: int) -> _LayerCosts:
    cluster = options.cluster
    ctx = CostContext(mesh, cluster.mesh_links(mesh), cluster.device, options.optimizer,
                      microbatches=microbatches, activations_in_flight=in_flight, remat=options.remat)
    return _LayerCosts(options, ctx)


class _RangeTable:
    """One logical mesh's layer costs as prefix sums: a layer range's (seconds per step, bytes
    per device) in O(1) where its fastest plans fit, each distinct layer solved once.

    A range's fastest plan is the sum of its layers' plus, with ``boundaries``, the correction
    of every boundary inside it (:meth:`_LayerCosts.boundary`): over every range of Alpa's
    GPT-1.3B within 0.01% of the range's own ILP (``benchmarks/range_costs.py``). Where that
    does not fit the budget, the layers' fastest plans are trimmed together until they fit
    (:meth:`_LayerCosts.trimmed`), and the boundary corrections are added as they are.

    Memory is counted as the range's own ILP counts it: apart, a layer keeps every value it
    receives from an earlier layer as a (replicated) input, so a value read by several layers
    of the range, or produced inside it, is counted more often than the range counts it (once
    as the range's input, or not at all: it is then an op's output). The excess is subtracted
    (:meth:`counted_apart`); user inputs, which may be sharded, are left counted as they are."""

    def __init__(self, graph: TracedGraph, layers: list[Layer], costs: _LayerCosts, boundaries: bool,
                 reads: list[dict[str, tuple[int, float]]] | None = None) -> None:
        self.graph, self.layers, self.costs = graph, layers, costs
        self.reads = layer_inputs(graph, layers) if reads is None else reads  # one per graph and layers
        self.excess: dict[int, list[float]] = {}  # start -> counted_apart(start, end) for every end
        self.prefix: dict[str, list[tuple[float, float]]] = {}
        # joins[i]: the corrections of the boundaries before layer i (between j - 1 and j, j <= i)
        self.joins = list(itertools.accumulate(
            costs.boundary(graph, layers[j - 1], layers[j]) if j and boundaries else 0.0 for j in range(len(layers))))

    def _sums(self, mode: str) -> list[tuple[float, float]]:
        if mode not in self.prefix:
            answers = (self.costs.cost(self.graph, layer, mode) for layer in self.layers)
            self.prefix[mode] = list(itertools.accumulate(answers, _add, initial=(0.0, 0.0)))
        return self.prefix[mode]

    def _range(self, mode: str, start: int, end: int) -> tuple[float, float]:
        table = self._sums(mode)
        return table[end][0] - table[start][0], table[end][1] - table[start][1]

    def counted_apart(self, start: int, end: int) -> float:
        """Bytes per device that layers [start, end) costed apart count beyond the range's own
        count of the values they receive from other layers (see the class docstring)."""
        if start not in self.excess:
            apart, once, received, out = 0.0, 0.0, set(), [0.0]
            for layer in range(start, len(self.layers)):
                for name, (producer, nbytes) in self.reads[layer].items():
                    apart += nbytes
                    if producer < start and name not in received:
                        received.add(name)
                        once += nbytes
                out.append((apart - once) * self.costs.ctx.activations_in_flight)
            self.excess[start] = out
        return self.excess[start][end - start]

    def least_memory(self, start: int, end: int) -> float:
        """Bytes per device of layers [start, end)'s least-memory plans."""
        return self._range(LEAN, start, end)[1] - self.counted_apart(start, end)

    def cost(self, start: int, end: int, budget: float | None) -> tuple[float, float]:
        """Layers [start, end): their fastest plans if they fit ``budget`` together, else
        trimmed to their shares, else their least-memory plans (which then do not fit)."""
        excess = self.counted_apart(start, end)
        joins = self.joins[end - 1] - self.joins[start]
        seconds, memory = self._range(FAST, start, end)
        if budget is None or memory - excess <= budget:
            return seconds + joins, memory - excess
        lean = self._range(LEAN, start, end)
        trimmed = None if lean[1] - excess >= budget else \
            self.costs.trimmed(self.graph, self.layers[start:end], budget + excess)
        if trimmed is None:
            return lean[0], lean[1] - excess
        return trimmed[0] + joins, trimmed[1] - excess


def layer_inputs(graph: TracedGraph, layers: list[Layer]) -> list[dict[str, tuple[int, float]]]:
    """For each layer, the values it reads that an earlier layer produced: name -> (producing
    layer, bytes of the whole value). Parameters, buffers and user inputs are not listed."""
    layer_of = _layer_index(layers)
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    out: list[dict[str, tuple[int, float]]] = []
    for i, layer in enumerate(layers):
        reads: dict[str, tuple[int, float]] = {}
        for name in layer.nodes:
            for source in fx_nodes[name].all_input_nodes:
                producer = layer_of.get(source.name, i)
                info = graph.nodes.get(source.name)
                if producer != i and info is not None and info.kind == "op" and info.shape is not None:
                    reads[source.name] = (producer, math.prod(info.shape) * info.itemsize)
        out.append(reads)
    return out


def _add(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    return x[0] + y[0], x[1] + y[1]


def _search_submesh(graph: TracedGraph, layers: list[Layer], options: PlannerOptions, popts: PipelineOptions,
                    schedule: str, microbatches: int, submesh: SubMesh, meshes: list[tuple[int, ...]],
                    boundaries: bool = False, costs: dict[tuple[int, ...], _LayerCosts] | None = None,
                    tied_meshes: list[tuple[int, ...]] | None = None) -> list[_Candidate]:
    """The best pipelines on one sub-mesh shape, each stage on the fastest of ``meshes`` (its
    logical mesh) that fits; ``boundaries`` adds the correction of every boundary inside a
    stage (:meth:`_LayerCosts.boundary`). Stages holding a tied parameter share one logical
    mesh: with several meshes, the DP runs once for each mesh those stages may take (each of
    ``tied_meshes``, default all), and each run's best is a candidate."""
    stages = options.devices // submesh.size
    # interleaved: the exact plans count each of a rank's INTERLEAVE chunks as a stage
    in_flight = activations_in_flight(schedule, microbatches, stages * (INTERLEAVE if schedule in INTERLEAVED else 1))
    if costs is None:
        costs = {}
    for mesh in meshes:
        if mesh not in costs:
            costs[mesh] = _layer_costs(options, mesh, microbatches, in_flight)
    reads = layer_inputs(graph, layers)
    tables = {mesh: _RangeTable(graph, layers, costs[mesh], boundaries, reads) for mesh in meshes}
    link = _link_between_stages(options, submesh)
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
        found.append(_Candidate(microbatches, submesh, [s.cost.logical_mesh for s in solution.stages],
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


def _submeshes(options: PlannerOptions, popts: PipelineOptions, num_layers: int) -> list[SubMesh]:
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


def _stage_meshes(options: PlannerOptions, submesh: SubMesh) -> list[tuple[int, ...]]:
    """Logical meshes of a sub-mesh: a pinned one, or (size,) and the 2-D shapes whose inner
    axis stays inside a node."""
    if options.mesh is not None:
        return [options.mesh] if math.prod(options.mesh) == submesh.size else []
    return [m for m in candidate_meshes(submesh.size) if len(m) == 1 or m[1] <= submesh.devices]


def _microbatch_candidates(spec: ModelSpec, popts: PipelineOptions) -> list[int]:
    if popts.microbatches is not None:
        return [popts.microbatches]
    batch = batch_size(spec.example_inputs)
    found = [batch // size for size in (1, 2, 4, 8, 16, 32, 64) if batch % size == 0 and 1 < batch // size <= 512]
    return sorted(set(found[:MICROBATCH_CANDIDATES]) | {1})


def _trace_microbatch(spec: ModelSpec, microbatches: int) -> TracedGraph:
    return trace(make_model_spec(spec.module, microbatch_inputs(spec.example_inputs, microbatches), spec.loss_fn,
                                 spec.name))


def search_pipelines(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions,
                     ) -> tuple[list[_Candidate], float]:
    """Every feasible pipeline candidate (best per microbatch count and sub-mesh), and the
    seconds spent tracing."""
    schedules = [popts.schedule] if popts.schedule else ["1f1b"]
    candidates: list[_Candidate] = []
    trace_s = 0.0
    for microbatches in _microbatch_candidates(spec, popts):
        start = time.perf_counter()
        graph = _trace_microbatch(spec, microbatches)
        trace_s += time.perf_counter() - start
        layers = make_layers(graph, find_classes(graph), popts.layers)
        for schedule in schedules:
            for submesh in _submeshes(options, popts, len(layers)):
                if (microbatches == 1) != (submesh.size == options.devices) and popts.microbatches is None:
                    continue  # one microbatch only without a pipeline; a pipeline only with several
                meshes = _stage_meshes(options, submesh)
                if not meshes:
                    continue
                # interleaved chunks are cut after the search, so they share one logical mesh
                for group in [[m] for m in meshes] if schedule in INTERLEAVED else [meshes]:
                    candidates += _search_submesh(graph, layers, options, popts, schedule, microbatches, submesh,
                                                  group)
    return _refine(candidates, options, popts), trace_s


def _refine(candidates: list[_Candidate], options: PlannerOptions, popts: PipelineOptions) -> list[_Candidate]:
    """Search the ``REFINED`` best pipelines again with the boundaries inside their stages
    costed (two ILPs more per distinct pair of adjacent layers, so not for every sub-mesh);
    best first."""
    candidates = sorted(candidates, key=lambda c: c.step_time_s)
    for i, c in enumerate(candidates[:REFINED]):
        again = _search_submesh(c.graph, c.layers, options, popts, c.schedule, c.microbatches, c.submesh,
                                list(c.costs or {}), boundaries=True, costs=c.costs,
                                tied_meshes=[c.tied_mesh] if c.tied_mesh else None)
        if again:
            candidates[i] = again[0]
    return sorted(candidates, key=lambda c: c.step_time_s)


def _stage_results(candidate: _Candidate, options: PlannerOptions, schedule: str
                   ) -> list[tuple[TracedGraph, IntraOpResult, CostContext]]:
    """One exact intra-op ILP per stage; a stage equal to one already solved (the same layers,
    in the same place of the pipeline, the same budget) takes its answer, renamed. A parameter
    that several stages read (a tied weight) is stored as the first of them chose, so that its
    copies' gradients sum shard by shard and no stage redistributes it.

    A pipeline rank holding several stages (interleaved) splits its memory among them
    (:func:`_split_budget`); where a stage's share proves smaller than the least it needs (the
    search's estimate can be low: a tied weight pinned to the first stage's placement), the
    rank's stages are planned again with that stage's least need, up to ``BUDGET_RETRIES``
    times."""
    stages, ranks = len(candidate.cuts), candidate.ranks
    solved: dict[tuple, tuple[TracedGraph, IntraOpResult]] = {}
    stored: dict[str, ShardingSpec] = {}  # FQN -> spec chosen by the first stage holding it
    results: dict[int, tuple[TracedGraph, IntraOpResult, CostContext]] = {}
    least, fast = _stage_needs(candidate)
    for rank in range(ranks):
        mine = list(range(rank, stages, ranks))
        for attempt in range(BUDGET_RETRIES + 1):
            kept = dict(stored)
            budgets = _split_budget(options.memory_budget, least, fast, ranks)
            needed = sum(least[t] for t in mine)
            if options.memory_budget is not None and len(mine) > 1 and needed > options.memory_budget:
                raise MemoryInfeasibleError(
                    f"the {len(mine)} stages of pipeline rank {rank} need at least {format_bytes(needed)} per device "
                    f"together, more than {format_bytes(options.memory_budget)}: give more memory or use 1f1b", needed)
            try:
                for s in mine:
                    results[s] = _plan_stage(candidate, s, budgets[s], options, schedule, solved, stored)
                break
            except MemoryInfeasibleError as e:
                stored.clear()
                stored.update(kept)
                if attempt == BUDGET_RETRIES or len(mine) == 1 or e.least_memory_bytes <= least[s]:
                    raise
                least[s] = e.least_memory_bytes
    return [results[s] for s in range(stages)]


def _plan_stage(candidate: _Candidate, index: int, budget: float | None, options: PlannerOptions, schedule: str,
                solved: dict[tuple, tuple[TracedGraph, IntraOpResult]], stored: dict[str, ShardingSpec],
                ) -> tuple[TracedGraph, IntraOpResult, CostContext]:
    """The exact ILP of one stage under ``budget``; records the placements of the parameters it
    stores first in ``stored``."""
    stages = len(candidate.cuts)
    (start, end), mesh = candidate.cuts[index], candidate.meshes[index]

    def allow_storage(info: NodeInfo, spec: ShardingSpec) -> bool:
        if info.fqn in stored:
            return spec == stored[info.fqn]
        return options.allow_storage is None or options.allow_storage(info, spec)

    nodes = [n for layer in candidate.layers[start:end] for n in layer.nodes]
    sub = extract(candidate.graph, nodes) if stages > 1 else candidate.graph
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device,
                      options.optimizer, microbatches=candidate.microbatches,
                      activations_in_flight=activations_in_flight(schedule, candidate.microbatches, stages),
                      remat=options.remat)
    pinned = tuple(sorted((fqn, stored[fqn]) for fqn in {info.fqn for info in sub.nodes.values()}
                          if fqn in stored))
    if any(len(spec) != len(mesh) for _, spec in pinned):
        raise AutoplanError(f"a tied parameter is stored on another logical mesh than {mesh_label(mesh)}: "
                            "the stages holding it must share one")
    key = (tuple(layer.signature for layer in candidate.layers[start:end]), start == 0,
           end == len(candidate.layers), pinned, mesh, budget)
    result = _renamed(*solved[key], sub) if key in solved else None
    if result is None:
        result = plan_intra_op(sub, find_classes(sub), mesh, ctx, budget,
                               options.solver, options.time_limit_s, allow_storage=allow_storage)
        solved[key] = (sub, result)
    for name, strategy in result.chosen.items():
        info = sub.nodes[name]
        if info.kind == "parameter" and info.fqn:
            stored.setdefault(info.fqn, strategy.output_spec)
    return sub, result, ctx


def _stage_needs(candidate: _Candidate) -> tuple[list[float], list[float]]:
    """Each stage's least memory and its fastest plans' memory, by the search's layer costs (by
    layer count, least 0, where they are not at hand)."""
    least, fast = [], []
    reads = layer_inputs(candidate.graph, candidate.layers)
    for (start, end), mesh in zip(candidate.cuts, candidate.meshes):
        if candidate.costs and mesh in candidate.costs:
            table = _RangeTable(candidate.graph, candidate.layers, candidate.costs[mesh], False, reads)
            least.append(table.least_memory(start, end))
            fast.append(max(least[-1], table.cost(start, end, None)[1]))
        else:
            least.append(0.0)
            fast.append(float(end - start))
    return least, fast


def _split_budget(budget: float | None, least: list[float], fast: list[float], ranks: int) -> list[float | None]:
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


def _renamed(graph: TracedGraph, result: IntraOpResult, other: TracedGraph) -> IntraOpResult | None:
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


def _assemble(spec: ModelSpec, candidate: _Candidate, options: PlannerOptions, schedule: str,
              timings: dict[str, float]) -> Plan:
    results = _stage_results(candidate, options, schedule)
    link = _link_between_stages(options, candidate.submesh)
    graph, layers = candidate.graph, candidate.layers
    crossing = cut_bytes(graph, layers)
    stage_plans, nodes, collectives, params, inputs = [], [], [], {}, {}
    latencies, memories, computes, comms, kinds = [], [], [], [], []
    for index, ((start, end), (sub, result, ctx)) in enumerate(zip(candidate.cuts, results)):
        prediction, stage_collectives = predict(sub, find_classes(sub), result, ctx)
        for c in stage_collectives:
            c.stages = [index]
        send_bytes = crossing[end] if end < len(layers) else 0.0
        send = 2 * collective_time("send_recv", send_bytes, 2, link) if send_bytes else 0.0
        if send_bytes:
            where = f"stage {index} -> stage {index + 1}"
            stage_collectives += [
                PlannedCollective("send_recv", phase, -1, send_bytes, candidate.microbatches, where,
                                  stages=[index, index + 1]) for phase in ("forward", "backward")]
        latencies.append(prediction.step_time_s / candidate.microbatches + send)
        memories.append(prediction.memory_bytes)
        computes.append(prediction.compute_s)
        comms.append(prediction.comm_s + send * candidate.microbatches)
        by_kind = dict(prediction.comm_by_kind_s)
        if send:
            by_kind["send_recv"] = send * candidate.microbatches
        kinds.append(by_kind)
        collectives += stage_collectives
        nodes += node_plans(sub, result)
        stage_params = placements(sub, result, ("parameter", "buffer"))
        params.update(stage_params)
        for name, spec_ in placements(sub, result, ("input",)).items():
            inputs.setdefault(name, spec_)
        size, rank = candidate.submesh.size, index % candidate.ranks
        stage_plans.append(StagePlan([layer.name for layer in layers[start:end]],
                                     list(range(rank * size, (rank + 1) * size)), list(candidate.meshes[index]),
                                     [n for layer in layers[start:end] for n in layer.nodes], list(stage_params),
                                     latencies[-1], memories[-1].peak))
    after, after_kinds = (_after_schedule(graph, stage_plans, params, options, link, collectives)
                          if len(stage_plans) > 1 else (0.0, {}))
    scheduled = pipeline_time(latencies, candidate.microbatches, schedule)
    step = scheduled + after
    worst = max(_per_rank(memories, candidate.ranks), key=lambda m: m.peak)
    busiest = max(range(len(latencies)), key=lambda i: latencies[i])
    by_kind = dict(kinds[busiest])
    for kind, seconds in after_kinds.items():
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    predicted = Prediction(step, computes[busiest], comms[busiest] + after, MemoryEstimate(**vars(worst)), by_kind,
                           bubble_s=max(0.0, scheduled - candidate.microbatches * max(latencies)))
    first = results[0][1]
    warnings_ = sorted({w for _, r, _ in results for w in r.warnings})
    emit_warnings(warnings_)
    return Plan(
        graph_hash=graph.graph_hash, devices=options.devices, cluster=options.cluster.to_dict(),
        mesh=list(candidate.meshes[0]), stages=stage_plans, microbatches=candidate.microbatches,
        schedule=schedule if len(stage_plans) > 1 else "none", params=params, inputs=inputs, nodes=nodes,
        collectives=collectives, predicted=predicted, solver=solver_stats(first), timings_s=timings,
        warnings=warnings_, model=spec.name)


def _per_rank(memories: list[MemoryEstimate], ranks: int) -> list[MemoryEstimate]:
    """Each pipeline rank's memory: the sum over the stages it holds (stage ``s`` on rank
    ``s % ranks``; several with the interleaved schedules). The sum of the peaks bounds the
    rank's peak from above."""
    out = []
    for rank in range(ranks):
        mine = memories[rank::ranks]
        out.append(MemoryEstimate(*(sum(getattr(m, f) for m in mine)
                                    for f in ("params", "grads", "optimizer", "activations", "peak"))))
    return out


def _after_schedule(graph: TracedGraph, stages: list[StagePlan], params: dict[str, list[str]],
                    options: PlannerOptions, link: LinkSpec, collectives: list[PlannedCollective]
                    ) -> tuple[float, dict[str, float]]:
    """The collectives a pipelined step runs after its schedule, appended to ``collectives``,
    and their seconds (total and by kind): a parameter held by stages on several pipeline ranks
    (a tied weight) has its copies' gradients all-reduced among those ranks, once per step; the
    loss is broadcast from the last stage to every rank."""
    seconds: dict[str, float] = {}
    infos = {info.fqn: info for info in graph.nodes.values() if info.kind == "parameter" and info.fqn}
    for fqn, info in infos.items():
        owners = [i for i, st in enumerate(stages) if fqn in st.params]
        blocks = {stages[i].devices[0] for i in owners}
        if len(blocks) < 2 or not is_floating(info.dtype) or info.shape is None:
            continue
        spec = spec_from_json(params.get(fqn, ["R"] * len(stages[owners[0]].mesh)))
        nbytes = math.prod(local_shape(info.shape, spec, tuple(stages[owners[0]].mesh))) * info.itemsize
        seconds[ALL_REDUCE] = seconds.get(ALL_REDUCE, 0.0) + collective_time(ALL_REDUCE, nbytes, len(blocks), link)
        collectives.append(PlannedCollective(ALL_REDUCE, "backward", -1, nbytes, 1, f"{fqn}: its copies' gradients",
                                             "gradient", stages=owners))
    loss_bytes = 4.0  # the float32 scalar
    seconds[BROADCAST] = collective_time(BROADCAST, loss_bytes, options.devices, link)
    collectives.append(PlannedCollective(BROADCAST, "forward", -1, loss_bytes, 1, "loss -> every rank", "loss"))
    return sum(seconds.values()), seconds


def candidate_name(c: _Candidate) -> str:
    meshes = ("mesh " + mesh_label(c.meshes[0]) if len(set(c.meshes)) == 1
              else "meshes " + "/".join(mesh_label(m) for m in c.meshes))
    return f"{len(c.cuts)} stage(s) x {meshes}, {c.microbatches} microbatch(es)"


def _no_plan_fits(spec: ModelSpec, options: PlannerOptions) -> MemoryInfeasibleError:
    """The error when no pipeline fits: it states the least memory of a plan without one."""
    from autoplan.planner.api import plan_traced

    try:
        plan_traced(trace(spec), replace(options, mesh=None))
    except MemoryInfeasibleError as e:
        least = e.least_memory_bytes
    else:  # a single-stage plan fits, but not with the pinned pipeline choices
        return MemoryInfeasibleError(f"no pipeline with the pinned choices fits {format_bytes(options.memory_budget)} "
                                     f"per device: pin fewer stages or more microbatches, or give more memory", 0.0)
    return MemoryInfeasibleError(
        f"no plan fits {format_bytes(options.memory_budget)} per device, pipelines included: the least any plan "
        f"needs is more than that (without a pipeline {format_bytes(least)}); give more memory "
        f"(--memory-per-device) or more devices", least)


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The search allocates millions of small objects (strategies, cost matrices, solver
    models) and leaves no reference cycles worth collecting while it runs; the cyclic
    collector's passes over them took about an eighth of the 39B case's planning time (memory
    peak with it paused: 514 MB against 465 MB). Cycles are collected when it resumes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def plan_pipeline(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions = PipelineOptions()) -> Plan:
    """Search stages × sub-meshes × logical meshes × microbatches and plan the best pipeline."""
    with _cyclic_gc_paused():
        return _plan_pipeline(spec, options, popts)


def _plan_pipeline(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions) -> Plan:
    if popts.schedule is not None:
        popts = replace(popts, schedule=normalize_schedule(popts.schedule))
    start = time.perf_counter()
    candidates, trace_s = search_pipelines(spec, options, popts)
    if not candidates:
        raise _no_plan_fits(spec, options)
    schedule = popts.schedule or "1f1b"
    search_s = time.perf_counter() - start - trace_s
    close = [c for c in candidates[:REFINED] if c.step_time_s <= candidates[0].step_time_s * (1 + RERANK_MARGIN)]
    planned: list[tuple[Plan, _Candidate]] = []
    errors: list[AutoplanError] = []
    for candidate in close:
        try:
            chosen = interleave(candidate) if schedule in INTERLEAVED else candidate
            planned.append((_assemble(spec, chosen, options, schedule, {}), candidate))
        except AutoplanError as e:
            errors.append(e)
    if not planned:
        raise errors[0]
    plan, best = min(planned, key=lambda pc: pc[0].predicted.step_time_s)
    plan.timings_s = {"trace": trace_s, "search": search_s, "total": time.perf_counter() - start}
    plan.alternatives = [Alternative(candidate_name(c), [len(c.cuts), *c.meshes[0]], p.predicted,
                                     f"{format_seconds(c.step_time_s)} per step in the stage search; planned exactly")
                         for p, c in planned if c is not best]
    plan.alternatives += [Alternative(candidate_name(c), [len(c.cuts), *c.meshes[0]], None,
                                      f"{format_seconds(c.step_time_s)} per step in the stage search")
                          for c in candidates[len(close):][:max(0, 6 - len(planned))]]
    return plan
