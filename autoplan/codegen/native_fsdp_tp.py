"""Recognising FSDP × tensor-parallel plans on a 2-D mesh, the way torchtitan composes them:
``parallelize_module`` on the tensor axis (``ColwiseParallel``/``RowwiseParallel`` per
``nn.Linear``, ``ColwiseParallel`` on an ``nn.Embedding``, ``SequenceParallel`` on the norms of a
sequence-parallel plan), then FSDP2's ``fully_shard`` per block and on the root over the data
axis.

A plan on mesh ``(data, tensor)`` is taken when, read axis by axis:

- **data axis (0).** Every user input is split on its batch dim (divisible) or whole; every
  parameter is stored sharded over axis 0 and every op reads it whole there (gathered at use:
  ZeRO-3 / FSDP); every activation keeps its axis-0 placement along every edge (no activation
  collective on axis 0), and only the loss makes partial sums there: a mean, or a cross-entropy
  averaged over the tokens it does not ignore (divided by the global count). No batch norm, no
  buffer written in the forward.
- **tensor axis (1).** The sharded parameters are those of ``nn.Linear`` and ``nn.Embedding``
  modules, each called once: a *column* linear (weight ``S(0)``, bias ``S(0)``, input ``R``,
  output sharded on its last dim), a *row* linear (weight ``S(1)``, input sharded on its last
  dim, output partial sums that every consumer reads whole — one all-reduce — or on one dim — a
  reduce-scatter), a *column* embedding (weight ``S(1)``, output sharded on its last dim). The
  values sharded on their last dim form regions that start at column modules: every op in a
  region reads sharded values of the region and values whole on axis 1 only (rotary tables,
  masks) and gives a sharded value (attention per head, the gated MLP's product); a region ends
  at the inputs of row linears, or — for a column module none of whose values reaches a row
  linear — at an exit: a chain of single-input ops (casts, views) kept sharded on the last dim
  whose every consumer reads the value whole (a gather) or on another dim (an all-to-all).
  ``ColwiseParallel(output_layouts=...)`` does that at the module's output instead: the same
  bytes (in fp32) and one collective, as planned.
- **sequence parallelism** (Megatron's). The other values sharded on axis 1 (the residual stream
  and the norms, split on the sequence) are read as they are given, but by column linears,
  which gather them (``ColwiseParallel(input_layouts=Shard(d))``), and come from a row linear's
  reduce-scatter, a column module's exit or one another; a module among them holding parameters
  (a norm, its weight whole on axis 1) runs as ``SequenceParallel``, which all-reduces its
  weight's gradient over axis 1 as the plan does. These values stay DTensors between the
  styles, so that the model reads their global shapes (positions, masks). Every other value is
  whole on axis 1.

What the native program executes then equals the plan's collectives: per block one gather of its
parameters over axis 0 in the forward and one in the backward, one reduce-scatter of their
gradients (FSDP2 groups the plan's per-parameter ones); on axis 1 each row linear's all-reduce and
each column exit's gather or all-to-all, each gathered column input in the forward, and in the
backward their duals: one all-reduce (or reduce-scatter, where the input was gathered) of the
gradient of each column linear's input — ``ColwiseParallel`` makes its input a replicated
DTensor, whose gradient arrives as partial sums: the plan's per-edge reductions — and a
sequence-parallel norm's weight gradient all-reduced; the loss and
the token count all-reduced over axis 0. FSDP2 stores dim 0 of each tensor-parallel shard
sharded over axis 0, where the plan may name another dim: the same bytes gathered and
reduce-scattered. ``check.py`` compares the counts.

Recomputed layers run under the module checkpoint of the data-parallel patterns without torch's
early stop: the recomputation runs the whole layer again, its row linears' all-reduces
included, as the plan lists them.

Not taken (the DTensor interpreter runs them): a plan that gathers inside a norm (its statistics,
as the search may choose under recomputation, or the sequence-sharded norm's output before its
weight's product, which saves the weight gradient's all-reduce), a loss over a batch split on
axis 1 too, tied parameters sharded on axis 1, ZeRO-1/2, anything else above. ``--manual
fsdp=,tp=`` plans keep to what these styles run (:func:`autoplan.planner.manual.manual_rule`;
among its rules, edge by edge in the ILP, nothing is resharded on axis 1 inside a norm): the plans of torchtitan's Llama-70B recipe
(``fsdp=32,tp=8,ac=full`` on 256 H100s), of the Llama-70B shape on 64 H100s (``fsdp=8,tp=8,ac=full``,
the layout among the found plan's native rivals) and of small Llamas are taken. A model
whose code sizes its heads from its configuration rather than from its tensors (``view(b, s,
self.num_heads, d)``) would see its local shards of heads with the global count and stop at its
first step with a shape error; the Hugging Face decoders size them from their tensors, as
torchtitan's models do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement

from autoplan.codegen.native_patterns import (
    MEAN_OPS,
    Recognised,
    batch_split,
    inside_module,
    is_token_mean,
    is_whole,
    loss_node,
    op_nodes,
    shard_dim,
    spec_text,
    target_name,
    tensor_inputs,
)
from autoplan.load import ModelSpec
from autoplan.plan_schema import NodePlan, Plan
from autoplan.sharding import parse_placement
from autoplan.trace.graph import TracedGraph

__all__ = ["recognise_fsdp_tp"]

_LINEAR = "aten.linear.default"
_EMBEDDING = "aten.embedding.default"
_GATHER_CHAIN_OPS = ("aten.view.default", "aten.reshape.default", "aten._unsafe_view.default",
                     "aten.contiguous.default", "aten.to.dtype", "aten._to_copy.default", "aten.clone.default")


def _axis(specs: Sequence[str] | None, axis: int) -> str | None:
    return None if specs is None else specs[axis]


def _whole(spec: str | None) -> bool:
    return spec is None or parse_placement(spec).is_replicate


def _sharded_dim(spec: str | None) -> int | None:
    return None if spec is None else shard_dim([spec])


def _partial(spec: str | None) -> bool:
    return spec is not None and not parse_placement(spec).is_replicate and not parse_placement(spec).is_shard


def _last_dim(node: torch.fx.Node) -> int:
    return len(node.meta["val"].shape) - 1


def _data_axis(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> str | None:
    """Why the plan's axis 0 is not FSDP's (None: it is)."""
    parameters = dict(spec.module.named_parameters(remove_duplicate=False))
    for fqn, specs in plan.params.items():
        if fqn not in parameters:
            if not is_whole(specs):
                return f"buffer {fqn} is {spec_text(specs)}"
            continue
        storage = plan.storage.get(fqn)
        if _sharded_dim(specs[0]) is None or storage is None or list(storage.param) != list(specs):
            return f"{fqn} is {spec_text(specs)}: not stored sharded over axis 0"
    why = batch_split(spec, graph, plan, 1)
    if why:
        return why
    for c in plan.collectives:
        on_data = c.tensor in ("parameter", "gradient", "loss count") or c.where.endswith("-> output")
        norm_gradient = c.tensor == "gradient" and c.kind == "all_reduce"  # over axis 1: checked with the styles
        if c.mesh_axis != (0 if on_data else 1) and not norm_gradient:
            return f"the plan has a {c.tensor} collective over axis {c.mesh_axis} ({c.kind} at {c.where})"
    return None


class _TensorAxis:
    """The tensor-parallel styles axis 1 of ``plan`` reduces to, or why not (``reason``)."""

    def __init__(self, spec: ModelSpec, graph: TracedGraph, plan: Plan) -> None:
        self.spec, self.graph, self.plan = spec, graph, plan
        self.plans: dict[str, NodePlan] = {p.name: p for p in plan.nodes}
        self.styles: dict[str, tuple[str, DPlacement | None]] = {}
        self.columns: dict[torch.fx.Node, str] = {}  # column module calls -> module FQN
        self.rows: set[torch.fx.Node] = set()
        self.region: set[torch.fx.Node] = set()
        self.gathered_edges: set[tuple[str, str]] = set()  # (value, reader): a column output's exit
        self.sequence: set[torch.fx.Node] = set()  # values sharded on axis 1 outside the regions
        self.input_layouts: dict[str, DPlacement] = {}  # column modules reading a sharded value

    def out(self, node: torch.fx.Node) -> str | None:
        p = self.plans.get(node.name)
        return _axis(p.outputs[0], 1) if p is not None and p.outputs else None

    def read(self, user: torch.fx.Node, value: torch.fx.Node) -> str | None:
        """How ``user`` reads ``value`` on axis 1."""
        p = self.plans.get(user.name)
        inputs = tensor_inputs(user)
        if p is None or value not in inputs:
            return None
        index = inputs.index(value)
        return _axis(p.inputs[index], 1) if index < len(p.inputs) else None

    def modules(self) -> str | None:
        """The column and row modules (``styles``), from the parameters sharded on axis 1."""
        sharded = {fqn for fqn, s in self.plan.params.items() if not _whole(s[1])}
        if any(fqn in self.graph.tied or fqn in self.graph.tied.values() for fqn in sharded):
            return "a tied parameter is sharded over axis 1"
        covered: set[str] = set()
        for node in op_nodes(self.graph):
            info = self.graph.nodes.get(node.name)
            p = self.plans.get(node.name)
            if info is None or p is None or not any(fqn in sharded for fqn in info.params):
                continue
            name = info.module
            try:
                module = self.spec.module.get_submodule(name)
            except AttributeError:
                return f"no module {name!r}"
            if name in self.styles:
                return f"{name} is called more than once"
            weight = _sharded_dim(self.plan.params.get(f"{name}.weight", ["R", "R"])[1])
            last = _last_dim(node)
            if isinstance(module, torch.nn.Linear) and target_name(node) == _LINEAR:
                bias = self.plan.params.get(f"{name}.bias") if module.bias is not None else None
                if weight == 0 and _whole(_axis(p.inputs[0], 1)) and _sharded_dim(self.out(node)) == last \
                        and (bias is None or _sharded_dim(bias[1]) == 0):
                    self.columns[node] = name
                    read = _sharded_dim(self.out(tensor_inputs(node)[0]))
                    if read is not None:  # gathered from a sequence-sharded value
                        self.input_layouts[name] = Shard(read)
                elif weight == 1 and _sharded_dim(_axis(p.inputs[0], 1)) == last and _partial(self.out(node)):
                    self.rows.add(node)
                    # its consumers read the partial sums whole (an all-reduce) or on one shard (a
                    # reduce-scatter onto the sequence)
                    wanted = {"R" if _whole(w) else w for w in (self.read(u, node) for u in node.users)}
                    layout = wanted.pop() if len(wanted) == 1 else None
                    if layout is None or (layout != "R" and _sharded_dim(layout) is None):
                        return f"{name}: its partial sums are read as {sorted(wanted | {str(layout)})}"
                    self.styles[name] = ("rowwise", Replicate() if layout == "R" else Shard(_sharded_dim(layout)))
                else:
                    return f"{name}: weight {spec_text(self.plan.params.get(f'{name}.weight'))} read " \
                           f"{spec_text(p.inputs[0])}, output {spec_text(p.outputs[0])}: neither column nor row " \
                           "parallel"
            elif isinstance(module, torch.nn.Embedding) and target_name(node) == _EMBEDDING and weight == 1 \
                    and _sharded_dim(self.out(node)) == last:
                self.columns[node] = name
            else:
                return f"{node.name} ({target_name(node)}) reads a parameter sharded over axis 1: " \
                       "not an nn.Linear or nn.Embedding call"
            covered.update(f"{name}.{n}" for n, _ in module.named_parameters())
        if sharded - covered:
            return f"{min(sharded - covered)} is sharded over axis 1 outside a linear or an embedding"
        if not self.columns:
            return "nothing is sharded over axis 1"
        return None

    def regions(self) -> str | None:
        """Walk each column module's sharded values to the row linears or an exit: a gather, or
        an all-to-all onto a sequence-sharded value."""
        for column, name in self.columns.items():
            seen, stack, rows, gathers = {column}, [column], 0, []
            while stack:
                value = stack.pop()
                for user in value.users:
                    if user.op == "output":
                        gathers.append((value, user, "R"))
                        continue
                    wants = self.read(user, value)
                    if user in self.rows and tensor_inputs(user)[0] is value:
                        rows += 1
                    elif _whole(wants) or wants != self.out(value):
                        gathers.append((value, user, wants or "R"))
                    elif user in self.columns or user in seen:
                        continue
                    elif _sharded_dim(self.out(user)) is None:
                        return f"{user.name} reads sharded {value.name} and gives {self.out(user)}"
                    else:
                        seen.add(user)
                        stack.append(user)
            self.region |= seen - {column}
            if rows and gathers:
                return f"{name}'s sharded values reach a row linear and are gathered ({gathers[0][0].name})"
            layouts = {"R" if _whole(wants) else wants for _, _, wants in gathers}
            if len(layouts) > 1:
                return f"{name}'s sharded values are read as {sorted(layouts)}"
            if gathers:
                why = self._gather_chain(column, seen)
                if why:
                    return f"{name}: {why}"
                self.gathered_edges |= {(v.name, u.name) for v, u, _ in gathers}
            layout = layouts.pop() if layouts else None
            self.styles[name] = ("colwise", None if layout is None else Replicate() if layout == "R"
                                 else Shard(_sharded_dim(layout)))
        for node in self.region:
            for value in tensor_inputs(node):
                if value not in self.region and value not in self.columns and not _whole(self.read(node, value)):
                    return f"{node.name} reads {value.name} as {self.read(node, value)} from outside a column region"
        return None

    def _gather_chain(self, column: torch.fx.Node, values: set[torch.fx.Node]) -> str | None:
        """Why ``values`` (a column module's output and what follows it) is not one chain of
        single-input ops kept sharded on the last dim (None: it is)."""
        node = column
        while True:
            if _sharded_dim(self.out(node)) != _last_dim(node):
                return f"{node.name} is not sharded on its last dim"
            following = [u for u in node.users if u in values]
            if not following:
                return None
            nxt = following[0]
            if len(following) > 1 or len(tensor_inputs(nxt)) != 1 or target_name(nxt) not in _GATHER_CHAIN_OPS:
                return f"{nxt.name} ({target_name(nxt)}) between the module and the gather"
            node = nxt

    def sequence_values(self) -> str | None:
        """Megatron's sequence parallelism: the values sharded on axis 1 outside the regions
        (the residual stream and the norms between the blocks' halves, split on their sequence
        dim) are read as they are given, but by the column linears, which gather them, and come
        from a row linear's reduce-scatter, a column module's all-to-all or one another. A
        module among them that holds parameters (a norm, its weight whole on axis 1) runs as
        ``SequenceParallel``: its weight's gradient all-reduced over axis 1, as planned."""
        self.sequence = {n for n in op_nodes(self.graph) if n.name in self.plans and n not in self.region
                         and n not in self.columns and n not in self.rows and not _whole(self.out(n))}
        if not self.sequence:
            return None
        for node in self.sequence:
            given = self.out(node)
            info = self.graph.nodes.get(node.name)
            for value in tensor_inputs(node):
                read = self.read(node, value)
                if value.name in self.graph.param_names:
                    if not _whole(read):
                        return f"{node.name} reads {value.name} as {read}"
                    owner = info.module if info is not None else ""
                    if not owner:
                        return f"{node.name} reads a parameter outside a module"
                    self.styles[owner] = ("sequence", Shard(_sharded_dim(given)))
                elif read != given or (value not in self.sequence and value not in self.rows
                                       and (value.name, node.name) not in self.gathered_edges):
                    return f"{node.name} ({given}) reads {value.name} as {read}"
            for user in node.users:
                if user.op == "output" or (user not in self.sequence and user not in self.columns):
                    return f"{node.name} ({given}) is read by {user.name}"
        for name, style in self.styles.items():
            if style[0] != "sequence":
                continue
            inside = [n for n in op_nodes(self.graph) if n.name in self.graph.nodes
                      and inside_module(self.graph.nodes[n.name].module, name)]
            if any(n not in self.sequence for n in inside):
                return f"{name} holds ops not sharded on the sequence"
        return None

    def rest(self) -> str | None:
        """Every other value is whole on axis 1; a row linear's partial sums are read whole."""
        loss = loss_node(self.graph)
        for node in op_nodes(self.graph):
            p = self.plans.get(node.name)
            if p is None or node in self.region or node in self.columns or node in self.rows or node in self.sequence:
                continue  # (a column's and a row's reads and outputs: modules(); the sequence's: sequence_values())
            for value in tensor_inputs(node):
                if (value in self.region or value in self.columns) and (value.name, node.name) in self.gathered_edges:
                    continue
                if value in self.rows and node not in self.rows:
                    if not _whole(self.read(node, value)):
                        return f"{node.name} reads row-parallel {value.name} as {self.read(node, value)}"
                    continue
                if not _whole(self.read(node, value)):
                    return f"{node.name} reads {value.name} as {self.read(node, value)} over axis 1"
            if any(not _whole(_axis(s, 1)) for s in p.outputs):
                return f"{node.name} gives {[spec_text(s) for s in p.outputs]}"
            if node is not loss and any(_partial(_axis(s, 0)) for s in p.outputs):
                return f"{node.name} makes partial sums over axis 0 and is not the loss"
        return None


def recognise_fsdp_tp(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised | str:
    """The ``"fsdp_tp"`` pattern (see the module docstring) with the tensor axis' styles by
    module FQN, or why ``plan`` is not one."""
    if len(plan.mesh) != 2:
        return f"mesh {plan.mesh} is not 2-D"
    if any(s.grad != s.param or s.optimizer_state != s.param for s in plan.storage.values()):
        return "ZeRO-1/2 storage"
    why = _data_axis(spec, graph, plan)
    if why:
        return why
    tensor = _TensorAxis(spec, graph, plan)
    why = tensor.modules() or tensor.regions() or tensor.sequence_values() or tensor.rest()
    if why:
        return why
    sequence_modules = [name for name, style in tensor.styles.items() if style[0] == "sequence"]
    for c in plan.collectives:
        if c.tensor == "gradient" and c.mesh_axis == 1 and \
                not any(c.where.startswith(f"{name}.") for name in sequence_modules):
            return f"the plan reduces a gradient over axis 1 ({c.kind} at {c.where})"
    loss = loss_node(graph)
    token_mean = loss is not None and is_token_mean(graph, loss)
    if loss is None or (target_name(loss) not in MEAN_OPS and not token_mean):
        return "the loss is not a mean: the ranks' gradient average would differ"
    return Recognised("fsdp_tp", tensor.styles, token_mean=token_mean, input_layouts=tensor.input_layouts)
