"""Rules for contractions: ``mm``, ``bmm``, ``matmul``, ``linear``, ``addmm``, ``baddbmm``,
``einsum``, ``embedding`` and convolutions.

The general rule is einsum's: ``C[m,n] = Σ_k A[m,k] B[k,n]`` shards ``m`` or ``n`` into
sharded outputs and the contracted ``k`` into partial sums (``k`` is *reducible*). A bias
added to the result is an *addend*: where the result is partial, so must it be. An embedding
is a contraction over the vocabulary ``v`` (a one-hot row times the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import (IndexMap, LetterMaker, Letters, Rule, batch_letters, broadcast_letters,
    node_names, op_name, output_shapes, replicated_map, tensor_shape)

_EQUATIONS = {
    "mm": "mk,kn->mn",
    "bmm": "bmk,bkn->bmn",
}


def einsum_map(operands: Sequence[fx.Node], equation: str) -> IndexMap | None:
    """The index map of ``einsum(equation, *operands)``; ``None`` for forms without a rule
    (an ellipsis, an operand count that does not match, one operand under two labellings)."""
    lhs, rhs = equation.replace(" ", "").split("->")
    in_terms = lhs.split(",")
    if len(in_terms) != len(operands) or "." in equation:
        return None
    inputs: dict[str, Letters | None] = {}
    for term, operand in zip(in_terms, operands):
        letters = tuple(term)
        if operand.name in inputs and inputs[operand.name] != letters:
            return None
        inputs[operand.name] = letters
    reducible = frozenset(x for term in in_terms for x in term if x not in rhs)
    return IndexMap(inputs, (tuple(rhs),), reducible=reducible)


def einsum(node: fx.Node, maker: LetterMaker) -> IndexMap | None:
    equation, operands = node.args[0], list(node.args[1])
    if "->" not in str(equation):
        return None  # implicit output: its letters are the sorted free ones, not written down
    return einsum_map(operands, str(equation))


def mm_or_bmm(node: fx.Node, maker: LetterMaker) -> IndexMap | None:
    return einsum_map([node.args[0], node.args[1]], _EQUATIONS[op_name(node)])


def linear(node: fx.Node, maker: LetterMaker) -> IndexMap:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    batch = batch_letters(len(tensor_shape(x)) - 1)
    inputs: dict[str, Letters | None] = {x.name: tuple(batch + "k"), w.name: ("n", "k")}
    if isinstance(b, fx.Node):
        inputs[b.name] = ("n",)
    return IndexMap(inputs, (tuple(batch + "n"),), reducible=frozenset("k"), addends=node_names(b))


def addmm(node: fx.Node, maker: LetterMaker) -> IndexMap:
    bias, x, w = node.args[0], node.args[1], node.args[2]
    inputs: dict[str, Letters | None] = {x.name: ("m", "k"), w.name: ("k", "n")}
    fixed: set[str] = set()
    if isinstance(bias, fx.Node):
        inputs[bias.name] = broadcast_letters(tensor_shape(bias), ("m", "n"), output_shapes(node)[0], maker, fixed)
    return IndexMap(inputs, (("m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed),
                    addends=node_names(bias))


def matmul(node: fx.Node, maker: LetterMaker) -> IndexMap:
    a, b = node.args[0], node.args[1]
    sa, sb = tensor_shape(a), tensor_shape(b)
    out_shape = output_shapes(node)[0]
    if len(sa) < 2 or len(sb) < 2:
        return replicated_map(node, maker)
    batch = batch_letters(len(out_shape) - 2)
    fixed: set[str] = set()
    a_batch = broadcast_letters(sa[:-2], tuple(batch), out_shape[:-2], maker, fixed)
    b_batch = broadcast_letters(sb[:-2], tuple(batch), out_shape[:-2], maker, fixed)
    inputs: dict[str, Letters | None] = {a.name: a_batch + ("m", "k")}
    if b.name in inputs:
        return replicated_map(node, maker)
    inputs[b.name] = b_batch + ("k", "n")
    return IndexMap(inputs, (tuple(batch) + ("m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed))


def baddbmm(node: fx.Node, maker: LetterMaker) -> IndexMap:
    bias, x, w = node.args[0], node.args[1], node.args[2]
    inputs: dict[str, Letters | None] = {x.name: ("b", "m", "k"), w.name: ("b", "k", "n")}
    fixed: set[str] = set()
    if isinstance(bias, fx.Node):
        inputs[bias.name] = broadcast_letters(tensor_shape(bias), ("b", "m", "n"), output_shapes(node)[0], maker,
                                              fixed)
    return IndexMap(inputs, (("b", "m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed),
                    addends=node_names(bias))


def embedding(node: fx.Node, maker: LetterMaker) -> IndexMap:
    weight, indices = node.args[0], node.args[1]
    batch = batch_letters(len(tensor_shape(indices)))
    return IndexMap({weight.name: ("v", "d"), indices.name: tuple(batch)}, (tuple(batch) + ("d",),),
                    reducible=frozenset("v"), whole_grads=frozenset("v"))


def convolution(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """Convolutions shard their batch only.

    Channel sharding (input channels ``c`` → partial sums, output channels ``O`` → a
    column-sharded weight) is correct mathematics, but DTensor cannot run it: its convolution
    handler (torch/distributed/tensor/_tp_conv.py) runs the local conv on the local tensors as
    they are, with the output placed like the INPUT and the weight assumed replicated. A
    channel-sharded input then fails ("Expected cond to be True" in _maybe_unpad_tensor,
    "expected input to have 8 channels, but got 4", or "Stride must be 1 when there is
    padding" from its width-halo path), and an S(0) weight gives a silently mislabelled output
    (O/n channels locally, declared replicated). So channels stay whole."""
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    spatial = len(tensor_shape(x)) - 2
    groups = 1
    if str(node.target).startswith("aten.convolution"):
        groups = int(node.args[8]) if len(node.args) > 8 else 1
        if len(node.args) > 6 and node.args[6]:  # transposed convolution
            return replicated_map(node, maker)
    elif len(node.args) > 6:
        groups = int(node.args[6])
    x_sp, w_sp, o_sp = maker.many(spatial), maker.many(spatial), maker.many(spatial)
    channel = "c" if groups == 1 else maker.fresh()
    inputs: dict[str, Letters | None] = {x.name: ("N", channel) + x_sp, w.name: ("O", "c") + w_sp}
    if isinstance(b, fx.Node):
        inputs[b.name] = ("O",)
    fixed = set(x_sp) | set(w_sp) | set(o_sp) | {channel, "c", "O"}
    return IndexMap(inputs, (("N", "O") + o_sp,), fixed=frozenset(fixed), addends=node_names(b))


RULES: MappingProxyType[str, Rule] = MappingProxyType({
    "mm": mm_or_bmm,
    "bmm": mm_or_bmm,
    "linear": linear,
    "addmm": addmm,
    "matmul": matmul,
    "baddbmm": baddbmm,
    "einsum": einsum,
    "embedding": embedding,
    "conv1d": convolution,
    "conv2d": convolution,
    "conv3d": convolution,
    "convolution": convolution,
})
