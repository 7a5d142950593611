"""How the program calls each planned op: on DTensors, or on local tensors where DTensor
cannot run it.

Some ops are replaced before they run (``REPLACED_OPS``): ``view`` by ``reshape``, and the
element-wise losses without a DTensor rule by their ATen decompositions.

Ops DTensor has no sharding rule for run on each rank's local tensors, as the plan says.

DTensor runs an op only where it has a strategy for it (or can trace one through the op's
decomposition), and the op's backward needs one too: ``hardswish_backward``,
``log_sigmoid_backward``, ``mkldnn_rnn_layer``, ``as_strided_`` and custom ops such as
transformers' ``grouped_mm_fallback`` have none. The plan already fixed how each input arrives
and how each output leaves, and its strategy is valid for the op (the op's index map says which
dims are independent), so the op can run on the local shards:

- each input arrives in the planned placements (the program's redistribution), and
  ``to_local(grad_placements=...)`` hands its gradient back as the plan says it leaves: a shard
  where the input is sharded, partial sums on the mesh axes where the op's backward leaves them
  (``NodePlan.grad_partial``: the input was whole but the output sharded), else replicated;
- the op and its backward run on plain tensors, recorded by autograd as usual;
- each tensor output becomes a DTensor with its planned placements (``from_local``).

A strategy with a partial output (``P``) is not run this way: a local mean is not a partial
sum of the global one. Such ops stay with DTensor, except a mixture-of-experts layer's experts
traced as one op (:mod:`autoplan.trace.experts`): DTensor has no rule for it, and on a shard of
the experts it computes their contributions, partial sums of the output by its math
(:func:`call_experts_locally`).
"""

from __future__ import annotations

from collections.abc import Callable
from types import MappingProxyType
from typing import Any

import torch
from torch._decomp import get_decompositions
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Placement

from autoplan.codegen.redistribution import to_dtensor_placements
from autoplan.plan_schema import NodePlan
from autoplan.trace.experts import EXPERTS_OP, local_experts_forward

__all__ = ["REPLACED_OPS", "call_planned_op", "has_dtensor_rule", "runs_locally", "call_locally",
           "call_experts_locally"]

# The tracer drops ``.contiguous()`` nodes (their presence depends on the tracing device), so a
# ``view`` may meet a non-contiguous tensor (after a transpose): run it as ``reshape``, which is a
# view whenever one is possible and has the same DTensor sharding rule.
# Element-wise losses without a DTensor rule run as their ATen decompositions (differences,
# powers, means), whose DTensor rules count a mean over the GLOBAL number of elements in the
# backward too.
_DECOMPOSED_LOSSES = (torch.ops.aten.mse_loss.default, torch.ops.aten.smooth_l1_loss.default,
                      torch.ops.aten.huber_loss.default, torch.ops.aten.binary_cross_entropy.default)


def _bce_with_logits(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                     pos_weight: torch.Tensor | None = None, reduction: int = 1) -> torch.Tensor:
    """``binary_cross_entropy_with_logits`` from ops whose backward DTensor can shard (torch's
    decomposition uses ``log_sigmoid``, whose backward has no rule): ``-log σ(x)`` as
    ``relu(-x) + log1p(exp(-|x|))``. ``reduction``: 0 none, 1 mean, 2 sum."""
    minus_log_sigmoid = torch.relu(-x) + torch.log1p(torch.exp(-torch.abs(x)))
    scale = minus_log_sigmoid if pos_weight is None else ((pos_weight - 1) * target + 1) * minus_log_sigmoid
    loss = (1 - target) * x + scale
    if weight is not None:
        loss = loss * weight
    return loss.mean() if reduction == 1 else loss.sum() if reduction == 2 else loss


_MEAN, _SUM = 1, 2  # ATen's Reduction


def _cross_entropy_over_counted_targets(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                                        reduction: int = _MEAN, ignore_index: int = -100,
                                        label_smoothing: float = 0.0) -> torch.Tensor:
    """A mean ``cross_entropy_loss`` as the sum of its terms over the number of targets it does
    not ignore, that count taken over the whole batch. DTensor's own rule averages the shards'
    means, which is the batch's mean only when every shard counts as many targets; here the
    sum stays partial and the count is all-reduced in the forward (the plan's "loss count")."""
    if reduction != _MEAN or weight is not None:
        return torch.ops.aten.cross_entropy_loss.default(x, target, weight, reduction, ignore_index, label_smoothing)
    summed = torch.ops.aten.cross_entropy_loss.default(x, target, None, _SUM, ignore_index, label_smoothing)
    return summed / _batch_count(target, ignore_index)


def _batch_count(target: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """How many targets of the whole batch are not ``ignore_index`` (all-reduced where
    ``target`` is sharded)."""
    count = (target != ignore_index).sum()
    if isinstance(count, DTensor):
        count = count.redistribute(count.device_mesh, [Replicate()] * count.device_mesh.ndim)
    return count


def _nll_over_counted_targets(op: torch._ops.OpOverload) -> Callable[..., torch.Tensor]:
    """``op`` (an ``nll_loss`` overload) averaged as :func:`_cross_entropy_over_counted_targets`
    averages ``cross_entropy_loss``: its partial sum over the whole batch's count."""

    def counted(x: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                reduction: int = _MEAN, ignore_index: int = -100) -> torch.Tensor:
        if reduction != _MEAN or weight is not None:
            return op(x, target, weight, reduction, ignore_index)
        return op(x, target, None, _SUM, ignore_index) / _batch_count(target, ignore_index)

    return counted


REPLACED_OPS = MappingProxyType({
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
    torch.ops.aten.cross_entropy_loss.default: _cross_entropy_over_counted_targets,
    **{op: _nll_over_counted_targets(op) for op in (torch.ops.aten.nll_loss.default, torch.ops.aten.nll_loss_nd.default,
                                                    torch.ops.aten.nll_loss2d.default)},
    torch.ops.aten.binary_cross_entropy_with_logits.default: _bce_with_logits,
    **get_decompositions(_DECOMPOSED_LOSSES),
})


def has_dtensor_rule(op: Any) -> bool:
    """Whether DTensor has a strategy of its own for ``op`` (an ATen overload); ops it would
    only decompose, or not run at all, count as without."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    return (op in propagator.op_strategy_funcs or op in propagator.op_to_rules
            or op in getattr(propagator, "op_single_dim_strategy_funcs", {}))


def _backward_lacks_rule(op: torch._ops.OpOverload) -> bool:
    """Whether the op's own backward (``hardsigmoid`` → ``hardsigmoid_backward``) is an ATen op
    DTensor has no rule of its own for (its decomposition path fails on some, such as
    ``hardsigmoid_backward``): the forward would run, the backward fail."""
    packet = getattr(torch.ops.aten, f"{op._schema.name.split('::')[-1]}_backward", None)
    if packet is None:
        return False
    overloads = [getattr(packet, name) for name in packet.overloads()]
    composite = torch._C.DispatchKey.CompositeImplicitAutograd  # decomposes into ops with rules
    return not any(has_dtensor_rule(o) or o.has_kernel_for_dispatch_key(composite) for o in overloads)


def runs_locally(op: Any, node_plan: NodePlan) -> bool:
    """Whether the program runs this op on local tensors: the planned strategy leaves no
    output as partial sums, and DTensor has no rule of its own for the op or for its backward.
    A CompositeImplicitAutograd op (``linear``, ``lstm``) decomposes before autograd records
    it, so DTensor meets its parts; it runs locally only when planned replicated throughout
    (``lstm``'s parts, ``mkldnn_rnn_layer``, have no rule)."""
    if not isinstance(op, torch._ops.OpOverload) or any("P" in spec for spec in node_plan.outputs):
        return False
    if has_dtensor_rule(op) and not _backward_lacks_rule(op):
        return False
    if op.has_kernel_for_dispatch_key(torch._C.DispatchKey.CompositeImplicitAutograd):
        return all(p == "R" for specs in [*node_plan.inputs, *node_plan.outputs] if specs for p in specs)
    return True


def _grad_placements(specs: list[str], partial_axes: list[int]) -> tuple[Placement, ...]:
    placements = list(to_dtensor_placements(specs))
    for axis in partial_axes:
        placements[axis] = Partial()
    return tuple(placements)


def call_locally(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], node_plan: NodePlan,
                 tensor_inputs: list[Any], mesh: DeviceMesh) -> Any:
    """``op(*args, **kwargs)`` on local tensors (see the module docstring); ``tensor_inputs``
    are the DTensor inputs in the order of ``node_plan.inputs``."""
    local: dict[int, torch.Tensor] = {}
    for pos, value in enumerate(tensor_inputs):
        if isinstance(value, DTensor) and id(value) not in local:
            specs = node_plan.inputs[pos] or [spec_of(p) for p in value.placements]
            partial = node_plan.grad_partial[pos] if pos < len(node_plan.grad_partial) else []
            local[id(value)] = value.to_local(grad_placements=_grad_placements(specs, partial))

    def unwrap(value: Any) -> Any:
        if isinstance(value, DTensor):
            return local.get(id(value), value.to_local())
        if isinstance(value, (list, tuple)):
            return type(value)(unwrap(v) for v in value)
        return value

    out = op(*unwrap(args), **{k: unwrap(v) for k, v in kwargs.items()})
    specs = iter(node_plan.outputs)

    def wrap(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            placements = to_dtensor_placements(next(specs, ["R"] * mesh.ndim))
            return DTensor.from_local(value, mesh, placements, run_check=False)
        if isinstance(value, (list, tuple)):
            return type(value)(wrap(v) for v in value)
        return value

    return wrap(out)


def call_experts_locally(args: tuple[Any, ...], kwargs: dict[str, Any], node_plan: NodePlan,
                         tensor_inputs: list[Any], mesh: DeviceMesh) -> Any:
    """``autoplan::moe_experts`` on local tensors (:func:`call_locally`): this rank's experts
    are those of its shard of the up projection's weight (``args[3]``), from the shard's offset
    on; the output leaves in the planned placements, partial sums on the axes sharding the
    experts."""
    weight = args[3]
    first, total = 0, weight.shape[0]
    if isinstance(weight, DTensor):
        _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
        first = int(offset[0])

    def experts(*local_args: Any) -> torch.Tensor:
        return local_experts_forward(*local_args, first_expert=first, num_experts=total)
    return call_locally(experts, args, kwargs, node_plan, tensor_inputs, mesh)


def spec_of(placement: Placement) -> str:
    """A DTensor placement as the plan writes it."""
    if placement.is_shard():
        return f"S({placement.dim})"
    return "P" if placement.is_partial() else "R"


def call_planned_op(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any], node_plan: NodePlan,
                    tensor_inputs: list[Any], mesh: DeviceMesh) -> Any:
    """One planned op, its inputs already in their planned placements: on local tensors where
    :func:`runs_locally` says so, else on DTensors (``REPLACED_OPS`` applied)."""
    if op is EXPERTS_OP:
        return call_experts_locally(args, kwargs, node_plan, tensor_inputs, mesh)
    if runs_locally(op, node_plan):
        return call_locally(op, args, kwargs, node_plan, tensor_inputs, mesh)
    return REPLACED_OPS.get(op, op)(*args, **kwargs)
