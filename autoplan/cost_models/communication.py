"""Collective costs (alpha-beta model, ring algorithms) and the collectives of a resharding.

Every ``nbytes`` is the full buffer held by one device, by kind:

- ``all_reduce``: the buffer being reduced;
- ``all_gather``: the gathered OUTPUT;
- ``reduce_scatter``: the INPUT before scattering;
- ``all_to_all``: the per-device buffer;
- ``send_recv``, ``broadcast``: the message.

Ring costs on ``n`` devices over a link of bandwidth ``bw`` (bytes/s) and latency ``α`` (s):

- all_reduce: 2(n−1)/n · B/bw + 2(n−1)·α
- all_gather, reduce_scatter, all_to_all: (n−1)/n · B/bw + (n−1)·α
- send_recv: B/bw + α
- broadcast (a binomial tree, as gloo and NCCL run small messages): B/bw + ⌈log2 n⌉·α

and nothing at all when n == 1.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from autoplan.sharding import Placement, R, ShardingSpec, local_shape, reduce_scatter_first, spec_name

from .hardware import LinkSpec


class CollectiveKind(StrEnum):
    """What a collective does; the value is how plan.json, cluster files and torch's
    CommDebugMode name it."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"
    BROADCAST = "broadcast"


ALL_REDUCE = CollectiveKind.ALL_REDUCE
ALL_GATHER = CollectiveKind.ALL_GATHER
REDUCE_SCATTER = CollectiveKind.REDUCE_SCATTER
ALL_TO_ALL = CollectiveKind.ALL_TO_ALL
SEND_RECV = CollectiveKind.SEND_RECV
BROADCAST = CollectiveKind.BROADCAST
COLLECTIVE_KINDS: tuple[CollectiveKind, ...] = tuple(CollectiveKind)


def _check(kind: str, n: int) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(COLLECTIVE_KINDS)}")
    if n < 1:
        raise ValueError(f"a collective needs at least one device, not {n}")


def bytes_moved_per_device(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends over the link in a ring ``kind`` on ``n`` devices (the
    bandwidth term): 2(n−1)/n·B for all-reduce, (n−1)/n·B for all-gather, reduce-scatter and
    all-to-all, B for send/recv and broadcast; 0 when n == 1."""
    _check(kind, n)
    if n == 1:
        return 0.0
    if kind == ALL_REDUCE:
        return 2 * (n - 1) / n * nbytes
    if kind in (SEND_RECV, BROADCAST):
        return float(nbytes)
    return (n - 1) / n * nbytes


def latency_steps(kind: str, n: int) -> int:
    """Number of sequential ring steps, each paying the link latency once."""
    _check(kind, n)
    if n == 1:
        return 0
    if kind == ALL_REDUCE:
        return 2 * (n - 1)
    if kind == SEND_RECV:
        return 1
    if kind == BROADCAST:
        return math.ceil(math.log2(n))
    return n - 1


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for collective ``kind`` on ``n`` devices with a per-device buffer of ``nbytes``
    bytes (see the module docstring for which buffer) over ``link``."""
    rates = link.rates(kind)
    return bytes_moved_per_device(kind, nbytes, n) / rates.bandwidth + latency_steps(kind, n) * rates.latency


@dataclass(frozen=True)
class CollectiveStep:
    """One collective over mesh axis ``mesh_axis`` with a per-device buffer of ``nbytes`` bytes
    (by the convention of ``kind``)."""

    kind: str
    mesh_axis: int
    nbytes: float

    def __str__(self) -> str:
        return f"{self.kind.replace('_', '-')} @ {self.mesh_axis} ({self.nbytes:g} B)"


def _transform_kind(current: Placement, target: Placement) -> str | None:
    """The collective that changes one mesh axis from ``current`` to ``target`` (None: local)."""
    if current == target or current.is_replicate:
        return None  # R -> S(d) slices, R -> P splits locally
    if current.is_partial:
        return ALL_REDUCE if target.is_replicate else REDUCE_SCATTER
    if target.is_replicate:
        return ALL_GATHER
    return ALL_TO_ALL if target.is_shard else None  # S(d) -> P pads with zeros locally


def _axis_transforms(src: list[Placement], dst: ShardingSpec, mesh_shape: tuple[int, ...]
                     ) -> list[tuple[int, Placement]]:
    """The per-axis changes that take ``src`` to ``dst``, in order, as (mesh axis, new placement).

    The order is DTensor's greedy one: if anything is sharded, first walk the axes from inner
    to outer, moving each to its target, except that an axis whose target shards a tensor dim
    that the axes before it shard differently now than in the target is replicated instead
    (nested shards must be undone inner first); then walk outer to inner for what is left."""
    cur = list(src)
    out: list[tuple[int, Placement]] = []
    if math.prod(n for p, n in zip(cur, mesh_shape) if p.is_shard) > 1:
        for axis in reversed(range(len(cur))):
            target = dst[axis]
            if target.is_shard:
                now = [i for i in range(axis) if cur[i].is_shard and cur[i].dim == target.dim]
                wanted = [i for i in range(axis) if dst[i].is_shard and dst[i].dim == target.dim]
                if now != wanted:
                    target = R
            if cur[axis] != target:
                out.append((axis, target))
                cur[axis] = target
    for axis in range(len(cur)):
        if cur[axis] != dst[axis]:
            out.append((axis, dst[axis]))
            cur[axis] = dst[axis]
    return out


def reshard_steps(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> list[CollectiveStep]:
    """See :func:`_reshard_steps` (memoised: planning asks for the same few pairs of specs
    and shapes many times)."""
    return list(_reshard_steps(tuple(src), tuple(dst), tuple(shape), itemsize, tuple(mesh_shape)))


@functools.lru_cache(maxsize=1 << 16)
def _reshard_steps(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> tuple[CollectiveStep, ...]:
    """The collectives that turn a tensor of global ``shape`` (``itemsize`` bytes per element)
    from spec ``src`` into spec ``dst``, as the emitted program runs them.

    Per axis: P→R all-reduce, P→S(d) reduce-scatter, S(d)→R all-gather, S(d)→S(e) all-to-all;
    R→S(d) and R→P are local (slice, split). S(d)→P is local too (zero padding) where no other
    axis shards dim d; otherwise the axis is gathered first. Partial targets are reached from
    replicated ones (the program makes partial sums locally). Partial axes that become shards
    are reduce-scattered before other partial axes are all-reduced
    (:func:`~autoplan.sharding.reduce_scatter_first`, as the program orders them); everything
    else follows DTensor's greedy order (:func:`_axis_transforms`). Each step's ``nbytes`` is computed from
    the spec in force at that moment. Mesh axes of size 1 never communicate.
    """
    if not len(src) == len(dst) == len(mesh_shape):
        raise ValueError(
            f"specs {spec_name(src)} and {spec_name(dst)} do not match a {len(mesh_shape)}-axis mesh {mesh_shape}"
        )
    cur = list(src)
    for axis, (c, t) in enumerate(zip(src, dst)):  # S(d) -> P by zero padding, where d is sharded once
        if t.is_partial and c.is_shard and not any(p.is_shard and p.dim == c.dim for i, p in enumerate(cur)
                                                    if i != axis):
            cur[axis] = t
    mid = tuple(R if t.is_partial and not c.is_partial else t for c, t in zip(cur, dst))
    steps: list[CollectiveStep] = []
    for axis in reduce_scatter_first(tuple(cur), dst):  # partial sums reduce-scattered before all-reduced
        before = float(math.prod(local_shape(shape, tuple(cur), mesh_shape)) * itemsize)
        cur[axis] = dst[axis]
        if mesh_shape[axis] > 1:
            steps.append(CollectiveStep(REDUCE_SCATTER, axis, before))
    for axis, target in _axis_transforms(cur, mid, mesh_shape):
        kind = _transform_kind(cur[axis], target)
        before = float(math.prod(local_shape(shape, tuple(cur), mesh_shape)) * itemsize)
        cur[axis] = target
        if kind is not None and mesh_shape[axis] > 1:
            after = float(math.prod(local_shape(shape, tuple(cur), mesh_shape)) * itemsize)
            steps.append(CollectiveStep(kind, axis, after if kind == ALL_GATHER else before))
    return tuple(steps)


def steps_time(steps: Iterable[CollectiveStep], mesh_shape: tuple[int, ...], links: tuple[LinkSpec, ...]) -> float:
    """Seconds for ``steps`` run one after another; step on axis ``a`` uses ``mesh_shape[a]``
    devices and ``links[a]``."""
    return sum(collective_time(s.kind, s.nbytes, mesh_shape[s.mesh_axis], links[s.mesh_axis]) for s in steps)


def reshard_time(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
    links: tuple[LinkSpec, ...],
) -> float:
    """Seconds to reshard a tensor of global ``shape`` from ``src`` to ``dst`` (see
    :func:`reshard_steps`) with ``links[a]`` the link of mesh axis ``a``."""
    return steps_time(reshard_steps(src, dst, shape, itemsize, mesh_shape), mesh_shape, links)
