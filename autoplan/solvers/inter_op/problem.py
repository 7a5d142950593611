"""The inter-op problem and solution: layers, the cluster, sub-meshes, stage costs, step time.

Layers ``0..L-1`` form a chain. The cluster has ``num_nodes`` nodes of ``M = devices_per_node``
devices, ``N = num_nodes * M`` in all. ``B`` microbatches flow through the pipeline. A stage is
a contiguous layer range on a sub-mesh of shape ``(n, m)``: ``(1, 2^j)`` with ``2^j <= M`` (a
slice of one node) or ``(n, M)`` with ``1 <= n <= num_nodes`` (``n`` whole nodes). A 1F1B or
GPipe schedule over stages with latencies ``t_1..t_S`` takes
``T = sum_i t_i + (B - 1) * max_j t_j`` (:func:`pipeline_step_time`). Stage pins
(``layer_stages``) put chosen layers in chosen stages of a pipeline of ``pinned_stages`` stages.
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
    layer_stages: tuple[tuple[int, int], ...] = ()  # (layer, stage) pins, 0-based; need pinned_stages

    def __post_init__(self) -> None:
        pins = self.layer_stages
        if not isinstance(pins, tuple) or not all(isinstance(pin, tuple) for pin in pins):
            try:  # a list of lists, say: store it as a tuple of tuples (the problem is frozen)
                object.__setattr__(self, "layer_stages", tuple(tuple(pin) for pin in pins))
            except TypeError:
                raise ValueError(f"layer_stages must be (layer, stage) pairs, not {pins!r}") from None
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
        self._validate_layer_stages()

    def stage_pins(self) -> dict[int, int]:
        """The pins as ``{layer: stage}`` (a repeated identical pin counts once)."""
        return dict(self.layer_stages)

    def _validate_layer_stages(self) -> None:
        """Raise ValueError unless some pipeline of ``pinned_stages`` stages obeys every pin."""
        pins = self.layer_stages
        if not pins:
            return
        L, S = self.num_layers, self.pinned_stages
        for pin in pins:
            if len(pin) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in pin):
                raise ValueError(f"layer_stages entries must be (layer, stage) pairs of ints, not {pin!r}")
        if S is None:
            raise ValueError("layer_stages needs pinned_stages: a stage index means nothing without "
                             "a known stage count (--stages)")
        stage_of: dict[int, int] = {}
        for layer, stage in pins:
            if not 0 <= layer < L:
                raise ValueError(f"layer_stages pins layer {layer}, out of range for "
                                 f"{L} layers (0..{L - 1})")
            if not 0 <= stage < S:
                raise ValueError(f"layer_stages pins layer {layer} to stage {stage}, out of range "
                                 f"for {S} pinned stages (0..{S - 1})")
            if stage_of.setdefault(layer, stage) != stage:
                raise ValueError(f"layer_stages pins layer {layer} twice, to stages "
                                 f"{stage_of[layer]} and {stage}")
        ordered = sorted(stage_of.items())
        for (a, sa), (b, sb) in zip(ordered, ordered[1:]):
            if sa > sb:
                raise ValueError(f"layer_stages breaks layer order: layer {a} is pinned to stage {sa} "
                                 f"but the later layer {b} to the earlier stage {sb}")
            if sb - sa > b - a:
                raise ValueError(f"layer_stages leaves not enough layers: stages {sa + 1}..{sb - 1} "
                                 f"between layer {a} (stage {sa}) and layer {b} (stage {sb}) "
                                 f"would get {b - a - 1} layer(s) for {sb - sa - 1} stage(s)")
        first, s_first = ordered[0]
        if first < s_first:
            raise ValueError(f"layer_stages leaves not enough layers: layer {first} in stage "
                             f"{s_first} leaves {first} layer(s) for the {s_first} stage(s) before it")
        last, s_last = ordered[-1]
        if L - last < S - s_last:
            raise ValueError(f"layer_stages leaves not enough layers: layer {last} in stage {s_last} "
                             f"leaves {L - 1 - last} layer(s) for the {S - 1 - s_last} stage(s) after it")


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
