"""Cutting a global batch into microbatches (along dim 0 of every user input)."""

from __future__ import annotations

import torch

from autoplan.errors import AutoplanError


def batch_size(example_inputs: tuple[torch.Tensor, ...]) -> int:
    """The global batch: dim 0 of the user inputs (they must agree)."""
    sizes = {int(x.shape[0]) for x in example_inputs if x.dim() > 0}
    if len(sizes) != 1:
        raise AutoplanError(f"the inputs disagree on the batch size (dim 0: {sorted(sizes)}): pipelining needs "
                            f"one batch dim")
    return sizes.pop()


def microbatch_inputs(example_inputs: tuple[torch.Tensor, ...], microbatches: int) -> tuple[torch.Tensor, ...]:
    """The first of ``microbatches`` equal pieces of the global batch."""
    batch = batch_size(example_inputs)
    if microbatches < 1 or batch % microbatches:
        raise AutoplanError(f"{microbatches} microbatches do not divide the batch of {batch}: choose a divisor")
    size = batch // microbatches
    return tuple(x[:size] if x.dim() > 0 else x for x in example_inputs)
