"""Which program runs a plan, told before anything runs: one of PyTorch's own (the model
itself, DDP, FSDP2, HSDP, FSDP x TP, ``parallelize_module``, stages cut from the model by
``torch.distributed.pipelining``) or autoplan's DTensor interpreter, and why.

:func:`program_choice` reads the plan and the traced model with the recognition the runtime
uses (:func:`autoplan.codegen.runtime.build_parallel_module`: :func:`~autoplan.codegen.native.recognised_pattern`
for one stage, accumulated microbatches included, :func:`~autoplan.codegen.native_pipeline.native_pipeline_form`
for several), so the summary names the program ``train.py`` builds. One thing only the run can
tell: a pipeline's stages are cut by torch's tracer, which may not cut a model (a
``torch.autocast`` region under a bf16 trace); then its stages run on the interpreter, and the
program the run prints says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from autoplan.codegen.native import recognised_pattern
from autoplan.codegen.native_patterns import Recognised
from autoplan.codegen.native_pipeline import native_pipeline_form
from autoplan.codegen.native_storage import TableRead
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan
from autoplan.trace.graph import TracedGraph

__all__ = ["INTERPRETER_PROGRAM", "ProgramChoice", "ProgramKind", "program_choice"]

INTERPRETER_PROGRAM = "autoplan's DTensor interpreter"


class ProgramKind(StrEnum):
    """The family of program that runs a plan."""

    NATIVE = "native"  # PyTorch's own data- and tensor-parallel modules on one stage
    NATIVE_PIPELINE = "native pipeline"  # stages cut from the model, on torch's schedule
    INTERPRETER = "interpreter"  # autoplan's DTensor interpreter, op by op


@dataclass(frozen=True)
class ProgramChoice:
    """What runs a plan (``text``) and, on the interpreter, why no native form does (``reason``)."""

    kind: ProgramKind
    text: str
    reason: str = ""

    def line(self) -> str:
        """One line for the summary."""
        return f"{self.text} ({self.reason})" if self.reason else self.text


_ONE_STAGE = {
    "single": "the model itself on one device",
    "replicated": "the model itself on every device, each computing the whole step (the plan has no collective)",
    "ddp": "PyTorch's DistributedDataParallel",
    "fsdp": "PyTorch's FSDP2 (fully_shard per block)",
    "hsdp": "PyTorch's FSDP2 on a 2-D mesh (HSDP: sharded within a node, replicated across)",
    "fsdp_tp": "PyTorch's parallelize_module on axis 1, then FSDP2 on axis 0 (FSDP x TP, as torchtitan composes them)",
    "tensor_parallel": "PyTorch's parallelize_module (ColwiseParallel/RowwiseParallel)",
}


def _storage_text(found: Recognised) -> str:
    """The parts of an FSDP plan FSDP2's groups hold otherwise: held, ZeRO-2, tables read in place."""
    parts = []
    if found.held_through_step:
        parts.append("weights held gathered through the microbatches")
    storage = found.storage
    if storage is not None:
        if storage.zero2:
            parts.append(f"{len(storage.zero2)} ZeRO-2 parameter(s) in groups of their own")
        parts += [f"{name} under {'Colwise' if read.read == TableRead.HIDDEN else 'Rowwise'}Parallel"
                  for name, read in storage.embeddings.items()]
    return f"; {', '.join(parts)}" if parts else ""


def _one_stage(found: Recognised, plan: Plan) -> ProgramChoice:
    accumulated = f", {plan.microbatches} microbatches accumulated" if plan.microbatches > 1 else ""
    checkpointed = f", {len(plan.recompute)} layer(s) checkpointed" if plan.recompute else ""
    return ProgramChoice(ProgramKind.NATIVE, f"{_ONE_STAGE[found.kind]}{_storage_text(found)}{accumulated}"
                                             f"{checkpointed}")


def _interpreter(reason: str) -> ProgramChoice:
    return ProgramChoice(ProgramKind.INTERPRETER, INTERPRETER_PROGRAM, reason)


def program_choice(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> ProgramChoice:
    """The program ``train.py`` builds for ``plan`` (module docstring); ``graph``: the trace of
    one microbatch of ``spec``, as the plan was planned on."""
    if len(plan.stages) == 1:
        found = recognised_pattern(spec, graph, plan)
        return _interpreter(found.reason) if found.kind == "none" else _one_stage(found, plan)
    form = native_pipeline_form(spec, graph, plan)
    if isinstance(form, str):
        return _interpreter(form)
    _, parallel = form
    devices = len(plan.stages[0].devices)
    if parallel is None:
        within = "one device each"
    elif parallel.replicated:
        within = f"each data parallel over {devices} devices (FSDP2's replicate)"
    else:
        held = ", held gathered through the microbatches" if parallel.held else ""
        beside = f", {len(parallel.whole)} parameter(s) kept whole under FSDP2's replicate" if parallel.whole else ""
        within = f"each FSDP2 fully_shard over {devices} devices{held}{beside}"
    return ProgramChoice(ProgramKind.NATIVE_PIPELINE,
                         f"{len(plan.stages)} stages cut from the model's own modules by torch.distributed.pipelining "
                         f"({plan.schedule}, {plan.microbatches} microbatches), {within}")
