"""Sharding vocabulary shared by every pass: placements and sharding specs.

A *placement* says what one mesh axis does with a tensor:

- ``R``    replicated: every device on the axis holds the whole tensor;
- ``S(d)`` sharded on tensor dim ``d`` (for a weight matrix ``S(0)`` is row-, ``S(1)`` column-sharded);
- ``P``    partial sums: every device holds an addend, the value is their sum.

A *sharding spec* is one placement per mesh axis, written like Alpa: ``S0R``, ``RS1``, ``PR``.
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple


class Placement(NamedTuple):
    """What one mesh axis does with a tensor. A named tuple, so that a spec's hash and
    comparisons run in C: the planner keys its memos by specs, millions of times per plan."""

    kind: str  # "R", "S" or "P"
    dim: int = -1  # tensor dim, for "S" only

    @classmethod
    def checked(cls, kind: str, dim: int = -1) -> Placement:
        """A placement, refusing a malformed one (an unknown kind; a dim on R or P, none on S)."""
        if kind not in ("R", "S", "P"):
            raise ValueError(f"placement kind must be R, S or P, not {kind!r}")
        if (kind == "S") != (dim >= 0):
            raise ValueError(f"placement {kind} with dim {dim} is malformed")
        return cls(kind, dim)

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"

    @property
    def is_replicate(self) -> bool:
        return self.kind == "R"

    @property
    def is_partial(self) -> bool:
        return self.kind == "P"

    def __str__(self) -> str:  # plan.json form
        return f"S({self.dim})" if self.kind == "S" else self.kind

    def short(self) -> str:  # Alpa-style form used inside spec names
        return f"S{self.dim}" if self.kind == "S" else self.kind


R = Placement("R")
P = Placement("P")


def S(dim: int) -> Placement:
    return Placement.checked("S", dim)


ShardingSpec = tuple[Placement, ...]

_PLACEMENT_RE = re.compile(r"^(R|P|S\((\d+)\)|S(\d+))$")


def parse_placement(text: str) -> Placement:
    """Parse ``"R"``, ``"P"``, ``"S(1)"`` or ``"S1"``."""
    m = _PLACEMENT_RE.match(text.strip())
    if not m:
        raise ValueError(f"cannot read placement {text!r}: expected R, P or S(d)")
    if m.group(1) in ("R", "P"):
        return Placement.checked(m.group(1))
    return S(int(m.group(2) or m.group(3)))


def spec_name(spec: ShardingSpec) -> str:
    """Alpa-style name of a spec: ``S0R``, ``RS1``; a 0-axis spec is ``-``."""
    return "".join(p.short() for p in spec) or "-"


def spec_to_json(spec: ShardingSpec) -> list[str]:
    return [str(p) for p in spec]


def spec_from_json(items: list[str]) -> ShardingSpec:
    return tuple(parse_placement(x) for x in items)


def replicated(ndim_mesh: int) -> ShardingSpec:
    return (R,) * ndim_mesh


def shard_factor(spec: ShardingSpec, mesh_shape: tuple[int, ...], dim: int) -> int:
    """How many pieces tensor dim ``dim`` is cut into by ``spec``."""
    return math.prod(n for p, n in zip(spec, mesh_shape) if p.is_shard and p.dim == dim)


def local_shape(shape: tuple[int, ...], spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per-device shape of a tensor of global ``shape`` under ``spec`` (dims assumed divisible)."""
    out = list(shape)
    for p, n in zip(spec, mesh_shape):
        if p.is_shard:
            out[p.dim] //= n
    return tuple(out)


def is_valid(spec: ShardingSpec, shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> bool:
    """True when every sharded dim exists and is divided evenly by the mesh axes sharding it."""
    for d in {p.dim for p in spec if p.is_shard}:
        if d >= len(shape) or shape[d] % shard_factor(spec, mesh_shape, d) != 0:
            return False
    return True


def reduce_scatter_first(src: ShardingSpec, dst: ShardingSpec) -> tuple[int, ...]:
    """The mesh axes whose partial sums a resharding ``src → dst`` reduce-scatters before it
    all-reduces any other axis: each axis going ``P → S(d)`` where ``d`` is sharded by no other
    axis (in ``src`` or ``dst``), when some other axis goes ``P → R``. The all-reduce then
    moves a shard, not the whole tensor: HSDP's gradient, partial over both axes of a
    ``dp × fsdp`` mesh, is reduce-scattered inside the ``fsdp`` group and its shard all-reduced
    across, as FSDP2 reduces it. Empty where the order does not matter."""
    if not any(s.is_partial and d.is_replicate for s, d in zip(src, dst)):
        return ()
    first = []
    for axis, (s, d) in enumerate(zip(src, dst)):
        if s.is_partial and d.is_shard and not any(
                p.is_shard and p.dim == d.dim for i, spec in enumerate((src, dst)) for j, p in enumerate(spec)
                if j != axis):
            first.append(axis)
    return tuple(first)


def num_elements_local(shape: tuple[int, ...], spec: ShardingSpec, mesh_shape: tuple[int, ...]) -> int:
    return math.prod(local_shape(shape, spec, mesh_shape))


def deferred_axes(uses: list[tuple[list[str] | None, tuple[int, ...]]], stored: list[str],
                  mesh_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The mesh axes a parameter's gradient is reduced over at the end of the backward, where
    every edge that reads it (``uses``: the spec it reads, as JSON, and the axes on which its
    backward leaves the gradient partial) reads it as ``stored`` and leaves the gradient partial
    on the same axes, all of them replicated in storage (data parallelism); else None (its
    edges reduce it). The program defers those reductions into buckets, or, for ZeRO-1, to the
    optimizer step, and the plan lists them so."""
    axes = {partial for _, partial in uses}
    if len(axes) != 1 or any(spec != stored for spec, _ in uses):
        return None
    reduced = tuple(a for a in next(iter(axes)) if mesh_shape[a] > 1)
    return reduced if reduced and all(stored[a] == "R" for a in reduced) else None


def boundary_spec(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> ShardingSpec:
    """How a value crosses a pipeline stage boundary between two stages on logical mesh
    ``mesh_shape``: every mesh axis of more than one device shards the first tensor dim that
    no earlier axis shards and that it divides evenly (a residual stream ``[b, s, h]`` on a
    ``4x2`` mesh goes ``[S(0), S(1)]``, with a batch of one ``[S(1), S(2)]``); an axis that
    finds none leaves it replicated. Rank ``i`` of the sender's sub-mesh sends its shard to
    rank ``i`` of the receiver's, so both must lay the value out alike: a value whose way from
    the stage computing it to the last reading it passes a stage on another logical mesh
    crosses whole instead, and so do a value smaller than the link moves in one latency
    (``planner.pipeline.range_costs.whole_below``) and one the same for every sample (a rotary
    table: ``NodeInfo.batch_free``), which batch shards read whole (the plan names those values). torchtitan's
    pipeline stages hand on their tensor-parallel shards the same way; a large value sent whole
    costs every rank the whole value in transfer and in the memory of every microbatch in
    flight."""
    used: set[int] = set()
    spec: list[Placement] = []
    for n in mesh_shape:
        dim = next((d for d, size in enumerate(shape) if n > 1 and d not in used and size >= n and size % n == 0),
                   None)
        if dim is None:
            spec.append(R)
        else:
            used.add(dim)
            spec.append(S(dim))
    return tuple(spec)


def boundary_shards(shape: tuple[int, ...], mesh_shape: tuple[int, ...]) -> int:
    """Into how many pieces :func:`boundary_spec` cuts a value: each rank sends one."""
    spec = boundary_spec(shape, mesh_shape)
    return math.prod(n for p, n in zip(spec, mesh_shape) if p.is_shard)
