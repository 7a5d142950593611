"""Parameter gathers prefetched beside the forward of the block before: what overlaps with what.

A plan that stores a block's parameters sharded and has their consumers read them whole
(ZeRO-3 / FSDP) gathers them before each use in the forward. The program issues a repeated
block's gathers when the block before it (the same stack, index one less) starts its forward,
as FSDP2 prefetches the next block's all-gather (:mod:`autoplan.codegen.prefetched_gathers`;
on a GPU on a stream of their own, beside the compute stream). So, per microbatch:

- **overlapped:** block ``b``'s forward gathers (every parameter of ``b`` an op of ``b``
  reads in another placement than stored, its forward resharding) run beside block ``b-1``'s
  forward compute. Hidden: ``min(G_b, C_(b-1))`` seconds, ``G_b`` the gathers' seconds and
  ``C_(b-1)`` the forward seconds of ``b-1``'s ops (their roofline, no collectives);
- **not overlapped** here, costed in full where they run: the gathers of the first block of a
  stack or of a pipeline stage (no block before it in the graph) and of parameters outside
  repeated blocks (embeddings, the head); a recomputed block's gathers again in its
  recomputation (inside the checkpointed region); every tensor-parallel collective (the
  compute waits for its result). The backward's gathers again (``reshard_after_forward``) and
  the gradients' reductions run beside the backward of a neighbouring block
  (:mod:`~autoplan.cost_models.backward_overlap`);
- only on a device whose host runs ahead of it with collectives on their own stream (a GPU:
  :attr:`~autoplan.cost_models.DeviceSpec.overlapped_dispatch`). On a CPU (gloo) nothing
  overlaps; the program still issues the gathers early, which changes nothing there.

Not modelled: a prefetched gather sharing a link with the previous block's own collectives
(it is costed as if it had the link alone), and the prefetched parameters' memory in the
forward (the backward's moments count a block's gathered parameters and the next block's,
:mod:`~autoplan.cost_models.transient_memory`, and the backward is the step's peak).

The intra-op ILP holds these as overlap rows (:class:`~autoplan.solvers.OverlapRow`,
:func:`autoplan.planner.mesh_plan.overlap_rows`); the plan lists the prefetched gathers
(:class:`~autoplan.plan_schema.PrefetchedGather`) and its prediction the hidden seconds.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from autoplan.cost_models.communication import reshard_steps
from autoplan.cost_models.step_costs import CostContext, resharded_itemsize, steps_seconds
from autoplan.sharding import ShardingSpec
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import TracedGraph
from autoplan.trace.repeated import node_block


@dataclass(frozen=True)
class BlockPrefetch:
    """Block ``block``'s forward gathers, issued at ``at`` (the first op of the block before
    it) and run beside that block's ops ``beside``. ``reads``: (parameter, consumer op, the
    consumer's tensor input position) of every parameter of the block an op of it reads."""

    block: tuple[str, int]
    at: str
    beside: tuple[str, ...]
    reads: tuple[tuple[str, str, int], ...]


def overlaps_gathers(ctx: CostContext) -> bool:
    """Whether the device runs prefetched gathers beside its compute (a GPU)."""
    return ctx.device.overlapped_dispatch


def block_ops(graph: TracedGraph) -> dict[tuple[str, int], list[str]]:
    """The ops of every repeated block in ``graph``, in graph order."""
    ops: dict[tuple[str, int], list[str]] = {}
    for name, info in graph.nodes.items():
        if info.kind == "op":
            block = node_block(graph, name)
            if block is not None:
                ops.setdefault(block, []).append(name)
    return ops


def own_reads(graph: TracedGraph, inputs: Mapping[str, list[str]], block: tuple[str, int],
              ops: list[str]) -> tuple[tuple[str, str, int], ...]:
    """(parameter, consumer op, the consumer's tensor input position) of every read of a
    parameter of ``block`` by one of its ``ops`` (``inputs``: op -> its tensor inputs)."""
    return tuple((source, op, pos) for op in ops for pos, source in enumerate(inputs.get(op, ()))
                 if graph.nodes[source].kind == "parameter" and node_block(graph, source) == block)


def block_prefetches(graph: TracedGraph, inputs: Mapping[str, list[str]]) -> list[BlockPrefetch]:
    """Every block of a repeated stack whose block before it is in ``graph``, with the
    parameter reads whose gathers can be prefetched: those of its own parameters by its ops
    (``inputs``: op -> its tensor inputs)."""
    ops = block_ops(graph)
    out = []
    for (stack, index), names in ops.items():
        before = ops.get((stack, index - 1))
        if before is None:
            continue
        reads = own_reads(graph, inputs, (stack, index), names)
        if reads:
            out.append(BlockPrefetch((stack, index), before[0], tuple(before), reads))
    return out


def forward_gather_seconds(graph: TracedGraph, parameter: str, stored: ShardingSpec, read: ShardingSpec | None,
                           ctx: CostContext) -> float:
    """Seconds per step of a parameter's forward resharding from ``stored`` to ``read`` (its
    gather), every microbatch; memoised in ``ctx.cache``."""
    if read is None or read == stored:
        return 0.0
    info = graph.nodes[parameter]
    itemsize = resharded_itemsize(info, ctx.optimizer.mixed_precision)
    key = ("forward gather", stored, read, info.shape, itemsize, ctx.microbatches)
    seconds = ctx.cache.get(key)
    if seconds is None:
        steps = reshard_steps(stored, read, info.shape or (), itemsize, ctx.mesh_shape)
        seconds = steps_seconds(steps, ctx) * ctx.microbatches
        ctx.cache[key] = seconds
    return seconds


def read_spec(strategy: Strategy, position: int) -> ShardingSpec | None:
    """The spec ``strategy`` reads its input ``position`` in (None: it does not read it)."""
    return strategy.input_specs[position] if position < len(strategy.input_specs) else None


@dataclass(frozen=True)
class HiddenGathers:
    """What a chosen plan prefetches: per block, where its gathers are issued and the reads
    (consumer op, input position) whose forward resharding moves data; and the seconds per
    step hidden behind the blocks before."""

    issued: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    seconds: float


def hidden_gathers(graph: TracedGraph, inputs: Mapping[str, list[str]], chosen: Mapping[str, Strategy],
                   forward_s: Mapping[str, float], ctx: CostContext) -> HiddenGathers:
    """The prefetched gathers of a plan (``chosen`` strategies, ``forward_s`` seconds of each
    op's forward) and the seconds they hide, ``sum_b min(G_b, C_(b-1))``, as the ILP's overlap
    rows cost them. Nothing where the device overlaps nothing."""
    if not overlaps_gathers(ctx):
        return HiddenGathers((), 0.0)
    issued, hidden = [], []
    for prefetch in block_prefetches(graph, inputs):
        reads, gathers = [], []
        for param, op, pos in prefetch.reads:
            seconds = forward_gather_seconds(graph, param, chosen[param].output_spec, read_spec(chosen[op], pos), ctx)
            if seconds > 0:
                reads.append((op, pos))
                gathers.append(seconds)
        if reads:
            issued.append((prefetch.at, tuple(reads)))
            hidden.append(min(math.fsum(gathers), math.fsum(forward_s.get(op, 0.0) for op in prefetch.beside)))
    return HiddenGathers(tuple(issued), math.fsum(hidden))
