"""Layer and layer-range costs for the stage search: each distinct layer's ILP once per logical
mesh, a range as its layers plus the boundaries between them (see the package docstring)."""

from __future__ import annotations

import collections
import itertools
import math
from dataclasses import dataclass, field

from autoplan.cost_models import LinkSpec
from autoplan.cost_models.step_costs import CostContext
from autoplan.planner.api import PlannerOptions
from autoplan.planner.mesh_plan import plan_intra_op
from autoplan.solvers import evaluate, trim_memory_together
from autoplan.solvers.inter_op import SubMesh
from autoplan.solvers.intra_op import IntraOpProblem
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer
from autoplan.trace.repeated import find_classes
from autoplan.trace.subgraph import extract, loss_name

FAST, LEAN = "fast", "lean"  # how a layer is costed in the stage search (LayerCosts.cost)


@dataclass
class LayerCosts:
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
                                       allow_storage=self.options.allow_storage, canonical=False)
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
                    total = add_costs(total, (counts[sig] * seconds, counts[sig] * memory))
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
                                   allow_storage=self.options.allow_storage, canonical=False)
            self.pairs[key] = result.solution.objective - self.cost(graph, first)[0] - self.cost(graph, second)[0]
        return self.pairs[key]


def link_between_stages(options: PlannerOptions, submesh: SubMesh) -> LinkSpec:
    cluster = options.cluster
    return cluster.intra_node if submesh.nodes == 1 and submesh.devices < cluster.devices_per_node else \
        cluster.inter_node


def cut_bytes(graph: TracedGraph, layers: list[Layer]) -> list[float]:
    """``out[c]``: bytes of the values that layers before ``c`` hand to layers at or after it
    (one microbatch), for every cut 0..len(layers). A value produced in layer i and last read
    in layer j (or, the loss, by the graph's output) crosses the cuts i+1..j."""
    layer_of = layer_index(layers)
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


def layer_costs(options: PlannerOptions, mesh: tuple[int, ...], microbatches: int, in_flight: int) -> LayerCosts:
    cluster = options.cluster
    ctx = CostContext(mesh, cluster.mesh_links(mesh), cluster.device, options.optimizer,
                      microbatches=microbatches, activations_in_flight=in_flight, remat=options.remat)
    return LayerCosts(options, ctx)


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
    layer_of = layer_index(layers)
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


def add_costs(x: tuple[float, float], y: tuple[float, float]) -> tuple[float, float]:
    return x[0] + y[0], x[1] + y[1]
