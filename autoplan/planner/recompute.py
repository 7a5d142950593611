"""Activation checkpointing decisions: which layers may be recomputed in the backward, and the
regions the cost model and the program read from a choice of layers.

A layer is recomputed as one region: the program runs its op nodes under non-reentrant
``torch.utils.checkpoint``, which keeps the values the region reads and runs its forward again
in the backward. A layer that writes into a tensor (``aten.add_`` on BatchNorm's
``num_batches_tracked``, ``copy_`` into a running mean) is never recomputed: the second forward
would write it twice.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from autoplan.plan_schema import RecomputedLayer
from autoplan.planner.mesh_plan import writes_first_input
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer


class RecomputePolicy(StrEnum):
    """Which layers are recomputed in the backward: those the planner picks where memory needs
    it (``auto``), every layer that may be (``all``), or none."""

    AUTO = "auto"
    ALL = "all"
    NONE = "none"


def recomputable(graph: TracedGraph, layers: list[Layer]) -> frozenset[int]:
    """The indices of the ``layers`` that may be recomputed: none of their ops writes into a tensor."""
    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    return frozenset(i for i, layer in enumerate(layers)
                     if not any(writes_first_input(fx_nodes[name]) for name in layer.nodes if name in fx_nodes))


def regions(layers: Iterable[Layer]) -> dict[str, str]:
    """Op node -> the name of the recomputed layer holding it (the cost model's
    :attr:`~autoplan.cost_models.step_costs.CostContext.recompute_regions`)."""
    return {name: layer.name for layer in layers for name in layer.nodes}


def recomputed_layers(layers: Iterable[Layer]) -> list[RecomputedLayer]:
    """The plan's record of recomputed layers."""
    return [RecomputedLayer(layer.name, list(layer.nodes)) for layer in layers]
