"""The user's training data: ``batches`` in model.py, fed to the planned program one global
batch per step.

``batches`` is an iterable of global batches (a ``torch.utils.data.DataLoader`` is the usual
case), or a zero-argument function returning one. Each batch is given as ``example_inputs``
is: a tensor, a tuple/list of tensors, or a dict of keyword inputs; its tensors must have the
example inputs' shapes and dtypes, because the plan was made for them (a DataLoader whose last
batch is short needs ``drop_last=True``).

Every rank reads the same global batch and the program keeps its own slice of it (see
:mod:`autoplan.codegen.runtime`). An iterable that can be iterated again (a DataLoader, a list)
is read epoch after epoch, and each epoch's iterator is created under the random seed
``seed + epoch``, so a shuffled DataLoader gives the same order in an uninterrupted run and in
one resumed from a checkpoint; a one-shot iterator (a generator) ends the run when it ends.
A :class:`BatchFeed` knows how many batches it has handed out (:attr:`position`), which is what
a checkpoint records and :meth:`BatchFeed.skip_to` restores.
"""

from __future__ import annotations

import types
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec

__all__ = ["BatchFeed", "find_batches"]


def find_batches(user_file: types.ModuleType, path: str, name: str = "batches") -> Iterable[Any] | None:
    """The iterable of global batches ``path`` defines as ``name`` (calling it if it is a
    function), or None where it defines none. One-line errors for anything else."""
    value = getattr(user_file, name, None)
    if value is None:
        return None
    if callable(value) and not isinstance(value, Iterable):
        try:
            value = value()
        except AutoplanError:
            raise
        except Exception as e:  # the user's function failed
            raise AutoplanError(f"{path}: {name}() raised {type(e).__name__}: {str(e).strip()[:200]}") from e
    if isinstance(value, (torch.Tensor, Mapping)) or not isinstance(value, Iterable):
        raise AutoplanError(f"{path}: {name} must be an iterable of global batches (a DataLoader, a list) or a "
                            f"function returning one, got {type(value).__name__}")
    return value


class BatchFeed:
    """Global batches for the planned program, as positional tuples on ``device``: from
    ``batches`` (see the module docstring), or the example inputs every step where
    ``batches`` is None."""

    def __init__(self, spec: ModelSpec, batches: Iterable[Any] | None, device: torch.device | str = "cpu",
                 seed: int = 0) -> None:
        self.spec = spec
        self.batches = batches
        self.device = torch.device(device)
        self.seed = seed
        self.position = 0  # batches handed out since the start of the run
        self.epoch = 0
        self._iterator: Iterator[Any] | None = None
        self._first: Any = None  # the batch read while the epoch's iterator was created

    @property
    def from_user(self) -> bool:
        return self.batches is not None

    @property
    def source(self) -> str:
        """Where the batches come from, in a few words (train.py prints it)."""
        if self.batches is None:
            return "the example inputs every step (define `batches` in the model file to train on data)"
        return f"batches ({type(self.batches).__name__})"

    def _start_epoch(self) -> bool:
        """A new iterator over the batches, created (and its first batch read, which is when a
        shuffling sampler draws its order) under the seed of this epoch."""
        assert self.batches is not None
        if self._iterator is not None and isinstance(self.batches, Iterator):
            return False  # a one-shot iterator (a generator): no second epoch
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed + self.epoch)
            self._iterator = iter(self.batches)
            self._first = next(self._iterator, StopIteration)
        return self._first is not StopIteration

    def _next_raw(self) -> Any:
        if self._iterator is not None:
            if self._first is not None:
                first, self._first = self._first, None
                return first
            batch = next(self._iterator, StopIteration)
            if batch is not StopIteration:
                return batch
            self.epoch += 1
        if not self._start_epoch():
            raise AutoplanError(f"the batches ran out after {self.position} batch(es): give more data or fewer "
                                f"--steps")
        first, self._first = self._first, None
        return first

    def skip_to(self, position: int) -> None:
        """Hand out the batches before ``position`` without using them: where a run resumed
        from a checkpoint continues."""
        while self.position < position:
            self.next_batch(check=False)

    def next_batch(self, check: bool = True) -> tuple[Any, ...]:
        """The next global batch as the program's positional inputs, checked against the
        example inputs and moved to the device."""
        if self.batches is None:
            self.position += 1
            return tuple(self.spec.example_inputs)
        raw = self._next_raw()
        index = self.position
        self.position += 1
        if not check:
            return ()
        inputs = self._positional(raw, index)
        return tuple(x.to(self.device) if isinstance(x, torch.Tensor) else x for x in inputs)

    def _positional(self, raw: Any, index: int) -> tuple[Any, ...]:
        if isinstance(raw, Mapping):
            inputs = self.spec.positional((), raw)
        elif isinstance(raw, torch.Tensor):
            inputs = (raw,)
        elif isinstance(raw, (tuple, list)):
            inputs = tuple(raw)
        else:
            raise AutoplanError(f"batch {index} is a {type(raw).__name__}: give batches as example_inputs is given "
                                f"(a tensor, a tuple of tensors or a dict of keyword inputs)")
        expected = self.spec.example_inputs
        if len(inputs) != len(expected):
            raise AutoplanError(f"batch {index} has {len(inputs)} input(s), the plan is for {len(expected)}: give "
                                f"batches shaped like example_inputs")
        names = self.spec.input_names or tuple(f"input {i}" for i in range(len(expected)))
        for name, got, want in zip(names, inputs, expected):
            if not isinstance(got, torch.Tensor):
                raise AutoplanError(f"batch {index}: {name} is a {type(got).__name__}, not a tensor: give batches "
                                    f"shaped like example_inputs")
            if tuple(got.shape) != tuple(want.shape) or got.dtype != want.dtype:
                raise AutoplanError(
                    f"batch {index}: {name} is {_describe(got)}, the plan is for {_describe(want)}: give global "
                    f"batches of the example inputs' shape and dtype (a DataLoader needs drop_last=True), or plan "
                    f"again with example inputs of this shape")
        return inputs


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
