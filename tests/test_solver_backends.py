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
