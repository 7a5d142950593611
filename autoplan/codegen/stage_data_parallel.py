"""Data parallelism inside the stages of a pipeline cut from the model's own modules
(:mod:`autoplan.codegen.native_pipeline`): every stage on ``d`` devices, each of them running
its own slice of every microbatch, the stage's parameters stored sharded over them and gathered
at use (FSDP2), as torchtitan composes FSDP with pipeline parallelism.

Which plans (:func:`stage_data_parallel`): every stage on a 1-D logical mesh of the same ``d``
devices, the devices of pipeline rank ``r`` being ``r·d … r·d + d - 1`` (the ``pp × dp`` device
mesh, row-major); within the stages, the plan is what a data-parallel program of one stage is
(:func:`~autoplan.codegen.native_patterns._recognise_data_parallel` on the plan less its sends and
the loss's broadcast): the microbatch split over the ``d`` devices, every trained parameter
stored sharded and gathered at use before the forward and again before the backward, its
gradient reduce-scattered after every microbatch (FSDP2 under a plain module, so that torch's
pipeline stage runs FSDP2's own backward), or every sharded one held gathered through the
microbatches and reduced once a step (:attr:`~autoplan.plan_schema.ParamStorage.held`: the stage
itself the FSDP2 root, ``reshard_after_forward=False``, which torch's stage holds and reduces
once), the others kept whole, their gradients all-reduced once a step (FSDP2's ``replicate`` on
the modules holding them, inside that root, which torch's stage reduces once with its groups;
a stage of whole parameters only is one ``replicate`` group), or every one whole (DDP: the
stage under ``replicate``, which torch's stage reduces once), and activations never gathered
(values crossing a stage boundary cross as shards, each device sending its slice to its peer of
the next stage); the loss a mean, or a cross-entropy averaged over the targets it counts.
Parameters kept whole beside ones gathered in every microbatch (``replicate`` would all-reduce
them after every microbatch's backward, the plan once a step), ZeRO-2, embedding tables read in
place and a mix of held and gathered parameters run on the interpreter.

How the program computes one device's loss and gradients. Microbatch ``m`` of the global batch
is split into ``d`` slices (the interpreter's order: microbatch first, then the device's slice).
Each device of the last stage computes its slice's loss ``L_{m,r}``; for a cross-entropy
averaged over counted targets the stage's cross-entropy node is replaced by
:class:`GlobalTokenMeanLoss`: the slice's summed loss ``S_{m,r}`` times ``d`` over the
microbatch's count ``C_m`` (all-reduced over the stage's devices: the plan's "loss count"), so
that ``(1/d) Σ_r L_{m,r}`` is the microbatch's mean. The schedule's loss function
(:class:`DataParallelLoss`) weighs it by the microbatch's share of the batch
(:func:`~autoplan.codegen.loss_weights.microbatch_weights`) and all-reduces its value over the
stage's devices (the plan's ``-> output`` all-reduce; the gradient is the slice's own). FSDP2
averages the devices' gradients, so every parameter's gradient is that of the global batch's
loss.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.fx

from autoplan.codegen.native_patterns import _recognise_data_parallel, held_as_sharded, loss_node
from autoplan.codegen.native_storage import ParameterStorage
from autoplan.codegen.token_mean import share_of_global_mean
from autoplan.cost_models.communication import CollectiveKind
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan, copies_summed
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import microbatch_inputs

_CROSS_ENTROPY = torch.ops.aten.cross_entropy_loss.default
_SUM = 2  # aten's reduction enum: 0 none, 1 mean, 2 sum


@dataclass(frozen=True)
class StageDataParallel:
    """How each stage runs over its ``devices`` (``d``): FSDP2 over the sharded parameters
    (``storage``), the loss's count all-reduced where ``token_mean``; ``held``: every sharded
    parameter gathered once a step and held through the microbatches, its gradient accumulated
    whole and reduce-scattered once (:attr:`~autoplan.plan_schema.ParamStorage.held`), else
    gathered and reduce-scattered in every microbatch."""

    devices: int
    storage: ParameterStorage
    token_mean: bool
    held: bool = False
    replicated: bool = False  # every parameter whole (DDP), its gradient all-reduced once a step
    whole: frozenset[str] = frozenset()  # beside held ones: kept whole, under FSDP2's replicate

    def within(self, stage_parameters: dict[str, str]) -> ParameterStorage:
        """The storage of one stage's parameters, by the names the stage holds them under
        (``stage_parameters`` maps each to the name the plan stores it under: a tied weight's
        head may be stored as its token table)."""
        dims = {own: self.storage.shard_dims[planned] for own, planned in stage_parameters.items()
                if planned in self.storage.shard_dims}
        return dataclasses.replace(self.storage, shard_dims=dims)


def stage_data_parallel(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> StageDataParallel | str:
    """How the stages of ``plan`` (each on several devices) run data parallel (module
    docstring), or why they do not."""
    d = len(plan.stages[0].devices)
    if len(plan.mesh) != 1 or any(stage.mesh != [d] for stage in plan.stages):
        return f"stages on logical meshes {[stage.mesh for stage in plan.stages]}, not one data axis each"
    trained = graph.parameter_fqns
    held = {fqn for fqn, s in plan.storage.items() if s.held}
    plan = held_as_sharded(plan) if held else plan
    cut = [name for name in graph.input_names if plan.inputs.get(name, ["R"]) not in (["R"], ["S(0)"])]
    if cut:
        return f"input {cut[0]} is {plan.inputs[cut[0]]}: the schedule splits microbatches on dim 0"
    loss = loss_node(graph)
    sent = [c.where for c in plan.collectives if c.where.endswith("-> output") and c.tensor == "activation"
            and (loss is None or c.where.split(" -> ")[0] != loss.name)]
    if sent:
        return f"the plan gathers a value over a stage's devices before sending it on ({sent[0]})"
    summed = {copies_summed(fqn) for fqn in graph.parameter_fqns}  # a tied weight's copies: the pipeline's
    within = dataclasses.replace(plan, collectives=[
        c for c in plan.collectives
        if c.kind not in (CollectiveKind.SEND_RECV, CollectiveKind.BROADCAST) and c.where not in summed])
    one = spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches))
    found = _recognise_data_parallel(one, graph, within, d)
    if isinstance(found, str):
        return found
    if found.kind == "ddp":
        return StageDataParallel(d, ParameterStorage(), found.token_mean, replicated=True)
    storage = found.storage
    if found.kind != "fsdp" or storage is None:
        return f"the stages are {found.kind}, not FSDP or DDP"
    if held and set(storage.shard_dims) != held:
        return "some parameters held gathered through the microbatches, others gathered in every microbatch"
    if storage.zero2 or storage.embeddings:
        return "ZeRO-2 parameters or tables read in place beside the sharded ones in a stage"
    whole = sorted(trained - set(storage.shard_dims) - set(graph.tied))
    if whole and not held:  # FSDP2's replicate would all-reduce them after every microbatch's backward
        return f"{whole[0]} kept whole beside parameters gathered in every microbatch"
    on_root = [fqn for fqn in whole if "." not in fqn]
    if on_root:
        return f"{on_root[0]} kept whole by the model's root module (a stage's root is FSDP2's)"
    return StageDataParallel(d, storage, found.token_mean, bool(held), whole=frozenset(whole))


def device_rows(plan: Plan, stage_ranks: Sequence[int]) -> bool:
    """Whether stage ``s`` lies on the devices of its pipeline rank's row of the ``pp × d``
    device mesh (row-major)."""
    d = len(plan.stages[0].devices)
    return all(stage.devices == list(range(rank * d, rank * d + d)) for rank, stage in zip(stage_ranks, plan.stages))


def local_batch(inputs: Sequence[torch.Tensor], microbatches: int, devices: int, index: int
                ) -> tuple[torch.Tensor, ...]:
    """This device's part of the global batch ``inputs``: slice ``index`` of the ``devices``
    slices of every microbatch, the microbatches in order (the schedule cuts it into
    microbatches again). Every input is cut so, as the stages were traced: one the plan holds
    whole on a stage's devices (the labels) is read as slices by the ops that read it."""
    return tuple(torch.cat([piece.chunk(devices)[index] for piece in x.chunk(microbatches)]) for x in inputs)


class GlobalTokenMeanLoss(torch.nn.Module):
    """aten's cross-entropy averaged over the targets of the whole microbatch, each device
    holding a slice of it: the slice's summed loss times ``devices`` over the microbatch's
    count, all-reduced over ``group`` (module docstring)."""

    def __init__(self, group: dist.ProcessGroup, devices: int) -> None:
        super().__init__()
        self.group = group
        self.devices = devices

    def forward(self, logits: torch.Tensor, target: torch.Tensor, weight: torch.Tensor | None = None,
                reduction: int = 1, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
        summed = _CROSS_ENTROPY(logits, target, weight, _SUM, ignore_index, label_smoothing)
        return share_of_global_mean(summed, target, ignore_index, [self.group], self.devices)


def count_over_devices(stage_module: torch.fx.GraphModule, group: dist.ProcessGroup, devices: int) -> bool:
    """Replace the stage's token-mean cross-entropy by :class:`GlobalTokenMeanLoss`; whether it
    holds one."""
    found = [n for n in stage_module.graph.nodes if n.op == "call_function" and n.target is _CROSS_ENTROPY]
    if not found:
        return False
    stage_module.add_submodule("global_token_mean", GlobalTokenMeanLoss(group, devices))
    for node in found:
        node.op, node.target = "call_module", "global_token_mean"
    stage_module.recompile()
    return True


class DataParallelLoss:
    """The schedule's loss function: a microbatch's loss (this device's slice's) times its
    weight, its value averaged over the stage's devices (an all-reduce, the plan's ``-> output``),
    its gradient the slice's own."""

    def __init__(self, group: dist.ProcessGroup | None, devices: int) -> None:
        self.group = group
        self.devices = devices

    def __call__(self, output: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        weighted = output * weight.reshape(()).to(output.dtype)
        if self.devices == 1:
            return weighted
        total = weighted.detach().clone()
        dist.all_reduce(total, group=self.group)
        return weighted + (total / self.devices - weighted.detach())


def replicated_collectives(groups: int) -> Counter[str]:
    """What ``replicate`` on a stage runs in a step under torch's pipeline stage: one gradient
    all-reduce per group, after the last microbatch's backward."""
    return Counter({"all_reduce": groups})


def fsdp_collectives(groups: int, microbatches: int, held: bool) -> Counter[str]:
    """What FSDP2 runs in a step of ``microbatches`` over ``groups`` groups: each gathered
    before every microbatch's forward and again before its backward, its gradients
    reduce-scattered after every backward; ``held``: each gathered once, before the first
    forward, and reduce-scattered once, after the last backward."""
    if held:
        return Counter({"all_gather": groups, "reduce_scatter": groups})
    return Counter({"all_gather": 2 * groups * microbatches, "reduce_scatter": groups * microbatches})
