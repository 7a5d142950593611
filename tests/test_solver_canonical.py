"""The canonical optimum: the same assignment from HiGHS and CBC, whatever the input order."""

from __future__ import annotations

import math
import random
import sys
import warnings
from pathlib import Path

import pytest

from autoplan.errors import MemoryInfeasibleError
from autoplan.solvers import Edge, IntraOpProblem, brute_force, canonical_solution, evaluate, solve_intra_op
from autoplan.solvers.intra_op import PeakRow, least_memory
from autoplan.solvers.intra_op.tie_break import (
    RANK_STRIDE,
    choice_ranks,
    tie_break_weights,
)

SOLVERS = ["highs", "cbc"]
CHOICE_LABELS = ["R", "S0", "S1", "S2", "P"]


def tied_problem(seed: int, budget: bool = False) -> IntraOpProblem:
    """Small integer costs and memory and 0/1 edge matrices: many assignments tie."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 7))]
    costs = [[float(rng.randint(0, 2)) for _ in range(n)] for n in sizes]
    memory = [[float(rng.choice([1, 1, 2])) for _ in range(n)] for n in sizes]
    edges = []
    for _ in range(rng.randint(1, 2 * len(sizes))):
        u, v = rng.sample(range(len(sizes)), 2)
        edges.append(Edge(u, v, [[0.0 if i == j else float(rng.randint(0, 1)) for j in range(sizes[v])]
                                 for i in range(sizes[u])]))
    names = [f"op_{seed}_{g}" for g in range(len(sizes))]
    choice_names = [rng.sample(CHOICE_LABELS, n) for n in sizes]
    problem = IntraOpProblem(costs, memory, edges, names=names, choice_names=choice_names)
    if budget:
        least, most = sum(min(m) for m in memory), sum(max(m) for m in memory)
        problem.memory_budget = math.floor((least + most) / 2) + 0.5
    return problem


def permuted(problem: IntraOpProblem, seed: int) -> tuple[IntraOpProblem, list[int], list[list[int]]]:
    """The problem with its groups, each group's choices and its edges shuffled; returns the
    new problem, ``groups`` (new position -> old group) and ``orders[old group]`` (new choice
    index -> old choice index)."""
    rng = random.Random(seed)
    groups = list(range(problem.num_groups))
    rng.shuffle(groups)
    where = {old: new for new, old in enumerate(groups)}
    orders = []
    for g in range(problem.num_groups):
        order = list(range(problem.num_choices(g)))
        rng.shuffle(order)
        orders.append(order)

    def pick(values: list, g: int) -> list:
        return [values[i] for i in orders[g]]

    edges = [Edge(where[e.src], where[e.dst],
                  [[e.cost[i][j] for j in orders[e.dst]] for i in orders[e.src]])
             for e in reversed(problem.edges)]
    shuffled = IntraOpProblem(
        [pick(problem.costs[g], g) for g in groups], [pick(problem.memory[g], g) for g in groups],
        edges, problem.memory_budget, [problem.names[g] for g in groups],
        [pick(problem.choice_names[g], g) for g in groups])
    return shuffled, groups, orders


def mapped_back(choices: list[int], groups: list[int], orders: list[list[int]]) -> list[int]:
    original = [0] * len(groups)
    for new, old in enumerate(groups):
        original[old] = orders[old][choices[new]]
    return original


@pytest.mark.parametrize("budget", [False, True])
@pytest.mark.parametrize("seed", range(25))
def test_highs_and_cbc_return_the_same_canonical_optimum(seed: int, budget: bool) -> None:
    problem = tied_problem(seed, budget)
    exact = brute_force(problem)
    solutions = [solve_intra_op(problem, solver=solver) for solver in SOLVERS]
    assert solutions[0].choices == solutions[1].choices == exact.choices
    for sol in solutions:
        assert sol.objective == pytest.approx(exact.objective, rel=1e-9, abs=1e-12)
        assert sol.memory == exact.memory
        if problem.memory_budget is not None:
            assert sol.memory <= problem.memory_budget


@pytest.mark.parametrize("seed", range(20))
def test_permuting_groups_and_choices_gives_the_same_assignment(seed: int) -> None:
    problem = tied_problem(seed, budget=seed % 2 == 1)
    reference = solve_intra_op(problem).choices
    for shuffle in range(3):
        shuffled, groups, orders = permuted(problem, 100 * seed + shuffle)
        for solver in SOLVERS:
            sol = solve_intra_op(shuffled, solver=solver)
            assert mapped_back(sol.choices, groups, orders) == reference


@pytest.mark.parametrize("seed", range(20))
def test_canonical_objective_is_the_optimum(seed: int) -> None:
    problem = tied_problem(seed, budget=True)
    raw = solve_intra_op(problem, canonical=False)
    canonical = solve_intra_op(problem)
    assert canonical.objective == pytest.approx(raw.objective, rel=1e-9, abs=1e-12)
    if problem.memory_budget is not None:
        assert canonical.memory <= problem.memory_budget
    assert canonical.objective == pytest.approx(brute_force(problem).objective, rel=1e-9, abs=1e-12)
    assert evaluate(problem, canonical.choices) == (canonical.objective, canonical.memory)


def _with_tied_peaks(seed: int) -> IntraOpProblem:
    """A tied problem with 1-2 integral peak rows and a budget between the least and the most
    its peak could need, so that some answers are bounded by a tightened budget."""
    problem = tied_problem(seed)
    rng = random.Random(seed + 7)
    problem.peaks = [PeakRow({g: [float(rng.randint(0, 3)) for _ in problem.costs[g]]
                              for g in rng.sample(range(problem.num_groups), rng.randint(1, problem.num_groups))},
                             0.0) for _ in range(rng.randint(1, 2))]
    least = least_memory(problem)
    most = math.fsum(max(m) for m in problem.memory) + max(row.most() for row in problem.peaks)
    problem.memory_budget = math.floor((least + most) / 2) + 0.5
    return problem


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("seed", range(20))
def test_breaking_the_ties_of_a_found_optimum_gives_the_canonical_solve(seed: int, solver: str) -> None:
    """canonical_solution (the tie-break of an optimum found before, as the planner breaks the
    chosen mesh's ties) returns what one canonical solve returns, with budgets, peak rows and
    tightened budgets among the problems."""
    problems = [tied_problem(seed), tied_problem(seed, budget=True), _with_tied_peaks(seed)]
    for problem in problems:
        try:
            found = solve_intra_op(problem, solver=solver, canonical=False)
        except MemoryInfeasibleError:
            continue
        broken = canonical_solution(problem, found, solver)
        assert broken.choices == solve_intra_op(problem, solver=solver).choices
        assert broken.objective == pytest.approx(found.objective, rel=1e-9, abs=1e-12)
        assert broken.kept_budget == found.kept_budget
        assert problem.memory_budget is None or broken.peak <= problem.memory_budget


def test_less_memory_wins_a_tie_then_the_choice_name() -> None:
    # both groups tie on cost in every consistent pair; off-diagonal pairs cost more
    edge = Edge(0, 1, [[0.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    problem = IntraOpProblem([[1.0] * 3, [1.0] * 3], [[4.0, 2.0, 2.0], [4.0, 2.0, 2.0]], [edge],
                             names=["a", "b"], choice_names=[["R", "S1", "S0"], ["R", "S1", "S0"]])
    for solver in SOLVERS:
        assert solve_intra_op(problem, solver=solver).choices == [2, 2]  # S0: least memory, then name
    problem.memory = [[1.0, 2.0, 2.0], [1.0, 2.0, 2.0]]
    for solver in SOLVERS:
        assert solve_intra_op(problem, solver=solver).choices == [0, 0]  # R now needs the least


def test_a_cheaper_assignment_is_never_traded_for_less_memory() -> None:
    problem = IntraOpProblem([[1.0, 1.0 + 1e-6]], [[2.0, 1.0]], [], names=["a"],
                             choice_names=[["R", "S0"]])
    assert solve_intra_op(problem).choices == [0]
    problem = IntraOpProblem([[1.0, 1.0], [0.0, 0.0]], [[2.0, 1.0], [1.0, 1.0]],
                             [Edge(0, 1, [[0.0, 1e-6], [1e-6, 1e-6]])])
    for solver in SOLVERS:
        assert solve_intra_op(problem, solver=solver).choices == [0, 0]


def test_weights_order_each_group_by_memory_then_name() -> None:
    problem = IntraOpProblem([[0.0] * 4], [[3.0, 1.0, 1.0, 2.0]], [], names=["g"],
                             choice_names=[["R", "S1", "S0", "P"]])
    assert choice_ranks(problem, 0) == [3, 1, 0, 2]
    weights = tie_break_weights(problem)[0]
    assert sorted(range(4), key=weights.__getitem__) == [2, 1, 3, 0]
    assert all(RANK_STRIDE * r <= w < RANK_STRIDE * (r + 1)
               for r, w in zip(choice_ranks(problem, 0), weights))


def test_data_parallel_mlp_input_is_batch_sharded() -> None:
    """The MLP of the DTensor checks' "mlp_dp_2" case: batch and sequence sharding and a
    replicated input sliced for free all cost the same; the canonical plan shards the batch."""
    pytest.importorskip("torch")
    import autoplan

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    try:
        import mlp
    finally:
        sys.path.pop(0)
    plans = []
    for solver in SOLVERS:
        model, inputs = mlp.build(hidden=64, batch=64, seq=128)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plans.append(autoplan.plan(model, inputs, devices=2, cluster="cpu", mesh=(2,),
                                       loss_fn=mlp.loss_fn, solver=solver, plan_only=True))
    for plan in plans:
        assert plan.inputs["x"] == ["S(0)"]
        assert all(spec == ["R"] for spec in plan.params.values())
    assert plans[0].inputs == plans[1].inputs and plans[0].params == plans[1].params
