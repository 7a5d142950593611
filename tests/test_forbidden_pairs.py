"""Forbidden pairs of an edge (:class:`~autoplan.solvers.intra_op.problem.Edge`): no solver
answer takes one, and the ILP's optimum over the assignments that take none is brute force's."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from autoplan.solvers.intra_op import Edge, IntraOpProblem, brute_force, reduce_problem, solve_intra_op, trim_memory
from autoplan.solvers.intra_op.problem import takes_forbidden_pair
from test_intra_op_ilp import assert_same_optimum, random_problem


def _forbidding(problem: IntraOpProblem, seed: int, share: float = 0.4) -> tuple[IntraOpProblem, list[int]]:
    """``problem`` with a ``share`` of each edge's pairs forbidden (a self-edge's diagonal
    included: it excludes a choice), except those of one random assignment, which stays
    feasible; and that assignment."""
    rng = random.Random(seed)
    witness = [rng.randrange(problem.num_choices(g)) for g in range(problem.num_groups)]
    edges = []
    for e in problem.edges:
        pairs = frozenset((i, j) for i in range(problem.num_choices(e.src)) for j in range(problem.num_choices(e.dst))
                          if rng.random() < share and (i, j) != (witness[e.src], witness[e.dst]))
        edges.append(replace(e, forbidden=pairs))
    budget = None
    if problem.memory_budget is not None:  # at least the witness's memory
        budget = max(problem.memory_budget, math.fsum(problem.memory[g][i] for g, i in enumerate(witness)) + 0.5)
    return replace(problem, edges=edges, memory_budget=budget), witness


@pytest.mark.parametrize("seed", range(60))
def test_the_ilp_finds_brute_forces_optimum_among_the_pairs_allowed(seed: int) -> None:
    problem, _ = _forbidding(random_problem(seed, budget_share=0.5 if seed % 3 == 0 else None), seed)
    exact = brute_force(problem)
    assert not takes_forbidden_pair(problem, exact.choices)
    for solver in ("highs", "cbc"):
        found = solve_intra_op(problem, solver=solver)
        assert not takes_forbidden_pair(problem, found.choices), solver
        assert_same_optimum(found.objective, exact.objective)
        assert found.choices == exact.choices  # the canonical optimum of the allowed assignments


def test_forbidding_the_optimum_gives_the_next_best_pair() -> None:
    costs = [[0.0, 1.0], [0.0, 2.0]]
    edge = [[0.0, 5.0], [5.0, 0.0]]  # the ends agree, or pay 5
    free = IntraOpProblem(costs, [[1.0, 1.0], [1.0, 1.0]], [Edge(0, 1, edge)])
    assert solve_intra_op(free).choices == [0, 0]
    both = IntraOpProblem(costs, free.memory, [Edge(0, 1, edge, frozenset({(0, 0)}))])
    assert solve_intra_op(both).choices == [1, 1]  # 3 s, against 5 s for a disagreement


def test_a_pair_with_a_single_choice_end_excludes_the_other_ends_choice() -> None:
    """Preprocessing turns it into a bound on the other end's own choice; a self-edge's
    forbidden diagonal excludes its choice too."""
    problem = IntraOpProblem([[0.0], [0.0, 1.0, 2.0]], [[1.0], [1.0, 1.0, 1.0]],
                             [Edge(0, 1, [[0.0, 0.0, 0.0]], frozenset({(0, 0)})),
                              Edge(1, 1, [[0.0] * 3 for _ in range(3)], frozenset({(1, 1)}))])
    reduced = reduce_problem(problem)
    assert reduced.excluded == {1: frozenset({0, 1})} and not reduced.forbidden
    assert solve_intra_op(problem).choices == [0, 2]
    assert brute_force(problem).choices == [0, 2]


def test_a_forbidden_pair_out_of_range_is_refused() -> None:
    with pytest.raises(ValueError, match="forbids the pair"):
        IntraOpProblem([[0.0, 1.0], [0.0]], [[1.0, 1.0], [1.0]], [Edge(0, 1, [[0.0], [0.0]], frozenset({(0, 1)}))])


def test_trimming_memory_never_switches_into_a_forbidden_pair() -> None:
    """The cheapest switch per byte freed (group 1 to its small choice) takes a forbidden pair
    with group 0's choice: the walk frees the memory another way."""
    costs = [[0.0, 1.0], [0.0, 0.1]]
    memory = [[10.0, 5.0], [10.0, 4.0]]
    edges = [Edge(0, 1, [[0.0, 0.0], [0.0, 0.0]], frozenset({(0, 1)}))]
    free = trim_memory(IntraOpProblem(costs, memory, [Edge(0, 1, [[0.0, 0.0], [0.0, 0.0]])]), [0, 0], 15.5)
    assert free == [0, 1]
    assert trim_memory(IntraOpProblem(costs, memory, edges), [0, 0], 15.5) == [1, 0]
