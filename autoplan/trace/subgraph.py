"""Cut a contiguous run of op nodes out of a traced graph, as a graph of its own.

A pipeline stage is such a run: the values it reads from earlier stages become placeholders
of kind ``"activation"`` (user inputs too, in every stage but the first, which hands them
on; parameters it reads keep their kind and FQN), and every value it produces that a later
stage needs, and the loss, becomes an output, which leaves as it crosses to the next stage
(:func:`autoplan.sharding.boundary_spec`). The model's other outputs are not outputs of a
stage: a pipelined step returns only the loss.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace

import torch
from torch import fx

from autoplan.trace.graph import NodeInfo, TracedGraph, lazy_graph_module


def boundary_values(graph: TracedGraph, node_names: list[str]) -> tuple[list[str], list[str]]:
    """(values the run reads from outside, values it produces that are used outside), by name,
    in graph order. Parameters, buffers and user inputs count as values read from outside."""
    inside = set(node_names)
    fx_nodes = graph.fx_nodes
    reads: list[str] = []
    for name in node_names:
        for inp in fx_nodes[name].all_input_nodes:
            if inp.name not in inside and inp.name not in reads:
                reads.append(inp.name)
    reads.sort(key=graph.node_order.__getitem__)
    loss = loss_name(graph)
    produced = [name for name in node_names
                if any(user.name not in inside and (user.op != "output" or name == loss) for user in fx_nodes[name].users)]
    return reads, produced


def loss_name(graph: TracedGraph) -> str | None:
    """The loss's node name: the graph's first output. A pipeline returns only the loss, so no
    other output of the model leaves its stage."""
    output = next(n for n in graph.graph_module.graph.nodes if n.op == "output")
    outs = output.args[0]
    first = outs[0] if isinstance(outs, (tuple, list)) else outs
    return first.name if isinstance(first, fx.Node) else None


def model_outputs(graph: TracedGraph) -> list[str]:
    """The graph's outputs other than the loss (its first), by node name: what the program
    returns beside the loss."""
    output = graph.graph_module.graph.output_node()
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return [v.name for v in values[1:] if isinstance(v, fx.Node)]


def _received_kinds(graph: TracedGraph, node_names: list[str]) -> tuple[str, ...]:
    """The kinds of value a run receives from the stage before it: the values of ops, and,
    unless the run is the first (no op of the graph comes before it), the user inputs too: the
    first stage takes them from the batch and hands on those later stages read."""
    order = graph.node_order
    start = order[node_names[0]] if node_names else 0
    first = not any(info.kind == "op" and order.get(name, start) < start for name, info in graph.nodes.items())
    return ("op",) if first else ("op", "input")


def extract(graph: TracedGraph, node_names: list[str]) -> TracedGraph:
    """The run ``node_names`` (op nodes, graph order) as a :class:`TracedGraph`."""
    reads, produced = boundary_values(graph, node_names)
    fx_nodes = graph.fx_nodes
    trained = graph.trained_values
    received = _received_kinds(graph, node_names)
    new = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    infos: dict[str, NodeInfo] = {}
    for name in reads:
        old = fx_nodes[name]
        node = new.placeholder(name)
        node.meta = dict(old.meta)
        env[old] = node
        info = graph.nodes[name]
        if info.kind in received:
            info = replace(info, kind="activation", target="placeholder", flops=0.0, params=(),
                           carries_grad=name in trained)
        infos[node.name] = info
    for name in node_names:
        old = fx_nodes[name]
        node = new.node_copy(old, lambda n: env[n])
        env[old] = node
        infos[node.name] = graph.nodes[name]
    outputs = [env[fx_nodes[name]] for name in produced]
    out = new.output(tuple(outputs))
    infos[out.name] = NodeInfo(out.name, "output", "output", None, "", 0, 0.0, 0.0, "", "", ())
    module = lazy_graph_module(torch.nn.Module(), new)
    digest = hashlib.sha256((graph.graph_hash + "|" + ",".join(node_names)).encode()).hexdigest()[:16]
    inputs = [n for n in reads if graph.nodes[n].kind in ("input", "op")]
    params = {n: fqn for n, fqn in graph.param_names.items() if n in reads}
    return TracedGraph(module, infos, digest, inputs, params, None, dict(graph.tied), materialized_outputs=None)
