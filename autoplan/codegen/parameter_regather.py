"""Parameters gathered for their use in the forward are gathered again in the backward, not kept.

A plan may store a parameter sharded over a mesh axis and have its consumer read it replicated
there: ZeRO-3 / FSDP on a data-parallel axis (or a weight stored sharded for a replicated op).
The program gathers it before the consumer runs. Kept as autograd would keep it (the consumer's
saved input), every gathered parameter would stay alive from its forward to its backward, and
the sharded storage would save nothing at the peak. :class:`GatheredParameters` does what
FSDP2's ``reshard_after_forward`` does: while the forward runs under :meth:`hooks`
(``torch.autograd.graph.saved_tensors_hooks``), a saved tensor whose storage is a gathered
parameter's is packed as the recipe to gather it again (the stored parameter and the
placements); the backward unpacks it by running the same gather. The plan lists that gather as
a backward collective of the edge (``(re-gathered)``), the cost model counts it, and
``--check`` counts it among the executed collectives.

Under a bf16 plan (``torch.autocast``, :mod:`autoplan.codegen.precision`) the consumer saves
autocast's bf16 cast of the gathered parameter, not the parameter: a saved tensor made by a cast
(``ToCopyBackward0``) of a gathered parameter is packed as the same recipe plus the cast.

Inside a recomputed layer, activation checkpointing's own hooks (innermost) take the saved
tensors instead: the recomputed forward gathers again, as the plan lists it.

Where the plan prefetches re-gathers (``Plan.prefetch_regathers``: planned for a GPU, whose
backward runs them beside the block after: :mod:`autoplan.cost_models.backward_overlap`), the
recipes of one forward are kept by repeated block, and when the gradient of a block's last op
arrives (its backward starts: :func:`backward_starts`, :meth:`GatheredParameters.watch`), the
block before it is gathered again at once: on CUDA on a stream of its own, which waits for the
compute stream, the consumer's stream waiting for its event and recording the tensors it reads
(as FSDP2 prefetches the next block's all-gather in the backward); on a CPU in place, the same
collectives earlier. The backward's unpacking takes them instead of gathering.

A parameter held gathered through the step (:mod:`autoplan.codegen.held_parameters`) is read
from its held copy: a saved read of it (or a cast of one) is packed as the recipe to take it
from that copy again, without communication (:meth:`GatheredParameters.remember_held`).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Placement
from torch.multiprocessing.reductions import StorageWeakRef

from autoplan.codegen.redistribution import redistribute
from autoplan.codegen.side_stream import SideStream, arrived
from autoplan.trace.naming import module_of_op
from autoplan.trace.repeated import block_of

Block = tuple[str, int]  # a repeated block: its stack's module path and its index


# autograd nodes of views: the tensor they made shares its input's storage
_VIEW_BACKWARDS = frozenset({"TBackward0", "TransposeBackward0", "PermuteBackward0", "ViewBackward0",
                             "UnsafeViewBackward0", "ExpandBackward0", "AliasBackward0", "UnsqueezeBackward0",
                             "SqueezeBackward0", "SqueezeBackward1"})


@dataclass(frozen=True)
class _Regather:
    """A saved view of a gathered parameter, as the recipe that rebuilds it: a DTensor view
    (``placements``, global ``shape`` and ``stride``), or a view of its local tensor (an op run
    on local tensors, :mod:`autoplan.codegen.op_calls`; ``placements`` None)."""

    source: _Source
    placements: tuple[Placement, ...] | None
    shape: torch.Size
    stride: tuple[int, ...]
    local_size: torch.Size
    local_stride: tuple[int, ...]
    local_offset: int
    dtype: torch.dtype | None  # a cast of the gathered parameter (autocast's): its dtype
    forward: _ForwardRegathers | None = field(default=None, compare=False)  # where it may be prefetched


@dataclass(frozen=True)
class _Source:
    """Where a gathered parameter comes from again: the stored ``param`` redistributed to
    ``specs``, or, with ``held_read`` (the dtype a consumer reads it in), ``param`` is a held
    parameter's copy, cast to that dtype."""

    param: DTensor
    specs: list[str]
    held_read: torch.dtype | None = None
    block: Block | None = None  # the repeated block whose parameter it is

    def rebuild(self, param_dtype: torch.dtype | None) -> torch.Tensor:
        """The gathered parameter's local tensor."""
        if self.held_read is not None:
            return _local(self.param).to(self.held_read)
        mesh = self.param.device_mesh
        return _local(redistribute(self.param, self.specs, mesh, param_dtype=param_dtype))


@dataclass
class _ForwardRegathers:
    """One forward's re-gathers by block, and those issued early: by ``id`` of the recipe, the
    gathered local tensor and the event the consumer's stream waits for (None on a CPU)."""

    by_block: dict[Block, list[weakref.ref[_Regather]]] = field(default_factory=dict)
    early: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = field(default_factory=dict)
    issued: set[Block] = field(default_factory=set)


def backward_starts(nodes: Iterable[torch.fx.Node]) -> dict[str, Block]:
    """The last op of every repeated block among ``nodes`` whose block before it is among them
    too: the gradient of its output arriving, that block's backward starts, and the block
    before it is re-gathered beside it (:meth:`GatheredParameters.watch`)."""
    last: dict[Block, str] = {}
    for n in nodes:
        block = op_block(n)
        if block is not None:
            last[block] = n.name
    return {name: block for block, name in last.items() if (block[0], block[1] - 1) in last}


def op_block(node: torch.fx.Node) -> Block | None:
    """The repeated block an op of the graph comes from (None: not an op, or outside blocks)."""
    return block_of(module_of_op(node, "")[0]) if node.op == "call_function" else None


def parameter_block(fqn: str) -> Block | None:
    """The repeated block a parameter (by its FQN) belongs to."""
    return block_of(fqn.rsplit(".", 1)[0]) if "." in fqn else None


def _local(t: DTensor) -> torch.Tensor:
    with torch.no_grad():
        return t.to_local()


class GatheredParameters:
    """The gathered parameters of one forward, by storage, and the hooks that re-gather them."""

    def __init__(self, param_dtype: torch.dtype | None = None, prefetch: bool = False,
                 device_type: str = "cpu") -> None:
        self.param_dtype = param_dtype  # what a parameter's gather moves (the plan's bf16), as in the forward
        self._gathered: dict[StorageWeakRef, _Source] = {}
        self._by_grad_fn: dict[Any, _Source] = {}  # autograd node of a gathered one
        self.active = False  # inside :meth:`hooks` (a forward)
        # the plan's ``prefetch_regathers``: a block's re-gathers issued beside the backward of
        # the block after it, on a stream of their own on a GPU
        self.prefetch = prefetch
        self._stream = SideStream(device_type, prefetch)
        self._forward: _ForwardRegathers | None = None
        self.prefetched = 0  # re-gathers taken where issued early

    def remember(self, gathered: Any, param: Any, specs: Sequence[str], block: Block | None = None) -> None:
        """``gathered`` is ``param`` (of repeated block ``block``, if any) redistributed to
        ``specs`` for a consumer."""
        if isinstance(gathered, DTensor) and isinstance(param, DTensor) and gathered is not param:
            key = StorageWeakRef(_local(gathered).untyped_storage())
            if key != StorageWeakRef(_local(param).untyped_storage()):  # not a view of the stored one
                self._remember(gathered, _Source(param, list(specs), block=block))

    def watch(self, output: Any, block: Block) -> None:
        """``output`` is the last op's of ``block`` (:func:`backward_starts`): when its
        gradient arrives, the block before it is re-gathered, beside ``block``'s backward."""
        if self._forward is not None and isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(functools.partial(self._issue_before, self._forward, block))

    def _issue_before(self, forward: _ForwardRegathers, block: Block, grad: torch.Tensor) -> None:
        before = (block[0], block[1] - 1)
        if before in forward.issued:
            return
        forward.issued.add(before)
        recipes = [r for r in (ref() for ref in forward.by_block.pop(before, [])) if r is not None]
        locals_, event = self._stream.run([functools.partial(self._rebuilt, recipe) for recipe in recipes])
        for recipe, local in zip(recipes, locals_):
            forward.early[id(recipe)] = (local, event)

    def remember_held(self, read: DTensor, held: DTensor) -> None:
        """``read`` is a held parameter's ``held`` copy as a consumer reads it (cast). Only
        inside a forward: a recomputation in the backward keeps what it reads."""
        if self.active:
            self._remember(read, _Source(held, [], read.dtype))  # no reference to the read itself

    def _remember(self, gathered: DTensor, source: _Source) -> None:
        self._gathered[StorageWeakRef(_local(gathered).untyped_storage())] = source
        if gathered.grad_fn is not None:
            self._by_grad_fn[gathered.grad_fn] = source

    def _cast_of_gathered(self, t: torch.Tensor) -> _Source | None:
        """The gathered parameter ``t`` is a dtype cast of (or a view of such a cast: autocast's
        ``linear`` saves the transposed cast), if it is one, the cast made of the gathered
        DTensor or of its local tensor. The cast keeps the gathered parameter's layout, so
        ``t``'s place in the cast's storage is its place in the gathered one's."""
        node = t.grad_fn
        while node is not None and type(node).__name__ in _VIEW_BACKWARDS and node.next_functions:
            node = node.next_functions[0][0]
        if node is None or type(node).__name__ != "ToCopyBackward0" or not node.next_functions:
            return None
        source = node.next_functions[0][0]
        # an op run on local tensors (:mod:`autoplan.codegen.op_calls`) casts the gathered
        # DTensor's local tensor: the same storage and layout
        while source is not None and type(source).__name__ == "_ToTorchTensorBackward" and source.next_functions:
            source = source.next_functions[0][0]
        return self._by_grad_fn.get(source)

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._gathered:
            return t
        local = _local(t) if isinstance(t, DTensor) else t
        try:
            entry = self._gathered.get(StorageWeakRef(local.untyped_storage()))
        except (RuntimeError, NotImplementedError):  # a tensor without storage: not a gathered one
            return t
        dtype = None
        if entry is None:
            entry = self._cast_of_gathered(t)
            if entry is None:
                return t
            dtype = t.dtype
        placements = tuple(t.placements) if isinstance(t, DTensor) else None
        forward = self._forward if entry.block is not None else None
        recipe = _Regather(entry, placements, t.shape, tuple(t.stride()),
                           local.size(), tuple(local.stride()), local.storage_offset(), dtype, forward)
        if forward is not None:
            forward.by_block.setdefault(entry.block, []).append(weakref.ref(recipe))
        return recipe

    def _rebuilt(self, packed: _Regather) -> torch.Tensor:
        """The local tensor ``packed`` saved, gathered again."""
        with torch.no_grad():
            full = packed.source.rebuild(self.param_dtype)
            if packed.dtype is not None:
                full = full.to(packed.dtype)
        return full.as_strided(packed.local_size, packed.local_stride, packed.local_offset)

    def _unpack(self, packed: Any) -> Any:
        if not isinstance(packed, _Regather):
            return packed
        early = packed.forward.early.pop(id(packed), None) if packed.forward is not None else None
        if early is None:
            local = self._rebuilt(packed)
        else:
            local = arrived(*early)
            self.prefetched += 1
        if packed.placements is None:
            return local
        return DTensor.from_local(local, packed.source.param.device_mesh, packed.placements, run_check=False,
                                  shape=packed.shape, stride=packed.stride)

    @contextlib.contextmanager
    def hooks(self) -> Iterator[None]:
        """Run a forward under this: gathered parameters its ops save are re-gathered in the
        backward instead of kept."""
        self.active = True
        self._forward = _ForwardRegathers() if self.prefetch else None
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        finally:
            self.active = False
            self._forward = None
            self._gathered.clear()
            self._by_grad_fn.clear()
