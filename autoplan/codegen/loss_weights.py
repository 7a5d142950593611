"""What each microbatch's loss weighs in a step's loss, so that microbatches run one after
another compute the loss of the whole batch: ``1/M`` each for a mean loss (``scale``), or,
for a mean over a count that depends on the data (a cross-entropy's targets that are not its
``ignore_index``), each microbatch's share of the batch's count, counted on the inputs
before the step runs (:func:`~autoplan.trace.batch_coupling.count_program`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def microbatch_weights(inputs: Sequence[torch.Tensor], microbatches: int, scale: float,
                       count: Callable[..., torch.Tensor] | None, device: torch.device | str) -> torch.Tensor:
    """``[M, 1]``: what each of the ``microbatches`` losses of the batch ``inputs`` (cut on
    dim 0) is multiplied by: ``scale``, or with ``count`` each microbatch's share of the
    counted targets (equal shares where none is counted)."""
    if count is None:
        return torch.full((microbatches, 1), scale, device=device)
    with torch.no_grad():
        pieces = zip(*(x.chunk(microbatches) for x in inputs))
        counts = torch.stack([count(*piece).to(torch.float64) for piece in pieces])
    total = counts.sum()
    weights = counts / total if total > 0 else torch.full_like(counts, 1.0 / microbatches)
    return weights.reshape(microbatches, 1).to(torch.float32).to(device)
