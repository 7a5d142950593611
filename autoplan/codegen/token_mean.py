"""A cross-entropy averaged over the tokens of the global batch, in programs where each rank
runs the model on its own slice (native DDP and FSDP).

``F.cross_entropy(..., reduction="mean")`` divides by the number of targets it does not ignore
(``ignore_index``), and that count differs between the ranks' slices. DDP and FSDP average the
ranks' gradients, which is the gradient of the global mean only when every rank divides by the
same count. :class:`GlobalTokenMean` makes each rank's cross-entropy

    L_r = S_r · N / C,  S_r = the rank's summed loss, C = Σ_r c_r (all-reduced), N = ranks,

so that the ranks' mean loss is (1/N) Σ_r L_r = Σ_r S_r / C, the single device's mean, and the
averaged gradient is the gradient of that mean. The count is all-reduced once per forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from autoplan.errors import AutoplanError

_SIGNATURE = inspect.signature(F.cross_entropy)


class GlobalTokenMean(TorchFunctionMode):
    """While active, every ``F.cross_entropy`` with a token mean (``reduction="mean"``, class
    index targets, no class weights) divides by the global batch's token count; ``calls``
    counts them."""

    def __init__(self, groups: Sequence[dist.ProcessGroup], ranks: int) -> None:
        super().__init__()
        self.groups = list(groups)  # the count is all-reduced over each in turn (each mesh axis)
        self.ranks = ranks
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.cross_entropy:
            return func(*args, **kwargs)
        bound = _SIGNATURE.bind(*args, **kwargs)
        bound.apply_defaults()
        given = bound.arguments
        if not _is_token_mean(given):
            return func(*args, **kwargs)
        self.calls += 1
        return share_of_global_mean(func(**{**given, "reduction": "sum"}), given["target"], given["ignore_index"],
                                    self.groups, self.ranks)


def share_of_global_mean(summed: torch.Tensor, target: torch.Tensor, ignore_index: int,
                         groups: Sequence[dist.ProcessGroup], ranks: int) -> torch.Tensor:
    """``L_r = S_r · N / C`` (module docstring): a rank's summed cross-entropy ``summed`` times
    the ``ranks`` over the count of targets not ignored, all-reduced over each of ``groups`` in
    turn."""
    count = (target != ignore_index).sum()
    for group in groups:
        dist.all_reduce(count, group=group)
    return summed * (ranks / count)


def _is_token_mean(given: dict[str, Any]) -> bool:
    target = given["target"]
    return (given["reduction"] == "mean" and given["weight"] is None and given["size_average"] is None
            and given["reduce"] is None and isinstance(target, torch.Tensor) and not target.is_floating_point())


def check_one_loss(mode: GlobalTokenMean) -> None:
    """The forward went through ``F.cross_entropy`` once, as the traced graph did."""
    if mode.calls != 1:
        raise AutoplanError(f"the loss's cross-entropy ran {mode.calls} times through F.cross_entropy, where the "
                            f"trace saw it once: compute it with torch.nn.functional.cross_entropy (or "
                            f"nn.CrossEntropyLoss) so that it can be averaged over the global batch")
