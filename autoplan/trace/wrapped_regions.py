"""Regions export keeps wrapped in a higher-order op, made plain ATen ops of the graph.

``torch.export`` keeps two kinds of the model's own regions as a higher-order op around a
sub-graph: ``torch.no_grad()`` (``wrap_with_set_grad_enabled``) and ``torch.autocast``
(``wrap_with_autocast``). Sharding strategies and DTensor understand plain ATen ops, so
:func:`inline_wrapped` copies a region's ops into the graph in place of its op.

An autocast region carries a decision the program must keep: Hugging Face's rotary embedding
(and GPT-2's upcast attention) turn autocast off so that their matrix products run in fp32
under a bf16 plan; computed in bf16, Llama's rotary angles at position 2,000 are off by
whole radians. Each inlined op of such a region keeps an :class:`AutocastRegion` in its
``meta`` (:data:`AUTOCAST_META`); the program runs it under that ``torch.autocast`` and the
cost model counts it in fp32 where autocast is off.

Hugging Face opens these regions through ``transformers.utils.generic.maybe_autocast``, which
is a no-op where autocast is off — as it is in autoplan's fp32 trace — so export would not see
them: :func:`visible_autocast_helpers` makes the helper open a real ``torch.autocast`` while
exporting.
"""

from __future__ import annotations

import contextlib
import operator
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.wrap import wrap_with_autocast

__all__ = ["AUTOCAST_META", "AutocastRegion", "autocast_region", "inline_autocast_regions", "inline_wrapped",
           "visible_autocast_helpers"]

#: The ``node.meta`` key of an op's :class:`AutocastRegion`.
AUTOCAST_META = "autoplan_autocast"

#: The ``nn_module_stack``-like metadata an inlined op takes from the region's op when it has none.
_INHERITED_META = ("nn_module_stack", "stack_trace", "source_fn_stack")


@dataclass(frozen=True)
class AutocastRegion:
    """The model's own ``torch.autocast(device, dtype, enabled)`` around an op."""

    enabled: bool
    dtype: str  # torch dtype name, e.g. "bfloat16" (what autocast casts to where enabled)

    def context(self, device_type: str) -> contextlib.AbstractContextManager:
        """The ``torch.autocast`` an op of this region runs under on ``device_type``."""
        return torch.autocast(device_type=device_type, dtype=getattr(torch, self.dtype), enabled=self.enabled)


def autocast_region(node: torch.fx.Node) -> AutocastRegion | None:
    """The model's autocast region around ``node`` (None: it follows the plan's precision)."""
    return node.meta.get(AUTOCAST_META)


def inline_wrapped(gm: torch.fx.GraphModule, node: torch.fx.Node, sub_node: torch.fx.Node,
                   operands: list[Any], mark: Callable[[torch.fx.Node], None] | None = None) -> bool:
    """Replace the higher-order op ``node`` (a region: ``sub_node`` names its sub-graph, which
    reads ``operands``) by copies of the sub-graph's ops, each passed to ``mark``. False, and
    the graph unchanged, where the sub-graph holds regions of its own or its result is used
    otherwise than through ``getitem``."""
    graph = gm.graph
    sub = getattr(gm, sub_node.target)
    if any(n.op not in ("placeholder", "call_function", "output") for n in sub.graph.nodes):
        return False  # nested regions: leave them
    sub_placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(sub_placeholders) != len(operands):
        return False
    if any(not (user.op == "call_function" and user.target is operator.getitem) for user in node.users) \
            and any(n.op == "output" and isinstance(n.args[0], (tuple, list)) for n in sub.graph.nodes):
        return False
    env: dict[torch.fx.Node, Any] = dict(zip(sub_placeholders, operands))
    result: Any = None
    with graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                result = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                continue
            new = graph.node_copy(n, lambda a: env[a])
            for key in _INHERITED_META:  # the region's ops belong to the module that opened it
                if key in node.meta and key not in n.meta:
                    new.meta[key] = node.meta[key]
            if mark is not None:
                mark(new)
            env[n] = new
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            user.replace_all_uses_with(result[user.args[1]])
            graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    graph.erase_node(node)
    if not sub_node.users:
        graph.erase_node(sub_node)
        if not any(n.op == "get_attr" and n.target == sub_node.target for n in graph.nodes):
            delattr(gm, sub_node.target)
    return True


def inline_autocast_regions(gm: torch.fx.GraphModule) -> None:
    """Inline every ``wrap_with_autocast`` region of ``gm`` and of the regions it holds (the
    innermost first), marking each op with its innermost :class:`AutocastRegion`."""
    for _, child in list(gm.named_children()):
        if isinstance(child, torch.fx.GraphModule):
            inline_autocast_regions(child)
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_autocast or node.kwargs:
            continue
        _device, dtype, enabled, _cache, sub_node, *operands = node.args
        region = AutocastRegion(bool(enabled), str(dtype or torch.get_autocast_dtype("cpu")).replace("torch.", ""))

        def mark(new: torch.fx.Node, region: AutocastRegion = region) -> None:
            new.meta.setdefault(AUTOCAST_META, region)

        changed |= inline_wrapped(gm, node, sub_node, operands, mark)
    if changed:
        gm.recompile()


@contextlib.contextmanager
def visible_autocast_helpers() -> Iterator[None]:
    """While exporting, Hugging Face's ``maybe_autocast`` helper (in every module that imported
    it) opens a real ``torch.autocast``, so that export records the model's fp32
    regions; the helper comes back afterwards. Without transformers loaded, nothing changes."""
    generic = sys.modules.get("transformers.utils.generic")
    helper = getattr(generic, "maybe_autocast", None)
    if helper is None:
        yield
        return

    def real_autocast(device_type: str, dtype: torch.dtype | None = None, enabled: bool = True,
                      cache_enabled: bool | None = None) -> torch.autocast:
        # a model on the meta device (planned at its real size) opens the region on the CPU
        device = "cpu" if device_type == "meta" else device_type
        return torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    # every module that imported the helper (transformers' own and a user's model file), read in
    # the module's own namespace: an attribute lookup on transformers' lazy modules imports them
    holders = [module for module in list(sys.modules.values())
               if getattr(module, "__dict__", {}).get("maybe_autocast") is helper]
    for module in holders:
        module.maybe_autocast = real_autocast
    try:
        yield
    finally:
        for module in holders:
            module.maybe_autocast = helper
