"""Rules for the ops of mixture-of-experts layers: the experts traced as one op
(``autoplan::moe_experts``, :mod:`autoplan.trace.experts`), the grouped matmul of the experts
(``aten._grouped_mm``, and transformers' ``transformers.grouped_mm_fallback`` custom op), the
routing counts (``histc``) and the router's ``scatter``.

The experts as one op, ``out[T, H] = moe_experts(x[T, H], i[T, k], w[T, k], up[E, ·, ·],
down[E, ·, ·])``, sum over the experts: ``out[t] = Σ_e Σ_slot [i[t, slot] = e] · w[t, slot] ·
expert_e(x[t])``. So the experts' dim ``E`` is a reduction letter: a device holding a shard of
the experts computes their contributions to every token, partial sums of the output (expert
parallelism; the gradients of ``x`` and ``w`` come back partial too). The tokens ``T`` are
independent of one another: a batch letter. The rest stays whole.

A grouped matmul ``out = _grouped_mm(x[S, k], w[E, k, n], offs[E])`` multiplies the rows of
group ``g`` (rows ``offs[g-1]:offs[g]``, tokens sorted by expert) by expert ``g``'s weight.
The experts' dim ``E`` cannot be sharded by an index map: a device holding experts ``e0:e1``
would need the rows of those experts only and offsets rebased to them (an all-to-all
dispatch), and with the global offsets its first local group would start at row 0. The rows
``S`` cannot be split either: a row's group is given by its global position. What is exact is
the contraction of each group: ``n`` sharded column-wise (``w`` on its last dim → the output
on its last dim) and ``k`` as a reduction (``x`` on its last dim with ``w`` on dim 1 → partial
sums); ``offs`` stays whole. These are the strategies DTensor runs for ``aten._grouped_mm``.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import (IndexMap, LetterMaker, Letters, Rule, normalize_dim, output_shapes,
    rule_table, tensor_inputs, tensor_shape)


def _arg(node: fx.Node, position: int, name: str, default: object = None) -> object:
    if len(node.args) > position:
        return node.args[position]
    return node.kwargs.get(name, default)


def grouped_mm(node: fx.Node, maker: LetterMaker) -> IndexMap | None:
    """``aten._grouped_mm(a, b, offs=None, bias=None, out_dtype=None)`` and
    ``transformers.grouped_mm_fallback(input, weight, offs)`` (the same 2-D × 3-D product,
    computed by a loop of ``mm`` over the experts).

    - 2-D × 3-D, ``a[S, k]``, ``b[E, k, n]``, groups of rows (the MoE forward): ``n``
      sharded, ``k`` reduced; ``S`` and ``E`` whole (see the module docstring).
    - 3-D × 3-D, no offsets: a batched matmul ``[E, m, k] × [E, k, n]``: the batch ``E``,
      ``m`` and ``n`` sharded, ``k`` reduced.
    - 2-D × 2-D, groups along ``k`` (a weight gradient), ``[m, K] × [K, n] → [G, m, n]``:
      ``m`` and ``n`` sharded; ``K`` (cut into groups) and ``G`` whole.
    - 3-D × 2-D, groups along ``n``, ``[G, m, k] × [k, N] → [m, N]``: ``m`` sharded, ``k``
      reduced; ``N`` and ``G`` whole.

    A bias (which DTensor's rule does not support either) leaves the op without a rule."""
    target = str(node.target)
    if not (target.startswith("aten._grouped_mm") or target.startswith("transformers.grouped_mm_fallback")):
        return None  # an op of another namespace under the same name
    a, b = _arg(node, 0, "self"), _arg(node, 1, "mat2")
    offs = _arg(node, 2, "offs")
    if isinstance(_arg(node, 3, "bias"), fx.Node) or not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return None
    if a is b or (isinstance(offs, fx.Node) and offs in (a, b)):
        return None
    ra, rb = len(tensor_shape(a) or ()), len(tensor_shape(b) or ())
    grouped = isinstance(offs, fx.Node)
    offs_letters: Letters = ("e",)
    if (ra, rb) == (2, 3) and grouped:
        inputs, out, fixed = {a.name: ("s", "k"), b.name: ("e", "k", "n")}, ("s", "n"), {"s", "e"}
        if target.startswith("transformers."):
            # DTensor has no rule for the custom op: the program runs it on local tensors,
            # which gives a shard of the output, not yet partial sums (``k`` stays whole)
            fixed.add("k")
    elif (ra, rb) == (3, 3) and not grouped:
        inputs, out, fixed = {a.name: ("e", "m", "k"), b.name: ("e", "k", "n")}, ("e", "m", "n"), set()
    elif (ra, rb) == (2, 2) and grouped:
        inputs, out, fixed = {a.name: ("m", "g"), b.name: ("g", "n")}, ("e", "m", "n"), {"e", "g"}
    elif (ra, rb) == (3, 2) and grouped:
        inputs, out, fixed = {a.name: ("e", "m", "k"), b.name: ("k", "g")}, ("m", "g"), {"e", "g"}
    else:
        return None
    letters: dict[str, Letters | None] = dict(inputs)
    if grouped:
        letters[offs.name] = offs_letters
    return IndexMap(letters, (out,), reducible=frozenset({"k"}), fixed=frozenset(fixed))


def moe_experts(node: fx.Node, maker: LetterMaker) -> IndexMap | None:
    """``autoplan::moe_experts(x, i, w, up, down, gated, transposed, activation)``: tokens
    ``t`` sharded, experts ``e`` reduced (see the module docstring); the hidden dim, the
    router's slots and the experts' matrices whole."""
    if not str(node.target).startswith("autoplan.moe_experts"):
        return None
    x, index, weights, up, down = node.args[:5]
    if not all(isinstance(t, fx.Node) for t in (x, index, weights, up, down)) or \
            len({x, index, weights, up, down}) < 5:
        return None
    inputs: dict[str, Letters | None] = {x.name: ("t", "h"), index.name: ("t", "k"), weights.name: ("t", "k"),
                                         up.name: ("e", "a", "b"), down.name: ("e", "c", "d")}
    return IndexMap(inputs, (("t", "h"),), reducible=frozenset({"e"}),
                    fixed=frozenset({"h", "k", "a", "b", "c", "d"}))


def histc(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``histc(x, bins, min, max)`` counts every element of ``x``: the histogram of a shard
    is a partial count, and the counts of the shards add up to the whole one — so every dim of
    ``x`` is a reduction letter (a sharded ``x`` gives partial sums) — but only when the bin
    range is given (``min < max``): with ``min == max`` (the default ``0, 0``) each shard
    would bin over its own data's range. The bins stay whole. Not linear: the histogram of a
    sum of partial values is not the sum of their histograms."""
    src = tensor_inputs(node)[0]
    letters = maker.many(len(tensor_shape(src)))
    bins = maker.many(len(output_shapes(node)[0]))
    lo, hi = _arg(node, 2, "min", 0), _arg(node, 3, "max", 0)
    ranged = isinstance(lo, (int, float)) and isinstance(hi, (int, float)) and lo < hi
    if ranged:
        return IndexMap({src.name: letters}, (bins,), reducible=frozenset(letters), fixed=frozenset(bins))
    return IndexMap({src.name: letters}, (bins,), fixed=frozenset(letters) | frozenset(bins))


def scatter(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``scatter(self, dim, index, src | value)`` and ``scatter_``: writes along ``dim``, so
    that dim stays whole (indices address all of it); any other dim on which ``self``,
    ``index`` and ``src`` have the same size may be split (each row scatters into its own
    row), as DTensor's rule does. Not linear: written values replace, they do not add."""
    self_, index = node.args[0], node.args[2]
    src = node.args[3] if len(node.args) > 3 else node.kwargs.get("src")
    shape = tensor_shape(self_)
    dim = normalize_dim(int(node.args[1]), len(shape))
    operands = [t for t in (self_, index, src) if isinstance(t, fx.Node)]
    shapes = [tensor_shape(t) for t in operands]
    out = maker.many(len(shape))
    fixed = {out[dim]}
    inputs: dict[str, Letters | None] = {}
    for t, s in zip(operands, shapes):
        if t.name in inputs:
            continue
        if len(s) != len(shape):
            inputs[t.name] = maker.many(len(s))
            fixed.update(inputs[t.name])
            continue
        letters = []
        for d, size in enumerate(s):
            if d != dim and all(len(o) == len(shape) and o[d] == shape[d] for o in shapes):
                letters.append(out[d])
            else:
                letters.append(maker.fresh())
                fixed.add(letters[-1])
        inputs[t.name] = tuple(letters)
    # a dim some operand cannot follow stays whole in every operand
    for d in range(len(shape)):
        if any(len(o) != len(shape) or o[d] != shape[d] for o in shapes):
            fixed.add(out[d])
    return IndexMap(inputs, (out,), fixed=frozenset(fixed))


RULES: MappingProxyType[str, Rule] = rule_table([
    (frozenset({"moe_experts"}), moe_experts),
    (frozenset({"_grouped_mm", "grouped_mm_fallback"}), grouped_mm),
    (frozenset({"histc"}), histc),
    (frozenset({"scatter", "scatter_"}), scatter),
])
