"""Gradient reductions run beside the backward of the block before: what overlaps with what.

The backward runs a stack's blocks in reverse. When block ``b``'s backward has produced its
parameters' gradients, the program on a GPU launches their reductions without waiting for
them: the bucketed all-reduces of data parallelism (:mod:`autoplan.codegen.gradient_buckets`,
as DDP does), the reduce-scatters of parameters gathered at use (ZeRO-3 / FSDP) and of ZeRO-2
gradients (:func:`autoplan.codegen.redistribution.launches_reduction`: asynchronous
collectives, awaited where the gradient is next read); FSDP2 launches its reduce-scatters the
same way. So, with one microbatch per step:

- **overlapped:** block ``b``'s gradient reductions (every edge from a parameter of ``b`` to
  an op of ``b``, its backward's collectives) run beside block ``b-1``'s backward: its
  recomputed forward where it is checkpointed and its backward proper. Hidden:
  ``min(R_b, B_(b-1))`` seconds, ``R_b`` the reductions' seconds
  (:func:`~autoplan.cost_models.step_costs.gradient_reduction_cost`) and ``B_(b-1)`` the
  seconds of ``b-1``'s ops' compute beyond their first forward (no collectives);
- **not overlapped,** costed in full: the reductions of a stack's first block (the backward
  after it is the embeddings', outside the blocks) and of parameters outside repeated blocks,
  a ZeRO-1 gradient's (reduced before the optimizer step, after the backward), every
  reduction where microbatches accumulate or a pipeline runs (the gradients of the last
  microbatch only could overlap, and the model leaves them whole), the backward's gathers
  again (``reshard_after_forward``; the compute waits for them) and every tensor-parallel
  collective;
- only on a device whose host runs ahead of it with collectives on their own stream (a GPU:
  :attr:`~autoplan.cost_models.DeviceSpec.overlapped_dispatch`). On a CPU nothing overlaps:
  the program awaits a gloo reduce-scatter where it launches it.

Not modelled: reductions sharing a link with the backward's gathers and with each other's
buckets beyond their sum (costed as if the link were theirs alone).

Beside the forward's prefetched gathers (:mod:`~autoplan.cost_models.gather_overlap`), whose
rows cover the forward of the same blocks, the intra-op ILP holds these as overlap rows too
(:class:`~autoplan.solvers.OverlapRow`, :func:`autoplan.planner.mesh_plan.overlap_rows`); the
prediction's ``hidden_s`` adds both.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from autoplan.cost_models.gather_overlap import block_prefetches, read_spec
from autoplan.cost_models.step_costs import (CostContext, NodeCost, gradient_reduction_cost, resharded_itemsize,
    step_reduction_spec, value_itemsize)
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import TracedGraph


def overlaps_reductions(ctx: CostContext) -> bool:
    """Whether gradient reductions run beside the backward: on a GPU, one microbatch per step."""
    return ctx.device.overlapped_dispatch and ctx.microbatches == 1


def reduction_seconds(graph: TracedGraph, parameter: str, stored: Strategy, reader: Strategy, position: int,
                      ctx: CostContext) -> float:
    """Seconds per step of the gradient reduction on the edge from ``parameter`` (stored as
    ``stored`` says) to the op reading it as its input ``position`` under ``reader``."""
    read = read_spec(reader, position)
    if read is None:
        return 0.0
    info = graph.nodes[parameter]
    mixed = ctx.optimizer.mixed_precision
    args = (stored.output_spec, read, info.shape or (), value_itemsize(info, mixed), reader.partial_axes(position),
            reader.whole_grad_axes, stored.grad_spec, resharded_itemsize(info, mixed),
            step_reduction_spec(stored.output_spec, stored.grad_spec, stored.state_spec))
    key = ("gradient reduction", args, ctx.microbatches, ctx.parameter_edges)
    seconds = ctx.cache.get(key)
    if seconds is None:
        src, dst, shape, itemsize, partial, whole, grad_src, moved, step_src = args
        seconds = gradient_reduction_cost(src, dst, shape, itemsize, ctx, partial, whole, grad_src, moved, step_src)
        ctx.cache[key] = seconds
    return seconds


def backward_window(cost: NodeCost) -> float:
    """Seconds per step of an op's compute beyond its first forward: its backward, and its
    forward again where it is recomputed."""
    return cost.compute_s - cost.forward_s


def hidden_reductions(graph: TracedGraph, inputs: Mapping[str, list[str]], chosen: Mapping[str, Strategy],
                      costs: Mapping[str, NodeCost], needs_grad: Mapping[str, bool], ctx: CostContext) -> float:
    """The seconds per step a plan's gradient reductions hide, ``sum_b min(R_b, B_(b-1))``, as
    the ILP's overlap rows cost them (``chosen`` strategies, ``costs`` of each node). Nothing
    where the device overlaps nothing or microbatches accumulate."""
    if not overlaps_reductions(ctx):
        return 0.0
    hidden = []
    for block in block_prefetches(graph, inputs):
        reductions = math.fsum(reduction_seconds(graph, param, chosen[param], chosen[op], pos, ctx)
                               for param, op, pos in block.reads if needs_grad.get(param))
        window = math.fsum(backward_window(costs[op]) for op in block.beside if op in costs)
        hidden.append(min(reductions, window))
    return math.fsum(hidden)
