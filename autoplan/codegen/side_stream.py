"""Work issued ahead of its consumer: on CUDA on a stream of its own, on a CPU in place.

The stream first waits for the compute stream (what the work reads is ready), runs the work,
and records an event; the consumer's stream waits for that event before it reads a result, and
the result's memory is recorded on the consumer's stream, so that it is not reused while read
(FSDP2's all-gather streams work the same way). On a CPU the work runs where it is issued."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor


class SideStream:
    """A stream of its own for work issued ahead, on CUDA (``device_type``) where ``needed``."""

    def __init__(self, device_type: str, needed: bool = True) -> None:
        self._stream = torch.cuda.Stream() if device_type == "cuda" and needed else None

    def run(self, work: Sequence[Callable[[], Any]]) -> tuple[list[Any], torch.cuda.Event | None]:
        """The results of ``work`` and the event a consumer waits for (None on a CPU)."""
        if self._stream is None:
            return [w() for w in work], None
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            results = [w() for w in work]
        return results, self._stream.record_event()


def arrived(value: Any, event: torch.cuda.Event | None) -> Any:
    """``value``, issued ahead under ``event``, ready for the current stream to read."""
    if event is not None:
        stream = torch.cuda.current_stream()
        stream.wait_event(event)
        local = value._local_tensor if isinstance(value, DTensor) else value
        if isinstance(local, torch.Tensor):
            local.record_stream(stream)
    return value
