"""Stage pins (``layer_stages``) in the inter-op DP: optimality against brute force, validation."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
from test_inter_op_dp import synthetic_cost

from autoplan.solvers.inter_op import (
    InterOpInfeasibleError,
    InterOpProblem,
    InterOpSolution,
    StageCost,
    StagePins,
    SubMesh,
    allowed_stage_counts,
    brute_force_inter_op,
    candidate_submeshes,
    pipeline_step_time,
    solve_inter_op,
    usable_stages,
)


def random_pins(rng: random.Random, num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """Valid pins: a random partition into ``num_stages`` stages, some of its layers pinned."""
    cuts = sorted(rng.sample(range(1, num_layers), num_stages - 1))
    bounds = list(zip((0, *cuts), (*cuts, num_layers)))
    stage_of = [q for q, (a, b) in enumerate(bounds) for _ in range(a, b)]
    layers = rng.sample(range(num_layers), rng.randint(1, num_layers))
    return tuple((layer, stage_of[layer]) for layer in layers)


def obeys_pins(problem: InterOpProblem, solution: InterOpSolution) -> bool:
    stages = solution.stages
    if len(stages) != problem.pinned_stages:
        return False
    return all(stages[q].start <= layer < stages[q].end for layer, q in problem.layer_stages)


def check_pipeline(problem: InterOpProblem, solution: InterOpSolution) -> None:
    """A contiguous cover on N devices obeying the pins, with (0) as its step time."""
    stages = solution.stages
    assert stages[0].start == 0 and stages[-1].end == problem.num_layers
    assert all(a.end == b.start for a, b in zip(stages, stages[1:]))
    assert sum(s.sub_mesh.size for s in stages) == problem.num_devices
    assert obeys_pins(problem, solution), (problem, [(s.start, s.end) for s in stages])
    latencies = [s.cost.latency_s for s in stages]
    assert solution.step_time_s == pipeline_step_time(latencies, problem.num_microbatches)


def optimum(problem: InterOpProblem, cost_fn) -> tuple[InterOpSolution | None, InterOpSolution | None]:
    """(DP, brute force), each None where it raises InterOpInfeasibleError."""
    answers = []
    for solve in (solve_inter_op, brute_force_inter_op):
        try:
            answers.append(solve(problem, cost_fn))
        except InterOpInfeasibleError:
            answers.append(None)
    return answers[0], answers[1]


# --------------------------------------------------------------------------------------------
# Optimality against brute force


def test_pinned_dp_matches_brute_force():
    rng = random.Random(2024)
    solved = infeasible = binding = 0
    for case in range(200):
        L = rng.randint(2, 6)
        nodes, per_node = rng.choice([1, 2]), rng.choice([1, 2, 4])
        N = nodes * per_node
        cost_fn = synthetic_cost(rng.randrange(10_000), L, rng.choice([0.0, 0.1, 0.3]))
        S = rng.randint(1, min(L, N))
        budget = rng.choice([None, None, rng.uniform(2.0, 20.0)])
        pins = random_pins(rng, L, S)
        problem = InterOpProblem(L, nodes, per_node, rng.randint(1, 4), memory_budget=budget,
                                 pinned_stages=S, layer_stages=pins)
        got, expected = optimum(problem, cost_fn)
        assert (got is None) == (expected is None), (case, problem)
        free, _ = optimum(replace(problem, layer_stages=()), cost_fn)
        if got is None:
            infeasible += 1
            continue
        solved += 1
        check_pipeline(problem, got)
        check_pipeline(problem, expected)
        assert math.isclose(got.step_time_s, expected.step_time_s, rel_tol=1e-9), (case, problem)
        assert free is not None, (case, problem)  # a pinned pipeline is an unpinned one
        assert got.step_time_s >= free.step_time_s * (1 - 1e-12), (case, problem)
        binding += got.step_time_s > free.step_time_s * (1 + 1e-9)
    assert solved > 100 and infeasible > 0 and binding >= 10, (solved, infeasible, binding)


def test_pins_force_a_worse_pipeline():
    def cost_fn(start: int, end: int, mesh: SubMesh) -> StageCost:
        return StageCost((end - start) / mesh.size, 0.0)

    free = solve_inter_op(InterOpProblem(6, 1, 4, 4, pinned_stages=2), cost_fn)
    assert [(s.start, s.end) for s in free.stages] == [(0, 3), (3, 6)]
    problem = InterOpProblem(6, 1, 4, 4, pinned_stages=2, layer_stages=((0, 0), (1, 1)))
    pinned = solve_inter_op(problem, cost_fn)
    assert [(s.start, s.end) for s in pinned.stages] == [(0, 1), (1, 6)]
    assert [s.sub_mesh.size for s in pinned.stages] == [2, 2]  # sizes 1, 2, 4 only
    assert pinned.step_time_s > free.step_time_s
    assert pinned.step_time_s == pytest.approx(brute_force_inter_op(problem, cost_fn).step_time_s)


def test_pins_given_as_lists_are_stored_as_tuples():
    problem = InterOpProblem(4, 1, 2, 1, pinned_stages=2, layer_stages=[[0, 0], [3, 1], [3, 1]])
    assert problem.layer_stages == ((0, 0), (3, 1), (3, 1))
    assert problem.stage_pins() == {0: 0, 3: 1}
    hash(problem)


def test_pins_leaving_no_feasible_pipeline_raise():
    def cost_fn(start: int, end: int, mesh: SubMesh) -> StageCost:
        return StageCost(1.0, 0.0, feasible=(start, end) != (0, 2))

    problem = InterOpProblem(3, 1, 2, 2, pinned_stages=2, layer_stages=((0, 0), (1, 0)))
    assert solve_inter_op(replace(problem, layer_stages=()), cost_fn).step_time_s == 3.0
    for solve in (solve_inter_op, brute_force_inter_op):
        with pytest.raises(InterOpInfeasibleError, match="stage pins") as raised:
            solve(problem, cost_fn)
        assert "\n" not in str(raised.value)


# --------------------------------------------------------------------------------------------
# Work: only stages some pinned pipeline can contain are priced


def test_usable_stages_is_exact_with_pins():
    """(W1) keeps a triple iff some brute-force pipeline obeying the pins contains it."""
    rng = random.Random(5)
    for _ in range(60):
        L = rng.randint(2, 6)
        nodes, per_node = rng.choice([(1, 1), (2, 1), (1, 2), (2, 2), (1, 4), (2, 4), (3, 2)])
        S = rng.randint(1, min(L, nodes * per_node))
        problem = InterOpProblem(L, nodes, per_node, 1, pinned_stages=S,
                                 layer_stages=random_pins(rng, L, S))
        meshes = candidate_submeshes(nodes, per_node)
        kept = set(usable_stages(problem, meshes, allowed_stage_counts(problem)))
        calls = set()

        def cost_fn(start: int, end: int, mesh: SubMesh) -> StageCost:
            calls.add((start, end, mesh))
            return StageCost(1.0, 0.0)

        try:
            brute_force_inter_op(problem, cost_fn)
        except InterOpInfeasibleError:
            pass
        assert kept == calls, problem


def test_stage_pins_index_ranges():
    problem = InterOpProblem(6, 1, 4, 1, pinned_stages=3, layer_stages=((2, 1),))
    pins = StagePins(problem)
    assert list(pins.indices(0, 2)) == [0]  # layers 0-1: stage 0 (layer 2 is in stage 1)
    assert list(pins.indices(0, 3)) == []  # layer 2 with layer 0: stage 1 would start at 0
    assert list(pins.indices(1, 3)) == [1]
    assert list(pins.indices(3, 4)) == []  # stage 1 holds layer 2, stage 2 ends at layer 5
    assert list(pins.indices(3, 6)) == [2]
    pins = StagePins(InterOpProblem(6, 1, 4, 1, pinned_stages=4, layer_stages=((0, 0),)))
    assert list(pins.indices(2, 3)) == [1, 2]  # after [0, 2), or after [0, 1) and [1, 2)
    assert list(pins.indices(0, 3)) == [0] and list(pins.indices(1, 2)) == [1]
    assert list(pins.indices(5, 6)) == [3] and list(pins.indices(1, 6)) == []


# --------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize("extra, message", [
    ({"layer_stages": ((0, 0),)}, "needs pinned_stages"),
    ({"pinned_stages": 3, "layer_stages": ((6, 0),)}, "layer 6, out of range"),
    ({"pinned_stages": 3, "layer_stages": ((-1, 0),)}, "layer -1, out of range"),
    ({"pinned_stages": 3, "layer_stages": ((1, 3),)}, "stage 3, out of range"),
    ({"pinned_stages": 3, "layer_stages": ((1, -1),)}, "stage -1, out of range"),
    ({"pinned_stages": 3, "layer_stages": ((1, 0), (1, 1))}, "layer 1 twice"),
    ({"pinned_stages": 3, "layer_stages": ((1, 1), (4, 0))}, "breaks layer order"),
    ({"pinned_stages": 3, "layer_stages": ((3, 0), (4, 2))}, "not enough layers"),
    ({"pinned_stages": 3, "layer_stages": ((1, 2),)}, "not enough layers"),
    ({"pinned_stages": 3, "layer_stages": ((5, 1),)}, "not enough layers"),
    ({"pinned_stages": 7, "layer_stages": ((0, 0),)}, "not enough layers"),
    ({"pinned_stages": 3, "layer_stages": ((1, True),)}, "pairs of ints"),
    ({"pinned_stages": 3, "layer_stages": ((1, 2, 3),)}, "pairs of ints"),
    ({"pinned_stages": 3, "layer_stages": (1, 2)}, "pairs"),
])
def test_invalid_pins_raise(extra, message):
    with pytest.raises(ValueError, match=message) as raised:
        InterOpProblem(6, 2, 4, 4, **extra)
    assert "\n" not in str(raised.value)


def test_valid_edge_pins_are_accepted():
    for pins in [((0, 0), (5, 2)), ((2, 2), (3, 2)), ((2, 0), (3, 1), (4, 2)), ((1, 1), (2, 2))]:
        problem = InterOpProblem(6, 2, 4, 4, pinned_stages=3, layer_stages=pins)
        solution = solve_inter_op(problem, synthetic_cost(1, 6, 0.0))
        check_pipeline(problem, solution)
