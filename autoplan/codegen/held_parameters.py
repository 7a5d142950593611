"""Parameters gathered once per step and held through its microbatches (FSDP under a pipeline).

A plan may store a parameter sharded over a mesh axis (its optimizer state's placements, the
shard the optimizer steps) and have every microbatch read it whole there
(:attr:`~autoplan.plan_schema.ParamStorage.held`). This is FSDP2 composed with
``torch.distributed.pipelining`` as torchtitan composes them: ``reshard_after_forward=False``
keeps a stage's parameters gathered across the microbatches of a step, and the schedule turns
gradient synchronisation off until the last microbatch, so each parameter is all-gathered once
per step and its gradient reduce-scattered once per step, not once per microbatch.

:class:`HeldParameter` carries it out for one parameter:

- :meth:`gather`, before the schedule runs: the stored shard cast to the plan's parameter dtype
  (bf16 under a bf16 plan, FSDP2's ``MixedPrecisionPolicy.param_dtype``) and all-gathered into
  the placements the plan reads it in, held without autograd history (the planned all-gather);
- :meth:`read`, in every microbatch's forward: the held copy cast back to the parameter's dtype
  for the consumer (:class:`_HeldRead`), whose ``torch.autocast`` cast of it is then the one the
  single-device model makes; its backward adds the incoming gradient, in the parameter's dtype
  (fp32: FSDP2's ``reduce_dtype``), to the step's accumulated gradient, in whatever placements
  the consumer's backward left it (partial sums over the batch axes);
- :meth:`reduce_gradient`, after the last microbatch: the accumulated gradient reduced into the
  stored shard's placements (a reduce-scatter where it is partial sums, the planned one) and
  handed to the parameter's ``.grad``; the held copy and the accumulated gradient are released.

Saved tensors: a consumer's saved read (or autocast's cast of it) is packed as the recipe to
take it from the held copy again (:mod:`autoplan.codegen.parameter_regather`), so it costs no
memory beyond the held copy, which lives through the step anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from autoplan.codegen.redistribution import reduce_to, to_dtensor_placements
from autoplan.plan_schema import ParamStorage


class _HeldRead(torch.autograd.Function):
    """The held copy as the consumer reads it: cast to the parameter's dtype in the forward;
    the gradient goes to :meth:`HeldParameter.accumulate` in the backward. The stored shard
    (``anchor``) is an input so that autograd runs this backward, also where a schedule splits
    the backward and differentiates the stage's parameters on their own (torch's zero-bubble
    schedules): it gets zeros (a local shard of zeros, no communication), the step's reduced
    gradient is added to them after the last microbatch."""

    @staticmethod
    def forward(ctx: Any, copy: DTensor, anchor: torch.Tensor, held: HeldParameter) -> DTensor:
        ctx.held = held
        ctx.anchor = anchor
        return copy.to(anchor.dtype)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[None, torch.Tensor, None]:
        ctx.held.accumulate(grad)
        return None, torch.zeros_like(ctx.anchor), None


class HeldParameter:
    """One held parameter of this rank: the stored shard ``param`` (an ``nn.Parameter`` in its
    stored placements) and the placements ``read`` every microbatch reads it in."""

    def __init__(self, param: torch.nn.Parameter, read: Sequence[Placement], dtype: torch.dtype | None) -> None:
        self.param = param
        self.read_placements = tuple(read)
        self.dtype = dtype or param.dtype  # what the held copy is kept (and gathered) in
        self.copy: DTensor | None = None
        self.grad: DTensor | None = None

    def gather(self) -> None:
        """The planned all-gather of the step: the stored shard, cast, into the read placements."""
        with torch.no_grad():
            shard = self.param.detach().to(self.dtype)
            self.copy = shard.redistribute(shard.device_mesh, self.read_placements)

    def read(self) -> DTensor:
        if self.copy is None:  # a forward outside a training step
            self.gather()
        return _HeldRead.apply(self.copy, self.param, self)

    def accumulate(self, grad: DTensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad

    def reduce_gradient(self) -> None:
        """The accumulated gradient into the stored placements, added to ``param.grad``; the
        held copy released."""
        grad, self.grad, self.copy = self.grad, None, None
        if grad is None:
            return
        reduced = reduce_to(grad, self.param.device_mesh, self.param.placements).to(self.param.dtype)
        self.param.grad = reduced if self.param.grad is None else self.param.grad + reduced


def held_parameters(plan_storage: Mapping[str, ParamStorage], params: Mapping[str, torch.Tensor],
                    dtype: torch.dtype | None) -> dict[str, HeldParameter]:
    """The held parameters among ``params`` (by FQN, stored in their optimizer state's
    placements), each kept as ``dtype`` (None: its own) while held."""
    out: dict[str, HeldParameter] = {}
    for fqn, storage in plan_storage.items():
        param = params.get(fqn)
        if storage.held and isinstance(param, torch.nn.Parameter) and param.requires_grad:
            out[fqn] = HeldParameter(param, to_dtensor_placements(storage.param), dtype)
    return out
