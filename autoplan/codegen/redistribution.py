"""Redistributing DTensors as the plan says: placements from plan.json, a rank's slice of the
global batch, and the planned redistribution of each edge with its backward (the gradient is
brought back to the producer's placement in one step, so the backward runs the collectives the
plan lists)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement as DPlacement

from autoplan.errors import AutoplanError
from autoplan.sharding import P, R, S, ShardingSpec, parse_placement, reduce_scatter_first


def to_dtensor_placements(specs: Sequence[str]) -> tuple[DPlacement, ...]:
    """Plan placement strings (``"R"``, ``"S(1)"``, ``"P"``) → DTensor placements."""
    out: list[DPlacement] = []
    for text in specs:
        p = parse_placement(text)
        if p.is_replicate:
            out.append(Replicate())
        elif p.is_shard:
            out.append(Shard(p.dim))
        else:
            out.append(Partial())
    return tuple(out)


def shard_batch(tensor: torch.Tensor, placements: Sequence[str | DPlacement], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of a global ``tensor`` under ``placements`` (no communication).

    ``placements`` are plan strings or DTensor placements, one per mesh axis; the tensor is cut
    like ``distribute_tensor`` cuts it (``torch.chunk`` order over the mesh axes)."""
    dplacements = to_dtensor_placements(placements) if placements and isinstance(placements[0], str) \
        else tuple(placements)  # type: ignore[arg-type]
    if any(isinstance(p, Partial) for p in dplacements):
        raise AutoplanError("a batch cannot be cut into partial sums: give R or S(d) placements")
    return distribute_tensor(tensor.detach(), mesh, dplacements, src_data_rank=None).to_local()


def _planned_spec(placements: Sequence[DPlacement]) -> ShardingSpec:
    return tuple(S(p.dim) if isinstance(p, Shard) else P if isinstance(p, Partial) else R for p in placements)


def reduce_to(value: DTensor, mesh: DeviceMesh, target: Sequence[DPlacement], async_op: bool = False) -> DTensor:
    """``value.redistribute(mesh, target)``, with partial sums reduce-scattered before other
    axes are all-reduced where the cost model orders them so
    (:func:`~autoplan.sharding.reduce_scatter_first`: HSDP's gradient is reduce-scattered over
    the sharding axis, then its shard all-reduced over the replicating one). ``async_op``: the
    last collective is launched and awaited where its result is first read (a parameter's
    gradient reduction, which the backward of the ops before runs beside:
    :mod:`~autoplan.cost_models.backward_overlap`)."""
    first = reduce_scatter_first(_planned_spec(value.placements), _planned_spec(target))
    if first:
        value = value.redistribute(mesh, [t if i in first else c
                                          for i, (c, t) in enumerate(zip(value.placements, target))])
    return value.redistribute(mesh, tuple(target), async_op=async_op)


def _target(placements: Sequence[str]) -> tuple[DPlacement, ...]:
    return to_dtensor_placements(placements)


def redistribute(value: Any, specs: list[str] | None, mesh: DeviceMesh,
                 grad_target: tuple[DPlacement, ...] | None = None, param_dtype: torch.dtype | None = None) -> Any:
    """Bring one op input to the placements the plan chose for it; in the backward, bring its
    gradient to the producer's placement, or to ``grad_target`` (a parameter whose gradient
    the plan stores sharded, ZeRO-2) (:class:`_PlannedRedistribute`). A parameter moves as
    ``param_dtype`` where given (the plan's bf16: :func:`_moved_as`), its gradient in its own."""
    if isinstance(value, DTensor) and value.requires_grad and specs is not None and _changes(value, specs):
        return _PlannedRedistribute.apply(value, specs, mesh, grad_target, param_dtype)
    return _moved_as(value, specs, mesh, param_dtype)


def _moved_as(value: Any, specs: list[str] | None, mesh: DeviceMesh, param_dtype: torch.dtype | None) -> Any:
    """``value`` redistributed to ``specs``; a floating-point parameter's elements moved as
    ``param_dtype`` (cast before its collectives, as FSDP2's ``MixedPrecisionPolicy`` gathers
    bf16 parameters, and back to the parameter's own dtype after, so the consumer computes as
    the single-device model does under ``torch.autocast``: its bf16 cast of the parameter is
    the same). Only a resharding that moves the parameter's shards (a gather, an all-to-all)
    casts: cutting a replicated one moves nothing."""
    if param_dtype is None or not isinstance(value, torch.nn.Parameter) or not isinstance(value, DTensor) \
            or value.dtype == param_dtype or not value.dtype.is_floating_point or specs is None \
            or not any(isinstance(c, Shard) and t != c for c, t in zip(value.placements, _target(specs))):
        return _redistribute_value(value, specs, mesh)
    return _redistribute_value(value.to(param_dtype), specs, mesh).to(value.dtype)


def _changes(value: DTensor, specs: list[str]) -> bool:
    """Whether ``specs`` ask a floating DTensor for other placements ("P" keeps a partial one)."""
    target = _target(specs)
    return len(target) != len(value.placements) or any(
        not (isinstance(t, Partial) and isinstance(c, Partial)) and t != c for c, t in zip(value.placements, target))


def launches_reduction(value: Any) -> bool:
    """Whether the gradient of ``value`` is reduced without being awaited at once: a
    parameter's, on a GPU (NCCL runs the collective on its own stream beside the backward).
    Gloo's collectives are awaited where they are launched: its asynchronous ones run on a pool
    of threads, where reduce-scatters launched back to back have been seen to deadlock two
    processes, and on a CPU the plan hides nothing behind them."""
    return isinstance(value, torch.nn.Parameter) and value.device.type == "cuda"


class _PlannedRedistribute(torch.autograd.Function):
    """One edge of the plan as one autograd node: the forward is the planned resharding
    (:func:`_redistribute_value`, run without recording its steps); the backward brings the
    incoming gradient, whatever placement the consumer's backward left it in (partial sums
    included), straight to the producer's placement with partial → replicated, in one DTensor
    redistribution: the collectives the plan costs for the edge's backward (``g_dst → g_src``),
    no more.

    (DTensor's own chain of redistributions and local conversions would each convert the
    gradient back in turn, and let a partial gradient flow on unreduced into the producer's
    backward, reducing it wherever a later step first needs it, often in another collective.)

    A parameter's gradient reduction on a GPU is launched and not awaited: the backward of the
    ops before runs while it is in flight, as the plan costs it
    (:mod:`~autoplan.cost_models.backward_overlap`; :func:`launches_reduction`)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, specs: list[str], mesh: DeviceMesh,  # type: ignore[override]
                grad_target: tuple[DPlacement, ...] | None, param_dtype: torch.dtype | None) -> DTensor:
        ctx.target = grad_target or tuple(Replicate() if p.is_partial() else p for p in value.placements)
        ctx.mesh = mesh
        ctx.launched = launches_reduction(value)
        return _moved_as(value, specs, mesh, param_dtype)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None, None]:  # type: ignore[override]
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.target:
            # Redistribute gives the gradient's GLOBAL stride to the contiguous LOCAL result of
            # its collective: gradients of transposed values must be made contiguous first
            grad = _contiguous(grad) if not grad.is_contiguous() else grad
            grad = reduce_to(grad, ctx.mesh, ctx.target, async_op=ctx.launched)
        return grad, None, None, None, None


def reduce_gradient_on_edge(before: Any, after: Any, target: tuple[DPlacement, ...] | None = None) -> Any:
    """An edge the forward does not reshard, whose consumer leaves partial gradients: reduce
    them at once, into the producer's placement (partial → replicated), as the plan costs it,
    or into ``target`` (a parameter whose gradient the plan stores sharded, ZeRO-2: a
    reduce-scatter).

    DTensor alone would let a partial gradient flow on through the producer's backward
    (views, adds and other ops linear in the gradient keep it partial) and reduce it wherever a
    later redistribution or op first needs it: often an edge or two upstream and in another
    collective. The consumer reads its own alias of the value, so the reduction happens before
    gradients from several consumers are summed. (A resharded edge does this in
    :class:`_PlannedRedistribute`.)"""
    if not (after is before and isinstance(after, DTensor) and after.requires_grad):
        return after
    if target is None:
        target = tuple(Replicate() if p.is_partial() else p for p in before.placements)
    mesh = after.device_mesh
    launched = launches_reduction(before)
    after = after.view_as(after)

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != target:
            return reduce_to(grad, mesh, target, async_op=launched)
        return grad

    after.register_hook(reduce)
    return after


def unmask_partial(value: Any) -> Any:
    """A masked partial → a plain ``Partial(sum)``, locally.

    DTensor's embedding with a vocabulary-sharded table returns a ``_MaskPartial``: each rank's
    rows for indices outside its shard are garbage until a reduction zeroes them with the mask
    of the LOCAL indices. Such a value cannot leave the op safely: DTensor redistributes mesh
    axis by mesh axis, and gathering another axis first changes the local shape so the mask no
    longer fits ("The shape of the mask [4] at index 0 does not match the shape of the indexed
    tensor [8, 16]"); it does not mix with a plain partial in an ``add``; a partial gradient
    cannot be redistributed back to it ("Redistribution from one partial type (P(sum)) to
    another (MaskP(...)) is unsupported"); and its mask is released by the first reduction, so
    a second consumer fails. Zeroing the masked rows at once makes the value an ordinary sum of
    per-rank addends. The gradient passes through unmasked and replicated, as DTensor's own
    backward of the reduction gives it (the embedding's backward reads the full indices)."""
    if not isinstance(value, DTensor):
        return value
    axes = [i for i, p in enumerate(value.placements) if isinstance(p, Partial) and type(p) is not Partial]
    if not axes:
        return value
    local = value.to_local()
    drop = torch.zeros((), dtype=torch.bool)
    for i in axes:
        buffer = value.placements[i].mask_buffer
        mask = buffer.data
        if mask is None:
            raise AutoplanError(f"a masked partial value lost its mask: {value.placements}")
        # release it as DTensor's reduction would: the placement object lives on in DTensor's
        # sharding cache, and the next embedding with this spec must find it empty ("MaskBuffer
        # has been materialized with conflicting data")
        buffer.release_mask()
        drop = drop | mask.reshape(tuple(mask.shape) + (1,) * (local.ndim - mask.ndim))
    local = local - torch.where(drop, local, torch.zeros((), dtype=local.dtype)).detach()
    placements = [Partial(p.reduce_op) if i in axes else p for i, p in enumerate(value.placements)]
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _redistribute_value(value: Any, specs: list[str] | None, mesh: DeviceMesh) -> Any:
    if specs is None or not isinstance(value, torch.Tensor):
        return value
    target = list(_target(specs))
    if not isinstance(value, DTensor):
        # A tensor made inside the graph (arange, zeros, a lifted constant): the same on every
        # rank, so it is replicated; cutting it to a shard needs no communication.
        value = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    current = value.placements
    if len(target) != len(current):
        raise AutoplanError(f"plan gives {len(target)} placements for a value on a {mesh.ndim}-D mesh")
    # "P" in the plan means "partial, any reduction": keep a Partial DTensor's own reduce op (a
    # mean's Partial("avg") must not be read as a sum). Integer tensors have no partial form.
    for i, (cur, tgt) in enumerate(zip(current, target)):
        if isinstance(tgt, Partial):
            if isinstance(cur, Partial):
                target[i] = cur
            elif not value.dtype.is_floating_point and not value.dtype.is_complex:
                target[i] = Replicate()
    if tuple(target) == tuple(current):
        return value
    # DTensor's Redistribute keeps the input's GLOBAL stride for its output (and, in the backward,
    # for the gradient), while a collective leaves a contiguous LOCAL tensor: for a transposed
    # input the two disagree, and a later view (a ``reshape`` that the global stride declares
    # viewable) fails on the local tensor, e.g. the backward of ``q.view(b, t, h, d).transpose(1,
    # 2)`` in attention. Redistributing a contiguous value keeps global and local layouts alike.
    if not value.is_contiguous():
        value = _contiguous(value)
    # Shard → Partial needs no communication: each rank holds its shard in place, zeros elsewhere
    # (DTensor itself would all-gather first).
    for i, (c, t) in enumerate(zip(current, target)):
        if isinstance(t, Partial) and isinstance(c, Shard) and _can_pad(value, i, mesh):
            value = _shard_to_partial(value, i, mesh)
    current = value.placements
    to_partial = [i for i, (c, t) in enumerate(zip(current, target))
                  if isinstance(t, Partial) and not isinstance(c, Partial)]
    if not to_partial:
        return reduce_to(value, mesh, target)
    # DTensor's public redistribute refuses to make a Partial. Go to Replicate on those axes
    # (the others to their target), then split the value into n addends of value / n.
    mid = [Replicate() if i in to_partial else t for i, t in enumerate(target)]
    if tuple(mid) != tuple(current):
        value = value.redistribute(mesh, mid)
    return _replicate_to_partial(value, to_partial, target, mesh)


def _contiguous(value: DTensor) -> DTensor:
    """``value`` with a contiguous layout. DTensor's own ``contiguous`` replicates a partial
    value (an all-reduce the plan does not ask for): copy the local tensor instead; the
    gradient of a partial value is replicated."""
    if not any(p.is_partial() for p in value.placements):
        return value.contiguous()
    grad_placements = [Replicate() if p.is_partial() else p for p in value.placements]
    local = value.to_local(grad_placements=grad_placements).contiguous()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=torch.empty(value.shape, device="meta").stride())


def _can_pad(value: DTensor, axis: int, mesh: DeviceMesh) -> bool:
    dim = value.placements[axis].dim
    alone = all(not (isinstance(p, Shard) and p.dim == dim) for j, p in enumerate(value.placements) if j != axis)
    return alone and value.shape[dim] % mesh.size(axis) == 0


def _shard_to_partial(value: DTensor, axis: int, mesh: DeviceMesh) -> DTensor:
    """Shard(d) → Partial(sum) on mesh axis ``axis``, locally: the shard padded with zeros to the
    full size of dim d. Its gradient is the slice of the (replicated) gradient."""
    dim = value.placements[axis].dim
    n, coord = mesh.size(axis), mesh.get_local_rank(axis)
    local = value.to_local()
    size = local.shape[dim]
    before = list(local.shape)
    before[dim] = coord * size
    after = list(local.shape)
    after[dim] = (n - 1 - coord) * size
    padded = torch.cat([local.new_zeros(before), local, local.new_zeros(after)], dim=dim)
    placements = list(value.placements)
    placements[axis] = Partial()
    return DTensor.from_local(padded, mesh, placements, run_check=False, shape=value.shape,
                              stride=torch.empty(value.shape, device="meta").stride())


def _replicate_to_partial(value: DTensor, axes: list[int], target: Sequence[DPlacement],
                          mesh: DeviceMesh) -> DTensor:
    """Replicate → Partial(sum) on ``axes``: each rank holds value / n.

    Autograd: the gradient of a partial value is replicated (every addend receives the whole
    gradient), and so is the gradient that reaches the replicated value: the local gradient
    passes through unscaled and stays replicated, with no communication, as the plan counts
    it. (Scaling it by 1/n and declaring it partial would be correct too, but would cost an
    all-reduce in the backward, e.g. for a replicated bias added to a row-sharded matmul.)"""
    n = 1
    for i in axes:
        n *= mesh.size(i)
    # the other axes: as the value is placed, except that a partial value's gradient is
    # replicated; declaring it partial would sum it n times.
    grad_placements = [Replicate() if isinstance(p, Partial) else p for p in value.placements]
    local = value.to_local(grad_placements=grad_placements)
    # forward: local / n; backward: the identity
    split = local.detach() / n + (local - local.detach())
    return DTensor.from_local(split, mesh, list(target), run_check=False,
                              shape=value.shape, stride=value.stride())


def spec_text(placements: Sequence[DPlacement]) -> str:
    return "".join("R" if p.is_replicate() else f"S{p.dim}" if p.is_shard() else "P" for p in placements)
