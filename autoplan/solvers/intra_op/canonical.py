r"""The canonical optimum: the same assignment whichever solver ran and whatever the input order.

Equal-cost assignments are common (a replicated input that the next op slices for free costs
what a sharded one costs; a batch-sharded chain costs what a sequence-sharded one does), and
which of them a MIP solver returns depends on its build and on the order variables come in.
After the solver's optimum ``x0`` (cost ``f0``), one more solve of the same model picks the
assignment :mod:`~autoplan.solvers.intra_op.tie_break` calls canonical: with row (5),
``f(x) <= f0 + tol(f0)``, it minimises ``W(x)``, whose integer weights prefer in every group
less memory, then the smaller choice name, and make the minimiser unique (up to hash
collisions).

The solve proves optimality with no relative gap and an absolute gap below one weight unit,
with rows held to EXACT_FEASIBILITY_TOL, and starts from ``x0`` (feasible under row
(5)). It is skipped when every decided group of ``x0``
already sits at its least weight (then nothing can beat ``x0``). Its answer is checked
exactly with :func:`~autoplan.solvers.intra_op.problem.evaluate` (cost within the tolerance
of ``f0``, memory within the budget); an answer that fails (a solver's tolerance let it
through) or a solve that does not finish is dropped and ``x0`` kept, so the result is never
worse than ``x0``.

Limits: the optimum ``f0`` is the solver's, proven to its relative gap; two solvers whose
optima differ by more than the tie tolerance define different tie sets. A solve stopped by
the time limit is not canonicalised at all (its answer is not an optimum). Memory counts
through each group's ranking, not as a total: of two tied assignments the one whose groups
hold their less-memory choices wins, which is not always the one of least total memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulp

from autoplan.solvers.intra_op.backends import SolverName
from autoplan.solvers.intra_op.ilp import (IlpModel, add_peak_row, bound_objective, minimise_weights,
    violated_peak_row)
from autoplan.solvers.intra_op.preprocess import ReducedProblem
from autoplan.solvers.intra_op.problem import IntraOpProblem, evaluate, transient
from autoplan.solvers.intra_op.run import extract_choices, run_model
from autoplan.solvers.intra_op.tie_break import objective_tolerance, tie_break_weights

WEIGHT_ABS_GAP = 0.5  # the weight solve's gap: W is an integer


@dataclass
class Canonical:
    """The canonical assignment and the seconds its extra solve took."""

    choices: list[int]
    seconds: float


def _accept(problem: IntraOpProblem, choices: list[int], most_seconds: float,
            most_memory: float | None) -> bool:
    cost, memory = evaluate(problem, choices)
    return cost <= most_seconds and (most_memory is None or memory + transient(problem, choices) <= most_memory)


def canonicalize(problem: IntraOpProblem, reduced: ReducedProblem, model: IlpModel,
                 choices: list[int], solver: SolverName, time_limit_s: float | None
                 ) -> Canonical:
    """The canonical assignment among those tying with ``choices`` (an optimum of ``model``).

    ``model`` is changed (row (5) added, objective replaced): solve it no more after.
    """
    weights = tie_break_weights(problem)
    if all(weights[g][choices[g]] == min(weights[g]) for g in reduced.active):
        return Canonical(choices, 0.0)
    f0, mem0 = evaluate(problem, choices)
    mem0 += transient(problem, choices)
    budget = problem.memory_budget
    bound_objective(model, reduced, f0, objective_tolerance(f0))
    minimise_weights(model, weights)
    seconds = 0.0
    while True:  # peak rows (6) lazily, as for the optimum
        run = run_model(model, solver, time_limit_s, None, exact_abs_gap=WEIGHT_ABS_GAP, warm_start=True)
        seconds += run.seconds
        if run.sol_status != pulp.LpSolutionOptimal:
            return Canonical(choices, seconds)
        found = extract_choices(model, reduced, problem.num_groups)
        row = violated_peak_row(problem, reduced, model, found)
        if row is None:
            break
        add_peak_row(model, row, budget or 0.0)
    most_memory = None if budget is None else max(budget, mem0)
    if not _accept(problem, found, f0 + objective_tolerance(f0), most_memory):
        return Canonical(choices, seconds)
    return Canonical(found, seconds)
