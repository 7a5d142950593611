"""Repeated layers: find the blocks of a model that repeat (a transformer's ``h.0``, ``h.1``, …)
and pair up their nodes, so that the intra-op ILP solves one block and shares the answer.

Nodes are put in *classes*: a node outside any repeated block is a class of its own; the
i-th node of every copy of a block whose op sequence and wiring match the first copy's
share a class. Every member of a class gets the same strategy.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from torch import fx

from autoplan.trace.graph import TracedGraph

_INDEX = re.compile(r"^\d+$")


@dataclass
class NodeClasses:
    """``members[c]`` are the node names of class ``c`` (the first is its representative);
    ``class_of`` inverts it. ``blocks`` names the blocks of every stack with repeated copies
    (``"h.0"``, …), in graph order, copies unlike the others included."""

    class_of: dict[str, int]
    members: list[list[str]]
    blocks: list[str]

    def representative(self, cls: int) -> str:
        return self.members[cls][0]

    @property
    def num_classes(self) -> int:
        return len(self.members)


def block_of(path: str) -> tuple[str, int] | None:
    """``("transformer.h", 3)`` for ``"transformer.h.3.attn.c_attn"``; ``None`` outside blocks."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if _INDEX.match(part):
            return ".".join(parts[:i]), int(part)
    return None


def node_block(graph: TracedGraph, name: str) -> tuple[str, int] | None:
    info = graph.nodes[name]
    if info.kind in ("parameter", "buffer") and info.fqn:
        return block_of(info.fqn.rsplit(".", 1)[0])
    if info.kind == "op":
        return block_of(info.module)
    return None


def _signatures(graph: TracedGraph, names: list[str], fx_nodes: dict[str, fx.Node]) -> list[tuple]:
    """Per node of a block: kind, target, shape, dtype, where its inputs come from (their
    position in the block, -1 outside it), which of them are frozen parameters (a block whose
    weights are trained and one whose weights are frozen are not copies) and its other
    arguments, with the nodes inside an argument (``cat``'s list of tensors) written as
    positions too, so that copies compare equal whatever the nodes are named."""
    position = {n: i for i, n in enumerate(names)}

    def where(node: fx.Node) -> int:
        return position.get(node.name, -1)

    sigs = []
    for name in names:
        info = graph.nodes[name]
        fx_node = fx_nodes[name]
        wiring = tuple(where(inp) for inp in fx_node.all_input_nodes)
        frozen = tuple(k for k, inp in enumerate(fx_node.all_input_nodes) if not graph.nodes[inp.name].carries_grad)
        consts = tuple(repr(fx.node.map_arg(a, where)) for a in fx_node.args if not isinstance(a, fx.Node))
        sigs.append((info.kind, info.target, info.shape, info.dtype, wiring, frozen, consts))
    return sigs


def find_classes(graph: TracedGraph) -> NodeClasses:
    """Group the graph's nodes into classes of corresponding nodes of repeated blocks."""
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    blocks: dict[tuple[str, int], list[str]] = {}
    for name in graph.nodes:
        key = node_block(graph, name)
        if key is not None:
            blocks.setdefault(key, []).append(name)

    by_prefix: dict[str, list[int]] = {}
    for prefix, index in blocks:
        by_prefix.setdefault(prefix, []).append(index)

    partner: dict[str, str] = {}  # node -> representative node of its class
    repeated: list[str] = []
    for prefix, indices in by_prefix.items():
        indices.sort()
        if len(indices) < 2:
            continue
        # copies with equal signatures share classes, whichever copy differs (a first block
        # that computes a shared position bias, a last one that normalises)
        alike: dict[tuple, list[int]] = {}
        for index in indices:
            alike.setdefault(tuple(_signatures(graph, blocks[(prefix, index)], fx_nodes)), []).append(index)
        groups = [group for group in alike.values() if len(group) > 1]
        for group in groups:
            reference = blocks[(prefix, group[0])]
            for index in group[1:]:
                partner.update(zip(blocks[(prefix, index)], reference))
        if groups:  # every copy is a block (a pipeline layer), the odd ones too
            repeated.extend(f"{prefix}.{i}" if prefix else str(i) for i in indices)

    # blocks in the order the graph runs them (two stacks may run in another order than the
    # order their parameters are declared in: CLIP's vision tower before its text tower)
    order = {name: i for i, name in enumerate(graph.nodes)}
    first_op = {f"{prefix}.{i}" if prefix else str(i): min((order[n] for n in names if graph.nodes[n].kind == "op"),
                                                            default=len(order))
                for (prefix, i), names in blocks.items()}
    repeated.sort(key=lambda block: first_op[block])

    class_of: dict[str, int] = {}
    members: list[list[str]] = []
    for name in graph.nodes:
        rep = partner.get(name)
        if rep is None:
            class_of[name] = len(members)
            members.append([name])
        else:
            cls = class_of[rep]
            class_of[name] = cls
            members[cls].append(name)
    return NodeClasses(class_of, members, repeated)


def split_classes(classes: NodeClasses, key: Callable[[str], Hashable]) -> NodeClasses:
    """``classes`` with each class cut into the members of equal ``key`` (first-seen order):
    members that are costed differently (a block recomputed in the backward and a copy that
    is not) must not share a strategy's cost."""
    members: list[list[str]] = []
    for group in classes.members:
        parts: dict[Hashable, list[str]] = {}
        for name in group:
            parts.setdefault(key(name), []).append(name)
        members.extend(parts.values())
    if len(members) == len(classes.members):
        return classes
    class_of = {name: c for c, group in enumerate(members) for name in group}
    return NodeClasses(class_of, members, list(classes.blocks))
