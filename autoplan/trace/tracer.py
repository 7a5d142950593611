"""Tracing a model into an ATen-level torch.fx graph whose nodes know their shapes and costs.

``trace(spec)`` exports ``loss_fn(module(*inputs), *inputs)`` (:mod:`autoplan.trace.export`):
torch.export's training IR is ATen-level but keeps composite ops such as ``aten.linear``,
``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` — the level at which sharding
strategies are written — so no decompositions are run. Export fakifies weights (and works on
``torch.device("meta")`` models), so tracing never allocates or copies them.

Every node then gets a :class:`NodeInfo`: shape and dtype (:mod:`values`), FLOPs and bytes
(:mod:`node_costs`), module and parameters read (:mod:`naming`); the graph gets a hash
(:mod:`graph_hash`).
"""

from __future__ import annotations

import dataclasses

import torch.export
import torch.fx

from autoplan.load import ModelSpec
from autoplan.trace.export import WRAPPER_PREFIX, export_model, tidy_graph
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.trace.graph_hash import graph_hash
from autoplan.trace.naming import (PlaceholderNames, module_of_op, owner_module, placeholder_names, target_name,
    tied_parameters)
from autoplan.trace.node_costs import node_bytes, node_flops
from autoplan.trace.values import dtype_name, first_tensor, int_shape, tensor_leaves
from autoplan.trace.wrapped_regions import autocast_region

__all__ = ["WRAPPER_PREFIX", "describe", "tensor_leaves", "trace"]


def trace(spec: ModelSpec) -> TracedGraph:
    """The ATen-level graph of ``loss_fn(module(*inputs), *inputs)`` and the model's outputs,
    with a :class:`NodeInfo` per node. Works on meta-device models and on real ones (their
    weights are fakified, never copied)."""
    exported = export_model(spec)
    gm = exported.graph_module
    tidy_graph(gm)
    return describe(gm, exported, spec.module)


def describe(gm: torch.fx.GraphModule, exported: torch.export.ExportedProgram, root: torch.nn.Module
             ) -> TracedGraph:
    """The TracedGraph of ``gm``, a tidied graph of ``root`` exported as ``exported`` (or one
    written like it: :mod:`autoplan.trace.rescale`)."""
    names = placeholder_names(exported.graph_signature)
    nodes = {node.name: _node_info(node, names, root) for node in gm.graph.nodes}
    for name in batch_free_values(gm, nodes):
        nodes[name] = dataclasses.replace(nodes[name], batch_free=True)
    return TracedGraph(
        graph_module=gm,
        nodes=nodes,
        graph_hash=graph_hash(gm.graph, nodes),
        input_names=names.inputs,
        param_names=names.fqn,
        exported=exported,
        tied=tied_parameters(gm, names.fqn, root),
    )


def batch_free_values(gm: torch.fx.GraphModule, nodes: dict[str, NodeInfo]) -> list[str]:
    """The op outputs of ``gm`` that no user input and no parameter flows into, transitively
    (computed from buffers, constants and shapes alone: Hugging Face's rotary ``cos``/``sin``
    from ``inv_freq`` and an ``arange`` of positions), and whose dim 0 is not the batch's (a
    mask expanded to the batch has it, and splits with the batch). None where the batch is
    of one sample, or unknown: every value's dim 0 may then be the batch's."""
    sizes = [nodes[n.name].shape[0] for n in gm.graph.nodes
             if nodes[n.name].kind == "input" and nodes[n.name].shape]
    if not sizes or sizes[0] < 2:
        return []
    batch = sizes[0]
    fed: set[str] = set()  # what a user input or a parameter flows into
    free: list[str] = []
    for node in gm.graph.nodes:
        info = nodes[node.name]
        if info.kind in ("input", "parameter") or any(i.name in fed for i in node.all_input_nodes):
            fed.add(node.name)
        elif info.kind == "op" and info.shape is not None and not (info.shape and info.shape[0] % batch == 0):
            free.append(node.name)
    return free


def _node_info(node: torch.fx.Node, names: PlaceholderNames, root: torch.nn.Module) -> NodeInfo:
    first = first_tensor(node.meta.get("val"))
    fqn = None
    params: tuple[str, ...] = ()
    flops = 0.0
    if node.op == "placeholder":
        kind = names.kind.get(node.name, "input")
        fqn = names.fqn.get(node.name)
        module, module_type = owner_module(root, fqn) if fqn is not None else ("", "")
    elif node.op == "output":
        kind, module, module_type = "output", "", ""
    elif node.op == "get_attr":  # a sub-graph of a higher-order op that stayed wrapped
        kind, module, module_type = "constant", "", ""
    else:
        kind = "op"
        module, module_type = module_of_op(node, type(root).__name__)
        if node.op == "call_function":
            flops = node_flops(node)
        read = (names.fqn.get(inp.name) for inp in node.all_input_nodes)
        params = tuple(dict.fromkeys(name for name in read if name is not None))
    return NodeInfo(
        name=node.name,
        kind=kind,
        target=target_name(node),
        shape=int_shape(first) if first is not None else None,
        dtype=dtype_name(first.dtype) if first is not None else "",
        itemsize=first.element_size() if first is not None else 0,
        flops=flops,
        bytes=node_bytes(node),
        module=module,
        module_type=module_type,
        params=params,
        fqn=fqn,
        carries_grad=kind != "parameter" or fqn is None or _trained(root, fqn),
        full_precision=_autocast_off(node),
    )


def _trained(root: torch.nn.Module, fqn: str) -> bool:
    """Whether the model trains its parameter ``fqn`` (read from the module, so that a graph
    written from a trace of the first blocks says so of every block's)."""
    try:
        return root.get_parameter(fqn).requires_grad
    except AttributeError:  # not a parameter of the module as named: taken as trained
        return True


def _autocast_off(node: torch.fx.Node) -> bool:
    """Whether the model computes ``node`` with autocast off (its own fp32 region)."""
    region = autocast_region(node)
    return region is not None and not region.enabled
