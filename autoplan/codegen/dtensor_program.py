"""Execute a :class:`Plan` with DTensor: the traced ATen graph, run node by node on DTensors.

``build_program(graph, plan, mesh, params)`` gives a :class:`ShardedProgram` (an ``nn.Module``)
that holds the model's parameters distributed with the plan's placements and whose forward
runs the traced graph with an ``fx.Interpreter``: before each op, every DTensor input is
redistributed to the placement the plan chose for that op, so the collectives happen where the
plan put them; in the backward, each edge brings its gradient back to the producer's placement
in one step (:class:`_PlannedRedistribute`, :func:`reduce_gradient_on_edge`), so the backward
runs the collectives the plan lists too (tests compare them, kind by kind, with
``CollectiveCounter``).

Conventions:

- ``program(*inputs)`` takes the GLOBAL batch: every rank passes the same full user inputs, and
  each rank keeps only its slice (no communication). It returns ``(loss, *model_outputs)`` as
  DTensors (``.full_tensor()`` gives the global value).
- Parameters are ``nn.Parameter(DTensor)`` under their FQN (dots become ``__`` in the module's
  own attribute names; :meth:`ShardedProgram.named_plan_parameters` gives them by FQN). A tied
  weight is one parameter, reachable under every FQN it has.
- Buffers become DTensor buffers (not parameters), so in-place updates such as BatchNorm's
  ``num_batches_tracked.add_(1)`` work.

The traps the exported graph sets for DTensor (see DESIGN.md) are handled here:
``_assert_tensor_metadata`` nodes are dropped, tensors created inside the graph (``arange``)
become replicated DTensors, attention runs with the math SDPA backend on CPUs (the CPU
flash-attention backward has no DTensor rule) and with the fused kernels on GPUs, and tied
weights stay one parameter.
"""

from __future__ import annotations

import contextlib
import operator
from collections import Counter
from collections.abc import Iterator, Sequence
from functools import partial
from typing import Any, Protocol

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.attention import SDPBackend, sdpa_kernel

from autoplan.codegen.checkpointing import CheckpointedRegions
from autoplan.codegen.collective_counter import CollectiveCounter
from autoplan.codegen.materialize import planned_tensor
from autoplan.codegen.op_calls import REPLACED_OPS, call_planned_op
from autoplan.codegen.parameter_regather import GatheredParameters, backward_starts, parameter_block
from autoplan.codegen.prefetched_gathers import PrefetchedGathers, recomputed_reads
from autoplan.codegen.precision import gathered_dtype
from autoplan.codegen.redistribution import (redistribute, reduce_gradient_on_edge, shard_batch, spec_text,
    to_dtensor_placements, unmask_partial)
from autoplan.codegen.sharded_state import gradient_placements
from autoplan.errors import AutoplanError
from autoplan.plan_schema import NodePlan, Plan
from autoplan.trace.graph import NodeKind, TracedGraph
from autoplan.trace.saved_inputs import regathers_for
from autoplan.trace.wrapped_regions import autocast_region

# Ops with no DTensor rule that only check metadata: skipped.
SKIPPED_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
}
SKIPPED_NAMES = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")


#: The attention kernels a program may run, by device type. On a CPU only the math backend: the
#: CPU flash-attention backward has no DTensor rule. On a GPU the fused kernels first, whose
#: DTensor rules shard the batch and head dims as the planner's attention rule does (the math
#: backend computes a bf16 attention in fp32 and keeps its whole score matrix).
ATTENTION_BACKENDS: dict[str, tuple[SDPBackend, ...]] = {
    "cpu": (SDPBackend.MATH,),
    "cuda": (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH),
}


@contextlib.contextmanager
def dispatch_settings(device_type: str) -> Iterator[None]:
    """What every op of a program on ``device_type`` runs under. ``implicit_replication``:
    plain tensors that ops create inside DTensor dispatch (masks in the math attention) mix
    with DTensors as replicated ones; attention runs with :data:`ATTENTION_BACKENDS`."""
    backends = ATTENTION_BACKENDS.get(device_type, ATTENTION_BACKENDS["cpu"])
    with implicit_replication(), sdpa_kernel(list(backends)):
        yield


def tensor_inputs_of(n: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs of ``n`` that are tensors, in the order a node plan lists them."""
    return [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


class _PlanInterpreter(torch.fx.Interpreter):
    """Runs the traced graph on DTensors, redistributing each op's inputs as the plan says."""

    def __init__(self, program: ShardedProgram) -> None:
        super().__init__(program.graph_module, garbage_collect_values=True)
        self.program = program
        self._placeholder_values: dict[str, Any] = {}
        self.checkpointed = CheckpointedRegions(program.plan.recompute, program.graph_module.graph.nodes,
                                                partial(dispatch_settings, program.mesh.device_type))
        self._nodes = {n.name: n for n in program.graph_module.graph.nodes}

    def run_with(self, placeholder_values: dict[str, Any]) -> Any:
        self._placeholder_values = placeholder_values
        try:
            return self.run()
        finally:
            self._placeholder_values = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        self.program.prefetched.issue(n.name, self._gather)
        if n in self.checkpointed:
            return self.checkpointed.value(n, self.env, self._run_in)
        return self._run_one(n)

    def _run_in(self, n: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
        """Run ``n`` on ``env`` (a recomputed layer's own values) instead of the walk's."""
        walk, self.env = self.env, env
        try:
            return self._run_one(n)
        finally:
            self.env = walk

    def _run_one(self, n: torch.fx.Node) -> Any:
        """``n``'s value (inside a checkpointed region too, where its output's gradient starts
        a block's backward: :meth:`GatheredParameters.watch`)."""
        out = self._value_of(n)
        block = self.program.backward_starts.get(n.name)
        if block is not None:
            self.program.gathered.watch(out, block)
            self.program.prefetched.watch(out, block, self._gather)
        return out

    def _value_of(self, n: torch.fx.Node) -> Any:
        region = autocast_region(n)
        if region is None:
            return self._value_in_plan_precision(n)
        with region.context(self.program.mesh.device_type):  # the model's own autocast region
            return self._value_in_plan_precision(n)

    def _value_in_plan_precision(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            return self._placeholder_values[n.name]
        if n.op == "call_function":
            name = getattr(n.target, "__name__", str(n.target))
            if n.target in SKIPPED_OPS or any(s in name for s in SKIPPED_NAMES):
                return None
            node_plan = self.program.node_plans.get(n.name)
            if node_plan is not None and n.target is not operator.getitem:
                return self._call_planned(n, node_plan)
        return super().run_node(n)

    def _gather(self, consumer: str, pos: int) -> Any:
        """Input ``pos`` of op ``consumer`` resharded as its plan reads it (a prefetched gather)."""
        a = tensor_inputs_of(self._nodes[consumer])[pos]
        fqn = self.program.placeholder_fqn.get(a.name)  # a parameter: read where it is kept
        value = self.program.tensor(fqn) if fqn is not None else self.env[a]
        return redistribute(value, self.program.node_plans[consumer].inputs[pos], self.program.mesh,
                            self.program.gradient_targets.get(a.name), self.program.param_dtype)

    def _call_planned(self, n: torch.fx.Node, node_plan: NodePlan) -> Any:
        tensor_inputs = tensor_inputs_of(n)
        if len(node_plan.inputs) != len(tensor_inputs):
            raise AutoplanError(f"plan for {n.name} lists {len(node_plan.inputs)} tensor inputs, the graph "
                                f"has {len(tensor_inputs)}: the plan is not for this graph")
        mesh = self.program.mesh
        arrived = {}
        for pos, (a, specs) in enumerate(zip(tensor_inputs, node_plan.inputs)):
            before = self.env[a]
            after = self.program.prefetched.take(n.name, pos)
            if after is None:
                after = redistribute(before, specs, mesh, self.program.gradient_targets.get(a.name),
                                     self.program.param_dtype)
            if after is not before and isinstance(before, DTensor):
                self.program.redistributions.append(
                    (f"{a.name} -> {n.name}", spec_text(before.placements), spec_text(after.placements)))
                if a.name in self.program.placeholder_fqn and regathers_for(n):
                    fqn = self.program.placeholder_fqn[a.name]
                    self.program.gathered.remember(after, before, specs, parameter_block(fqn))
            if pos < len(node_plan.grad_partial) and node_plan.grad_partial[pos] \
                    and a.name not in self.program.deferred_gradients:
                after = reduce_gradient_on_edge(before, after, self.program.gradient_targets.get(a.name))
            arrived[a] = after
        args = torch.fx.node.map_arg(n.args, lambda a: arrived.get(a, self.env[a]))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: arrived.get(a, self.env[a]))
        out = call_planned_op(n.target, args, kwargs, node_plan, [arrived[a] for a in tensor_inputs], mesh)
        if isinstance(out, (tuple, list)):
            return type(out)(unmask_partial(o) for o in out)
        return unmask_partial(out)

    def call_function(self, target, args, kwargs):
        return REPLACED_OPS.get(target, target)(*args, **kwargs)


class BucketedReduction(Protocol):
    """What the program asks of whatever reduces its bucketed gradients
    (:class:`autoplan.codegen.gradient_buckets.GradientBuckets`, which depends on this module,
    not the other way round)."""

    def replaced(self) -> int: ...

    def launched(self) -> int: ...


class ShardedProgram(torch.nn.Module):
    """The traced model distributed by a plan. See the module docstring for the conventions.

    ``forward(*inputs)`` takes the GLOBAL user inputs (the same on every rank) and returns
    ``(loss, *model_outputs)`` as DTensors."""

    def __init__(self, graph: TracedGraph, plan: Plan, mesh: DeviceMesh, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if plan.graph_hash != graph.graph_hash:
            raise AutoplanError("the plan was made for another graph (graph_hash differs): plan this model again")
        if tuple(mesh.shape) != tuple(plan.mesh):
            raise AutoplanError(f"the plan is for mesh {plan.mesh}, the device mesh is {list(mesh.shape)}")
        self.mesh = mesh
        self.plan = plan
        self.graph_module = graph.graph_module
        self.input_names = list(graph.input_names)
        self.node_plans = {np_.name: np_ for np_ in plan.nodes}
        self.tied = dict(graph.tied)
        # placeholder name -> FQN, every FQN resolved to the one the graph reads
        # tensor constants the export lifted (``lifted_tensor_0``) are not the model's tensors
        self.placeholder_fqn = {name: self.tied.get(fqn, fqn) for name, fqn in graph.param_names.items()
                                if graph.nodes[name].kind != NodeKind.CONSTANT}
        buffer_fqns = {info.fqn for info in graph.nodes.values() if info.kind == "buffer" and info.fqn}
        self._fqn_to_attr: dict[str, str] = {}
        for fqn in dict.fromkeys(self.placeholder_fqn.values()):
            if fqn not in params:
                raise AutoplanError(f"no tensor given for {fqn}: pass model.named_parameters() and named_buffers()")
            tensor = params[fqn].detach()
            specs = plan.params.get(fqn, ["R"] * mesh.ndim)
            placements = to_dtensor_placements(specs)
            if any(isinstance(p, Partial) for p in placements):
                raise AutoplanError(f"plan stores {fqn} as partial sums ({specs}): a parameter must be R or S(d)")
            dt = planned_tensor(tensor, mesh, placements)  # a meta tensor: this rank's shard, empty
            attr = fqn.replace(".", "__")
            if fqn in buffer_fqns or not tensor.is_floating_point():
                self.register_buffer(attr, dt)
            else:
                self.register_parameter(attr, torch.nn.Parameter(dt, requires_grad=params[fqn].requires_grad))
            self._fqn_to_attr[fqn] = attr
        self._constants = self._lifted_constants(graph)
        # (edge, from, to) of every redistribution the last forward did, to see where
        # collectives come from
        self.redistributions: list[tuple[str, str, str]] = []
        # parameters (placeholder names) whose gradient reduction a GradientBuckets runs
        # after the backward instead of on their edges, and those buckets
        self.deferred_gradients: set[str] = set()
        self.gradient_buckets: BucketedReduction | None = None
        # parameters redistributed for a consumer: re-gathered in the backward, not kept
        self.param_dtype = gathered_dtype(plan.precision)  # what a parameter's gathers move
        self.gathered = GatheredParameters(self.param_dtype, plan.prefetch_regathers, mesh.device_type)
        # the ops whose output's gradient starts a block's backward, where the block before it
        # is re-gathered (plan.prefetch_regathers)
        self.backward_starts = backward_starts(graph.graph_module.graph.nodes) if plan.prefetch_regathers else {}
        # gathers issued a block ahead of their consumers (plan.prefetch), and a recomputed
        # block's issued when the backward of the block after it starts (plan.prefetch_regathers)
        recomputed = {name for layer in plan.recompute for name in layer.nodes}
        planned = {n.name: tensor_inputs_of(n) for n in graph.graph_module.graph.nodes
                   if n.name in self.node_plans and n.target is not operator.getitem}
        self.prefetched = PrefetchedGathers(
            plan.prefetch, mesh.device_type,
            recomputed_reads(planned, (n for n in graph.graph_module.graph.nodes if n.name in recomputed),
                             self.placeholder_fqn) if plan.prefetch_regathers else None)
        # parameters (placeholder names) whose edges reduce the gradient into the placements
        # the plan stores it in rather than the parameter's (ZeRO-2)
        # (``gradient_placements``: the same by ``id(parameter)``, for the gradient hooks)
        self.gradient_placements = gradient_placements(plan.storage, self.named_plan_parameters())
        self.gradient_targets = {name: self.gradient_placements[id(self.tensor(fqn))]
                                 for name, fqn in self.placeholder_fqn.items()
                                 if id(self.tensor(fqn)) in self.gradient_placements}
        self._interpreter = _PlanInterpreter(self)

    @staticmethod
    def _lifted_constants(graph: TracedGraph) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        ep = graph.exported
        consts = {}
        if ep is not None:
            consts = dict(getattr(ep, "constants", {}) or {})
            for spec in ep.graph_signature.input_specs:
                if spec.target in consts:
                    out[spec.arg.name] = consts[spec.target]
        return out

    def observable_collectives(self, phase: str) -> dict[str, int]:
        """What ``CollectiveCounter`` should count in ``phase``: the plan's collectives, with the
        bucketed gradient all-reduces counted per bucket (:mod:`gradient_buckets`)."""
        counts = planned_collectives(self.plan, phase)
        if phase == "backward" and self.gradient_buckets is not None:
            buckets = self.gradient_buckets
            counts["all_reduce"] = counts.get("all_reduce", 0) - buckets.replaced() + buckets.launched()
        return {kind: n for kind, n in counts.items() if n}

    def tensor(self, fqn: str) -> torch.Tensor:
        """The distributed parameter (or buffer) under ``fqn`` (a tied FQN gives the shared one)."""
        fqn = self.tied.get(fqn, fqn)
        return getattr(self, self._fqn_to_attr[fqn])

    def named_plan_tensors(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer by the model's FQN, tied FQNs included (they give the same
        object)."""
        out = {fqn: self.tensor(fqn) for fqn in self._fqn_to_attr}
        out.update({fqn: self.tensor(used) for fqn, used in self.tied.items() if used in self._fqn_to_attr})
        return out

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by the model's FQN, tied FQNs included (they give the same object)."""
        return {k: v for k, v in self.named_plan_tensors().items() if isinstance(v, torch.nn.Parameter)}

    def distribute_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        """Global user inputs → DTensors with the plan's input placements (local slicing only)."""
        if len(inputs) != len(self.input_names):
            raise AutoplanError(f"the program takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                                f"got {len(inputs)}")
        out = []
        for name, value in zip(self.input_names, inputs):
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                out.append(value)
                continue
            placements = to_dtensor_placements(self.plan.inputs.get(name, ["R"] * self.mesh.ndim))
            local = shard_batch(value, placements, self.mesh)
            out.append(DTensor.from_local(local, self.mesh, placements, run_check=False,
                                          shape=value.shape, stride=value.stride()))
        return out

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        self.redistributions = []
        values: dict[str, Any] = {}
        user = iter(self.distribute_inputs(inputs))
        for node in self.graph_module.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in self.placeholder_fqn:
                values[node.name] = self.tensor(self.placeholder_fqn[node.name])
            elif node.name in self.input_names:
                values[node.name] = next(user)
            elif node.name in self._constants:
                values[node.name] = self._constants[node.name]
            else:
                raise AutoplanError(f"graph input {node.name} is neither a parameter, a buffer nor a user input")
        try:
            with dispatch_settings(self.mesh.device_type), self.gathered.hooks():
                out = self._interpreter.run_with(values)
        finally:
            self.prefetched.clear()
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        # The plan materialises the loss replicated (its "-> output" collective); the model's
        # other outputs stay as computed (call .full_tensor() to gather them).
        loss = out[0]
        if isinstance(loss, DTensor) and any(not p.is_replicate() for p in loss.placements):
            loss = loss.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
            self.redistributions.append(("loss -> output", spec_text(out[0].placements), spec_text(loss.placements)))
        return (loss, *out[1:])


def build_program(graph: TracedGraph, plan: Plan, mesh: DeviceMesh, params: dict[str, torch.Tensor]) -> ShardedProgram:
    """A :class:`ShardedProgram` executing ``plan`` for ``graph`` on ``mesh``.

    ``params`` are the model's parameters and buffers by FQN (``dict(model.named_parameters())``
    plus ``named_buffers()``), the same on every rank; each rank keeps its own shard."""
    return ShardedProgram(graph, plan, mesh, params)


def executed_collectives(program: ShardedProgram, inputs: Sequence[Any]) -> dict[str, int]:
    """Run the program's forward once and count the collectives it executes by kind
    (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) — to set beside
    ``plan.collectives_in("forward")`` (:func:`planned_collectives`). Autograd stays on, as in
    a training step; the backward is not run."""
    with CollectiveCounter() as counter:
        program(*inputs)
    return dict(counter.counts)


def planned_collectives(plan: Plan, phase: str = "forward") -> dict[str, int]:
    """The plan's collectives in ``phase``, counted by kind (the same keys as
    :func:`executed_collectives`)."""
    counts: Counter[str] = Counter()
    for c in plan.collectives_in(phase):
        counts[c.kind] += c.count
    return dict(counts)
