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

Stage pins
----------
``layer_stages`` pins layers to stage indices of a pipeline of exactly ``S`` stages
(``pinned_stages``; ``A = {S}``). Counting stages from the start, the stage that begins at
layer ``k`` when ``s`` stages remain is stage ``S - s``, so the pins restrict the choices of (2)::

    choice (k..i, (n, m)) is usable in F(s, k, d | t_max) only if
    stage(l) = S - s for every pinned layer l with k <= l <= i                               (2')

and the DP keeps ``s`` whenever a layer is pinned. Every layer lies in exactly one stage, so a
pipeline built from choices obeying (2') obeys every pin, and (2)-(5) give the optimum of (0)
among those pipelines. Each choice is used only at the stage indices ``S - s`` at which some
pipeline obeying the pins can hold its layer range (:class:`~.stages.StagePins`): a range of
``s`` (a slice in the vectorised update, empty for a range whose pinned layers disagree); this
implies (2') and drops only choices no such pipeline contains.

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
     need (0, 1 or 2) and the most they allow (``L - (i - k)``), with ``c + 1`` in ``A``, and,
     with stage pins, some stage index can hold ``[k, i)`` (see "Stage pins").
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

import math
import time
from dataclasses import dataclass

import numpy as np

from autoplan.solvers.inter_op.problem import (InterOpProblem, InterOpSolution, StageAssignment, StageCost,
    StageCostFn, SubMesh, pipeline_step_time, problem_submeshes)
from autoplan.solvers.inter_op.stages import (StageOracle, StagePins, allowed_stage_counts, infeasible_error,
    stage_count_free, usable_stages)


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
        self.track_stages = not stage_count_free(problem, allowed)
        self.stage_axis = max(allowed) + 1 if self.track_stages else 1
        # per choice, the s it updates in (2) (destination) and the s - 1 it reads (source)
        every_s = ((slice(1, None), slice(None, -1)) if self.track_stages
                   else (slice(0, 1), slice(0, 1)))
        self.s_slices: list[tuple[slice, slice] | None] = [every_s] * len(choices)
        if problem.layer_stages:  # (2'): stage index p = S - s, so s runs over S - p
            pins, S = StagePins(problem), problem.pinned_stages
            for idx, choice in enumerate(choices):
                p = pins.indices(choice.start, choice.end)
                self.s_slices[idx] = ((slice(S - p[-1], S - p[0] + 1), slice(S - p[-1] - 1, S - p[0]))
                                      if p else None)
        # usable choices by first layer, fastest first, so a pass can stop at t_max
        self.by_start: list[list[int]] = [[] for _ in range(self.L)]
        for idx in sorted(range(len(choices)), key=lambda j: choices[j].cost.latency_s):
            if self.s_slices[idx] is not None:
                self.by_start[choices[idx].start].append(idx)
        self.passes = 0

    def solve(self, t_max: float) -> list[int] | None:
        """Indices of the choices of argmin (4) at t_max, first stage first; None if +inf."""
        self.passes += 1
        L, N = self.L, self.N
        F = np.full((self.stage_axis, L + 1, N + 1), np.inf)
        pick = np.full(F.shape, -1, dtype=np.int64)
        F[0, L, 0] = 0.0  # (3)
        for k in range(L - 1, -1, -1):  # F(., i+1, .) is final before F(., k, .) is built
            for idx in self.by_start[k]:
                choice = self.choices[idx]
                t = choice.cost.latency_s
                if t > t_max:
                    break
                z = choice.mesh.size
                dst_s, src_s = self.s_slices[idx]
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
    """The pipeline minimising (0) under (1), the budget, the stage-count limits and the stage
    pins (2').

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
        raise infeasible_error(problem, None, allowed)
    oracle = StageOracle(cost_fn, problem.memory_budget)
    choices = []
    for start, end, mesh in usable_stages(problem, submeshes, allowed):  # (W1)
        cost = oracle.usable(start, end, mesh)
        if cost is not None:
            choices.append(_Choice(start, end, mesh, cost))
    dp = _StageDP(problem, choices, allowed)

    best = dp.solve(math.inf)  # (W2): F_inf and a first pipeline
    if best is None:
        raise infeasible_error(problem, oracle, allowed)
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
