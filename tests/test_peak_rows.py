"""Peak rows of the intra-op ILP (autoplan/solvers/intra_op/ilp.py, rows (4) and (6)): the
budget bounds the kept memory plus the largest row, the moment the backward holds the most;
exactly (the rows added lazily) or by tightening the budget (the default)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autoplan.errors import MemoryInfeasibleError
from autoplan.solvers.intra_op import (IntraOpProblem, PeakRow, brute_force, evaluate, least_memory, reduce_problem,
    solve_intra_op, transient)
from test_intra_op_ilp import assert_same_optimum, random_problem


def random_pairs(problem: IntraOpProblem, rng: random.Random) -> dict[tuple[int, int], list[list[float]]]:
    """0-2 pair terms between random different groups (either orientation), integral, most
    entries 0 as a gathered parameter's are where storage and read agree."""
    if problem.num_groups < 2:
        return {}
    pairs = {}
    for _ in range(rng.randint(0, 2)):
        u, v = rng.sample(range(problem.num_groups), 2)
        pairs[u, v] = [[float(rng.choice([0, 0, rng.randint(1, 30)])) for _ in problem.costs[v]]
                       for _ in problem.costs[u]]
    return pairs


def with_peaks(seed: int, budget_share: float) -> IntraOpProblem:
    """A random problem with 1-4 integral peak rows over random groups, its budget at a
    half-integer between the least and the most any assignment's peak could need."""
    problem = random_problem(seed)
    rng = random.Random(seed + 1)
    groups = range(problem.num_groups)
    problem.peaks = [PeakRow({g: [float(rng.randint(0, 40)) for _ in problem.costs[g]]
                              for g in rng.sample(groups, rng.randint(1, problem.num_groups))},
                             float(rng.randint(0, 5)), random_pairs(problem, rng))
                     for _ in range(rng.randint(1, 4))]
    least = least_memory(problem)
    most = math.fsum(max(m) for m in problem.memory) + max(row.most() for row in problem.peaks)
    problem.memory_budget = math.floor(least + budget_share * (most - least)) + 0.5
    return problem


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget_share=st.floats(0.0, 1.0))
def test_the_ilp_with_peak_rows_matches_brute_force(seed: int, budget_share: float) -> None:
    problem = with_peaks(seed, budget_share)
    try:
        exact = brute_force(problem)
    except MemoryInfeasibleError:
        for solver in ("highs", "cbc"):
            with pytest.raises(MemoryInfeasibleError, match="per device"):
                solve_intra_op(problem, solver=solver)
        return
    for solver in ("highs", "cbc"):
        sol = solve_intra_op(problem, solver=solver, exact_peaks=True)
        assert_same_optimum(sol.objective, exact.objective)
        assert sol.choices == exact.choices
        assert sol.transient == transient(problem, sol.choices) == max(row.value(sol.choices) for row in problem.peaks)
        assert sol.peak == pytest.approx(evaluate(problem, sol.choices)[1] + sol.transient)
        assert sol.peak <= problem.memory_budget


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget_share=st.floats(0.0, 1.0))
def test_the_tightened_budget_fits_the_peak_and_is_never_better_than_the_optimum(seed: int,
                                                                                  budget_share: float) -> None:
    """The default: the budget tightened by the answer's own transient. Its answer always fits
    the peak; it may cost more than the exact optimum (a plan that keeps more and holds less in
    its largest moment), never less."""
    problem = with_peaks(seed, budget_share)
    try:
        exact = brute_force(problem)
    except MemoryInfeasibleError:
        with pytest.raises(MemoryInfeasibleError):
            solve_intra_op(problem)
        return
    sol = solve_intra_op(problem)
    assert sol.peak <= problem.memory_budget
    assert sol.objective >= exact.objective - 1e-9


def test_a_peak_row_makes_the_solver_give_up_speed_for_a_smaller_moment() -> None:
    # group 0: fast (1 byte kept) or slow (2 bytes kept); the fast choice holds 10 bytes at a moment
    problem = IntraOpProblem([[1.0, 2.0]], [[1.0, 2.0]], [], memory_budget=None,
                             peaks=[PeakRow({0: [10.0, 3.0]})])
    assert solve_intra_op(problem).choices == [0]  # no budget: the rows do not bind
    problem.memory_budget = 8.0
    sol = solve_intra_op(problem)
    assert sol.choices == [1] and sol.memory == 2.0 and sol.transient == 3.0 and sol.peak == 5.0
    problem.memory_budget = 4.0
    with pytest.raises(MemoryInfeasibleError, match="transients"):
        solve_intra_op(problem)


def test_preprocessing_folds_fixed_groups_and_drops_rows_that_cannot_be_the_largest() -> None:
    problem = IntraOpProblem([[1.0], [1.0, 2.0]], [[1.0], [1.0, 2.0]], [], memory_budget=3.5,
                             peaks=[PeakRow({0: [5.0], 1: [0.0, 1.0]}),  # 5..6
                                    PeakRow({1: [1.0, 2.0]}),  # 1..2: never above 5, dropped
                                    PeakRow({1: [0.0, 1.0]}, 5.0)])  # the first again, once the fixed group folds
    reduced = reduce_problem(problem)
    assert [(row.terms, row.constant) for row in reduced.peaks] == [({1: [0.0, 1.0]}, 5.0)]


def test_rows_are_validated() -> None:
    with pytest.raises(ValueError, match="peak row 0 names group 3"):
        IntraOpProblem([[1.0]], [[1.0]], [], peaks=[PeakRow({3: [1.0]})])
    with pytest.raises(ValueError, match="peak row 0 has 2 entries"):
        IntraOpProblem([[1.0]], [[1.0]], [], peaks=[PeakRow({0: [1.0, 2.0]})])
    with pytest.raises(ValueError, match="cannot be negative"):
        IntraOpProblem([[1.0]], [[1.0]], [], peaks=[PeakRow({0: [-1.0]})])


def test_a_pair_term_keeps_the_two_groups_from_the_pair_that_holds_a_gathered_copy() -> None:
    """Group 0 stores a parameter whole (choice 0: 9.5 bytes kept) or sharded (choice 1: 2
    bytes); its consumer, group 1, reads it whole (choice 0: fast) or sharded (choice 1: 5 s
    slower). Storing it sharded and reading it whole gathers a copy of 8 bytes at the moment
    (the pair term): under a budget of 10 bytes only reading it sharded fits, under 11 the
    gathered copy fits beside the shard."""
    problem = IntraOpProblem([[0.0, 0.0], [0.0, 5.0]], [[9.5, 2.0], [0.0, 0.0]], [], memory_budget=10.0,
                             peaks=[PeakRow({}, 1.0, {(0, 1): [[0.0, 0.0], [8.0, 0.0]]})])
    assert brute_force(problem).choices == [1, 1]
    for solver in ("highs", "cbc"):
        sol = solve_intra_op(problem, solver=solver, exact_peaks=True)
        assert sol.choices == [1, 1] and sol.peak == 3.0
        assert solve_intra_op(problem, solver=solver).choices == [1, 1]
    problem.memory_budget = 11.0
    assert brute_force(problem).choices == [1, 0]
    for solver in ("highs", "cbc"):
        sol = solve_intra_op(problem, solver=solver, exact_peaks=True)
        assert sol.choices == [1, 0] and sol.peak == 11.0
    assert PeakRow({}, 1.0, {(1, 0): [[0.0, 8.0], [0.0, 0.0]]}).value([1, 0]) == 9.0  # either orientation


def test_pairs_are_validated() -> None:
    with pytest.raises(ValueError, match="two different groups"):
        IntraOpProblem([[1.0, 2.0]], [[1.0, 1.0]], [], peaks=[PeakRow({}, 0.0, {(0, 0): [[1.0, 0.0], [0.0, 1.0]]})])
    with pytest.raises(ValueError, match="is not 2 x 1"):
        IntraOpProblem([[1.0, 2.0], [1.0]], [[1.0, 1.0], [1.0]], [], peaks=[PeakRow({}, 0.0, {(0, 1): [[1.0]]})])
    with pytest.raises(ValueError, match="cannot be negative"):
        IntraOpProblem([[1.0], [1.0]], [[1.0], [1.0]], [], peaks=[PeakRow({}, 0.0, {(0, 1): [[-1.0]]})])


def test_a_fractional_relaxation_that_passes_the_peak_starts_the_tightening_at_its_transient(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Two groups: fast and large (6 bytes kept, 3 held at the peak) or slow and small (2 bytes).
    Under 10 bytes the relaxation takes 1.5 of the large choices (fractional); its likeliest
    assignment, both large, holds 6 at the peak: the budget is tightened by 6 before any
    branch-and-bound, and the one that follows finds the answer."""
    import autoplan.solvers.intra_op.solve as solve_module

    runs: list[bool] = []
    run_model = solve_module.run_model

    def counted(*args: object, **kwargs: object) -> object:
        runs.append(bool(kwargs.get("branch", True)))
        return run_model(*args, **kwargs)

    monkeypatch.setattr(solve_module, "run_model", counted)
    problem = IntraOpProblem([[0.0, 1.0], [0.0, 1.0]], [[6.0, 2.0], [6.0, 2.0]], [], memory_budget=10.0,
                             peaks=[PeakRow({0: [3.0, 0.0], 1: [3.0, 0.0]})])
    sol = solve_intra_op(problem, canonical=False)
    assert sol.choices == [1, 1] and sol.peak == 4.0
    assert runs == [False, True]  # the relaxation alone, then one branch-and-bound
    assert sol.objective == brute_force(problem).objective
