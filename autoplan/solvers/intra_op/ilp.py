r"""The model of the intra-op ILP (data as in :mod:`~autoplan.solvers.intra_op.problem`), as arrays.

Variables
---------
``s[g,i] in {0, 1}``   group ``g`` picks choice ``i``                      (binary)
``e[uv,i,j] >= 0``     edge ``(u, v)`` sees the pair ``(i, j)``             (continuous)
``t >= 0``             the transient above the kept memory (with peak rows)  (continuous)
``h[o] >= 0``          seconds overlap row ``o`` hides                       (continuous)

Model
-----
::

    minimise    sum_g sum_i c[g,i] s[g,i] + sum_(u,v) sum_(i,j) R[uv][i,j] e[uv,i,j]
                  - sum_o w[o] h[o]                                                    (0)
    subject to  sum_i s[g,i] = 1                  for every group g                      (1)
                sum_j e[uv,i,j] = s[u,i]          for every edge (u,v), every i          (2)
                sum_i e[uv,i,j] = s[v,j]          for every edge (u,v), every j          (3)
                sum_g sum_i m[g,i] s[g,i] + t <= M    when a budget is given             (4)
                p0[r] + sum_g sum_i p[r,g,i] s[g,i]
                      + sum_(u,v) sum_(i,j) q[r,uv][i,j] e[uv,i,j] <= t    for every peak row r  (6)
                h[o] <= a0[o] + sum_g sum_i a[o,g,i] s[g,i]
                      + sum_(u,v) sum_(i,j) a[o,uv][i,j] e[uv,i,j]     for every overlap row o   (7)
                h[o] <= b0[o] + sum_g sum_i b[o,g,i] s[g,i]
                      + sum_(u,v) sum_(i,j) b[o,uv][i,j] e[uv,i,j]     for every overlap row o   (8)

An edge's forbidden pairs and the choices they exclude (preprocessing's (P8)) are bounds, not
rows: their ``e`` and ``s`` columns have upper bound 0 (:func:`_forbid`).

(4) and (6) bound the step's peak, ``mem(x) + max(0, max_r p_r(x))``
(:mod:`~autoplan.solvers.intra_op.problem`): ``t`` is at least every row, so at least their
maximum, and nothing gains from a larger ``t``; without peak rows ``t`` is left out. A row's
pair terms ``q`` (a value whose size depends on two groups' choices: a parameter gathered for
its consumer) are read off the edge's ``e`` columns, which (2)-(3) make the product of the two
ends' choices. Rows (6)
are added lazily (:func:`~autoplan.solvers.intra_op.solve.solve_intra_op`): the model starts
with none (``t = 0``), and each solve whose answer's peak passes ``M`` adds the row it passes it
by. A model with fewer rows is a relaxation, so an answer that meets every row is optimal for
all of them. All rows at once (one per op of the graph) make the LP relaxation weak: on the
test zoo's models HiGHS ran for minutes on models it solves in seconds with the one or two
rows that bind.

(7) and (8) make ``h[o]`` at most the smaller of the row's collectives ``a_o(x)`` and the
compute they run beside ``b_o(x)``; the objective gains ``w[o]`` per second of ``h[o]``, so at
an optimum ``h[o] = min(a_o(x), b_o(x))`` (:class:`~autoplan.solvers.intra_op.problem.OverlapRow`).
Both are linear in ``s`` and ``e``; the min is exact because it is maximised. The planner's rows
are a block's forward gathers beside the forward of the block before and its gradient
reductions beside that block's backward (:func:`autoplan.planner.mesh_plan.overlap_rows`).

Each family is built by one function: (0) :func:`_objective`, (1)
:func:`_add_onehot_constraints`, (2)-(3) :func:`_add_edge_marginal_constraints`, (4)
:func:`_add_memory_constraint`, (6) :func:`add_peak_row`, (7)-(8) :func:`_add_overlap_rows`;
:func:`build_model` puts (0)-(4), (7) and (8) together over the groups
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
next to solver tolerances), and rows (7)-(8) by the same scale (``h`` is in its units); rows (4)
and (6) by ``M`` (their tolerance becomes relative; ``t`` is in units of ``M``).

Columns and rows are kept as arrays (:class:`IlpModel`): columns ``s`` group by group, then
each edge's ``e`` row by row, then ``t``, then ``h``; rows in the order the families are added. HiGHS
reads them as they are (:class:`~autoplan.solvers.intra_op.backends.HighsBackend`); pulp's
model of the same columns and rows (:meth:`IlpModel.to_pulp`) is built only for CBC. A layer's
model has tens of thousands of ``e`` columns, and building them as pulp variables took longer
than HiGHS takes to solve the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pulp

from autoplan.solvers.intra_op.preprocess import ReducedProblem
from autoplan.solvers.intra_op.problem import ChoiceSum, IntraOpProblem, PeakRow, fits_budget

INFINITY = math.inf


class EdgeBlock(NamedTuple):
    """The ``e`` columns of edge ``(u, v)``: ``rows x cols`` of them from column ``first``, row
    by row (``e[uv,i,j]`` is column ``first + i * cols + j``)."""

    u: int
    v: int
    first: int
    rows: int
    cols: int


@dataclass
class IlpModel:
    """The model as arrays: per column its objective coefficient and upper bound (every column
    is at least 0; the ``s`` columns are binary), and the rows in compressed form, added in
    blocks. ``values`` and ``status`` hold the last solve's answer
    (:func:`~autoplan.solvers.intra_op.run.run_model`)."""

    s: dict[int, np.ndarray]  # active group -> the columns of its binaries, one per choice
    edge_columns: list[EdgeBlock]  # each edge's e columns
    costs: np.ndarray  # the objective being minimised, per column
    objective: np.ndarray  # (0) as built, in model units (the tie-break replaces ``costs``)
    upper: np.ndarray  # per column: 1 for a binary, infinite for a continuous one
    binaries: np.ndarray  # the binary columns (int32)
    scale: float  # objective (0) coefficients were divided by this (P5)
    transient: int | None = None  # t's column, where the budget binds and there are peak rows
    hidden: list[int] = field(default_factory=list)  # h's columns, one per overlap row
    peaks: list[PeakRow] = field(default_factory=list)  # the rows (6) added so far
    values: np.ndarray | None = None  # the last solve's column values
    # an assignment's ``s`` columns and their values (:meth:`start_at`): where there are no
    # ``values`` yet, a warm-started solve starts from it and the solver completes the rest
    start: tuple[np.ndarray, np.ndarray] | None = None
    status: int = pulp.LpStatusNotSolved  # the last solve's pulp status
    # the rows, block by block (:meth:`add_rows`): entries per row, their columns and
    # coefficients, the rows' bounds
    _lengths: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _columns: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _coefficients: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _lower: list[np.ndarray] = field(default_factory=list, init=False, repr=False)
    _upper: list[np.ndarray] = field(default_factory=list, init=False, repr=False)

    @property
    def num_columns(self) -> int:
        return len(self.costs)

    @property
    def num_rows(self) -> int:
        return sum(len(lengths) for lengths in self._lengths)

    def start_at(self, choices: list[int]) -> None:
        """Start the next warm-started solve from ``choices`` (a choice per group of the
        problem): the ``s`` columns of the active groups, 1 at the choice and 0 elsewhere."""
        if not self.s:
            return
        columns = np.concatenate(list(self.s.values()))
        values = np.concatenate([(np.arange(len(group)) == choices[g]).astype(np.float64)
                                 for g, group in self.s.items()])
        self.start = (columns.astype(np.int32), values)

    def add_rows(self, lengths: np.ndarray, columns: np.ndarray, coefficients: np.ndarray,
                 lower: np.ndarray, upper: np.ndarray) -> None:
        """Rows in compressed form: row ``r`` has ``lengths[r]`` entries, the next ones of
        ``columns`` and ``coefficients``; ``lower <= row <= upper``. Zero coefficients are left
        out."""
        keep = coefficients != 0
        if not keep.all():
            row_of = np.repeat(np.arange(len(lengths)), lengths)
            lengths = np.bincount(row_of[keep], minlength=len(lengths))
            columns, coefficients = columns[keep], coefficients[keep]
        self._lengths.append(np.asarray(lengths, dtype=np.int64))
        self._columns.append(np.asarray(columns, dtype=np.int32))
        self._coefficients.append(np.asarray(coefficients, dtype=np.float64))
        self._lower.append(np.asarray(lower, dtype=np.float64))
        self._upper.append(np.asarray(upper, dtype=np.float64))

    def add_row(self, terms: list[tuple[int, float]], lower: float, upper: float) -> None:
        """One row ``lower <= sum c x[column] <= upper`` over (column, c) ``terms``."""
        columns, coefficients = zip(*terms) if terms else ((), ())
        self.add_rows(np.array([len(columns)]), np.array(columns, dtype=np.int32),
                      np.array(coefficients, dtype=np.float64), np.array([lower]), np.array([upper]))

    def matrix(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(starts, columns, coefficients, lower, upper) of every row, in compressed form."""
        lengths = _joined(self._lengths, np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int32) if len(lengths) else \
            np.zeros(0, dtype=np.int32)
        return (starts, _joined(self._columns, np.int32), _joined(self._coefficients, np.float64),
                _joined(self._lower, np.float64), _joined(self._upper, np.float64))

    def column_names(self) -> list[str]:
        """A name per column, for pulp: ``s_g_i``, ``e_u_v_i_j``, ``transient``."""
        names = [""] * self.num_columns
        for g, columns in self.s.items():
            for i, column in enumerate(columns):
                names[column] = f"s_{g}_{i}"
        for u, v, first, rows, cols in self.edge_columns:
            for i in range(rows):
                for j in range(cols):
                    names[first + i * cols + j] = f"e_{u}_{v}_{i}_{j}"
        if self.transient is not None:
            names[self.transient] = "transient"
        for o, column in enumerate(self.hidden):
            names[column] = f"hidden_{o}"
        return names

    def to_pulp(self) -> tuple[pulp.LpProblem, list[pulp.LpVariable]]:
        """pulp's model of these columns, rows and costs (for CBC), and its variables by column."""
        lp = pulp.LpProblem("intra_op", pulp.LpMinimize)
        binary = np.zeros(self.num_columns, dtype=bool)
        binary[self.binaries] = True
        variables = [_new_variable(lp, name, pulp.LpBinary if binary[k] else pulp.LpContinuous)
                     for k, name in enumerate(self.column_names())]
        for k in np.flatnonzero(self.upper == 0):  # excluded choices and forbidden pairs
            variables[k].upBound = 0
        starts, columns, coefficients, lower, upper = self.matrix()
        ends = list(starts[1:]) + [len(columns)]
        for r, (start, end) in enumerate(zip(starts, ends)):
            expr = pulp.LpAffineExpression([(variables[c], float(x))
                                            for c, x in zip(columns[start:end], coefficients[start:end])])
            if lower[r] == upper[r]:
                lp.addConstraint(expr == float(upper[r]), f"r{r}")
            else:
                if upper[r] < INFINITY:
                    lp.addConstraint(expr <= float(upper[r]), f"r{r}")
                if lower[r] > -INFINITY:
                    lp.addConstraint(expr >= float(lower[r]), f"r{r}_lower")
        lp.setObjective(pulp.LpAffineExpression([(variables[k], float(c)) for k, c in enumerate(self.costs) if c]))
        return lp, variables

    def objective_value(self) -> float:
        """The current objective at the last solve's values."""
        assert self.values is not None, "the model has not been solved"
        return float(np.dot(self.costs, self.values))


def _joined(blocks: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(blocks) if blocks else np.zeros(0, dtype=dtype)


def _new_variable(lp: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A variable >= 0 (binary or continuous); pulp >= 3.3 wants them made by the problem."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, lowBound=0, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def _columns(reduced: ReducedProblem) -> tuple[dict[int, np.ndarray], list[EdgeBlock], int]:
    """The ``s`` columns of every active group, then each edge's ``e`` block; the column count."""
    s: dict[int, np.ndarray] = {}
    column = 0
    for g in reduced.active:
        n = len(reduced.node_costs[g])
        s[g] = np.arange(column, column + n, dtype=np.int32)
        column += n
    edges = []
    for (u, v), matrix in reduced.edges.items():
        rows, cols = len(matrix), len(matrix[0])
        edges.append(EdgeBlock(u, v, column, rows, cols))
        column += rows * cols
    return s, edges, column


def _add_onehot_constraints(model: IlpModel) -> None:
    """Equation (1): sum_i s[g,i] = 1 for every active group g."""
    groups = list(model.s.values())
    if not groups:
        return
    lengths = np.array([len(columns) for columns in groups])
    ones = np.ones(len(groups))
    model.add_rows(lengths, np.concatenate(groups), np.ones(int(lengths.sum())), ones, ones)


def _add_edge_marginal_constraints(model: IlpModel) -> None:
    """Equations (2) and (3): rows of e[uv] sum to s[u,i], columns to s[v,j]."""
    for u, v, first, rows, cols in model.edge_columns:
        block = first + np.arange(rows * cols, dtype=np.int32).reshape(rows, cols)
        # (2): row i of e[uv], then -s[u,i]
        columns = np.concatenate([block, model.s[u].reshape(rows, 1)], axis=1).ravel()
        coefficients = np.tile(np.append(np.ones(cols), -1.0), rows)
        zeros = np.zeros(rows)
        model.add_rows(np.full(rows, cols + 1), columns, coefficients, zeros, zeros)
        # (3): column j of e[uv], then -s[v,j]
        columns = np.concatenate([block.T, model.s[v].reshape(cols, 1)], axis=1).ravel()
        coefficients = np.tile(np.append(np.ones(rows), -1.0), cols)
        zeros = np.zeros(cols)
        model.add_rows(np.full(cols, rows + 1), columns, coefficients, zeros, zeros)


def _fixed_memory(problem: IntraOpProblem, reduced: ReducedProblem) -> float:
    return math.fsum(problem.memory[g][i] for g, i in reduced.fixed.items())


def _add_memory_constraint(model: IlpModel, reduced: ReducedProblem, problem: IntraOpProblem) -> None:
    """Equation (4), divided by M: sum over active groups of (m/M) s + t/M <= 1 - fixed memory / M,
    with ``t`` where preprocessing left peak rows; rows (6) come one by one
    (:func:`add_peak_row`)."""
    if not reduced.budget_binding:
        return
    budget = problem.memory_budget
    terms = [(int(x), problem.memory[g][i] / budget) for g, xs in model.s.items() for i, x in enumerate(xs)]
    if model.transient is not None:
        terms.append((model.transient, 1.0))
    model.add_row(terms, -INFINITY, (budget - _fixed_memory(problem, reduced)) / budget)


def add_peak_row(model: IlpModel, row: PeakRow, budget: float) -> None:
    """Equation (6) for one peak row of the reduced problem (P6), divided by M:
    sum over its groups of (p/M) s + sum over its pairs of (q/M) e - t/M <= -p0/M."""
    assert model.transient is not None, "a model without t has no peak rows"
    held = _sum_terms(model, row, budget)
    model.add_row(held + [(model.transient, -1.0)], -INFINITY, -row.constant / budget)
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


def _objective(model: IlpModel, reduced: ReducedProblem) -> tuple[np.ndarray, float]:
    """Equation (0) over the active groups, divided by the largest coefficient of its ``s`` and
    ``e`` columns (``h`` is in units of that scale: its coefficients are the rows' weights)."""
    costs = np.zeros(model.num_columns)
    for g, columns in model.s.items():
        costs[columns] = reduced.node_costs[g]
    for u, v, first, rows, cols in model.edge_columns:
        costs[first:first + rows * cols] = np.asarray(reduced.edges[u, v], dtype=np.float64).ravel()
    nonzero = np.abs(costs[costs != 0])
    scale = float(nonzero.max()) if nonzero.size else 1.0
    costs /= scale
    for column, row in zip(model.hidden, reduced.overlaps):
        costs[column] = -row.weight
    return costs, scale


def _sum_terms(model: IlpModel, row: ChoiceSum, divisor: float) -> list[tuple[int, float]]:
    """(column, coefficient / divisor) of a sum's terms and pairs (pairs on kept edges)."""
    terms = [(int(x), values[i] / divisor) for g, values in row.terms.items() for i, x in enumerate(model.s[g])
             if values[i]]
    blocks = {(block.u, block.v): block for block in model.edge_columns}
    for (u, v), matrix in row.pairs.items():  # oriented u < v by (P6), on a kept edge
        first, cols = blocks[u, v].first, blocks[u, v].cols
        terms += [(first + i * cols + j, x / divisor) for i, r in enumerate(matrix) for j, x in enumerate(r) if x]
    return terms


def _add_overlap_rows(model: IlpModel, reduced: ReducedProblem) -> None:
    """Equations (7) and (8), divided by the objective's scale: ``h - a(x) <= a0`` and
    ``h - b(x) <= b0`` for every overlap row."""
    for column, row in zip(model.hidden, reduced.overlaps):
        for part in (row.comm, row.compute):
            negated = [(c, -x) for c, x in _sum_terms(model, part, model.scale)]
            model.add_row(negated + [(column, 1.0)], -INFINITY, part.constant / model.scale)


def _forbid(upper: np.ndarray, s: dict[int, np.ndarray], edges: list[EdgeBlock], reduced: ReducedProblem) -> None:
    """(P8) of preprocessing: the ``s`` column of every excluded choice and the ``e`` column of
    every forbidden pair bounded by 0 (with (2)-(3), ``s[u,i] + s[v,j] <= 1`` for a forbidden
    pair ``(i, j)``: row ``i`` of ``e[uv]`` must carry ``s[u,i]`` to column ``j``'s ``s[v,j]``)."""
    for g, choices in reduced.excluded.items():
        if g in s:
            upper[s[g][sorted(choices)]] = 0.0
    for u, v, first, _, cols in edges:
        for i, j in reduced.forbidden.get((u, v), ()):
            upper[first + i * cols + j] = 0.0


def build_model(problem: IntraOpProblem, reduced: ReducedProblem) -> IlpModel:
    """The model of equations (0)-(4) over the groups (P4) left undecided, with ``t`` where
    peak rows (6) may be added (:func:`add_peak_row`)."""
    s, edges, columns = _columns(reduced)
    transient = None
    if reduced.budget_binding and reduced.peaks:
        transient, columns = columns, columns + 1
    hidden = list(range(columns, columns + len(reduced.overlaps)))
    columns += len(hidden)
    upper = np.full(columns, INFINITY)
    binaries = np.concatenate(list(s.values())) if s else np.zeros(0, dtype=np.int32)
    upper[binaries] = 1.0
    _forbid(upper, s, edges, reduced)
    model = IlpModel(s, edges, np.zeros(columns), np.zeros(columns), upper, binaries.astype(np.int32), 1.0,
                     transient, hidden)
    model.costs, model.scale = _objective(model, reduced)
    model.objective = model.costs.copy()
    _add_onehot_constraints(model)
    _add_edge_marginal_constraints(model)
    _add_memory_constraint(model, reduced, problem)
    _add_overlap_rows(model, reduced)
    return model


def model_value(model: IlpModel, reduced: ReducedProblem, seconds: float) -> float:
    """An exact objective (seconds, constant included) in the units of (0) as built."""
    return (seconds - reduced.constant) / model.scale


def bound_objective(model: IlpModel, reduced: ReducedProblem, seconds: float,
                    tolerance: float) -> None:
    """Row (5): objective (0) at most ``seconds + tolerance``, normalised to a relative row."""
    rhs = model_value(model, reduced, seconds) + tolerance / model.scale
    divisor = max(abs(model_value(model, reduced, seconds)), 1.0)
    columns = np.flatnonzero(model.objective)
    model.add_rows(np.array([len(columns)]), columns, model.objective[columns] / divisor,
                   np.array([-INFINITY]), np.array([rhs / divisor]))


def minimise_weights(model: IlpModel, weights: list[list[int]]) -> None:
    """Objective: ``sum w[g,i] s[g,i]`` over the active groups (integer weights)."""
    costs = np.zeros(model.num_columns)
    for g, columns in model.s.items():
        costs[columns] = [float(w) for w in weights[g]]
    model.costs = costs
