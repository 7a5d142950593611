"""A zoo of tiny public model architectures, for surveying what autoplan plans and runs
(``benchmarks/zoo_survey.py``): Hugging Face transformers models (:mod:`zoo_hf`) and plain
PyTorch models, including stand-ins for torchvision architectures (:mod:`zoo_torch`).

Every builder returns a :class:`ZooCase`: the model (random weights after
``torch.manual_seed(0)``, dropouts 0, float32 on the CPU), its example inputs (a dict of keyword
arguments for transformers models, called as ``model(**inputs)``; a tuple for plain models) and
``loss_fn(output, *inputs)``, or None when the output carries ``.loss``. Import this module
(``tests/`` on ``sys.path``), not :mod:`zoo_hf` or :mod:`zoo_torch` directly.

    from zoo import ALL_CASES
    case = ALL_CASES["llama"]()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

BATCH, SEQ, VOCAB = 8, 16, 128


@dataclass
class ZooCase:
    name: str
    family: str  # decoder, moe, encoder, encoder-decoder, vision, state-space, plain
    model: torch.nn.Module
    example_inputs: dict[str, Any] | tuple[torch.Tensor, ...]
    loss_fn: Callable[..., torch.Tensor] | None = None

    def loss(self) -> torch.Tensor:
        """One forward pass on the example inputs, and its scalar loss."""
        if isinstance(self.example_inputs, dict):
            output = self.model(**self.example_inputs)
            tensors = tuple(v for v in self.example_inputs.values() if isinstance(v, torch.Tensor))
        else:
            output = self.model(*self.example_inputs)
            tensors = self.example_inputs
        return output.loss if self.loss_fn is None else self.loss_fn(output, *tensors)


from zoo_hf import HF_CASES  # noqa: E402  (they import ZooCase from here)
from zoo_torch import TORCH_CASES  # noqa: E402

ALL_CASES: dict[str, Callable[[], ZooCase]] = {**HF_CASES, **TORCH_CASES}
# families the installed libraries lack, skipped (none with transformers 5.24.0); torchvision is
# not installable here, so zoo_torch has plain-PyTorch stand-ins for its architectures
SKIPPED: dict[str, str] = {}
