r"""Intra-op ILP: pick one sharding strategy per op group, minimising time under a memory budget.

Pure mathematics: numbers in, choices out (no torch). The planner turns a traced graph into an
:class:`IntraOpProblem` (node cost vectors, edge resharding matrices, memory per strategy) and
reads the chosen index per group back from the :class:`IntraOpSolution`.

One module per job:

* :mod:`.problem`: the data, its validation, the exact cost ``f(x)`` and memory of an assignment;
* :mod:`.preprocess`: (P1)-(P5), a smaller model with the same answer;
* :mod:`.ilp`: the model as arrays, equations (0)-(4) and (6) (and the tie-break row (5));
* :mod:`.backends`: solver names, availability and fallback, solver settings;
* :mod:`.run`: running a solver, its status and bound, the choices it made;
* :mod:`.solve`: :func:`solve_intra_op`, from problem to solution;
* :mod:`.tie_break` and :mod:`.canonical`: which of several equal-cost optima is returned;
* :mod:`.brute_force`, :mod:`.trimming`, :mod:`.explain`: enumeration, a memory-trimming
  greedy, text.
"""

from autoplan.solvers.intra_op.backends import (DEFAULT_MIP_GAP, HIGHS_ABS_GAP, SOLVER_NAMES, SolverFallbackWarning,
    SolverName, check_solver_name, pick_solver, solver_available)
from autoplan.solvers.intra_op.brute_force import BRUTE_FORCE_LIMIT, brute_force
from autoplan.solvers.intra_op.explain import explain
from autoplan.solvers.intra_op.ilp import IlpModel, build_model
from autoplan.solvers.intra_op.preprocess import SEPARABLE_RTOL, ReducedProblem, reduce_problem
from autoplan.solvers.intra_op.problem import (ChoiceSum, Edge, IntraOpProblem, IntraOpSolution, OverlapRow, PeakRow,
    check_memory_feasible, evaluate, least_memory, transient)
from autoplan.solvers.intra_op.run import parse_cbc_bound
from autoplan.solvers.intra_op.solve import (SolverTimeoutError, canonical_solution, relative_gap, solution_status,
    solve_intra_op)
from autoplan.solvers.intra_op.trimming import trim_memory, trim_memory_together

__all__ = [
    "ChoiceSum",
    "BRUTE_FORCE_LIMIT",
    "DEFAULT_MIP_GAP",
    "HIGHS_ABS_GAP",
    "SEPARABLE_RTOL",
    "SOLVER_NAMES",
    "Edge",
    "IlpModel",
    "IntraOpProblem",
    "IntraOpSolution",
    "OverlapRow",
    "PeakRow",
    "ReducedProblem",
    "SolverFallbackWarning",
    "SolverName",
    "SolverTimeoutError",
    "brute_force",
    "canonical_solution",
    "build_model",
    "check_memory_feasible",
    "check_solver_name",
    "evaluate",
    "explain",
    "least_memory",
    "parse_cbc_bound",
    "pick_solver",
    "reduce_problem",
    "relative_gap",
    "solution_status",
    "solve_intra_op",
    "solver_available",
    "transient",
    "trim_memory",
    "trim_memory_together",
]
