"""Costs of strategies for one training step on one logical mesh.

A training step is forward + backward + optimizer step. Per node and strategy:

- compute: a roofline of the node's FLOPs and bytes divided by the ways the work is split,
  with the device's per-op overhead (dispatch; measured by ``autoplan calibrate``; added on a
  CPU, hidden behind a longer kernel on a GPU: :func:`~autoplan.cost_models.compute.op_seconds`), once for
  the forward and ``backward_factor`` times again for the backward (2: gradients with respect
  to inputs and weights) when the node needs gradients;
- no communication of its own, a collective belongs to an edge; except the scalar all-reduce
  by which a mean loss with a sharded batch replicates its target count in the backward;
- the optimizer step of a parameter (memory-bound over the local shard);
- memory per device: parameters, gradients and optimizer state of the local shard, and the
  activations the forward keeps for the backward.

Parameters gathered at use (ZeRO-3 / FSDP). A parameter stored sharded over a mesh axis whose
consumer reads it replicated there is gathered before each use in the forward; where the
consumer keeps it for its backward (:func:`autoplan.trace.saved_inputs.keeps_value`), the
program keeps the stored shard instead and gathers it again in the backward (FSDP2's
``reshard_after_forward``), and the backward's resharding reduce-scatters its gradient. The
kept memory counts the stored shard (parameter, gradient, optimizer state); the gathered
copies are alive for a moment, and the backward's moments count them
(:mod:`~autoplan.cost_models.transient_memory`: a block's parameters gathered with their
gradients, and the next block's prefetched, as FSDP2 holds them). A gather's edge costs it in
full; on a GPU the forward gathers of a repeated block are issued while the block before it
computes, and the seconds they hide there are taken off by the ILP's overlap rows
(:mod:`~autoplan.cost_models.gather_overlap`, which says what overlaps with what), as are the
seconds the gradient reductions of the block after and the re-gathers of the block before hide
behind a block's backward (:mod:`~autoplan.cost_models.backward_overlap`); every other
collective here runs in full, the compute waiting for it. Under mixed
precision a gather moves bf16 (:func:`resharded_itemsize`, FSDP2's ``MixedPrecisionPolicy``),
the gradient's reduce-scatter fp32.

Optimizer state sharded under a whole parameter (ZeRO-1/2). A trained parameter's storage
strategy may keep its placement ``p`` and store its optimizer state in ``s``, ``p`` with one
replicated mesh axis sharded (:attr:`Strategy.state_spec`), and its reduced gradient in ``s``
too (:attr:`Strategy.grad_spec`). Memory: parameter ``|p|·b_param``, gradient ``|g|·b_grad``,
state ``|s|·b_state`` (``|x|`` the local elements); the optimizer step runs over ``|s|``; once
per step the updated shards are all-gathered ``s → p`` (:func:`sharded_state_steps`, the
optimizer phase). The gradient's edges reduce into ``g`` instead of ``p``: a reduce-scatter
where the parameter's reduction is an all-reduce, the same bytes on a ring. Where microbatches
accumulate, a ZeRO-2 gradient is reduce-scattered after every microbatch's backward and summed
into its shard (as DeepSpeed's ZeRO-2 does), so that no whole gradient outlives a microbatch:
``microbatches`` reduce-scatters per step (and on a 2-D mesh as many all-reduces over the axis
that replicates the shard), costed as bucketed, as FSDP2 reduces a group's gradients at once;
the DTensor interpreter reduces them parameter by parameter, a latency each. A ZeRO-1 gradient
(``g = p``) accumulates whole, as partial sums, and is reduced once per step, before the
optimizer step, straight into ``s`` (the shard the optimizer steps): a reduce-scatter where
plain storage all-reduces, parameter by parameter (a latency each, not bucketed), so that
ZeRO-1 moves the bytes of plain data parallelism (a reduce-scatter and an all-gather make one
all-reduce) and keeps a shard of the optimizer state (:func:`edge_steps`' ``step_src``).

Parameters gathered once per step and held (FSDP under a pipeline, ``reshard_after_forward=False``,
:attr:`Strategy.held`). Where microbatches run, a parameter may be stored sharded as its
optimizer state ``s`` and gathered into ``p`` once per step, before the first microbatch, as a
copy in the precision's parameter dtype (bf16) that every microbatch reads; its gradient
accumulates whole (fp32) in ``p`` and is reduce-scattered into ``s`` once per step, after the
last microbatch. Its edges are ZeRO-1's (read as stored in ``p``, the gradient reduced once
into ``s``); memory: the shard ``|s|·b_param``, the held copy ``|p|·b_copy`` (2 under bf16, no
other compute copy: autocast's cast of it is taken from it again in the backward), the
accumulated gradient ``|p|·b_grad``, the state ``|s|·b_state``; the step's all-gather moves
``|p|·b_copy``. Against ZeRO-1 (``|p|·(b_param + b_copy) + |p|·b_grad + |s|·b_state``, the
updated fp32 shards gathered) it keeps ``|p|·b_param − |s|·b_param`` less and gathers half the
bytes under bf16; under fp32 it keeps more and gathers as much, so the search offers it under
mixed precision only (a manual plan's ``fsdp=`` under a pipeline asks for it in any precision).

Activation checkpointing. A recomputed node (in a layer the plan recomputes,
``recompute_regions``) runs its forward once more in the backward, and so does every
resharding on its inputs (the recomputed forward redistributes again). It keeps its output
for the backward only where a node outside its region reads it (the next region's saved
input). In a selectively recomputed layer the matrix products and attention
(``recompute_saved``) keep their outputs and do not run again; the resharding of their inputs
does, as in a fully recomputed one.

Per edge (producer spec → consumer spec): the forward resharding, plus the backward one that
carries the gradient the other way. The consumer leaves an input's gradient as partial sums on
every mesh axis its strategy shards a letter the input lacks (:attr:`Strategy.partial_grads`:
the input was replicated over devices that each used it for a different slice of the work);
the backward resharding reduces them into the producer's placement — an all-reduce into a
replicated one, a reduce-scatter into a sharded one. This is where the gradient reduction of a
parameter replicated over a batch-sharded mesh axis appears (once per step, in buckets as DDP
and FSDP do: bandwidth without a latency per parameter; per microbatch where the parameter is
read in another placement than it is stored), and the backward all-reduce of Megatron's
column-parallel input.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from autoplan.cost_models import (BACKWARD_FACTOR, CollectiveStep, DeviceSpec, LinkSpec, OptimizerSpec,
    collective_time, op_seconds, optimizer_step_time, reshard_steps, roofline_time)
from autoplan.sharding import P, R, ShardingSpec, local_shape
from autoplan.strategies.candidates import Strategy
from autoplan.trace.experts import saved_inside_elements
from autoplan.trace.graph import NodeInfo
from autoplan.trace.saved_inputs import ALIASING_OPS

FLOATING_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2"})


def is_floating(dtype: str) -> bool:
    return dtype.replace("torch.", "") in FLOATING_DTYPES


@dataclass(frozen=True)
class MemoryParts:
    """Bytes per device."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations

    def __add__(self, other: MemoryParts) -> MemoryParts:
        return MemoryParts(self.params + other.params, self.grads + other.grads,
                           self.optimizer + other.optimizer, self.activations + other.activations)

    def scaled(self, k: float) -> MemoryParts:
        return MemoryParts(self.params * k, self.grads * k, self.optimizer * k, self.activations * k)


@dataclass(frozen=True)
class NodeCost:
    """Seconds per training step and bytes per device of one node under one strategy."""

    compute_s: float = 0.0
    comm_s: float = 0.0
    optimizer_s: float = 0.0
    memory: MemoryParts = field(default_factory=MemoryParts)
    forward_s: float = 0.0  # of compute_s, the forward's first run (what prefetched gathers run beside)

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s + self.optimizer_s


@dataclass
class CostContext:
    """Everything a cost needs to know about the mesh and the hardware. ``cache`` memoises
    edge costs, which repeat across layers (keyed by specs, shape and dtype). With a pipeline
    the graph is one microbatch's: its compute and activation traffic count ``microbatches``
    times per step, gradient reductions and the optimizer step once."""

    mesh_shape: tuple[int, ...]
    links: tuple[LinkSpec, ...]
    device: DeviceSpec
    optimizer: OptimizerSpec
    backward_factor: float = 2.0
    microbatches: int = 1  # per-microbatch work (compute, activation traffic) runs this many times a step
    activations_in_flight: int = 1  # microbatches whose activations a stage holds at once (the schedule's)
    recompute_regions: Mapping[str, str] = field(default_factory=dict)  # op node -> its recomputed layer
    recompute_saved: frozenset[str] = frozenset()  # op nodes of those layers whose outputs are kept
    # parameter → consumer edges of the graph being planned (that carry a gradient): each bucketed
    # gradient reduction pays this share of one collective's latency (see steps_seconds)
    parameter_edges: int = 0
    # the plan has one stage: its ILP may hold more choices (a dim split over the axes of a mesh
    # across nodes, HSDP's batch: planner.mesh_plan.splits_dims_over_axes; sharded storage where
    # gathers hide: planner.mesh_plan._solve); off for the stages of a pipeline, which the search keeps small
    one_stage: bool = True
    cache: dict = field(default_factory=dict)


    def region_of(self, name: str) -> str | None:
        """The recomputed region holding op node ``name`` (None: its activations are kept)."""
        return self.recompute_regions.get(name)

    def recomputes(self, name: str) -> bool:
        """Whether op node ``name`` runs its forward again in the backward."""
        return name in self.recompute_regions and name not in self.recompute_saved


HALF_PRECISION = "bfloat16"


def value_itemsize(info: NodeInfo, mixed_precision: bool) -> int:
    """Bytes per element of a value a step computes, keeps or moves. Under mixed precision a
    float32 activation (or user input) is costed as bfloat16: the program's forward runs
    under ``torch.autocast``, where matrix products compute in bf16 and the values computed
    from them follow (a value mixing a bf16 result with an fp32 one, such as a residual sum,
    stays fp32 in the program: the cost model's approximation). A parameter keeps its own
    size: it is the float32 master, and its gradients are reduced in float32 (its forward
    resharding moves bf16: :func:`resharded_itemsize`). An op the model computes with autocast
    off keeps its own size too (:attr:`NodeInfo.full_precision`)."""
    if mixed_precision and info.kind != "parameter" and not info.full_precision \
            and info.dtype.replace("torch.", "") == "float32":
        return 2
    return info.itemsize


def resharded_itemsize(info: NodeInfo, mixed_precision: bool) -> int:
    """Bytes per element of a value's forward resharding. Under mixed precision a float32
    parameter moves as bfloat16: the program casts the master's shard to bf16 before it gathers
    it (and again for the backward's re-gather), as FSDP2's ``MixedPrecisionPolicy(param_dtype=
    bfloat16)`` does; the gradient goes back in float32 (:func:`value_itemsize`)."""
    if mixed_precision and info.kind == "parameter" and info.dtype.replace("torch.", "") == "float32":
        return 2
    return value_itemsize(info, mixed_precision)


def compute_dtype(info: NodeInfo, mixed_precision: bool) -> str:
    """The dtype an op's FLOPs run at: bfloat16 for a float32 op under mixed precision, unless
    the model turned autocast off around it."""
    dtype = info.dtype or "float32"
    lowered = mixed_precision and not info.full_precision and dtype.replace("torch.", "") == "float32"
    return HALF_PRECISION if lowered else dtype


def model_flops_utilization(graph_nodes: Iterable[NodeInfo], passes: int, step_time_s: float, devices: int,
                            device: DeviceSpec, mixed_precision: bool) -> float:
    """Model FLOPs utilisation of a step that runs the graph of ``graph_nodes`` ``passes`` times
    (microbatches): its forward and backward FLOPs (``1 + BACKWARD_FACTOR`` forwards; a
    recomputed forward is not the model's work) over what ``devices`` devices could do in the
    step at the peak of the dtype the heaviest op computes in."""
    nodes = [n for n in graph_nodes if n.kind == "op"]
    if not nodes or step_time_s <= 0:
        return 0.0
    flops = sum(n.flops for n in nodes) * passes * (1 + BACKWARD_FACTOR)
    dtype = compute_dtype(max(nodes, key=lambda n: n.flops), mixed_precision)
    return flops / (step_time_s * devices * device.peak(dtype))


def local_bytes(shape: tuple[int, ...], itemsize: int, spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> float:
    """Bytes of one device's shard of a value of ``shape`` stored in ``spec``."""
    return float(math.prod(local_shape(shape, spec, mesh_shape))) * itemsize


def storage_cost(info: NodeInfo, spec: ShardingSpec, ctx: CostContext, trainable: bool,
                 grad_spec: ShardingSpec | None = None, state_spec: ShardingSpec | None = None,
                 held: bool = False) -> NodeCost:
    """A parameter, buffer or user input stored in ``spec``. A trained parameter's gradient
    is kept in ``grad_spec`` and its optimizer state in ``state_spec`` (``None``: as the
    parameter). Under a sharded state (ZeRO-1/2) the optimizer steps this rank's shard, and
    the updated shards are all-gathered into the parameter's placement once per step. A
    ``held`` parameter is stored in ``state_spec`` (the module docstring)."""
    shape = info.shape or ()
    elements = float(math.prod(local_shape(shape, spec, ctx.mesh_shape)))
    if info.kind == "parameter" and trainable:
        param_b, grad_b, opt_b = ctx.optimizer.state_bytes_per_param(info.itemsize)
        grad_elements = float(math.prod(local_shape(shape, grad_spec or spec, ctx.mesh_shape)))
        state_elements = float(math.prod(local_shape(shape, state_spec or spec, ctx.mesh_shape)))
        step = optimizer_step_time(state_elements, ctx.device, ctx.optimizer, info.itemsize)
        copy_b = state_gather_itemsize(info, ctx, held)
        gather = steps_seconds(sharded_state_steps(spec, state_spec, shape, copy_b, ctx), ctx)
        if held:  # the stored shard, and the held copy the forward computes with
            params = state_elements * param_b + elements * copy_b
        else:
            params = elements * (param_b + ctx.optimizer.compute_copy_bytes)
        return NodeCost(comm_s=gather, optimizer_s=step,
                        memory=MemoryParts(params, grad_elements * grad_b, state_elements * opt_b))
    if info.kind in ("parameter", "buffer", "constant"):
        return NodeCost(memory=MemoryParts(params=elements * info.itemsize))
    itemsize = value_itemsize(info, ctx.optimizer.mixed_precision)
    return NodeCost(memory=MemoryParts(activations=elements * itemsize * ctx.activations_in_flight))


def state_gather_itemsize(info: NodeInfo, ctx: CostContext, held: bool) -> int:
    """Bytes per element of a sharded-state parameter's gather once per step: a held one's copy
    moves in the precision's parameter dtype (:func:`resharded_itemsize`), ZeRO-1/2's updated
    shards in the parameter's own."""
    return resharded_itemsize(info, ctx.optimizer.mixed_precision) if held else info.itemsize


def sharded_state_steps(spec: ShardingSpec, state_spec: ShardingSpec | None, shape: tuple[int, ...], itemsize: int,
                        ctx: CostContext) -> list[CollectiveStep]:
    """The optimizer phase's collectives of a parameter stored in ``spec`` whose optimizer
    state is ``state_spec``: the updated shards gathered into the parameter (none when the
    state is stored as the parameter)."""
    if state_spec is None or state_spec == spec:
        return []
    return reshard_steps(state_spec, spec, shape, itemsize, ctx.mesh_shape)


def aten_name(info: NodeInfo) -> str:
    """An op node's ATen name without namespace and overload (``linear``), else its target."""
    parts = info.target.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "aten" else info.target


def moved_bytes(info: NodeInfo) -> float:
    """Bytes an op node reads and writes: the traced count, or none for a view."""
    return 0.0 if aten_name(info) in ALIASING_OPS else info.bytes


def op_cost(info: NodeInfo, strategy: Strategy, inputs: list[NodeInfo], grad_inputs: list[bool],
            needs_grad: bool, saves_output: bool, ctx: CostContext, recomputed: bool = False) -> NodeCost:
    """An op node under ``strategy``. ``grad_inputs[i]`` says whether input i needs a gradient.

    Forward: the roofline of the node's FLOPs and moved bytes (:func:`moved_bytes`; the memory
    term at the device's :attr:`~autoplan.cost_models.DeviceSpec.activation_bandwidth`) split
    over the shards, with the device's per-op overhead (:func:`op_seconds`); the backward costs ``backward_factor``
    forwards, and one forward more where the node is ``recomputed``. Memory: the output where
    the backward reads it, and what the op keeps inside itself (:func:`kept_inside`)."""
    shards = strategy.compute_shards
    mixed = ctx.optimizer.mixed_precision
    itemsize = value_itemsize(info, mixed)
    moved = moved_bytes(info) * (itemsize / info.itemsize if info.itemsize else 1.0)
    forward = roofline_time(info.flops / shards, moved / shards, ctx.device, compute_dtype(info, mixed))
    backward = (ctx.backward_factor if needs_grad else 0.0) + (1.0 if recomputed else 0.0)
    forward_s = op_seconds(forward, ctx.device) * ctx.microbatches
    compute = forward_s * (1.0 + backward)
    comm = steps_seconds(count_reduction_steps(info, strategy), ctx) * (1.0 + recomputed) * ctx.microbatches \
        if needs_grad else 0.0
    activations = 0.0
    if saves_output and info.shape is not None:
        activations = local_bytes(info.shape, itemsize, strategy.output_spec, ctx.mesh_shape)
    if needs_grad and not recomputed:  # a recomputed op keeps nothing until its forward runs again
        activations += kept_inside(info, strategy, inputs, itemsize, ctx)
    activations *= ctx.activations_in_flight
    return NodeCost(compute_s=compute, comm_s=comm, memory=MemoryParts(activations=activations), forward_s=forward_s)


def kept_inside(info: NodeInfo, strategy: Strategy, inputs: list[NodeInfo], itemsize: int,
                ctx: CostContext) -> float:
    """Bytes per device an op keeps inside itself for its backward, beyond the values the graph
    shows: those of a mixture-of-experts layer's experts traced as one op
    (:func:`~autoplan.trace.experts.saved_inside_elements`, for this device's tokens); none for
    other ops."""
    if not info.target.startswith("autoplan.moe_experts") or info.shape is None or len(inputs) < 5 \
            or any(i.shape is None for i in inputs[:5]):
        return 0.0
    tokens = local_shape(info.shape, strategy.output_spec, ctx.mesh_shape)[0]
    hidden, index, _, gate_up, down = (i.shape for i in inputs[:5])
    return saved_inside_elements(hidden, index, gate_up, down, tokens) * itemsize


def count_reduction_steps(info: NodeInfo, strategy: Strategy) -> list[CollectiveStep]:
    """The collectives an op runs for its own reduction (:attr:`Strategy.count_reductions`): one
    all-reduce of a scalar per mesh axis, the target count of a mean loss whose batch is
    sharded, in the forward, which divides the loss's partial sum by it
    (:func:`autoplan.codegen.op_calls._cross_entropy_over_counted_targets`), and again in the
    backward where the loss is recomputed."""
    return [CollectiveStep("all_reduce", axis, float(info.itemsize)) for axis in strategy.count_reductions]


def _as_gradient_spec(spec: ShardingSpec) -> ShardingSpec:
    return tuple(R if p.is_partial else p for p in spec)


def edge_steps(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, carries_grad: bool,
               ctx: CostContext, partial_axes: frozenset[int] = frozenset(), whole_axes: frozenset[int] = frozenset(),
               grad_src: ShardingSpec | None = None, forward_itemsize: int | None = None,
               step_src: ShardingSpec | None = None) -> tuple[list[CollectiveStep], list[CollectiveStep]]:
    """Forward and backward collectives of an edge whose producer emits ``src`` and whose
    consumer reads ``dst``. The consumer's backward leaves the gradient as partial sums on
    ``partial_axes`` (:attr:`Strategy.partial_grads`); carrying it back into the producer's
    placement reduces it there: an all-reduce into a replicated placement, a reduce-scatter
    into a sharded one (as DTensor's backward does). On ``whole_axes`` the consumer's backward
    gives the gradient replicated (:attr:`Strategy.whole_grad_axes`). A parameter whose
    gradient is stored in ``grad_src`` (ZeRO-2) has it reduced into that placement instead:
    a reduce-scatter where the parameter's would be an all-reduce. A parameter read as stored
    whose optimizer state is stored in ``step_src`` (ZeRO-1) has its gradient reduced into that
    placement, once per step (the module docstring). The forward moves ``forward_itemsize``
    bytes per element where given (:func:`resharded_itemsize`), the backward ``itemsize``."""
    forward = reshard_steps(src, dst, shape, forward_itemsize or itemsize, ctx.mesh_shape) if src != dst else []
    backward: list[CollectiveStep] = []
    if carries_grad:
        g_dst = tuple(P if axis in partial_axes else R if axis in whole_axes else p
                      for axis, p in enumerate(_as_gradient_spec(dst)))
        g_src = grad_src if grad_src is not None else step_src if step_src is not None and src == dst \
            else _as_gradient_spec(src)
        if g_dst != g_src:
            backward = reshard_steps(g_dst, g_src, shape, itemsize, ctx.mesh_shape)
    return forward, backward


def steps_seconds(steps: list[CollectiveStep], ctx: CostContext, bucketed: bool = False) -> float:
    """Seconds of ``steps``. ``bucketed`` collectives (gradient reductions) are flattened into
    buckets: each pays its bandwidth, and a share ``1 / ctx.parameter_edges`` of one
    collective's latency. The program reduces a step's bucketed gradients in a few collectives
    per mesh axis, of which the last one's latency is not hidden behind the backward (DDP's
    first buckets overlap with it): spread over the graph's parameter edges, a plan that reduces
    every parameter's gradient on an axis (data parallelism) pays exactly that one latency, one
    that reduces some of them pays their share (a linear stand-in for "once if any", which keeps
    the ILP's edge costs separable)."""
    total = 0.0
    for s in steps:
        link, n = ctx.links[s.mesh_axis], ctx.mesh_shape[s.mesh_axis]
        if bucketed:
            total += collective_time(s.kind, s.nbytes, n, link.without_latency())
            if ctx.parameter_edges:
                total += collective_time(s.kind, 0.0, n, link) / ctx.parameter_edges
        else:
            total += collective_time(s.kind, s.nbytes, n, link)
    return total


def step_reduction_spec(spec: ShardingSpec, grad_spec: ShardingSpec | None, state_spec: ShardingSpec | None
                        ) -> ShardingSpec | None:
    """The placement a ZeRO-1 parameter stored in ``spec`` has its gradient reduced into once
    per step: its optimizer state's (None for plain storage and ZeRO-2, whose gradient has its
    own placement ``grad_spec``)."""
    return state_spec if grad_spec is None and state_spec is not None and state_spec != spec else None


def gradient_reductions(grad_spec: ShardingSpec | None, spec: ShardingSpec, ctx: CostContext) -> int:
    """How many times a step reduces the gradient of a parameter stored in ``spec`` and read so:
    once, or, where its gradient is stored sharded unlike it (ZeRO-2), after every microbatch."""
    return ctx.microbatches if grad_spec is not None and grad_spec != spec else 1


def regather_runs(from_parameter: bool, recomputed: bool, kept: bool) -> int:
    """How many times more than once per microbatch an edge's forward resharding runs: again
    in the backward where the consumer is recomputed, or where a parameter resharded for its
    consumer is kept for the backward (the program keeps the stored parameter and gathers it
    again, as FSDP's ``reshard_after_forward`` does:
    :mod:`autoplan.codegen.parameter_regather`)."""
    return 1 if recomputed or (from_parameter and kept) else 0


def edge_cost(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, carries_grad: bool,
              ctx: CostContext, partial_axes: frozenset[int] = frozenset(), from_parameter: bool = False,
              whole_axes: frozenset[int] = frozenset(), recomputed: bool = False, kept: bool = False,
              grad_src: ShardingSpec | None = None, forward_itemsize: int | None = None,
              step_src: ShardingSpec | None = None) -> float:
    """Seconds per step spent resharding along an edge, memoised: the forward every
    microbatch (twice where the consumer is ``recomputed``); the backward every microbatch,
    except for the gradient of a parameter read as it is stored, which is reduced once per
    step (bucketed, no latency per parameter). A parameter read in another placement is
    resharded every microbatch, and its gradient goes back through that resharding each time;
    where its consumer ``kept`` it for the backward, the backward gathers it again
    (:func:`regather_runs`); a ZeRO-1 gradient (``step_src``) is reduce-scattered parameter by
    parameter, not in buckets. ``grad_src``, ``forward_itemsize``, ``step_src``: see
    :func:`edge_steps`."""
    if src == dst and not (carries_grad and partial_axes):
        return 0.0
    key = (src, dst, shape, itemsize, carries_grad, partial_axes, whole_axes,
           ctx.parameter_edges if from_parameter else -1, recomputed, kept, grad_src, forward_itemsize, step_src)
    cached = ctx.cache.get(key)
    if cached is None:
        backward, forward_s, backward_s = _memoised_steps(src, dst, shape, itemsize, carries_grad, ctx, partial_axes,
                                                          whole_axes, grad_src, forward_itemsize, step_src)
        if from_parameter and src == dst:  # reduced once per step; a ZeRO-2 gradient every microbatch
            cached = steps_seconds(backward, ctx, bucketed=step_src is None) * gradient_reductions(grad_src, src, ctx)
        else:
            runs = 1.0 + regather_runs(from_parameter, recomputed, kept)
            cached = (runs * forward_s + backward_s) * ctx.microbatches
        ctx.cache[key] = cached
    return cached


def _memoised_steps(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int, carries_grad: bool,
                    ctx: CostContext, partial_axes: frozenset[int], whole_axes: frozenset[int],
                    grad_src: ShardingSpec | None, forward_itemsize: int | None, step_src: ShardingSpec | None
                    ) -> tuple[list[CollectiveStep], float, float]:
    """An edge's backward collectives and the seconds of one run of its forward and of its
    backward (:func:`edge_steps`), memoised in ``ctx.cache``: the collectives do not depend on
    how often they run (an op's edges are costed again recomputed, and a parameter's again
    kept for the backward)."""
    key = ("edge steps", src, dst, shape, itemsize, carries_grad, partial_axes, whole_axes, grad_src,
           forward_itemsize, step_src)
    steps = ctx.cache.get(key)
    if steps is None:
        forward, backward = edge_steps(src, dst, shape, itemsize, carries_grad, ctx, partial_axes, whole_axes,
                                       grad_src, forward_itemsize, step_src)
        steps = (backward, steps_seconds(forward, ctx), steps_seconds(backward, ctx))
        ctx.cache[key] = steps
    return steps


def gradient_reduction_cost(src: ShardingSpec, dst: ShardingSpec, shape: tuple[int, ...], itemsize: int,
                            ctx: CostContext, partial_axes: frozenset[int] = frozenset(),
                            whole_axes: frozenset[int] = frozenset(), grad_src: ShardingSpec | None = None,
                            forward_itemsize: int | None = None, step_src: ShardingSpec | None = None) -> float:
    """Of a trained parameter's edge (:func:`edge_cost` with ``from_parameter``), the seconds
    per step its gradient's reduction takes in the backward, as the program launches it when
    the gradient is ready: the bucketed reduction of a parameter read as stored, a ZeRO-2
    gradient's reduce-scatter, or the reduce-scatter back through a gather. None of a ZeRO-1
    gradient's (``step_src``), which is reduced before the optimizer step, after the backward."""
    if src == dst and (step_src is not None or not partial_axes):
        return 0.0
    backward, _, backward_s = _memoised_steps(src, dst, shape, itemsize, True, ctx, partial_axes, whole_axes,
                                              grad_src, forward_itemsize, step_src)
    if src == dst:
        return steps_seconds(backward, ctx, bucketed=True) * gradient_reductions(grad_src, src, ctx)
    return backward_s * ctx.microbatches
