"""solve_intra_op: check, preprocess, build, solve, canonicalise, report.

The reported objective and memory are recomputed exactly from the problem data, never read
from the LP.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pulp

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.solvers.intra_op.backends import SolverName, pick_solver
from autoplan.solvers.intra_op.canonical import canonicalize
from autoplan.solvers.intra_op.ilp import IlpModel, add_peak_row, build_model, violated_peak_row
from autoplan.solvers.intra_op.preprocess import ReducedProblem, reduce_problem
from autoplan.solvers.intra_op.problem import (IntraOpProblem, IntraOpSolution, check_memory_feasible, evaluate,
    fits_budget, least_memory, takes_forbidden_pair, transient)
from autoplan.solvers.intra_op.run import SolverRun, extract_choices, likeliest_choices, run_model
from autoplan.solvers.units import format_bytes


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
                solver: str, seconds: float, num_variables: int, num_constraints: int,
                kept_budget: float | None = None) -> IntraOpSolution:
    """An IntraOpSolution whose objective, memory and transient are evaluated exactly from ``choices``."""
    if takes_forbidden_pair(problem, choices):
        raise RuntimeError("the ILP's answer takes a pair of choices an edge forbids; this is a bug in autoplan")
    objective, memory = evaluate(problem, choices)
    return IntraOpSolution(choices, objective, memory, status, gap, solver, seconds,
                           num_variables, num_constraints, transient(problem, choices), kept_budget)


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
    exact_peaks: bool = False,
) -> IntraOpSolution:
    """Solve the ILP of :mod:`~autoplan.solvers.intra_op.ilp` for ``problem``.

    ``solver`` is "highs" (default) or "cbc"; when pulp cannot run it the other one runs, with
    a SolverFallbackWarning, and ``solution.solver`` says which. ``mip_gap`` loosens the
    relative gap the solver must prove (default DEFAULT_MIP_GAP). With ``canonical`` (default)
    a proven optimum is replaced by the canonical one among the assignments that tie with it
    (:mod:`~autoplan.solvers.intra_op.canonical`); ``solve_time_s`` includes those solves.
    Raises MemoryInfeasibleError when no plan fits the budget and SolverTimeoutError when the
    time limit passed before any plan was found.

    Peak rows bound the budget by tightening it (:func:`_solve_tightened`, fast) unless
    ``exact_peaks`` or the tightening finds no plan; then by the rows themselves, added lazily
    (:func:`_solve_with_lazy_peaks`, exact). The canonical tie-break keeps its answer only where
    that fits the peak too.
    """
    problem.validate()
    _check_solver_arguments(time_limit_s, mip_gap)
    chosen_solver = pick_solver(solver)
    check_memory_feasible(problem)
    reduced = reduce_problem(problem)
    if not reduced.active:
        choices = [reduced.fixed[g] for g in range(problem.num_groups)]
        if not fits_budget(problem, choices):
            raise _no_peak_fits(problem)
        return solution_of(problem, choices, "optimal", 0.0, chosen_solver, 0.0, 0, 0)
    tightened = None if exact_peaks else _solve_tightened(problem, chosen_solver, time_limit_s, mip_gap)
    if tightened is None:
        solved = _solve_with_lazy_peaks(problem, reduced, chosen_solver, time_limit_s, mip_gap)
    else:
        solved = tightened
    model, run, choices, seconds = solved.model, solved.run, solved.choices, solved.seconds
    num_variables, num_constraints = model.num_columns, model.num_rows
    status = solution_status(run.sol_status, time_limit_s)
    objective, _ = evaluate(problem, choices)
    gap = _reported_gap(status, objective, run, model, solved.reduced, mip_gap)
    if canonical and status == "optimal":
        tie_broken = canonicalize(solved.problem, solved.reduced, model, choices, chosen_solver, time_limit_s)
        seconds += tie_broken.seconds
        if fits_budget(problem, tie_broken.choices):
            choices = tie_broken.choices
    kept_budget = solved.problem.memory_budget if tightened is not None else None
    return solution_of(problem, choices, status, gap, run.solver, seconds,
                       num_variables, num_constraints, kept_budget)


def canonical_solution(problem: IntraOpProblem, optimum: IntraOpSolution, solver: str = "highs",
                       time_limit_s: float | None = None) -> IntraOpSolution:
    """``optimum`` (what :func:`solve_intra_op` found for ``problem`` without the tie-break)
    with its ties broken canonically, as ``solve_intra_op(problem, canonical=True)`` breaks
    them, without solving for the optimum again: the tie-break's model is built anew, for the
    budget the optimum was proven under (``optimum.kept_budget``, else the problem's own, its
    peak rows added lazily), and its solve starts from the optimum's choices. An answer that
    is not proven optimal is returned as it is."""
    if optimum.status != "optimal":
        return optimum
    chosen_solver = pick_solver(solver)
    solved = problem if optimum.kept_budget is None else \
        replace(problem, memory_budget=optimum.kept_budget, peaks=[])
    reduced = reduce_problem(solved)
    if not reduced.active:
        return optimum
    model = build_model(solved, reduced)
    model.start_at(optimum.choices)
    tie_broken = canonicalize(solved, reduced, model, optimum.choices, chosen_solver, time_limit_s)
    choices = tie_broken.choices if fits_budget(problem, tie_broken.choices) else optimum.choices
    return solution_of(problem, choices, optimum.status, optimum.gap, optimum.solver,
                       optimum.solve_time_s + tie_broken.seconds, optimum.num_variables, optimum.num_constraints,
                       optimum.kept_budget)


@dataclass
class _Solved:
    """A solved model: the problem and reduction it was built from, its last run, its answer."""

    problem: IntraOpProblem
    reduced: ReducedProblem
    model: IlpModel
    run: SolverRun
    choices: list[int]
    seconds: float


TIGHTENINGS = 8  # most solves of the tightened budget before the exact rows take over


def _solve_tightened(problem: IntraOpProblem, solver: SolverName, time_limit_s: float | None,
                     mip_gap: float | None) -> _Solved | None:
    """The peak bounded by tightening the budget: the model without peak rows under ``M - T``,
    ``T`` starting at 0 and raised to each answer's transient while the answer's peak passes
    ``M`` (it then holds more than ``T``, so ``T`` grows every time). The answer is the optimum
    among the plans that keep at most ``M - T``, ``T`` its own transient: every plan that fits,
    except one that keeps more and holds less in the backward's largest moment (the exact rows,
    :func:`_solve_with_lazy_peaks`, find that one too, at many times the solver's time). None
    where the tightened budget admits no plan, or after ``TIGHTENINGS`` solves.

    With HiGHS the first model's relaxation is solved alone (an integral one is the answer, as
    ever): where it is fractional and its likeliest assignment (:func:`likeliest_choices`) does
    not fit, ``T`` starts at that assignment's transient, and the branch-and-bound under ``M``
    is skipped (on the stages of the Llama-70B shape the likeliest assignment's transient was
    the answer's every time, and its first branch-and-bound a third of the stage's time)."""
    if problem.memory_budget is None or not problem.peaks:
        return None
    held, seconds = 0.0, 0.0
    relaxed_first = solver == "highs"
    for _ in range(TIGHTENINGS):
        if held > problem.memory_budget:
            return None
        tight = replace(problem, memory_budget=problem.memory_budget - held, peaks=[])
        try:
            check_memory_feasible(tight)
        except MemoryInfeasibleError:
            return None
        reduced = reduce_problem(tight)
        if not reduced.active:
            return None
        model = build_model(tight, reduced)
        run = run_model(model, solver, time_limit_s, mip_gap, branch=not relaxed_first)
        seconds += run.seconds
        if relaxed_first:
            relaxed_first = False
            likely_transient = _likely_transient(problem, reduced, model, run)
            if likely_transient is not None:
                held = likely_transient
                continue
            if run.sol_status == pulp.LpSolutionNoSolutionFound:  # fractional: the branch-and-bound
                run = run_model(model, solver, time_limit_s, mip_gap)
                seconds += run.seconds
        if model.status == pulp.LpStatusInfeasible:
            return None
        solution_status(run.sol_status, time_limit_s)  # raises where there is no answer
        choices = extract_choices(model, reduced, problem.num_groups)
        if fits_budget(problem, choices):
            return _Solved(tight, reduced, model, run, choices, seconds)
        held = max(held, transient(problem, choices))
    return None


def _likely_transient(problem: IntraOpProblem, reduced: ReducedProblem, model: IlpModel, run: SolverRun
                      ) -> float | None:
    """The transient of a fractional relaxation's likeliest assignment, where that assignment
    does not fit the budget; else None (an integral relaxation is the answer, and is kept)."""
    if run.sol_status != pulp.LpSolutionNoSolutionFound or model.values is None:
        return None
    likely = likeliest_choices(model, reduced, problem.num_groups)
    held = transient(problem, likely)
    return None if held <= 0 or fits_budget(problem, likely) else held


def _solve_with_lazy_peaks(problem: IntraOpProblem, reduced: ReducedProblem, solver: SolverName,
                           time_limit_s: float | None, mip_gap: float | None) -> _Solved:
    """The model solved with its peak rows (6) added lazily (:mod:`~autoplan.solvers.intra_op.ilp`):
    first with none, then, while the answer's peak passes the budget, with the row it passes it
    by added, and solved again: the exact optimum under the peak rows."""
    model = build_model(problem, reduced)
    seconds = 0.0
    while True:
        run = run_model(model, solver, time_limit_s, mip_gap)
        seconds += run.seconds
        if model.status == pulp.LpStatusInfeasible and model.peaks:
            raise _no_peak_fits(problem)
        solution_status(run.sol_status, time_limit_s)  # raises where there is no answer
        choices = extract_choices(model, reduced, problem.num_groups)
        row = violated_peak_row(problem, reduced, model, choices)
        if row is None:
            return _Solved(problem, reduced, model, run, choices, seconds)
        add_peak_row(model, row, problem.memory_budget or 0.0)
