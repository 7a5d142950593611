"""The intra-op pass on one logical mesh: strategies per node, costs, the ILP, and the
chosen strategy of every node.

To keep the ILP small, nodes share decision variables in three ways before it is built:

1. *repeated layers* (:mod:`autoplan.trace.repeated`): corresponding nodes of every copy of
   a block form one class and get one strategy;
2. *followers*: a node with a single tensor input (element-wise, view, ``getitem``) whose
   strategies can take each of its producer's outputs without resharding follows the
   producer — the producer's choice fixes its strategy;
3. *storage*: a parameter or input read by one consumer is stored in the spec that consumer
   asks for. Where the fastest such plan does not fit the memory budget, a trained parameter
   keeps its own decision instead: stored as its consumer reads it, or sharded over an axis
   where the consumer reads it whole and gathered at use (ZeRO-3 / FSDP), which only memory
   makes worth its gathers, each with or without its optimizer state (and gradient) sharded
   where the parameter is replicated (ZeRO-1/2) (:func:`_solve`).

Each ILP *group* is then a root class plus the classes that follow it, with a map from the
group's choice to each member class's strategy. The ILP (see :mod:`autoplan.solvers.intra_op`)
sees only groups, their summed costs, and edge matrices between groups.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from torch import fx

from autoplan.cost_models.gather_overlap import (BlockPrefetch, block_prefetches, forward_gather_seconds,
    overlaps_gathers, read_spec)
from autoplan.cost_models.backward_overlap import (BackwardWindow, Read, backward_window, backward_windows,
    overlaps_reductions, overlaps_regathers, reduction_seconds)
from autoplan.cost_models.transient_memory import GatheredRead, gathered_bytes, peak_moments, value_bytes
from autoplan.cost_models.step_costs import (ALIASING_OPS, CostContext, NodeCost, edge_cost, is_floating, op_cost,
    edge_steps, resharded_itemsize, step_reduction_spec, steps_seconds, storage_cost, value_itemsize)
from autoplan.errors import AutoplanError
from autoplan.planner.pins import PinKind, PinSet
from autoplan.sharding import R, ShardingSpec, boundary_spec, spec_name, spec_to_json
from autoplan.solvers import (ChoiceSum, Edge, IntraOpProblem, IntraOpSolution, OverlapRow, PeakRow,
    canonical_solution, evaluate, solve_intra_op, transient)
from autoplan.strategies.candidates import (Strategy, enumerate_strategies, replicated_strategy,
    sharded_state_strategies, storage_strategies, strategy_name, tensor_specs)
from autoplan.strategies.index_maps import index_map_for, op_name
from autoplan.trace.graph import NodeInfo, NodeKind, TracedGraph
from autoplan.trace.repeated import NodeClasses, split_classes
from autoplan.trace.saved_inputs import keeps_value, regathers_for
from autoplan.trace.subgraph import model_outputs

# ops whose output the backward does not need saved: views, and copies of the same values
VIEW_OPS = ALIASING_OPS | {"getitem", "contiguous"}


STORED_KINDS = (NodeKind.PARAMETER, NodeKind.BUFFER, NodeKind.INPUT, NodeKind.CONSTANT, NodeKind.ACTIVATION)


class UnknownOpWarning(UserWarning):
    """An op without a sharding rule: it is planned replicated."""


@dataclass
class ClassStrategies:
    """The strategies of one class (computed on its representative node)."""

    kind: str  # "storage", "op", "fallback", "getitem", "output"
    strategies: list[Strategy]
    costs: list[NodeCost]


@dataclass
class Grouping:
    """Classes merged into ILP groups: ``group_of[c]`` and ``choice_map[c][i]`` (the strategy
    index class ``c`` takes when its group picks choice ``i``)."""

    group_of: list[int]
    choice_map: list[list[int]]
    roots: list[int]  # root class of each group
    gathered_storage: bool = False  # gathered storage and sharded optimizer state among the choices

    def strategy_index(self, cls: int, group_choices: list[int]) -> int:
        return self.choice_map[cls][group_choices[self.group_of[cls]]]


@dataclass
class IntraOpResult:
    """The outcome of the intra-op pass on one mesh."""

    mesh_shape: tuple[int, ...]
    chosen: dict[str, Strategy]  # node name -> strategy
    node_costs: dict[str, NodeCost]
    solution: IntraOpSolution
    problem: IntraOpProblem
    num_classes: int
    num_nodes: int
    input_names: dict[str, list[str]]  # node -> its tensor inputs, in the order of Strategy.input_specs
    needs_grad: dict[str, bool]
    warnings: list[str] = field(default_factory=list)
    gathered_storage: bool = False  # the problem solved had gathered storage among its choices (:func:`_solve`)


@dataclass
class GraphView:
    """Read-only facts about the graph that every step below needs."""

    graph: TracedGraph
    fx_nodes: dict[str, fx.Node]
    inputs: dict[str, list[str]]  # node -> tensor input names, positional
    users: dict[str, list[str]]
    needs_grad: dict[str, bool]
    loss_name: str

    @cached_property
    def prefetches(self) -> list[BlockPrefetch]:
        """The blocks whose forward gathers may be issued a block ahead (every solve of the
        graph asks: found once)."""
        return block_prefetches(self.graph, self.inputs)

    @cached_property
    def backward_windows(self) -> list[BackwardWindow]:
        """The blocks whose backward runs collectives of their neighbours beside it (found once)."""
        return backward_windows(self.graph, self.inputs)

    @classmethod
    def of(cls, graph: TracedGraph) -> GraphView:
        fx_nodes = graph.fx_nodes
        inputs: dict[str, list[str]] = {}
        users: dict[str, list[str]] = {name: [] for name in fx_nodes}
        for name, node in fx_nodes.items():
            names = [n.name for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
            if node.target is operator.getitem:
                names = [node.args[0].name]  # the multi-output producer it picks from
            if node.op == "output" and graph.materialized_outputs is not None:
                names = names[:graph.materialized_outputs]  # the loss; other outputs stay as computed
            inputs[name] = names
            for inp in names:
                users[inp].append(name)
        needs_grad: dict[str, bool] = {}
        for name, node in fx_nodes.items():
            info = graph.nodes.get(name)
            if info is None or info.kind == "output":
                needs_grad[name] = False
            elif info.kind in ("parameter", "activation"):  # a trained parameter; a value from a stage before
                needs_grad[name] = is_floating(info.dtype) and info.carries_grad
            elif info.kind in ("buffer", "input", "constant"):
                needs_grad[name] = False
            else:
                needs_grad[name] = is_floating(info.dtype) and any(needs_grad.get(i, False) for i in inputs[name])
        output = next(n for n in fx_nodes.values() if n.op == "output")
        loss = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
        return cls(graph, fx_nodes, inputs, users, needs_grad, loss.name)


def crossing_spec(graph: TracedGraph, name: str, mesh_shape: tuple[int, ...]) -> ShardingSpec:
    """How value ``name`` of a pipeline stage's graph crosses its boundary: whole where the
    stage graph says so (:attr:`TracedGraph.whole_values`), else as
    :func:`~autoplan.sharding.boundary_spec` lays it out."""
    if name in graph.whole_values:
        return (R,) * len(mesh_shape)
    return boundary_spec(graph.nodes[name].shape or (), mesh_shape)


def _output_class_strategies(view: GraphView, name: str, mesh_shape: tuple[int, ...]) -> ClassStrategies:
    """The graph's outputs that must be materialised leave replicated; a pipeline stage's leave
    as they cross to the next stage (:func:`~autoplan.sharding.boundary_spec`; the loss, a
    scalar, replicated)."""
    graph = view.graph
    if graph.materialized_outputs is None:
        specs = tuple(crossing_spec(graph, i, mesh_shape) for i in view.inputs[name])
    else:
        specs = tuple((R,) * len(mesh_shape) for _ in view.inputs[name])
    return ClassStrategies("output", [Strategy(strategy_name(specs, ()), specs, (), 1)], [NodeCost()])


# may a value be stored (or an op produce it) in a spec
PlacementRule = Callable[[NodeInfo, ShardingSpec], bool]
# may an op read its inputs (their infos, in order) in a strategy's input specs
ReadingRule = Callable[[list[NodeInfo], Strategy], bool]
#: ``allowed(given, read)``: whether a value given in spec ``given`` may be read in spec ``read``
#: (hashable: the edges it applies to share its answers)
ReshardAllowed = Callable[[ShardingSpec, ShardingSpec], bool]
#: ``rule(producer, reader)``: the reshardings allowed on the edges from one node to another;
#: None where every one is
ReshardingRule = Callable[[NodeInfo, NodeInfo], ReshardAllowed | None]


@dataclass(frozen=True)
class StorageRule:
    """A restriction of the search (a manual plan's, a pipeline stage's pinned parameters):
    ``rule(info, spec)`` says whether a value may be stored in ``spec`` (or an op produce it).
    With ``sharded_state``, a trained parameter must take a ZeRO-1/2 strategy it accepts where
    one exists (none accepted: plain storage only); without it the ZeRO strategies are free
    choices. ``dims_over_axes`` lets strategies split one dim over several mesh axes
    (:func:`~autoplan.strategies.candidates.enumerate_strategies`), as a rule that shards the
    batch over two axes needs. ``reads(inputs, strategy)`` says whether an op may read its
    inputs in the strategy's specs (an op none of whose strategies it accepts keeps them all).
    ``reshards(producer, reader)`` says which reshardings the edges between two nodes allow
    (``allowed(given, read)``: may a value given in one spec be read in another): the ILP never
    takes a pair of strategies whose resharding an edge refuses (its forbidden pairs,
    :class:`~autoplan.solvers.intra_op.problem.Edge`)."""

    allowed: PlacementRule
    sharded_state: Callable[[Strategy], bool] | None = None
    dims_over_axes: bool = False  # a tensor dim may be split over several mesh axes (HSDP's batch)
    reads: ReadingRule | None = None
    reshards: ReshardingRule | None = None

    def __call__(self, info: NodeInfo, spec: ShardingSpec) -> bool:
        return self.allowed(info, spec)


def splits_dims_over_axes(ctx: CostContext, rule: StorageRule | None = None) -> bool:
    """Whether strategies on ``ctx``'s mesh may split one tensor dim over several mesh axes:
    where a rule asks for it (``--manual dp=,fsdp=``), and on a mesh whose axes communicate over
    different links (a mesh across nodes: the batch over both axes with parameters sharded
    inside a node and replicated across is HSDP) unless ``ctx`` is a pipeline stage's
    (:attr:`CostContext.one_stage`: the stage search keeps stages inside nodes where
    it can, and its ILPs small). On a mesh of one link a dim split over two axes adds little
    to what the 1-D mesh of their product offers, and is left out to keep the ILP small. Where
    it splits them, sharded storage is among the ILP's choices too (:func:`_solve`)."""
    if rule is not None and rule.dims_over_axes:
        return True
    return ctx.one_stage and len({link for link, n in zip(ctx.links, ctx.mesh_shape) if n > 1}) > 1


def _num_outputs(node: fx.Node) -> int:
    """How many values an op returns (a tuple or list of them, or one)."""
    value = node.meta.get("val")
    return len(value) if isinstance(value, (tuple, list)) else 1


def pinned_strategies(info: NodeInfo, strategies: list[Strategy], mesh_shape: tuple[int, ...],
                      pins: PinSet | None, storage: bool = True) -> list[Strategy]:
    """The strategies whose output the user's pins allow (all of them where none holds the
    node), with ``storage`` also how they store a parameter's gradient and optimizer state
    (a zero2 pin's); none allowed is refused in one line: a pin is a constraint, never dropped."""
    if not pins or info.kind in ("output", "activation"):
        return strategies
    held = pins.value_pins(info)
    if not held:
        return strategies
    kept = [s for s in strategies if all(p.allows_strategy(s, mesh_shape) if storage else
                                         p.allows(s.output_specs[0], mesh_shape) for p in held)]
    if not kept:
        what = info.fqn or info.name
        zero2 = next((p for p in held if p.kind == PinKind.ZERO2), None)
        if zero2 is not None and storage:
            raise AutoplanError(f"pin {zero2.text!r} cannot hold on mesh {'x'.join(map(str, mesh_shape))}: {what} "
                                f"is not offered ZeRO-2 storage there (a trained parameter whole, its gradient and "
                                f"optimizer state sharded); pin it fsdp or a placement instead")
        offered = ", ".join(sorted({"[" + ", ".join(spec_to_json(s.output_specs[0])) + "]" for s in strategies}))
        raise AutoplanError(f"pin {held[0].text!r} cannot hold on mesh {'x'.join(map(str, mesh_shape))}: "
                            f"{what} ({info.target}, shape {list(info.shape or ())}) may be {offered} there; "
                            f"pin one of those, or another mesh")
    return kept


def offered_output_specs(view: GraphView, name: str, mesh_shape: tuple[int, ...], dims_over_axes: bool = False
                         ) -> list[ShardingSpec]:
    """The output specs the strategies of node ``name`` offer on ``mesh_shape``, before any
    rule or pin (what a pin may choose from); ``dims_over_axes``: with one dim split over
    several axes (:func:`splits_dims_over_axes`)."""
    info = view.graph.nodes[name]
    node = view.fx_nodes[name]
    if info.kind in STORED_KINDS:
        return tensor_specs(info.shape or (), mesh_shape, dims_over_axes)
    imap = index_map_for(node) if info.shape is not None or node.meta.get("val") is not None else None
    if imap is None:
        return [(R,) * len(mesh_shape)]
    differentiable = frozenset(i for i in view.inputs[name] if view.needs_grad[i])
    strategies = enumerate_strategies(imap, view.inputs[name], mesh_shape, differentiable,
                                      allow_partial=is_floating(info.dtype), dims_over_axes=dims_over_axes)
    return list(dict.fromkeys(s.output_specs[0] for s in strategies)) or [(R,) * len(mesh_shape)]


def _class_strategies(view: GraphView, name: str, mesh_shape: tuple[int, ...], ctx: CostContext,
                      producer: ClassStrategies | None, warn: Callable[[str], None],
                      allow_storage: StorageRule | None = None, pins: PinSet | None = None) -> ClassStrategies:
    info = view.graph.nodes[name]
    node = view.fx_nodes[name]
    if info.kind == "output":
        return _output_class_strategies(view, name, mesh_shape)
    over_axes = splits_dims_over_axes(ctx, allow_storage)
    if info.kind in STORED_KINDS:
        strategies = storage_strategies(info.shape or (), mesh_shape, over_axes)
        if info.kind == "activation":  # received from an earlier stage as it crosses, its gradient sent back alike
            arrives = crossing_spec(view.graph, name, mesh_shape)
            strategies = [s for s in strategies if s.output_spec == arrives] or \
                [Strategy(spec_name(arrives), (), (arrives,), 1)]
        elif allow_storage is not None:
            strategies = [s for s in strategies if allow_storage(info, s.output_spec)] or strategies[:1]
        strategies = pinned_strategies(info, strategies, mesh_shape, pins, storage=False)
        if not view.users[name]:  # e.g. the unused name of a tied weight: it costs nothing
            return ClassStrategies("storage", strategies, [NodeCost() for _ in strategies])
        if _trained_parameter(view, name):  # ZeRO-1/2; held where microbatches run (under bf16, or
            # asked for) and one consumer reads it, whose gradient the step accumulates as it comes
            required = allow_storage.sharded_state if allow_storage is not None else None
            held = ctx.microbatches > 1 and len(view.users[name]) == 1 \
                and (ctx.optimizer.mixed_precision or required is not None)
            variants = [v for s in strategies for v in sharded_state_strategies(
                s, info.shape or (), mesh_shape, gradients=True, held=held)]
            if required is None:  # a free choice
                strategies = strategies + variants
            else:  # a rule that names a sharded state (--manual zero=) requires it where it exists
                strategies = [v for v in variants if required(v)] or strategies
        strategies = pinned_strategies(info, strategies, mesh_shape, pins)  # a zero2 pin's storage
        costs = [storage_cost(info, s.output_spec, ctx, view.needs_grad[name], s.grad_spec, s.state_spec, s.held)
                 for s in strategies]
        return ClassStrategies("storage", strategies, costs)
    input_names = view.inputs[name]
    input_infos = [view.graph.nodes[i] for i in input_names]
    grad_inputs = [view.needs_grad[i] for i in input_names]
    region = ctx.region_of(name)  # recomputed: kept only where read outside its region (or graph)
    saves = view.needs_grad[name] and op_name(node) not in VIEW_OPS and (not ctx.recomputes(name) or any(
        view.graph.nodes[u].kind != "op" or ctx.region_of(u) != region for u in view.users[name]))
    if node.target is operator.getitem and producer is not None:
        index = node.args[1]
        picked = [p.output_specs[index] if isinstance(index, int) and index < len(p.output_specs)
                  else (R,) * len(mesh_shape) for p in producer.strategies]
        strategies = [Strategy(strategy_name((p.output_specs[0],), (spec,)), (spec,), (spec,), 1)
                      for p, spec in zip(producer.strategies, picked)]
        costs = [NodeCost() for _ in strategies]
        return ClassStrategies("getitem", strategies, costs)
    imap = index_map_for(node) if info.shape is not None or node.meta.get("val") is not None else None
    if imap is None:
        warn(f"no sharding rule for {info.target}: planned replicated")
        strategies = [replicated_strategy(len(input_names), _num_outputs(node), len(mesh_shape))]
        kind = "fallback"
    else:
        differentiable = frozenset(i for i, g in zip(input_names, grad_inputs) if g)
        strategies = enumerate_strategies(imap, input_names, mesh_shape, differentiable,
                                          allow_partial=is_floating(info.dtype), dims_over_axes=over_axes,
                                          memo=ctx.cache.setdefault("strategies", {}))
        kind = "op"
        if allow_storage is not None:  # a rule may also constrain what ops produce (manual plans)
            strategies = [s for s in strategies if allow_storage(info, s.output_specs[0])] or strategies
            if allow_storage.reads is not None:  # and what they read
                strategies = [s for s in strategies if allow_storage.reads(input_infos, s)] or strategies
        if not strategies:
            strategies = [replicated_strategy(len(input_names), len(imap.outputs), len(mesh_shape))]
    strategies = pinned_strategies(info, strategies, mesh_shape, pins)
    costs = [op_cost(info, s, input_infos, grad_inputs, view.needs_grad[name], saves, ctx, ctx.recomputes(name))
             for s in strategies]
    return ClassStrategies(kind, strategies, costs)


def _class_edges(view: GraphView, classes: NodeClasses) -> dict[tuple[int, int, int], int]:
    """(producer class, consumer class, input position) -> how many graph edges it stands for."""
    edges: dict[tuple[int, int, int], int] = {}
    for name, input_names in view.inputs.items():
        v = classes.class_of.get(name)
        if v is None or view.fx_nodes[name].target is operator.getitem:
            continue  # a getitem always follows its producer: no resharding between them
        for pos, inp in enumerate(input_names):
            key = (classes.class_of[inp], v, pos)
            edges[key] = edges.get(key, 0) + 1
    return edges


def _consistent_producer(view: GraphView, classes: NodeClasses, cls: int, pos: int) -> int | None:
    """The class feeding input ``pos`` of every member of ``cls``, if it is one class."""
    producers = {classes.class_of[view.inputs[m][pos]] for m in classes.members[cls] if len(view.inputs[m]) > pos}
    return producers.pop() if len(producers) == 1 else None


def writes_first_input(node: fx.Node) -> bool:
    """Whether an op writes into its first argument (``aten.copy_``, ``aten.fill_``, …)."""
    schema = getattr(node.target, "_schema", None)
    if node.op != "call_function" or schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _trained_parameter(view: GraphView, name: str) -> bool:
    return view.graph.nodes[name].kind == "parameter" and view.needs_grad[name]


def _group(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], gathered_storage: bool) -> Grouping:
    n = classes.num_classes
    group_of = list(range(n))
    # sharded optimizer state (ZeRO-1/2) is a choice only beside gathered storage (or the only one)
    choice_map = []
    for c in range(n):
        plain = [j for j, s in enumerate(strat[c].strategies) if s.state_spec is None]
        choice_map.append(list(range(len(strat[c].strategies))) if gathered_storage or not plain else plain)
    followers: dict[int, list[int]] = {}  # root -> the classes that follow it

    def attach(cls: int, target: int, pick: Callable[[int], int | None]) -> bool:
        """Make ``cls`` follow ``target``'s group, taking strategy pick(target strategy). The
        classes that followed ``cls`` follow the new root through it."""
        root = group_of[target]
        mapping = []
        for target_index in choice_map[target]:
            chosen = pick(target_index)
            if chosen is None:
                return False
            mapping.append(chosen)
        group_of[cls] = root
        choice_map[cls] = mapping
        moved = followers.pop(cls, [])
        for c in moved:  # they took cls's own choices (cls was a root): compose
            group_of[c] = root
            choice_map[c] = [choice_map[c][j] for j in mapping]
        followers.setdefault(root, []).extend([cls, *moved])
        return True

    # followers, in graph order so that a producer's own grouping is final first
    for cls in range(n):
        rep = classes.representative(cls)
        cs = strat[cls]
        if cs.kind not in ("op", "getitem") or len(view.inputs[rep]) != 1:
            continue
        producer = _consistent_producer(view, classes, cls, 0)
        if producer is None or producer == cls:
            continue
        if cs.kind == "getitem":
            attach(cls, producer, lambda i: i)
            continue
        wanted: dict[ShardingSpec, int] = {}
        for j, s in enumerate(cs.strategies):
            spec = s.input_specs[0]
            if spec is not None and (spec not in wanted or cs.costs[j].total_s < cs.costs[wanted[spec]].total_s):
                wanted[spec] = j
        attach(cls, producer, lambda i: wanted.get(strat[producer].strategies[i].output_spec))

    # an op that writes into its first input (copy_, fill_, masked_fill_) reads it as it is
    # and returns it so: redistributed, the write would land on a copy, not on the tensor (or
    # the view of a tensor) the rest of the graph reads
    for cls in range(n):
        rep = classes.representative(cls)
        cs = strat[cls]
        if cs.kind != "op" or group_of[cls] != cls or not writes_first_input(view.fx_nodes[rep]):
            continue
        producer = _consistent_producer(view, classes, cls, 0)
        if producer is None or producer == cls:
            continue
        in_place = {s.input_specs[0]: j for j, s in enumerate(cs.strategies)
                    if s.input_specs[0] is not None and s.output_spec == s.input_specs[0]}
        attach(cls, producer, lambda i: in_place.get(strat[producer].strategies[i].output_spec))

    # storage read by a single consumer class takes the spec that consumer asks for; with
    # ``gathered_storage`` a trained parameter keeps its own choice: stored sharded where its
    # consumer reads it whole, it is gathered at use (ZeRO-3 / FSDP)
    for cls in range(n):
        if strat[cls].kind != "storage" or (gathered_storage and _trained_parameter(view, classes.representative(cls))):
            continue
        consumers = {(classes.class_of[u], view.inputs[u].index(m)) for m in classes.members[cls]
                     for u in view.users[m]}
        per_member = all(len(view.users[m]) == 1 for m in classes.members[cls])
        if len(consumers) != 1 or not per_member:
            continue
        consumer, pos = consumers.pop()
        index = {s.output_spec: i for i, s in enumerate(strat[cls].strategies) if s.state_spec is None}
        attach(cls, consumer, lambda i: index.get(strat[consumer].strategies[i].input_specs[pos]))

    roots = sorted({group_of[c] for c in range(n)})
    renumber = {r: g for g, r in enumerate(roots)}
    return Grouping([renumber[group_of[c]] for c in range(n)], choice_map, roots, gathered_storage)


def _build_problem(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], grouping: Grouping,
                   ctx: CostContext, memory_budget: float | None, with_peaks: bool = False,
                   reshards: ReshardingRule | None = None) -> IntraOpProblem:
    """The ILP's data; ``with_peaks`` adds the backward's moments as peak rows
    (:func:`peak_rows`), which the budget bounds beside the kept memory; ``reshards``: the
    reshardings allowed between a value's producer and its reader (:class:`StorageRule`),
    the others the edges' forbidden pairs."""
    num_groups = len(grouping.roots)
    sizes = [len(grouping.choice_map[root]) for root in grouping.roots]
    costs = [[0.0] * k for k in sizes]
    memory = [[0.0] * k for k in sizes]
    for cls in range(classes.num_classes):
        g = grouping.group_of[cls]
        count = len(classes.members[cls])
        for i, j in enumerate(grouping.choice_map[cls]):
            cost = strat[cls].costs[j]
            costs[g][i] += count * cost.total_s
            memory[g][i] += count * cost.memory.total
    edges: list[Edge] = []
    for (u, v, pos), count in _class_edges(view, classes).items():
        src_info = view.graph.nodes[classes.representative(u)]
        shape, itemsize = src_info.shape or (), value_itemsize(src_info, ctx.optimizer.mixed_precision)
        moved = resharded_itemsize(src_info, ctx.optimizer.mixed_precision)
        grad = view.needs_grad[classes.representative(u)]
        gu, gv = grouping.group_of[u], grouping.group_of[v]
        from_parameter = src_info.kind == "parameter"
        sources = (strat[u].strategies[j] for j in grouping.choice_map[u])
        src_specs = tuple((s.output_spec, s.grad_spec, step_reduction_spec(s.output_spec, s.grad_spec, s.state_spec))
                          for s in sources)
        reads = tuple((s.input_specs[pos], s.partial_axes(pos), s.whole_grad_axes)
                      for s in (strat[v].strategies[j] for j in grouping.choice_map[v]))
        recomputed = ctx.region_of(classes.representative(v)) is not None
        kept = from_parameter and grad and parameter_kept(view.fx_nodes, view.needs_grad, classes.representative(v),
                                                          src_info.name, ctx)
        matrix = _edge_matrix(src_specs, reads, shape, itemsize, grad, ctx, from_parameter, recomputed, kept, moved)
        allowed = reshards(src_info, view.graph.nodes[classes.representative(v)]) if reshards is not None else None
        forbidden = _forbidden_pairs(src_specs, reads, allowed, ctx) if allowed is not None else frozenset()
        if forbidden or any(any(row) for row in matrix):
            edges.append(Edge(gu, gv, [[count * c for c in row] for row in matrix], forbidden))
    names = [classes.representative(root) for root in grouping.roots]
    choice_names = [[strat[root].strategies[j].name for j in grouping.choice_map[root]] for root in grouping.roots]
    assert len(names) == num_groups
    peaks = peak_rows(view, classes, strat, grouping, ctx) if with_peaks else []
    overlaps = overlap_rows(view, classes, strat, grouping, ctx)
    return IntraOpProblem(costs, memory, edges, memory_budget, names, choice_names, peaks, overlaps)


def overlap_rows(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], grouping: Grouping,
                 ctx: CostContext) -> list[OverlapRow]:
    """The ILP's overlap rows: per block whose block before it is in the graph, its
    parameters' forward gathers beside that block's forward compute
    (:mod:`~autoplan.cost_models.gather_overlap`); per block with a block after or before it,
    the gradient reductions of the one after and the re-gathers of the one before beside its
    backward (:mod:`~autoplan.cost_models.backward_overlap`); the collectives per choice of the
    parameter's group and the consumer's, the compute per choice of each op's group. Copies of
    a repeated block give equal rows (the same classes): one row each, with their count as its
    weight. None where the device overlaps nothing."""
    rows: dict[tuple, OverlapRow] = {}

    def add_row(key: tuple, reads: list[tuple[Read, Callable[[Strategy, Strategy, str, int], float]]],
                beside: tuple[str, ...], seconds: Callable[[NodeCost], float]) -> None:
        classed = sorted((classes.class_of[param], classes.class_of[op], pos, param, cost)
                         for (param, op, pos), cost in reads)
        ops = tuple(sorted(classes.class_of[op] for op in beside if op in classes.class_of))
        key = (key, tuple((u, v, pos, cost.__name__) for u, v, pos, _, cost in classed), ops)
        if key in rows:
            rows[key].weight += 1.0
            return
        comm = ChoiceSum({})
        for u, v, pos, param, cost in classed:
            stored = [strat[u].strategies[j] for j in grouping.choice_map[u]]
            read = [strat[v].strategies[j] for j in grouping.choice_map[v]]
            _add_pair(comm, grouping.group_of[u], grouping.group_of[v],
                      [[cost(a, b, param, pos) for b in read] for a in stored])
        compute = ChoiceSum({})
        for cls in ops:
            _add_term(compute, grouping.group_of[cls], [seconds(strat[cls].costs[j]) for j in grouping.choice_map[cls]])
        if comm.most() > 0 and compute.most() > 0:
            rows[key] = OverlapRow(comm, compute)

    def gather(a: Strategy, b: Strategy, param: str, pos: int) -> float:
        return forward_gather_seconds(view.graph, param, a.output_spec, read_spec(b, pos), ctx)

    def reduction(a: Strategy, b: Strategy, param: str, pos: int) -> float:
        return reduction_seconds(view.graph, param, a, b, pos, ctx)

    if overlaps_gathers(ctx):
        for prefetch in view.prefetches:
            add_row("forward", [(r, gather) for r in prefetch.reads], prefetch.beside, lambda c: c.forward_s)
    reduces, regathers = overlaps_reductions(ctx), overlaps_regathers(ctx)
    if reduces or regathers:
        for window in view.backward_windows:
            reads = [(r, reduction) for r in window.reductions if reduces and view.needs_grad.get(r[0])]
            reads += [(r, gather) for r in window.regathers
                      if regathers and regathered(view.fx_nodes, view.needs_grad, r[1], r[0], ctx)]
            add_row("backward", reads, window.ops, backward_window)
    return list(rows.values())


def regathered(fx_nodes: Mapping[str, fx.Node], needs_grad: Mapping[str, bool], consumer: str, param: str,
               ctx: CostContext) -> bool:
    """Whether the backward runs ``consumer``'s read of its trained input ``param`` again
    (:func:`~autoplan.cost_models.step_costs.regather_runs`): where the consumer is recomputed,
    or keeps the parameter for its backward. A parameter gathered for it is gathered again
    there, and may be prefetched (:mod:`~autoplan.cost_models.backward_overlap`)."""
    return bool(needs_grad.get(param)) and (
        ctx.region_of(consumer) is not None or parameter_kept(fx_nodes, needs_grad, consumer, param, ctx))


def _add_term(total: ChoiceSum, group: int, values: list[float]) -> None:
    held = total.terms.setdefault(group, [0.0] * len(values))
    held[:] = [a + b for a, b in zip(held, values)]


def _add_pair(total: ChoiceSum, gu: int, gv: int, matrix: list[list[float]]) -> None:
    """``matrix[i][j]`` (choice i of group ``gu``, j of ``gv``) added to ``total``: a term where
    the two are one group, else a pair oriented ``u < v``."""
    if not any(map(any, matrix)):
        return
    if gu == gv:
        _add_term(total, gu, [matrix[i][i] for i in range(len(matrix))])
        return
    key, oriented = ((gu, gv), matrix) if gu < gv else ((gv, gu), [list(c) for c in zip(*matrix)])
    held = total.pairs.get(key)
    total.pairs[key] = oriented if held is None else [[a + b for a, b in zip(r, o)] for r, o in zip(held, oriented)]


def peak_rows(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], grouping: Grouping,
              ctx: CostContext) -> list[PeakRow]:
    """The ILP's peak rows: every moment of the backward
    (:func:`~autoplan.cost_models.transient_memory.peak_moments`) as bytes per device per
    choice of the groups whose values it holds, each value's local shard under the strategy its
    class takes (the same bytes :func:`~autoplan.cost_models.transient_memory.backward_transient`
    reports for the chosen plan). Equal rows are given once."""
    sizes: dict[int, list[float]] = {}  # class -> bytes of its value per choice of its group

    def class_bytes(cls: int) -> list[float]:
        if cls not in sizes:
            info = view.graph.nodes[classes.representative(cls)]
            specs = (strat[cls].strategies[j].output_specs for j in grouping.choice_map[cls])
            sizes[cls] = [value_bytes(info, out[0] if out else None, ctx) for out in specs]
        return sizes[cls]

    # (storage class, consumer class, position, gradient) -> the read's bytes per choice pair of
    # the two groups (u, v) (u < v), or per choice of one group (u == v); None where all are 0
    gathered: dict[tuple[int, int, int, bool], tuple[int, int, list] | None] = {}

    def gathered_term(read: GatheredRead) -> tuple[int, int, list] | None:
        source = view.inputs[read.consumer][read.position]
        u, v = classes.class_of[source], classes.class_of[read.consumer]
        key = (u, v, read.position, read.gradient)
        if key not in gathered:
            info = view.graph.nodes[source]
            stored = [strat[u].strategies[j].output_spec for j in grouping.choice_map[u]]
            reads = [read_spec(strat[v].strategies[j], read.position) for j in grouping.choice_map[v]]
            matrix = [[gathered_bytes(info, s, r, read.gradient, ctx) for r in reads] for s in stored]
            gu, gv = grouping.group_of[u], grouping.group_of[v]
            if not any(map(any, matrix)):
                gathered[key] = None
            elif gu == gv:
                gathered[key] = (gu, gu, [matrix[i][i] for i in range(len(matrix))])
            else:
                gathered[key] = (gu, gv, matrix) if gu < gv else (gv, gu, [list(c) for c in zip(*matrix)])
        return gathered[key]

    sums: dict[tuple, list[list[float]]] = {}  # one matrix per sum of reads, shared by the rows that hold it

    def pair_sum(parts: list[tuple[list[list[float]], int]]) -> list[list[float]]:
        if len(parts) == 1 and parts[0][1] == 1:
            return parts[0][0]
        key = tuple(sorted((id(m), n) for m, n in parts))
        if key not in sums:
            sums[key] = [[math.fsum(n * m[i][j] for m, n in parts) for j in range(len(parts[0][0][0]))]
                         for i in range(len(parts[0][0]))]
        return sums[key]

    moments = peak_moments(view.graph.nodes, view.inputs, view.needs_grad, model_outputs(view.graph), ctx)
    rows: dict[tuple, PeakRow] = {}
    for moment in moments:
        terms: dict[int, list[float]] = {}
        parts: dict[tuple[int, int], list[tuple[list[list[float]], int]]] = {}
        for name, count in moment.items():
            if isinstance(name, GatheredRead):
                term = gathered_term(name)
                if term is None:
                    continue
                u, v, values = term
                if u == v:
                    row = terms.setdefault(u, [0.0] * len(values))
                    for i, x in enumerate(values):
                        row[i] += count * x
                else:
                    parts.setdefault((u, v), []).append((values, count))
                continue
            cls = classes.class_of.get(name)
            if cls is None:
                continue
            row = terms.setdefault(grouping.group_of[cls], [0.0] * len(grouping.choice_map[cls]))
            for i, b in enumerate(class_bytes(cls)):
                row[i] += count * b
        terms = {g: row for g, row in sorted(terms.items()) if any(row)}
        pairs = {uv: pair_sum(p) for uv, p in sorted(parts.items())}
        if terms or pairs:
            # the pairs' matrices are shared by every moment that holds the same reads: by identity
            key = (tuple((g, tuple(row)) for g, row in terms.items()), tuple((uv, id(m)) for uv, m in pairs.items()))
            rows.setdefault(key, PeakRow(terms, 0.0, pairs))
    return list(rows.values())


def _edge_matrix(src_specs: tuple[tuple[ShardingSpec, ShardingSpec | None, ShardingSpec | None], ...],
                 reads: tuple[tuple[ShardingSpec | None, frozenset[int], frozenset[int]], ...],
                 shape: tuple[int, ...], itemsize: int, grad: bool, ctx: CostContext, from_parameter: bool,
                 recomputed: bool = False, kept: bool = False, forward_itemsize: int | None = None
                 ) -> list[list[float]]:
    """Seconds of one edge for every producer (its spec, its gradient's where stored unlike it,
    and a ZeRO-1 gradient's reduction placement: :func:`step_reduction_spec`) × consumer read
    (its spec, partial and whole gradient axes), memoised whole in ``ctx.cache``: the edges
    between ops of one kind repeat within a layer and across the layers planned on one mesh."""
    key = ("edge matrix", src_specs, reads, shape, itemsize, grad, from_parameter,
           ctx.parameter_edges if from_parameter else -1, recomputed, kept, forward_itemsize)
    matrix = ctx.cache.get(key)
    if matrix is None:
        # many producer choices emit the same spec, and many consumer choices read the same:
        # each distinct pair is costed once
        sources: dict[tuple[ShardingSpec, ShardingSpec | None, ShardingSpec | None], int] = {}
        targets: dict[tuple[ShardingSpec | None, frozenset[int], frozenset[int]], int] = {}
        rows = [sources.setdefault(s, len(sources)) for s in src_specs]
        cols = [targets.setdefault(r, len(targets)) for r in reads]
        distinct = [[0.0 if dst is None else edge_cost(src, dst, shape, itemsize, grad, ctx, partial, from_parameter,
                                                       whole, recomputed, kept, grad_src, forward_itemsize, step_src)
                     for dst, partial, whole in targets] for src, grad_src, step_src in sources]
        matrix = [[distinct[i][j] for j in cols] for i in rows]
        ctx.cache[key] = matrix
    return matrix


def _forbidden_pairs(src_specs: tuple[tuple[ShardingSpec, ShardingSpec | None, ShardingSpec | None], ...],
                     reads: tuple[tuple[ShardingSpec | None, frozenset[int], frozenset[int]], ...],
                     allowed: ReshardAllowed, ctx: CostContext) -> frozenset[tuple[int, int]]:
    """The pairs (producer choice, reader choice) of one edge whose resharding ``allowed``
    refuses, memoised in ``ctx.cache`` as :func:`_edge_matrix` is."""
    key = ("forbidden pairs", src_specs, reads, allowed)
    pairs = ctx.cache.get(key)
    if pairs is None:
        refused = {(given, read): not allowed(given, read) for given, _, _ in src_specs
                   for read, _, _ in reads if read is not None}
        pairs = frozenset((i, j) for i, (given, _, _) in enumerate(src_specs) for j, (read, _, _) in enumerate(reads)
                          if read is not None and refused[given, read])
        ctx.cache[key] = pairs
    return pairs


def parameter_kept(fx_nodes: Mapping[str, fx.Node], needs_grad: Mapping[str, bool], consumer: str, param: str,
                   ctx: CostContext) -> bool:
    """Whether ``consumer`` keeps its input ``param`` for the backward (then a gathered
    parameter is gathered again there: :func:`regathers_for`), memoised in ``ctx.cache`` by op
    and input geometry."""
    node = fx_nodes[consumer]
    return regathers_for(node) and keeps_value(node, fx_nodes[param], needs_grad,
                                               ctx.cache.setdefault("saved inputs", {}))


def with_parameter_edges(ctx: CostContext, graph: TracedGraph, view: GraphView | None = None) -> CostContext:
    """``ctx`` for ``graph``: with its number of parameter → consumer edges that carry a
    gradient (:attr:`CostContext.parameter_edges`, the bucket latency's denominator)."""
    view = view or GraphView.of(graph)
    edges = sum(len(view.users[name]) for name, info in graph.nodes.items()
                if info.kind == "parameter" and view.needs_grad.get(name))
    return ctx if edges == ctx.parameter_edges else replace(ctx, parameter_edges=edges)


def _solve(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], ctx: CostContext,
           memory_budget: float | None, solver: str, time_limit_s: float | None, canonical: bool,
           gathered_storage: bool = False, optimum: IntraOpResult | None = None,
           reshards: ReshardingRule | None = None) -> tuple[Grouping, IntraOpProblem, IntraOpSolution]:
    """The ILP, solved (:func:`_solve_once`); where no plan keeps to the reshardings
    ``reshards`` allows (the strategies other rules left admit none, or none that fits), the ILP
    without them (the plan then runs on whatever program takes it)."""
    if reshards is None:
        return _solve_once(view, classes, strat, ctx, memory_budget, solver, time_limit_s, canonical,
                           gathered_storage, optimum)
    try:
        return _solve_once(view, classes, strat, ctx, memory_budget, solver, time_limit_s, canonical,
                           gathered_storage, optimum, reshards)
    except (AutoplanError, RuntimeError):
        return _solve_once(view, classes, strat, ctx, memory_budget, solver, time_limit_s, canonical,
                           gathered_storage, optimum)


def _solve_once(view: GraphView, classes: NodeClasses, strat: list[ClassStrategies], ctx: CostContext,
                memory_budget: float | None, solver: str, time_limit_s: float | None, canonical: bool,
                gathered_storage: bool = False, optimum: IntraOpResult | None = None,
                reshards: ReshardingRule | None = None) -> tuple[Grouping, IntraOpProblem, IntraOpSolution]:
    """The ILP, solved. Storing a trained parameter sharded and gathering it at use costs
    gathers and saves memory (its optimizer step shrinks too, on GPU clusters by less than
    the gathers cost), so it is searched where memory needs it: the fastest plan with every
    trained parameter stored as its consumer reads it is found first, and where that plan
    does not fit the budget the problem is solved again with gathered storage among the
    choices (:func:`_group`), and with it the parameters' sharded optimizer state (ZeRO-1/2:
    one all-gather per step, a reduce-scatter for an all-reduce). A plan that fits without
    them may be beaten by one that shards for the optimizer's sake alone (a ZeRO-2 step can
    cost less than a replicated one); on one node that plan is not searched. With
    ``gathered_storage`` they are among the choices from the start (the stage search's layer
    costs, whose problems are trimmed to fit memory later), and so they are on a mesh across
    nodes (:func:`splits_dims_over_axes`): there HSDP, the batch over both axes and the
    parameters gathered inside a node, reduces a shard of each gradient across nodes where a
    replicated parameter reduces all of it, and ZeRO-2 over both axes reduce-scatters each
    gradient inside a node before a shard of it crosses (Llama 3.1 8B's shape on 4x8 H100s,
    every layer recomputed: 1.86 s per step against 2.54 s for the plan without them). And so
    they are where the device hides a block's forward gathers behind the block before, in a
    plan of one stage (:func:`_hides_gathers`): there a parameter gathered at use may be the
    faster choice, its hidden gathers cheaper than the optimizer step it shrinks (and one held
    through accumulated microbatches moves fewer bytes than a replicated one under bf16).

    ``optimum``: this call's answer found before without the tie-break; the problem it solved is
    built again and only its ties are broken (:func:`~autoplan.solvers.canonical_solution`).
    ``reshards``: see :func:`_build_problem`."""
    peaks = memory_budget is not None  # the budget bounds the peak: kept values and the backward's moments
    if optimum is not None:
        grouping = _group(view, classes, strat, gathered_storage=optimum.gathered_storage)
        problem = _build_problem(view, classes, strat, grouping, ctx,
                                 memory_budget if optimum.gathered_storage else None, peaks, reshards)
        return grouping, problem, canonical_solution(problem, optimum.solution, solver, time_limit_s)
    if gathered_storage or splits_dims_over_axes(ctx) or _hides_gathers(view, ctx):
        grouping = _group(view, classes, strat, gathered_storage=True)
        problem = _build_problem(view, classes, strat, grouping, ctx, memory_budget, peaks, reshards)
        return grouping, problem, solve_intra_op(problem, solver=solver, time_limit_s=time_limit_s,
                                                 canonical=canonical)
    grouping = _group(view, classes, strat, gathered_storage=False)
    problem = _build_problem(view, classes, strat, grouping, ctx, None, peaks, reshards)
    fastest = solve_intra_op(problem, solver=solver, time_limit_s=time_limit_s, canonical=False)
    if memory_budget is None or fastest.peak <= memory_budget:
        if canonical:
            fastest = canonical_solution(problem, fastest, solver, time_limit_s)
        return grouping, problem, fastest
    grouping = _group(view, classes, strat, gathered_storage=True)
    problem = _build_problem(view, classes, strat, grouping, ctx, memory_budget, peaks, reshards)
    return grouping, problem, solve_intra_op(problem, solver=solver, time_limit_s=time_limit_s, canonical=canonical)


def _hides_gathers(view: GraphView, ctx: CostContext) -> bool:
    """Whether a block's forward gathers could hide behind the block before (a GPU, and a
    repeated block whose block before it is in the graph), in a plan of one stage (a
    pipeline's stage ILPs are kept small: on the Llama 3.1 70B shape on 256 H100s, sharded
    storage in every stage's ILP planned in 63.3 s instead of 41.4 s, and found the same plan)."""
    return ctx.one_stage and overlaps_gathers(ctx) and bool(view.prefetches)


@dataclass
class PreparedPlan:
    """What :func:`plan_intra_op` computes before its ILP: the graph's facts, the context with
    its parameter edges counted, the node classes (split where recomputation or pins tell
    copies apart) and each class's strategies with their costs. Solves of one graph on one
    mesh that differ only in whether gathered storage is a choice (the stage search's fastest
    and storage ILPs of a layer) share it."""

    view: GraphView
    ctx: CostContext
    classes: NodeClasses
    strategies: list[ClassStrategies]
    messages: list[str]
    reshards: ReshardingRule | None = None  # the rule's (StorageRule.reshards)


def prepare_intra_op(graph: TracedGraph, classes: NodeClasses, mesh_shape: tuple[int, ...], ctx: CostContext,
                     allow_storage: StorageRule | None = None, pins: PinSet | None = None) -> PreparedPlan:
    """The strategies of every node class of ``graph`` on a mesh of ``mesh_shape`` (see
    :func:`plan_intra_op` for ``allow_storage`` and ``pins``)."""
    view = GraphView.of(graph)
    ctx = with_parameter_edges(ctx, graph, view)
    if ctx.recompute_regions:  # copies of a block share a strategy only where they are recomputed alike
        classes = split_classes(classes, lambda name: (ctx.region_of(name) is not None, ctx.recomputes(name)))
    if pins:  # copies of a block share a strategy only where they are pinned alike
        classes = split_classes(classes, lambda name: pins.key(graph.nodes[name]))
    messages: list[str] = []

    def warn(message: str) -> None:
        if message not in messages:
            messages.append(message)

    strat: list[ClassStrategies] = []
    for cls in range(classes.num_classes):
        rep = classes.representative(cls)
        node = view.fx_nodes[rep]
        producer = None
        if node.target is operator.getitem:
            producer = strat[classes.class_of[node.args[0].name]]
        strat.append(_class_strategies(view, rep, mesh_shape, ctx, producer, warn, allow_storage, pins))
    return PreparedPlan(view, ctx, classes, strat, messages, allow_storage.reshards if allow_storage else None)


def plan_intra_op(graph: TracedGraph, classes: NodeClasses, mesh_shape: tuple[int, ...], ctx: CostContext,
                  memory_budget: float | None, solver: str = "highs", time_limit_s: float | None = None,
                  pick: Callable[[int, list[str]], int] | None = None,
                  allow_storage: StorageRule | None = None, canonical: bool = True,
                  pins: PinSet | None = None, gathered_storage: bool = False,
                  prepared: PreparedPlan | None = None, optimum: IntraOpResult | None = None) -> IntraOpResult:
    """Choose a strategy for every node of ``graph`` on a mesh of ``mesh_shape``.

    ``pick(group, choice_names) -> index`` replaces the ILP with a given assignment (tests that
    run arbitrary valid assignments); every pick is a valid plan. ``allow_storage(info, spec)``
    restricts how parameters, buffers and inputs may be stored and what ops may produce
    (manual plans: data parallel over a mesh axis means parameters replicated and the batch
    sharded there); a stored value keeps its first spec (replicated) and an op all its
    strategies if the rule allows none. ``canonical`` breaks ties among equal-cost assignments
    canonically (:mod:`autoplan.solvers.intra_op.canonical`), at the price of a second solve:
    needed for a plan that runs, not for a cost estimate. ``pins`` (the user's, see
    :mod:`autoplan.planner.pins`) leave each node they hold only the strategies whose output
    they allow: constraints of the ILP, whose resharding the objective pays.
    ``gathered_storage``: see :func:`_solve`. ``prepared``: :func:`prepare_intra_op`'s answer for
    the same graph, classes, mesh, context, ``allow_storage`` and ``pins``, where the caller
    has it already. ``optimum``: the answer of a call with the same arguments but ``canonical``
    False; only its ties are broken (a second solve, not a third)."""
    if prepared is None:
        prepared = prepare_intra_op(graph, classes, mesh_shape, ctx, allow_storage, pins)
    view, ctx, classes, strat = prepared.view, prepared.ctx, prepared.classes, prepared.strategies
    messages = list(prepared.messages)
    if pick is None:
        grouping, problem, solution = _solve(view, classes, strat, ctx, memory_budget, solver, time_limit_s, canonical,
                                             gathered_storage, optimum, prepared.reshards)
    else:
        grouping = _group(view, classes, strat, gathered_storage=True)
        problem = _build_problem(view, classes, strat, grouping, ctx, memory_budget, memory_budget is not None,
                                 prepared.reshards)
        choices = [pick(g, problem.choice_names[g]) for g in range(len(problem.costs))]
        objective, memory = evaluate(problem, choices)
        solution = IntraOpSolution(choices, objective, memory, "picked", None, "pick", 0.0, 0, 0,
                                   transient(problem, choices))
    chosen: dict[str, Strategy] = {}
    node_costs: dict[str, NodeCost] = {}
    for cls in range(classes.num_classes):
        j = grouping.strategy_index(cls, solution.choices)
        for member in classes.members[cls]:
            chosen[member] = strat[cls].strategies[j]
            node_costs[member] = strat[cls].costs[j]
    return IntraOpResult(mesh_shape, chosen, node_costs, solution, problem, classes.num_classes,
                         len(graph.nodes), view.inputs, view.needs_grad, messages, grouping.gathered_storage)


def recompute_change(graph: TracedGraph, result: IntraOpResult, ctx: CostContext,
                     kept: frozenset[str] = frozenset(), only: frozenset[str] | None = None) -> tuple[float, float]:
    """(seconds added, bytes freed) per step by recomputing every op of ``graph`` (or of its
    nodes in ``only``) in the backward under ``result``'s strategies (as one region, costed as
    :func:`~autoplan.cost_models.step_costs.op_cost` and :func:`edge_cost` cost a recomputed
    node): each op's forward and the forward resharding of its inputs run once more; the
    outputs of ops that only the graph itself reads are no longer kept. The ops in ``kept``
    (selective recomputation: :func:`~autoplan.planner.recompute.saved_outputs`) keep their
    outputs and do not run again; their inputs' resharding does."""
    fx_nodes = graph.fx_nodes
    mixed = ctx.optimizer.mixed_precision
    added = freed = 0.0
    for name, cost in result.node_costs.items():
        info = graph.nodes[name]
        if info.kind != "op" or (only is not None and name not in only):
            continue
        if name not in kept:
            added += cost.compute_s / (1.0 + (ctx.backward_factor if result.needs_grad[name] else 0.0))
            if not any(user.op == "output" for user in fx_nodes[name].users):
                freed += cost.memory.activations
        if fx_nodes[name].target is operator.getitem:
            continue
        strategy = result.chosen[name]
        for pos, source in enumerate(result.input_names[name]):
            dst = strategy.input_specs[pos] if pos < len(strategy.input_specs) else None
            produced = result.chosen[source].output_specs
            if dst is None or not produced or produced[0] == dst:
                continue
            source_info = graph.nodes[source]
            if source_info.kind == "parameter" and result.needs_grad[source] and \
                    parameter_kept(fx_nodes, result.needs_grad, name, source, ctx):
                continue  # gathered again in the backward already
            forward, _ = edge_steps(produced[0], dst, source_info.shape or (), resharded_itemsize(source_info, mixed),
                                    False, ctx)
            added += steps_seconds(forward, ctx) * ctx.microbatches
    return added, freed


def emit_warnings(messages: list[str]) -> None:
    for message in messages:
        warnings.warn(message, UnknownOpWarning, stacklevel=3)
