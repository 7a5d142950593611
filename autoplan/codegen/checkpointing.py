"""Run the layers a plan recomputes (:attr:`Plan.recompute`) under activation checkpointing.

A program that walks the traced graph node by node hands each node to
:meth:`CheckpointedRegions.value`. At a recomputed layer's first node the whole layer runs as
one function under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the
forward keeps only the values the layer reads from outside; the backward runs the whole layer
again (its redistributions, and so its collectives, included; no early stop) before its
gradients. The layer's
other nodes then take the values it produced; the values only the layer itself reads are not
kept at all. A layer recomputed selectively runs under torch's selective activation
checkpointing with a policy that must save the outputs of the plan's
:data:`~autoplan.plan_schema.SELECTIVE_SAVED_OPS` (matrix products, attention) and recomputes
everything else, its redistributions included. A layer recomputed by the per-op policy
(``op``) runs so too, its policy saving those outputs only while one of the layer's kept nodes
(:func:`~autoplan.plan_schema.kept_outputs`: its attention and every other matrix product, by
node, as the cost model reads them) runs. Where a native program checkpoints a whole module,
:class:`KeptModules` keeps the same outputs by marking the calls of the submodules that hold
them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autoplan.errors import AutoplanError
from autoplan.plan_schema import ATTENTION_OPS, SELECTIVE_SAVED_OPS, RecomputedLayer, RecomputeMode, kept_outputs
from autoplan.strategies.letters import op_name

NodeRunner = Callable[[torch.fx.Node, dict[torch.fx.Node, Any]], Any]


@dataclass(frozen=True)
class Region:
    """One recomputed layer: its nodes in graph order, the values it reads from outside and
    the values of its own that later nodes read."""

    layer: str
    nodes: tuple[torch.fx.Node, ...]
    inputs: tuple[torch.fx.Node, ...]
    outputs: tuple[torch.fx.Node, ...]
    selective: bool = False  # the outputs of SELECTIVE_SAVED_OPS kept, the rest recomputed
    # (per-op) only those of these nodes; None: of every node
    kept: frozenset[torch.fx.Node] | None = None


def _region(layer: RecomputedLayer, by_name: Mapping[str, torch.fx.Node], order: Mapping[torch.fx.Node, int]
            ) -> Region | None:
    nodes = sorted((by_name[name] for name in layer.nodes if name in by_name), key=order.__getitem__)
    if not nodes:
        return None
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    late = [a.name for a in inputs if order.get(a, -1) > order[nodes[0]]]  # unlisted: given before the walk
    if late:
        raise AutoplanError(f"layer {layer.layer} reads {late[0]}, which the graph computes inside it: "
                            f"the layer cannot be recomputed; plan again without recomputing it")
    outputs = tuple(n for n in nodes if any(u not in inside for u in n.users))
    kept = None
    if layer.mode == RecomputeMode.PER_OP:
        calls = [n for n in nodes if n.op == "call_function"]
        names = kept_outputs(((n.name, op_name(n)) for n in calls), RecomputeMode.PER_OP)
        kept = frozenset(n for n in calls if n.name in names)
    return Region(layer.layer, tuple(nodes), tuple(inputs), outputs, layer.mode != RecomputeMode.FULL, kept)


class CheckpointedRegions:
    """The recomputed layers among ``nodes`` and the values they produced that the walk has
    not reached yet."""

    def __init__(self, recomputed: Iterable[RecomputedLayer], nodes: Iterable[torch.fx.Node],
                 context: Callable[[], AbstractContextManager] = nullcontext) -> None:
        self.context = context
        listed = list(nodes)
        by_name = {n.name: n for n in listed}
        order = {n: i for i, n in enumerate(listed)}
        self.region_of: dict[torch.fx.Node, Region] = {}
        for layer in recomputed:
            region = _region(layer, by_name, order)
            if region is not None:
                self.region_of.update((n, region) for n in region.nodes)
        self._pending: dict[torch.fx.Node, Any] = {}

    def __contains__(self, node: torch.fx.Node) -> bool:
        return node in self.region_of

    def value(self, node: torch.fx.Node, env: Mapping[torch.fx.Node, Any], run_node: NodeRunner) -> Any:
        """``node``'s value: at its region's first node the region runs (``run_node(n, values)``
        runs one node on the values computed so far); ``None`` for a value only the region reads."""
        region = self.region_of[node]
        if node is region.nodes[0]:
            self._pending.update(run_checkpointed(region, [env[a] for a in region.inputs], run_node, self.context))
        return self._pending.pop(node, None)


def run_checkpointed(region: Region, inputs: list[Any], run_node: NodeRunner,
                     context: Callable[[], AbstractContextManager] = nullcontext) -> dict[torch.fx.Node, Any]:
    """Run ``region`` on ``inputs`` (the values of ``region.inputs``) under non-reentrant
    activation checkpointing; its outputs by node. The region runs inside ``context()`` both
    times (the program's dispatch settings: the backward's recomputation runs outside the
    forward's ``with`` blocks, and must save the same tensors)."""

    running: list[bool] = [True]  # whether the node running now is one whose outputs the policy keeps

    def body(*values: Any) -> tuple[Any, ...]:
        local: dict[torch.fx.Node, Any] = dict(zip(region.inputs, values))
        with context():
            for n in region.nodes:
                running[0] = region.kept is None or n in region.kept
                local[n] = run_node(n, local)
        return tuple(local[n] for n in region.outputs)

    # early_stop=False: the whole region runs again, its last collectives included, as planned
    # (torch's early stop would end the recomputation at the last tensor the backward needs)
    extra = {} if not region.selective else {"context_fn": selective_contexts} if region.kept is None else \
        {"context_fn": lambda: create_selective_checkpoint_contexts(partial(keeps_while, running))}
    results = checkpoint(body, *inputs, use_reentrant=False, preserve_rng_state=True, early_stop=False, **extra)
    return dict(zip(region.outputs, results))


def keeps_selectively(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's policy: keep what :data:`SELECTIVE_SAVED_OPS` compute,
    recompute the rest."""
    packet = getattr(func, "overloadpacket", None)
    return CheckpointPolicy.MUST_SAVE if packet is not None and packet.__name__ in SELECTIVE_SAVED_OPS \
        else CheckpointPolicy.PREFER_RECOMPUTE


def keeps_while(running: list[bool], ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The per-op policy: :func:`keeps_selectively`'s answer while a kept node runs
    (``running[0]``), else recompute. The forward and the recomputation run the same nodes in
    the same order, so the two ask alike."""
    return keeps_selectively(ctx, func) if running[0] else CheckpointPolicy.PREFER_RECOMPUTE


class KeptModules:
    """The per-op policy where a checkpointed *module* runs (the native programs): the outputs of
    attention are kept, and those of a matrix product only while one of ``modules`` runs (each
    holds one of the plan's kept products: :func:`~autoplan.codegen.native_patterns.kept_modules`);
    the rest are computed again. A forward hook pair on each module marks its call, in the
    forward and again in the recomputation, so the two ask alike."""

    def __init__(self, modules: Iterable[torch.nn.Module]) -> None:
        self.running: list[bool] = [False]
        for module in modules:
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._leave)

    def _enter(self, module: torch.nn.Module, args: Any) -> None:
        self.running[0] = True

    def _leave(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.running[0] = False

    def policy(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        packet = getattr(func, "overloadpacket", None)
        if packet is not None and packet.__name__ in ATTENTION_OPS:
            return CheckpointPolicy.MUST_SAVE
        return keeps_while(self.running, ctx, func)

    def contexts(self) -> tuple[AbstractContextManager, AbstractContextManager]:
        """The forward's and the recomputation's contexts (a checkpoint's ``context_fn``)."""
        return create_selective_checkpoint_contexts(self.policy)


def selective_contexts() -> tuple[AbstractContextManager, AbstractContextManager]:
    """The forward's and the recomputation's contexts of selective checkpointing."""
    return create_selective_checkpoint_contexts(keeps_selectively)
