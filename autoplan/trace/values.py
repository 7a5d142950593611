"""Walking the values a traced graph carries: the tensors inside a model's output or inside an
fx node's fake value, and their shapes, dtypes and sizes."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx


def tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a model output, in order: tensors, tuples/lists, dicts (transformers'
    ModelOutput is an OrderedDict of its non-None fields), dataclasses; other leaves skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from tensor_leaves(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from tensor_leaves(getattr(value, f.name))


def first_tensor(value: Any) -> torch.Tensor | None:
    """The first tensor of a node's value (a tensor, or nested tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = first_tensor(item)
            if found is not None:
                return found
    return None


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor of a node's value (a tensor, or nested tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def dtype_name(dtype: torch.dtype) -> str:
    """``"float32"`` for ``torch.float32``."""
    return str(dtype).removeprefix("torch.")


def fake_value(node: Any) -> Any:
    """A node's fake value (``meta["val"]``); anything else as it is."""
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def fake_arguments(value: Any) -> Any:
    """args/kwargs with every fx Node replaced by its fake value."""
    return torch.fx.node.map_arg(value, lambda n: n.meta.get("val"))


def int_shape(x: Any) -> tuple[int, ...]:
    """A tensor's shape as plain ints."""
    return tuple(int(s) for s in x.shape)
