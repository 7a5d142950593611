"""The planned program as a module a user trains with an ordinary loop: built from a Plan,
never planning (``autoplan.parallelize`` plans first where no plan is given)::

    pm = build_parallel_module(spec, plan)       # in every process of a torchrun job
    for batch in data:                           # each rank passes the same GLOBAL batch
        loss = pm.train_step(*batch)             # forward, backward, the plan's optimizer step

Every rank checks that all ranks hold the same decisions before it builds anything. Each
rank passes the *global* batch; the program keeps its own slice of it without communication
(:func:`autoplan.codegen.dtensor_program.shard_batch` cuts one by hand).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement

from autoplan.codegen.dtensor_program import ShardedProgram, build_program
from autoplan.codegen.gradient_buckets import GradientBuckets
from autoplan.codegen.materialize import has_meta_tensors, initialise
from autoplan.codegen.optimizer import build_optimizer, refuse_unsupported
from autoplan.codegen.precision import compute_precision
from autoplan.codegen.redistribution import reduce_to
from autoplan.codegen.sharded_state import ShardedOptimizerState
from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.tracer import trace

if TYPE_CHECKING:
    from autoplan.codegen.native import NativeProgram


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device_type: str  # "cuda" or "cpu"


def init_distributed() -> DistContext:
    """Join the job torchrun started (NCCL with one GPU per local rank where CUDA is available,
    gloo on CPUs); a no-op when the process group exists already."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if not dist.is_initialized():
        if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
            raise AutoplanError("no distributed job: launch with torchrun --nproc-per-node N, "
                                "or call torch.distributed.init_process_group first")
        if use_cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if use_cuda else "gloo", **_restarted_job_store())
    backend = dist.get_backend()
    device_type = "cuda" if use_cuda and backend == "nccl" else "cpu"
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, device_type)


def _restarted_job_store() -> dict[str, Any]:
    """Where torchrun restarted the job (``--max-restarts``) and the processes meet in the
    agent's store, the store under a prefix of this attempt, so that the new processes do not
    read the addresses the failed attempt's processes left there (they would connect to
    processes that are gone); otherwise nothing (torchrun's environment decides)."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=False)
    return dict(store=dist.PrefixStore(f"autoplan/attempt_{attempt}", store), rank=int(os.environ["RANK"]),
                world_size=world_size)


class ParallelOutput(NamedTuple):
    """What the planned program returns: the replicated scalar ``loss`` (call ``.backward()``)
    and the model's ``outputs`` as DTensors (``.full_tensor()`` gathers one)."""

    loss: torch.Tensor
    outputs: tuple[Any, ...]


class PlannedTraining(torch.nn.Module):
    """What every planned program offers: the plan's optimizer over this rank's parameters,
    and a training step that carries out the plan (forward, backward, optimizer step)."""

    plan: Plan
    optimizer: torch.optim.Optimizer
    sharded_state: ShardedOptimizerState  # the master shards of ZeRO-1/2 parameters

    def __init__(self, spec: ModelSpec | None = None) -> None:
        super().__init__()
        # a batch may be passed as the example inputs were given: positionally or by keyword
        self._positional = spec.positional if spec is not None else (lambda args, kwargs: tuple(args))

    def batch(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        """The program's positional inputs of a batch given positionally or by keyword."""
        return self._positional(args, kwargs)

    def forward_backward(self, *inputs: Any, **keyword_inputs: Any) -> torch.Tensor:
        """Forward and backward of one global batch (gradients accumulate); the loss as a
        plain scalar."""
        raise NotImplementedError

    def optimizer_step(self) -> None:
        """The plan's optimizer step (on the master shards of ZeRO parameters, which then
        rebuild their parameters), then the gradients are cleared."""
        self.sharded_state.before_step()
        self.optimizer.step()
        self.sharded_state.after_step()
        self.optimizer.zero_grad()

    def _build_optimizer(self, program: torch.nn.Module) -> None:
        """The plan's optimizer over ``program``'s parameters, ZeRO ones by their master shards
        (a native program's FSDP2 steps its own shards: none there)."""
        native = getattr(program, "kind", None) is not None  # NativeProgram, AccumulatedProgram
        self.sharded_state = ShardedOptimizerState({} if native else self.plan.storage,
                                                   program.named_plan_parameters())
        params = self.sharded_state.parameters(list(program.parameters()))
        self.optimizer = build_optimizer(self.plan.optimizer, params)

    @property
    def description(self) -> str:
        """What runs the plan, in a few words: a native PyTorch program, the DTensor interpreter
        or the pipeline schedule."""
        return getattr(self.program, "description", "the DTensor interpreter (autoplan.codegen.dtensor_program)")

    def train_step(self, *inputs: Any, **keyword_inputs: Any) -> torch.Tensor:
        """One training step as planned: forward, backward and the optimizer step; returns
        the loss (computed before the step) as a plain scalar."""
        loss = self.forward_backward(*inputs, **keyword_inputs)
        self.optimizer_step()
        return loss


class ParallelModule(PlannedTraining):
    """The model parallelized by ``plan``. ``pm(*global_inputs)`` → :class:`ParallelOutput`."""

    def __init__(self, program: ShardedProgram | NativeProgram, plan: Plan, device_type: str,
                 spec: ModelSpec | None = None) -> None:
        super().__init__(spec)
        self.program = program
        self.plan = plan
        self.device_type = device_type
        buckets, targets = None, {}  # a native program reduces its gradients itself (DDP, FSDP, ZeRO-2)
        if isinstance(program, ShardedProgram):
            buckets = program.gradient_buckets = GradientBuckets(program)
            targets = program.gradient_placements
        for param in {id(p): p for p in program.parameters()}.values():
            if not param.requires_grad:  # a frozen parameter (Whisper's positions) has no gradient
                continue
            if buckets is None or not buckets.owns(param):
                param.register_post_accumulate_grad_hook(partial(_reduce_gradient, targets.get(id(param))))
        self._build_optimizer(program)

    @property
    def mesh(self) -> DeviceMesh:
        return self.program.mesh

    def forward(self, *inputs: Any, **keyword_inputs: Any) -> ParallelOutput:
        inputs = self.batch(inputs, keyword_inputs)
        if self.device_type != "cpu":
            inputs = tuple(x.to(self.device_type) if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
                           else x for x in inputs)
        with compute_precision(self.plan.precision, self.device_type):
            loss, *outputs = self.program(*inputs)
        return ParallelOutput(loss, tuple(outputs))

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by the model's own names (tied names give the same object)."""
        return self.program.named_plan_parameters()

    def forward_backward(self, *inputs: Any, **keyword_inputs: Any) -> torch.Tensor:
        loss = self(*inputs, **keyword_inputs).loss
        loss.backward()
        return (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()


class PipelinedModule(PlannedTraining):
    """A pipelined plan: ``forward_backward(*global_inputs)`` runs every microbatch's forward
    and backward through the schedule (gradients accumulate in this rank's stage parameters)
    and returns the global loss on every rank. This rank holds only its stages' parameters."""

    def __init__(self, program: torch.nn.Module, plan: Plan, spec: ModelSpec | None = None) -> None:
        super().__init__(spec)
        self.program = program
        self.plan = plan
        self._build_optimizer(program)

    @property
    def description(self) -> str:
        return getattr(self.program, "description", None) or \
            f"torch.distributed.pipelining ({self.plan.schedule}, {len(self.plan.stages)} stage(s))"

    def forward(self, *inputs: Any, **keyword_inputs: Any) -> ParallelOutput:
        raise AutoplanError("a pipelined plan runs forward and backward together: call pm.train_step(*batch)")

    def forward_backward(self, *inputs: Any, **keyword_inputs: Any) -> torch.Tensor:
        return self.program.train_step(*self.batch(inputs, keyword_inputs))

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        return self.program.named_plan_parameters()


def _reduce_gradient(target: tuple[Placement, ...] | None, param: torch.Tensor) -> None:
    """The planned gradient reduction, in the backward as DDP does it: a gradient left as
    partial sums (a parameter replicated over a batch-sharded mesh axis) is reduced into the
    parameter's own placement, or into the ``target`` placements the plan stores the gradient
    in (ZeRO-2: a reduce-scatter), as soon as it is accumulated, so that the optimizer and the
    user see finished gradients."""
    grad = param.grad
    if isinstance(grad, DTensor) and isinstance(param, DTensor):
        placements = target if target is not None else param.placements
        if grad.placements != placements:
            param.grad = reduce_to(grad, param.device_mesh, placements)


def decision_digest(plan: Plan) -> str:
    """A hash of what a plan decides (:meth:`Plan.decisions`), not of how long it took."""
    return hashlib.sha256(json.dumps(plan.decisions(), sort_keys=True).encode()).hexdigest()


def check_plan_fits(plan: Plan, graph: TracedGraph, world_size: int) -> None:
    """One-line errors for a plan that does not belong to this model or this job."""
    if plan.graph_hash != graph.graph_hash:
        raise AutoplanError(f"plan.json was made for another model (graph hash {plan.graph_hash}, this model "
                            f"{graph.graph_hash}): plan this model again")
    check_plan_devices(plan, world_size)


def check_plan_devices(plan: Plan, world_size: int) -> None:
    if plan.devices != world_size:
        more = "more" if plan.devices > world_size else "fewer"
        raise AutoplanError(f"the plan is for {plan.devices} devices but this job has {world_size} processes "
                            f"({more} devices planned than launched): launch with --nproc-per-node "
                            f"{plan.devices} or plan again with --devices {world_size}")


def _agree_across_ranks(plan: Plan) -> None:
    digests: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(digests, decision_digest(plan))
    if len(set(digests)) != 1:
        raise AutoplanError("ranks planned differently (non-deterministic planning): pass the same plan= to "
                            "every rank")


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers by FQN, tied names included; meta ones are allocated as the
    program's shards (:mod:`autoplan.codegen.materialize`)."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(dict(model.named_buffers(remove_duplicate=False)))
    return tensors


def _initialise_meta_model(spec: ModelSpec, program: Any) -> None:
    """A meta-device model's initialisation, run on the program's shards."""
    if has_meta_tensors(spec.module):
        initialise(spec.module, program.named_plan_tensors(), spec.init_weights)


def build_parallel_module(spec: ModelSpec, plan: Plan, mesh: DeviceMesh | None = None,
                          graph: TracedGraph | None = None, prefer_native: bool = True
                          ) -> ParallelModule | PipelinedModule:
    """The program of ``plan`` for a loaded :class:`ModelSpec`, in this rank of the job.

    With ``prefer_native`` (the default), a plan that reduces to a pattern PyTorch implements
    itself — one device (the model itself), data parallelism (DDP), fully sharded data
    parallelism (FSDP2's ``fully_shard``), each with checkpointed layers, or Megatron
    column/row pairs (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``) on a
    1-D mesh — runs through that API
    (:func:`autoplan.codegen.native.native_module`); any other plan, or ``prefer_native=False``,
    runs on the DTensor interpreter (:func:`build_program`). A decision the program cannot
    carry out is refused in one line before anything is built."""
    ctx = init_distributed()
    check_plan_devices(plan, ctx.world_size)
    refuse_unsupported(plan)
    if plan.scheduled:
        return _pipelined(spec, plan, ctx, graph, prefer_native)
    graph = graph or trace(spec)
    check_plan_fits(plan, graph, ctx.world_size)
    _agree_across_ranks(plan)
    if mesh is None:
        mesh = _named_mesh(ctx, plan)
    elif tuple(mesh.shape) != tuple(plan.mesh):
        raise AutoplanError(f"the plan is for mesh {plan.mesh} but the given mesh is {list(mesh.shape)}")
    tensors = _model_tensors(spec.module)
    program = None
    if prefer_native:
        from autoplan.codegen.native import native_module

        program = native_module(spec, graph, plan, mesh)
    if program is None:
        program = build_program(graph, plan, mesh, tensors)
        _initialise_meta_model(spec, program)
    return ParallelModule(program, plan, ctx.device_type, spec)


def _named_mesh(ctx: DistContext, plan: Plan) -> DeviceMesh:
    """The plan's mesh, its axes named: FSDP2 takes a 2-D mesh as HSDP's (replicate, shard)
    only when they are named."""
    return init_device_mesh(ctx.device_type, tuple(plan.mesh),
                            mesh_dim_names=tuple(f"axis{i}" for i in range(len(plan.mesh))))


def _pipelined(spec: ModelSpec, plan: Plan, ctx: DistContext, graph: TracedGraph | None,
               prefer_native: bool = True) -> PipelinedModule:
    """A pipelined plan was traced for one microbatch: trace the same, check, build: one stage
    accumulating microbatches natively where its microbatch is DDP, FSDP (whole parameters
    beside sharded ones included), HSDP, ZeRO-2 or FSDP x TP
    (:mod:`autoplan.codegen.native_accumulation`); stages cut from the model's own modules, of
    one device each or FSDP over several (:mod:`autoplan.codegen.native_pipeline`); else the
    interpreter's stages on torch's pipeline schedule."""
    from autoplan.codegen.pipeline_program import build_pipeline

    if graph is None:
        one = spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches))
        graph = trace(one)
    check_plan_fits(plan, graph, ctx.world_size)
    _agree_across_ranks(plan)
    if prefer_native and len(plan.stages) == 1:
        from autoplan.codegen.native import native_module, native_pattern
        from autoplan.codegen.native_accumulation import AccumulatedProgram

        found = native_pattern(spec, graph, plan)  # before the plan's mesh (process groups) is made for it
        native = native_module(spec, graph, plan, _named_mesh(ctx, plan), found) if found else None
        if native is not None:
            return PipelinedModule(AccumulatedProgram(native, graph, ctx.device_type), plan, spec)
    if prefer_native:
        from autoplan.codegen.native_pipeline import native_pipeline

        own = native_pipeline(spec, graph, plan, ctx.device_type)  # stages cut from the model's modules
        if own is not None:
            return PipelinedModule(own, plan, spec)
    program = build_pipeline(graph, plan, _model_tensors(spec.module), ctx.device_type)
    _initialise_meta_model(spec, program)
    return PipelinedModule(program, plan, spec)
