"""Per-op index maps: which tensor dims of an op's inputs and outputs move together.

Every op the planner knows is described by one :class:`IndexMap`, in the spirit of an einsum
equation: each dim of each tensor gets a *letter*. Sharding a letter over a mesh axis shards
every tensor dim that carries it. A letter that appears in the inputs but not in the outputs
is either *reducible* (the op sums over it: sharding it leaves partial sums, ``P``, in the
output — contractions, ``sum``, ``mean``, losses) or *fixed* (it must stay whole: softmax's
dim, a normalised dim, a sliced dim, a convolution's spatial dims). This single description
gives the general contraction rule (mm, bmm, linear, addmm, einsum, conv, embedding),
the followers (element-wise and view ops), reductions, softmax, norms and attention.

The type and its letter bookkeeping are in :mod:`autoplan.strategies.letters`; the rules, one
module per op family, in :mod:`autoplan.strategies.rules`. This module looks a node's op up
among them. Ops are named by their ATen overload packet (``"aten.linear"``); an op missing
from every family, or in a form its rule does not cover, gets ``None`` from
:func:`index_map_for` and is planned replicated with a warning.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import IndexMap, LetterMaker, Letters, Rule, finish, op_name
from autoplan.strategies.rules import contractions, moe, nn, pointwise, shapes

__all__ = ["IndexMap", "Letters", "index_map_for", "known_ops", "op_name"]


def _merge(*tables: Mapping[str, Rule]) -> MappingProxyType[str, Rule]:
    merged: dict[str, Rule] = {}
    for table in tables:
        for op, rule in table.items():
            if op in merged:
                raise ValueError(f"two index-map rules for {op!r}")
            merged[op] = rule
    return MappingProxyType(merged)


_RULES = _merge(contractions.RULES, nn.RULES, shapes.RULES, pointwise.RULES, moe.RULES)


def known_ops() -> frozenset[str]:
    """The ATen overload-packet names that have an index-map rule."""
    return frozenset(_RULES)


def index_map_for(node: fx.Node) -> IndexMap | None:
    """The index map of a call_function node, or ``None`` when the planner has no rule."""
    rule = _RULES.get(op_name(node))
    if rule is None:
        return None
    imap = rule(node, LetterMaker())
    return None if imap is None else finish(imap, node)
