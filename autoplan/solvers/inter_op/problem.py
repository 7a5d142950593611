"""The inter-op problem and solution: layers, the cluster, sub-meshes, stage costs, step time.

Layers ``0..L-1`` form a chain. The cluster has ``num_nodes`` nodes of ``M = devices_per_node``
devices, ``N = num_nodes * M`` in all. ``B`` microbatches flow through the pipeline. A stage is
a contiguous layer range on a sub-mesh of shape ``(n, m)``: ``(1, 2^j)`` with ``2^j <= M`` (a
slice of one node) or ``(n, M)`` with ``1 <= n <= num_nodes`` (``n`` whole nodes). A 1F1B or
GPipe schedule over stages with latencies ``t_1..t_S`` takes
``T = sum_i t_i + (B - 1) * max_j t_j`` (:func:`pipeline_step_time`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

from autoplan.errors import AutoplanError


class InterOpInfeasibleError(AutoplanError):
    """No pipeline of the model fits the cluster (memory, stage count, or feasibility)."""


@dataclass(frozen=True)
class SubMesh:
    """A block of the cluster: ``nodes`` nodes, ``devices`` devices on each."""

    nodes: int  # 1 for a slice of one node
    devices: int  # devices per node used (2^k when nodes == 1, devices_per_node otherwise)

    def __post_init__(self) -> None:
        for name in ("nodes", "devices"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"SubMesh.{name} must be an int >= 1, not {value!r}")

    @property
    def size(self) -> int:
        return self.nodes * self.devices

    def __str__(self) -> str:
        return f"{self.nodes}x{self.devices}"


@dataclass(frozen=True)
class StageCost:
    """What the oracle says about layers [start, end) on one sub-mesh."""

    latency_s: float  # t_intra: one microbatch's forward + backward on this stage (seconds)
    memory_bytes: float  # per-device memory for the microbatches in flight under the schedule
    feasible: bool = True
    logical_mesh: tuple[int, ...] = ()  # the logical mesh the caller chose
    detail: object = None  # anything the caller wants back


# layers [start, end) on sub_mesh -> best StageCost (already minimised over logical meshes)
StageCostFn = Callable[[int, int, SubMesh], StageCost]


def check_int(name: str, value: object, low: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{' or None' if optional else ''}, "
                         f"not {value!r}")


@dataclass(frozen=True)
class InterOpProblem:
    """The chain, the cluster, the microbatches and the optional limits."""

    num_layers: int
    num_nodes: int
    devices_per_node: int
    num_microbatches: int  # B
    memory_budget: float | None = None  # bytes per device
    max_stages: int | None = None  # optional cap on the number of stages
    pinned_stages: int | None = None  # exactly this many stages (--stages S)
    submeshes: tuple[SubMesh, ...] | None = None  # only these sub-mesh shapes (default: every candidate)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_devices(self) -> int:
        return self.num_nodes * self.devices_per_node

    def validate(self) -> None:
        """Raise ValueError naming the first malformed field."""
        check_int("num_layers", self.num_layers, 1)
        check_int("num_nodes", self.num_nodes, 1)
        check_int("devices_per_node", self.devices_per_node, 1)
        check_int("num_microbatches", self.num_microbatches, 1)
        check_int("max_stages", self.max_stages, 1, optional=True)
        check_int("pinned_stages", self.pinned_stages, 1, optional=True)
        budget = self.memory_budget
        if budget is not None and (not isinstance(budget, numbers.Real)
                                   or not math.isfinite(budget) or budget < 0):
            raise ValueError(f"memory_budget must be a finite number >= 0 or None, not {budget!r}")
        if (self.pinned_stages is not None and self.max_stages is not None
                and self.pinned_stages > self.max_stages):
            raise ValueError(f"pinned_stages={self.pinned_stages} exceeds "
                             f"max_stages={self.max_stages}")


def problem_submeshes(problem: InterOpProblem) -> list[SubMesh]:
    """The sub-mesh shapes a problem allows: its own list, or every candidate."""
    every = candidate_submeshes(problem.num_nodes, problem.devices_per_node)
    if problem.submeshes is None:
        return every
    return [m for m in every if m in problem.submeshes]


@dataclass
class StageAssignment:
    """Layers [start, end) on ``sub_mesh``, with the oracle's cost for it."""

    start: int
    end: int
    sub_mesh: SubMesh
    cost: StageCost


@dataclass
class InterOpSolution:
    """The chosen stages, first to last, and the step time (0) they give."""

    stages: list[StageAssignment]
    step_time_s: float  # sum t_i + (B - 1) * max t_i
    t_max_s: float  # max t_i
    num_candidates_evaluated: int  # oracle calls (distinct (start, end, sub-mesh) triples)
    solve_time_s: float
    num_dp_passes: int = 0  # DP passes over (2) (0 for brute force)


def candidate_submeshes(num_nodes: int, devices_per_node: int) -> list[SubMesh]:
    """(1, 1), (1, 2), (1, 4), ... up to devices_per_node, then (1..num_nodes, devices_per_node)."""
    check_int("num_nodes", num_nodes, 1)
    check_int("devices_per_node", devices_per_node, 1)
    meshes = []
    width = 1
    while width < devices_per_node:
        meshes.append(SubMesh(1, width))
        width *= 2
    meshes += [SubMesh(n, devices_per_node) for n in range(1, num_nodes + 1)]
    return meshes


def pipeline_step_time(latencies: list[float], num_microbatches: int) -> float:
    """Equation (0): sum t_i + (B - 1) * max t_i for stage latencies t_i and B microbatches."""
    check_int("num_microbatches", num_microbatches, 1)
    if not latencies:
        raise ValueError("a pipeline needs at least one stage latency")
    return math.fsum(latencies) + (num_microbatches - 1) * max(latencies)
