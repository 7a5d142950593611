"""The ILP solvers pulp can run for us: their names, which one runs, and how it is set up.

HiGHS (``highspy``, the default) and CBC (the binary pulp bundles) both run single-threaded,
so a solve is deterministic for a given build. HiGHS solves the linear relaxation first
(:class:`RelaxationFirstHiGHS`): where its optimum is integral it is the ILP's optimum, proven,
at a third of the branch-and-bound's time on the intra-op models, whose relaxation is mostly
integral; elsewhere the ILP is solved as before. A name is checked in one place,
:func:`check_solver_name`; when the requested solver cannot run the other one does, and a
:class:`SolverFallbackWarning` says so.
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Iterator
from typing import Literal, cast, get_args

import pulp

from autoplan.errors import AutoplanError
from autoplan.stdout_redirect import stdout_fd_redirected

SolverName = Literal["highs", "cbc"]
SOLVER_NAMES: tuple[SolverName, ...] = get_args(SolverName)
DEFAULT_MIP_GAP = 1e-7  # relative gap the solver must prove before it reports "optimal"
HIGHS_ABS_GAP = 1e-9  # absolute gap, in units of the largest objective coefficient (P5)
EXACT_FEASIBILITY_TOL = 1e-10  # tie-break solves: rows (5)-(6) hold to this, not to 1e-7
# pulp 3.3 deprecates its bundled CBC, which is the CBC we want; only that warning is silenced
_CBC_DEPRECATION = r"PULP_CBC_CMD is deprecated"


class SolverFallbackWarning(UserWarning):
    """The requested ILP solver cannot run here; the other one runs instead."""


def check_solver_name(name: object) -> SolverName:
    """``name`` as a SolverName; AutoplanError naming the bad value and the valid ones."""
    if name not in SOLVER_NAMES:
        raise AutoplanError(f"unknown solver {name!r}: use one of {', '.join(SOLVER_NAMES)}")
    return cast(SolverName, name)


@contextlib.contextmanager
def _cbc_deprecation_silenced() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_CBC_DEPRECATION, category=DeprecationWarning)
        yield


def _highs_banner_silenced() -> None:
    """HiGHS prints its banner on stdout when a process creates its first solver, before pulp
    can turn its output off (``msg=False``): create a solver here, before pulp's, with stdout
    pointed at the null device, so that the command's stdout holds only what it means to print.
    Later creations print nothing; one costs about 0.2 ms."""
    import highspy

    with open(os.devnull, "w") as null, stdout_fd_redirected(null.fileno()):
        highspy.Highs()


INTEGRALITY_TOL = 1e-9  # a relaxed binary this close to 0 or 1 counts as integral


class RelaxationFirstHiGHS(pulp.HiGHS):
    """pulp's HiGHS that first solves the model with its integer columns relaxed to continuous.
    An optimal relaxation whose integer columns all lie within INTEGRALITY_TOL of an integer is
    an optimum of the ILP (it is feasible, and no integer point beats the relaxation), and its
    objective the proven bound (``relaxation_bound``); otherwise the integer columns are
    restored and the ILP is solved from the start (``relaxation_bound`` None), from the
    variables' current values as its first incumbent with ``warm_start`` (the canonical
    tie-break starts from the optimum it breaks the tie of: it is feasible there, and the
    search only has to prove it or beat it, in half the time on a 20,000-variable model)."""

    relaxation_bound: float | None = None

    def __init__(self, *args: object, warm_start: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.warm_start = warm_start

    def buildSolverModel(self, lp: pulp.LpProblem) -> None:  # noqa: N802 - pulp's name
        """pulp's model for HiGHS, the same columns, bounds, costs and rows in the same order as
        pulp's own ``buildSolverModel`` gives, passed in two calls instead of one per column and
        one per row."""
        import highspy
        import numpy as np

        inf = highspy.kHighsInf
        highs = lp.solverModel
        columns = lp.variables()
        sign = -1.0 if lp.sense == pulp.LpMaximize else 1.0
        objective = lp.objective if lp.objective is not None else {}
        for index, var in enumerate(columns):
            var.index = index
        costs = np.array([sign * objective.get(var, 0.0) for var in columns], dtype=np.float64)
        lower = np.array([-inf if var.lowBound is None else var.lowBound for var in columns], dtype=np.float64)
        upper = np.array([inf if var.upBound is None else var.upBound for var in columns], dtype=np.float64)
        none_int, none_float = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64)
        highs.addCols(len(columns), costs, lower, upper, 0, none_int, none_int, none_float)
        integer = np.array([var.index for var in columns if var.cat == pulp.LpInteger], dtype=np.int32)
        if integer.size and self.mip:
            kinds = np.full(integer.size, highspy.HighsVarType.kInteger)
            highs.changeColsIntegrality(integer.size, integer, kinds)
        starts, indices, values, row_lower, row_upper = [], [], [], [], []
        for index, constraint in enumerate(lp._constraints.values()):
            constraint.index = index
            starts.append(len(indices))
            for var, coefficient in constraint.items():
                if coefficient != 0:
                    indices.append(var.index)
                    values.append(coefficient)
            lb, ub = constraint.getLb(), constraint.getUb()
            row_lower.append(-inf if lb is None else lb)
            row_upper.append(inf if ub is None else ub)
        if starts:
            highs.addRows(len(starts), np.array(row_lower, dtype=np.float64), np.array(row_upper, dtype=np.float64),
                          len(indices), np.array(starts, dtype=np.int32), np.array(indices, dtype=np.int32),
                          np.array(values, dtype=np.float64))

    def callSolver(self, lp: pulp.LpProblem) -> None:  # noqa: N802 - pulp's name
        import highspy
        import numpy as np

        highs = lp.solverModel
        self.relaxation_bound = None
        variables = lp.variables()  # in column order: pulp numbered them so
        integer = np.array([var.index for var in variables if var.cat == pulp.LpInteger], dtype=np.int32)
        if integer.size and self.mip:
            kinds = highspy.HighsVarType
            highs.changeColsIntegrality(integer.size, integer, np.full(integer.size, kinds.kContinuous))
            started = time.perf_counter()
            highs.run()
            if highs.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                values = np.asarray(highs.getSolution().col_value)[integer]
                if np.all(np.abs(values - np.round(values)) <= INTEGRALITY_TOL):
                    self.relaxation_bound = float(highs.getInfo().objective_function_value)
                    return
            highs.changeColsIntegrality(integer.size, integer, np.full(integer.size, kinds.kInteger))
            # HiGHS 1.16 may report the branch-and-bound's objective beside a stale solution
            # of the relaxation's run unless its solver state is cleared in between
            highs.clearSolver()
            if self.timeLimit is not None:  # the time limit covers both runs
                highs.setOptionValue("time_limit", max(1e-3, float(self.timeLimit) - (time.perf_counter() - started)))
        if self.warm_start:
            start = highspy.HighsSolution()
            start.col_value = [var.varValue or 0.0 for var in variables]
            start.value_valid = True
            highs.setSolution(start)
        highs.run()


def solver_available(name: SolverName) -> bool:
    """Whether pulp can run ``name`` here (HiGHS needs highspy; CBC its bundled binary)."""
    if name == "highs":
        return bool(pulp.HiGHS(msg=False).available())
    with _cbc_deprecation_silenced():
        return bool(pulp.PULP_CBC_CMD(msg=False).available())


def pick_solver(requested: object) -> SolverName:
    """The requested solver if pulp can run it, else the other one with a warning."""
    name = check_solver_name(requested)
    if solver_available(name):
        return name
    for other in SOLVER_NAMES:
        if other != name and solver_available(other):
            warnings.warn(f"ILP solver {name!r} is not available here; solving with {other!r} "
                          "instead", SolverFallbackWarning, stacklevel=3)
            return other
    raise AutoplanError("no ILP solver can run: install highspy, or pulp with its bundled CBC")


def make_backend(name: SolverName, time_limit_s: float | None, mip_gap: float | None,
                 log_path: str, exact_abs_gap: float | None = None, warm_start: bool = False) -> pulp.LpSolver:
    """A pulp solver object. With ``exact_abs_gap`` (the tie-break solves): no relative gap,
    that absolute gap, and rows held to EXACT_FEASIBILITY_TOL instead of the default 1e-7.
    ``warm_start``: HiGHS starts from the variables' current values (CBC ignores it)."""
    exact = exact_abs_gap is not None
    gap_rel = 0.0 if exact else (DEFAULT_MIP_GAP if mip_gap is None else mip_gap)
    if name == "highs":
        _highs_banner_silenced()
        extra = {"primal_feasibility_tolerance": EXACT_FEASIBILITY_TOL} if exact else {}
        return RelaxationFirstHiGHS(msg=False, timeLimit=time_limit_s, gapRel=gap_rel,
                                    gapAbs=exact_abs_gap if exact else HIGHS_ABS_GAP, threads=1,
                                    warm_start=warm_start, **extra)
    options = [f"primalTolerance {EXACT_FEASIBILITY_TOL:g}"] if exact else []
    with _cbc_deprecation_silenced():
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel,
                                 gapAbs=exact_abs_gap, threads=1, logPath=log_path,
                                 options=options)
