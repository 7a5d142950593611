"""Collective costs (alpha-beta model, ring algorithms) and the collectives of a resharding.

Every ``nbytes`` is the full buffer held by one device, by kind:

- ``all_reduce``: the buffer being reduced;
- ``all_gather``: the gathered OUTPUT;
- ``reduce_scatter``: the INPUT before scattering;
- ``all_to_all``: the per-device buffer;
- ``send_recv``: the message.

Ring costs on ``n`` devices over a link of bandwidth ``bw`` (bytes/s) and latency ``α`` (s):

- all_reduce: 2(n−1)/n · B/bw + 2(n−1)·α
- all_gather, reduce_scatter, all_to_all: (n−1)/n · B/bw + (n−1)·α
- send_recv: B/bw + α

and nothing at all when n == 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from autoplan.sharding import R, ShardingSpec, local_shape, spec_name

from .hardware import LinkSpec

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
ALL_TO_ALL = "all_to_all"
SEND_RECV = "send_recv"
COLLECTIVE_KINDS: tuple[str, ...] = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL, SEND_RECV)


def _check(kind: str, n: int) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"unknown collective {kind!r}: expected one of {', '.join(COLLECTIVE_KINDS)}")
    if n < 1:
        raise ValueError(f"a collective needs at least one device, not {n}")


def bytes_moved_per_device(kind: str, nbytes: float, n: int) -> float:
    """Bytes each device sends over the link in a ring ``kind`` on ``n`` devices (the
    bandwidth term): 2(n−1)/n·B for all-reduce, (n−1)/n·B for all-gather, reduce-scatter and
    all-to-all, B for send/recv; 0 when n == 1."""
    _check(kind, n)
    if n == 1:
        return 0.0
    if kind == ALL_REDUCE:
        return 2 * (n - 1) / n * nbytes
    if kind == SEND_RECV:
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
    return n - 1


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Seconds for collective ``kind`` on ``n`` devices with a per-device buffer of ``nbytes``
    bytes (see the module docstring for which buffer) over ``link``."""
    return bytes_moved_per_device(kind, nbytes, n) / link.bandwidth + latency_steps(kind, n) * link.latency


@dataclass(frozen=True)
class CollectiveStep:
    """One collective over mesh axis ``mesh_axis`` with a per-device buffer of ``nbytes`` bytes
    (by the convention of ``kind``)."""

    kind: str
    mesh_axis: int
    nbytes: float

    def __str__(self) -> str:
        return f"{self.kind.replace('_', '-')} @ {self.mesh_axis} ({self.nbytes:g} B)"


def reshard_steps(
    src: ShardingSpec,
    dst: ShardingSpec,
    shape: tuple[int, ...],
    itemsize: int,
    mesh_shape: tuple[int, ...],
) -> list[CollectiveStep]:
    """The collectives that turn a tensor of global ``shape`` (``itemsize`` bytes per element)
    from spec ``src`` into spec ``dst``, one mesh axis at a time.

    Per axis: equal → nothing; R→S(d), R→P, S(d)→P → nothing (local slice or zero-fill);
    P→S(d) → reduce-scatter; P→R → all-reduce; S(d)→R → all-gather; S(d)→S(e) → all-to-all.
    Order: reductions first (reduce-scatters, which shrink the buffer, before all-reduces),
    then all-gathers, then all-to-alls, then the free local steps; each step's ``nbytes`` is
    computed from the spec in force at that moment, so later steps see the sizes earlier
    ones left. Mesh axes of size 1 never communicate and give no step.
    """
    if not len(src) == len(dst) == len(mesh_shape):
        raise ValueError(
            f"specs {spec_name(src)} and {spec_name(dst)} do not match a {len(mesh_shape)}-axis mesh {mesh_shape}"
        )
    cur = list(src)
    steps: list[CollectiveStep] = []

    def local_bytes() -> float:
        return float(math.prod(local_shape(shape, tuple(cur), mesh_shape)) * itemsize)

    def emit(kind: str, axis: int, nbytes: float) -> None:
        if mesh_shape[axis] > 1:  # one device on the axis: nothing to exchange
            steps.append(CollectiveStep(kind, axis, nbytes))

    axes = range(len(mesh_shape))
    for a in axes:  # P -> S(d): reduce-scatter, nbytes = input
        if cur[a].is_partial and dst[a].is_shard:
            emit(REDUCE_SCATTER, a, local_bytes())
            cur[a] = dst[a]
    for a in axes:  # P -> R: all-reduce, nbytes = buffer
        if cur[a].is_partial and dst[a].is_replicate:
            emit(ALL_REDUCE, a, local_bytes())
            cur[a] = R
    for a in axes:  # S(d) -> R: all-gather, nbytes = output
        if cur[a].is_shard and dst[a].is_replicate:
            cur[a] = R
            emit(ALL_GATHER, a, local_bytes())
    for a in axes:  # S(d) -> S(e): all-to-all, nbytes = the per-device buffer
        if cur[a].is_shard and dst[a].is_shard and cur[a] != dst[a]:
            emit(ALL_TO_ALL, a, local_bytes())
            cur[a] = dst[a]
    # What is left (R -> S, R -> P, S -> P) is local: slice or zero-fill.
    return steps


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
