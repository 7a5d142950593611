"""Activation checkpointing decisions: which layers may be recomputed in the backward, and the
regions the cost model and the program read from a choice of layers.

A layer is recomputed as one region: the program runs its op nodes under non-reentrant
``torch.utils.checkpoint``, which keeps the values the region reads and runs its forward again
in the backward. A layer that writes into a tensor (``aten.add_`` on BatchNorm's
``num_batches_tracked``, ``copy_`` into a running mean) is never recomputed: the second forward
would write it twice.

A layer is recomputed in one of two modes (:class:`RecomputeMode`): ``full`` keeps only the
values the region reads; ``selective`` also keeps the outputs of its matrix products and
attention (:data:`SELECTIVE_SAVED_OPS`, torch's selective activation checkpointing with a
policy that must save them), so the backward recomputes only the cheap ops between them
(norms, activations, element-wise products, rotary embeddings): less time than ``full``, less
memory freed. The cost model reads the kept nodes from :func:`saved_outputs`: they keep their
outputs and are not computed again; the resharding of their inputs is (the redistributions
inside the region are not saved, and run again).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from autoplan.plan_schema import SELECTIVE_SAVED_OPS, RecomputedLayer, RecomputeMode
from autoplan.planner.mesh_plan import writes_first_input
from autoplan.strategies.letters import op_name
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer


class RecomputePolicy(StrEnum):
    """Which layers are recomputed in the backward: those the planner picks where memory needs
    it, fully or selectively (``auto``), every layer that may be (``all``: fully;
    ``selective``: selectively), or none."""

    AUTO = "auto"
    ALL = "all"
    SELECTIVE = "selective"
    NONE = "none"


def every_layer(policy: RecomputePolicy | str) -> bool:
    """Whether ``policy`` recomputes every layer that may be (fully or selectively)."""
    return policy in (RecomputePolicy.ALL, RecomputePolicy.SELECTIVE)


def policy_mode(policy: RecomputePolicy | str) -> RecomputeMode:
    """The mode in which a policy that recomputes every layer recomputes them."""
    return RecomputeMode.SELECTIVE if policy == RecomputePolicy.SELECTIVE else RecomputeMode.FULL


def recomputable(graph: TracedGraph, layers: list[Layer]) -> frozenset[int]:
    """The indices of the ``layers`` that may be recomputed: none of their ops writes into a tensor."""
    fx_nodes = graph.fx_nodes
    return frozenset(i for i, layer in enumerate(layers)
                     if not any(writes_first_input(fx_nodes[name]) for name in layer.nodes if name in fx_nodes))


def regions(layers: Iterable[Layer]) -> dict[str, str]:
    """Op node -> the name of the recomputed layer holding it (the cost model's
    :attr:`~autoplan.cost_models.step_costs.CostContext.recompute_regions`)."""
    return {name: layer.name for layer in layers for name in layer.nodes}


def saved_outputs(graph: TracedGraph, layers: Iterable[Layer]) -> frozenset[str]:
    """The op nodes of selectively recomputed ``layers`` whose outputs are kept (the cost
    model's :attr:`~autoplan.cost_models.step_costs.CostContext.recompute_saved`)."""
    fx_nodes = graph.fx_nodes
    return frozenset(name for layer in layers for name in layer.nodes
                     if name in fx_nodes and fx_nodes[name].op == "call_function"
                     and op_name(fx_nodes[name]) in SELECTIVE_SAVED_OPS)


def recomputed_layers(layers: Iterable[Layer], selective: Iterable[Layer] = ()) -> list[RecomputedLayer]:
    """The plan's record of recomputed layers: ``layers``, those also in ``selective``
    selectively, the others fully."""
    lightly = {layer.name for layer in selective}
    return [RecomputedLayer(layer.name, list(layer.nodes),
                            (RecomputeMode.SELECTIVE if layer.name in lightly else RecomputeMode.FULL).value)
            for layer in layers]
