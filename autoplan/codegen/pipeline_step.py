"""What every step over microbatches does with its batch and its gradients: the pipelines (the
interpreter's, :mod:`autoplan.codegen.pipeline_program`, and the one cut from the model's
modules, :mod:`autoplan.codegen.native_pipeline`) and accumulation on a native program
(:mod:`autoplan.codegen.native_accumulation`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from autoplan.errors import AutoplanError


def step_inputs(inputs: Sequence[Any], input_names: Sequence[str], microbatches: int,
                device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """The GLOBAL batch of one step on ``device``: one tensor per input of the program, each with
    a batch dim that ``microbatches`` divide; a one-line error otherwise."""
    if len(inputs) != len(input_names):
        raise AutoplanError(f"the program takes {len(input_names)} inputs ({', '.join(input_names)}), "
                            f"got {len(inputs)}")
    moved = tuple(x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs)
    for x in moved:
        if not isinstance(x, torch.Tensor) or x.dim() == 0 or x.shape[0] % microbatches:
            raise AutoplanError(f"every input needs a batch dim divisible by {microbatches} microbatches")
    return moved


@contextmanager
def gradients_added(params: Sequence[torch.Tensor]) -> Iterator[None]:
    """Run a schedule's step with ``params``' gradients cleared, then add back those they had:
    torch's pipeline stages start each step's gradients afresh, and successive steps before an
    optimizer step accumulate, as one device's backward calls do."""
    stashed = [p.grad for p in params]
    for p in params:
        p.grad = None
    yield
    for p, old in zip(params, stashed):
        if old is not None:
            p.grad = old if p.grad is None else old + p.grad
