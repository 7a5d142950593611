"""The inter-op DP: optimality against brute force, budgets, stage counts, memoisation, errors."""

from __future__ import annotations

import ast
import itertools
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from autoplan.errors import AutoplanError
from autoplan.solvers import inter_op
from autoplan.solvers.inter_op import (
    InterOpInfeasibleError,
    InterOpProblem,
    InterOpSolution,
    StageCost,
    SubMesh,
    allowed_stage_counts,
    brute_force_inter_op,
    candidate_submeshes,
    explain_inter_op,
    pipeline_step_time,
    solve_inter_op,
    usable_stages,
)

# (num_nodes, devices_per_node): N in {1, 2, 4, 8}, devices_per_node in {1, 2, 4}
CLUSTERS = [(1, 1), (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (1, 4), (2, 4)]
MICROBATCHES = [1, 4, 16]


def synthetic_cost(seed: int, num_layers: int, infeasible_share: float = 0.1,
                   quantum: float | None = None):
    """A seeded oracle: latency = work/size^alpha + comm*log2(size)*noise + cross-node term,
    memory = mem/size^beta; some stages infeasible. ``quantum`` rounds latencies (many ties).
    The noise is keyed by the triple, so the oracle does not depend on the order of calls."""
    rng = random.Random(seed)
    work = [rng.uniform(0.5, 2.0) for _ in range(num_layers)]
    mem = [rng.uniform(1.0, 10.0) for _ in range(num_layers)]
    alpha, beta = rng.uniform(0.5, 1.0), rng.uniform(0.3, 1.0)
    comm, cross = rng.uniform(0.0, 0.3), rng.uniform(0.0, 0.5)

    def cost(start: int, end: int, mesh: SubMesh) -> StageCost:
        r = random.Random(f"{seed}/{start}/{end}/{mesh.nodes}/{mesh.devices}")
        z = mesh.size
        latency = (math.fsum(work[start:end]) / z ** alpha
                   + comm * math.log2(z) * r.uniform(0.5, 1.5) + cross * (mesh.nodes - 1))
        if quantum is not None:
            latency = quantum * max(1, round(latency / quantum))
        memory = math.fsum(mem[start:end]) / z ** beta
        return StageCost(latency, memory, feasible=r.random() >= infeasible_share,
                         logical_mesh=(z,))

    return cost


def all_memories(problem: InterOpProblem, cost_fn) -> list[float]:
    meshes = candidate_submeshes(problem.num_nodes, problem.devices_per_node)
    L = problem.num_layers
    return sorted(cost_fn(a, b, m).memory_bytes
                  for a in range(L) for b in range(a + 1, L + 1) for m in meshes)


def check_valid(problem: InterOpProblem, solution: InterOpSolution) -> None:
    """Contiguous cover of the layers, sizes adding up to N, budget and stage counts obeyed,
    step time equal to equation (0) of the chosen stages."""
    stages = solution.stages
    assert stages[0].start == 0 and stages[-1].end == problem.num_layers
    assert all(a.end == b.start for a, b in itertools.pairwise(stages))
    assert all(s.start < s.end for s in stages)
    assert sum(s.sub_mesh.size for s in stages) == problem.num_devices
    meshes = candidate_submeshes(problem.num_nodes, problem.devices_per_node)
    assert all(s.sub_mesh in meshes for s in stages)
    assert all(s.cost.feasible for s in stages)
    if problem.memory_budget is not None:
        assert all(s.cost.memory_bytes <= problem.memory_budget for s in stages)
    assert len(stages) in allowed_stage_counts(problem)
    latencies = [s.cost.latency_s for s in stages]
    assert solution.step_time_s == pipeline_step_time(latencies, problem.num_microbatches)
    assert solution.t_max_s == max(latencies)


def assert_same_optimum(problem: InterOpProblem, cost_fn) -> InterOpSolution | None:
    """DP and brute force agree (relative 1e-9), or both raise InterOpInfeasibleError."""
    try:
        expected = brute_force_inter_op(problem, cost_fn)
    except InterOpInfeasibleError:
        with pytest.raises(InterOpInfeasibleError):
            solve_inter_op(problem, cost_fn)
        return None
    got = solve_inter_op(problem, cost_fn)
    check_valid(problem, got)
    check_valid(problem, expected)
    assert got.step_time_s == pytest.approx(expected.step_time_s, rel=1e-9, abs=0), problem
    return got


# --------------------------------------------------------------------------------------------
# Formulas and sub-meshes


def test_pipeline_step_time_formula():
    assert pipeline_step_time([1.0, 2.0, 3.0], 4) == 6.0 + 3 * 3.0
    assert pipeline_step_time([1.0, 2.0, 3.0], 1) == 6.0
    assert pipeline_step_time([2.5], 16) == 16 * 2.5
    with pytest.raises(ValueError):
        pipeline_step_time([], 4)
    with pytest.raises(ValueError):
        pipeline_step_time([1.0], 0)


def test_candidate_submeshes():
    shapes = [(m.nodes, m.devices) for m in candidate_submeshes(2, 8)]
    assert shapes == [(1, 1), (1, 2), (1, 4), (1, 8), (2, 8)]
    assert candidate_submeshes(1, 1) == [SubMesh(1, 1)]
    assert [(m.nodes, m.devices) for m in candidate_submeshes(4, 1)] == [
        (1, 1), (2, 1), (3, 1), (4, 1)]
    # devices_per_node not a power of two: slices of 2^k, then whole nodes
    assert [(m.nodes, m.devices) for m in candidate_submeshes(2, 6)] == [
        (1, 1), (1, 2), (1, 4), (1, 6), (2, 6)]
    assert SubMesh(2, 8).size == 16 and str(SubMesh(2, 8)) == "2x8"
    with pytest.raises(ValueError):
        SubMesh(0, 8)


def test_problem_validation():
    with pytest.raises(ValueError, match="num_microbatches"):
        InterOpProblem(4, 1, 2, 0)
    with pytest.raises(ValueError, match="memory_budget"):
        InterOpProblem(4, 1, 2, 1, memory_budget=math.inf)
    with pytest.raises(ValueError, match="pinned_stages"):
        InterOpProblem(4, 1, 4, 1, max_stages=2, pinned_stages=3)


# --------------------------------------------------------------------------------------------
# Optimality against brute force


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("microbatches", MICROBATCHES)
def test_dp_matches_brute_force(cluster, microbatches):
    nodes, per_node = cluster
    for L in range(1, 7):
        seed = random.Random(f"{nodes}/{per_node}/{microbatches}/{L}").randrange(10_000)
        for variant, cost_fn in [("plain", synthetic_cost(seed, L)),
                                 ("ties", synthetic_cost(seed, L, quantum=0.25)),
                                 ("all feasible", synthetic_cost(seed, L, 0.0))]:
            problem = InterOpProblem(L, nodes, per_node, microbatches)
            solution = assert_same_optimum(problem, cost_fn)
            if variant == "all feasible":
                assert solution is not None  # N >= 1 and L >= 1: some pipeline exists


@pytest.mark.parametrize("cluster", CLUSTERS)
@pytest.mark.parametrize("microbatches", MICROBATCHES)
def test_dp_matches_brute_force_with_memory_budget(cluster, microbatches):
    nodes, per_node = cluster
    rng = random.Random(f"budget/{nodes}/{per_node}/{microbatches}")
    feasible_seen = 0
    for L in range(1, 7):
        for _ in range(3):
            cost_fn = synthetic_cost(rng.randrange(10_000), L, infeasible_share=0.05)
            memories = all_memories(InterOpProblem(L, nodes, per_node, 1), cost_fn)
            budget = rng.choice(memories) + 1e-9 * rng.random()  # exactly at, or just above, one
            problem = InterOpProblem(L, nodes, per_node, microbatches, memory_budget=budget)
            feasible_seen += assert_same_optimum(problem, cost_fn) is not None
    assert feasible_seen > 0


@pytest.mark.parametrize("cluster", CLUSTERS)
def test_dp_matches_brute_force_with_pinned_and_max_stages(cluster):
    nodes, per_node = cluster
    N = nodes * per_node
    for L in range(1, 7):
        cost_fn = synthetic_cost(100 * N + L, L, infeasible_share=0.05)
        for stages in range(1, min(L, N) + 2):  # one more than possible: must raise
            for B in (1, 4):
                pinned = InterOpProblem(L, nodes, per_node, B, pinned_stages=stages)
                solution = assert_same_optimum(pinned, cost_fn)
                if solution is not None:
                    assert len(solution.stages) == stages
                capped = InterOpProblem(L, nodes, per_node, B, max_stages=stages)
                solution = assert_same_optimum(capped, cost_fn)
                if solution is not None:
                    assert len(solution.stages) <= stages


def test_dp_matches_brute_force_budget_and_pinned():
    rng = random.Random(7)
    for _ in range(40):
        nodes, per_node = rng.choice(CLUSTERS)
        L = rng.randint(1, 6)
        cost_fn = synthetic_cost(rng.randrange(10_000), L)
        memories = all_memories(InterOpProblem(L, nodes, per_node, 1), cost_fn)
        problem = InterOpProblem(L, nodes, per_node, rng.choice(MICROBATCHES),
                                 memory_budget=rng.choice(memories),
                                 pinned_stages=rng.randint(1, min(L, nodes * per_node)))
        assert_same_optimum(problem, cost_fn)


def test_t_max_enumeration_matters():
    """A case where the pipeline with the least sum of latencies is not the best: the DP must
    trade a larger sum for a smaller max (a single t_max = +inf pass would get this wrong)."""
    table = {  # 2 layers on 2 devices (2 nodes x 1)
        (0, 2, 2): 2.0,  # one stage on both devices: sum 2, max 2
        (0, 1, 1): 1.2, (1, 2, 1): 1.2,  # two stages: sum 2.4, max 1.2
    }

    def cost_fn(start, end, mesh):
        t = table.get((start, end, mesh.size))
        return StageCost(t or 0.0, 0.0, feasible=t is not None)

    one = solve_inter_op(InterOpProblem(2, 2, 1, 1), cost_fn)
    assert len(one.stages) == 1 and one.step_time_s == 2.0  # B = 1: sum only
    many = solve_inter_op(InterOpProblem(2, 2, 1, 8), cost_fn)
    assert len(many.stages) == 2
    assert many.step_time_s == pytest.approx(2.4 + 7 * 1.2)  # < 2.0 * 8


# --------------------------------------------------------------------------------------------
# Memory budgets and infeasibility


def layer_bound_cost(start: int, end: int, mesh: SubMesh) -> StageCost:
    """Perfect scaling (one stage is fastest: no bubble) but memory per layer does not shrink
    with devices (think replicated weights): a small budget forces more stages."""
    layers = end - start
    return StageCost(latency_s=layers / mesh.size, memory_bytes=10.0 * layers)


def test_memory_budget_forces_more_stages():
    free = solve_inter_op(InterOpProblem(8, 2, 4, 8), layer_bound_cost)
    assert len(free.stages) == 1 and free.step_time_s == pytest.approx(8 * 8 / 8)
    for budget, least_stages in [(40.0, 2), (20.0, 4), (10.0, 8)]:
        problem = InterOpProblem(8, 2, 4, 8, memory_budget=budget)
        tight = solve_inter_op(problem, layer_bound_cost)
        check_valid(problem, tight)
        assert len(tight.stages) >= least_stages
        assert tight.step_time_s > free.step_time_s
        assert tight.step_time_s == pytest.approx(
            brute_force_inter_op(problem, layer_bound_cost).step_time_s, rel=1e-9)


def test_budget_nothing_fits_raises_one_line():
    problem = InterOpProblem(4, 2, 4, 8, memory_budget=5.0)  # every stage needs >= 10
    with pytest.raises(InterOpInfeasibleError) as raised:
        solve_inter_op(problem, layer_bound_cost)
    message = str(raised.value)
    assert isinstance(raised.value, AutoplanError)
    assert "\n" not in message
    assert "no pipeline" in message and "--memory-per-device" in message
    with pytest.raises(InterOpInfeasibleError):
        brute_force_inter_op(problem, layer_bound_cost)


def test_too_many_pinned_stages_raises_one_line():
    calls = []

    def cost_fn(start, end, mesh):
        calls.append((start, end, mesh))
        return layer_bound_cost(start, end, mesh)

    for problem in (InterOpProblem(3, 2, 4, 4, pinned_stages=4),  # more stages than layers
                    InterOpProblem(8, 1, 2, 4, pinned_stages=3)):  # more stages than devices
        with pytest.raises(InterOpInfeasibleError) as raised:
            solve_inter_op(problem, cost_fn)
        assert "\n" not in str(raised.value) and "--stages" in str(raised.value)
    assert calls == []  # decided before any oracle call


def test_all_stages_infeasible_raises():
    def cost_fn(start, end, mesh):
        return StageCost(1.0, 1.0, feasible=False)

    with pytest.raises(InterOpInfeasibleError, match="infeasible"):
        solve_inter_op(InterOpProblem(3, 1, 4, 4), cost_fn)


def test_bad_oracle_answers_are_rejected():
    with pytest.raises(TypeError, match="StageCost"):
        solve_inter_op(InterOpProblem(2, 1, 2, 1), lambda a, b, m: 1.0)
    with pytest.raises(ValueError, match="latency_s"):
        solve_inter_op(InterOpProblem(2, 1, 2, 1), lambda a, b, m: StageCost(math.inf, 0.0))

    def cost_fn(start, end, mesh):  # an infeasible stage may carry any numbers
        if end - start == 2:
            return StageCost(math.inf, math.nan, feasible=False)
        return StageCost(1.0, 0.0)

    solution = solve_inter_op(InterOpProblem(2, 1, 2, 1), cost_fn)
    assert [(s.start, s.end) for s in solution.stages] == [(0, 1), (1, 2)]
    assert solution.step_time_s == 2.0


# --------------------------------------------------------------------------------------------
# Memoisation and work


def counting(cost_fn):
    calls = Counter()

    def wrapped(start, end, mesh):
        calls[(start, end, mesh)] += 1
        return cost_fn(start, end, mesh)

    return wrapped, calls


@pytest.mark.parametrize("cluster", [(2, 4), (4, 2), (8, 1), (4, 8)])
@pytest.mark.parametrize("microbatches", MICROBATCHES)
def test_cost_fn_called_once_per_stage_and_submesh(cluster, microbatches):
    nodes, per_node = cluster
    L = 10
    meshes = candidate_submeshes(nodes, per_node)
    for extra in ({}, {"max_stages": 3}, {"pinned_stages": 2}, {"memory_budget": 20.0}):
        wrapped, calls = counting(synthetic_cost(5, L))
        problem = InterOpProblem(L, nodes, per_node, microbatches, **extra)
        solution = solve_inter_op(problem, wrapped)
        assert max(calls.values()) == 1
        assert solution.num_candidates_evaluated == len(calls) <= L * L * len(meshes)
        assert all(mesh in meshes and 0 <= a < b <= L for a, b, mesh in calls)


def test_only_stages_that_can_tile_are_evaluated():
    wrapped, calls = counting(synthetic_cost(3, 6, 0.0))
    solve_inter_op(InterOpProblem(6, 1, 1, 4), wrapped)
    assert list(calls) == [(0, 6, SubMesh(1, 1))]  # one device: one stage, the whole model
    wrapped, calls = counting(synthetic_cost(3, 6, 0.0))
    solve_inter_op(InterOpProblem(6, 2, 4, 4, pinned_stages=2), wrapped)
    assert all((a == 0) != (b == 6) for a, b, _ in calls)  # two stages: a prefix or a suffix
    assert all(mesh.size < 8 for _, _, mesh in calls)  # the other stage needs a device


def test_usable_stages_is_exact():
    """(W1) keeps a triple iff some brute-force pipeline contains it."""
    for nodes, per_node in CLUSTERS + [(3, 2), (2, 6)]:
        for L in range(1, 6):
            for pinned in (None, 1, 2, 3):
                problem = InterOpProblem(L, nodes, per_node, 1, pinned_stages=pinned)
                meshes = candidate_submeshes(nodes, per_node)
                kept = set(usable_stages(problem, meshes, allowed_stage_counts(problem)))
                wrapped, calls = counting(lambda a, b, m: StageCost(1.0, 0.0))
                try:
                    brute_force_inter_op(problem, wrapped)
                except InterOpInfeasibleError:
                    pass
                assert kept == set(calls), (nodes, per_node, L, pinned)


def test_t_max_pruning_saves_passes():
    cost_fn = synthetic_cost(11, 16, 0.0)
    problem = InterOpProblem(16, 4, 8, 16)
    solution = solve_inter_op(problem, cost_fn)
    meshes = candidate_submeshes(4, 8)
    distinct = {cost_fn(a, b, m).latency_s for a, b, m in
                usable_stages(problem, meshes, allowed_stage_counts(problem))}
    assert solution.num_dp_passes < len(distinct) / 4
    assert solve_inter_op(InterOpProblem(16, 4, 8, 1), cost_fn).num_dp_passes == 1  # B = 1


def test_no_torch_import():
    modules = sorted(Path(inter_op.__file__).parent.glob("*.py"))
    assert len(modules) > 1  # the package's modules, not only its __init__
    imported = set()
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                imported.add((node.module or "").split(".")[0])
    assert "torch" not in imported
    assert imported <= {"__future__", "itertools", "math", "numbers", "time", "collections",
                        "dataclasses", "numpy", "autoplan"}


def test_explain_names_every_stage():
    problem = InterOpProblem(6, 2, 2, 4)
    solution = solve_inter_op(problem, synthetic_cost(2, 6, 0.0))
    text = explain_inter_op(solution)
    assert text.count("\n") == len(solution.stages)
    assert "stage 0: layers 0-" in text and str(solution.stages[-1].sub_mesh) in text
