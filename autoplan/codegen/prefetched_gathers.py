"""Parameter gathers issued a block ahead of their consumers, as the plan lists them.

The plan's :class:`~autoplan.plan_schema.PrefetchedGather` entries name, per repeated block,
the op before which its parameters' forward gathers are issued (the first op of the block
before it) and the reads they serve. :meth:`PrefetchedGathers.issue` runs those reshardings
there, through the same redistribution the consumer would run (its backward included); the
consumer then takes the arrived value (:meth:`PrefetchedGathers.take`) instead of gathering.
The cost model hides ``min(gathers, forward of the block before)`` of them
(:mod:`autoplan.cost_models.gather_overlap`).

On CUDA the gathers are issued on a stream of their own, which first waits for the compute
stream (the stored shards are ready), so that the block before computes while they run (FSDP2
gathers on its all-gather stream the same way); the consumer's stream waits for the gathers'
event before it reads them, and the gathered tensors are recorded on that stream, so their
memory is not reused while it reads them. On a CPU the gathers run where issued: the same
collectives, earlier, nothing beside them.

A recomputed block gathers its parameters again in its recomputation. Where the plan prefetches
re-gathers (``Plan.prefetch_regathers``), those gathers are issued when the gradient of the next
block's last op arrives (:meth:`PrefetchedGathers.watch`), beside that block's backward
(:mod:`autoplan.cost_models.backward_overlap`), with autograd recording them as the
recomputation's own gathers would; the recomputation takes them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from autoplan.codegen.parameter_regather import Block, op_block, parameter_block
from autoplan.codegen.side_stream import SideStream, arrived
from autoplan.plan_schema import PrefetchedGather


def recomputed_reads(inputs: Mapping[str, Sequence[torch.fx.Node]], nodes: Iterable[torch.fx.Node],
                     parameters: Mapping[str, str]) -> dict[Block, list[tuple[str, int]]]:
    """Per repeated block, (op, input position) of every read of one of its ``parameters``
    (placeholder name -> FQN) by one of its ``nodes`` (the recomputed ops; ``inputs``: a
    planned op's tensor inputs): what its recomputation gathers again."""
    out: dict[Block, list[tuple[str, int]]] = {}
    for n in nodes:
        block = op_block(n)
        if block is None or n.name not in inputs:
            continue
        for pos, a in enumerate(inputs[n.name]):
            fqn = parameters.get(a.name)
            if fqn is not None and parameter_block(fqn) == block:
                out.setdefault(block, []).append((n.name, pos))
    return out


class PrefetchedGathers:
    """The gathers of ``prefetch`` issued at their op and taken by their consumers, within one
    forward (:meth:`clear` drops what a forward left); and, with ``recomputed`` (per repeated
    block, the reads of its parameters by its recomputed ops), a block's recomputation's
    gathers issued when the backward of the block after it starts (:meth:`watch`), taken by
    the recomputation."""

    def __init__(self, prefetch: Sequence[PrefetchedGather], device_type: str,
                 recomputed: Mapping[Block, list[tuple[str, int]]] | None = None) -> None:
        self._at = {p.at: [(consumer, int(pos)) for consumer, pos in p.reads] for p in prefetch}
        self._recomputed = dict(recomputed or {})
        self._stream = SideStream(device_type, bool(self._at or self._recomputed))
        self._ready: dict[tuple[str, int], tuple[Any, torch.cuda.Event | None]] = {}
        self.recomputation_gathers = 0  # a recomputation's gathers issued early

    def watch(self, output: Any, block: Block, gather: Callable[[str, int], Any]) -> None:
        """``output`` is the last op's of ``block``: when its gradient arrives, the block
        before it has its recomputation's gathers issued (``gather(consumer, position)``, with
        autograd recording, as the recomputation's own would)."""
        before = (block[0], block[1] - 1)
        reads = self._recomputed.get(before)
        if reads and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda grad: self._issue_recorded(reads, gather))

    def _issue_recorded(self, reads: list[tuple[str, int]], gather: Callable[[str, int], Any]) -> None:
        with torch.enable_grad():
            self._issue(reads, gather)
        self.recomputation_gathers += len(reads)

    def issue(self, op: str, gather: Callable[[str, int], Any]) -> None:
        """Before op ``op`` runs: ``gather(consumer, position)`` for every read issued there."""
        reads = self._at.get(op)
        if reads:
            self._issue(reads, gather)

    def _issue(self, reads: list[tuple[str, int]], gather: Callable[[str, int], Any]) -> None:
        values, event = self._stream.run([functools.partial(gather, *read) for read in reads])
        for read, value in zip(reads, values):
            self._ready[read] = (value, event)

    def take(self, consumer: str, position: int) -> Any | None:
        """The gathered input ``position`` of ``consumer``, where it was issued (None: it was
        not, or it was taken already: a recomputed forward gathers again)."""
        entry = self._ready.pop((consumer, position), None)
        if entry is None:
            return None
        return arrived(*entry)

    def clear(self) -> None:
        self._ready.clear()
