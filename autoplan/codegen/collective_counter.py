"""Count the collectives a program executes, by kind.

:class:`CollectiveCounter` is a ``TorchDispatchMode`` that counts the same operations as
torch's ``CommDebugMode`` (functional collectives and the c10d collectives, below DTensor),
without its module tracker: the tracker follows module hooks, which the stages of a
``torch.distributed.pipelining`` schedule do not nest the way it expects (it fails inside a
stage's forward). Point-to-point sends and receives are not collectives and are not counted.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: A collective op's name (lower case) contains one of these; the value is its kind.
COLLECTIVE_NAMES = {
    "all_reduce": "all_reduce", "allreduce": "all_reduce", "all_gather": "all_gather",
    "allgather": "all_gather", "reduce_scatter": "reduce_scatter", "all_to_all": "all_to_all",
    "alltoall": "all_to_all", "broadcast": "broadcast", "scatter": "scatter",
}
_NAMESPACES = ("_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d", "_dtensor")


def collective_kind(op: Any) -> str:
    """``all_reduce``, ``all_gather``, ... for a collective op (or its name)."""
    name = str(op).lower()
    return next((kind for key, kind in COLLECTIVE_NAMES.items() if key in name), name)


def _is_collective(func: Any) -> bool:
    name = func._overloadpacket.__name__.lower()
    return getattr(func, "namespace", "") in _NAMESPACES and any(key in name for key in COLLECTIVE_NAMES)


class CollectiveCounter(TorchDispatchMode):
    """``with CollectiveCounter() as counter: ...`` then ``counter.counts`` (kind → calls) and
    ``counter.dtypes`` (kind → the dtypes of the tensors its calls moved)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.dtypes: dict[str, set[str]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor desugar into the collectives it runs, then count those
        out = func(*args, **kwargs)
        if _is_collective(func):
            kind = collective_kind(func._overloadpacket.__name__)
            self.counts[kind] += 1
            self.dtypes.setdefault(kind, set()).update(str(t.dtype).replace("torch.", "")
                                                       for t in tree_leaves(args) if isinstance(t, torch.Tensor))
        return out
