"""Run a plan with PyTorch's own parallel APIs where the plan reduces to one of their patterns.

``native_module(spec, graph, plan, mesh)`` returns a :class:`NativeProgram` — a drop-in for
:class:`~autoplan.codegen.dtensor_program.ShardedProgram` inside a ``ParallelModule`` — or
``None`` when the plan is not one of the patterns below (the DTensor interpreter runs it then).
Recognition reads only the plan and the traced graph; it is deliberately conservative: a plan is
taken natively only when the native program does what the plan says (same placements, same
collectives up to DDP's bucketing) and provably computes the same loss and gradients.

Patterns (1-D meshes but for the 2-D ones of HSDP and FSDP x TP, one stage, one microbatch; DDP,
FSDP, HSDP, ZeRO-2 and FSDP x TP also with microbatches accumulated, each microbatch through this
program, and their sharded parameters then also held gathered through the step:
:mod:`autoplan.codegen.native_accumulation`):

``"single"`` — a plan of one device: the user's module (a copy) itself.

``"replicated"`` — a plan of several devices that each compute the whole step alike (every
input, parameter and value whole, no collective: a small model whose links cost more than the
work they would split): the user's module (a copy) itself on every device, as ``"single"``.

``"ddp"`` — pure data parallelism. Every parameter and buffer is ``R``; the user inputs are
``S(d)`` (their batch dim; ``R`` inputs are passed whole) with the batch divisible by the mesh;
every op keeps the batch sharded (no activation collective in the plan besides the loss's
``-> output`` all-reduce, only gradient all-reduces in the backward, and the all-reduces of the
gradients of values no user input flows into, such as a learned position table's rows added to
the tokens: DDP reduces those sums in the gradients of the parameters the values come from, the
same sums, since their backward is one linear map on every rank); the only op that
produces partial sums is the loss itself, and it is an ``aten.mean`` over all elements or a
cross-entropy averaged over the targets it does not ignore (the graph's only one, class-index
targets, no class weights); no batch-norm and no buffer written in the forward. Then the global
loss is the mean of the per-rank losses over equal shards, so DDP's *average* of per-rank
gradients is the gradient of the global loss. A cross-entropy's mean divides by a count that
differs between the ranks' shards: the program runs the model under
:class:`~autoplan.codegen.token_mean.GlobalTokenMean`, which divides each rank's summed loss by
the global count (all-reduced in the forward, the plan's "loss count") times the number of
ranks, which makes the same equality exact. A sum loss, class weights or BatchNorm statistics
break it, and such plans are refused. Each rank runs the user's module (a copy) wrapped in
``DistributedDataParallel`` on its own slice of the global batch; the loss returned is the
global mean (its value is all-reduced, its gradient is the local loss's, which DDP averages).

``"fsdp"`` — the same, with every parameter stored sharded on dim 0 over the mesh and read whole
by every op that reads it (ZeRO-3; buffers stay whole). FSDP2's ``fully_shard`` shards each of
the plan's layers that is a module holding parameters (the repeated blocks), then the root
(what is left: embeddings, the head, tied weights), each with ``reshard_after_forward=True``:
a group's parameters are all-gathered before its forward, freed after it, gathered again for
its backward, and its gradients reduce-scattered (averaged over the ranks, as DDP averages).
The plan gathers and reduce-scatters per parameter; FSDP2 does it per group: the same bytes in
fewer calls. A parameter stored sharded on another dim (``S(1)``: a tied table) is sharded there
(``shard_placement_fn``, evenly), and the parameters a 1-D plan keeps whole beside the sharded
ones (norm weights, biases: their gathers cost a latency each) are left out of the groups and
``replicate``d on the modules holding them, their gradients all-reduced
(:mod:`autoplan.codegen.native_fsdp`). A 1-D plan's parameters may mix kinds, as the search's
plans at real size do (:mod:`autoplan.codegen.native_storage`): a module holding only ZeRO-2
parameters (a head) is a group of its own, ``fully_shard``ed first with
``reshard_after_forward=False``; an embedding table the plan reads in place (sharded on the
vocabulary or the hidden dim, the ids whole) runs under ``RowwiseParallel`` or
``ColwiseParallel`` on the mesh, its output redistributed onto the batch shards as the plan
moves it (a reduce-scatter, an all-to-all) and its gradient divided by the ranks as FSDP2
averages the others'. Under a bf16 plan every group has the plan's
``MixedPrecisionPolicy``: parameters gathered and computed with in bf16, gradients reduced in
fp32 into the fp32 shards (the optimizer's master weights), as the plan costs the gathers.

A ZeRO-2 plan (every parameter whole, its gradient and optimizer state stored sharded on dim
0 over a 1-D mesh: :func:`~autoplan.codegen.native_patterns.zero_storage`) runs the same way
with ``reshard_after_forward=False``, FSDP2's ZeRO-2 (FSDP1's ``SHARD_GRAD_OP``): a group's
parameters are gathered before its forward and held through its backward (recomputation
included: no second gather), its gradients reduce-scattered into the shards the optimizer
steps. The plan gathers each parameter's updated shards after the optimizer step; FSDP2
gathers them before the next forward: the same bytes once per step, a phase later, and
between steps each rank keeps only its shards (less memory than the plan counts). ZeRO-1 (a
whole gradient kept to the step) has no FSDP2 form: torch's ``ZeroRedundancyOptimizer``
all-reduces the gradients and broadcasts the updated parameters, half as many bytes again as
the plan's reduce-scatter and all-gather, so such plans run on the interpreter.

``"hsdp"`` — FSDP on a 2-D ``dp × fsdp`` mesh: the batch split over both axes (each rank's
slice is its mesh coordinate read row-major, as DTensor lays out ``[Shard(0), Shard(0)]``), every
parameter replicated over axis 0 and stored sharded over axis 1 (``[R, S(0)]``), read
whole; beside them, as on a 1-D mesh, whole parameters (``replicate`` over every rank),
ZeRO-2 modules and an embedding table read in place over axis 1 and gathered over axis 0, its
ids split over axis 0 only (:mod:`autoplan.codegen.native_storage`). ``fully_shard`` on the
named 2-D mesh is FSDP2's HSDP: per group an all-gather over axis 1 before the forward and
again before the backward, the gradient reduce-scattered over axis 1
and its shard all-reduced over axis 0 (the order the plan costs:
:func:`~autoplan.sharding.reduce_scatter_first`). The loss and a cross-entropy's token count are
all-reduced over each axis in turn, as the plan reduces them.

``"fsdp_tp"`` — FSDP over axis 0 of a 2-D mesh composed with tensor parallelism over axis 1, as
torchtitan composes them: ``parallelize_module`` on the tensor axis (column and row linears, a
column-parallel embedding and head whose outputs are gathered), the recomputed layers
checkpointed, then ``fully_shard`` per block and on the root over the data axis. Recognition
and how the collectives correspond: :mod:`autoplan.codegen.native_fsdp_tp`.

Each of the data-parallel patterns checkpoints the plan's recomputed layers
(:attr:`~autoplan.plan_schema.Plan.recompute`), which must name modules, with
``torch.distributed._composable.checkpoint`` (non-reentrant, the module's parameter names
unchanged): the backward runs the module's forward again, keeping the outputs of its matrix
products and attention where the layer is recomputed selectively
(:func:`~autoplan.codegen.checkpointing.selective_contexts`), and by the per-op policy those of
its attention and of the submodules that hold the plan's kept products (an ``nn.Linear`` each:
:func:`~autoplan.codegen.native_patterns.kept_modules`, whose calls a hook pair marks,
:class:`~autoplan.codegen.checkpointing.KeptModules`; a layer whose kept products are not
such calls runs on the interpreter, which keeps them by node). The plan's layer may hold ops outside
that module (the embedding before the first block, the head and the loss after the last); those
run once and keep their outputs, so the loss's count is not all-reduced again in the backward
as the plan lists for a recomputed loss. The plan's precision is the ``torch.autocast`` that
:class:`~autoplan.codegen.runtime.ParallelModule` runs every program under: parameters stay
fp32 (FSDP's gather in bf16 under its policy, above).

``"tensor_parallel"`` — Megatron tensor parallelism. The non-replicated parameters are exactly
those of ``nn.Linear`` modules in adjacent pairs: a column-parallel linear (weight ``S(0)``,
bias ``S(0)``, activation arriving ``R``, output ``S(-1)``), a chain of single-input ops kept
``S(-1)`` (GELU), and a row-parallel linear (weight ``S(1)``, output partial). Every other op is
``R``, except downstream of a row-parallel linear, where the plan may keep the value partial or
sharded on one dim ``d`` (the loss on a sequence-sharded output). The model is
``parallelize_module(copy, mesh, {col: ColwiseParallel(), row: RowwiseParallel(output_layouts=
L)})`` with ``L`` the layout the plan's consumers want: ``Shard(d)`` when they read ``S(d)``
(a reduce-scatter; the output stays a DTensor and the loss runs on DTensors), ``Replicate()``
when they read ``R`` or ``P`` (an all-reduce; the plan may delay it past element-wise ops on
partial sums — same count, same bytes). A row bias the plan stores ``S(0)`` (and pads into
partial sums) is kept replicated by ``RowwiseParallel``: ``bias`` bytes more per device.

How the plan's collectives map onto the native program (:attr:`NativeProgram.collective_map`;
FSDP's per-group gathers and reduce-scatters are in ``"fsdp"`` above):

- tensor parallel: each planned activation collective is executed by DTensor inside the
  parallel styles (``RowwiseParallel``'s output redistribute: all-reduce or reduce-scatter in
  the forward, its dual — nothing or an all-gather — in the backward) or by the loss's own
  ``-> output`` all-reduce. ``CollectiveCounter`` sees all of them, so ``check.py`` compares
  planned with executed counts as for the interpreter.
- DDP: the loss's ``-> output`` all-reduce is done here (``dist.all_reduce`` of one scalar;
  ``CollectiveCounter`` counts it). The plan lists one gradient all-reduce per parameter
  (``bucketed=True``); DDP's reducer instead all-reduces flat *buckets* of gradients (25 MiB
  cap by default: one bucket for the test MLPs) during the backward — the same bytes in total,
  fewer calls. In torch 2.13 the reducer's all-reduce goes through the ``c10d`` dispatcher op,
  so ``CollectiveCounter`` does count it (measured: 1 executed for 4 planned, gloo). The comparison
  in ``check.py`` should therefore set the *bucket count* against the plan's bucketed gradient
  all-reduces, not the per-parameter count: :meth:`NativeProgram.observable_collectives`
  gives the expected counts (the plan's, with those all-reduces replaced by
  ``len(ddp_buckets())``); every other collective is compared one for one.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import warnings
from collections import Counter
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import Placement as DPlacement

from autoplan.codegen.checkpointing import KeptModules, selective_contexts
from autoplan.codegen.materialize import has_meta_tensors, materialise_whole
from autoplan.codegen.native_fsdp import frozen_group, shard_modules
from autoplan.codegen.native_patterns import (CollectiveMapping, Recognised, inside_module, kept_modules, recognise,
    reduced_in_parameters, split_axes)
from autoplan.codegen.native_storage import ParameterStorage, TableRead, parallelize_embeddings
from autoplan.codegen.precision import mixed_precision_policy
from autoplan.codegen.redistribution import to_dtensor_placements
from autoplan.codegen.token_mean import GlobalTokenMean, check_one_loss
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan, PlannedCollective, RecomputeMode
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import microbatch_inputs

__all__ = ["CollectiveMapping", "NativeProgram", "native_module", "native_pattern", "not_run_again", "recognise",
           "rerun_nodes", "sharded_blocks"]


class NativeProgram(torch.nn.Module):
    """The model run with DDP or ``parallelize_module``; behaves like ``ShardedProgram``:
    ``forward(*global_inputs)`` → ``(loss, *outputs)`` with the loss a replicated DTensor and
    the model outputs as DTensors (``.full_tensor()`` gathers one)."""

    def __init__(self, kind: str, module: torch.nn.Module, spec: ModelSpec, graph: TracedGraph, plan: Plan,
                 mesh: DeviceMesh, styles: dict[str, tuple[str, DPlacement | None]], fsdp_groups: int = 0,
                 token_mean: bool = False, reshard_after_forward: bool = True, replicate_groups: int = 0,
                 held_groups: int = 0, storage: ParameterStorage | None = None, table_groups: int = 0,
                 held_through_step: bool = False) -> None:
        super().__init__()
        self.token_mean = token_mean  # the cross-entropy divides by the global batch's token count
        self.fsdp_groups = fsdp_groups  # fully_shard units: one all-gather (and reduce-scatter) each
        self.replicate_groups = replicate_groups  # replicate units beside them: one all-reduce each
        self.held_groups = held_groups  # ZeRO-2 units beside them: gathered once per step
        self.storage = storage  # an FSDP plan's parameters by how they are held
        self.table_groups = table_groups  # tables read in place, FSDP over axis 0 of a 2-D mesh
        # False: ZeRO-2, a group's parameters gathered in the forward and held through the backward
        self.reshard_after_forward = reshard_after_forward
        # the sharded groups held gathered through the step's microbatches, their gradients
        # accumulated whole and reduce-scattered once a step (the plan's held storage)
        self.held_through_step = held_through_step
        self.kind = kind
        self.mesh = mesh
        self.plan = plan
        self.styles = styles
        self.module = module
        self.loss_fn = spec.loss_fn
        self._call = spec.call  # the model called as the user calls it (by keyword, or positionally)
        self.input_names = list(graph.input_names)
        self.redistributions: list[tuple[str, str, str]] = []
        # the axes the batch is split over: every axis, but the tensor axis of FSDP x TP
        self._data_axes = 1 if kind == "fsdp_tp" else mesh.ndim
        self._n = math.prod(mesh.shape[:self._data_axes])
        # each input's batch dim and the leading mesh axes it is split over (ids an embedding reads
        # whole over the last axis: the first only)
        self._input_splits = [split_axes(plan.inputs.get(name, ["R"])[:self._data_axes]) for name in self.input_names]
        self._output_placements = self._model_output_placements(graph, plan, self._data_axes)
        # the nodes the checkpointed modules run again in the backward
        self._rerun = rerun_nodes(graph, plan)
        # DDP and FSDP: values the same on every rank, whose gradients they reduce in their parameters'
        self._same = graph.input_free_values if kind in ("ddp", "fsdp", "hsdp") else frozenset()
        self._dtensor_output = any(isinstance(p, Shard) for kind_, p in styles.values() if kind_ == "rowwise")
        self.collective_map = self._collective_map()

    @staticmethod
    def _model_output_placements(graph: TracedGraph, plan: Plan, data_axes: int) -> list[tuple[DPlacement, ...]]:
        """Each model output's placements: the plan's over the data axes, whole over the tensor
        axis of FSDP x TP (its column outputs are gathered at the module)."""
        plans = {p.name: p for p in plan.nodes}
        out = next(n for n in graph.graph_module.graph.nodes if n.op == "output")
        results = out.args[0] if isinstance(out.args[0], (tuple, list)) else (out.args[0],)
        placements = []
        for r in results[1:]:
            p = plans.get(r.name) if isinstance(r, torch.fx.Node) else None
            specs = p.outputs[0] if p is not None and p.outputs else ["R"]
            specs = [("R" if s == "P" else s) if axis < data_axes else "R" for axis, s in enumerate(specs)]
            placements.append(to_dtensor_placements(specs))
        return placements

    # -- what runs --------------------------------------------------------------------------

    def _local_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        out = []
        for value, (d, axes) in zip(inputs, self._input_splits):
            if d is not None and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                value = value.chunk(math.prod(self.mesh.shape[:axes]), d)[_batch_slice(self.mesh, axes)]
            out.append(value)
        return out

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        if len(inputs) != len(self.input_names):
            raise TypeError(f"the program takes {len(self.input_names)} inputs, got {len(inputs)}")
        rep = (Replicate(),)
        if self.kind in ("single", "replicated"):
            output = self._call(self.module, tuple(inputs))
            local_loss = self.loss_fn(output, *inputs)
            loss = DTensor.from_local(local_loss, self.mesh, rep, run_check=False)
            outs = [DTensor.from_local(o, self.mesh, rep, run_check=False) if isinstance(o, torch.Tensor) else o
                    for o in _model_outputs(output, local_loss)]
            return (loss, *outs)
        if self.kind in ("ddp", "fsdp", "hsdp", "fsdp_tp"):
            local = self._local_inputs(inputs)
            groups = [self.mesh.get_group(axis) for axis in range(self._data_axes)]
            with warnings.catch_warnings():
                # the loss reads the model's outputs out of place: FSDP2's warning about in-place
                # ops on a returned view does not apply
                warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
                with GlobalTokenMean(groups, self._n) if self.token_mean else nullcontext() as mean:
                    output = self._call(self.module, tuple(local))
                    local_loss = self.loss_fn(output, *local)
            if mean is not None:
                check_one_loss(mean)
            if self.kind != "ddp" and not torch.is_grad_enabled():
                self._reshard()  # no backward frees what ZeRO-2 and replicate's bf16 casts hold after it
            # The value of the global loss (the mean of equal shards' means); the gradient of
            # the local one, which DDP's all-reduce and FSDP's reduce-scatter average over ranks.
            total = local_loss.detach().clone()
            for group in groups:  # over each data axis, as the plan reduces the loss
                dist.all_reduce(total, group=group)
            loss = local_loss + (total / self._n - local_loss.detach())
            loss = DTensor.from_local(loss, self.mesh, rep * self.mesh.ndim, run_check=False)
            outs = _model_outputs(output, local_loss)
            wrapped = [DTensor.from_local(o, self.mesh, pl, run_check=False) if isinstance(o, torch.Tensor) else o
                       for o, pl in zip(outs, self._output_placements)]
            return (loss, *wrapped)
        if self._dtensor_output:
            # The row-parallel output stays a (sharded) DTensor: the loss runs on DTensors with
            # the inputs replicated, as the plan's sharded loss ops do.
            with implicit_replication():
                output = self._call(self.module, inputs)
                rep_inputs = [DTensor.from_local(x, self.mesh, rep, run_check=False)
                              if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs]
                loss = self.loss_fn(output, *rep_inputs)
        else:
            output = self._call(self.module, inputs)
            loss = self.loss_fn(output, *inputs)
        if isinstance(loss, DTensor):
            if any(not p.is_replicate() for p in loss.placements):
                loss = loss.redistribute(self.mesh, rep)
        else:
            loss = DTensor.from_local(loss, self.mesh, rep, run_check=False)
        outs = [o if isinstance(o, DTensor) or not isinstance(o, torch.Tensor)
                else DTensor.from_local(o, self.mesh, rep, run_check=False) for o in _model_outputs(output, loss)]
        return (loss, *outs)

    @property
    def description(self) -> str:
        """What runs the plan, in a few words."""
        checkpointed = f", {len(self.plan.recompute)} checkpointed layer(s)" if self.plan.recompute else ""
        runs = {"single": "the model itself on one device",
                "replicated": "the model itself on every device, the step computed alike (no collective)",
                "ddp": "DistributedDataParallel",
                "fsdp": f"FSDP2 fully_shard ({self.fsdp_groups} groups{self._zero2_text}{self._held_text}"
                        f"{self._replicate_text}{self._embeddings_text})",
                "hsdp": f"FSDP2 fully_shard on a 2-D mesh, HSDP ({self.fsdp_groups} groups{self._zero2_text}"
                        f"{self._held_text}{self._replicate_text}{self._embeddings_text})",
                "fsdp_tp": f"parallelize_module on axis 1, then FSDP2 fully_shard on axis 0 ({self.fsdp_groups} "
                           "groups)",
                "tensor_parallel": "parallelize_module (ColwiseParallel/RowwiseParallel)"}[self.kind]
        return f"native: {runs}{checkpointed}"

    def held_modules(self) -> list[torch.nn.Module]:
        """The modules of the ZeRO-2 parameters beside FSDP's groups, and the embeddings whose
        tables FSDP2 gathers over axis 0 of a 2-D mesh: each a group held from its forward
        through its backward."""
        if self.storage is None:
            return []
        names = dict.fromkeys(fqn.rpartition(".")[0] for fqn in self.storage.zero2)
        tables = self.storage.embeddings if self.table_groups else {}
        return [self.user_module.get_submodule(name) for name in (*names, *tables)]

    def _reshard(self) -> None:
        """Free every FSDP2 group's gathered parameters, its shards the module's parameters again."""
        from torch.distributed.fsdp import FSDPModule

        for m in self.module.modules():
            if isinstance(m, FSDPModule):
                m.reshard()

    @property
    def _replicate_text(self) -> str:
        return f"; replicate on {self.replicate_groups} modules" if self.replicate_groups else ""

    @property
    def _held_text(self) -> str:
        held = f"; {self.held_groups} ZeRO-2 modules held through the backward" if self.held_groups else ""
        n = self.table_groups
        return held + (f"; {n} table{'s' if n > 1 else ''} sharded over axis 0" if n else "")

    @property
    def _embeddings_text(self) -> str:
        storage = self.storage
        if storage is None or not storage.embeddings:
            return ""
        reads = ", ".join(f"{name} {'Colwise' if read.read == TableRead.HIDDEN else 'Rowwise'}Parallel"
                          for name, read in storage.embeddings.items())
        return f"; tables read in place: {reads}"

    @property
    def _zero2_text(self) -> str:
        if self.held_through_step:
            return ", held gathered through the microbatches, gradients reduced once a step"
        return "" if self.reshard_after_forward else ", not resharded after the forward: ZeRO-2"

    # -- what ShardedProgram offers -----------------------------------------------------------

    @property
    def user_module(self) -> torch.nn.Module:
        """The (copied) user module, unwrapped from DDP."""
        return self.module.module if self.kind == "ddp" else self.module

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by the model's FQN, tied FQNs included (they give the same object)."""
        return dict(self.user_module.named_parameters(remove_duplicate=False))

    def tensor(self, fqn: str) -> torch.Tensor:
        named = dict(self.user_module.named_parameters(remove_duplicate=False))
        named.update(dict(self.user_module.named_buffers(remove_duplicate=False)))
        return named[fqn]

    # -- collectives ---------------------------------------------------------------------------

    def _not_run_again(self, c: PlannedCollective) -> bool:
        return not_run_again(c, self._rerun)

    def _grouped_by_fsdp(self, c: PlannedCollective) -> bool:
        """Whether FSDP2 runs ``c`` as part of its per-group collectives (a parameter's gather or
        a gradient's reduce-scatter, or the edge all-reduce of a value's gradient that FSDP2
        reduces in the parameters it comes from: :func:`~autoplan.codegen.native_patterns.reduced_in_parameters`)."""
        if self.kind == "fsdp_tp" and c.mesh_axis != 0:
            return False  # a sequence-parallel norm's weight gradient, all-reduced over the tensor axis
        return self.kind in ("fsdp", "hsdp", "fsdp_tp") and (c.tensor in ("parameter", "gradient")
                                                              or reduced_in_parameters(c, self._same))

    def _in_ddp_buckets(self, c: PlannedCollective) -> bool:
        """Whether DDP runs ``c`` in its gradient buckets: a parameter's gradient all-reduce, or
        the edge all-reduce of a value's gradient that DDP reduces in the parameters it comes
        from (:func:`~autoplan.codegen.native_patterns.reduced_in_parameters`)."""
        return (c.tensor == "gradient" and c.bucketed) or reduced_in_parameters(c, self._same)

    @property
    def _lookups(self) -> set[str]:
        """The embedding nodes whose tables are read in place."""
        return {read.node for read in self.storage.embeddings.values()} if self.storage else set()

    def _collective_map(self) -> list[CollectiveMapping]:
        out = []
        grads = [c for c in self.plan.collectives if self._in_ddp_buckets(c)]
        grouped = [c for c in self.plan.collectives if self._grouped_by_fsdp(c)]
        for c in self.plan.collectives:
            if c in grads or c in grouped:
                continue
            what = f"{c.kind} x{c.count} {c.phase} at {c.where}"
            if self._not_run_again(c):
                native = "none: it is outside the checkpointed block modules, which run again without it"
            elif self.token_mean and c.tensor == "loss count":
                native = "GlobalTokenMean: the cross-entropy's token count, all-reduced in the forward"
            elif c.where.endswith("-> output"):
                native = "the loss's all-reduce (NativeProgram.forward)" if self.kind != "tensor_parallel" else \
                    "DTensor: the loss's redistribute to Replicate"
            elif self.storage is not None and c.where.split(" -> ")[0] in self._lookups:
                native = "DTensor inside the embedding's parallel style: its output redistributed onto the " \
                         "batch shards (an all-to-all from hidden slices, a reduce-scatter of partial sums), " \
                         "the gradient back in the backward"
            elif self.kind in ("tensor_parallel", "fsdp_tp"):
                native = "DTensor inside a parallel style's redistribute: RowwiseParallel's output, " \
                         "ColwiseParallel's gathered output, the gradient of ColwiseParallel's input"
            else:
                native = "?"
            out.append(CollectiveMapping(what, native, not self._not_run_again(c)))
        if grouped:
            nbytes = sum(c.bytes * c.count for c in grouped)
            out.append(CollectiveMapping(
                f"{sum(c.count for c in grouped)} parameter all-gathers and gradient reduce-scatters, "
                f"{nbytes:.0f} bytes",
                f"FSDP2: per fully_shard group ({self.fsdp_groups}), one all-gather in the forward, one in the "
                "backward and one reduce-scatter of the gradients (HSDP: and one all-reduce of the reduced shard "
                "over axis 0); the same bytes in fewer calls" if self.reshard_after_forward else
                f"FSDP2 without resharding after the forward, held through the microbatches: per fully_shard "
                f"group ({self.fsdp_groups}), one all-gather before the first microbatch's forward and one "
                "reduce-scatter of the accumulated gradients in the last one's backward (HSDP: and one all-reduce "
                "of the reduced shard over axis 0); the same bytes in fewer calls" if self.held_through_step else
                f"FSDP2 without resharding after the forward (ZeRO-2): per fully_shard group ({self.fsdp_groups}), "
                "one reduce-scatter of the gradients in the backward (HSDP: and one all-reduce of the reduced "
                "shard over axis 0), and the all-gather of the updated shards that the plan runs after the "
                "optimizer step run before the next forward; the same bytes in fewer calls", False))
        if self.held_groups:
            out.append(CollectiveMapping(
                "the ZeRO-2 parameters' gradient reduce-scatters and the gathers of their updated shards",
                f"FSDP2 without resharding after the forward, one group per module holding them "
                f"({self.held_groups}): one all-gather before the forward, one reduce-scatter in the backward "
                "(HSDP: and one all-reduce of the reduced shard over axis 0)", False))
        if self.table_groups:
            out.append(CollectiveMapping(
                "the gathers over axis 0 of the tables read in place, and their gradients' reduce-scatters",
                f"FSDP2 over axis 0 on each embedding ({self.table_groups}), not resharded after the forward: one "
                "all-gather before the lookup, one reduce-scatter in the backward", False))
        if self.replicate_groups:
            out.append(CollectiveMapping(
                "the gradient all-reduces of the parameters kept whole beside the sharded ones (bucketed)",
                f"replicate (FSDP2's DDP): one all-reduce per module holding them ({self.replicate_groups}), "
                "once per step", False))
        if grads and self.kind == "ddp":
            nbytes = sum(c.bytes * c.count for c in grads)
            out.append(CollectiveMapping(
                f"all_reduce x{sum(c.count for c in grads)} backward (gradients, bucketed), {nbytes:.0f} bytes",
                "DDP reducer: one all-reduce per flat gradient bucket (bucket_cap_mb=25), same bytes; "
                "the collective counter counts buckets, not parameters", False))
        return out

    def ddp_buckets(self) -> list[int]:
        """DDP's gradient buckets (bytes each); DDP rebuilds them after the first backward."""
        if self.kind != "ddp":
            return []
        sizes = str(self.module._get_ddp_logging_data().get("bucket_sizes", ""))
        return [int(s) for s in sizes.replace(" ", "").split(",") if s]

    def observable_collectives(self, phase: str) -> dict[str, int]:
        """What ``CollectiveCounter`` should count in ``phase``: the plan's collectives, except that
        under DDP the plan's per-parameter gradient all-reduces (``bucketed=True``) become one
        all-reduce per DDP bucket (see the module docstring), and under FSDP the per-parameter
        gathers and reduce-scatters become one per ``fully_shard`` group."""
        counts: Counter[str] = Counter()
        grads = 0
        m = self.plan.microbatches  # accumulated (:mod:`autoplan.codegen.native_accumulation`)
        if self.kind in ("fsdp", "hsdp", "fsdp_tp") and phase in ("forward", "backward"):
            if self.reshard_after_forward:  # every microbatch gathers before its forward and its backward
                counts["all_gather"] += self.fsdp_groups * m
            elif phase == "forward":  # ZeRO-2: once per step, held through the microbatches
                counts["all_gather"] += self.fsdp_groups
            if phase == "forward":  # ZeRO-2 modules and tables beside FSDP's groups: likewise
                counts["all_gather"] += self.held_groups + self.table_groups
            if phase == "backward":
                # held through the step: the sharded groups' gradients accumulate whole, reduced once
                reduced = self.fsdp_groups * (1 if self.held_through_step else m)
                counts["reduce_scatter"] += reduced + (self.held_groups + self.table_groups) * m
                if self.replicate_groups:  # once per step: their gradients accumulate whole
                    counts["all_reduce"] += self.replicate_groups
                if self.kind == "hsdp":  # HSDP's groups all-reduce their reduced shards over axis 0
                    counts["all_reduce"] += reduced + self.held_groups * m
        for c in self.plan.collectives_in(phase):
            if self._grouped_by_fsdp(c) or self._not_run_again(c):
                continue
            if self.kind == "ddp" and self._in_ddp_buckets(c):
                grads += c.count
                continue
            counts[c.kind] += c.count
        if grads:
            counts["all_reduce"] += len(self.ddp_buckets())
        return dict(counts)


def rerun_nodes(graph: TracedGraph, plan: Plan) -> set[str]:
    """The nodes the plan's checkpointed modules run again in the backward: those of its
    recomputed layers that lie inside the layer's module."""
    return {name for layer in plan.recompute for name in layer.nodes
            if name in graph.nodes and inside_module(graph.nodes[name].module, layer.layer)}


def not_run_again(c: PlannedCollective, rerun: set[str]) -> bool:
    """Whether ``c`` is a recomputation's collective that a program checkpointing modules does
    not run again: the plan's recomputed layer holds the ops before the first block and after
    the last (the embedding and its gather, the head, the loss and its count), the checkpointed
    block module does not (``rerun``: :func:`rerun_nodes`), so those run once."""
    if c.phase != "backward" or not (c.where.endswith("(recomputed)") or c.tensor == "loss count"):
        return False
    producer = c.where.split(" -> ")[0].split(" (")[0]
    return producer not in rerun


def _batch_slice(mesh: DeviceMesh, axes: int) -> int:
    """Which of the equal slices of a batch split over the mesh's first ``axes`` axes this rank
    computes: its coordinate read row-major, as DTensor lays out a dim sharded over them
    (``[Shard(0), Shard(0)]``)."""
    index = 0
    for size, coordinate in list(zip(mesh.shape, mesh.get_coordinate() or ()))[:axes]:
        index = index * size + coordinate
    return index


def _model_outputs(output: Any, loss: Any) -> list[Any]:
    """The model's output tensors, less the loss where the model returns it (``output.loss``):
    the program returns that as its first value."""
    from autoplan.trace.values import tensor_leaves

    return [t for t in tensor_leaves(output) if t is not loss]


def _parallelize(module: torch.nn.Module, mesh: DeviceMesh, styles: dict[str, tuple[str, DPlacement | None]],
                 input_layouts: dict[str, DPlacement] | None = None) -> None:
    """``parallelize_module`` with the recognised styles: column parallel (its output sharded,
    gathered where the style names ``Replicate``, all-to-all'd onto a sequence shard where it
    names ``Shard``; its input gathered where ``input_layouts`` names a shard), row parallel
    (its output reduced to the layout named), sequence parallel (a norm on sequence shards).
    Values sharded on the sequence stay DTensors between the styles; the others are local."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {}
    for name, (kind, layout) in styles.items():
        local = not isinstance(layout, Shard)
        if kind == "colwise":
            plan[name] = ColwiseParallel(input_layouts=(input_layouts or {}).get(name, Replicate()),
                                         output_layouts=layout or Shard(-1), use_local_output=local)
        elif kind == "sequence":
            plan[name] = SequenceParallel(sequence_dim=layout.dim)
        else:
            plan[name] = RowwiseParallel(output_layouts=layout, use_local_output=local)
    # every rank holds the same weights: cut them locally (src_data_rank=None), no scatter
    parallelize_module(module, mesh, plan, src_data_rank=None)


def _without_cache(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with a Hugging Face model's key-value cache turned off (``config.use_cache``):
    the traced graph returns no cache, and a checkpointed layer that wrote one in the forward
    would find it full when the backward runs the layer again (its attention over twice the
    keys, and selective checkpointing's saved outputs out of step)."""
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    return module


def sharded_blocks(module: torch.nn.Module, plan: Plan) -> list[torch.nn.Module]:
    """The modules FSDP shards and gathers as one unit each: the plan's layers that are modules
    and hold parameters (the repeated blocks, as torchtitan wraps each transformer block), in
    order; the root gathers what is left (embeddings, the head, tied weights)."""
    blocks = []
    for name in dict.fromkeys(layer for stage in plan.stages for layer in stage.layers):
        try:
            block = module.get_submodule(name) if name else None
        except AttributeError:
            continue
        if block is not None and block is not module and any(True for _ in block.parameters()):
            blocks.append(block)
    return blocks


def native_pattern(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised | None:
    """The native pattern ``plan`` reduces to (:func:`recognised_pattern`), or None where the
    interpreter runs it."""
    found = recognised_pattern(spec, graph, plan)
    return None if found.kind == "none" else found


def recognised_pattern(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised:
    """:func:`recognise` on ``spec`` as ``graph`` was traced (one microbatch's inputs), with the
    modules whose products per-op recomputation keeps; kind ``"none"`` and the reason where the
    interpreter runs the plan."""
    kept = kept_modules(graph, plan)
    if isinstance(kept, str):  # the interpreter keeps such products by node
        return Recognised("none", {}, kept)
    one = spec if plan.microbatches == 1 else \
        spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches))
    found = recognise(one, graph, plan)
    if found.kind in ("fsdp", "hsdp", "fsdp_tp"):
        frozen = frozen_group(spec.module, sharded_blocks(spec.module, plan))
        if frozen is not None:
            return Recognised("none", {}, frozen)
    return found if found.kind == "none" else dataclasses.replace(found, kept_modules=kept)


def native_module(spec: ModelSpec, graph: TracedGraph, plan: Plan, mesh: DeviceMesh,
                  found: Recognised | None = None) -> NativeProgram | None:
    """The native program for ``plan`` (DDP or ``parallelize_module``), or ``None`` when the plan
    is not one of the recognised patterns (see the module docstring); ``found``: its
    :func:`native_pattern`, where the caller has it. ``spec.module`` is not modified: the
    program wraps a copy (on the mesh's device)."""
    found = found or native_pattern(spec, graph, plan)
    if found is None:
        return None
    kept = found.kept_modules
    whole_mesh = mesh
    meta = has_meta_tensors(spec.module)  # allocated below, shard by shard where the plan shards
    module = _without_cache(copy.deepcopy(spec.module))
    if not meta:
        module.to(mesh.device_type)
    elif found.kind in ("single", "replicated", "ddp"):  # a whole copy on every rank, by design
        materialise_whole(module, mesh.device_type, spec.init_weights)
    if found.kind == "fsdp_tp":  # tensor parallelism first, then checkpointing and FSDP, as torchtitan
        data, tensor = mesh.mesh_dim_names or ()
        _parallelize(module, mesh[tensor], found.styles, found.input_layouts)
    tables = 0
    if found.storage is not None and found.storage.embeddings:  # tables read in place, before FSDP
        tables = parallelize_embeddings(module, mesh, found.storage.embeddings,
                                        mixed_precision_policy(plan.precision))
    for layer in plan.recompute:
        selective = {"context_fn": selective_contexts} if layer.mode == RecomputeMode.SELECTIVE else \
            {"context_fn": KeptModules(map(module.get_submodule, kept[layer.layer])).contexts} \
            if layer.mode == RecomputeMode.PER_OP else {}
        # under tensor parallelism the whole layer again, its last all-reduces included, as planned
        # (torch's early stop would end the recomputation at the last tensor the backward needs)
        checkpoint(module.get_submodule(layer.layer), early_stop=found.kind != "fsdp_tp", **selective)
    if found.kind in ("single", "replicated"):
        return NativeProgram(found.kind, module, spec, graph, plan, mesh, {})
    if found.kind in ("fsdp", "hsdp", "fsdp_tp"):
        # on a 2-D mesh FSDP2 replicates over axis 0 and shards over axis 1 (HSDP), or shards over
        # axis 0 the tensor-parallel shards of axis 1 (FSDP x TP, as torchtitan composes them);
        # every group re-gathers in the backward what it freed after the forward, the root too:
        # the plan re-gathers every weight a backward reads
        if found.kind == "fsdp_tp":
            mesh = mesh[data]
        resharded = found.reshard_after_forward  # False: ZeRO-2 or held, gathered once per step
        units = shard_modules(module, sharded_blocks(module, plan), mesh, mixed_precision_policy(plan.precision),
                              resharded, found.storage)
        if meta:
            materialise_whole(module, mesh.device_type, spec.init_weights)  # to_empty allocates the shards
        return NativeProgram(found.kind, module, spec, graph, plan, whole_mesh, found.styles,
                             fsdp_groups=units.sharded, replicate_groups=units.replicated, held_groups=units.held,
                             table_groups=tables,
                             storage=found.storage,
                             token_mean=found.token_mean, reshard_after_forward=resharded,
                             held_through_step=found.held_through_step)
    if found.kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [torch.device(mesh.device_type, torch.accelerator.current_device_index())] \
            if mesh.device_type != "cpu" else None
        # a parameter no op reads would stall DDP's reducer unless it is told to look for it
        read = {graph.param_names[n.name] for n in graph.graph_module.graph.nodes
                if n.op == "placeholder" and n.name in graph.param_names and n.users}
        unused = any(fqn not in read and fqn not in graph.tied
                     for fqn, p in module.named_parameters(remove_duplicate=False) if p.requires_grad)
        wrapped = DistributedDataParallel(module, device_ids=device_ids, process_group=mesh.get_group(),
                                          forward_sync_buffers=False, find_unused_parameters=unused)
        return NativeProgram("ddp", wrapped, spec, graph, plan, mesh, {}, token_mean=found.token_mean)
    _parallelize(module, mesh, found.styles)
    if meta:
        materialise_whole(module, mesh.device_type, spec.init_weights)
    return NativeProgram("tensor_parallel", module, spec, graph, plan, mesh, found.styles)

