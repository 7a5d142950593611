"""Per-op index maps: which tensor dims of an op's inputs and outputs move together.

Every op the planner knows is described by one :class:`IndexMap`, in the spirit of an einsum
equation: each dim of each tensor gets a *letter*. Sharding a letter over a mesh axis shards
every tensor dim that carries it. A letter that appears in the inputs but not in the outputs
is either *reducible* (the op sums over it: sharding it leaves partial sums, ``P``, in the
output — contractions, ``sum``, ``mean``, losses) or *fixed* (it must stay whole: softmax's
dim, a normalised dim, a sliced dim, a convolution's spatial dims). This single description
gives the general contraction rule (mm, bmm, linear, addmm, einsum, conv, embedding),
the followers (element-wise and view ops), reductions, softmax, norms and attention.

Ops are named by their ATen overload packet (``"aten.linear"``); an op missing from
:func:`index_map_for` gets ``None`` and is planned replicated with a warning.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    the backward all-reduces that (scalar) count before dividing by it. Where a
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


def _shape(node: object) -> tuple[int, ...] | None:
    if not isinstance(node, fx.Node):
        return None
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return tuple(int(s) for s in val.shape)
    return None


def _output_shapes(node: fx.Node) -> list[tuple[int, ...]]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return [tuple(int(s) for s in val.shape)]
    if isinstance(val, (tuple, list)):
        return [tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else () for v in val]
    return []


class _LetterMaker:
    """Hands out fresh letters; one per op, so letters never collide inside an op."""

    def __init__(self) -> None:
        self._count = itertools.count()

    def fresh(self) -> str:
        return f"i{next(self._count)}"

    def many(self, n: int) -> Letters:
        return tuple(self.fresh() for _ in range(n))


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _dims_arg(arg: object, ndim: int) -> list[int]:
    if arg is None:
        return list(range(ndim))
    if isinstance(arg, int):
        return [_dim(arg, ndim)]
    items = list(arg)  # type: ignore[arg-type]
    if not items:
        return list(range(ndim))
    return [_dim(int(d), ndim) for d in items]


def _broadcast_letters(shape: tuple[int, ...], out_letters: Letters, out_shape: tuple[int, ...],
                       maker: _LetterMaker, fixed: set[str]) -> Letters:
    """Letters of an input broadcast against an output: right-aligned; size-1 dims that the
    output expands get a fresh fixed letter."""
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


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [n for n in node.all_input_nodes if _shape(n) is not None]


def _finish(imap: IndexMap, node: fx.Node) -> IndexMap:
    sizes: dict[str, int] = {}
    pairs: list[tuple[Letters, tuple[int, ...]]] = []
    for name, letters in imap.inputs.items():
        shape = _shape(_find_input(node, name))
        if letters is not None and shape is not None:
            pairs.append((letters, shape))
    pairs.extend(zip(imap.outputs, _output_shapes(node)))
    for letters, shape in pairs:
        if len(letters) != len(shape):
            raise ValueError(f"index map of {node.name} has {len(letters)} letters for shape {shape}")
        for letter, size in zip(letters, shape):
            # a view's leading letter spans dims of different sizes; every tensor's own shape
            # is checked for divisibility when strategies are enumerated
            sizes[letter] = max(size, sizes.get(letter, 0))
    shapes = {name: _shape(_find_input(node, name)) for name in imap.inputs}
    return dataclasses.replace(imap, sizes=sizes, input_shapes={k: v for k, v in shapes.items() if v is not None},
                               output_shapes=tuple(_output_shapes(node)))


def _find_input(node: fx.Node, name: str) -> fx.Node | None:
    for n in node.all_input_nodes:
        if n.name == name:
            return n
    return None


# --------------------------------------------------------------------------------------------
# Rules. Each returns an IndexMap (letters not yet sized) or None (no rule applies).
# --------------------------------------------------------------------------------------------

_ELEMENTWISE = frozenset(
    """add sub mul div true_divide pow tanh gelu relu silu sigmoid exp log log1p neg rsqrt sqrt
    where eq ne lt le gt ge logical_and logical_or logical_not __and__ __or__ bitwise_and
    bitwise_or bitwise_not masked_fill clamp clamp_min clamp_max softplus erf sin cos abs
    reciprocal maximum minimum dropout native_dropout hardtanh leaky_relu elu mish square
    add_ mul_ sub_ div_ fill_ zeros_like ones_like full_like empty_like rand_like randn_like
    type_as lerp addcmul addcdiv sign floor ceil round trunc isnan isinf nan_to_num tril triu
    silu_ relu_ gelu_ copy_ rsub remainder fmod sgn exp2 expm1 log2 log10 sinh cosh atan
    asin acos tan bitwise_xor logical_xor hardswish hardsigmoid""".split()
)
# element-wise ops that are linear in their tensor inputs (P passes through)
_LINEAR_ELEMENTWISE = frozenset("add sub neg add_ sub_ rsub".split())
_LINEAR_WITH_SCALAR = frozenset("mul div true_divide mul_ div_".split())
_IDENTITY = frozenset(
    "clone contiguous alias detach to _to_copy lift_fresh_copy _to_dim_order_copy".split()
)
_CREATION = frozenset(
    """arange zeros ones full empty scalar_tensor randn rand randint new_ones new_zeros new_empty
    new_full linspace eye tensor randperm full_like_creation""".split()
)
# ops with a known rule that is: keep everything replicated (gathers/scatters by index)
_REPLICATED_ONLY = frozenset(
    """index index_select gather scatter scatter_add index_put index_put_ nonzero masked_select
    masked_scatter take embedding_bag roll flip argsort sort topk multinomial""".split()
)
_SUM_REDUCTIONS = frozenset("sum mean".split())
_OTHER_REDUCTIONS = frozenset(
    "amax amin max min argmax argmin var std any all prod logsumexp norm var_mean std_mean".split()
)
_DIM_FIXED = frozenset(
    "softmax _softmax log_softmax _log_softmax cumsum cumprod diff _safe_softmax".split()
)
_VIEWS = frozenset("view _unsafe_view reshape flatten unflatten expand expand_as view_as".split())
_CONTRACTION_EQUATIONS = {
    "mm": "mk,kn->mn",
    "bmm": "bmk,bkn->bmn",
}


def _elementwise(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    out_shape = _output_shapes(node)[0]
    out_letters = maker.many(len(out_shape))
    fixed: set[str] = set()
    inputs: dict[str, Letters | None] = {}
    for inp in _tensor_inputs(node):
        if op in ("zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like"):
            inputs[inp.name] = None
            continue
        inputs[inp.name] = _broadcast_letters(_shape(inp), out_letters, out_shape, maker, fixed)
    if op in ("tril", "triu"):
        fixed.update(out_letters[-2:])
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    linear = op in _LINEAR_ELEMENTWISE or (op in _LINEAR_WITH_SCALAR and len(tensor_args) == 1)
    return IndexMap(inputs, (out_letters,), fixed=frozenset(fixed), linear=linear)


def _identity(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    inputs = _tensor_inputs(node)
    letters = maker.many(len(_output_shapes(node)[0]))
    return IndexMap({inputs[0].name: letters}, (letters,), linear=True)


def _creation(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    outs = tuple(maker.many(len(s)) for s in _output_shapes(node))
    fixed = frozenset(letter for out in outs for letter in out)
    return IndexMap({inp.name: None for inp in _tensor_inputs(node)}, outs, fixed=fixed)


def _replicated(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    inputs = {inp.name: maker.many(len(_shape(inp))) for inp in _tensor_inputs(node)}
    outs = tuple(maker.many(len(s)) for s in _output_shapes(node))
    fixed = frozenset(x for letters in list(inputs.values()) + list(outs) for x in letters)
    return IndexMap(inputs, outs, fixed=fixed)


def _reduction(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    in_letters = maker.many(len(shape))
    dims_arg = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if op in ("max", "min") and dims_arg is None:
        dims_arg = None
    if isinstance(dims_arg, fx.Node):
        return _replicated(node, maker)
    dims = _dims_arg(dims_arg, len(shape))
    keepdim = bool(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], bool) else bool(
        node.kwargs.get("keepdim", False))
    outs = []
    for out_shape in _output_shapes(node):
        if keepdim:
            letters = tuple(maker.fresh() if i in dims else l for i, l in enumerate(in_letters))
        else:
            letters = tuple(l for i, l in enumerate(in_letters) if i not in dims)
        outs.append(letters if len(letters) == len(out_shape) else maker.many(len(out_shape)))
    reduced = frozenset(in_letters[d] for d in dims)
    fixed_new = frozenset(x for out in outs for x in out if x not in in_letters)
    if op in _SUM_REDUCTIONS:
        return IndexMap({src.name: in_letters}, tuple(outs), reducible=reduced, fixed=fixed_new, linear=True)
    return IndexMap({src.name: in_letters}, tuple(outs), fixed=reduced | fixed_new)


def _dim_fixed(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    fixed = {letters[_dim(int(dim), len(shape))]} if shape else set()
    out_shape = _output_shapes(node)[0]
    out = letters if len(out_shape) == len(shape) else maker.many(len(out_shape))
    if out is not letters:
        fixed.update(out)
    return IndexMap({src.name: letters}, (out,), fixed=frozenset(fixed))


def _view_groups(src: tuple[int, ...], dst: tuple[int, ...]) -> list[tuple[list[int], list[int]]] | None:
    """Pair runs of input dims with runs of output dims of equal product (size-1 dims alone)."""
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


def _view(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    in_shape = _shape(src)
    out_shape = _output_shapes(node)[0]
    groups = _view_groups(in_shape, out_shape)
    if groups is None:
        return _replicated(node, maker)
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
        fixed.update(l for d in gi[1:] for l in [in_letters[d]])
        fixed.update(l for d in gj[1:] for l in [out_letters[d]])
    return IndexMap({src.name: tuple(in_letters)}, (tuple(out_letters),), fixed=frozenset(fixed), linear=True)


def _permute(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    ndim = len(_shape(src))
    letters = maker.many(ndim)
    if op == "permute":
        order = [_dim(int(d), ndim) for d in node.args[1]]
    elif op == "t" or op == "numpy_T":
        order = list(range(ndim))[::-1]
    else:  # transpose / swapaxes
        a, b = _dim(int(node.args[1]), ndim), _dim(int(node.args[2]), ndim)
        order = list(range(ndim))
        order[a], order[b] = order[b], order[a]
    return IndexMap({src.name: letters}, (tuple(letters[d] for d in order),), linear=True)


def _squeeze_unsqueeze(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    # size-1 dims come and go; the view grouping handles them.
    return _view(node, maker)


def _slice_like(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    dim = _dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(shape))
    out_shape = _output_shapes(node)[0]
    if op == "select":
        out = tuple(l for i, l in enumerate(letters) if i != dim)
        return IndexMap({src.name: letters}, (out,), fixed=frozenset({letters[dim]}), linear=True)
    if op == "slice" and out_shape == shape:
        return IndexMap({src.name: letters}, (letters,), linear=True)
    out = tuple(maker.fresh() if i == dim else l for i, l in enumerate(letters))
    return IndexMap({src.name: letters}, (out,), fixed=frozenset({letters[dim], out[dim]}), linear=True)


def _split(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    dim = _dim(int(node.args[2]) if len(node.args) > 2 else int(node.kwargs.get("dim", 0)), len(shape))
    outs = []
    fixed = {letters[dim]}
    for _ in _output_shapes(node):
        out = tuple(maker.fresh() if i == dim else l for i, l in enumerate(letters))
        fixed.add(out[dim])
        outs.append(out)
    return IndexMap({src.name: letters}, tuple(outs), fixed=frozenset(fixed), linear=True)


def _unbind(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    dim = _dim(int(node.args[1]) if len(node.args) > 1 else 0, len(shape))
    out = tuple(l for i, l in enumerate(letters) if i != dim)
    return IndexMap({src.name: letters}, tuple(out for _ in _output_shapes(node)),
                    fixed=frozenset({letters[dim]}), linear=True)


def _cat(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    tensors = [t for t in node.args[0] if isinstance(t, fx.Node)]
    out_shape = _output_shapes(node)[0]
    out = maker.many(len(out_shape))
    dim = _dim(int(node.args[1]) if len(node.args) > 1 else int(node.kwargs.get("dim", 0)), len(out_shape))
    fixed = {out[dim]}
    inputs: dict[str, Letters | None] = {}
    for t in tensors:
        if op == "stack":
            letters = tuple(l for i, l in enumerate(out) if i != dim)
        else:
            letters = tuple(maker.fresh() if i == dim else l for i, l in enumerate(out))
            fixed.add(letters[dim])
        inputs[t.name] = letters
    return IndexMap(inputs, (out,), fixed=frozenset(fixed), linear=True)


def _einsum_map(node: fx.Node, operands: Sequence[fx.Node], equation: str) -> IndexMap:
    lhs, rhs = equation.replace(" ", "").split("->")
    in_terms = lhs.split(",")
    if len(in_terms) != len(operands) or "." in equation:
        raise ValueError(f"unsupported einsum {equation!r}")
    inputs: dict[str, Letters | None] = {}
    for term, operand in zip(in_terms, operands):
        letters = tuple(term)
        if operand.name in inputs and inputs[operand.name] != letters:
            raise ValueError("operand used twice with different letters")
        inputs[operand.name] = letters
    out = tuple(rhs)
    reducible = frozenset(x for term in in_terms for x in term if x not in rhs)
    return IndexMap(inputs, (out,), reducible=reducible)


def _batch_letters(n: int) -> str:
    return "".join(chr(ord("A") + i) for i in range(n))


def _linear(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    batch = _batch_letters(len(_shape(x)) - 1)
    inputs: dict[str, Letters | None] = {x.name: tuple(batch + "k"), w.name: ("n", "k")}
    if isinstance(b, fx.Node):
        inputs[b.name] = ("n",)
    return IndexMap(inputs, (tuple(batch + "n"),), reducible=frozenset("k"), addends=_names(b))


def _addmm(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    bias, x, w = node.args[0], node.args[1], node.args[2]
    inputs: dict[str, Letters | None] = {x.name: ("m", "k"), w.name: ("k", "n")}
    fixed: set[str] = set()
    if isinstance(bias, fx.Node):
        inputs[bias.name] = _broadcast_letters(_shape(bias), ("m", "n"), _output_shapes(node)[0], maker, fixed)
    return IndexMap(inputs, (("m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed), addends=_names(bias))


def _names(*nodes: object) -> frozenset[str]:
    return frozenset(n.name for n in nodes if isinstance(n, fx.Node))


def _matmul(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    a, b = node.args[0], node.args[1]
    sa, sb = _shape(a), _shape(b)
    out_shape = _output_shapes(node)[0]
    if len(sa) < 2 or len(sb) < 2:
        return _replicated(node, maker)
    nb = len(out_shape) - 2
    batch = _batch_letters(nb)
    fixed: set[str] = set()
    a_batch = _broadcast_letters(sa[:-2], tuple(batch), out_shape[:-2], maker, fixed)
    b_batch = _broadcast_letters(sb[:-2], tuple(batch), out_shape[:-2], maker, fixed)
    inputs: dict[str, Letters | None] = {a.name: a_batch + ("m", "k")}
    if b.name in inputs:
        return _replicated(node, maker)
    inputs[b.name] = b_batch + ("k", "n")
    return IndexMap(inputs, (tuple(batch) + ("m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed))


def _baddbmm(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    bias, x, w = node.args[0], node.args[1], node.args[2]
    inputs: dict[str, Letters | None] = {x.name: ("b", "m", "k"), w.name: ("b", "k", "n")}
    fixed: set[str] = set()
    if isinstance(bias, fx.Node):
        inputs[bias.name] = _broadcast_letters(_shape(bias), ("b", "m", "n"), _output_shapes(node)[0], maker, fixed)
    return IndexMap(inputs, (("b", "m", "n"),), reducible=frozenset("k"), fixed=frozenset(fixed),
                    addends=_names(bias))


def _embedding(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    weight, indices = node.args[0], node.args[1]
    batch = _batch_letters(len(_shape(indices)))
    return IndexMap({weight.name: ("v", "d"), indices.name: tuple(batch)}, (tuple(batch) + ("d",),),
                    reducible=frozenset("v"), whole_grads=frozenset("v"))


def _conv(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    x, w = node.args[0], node.args[1]
    b = node.args[2] if len(node.args) > 2 else None
    spatial = len(_shape(x)) - 2
    groups = 1
    if str(node.target).startswith("aten.convolution"):
        groups = int(node.args[8]) if len(node.args) > 8 else 1
        if len(node.args) > 6 and node.args[6]:  # transposed convolution
            return _replicated(node, maker)
    elif len(node.args) > 6:
        groups = int(node.args[6])
    x_sp, w_sp, o_sp = maker.many(spatial), maker.many(spatial), maker.many(spatial)
    channel = "c" if groups == 1 else maker.fresh()
    inputs: dict[str, Letters | None] = {x.name: ("N", channel) + x_sp, w.name: ("O", "c") + w_sp}
    if isinstance(b, fx.Node):
        inputs[b.name] = ("O",)
    # Only the batch letter N is shardable. Channel sharding (input channels "c" → partial sums,
    # output channels "O" → a column-sharded weight) is correct mathematics, but DTensor cannot
    # run it: its convolution handler (torch/distributed/tensor/_tp_conv.py) runs the local conv
    # on the local tensors as they are, with the output placed like the INPUT and the weight
    # assumed replicated. A channel-sharded input then fails ("Expected cond to be True" in
    # _maybe_unpad_tensor, "expected input to have 8 channels, but got 4", or "Stride must be 1
    # when there is padding" from its width-halo path), and an S(0) weight gives a silently
    # mislabelled output (O/n channels locally, declared replicated). So channels stay whole.
    fixed = set(x_sp) | set(w_sp) | set(o_sp) | {channel, "c", "O"}
    return IndexMap(inputs, (("N", "O") + o_sp,), fixed=frozenset(fixed), addends=_names(b))


def _pool(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    outs = []
    fixed = set(letters[2:])
    for out_shape in _output_shapes(node):
        out = letters[:2] + maker.many(len(out_shape) - 2)
        fixed.update(out[2:])
        outs.append(out)
    return IndexMap({src.name: letters}, tuple(outs), fixed=frozenset(fixed))


def _layer_norm(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    x = node.args[0]
    shape = _shape(x)
    normalized = len(node.args[1])
    letters = maker.many(len(shape))
    norm_letters = letters[len(shape) - normalized:]
    inputs: dict[str, Letters | None] = {x.name: letters}
    for extra in node.args[2:4]:
        if isinstance(extra, fx.Node):
            inputs[extra.name] = norm_letters
    outs = [letters]
    fixed = set(norm_letters)
    for out_shape in _output_shapes(node)[1:]:  # native_layer_norm's mean / rstd
        out = letters[: len(shape) - normalized] + maker.many(len(out_shape) - (len(shape) - normalized))
        fixed.update(out[len(shape) - normalized:])
        outs.append(out)
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


def _rms_norm(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    return _layer_norm(node, maker)


def _batch_norm(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    """Training batch norm computes statistics over N and the spatial dims: only the channel
    dim may be sharded if results are to equal the single device's."""
    x = node.args[0]
    shape = _shape(x)
    letters = ("N", "C") + maker.many(len(shape) - 2)
    inputs: dict[str, Letters | None] = {x.name: letters}
    for extra in node.args[1:5]:
        if isinstance(extra, fx.Node):
            inputs[extra.name] = ("C",)
    outs = [letters] + [("C",) if len(s) == 1 else maker.many(len(s)) for s in _output_shapes(node)[1:]]
    fixed = {"N"} | set(letters[2:]) | {x for out in outs[1:] for x in out if x != "C"}
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


def _sdpa(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    nb = len(_shape(q)) - 2
    batch = tuple(_batch_letters(nb))
    fixed = {"l", "s", "e", "f"}
    inputs: dict[str, Letters | None] = {}
    for t, tail in ((q, ("l", "e")), (k, ("s", "e")), (v, ("s", "f"))):
        letters = _broadcast_letters(_shape(t)[:-2], batch, _shape(q)[:-2], maker, fixed) + tail
        if t.name in inputs and inputs[t.name] != letters:
            return _replicated(node, maker)
        inputs[t.name] = letters
    if isinstance(mask, fx.Node):
        mshape = _shape(mask)
        full = batch + ("l", "s")
        inputs[mask.name] = _broadcast_letters(mshape, full, _shape(q)[:-1] + (_shape(k)[-2],), maker, fixed)
    outs = [batch + ("l", "f")]
    for out_shape in _output_shapes(node)[1:]:
        extra = maker.many(len(out_shape))
        fixed.update(extra)
        outs.append(extra)
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


_MEAN = 1  # ATen's Reduction::Mean


def _loss(node: fx.Node, op: str, maker: _LetterMaker) -> IndexMap:
    """cross_entropy_loss / nll_loss (input [N, C, *d], target [N, *d]) and mse/l1 losses."""
    tensors = _tensor_inputs(node)
    out_shape = _output_shapes(node)[0]
    if op in ("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy",
              "binary_cross_entropy_with_logits"):
        shape = _shape(tensors[0])
        letters = maker.many(len(shape))
        fixed: set[str] = set()
        inputs = {t.name: _broadcast_letters(_shape(t), letters, shape, maker, fixed) for t in tensors}
        if out_shape == ():
            return IndexMap(inputs, ((),), reducible=frozenset(letters), fixed=frozenset(fixed))
        return IndexMap(inputs, (letters,), fixed=frozenset(fixed))
    x, target = node.args[0], node.args[1]
    xs = _shape(x)
    rest = maker.many(max(len(xs) - 2, 0))
    x_letters = ("N", "C") + rest if len(xs) >= 2 else ("C",)
    t_letters = ("N",) + rest if len(xs) >= 2 else ()
    inputs = {x.name: x_letters, target.name: t_letters}
    weight = node.args[2] if len(node.args) > 2 else node.kwargs.get("weight")
    if isinstance(weight, fx.Node):
        inputs[weight.name] = ("C",)
    if out_shape == ():
        reduction = node.args[3] if len(node.args) > 3 else node.kwargs.get("reduction", _MEAN)
        counted = frozenset(("N",) + rest) if reduction == _MEAN else frozenset()
        return IndexMap(inputs, ((),), reducible=frozenset(("N",) + rest), fixed=frozenset({"C"}), counted=counted)
    return IndexMap(inputs, (("N",) + rest,), fixed=frozenset({"C"}))


def _einsum(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    equation, operands = node.args[0], list(node.args[1])
    return _einsum_map(node, operands, str(equation))


_RULES: dict[str, Callable[[fx.Node, _LetterMaker], IndexMap]] = {
    "linear": _linear,
    "addmm": _addmm,
    "matmul": _matmul,
    "baddbmm": _baddbmm,
    "embedding": _embedding,
    "conv1d": _conv,
    "conv2d": _conv,
    "conv3d": _conv,
    "convolution": _conv,
    "layer_norm": _layer_norm,
    "native_layer_norm": _layer_norm,
    "rms_norm": _rms_norm,
    "group_norm": lambda n, m: _replicated(n, m),
    "batch_norm": _batch_norm,
    "native_batch_norm": _batch_norm,
    "_native_batch_norm_legit_functional": _batch_norm,
    "_native_batch_norm_legit_no_training": _batch_norm,
    "scaled_dot_product_attention": _sdpa,
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa,
    "_scaled_dot_product_efficient_attention": _sdpa,
    "_scaled_dot_product_flash_attention": _sdpa,
    "einsum": _einsum,
    "split": _split,
    "split_with_sizes": _split,
    "chunk": _split,
    "unbind": _unbind,
    "squeeze": _squeeze_unsqueeze,
    "unsqueeze": _squeeze_unsqueeze,
    "pad": lambda n, m: _pad(n, m),
    "constant_pad_nd": lambda n, m: _pad(n, m),
}


def _pad(node: fx.Node, maker: _LetterMaker) -> IndexMap:
    src = _tensor_inputs(node)[0]
    shape = _shape(src)
    letters = maker.many(len(shape))
    pads = list(node.args[1])
    padded = {len(shape) - 1 - i // 2 for i, p in enumerate(pads) if p}
    out = tuple(maker.fresh() if d in padded else l for d, l in enumerate(letters))
    fixed = {letters[d] for d in padded} | {out[d] for d in padded}
    return IndexMap({src.name: letters}, (out,), fixed=frozenset(fixed))


def op_name(node: fx.Node) -> str:
    """The ATen overload-packet name of a call_function node (``"linear"``), or the Python
    function's name for non-ATen targets (``"getitem"``)."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return str(packet.__name__)
    return getattr(target, "__name__", str(target))


def index_map_for(node: fx.Node) -> IndexMap | None:
    """The index map of a call_function node, or ``None`` when the planner has no rule."""
    op = op_name(node)
    maker = _LetterMaker()
    imap: IndexMap | None
    if op in _RULES:
        imap = _RULES[op](node, maker)
    elif op in _CONTRACTION_EQUATIONS:
        imap = _einsum_map(node, [node.args[0], node.args[1]], _CONTRACTION_EQUATIONS[op])
    elif op in _ELEMENTWISE:
        imap = _elementwise(node, op, maker)
    elif op in _IDENTITY:
        imap = _identity(node, maker)
    elif op in _CREATION:
        imap = _creation(node, maker)
    elif op in _REPLICATED_ONLY:
        imap = _replicated(node, maker)
    elif op in _SUM_REDUCTIONS or op in _OTHER_REDUCTIONS:
        imap = _reduction(node, op, maker)
    elif op in _DIM_FIXED:
        imap = _dim_fixed(node, maker)
    elif op in _VIEWS:
        imap = _view(node, maker)
    elif op in ("transpose", "permute", "t", "swapaxes", "numpy_T"):
        imap = _permute(node, op, maker)
    elif op in ("slice", "select", "narrow"):
        imap = _slice_like(node, op, maker)
    elif op in ("cat", "concat", "stack"):
        imap = _cat(node, op, maker)
    elif op in ("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "mse_loss", "l1_loss",
                "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "binary_cross_entropy_with_logits"):
        imap = _loss(node, op, maker)
    elif op in ("adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "avg_pool1d",
                "avg_pool2d", "avg_pool3d", "max_pool1d", "max_pool2d", "max_pool3d",
                "max_pool2d_with_indices", "adaptive_max_pool2d", "upsample_nearest2d",
                "upsample_bilinear2d"):
        imap = _pool(node, maker)
    else:
        return None
    return _finish(imap, node)
