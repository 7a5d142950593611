"""Solver names, availability and fallback, and the scoped silencing of pulp's CBC deprecation."""

from __future__ import annotations

import warnings

import pulp
import pytest

from autoplan.errors import AutoplanError
from autoplan.solvers import (
    SOLVER_NAMES,
    Edge,
    IntraOpProblem,
    check_solver_name,
    solve_intra_op,
)
from autoplan.solvers.intra_op import backends


def small_problem() -> IntraOpProblem:
    return IntraOpProblem([[1.0, 2.0], [2.0, 1.0]], [[1.0, 1.0], [1.0, 1.0]],
                          [Edge(0, 1, [[0.0, 3.0], [3.0, 0.0]])])


def test_solver_names_are_checked_in_one_place() -> None:
    assert SOLVER_NAMES == ("highs", "cbc")
    assert [check_solver_name(name) for name in SOLVER_NAMES] == ["highs", "cbc"]
    with pytest.raises(AutoplanError, match="^unknown solver 'HiGHS': use one of highs, cbc$"):
        check_solver_name("HiGHS")
    with pytest.raises(AutoplanError, match="unknown solver None"):
        solve_intra_op(small_problem(), solver=None)


@pytest.mark.parametrize("missing, runs", [("highs", "cbc"), ("cbc", "highs")])
def test_a_missing_solver_falls_back_with_a_warning(monkeypatch, missing: str, runs: str) -> None:
    monkeypatch.setattr(backends, "solver_available", lambda name: name != missing)
    with pytest.warns(backends.SolverFallbackWarning,
                      match=f"ILP solver '{missing}' is not available here; solving with '{runs}'"):
        solution = solve_intra_op(small_problem(), solver=missing)
    assert solution.solver == runs and solution.choices == [0, 0]


def test_an_available_solver_runs_without_a_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for name in SOLVER_NAMES:
            assert solve_intra_op(small_problem(), solver=name).solver == name


def test_only_pulps_cbc_deprecation_is_silenced() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with backends._cbc_deprecation_silenced():
            pulp.PULP_CBC_CMD(msg=False)
            warnings.warn("another API is deprecated", DeprecationWarning)
    assert [str(w.message) for w in caught] == ["another API is deprecated"]


def _highs_runs(monkeypatch) -> list[backends.HighsBackend]:
    """Every HiGHS backend the next solves make, kept to read after them."""
    made: list[backends.HighsBackend] = []
    make = backends.make_backend

    def keep(*args, **kwargs):
        backend = make(*args, **kwargs)
        made.append(backend)
        return backend
    monkeypatch.setattr("autoplan.solvers.intra_op.run.make_backend", keep)
    return made


def test_an_integral_relaxation_is_the_ilp_optimum(monkeypatch) -> None:
    """Three groups joined in a triangle of edges that charge for disagreeing: the relaxation
    is integral, and its optimum is taken as the ILP's, proven (gap 0), with no
    branch-and-bound."""
    made = _highs_runs(monkeypatch)
    disagree = [[0.0, 1.0], [1.0, 0.0]]
    problem = IntraOpProblem([[1.0, 2.0], [2.0, 1.0], [1.5, 1.0]], [[1.0, 1.0]] * 3,
                             [Edge(0, 1, [[3 * x for x in row] for row in disagree]),
                              Edge(1, 2, [[2 * x for x in row] for row in disagree]), Edge(0, 2, disagree)])
    solution = solve_intra_op(problem, solver="highs", canonical=False)
    assert solution.choices == [1, 1, 1] and solution.objective == pytest.approx(4.0)
    assert solution.status == "optimal" and solution.gap == 0.0
    assert [backend.relaxation_bound is not None for backend in made] == [True]


def test_a_fractional_relaxation_falls_back_to_the_ilp(monkeypatch) -> None:
    """Two groups sharing a budget that only one can spend on its cheap choice: the relaxation
    splits the budget (fractional), so the ILP runs after it: the optimum of the three plans
    that fit."""
    made = _highs_runs(monkeypatch)
    problem = IntraOpProblem([[1.0, 3.0], [1.0, 2.5]], [[2.0, 1.0], [2.0, 1.0]], [], memory_budget=3.5)
    solution = solve_intra_op(problem, solver="highs", canonical=False)
    assert solution.choices == [0, 1] and solution.objective == pytest.approx(3.5)
    assert made and made[0].relaxation_bound is None
