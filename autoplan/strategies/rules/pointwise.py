"""Rules for element-wise ops (they follow their inputs), creation ops, reductions, and ops
that keep one dim whole (softmax, cumsum).

Element-wise inputs broadcast against the output right-aligned; ``add``/``sub`` of two
tensors and scaling by a constant are linear (partial sums pass through); a number added to
partial sums is not (it would be added once per rank). A ``sum``/``mean`` over a sharded dim
leaves partial sums; other reductions (``amax``, ``var``, …) keep their reduced dims whole.
Casts, aliases and a ``contiguous`` of a contiguous value pass partial sums; a ``clone`` and a
``contiguous`` that copies do not: DTensor reduces partial sums before it copies.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import (IndexMap, LetterMaker, Letters, Rule, broadcast_letters, copies_its_input,
    dims_arg, normalize_dim, op_name, output_shapes, replicated_map, rule_table, tensor_inputs, tensor_shape)

ELEMENTWISE = frozenset(
    """add sub mul div true_divide pow tanh gelu relu silu sigmoid exp log log1p neg rsqrt sqrt
    where eq ne lt le gt ge logical_and logical_or logical_not __and__ __or__ bitwise_and
    bitwise_or bitwise_not masked_fill clamp clamp_min clamp_max softplus erf sin cos abs
    reciprocal maximum minimum dropout native_dropout hardtanh leaky_relu elu mish square
    add_ mul_ sub_ div_ fill_ zeros_like ones_like full_like empty_like rand_like randn_like
    type_as lerp addcmul addcdiv sign floor ceil round trunc isnan isinf nan_to_num tril triu
    silu_ relu_ gelu_ copy_ rsub remainder fmod sgn exp2 expm1 log2 log10 sinh cosh atan
    asin acos tan bitwise_xor logical_xor hardswish hardsigmoid floor_divide floor_divide_ masked_fill_""".split()
)
# element-wise ops that are linear in their tensor inputs (P passes through)
_LINEAR_ELEMENTWISE = frozenset("add sub neg add_ sub_ rsub".split())
_LINEAR_WITH_SCALAR = frozenset("mul div true_divide mul_ div_".split())
# *_like ops read only their input's shape
_SHAPE_ONLY = frozenset("zeros_like ones_like full_like empty_like rand_like randn_like".split())
IDENTITY = frozenset("clone contiguous alias detach to _to_copy lift_fresh_copy _to_dim_order_copy".split())
CREATION = frozenset(
    """arange zeros ones full empty scalar_tensor randn rand randint new_ones new_zeros new_empty
    new_full linspace eye tensor randperm full_like_creation""".split()
)
# ops with a known rule that is: keep everything replicated (gathers/scatters by index;
# ``scatter`` and ``scatter_`` have their own rule in :mod:`autoplan.strategies.rules.moe`)
REPLICATED_ONLY = frozenset(
    """index index_select gather scatter_add index_put index_put_ nonzero masked_select
    masked_scatter take embedding_bag roll flip argsort sort topk multinomial""".split()
)
SUM_REDUCTIONS = frozenset("sum mean".split())
OTHER_REDUCTIONS = frozenset(
    "amax amin max min argmax argmin var std any all prod logsumexp norm var_mean std_mean".split()
)
DIM_FIXED = frozenset("softmax _softmax log_softmax _log_softmax cumsum cumprod diff _safe_softmax".split())


def elementwise(node: fx.Node, maker: LetterMaker) -> IndexMap:
    op = op_name(node)
    out_shape = output_shapes(node)[0]
    out_letters = maker.many(len(out_shape))
    fixed: set[str] = set()
    inputs: dict[str, Letters | None] = {}
    for inp in tensor_inputs(node):
        if op in _SHAPE_ONLY:
            inputs[inp.name] = None
            continue
        inputs[inp.name] = broadcast_letters(tensor_shape(inp), out_letters, out_shape, maker, fixed)
    if op in ("tril", "triu"):
        fixed.update(out_letters[-2:])
    tensor_args = [a for a in node.args if isinstance(a, fx.Node)]
    # div with a rounding mode (floor / trunc) is not linear: floor(a/2) + floor(b/2) != floor((a+b)/2)
    rounded = node.kwargs.get("rounding_mode") is not None
    # a number added to partial sums would be added once per rank (x + eps: an RMSNorm's variance)
    adds_number = op != "neg" and len(tensor_args) < 2
    linear = (op in _LINEAR_ELEMENTWISE and not adds_number) or \
        (op in _LINEAR_WITH_SCALAR and len(tensor_args) == 1 and not rounded)
    return IndexMap(inputs, (out_letters,), fixed=frozenset(fixed), linear=linear)


def broadcast_tensors(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``broadcast_tensors``: every output has the common shape, output ``i`` input ``i``
    expanded into it (dims an input expands from size 1 stay whole)."""
    shapes = output_shapes(node)
    out_letters = maker.many(len(shapes[0]))
    fixed: set[str] = set()
    inputs: dict[str, Letters | None] = {
        inp.name: broadcast_letters(tensor_shape(inp), out_letters, shapes[0], maker, fixed)
        for inp in tensor_inputs(node)}
    return IndexMap(inputs, tuple(out_letters for _ in shapes), fixed=frozenset(fixed))


def identity(node: fx.Node, maker: LetterMaker) -> IndexMap:
    inputs = tensor_inputs(node)
    letters = maker.many(len(output_shapes(node)[0]))
    op = op_name(node)
    linear = op != "clone" and not (op == "contiguous" and copies_its_input(node))
    return IndexMap({inputs[0].name: letters}, (letters,), linear=linear)


def creation(node: fx.Node, maker: LetterMaker) -> IndexMap:
    outs = tuple(maker.many(len(s)) for s in output_shapes(node))
    fixed = frozenset(letter for out in outs for letter in out)
    return IndexMap({inp.name: None for inp in tensor_inputs(node)}, outs, fixed=fixed)


def reduction(node: fx.Node, maker: LetterMaker) -> IndexMap:
    op = op_name(node)
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    in_letters = maker.many(len(shape))
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    if isinstance(dims, fx.Node):
        return replicated_map(node, maker)
    reduced_dims = dims_arg(dims, len(shape))
    keepdim = bool(node.args[2]) if len(node.args) > 2 and isinstance(node.args[2], bool) else bool(
        node.kwargs.get("keepdim", False))
    outs = []
    for out_shape in output_shapes(node):
        if keepdim:
            letters = tuple(maker.fresh() if i in reduced_dims else x for i, x in enumerate(in_letters))
        else:
            letters = tuple(x for i, x in enumerate(in_letters) if i not in reduced_dims)
        outs.append(letters if len(letters) == len(out_shape) else maker.many(len(out_shape)))
    reduced = frozenset(in_letters[d] for d in reduced_dims)
    fixed_new = frozenset(x for out in outs for x in out if x not in in_letters)
    if op in SUM_REDUCTIONS:
        return IndexMap({src.name: in_letters}, tuple(outs), reducible=reduced, fixed=fixed_new, linear=True)
    return IndexMap({src.name: in_letters}, tuple(outs), fixed=reduced | fixed_new)


def dim_fixed(node: fx.Node, maker: LetterMaker) -> IndexMap:
    src = tensor_inputs(node)[0]
    shape = tensor_shape(src)
    letters = maker.many(len(shape))
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    fixed = {letters[normalize_dim(int(dim), len(shape))]} if shape else set()
    out_shape = output_shapes(node)[0]
    out = letters if len(out_shape) == len(shape) else maker.many(len(out_shape))
    if out is not letters:
        fixed.update(out)
    return IndexMap({src.name: letters}, (out,), fixed=frozenset(fixed))


RULES: MappingProxyType[str, Rule] = rule_table([(ELEMENTWISE, elementwise), (IDENTITY, identity),
    (CREATION, creation), (REPLICATED_ONLY, replicated_map), (SUM_REDUCTIONS | OTHER_REDUCTIONS, reduction),
    (DIM_FIXED, dim_fixed), (frozenset({"broadcast_tensors"}), broadcast_tensors)])
