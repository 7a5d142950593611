"""Cut a traced graph into layers: the units the pipeline DP assigns to stages.

Where the model repeats a block (a transformer's ``h.0`` … ``h.47``), each block is a layer;
what comes before the first block joins the first layer, what follows the last block joins the
last. Otherwise a clustering DP (Alpa's layer construction) cuts the op nodes, in graph order,
into ``L`` contiguous groups that balance FLOPs, preferring cuts where few bytes cross.
``num_layers`` merges blocks (or sets ``L``) to a given count.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

from autoplan.errors import AutoplanError
from autoplan.trace.graph import TracedGraph
from autoplan.trace.repeated import NodeClasses, block_of


@dataclass(frozen=True)
class Layer:
    """A contiguous run of op nodes. ``signature`` is equal for layers whose ops and shapes are
    equal, so that their costs are computed once."""

    name: str
    nodes: tuple[str, ...]
    signature: str
    flops: float


def _signature(graph: TracedGraph, nodes: list[str]) -> str:
    h = hashlib.sha256()
    for name in nodes:
        info = graph.nodes[name]
        h.update(f"{info.target}|{info.shape}|{info.dtype};".encode())
    return h.hexdigest()[:16]


def _make(graph: TracedGraph, groups: list[list[str]], names: list[str]) -> list[Layer]:
    return [Layer(name, tuple(g), _signature(graph, g), sum(graph.nodes[n].flops for n in g))
            for name, g in zip(names, groups)]


def _block_layers(graph: TracedGraph, classes: NodeClasses) -> tuple[list[list[str]], list[str]] | None:
    blocks = list(classes.blocks)
    if len(blocks) < 2:
        return None
    index = {b: i for i, b in enumerate(blocks)}
    groups: list[list[str]] = [[] for _ in blocks]
    current = 0
    for name, info in graph.nodes.items():
        if info.kind != "op":
            continue
        key = block_of(info.module)
        if key is not None:
            label = f"{key[0]}.{key[1]}" if key[0] else str(key[1])
            current = max(current, index.get(label, current))
        groups[current].append(name)  # graph order is topological: never move back
    kept = [i for i, group in enumerate(groups) if group]  # a block whose ops ran inside another's
    return [groups[i] for i in kept], [blocks[i] for i in kept]


def _merge(groups: list[list[str]], names: list[str], count: int) -> tuple[list[list[str]], list[str]]:
    """Merge consecutive groups into ``count`` groups of near-equal length."""
    bounds = [round(i * len(groups) / count) for i in range(count + 1)]
    merged = [[n for g in groups[a:b] for n in g] for a, b in zip(bounds, bounds[1:])]
    labels = [names[a] if b - a == 1 else f"{names[a]}..{names[b - 1]}" for a, b in zip(bounds, bounds[1:])]
    return merged, labels


def _crossing_bytes(graph: TracedGraph, ops: list[str]) -> list[float]:
    """bytes[i]: bytes of the values produced at or before ops[i] and used after it."""
    position = {name: i for i, name in enumerate(ops)}
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    delta = [0.0] * (len(ops) + 1)
    for i, name in enumerate(ops):
        last = max((position.get(u.name, len(ops)) for u in fx_nodes[name].users), default=i)
        info = graph.nodes[name]
        size = math.prod(info.shape or ()) * info.itemsize if info.shape is not None else 0
        delta[i] += size
        delta[min(last, len(ops))] -= size
    out, running = [], 0.0
    for i in range(len(ops)):
        running += delta[i]
        out.append(running)
    return out


def cluster_layers(graph: TracedGraph, num_layers: int, cut_weight: float = 1e-3) -> list[Layer]:
    """Alpa-style clustering: cut the op nodes into ``num_layers`` contiguous groups minimising
    the largest group's FLOPs plus ``cut_weight`` × bytes crossing each cut (a DP over cuts)."""
    ops = [n for n, info in graph.nodes.items() if info.kind == "op"]
    if num_layers < 1 or num_layers > len(ops):
        raise AutoplanError(f"cannot cut {len(ops)} ops into {num_layers} layers: choose --layers between 1 and "
                            f"{len(ops)}")
    prefix = [0.0]
    for name in ops:
        prefix.append(prefix[-1] + graph.nodes[name].flops)
    crossing = _crossing_bytes(graph, ops)
    total = prefix[-1] or 1.0
    n = len(ops)
    # best[k][j]: (max group cost, cut penalty) splitting ops[:j] into k groups
    inf = (math.inf, math.inf)
    best = [[inf] * (n + 1) for _ in range(num_layers + 1)]
    back = [[0] * (n + 1) for _ in range(num_layers + 1)]
    best[0][0] = (0.0, 0.0)
    for k in range(1, num_layers + 1):
        for j in range(k, n - (num_layers - k) + 1):
            for i in range(k - 1, j):
                prev = best[k - 1][i]
                if prev[0] == math.inf:
                    continue
                group = (prefix[j] - prefix[i]) / total
                penalty = prev[1] + (cut_weight * crossing[j - 1] / 1e6 if j < n else 0.0)
                cand = (max(prev[0], group), penalty)
                if cand[0] + cand[1] < best[k][j][0] + best[k][j][1]:
                    best[k][j], back[k][j] = cand, i
    cuts, j = [], n
    for k in range(num_layers, 0, -1):
        cuts.append(j)
        j = back[k][j]
    cuts = [0] + cuts[::-1]
    groups = [ops[a:b] for a, b in zip(cuts, cuts[1:])]
    return _make(graph, groups, [f"layer{i}" for i in range(len(groups))])


def make_layers(graph: TracedGraph, classes: NodeClasses, num_layers: int | None = None) -> list[Layer]:
    """Layers at repeated-block boundaries where the model has them, else by clustering;
    ``num_layers`` pins how many."""
    found = _block_layers(graph, classes)
    if found is not None:
        groups, names = found
        if num_layers is not None:
            if not 1 <= num_layers <= len(groups):
                raise AutoplanError(f"--layers {num_layers}: the model has {len(groups)} blocks; choose 1 to "
                                    f"{len(groups)}")
            groups, names = _merge(groups, names, num_layers)
        return _make(graph, groups, names)
    ops_with_work = sum(1 for info in graph.nodes.values() if info.kind == "op" and info.flops > 0)
    return cluster_layers(graph, num_layers or max(1, min(8, ops_with_work)))
