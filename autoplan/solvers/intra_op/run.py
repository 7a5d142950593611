"""Running a solver on a built model: its status, its proven bound, the choices it made."""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

import pulp

from autoplan.solvers.intra_op.backends import RelaxationFirstHiGHS, SolverName, make_backend
from autoplan.solvers.intra_op.ilp import IlpModel
from autoplan.solvers.intra_op.preprocess import ReducedProblem


@dataclass
class SolverRun:
    solver: SolverName
    sol_status: int
    bound: float | None  # best bound in model units (scaled, without the constant)
    seconds: float


def parse_cbc_bound(log: str) -> float | None:
    """CBC's best bound from its log: the last "best possible X" (8 digits), else the
    "Lower bound:" line of the result summary (5 digits); None when neither is there."""
    for pattern in (r"best possible (\S+?)\)", r"^Lower bound:\s+(\S+)"):
        found = re.findall(pattern, log, flags=re.MULTILINE)
        if found:
            try:
                return float(found[-1])
            except ValueError:
                continue
    return None


def _highs_bound(lp: pulp.LpProblem, backend: pulp.LpSolver) -> float | None:
    """The proven bound: an integral relaxation's objective, else the branch-and-bound's."""
    if isinstance(backend, RelaxationFirstHiGHS) and backend.relaxation_bound is not None:
        return backend.relaxation_bound
    model = getattr(lp, "solverModel", None)
    return None if model is None else float(model.getInfo().mip_dual_bound)


def _cbc_bound(log_path: str) -> float | None:
    if not os.path.exists(log_path):
        return None
    with open(log_path) as f:
        return parse_cbc_bound(f.read())


def run_model(model: IlpModel, solver: SolverName, time_limit_s: float | None,
              mip_gap: float | None, exact_abs_gap: float | None = None, warm_start: bool = False) -> SolverRun:
    """Solve ``model.lp`` with its current objective (see :func:`make_backend` for the gaps and
    ``warm_start``)."""
    with tempfile.TemporaryDirectory(prefix="autoplan_ilp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        backend = make_backend(solver, time_limit_s, mip_gap, log_path, exact_abs_gap, warm_start)
        start = time.perf_counter()
        model.lp.solve(backend)
        seconds = time.perf_counter() - start
        bound = _highs_bound(model.lp, backend) if solver == "highs" else _cbc_bound(log_path)
    return SolverRun(solver, model.lp.sol_status, bound, seconds)


def extract_choices(model: IlpModel, reduced: ReducedProblem, num_groups: int) -> list[int]:
    """argmax of s per active group (lowest index on ties), fixed choices for the rest."""
    choices = [reduced.fixed.get(g, -1) for g in range(num_groups)]
    for g, variables in model.s.items():
        values = [x.varValue or 0.0 for x in variables]
        best = max(range(len(values)), key=lambda i: (values[i], -i))
        if values[best] < 0.5:
            raise RuntimeError(f"the ILP solver left group {g} without a choice ({values})")
        choices[g] = best
    return choices
