"""The ILP solvers: their names, which one runs, and how it is set up.

HiGHS (``highspy``, the default, run on the model's arrays) and CBC (the binary pulp bundles,
through pulp's model) both run single-threaded, so a solve is deterministic for a given build;
CBC runs without its integer preprocessing, which returned a worse answer as optimal.
HiGHS solves the linear relaxation first (:class:`HighsBackend`): where its optimum is integral
it is the ILP's optimum, proven, at a fraction of the branch-and-bound's time on the intra-op
models, whose relaxation is mostly integral; elsewhere the ILP is solved as before. A name is
checked in one place, :func:`check_solver_name`; when the requested solver cannot run the
other one does, and a :class:`SolverFallbackWarning` says so.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import numpy as np
import pulp

from autoplan.errors import AutoplanError
from autoplan.stdout_redirect import stdout_fd_redirected

if TYPE_CHECKING:
    from autoplan.solvers.intra_op.ilp import IlpModel

SolverName = Literal["highs", "cbc"]
SOLVER_NAMES: tuple[SolverName, ...] = get_args(SolverName)
DEFAULT_MIP_GAP = 1e-7  # relative gap the solver must prove before it reports "optimal"
HIGHS_ABS_GAP = 1e-9  # absolute gap, in units of the largest objective coefficient (P5)
EXACT_FEASIBILITY_TOL = 1e-10  # tie-break solves: rows (5)-(6) hold to this, not to 1e-7
# HiGHS's branch-and-bound without restarts and without its RINS and RENS sub-MIP heuristics.
# The stage ILPs whose relaxation is fractional (a 2-D mesh's stage of the Llama-70B shape:
# 25,000 columns, a binding memory row) close at the root or within a few nodes; HiGHS spent
# most of their time in those heuristics and in restarting after reduced-cost fixing. Without
# them the exact phase's five slowest solves took 9.8 s instead of 17.1 s, to the same optima.
HIGHS_MIP_OPTIONS = {"mip_allow_restart": False, "mip_heuristic_run_rins": False, "mip_heuristic_run_rens": False}
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


@dataclass
class Answer:
    """What a solve left: pulp's status and solution status, the column values (None without
    any), and the proven bound in model units (None where unknown)."""

    status: int
    sol_status: int
    values: np.ndarray | None
    bound: float | None


def _highs_status(highs: Any) -> tuple[int, int]:
    """pulp's (status, solution status) for HiGHS's model status, as pulp's own HiGHS reads it:
    a time or iteration limit without a solution is "not solved"."""
    import highspy

    kind = highspy.HighsModelStatus
    status = highs.getModelStatus()
    if status == kind.kOptimal:
        return pulp.LpStatusOptimal, pulp.LpSolutionOptimal
    if status in (kind.kInfeasible, kind.kUnboundedOrInfeasible):
        return pulp.LpStatusInfeasible, pulp.LpSolutionInfeasible
    if status == kind.kUnbounded:
        return pulp.LpStatusUnbounded, pulp.LpSolutionUnbounded
    if status in (kind.kObjectiveBound, kind.kObjectiveTarget, kind.kInterrupt, kind.kTimeLimit,
                  kind.kIterationLimit):
        if status in (kind.kTimeLimit, kind.kIterationLimit) and highs.getObjectiveValue() == math.inf:
            return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
        return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible
    return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound


class HighsBackend:
    """HiGHS (``highspy``) run on the model's arrays, the linear relaxation first: its integer
    columns are relaxed to continuous and the relaxation solved by the simplex without presolve
    (on the stage search's layer models several times faster than with it). An optimal
    relaxation whose integer columns all lie within INTEGRALITY_TOL of an integer is an optimum
    of the ILP (it is feasible, and no integer point beats the relaxation), and its objective
    the proven bound (``relaxation_bound``); otherwise the integer columns are restored and the
    ILP is solved from the start with presolve (``relaxation_bound`` None), from the model's
    last values as its first incumbent with ``warm_start`` (before any, from its ``start``: an
    assignment's binaries, which HiGHS completes with the LP they leave) (the canonical tie-break starts
    from the optimum it breaks the tie of: it is feasible there, and the search only has to
    prove it or beat it, in half the time on a 20,000-variable model). Without ``branch`` a
    fractional relaxation is the answer: no solution, the relaxation's values."""

    relaxation_bound: float | None = None

    def __init__(self, time_limit_s: float | None, gap_rel: float, gap_abs: float,
                 options: dict[str, Any] | None = None, warm_start: bool = False, branch: bool = True) -> None:
        self.time_limit_s = time_limit_s
        self.options = {"output_flag": False, "mip_rel_gap": gap_rel, "mip_abs_gap": gap_abs, "threads": 1,
                        **HIGHS_MIP_OPTIONS, **(options or {})}
        if time_limit_s is not None:
            self.options["time_limit"] = float(time_limit_s)
        self.warm_start = warm_start
        self.branch = branch

    def _highs(self, model: IlpModel) -> Any:
        """A HiGHS instance holding the model's columns (costs, bounds) and rows, every column
        continuous (:meth:`solve` makes the binaries integer where the relaxation is not)."""
        import highspy

        highs = highspy.Highs()
        for key, value in self.options.items():
            highs.setOptionValue(key, value)
        n = model.num_columns
        none_int, none_float = np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.float64)
        highs.addCols(n, model.costs, np.zeros(n), model.upper, 0, none_int, none_int, none_float)
        starts, columns, coefficients, lower, upper = model.matrix()
        inf = highspy.kHighsInf
        if len(starts):
            highs.addRows(len(starts), np.where(np.isinf(lower), -inf, lower), np.where(np.isinf(upper), inf, upper),
                          len(columns), starts, columns, coefficients)
        return highs

    def solve(self, model: IlpModel) -> Answer:
        import highspy

        highs = self._highs(model)
        self.relaxation_bound = None
        integer = model.binaries
        kinds = highspy.HighsVarType
        if integer.size:
            highs.setOptionValue("presolve", "off")
            started = time.perf_counter()
            highs.run()
            highs.setOptionValue("presolve", "choose")
            if highs.getModelStatus() == highspy.HighsModelStatus.kOptimal:
                values = np.asarray(highs.getSolution().col_value)
                relaxed = values[integer]
                if np.all(np.abs(relaxed - np.round(relaxed)) <= INTEGRALITY_TOL):
                    self.relaxation_bound = float(highs.getInfo().objective_function_value)
                    return Answer(pulp.LpStatusOptimal, pulp.LpSolutionOptimal, values, self.relaxation_bound)
                if not self.branch:
                    return Answer(pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound, values, None)
            highs.changeColsIntegrality(integer.size, integer, np.full(integer.size, kinds.kInteger))
            # HiGHS 1.16 may report the branch-and-bound's objective beside a stale solution
            # of the relaxation's run unless its solver state is cleared in between
            highs.clearSolver()
            if self.time_limit_s is not None:  # the time limit covers both runs
                left = float(self.time_limit_s) - (time.perf_counter() - started)
                highs.setOptionValue("time_limit", max(1e-3, left))
        if self.warm_start and model.values is not None:
            start = highspy.HighsSolution()
            start.col_value = list(model.values)
            start.value_valid = True
            highs.setSolution(start)
        elif self.warm_start and model.start is not None:  # the binaries only: HiGHS solves for the rest
            columns, values = model.start
            highs.setSolution(len(columns), columns, values)
        highs.run()
        status, sol_status = _highs_status(highs)
        values = np.asarray(highs.getSolution().col_value) if sol_status != pulp.LpSolutionNoSolutionFound else None
        return Answer(status, sol_status, values, float(highs.getInfo().mip_dual_bound))


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
                 log_path: str, exact_abs_gap: float | None = None, warm_start: bool = False,
                 branch: bool = True) -> HighsBackend | pulp.LpSolver:
    """The backend that solves a model: :class:`HighsBackend`, or pulp's CBC. With
    ``exact_abs_gap`` (the tie-break solves): no relative gap, that absolute gap, and rows held
    to EXACT_FEASIBILITY_TOL instead of the default 1e-7. ``warm_start``: HiGHS starts from the
    model's last values; without ``branch`` it stops at a fractional relaxation (CBC ignores
    both)."""
    exact = exact_abs_gap is not None
    gap_rel = 0.0 if exact else (DEFAULT_MIP_GAP if mip_gap is None else mip_gap)
    if name == "highs":
        _highs_banner_silenced()
        extra = {"primal_feasibility_tolerance": EXACT_FEASIBILITY_TOL} if exact else {}
        return HighsBackend(time_limit_s, gap_rel, exact_abs_gap if exact else HIGHS_ABS_GAP, extra, warm_start,
                            branch)
    # CBC's integer preprocessing cut off the optimum of a 6-group model with a binding memory row
    # and reported the worse answer optimal (tests/test_intra_op_ilp.py: seed 479001599); without it
    # the branch-and-bound is exact
    options = ["preprocess off"] + ([f"primalTolerance {EXACT_FEASIBILITY_TOL:g}"] if exact else [])
    with _cbc_deprecation_silenced():
        return pulp.PULP_CBC_CMD(msg=False, timeLimit=time_limit_s, gapRel=gap_rel,
                                 gapAbs=exact_abs_gap, threads=1, logPath=log_path,
                                 options=options)
