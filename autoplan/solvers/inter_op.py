r"""Inter-op DP (Alpa §5.2): cut a chain of layers into pipeline stages, give each a sub-mesh.

Pure mathematics: numbers in, choices out (no torch). The planner supplies a cost oracle
``cost_fn(start, end, sub_mesh) -> StageCost`` (layers ``[start, end)`` on ``sub_mesh``, already
minimised over logical meshes by the intra-op pass) and reads the stages back from the
:class:`InterOpSolution`.

Data
----
Layers ``0..L-1`` form a chain. The cluster has ``num_nodes`` nodes of ``M = devices_per_node``
devices, ``N = num_nodes * M`` in all. ``B`` microbatches flow through the pipeline. A stage is
a contiguous layer range ``[k, i]`` on a sub-mesh of shape ``(n, m)``:

* ``(1, 2^j)`` with ``2^j <= M`` (a slice of one node), or
* ``(n, M)`` with ``1 <= n <= num_nodes`` (``n`` whole nodes)

(:func:`candidate_submeshes`). ``t_intra(k..i, (n, m))`` is the latency of one microbatch's
forward and backward on that stage (``StageCost.latency_s``). A (stage, sub-mesh) pair whose
cost is ``feasible=False`` or whose ``memory_bytes`` exceeds the budget is *absent*: no choice.

Objective (Alpa eq. 2)
----------------------
A 1F1B or GPipe schedule of ``B`` microbatches over stages with latencies ``t_1..t_S`` takes::

    T = sum_{i=1..S} t_i + (B - 1) * max_{1<=j<=S} t_j                                      (0)

(:func:`pipeline_step_time`), minimised over the number of stages ``S``, the layer cuts and the
sub-mesh of every stage, subject to::

    sum_{i=1..S} n_i * m_i = N                                                              (1)

Why (1) is enough (Alpa's argument): sub-meshes of the shapes above always tile a cluster whose
``M`` is a power of two when their sizes add up to ``N`` (every slice size divides ``M``, so
first-fit in decreasing size fills nodes exactly). When ``M`` is not a power of two, (1) is
necessary but not sufficient (``M = 6``: three ``(1, 4)`` slices add up to 12 devices but do
not fit on two nodes); like Alpa, this module accepts (1) as the condition anyway.

The DP (Alpa eqs. 3 and 4)
--------------------------
The ``max`` makes (0) non-separable, so Alpa fixes an upper bound ``t_max`` on every stage's
latency and solves a separable problem for each ``t_max``. ``F(s, k, d | t_max)`` is the least
``sum t_i`` of slicing layers ``k..L-1`` into ``s`` stages on exactly ``d`` devices with every
``t_i <= t_max`` (slicing from the start, ``s`` = stages still to place, ``d`` = devices left)::

    F(s, k, d | t_max) = min_{k <= i <= L-1, (n, m): n*m <= d,
                              t_intra(k..i, (n, m)) <= t_max}
                             F(s - 1, i + 1, d - n*m | t_max) + t_intra(k..i, (n, m))       (2)
    F(0, L, 0 | t_max) = 0,    F = +inf where no choice exists                              (3)
    T*(t_max) = min_{s in A} F(s, 0, N | t_max) + (B - 1) * t_max                           (4)
    T* = min_{t_max} T*(t_max)                                                              (5)

``A`` is the set of allowed stage counts: ``{S}`` when the stage count is pinned, else
``1..min(L, N, max_stages)``. For a solution of (4), ``T`` of (0) is at most ``T*(t_max)`` (its
largest stage may be faster than ``t_max``), with equality at ``t_max`` = the largest stage
latency of an optimal pipeline; so (5), taken over every distinct stage latency, is the optimum
of (0). The reported ``step_time_s`` is (0) recomputed from the chosen stages.

In Alpa ``t_intra`` also takes ``s`` (1F1B keeps more microbatches in flight on early stages,
which changes their memory); here the oracle has no stage index, so the caller folds the
schedule into ``memory_bytes`` and ``s`` only counts stages. When no stage count is constrained
(every partition has at most ``min(L, N)`` stages anyway) the ``s`` index is dropped from (2)
and ``F(k, d)`` is solved instead: same optimum, ``min(L, N)`` times less work.

Work saved (the answer is unchanged)
------------------------------------
(W1) Oracle calls: only (stage, sub-mesh) pairs that some pipeline obeying (1) and ``A`` can
     contain are evaluated: ``[k, i)`` on size ``z`` is kept iff ``N - z`` is a sum of ``c``
     sub-mesh sizes for some ``c`` between the fewest stages the layers outside ``[k, i)``
     need (0, 1 or 2) and the most they allow (``L - (i - k)``), with ``c + 1`` in ``A``.
     Each pair is evaluated once (memoised per solve), so at most ``L(L+1)/2 * |sub-meshes|``
     oracle calls: on one device only ``[0, L)`` is evaluated.
(W2) ``t_max = +inf`` is solved first: ``F_inf = min_s F(s, 0, N | inf)`` is a lower bound on
     every ``sum t_i``, so ``T*(t_max) >= F_inf + (B - 1) * t_max``; the enumeration of
     ``t_max`` in increasing order stops at the first value where that bound reaches the best
     ``T`` found (stronger than Alpa's ``(B - 1) * t_max >= best``). With ``B = 1`` the
     ``t_max = +inf`` pass is the answer.
(W3) Feasibility of (4) is monotone in ``t_max``: the smallest feasible ``t_max`` is found by
     bisection before the increasing scan starts.
Each DP pass updates (2) for one stage choice at a time, vectorised over ``s`` and ``d``.
"""

from __future__ import annotations

import itertools
import math
import numbers
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from autoplan.errors import AutoplanError
from autoplan.solvers.units import format_bytes, format_seconds

BRUTE_FORCE_LIMIT = 1_000_000  # most pipelines brute_force_inter_op enumerates


class InterOpInfeasibleError(AutoplanError):
    """No pipeline of the model fits the cluster (memory, stage count, or feasibility)."""


# --------------------------------------------------------------------------------------------
# Problem and solution


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


def _check_int(name: str, value: object, low: int, optional: bool = False) -> None:
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
        _check_int("num_layers", self.num_layers, 1)
        _check_int("num_nodes", self.num_nodes, 1)
        _check_int("devices_per_node", self.devices_per_node, 1)
        _check_int("num_microbatches", self.num_microbatches, 1)
        _check_int("max_stages", self.max_stages, 1, optional=True)
        _check_int("pinned_stages", self.pinned_stages, 1, optional=True)
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


# --------------------------------------------------------------------------------------------
# Sub-meshes, step time, stage counts


def candidate_submeshes(num_nodes: int, devices_per_node: int) -> list[SubMesh]:
    """(1, 1), (1, 2), (1, 4), ... up to devices_per_node, then (1..num_nodes, devices_per_node)."""
    _check_int("num_nodes", num_nodes, 1)
    _check_int("devices_per_node", devices_per_node, 1)
    meshes = []
    width = 1
    while width < devices_per_node:
        meshes.append(SubMesh(1, width))
        width *= 2
    meshes += [SubMesh(n, devices_per_node) for n in range(1, num_nodes + 1)]
    return meshes


def pipeline_step_time(latencies: list[float], num_microbatches: int) -> float:
    """Equation (0): sum t_i + (B - 1) * max t_i for stage latencies t_i and B microbatches."""
    _check_int("num_microbatches", num_microbatches, 1)
    if not latencies:
        raise ValueError("a pipeline needs at least one stage latency")
    return math.fsum(latencies) + (num_microbatches - 1) * max(latencies)


def allowed_stage_counts(problem: InterOpProblem) -> list[int]:
    """The set A of (4): stage counts a pipeline may have (each stage needs a layer, a device)."""
    most = min(problem.num_layers, problem.num_devices)
    if problem.max_stages is not None:
        most = min(most, problem.max_stages)
    if problem.pinned_stages is not None:
        return [problem.pinned_stages] if problem.pinned_stages <= most else []
    return list(range(1, most + 1))


def _stage_count_free(problem: InterOpProblem, allowed: list[int]) -> bool:
    """True when A holds every count a partition can have, so (2) may drop its s index."""
    return allowed == list(range(1, min(problem.num_layers, problem.num_devices) + 1))


def _device_sums(sizes: list[int], max_count: int, total: int) -> list[int]:
    """Bitsets: bit r of entry c is set iff r (<= total) is a sum of c sizes (repeats allowed)."""
    mask = (1 << (total + 1)) - 1
    sums = [1]  # zero sizes add up to 0
    for _ in range(max_count):
        reached = 0
        for size in sizes:
            reached |= sums[-1] << size
        sums.append(reached & mask)
    return sums


def usable_stages(problem: InterOpProblem, submeshes: list[SubMesh],
                  allowed: list[int]) -> list[tuple[int, int, SubMesh]]:
    """(W1): the (start, end, sub-mesh) triples some pipeline obeying (1) and A can contain."""
    if not allowed:
        return []
    L, N = problem.num_layers, problem.num_devices
    allowed_set = set(allowed)
    sums = _device_sums(sorted({m.size for m in submeshes}), max(allowed) - 1, N)
    out = []
    for start in range(L):
        for end in range(start + 1, L + 1):
            fewest = (start > 0) + (end < L)
            most = L - (end - start)
            for mesh in submeshes:
                rest = N - mesh.size
                if rest < 0:
                    continue
                if any(c + 1 in allowed_set and (sums[c] >> rest) & 1
                       for c in range(fewest, min(most, len(sums) - 1) + 1)):
                    out.append((start, end, mesh))
    return out


# --------------------------------------------------------------------------------------------
# The memoised oracle


class _Oracle:
    """cost_fn memoised per (start, end, sub-mesh) for one solve; checks what comes back."""

    def __init__(self, cost_fn: StageCostFn, budget: float | None) -> None:
        self.cost_fn = cost_fn
        self.budget = budget
        self.cache: dict[tuple[int, int, SubMesh], StageCost] = {}
        self.over_budget = 0  # evaluated stages whose memory exceeds the budget
        self.infeasible = 0  # evaluated stages the oracle marked infeasible
        self.least_memory = math.inf  # least memory of any feasible evaluated stage

    def __call__(self, start: int, end: int, mesh: SubMesh) -> StageCost:
        key = (start, end, mesh)
        if key not in self.cache:
            cost = self.cost_fn(start, end, mesh)
            _check_stage_cost(key, cost)
            self.cache[key] = cost
            if not cost.feasible:
                self.infeasible += 1
            else:
                self.least_memory = min(self.least_memory, cost.memory_bytes)
                if self.budget is not None and cost.memory_bytes > self.budget:
                    self.over_budget += 1
        return self.cache[key]

    def usable(self, start: int, end: int, mesh: SubMesh) -> StageCost | None:
        """The cost, or None when the stage is absent (infeasible or over the budget)."""
        cost = self(start, end, mesh)
        if not cost.feasible:
            return None
        if self.budget is not None and cost.memory_bytes > self.budget:
            return None
        return cost

    @property
    def num_evaluated(self) -> int:
        return len(self.cache)


def _check_stage_cost(key: tuple[int, int, SubMesh], cost: object) -> None:
    start, end, mesh = key
    where = f"cost_fn({start}, {end}, {mesh})"
    if not isinstance(cost, StageCost):
        raise TypeError(f"{where} returned {type(cost).__name__}, not StageCost")
    if not cost.feasible:
        return
    for name in ("latency_s", "memory_bytes"):
        x = getattr(cost, name)
        if not isinstance(x, numbers.Real) or not math.isfinite(x) or x < 0:
            raise ValueError(f"{where}.{name} is {x!r}: a feasible stage needs a finite number "
                             ">= 0 (mark an impossible stage feasible=False instead)")


def _infeasible_error(problem: InterOpProblem, oracle: _Oracle | None,
                      allowed: list[int]) -> InterOpInfeasibleError:
    """One line: why no pipeline exists and what to change."""
    L, N = problem.num_layers, problem.num_devices
    cluster = f"{problem.num_nodes}x{problem.devices_per_node}"
    if not allowed:
        asked = problem.pinned_stages
        return InterOpInfeasibleError(
            f"no pipeline of {asked} stages exists: each stage needs a layer and a device, and "
            f"the model has {L} layers, the cluster {N} devices; ask for fewer stages (--stages)"
        )
    count = (f"exactly {problem.pinned_stages}" if problem.pinned_stages is not None
             else f"at most {allowed[-1]}")
    if oracle is not None and oracle.over_budget:
        least = ("" if not math.isfinite(oracle.least_memory)
                 else f" (the smallest stage needs {format_bytes(oracle.least_memory)})")
        return InterOpInfeasibleError(
            f"no pipeline of {L} layers in {count} stages on {cluster} devices fits "
            f"{format_bytes(problem.memory_budget)} per device{least}; give more memory "
            "(--memory-per-device), more devices, or allow more stages"
        )
    return InterOpInfeasibleError(
        f"no pipeline of {L} layers in {count} stages on {cluster} devices is feasible: "
        "every stage that tiles the cluster was marked infeasible; "
        "use more devices or allow a different number of stages"
    )


# --------------------------------------------------------------------------------------------
# The DP (2)-(4)


@dataclass
class _Choice:
    start: int
    end: int
    mesh: SubMesh
    cost: StageCost


class _StageDP:
    """Equations (2)-(4) over the present stage choices, one pass per t_max."""

    def __init__(self, problem: InterOpProblem, choices: list[_Choice],
                 allowed: list[int]) -> None:
        self.L, self.N = problem.num_layers, problem.num_devices
        self.choices = choices
        self.allowed = allowed
        self.track_stages = not _stage_count_free(problem, allowed)
        self.stage_axis = max(allowed) + 1 if self.track_stages else 1
        # choices by first layer, fastest first, so a pass can stop at t_max
        self.by_start: list[list[int]] = [[] for _ in range(self.L)]
        for idx in sorted(range(len(choices)), key=lambda j: choices[j].cost.latency_s):
            self.by_start[choices[idx].start].append(idx)
        self.passes = 0

    def solve(self, t_max: float) -> list[int] | None:
        """Indices of the choices of argmin (4) at t_max, first stage first; None if +inf."""
        self.passes += 1
        L, N = self.L, self.N
        F = np.full((self.stage_axis, L + 1, N + 1), np.inf)
        pick = np.full(F.shape, -1, dtype=np.int64)
        F[0, L, 0] = 0.0  # (3)
        dst_s, src_s = ((slice(1, None), slice(None, -1)) if self.track_stages
                        else (slice(0, 1), slice(0, 1)))
        for k in range(L - 1, -1, -1):  # F(., i+1, .) is final before F(., k, .) is built
            for idx in self.by_start[k]:
                choice = self.choices[idx]
                t = choice.cost.latency_s
                if t > t_max:
                    break
                z = choice.mesh.size
                candidate = F[src_s, choice.end, : N + 1 - z] + t  # (2), every s and d at once
                target = F[dst_s, k, z:]
                better = candidate < target
                np.copyto(target, candidate, where=better)
                np.copyto(pick[dst_s, k, z:], idx, where=better)
        return self._backtrack(F, pick)

    def _backtrack(self, F: np.ndarray, pick: np.ndarray) -> list[int] | None:
        if self.track_stages:
            s = min(self.allowed, key=lambda c: (F[c, 0, self.N], c))
        else:
            s = 0
        if not math.isfinite(F[s, 0, self.N]):
            return None
        out, k, d = [], 0, self.N
        while k < self.L:
            idx = int(pick[s, k, d])
            out.append(idx)
            k, d = self.choices[idx].end, d - self.choices[idx].mesh.size
            s -= 1 if self.track_stages else 0
        assert d == 0 and s == 0, "inter-op DP backtrack did not end at F(0, L, 0)"
        return out


def _step_time(choices: list[_Choice], picked: list[int], B: int) -> tuple[float, float]:
    latencies = [choices[i].cost.latency_s for i in picked]
    return pipeline_step_time(latencies, B), max(latencies)


def solve_inter_op(problem: InterOpProblem, cost_fn: StageCostFn) -> InterOpSolution:
    """The pipeline minimising (0) under (1), the budget and the stage-count limits.

    Enumerates t_max over the distinct latencies of the present stages (5), in increasing
    order from the smallest feasible one (W3), stopping by (W2). Raises InterOpInfeasibleError
    when no pipeline exists.
    """
    clock = time.perf_counter()
    problem.validate()
    B = problem.num_microbatches
    submeshes = problem_submeshes(problem)
    allowed = allowed_stage_counts(problem)
    if not allowed:
        raise _infeasible_error(problem, None, allowed)
    oracle = _Oracle(cost_fn, problem.memory_budget)
    choices = []
    for start, end, mesh in usable_stages(problem, submeshes, allowed):  # (W1)
        cost = oracle.usable(start, end, mesh)
        if cost is not None:
            choices.append(_Choice(start, end, mesh, cost))
    dp = _StageDP(problem, choices, allowed)

    best = dp.solve(math.inf)  # (W2): F_inf and a first pipeline
    if best is None:
        raise _infeasible_error(problem, oracle, allowed)
    f_inf = math.fsum(choices[i].cost.latency_s for i in best)
    best_time, best_max = _step_time(choices, best, B)

    latencies = sorted({c.cost.latency_s for c in choices})
    if f_inf + (B - 1) * latencies[0] < best_time:
        found: dict[int, list[int]] = {}
        low, high = 0, latencies.index(best_max)  # (W3): high is feasible
        while low < high:
            mid = (low + high) // 2
            picked = dp.solve(latencies[mid])
            if picked is None:
                low = mid + 1
            else:
                found[mid], high = picked, mid
        for j in range(low, len(latencies)):
            if f_inf + (B - 1) * latencies[j] >= best_time:  # (W2)
                break
            picked = found.pop(j) if j in found else dp.solve(latencies[j])
            step, t_max = _step_time(choices, picked, B)
            if step < best_time:
                best, best_time, best_max = picked, step, t_max

    stages = [StageAssignment(choices[i].start, choices[i].end, choices[i].mesh,
                              choices[i].cost) for i in best]
    return InterOpSolution(stages, best_time, best_max, oracle.num_evaluated,
                           time.perf_counter() - clock, dp.passes)


# --------------------------------------------------------------------------------------------
# Brute force (tests, tiny problems)


def _mesh_sequences(submeshes: list[SubMesh], count: int, devices: int):
    """Every sequence of ``count`` sub-meshes whose sizes add up to ``devices`` (1)."""
    if count == 0:
        if devices == 0:
            yield ()
        return
    for mesh in submeshes:
        if mesh.size <= devices - (count - 1):
            for rest in _mesh_sequences(submeshes, count - 1, devices - mesh.size):
                yield (mesh, *rest)


def brute_force_inter_op(problem: InterOpProblem, cost_fn: StageCostFn) -> InterOpSolution:
    """The optimum of (0) by enumerating every contiguous partition and every sub-mesh
    assignment with sizes adding up to N (at most BRUTE_FORCE_LIMIT pipelines)."""
    clock = time.perf_counter()
    problem.validate()
    L, N, B = problem.num_layers, problem.num_devices, problem.num_microbatches
    submeshes = problem_submeshes(problem)
    allowed = allowed_stage_counts(problem)
    oracle = _Oracle(cost_fn, problem.memory_budget)
    best: tuple[float, list[StageAssignment]] | None = None
    enumerated = 0
    for count in allowed:
        for cuts in itertools.combinations(range(1, L), count - 1):
            bounds = list(zip((0, *cuts), (*cuts, L)))
            for meshes in _mesh_sequences(submeshes, count, N):
                enumerated += 1
                if enumerated > BRUTE_FORCE_LIMIT:
                    raise ValueError(f"brute_force_inter_op would enumerate more than "
                                     f"{BRUTE_FORCE_LIMIT} pipelines")
                costs = [oracle.usable(a, b, m) for (a, b), m in zip(bounds, meshes)]
                if any(c is None for c in costs):
                    continue
                step = pipeline_step_time([c.latency_s for c in costs], B)
                if best is None or step < best[0]:
                    best = (step, [StageAssignment(a, b, m, c)
                                   for (a, b), m, c in zip(bounds, meshes, costs)])
    if best is None:
        raise _infeasible_error(problem, oracle, allowed)
    step, stages = best
    return InterOpSolution(stages, step, max(s.cost.latency_s for s in stages),
                           oracle.num_evaluated, time.perf_counter() - clock, 0)


# --------------------------------------------------------------------------------------------
# Explanation


def explain_inter_op(solution: InterOpSolution) -> str:
    """The pipeline as text: one line for the whole, one per stage."""
    lines = [(
        f"pipeline of {len(solution.stages)} stage(s): step {format_seconds(solution.step_time_s)}"
        f" (slowest stage {format_seconds(solution.t_max_s)}; "
        f"{solution.num_candidates_evaluated} stage costs evaluated, "
        f"{solution.num_dp_passes} DP passes, {solution.solve_time_s:.2f} s)"
    )]
    for s, stage in enumerate(solution.stages):
        logical = ("" if not stage.cost.logical_mesh
                   else f" (logical mesh {'x'.join(map(str, stage.cost.logical_mesh))})")
        lines.append(
            f"  stage {s}: layers {stage.start}-{stage.end - 1} on {stage.sub_mesh}{logical}: "
            f"{format_seconds(stage.cost.latency_s)} per microbatch, "
            f"{format_bytes(stage.cost.memory_bytes)} per device"
        )
    return "\n".join(lines)
