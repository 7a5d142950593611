"""Activation checkpointing decisions: which layers may be recomputed in the backward, and the
regions the cost model and the program read from a choice of layers.

A layer is recomputed as one region: the program runs its op nodes under non-reentrant
``torch.utils.checkpoint``, which keeps the values the region reads and runs its forward again
in the backward. A layer that writes into a tensor (``aten.add_`` on BatchNorm's
``num_batches_tracked``, ``copy_`` into a running mean) is never recomputed: the second forward
would write it twice.

A layer is recomputed in one of three modes (:class:`RecomputeMode`): ``full`` keeps only the
values the region reads; ``selective`` also keeps the outputs of its matrix products and
attention (:data:`SELECTIVE_SAVED_OPS`, torch's selective activation checkpointing with a
policy that must save them), so the backward recomputes only the cheap ops between them
(norms, activations, element-wise products, rotary embeddings): less time than ``full``, less
memory freed; ``op``, torchtitan's per-op policy, keeps the attention's outputs and every
other matrix product's (:func:`~autoplan.plan_schema.kept_outputs`), between the two. Under
``auto`` the stage search chooses, layer by layer, between ``full`` and ``selective``, and the
exact plans also try each close candidate with its recomputed layers in ``op``
(:func:`~autoplan.planner.pipeline._per_op_rivals`); ``op`` for every layer that may be
recomputed is asked for with ``recompute="op"`` (``--manual ac=op``). The cost
model reads the kept nodes from :func:`saved_outputs`: they keep their outputs and are not
computed again; the resharding of their inputs is (the redistributions inside the region are
not saved, and run again).
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from autoplan.plan_schema import RecomputedLayer, RecomputeMode, kept_outputs
from autoplan.planner.mesh_plan import writes_first_input
from autoplan.strategies.letters import op_name
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer


class RecomputePolicy(StrEnum):
    """Which layers are recomputed in the backward: those the planner picks where memory needs
    it, fully, selectively or by the per-op policy (``auto``), every layer that may be (``all``:
    fully; ``selective``: selectively; ``op``: by torchtitan's per-op policy), or none."""

    AUTO = "auto"
    ALL = "all"
    SELECTIVE = "selective"
    PER_OP = "op"
    NONE = "none"


def every_layer(policy: RecomputePolicy | str) -> bool:
    """Whether ``policy`` recomputes every layer that may be (in any mode)."""
    return policy in (RecomputePolicy.ALL, RecomputePolicy.SELECTIVE, RecomputePolicy.PER_OP)


def policy_mode(policy: RecomputePolicy | str) -> RecomputeMode:
    """The mode in which a policy that recomputes every layer recomputes them."""
    return {RecomputePolicy.SELECTIVE: RecomputeMode.SELECTIVE,
            RecomputePolicy.PER_OP: RecomputeMode.PER_OP}.get(RecomputePolicy(policy), RecomputeMode.FULL)


def lighter_mode(policy: RecomputePolicy | str) -> RecomputeMode:
    """The mode of the layers a plan under ``policy`` recomputes keeping some outputs (its
    "selective" layers): ``op`` under the per-op policy, else ``selective``."""
    return RecomputeMode.PER_OP if policy == RecomputePolicy.PER_OP else RecomputeMode.SELECTIVE


def recomputable(graph: TracedGraph, layers: list[Layer]) -> frozenset[int]:
    """The indices of the ``layers`` that may be recomputed: none of their ops writes into a tensor."""
    fx_nodes = graph.fx_nodes
    return frozenset(i for i, layer in enumerate(layers)
                     if not any(writes_first_input(fx_nodes[name]) for name in layer.nodes if name in fx_nodes))


def regions(layers: Iterable[Layer]) -> dict[str, str]:
    """Op node -> the name of the recomputed layer holding it (the cost model's
    :attr:`~autoplan.cost_models.step_costs.CostContext.recompute_regions`)."""
    return {name: layer.name for layer in layers for name in layer.nodes}


def saved_outputs(graph: TracedGraph, layers: Iterable[Layer], mode: RecomputeMode = RecomputeMode.SELECTIVE
                  ) -> frozenset[str]:
    """The op nodes of ``layers``, recomputed in ``mode``, whose outputs are kept (the cost
    model's :attr:`~autoplan.cost_models.step_costs.CostContext.recompute_saved`)."""
    if mode == RecomputeMode.FULL:
        return frozenset()
    return frozenset().union(*(kept_outputs(layer_ops(graph, layer.nodes), mode) for layer in layers))


def layer_ops(graph: TracedGraph, names: Iterable[str]) -> list[tuple[str, str]]:
    """``(node name, ATen overload-packet name)`` of the call nodes among ``names``, in their order."""
    fx_nodes = graph.fx_nodes
    return [(name, op_name(fx_nodes[name])) for name in names
            if name in fx_nodes and fx_nodes[name].op == "call_function"]


def recomputed_layers(layers: Iterable[Layer], selective: Iterable[Layer] = (),
                      lighter: RecomputeMode = RecomputeMode.SELECTIVE) -> list[RecomputedLayer]:
    """The plan's record of recomputed layers: ``layers``, those also in ``selective`` in the
    ``lighter`` mode, the others fully."""
    lightly = {layer.name for layer in selective}
    return [RecomputedLayer(layer.name, list(layer.nodes),
                            (lighter if layer.name in lightly else RecomputeMode.FULL).value)
            for layer in layers]
