"""Gradient accumulation on PyTorch's own data-parallel programs: a plan of one stage whose
step runs its microbatches one after another (:attr:`~autoplan.plan_schema.Plan.microbatches`),
recognised as DDP, FSDP, HSDP, ZeRO-2 or FSDP x TP on one microbatch
(:func:`~autoplan.codegen.native_patterns.recognise`), runs the
:class:`~autoplan.codegen.native.NativeProgram` of that microbatch once per microbatch, each
microbatch's loss weighted by its share of the step's
(:func:`~autoplan.codegen.loss_weights.microbatch_weights`), and tells DDP and FSDP2 which
backward ends the step, so that each reduces and gathers as often as the plan says:

- DDP: the plan all-reduces a replicated parameter's gradient once per step, after the last
  microbatch; the microbatches before it run under ``no_sync()`` (the gradients accumulate on
  every rank) and the last one's backward all-reduces the sums, bucket by bucket.
- FSDP, HSDP and FSDP x TP (``reshard_after_forward=True``): the plan gathers every parameter
  before each microbatch's forward and again before its backward, and reduce-scatters its
  gradient after every microbatch, summing into the shard (no whole gradient outlives a
  microbatch): FSDP2's own behaviour, nothing to tell. (The tensor axis's collectives run in
  every microbatch, as planned.)
- Parameters a 1-D FSDP plan keeps whole beside the sharded ones (:mod:`autoplan.codegen.native_fsdp`):
  their gradients are all-reduced once per step, as DDP's; their ``replicate`` modules are told
  to skip the reduction (``set_requires_gradient_sync``) but for the last microbatch.
- ZeRO-2 (``reshard_after_forward=False``): the plan holds every parameter whole through the
  step and reduce-scatters each microbatch's gradient into its shard; FSDP2 gathers a group
  before the first forward and, told not to reshard after the backward of any microbatch but
  the last (``set_reshard_after_backward``), holds it through the others, reduce-scattering
  after each.
- Parameters held gathered through the step (:attr:`~autoplan.plan_schema.ParamStorage.held`:
  stored sharded, gathered once a step, their gradients accumulated whole and reduced into
  the shard once, after the last microbatch) on a 1-D mesh (HSDP and FSDP x TP so held stay on
  the interpreter): FSDP2 with ``reshard_after_forward=False``,
  told for every microbatch but the last neither to reshard after the backward nor to reduce
  (``set_requires_gradient_sync``): it gathers each group before the first forward, keeps the
  gathered parameters and their summed gradients (in the reduction's dtype) through the
  others, and reduce-scatters the sum in the last backward.

Every other pattern runs on the interpreter inside ``torch.distributed.pipelining``'s schedule.
"""

from __future__ import annotations

from collections import Counter
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch.distributed._composable.replicate_with_fsdp import ReplicateModule
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from autoplan.codegen.loss_weights import microbatch_weights
from autoplan.codegen.native import NativeProgram
from autoplan.codegen.pipeline_step import step_inputs
from autoplan.codegen.precision import compute_precision
from autoplan.plan_schema import CouplingHandling
from autoplan.trace.batch_coupling import count_program
from autoplan.trace.graph import TracedGraph


class AccumulatedProgram(torch.nn.Module):
    """``program`` (one microbatch's native program) run over a step's microbatches; offers
    what :class:`~autoplan.codegen.runtime.PipelinedModule` calls (``train_step``)."""

    def __init__(self, program: NativeProgram, graph: TracedGraph, device_type: str) -> None:
        super().__init__()
        self.program = program
        self.kind = program.kind
        self.plan = program.plan
        self.microbatches = self.plan.microbatches
        self.device_type = device_type
        self.input_names = program.input_names
        weighted = [c.node for c in self.plan.batch_coupling if c.handling == CouplingHandling.WEIGHTED_MICROBATCHES]
        self._count = count_program(graph, weighted[0]) if weighted else None

    @property
    def mesh(self) -> Any:
        return self.program.mesh

    @property
    def description(self) -> str:
        return f"{self.program.description}, {self.microbatches} microbatches accumulated"

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        return self.program.named_plan_parameters()

    def _fsdp_modules(self) -> list[FSDPModule]:
        return [m for m in self.program.module.modules() if isinstance(m, FSDPModule)]

    def _backward_of(self, index: int) -> AbstractContextManager[Any]:
        """How microbatch ``index``'s forward and backward run: DDP without its all-reduce but
        for the last; ZeRO-2's groups held gathered after every backward but the last; groups
        held through the step also without their reduce-scatter but for the last."""
        last = index == self.microbatches - 1
        if self.program.kind == "ddp":
            return nullcontext() if last else self.program.module.no_sync()
        zero2 = {id(m) for m in self.program.held_modules()}
        for module in self._fsdp_modules():
            if isinstance(module, ReplicateModule):  # reduced once per step, as DDP's
                module.set_requires_gradient_sync(last, recurse=False)
            elif not self.program.reshard_after_forward or id(module) in zero2:
                module.set_reshard_after_backward(last, recurse=False)
                if self.program.held_through_step and id(module) not in zero2:  # reduced once per step
                    module.set_requires_gradient_sync(last, recurse=False)
        return nullcontext()

    def train_step(self, *inputs: Any) -> torch.Tensor:
        """Forward and backward of every microbatch of the global batch ``inputs`` (the same on
        every rank), gradients accumulated into the parameters; the step's loss (a 0-d
        tensor, the same on every rank)."""
        m = self.microbatches
        device = self.program.mesh.device_type
        inputs = step_inputs(inputs, self.input_names, m, device)
        weights = microbatch_weights(inputs, m, 1.0 / m, self._count, device)
        total = torch.zeros((), device=device)
        for i, piece in enumerate(zip(*(x.chunk(m) for x in inputs))):
            with self._backward_of(i):
                with compute_precision(self.plan.precision, self.device_type):
                    loss = self.program(*piece)[0]
                local = loss.to_local() if isinstance(loss, DTensor) else loss
                weighted = local * weights[i, 0].to(local.dtype)
                weighted.backward()
            total += weighted.detach().to(total.dtype)
        return total.to(torch.float32)

    def observable_collectives(self, phase: str) -> dict[str, int]:
        """What ``CollectiveCounter`` should count in one step's ``phase`` (``"step"``: every
        microbatch's forward and backward), as :meth:`NativeProgram.observable_collectives`
        counts a step's."""
        if phase == "optimizer":
            return self.program.observable_collectives(phase)
        counts: Counter[str] = Counter()
        for part in ("forward", "backward"):
            counts.update(self.program.observable_collectives(part))
        return dict(counts)
