"""Solvers: pure mathematics (numbers in, choices out, no torch)."""

from autoplan.solvers.intra_op import (
    Edge,
    IntraOpProblem,
    IntraOpSolution,
    SolverTimeoutError,
    brute_force,
    evaluate,
    explain,
    solve_intra_op,
)
from autoplan.solvers.units import format_bytes, format_seconds

__all__ = [
    "Edge",
    "IntraOpProblem",
    "IntraOpSolution",
    "SolverTimeoutError",
    "brute_force",
    "evaluate",
    "explain",
    "format_bytes",
    "format_seconds",
    "solve_intra_op",
]
