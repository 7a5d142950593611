"""Layer and layer-range costs for the stage search: each distinct layer's ILP once per logical
mesh, a range as its layers plus the boundaries between them (see the package docstring)."""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from autoplan.cost_models import LinkSpec
from autoplan.cost_models.step_costs import CostContext, value_itemsize
from autoplan.cost_models.transient_memory import backward_transient
from autoplan.planner.api import PlannerOptions
from autoplan.planner.mesh_plan import (IntraOpResult, PreparedPlan, plan_intra_op, prepare_intra_op, recompute_change,
                                       splits_dims_over_axes)
from autoplan.planner.recompute import (RecomputeMode, RecomputePolicy, every_layer, lighter_mode, policy_mode,
    recomputable, regions, saved_outputs)
from autoplan.sharding import boundary_shards
from autoplan.solvers import evaluate
from autoplan.solvers.intra_op.trimming import TrimPath, TrimWalk
from autoplan.solvers.inter_op import SubMesh
from autoplan.solvers.intra_op import IntraOpProblem
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.trace.layers import Layer
from autoplan.trace.repeated import find_classes
from autoplan.trace.subgraph import extract, loss_name, model_outputs

FAST, LEAN = "fast", "lean"  # how a layer is costed in the stage search (LayerCosts.cost)
# a range recomputing every layer is trimmed recomputed only where it holds at most this many
# times the layers of a stage of a balanced pipeline (:meth:`RangeTable._recomputed_trimmed`)
RECOMPUTED_TRIM_REACH = 2
# ... and where the other estimate of it trimmed adds more than this share to its untrimmed seconds
TRIMMED_CLOSE = 0.25


@dataclass
class LayerCosts:
    """Per-layer ILP costs on one logical mesh, cached by the layer's signature."""

    options: PlannerOptions
    ctx: CostContext
    cache: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    # the layers' ILPs with gathered storage among the choices (FSDP, ZeRO-1/2) and their
    # fastest answers: what trimming and the least-memory plans choose from
    problems: dict[str, IntraOpProblem] = field(default_factory=dict)
    fast_choices: dict[str, list[int]] = field(default_factory=dict)
    trims: dict[tuple, tuple[float, float] | None] = field(default_factory=dict)
    trim_paths: dict[tuple, TrimPath] = field(default_factory=dict)  # by the layers' signature counts
    trim_walks: dict[tuple[str, ...], TrimWalk] = field(default_factory=dict)  # by their signatures (any counts)
    # (seconds, bytes) of a walk's choices after so many switches: budgets between two steps share them
    trim_steps: dict[tuple[tuple, int], tuple[float, float]] = field(default_factory=dict)
    pairs: dict[tuple[str, str], float] = field(default_factory=dict)  # boundary corrections
    # the seconds recomputing the second layer of a pair adds, in the pair's plan, by
    # (first signature, second signature, mode) (:meth:`boundary`)
    recompute_in_pair: dict[tuple[str, str, RecomputeMode], float] = field(default_factory=dict)
    # recomputing a fastest plan, by (signature, mode)
    changes: dict[tuple[str, RecomputeMode], tuple[float, float]] = field(default_factory=dict)
    # the backward's transient of a fastest plan, kept (mode None) or recomputed, by (signature, mode)
    transients: dict[tuple[str, RecomputeMode | None], float] = field(default_factory=dict)
    # a layer's own graph and strategies, shared by its fastest and its storage ILP (with the
    # layer they were made from: layers of one signature differ in their nodes' names)
    prepared: dict[str, tuple[Layer, TracedGraph, PreparedPlan]] = field(default_factory=dict)
    stages: int = 1  # the pipeline's stages (ranks) these costs are for
    # each node's strategy (by name) in a layer's fastest plan, by signature (:meth:`cost`)
    fast_names: dict[str, dict[str, str]] = field(default_factory=dict)
    # a layer's storage ILP recomputed in a mode, by (signature, mode), and where its trimming
    # starts, by (signature, mode, start) (:meth:`recomputed_problem`)
    recomputed_problems: dict[tuple[str, RecomputeMode], IntraOpProblem] = field(default_factory=dict)
    recomputed_starts: dict[tuple[str, RecomputeMode, str], list[int]] = field(default_factory=dict)
    # a layer's fastest plan, its graph and the layer it was made from, by signature: what
    # recomputing it in a mode changes is worked out from them (:meth:`recomputed`)
    fast_results: dict[str, tuple[Layer, TracedGraph, IntraOpResult]] = field(default_factory=dict)

    @property
    def lighter(self) -> RecomputeMode:
        """The mode of the layers recomputed keeping some outputs (:func:`lighter_mode`)."""
        return lighter_mode(self.options.recompute)

    def portable(self) -> LayerCosts:
        """A copy to send between processes: without the options (they may hold functions) or
        the edge-cost memo or the trimming walks (and what they found) or the layers' graphs,
        fastest plans or recomputed problems (:meth:`restore` puts the options back)."""
        return replace(self, options=None, ctx=replace(self.ctx, cache={}), trim_paths={}, trim_walks={},
                       trim_steps={}, prepared={}, recomputed_problems={}, fast_results={})

    def _prepared(self, graph: TracedGraph, layer: Layer) -> tuple[Layer, TracedGraph, PreparedPlan]:
        """The first layer of ``layer``'s signature costed, its own graph and its strategies on
        this mesh (:func:`prepare_intra_op`)."""
        if layer.signature not in self.prepared:
            sub = small_whole(extract(graph, list(layer.nodes)), whole_below(self.options))
            self.prepared[layer.signature] = (layer, sub, prepare_intra_op(
                sub, find_classes(sub), self.ctx.mesh_shape, self.ctx, self.options.allow_storage, self.options.pins))
        return self.prepared[layer.signature]

    def restore(self, options: PlannerOptions) -> None:
        self.options = options

    def cost(self, graph: TracedGraph, layer: Layer, mode: str = FAST) -> tuple[float, float]:
        """(seconds per step, bytes per device) of one layer, by ``mode``: its fastest plan
        (``FAST``, its own ILP, parameters stored as read) or its least-memory plan (``LEAN``,
        gathered storage among the choices)."""
        key = (layer.signature, mode)
        if key not in self.cache:
            if mode == LEAN:  # the least-memory choice of every group (cheapest among equals): no ILP
                problem = self.storage_problem(graph, layer)
                choices = [min(range(len(m)), key=lambda i, m=m, c=c: (m[i], c[i]))
                           for m, c in zip(problem.memory, problem.costs)]
                self.cache[key] = evaluate(problem, choices)
            else:
                layer, sub, prepared = self._prepared(graph, layer)
                result = plan_intra_op(sub, prepared.classes, self.ctx.mesh_shape, self.ctx, None,
                                       self.options.solver, self.options.time_limit_s,
                                       allow_storage=self.options.allow_storage, canonical=False,
                                       pins=self.options.pins, prepared=prepared)
                self.fast_results[layer.signature] = (layer, sub, result)
                self.transients.update(layer_transients(sub, layer, result, self.ctx, (None,)))
                for mode in (RecomputeMode.FULL, self.lighter):
                    self._recomputing(layer.signature, mode)
                self.fast_names[layer.signature] = {name: chosen.name for name, chosen in result.chosen.items()}
                if splits_dims_over_axes(self.ctx):  # its ILP had gathered storage among the choices
                    self.problems.setdefault(layer.signature, result.problem)  # (mesh_plan._solve):
                    self.fast_choices.setdefault(layer.signature, result.solution.choices)  # the storage ILP
                self.cache[key] = (result.solution.objective, result.solution.memory)
        return self.cache[key]

    def storage_problem(self, graph: TracedGraph, layer: Layer) -> IntraOpProblem:
        """One layer's ILP with gathered storage among the choices, solved without a budget
        once (its fastest answer is where trimming starts): a layer that does not fit sheds
        parameter, gradient and optimizer-state memory through FSDP and ZeRO-1/2 as well as
        through tensor parallelism."""
        if layer.signature not in self.problems and splits_dims_over_axes(self.ctx):
            self.cost(graph, layer)  # the fastest plan's ILP is this one there: solved once
        if layer.signature not in self.problems:
            _, sub, prepared = self._prepared(graph, layer)
            result = plan_intra_op(sub, prepared.classes, self.ctx.mesh_shape, self.ctx, None,
                                   self.options.solver, self.options.time_limit_s,
                                   allow_storage=self.options.allow_storage, canonical=False,
                                   pins=self.options.pins, gathered_storage=True, prepared=prepared)
            self.problems[layer.signature] = result.problem
            self.fast_choices[layer.signature] = result.solution.choices
        return self.problems[layer.signature]

    def recomputed(self, graph: TracedGraph, layer: Layer, mode: RecomputeMode = RecomputeMode.FULL
                   ) -> tuple[float, float]:
        """(seconds per step, bytes per device) of one layer's fastest plan recomputed in the
        backward in ``mode``, the same strategies
        (:func:`~autoplan.planner.mesh_plan.recompute_change`: no ILP)."""
        seconds, memory = self.cost(graph, layer)
        added, freed = self._recomputing(layer.signature, mode)
        return seconds + added, memory - freed

    def _recomputing(self, signature: str, mode: RecomputeMode) -> tuple[float, float]:
        """(seconds added, bytes freed) recomputing a layer's fastest plan in ``mode`` (computed
        with the backward's transient so for the modes the search reads, on demand for another)."""
        if (signature, mode) not in self.changes:
            layer, sub, result = self.fast_results[signature]
            self.changes[signature, mode] = recompute_change(sub, result, self.ctx, saved_outputs(sub, [layer], mode))
            self.transients.update(layer_transients(sub, layer, result, self.ctx, (mode,)))
        return self.changes[signature, mode]

    def recomputed_problem(self, graph: TracedGraph, layer: Layer, mode: RecomputeMode, start: str = FAST
                           ) -> tuple[IntraOpProblem, list[int]]:
        """One layer's ILP with gathered storage among the choices and the layer recomputed in
        ``mode`` in its costs (each choice's seconds with the forward run again, its memory
        without what recomputation frees), built, not solved, and where trimming it starts: the
        strategies of the layer's fastest plan (``FAST``: :meth:`cost`) or of the fastest with
        gathered storage among the choices (``LEAN``: :meth:`storage_problem`), each group as
        that plan chose it by name (a group that recomputation splits off, its cheapest). The two
        differ where storing weights sharded and gathered pays: Llama 3.1 405B's block on 8x8 is
        tensor parallel in the first and data parallel, its weights held gathered through the
        step, in the second, from which trimming reaches a small budget only by gathering the
        weights every microbatch."""
        if (layer.signature, mode) not in self.recomputed_problems:
            first, sub, _ = self._prepared(graph, layer)
            saved = saved_outputs(sub, [first], mode)
            ctx = replace(self.ctx, recompute_regions=regions([first]), recompute_saved=saved)
            self.recomputed_problems[layer.signature, mode] = plan_intra_op(
                sub, find_classes(sub), self.ctx.mesh_shape, ctx, None, allow_storage=self.options.allow_storage,
                pins=self.options.pins, pick=lambda group, names: 0).problem
        built = self.recomputed_problems[layer.signature, mode]
        key = (layer.signature, mode, start)
        if key not in self.recomputed_starts:
            self.cost(graph, layer)
            chosen = self.fast_names[layer.signature] if start == FAST else \
                named_choices(self.storage_problem(graph, layer), self.fast_choices[layer.signature])
            starts = []
            for g in range(built.num_groups):
                names = built.choice_names[g] if built.choice_names else []
                wanted = chosen.get(built.group_name(g))
                starts.append(names.index(wanted) if wanted in names else
                              min(range(built.num_choices(g)), key=lambda i, g=g: built.costs[g][i]))
            self.recomputed_starts[key] = starts
        return built, self.recomputed_starts[key]

    def transient(self, graph: TracedGraph, layer: Layer, mode: RecomputeMode | None = None) -> float:
        """Bytes per device the backward of one layer's fastest plan holds above its kept values
        at its peak, kept or recomputed in ``mode`` (:func:`layer_transients`)."""
        self.cost(graph, layer)
        if mode is not None:
            self._recomputing(layer.signature, mode)
        return self.transients[layer.signature, mode]

    def trimmed(self, graph: TracedGraph, layers: list[Layer], budget: float,
                modes: list[RecomputeMode] | None = None, start: str = FAST) -> tuple[float, float] | None:
        """(seconds, bytes) of ``layers``' fastest plans trimmed together until they fit
        ``budget`` bytes (:func:`autoplan.solvers.trim_memory_together`, a greedy estimate, no
        ILP: each step frees memory where it costs the least time per byte, in any layer; equal
        layers switch alike, as their classes do in the ILP). With ``modes``, layer ``k``
        recomputed in ``modes[k]``: its problem and where it starts are :meth:`recomputed_problem`'s
        (from ``start``). None if even their least-memory plans do not fit."""
        kinds = [(layer.signature, f"{modes[k].value} from {start}" if modes else "")
                 for k, layer in enumerate(layers)]
        counts = collections.Counter(kinds)
        key = (tuple(sorted(counts.items())), budget)
        if key not in self.trims:
            order = sorted(counts)
            first = {kind: k for k, kind in reversed(list(enumerate(kinds)))}  # a layer of each kind
            problems, starts = [], []
            for kind in order:
                layer = layers[first[kind]]
                if modes:
                    problem, chosen = self.recomputed_problem(graph, layer, modes[first[kind]], start)
                else:
                    problem, chosen = self.storage_problem(graph, layer), self.fast_choices[kind[0]]
                problems.append(problem)
                starts.append(chosen)
            path_key = key[0]
            if path_key not in self.trim_paths:
                if tuple(order) not in self.trim_walks:
                    self.trim_walks[tuple(order)] = TrimWalk(problems, starts)
                self.trim_paths[path_key] = TrimPath(problems, [counts[kind] for kind in order], starts,
                                                     self.trim_walks[tuple(order)])
            path = self.trim_paths[path_key]
            steps = path.steps_to(budget)
            if steps is not None and (path_key, steps) not in self.trim_steps:
                total = (0.0, 0.0)
                for kind, problem, chosen in zip(order, problems, path.choices_after(steps)):
                    seconds, memory = evaluate(problem, chosen)
                    total = add_costs(total, (counts[kind] * seconds, counts[kind] * memory))
                self.trim_steps[path_key, steps] = total
            self.trims[key] = None if steps is None else self.trim_steps[path_key, steps]
        return self.trims[key]

    def boundary(self, graph: TracedGraph, first: Layer, second: Layer) -> float:
        """Seconds that planning two adjacent layers together adds to planning them apart (their
        fastest plans). Apart, every value the first layer hands on leaves it as it would cross
        a stage boundary (:func:`~autoplan.sharding.boundary_spec`), and the second layer takes
        it so; together, it may stay as the first computes it: the correction is usually a
        saving. Memory is not corrected: apart, the handed-on value counts in both layers, which
        errs on the safe side (the pair's own plan may differ from both layers', so a memory
        correction taken from it can err on the unsafe side).

        A range adds its boundaries' corrections to its layers' seconds, so each layer's seconds
        meet the corrections of the boundaries on both its sides. Where apart the layers take
        plans that together they do not (Llama 3.1 405B's blocks on a 1-D mesh of 128 devices:
        6.36 s apart, 6.17 s a pair, a correction of -6.56 s), the corrections of a long range
        would outweigh its layers and its estimate fall below nothing. A correction saves at
        most half of the two layers' seconds, so that a range's estimate keeps at least half
        of its first and last layers'.

        The pair's plan also gives the seconds that recomputing the second layer adds where
        it follows the first (:meth:`recompute_seconds`)."""
        key = (first.signature, second.signature)
        if key not in self.pairs:
            sub = small_whole(extract(graph, list(first.nodes) + list(second.nodes)), whole_below(self.options))
            result = plan_intra_op(sub, find_classes(sub), self.ctx.mesh_shape, self.ctx, None,
                                   self.options.solver, self.options.time_limit_s,
                                   allow_storage=self.options.allow_storage, canonical=False,
                                   pins=self.options.pins)
            apart = self.cost(graph, first)[0] + self.cost(graph, second)[0]
            self.pairs[key] = max(result.solution.objective - apart, -apart / 2)
            only = frozenset(second.nodes)
            for mode in (RecomputeMode.FULL, self.lighter):
                kept = saved_outputs(sub, [second], mode)
                self.recompute_in_pair[(*key, mode)] = recompute_change(sub, result, self.ctx, kept, only)[0]
        return self.pairs[key]

    def recompute_seconds(self, graph: TracedGraph, layer: Layer, mode: RecomputeMode,
                          before: Layer | None = None) -> float:
        """Seconds per step that recomputing ``layer``'s fastest plan in ``mode`` adds: its own ops
        in the plan of the pair it forms with the layer ``before`` it, where it follows that
        layer inside a stage and their pair is costed (:meth:`boundary`); else in its own plan
        (:meth:`recomputed`). Alone, a layer receives its inputs as across a stage boundary, and
        its plan may gather them and compute its first ops replicated before it shards them
        (Llama 3.1 8B's block on a 4x8 mesh: its RMSNorm's upcast on the whole batch, measured
        when inputs crossed whole), which recomputing would run again; in
        the pair it takes them as the layer before hands them on (the block's recomputation
        costed 21% less there)."""
        key = None if before is None else (before.signature, layer.signature, mode)
        if key in self.recompute_in_pair:
            return self.recompute_in_pair[key]
        return self.recomputed(graph, layer, mode)[0] - self.cost(graph, layer)[0]


def named_choices(problem: IntraOpProblem, choices: list[int]) -> dict[str, str]:
    """Each group's chosen choice, by the group's and the choice's names."""
    return {problem.group_name(g): problem.choice_name(g, i) for g, i in enumerate(choices)}


def layer_transients(sub: TracedGraph, layer: Layer, result: IntraOpResult, ctx: CostContext,
                     modes: Iterable[RecomputeMode | None]) -> dict[tuple[str, RecomputeMode | None], float]:
    """The backward's transient (:func:`~autoplan.cost_models.transient_memory.backward_transient`)
    of one layer's plan ``result`` on its own graph ``sub``, kept (mode None) or recomputed in
    each of ``modes``, by (signature, mode)."""
    outputs = model_outputs(sub)

    def held(again: CostContext) -> float:
        return backward_transient(sub.nodes, result.chosen, result.input_names, result.needs_grad, outputs, again)

    return {(layer.signature, mode): held(ctx) if mode is None else held(replace(
        ctx, recompute_regions=regions([layer]), recompute_saved=saved_outputs(sub, [layer], mode)))
            for mode in modes}


def link_between_stages(options: PlannerOptions, submesh: SubMesh) -> LinkSpec:
    cluster = options.cluster
    return cluster.intra_node if submesh.nodes == 1 and submesh.devices < cluster.devices_per_node else \
        cluster.inter_node


def cut_bytes(graph: TracedGraph, layers: list[Layer], mesh_shape: tuple[int, ...] = (),
              whole: frozenset[str] = frozenset(), below: float = 0.0) -> list[float]:
    """``out[c]``: bytes of the values that layers before ``c`` hand to layers at or after it
    (one microbatch), for every cut 0..len(layers): what each rank of a stage on ``mesh_shape``
    sends the next, its shard of each value (:func:`~autoplan.sharding.boundary_spec`; no
    mesh, a value in ``whole`` or one :func:`crosses_whole`: the whole value). A value produced in
    layer i and last read in layer j (or, the loss, by the graph's output) crosses the cuts
    i+1..j. (Sizes in the traced dtype: pipeline stages send their values so, under bf16
    autocast too.)"""
    layer_of = layer_index(layers)
    fx_nodes = graph.fx_nodes
    loss = loss_name(graph)
    diff = [0.0] * (len(layers) + 2)
    for name, i in layer_of.items():
        last = max((layer_of.get(user.name, len(layers)) for user in fx_nodes[name].users
                    if user.op != "output" or name == loss), default=i)
        info = graph.nodes[name]
        if last > i and info.shape is not None:
            nbytes = math.prod(info.shape) * info.itemsize
            if name not in whole and not crosses_whole(info, below):
                nbytes /= boundary_shards(info.shape, mesh_shape)
            diff[i + 1] += nbytes
            diff[last + 1] -= nbytes
    return list(itertools.accumulate(diff))[:len(layers) + 1]


def whole_below(options: PlannerOptions) -> float:
    """Bytes below which a value crosses a stage boundary whole: what the link between stages
    inside a node moves in one latency (its latency times its bandwidth). Sharding a smaller
    value saves less than a latency of transfer, and where the next stage computes on it whole
    it costs an all-gather, a latency at least, each microbatch (a small model's pipeline on
    H100s ran 2.8 times slower with every value sharded)."""
    rates = options.cluster.intra_node.rates("send_recv")
    return rates.latency * rates.bandwidth


def crosses_whole(info: NodeInfo, below: float) -> bool:
    """Whether a value crosses a stage boundary whole: it is smaller than ``below`` bytes (in
    its traced dtype), or the same for every sample (:attr:`NodeInfo.batch_free`: a rotary
    table, which batch shards read whole)."""
    return info.shape is not None and (info.batch_free or math.prod(info.shape) * info.itemsize < below)


def small_whole(sub: TracedGraph, below: float) -> TracedGraph:
    """``sub`` (a layer's or a stage's graph) with its values smaller than ``below`` bytes,
    and those the same for every sample, crossing whole (:func:`crosses_whole`)."""
    small = frozenset(name for name, info in sub.nodes.items() if crosses_whole(info, below))
    return replace(sub, whole_values=sub.whole_values | small) if small else sub


def whole_crossings(graph: TracedGraph, layers: list[Layer], cuts: list[tuple[int, int]],
                    meshes: list[tuple[int, ...]]) -> frozenset[str]:
    """The values of a pipeline (stages ``cuts`` of ``layers`` on logical ``meshes``) that cross
    its stage boundaries whole: those whose way from the stage computing them (the first, for a
    user input) to the last stage reading them passes a stage on another logical mesh (the
    program lays them out alike: :class:`~autoplan.codegen.pipeline_program.StageCrossing`)."""
    if len({tuple(m) for m in meshes}) < 2:
        return frozenset()
    layer_of = layer_index(layers)
    stage_of_layer = {i: s for s, (start, end) in enumerate(cuts) for i in range(start, end)}
    out: set[str] = set()
    for node in graph.graph_module.graph.nodes:
        info = graph.nodes.get(node.name)
        if info is None or (node.name not in layer_of and info.kind != "input"):
            continue
        first = stage_of_layer[layer_of[node.name]] if node.name in layer_of else 0
        last = max((stage_of_layer[layer_of[u.name]] for u in node.users if u.name in layer_of), default=first)
        if len({tuple(meshes[s]) for s in range(first, last + 1)}) > 1:
            out.add(node.name)
    return frozenset(out)


def layer_index(layers: list[Layer]) -> dict[str, int]:
    """Node name -> the index of the layer holding it."""
    return {name: i for i, layer in enumerate(layers) for name in layer.nodes}


def tied_layers(graph: TracedGraph, layers: list[Layer]) -> set[int]:
    """The layers that read a parameter another layer also reads (a tied embedding and head):
    the stages holding them must store it alike, so they share a logical mesh."""
    layer_of = layer_index(layers)
    out: set[int] = set()
    for node in graph.graph_module.graph.nodes:
        info = graph.nodes.get(node.name)
        if info is None or info.kind != "parameter":
            continue
        readers = {layer_of[user.name] for user in node.users if user.name in layer_of}
        if len(readers) > 1:
            out |= readers
    return out


def layer_costs(options: PlannerOptions, mesh: tuple[int, ...], microbatches: int, in_flight: int,
                stages: int = 1) -> LayerCosts:
    cluster = options.cluster
    ctx = CostContext(mesh, cluster.mesh_links(mesh), cluster.device, options.optimizer,
                      microbatches=microbatches, activations_in_flight=in_flight, one_stage=stages == 1)
    return LayerCosts(options, ctx, stages=stages)


@dataclass(frozen=True)
class RangePlan:
    """A layer range's estimated plan: seconds per step, bytes per device (at the step's peak,
    the backward's transient included, where :meth:`RangeTable.plan` returns it), and the
    (absolute) indices of the layers it recomputes in the backward."""

    seconds: float
    memory: float
    recomputed: frozenset[int] = frozenset()
    selective: frozenset[int] = frozenset()  # those of them recomputed selectively (the others fully)

    def shifted(self, by: int) -> RangePlan:
        """The same plan for the range ``by`` layers later (its recomputed layers moved along)."""
        if not by or not self.recomputed:
            return self
        return replace(self, recomputed=frozenset(i + by for i in self.recomputed),
                       selective=frozenset(i + by for i in self.selective))


class RangeTable:
    """One logical mesh's layer costs as prefix sums: a layer range's (seconds per step, bytes
    per device) in O(1) where its fastest plans fit, each distinct layer solved once.

    A range's fastest plan is the sum of its layers' plus, with ``boundaries``, the correction
    of every boundary inside it (:meth:`LayerCosts.boundary`): over every range of Alpa's
    GPT-1.3B within 0.01% of the range's own ILP (``benchmarks/range_costs.py``). Where that
    does not fit the budget, the layers' fastest plans are trimmed together until they fit
    (:meth:`LayerCosts.trimmed`), and the boundary corrections are added as they are.

    Memory is counted as the range's own ILP counts it: apart, a layer keeps every value it
    receives from an earlier layer as a (replicated) input, so a value read by several layers
    of the range, or produced inside it, is counted more often than the range counts it (once
    as the range's input, or not at all: it is then an op's output). The excess is subtracted
    (:meth:`counted_apart`); user inputs, which may be sharded, are left counted as they are."""

    def __init__(self, graph: TracedGraph, layers: list[Layer], costs: LayerCosts, boundaries: bool,
                 reads: list[dict[str, tuple[int, float]]] | None = None,
                 policy: RecomputePolicy | None = None, may_recompute: frozenset[int] | None = None) -> None:
        self.graph, self.layers, self.costs, self.boundaries = graph, layers, costs, boundaries
        self.policy = policy or costs.options.recompute  # which layers may be recomputed
        self.reads = layer_inputs(graph, layers, costs.ctx.optimizer.mixed_precision, costs.ctx.mesh_shape,
                                  whole_below(costs.options)) if reads is None else reads
        self.excess: dict[int, list[float]] = {}  # start -> counted_apart(start, end) for every end
        self.prefix: dict[str, list[tuple[float, float]]] = {}
        self.may_recompute = may_recompute  # the layers that may be recomputed (:func:`recomputable`)
        self.state_prefix: list[float] | None = None  # :meth:`_state_parts`
        self.shared_state: list[tuple[float, tuple[int, ...]]] = []
        pins = costs.options.pins  # the layers the user's checkpoint pins recompute, whatever the policy
        self.pinned_recompute = pins.checkpointed_layers(graph, layers) if pins else frozenset()
        self.plans: dict[tuple[int, int, float | None], RangePlan] = {}
        # a plan by what it depends on beyond its layers' positions (:meth:`_twin_key`), with the
        # range's start: the ranges of a stack of equal blocks share their plans
        self.twins: dict[tuple, tuple[int, RangePlan]] = {}
        self.tokens: tuple[int, ...] | None = None  # per layer, its kind (:meth:`_layer_tokens`)
        # per layer, by recompute mode (None: kept): the backward's transient, and recomputing's
        # (seconds added, bytes freed); and running maxima of transients from each start layer
        self.layer_transients: dict[RecomputeMode | None, list[float]] = {}
        self.recompute_steps: dict[RecomputeMode, list[tuple[float, float]]] = {}
        self.recompute_orders: dict[tuple[tuple[RecomputeMode, ...], bool], list[int]] = {}
        self.running_max: dict[RecomputeMode | None, dict[int, list[float]]] = {}
        # (start, end, recomputed, selective) -> the range's transient (:meth:`_with_transient`)
        self.range_transients: dict[tuple[int, int, frozenset[int], frozenset[int]], float] = {}
        # joins[i]: the corrections of the boundaries before layer i (between j - 1 and j, j <= i)
        self.joins = list(itertools.accumulate(
            costs.boundary(graph, layers[j - 1], layers[j]) if j and boundaries else 0.0 for j in range(len(layers))))

    def _sums(self, mode: str) -> list[tuple[float, float]]:
        if mode not in self.prefix:
            answers = (self.costs.cost(self.graph, layer, mode) for layer in self.layers)
            self.prefix[mode] = list(itertools.accumulate(answers, add_costs, initial=(0.0, 0.0)))
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

    def least_memory(self, start: int, end: int, recomputed: frozenset[int] = frozenset(),
                     selective: frozenset[int] = frozenset()) -> float:
        """Bytes per device of layers [start, end)'s least-memory plans at the step's peak (with the
        transient of their fastest plans, which shard the backward's values no more than they do),
        the layers in ``recomputed`` recomputed (those in ``selective`` in the lighter mode,
        :attr:`LayerCosts.lighter`): each frees
        what recomputing its fastest plan frees, down to the parameters' floor
        (:meth:`state_floor`)."""
        modes = {i: self.costs.lighter if i in selective else RecomputeMode.FULL
                 for i in recomputed if start <= i < end}
        freed = math.fsum(self._recompute_steps(how)[i][1] for i, how in modes.items())
        kept = self._range(LEAN, start, end)[1] - self.counted_apart(start, end)
        if modes:
            kept = max(kept - freed, self.state_floor(start, end))
        return kept + self.transient(start, end, modes or None)

    def state_floor(self, start: int, end: int) -> float:
        """Bytes per device that no plan of layers [start, end) goes below: the parameters they
        read, each with its gradient and optimizer state, sharded over every device of the mesh
        (ZeRO-3 over the whole mesh; a tied parameter once)."""
        if self.state_prefix is None:
            self.state_prefix, self.shared_state = self._state_parts()
        total = self.state_prefix[end] - self.state_prefix[start]
        total += math.fsum(nbytes for nbytes, readers in self.shared_state
                           if any(start <= i < end for i in readers))
        return total / math.prod(self.costs.ctx.mesh_shape)

    def _state_parts(self) -> tuple[list[float], list[tuple[float, tuple[int, ...]]]]:
        """The training-state bytes of the parameters the layers read: as prefix sums over the
        layers for those only one layer reads, and apart with the layers reading them for those
        several read (a tied parameter counts once in a range)."""
        per_element = self.costs.ctx.optimizer.bytes_per_param
        state = {info.fqn: math.prod(info.shape or ()) * per_element(info.itemsize)
                 for info in self.graph.nodes.values() if info.kind == "parameter" and info.fqn}
        readers: dict[str, list[int]] = {}
        for i, layer in enumerate(self.layers):
            for fqn in {fqn for name in layer.nodes for fqn in self.graph.nodes[name].params}:
                readers.setdefault(fqn, []).append(i)
        own = [0.0] * len(self.layers)
        shared = []
        for fqn, layers in readers.items():
            if len(layers) == 1:
                own[layers[0]] += state.get(fqn, 0.0)
            else:
                shared.append((state.get(fqn, 0.0), tuple(layers)))
        return [0.0, *itertools.accumulate(own)], shared

    def transient(self, start: int, end: int, modes: Mapping[int, RecomputeMode] | None = None) -> float:
        """The backward's transient of layers [start, end): the largest of their fastest plans'
        (:meth:`LayerCosts.transient`; one layer's backward runs at a time), each kept or
        recomputed in its mode in ``modes``."""
        kept = self._layer_transients(None)
        if not modes:
            return self._largest(None, start, end)
        by_mode = {how: self._layer_transients(how) for how in set(modes.values())}
        return max(by_mode[modes[i]][i] if i in modes else kept[i] for i in range(start, end))

    def _layer_transients(self, mode: RecomputeMode | None) -> list[float]:
        """Every layer's :meth:`LayerCosts.transient` in ``mode``."""
        if mode not in self.layer_transients:
            self.layer_transients[mode] = [self.costs.transient(self.graph, layer, mode) for layer in self.layers]
        return self.layer_transients[mode]

    def _largest(self, how: RecomputeMode | None, start: int, end: int) -> float:
        """The largest per-layer transient of layers [start, end): kept (``how`` None), or the
        larger of kept and recomputed in ``how`` for the layers that may be recomputed; from
        running maxima kept for each start layer."""
        by_start = self.running_max.setdefault(how, {})
        if start not in by_start:
            kept = self._layer_transients(None)
            if how is None:
                values = kept[start:]
            else:
                again, may = self._layer_transients(how), self._may_recompute()
                values = [max(kept[i], again[i]) if i in may else kept[i]
                          for i in range(start, len(self.layers))]
            by_start[start] = list(itertools.accumulate(values, max))
        return by_start[start][end - start - 1]

    def _recompute_steps(self, how: RecomputeMode) -> list[tuple[float, float]]:
        """Every layer's (seconds added, bytes freed) when its fastest plan is recomputed in ``how``
        (:meth:`LayerCosts.recomputed`), the seconds, with ``boundaries``, in the plan of the pair
        it forms with the layer before it (:meth:`LayerCosts.recompute_seconds`). (The bytes
        freed stay the layer's own: they free what its own plan keeps. The first layer of a
        later stage is costed in the pair too, though its inputs come from the stage before: one
        layer per stage.)"""
        if how not in self.recompute_steps:
            steps = []
            for i, layer in enumerate(self.layers):
                plain, again = self.costs.cost(self.graph, layer), self.costs.recomputed(self.graph, layer, how)
                before = self.layers[i - 1] if i and self.boundaries else None
                steps.append((self.costs.recompute_seconds(self.graph, layer, how, before), plain[1] - again[1]))
            self.recompute_steps[how] = steps
        return self.recompute_steps[how]

    def _recompute_order(self, phases: tuple[RecomputeMode, ...], every: bool) -> list[int]:
        """Every layer, by the seconds recomputing it in the last of ``phases`` adds per byte it
        frees, least first (those that free nothing left out, unless ``every``), once the phases
        before have recomputed every layer they take: the ones this order (for those phases)
        lists."""
        if (phases, every) not in self.recompute_orders:
            steps = list(self._recompute_steps(phases[-1]))
            if len(phases) > 1:  # beyond what the earlier phases recomputed
                before = self._recompute_steps(phases[-2])
                for i in self._recompute_order(phases[:-1], every):
                    steps[i] = (steps[i][0] - before[i][0], steps[i][1] - before[i][1])
            self.recompute_orders[phases, every] = sorted(
                (i for i in range(len(self.layers)) if every or steps[i][1] > 0), key=lambda i: _by_rate(steps[i], i))
        return self.recompute_orders[phases, every]

    def _transient_bound(self, start: int, end: int, how: RecomputeMode, pinned: frozenset[int],
                         candidates: list[int]) -> float:
        """:meth:`transient` with the ``pinned`` layers recomputed fully and every one of
        ``candidates`` kept or recomputed in ``how``, whichever holds more: a budget less this
        bound holds whichever of them recomputation then picks. (``candidates``: the layers of
        the range that may be recomputed, less the pinned ones.)"""
        if not pinned:
            return self._largest(how, start, end)
        kept, again, full = (self._layer_transients(None), self._layer_transients(how),
                             self._layer_transients(RecomputeMode.FULL))
        chosen = set(candidates)

        def largest(i: int) -> float:
            if i in pinned:
                return full[i]
            return max(kept[i], again[i]) if i in chosen else kept[i]
        return max(largest(i) for i in range(start, end))

    def _with_transient(self, start: int, end: int, plan: RangePlan) -> RangePlan:
        """``plan`` with its memory at the step's peak: its kept bytes plus its transient (kept
        by the range and the layers it recomputes: the search asks for the same ones under many
        budgets)."""
        key = (start, end, plan.recomputed, plan.selective)
        transient = self.range_transients.get(key)
        if transient is None:
            modes = {i: self.costs.lighter if i in plan.selective else RecomputeMode.FULL
                     for i in plan.recomputed}
            transient = self.range_transients[key] = self.transient(start, end, modes)
        return RangePlan(plan.seconds, plan.memory + transient, plan.recomputed, plan.selective)

    def cost(self, start: int, end: int, budget: float | None) -> tuple[float, float]:
        """(seconds per step, bytes per device) of :meth:`plan`."""
        chosen = self.plan(start, end, budget)
        return chosen.seconds, chosen.memory

    def plan(self, start: int, end: int, budget: float | None) -> RangePlan:
        """Layers [start, end): their fastest plans if they fit ``budget`` together (at the step's
        peak: kept bytes and the transient, :meth:`transient`); else trimmed
        to fit (:meth:`_sharded`); else with layers recomputed in the backward
        (:meth:`_recomputed`), or the leaner of the two where neither fits. Recomputation comes
        after sharding because the search's trimming estimate runs high where its estimate of
        recomputation does not, so that the faster of the two is not decided on unequal
        estimates (the search also runs without recomputation, and the exact plans settle
        close calls: ``_trimmed_rival`` in the package). The table's ``policy`` (default
        ``PlannerOptions.recompute``) may ask for every layer that may be recomputed, or none."""
        key = (start, end, budget)
        found = self.plans.get(key)
        if found is None:
            twin = self._twin_key(start, end, budget)
            if twin in self.twins:
                origin, plan = self.twins[twin]
                found = plan.shifted(start - origin)
            else:
                found = self._plan(start, end, budget)
                self.twins[twin] = (start, found)
            self.plans[key] = found
        return found

    def _twin_key(self, start: int, end: int, budget: float | None) -> tuple:
        """What the plan of layers [start, end) depends on beyond where the range lies: its
        layers' kinds in order (:meth:`_layer_tokens`) and the kind of the layer before it (the
        boundary corrections and the seconds of recomputing the first layer read it), the
        bytes its layers count apart of the values they receive (:meth:`counted_apart`, which
        tells how they read one another and the layers before), and the budget. Two ranges of
        one stack of equal blocks that agree on these have one plan, its recomputed layers
        shifted (the stage search asks for every range of a deep model: the 80 blocks of a
        Llama-70B give about 3,400 ranges and some 350 plans)."""
        tokens = self._layer_tokens()
        return tokens[start:end], tokens[start - 1] if start else -1, self.counted_apart(start, end), budget

    def _may_recompute(self) -> frozenset[int]:
        if self.may_recompute is None:
            self.may_recompute = recomputable(self.graph, self.layers)
        return self.may_recompute

    def _layer_tokens(self) -> tuple[int, ...]:
        """Per layer, a number for its kind: its signature, whether a checkpoint pin recomputes
        it and whether it may be recomputed (equal numbers, equal kinds)."""
        if self.tokens is None:
            may = self._may_recompute()
            kinds: dict[tuple[str, bool, bool], int] = {}
            self.tokens = tuple(kinds.setdefault((layer.signature, i in self.pinned_recompute, i in may), len(kinds))
                                for i, layer in enumerate(self.layers))
        return self.tokens

    def _plan(self, start: int, end: int, budget: float | None) -> RangePlan:
        # the budget bounds the peak: trimming gets what the transient leaves (recomputation
        # leaves room for the transient of the layers it recomputes: :meth:`_recomputed`)
        kept = None if budget is None else budget - self.transient(start, end)
        pinned = frozenset(i for i in range(start, end) if i in self.pinned_recompute)
        policy = self.policy
        every = every_layer(policy)
        if pinned:  # checkpoint pins: those layers recomputed, more where the policy and memory ask
            plan = self._recomputed(start, end, budget if policy != RecomputePolicy.NONE else None,
                                    every=every, pinned=pinned, mode=policy_mode(policy) if every else None)
            assert plan is not None
            return plan
        seconds, memory = self._range(FAST, start, end)
        fastest = self._with_transient(start, end, RangePlan(seconds + self.joins[end - 1] - self.joins[start],
                                                             memory - self.counted_apart(start, end)))
        fits = budget is None or fastest.memory <= budget
        if every:
            return self._recomputed(start, end, budget, every=True, mode=policy_mode(policy)) or (
                fastest if fits else self._with_transient(start, end, self._sharded(start, end, kept)))
        if fits:
            return fastest
        assert budget is not None and kept is not None
        sharded = self._with_transient(start, end, self._sharded(start, end, kept))
        recomputed = self._recomputed(start, end, budget) if policy == RecomputePolicy.AUTO else None
        if sharded.memory <= budget or recomputed is None:
            return sharded
        return recomputed if recomputed.memory <= budget or recomputed.memory < sharded.memory else sharded

    def _sharded(self, start: int, end: int, budget: float) -> RangePlan:
        """The layers' fastest plans trimmed to fit ``budget`` together, else their
        least-memory plans (which then do not fit)."""
        excess = self.counted_apart(start, end)
        joins = self.joins[end - 1] - self.joins[start]
        lean = self._range(LEAN, start, end)
        trimmed = None if lean[1] - excess >= budget else \
            self.costs.trimmed(self.graph, self.layers[start:end], budget + excess)
        if trimmed is None:
            return RangePlan(lean[0], lean[1] - excess)
        return RangePlan(trimmed[0] + joins, trimmed[1] - excess)

    def _recomputed(self, start: int, end: int, budget: float | None, every: bool = False,
                    pinned: frozenset[int] = frozenset(), mode: RecomputeMode | None = None) -> RangePlan | None:
        """Recompute layers in the backward until the range fits ``budget`` at its peak (the
        kept bytes get what the transient of the phase's recomputation leaves: a recomputed
        layer holds its values again in the backward) (all that may be,
        with ``every``, in ``mode``): the ``pinned`` ones first, fully; then, where ``mode`` is
        None, the layers selectively, at each step, in its fastest plan, the layer that frees
        the most bytes per second it adds (:meth:`LayerCosts.recomputed`, a quick estimate like
        the trimming), and where that is not enough the selective ones fully, by the same
        measure (selective recomputation adds the cheap ops only, so it usually frees more
        bytes per second); with a ``mode``, the layers in that mode only. Where recomputing
        every layer of the range in a mode is not enough, its layers are also trimmed (see
        below), and the fastest answer that fits wins: every layer selectively and trimmed
        (FSDP with selective checkpointing) may beat every layer fully. None where no layer of
        the range may be recomputed."""
        may = self._may_recompute()
        candidates = [i for i in range(start, end) if i in may]
        if not candidates:
            return None
        excess = self.counted_apart(start, end)
        joins = self.joins[end - 1] - self.joins[start]
        seconds, memory = self._range(FAST, start, end)
        memory -= excess
        applied: dict[int, tuple[RecomputeMode, float, float]] = {}  # layer -> (mode, seconds added, bytes freed)

        def apply_in_turn(layers: list[int], how: RecomputeMode, room: float | None = None) -> None:
            # recompute each of ``layers`` in ``how`` (what it adds and frees beyond what it does
            # now), one by one until the kept bytes fit ``room`` (all of them where None); one
            # loop, no call per layer: the search runs it millions of times
            nonlocal seconds, memory
            steps = self._recompute_steps(how)
            for i in layers:
                if room is not None and memory <= room:
                    break
                step_seconds, step_bytes = steps[i]
                _, before_s, before_b = applied.get(i, (how, 0.0, 0.0))
                added, freed = step_seconds - before_s, step_bytes - before_b
                applied[i] = (how, before_s + added, before_b + freed)
                seconds, memory = seconds + added, memory - freed

        def as_now() -> RangePlan:
            return self._with_transient(start, end, RangePlan(seconds + joins, memory, frozenset(applied),
                                                              _selective(applied)))

        def trimmed_now(room: float) -> RangePlan:
            # every layer recomputed and still too large: trim as well, counting on a share 1/n of
            # the bytes recomputing frees (a trimmed plan may keep fewer activations to free, where
            # it shards them; n the mesh's size), else, where that does not fit, on all of them (a
            # plan that trims parameters and optimizer state only, as FSDP does, frees as many);
            # and charging the fastest plans' recomputation. On a large mesh the fastest plans'
            # activations can outweigh a trimmed plan's bytes, and the estimate would fall below
            # nothing: there it is the training state of the range's parameters sharded over
            # every device (:meth:`state_floor`), which no plan goes below. (A floor everywhere
            # is too high a bar: the transient added below is the fastest plans', larger than a
            # trimmed plan's, and the two errors offset each other where both are small.)
            added = sum(a for _, a, _ in applied.values())
            freed = sum(b for _, _, b in applied.values())
            recomputed, selective = frozenset(applied), _selective(applied)
            plan = None
            for share in (freed / math.prod(self.costs.ctx.mesh_shape), freed):
                trimmed = self._sharded(start, end, room + share)
                memory = trimmed.memory - share
                if memory < 0:
                    memory = self.state_floor(start, end)
                plan = RangePlan(trimmed.seconds + added, memory, recomputed, selective)
                if plan.memory <= room:
                    break
            assert plan is not None
            return self._with_transient(start, end, plan)

        apply_in_turn(sorted(pinned), RecomputeMode.FULL)
        others = [i for i in candidates if i not in pinned]
        phases = [mode] if mode is not None else [self.costs.lighter, RecomputeMode.FULL]
        found: list[RangePlan] = []  # each phase's answer: fitting, or every layer recomputed so and trimmed
        within = set(others)
        for phase, how in enumerate(phases):
            # the kept bytes get what the transient of this phase's recomputation leaves
            room = None if budget is None else budget - self._transient_bound(start, end, how, pinned, others)
            # the layers by the seconds each adds per byte it frees, from what the phases before
            # recomputed: all they could (else the range fitted), so the table's order holds
            order = [i for i in self._recompute_order(tuple(phases[:phase + 1]), every) if i in within]
            if every:
                apply_in_turn(order, how)
            elif room is not None:
                apply_in_turn(order, how, room)
            if room is None or memory <= room:
                found.append(as_now())
                break
            if len(applied) == end - start:
                found.append(trimmed_now(room))
                close = found[-1].memory <= budget and found[-1].seconds <= (seconds + joins) * (1 + TRIMMED_CLOSE)
                refit = None if close else self._recomputed_trimmed(start, end, room, applied)
                if refit is not None:
                    found.append(self._with_transient(start, end, refit))
        fitting = [plan for plan in found if budget is None or plan.memory <= budget]
        if fitting:  # selectively and trimmed may beat fully recomputed (FSDP with selective checkpointing)
            return min(fitting, key=lambda plan: plan.seconds)
        return min(found, key=lambda plan: plan.memory) if found else as_now()

    def _recomputed_trimmed(self, start: int, end: int, room: float,
                            applied: dict[int, tuple[RecomputeMode, float, float]]) -> RangePlan | None:
        """Layers [start, end), every one recomputed fully as in ``applied``, trimmed together until
        their kept bytes fit ``room``: each layer's problem with its recomputation in the costs
        (:meth:`LayerCosts.recomputed_problem`), trimmed from its fastest plan's strategies.
        Trimming the kept plans instead, beside what recomputing them frees (:meth:`_recomputed`'s
        share), trims activations that recomputation frees anyway: Llama 3.1 405B's 16 blocks on
        8x8 with every block recomputed, estimated so at 63.3 s per step, are planned at 23 s, and
        trimmed recomputed at 21.6 s. The seconds recomputation adds are those of
        :meth:`_recompute_steps` (a layer in the plan of its pair with the one before). Trimming
        starts from each of two plans (:meth:`LayerCosts.recomputed_problem`), the faster answer
        kept. (Tried only where the other estimate, :meth:`_recomputed`'s, does not fit or adds
        more than ``TRIMMED_CLOSE`` to the untrimmed seconds.) None where even the least-memory
        plans do not fit, where a layer is recomputed selectively (trimming a selectively
        recomputed block trims the activations it keeps: the other estimate does that), or where
        the range holds more than ``RECOMPUTED_TRIM_REACH`` times the layers of a stage of a
        balanced pipeline: a layer's recomputed problem is built once per logical mesh,
        microbatch count and mode, about as long as its ILP takes (the Llama-70B shape on 64
        H100s: 10 s more to plan for every range, 1.5 s more for these)."""
        if end - start > RECOMPUTED_TRIM_REACH * -(-len(self.layers) // self.costs.stages):
            return None  # far longer than a stage of a balanced pipeline: not worth its problems' building
        if self.state_floor(start, end) > room:
            return None  # no plan of the range keeps less
        modes = [applied[i][0] for i in range(start, end)]
        if any(how != RecomputeMode.FULL for how in modes):
            return None
        layers = self.layers[start:end]
        excess = self.counted_apart(start, end)
        found = [t for t in (self.costs.trimmed(self.graph, layers, room + excess, modes, origin)
                             for origin in (FAST, LEAN)) if t is not None]
        if not found:
            return None
        trimmed = min(found)
        # the recomputation's seconds as the pairs cost them, in place of each layer's own
        own = math.fsum(self.costs.recompute_seconds(self.graph, layer, how) for layer, how in zip(layers, modes))
        paired = math.fsum(added for _, added, _ in applied.values())
        joins = self.joins[end - 1] - self.joins[start]
        return RangePlan(trimmed[0] + joins + paired - own, trimmed[1] - excess, frozenset(applied))


def _by_rate(step: tuple[float, float], i: int) -> tuple[float, int]:
    """The order in which layers are recomputed: seconds added per byte freed, then index."""
    added, freed = step
    return (added / freed if freed > 0 else math.inf, i)


def _selective(applied: dict[int, tuple[RecomputeMode, float, float]]) -> frozenset[int]:
    return frozenset(i for i, (how, _, _) in applied.items() if how != RecomputeMode.FULL)


def layer_inputs(graph: TracedGraph, layers: list[Layer], mixed_precision: bool = False,
                 mesh_shape: tuple[int, ...] = (), below: float = 0.0) -> list[dict[str, tuple[int, float]]]:
    """For each layer, the values it reads that an earlier layer produced: name -> (producing
    layer, bytes of the value as it arrives on a device of ``mesh_shape``: its shard, as it
    crosses a stage boundary, or the whole value where it :func:`crosses_whole`). Parameters,
    buffers and user inputs are not listed."""
    layer_of = layer_index(layers)
    fx_nodes = graph.fx_nodes
    out: list[dict[str, tuple[int, float]]] = []
    for i, layer in enumerate(layers):
        reads: dict[str, tuple[int, float]] = {}
        for name in layer.nodes:
            for source in fx_nodes[name].all_input_nodes:
                producer = layer_of.get(source.name, i)
                info = graph.nodes.get(source.name)
                if producer != i and info is not None and info.kind == "op" and info.shape is not None:
                    nbytes = math.prod(info.shape) * value_itemsize(info, mixed_precision)
                    shards = 1 if crosses_whole(info, below) else boundary_shards(info.shape, mesh_shape)
                    reads[source.name] = (producer, nbytes / shards)
        out.append(reads)
    return out


def add_costs(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    return x[0] + y[0], x[1] + y[1]
