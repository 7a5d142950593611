"""Which stages a pipeline may contain, and the memoised cost oracle that prices them.

Stage counts: the set ``A`` of allowed counts (each stage needs a layer and a device, and the
caller may cap or pin the count). Stage pins: :class:`StagePins`, the stage indices at which a
layer range may stand. Work saved (W1): only (stage, sub-mesh) pairs that some pipeline obeying
``sum_i n_i m_i = N``, ``A`` and the pins can contain are evaluated; see :func:`usable_stages`
and the DP's docstring (:mod:`~autoplan.solvers.inter_op.dp`).
"""

from __future__ import annotations

import math
import numbers

from autoplan.solvers.inter_op.problem import InterOpInfeasibleError, InterOpProblem, StageCost, StageCostFn, SubMesh
from autoplan.solvers.units import format_bytes


def allowed_stage_counts(problem: InterOpProblem) -> list[int]:
    """The set A of (4): stage counts a pipeline may have (each stage needs a layer, a device)."""
    most = min(problem.num_layers, problem.num_devices)
    if problem.max_stages is not None:
        most = min(most, problem.max_stages)
    if problem.pinned_stages is not None:
        return [problem.pinned_stages] if problem.pinned_stages <= most else []
    return list(range(1, most + 1))


def stage_count_free(problem: InterOpProblem, allowed: list[int]) -> bool:
    """True when A holds every count a partition can have and no layer is pinned to a stage,
    so (2) may drop its s index."""
    return not problem.layer_stages and allowed == list(range(1, min(problem.num_layers, problem.num_devices) + 1))


class StagePins:
    """The pins of a problem as bounds on its cuts, and the stage indices a layer range may take.

    Stage ``q`` of ``S`` holds layers ``[c_q, c_{q+1})`` with ``0 = c_0 < c_1 < ... < c_S = L``;
    a pin ``(l, q)`` asks ``c_q <= l < c_{q+1}``. These are bounds ``lo[q] <= c_q <= hi[q]``,
    tightened by ``lo[q] >= lo[q-1] + 1`` (forward) and ``hi[q] <= hi[q+1] - 1`` (backward).
    A validated problem leaves every ``lo[q] <= hi[q]``, and then ``[start, end)`` is stage ``p``
    of some pipeline obeying the pins iff ``lo[p] <= start <= hi[p]`` and
    ``lo[p+1] <= end <= hi[p+1]`` (the least cuts before ``p`` and the largest after ``p + 1``
    fit). As ``lo`` and ``hi`` increase with ``q``, those ``p`` form a range.
    """

    def __init__(self, problem: InterOpProblem) -> None:
        L, S = problem.num_layers, problem.pinned_stages
        if S is None:
            raise ValueError("stage pins need pinned_stages")
        lo, hi = [0] + [1] * (S - 1) + [L], [0] + [L - 1] * (S - 1) + [L]
        for layer, stage in problem.layer_stages:
            hi[stage] = min(hi[stage], layer)
            lo[stage + 1] = max(lo[stage + 1], layer + 1)
        for q in range(1, S + 1):
            lo[q] = max(lo[q], lo[q - 1] + 1)
        for q in range(S - 1, -1, -1):
            hi[q] = min(hi[q], hi[q + 1] - 1)
        if any(a > b for a, b in zip(lo, hi)):
            raise ValueError(f"no pipeline of {S} stages obeys layer_stages={problem.layer_stages}")
        self.num_stages = S
        # cuts[x]: the cut indices q with lo[q] <= x <= hi[q], as (first, last); (S + 1, -1) if none
        self.cuts = [(S + 1, -1)] * (L + 1)
        for q in range(S + 1):
            for x in range(lo[q], hi[q] + 1):
                first, last = self.cuts[x]
                self.cuts[x] = (min(first, q), max(last, q))

    def indices(self, start: int, end: int) -> range:
        """The stage indices ``p`` at which layers ``[start, end)`` may stand (maybe none)."""
        first_start, last_start = self.cuts[start]
        first_end, last_end = self.cuts[end]
        return range(max(first_start, first_end - 1), min(last_start, last_end - 1) + 1)


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
    """(W1): the (start, end, sub-mesh) triples some pipeline obeying (1), A and the stage pins
    can contain."""
    if not allowed:
        return []
    L, N = problem.num_layers, problem.num_devices
    pins = StagePins(problem) if problem.layer_stages else None
    allowed_set = set(allowed)
    sums = _device_sums(sorted({m.size for m in submeshes}), max(allowed) - 1, N)
    out = []
    for start in range(L):
        for end in range(start + 1, L + 1):
            if pins is not None and not pins.indices(start, end):
                continue  # no pipeline obeying the pins has this layer range as a stage
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


class StageOracle:
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


def infeasible_error(problem: InterOpProblem, oracle: StageOracle | None,
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
    pinned = problem.layer_stages
    if pinned:
        count += f" stages obeying the stage pins (layer_stages={list(pinned)})"
    else:
        count += " stages"
    relax = ", or relax the stage pins" if pinned else ""
    if oracle is not None and oracle.over_budget:
        least = ("" if not math.isfinite(oracle.least_memory)
                 else f" (the smallest stage needs {format_bytes(oracle.least_memory)})")
        return InterOpInfeasibleError(
            f"no pipeline of {L} layers in {count} on {cluster} devices fits "
            f"{format_bytes(problem.memory_budget)} per device{least}; give more memory "
            f"(--memory-per-device), more devices, or allow more stages{relax}"
        )
    return InterOpInfeasibleError(
        f"no pipeline of {L} layers in {count} on {cluster} devices is feasible: "
        f"every stage that tiles the cluster{' and obeys the pins' if pinned else ''} was marked infeasible; "
        f"use more devices or allow a different number of stages{relax}"
    )
