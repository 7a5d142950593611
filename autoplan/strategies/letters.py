"""The :class:`IndexMap` type and the letter bookkeeping every op rule shares.

An index map describes an op the way an einsum equation does: each dim of each tensor gets a
*letter*, and sharding a letter over a mesh axis shards every tensor dim that carries it. A
letter that appears in the inputs but not in the outputs is either *reducible* (the op sums
over it: sharding it leaves partial sums, ``P``, in the output) or *fixed* (it must stay
whole). Rules (:mod:`autoplan.strategies.rules`) build an index map from a node's shapes and
arguments; :func:`finish` then records the size of every letter.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import fx

Letters = tuple[str, ...]


@dataclass(frozen=True)
class IndexMap:
    """Letters for an op's tensor inputs and outputs.

    ``inputs`` maps an input node's name to its letters (``None``: the op does not read the
    input's values, e.g. ``new_ones``, so its placement is free); ``outputs`` holds the
    letters of each tensor output. ``reducible`` letters produce partial sums when sharded;
    ``fixed`` letters are never sharded. ``linear`` ops also pass partial sums through
    (``P`` in, ``P`` out): views, add/sub, sums, scaling by a constant. ``addends`` are inputs
    added to a contraction's result (a bias): where the result is partial, they must be too.
    ``counted`` letters are those a mean loss counts its targets over: where one is sharded,
    the forward all-reduces that (scalar) count and divides the partial sum of the loss terms
    by it. Where a
    ``whole_grads`` letter is sharded, the op's backward gives its inputs' gradients
    replicated on that axis (an embedding with a vocabulary-sharded table: the program unmasks
    the partial output at once, and the table's gradient comes back whole).
    """

    inputs: dict[str, Letters | None]
    outputs: tuple[Letters, ...]
    reducible: frozenset[str] = frozenset()
    fixed: frozenset[str] = frozenset()
    linear: bool = False
    sizes: dict[str, int] = field(default_factory=dict)  # letter -> size, filled by finish()
    addends: frozenset[str] = frozenset()  # inputs added to a contraction's result (biases)
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # filled by finish()
    output_shapes: tuple[tuple[int, ...], ...] = ()  # filled by finish()
    counted: frozenset[str] = frozenset()
    whole_grads: frozenset[str] = frozenset()  # letters whose sharding leaves input gradients replicated

    def shardable_letters(self) -> list[str]:
        """Letters that may be sharded, in a deterministic order."""
        seen: list[str] = []
        for letters in list(self.outputs) + [v for v in self.inputs.values() if v]:
            for letter in letters:
                if letter not in seen and letter not in self.fixed:
                    in_output = any(letter in out for out in self.outputs)
                    if in_output or letter in self.reducible:
                        seen.append(letter)
        return [letter for letter in seen if self.sizes.get(letter, 0) > 1]


class LetterMaker:
    """Hands out fresh letters; one per op, so letters never collide inside an op."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def fresh(self) -> str:
        return f"i{next(self._count)}"

    def many(self, n: int) -> Letters:
        return tuple(self.fresh() for _ in range(n))


# A rule: the index map of a node (letters not yet sized), or None when the rule does not
# cover this form of the op (the planner then plans it replicated, with a warning).
Rule = Callable[[fx.Node, LetterMaker], "IndexMap | None"]


def op_name(node: fx.Node) -> str:
    """The ATen overload-packet name of a call_function node (``"linear"``), or the Python
    function's name for non-ATen targets (``"getitem"``)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return getattr(target, "__name__", str(target))


def tensor_shape(node: object) -> tuple[int, ...] | None:
    """The shape of a node whose value is one tensor; ``None`` otherwise."""
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def output_shapes(node: fx.Node) -> list[tuple[int, ...]]:
    """One shape per output of the node (``()`` for a non-tensor item of a tuple output)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [tuple(int(s) for s in val.shape)]
    if isinstance(val, (tuple, list)):
        return [tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else () for v in val]
    return []


def copies_its_input(node: fx.Node, shape: tuple[int, ...] | None = None) -> bool:
    """Whether the traced input of ``node`` cannot be viewed as ``shape`` (default: as it is,
    contiguous), so that a ``reshape``/``contiguous`` of it copies. DTensor reduces partial sums
    before any copy (``clone``), so such an op is not linear for the planner either. A value
    without traced strides counts as viewable."""
    src = next(iter(tensor_inputs(node)), None)
    val = src.meta.get("val") if src is not None else None
    if not isinstance(val, torch.Tensor):
        return False
    if shape is None:
        return not val.is_contiguous()
    try:
        torch.empty_strided(tuple(val.shape), tuple(val.stride()), device="meta").view(shape)
    except RuntimeError:
        return True
    return False


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The node's inputs whose value is one tensor, in first-use order."""
    return [n for n in node.all_input_nodes if tensor_shape(n) is not None]


def input_named(node: fx.Node, name: str) -> fx.Node | None:
    for n in node.all_input_nodes:
        if n.name == name:
            return n
    return None


def node_names(*nodes: object) -> frozenset[str]:
    """The names of those of ``nodes`` that are fx nodes (an optional bias may be ``None``)."""
    return frozenset(n.name for n in nodes if isinstance(n, fx.Node))


def normalize_dim(d: int, ndim: int) -> int:
    """A possibly negative dim as an index in ``range(ndim)``."""
    return d + ndim if d < 0 else d


def dims_arg(arg: object, ndim: int) -> list[int]:
    """The dims a reduction's ``dim`` argument names; all dims when it is ``None`` or empty."""
    if arg is None:
        return list(range(ndim))
    if isinstance(arg, int):
        return [normalize_dim(arg, ndim)]
    items = list(arg)  # type: ignore[arg-type]
    if not items:
        return list(range(ndim))
    return [normalize_dim(int(d), ndim) for d in items]


def batch_letters(n: int) -> str:
    """``"ABC…"``: ``n`` letters for leading batch dims."""
    return "".join(chr(ord("A") + i) for i in range(n))


def broadcast_letters(shape: tuple[int, ...], out_letters: Letters, out_shape: tuple[int, ...],
                      maker: LetterMaker, fixed: set[str]) -> Letters:
    """Letters of an input broadcast against an output: right-aligned; size-1 dims that the
    output expands get a fresh letter, added to ``fixed``."""
    offset = len(out_shape) - len(shape)
    letters = []
    for i, size in enumerate(shape):
        j = i + offset
        if j >= 0 and size == out_shape[j]:
            letters.append(out_letters[j])
        else:
            new = maker.fresh()
            fixed.add(new)
            letters.append(new)
    return tuple(letters)


def finish(imap: IndexMap, node: fx.Node) -> IndexMap:
    """``imap`` with the size of every letter and the shape of every tensor recorded.

    A letter's size is the largest dim it labels: a view's leading letter spans dims of
    different sizes, and each tensor's own shape is checked for divisibility when strategies
    are enumerated."""
    sizes: dict[str, int] = {}
    pairs: list[tuple[Letters, tuple[int, ...]]] = []
    for name, letters in imap.inputs.items():
        shape = tensor_shape(input_named(node, name))
        if letters is not None and shape is not None:
            pairs.append((letters, shape))
    pairs.extend(zip(imap.outputs, output_shapes(node)))
    for letters, shape in pairs:
        if len(letters) != len(shape):
            raise ValueError(f"index map of {node.name} has {len(letters)} letters for shape {shape}")
        for letter, size in zip(letters, shape):
            sizes[letter] = max(size, sizes.get(letter, 0))
    shapes = {name: tensor_shape(input_named(node, name)) for name in imap.inputs}
    return dataclasses.replace(imap, sizes=sizes, input_shapes={k: v for k, v in shapes.items() if v is not None},
                               output_shapes=tuple(output_shapes(node)))


def replicated_map(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """The index map that shards nothing: every letter of every tensor fixed."""
    inputs = {inp.name: maker.many(len(tensor_shape(inp))) for inp in tensor_inputs(node)}
    outs = tuple(maker.many(len(s)) for s in output_shapes(node))
    fixed = frozenset(x for letters in list(inputs.values()) + list(outs) for x in letters)
    return IndexMap(inputs, outs, fixed=fixed)


def rule_table(families: list[tuple[frozenset[str], Rule]]) -> MappingProxyType[str, Rule]:
    """A read-only table op name -> rule from (op names, rule) families."""
    return MappingProxyType({op: rule for ops, rule in families for op in ops})
