"""The canonical optimum by enumeration (tests, tiny problems).

The rule of :mod:`~autoplan.solvers.intra_op.tie_break`, over every assignment: the least
cost ``f*`` under the budget (peak rows included); among the assignments within the tie tolerance of ``f*`` that
fit the budget, the least weight ``W``.
"""

from __future__ import annotations

import math
import time

import numpy as np

from autoplan.errors import MemoryInfeasibleError
from autoplan.solvers.intra_op.problem import (ChoiceSum, IntraOpProblem, IntraOpSolution, check_memory_feasible,
    least_memory)
from autoplan.solvers.intra_op.solve import solution_of
from autoplan.solvers.intra_op.tie_break import objective_tolerance, tie_break_weights
from autoplan.solvers.units import format_bytes

BRUTE_FORCE_LIMIT = 1_000_000  # most assignments brute_force enumerates


def _along(shape: tuple[int, ...], axis: int, vector: np.ndarray) -> np.ndarray:
    view = [1] * len(shape)
    view[axis] = len(vector)
    return vector.reshape(view)


def _cost_and_memory_tensors(problem: IntraOpProblem) -> tuple[np.ndarray, np.ndarray]:
    """Cost and memory of every assignment, one array axis per group (C order = lexicographic)."""
    shape = tuple(problem.num_choices(g) for g in range(problem.num_groups))
    cost = np.zeros(shape)
    memory = np.zeros(shape)
    for g in range(problem.num_groups):
        cost += _along(shape, g, np.asarray(problem.costs[g], dtype=float))
        memory += _along(shape, g, np.asarray(problem.memory[g], dtype=float))
    for edge in problem.edges:
        matrix = np.asarray(edge.cost, dtype=float)
        if edge.src == edge.dst:
            cost += _along(shape, edge.src, np.diag(matrix).copy())
            continue
        cost += _pair_tensor(shape, edge.src, edge.dst, matrix)
    for row in problem.overlaps:
        hidden = np.minimum(_sum_tensor(row.comm, shape), _sum_tensor(row.compute, shape))
        cost -= row.weight * np.maximum(hidden, 0.0)
    return cost, memory


def _pair_tensor(shape: tuple[int, ...], u: int, v: int, matrix: np.ndarray) -> np.ndarray:
    """``matrix[x_u, x_v]`` of every assignment, broadcast over the other groups' axes."""
    view = [1] * len(shape)
    view[u], view[v] = shape[u], shape[v]
    return (matrix if u < v else matrix.T).reshape(view)


def _allowed_tensor(problem: IntraOpProblem, shape: tuple[int, ...]) -> np.ndarray:
    """Whether each assignment takes no pair an edge forbids."""
    allowed = np.ones(shape, dtype=bool)
    for edge in problem.edges:
        if not edge.forbidden:
            continue
        mask = np.ones((problem.num_choices(edge.src), problem.num_choices(edge.dst)), dtype=bool)
        for i, j in edge.forbidden:
            mask[i, j] = False
        if edge.src == edge.dst:
            allowed &= _along(shape, edge.src, np.diag(mask).copy())
        else:
            allowed &= _pair_tensor(shape, edge.src, edge.dst, mask)
    return allowed


def _transient_tensor(problem: IntraOpProblem, shape: tuple[int, ...]) -> np.ndarray:
    """``trans(x)`` of every assignment: the largest peak row, 0 without rows."""
    out = np.zeros(shape)
    for row in problem.peaks:
        out = np.maximum(out, _sum_tensor(row, shape))
    return out


def _sum_tensor(row: ChoiceSum, shape: tuple[int, ...]) -> np.ndarray:
    """A sum over choices (a peak row, one side of an overlap row) of every assignment."""
    value = np.full(shape, row.constant)
    for g, terms in row.terms.items():
        value = value + _along(shape, g, np.asarray(terms, dtype=float))
    for (u, v), matrix in row.pairs.items():
        value = value + _pair_tensor(shape, u, v, np.asarray(matrix, dtype=float))
    return value


def _weight_tensor(problem: IntraOpProblem, shape: tuple[int, ...]) -> np.ndarray:
    weights = np.zeros(shape, dtype=np.int64)
    for g, row in enumerate(tie_break_weights(problem)):
        weights += _along(shape, g, np.asarray(row, dtype=np.int64))
    return weights


def brute_force(problem: IntraOpProblem) -> IntraOpSolution:
    """The canonical optimum by enumerating every assignment (at most BRUTE_FORCE_LIMIT)."""
    problem.validate()
    count = math.prod(problem.num_choices(g) for g in range(problem.num_groups))
    if count > BRUTE_FORCE_LIMIT:
        raise ValueError(
            f"brute_force would enumerate {count} assignments (limit {BRUTE_FORCE_LIMIT})"
        )
    check_memory_feasible(problem)
    start = time.perf_counter()
    if problem.num_groups == 0:
        return solution_of(problem, [], "optimal", 0.0, "brute_force", 0.0, 0, 0)
    cost, memory = _cost_and_memory_tensors(problem)
    fits = _allowed_tensor(problem, cost.shape)
    if problem.memory_budget is not None:
        fits &= memory + _transient_tensor(problem, cost.shape) <= problem.memory_budget
    if not fits.any():
        raise MemoryInfeasibleError(f"no assignment fits {format_bytes(problem.memory_budget or 0.0)} per device "
                                    "with its peak rows", least_memory(problem))
    best = float(cost[fits].min())
    tied = fits & (cost <= best + objective_tolerance(best))
    weights = np.where(tied, _weight_tensor(problem, cost.shape), np.iinfo(np.int64).max)
    flat = int(np.argmin(weights))
    choices = [int(i) for i in np.unravel_index(flat, cost.shape)]
    seconds = time.perf_counter() - start
    return solution_of(problem, choices, "optimal", 0.0, "brute_force", seconds, 0, 0)
