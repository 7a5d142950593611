"""Run a pipelined plan with stage modules cut from the user's own module.

``native_pipeline(spec, graph, plan, device_type)`` returns a :class:`NativePipelineProgram`
(what :class:`~autoplan.codegen.runtime.PipelinedModule` runs) or ``None``, where the DTensor
interpreter's pipeline (:mod:`autoplan.codegen.pipeline_program`) runs the plan instead.

What runs: ``torch.distributed.pipelining.pipeline`` traces the model (a copy, its forward
returning the loss) with a split point at the first module of every stage but the first, and
cuts it into one ``GraphModule`` per stage whose submodules keep the model's hierarchy and its
parameters' names (``model.layers.3`` is a module of the stage that runs it), so each stage runs
the user's own modules, as torchtitan's stages do, not an op-by-op interpreter. Each of this
rank's stages (several under a schedule of virtual stages) is wrapped in a ``PipelineStage``
and stepped by the plan's torch schedule; its recomputed layers are checkpointed modules
(``torch.distributed._composable.checkpoint``, non-reentrant: the whole layer again, or
selectively, keeping its matrix products and attention), and a bf16 plan runs each stage's
forward under the plan's ``torch.autocast``. The schedule's loss function multiplies each
microbatch's loss by its weight (:func:`~autoplan.codegen.loss_weights.microbatch_weights`:
``1/M``, or its share of a cross-entropy's counted targets), so the gradients are those of the
global batch's loss, and the last stage's summed loss is broadcast to every rank, as the plan
lists it.

Which plans (recognition reads the plan and the model, and the cut is checked against the
plan once traced): every stage on one device, on the rank torch's schedule gives it (one stage
per rank for ``gpipe`` and ``1f1b``, virtual stages looped or in a V for the others:
:func:`~autoplan.codegen.pipeline_layout.stage_ranks`), so the plan's only collectives are the
loss's broadcast and the sums of a tied weight's copies (its sends are point-to-point); or
every stage on the ``d`` devices of its pipeline rank's row of a ``pp × d`` device mesh, data
parallel over them with its parameters stored sharded (FSDP2) or whole (DDP, FSDP2's
``replicate``) (:mod:`autoplan.codegen.stage_data_parallel`: each device runs its slice of every
microbatch, sends its slice of the boundary values to its peer in the next stage, and a bf16
plan's stages are traced with their parameters in bf16, as FSDP2 gathers them); stage ``s``
starts at a module of the model (the plan's first layer of the stage) and holds exactly the
parameters the plan gives it; a weight several stages read (a token table that is also the
head: nanoGPT's, Gemma's, a Llama's under ``tie_word_embeddings``) is held by each, on pipeline
ranks of their own, its names in one stage tied again to one parameter (torch's cut gives each
name a copy), and its copies' gradients summed after the schedule among the devices holding the
same part of it, as the plan sums them (``"its copies' gradients"``: every stage stores it
alike); its recomputed layers are modules, recomputed fully or selectively; the model couples
its samples at most through a mean loss over a counted batch; and torch's tracer cuts it (one
it does not, such as a model with a ``torch.autocast`` region under a bf16 trace, runs on the
interpreter). Stages that are tensor parallel, that gather activations over their devices, mix
parameters held through the microbatches with ones gathered in every microbatch, keep some whole
beside ones gathered in every microbatch (whole beside held ones run natively), and every other
plan, run on the interpreter.

Every rank traces the whole model on its device, as it will run (its dtypes under the plan's
autocast are the stages' metadata), and keeps only its stages. A model built on the meta device
(one larger than a device) is traced as fake tensors on the device (torch's ``FakeTensorMode``:
nothing allocated, the dtypes still the autocast's); this rank's stages are then made meta,
sharded (FSDP2 on the meta modules), allocated (``to_empty``: the shards only) and initialised
by the model's own initialisation, as :mod:`autoplan.codegen.materialize` initialises every
program, a tied weight's copies made equal to its first stage's; weights are loaded into them
as into any program (``--weights``). A stage's inputs and outputs are recorded contiguous and
sent so: torch's stage allocates its receive buffers with the recorded strides, and a process
group sends only contiguous tensors.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import operator
import types
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_map

from autoplan.codegen.checkpointing import selective_contexts
from autoplan.codegen.loss_weights import microbatch_weights
from autoplan.codegen.materialize import has_meta_tensors, initialise, on_device, tensors_on_meta
from autoplan.codegen.native import not_run_again, rerun_nodes, sharded_blocks
from autoplan.codegen.native_fsdp import frozen_group
from autoplan.codegen.native_patterns import reduced_in_parameters
from autoplan.codegen.pipeline_layout import is_multi_stage, schedule_class, stage_ranks
from autoplan.codegen.pipeline_step import gradients_added, step_inputs
from autoplan.codegen.precision import compute_precision, gathered_dtype, mixed_precision_policy
from autoplan.codegen.stage_data_parallel import (DataParallelLoss, StageDataParallel, count_over_devices,
    device_rows, fsdp_collectives, local_batch, replicated_collectives, stage_data_parallel)
from autoplan.cost_models.communication import CollectiveKind
from autoplan.load import ModelSpec
from autoplan.plan_schema import CouplingHandling, Plan, RecomputeMode, copies_summed
from autoplan.trace.batch_coupling import count_program
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import microbatch_inputs

__all__ = ["NativePipelineProgram", "native_pipeline", "native_pipeline_form", "stage_starts"]

_RECOMPUTED_HERE = (RecomputeMode.FULL, RecomputeMode.SELECTIVE)


def stage_starts(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> list[str] | None:
    """The module each stage but the first starts at, where ``plan`` is one this program runs
    (the module docstring's conditions that the plan and the model show before tracing); None
    otherwise."""
    form = native_pipeline_form(spec, graph, plan)
    return None if isinstance(form, str) else form[0]


def native_pipeline_form(spec: ModelSpec, graph: TracedGraph, plan: Plan
                         ) -> tuple[list[str], StageDataParallel | None] | str:
    """:func:`stage_starts` and, for stages of several devices, how they run data parallel; or
    why the plan is not one this program runs."""
    if len(plan.stages) < 2:
        return "one stage"
    if len({len(stage.devices) for stage in plan.stages}) != 1:
        return "stages on different numbers of devices"
    d = len(plan.stages[0].devices)
    ranks = stage_ranks(plan.schedule, len(plan.stages), plan.devices // d) if plan.devices % d == 0 else []
    if not ranks or not device_rows(plan, ranks):
        return "stages not on the rows of a pipeline x data device mesh that torch's schedule gives them"
    shared = shared_parameters(graph, plan)
    if any(len({ranks[s] for s in stages}) < len(stages) for stages in shared.values()):
        return "a weight two stages of one pipeline rank read (torch's cut would give that rank two copies)"
    summed = {copies_summed(fqn) for fqn in shared}
    if d == 1 and any(c.kind not in (CollectiveKind.SEND_RECV, CollectiveKind.BROADCAST)
                      and not (c.kind == CollectiveKind.ALL_REDUCE and c.where in summed) for c in plan.collectives):
        return "stages of one device each with collectives inside them"
    split = [stage.mesh for stage in plan.stages if sum(n > 1 for n in stage.mesh) > 1]
    if split:
        return f"stages on {'x'.join(map(str, split[0]))} meshes (tensor parallelism inside stages)"
    parallel = stage_data_parallel(spec, graph, plan) if d > 1 else None
    if isinstance(parallel, str):
        return parallel
    frozen = frozen_group(spec.module, sharded_blocks(spec.module, plan)) \
        if parallel is not None and not parallel.replicated else None
    if frozen is not None:
        return frozen
    coupled = [c for c in plan.batch_coupling if c.handling != CouplingHandling.WEIGHTED_MICROBATCHES]
    if coupled:
        return f"{coupled[0].node} couples the samples of a microbatch beyond a weighted mean loss"
    modules = dict(spec.module.named_modules())
    for layer in plan.recompute:
        if layer.mode not in _RECOMPUTED_HERE or not layer.layer or layer.layer not in modules:
            return f"layer {layer.layer or '(ops)'} recomputed {layer.mode} is not a module recomputed whole or " \
                   "selectively"
    starts = [stage.layers[0] for stage in plan.stages[1:]]
    missing = [name for name in starts if not name or name not in modules]
    if missing:
        return f"a stage starts at {missing[0] or 'an op'}, not at a module of the model"
    return starts, parallel


def shared_parameters(graph: TracedGraph, plan: Plan) -> dict[str, list[int]]:
    """The trained parameters that several stages read (a token table that is also the head),
    by the name the graph reads them under, with those stages."""
    trained = graph.parameter_fqns
    readers: dict[str, list[int]] = {}
    for s, stage in enumerate(plan.stages):
        for fqn in {graph.tied.get(name, name) for name in stage.params} & trained:
            readers.setdefault(fqn, []).append(s)
    return {fqn: stages for fqn, stages in readers.items() if len(stages) > 1}


def native_pipeline(spec: ModelSpec, graph: TracedGraph, plan: Plan, device_type: str
                    ) -> NativePipelineProgram | None:
    """This rank's :class:`NativePipelineProgram` for ``plan``, or None where the plan is not
    one it runs (the same answer on every rank: each traces the same model)."""
    form = native_pipeline_form(spec, graph, plan)
    if isinstance(form, str):
        return None
    starts, parallel = form
    program = NativePipelineProgram(spec, graph, plan, starts, device_type, parallel)
    return program if program.matches_plan else None


class NativePipelineProgram(torch.nn.Module):
    """This rank's stages of a pipelined plan, cut from the user's module (module docstring);
    offers what :class:`~autoplan.codegen.runtime.PipelinedModule` calls: ``train_step`` on the
    global batch, ``named_plan_parameters`` by the model's names, ``observable_collectives``."""

    kind = "pipeline"

    def __init__(self, spec: ModelSpec, graph: TracedGraph, plan: Plan, starts: Sequence[str],
                 device_type: str, parallel: StageDataParallel | None = None) -> None:
        super().__init__()
        from torch.distributed.pipelining import SplitPoint, pipeline
        from torch.distributed.pipelining.stage import build_stage

        self.plan = plan
        self.num_microbatches = plan.microbatches
        self.input_names = list(graph.input_names)
        # values the same on every rank, whose gradients data-parallel stages reduce in their parameters'
        self._same = graph.input_free_values if parallel is not None else frozenset()
        self.device = torch.device(device_type, torch.cuda.current_device()) if device_type == "cuda" \
            else torch.device(device_type)
        self.devices = parallel.devices if parallel is not None else 1  # of each stage
        ranks = stage_ranks(plan.schedule, len(plan.stages), plan.devices // self.devices)
        self.stage_indices = [s for s, rank in enumerate(ranks) if rank == dist.get_rank() // self.devices]
        self.gradient_buckets_launched = 0  # FSDP2 reduces the gradients of stages on several devices
        self.fsdp_groups = 0
        self.replicate_groups = 0
        self.held = False
        self.has_first = 0 in self.stage_indices
        self.has_last = len(plan.stages) - 1 in self.stage_indices
        self.loss_src = plan.stages[-1].devices[0]
        # a model on the meta device is traced as fake tensors on this device (nothing
        # allocated, its dtypes under the plan's autocast as it will run), and only this rank's
        # stages are allocated, shard by shard (:meth:`_materialised`)
        self.meta = has_meta_tensors(spec.module)
        fake = FakeTensorMode(allow_non_fake_inputs=True) if self.meta else None
        model = copy.deepcopy(spec.module)
        with fake or contextlib.nullcontext():
            model = _returning_the_loss(spec, model.to_empty(device=self.device) if fake else model.to(self.device))
        gathered = gathered_dtype(plan.precision) if parallel is not None else None
        masters = _cast_parameters(model, gathered) if gathered is not None else {}
        # each device's slice of a microbatch: the stages' metadata
        example = tuple(on_device(x, self.device, fake)
                        for x in microbatch_inputs(spec.example_inputs, plan.microbatches * self.devices))
        try:
            with compute_precision(plan.precision, device_type):  # traced as it runs: its dtypes are the stages'
                pipe = pipeline(model, example, split_spec={name: SplitPoint.BEGINNING for name in starts})
        except Exception:  # noqa: BLE001  (torch's tracer cannot cut this model: the interpreter runs it)
            self.matches_plan = False
            return
        self.matches_plan = _handed_on_stage_by_stage(pipe.split_gm) and pipe.num_stages == len(plan.stages) \
            and all(_parameter_names(pipe.get_stage_module(s), graph) == _planned_parameters(plan, graph, s)
                    for s in range(pipe.num_stages))
        if not self.matches_plan:
            return
        self.stage_modules = torch.nn.ModuleList(pipe.get_stage_module(s) for s in self.stage_indices)
        for module in self.stage_modules:
            _received_and_sent_contiguous(module)
            _tied_again(module, graph)
        for module in self.stage_modules:  # traced with the parameters as FSDP2 gathers them; stored fp32
            for name, p in module.named_parameters():
                p.data = masters.get(name, p.data)
            if self.meta:
                tensors_on_meta(module)
        self._rerun = rerun_nodes(graph, plan)
        self.checkpointed = [name for module in self.stage_modules for name in _checkpoint(module, plan)]
        group, self.data_group, self.data_index = None, None, 0
        if parallel is not None:  # (before the forward is wrapped: it recompiles the last stage)
            group = self._sharded_over_devices(parallel, plan, graph, device_type)
        shared = shared_parameters(graph, plan)
        self.tied_copies = self._tied_copies(graph, shared, ranks)  # (FSDP2's parameters: after sharding)
        self._summed_here = {copies_summed(fqn) for fqn in shared}
        if self.meta:
            self._materialised(spec)
        for module in self.stage_modules:
            _run_forward_under(module, plan, device_type)
        # a stage that is itself an FSDP2 module is held gathered by torch's stage through the
        # microbatches and reduced once; under a plain module FSDP2 gathers and reduces in each
        wrapped = parallel is not None and not (parallel.held or parallel.replicated)
        self.held = parallel is not None and parallel.held
        self.pipeline_stages = [build_stage(_Stage(module) if wrapped else module, s, pipe.info(), self.device, group)
                                for s, module in zip(self.stage_indices, self.stage_modules)]
        weighted = [c.node for c in plan.batch_coupling if c.handling == CouplingHandling.WEIGHTED_MICROBATCHES
                    and plan.microbatches > 1]
        self._count = count_program(graph, weighted[0]) if weighted else None
        cls = schedule_class(plan.schedule)
        stages = self.pipeline_stages if is_multi_stage(cls) else self.pipeline_stages[0]
        loss = DataParallelLoss(self.data_group, self.devices)
        self.schedule = cls(stages, plan.microbatches, loss_fn=loss, scale_grads=False)

    def _tied_copies(self, graph: TracedGraph, shared: dict[str, list[int]], ranks: Sequence[int]
                     ) -> list[tuple[torch.nn.Parameter, dist.ProcessGroup]]:
        """This rank's copies of the weights several pipeline ranks hold (a token table that
        is also the head), each with the process group of the devices holding the same part
        of it (the same position in their stage's devices: each stage stores it alike), among
        which its gradient is summed after the schedule (the plan's "its copies' gradients").
        ``shared``: :func:`shared_parameters`. Every rank makes every group, in the same order."""
        mine = {graph.tied.get(name, name): p for module in self.stage_modules
                for name, p in module.named_parameters(remove_duplicate=False)}
        d, position = self.devices, dist.get_rank() % self.devices
        summed = []
        for fqn, stages in sorted(shared.items()):
            for k in range(d):
                group = dist.new_group(sorted(ranks[s] * d + k for s in stages))
                if fqn in mine and k == position:
                    summed.append((mine[fqn], group))
        return summed

    def _materialised(self, spec: ModelSpec) -> None:
        """This rank's stages of a meta-device model allocated (FSDP2's shards only) and
        initialised by the model's own initialisation (:mod:`autoplan.codegen.materialize`);
        a tied weight's copies then made equal to its first stage's, each part among the
        devices holding it."""
        names = {name for name, _ in [*spec.module.named_parameters(remove_duplicate=False),
                                      *spec.module.named_buffers(remove_duplicate=False)]}
        tensors: dict[str, torch.Tensor] = {}
        for module in self.stage_modules:
            module.to_empty(device=self.device)
            tensors.update((name, t) for name, t in [*module.named_parameters(remove_duplicate=False),
                                                     *module.named_buffers(remove_duplicate=False)] if name in names)
        initialise(spec.module, tensors, spec.init_weights)
        with torch.no_grad():
            for param, group in self.tied_copies:
                dist.broadcast(param.to_local() if isinstance(param, DTensor) else param, group=group, group_src=0)

    def _sharded_over_devices(self, parallel: StageDataParallel, plan: Plan, graph: TracedGraph,
                              device_type: str) -> dist.ProcessGroup:
        """Shard this rank's stages over their devices (FSDP2 per block and on the stage's
        root), their cross-entropy averaged over the microbatch's counted targets; the process
        group of this rank's peers in the other stages."""
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.device_mesh import init_device_mesh

        from autoplan.codegen.native_fsdp import shard_modules

        mesh = init_device_mesh(device_type, (plan.devices // self.devices, self.devices),
                                mesh_dim_names=("pp", "dp"))
        self.data_group, self.data_index = mesh.get_group("dp"), mesh.get_local_rank("dp")
        policy = mixed_precision_policy(plan.precision)
        for module in self.stage_modules:
            if parallel.token_mean:
                count_over_devices(module, self.data_group, self.devices)
            names = {name: graph.tied.get(name, name) for name, _ in module.named_parameters()}
            within = parallel.within(names)
            if parallel.replicated or not within.shard_dims:
                # DDP in FSDP2's groups (a held plan's stage of whole parameters too), reduced once
                # a step by torch's stage
                replicate(module, mesh=mesh["dp"], mp_policy=policy)
                self.replicate_groups += 1
                continue
            # held: the stage is FSDP2's root, and torch's stage holds and reduces its groups (the
            # replicate groups of the parameters kept whole beside them too) once a step
            units = shard_modules(module, sharded_blocks(module, plan), mesh["dp"], policy, not parallel.held, within)
            self.fsdp_groups += units.sharded
            self.replicate_groups += units.replicated
        return mesh.get_group("pp")

    @property
    def description(self) -> str:
        checkpointed = f", {len(self.checkpointed)} checkpointed layer(s)" if self.checkpointed else ""
        held = ", held gathered through the microbatches" if self.held else ""
        whole = f", {self.replicate_groups} replicate group(s) beside" if self.fsdp_groups and self.replicate_groups \
            else ""
        sharded = "" if self.devices == 1 else \
            f", each stage FSDP2 fully_shard over {self.devices} devices{held}{whole}" if self.fsdp_groups else \
            f", each stage replicated over {self.devices} devices (FSDP2's replicate)"
        return (f"native: torch.distributed.pipelining ({self.plan.schedule}, {len(self.plan.stages)} stages cut from "
                f"the model's own modules, {self.num_microbatches} microbatches{checkpointed}{sharded})")

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters, by the model's names."""
        return {name: p for module in self.stage_modules
                for name, p in module.named_parameters(remove_duplicate=False)}

    def train_step(self, *inputs: torch.Tensor) -> torch.Tensor:
        """One schedule step on the GLOBAL batch (the same on every rank): forward and backward of
        every microbatch (this device's slice of each), gradients added to this rank's parameters;
        the global loss (a 0-d tensor, the same on every rank)."""
        m = self.num_microbatches
        inputs = step_inputs(inputs, self.input_names, m * self.devices, self.device)
        weights = microbatch_weights(inputs, m, 1.0 / m, self._count, self.device)
        if self.devices > 1:
            inputs = local_batch(inputs, m, self.devices, self.data_index)
        losses: list[torch.Tensor] = []
        with gradients_added(list(self.stage_modules.parameters())):
            self.schedule.step(*(inputs if self.has_first else ()), target=weights if self.has_last else None,
                               losses=losses, return_outputs=False)
            for param, group in self.tied_copies:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                grad = param.grad
                dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)
        loss = torch.stack([x.detach() for x in losses]).sum() if self.has_last and losses \
            else torch.zeros((), device=self.device)
        loss = loss.to(torch.float32).contiguous()
        dist.broadcast(loss, src=self.loss_src)
        return loss

    def observable_collectives(self, phase: str) -> dict[str, int]:
        """What ``CollectiveCounter`` should count on this rank in one step's ``phase`` (``"step"``:
        every microbatch's forward and backward; ``"optimizer"``): the plan's collectives of
        this rank's stages and the loss's broadcast, the parameters' gathers and the gradients'
        reduce-scatters by FSDP2's groups, not by parameter; sends are point-to-point, not
        counted."""
        counts: Counter[str] = Counter()
        if phase != "optimizer":
            counts.update(fsdp_collectives(self.fsdp_groups, self.num_microbatches, self.held))
            counts.update(replicated_collectives(self.replicate_groups))
        mine = set(self.stage_indices)
        for c in self.plan.collectives:
            if (c.phase == "optimizer") != (phase == "optimizer") or c.kind == CollectiveKind.SEND_RECV:
                continue
            if c.tensor in ("parameter", "gradient") and c.where not in self._summed_here:
                continue  # (FSDP2 gathers and reduces by groups, counted above)
            if reduced_in_parameters(c, self._same):
                continue  # (reduced in the gradients of the parameters it comes from, counted above)
            if c.stages and not mine & set(c.stages):
                continue
            if not_run_again(c, self._rerun):
                continue
            counts[str(c.kind)] += c.count
        return {kind: n for kind, n in counts.items() if n}


class _Stage(torch.nn.Module):
    """A stage sharded by FSDP2 under a plain module, so that torch's pipeline stage runs its
    backward as FSDP2 runs any: its gradients reduce-scattered after every microbatch, as the
    plan reduces them (a stage that is itself an FSDP2 module is held gathered through the
    microbatches and reduced once)."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    @property
    def graph(self) -> torch.fx.Graph:
        """The stage's graph, which torch's pipeline stage reads its inputs and outputs from."""
        return self.stage.graph  # type: ignore[return-value]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.stage(*args, **kwargs)


def _cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Cast ``module``'s parameters to ``dtype`` (FSDP2's gathered dtype under a bf16 plan), so
    that torch's tracer records the dtypes the stages run with; their values before, by name."""
    masters = {}
    for name, p in module.named_parameters():
        masters[name] = p.data
        p.data = p.data.to(dtype)
    return masters


def _returning_the_loss(spec: ModelSpec, module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with a forward that takes the inputs positionally and returns the loss (the
    model called as the user calls it, then ``spec.loss_fn``), its parameters' names unchanged.
    Each input is copied first, so that one a later stage reads (the labels) is an output of
    the first stage, handed on with the activations, not an input of that stage."""
    call_original = types.MethodType(type(module).forward, module)

    def forward(self: torch.nn.Module, *inputs: Any) -> torch.Tensor:
        inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        return spec.loss_fn(spec.call(call_original, inputs), *inputs)

    names = [f"input_{i}" for i in range(len(spec.example_inputs))]
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names])
    module.forward = types.MethodType(forward, module)
    config = getattr(module, "config", None)
    if getattr(config, "use_cache", False):  # no key-value cache: the graph returns none
        config.use_cache = False
    return module


def _handed_on_stage_by_stage(split: torch.fx.GraphModule) -> bool:
    """Rewrite the pipe's stages so that every value a stage reads comes from the stage just
    before it: one made earlier (the labels, a rotary table every block reads) is taken in and
    given back unchanged by each stage between (torch's stages send only to the next one, and
    its gradient back). False, leaving it as it is, where a stage after the first reads an input
    of the model itself."""
    graph = split.graph
    stages = [n for n in graph.nodes if n.op == "call_module"]
    index = {node: k for k, node in enumerate(stages)}

    def producer(value: torch.fx.Node) -> torch.fx.Node:
        while value.target is operator.getitem:
            value = value.args[0]  # type: ignore[assignment]
        return value

    if any(isinstance(a, torch.fx.Node) and producer(a).op == "placeholder" for node in stages[1:] for a in node.args):
        return False
    carried: dict[tuple[torch.fx.Node, int], torch.fx.Node] = {}  # (value, stage) -> the value after that stage
    for k, node in enumerate(stages):
        for position, arg in enumerate(node.args):
            if not isinstance(arg, torch.fx.Node) or index.get(producer(arg), k) >= k - 1:
                continue
            example = _placeholders(split.get_submodule(str(node.target)))[position].meta["val"]
            value = arg
            for between in range(index[producer(arg)] + 1, k):
                if (arg, between) not in carried:
                    carried[arg, between] = _given_back(split, stages[between], value, example)
                value = carried[arg, between]
            node.update_arg(position, value)
    graph.lint()
    split.recompile()
    return True


def _given_back(split: torch.fx.GraphModule, stage: torch.fx.Node, value: torch.fx.Node, example: Any
                ) -> torch.fx.Node:
    """``stage`` (a call of one stage module in the pipe's graph) made to take ``value`` and
    return it as its last output; the pipe graph's node of that output."""
    module = split.get_submodule(str(stage.target))
    inputs = _placeholders(module)
    if value in stage.args:
        taken = inputs[list(stage.args).index(value)]
    else:
        with module.graph.inserting_after(inputs[-1]):
            taken = module.graph.placeholder(f"handed_on_{len(inputs)}")
        taken.meta["val"] = example
        stage.args = (*stage.args, value)
    output = module.graph.output_node()
    given = output.args[0]
    graph = split.graph
    if not isinstance(given, (tuple, list)):  # one output: its readers now read item 0
        with graph.inserting_after(stage):
            first = graph.call_function(operator.getitem, (stage, 0))
        stage.replace_all_uses_with(first, delete_user_cb=lambda user: user is not first)
        given = (given,)
    output.args = ((*given, taken),)
    module.recompile()
    last = max((u for u in stage.users if u.target is operator.getitem), key=lambda u: u.args[1])
    with graph.inserting_after(last):
        return graph.call_function(operator.getitem, (stage, len(given)))


def _received_and_sent_contiguous(stage_module: torch.nn.Module) -> None:
    """The stage's inputs and outputs recorded as contiguous tensors: torch's stage allocates
    its receive buffers (of the inputs, and of the outputs' gradients) with the recorded
    strides, and a process group sends and receives only contiguous tensors (the outputs are
    made contiguous as they are sent: :func:`_run_forward_under`)."""
    graph = stage_module.graph  # type: ignore[union-attr]
    for node in _placeholders(stage_module) + _output_nodes(graph):
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor) and not value.is_contiguous():
            with value.fake_mode if hasattr(value, "fake_mode") else contextlib.nullcontext():
                node.meta["val"] = torch.empty(value.shape, dtype=value.dtype, device=value.device)


def _output_nodes(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    found: list[torch.fx.Node] = []
    torch.fx.node.map_arg(graph.output_node().args, found.append)
    return found


def _placeholders(module: torch.nn.Module) -> list[torch.fx.Node]:
    return [n for n in module.graph.nodes if n.op == "placeholder"]  # type: ignore[union-attr]


def _parameter_names(module: torch.nn.Module, graph: TracedGraph) -> set[str]:
    """The parameters ``module`` holds, by the names the graph reads them under."""
    return {graph.tied.get(name, name) for name, _ in module.named_parameters(remove_duplicate=False)}


def _tied_again(module: torch.nn.Module, graph: TracedGraph) -> None:
    """The names of one tied weight in a stage (a token table and the head) made to hold one
    parameter again: torch's cut gives each name its own copy."""
    held: dict[str, torch.nn.Parameter] = {}
    for name, param in list(module.named_parameters(remove_duplicate=False)):
        kept = held.setdefault(graph.tied.get(name, name), param)
        if kept is not param:
            owner, _, attr = name.rpartition(".")
            module.get_submodule(owner).register_parameter(attr, kept)


def _planned_parameters(plan: Plan, graph: TracedGraph, stage: int) -> set[str]:
    """The trained parameters the plan gives ``stage``, by the names the graph reads them under."""
    return {graph.tied.get(fqn, fqn) for fqn in plan.stages[stage].params} & graph.parameter_fqns


def _checkpoint(stage_module: torch.nn.Module, plan: Plan) -> list[str]:
    """Checkpoint the plan's recomputed layers that this stage holds; their names."""
    from torch.distributed._composable import checkpoint

    here = dict(stage_module.named_modules())
    done = []
    for layer in plan.recompute:
        if layer.layer in here:
            context = {"context_fn": selective_contexts} if layer.mode == RecomputeMode.SELECTIVE else {}
            checkpoint(here[layer.layer], **context)
            done.append(layer.layer)
    return done


def _run_forward_under(stage_module: torch.nn.Module, plan: Plan, device_type: str) -> None:
    """The stage's forward run under the plan's precision (``torch.autocast`` for bf16, as the
    model was traced and the interpreter runs its stages; the backward runs in the dtypes the
    forward chose), its outputs made contiguous: torch's stage sends them as they are, and a
    transposed value (Whisper's encoder states handed on) cannot be sent."""
    forward = stage_module.forward

    def in_precision(*args: Any, **kwargs: Any) -> Any:
        with compute_precision(plan.precision, device_type):
            outputs = forward(*args, **kwargs)
        return tree_map(lambda x: x.contiguous() if isinstance(x, torch.Tensor) else x, outputs)

    stage_module.forward = in_precision
