r"""The pulp model of the intra-op ILP (data as in :mod:`~autoplan.solvers.intra_op.problem`).

Variables
---------
``s[g,i] in {0, 1}``   group ``g`` picks choice ``i``                      (binary)
``e[uv,i,j] >= 0``     edge ``(u, v)`` sees the pair ``(i, j)``             (continuous)
``t >= 0``             the transient above the kept memory (with peak rows)  (continuous)

Model
-----
::

    minimise    sum_g sum_i c[g,i] s[g,i] + sum_(u,v) sum_(i,j) R[uv][i,j] e[uv,i,j]      (0)
    subject to  sum_i s[g,i] = 1                  for every group g                      (1)
                sum_j e[uv,i,j] = s[u,i]          for every edge (u,v), every i          (2)
                sum_i e[uv,i,j] = s[v,j]          for every edge (u,v), every j          (3)
                sum_g sum_i m[g,i] s[g,i] + t <= M    when a budget is given             (4)
                p0[r] + sum_g sum_i p[r,g,i] s[g,i] <= t    for every peak row r          (6)

(4) and (6) bound the step's peak, ``mem(x) + max(0, max_r p_r(x))``
(:mod:`~autoplan.solvers.intra_op.problem`): ``t`` is at least every row, so at least their
maximum, and nothing gains from a larger ``t``; without peak rows ``t`` is left out. Rows (6)
are added lazily (:func:`~autoplan.solvers.intra_op.solve.solve_intra_op`): the model starts
with none (``t = 0``), and each solve whose answer's peak passes ``M`` adds the row it passes it
by. A model with fewer rows is a relaxation, so an answer that meets every row is optimal for
all of them. All rows at once (one per op of the graph) make the LP relaxation weak: on the
test zoo's models HiGHS ran for minutes on models it solves in seconds with the one or two
rows that bind.

Each family is built by one function: (0) :func:`_set_objective`, (1)
:func:`_add_onehot_constraints`, (2)-(3) :func:`_add_edge_marginal_constraints`, (4)
:func:`_add_memory_constraint`, (6) :func:`add_peak_row`; :func:`build_model` puts (0)-(4)
together over the groups
preprocessing (:mod:`~autoplan.solvers.intra_op.preprocess`) left undecided. The canonical
tie-break (:mod:`~autoplan.solvers.intra_op.canonical`) re-solves the same model with row
(5) (:func:`bound_objective`) and the objective of :func:`minimise_weights`::

    (0) <= f0 + tol,            divided by max(|f0|, 1), in the units of (0) as built     (5)

Why (2)-(3) linearise ``e = s_u s_v^T`` exactly: when ``s`` is integral, (2) forces every row
``i`` of ``e[uv]`` with ``s[u,i] = 0`` to zero; the one remaining row sums to 1 and, by (3), its
entry ``j`` equals ``s[v,j]``, so ``e[uv,i*,j*] = 1`` and every other entry is 0. This
"marginal" (local-polytope) form has a far tighter LP relaxation than Alpa's product form
``e >= s_u + s_v - 1``: on a 2,000-variable, 300-edge problem the product form found no
solution in 120 s, the marginal form solved in 1.5 s (``benchmarks/ilp_scaling.py``). The
relaxation is often integral outright (most layer ILPs of the stage search): HiGHS solves it
first and keeps such an optimum, which is the ILP's
(:class:`~autoplan.solvers.intra_op.backends.RelaxationFirstHiGHS`).

Numerics (P5): the objective is divided by its largest coefficient (costs in seconds are tiny
next to solver tolerances) and rows (4) and (6) by ``M`` (their tolerance becomes relative;
``t`` is in units of ``M``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pulp

from autoplan.solvers.intra_op.preprocess import ReducedProblem
from autoplan.solvers.intra_op.problem import IntraOpProblem, PeakRow, fits_budget


class ColumnCachedProblem(pulp.LpProblem):
    """pulp's problem, whose ``variables()`` (the solver's columns) pulp gathers again from every
    row and sorts by name on each call, several times per solve: here the list is kept while no
    row is added and the objective is the same object (our models bring no variable in any
    other way), so the solver gets the same columns in the same order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._rows_added = 0
        self._columns: tuple[int, object, list[pulp.LpVariable]] | None = None
        super().__init__(*args, **kwargs)

    def addConstraint(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802 - pulp's name
        self._rows_added += 1
        super().addConstraint(*args, **kwargs)

    def variables(self) -> list[pulp.LpVariable]:
        cached = self._columns
        if cached is None or cached[0] != self._rows_added or cached[1] is not self.objective:
            cached = self._columns = (self._rows_added, self.objective, list(super().variables()))
        return cached[2]


@dataclass
class IlpModel:
    lp: pulp.LpProblem
    s: dict[int, list[pulp.LpVariable]]  # active group -> one binary per choice
    scale: float  # objective (0) coefficients were divided by this (P5)
    objective: pulp.LpAffineExpression  # (0) as built, in model units
    transient: pulp.LpVariable | None = None  # t, where the budget binds and there are peak rows
    peaks: list[PeakRow] = field(default_factory=list)  # the rows (6) added so far


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]


def _new_variable(lp: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A variable >= 0 (binary or continuous); pulp >= 3.3 wants them made by the problem."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, lowBound=0, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def _onehot_variables(lp: pulp.LpProblem, reduced: ReducedProblem
                      ) -> dict[int, list[pulp.LpVariable]]:
    return {
        g: [_new_variable(lp, f"s_{g}_{i}", pulp.LpBinary)
            for i in range(len(reduced.node_costs[g]))]
        for g in reduced.active
    }


def _add_onehot_constraints(lp: pulp.LpProblem, s: dict, problem: IntraOpProblem) -> None:
    """Equation (1): sum_i s[g,i] = 1 for every active group g."""
    for g, variables in s.items():
        expr = pulp.LpAffineExpression([(x, 1.0) for x in variables])
        lp.addConstraint(expr == 1, f"onehot_{g}_{_sanitize(problem.group_name(g))}")


def _add_edge_marginal_constraints(
    lp: pulp.LpProblem, s: dict, reduced: ReducedProblem, problem: IntraOpProblem
) -> list[tuple[pulp.LpVariable, float]]:
    """Equations (2) and (3): rows of e[uv] sum to s[u,i], columns to s[v,j].

    Returns the edge part of objective (0) as (variable, seconds) pairs.
    """
    terms = []
    for (u, v), matrix in reduced.edges.items():
        tag = f"{u}_{v}"
        label = _sanitize(f"{problem.group_name(u)}__{problem.group_name(v)}")
        e = [[_new_variable(lp, f"e_{tag}_{i}_{j}", pulp.LpContinuous) for j in range(len(row))]
             for i, row in enumerate(matrix)]
        for i, row in enumerate(e):  # (2)
            expr = pulp.LpAffineExpression([(x, 1.0) for x in row] + [(s[u][i], -1.0)])
            lp.addConstraint(expr == 0, f"edge_src_{tag}_{i}_{label}")
        for j in range(len(matrix[0])):  # (3)
            column = [(e[i][j], 1.0) for i in range(len(matrix))]
            expr = pulp.LpAffineExpression(column + [(s[v][j], -1.0)])
            lp.addConstraint(expr == 0, f"edge_dst_{tag}_{j}_{label}")
        terms += [(e[i][j], x) for i, row in enumerate(matrix) for j, x in enumerate(row) if x]
    return terms


def _memory_terms(s: dict, problem: IntraOpProblem, divisor: float
                  ) -> list[tuple[pulp.LpVariable, float]]:
    return [(x, problem.memory[g][i] / divisor) for g, xs in s.items() for i, x in enumerate(xs)]


def _fixed_memory(problem: IntraOpProblem, reduced: ReducedProblem) -> float:
    return math.fsum(problem.memory[g][i] for g, i in reduced.fixed.items())


def _add_memory_constraint(
    lp: pulp.LpProblem, s: dict, reduced: ReducedProblem, problem: IntraOpProblem
) -> pulp.LpVariable | None:
    """Equation (4), divided by M: sum over active groups of (m/M) s + t/M <= 1 - fixed memory / M,
    with ``t`` (returned) where preprocessing left peak rows; rows (6) come one by one
    (:func:`add_peak_row`)."""
    if not reduced.budget_binding:
        return None
    budget = problem.memory_budget
    fixed = _fixed_memory(problem, reduced)
    terms = _memory_terms(s, problem, budget)
    t = None
    if reduced.peaks:
        t = _new_variable(lp, "transient", pulp.LpContinuous)
        terms.append((t, 1.0))
    expr = pulp.LpAffineExpression(terms)
    lp.addConstraint(expr <= (budget - fixed) / budget, "memory_budget")
    return t


def add_peak_row(model: IlpModel, row: PeakRow, budget: float) -> None:
    """Equation (6) for one peak row of the reduced problem (P6), divided by M:
    sum over its groups of (p/M) s - t/M <= -p0/M."""
    assert model.transient is not None, "a model without t has no peak rows"
    held = [(x, values[i] / budget) for g, values in row.terms.items() for i, x in enumerate(model.s[g]) if values[i]]
    expr = pulp.LpAffineExpression(held + [(model.transient, -1.0)])
    model.lp.addConstraint(expr <= -row.constant / budget, f"peak_{len(model.peaks)}")
    model.peaks.append(row)


def violated_peak_row(problem: IntraOpProblem, reduced: ReducedProblem, model: IlpModel, choices: list[int]
                      ) -> PeakRow | None:
    """The row of the reduced problem (P6) by which ``choices`` pass the budget, to add to
    ``model``; None where they fit, or where that row is in the model already (the solver's
    tolerance let it through)."""
    if not reduced.budget_binding or not reduced.peaks or fits_budget(problem, choices):
        return None
    worst = max(reduced.peaks, key=lambda row: row.value(choices))
    return None if any(worst is row for row in model.peaks) else worst


def _set_objective(lp: pulp.LpProblem, s: dict, reduced: ReducedProblem, edge_terms: list
                   ) -> tuple[float, pulp.LpAffineExpression]:
    """Equation (0) over the active groups, divided by its largest coefficient."""
    node_terms = [(x, reduced.node_costs[g][i]) for g, xs in s.items() for i, x in enumerate(xs)]
    terms = [(x, c) for x, c in node_terms + edge_terms if c]
    scale = max((abs(c) for _, c in terms), default=1.0)
    objective = pulp.LpAffineExpression([(x, c / scale) for x, c in terms])
    lp.setObjective(objective)
    return scale, objective


def build_model(problem: IntraOpProblem, reduced: ReducedProblem) -> IlpModel:
    """The pulp model of equations (0)-(4) over the groups (P4) left undecided, with ``t`` where
    peak rows (6) may be added (:func:`add_peak_row`)."""
    lp = ColumnCachedProblem("intra_op", pulp.LpMinimize)
    s = _onehot_variables(lp, reduced)
    _add_onehot_constraints(lp, s, problem)
    edge_terms = _add_edge_marginal_constraints(lp, s, reduced, problem)
    t = _add_memory_constraint(lp, s, reduced, problem)
    scale, objective = _set_objective(lp, s, reduced, edge_terms)
    return IlpModel(lp, s, scale, objective, t)


def model_value(model: IlpModel, reduced: ReducedProblem, seconds: float) -> float:
    """An exact objective (seconds, constant included) in the units of (0) as built."""
    return (seconds - reduced.constant) / model.scale


def bound_objective(model: IlpModel, reduced: ReducedProblem, seconds: float,
                    tolerance: float) -> None:
    """Row (5): objective (0) at most ``seconds + tolerance``, normalised to a relative row."""
    rhs = model_value(model, reduced, seconds) + tolerance / model.scale
    divisor = max(abs(model_value(model, reduced, seconds)), 1.0)
    expr = pulp.LpAffineExpression([(x, c / divisor) for x, c in model.objective.items()])
    model.lp.addConstraint(expr <= rhs / divisor, "canonical_objective")


def minimise_weights(model: IlpModel, weights: list[list[int]]) -> None:
    """Objective: ``sum w[g,i] s[g,i]`` over the active groups (integer weights)."""
    terms = [(x, float(weights[g][i])) for g, xs in model.s.items() for i, x in enumerate(xs)]
    model.lp.setObjective(pulp.LpAffineExpression(terms))
