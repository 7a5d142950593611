"""The forward FLOPs and the bytes moved of one fx node.

FLOPs come from ``torch.utils.flop_counter``'s formulas, plus formulas for the composite ops
that export's training IR keeps but the flop counter only knows decomposed (linear, matmul,
attention, convolutions, einsum), and for the experts of mixture-of-experts layers (grouped
matrix products, and the experts traced as one op: :mod:`autoplan.trace.experts`). A formula
that fails on a node counts 0 FLOPs for it and warns (:class:`FlopCountWarning`), naming the
op. Bytes are those of the distinct tensor
inputs read plus the tensor outputs written.
"""

from __future__ import annotations

import math
import operator
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
from torch.utils.flop_counter import conv_flop_count, flop_registry

from autoplan.load import _first_line
from autoplan.trace.experts import EXPERTS_OP, experts_flops
from autoplan.trace.values import fake_arguments, first_tensor, int_shape, nbytes, tensors_in

__all__ = ["FlopCountWarning", "node_bytes", "node_flops"]

aten = torch.ops.aten


class FlopCountWarning(UserWarning):
    """A FLOP formula failed on an op: the op is counted as 0 FLOPs."""


def _linear_flops(args: tuple, kwargs: dict, out: Any) -> float:
    """``2 · rows(x) · out_features · in_features``."""
    x, w = args[0], args[1]
    return 2.0 * math.prod(int_shape(x)[:-1]) * w.shape[0] * w.shape[-1]


def _matmul_flops(args: tuple, kwargs: dict, out: Any) -> float:
    """``2 · numel(out) · k`` (``2k`` for a dot product of two vectors)."""
    a, b = args[0], args[1]
    k = a.shape[-1]
    if a.dim() == 1 and b.dim() == 1:
        return 2.0 * k
    return 2.0 * out.numel() * k


def _sdpa_flops(args: tuple, kwargs: dict, out: Any) -> float:
    """``q kᵀ`` then probabilities ``· v``, per query head (grouped-query attention included):
    ``2 · rows(q) · s_k · (e + f)``. Like torch.utils.flop_counter, causal masking is not
    discounted."""
    q, k, v = args[0], args[1], args[2]
    rows = math.prod(int_shape(q)[:-1])
    s_k = k.shape[-2]
    return 2.0 * rows * s_k * (q.shape[-1] + v.shape[-1])


def _conv_shapes(args: tuple, out: Any) -> tuple[list[int], list[int], list[int]]:
    x, w = args[0], args[1]
    x_shape, out_shape = list(int_shape(x)), list(int_shape(first_tensor(out)))
    if len(x_shape) == w.dim() - 1:  # unbatched input
        x_shape, out_shape = [1, *x_shape], [1, *out_shape]
    return x_shape, list(int_shape(w)), out_shape


def _conv_nd_flops(args: tuple, kwargs: dict, out: Any) -> float:
    return float(conv_flop_count(*_conv_shapes(args, out), transposed=False))


def _conv_transpose_nd_flops(args: tuple, kwargs: dict, out: Any) -> float:
    return float(conv_flop_count(*_conv_shapes(args, out), transposed=True))


def _einsum_flops(args: tuple, kwargs: dict, out: Any) -> float:
    """``2 · Π(letter sizes) · (operands - 1)``: every product of the operands, summed.
    Equations with an ellipsis count 0."""
    equation, operands = args[0], args[1]
    if len(operands) < 2:
        return 0.0
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if any("..." in term for term in inputs):
        return 0.0
    sizes: dict[str, int] = {}
    for term, t in zip(inputs, operands):
        for letter, size in zip(term, t.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    return 2.0 * math.prod(sizes.values()) * (len(operands) - 1)


def _grouped_mm_flops(args: tuple, kwargs: dict, out: Any) -> float:
    """``aten._grouped_mm`` and transformers' ``grouped_mm_fallback``: every row (2-D × 3-D,
    groups of rows: a mixture of experts' forward), every column (3-D × 2-D) or every slice of
    the contraction (2-D × 2-D) meets one group's matrix; 3-D × 3-D is a batched product.
    (Rows past the last offset, which the product skips, are counted too.)"""
    a, b = args[0].shape, args[1].shape
    if (len(a), len(b)) == (2, 3):
        return 2.0 * a[0] * a[1] * b[2]
    if (len(a), len(b)) == (3, 3):
        return 2.0 * a[0] * a[1] * a[2] * b[2]
    if (len(a), len(b)) == (2, 2):
        return 2.0 * a[0] * a[1] * b[1]
    if (len(a), len(b)) == (3, 2):
        return 2.0 * a[1] * a[2] * b[1]
    raise ValueError(f"grouped product of ranks {len(a)} and {len(b)}")


# formulas of ops outside ATen that may not be registered when this module loads, by name
_EXTRA_FLOPS_BY_NAME: dict[str, Callable[[tuple, dict, Any], float]] = {
    "transformers::grouped_mm_fallback": _grouped_mm_flops,
}

_EXTRA_FLOPS: dict[Any, Callable[[tuple, dict, Any], float]] = {
    aten._grouped_mm: _grouped_mm_flops,
    aten.linear: _linear_flops,
    aten.matmul: _matmul_flops,
    aten.scaled_dot_product_attention: _sdpa_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
    aten._scaled_dot_product_attention_math: _sdpa_flops,
    aten.conv1d: _conv_nd_flops,
    aten.conv2d: _conv_nd_flops,
    aten.conv3d: _conv_nd_flops,
    aten.conv_transpose1d: _conv_transpose_nd_flops,
    aten.conv_transpose2d: _conv_transpose_nd_flops,
    aten.conv_transpose3d: _conv_transpose_nd_flops,
    aten.einsum: _einsum_flops,
    EXPERTS_OP.overloadpacket: lambda args, kwargs, out: experts_flops(args[1], args[3], args[4]),
}


def node_flops(node: torch.fx.Node) -> float:
    """Forward FLOPs of a call_function node; 0 for ops no formula counts. A formula that
    raises on the node counts 0 and warns with a :class:`FlopCountWarning` naming the op."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0.0
    packet = target.overloadpacket
    extra = _EXTRA_FLOPS.get(packet) or _EXTRA_FLOPS_BY_NAME.get(target.name())
    registered = None if extra is not None else flop_registry.get(packet)
    if extra is None and registered is None:
        return 0.0
    args, kwargs = fake_arguments(node.args), fake_arguments(node.kwargs)
    out = node.meta.get("val")
    try:
        if extra is not None:
            return float(extra(args, kwargs, out))
        # as FlopCounterMode calls them: the op's args and kwargs, out_val the op's output
        return float(registered(*args, **kwargs, out_val=out))
    except Exception as e:  # an unusual overload the formula does not understand
        warnings.warn(f"no FLOP count for {target} (node {node.name}): {type(e).__name__}: {_first_line(e)}; "
                      f"counted as 0 FLOPs", FlopCountWarning, stacklevel=2)
        return 0.0


def node_bytes(node: torch.fx.Node) -> float:
    """Bytes read (distinct tensor inputs) plus bytes written (tensor outputs)."""
    if node.op == "placeholder":
        return float(sum(nbytes(t) for t in tensors_in(node.meta.get("val"))))
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    total = 0
    for inp in node.all_input_nodes:
        total += sum(nbytes(t) for t in tensors_in(inp.meta.get("val")))
    total += sum(nbytes(t) for t in tensors_in(node.meta.get("val")))
    return float(total)
