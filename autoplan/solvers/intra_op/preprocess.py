"""Preprocessing (P1)-(P5): a smaller model with the same answer.

(P1) A self-edge ``(g, g)`` means both ends pick the same index: ``c[g,i] += R[gg][i,i]``.
(P2) Duplicate edges add up; ``(v, u)`` is merged into ``(u, v)`` transposed.
(P3) A separable matrix ``R[i,j] = a[i] + b[j]`` (to SEPARABLE_RTOL relative) folds into the
     node costs, ``c[u] += a``, ``c[v] += b``. This covers all-zero and constant matrices and
     every edge that touches a single-choice group.
(P4) A group with a single choice gets no variable (``s = 1``). When no budget constrains the
     model, a group left without edges is decided alone: among its cheapest choices (ties
     within the tolerance of :mod:`~autoplan.solvers.intra_op.tie_break`) the one with the
     least (memory, choice name), which is the canonical assignment's choice for it.
(P5) Numerics: each group's costs are shifted by their minimum (a constant, since exactly one
     choice is taken); the ILP divides its objective by its largest coefficient and the memory
     row by ``M`` (:mod:`~autoplan.solvers.intra_op.ilp`). A budget that even the
     largest-memory assignment meets (its largest peak row included) drops the memory row.
(P6) Peak rows: a fixed group's term joins the row's constant (a pair with one end fixed becomes
     the other end's term; a pair of active groups is read off its edge's ``e`` columns, so
     such an edge is kept, with zero costs where (P3) folded it); a row whose most is no more
     than the largest least of any row can never be the largest and is dropped (the row of
     that least is kept), and so are rows equal to one kept.
(P7) Overlap rows: both sums reduced over the active groups as in (P6) (their pairs' edges
     kept); a row with both sums fixed hides a constant, taken out with the others (P5); a row
     whose collectives are never more than zero is dropped; equal rows add their weights. A
     group in an overlap row is never decided alone (P4): its choice changes what is hidden.
(P8) Forbidden pairs merge as the costs do (a self-edge's pair ``(i, i)`` excludes choice ``i``;
     a reversed edge's pairs transposed); a pair with a single-choice end excludes the other
     end's choice; the other pairs keep their edge in the model (with zero costs where (P3)
     folded it), their ``e`` columns fixed at 0 (:mod:`~autoplan.solvers.intra_op.ilp`), and
     excluded choices' ``s`` columns too. A group decided alone (P4) takes an allowed choice; a
     group with none gets a variable, which makes the model infeasible, as the problem is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TypeVar

from autoplan.solvers.intra_op.problem import ChoiceSum, IntraOpProblem, OverlapRow, PeakRow
from autoplan.solvers.intra_op.tie_break import preferred_choice

SumT = TypeVar("SumT", bound=ChoiceSum)
SEPARABLE_RTOL = 1e-12  # (P3) residual allowed, relative to the matrix's largest entry


@dataclass
class ReducedProblem:
    """The problem after (P1)-(P5): what the ILP still has to decide."""

    node_costs: list[list[float]]  # shifted so each group's minimum is 0
    constant: float  # seconds taken out of the model: minima of every group
    edges: dict[tuple[int, int], list[list[float]]]  # merged, non-separable, u < v
    fixed: dict[int, int]  # groups decided before the ILP -> their choice
    active: list[int]  # groups that get binary variables, ascending
    budget_binding: bool  # the memory row is needed
    peaks: list[PeakRow] = field(default_factory=list)  # (P6): over active groups, when the budget binds
    overlaps: list[OverlapRow] = field(default_factory=list)  # (P7): over active groups
    forbidden: dict[tuple[int, int], frozenset[tuple[int, int]]] = field(default_factory=dict)  # (P8), u < v
    excluded: dict[int, frozenset[int]] = field(default_factory=dict)  # (P8): choices no assignment takes


def _merge_edges(problem: IntraOpProblem, node_costs: list[list[float]]) -> dict:
    """(P1) fold self-edges into node costs; (P2) sum duplicate and reversed edges."""
    merged: dict[tuple[int, int], list[list[float]]] = {}
    for edge in problem.edges:
        if edge.src == edge.dst:
            for i, row in enumerate(edge.cost):
                node_costs[edge.src][i] += row[i]
            continue
        u, v = min(edge.src, edge.dst), max(edge.src, edge.dst)
        matrix = edge.cost if edge.src == u else [list(col) for col in zip(*edge.cost)]
        if (u, v) not in merged:
            merged[(u, v)] = [list(map(float, row)) for row in matrix]
            continue
        target = merged[(u, v)]
        for i, row in enumerate(matrix):
            for j, x in enumerate(row):
                target[i][j] += x
    return merged


Pairs = dict[tuple[int, int], set[tuple[int, int]]]


def _merge_forbidden(problem: IntraOpProblem) -> tuple[Pairs, dict[int, set[int]]]:
    """(P8) the edges' forbidden pairs merged (oriented ``u < v``), and the choices excluded:
    by a self-edge's pair ``(i, i)``, or by a pair whose other end has a single choice."""
    pairs: Pairs = {}
    excluded: dict[int, set[int]] = {}
    for edge in problem.edges:
        for i, j in edge.forbidden:
            if edge.src == edge.dst:
                if i == j:
                    excluded.setdefault(edge.src, set()).add(i)
                continue
            (u, a), (v, b) = sorted([(edge.src, i), (edge.dst, j)])
            if problem.num_choices(u) == 1:
                excluded.setdefault(v, set()).add(b)
            elif problem.num_choices(v) == 1:
                excluded.setdefault(u, set()).add(a)
            else:
                pairs.setdefault((u, v), set()).add((a, b))
    return pairs, excluded


def _separable_parts(matrix: list[list[float]]) -> tuple[list[float], list[float]] | None:
    """(a, b) with matrix[i][j] == a[i] + b[j] to SEPARABLE_RTOL, else None."""
    a = [row[0] for row in matrix]
    b = [x - matrix[0][0] for x in matrix[0]]
    tol = SEPARABLE_RTOL * max(abs(x) for row in matrix for x in row)
    for i, row in enumerate(matrix):
        for j, x in enumerate(row):
            if abs(x - a[i] - b[j]) > tol:
                return None
    return a, b


def _fold_separable_edges(edges: dict, node_costs: list[list[float]]) -> dict:
    """(P3) move separable edge matrices (incl. all-zero ones) into the node costs."""
    kept = {}
    for (u, v), matrix in sorted(edges.items()):
        parts = _separable_parts(matrix)
        if parts is None:
            kept[(u, v)] = matrix
            continue
        for i, x in enumerate(parts[0]):
            node_costs[u][i] += x
        for j, x in enumerate(parts[1]):
            node_costs[v][j] += x
    return kept


def _shift_node_costs(node_costs: list[list[float]]) -> float:
    """(P5) subtract each group's minimum cost; return the sum of the minima."""
    total = []
    for costs in node_costs:
        low = min(costs)
        total.append(low)
        costs[:] = [x - low for x in costs]
    return math.fsum(total)


def _budget_binding(problem: IntraOpProblem) -> bool:
    """(P5) the memory row is needed unless even the largest-memory assignment meets the budget."""
    if problem.memory_budget is None:
        return False
    most = math.fsum(max(m) for m in problem.memory) + max((row.most() for row in problem.peaks), default=0.0)
    return most > problem.memory_budget


def _reduced_row(row: SumT, fixed: dict[int, int]) -> SumT:
    """(P6) one sum over the active groups: a fixed group's term (and a pair's entries at
    both ends' fixed choices) joins the constant, a pair with one end fixed becomes the other
    end's term, and the remaining pairs are oriented ``u < v`` and summed."""
    constant = row.constant + math.fsum(t[fixed[g]] for g, t in row.terms.items() if g in fixed)
    terms = {g: list(t) for g, t in row.terms.items() if g not in fixed}
    pairs: dict[tuple[int, int], list[list[float]]] = {}
    for (u, v), matrix in row.pairs.items():
        if u in fixed and v in fixed:
            constant += matrix[fixed[u]][fixed[v]]
        elif u in fixed or v in fixed:
            g, vector = (v, matrix[fixed[u]]) if u in fixed else (u, [r[fixed[v]] for r in matrix])
            target = terms.setdefault(g, [0.0] * len(vector))
            target[:] = [a + b for a, b in zip(target, vector)]
        else:  # matrices are shared between rows, never written to: a sum is a new one
            key, oriented = ((u, v), matrix) if u < v else ((v, u), [list(c) for c in zip(*matrix)])
            held = pairs.get(key)
            pairs[key] = oriented if held is None else [[a + b for a, b in zip(r, o)] for r, o in zip(held, oriented)]
    return type(row)(dict(sorted(terms.items())), constant, dict(sorted(pairs.items())))


def _reduced_peaks(problem: IntraOpProblem, fixed: dict[int, int]) -> list[PeakRow]:
    """(P6) the peak rows over the active groups, the dominated and repeated ones dropped."""
    rows: dict[tuple, PeakRow] = {}
    for row in problem.peaks:
        reduced = _reduced_row(row, fixed)
        rows.setdefault(_sum_key(reduced), reduced)
    if not rows:
        return []
    highest = max(rows.values(), key=PeakRow.least)  # the transient is never below its least
    return [row for row in rows.values() if row is highest or row.most() > highest.least()]


def _sum_key(row: ChoiceSum) -> tuple:
    return (row.constant, tuple((g, tuple(t)) for g, t in row.terms.items()),
            tuple((uv, id(m)) for uv, m in row.pairs.items()))  # rows share their pairs' matrices


def _reduced_overlaps(problem: IntraOpProblem, fixed: dict[int, int]) -> tuple[list[OverlapRow], float]:
    """(P7) the overlap rows over the active groups, and the seconds hidden by rows whose two
    sums are fixed."""
    rows: dict[tuple, OverlapRow] = {}
    hidden = 0.0
    for overlap in problem.overlaps:
        comm, compute = _reduced_row(overlap.comm, fixed), _reduced_row(overlap.compute, fixed)
        if comm.most() <= 0 or compute.most() <= 0:
            continue
        if not (comm.terms or comm.pairs) and not (compute.terms or compute.pairs):
            hidden += overlap.weight * min(comm.constant, compute.constant)
            continue
        key = (_sum_key(comm), _sum_key(compute))
        held = rows.get(key)
        rows[key] = OverlapRow(comm, compute, overlap.weight + (held.weight if held is not None else 0.0))
    return list(rows.values()), hidden


def _fixed_groups(problem: IntraOpProblem, node_costs: list[list[float]], edges: dict,
                  budget_binding: bool, excluded: dict[int, set[int]]) -> dict[int, int]:
    """(P4) groups decided without the ILP: single choice, or isolated (no edge, no overlap
    row) with no binding budget; of their choices not ``excluded`` (P8)."""
    on_edge = {g for pair in edges for g in pair}
    for overlap in problem.overlaps:
        for part in (overlap.comm, overlap.compute):
            on_edge.update(part.terms)
            on_edge.update(g for pair in part.pairs for g in pair)
    fixed = {}
    for g, costs in enumerate(node_costs):
        allowed = [i for i in range(len(costs)) if i not in excluded[g]] if g in excluded else None
        if allowed == []:
            continue  # infeasible: left to the ILP, which says so
        if len(costs) == 1:
            fixed[g] = 0
        elif not budget_binding and g not in on_edge:
            fixed[g] = preferred_choice(problem, g, costs, allowed)
    return fixed


def reduce_problem(problem: IntraOpProblem) -> ReducedProblem:
    """Apply (P1)-(P7); the optimum of the reduced model plus the constant is the optimum."""
    node_costs = [list(map(float, c)) for c in problem.costs]
    edges = _merge_edges(problem, node_costs)
    edges = _fold_separable_edges(edges, node_costs)
    forbidden, excluded = _merge_forbidden(problem)
    for (u, v) in forbidden:  # (P8): their edges kept
        edges.setdefault((u, v), [[0.0] * problem.num_choices(v) for _ in range(problem.num_choices(u))])
    binding = _budget_binding(problem)
    fixed = _fixed_groups(problem, node_costs, edges, binding, excluded)  # before (P5): real magnitudes
    constant = _shift_node_costs(node_costs)
    active = [g for g in range(problem.num_groups) if g not in fixed]
    peaks = _reduced_peaks(problem, fixed) if binding else []
    overlaps, hidden = _reduced_overlaps(problem, fixed)
    sums = [*peaks, *(part for row in overlaps for part in (row.comm, row.compute))]
    for row in sums:  # a pair's entries are edge columns of the model: a pair needs its edge
        for (u, v), matrix in row.pairs.items():
            edges.setdefault((u, v), [[0.0] * len(matrix[0]) for _ in matrix])
    return ReducedProblem(node_costs, constant - hidden, edges, fixed, active, binding, peaks, overlaps,
                          {uv: frozenset(p) for uv, p in forbidden.items()},
                          {g: frozenset(c) for g, c in excluded.items()})
