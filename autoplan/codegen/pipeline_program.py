"""Execute a pipelined :class:`Plan`: ``torch.distributed.pipelining`` stages, each stage
intra-op sharded with DTensor on its own sub-mesh.

``build_pipeline(graph, plan, params, device_type)`` is called in every rank of a job whose world
size is ``plan.devices``; it gives a :class:`PipelineProgram`. ``program.train_step(*inputs)``
takes the GLOBAL batch (the same on every rank), runs one schedule step (forward and backward of
every microbatch), leaves this rank's gradients accumulated in its parameters and returns the
global loss (the same on every rank).

Layout
------
Every stage holds k devices; each has its own logical mesh ``StagePlan.mesh`` (``(4,)`` for one
stage, ``(2, 2)`` for the next, say). For every distinct stage mesh shape the job's
``plan.devices`` ranks form a world ``DeviceMesh`` of shape ``(pp, *shape)`` with dim names
``("pp", "m0", "m1", ...)``: pp rank p owns the contiguous ranks ``p*k .. p*k+k-1``, and a
stage's sub-mesh is the slice of its shape's world mesh at this rank's pp coordinate. The
``pp`` process group of a rank links the ranks with the same position ``rank % k`` in every pp
rank (the same for every shape); stages send over it. Between two stages on the same logical
mesh a value crosses as shards (rank ``i`` sends rank ``i`` its piece); on its way to or from a
stage on another logical mesh it crosses whole (:class:`StageCrossing`).

Mapping ``plan.stages`` to ranks: ``plan.stages[s].devices`` must be exactly one pp rank's block.
``len(plan.stages) == pp`` for the single-stage schedules (``gpipe``, ``1f1b``): stage s on pp
rank s. With V virtual stages per rank (``len(plan.stages) == pp * V``) the multi-stage
schedules want torch's own stage → rank maps, which :func:`stage_ranks` gives:

- ``interleaved1f1b``, ``loopedbfs``, ``interleavedzerobubble`` ("loop"): stage s on pp rank
  ``s % pp`` (e.g. pp=2, 4 stages: ranks 0, 1, 0, 1);
- ``zbvzerobubble``, ``dualpipev`` ("v", exactly 2 stages per rank): stages 0..pp-1 on ranks
  0..pp-1, stages pp..2pp-1 back from pp-1 to 0 (pp=2: ranks 0, 1, 1, 0).

Stage submodules
----------------
Each stage runs its op nodes (``StagePlan.nodes``, graph order) with DTensors on its sub-mesh,
redistributing every op's inputs to the plan's placements as :mod:`dtensor_program` does. Its
inputs are the values crossing its left boundary: every value produced before the stage (user
inputs included) and used in it or after it, in graph order; the first stage takes all user
inputs, and passes on those later stages need (nanoGPT's ``targets`` travels to the last stage).
A stage's outputs are the next stage's inputs; the last stage returns its microbatch's scalar
loss. Values cross as plain local tensors, each rank's piece of the value as
:func:`~autoplan.sharding.boundary_spec` lays it out on the stage's mesh (the residual stream
``[b, s, h]`` of a stage on ``4x2`` is sent as its ``[S(0), S(1)]`` shards, an eighth per rank,
as torchtitan's tensor-parallel stages hand on theirs), or whole where the plan says so
(:attr:`~autoplan.plan_schema.Plan.crossing_whole`: values too small to gain from sharding)
or where its way passes a stage on another logical mesh. A stage output is redistributed to
those placements and ``to_local()``-ed; a received tensor is wrapped as a DTensor of them (its
backward redistributes the gradient to them, so every rank sends back the gradient of the
piece it received). The planner costs each stage's ILP with its received values and outputs
fixed so.

Loss and gradients: the schedule's ``loss_fn`` returns the stage's loss times ``1/M`` (for a
mean loss; ``loss_reduction="sum"`` uses 1), and the schedule runs with ``scale_grads=False``:
the gradients are then exactly those of the global-batch loss, and they ACCUMULATE over
successive ``train_step`` calls (torch's ``scale_grads=True`` divides the accumulated ``.grad``
after every step, so it would also divide gradients accumulated before the step).
After the schedule: gradients left as partial sums (a parameter replicated over a batch-sharded
mesh axis) are reduced into the parameter's placement, once per step, not once per microbatch,
in buckets (one flat all-reduce per dtype, set of axes and axis, where the plan lists one per
parameter: :attr:`PipelineProgram.gradient_buckets_launched` counts them for ``--check``).
A gradient the plan stores sharded unlike its parameter (ZeRO-2) is instead reduce-scattered on
each edge that reads the parameter, in every microbatch's backward, and accumulates as a shard
(``reduce_gradient_on_edge``): no whole gradient outlives a microbatch, as the plan costs it.
A held parameter (FSDP under a pipeline: stored as its shard, gathered once per step and held
through the microbatches) is gathered before the schedule runs and its accumulated gradient
reduce-scattered into the shard after it (:mod:`autoplan.codegen.held_parameters`).

Tied weights (nanoGPT's ``wte``/``lm_head``): a parameter read by stages on different pp ranks
is held by each of them (distributed the same way on each sub-mesh); after the step the copies'
gradients are all-reduced among the owners (one group per sub-mesh coordinate), so every copy
gets the full gradient and identical optimizer steps keep the copies equal. Stages on the same
pp rank share one ``nn.Parameter``. Buffers read by several pp ranks are copied and NOT kept in
sync (none of the example models has one).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.placement_types import Placement

from autoplan.codegen.checkpointing import CheckpointedRegions
from autoplan.codegen.dtensor_program import ShardedProgram, dispatch_settings, tensor_inputs_of
from autoplan.codegen.prefetched_gathers import PrefetchedGathers, recomputed_reads
from autoplan.codegen.gradient_buckets import parameter_reads
from autoplan.codegen.held_parameters import HeldParameter, held_parameters
from autoplan.codegen.materialize import planned_tensor
from autoplan.codegen.op_calls import REPLACED_OPS, call_planned_op
from autoplan.codegen.parameter_regather import GatheredParameters, backward_starts, parameter_block
from autoplan.codegen.pipeline_layout import (StageLayout, is_multi_stage, is_skipped, pipeline_layout,
    schedule_class, stage_ranks)
from autoplan.codegen.pipeline_step import gradients_added, step_inputs
from autoplan.codegen.precision import compute_precision, gathered_dtype
from autoplan.codegen.redistribution import reduce_gradient_on_edge, reduce_to, redistribute, to_dtensor_placements
from autoplan.codegen.loss_weights import microbatch_weights
from autoplan.codegen.sharded_state import gradient_placements, reduced_before_step
from autoplan.errors import AutoplanError
from autoplan.sharding import boundary_spec, deferred_axes, spec_to_json
from autoplan.plan_schema import CouplingHandling, NodePlan, Plan, PrefetchedGather, RecomputedLayer
from autoplan.trace.batch_coupling import count_program
from autoplan.trace.graph import NodeKind, TracedGraph
from autoplan.trace.saved_inputs import regathers_for
from autoplan.trace.wrapped_regions import autocast_region

__all__ = [
    "PipelineProgram",
    "StageLayout",
    "build_pipeline",
    "pipeline_layout",
    "schedule_class",
    "stage_ranks",
]

@dataclass(frozen=True)
class StageCrossing:
    """How a stage's values cross its boundaries: the placements (on its sub-mesh) of each value
    it receives and of each it hands on, in :class:`StageLayout` order. Rank ``i`` of a stage
    sends its shard to rank ``i`` of the next, so both lay a value out alike
    (:func:`~autoplan.sharding.boundary_spec`), and a value whose way from the stage computing
    it to the last reading it passes a stage on another logical mesh crosses whole, at every
    boundary, as the planner costs it (:func:`~autoplan.planner.pipeline.range_costs.whole_crossings`);
    the first stage receives the microbatch whole, the last hands on only its loss."""

    inputs: list[tuple[Placement, ...]]
    outputs: list[tuple[Placement, ...]]

    @classmethod
    def of(cls, layout: StageLayout, meshes: Sequence[tuple[int, ...]], index: int,
           crossing_whole: frozenset[str] = frozenset()) -> StageCrossing:
        """Stage ``index``'s crossings; the values named in ``crossing_whole`` (the plan's
        :attr:`~autoplan.plan_schema.Plan.crossing_whole`) cross whole."""
        mesh = tuple(meshes[index])
        whole = (Replicate(),) * len(mesh)

        def placements(node: torch.fx.Node) -> tuple[Placement, ...]:
            if node.name in crossing_whole:
                return whole
            # its way: every stage from the first that sends it to the last that receives it
            way = [s for s in range(1, layout.num_stages) if node in layout.inputs[s]]
            if len({tuple(meshes[s]) for s in range(way[0] - 1, way[-1] + 1)}) > 1:
                return whole  # passes a stage on another logical mesh
            shape = tuple(int(d) for d in node.meta["val"].shape)
            return tuple(to_dtensor_placements(spec_to_json(boundary_spec(shape, mesh))))

        inputs = [placements(n) if index else whole for n in layout.inputs[index]]
        last = index == layout.num_stages - 1
        outputs = [whole if last else placements(n) for n in layout.outputs[index]]
        return cls(inputs, outputs)

    def example_inputs(self, nodes: Sequence[torch.fx.Node], mesh_shape: tuple[int, ...], grads: Sequence[bool],
                       device: torch.device) -> tuple[torch.Tensor, ...]:
        """What torch's stage receives (its buffers' shapes): this rank's shard of each value."""
        return tuple(_example(n, g, device, p, mesh_shape) for n, g, p in zip(nodes, grads, self.inputs))

    def example_outputs(self, nodes: Sequence[torch.fx.Node], mesh_shape: tuple[int, ...], grads: Sequence[bool],
                        device: torch.device) -> tuple[torch.Tensor, ...]:
        return tuple(_example(n, g, device, p, mesh_shape) for n, g, p in zip(nodes, grads, self.outputs))


class _StageModule(torch.nn.Module):
    """One pipeline stage: runs its nodes on DTensors over its sub-mesh. ``forward`` takes the
    boundary values as plain (full) tensors and returns plain tensors (or the scalar loss)."""

    def __init__(self, index: int, layout: StageLayout, mesh: DeviceMesh, node_plans: dict[str, NodePlan],
                 params: dict[str, torch.Tensor], placeholder_fqn: dict[str, str],
                 constants: dict[str, torch.Tensor], graph_module: torch.fx.GraphModule,
                 recomputed: Sequence[RecomputedLayer] = (),
                 precision: Callable[[], AbstractContextManager] = nullcontext,
                 gradient_targets: dict[int, tuple[Placement, ...]] | None = None,
                 param_dtype: torch.dtype | None = None, held: dict[str, HeldParameter] | None = None,
                 crossing: StageCrossing | None = None, prefetch: Sequence[PrefetchedGather] = (),
                 prefetch_regathers: bool = False) -> None:
        super().__init__()
        self.index = index
        self.mesh = mesh
        # how each value arrives and leaves (this rank's shard of it, or the whole value)
        self.crossing = crossing or StageCrossing([], [])
        self.precision = precision  # the plan's precision, entered by each forward
        self.gradient_targets = gradient_targets or {}  # id(parameter) -> its gradient's placements (ZeRO-2)
        self.node_plans = node_plans
        self.graph_module = graph_module
        self.nodes = layout.nodes[index]
        self.input_nodes = layout.inputs[index]
        self.output_nodes = layout.outputs[index]
        self.checkpointed = CheckpointedRegions(recomputed, self.nodes, partial(dispatch_settings, mesh.device_type))
        self.is_last = index == layout.num_stages - 1
        self._locals: dict[torch.fx.Node, str] = {}  # parameter/buffer placeholder -> attribute
        self._constants: dict[torch.fx.Node, torch.Tensor] = {}
        self._held: dict[torch.fx.Node, HeldParameter] = {}  # read from the step's held copy
        for node in layout.param_nodes[index]:
            if node.name in placeholder_fqn:
                fqn = placeholder_fqn[node.name]
                if held and fqn in held:
                    self._held[node] = held[fqn]
                attr = fqn.replace(".", "__")
                tensor = params[fqn]
                if isinstance(tensor, torch.nn.Parameter):
                    self.register_parameter(attr, tensor)
                else:
                    self.register_buffer(attr, tensor)
                self._locals[node] = attr
            elif node.name in constants:
                self._constants[node] = constants[node.name]
            else:
                raise AutoplanError(f"graph input {node.name} is neither a parameter, a buffer nor a user input")
        self.redistributions: list[tuple[str, str, str]] = []
        # parameters redistributed for a consumer: re-gathered in the backward, not kept
        self.param_dtype = param_dtype  # what a parameter's gathers move
        self.gathered = GatheredParameters(param_dtype, prefetch_regathers, mesh.device_type)
        # the ops whose output's gradient starts a block's backward (the block before it re-gathered)
        self.backward_starts = backward_starts(self.nodes) if prefetch_regathers else {}
        self._blocks = {node: parameter_block(placeholder_fqn[node.name]) for node in self._locals}  # repeated ones
        # gathers issued a block ahead of their consumers (the plan's, for this stage's ops)
        names = {n.name for n in self.nodes}
        self._by_name = {n.name: n for n in self.nodes}
        # and a recomputed block's, issued when the backward of the block after it starts
        in_layers = {name for layer in recomputed for name in layer.nodes}
        planned = {n.name: tensor_inputs_of(n) for n in self.nodes
                   if n.name in node_plans and n.target is not operator.getitem}
        gathered = {node.name: placeholder_fqn[node.name] for node in self._locals if node not in self._held}
        self.prefetched = PrefetchedGathers(
            [p for p in prefetch if p.at in names], mesh.device_type,
            recomputed_reads(planned, (n for n in self.nodes if n.name in in_layers), gathered)
            if prefetch_regathers else None)

    def forward(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self.input_nodes):
            raise AutoplanError(f"stage {self.index} takes {len(self.input_nodes)} values, got {len(args)}")
        replicate = (Replicate(),) * self.mesh.ndim
        env: dict[torch.fx.Node, Any] = {}
        for i, (node, value) in enumerate(zip(self.input_nodes, args)):
            arrives = self.crossing.inputs[i] if i < len(self.crossing.inputs) else replicate
            env[node] = DTensor.from_local(value, self.mesh, arrives, run_check=False) \
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) else value
        for node, attr in self._locals.items():
            env[node] = self._held.get(node) or getattr(self, attr)  # a held one is read at each use
        env.update(self._constants)
        try:
            with self.precision(), dispatch_settings(self.mesh.device_type), self.gathered.hooks():
                for n in self.nodes:
                    self.prefetched.issue(n.name, partial(self._gather, env))
                    env[n] = self.checkpointed.value(n, env, self._run) if n in self.checkpointed else self._run(n, env)
        finally:
            self.prefetched.clear()
        outs = []
        for i, node in enumerate(self.output_nodes):
            value = env[node]
            if isinstance(value, DTensor):
                leaves = self.crossing.outputs[i] if i < len(self.crossing.outputs) else replicate
                if tuple(value.placements) != tuple(leaves):
                    value = value.redistribute(self.mesh, leaves)
                value = value.to_local()
            if isinstance(value, torch.Tensor):
                # sent as traced: a value the precision computed in bf16 goes out in its model dtype
                value = value.to(node.meta["val"].dtype)
                # torch's zero-bubble schedules detach the outputs in place: no views
                value = value.contiguous()
                if value._is_view():
                    value = value.clone()
            outs.append(value)
        if self.is_last:
            return outs[0]
        return tuple(outs)

    def _gather(self, env: dict[torch.fx.Node, Any], consumer: str, pos: int) -> Any:
        """Input ``pos`` of op ``consumer`` resharded as its plan reads it (a prefetched gather)."""
        a = tensor_inputs_of(self._by_name[consumer])[pos]
        return redistribute(env[a], self.node_plans[consumer].inputs[pos], self.mesh,
                            self.gradient_targets.get(id(env[a])), self.param_dtype)

    def _gather_stored(self, consumer: str, pos: int) -> Any:
        """Input ``pos`` of op ``consumer``, a parameter of this stage, resharded as its plan
        reads it (a recomputation's prefetched gather)."""
        a = tensor_inputs_of(self._by_name[consumer])[pos]
        param = getattr(self, self._locals[a])
        return redistribute(param, self.node_plans[consumer].inputs[pos], self.mesh,
                            self.gradient_targets.get(id(param)), self.param_dtype)

    def _run(self, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        """``n``'s value (inside a checkpointed region too, where its output's gradient starts
        a block's backward: :meth:`GatheredParameters.watch`)."""
        out = self._value_of(n, env)
        block = self.backward_starts.get(n.name)
        if block is not None:
            self.gathered.watch(out, block)
            self.prefetched.watch(out, block, self._gather_stored)
        return out

    def _value_of(self, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        region = autocast_region(n)
        if region is None:
            return self._value_in_plan_precision(n, env)
        with region.context(self.mesh.device_type):  # the model's own autocast region
            return self._value_in_plan_precision(n, env)

    def _value_in_plan_precision(self, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        if n.op == "get_attr":
            target = self.graph_module
            for part in str(n.target).split("."):
                target = getattr(target, part)
            return target
        if is_skipped(n):
            return None
        node_plan = self.node_plans.get(n.name)
        arrived: dict[torch.fx.Node, Any] = {}
        for a in n.all_input_nodes:
            if isinstance(env.get(a), HeldParameter):  # its held copy, cast, for this consumer only
                arrived[a] = env[a].read()
                self.gathered.remember_held(arrived[a], env[a].copy)
        if node_plan is not None and n.target is not operator.getitem:
            tensor_inputs = tensor_inputs_of(n)
            if len(node_plan.inputs) != len(tensor_inputs):
                raise AutoplanError(f"plan for {n.name} lists {len(node_plan.inputs)} tensor inputs, the graph has "
                                    f"{len(tensor_inputs)}: the plan is not for this graph")
            for pos, (a, specs) in enumerate(zip(tensor_inputs, node_plan.inputs)):
                if a in self._held:
                    arrived[a] = redistribute(arrived[a], specs, self.mesh)
                    continue
                target = self.gradient_targets.get(id(env[a])) if a in self._locals else None
                prefetched = self.prefetched.take(n.name, pos)
                arrived[a] = prefetched if prefetched is not None else \
                    redistribute(env[a], specs, self.mesh, target, self.param_dtype)
                if a in self._locals:  # a parameter's partial gradient is reduced after the schedule,
                    if regathers_for(n):  # a ZeRO-2 one into its shard on the edge, every microbatch
                        self.gathered.remember(arrived[a], env[a], specs, self._blocks.get(a))
                    if target is not None:
                        arrived[a] = reduce_gradient_on_edge(env[a], arrived[a], target)
                elif pos < len(node_plan.grad_partial) and node_plan.grad_partial[pos]:
                    arrived[a] = reduce_gradient_on_edge(env[a], arrived[a])  # on the edge, as planned
        args = torch.fx.node.map_arg(n.args, lambda a: arrived[a] if a in arrived else env[a])
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: arrived[a] if a in arrived else env[a])
        if node_plan is not None and n.target is not operator.getitem:
            return call_planned_op(n.target, args, kwargs, node_plan, [arrived[a] for a in tensor_inputs], self.mesh)
        return REPLACED_OPS.get(n.target, n.target)(*args, **kwargs)


def _example(node: torch.fx.Node, requires_grad: bool, device: torch.device,
             placements: tuple[Placement, ...] = (), mesh_shape: tuple[int, ...] = ()) -> torch.Tensor:
    """An empty tensor of ``node``'s value as one rank holds it under ``placements``."""
    val = node.meta["val"]
    shape = [int(d) for d in val.shape]
    for p, n in zip(placements, mesh_shape):
        if p.is_shard():
            shape[p.dim] //= n
    return torch.empty(tuple(shape), dtype=val.dtype, device=device, requires_grad=requires_grad)


# --------------------------------------------------------------------------------------------
# The program


class PipelineProgram(torch.nn.Module):
    """This rank's part of a pipelined plan. See the module docstring.

    ``stages`` are this rank's stage modules (several with virtual stages), ``schedule`` the
    torch schedule object, ``mesh`` the world ``DeviceMesh`` ``(pp, *plan.mesh)`` (stage 0's
    logical mesh), ``stage_meshes`` the sub-mesh of each of this rank's stages by stage index."""

    def __init__(self, graph: TracedGraph, plan: Plan, params: dict[str, torch.Tensor], device_type: str = "cpu",
                 world_mesh: DeviceMesh | None = None, loss_reduction: str = "mean") -> None:
        super().__init__()
        from torch.distributed.pipelining import PipelineStage

        if plan.graph_hash != graph.graph_hash:
            raise AutoplanError("the plan was made for another graph (graph_hash differs): plan this model again")
        if not dist.is_initialized():
            raise AutoplanError("no process group: call autoplan.codegen.runtime.init_distributed() first")
        if dist.get_world_size() != plan.devices:
            raise AutoplanError(f"the plan is for {plan.devices} devices but this job has {dist.get_world_size()} "
                                f"processes: launch with --nproc-per-node {plan.devices}")
        if loss_reduction not in ("mean", "sum"):
            raise AutoplanError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        self.plan = plan
        self.layout = layout = pipeline_layout(graph, plan)
        self.num_microbatches = plan.microbatches
        self.loss_reduction = loss_reduction
        self.input_names = list(graph.input_names)
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device(device_type)
        # one world mesh per distinct stage mesh shape, created in stage order on every rank
        world_meshes: dict[tuple[int, ...], DeviceMesh] = {}
        for st in plan.stages:
            shape = tuple(st.mesh)
            if shape not in world_meshes:
                reuse = world_mesh if shape == tuple(plan.stages[0].mesh) else None
                world_meshes[shape] = _world_mesh(device_type, layout.pp, shape, plan.devices, reuse)
        self.mesh = world_meshes[tuple(plan.stages[0].mesh)]
        self.pp_group = self.mesh.get_group("pp")
        self.pp_rank = self.mesh.get_local_rank("pp")
        local_stages = layout.stages_of_rank(self.pp_rank)
        self.stage_meshes = {s: _slice(world_meshes[tuple(plan.stages[s].mesh)]) for s in local_stages}
        k = math.prod(plan.stages[0].mesh)
        self.coordinate = dist.get_rank() % k

        # parameters of this rank's stages, distributed on the sub-mesh; one object per FQN
        tied = dict(graph.tied)
        self.tied = tied
        placeholder_fqn = {name: tied.get(fqn, fqn) for name, fqn in graph.param_names.items()
                           if graph.nodes[name].kind != NodeKind.CONSTANT}  # not lifted tensor constants
        buffer_fqns = {info.fqn for info in graph.nodes.values() if info.kind == "buffer" and info.fqn}
        self.stage_indices = local_stages
        owners: dict[str, set[int]] = {}
        holder: dict[str, DeviceMesh] = {}  # FQN -> the sub-mesh of this rank's first stage reading it
        for s in range(layout.num_stages):
            for node in layout.param_nodes[s]:
                if node.name in placeholder_fqn:
                    fqn = placeholder_fqn[node.name]
                    owners.setdefault(fqn, set()).add(layout.stage_rank[s])
                    if s in self.stage_meshes:
                        mesh = holder.setdefault(fqn, self.stage_meshes[s])
                        if tuple(mesh.shape) != tuple(self.stage_meshes[s].shape):
                            raise AutoplanError(f"{fqn} is read by stages on logical meshes {tuple(mesh.shape)} and "
                                                f"{tuple(self.stage_meshes[s].shape)} of one pipeline rank: "
                                                "the stages holding a parameter must share a logical mesh")
        self._local: dict[str, torch.Tensor] = {}
        for fqn in sorted(f for f, ranks in owners.items() if self.pp_rank in ranks):
            if fqn not in params:
                raise AutoplanError(f"no tensor given for {fqn}: pass model.named_parameters() and named_buffers()")
            tensor = params[fqn].detach()
            tensor = tensor if tensor.is_meta else tensor.to(self.device)
            mesh = holder[fqn]
            storage = plan.storage.get(fqn)
            # a held parameter is stored as its optimizer state's shard, and gathered once per step
            specs = storage.optimizer_state if storage is not None and storage.held \
                else plan.params.get(fqn, ["R"] * mesh.ndim)
            if len(specs) != mesh.ndim:
                raise AutoplanError(f"plan stores {fqn} as {specs}, but its stage's mesh has {mesh.ndim} axes: "
                                    "the stages holding a parameter must share a logical mesh")
            placements = to_dtensor_placements(specs)
            if any(isinstance(p, Partial) for p in placements):
                raise AutoplanError(f"plan stores {fqn} as partial sums ({specs}): a parameter must be R or S(d)")
            dt = planned_tensor(tensor, mesh, placements)  # a meta tensor: this rank's shard, empty
            if fqn in buffer_fqns or not tensor.is_floating_point():
                self._local[fqn] = dt
            else:
                self._local[fqn] = torch.nn.Parameter(dt, requires_grad=params[fqn].requires_grad)
        self.gradient_targets = gradient_placements(plan.storage, self._local)
        self.held = held_parameters(plan.storage, self._local, gathered_dtype(plan.precision))
        node_plans = {np_.name: np_ for np_ in plan.nodes}
        # ZeRO-1 parameters (ids) whose every edge reads them as stored: their partial sums are
        # reduce-scattered by the optimizer step (the others' edges reduce them, as planned)
        deferred = set()
        for name, uses in parameter_reads(graph.graph_module, node_plans, placeholder_fqn).items():
            fqn = placeholder_fqn[name]
            local = self._local.get(fqn)
            if local is not None and deferred_axes(uses, plan.params.get(fqn, []),
                                                   tuple(local.device_mesh.shape)) is not None:
                deferred.add(fqn)
        self.reduced_before_step = reduced_before_step(plan.storage, self._local, deferred)
        constants = ShardedProgram._lifted_constants(graph)
        self.stage_modules = torch.nn.ModuleList(
            _StageModule(s, layout, self.stage_meshes[s], node_plans, self._local, placeholder_fqn, constants,
                         graph.graph_module, plan.recompute, partial(compute_precision, plan.precision, device_type),
                         self.gradient_targets, gathered_dtype(plan.precision), self.held,
                         StageCrossing.of(layout, [tuple(st.mesh) for st in plan.stages], s,
                                          frozenset(plan.crossing_whole)), plan.prefetch, plan.prefetch_regathers)
            for s in local_stages)

        # groups summing the gradients of parameters held on several pp ranks (tied weights):
        # every rank creates every group, in the same order
        self._shared: list[tuple[str, Any]] = []
        groups: dict[tuple[int, ...], Any] = {}
        for fqn in sorted(owners):
            ranks = tuple(sorted(owners[fqn]))
            if len(ranks) < 2 or fqn in buffer_fqns or not params[fqn].is_floating_point() \
                    or not params[fqn].requires_grad:
                continue
            if ranks not in groups:
                mine = None
                for c in range(k):
                    group = dist.new_group([p * k + c for p in ranks])
                    if c == self.coordinate:
                        mine = group
                groups[ranks] = mine
            if self.pp_rank in ranks:
                self._shared.append((fqn, groups[ranks]))

        # the torch stages and schedule
        self.pipeline_stages = []
        for module in self.stage_modules:
            s = module.index
            first = s == 0
            shape = tuple(module.mesh.shape)
            in_args = module.crossing.example_inputs(
                layout.inputs[s], shape, [(not first) and layout.needs_grad.get(n, False) for n in layout.inputs[s]],
                self.device)
            if module.is_last:
                out_args: tuple[torch.Tensor, ...] = (_example(layout.loss_node, True, self.device),)
            else:
                out_args = module.crossing.example_outputs(
                    layout.outputs[s], shape, [layout.needs_grad.get(n, False) for n in layout.outputs[s]], self.device)
            self.pipeline_stages.append(PipelineStage(module, s, layout.num_stages, self.device,
                                                      input_args=in_args, output_args=out_args,
                                                      group=self.pp_group))
        cls = schedule_class(plan.schedule)
        self._scale = 1.0 / plan.microbatches if loss_reduction == "mean" else 1.0
        # a mean loss over a data-dependent count: each microbatch's mean is weighted by its
        # share of the targets, counted on the inputs before the schedule runs
        weighted = [c.node for c in plan.batch_coupling if c.handling == CouplingHandling.WEIGHTED_MICROBATCHES
                    and plan.microbatches > 1]
        self._count = count_program(graph, weighted[0]) if weighted else None

        def loss_fn(output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return output * weight.reshape(()).to(output.dtype)

        stages_arg = self.pipeline_stages if is_multi_stage(cls) else self.pipeline_stages[0]
        self.schedule = cls(stages_arg, plan.microbatches, loss_fn=loss_fn, scale_grads=False)
        self.gradient_buckets_launched = 0  # flat all-reduces of the last step's bucketed gradients
        self.has_first = 0 in local_stages
        self.has_last = layout.num_stages - 1 in local_stages
        self.loss_src = plan.stages[-1].devices[0]
        self.single_stage = layout.num_stages == 1  # gradient accumulation

    # -- parameters

    def named_plan_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and buffers by the model's FQN (DTensors on the stage's
        sub-mesh); tied FQNs whose weight this rank holds give the same object."""
        out = dict(self._local)
        out.update({fqn: out[used] for fqn, used in self.tied.items() if used in out})
        return out

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        return {k: v for k, v in self.named_plan_tensors().items() if isinstance(v, torch.nn.Parameter)}

    # -- one step

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One schedule step on the GLOBAL batch (the same on every rank): forward and backward of
        every microbatch; gradients are added to this rank's parameters' ``.grad``. Returns the
        global loss (a 0-d tensor, the same on every rank)."""
        inputs = step_inputs(inputs, self.input_names, self.num_microbatches, self.device)
        params = [t for t in self._local.values() if isinstance(t, torch.nn.Parameter)]
        losses: list[torch.Tensor] = []
        args = inputs if self.has_first else ()
        with gradients_added(params):
            for held in self.held.values():  # gathered once for all the microbatches
                held.gather()
            self.schedule.step(*args, target=self._microbatch_weights(inputs), losses=losses, return_outputs=False)
            for held in self.held.values():  # reduce-scattered once, after the last microbatch
                held.reduce_gradient()
            self._finish_gradients(params)
        loss = torch.stack([x.detach() for x in losses]).sum() if self.has_last and losses \
            else torch.zeros((), device=self.device)
        loss = loss.to(torch.float32).contiguous()
        if not self.single_stage:  # one stage: every rank computed the loss
            dist.broadcast(loss, src=self.loss_src)
        return loss

    def _microbatch_weights(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """``[M, 1]``: what each microbatch's loss is multiplied by (the schedule hands
        microbatch ``i`` row ``i`` as its target)."""
        return microbatch_weights(inputs, self.num_microbatches, self._scale, self._count, self.device)

    def _finish_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        # partial sums → the parameter's placement: summed over axes where the parameter is
        # replicated (data parallelism over a batch-sharded axis) in buckets, one flat
        # all-reduce per bucket and axis, as the plan costs them; anything else one by one
        buckets: dict[tuple[DeviceMesh, tuple[int, ...], torch.dtype], list[torch.nn.Parameter]] = {}
        for p in params:
            g = p.grad
            if not isinstance(g, DTensor):
                continue
            if id(p) in self.reduced_before_step:  # ZeRO-1: reduce-scattered by the optimizer step
                continue
            target = self.gradient_targets.get(id(p))
            if target is not None:  # ZeRO-2: reduced (or sliced) into the gradient's own placements
                if tuple(g.placements) != tuple(target):
                    p.grad = reduce_to(g, p.device_mesh, target)
                continue
            if g.placements == p.placements:
                continue
            axes = tuple(i for i, (q, r) in enumerate(zip(g.placements, p.placements)) if q != r)
            if all(isinstance(g.placements[i], Partial) and g.placements[i].reduce_op == "sum"
                   and p.placements[i].is_replicate() for i in axes):
                buckets.setdefault((p.device_mesh, axes, g.dtype), []).append(p)
            else:
                p.grad = reduce_to(g, p.device_mesh, p.placements)
        for (mesh, axes, _), members in buckets.items():
            flat = torch.cat([p.grad.to_local().reshape(-1) for p in members])
            for axis in axes:
                dist.all_reduce(flat, group=mesh.get_group(axis))
            offset = 0
            for p in members:
                local = p.grad.to_local()
                piece = flat[offset:offset + local.numel()].view_as(local)
                p.grad = DTensor.from_local(piece, p.device_mesh, p.placements, run_check=False,
                                            shape=p.shape, stride=p.stride())
                offset += local.numel()
        self.gradient_buckets_launched = sum(len(axes) for _, axes, _ in buckets)
        # tied weights: sum the copies' gradients over their owners
        for fqn, group in self._shared:
            p = self._local[fqn]
            g = p.grad
            # a ZeRO-2 gradient: sharded; a ZeRO-1 gradient: still partial sums
            placements = tuple(g.placements) if g is not None and id(p) in self.reduced_before_step \
                else tuple(self.gradient_targets.get(id(p), p.placements))
            if g is None:
                with torch.no_grad():
                    local = torch.zeros_like(p.detach().redistribute(p.device_mesh, placements).to_local())
            else:
                local = g.to_local().clone()
            dist.all_reduce(local, group=group)
            p.grad = DTensor.from_local(local, p.device_mesh, placements, run_check=False,
                                        shape=p.shape, stride=p.stride())


def _world_mesh(device_type: str, pp: int, shape: tuple[int, ...], devices: int,
                reuse: DeviceMesh | None) -> DeviceMesh:
    """The ``(pp, *shape)`` mesh named ``("pp", "m0", ...)`` over ranks 0..devices-1 in order
    (``reuse`` when it is that mesh)."""
    full = (pp, *shape)
    names = ("pp", *(f"m{i}" for i in range(len(shape))))
    if reuse is None:
        return init_device_mesh(device_type, full, mesh_dim_names=names)
    if tuple(reuse.shape) != full or tuple(reuse.mesh_dim_names or ()) != names \
            or reuse.mesh.flatten().tolist() != list(range(devices)):
        raise AutoplanError(f"world mesh {tuple(reuse.shape)} {reuse.mesh_dim_names} is not "
                            f"{full} {names} over ranks 0..{devices - 1} in order")
    return reuse


def _slice(world: DeviceMesh) -> DeviceMesh:
    """This rank's sub-mesh of a ``(pp, m0, ...)`` world mesh."""
    names = world.mesh_dim_names or ()
    return world[names[1:]] if len(names) > 2 else world[names[1]]


def build_pipeline(graph: TracedGraph, plan: Plan, params: dict[str, torch.Tensor], device_type: str = "cpu",
                   world_mesh: DeviceMesh | None = None, loss_reduction: str = "mean") -> PipelineProgram:
    """This rank's :class:`PipelineProgram` for a pipelined ``plan`` (``len(plan.stages) > 1``).

    Call it in every rank of a job of ``plan.devices`` processes. ``graph`` is the graph traced
    for ONE microbatch (the plan's), ``params`` the model's parameters and buffers by FQN (the
    same full tensors on every rank; each rank keeps what its stages read, sharded).
    ``world_mesh`` reuses a ``(pp, *plan.mesh)`` mesh named ``("pp", "m0", ...)`` for the stages
    on ``plan.mesh`` (stage 0's logical mesh; the others get their own);
    ``loss_reduction`` says whether the model's loss is a mean over the batch (the gradient is
    then that of the mean over microbatches) or a sum."""
    return PipelineProgram(graph, plan, params, device_type, world_mesh, loss_reduction)
