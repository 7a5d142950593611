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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from autoplan.plan_schema import PrefetchedGather


class PrefetchedGathers:
    """The gathers of ``prefetch`` issued at their op and taken by their consumers, within one
    forward (:meth:`clear` drops what a forward left)."""

    def __init__(self, prefetch: Sequence[PrefetchedGather], device_type: str) -> None:
        self._at = {p.at: [(consumer, int(pos)) for consumer, pos in p.reads] for p in prefetch}
        self._stream = torch.cuda.Stream() if device_type == "cuda" and self._at else None
        self._ready: dict[tuple[str, int], tuple[Any, torch.cuda.Event | None]] = {}

    def issue(self, op: str, gather: Callable[[str, int], Any]) -> None:
        """Before op ``op`` runs: ``gather(consumer, position)`` for every read issued there."""
        reads = self._at.get(op)
        if not reads:
            return
        if self._stream is None:
            for read in reads:
                self._ready[read] = (gather(*read), None)
            return
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            values = [gather(*read) for read in reads]
        event = self._stream.record_event()
        for read, value in zip(reads, values):
            self._ready[read] = (value, event)

    def take(self, consumer: str, position: int) -> Any | None:
        """The gathered input ``position`` of ``consumer``, where it was issued (None: it was
        not, or it was taken already: a recomputed forward gathers again)."""
        entry = self._ready.pop((consumer, position), None)
        if entry is None:
            return None
        value, event = entry
        if event is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(event)
            local = value._local_tensor if isinstance(value, DTensor) else value
            if isinstance(local, torch.Tensor):
                local.record_stream(stream)
        return value

    def clear(self) -> None:
        self._ready.clear()
