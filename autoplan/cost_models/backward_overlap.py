"""Collectives run beside the backward of a block: what overlaps with what.

The backward runs a stack's blocks in reverse. While block ``c``'s backward computes (its
recomputed forward where it is checkpointed, and its backward proper), two kinds of collective
run beside it on a GPU, as FSDP2 runs them:

- **the gradient reductions of block c+1** (the block whose backward just ended): every edge
  from a parameter of ``c+1`` to an op of ``c+1``, its backward's collectives — the bucketed
  all-reduces of data parallelism (:mod:`autoplan.codegen.gradient_buckets`, as DDP does), the
  reduce-scatters of parameters gathered at use (ZeRO-3 / FSDP) and of ZeRO-2 gradients
  (:func:`autoplan.codegen.redistribution.launches_reduction`: launched, awaited where the
  gradient is next read). Only with one microbatch per step: where microbatches accumulate, a
  ZeRO-1 or data-parallel gradient is reduced once, after the last, and the model leaves every
  reduction there whole;
- **the re-gathers of block c-1** (the block whose backward comes next): every parameter of
  ``c-1`` gathered at use whose consumer keeps it for its backward (``reshard_after_forward``)
  or is recomputed (its recomputation gathers again), gathered again for that backward. The
  program issues them when the gradient of block ``c``'s output arrives, every microbatch
  (:mod:`autoplan.codegen.parameter_regather` for a kept read,
  :mod:`autoplan.codegen.prefetched_gathers` for a recomputed one), as FSDP2 prefetches the
  next block's all-gather in the backward.

Hidden per block: ``min(R_(c+1) + G_(c-1), B_c)`` seconds, ``R`` the reductions' seconds
(:func:`~autoplan.cost_models.step_costs.gradient_reduction_cost`), ``G`` the re-gathers'
(:func:`~autoplan.cost_models.gather_overlap.forward_gather_seconds`, a re-gather moving what
the forward's gather moved) and ``B_c`` the seconds of ``c``'s ops' compute beyond their first
forward (no collectives).

**Not overlapped,** costed in full: the reductions of a stack's first block (the backward after
it is the embeddings', outside the blocks) and of parameters outside repeated blocks; the
re-gathers of a stack's last block (nothing of the stack runs before it in the backward) and of
a pipeline stage's last block; a ZeRO-1 gradient's reduction (before the
optimizer step, after the backward); every tensor-parallel collective. Only on a device whose
host runs ahead of it with collectives on their own stream (a GPU:
:attr:`~autoplan.cost_models.DeviceSpec.overlapped_dispatch`); on a CPU nothing overlaps (the
program awaits a gloo reduction where it launches it, and re-gathers early in place).

Not modelled: these collectives sharing a link with each other beyond their sum, or with a
tensor-parallel collective of ``c``'s backward (costed as if the link were theirs alone); that
where ``c`` is recomputed, the gradient of its last op, which issues the re-gathers, arrives
only after its recomputation, so that they run beside its backward proper (``B_c`` counts the
recomputation too).

Beside the forward's prefetched gathers (:mod:`~autoplan.cost_models.gather_overlap`), whose
rows cover the forward of the same blocks, the intra-op ILP holds these as overlap rows too
(:class:`~autoplan.solvers.OverlapRow`, :func:`autoplan.planner.mesh_plan.overlap_rows`); the
prediction's ``hidden_s`` adds both.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from autoplan.cost_models.gather_overlap import block_ops, forward_gather_seconds, own_reads, read_spec
from autoplan.cost_models.step_costs import (CostContext, NodeCost, gradient_reduction_cost, resharded_itemsize,
    step_reduction_spec, value_itemsize)
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import TracedGraph

#: (parameter, consumer op, the consumer's tensor input position)
Read = tuple[str, str, int]


@dataclass(frozen=True)
class BackwardWindow:
    """Block ``block``'s backward (its ops ``ops``) and the collectives beside it: the gradient
    reductions of the parameter reads ``reductions`` (those of the block after it) and the
    re-gathers of ``regathers`` (those of the block before it)."""

    block: tuple[str, int]
    ops: tuple[str, ...]
    reductions: tuple[Read, ...]
    regathers: tuple[Read, ...]


def backward_windows(graph: TracedGraph, inputs: Mapping[str, list[str]]) -> list[BackwardWindow]:
    """Every block of a repeated stack with a block after it or before it in ``graph``, the
    reads of their own parameters by their ops (``inputs``: op -> its tensor inputs) beside it."""
    ops = block_ops(graph)

    def reads(block: tuple[str, int]) -> tuple[Read, ...]:
        return own_reads(graph, inputs, block, ops.get(block, []))

    out = []
    for (stack, index), names in ops.items():
        after, before = reads((stack, index + 1)), reads((stack, index - 1))
        if after or before:
            out.append(BackwardWindow((stack, index), tuple(names), after, before))
    return out


def overlaps_reductions(ctx: CostContext) -> bool:
    """Whether gradient reductions run beside the backward: on a GPU, one microbatch per step."""
    return ctx.device.overlapped_dispatch and ctx.microbatches == 1


def overlaps_regathers(ctx: CostContext) -> bool:
    """Whether the backward's re-gathers run beside the backward of the block after: on a GPU."""
    return ctx.device.overlapped_dispatch


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


def hidden_in_backward(graph: TracedGraph, windows: list[BackwardWindow], chosen: Mapping[str, Strategy],
                       costs: Mapping[str, NodeCost], needs_grad: Mapping[str, bool],
                       regathered: Callable[[str, str], bool], ctx: CostContext) -> float:
    """The seconds per step a plan's collectives hide beside the backward,
    ``sum_c min(R_(c+1) + G_(c-1), B_c)``, as the ILP's overlap rows cost them (``chosen``
    strategies, ``costs`` of each node; ``regathered(consumer, parameter)``: whether the
    backward runs the consumer's read again, recomputed or kept, so that a gathered parameter
    is gathered again there)."""
    reduces, regathers = overlaps_reductions(ctx), overlaps_regathers(ctx)
    hidden = []
    for window in windows:
        comm = []
        if reduces:
            comm += [reduction_seconds(graph, param, chosen[param], chosen[op], pos, ctx)
                     for param, op, pos in window.reductions if needs_grad.get(param)]
        if regathers:
            comm += [forward_gather_seconds(graph, param, chosen[param].output_spec, read_spec(chosen[op], pos), ctx)
                     for param, op, pos in window.regathers if regathered(op, param)]
        compute = math.fsum(backward_window(costs[op]) for op in window.ops if op in costs)
        hidden.append(min(math.fsum(comm), compute))
    return math.fsum(hidden)
