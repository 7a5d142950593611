"""Running a solver on a built model: its status, its proven bound, the choices it made."""

from __future__ import annotations

import os
import re
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import pulp

from autoplan.solvers.intra_op.backends import Answer, HighsBackend, SolverName, make_backend
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


def _cbc_bound(log_path: str) -> float | None:
    if not os.path.exists(log_path):
        return None
    with open(log_path) as f:
        return parse_cbc_bound(f.read())


def _solve_with_cbc(model: IlpModel, backend: pulp.LpSolver, log_path: str) -> Answer:
    """CBC on pulp's model of ``model`` (:meth:`IlpModel.to_pulp`), started from nothing."""
    lp, variables = model.to_pulp()
    lp.solve(backend)
    values = None
    if lp.sol_status in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        values = np.array([var.varValue or 0.0 for var in variables])
    return Answer(lp.status, lp.sol_status, values, _cbc_bound(log_path))


def run_model(model: IlpModel, solver: SolverName, time_limit_s: float | None,
              mip_gap: float | None, exact_abs_gap: float | None = None, warm_start: bool = False,
              branch: bool = True) -> SolverRun:
    """Solve ``model`` with its current objective (see :func:`make_backend` for the gaps,
    ``warm_start`` and ``branch``); its ``values`` and ``status`` become the answer's."""
    if solver == "highs":
        backend = make_backend(solver, time_limit_s, mip_gap, "", exact_abs_gap, warm_start, branch)
        assert isinstance(backend, HighsBackend)
        start = time.perf_counter()
        answer = backend.solve(model)
        seconds = time.perf_counter() - start
    else:
        with tempfile.TemporaryDirectory(prefix="autoplan_ilp_") as tmp:  # CBC's log, read for its bound
            log_path = os.path.join(tmp, "cbc.log")
            backend = make_backend(solver, time_limit_s, mip_gap, log_path, exact_abs_gap, warm_start)
            start = time.perf_counter()
            answer = _solve_with_cbc(model, backend, log_path)
            seconds = time.perf_counter() - start
    model.status = answer.status
    if answer.values is not None:
        model.values = answer.values
    return SolverRun(solver, answer.sol_status, answer.bound, seconds)


def likeliest_choices(model: IlpModel, reduced: ReducedProblem, num_groups: int) -> list[int]:
    """The largest ``s`` per active group (lowest index on ties), fixed choices for the rest:
    a fractional relaxation's likeliest assignment."""
    assert model.values is not None, "the model has not been solved"
    choices = [reduced.fixed.get(g, -1) for g in range(num_groups)]
    for g, columns in model.s.items():
        choices[g] = int(np.argmax(model.values[columns]))
    return choices


def extract_choices(model: IlpModel, reduced: ReducedProblem, num_groups: int) -> list[int]:
    """The solver's answer: :func:`likeliest_choices`, where every group's is taken (its ``s``
    at least 0.5)."""
    choices = likeliest_choices(model, reduced, num_groups) if model.values is not None else None
    for g, columns in model.s.items():
        values = [float(x) for x in model.values[columns]] if model.values is not None else [0.0] * len(columns)
        if choices is None or values[choices[g]] < 0.5:
            raise RuntimeError(f"the ILP solver left group {g} without a choice ({values})")
    return choices if choices is not None else [reduced.fixed.get(g, -1) for g in range(num_groups)]
