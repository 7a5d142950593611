"""Ops that couple the samples of a batch, and what splitting the batch does to them.

Most ops treat each sample alone, so a batch cut into pieces (across devices, or into pipeline
microbatches) gives the single-device result. Two kinds do not:

- **batch statistics**: BatchNorm in training normalises with the mean and variance of the
  whole batch. A microbatch would normalise with its own. (Across devices the sharding rule
  keeps BatchNorm's batch dim whole, so data parallelism gathers the batch before it.)
- **target counts**: a mean cross-entropy / NLL loss divides by the number of targets that
  are not ``ignore_index``, which depends on the data. The mean over the batch is
  ``Σᵢ Sᵢ / Σᵢ cᵢ`` over microbatches ``i`` (``Sᵢ`` the sum of the per-target losses, ``cᵢ`` the
  count), not the mean of the microbatches' means ``Σᵢ (Sᵢ / cᵢ) / M``. When the loss is that
  mean itself (up to a constant factor) and its targets are computed from the user's inputs
  alone, the program weighs microbatch ``i``'s mean by ``cᵢ / Σⱼ cⱼ``, counted on the inputs
  before the schedule runs (:func:`count_program`), which is exact. Otherwise the batch is
  not split into microbatches.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch
from torch import fx

from autoplan.errors import AutoplanError
from autoplan.plan_schema import BatchCouplingPlan, CouplingHandling
from autoplan.trace.graph import NodeKind, TracedGraph

__all__ = ["BatchCoupling", "CouplingKind", "batch_couplings", "count_program", "coupling_plans",
           "microbatch_split_refusal"]

aten = torch.ops.aten

_BATCH_NORMS = frozenset("batch_norm native_batch_norm _native_batch_norm_legit _native_batch_norm_legit_functional "
                         "cudnn_batch_norm miopen_batch_norm".split())
_COUNTED_LOSSES = frozenset("cross_entropy_loss nll_loss nll_loss_nd nll_loss2d".split())
_MEAN = 1  # ATen's Reduction::Mean
# ops between a loss and the graph's output that scale it by a constant at most
_SCALING = frozenset("mul div to _to_copy clone view reshape alias squeeze unsqueeze".split())


class CouplingKind(StrEnum):
    BATCH_STATISTICS = "batch statistics"
    TARGET_COUNT = "target count"


@dataclass(frozen=True)
class BatchCoupling:
    """One op that couples the samples of a batch; ``weighable``: a target count the program
    can weigh microbatches by (see the module docstring)."""

    node: str
    op: str
    module: str
    kind: CouplingKind
    weighable: bool = False

    def describe(self) -> str:
        where = f" in {self.module}" if self.module else ""
        return f"{self.op}{where} ({self.kind})"


def _op(node: fx.Node) -> str:
    return getattr(node.target, "__name__", str(node.target)).split(".")[0]


def op_argument(node: fx.Node, name: str, default: object = None) -> object:
    """An argument of an ATen op by its schema name, positional or keyword."""
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return default
    for i, arg in enumerate(schema.arguments):
        if arg.name == name:
            if i < len(node.args):
                return node.args[i]
            return node.kwargs.get(name, arg.default_value if arg.has_default_value() else default)
    return default


def _is_counted_mean(node: fx.Node) -> bool:
    return _op(node) in _COUNTED_LOSSES and op_argument(node, "reduction", _MEAN) == _MEAN


def _scaled_root(loss: fx.Node) -> fx.Node:
    """The node the loss output is a constant multiple of (the loss itself when it is not)."""
    node = loss
    while node.op == "call_function" and _op(node) in _SCALING:
        tensors = [a for a in node.args if isinstance(a, fx.Node)]
        if len(tensors) != 1:
            break
        node = tensors[0]
    return node


def _loss_node(graph: TracedGraph) -> fx.Node:
    output = next(n for n in graph.graph_module.graph.nodes if n.op == "output")
    first = output.args[0][0] if isinstance(output.args[0], (tuple, list)) else output.args[0]
    return first


def _input_only_ancestors(graph: TracedGraph, roots: list[fx.Node]) -> list[fx.Node] | None:
    """The nodes ``roots`` are computed from, in graph order, when they read the user's inputs
    and constants only (no parameter, buffer or activation); else None."""
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "placeholder":
            if node.name not in graph.input_names:
                return None
            continue
        if node.op != "call_function":
            return None
        info = graph.nodes.get(node.name)
        if info is not None and info.kind in (NodeKind.PARAMETER, NodeKind.BUFFER):
            return None
        stack.extend(node.all_input_nodes)
    return [n for n in graph.graph_module.graph.nodes if n in seen]


def batch_couplings(graph: TracedGraph) -> list[BatchCoupling]:
    """The ops of ``graph`` that couple the samples of its batch, in graph order."""
    found: list[BatchCoupling] = []
    loss = _scaled_root(_loss_node(graph))
    for node in graph.graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        op = _op(node)
        module = graph.nodes[node.name].module if node.name in graph.nodes else ""
        if op in _BATCH_NORMS and op_argument(node, "training", True):
            found.append(BatchCoupling(node.name, op, module, CouplingKind.BATCH_STATISTICS))
        elif _is_counted_mean(node):
            weighable = (node is loss and op_argument(node, "weight") is None
                         and _input_only_ancestors(graph, [node.args[1]]) is not None)
            found.append(BatchCoupling(node.name, op, module, CouplingKind.TARGET_COUNT, weighable))
    return found


def microbatch_split_refusal(couplings: list[BatchCoupling]) -> str | None:
    """Why the batch may not be cut into microbatches (None when it may)."""
    blocking = [c for c in couplings if not c.weighable]
    if not blocking:
        return None
    first = blocking[0]
    why = ("normalises with the statistics of the whole batch" if first.kind == CouplingKind.BATCH_STATISTICS
           else "divides by a count of targets the program cannot weigh microbatches by")
    return f"{first.describe()} {why}"


def coupling_plans(graph: TracedGraph, microbatches: int) -> list[BatchCouplingPlan]:
    """What a plan of ``microbatches`` records about the batch couplings of ``graph``; a
    one-line error when that many microbatches would change what the model computes."""
    couplings = batch_couplings(graph)
    if microbatches > 1:
        refusal = microbatch_split_refusal(couplings)
        if refusal:
            raise AutoplanError(f"{microbatches} microbatches would change what the model computes: {refusal}; "
                                f"use one microbatch (--microbatches 1)")
    handling = CouplingHandling.WHOLE_BATCH if microbatches == 1 else CouplingHandling.WEIGHTED_MICROBATCHES
    return [BatchCouplingPlan(c.node, c.describe(), handling) for c in couplings]


def count_program(graph: TracedGraph, node_name: str) -> fx.GraphModule:
    """A GraphModule ``(*user_inputs) -> count``: how many targets of the counted loss
    ``node_name`` are not its ``ignore_index``, computed from the inputs alone."""
    loss = graph.fx_node(node_name)
    target = loss.args[1]
    ancestors = _input_only_ancestors(graph, [target])
    if ancestors is None:
        raise ValueError(f"the targets of {node_name} are not computed from the inputs alone")
    ignore_index = op_argument(loss, "ignore_index", -100)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = {n.name: n for n in graph.graph_module.graph.nodes if n.op == "placeholder"}
    for name in graph.input_names:
        env[placeholders[name]] = new.placeholder(name)
    for node in ancestors:
        if node not in env:
            env[node] = new.node_copy(node, lambda n: env[n])
            if env[node].kwargs.get("device") == torch.device("meta") \
                    and getattr(node.target, "overloadpacket", None) in (aten.to, aten._to_copy):
                # a model traced on the meta device moves the targets there (HF's
                # ``labels.to(logits.device)``): the count stays on the inputs' device
                env[node].kwargs = {k: v for k, v in env[node].kwargs.items() if k != "device"}
    kept = new.call_function(aten.ne.Scalar, (env[target], ignore_index))
    new.output(new.call_function(aten.sum.default, (kept,)))
    return fx.GraphModule(graph.graph_module, new)

