"""Solvers: pure mathematics (numbers in, choices out, no torch)."""

from autoplan.solvers.inter_op import (InterOpInfeasibleError, InterOpProblem, InterOpSolution, StageAssignment,
    StageCost, StageCostFn, SubMesh, brute_force_inter_op, candidate_submeshes, explain_inter_op, pipeline_step_time,
    solve_inter_op)
from autoplan.solvers.intra_op import (SOLVER_NAMES, ChoiceSum, Edge, IntraOpProblem, IntraOpSolution, OverlapRow,
    PeakRow, SolverFallbackWarning, SolverName, SolverTimeoutError, brute_force, check_solver_name, evaluate,
    explain, solve_intra_op, transient, trim_memory, trim_memory_together)
from autoplan.solvers.units import format_bytes, format_seconds

__all__ = [
    "SOLVER_NAMES",
    "ChoiceSum",
    "Edge",
    "InterOpInfeasibleError",
    "InterOpProblem",
    "InterOpSolution",
    "IntraOpProblem",
    "IntraOpSolution",
    "OverlapRow",
    "PeakRow",
    "SolverFallbackWarning",
    "SolverName",
    "SolverTimeoutError",
    "StageAssignment",
    "StageCost",
    "StageCostFn",
    "SubMesh",
    "brute_force",
    "brute_force_inter_op",
    "candidate_submeshes",
    "check_solver_name",
    "evaluate",
    "explain",
    "explain_inter_op",
    "format_bytes",
    "format_seconds",
    "pipeline_step_time",
    "solve_inter_op",
    "solve_intra_op",
    "transient",
    "trim_memory",
    "trim_memory_together",
]
