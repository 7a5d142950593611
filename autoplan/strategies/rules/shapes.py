"""Rules for ops that move dims around without arithmetic: views and reshapes, permutations,
slices, splits and concatenations, padding. All are linear (partial sums pass through), except
a ``reshape`` (or ``flatten``) that must copy its input (a transposed or expanded one): DTensor
reduces partial sums before it copies.

A view pairs runs of input dims with runs of output dims of equal product; the leading dim of
each run keeps its letter and the others stay whole. The dim an op slices, splits, pads or
concatenates along stays whole.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import (IndexMap, LetterMaker, Letters, Rule, copies_its_input, normalize_dim, op_name,
    output_shapes, replicated_map, rule_table, tensor_inputs, tensor_shape)

VIEWS = frozenset("view _unsafe_view reshape flatten unflatten expand_as view_as squeeze unsqueeze".split())
#: views that copy an input they cannot view
_COPYING_VIEWS = frozenset({"reshape", "flatten"})
PERMUTES = frozenset("transpose permute t swapaxes numpy_T".split())
SLICES = frozenset("slice select narrow".split())
CONCATENATIONS = frozenset("cat concat stack".split())


def view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims alone);
    ``None`` when the shapes cannot be paired so."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        if i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            groups.append(([i], []))
            i += 1
            continue
        if j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            groups.append(([], [j]))
            j += 1
            continue
        if i >= len(src) or j >= len(dst):
            return None
        gi, gj = [i], [j]
        pi, pj = src[i], dst[j]
        i += 1
        j += 1
        while pi != pj:
            if pi < pj:
                if i >= len(src):
                    return None
                pi *= src[i]
                gi.append(i)
                i += 1
            else:
                if j >= len(dst):
                    return None
                pj *= dst[j]
                gj.append(j)
                j += 1
        groups.append((gi, gj))
    return groups


def view(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """Views, reshapes, and squeeze/unsqueeze (size-1 dims come and go in the grouping)."""
    src = tensor_inputs(node)[0]
    in_shape = tensor_shape(src)
    out_shape = output_shapes(node)[0]
    groups = view_groups(in_shape, out_shape)
    if groups is None:
        return replicated_map(node, maker)
    in_letters: list[str] = [""] * len(in_shape)
    out_letters: list[str] = [""] * len(out_shape)
    fixed: set[str] = set()
    for gi, gj in groups:
        # the leading dim of a merged/split run keeps the letter; the rest stay whole
        lead = maker.fresh()
        for k, d in enumerate(gi):
            in_letters[d] = lead if k == 0 else maker.fresh()
        for k, d in enumerate(gj):
            out_letters[d] = lead if k == 0 else maker.fresh()
        if not gi or not gj:
            fixed.add(lead)
        fixed.update(in_letters[d] for d in gi[1:])
        fixed.update(out_letters[d] for d in gj[1:])
    linear = not (op_name(node) in _COPYING_VIEWS and copies_its_input(node, out_shape))
    return IndexMap({src.name: tuple(in_letters)}, (tuple(out_letters),), fixed=frozenset(fixed), linear=linear)


def expand(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``expand``: dims align from the right; a dim the output keeps at the input's size keeps
    its letter, one it broadcasts (from size 1, or new in front) gets a fresh letter that stays
    whole, as does the size-1 input dim it comes from. (A view's pairing of runs does not apply:
    ``[B, 8, 1, S, D] -> [B, 8, 4, S, D]`` has no run of equal product for the 1 -> 4.)"""
    src = tensor_inputs(node)[0]
    in_shape = tensor_shape(src)
    out_shape = output_shapes(node)[0]
    offset = len(out_shape) - len(in_shape)
    in_letters: list[str] = [maker.fresh() for _ in in_shape]
    out_letters: list[str] = []
    fixed: set[str] = set()
    for j, size in enumerate(out_shape):
        i = j - offset
        if i >= 0 and in_shape[i] == size:
            out_letters.append(in_letters[i])
            continue
        out_letters.append(maker.fresh())
        fixed.add(out_letters[-1])
        if i >= 0:
            fixed.add(in_letters[i])
    return IndexMap({src.name: tuple(in_letters)}, (tuple(out_letters),), fixed=frozenset(fixed), linear=True)


def permute(node: fx.Node, maker: LetterMaker) -> IndexMap:
    op = op_name(node)
    src = tensor_inputs(node)[0]
    ndim = len(tensor_shape(src))
    letters = maker.many(ndim)
    if op == "permute":
        order = [normalize_dim(int(d), ndim) for d in node.args[1]]
    elif op == "t" or op == "numpy_T":
        order = list(range(ndim))[::-1]
    else:  # transpose / swapaxes
        a, b = normalize_dim(int(node.args[1]), ndim), normalize_dim(int(node.args[2]), ndim)
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    return IndexMap({src.name: letters}, (tuple(letters[d] for d in order),), linear=True)


def slice_like(node: fx.Node, maker: LetterMaker) -> IndexMap:
    op = op_name(node)
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    letters = maker.many(len(shape))
    dim = normalize_dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(shape))
    out_shape = output_shapes(node)[0]
    if op == "select":
        out = tuple(x for i, x in enumerate(letters) if i != dim)
        return IndexMap({src.name: letters}, (out,), fixed=frozenset({letters[dim]}), linear=True)
    if op == "slice" and out_shape == shape:
        return IndexMap({src.name: letters}, (letters,), linear=True)
    out = tuple(maker.fresh() if i == dim else x for i, x in enumerate(letters))
    return IndexMap({src.name: letters}, (out,), fixed=frozenset({letters[dim], out[dim]}), linear=True)


def split(node: fx.Node, maker: LetterMaker) -> IndexMap:
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    letters = maker.many(len(shape))
    dim = normalize_dim(int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", 0)), len(shape))
    outs = []
    fixed = {letters[dim]}
    for _ in output_shapes(node):
        out = tuple(maker.fresh() if i == dim else x for i, x in enumerate(letters))
        fixed.add(out[dim])
        outs.append(out)
    return IndexMap({src.name: letters}, tuple(outs), fixed=frozenset(fixed), linear=True)


def unbind(node: fx.Node, maker: LetterMaker) -> IndexMap:
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    letters = maker.many(len(shape))
    dim = normalize_dim(int(node.args[1]) if len(node.args) > 1 else 0, len(shape))
    out = tuple(x for i, x in enumerate(letters) if i != dim)
    return IndexMap({src.name: letters}, tuple(out for _ in output_shapes(node)),
                    fixed=frozenset({letters[dim]}), linear=True)


def concatenate(node: fx.Node, maker: LetterMaker) -> IndexMap:
    op = op_name(node)
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out_shape = output_shapes(node)[0]
    out = maker.many(len(out_shape))
    dim = normalize_dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(out_shape))
    fixed = {out[dim]}
    inputs: dict[str, Letters | None] = {}
    for t in tensors:
        if op == "stack":
            letters = tuple(x for i, x in enumerate(out) if i != dim)
        else:
            letters = tuple(maker.fresh() if i == dim else x for i, x in enumerate(out))
            fixed.add(letters[dim])
        inputs[t.name] = letters
    return IndexMap(inputs, (out,), fixed=frozenset(fixed), linear=True)


def pad(node: fx.Node, maker: LetterMaker) -> IndexMap:
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    letters = maker.many(len(shape))
    pads = list(node.args[1])
    padded = {len(shape) - 1 - i // 2 for i, p in enumerate(pads) if p}
    out = tuple(maker.fresh() if d in padded else x for d, x in enumerate(letters))
    fixed = {letters[d] for d in padded} | {out[d] for d in padded}
    return IndexMap({src.name: letters}, (out,), fixed=frozenset(fixed))


def repeat(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``x.repeat(*repeats)`` tiles ``x``: a dim repeated once keeps its letter; a dim repeated
    ``k > 1`` times stays whole (the output is ``k`` copies of the whole dim one after the other,
    so a shard of the input is not a shard of the output), and so do the new leading dims when
    ``repeats`` is longer than ``x``'s rank. Linear: tiling partial sums gives partial sums."""
    src = tensor_inputs(node)[0]
    ndim = len(tensor_shape(src))
    repeats = [int(r) for r in node.args[1]]
    lead = len(repeats) - ndim
    if lead < 0:
        return replicated_map(node, maker)
    out = list(maker.many(lead))
    fixed = set(out)
    letters: list[str] = []
    for d in range(ndim):
        x = maker.fresh()
        letters.append(x)
        if repeats[lead + d] == 1:
            out.append(x)
        else:
            out.append(maker.fresh())
            fixed.update((x, out[-1]))
    return IndexMap({src.name: tuple(letters)}, (tuple(out),), fixed=frozenset(fixed), linear=True)


def repeat_interleave(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``x.repeat_interleave(k, dim)`` with an int ``k`` repeats each element ``k`` times in
    place: rows ``a:b`` of ``x`` give rows ``a*k:b*k`` of the output, so the repeated dim keeps
    its letter (a contiguous block stays a contiguous block of ``k`` times the size), and the
    other dims too. Without ``dim`` (``x`` flattened), a 1-D ``x`` is the same; other forms
    (a tensor of repeats, a flattened n-D ``x``) stay replicated. Kept non-linear, as in
    DTensor's rule (which replicates a partial input)."""
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    reps = node.args[1] if len(node.args) > 1 else node.kwargs.get("repeats")
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
    if isinstance(reps, fx.Node) or not isinstance(reps, int) or not shape or src is not node.args[0]:
        return replicated_map(node, maker)
    if dim is None and len(shape) != 1:
        return replicated_map(node, maker)
    letters = maker.many(len(shape))
    return IndexMap({src.name: letters}, (letters,))


RULES: MappingProxyType[str, Rule] = rule_table([
    (VIEWS, view), (frozenset({"expand"}), expand), (PERMUTES, permute), (SLICES, slice_like),
    (CONCATENATIONS, concatenate), (frozenset({"split", "split_with_sizes", "chunk"}), split),
    (frozenset({"unbind"}), unbind), (frozenset({"pad", "constant_pad_nd"}), pad),
    (frozenset({"repeat"}), repeat), (frozenset({"repeat_interleave"}), repeat_interleave)])
