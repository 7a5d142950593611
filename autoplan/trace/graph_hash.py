"""A short hash that identifies a traced graph (ops, wiring, constants, parameter names,
shapes, dtypes), so that a plan can be tied to the graph it was made for."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.fx

from autoplan.trace.graph import NodeInfo

__all__ = ["graph_hash"]

aten = torch.ops.aten


def _encode(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    """An argument as plain data: nodes by their position, devices erased."""
    if isinstance(value, torch.fx.Node):
        return ("%", index[value])
    if isinstance(value, (tuple, list)):
        return tuple(_encode(v, index) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _encode(v, index)) for k, v in value.items()))
    if isinstance(value, torch.device):
        return "device"  # a plan made on the meta device applies to the real model
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, bool, str)) or value is None:
        return value
    if isinstance(value, slice):
        return ("slice", _encode(value.start, index), _encode(value.stop, index), _encode(value.step, index))
    return type(value).__name__


def graph_hash(graph: torch.fx.Graph, infos: dict[str, NodeInfo]) -> str:
    """16 hex digits of a SHA-256 over every node's op, target, kind, FQN, encoded arguments,
    shape and dtype, in graph order."""
    h = hashlib.sha256()
    index: dict[torch.fx.Node, int] = {}
    counted = 0
    for node in graph.nodes:
        if node.target is aten.contiguous.default and len(node.args) == 1 and not node.kwargs:
            # whether export records a .contiguous() depends on the strides the device's kernels
            # produce (meta and CPU differ after attention): hash it as its input
            index[node] = index[node.args[0]]
            continue
        index[node] = counted
        counted += 1
        info = infos[node.name]
        record = (
            node.op,
            info.target,
            str(info.kind),
            info.fqn,
            _encode(node.args, index),
            _encode(node.kwargs, index),
            info.shape,
            info.dtype,
        )
        h.update(repr(record).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]
