"""Rules for neural-network ops: normalisation, attention, losses and pooling.

Layer and RMS norms keep their normalised dims whole; training batch norm keeps the batch and
spatial dims whole (its statistics run over them), so only channels may be sharded.
Attention shards its batch and head dims; the sequence and feature dims stay whole. A
loss reduced to a scalar is a sum over the batch (partial sums), and a mean loss also counts
its targets over the batch (``counted``).
"""

from __future__ import annotations

from types import MappingProxyType

from torch import fx

from autoplan.strategies.letters import (IndexMap, LetterMaker, Letters, Rule, batch_letters, broadcast_letters,
    op_name, output_shapes, replicated_map, rule_table, tensor_inputs, tensor_shape)

_MEAN = 1  # ATen's Reduction::Mean
_ELEMENTWISE_LOSSES = frozenset(
    "mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits kl_div".split()
)
_CLASS_LOSSES = frozenset("cross_entropy_loss nll_loss nll_loss_nd nll_loss2d".split())
POOLS = frozenset(
    """adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d avg_pool1d avg_pool2d avg_pool3d
    max_pool1d max_pool2d max_pool3d max_pool2d_with_indices adaptive_max_pool2d upsample_nearest2d
    upsample_bilinear2d""".split()
)


def layer_norm(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """layer_norm, native_layer_norm (with its mean and rstd outputs) and rms_norm."""
    x = node.args[0]
    shape = tensor_shape(x)
    normalized = len(node.args[1])
    letters = maker.many(len(shape))
    kept = len(shape) - normalized
    norm_letters = letters[kept:]
    inputs: dict[str, Letters | None] = {x.name: letters}
    for extra in node.args[2:4]:
        if isinstance(extra, fx.Node):
            inputs[extra.name] = norm_letters
    outs = [letters]
    fixed = set(norm_letters)
    for out_shape in output_shapes(node)[1:]:  # native_layer_norm's mean / rstd
        out = letters[:kept] + maker.many(len(out_shape) - kept)
        fixed.update(out[kept:])
        outs.append(out)
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


def batch_norm(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """Training batch norm computes statistics over N and the spatial dims: only the channel
    dim may be sharded if results are to equal the single device's."""
    x = node.args[0]
    shape = tensor_shape(x)
    letters = ("N", "C") + maker.many(len(shape) - 2)
    inputs: dict[str, Letters | None] = {x.name: letters}
    for extra in node.args[1:5]:
        if isinstance(extra, fx.Node):
            inputs[extra.name] = ("C",)
    outs = [letters] + [("C",) if len(s) == 1 else maker.many(len(s)) for s in output_shapes(node)[1:]]
    fixed = {"N"} | set(letters[2:]) | {x for out in outs[1:] for x in out if x != "C"}
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


def attention(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """``softmax(q kᵀ + mask) v`` per batch and head: q ``[…, l, e]``, k ``[…, s, e]``,
    v ``[…, s, f]``; k and v may have fewer heads (broadcast, so their head dim stays whole)."""
    q, k, v = node.args[0], node.args[1], node.args[2]
    mask = node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")
    q_shape = tensor_shape(q)
    batch = tuple(batch_letters(len(q_shape) - 2))
    fixed = {"l", "s", "e", "f"}
    inputs: dict[str, Letters | None] = {}
    for t, tail in ((q, ("l", "e")), (k, ("s", "e")), (v, ("s", "f"))):
        letters = broadcast_letters(tensor_shape(t)[:-2], batch, q_shape[:-2], maker, fixed) + tail
        if t.name in inputs and inputs[t.name] != letters:
            return replicated_map(node, maker)
        inputs[t.name] = letters
    if isinstance(mask, fx.Node):
        full = batch + ("l", "s")
        inputs[mask.name] = broadcast_letters(tensor_shape(mask), full, q_shape[:-1] + (tensor_shape(k)[-2],),
                                              maker, fixed)
    outs = [batch + ("l", "f")]
    for out_shape in output_shapes(node)[1:]:
        extra = maker.many(len(out_shape))
        fixed.update(extra)
        outs.append(extra)
    return IndexMap(inputs, tuple(outs), fixed=frozenset(fixed))


def loss(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """cross_entropy_loss / nll_loss (input [N, C, *d], target [N, *d]) and element-wise losses."""
    tensors = tensor_inputs(node)
    out_shape = output_shapes(node)[0]
    if op_name(node) in _ELEMENTWISE_LOSSES:
        shape = tensor_shape(tensors[0])
        letters = maker.many(len(shape))
        fixed: set[str] = set()
        inputs = {t.name: broadcast_letters(tensor_shape(t), letters, shape, maker, fixed) for t in tensors}
        if out_shape == ():
            return IndexMap(inputs, ((),), reducible=frozenset(letters), fixed=frozenset(fixed))
        return IndexMap(inputs, (letters,), fixed=frozenset(fixed))
    x, target = node.args[0], node.args[1]
    xs = tensor_shape(x)
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


def pair_loss(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """cosine_embedding_loss / margin_ranking_loss / hinge_embedding_loss: inputs ``[N, D]``
    (or ``[N]``) with a target ``[N]``; per-sample terms summed (or averaged) over ``N``. Only
    the samples may be split; a per-sample output (no reduction) keeps ``N``."""
    tensors = tensor_inputs(node)
    first = tensor_shape(tensors[0])
    if not first:
        return replicated_map(node, maker)
    letters = ("N",) + maker.many(len(first) - 1)
    fixed: set[str] = set(letters[1:])
    inputs: dict[str, Letters | None] = {}
    for t in tensors:  # the inputs are [N, D] like the first, the target [N]
        shape = tensor_shape(t)
        inputs[t.name] = letters[:len(shape)] if shape == first[:len(shape)] else maker.many(len(shape))
        fixed.update(x for x in inputs[t.name] if x not in letters)
    if output_shapes(node)[0] == ():
        return IndexMap(inputs, ((),), reducible=frozenset({"N"}), fixed=frozenset(fixed))
    return IndexMap(inputs, (("N",),), fixed=frozenset(fixed))


def pool(node: fx.Node, maker: LetterMaker) -> IndexMap:
    """Pooling and upsampling: batch and channels follow, spatial dims stay whole."""
    src = tensor_inputs(node)[0]
    letters = maker.many(len(tensor_shape(src)))
    outs = []
    fixed = set(letters[2:])
    for out_shape in output_shapes(node):
        out = letters[:2] + maker.many(len(out_shape) - 2)
        fixed.update(out[2:])
        outs.append(out)
    return IndexMap({src.name: letters}, tuple(outs), fixed=frozenset(fixed))


RULES: MappingProxyType[str, Rule] = rule_table([
    (frozenset({"layer_norm", "native_layer_norm", "rms_norm"}), layer_norm),
    (frozenset({"batch_norm", "native_batch_norm", "_native_batch_norm_legit_functional", "_native_batch_norm_legit_no_training"}), batch_norm),
    (frozenset({"group_norm"}), replicated_map),
    (frozenset({"scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention"}), attention),
    (_ELEMENTWISE_LOSSES | _CLASS_LOSSES, loss), (POOLS, pool),
    (frozenset({"cosine_embedding_loss", "margin_ranking_loss", "hinge_embedding_loss"}), pair_loss)])
