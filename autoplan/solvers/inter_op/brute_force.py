"""The optimum of the step time by enumerating every pipeline (tests, tiny problems)."""

from __future__ import annotations

import itertools
import time

from autoplan.solvers.inter_op.problem import (InterOpProblem, InterOpSolution, StageAssignment, StageCostFn,
    SubMesh, pipeline_step_time, problem_submeshes)
from autoplan.solvers.inter_op.stages import StageOracle, allowed_stage_counts, infeasible_error

BRUTE_FORCE_LIMIT = 1_000_000  # most pipelines brute_force_inter_op enumerates


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
    """The optimum of (0) by enumerating every contiguous partition that obeys the stage pins
    and every sub-mesh assignment with sizes adding up to N (at most BRUTE_FORCE_LIMIT
    pipelines)."""
    clock = time.perf_counter()
    problem.validate()
    L, N, B = problem.num_layers, problem.num_devices, problem.num_microbatches
    submeshes = problem_submeshes(problem)
    allowed = allowed_stage_counts(problem)
    pins = problem.stage_pins()
    oracle = StageOracle(cost_fn, problem.memory_budget)
    best: tuple[float, list[StageAssignment]] | None = None
    enumerated = 0
    for count in allowed:
        for cuts in itertools.combinations(range(1, L), count - 1):
            bounds = list(zip((0, *cuts), (*cuts, L)))
            if not all(bounds[stage][0] <= layer < bounds[stage][1] for layer, stage in pins.items()):
                continue  # breaks a stage pin (pins come with pinned_stages, so count is S)
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
        raise infeasible_error(problem, oracle, allowed)
    step, stages = best
    return InterOpSolution(stages, step, max(s.cost.latency_s for s in stages),
                           oracle.num_evaluated, time.perf_counter() - clock, 0)
