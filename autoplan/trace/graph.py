"""The traced graph: an ATen-level torch.fx graph whose every node knows its shape, dtype,
FLOPs, bytes, the module it came from and the parameters it reads."""

from __future__ import annotations

import functools

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch.fx._lazy_graph_module import _LazyGraphModule


class NodeKind(StrEnum):
    """What a node of the traced graph is."""

    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"  # a user input
    CONSTANT = "constant"  # a tensor attribute that is neither parameter nor buffer
    OP = "op"  # a call_function
    OUTPUT = "output"
    ACTIVATION = "activation"  # in a pipeline stage's graph: a value received from an earlier stage


@dataclass(frozen=True)
class NodeInfo:
    """What the planner knows about one fx node.

    ``kind`` is one of ``"parameter"``, ``"buffer"``, ``"input"`` (a user input), ``"op"``
    (a call_function) or ``"output"`` — or, rarely, ``"constant"`` (a tensor attribute that is
    neither parameter nor buffer, which export lifts as an input). ``shape``/``dtype``/``itemsize`` describe the node's
    first tensor output (``None``/``""``/0 when it produces no tensor). ``flops`` is the
    forward FLOPs of the op (torch.utils.flop_counter; 0 for ops it does not count), ``bytes``
    the bytes it reads plus writes. ``module`` is the qualified name of the innermost
    nn.Module the op came from (``""`` for the root), ``module_type`` its class name.
    ``params`` are the FQNs of parameters (and buffers) among the op's direct inputs;
    ``fqn`` is the FQN of a parameter/buffer placeholder itself. ``full_precision``: the model
    turned ``torch.autocast`` off around the op (:mod:`autoplan.trace.wrapped_regions`), so it
    computes in its traced dtype whatever the plan's precision. ``batch_free``: an op output
    that no user input and no parameter flows into (:func:`autoplan.trace.tracer.batch_free_values`).
    """

    name: str
    kind: NodeKind
    target: str
    shape: tuple[int, ...] | None
    dtype: str
    itemsize: int
    flops: float
    bytes: float
    module: str
    module_type: str
    params: tuple[str, ...]
    fqn: str | None = None
    # an "activation" (a value from an earlier pipeline stage): whether the model's graph
    # computes it from trained parameters, so that its gradient goes back to that stage; a
    # "parameter": whether the model trains it (``requires_grad``: a frozen one, such as
    # Whisper's positional table, has no gradient and no optimizer state)
    carries_grad: bool = True
    full_precision: bool = False
    # an op output computed from no user input and no parameter (a rotary table, position ids,
    # a mask made from shapes): the same for every sample, so it crosses a pipeline stage
    # boundary whole (sharded, the next stage would gather it wherever batch shards read it)
    batch_free: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", NodeKind(self.kind))  # a bad kind fails here, named


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A graph module whose Python code is generated only when it is read or the module is
    called (torch's own ``_LazyGraphModule``): the planner makes hundreds of graphs it only
    inspects (layers, stages, graphs written from a trace), and generating and compiling the
    code of each took seconds in a real-size model's search."""
    return _LazyGraphModule(root, graph)


@dataclass
class TracedGraph:
    """The traced model. ``graph_module`` computes ``(loss, *model_outputs)`` from
    ``(*params_and_buffers, *user_inputs)`` as torch.export lifts them; ``nodes`` is in graph
    order and keyed by fx node name. ``graph_hash`` identifies the graph (ops, shapes, dtypes)
    so that a plan can be tied to it."""

    graph_module: torch.fx.GraphModule
    nodes: dict[str, NodeInfo]
    graph_hash: str
    input_names: list[str]  # placeholder names of the user inputs, in order
    param_names: dict[str, str] = field(default_factory=dict)  # placeholder name -> FQN (params and buffers)
    exported: Any = None  # the torch.export.ExportedProgram, when kept
    # Tied parameters: one tensor under several FQNs (GPT-2's lm_head.weight and
    # transformer.wte.weight). Export keeps a placeholder per FQN but every use reads one of them;
    # this maps each other FQN (whose placeholder has no users) to the FQN the graph reads.
    # Count such a tensor once, and keep it one parameter after distribution.
    tied: dict[str, str] = field(default_factory=dict)
    # how many leading outputs must end replicated (the loss); None: a pipeline stage's graph,
    # which hands every output on to the next stage
    materialized_outputs: int | None = 1
    # a pipeline stage's graph: the values it receives or hands on whole, because on their way
    # from the stage computing them to the last reading them they pass a stage on another
    # logical mesh; the others cross as :func:`autoplan.sharding.boundary_spec` lays them out
    whole_values: frozenset[str] = frozenset()

    def fx_node(self, name: str) -> torch.fx.Node:
        return self.fx_nodes[name]

    def same_as(self, other: TracedGraph) -> bool:
        """Whether ``other`` is this graph: the same hash (ops, wiring, shapes, dtypes), nodes by
        name in order, parameters by name and which of them are trained, so that a plan made on
        one is the plan of the other (a graph written from a trace of the first blocks against
        the whole model's trace)."""
        return (self.graph_hash == other.graph_hash and list(self.nodes) == list(other.nodes)
                and self.param_names == other.param_names and self.input_names == other.input_names
                and self._frozen_parameters == other._frozen_parameters)

    @functools.cached_property
    def _frozen_parameters(self) -> frozenset[str]:
        return frozenset(name for name, info in self.nodes.items()
                         if info.kind == "parameter" and not info.carries_grad)

    @functools.cached_property
    def fx_nodes(self) -> dict[str, torch.fx.Node]:
        """The fx nodes by name, in graph order (a traced graph is not changed once made)."""
        return {node.name: node for node in self.graph_module.graph.nodes}

    @functools.cached_property
    def node_order(self) -> dict[str, int]:
        """Each node's position in the graph, by name."""
        return {name: i for i, name in enumerate(self.fx_nodes)}

    @functools.cached_property
    def parameter_fqns(self) -> frozenset[str]:
        """The model's parameters (not its buffers), by FQN, each name of a tied one included."""
        return frozenset(fqn for name, fqn in self.param_names.items()
                         if name in self.nodes and self.nodes[name].kind == NodeKind.PARAMETER)

    @functools.cached_property
    def trained_values(self) -> frozenset[str]:
        """The nodes whose value depends on a floating parameter the model trains (their
        gradient is computed): such parameters, and the op nodes and activations computed from
        them."""
        found: set[str] = set()
        for node in self.graph_module.graph.nodes:
            info = self.nodes.get(node.name)
            if info is None:
                continue
            if info.kind == "parameter" and "float" in info.dtype and info.carries_grad:
                found.add(node.name)
            elif info.kind in ("op", "activation") and any(i.name in found for i in node.all_input_nodes):
                found.add(node.name)
        return frozenset(found)

    @functools.cached_property
    def input_free_values(self) -> frozenset[str]:
        """The nodes into which no user input flows (computed from parameters, buffers and
        constants alone, as a learned position table's rows for positions ``0..T-1``): the same
        on every rank of a data-parallel program."""
        batched = set(self.input_names)
        same = set()
        for node in self.graph_module.graph.nodes:
            if node.name in batched:
                continue
            if any(arg.name in batched for arg in node.all_input_nodes):
                batched.add(node.name)
            else:
                same.add(node.name)
        return frozenset(same)

    @property
    def total_flops(self) -> float:
        return sum(n.flops for n in self.nodes.values())
