"""solve_intra_op: check, preprocess, build, solve, canonicalise, report.

The reported objective and memory are recomputed exactly from the problem data, never read
from the LP.
"""

from __future__ import annotations

import math

import pulp

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.solvers.intra_op.backends import pick_solver
from autoplan.solvers.intra_op.canonical import canonicalize
from autoplan.solvers.intra_op.ilp import IlpModel, build_model
from autoplan.solvers.intra_op.preprocess import ReducedProblem, reduce_problem
from autoplan.solvers.intra_op.problem import (IntraOpProblem, IntraOpSolution, check_memory_feasible, evaluate,
    least_memory, transient)
from autoplan.solvers.units import format_bytes
from autoplan.solvers.intra_op.run import SolverRun, extract_choices, run_model


class SolverTimeoutError(AutoplanError):
    """The ILP solver found no feasible plan within its time limit."""


def solution_status(sol_status: int, time_limit_s: float | None) -> str:
    """Map pulp's ``sol_status`` to "optimal" / "time_limit"; raise when there is no plan.

    pulp reports ``status == Optimal`` even when a time limit stopped the search with a
    feasible incumbent; only ``sol_status`` tells the two apart.
    """
    if sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit"
    if sol_status == pulp.LpSolutionNoSolutionFound:
        limit = "its limit" if time_limit_s is None else f"{time_limit_s:g} s"
        raise SolverTimeoutError(
            f"the ILP solver found no plan within {limit}; raise the time limit"
        )
    raise RuntimeError(
        f"the ILP solver returned {pulp.LpSolution.get(sol_status, sol_status)} for a model "
        "that has a feasible plan; this is a bug in autoplan"
    )


def relative_gap(objective: float, bound: float | None) -> float | None:
    """(objective - bound) / |objective|, the MIP gap of a feasible plan; None without a bound."""
    if bound is None or not math.isfinite(bound):
        return None
    if objective == 0:
        return 0.0
    return max(0.0, objective - bound) / abs(objective)


def _check_solver_arguments(time_limit_s: float | None, mip_gap: float | None) -> None:
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 or None, not {time_limit_s!r}")
    if mip_gap is not None and not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap must be in [0, 1) or None, not {mip_gap!r}")


def _reported_gap(status: str, objective: float, run: SolverRun, model: IlpModel,
                  reduced: ReducedProblem, mip_gap: float | None) -> float | None:
    """0.0 when proven optimal at the default gap; else the proven gap (None if unknown)."""
    if status == "optimal" and mip_gap is None:
        return 0.0
    bound = None if run.bound is None else run.bound * model.scale + reduced.constant
    gap = relative_gap(objective, bound)
    if status == "optimal" and gap is None:
        return mip_gap
    return gap


def solution_of(problem: IntraOpProblem, choices: list[int], status: str, gap: float | None,
                solver: str, seconds: float, num_variables: int, num_constraints: int
                ) -> IntraOpSolution:
    """An IntraOpSolution whose objective, memory and transient are evaluated exactly from ``choices``."""
    objective, memory = evaluate(problem, choices)
    return IntraOpSolution(choices, objective, memory, status, gap, solver, seconds,
                           num_variables, num_constraints, transient(problem, choices))


def _no_peak_fits(problem: IntraOpProblem) -> MemoryInfeasibleError:
    """The budget is infeasible with the peak rows (the lower bound of
    :func:`~autoplan.solvers.intra_op.problem.check_memory_feasible` did not show it)."""
    least = least_memory(problem)
    return MemoryInfeasibleError(
        f"no plan fits {format_bytes(problem.memory_budget or 0.0)} per device with the backward's transients "
        f"(at least {format_bytes(least)}, likely more); give more memory (--memory-per-device), more devices "
        "or more microbatches", least)


def solve_intra_op(
    problem: IntraOpProblem,
    solver: str = "highs",
    time_limit_s: float | None = None,
    mip_gap: float | None = None,
    canonical: bool = True,
) -> IntraOpSolution:
    """Solve the ILP of :mod:`~autoplan.solvers.intra_op.ilp` for ``problem``.

    ``solver`` is "highs" (default) or "cbc"; when pulp cannot run it the other one runs, with
    a SolverFallbackWarning, and ``solution.solver`` says which. ``mip_gap`` loosens the
    relative gap the solver must prove (default DEFAULT_MIP_GAP). With ``canonical`` (default)
    a proven optimum is replaced by the canonical one among the assignments that tie with it
    (:mod:`~autoplan.solvers.intra_op.canonical`); ``solve_time_s`` includes those solves.
    Raises MemoryInfeasibleError when no plan fits the budget and SolverTimeoutError when the
    time limit passed before any plan was found.
    """
    problem.validate()
    _check_solver_arguments(time_limit_s, mip_gap)
    chosen_solver = pick_solver(solver)
    check_memory_feasible(problem)
    reduced = reduce_problem(problem)
    if not reduced.active:
        choices = [reduced.fixed[g] for g in range(problem.num_groups)]
        return solution_of(problem, choices, "optimal", 0.0, chosen_solver, 0.0, 0, 0)
    model = build_model(problem, reduced)
    num_variables, num_constraints = len(model.lp.variables()), model.lp.numConstraints()
    run = run_model(model, chosen_solver, time_limit_s, mip_gap)
    if model.lp.status == pulp.LpStatusInfeasible and problem.peaks and reduced.budget_binding:
        raise _no_peak_fits(problem)
    status = solution_status(run.sol_status, time_limit_s)
    choices = extract_choices(model, reduced, problem.num_groups)
    objective, _ = evaluate(problem, choices)
    gap = _reported_gap(status, objective, run, model, reduced, mip_gap)
    seconds = run.seconds
    if canonical and status == "optimal":
        tie_broken = canonicalize(problem, reduced, model, choices, chosen_solver, time_limit_s)
        choices, seconds = tie_broken.choices, seconds + tie_broken.seconds
    return solution_of(problem, choices, status, gap, run.solver, seconds,
                       num_variables, num_constraints)
