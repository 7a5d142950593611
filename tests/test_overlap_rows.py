"""Overlap rows of the intra-op ILP (autoplan/solvers/intra_op/ilp.py, rows (7) and (8)):
collectives that run beside compute hide ``min(comm(x), compute(x))`` seconds of the step."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.solvers.intra_op import (IntraOpProblem, OverlapRow, brute_force, evaluate, reduce_problem,
    solve_intra_op)
from autoplan.solvers.intra_op.problem import ChoiceSum
from test_intra_op_ilp import assert_same_optimum, random_problem
from test_peak_rows import random_pairs


def random_sum(problem: IntraOpProblem, rng: random.Random) -> ChoiceSum:
    groups = range(problem.num_groups)
    return ChoiceSum({g: [rng.choice([0.0, rng.uniform(0.0, 1.0)]) for _ in problem.costs[g]]
                      for g in rng.sample(groups, rng.randint(1, problem.num_groups))},
                     rng.choice([0.0, rng.uniform(0.0, 0.5)]),
                     {uv: [[x / 30 for x in row] for row in m] for uv, m in random_pairs(problem, rng).items()})


def with_overlaps(seed: int, budget_share: float | None) -> IntraOpProblem:
    problem = random_problem(seed, budget_share=budget_share)
    rng = random.Random(seed + 2)
    problem.overlaps = [OverlapRow(random_sum(problem, rng), random_sum(problem, rng), float(rng.randint(1, 3)))
                        for _ in range(rng.randint(1, 3))]
    return problem


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget_share=st.one_of(st.none(), st.floats(0.0, 1.0)))
def test_the_ilp_with_overlap_rows_matches_brute_force(seed: int, budget_share: float | None) -> None:
    problem = with_overlaps(seed, budget_share)
    exact = brute_force(problem)
    for solver in ("highs", "cbc"):
        sol = solve_intra_op(problem, solver=solver)
        assert_same_optimum(sol.objective, exact.objective)
        assert sol.objective == pytest.approx(evaluate(problem, sol.choices)[0])


def test_hiding_a_gather_makes_the_sharded_choice_the_faster_one() -> None:
    """Group 0 stores a parameter whole (0.5 s more for its memory traffic) or sharded (a 1 s
    gather); group 1 is the block before, computing for 0.8 s or 2 s. Without the row the whole
    parameter wins; with it the gather hides behind the compute: 1 - min(1, compute)."""
    costs = [[0.5, 1.0], [0.8, 2.0]]
    plain = IntraOpProblem(costs, [[1.0, 1.0], [1.0, 1.0]], [])
    assert solve_intra_op(plain).choices == [0, 0]
    row = OverlapRow(ChoiceSum({0: [0.0, 1.0]}), ChoiceSum({1: [0.8, 2.0]}))
    overlapped = IntraOpProblem(costs, [[1.0, 1.0], [1.0, 1.0]], [], overlaps=[row])
    sol = solve_intra_op(overlapped)
    assert sol.choices == [1, 0]
    assert sol.objective == pytest.approx(1.0 + 0.8 - 0.8)
    assert brute_force(overlapped).choices == [1, 0]


def test_rows_with_fixed_sums_become_a_constant_and_equal_rows_add_their_weights() -> None:
    fixed = OverlapRow(ChoiceSum({0: [0.3]}), ChoiceSum({}, 0.5))
    open_row = OverlapRow(ChoiceSum({1: [0.0, 1.0]}), ChoiceSum({}, 0.5))
    problem = IntraOpProblem([[1.0], [0.0, 0.2]], [[1.0], [1.0, 1.0]], [],
                             overlaps=[fixed, open_row, OverlapRow(open_row.comm, open_row.compute, 2.0)])
    reduced = reduce_problem(problem)
    assert reduced.constant == pytest.approx(1.0 - 0.3)
    assert [row.weight for row in reduced.overlaps] == [3.0]
    assert 1 in reduced.active  # its choice changes what is hidden: never decided alone
    assert solve_intra_op(problem).choices == [0, 1]  # 0.2 - 3 * 0.5 beats 0


def test_overlap_rows_are_validated() -> None:
    with pytest.raises(ValueError, match="overlap row 0's comm names group 3"):
        IntraOpProblem([[1.0]], [[1.0]], [], overlaps=[OverlapRow(ChoiceSum({3: [1.0]}), ChoiceSum({}))])
    with pytest.raises(ValueError, match="weight"):
        IntraOpProblem([[1.0]], [[1.0]], [], overlaps=[OverlapRow(ChoiceSum({}), ChoiceSum({}), 0.0)])


def test_prefetched_gathers_are_issued_at_their_op_and_taken_once() -> None:
    from autoplan.codegen.prefetched_gathers import PrefetchedGathers
    from autoplan.plan_schema import PrefetchedGather

    issued = []

    def gather(consumer: str, position: int) -> str:
        issued.append((consumer, position))
        return f"{consumer}.{position}"

    prefetched = PrefetchedGathers([PrefetchedGather("first_of_block_0", [("linear_2", 1), ("mul_3", 0)])], "cpu")
    prefetched.issue("linear_0", gather)  # no gathers issued there
    assert issued == [] and prefetched.take("linear_2", 1) is None
    prefetched.issue("first_of_block_0", gather)
    assert issued == [("linear_2", 1), ("mul_3", 0)]
    assert prefetched.take("linear_2", 1) == "linear_2.1"
    assert prefetched.take("linear_2", 1) is None  # a recomputed forward gathers again
    prefetched.clear()
    assert prefetched.take("mul_3", 0) is None
