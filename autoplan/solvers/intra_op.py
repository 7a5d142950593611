r"""Intra-op ILP: pick one sharding strategy per op group, minimising time under a memory budget.

Pure mathematics: numbers in, choices out (no torch). The planner turns a traced graph into an
:class:`IntraOpProblem` (node cost vectors, edge resharding matrices, memory per strategy) and
reads the chosen index per group back from the :class:`IntraOpSolution`.

Data
----
Groups ``g = 1..G``; group ``g`` has ``n_g >= 1`` choices ``i``, each with a cost ``c[g,i]``
(seconds) and a memory ``m[g,i]`` (bytes per device). Edges ``(u, v)`` carry a matrix
``R[uv][i,j]``: the seconds spent when ``u`` picks ``i`` and ``v`` picks ``j`` (resharding).
``M`` is the memory budget per device (optional).

Variables
---------
``s[g,i] in {0, 1}``   group ``g`` picks choice ``i``                      (binary)
``e[uv,i,j] >= 0``     edge ``(u, v)`` sees the pair ``(i, j)``             (continuous)

Model
-----
::

    minimise    sum_g sum_i c[g,i] s[g,i] + sum_(u,v) sum_(i,j) R[uv][i,j] e[uv,i,j]      (0)
    subject to  sum_i s[g,i] = 1                  for every group g                      (1)
                sum_j e[uv,i,j] = s[u,i]          for every edge (u,v), every i          (2)
                sum_i e[uv,i,j] = s[v,j]          for every edge (u,v), every j          (3)
                sum_g sum_i m[g,i] s[g,i] <= M    when a budget is given                 (4)

Why (2)-(3) linearise ``e = s_u s_v^T`` exactly: when ``s`` is integral, (2) forces every row
``i`` of ``e[uv]`` with ``s[u,i] = 0`` to zero; the one remaining row sums to 1 and, by (3), its
entry ``j`` equals ``s[v,j]``, so ``e[uv,i*,j*] = 1`` and every other entry is 0. This
"marginal" (local-polytope) form has a far tighter LP relaxation than Alpa's product form
``e >= s_u + s_v - 1``: on a 2,000-variable, 300-edge problem the product form found no
solution in 120 s, the marginal form solved in 1.5 s (``benchmarks/ilp_scaling.py``).

Memory is separable, so the least memory any assignment needs is ``sum_g min_i m[g,i]``; when
that exceeds ``M`` no plan exists and :class:`~autoplan.errors.MemoryInfeasibleError` is raised
before any solver runs.

Preprocessing (keeps the model small; the answer is unchanged)
--------------------------------------------------------------
(P1) A self-edge ``(g, g)`` means both ends pick the same index: ``c[g,i] += R[gg][i,i]``.
(P2) Duplicate edges add up; ``(v, u)`` is merged into ``(u, v)`` transposed.
(P3) A separable matrix ``R[i,j] = a[i] + b[j]`` (to 1e-12 relative) folds into the node costs,
     ``c[u] += a``, ``c[v] += b``. This covers all-zero and constant matrices and every edge
     that touches a single-choice group.
(P4) A group with a single choice gets no variable (``s = 1``). When no budget constrains the
     model, a group left without edges takes ``argmin_i c[g,i]`` (lowest index on ties).
(P5) Numerics: each group's costs are shifted by their minimum (a constant, since exactly one
     choice is taken), the objective is divided by its largest coefficient (costs in seconds
     are tiny next to solver tolerances) and row (4) is divided by ``M`` (its tolerance becomes
     relative). A budget that even the largest-memory assignment meets drops row (4).

Solvers: HiGHS (default; single-threaded, deterministic) or CBC through pulp. The reported
objective and memory are recomputed exactly from the problem data, never read from the LP.
"""

from __future__ import annotations

import math
import numbers
import os
import re
import tempfile
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pulp

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.solvers.units import format_bytes, format_seconds

SOLVER_NAMES = ("highs", "cbc")
DEFAULT_MIP_GAP = 1e-7  # relative gap the solver must prove before it reports "optimal"
HIGHS_ABS_GAP = 1e-9  # absolute gap, in units of the largest objective coefficient (P5)
SEPARABLE_RTOL = 1e-12  # (P3) residual allowed, relative to the matrix's largest entry
BRUTE_FORCE_LIMIT = 1_000_000  # most assignments brute_force enumerates


class SolverTimeoutError(AutoplanError):
    """The ILP solver found no feasible plan within its time limit."""


# --------------------------------------------------------------------------------------------
# Problem and solution


@dataclass
class Edge:
    """A resharding term between two groups: ``cost[i][j]`` seconds when src picks i, dst j."""

    src: int
    dst: int
    cost: list[list[float]]


@dataclass
class IntraOpProblem:
    """Node costs (seconds), memory (bytes per device) per choice, and edge cost matrices."""

    costs: list[list[float]]
    memory: list[list[float]]
    edges: list[Edge]
    memory_budget: float | None = None
    names: list[str] | None = None
    choice_names: list[list[str]] | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def num_groups(self) -> int:
        return len(self.costs)

    def num_choices(self, group: int) -> int:
        return len(self.costs[group])

    def group_name(self, group: int) -> str:
        return self.names[group] if self.names is not None else f"group{group}"

    def choice_name(self, group: int, choice: int) -> str:
        if self.choice_names is not None:
            return self.choice_names[group][choice]
        return f"#{choice}"

    def validate(self) -> None:
        """Raise ValueError naming the first malformed field."""
        _validate_groups(self.costs, self.memory)
        for k, edge in enumerate(self.edges):
            _validate_edge(k, edge, self.costs)
        _validate_budget(self.memory_budget)
        _validate_names(self.names, self.choice_names, self.costs)


@dataclass
class IntraOpSolution:
    """The chosen index per group, with the exact cost and memory of that choice."""

    choices: list[int]
    objective: float
    memory: float
    status: str  # "optimal" or "time_limit"
    gap: float | None
    solver: str  # "highs", "cbc" (or "brute_force")
    solve_time_s: float
    num_variables: int
    num_constraints: int


def _check_finite(values: list[float], what: str, nonnegative: bool = False) -> None:
    for x in values:
        # float/int first: the ABC check of numbers.Real is slow, and validation runs over
        # every cost of every ILP the stage search builds
        if not (type(x) in (float, int) or isinstance(x, numbers.Real)) or not math.isfinite(x):
            raise ValueError(
                f"{what} holds {x!r}: costs and memory must be finite numbers "
                "(leave an impossible strategy out instead of giving it an infinite cost)"
            )
        if nonnegative and x < 0:
            raise ValueError(f"{what} holds {x!r}: memory cannot be negative")


def _validate_groups(costs: list[list[float]], memory: list[list[float]]) -> None:
    if len(memory) != len(costs):
        raise ValueError(f"costs has {len(costs)} groups but memory has {len(memory)}")
    for g, (c, m) in enumerate(zip(costs, memory)):
        if len(c) == 0:
            raise ValueError(f"group {g} has no choices: every group needs at least one")
        if len(m) != len(c):
            raise ValueError(f"group {g} has {len(c)} costs but {len(m)} memory entries")
        _check_finite(c, f"costs[{g}]")
        _check_finite(m, f"memory[{g}]", nonnegative=True)


def _validate_edge(k: int, edge: Edge, costs: list[list[float]]) -> None:
    num_groups = len(costs)
    for end in ("src", "dst"):
        index = getattr(edge, end)
        if not isinstance(index, int) or not 0 <= index < num_groups:
            raise ValueError(f"edge {k} has {end}={index!r}, outside 0..{num_groups - 1}")
    rows, cols = len(costs[edge.src]), len(costs[edge.dst])
    if len(edge.cost) != rows:
        raise ValueError(
            f"edge {k} ({edge.src}->{edge.dst}) has {len(edge.cost)} rows; "
            f"src group {edge.src} has {rows} choices"
        )
    for i, row in enumerate(edge.cost):
        if len(row) != cols:
            raise ValueError(
                f"edge {k} ({edge.src}->{edge.dst}) row {i} has {len(row)} entries; "
                f"dst group {edge.dst} has {cols} choices"
            )
        _check_finite(row, f"edge {k} row {i}")


def _validate_budget(budget: float | None) -> None:
    if budget is None:
        return
    if not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        raise ValueError(f"memory_budget must be a finite number >= 0 or None, not {budget!r}")


def _validate_names(
    names: list[str] | None, choice_names: list[list[str]] | None, costs: list[list[float]]
) -> None:
    if names is not None and len(names) != len(costs):
        raise ValueError(f"names has {len(names)} entries for {len(costs)} groups")
    if choice_names is None:
        return
    if len(choice_names) != len(costs):
        raise ValueError(f"choice_names has {len(choice_names)} entries for {len(costs)} groups")
    for g, (cn, c) in enumerate(zip(choice_names, costs)):
        if len(cn) != len(c):
            raise ValueError(f"choice_names[{g}] has {len(cn)} names for {len(c)} choices")


# --------------------------------------------------------------------------------------------
# Evaluation and the memory check shared by every solver


def evaluate(problem: IntraOpProblem, choices: list[int]) -> tuple[float, float]:
    """(seconds, bytes per device) of an assignment: node costs plus every edge term."""
    if len(choices) != problem.num_groups:
        raise ValueError(f"{len(choices)} choices for {problem.num_groups} groups")
    for g, i in enumerate(choices):
        if not 0 <= i < problem.num_choices(g):
            raise ValueError(f"choice {i} of group {g} is outside 0..{problem.num_choices(g) - 1}")
    cost = math.fsum(problem.costs[g][i] for g, i in enumerate(choices))
    cost += math.fsum(e.cost[choices[e.src]][choices[e.dst]] for e in problem.edges)
    memory = math.fsum(problem.memory[g][i] for g, i in enumerate(choices))
    return cost, memory


def trim_memory(problem: IntraOpProblem, choices: list[int], budget: float) -> list[int] | None:
    """A quick feasible assignment under ``budget`` from ``choices`` (the fastest one): switch,
    one group at a time, to the choice that frees memory for the least added cost per byte
    (its node cost and the edges it touches, the others held), until the memory fits. None if
    even the least-memory choices do not fit. A heuristic for estimates, not an optimum."""
    trimmed = trim_memory_together([problem], [1], [choices], budget)
    return None if trimmed is None else trimmed[0]


def trim_memory_together(problems: list[IntraOpProblem], counts: list[int], choices: list[list[int]],
                         budget: float) -> list[list[int]] | None:
    """:func:`trim_memory` over independent problems that share one ``budget``: problem ``p``
    stands for ``counts[p]`` identical copies (they switch together), so memory is
    ``sum_p counts[p] * memory_p``. Each step takes the switch, in any problem, that frees
    memory for the least added cost per byte (a copy's rate is the problem's rate), which
    spends the budget where it buys the most speed. None if even the least-memory choices of
    every problem do not fit."""
    if not len(problems) == len(counts) == len(choices):
        raise ValueError("problems, counts and choices must have one entry per problem")
    choices = [list(c) for c in choices]
    touching: list[dict[int, list]] = []
    for problem in problems:
        edges: dict[int, list] = {}
        for e in problem.edges:
            edges.setdefault(e.src, []).append(e)
            edges.setdefault(e.dst, []).append(e)
        touching.append(edges)

    def cost_of(p: int, g: int, i: int) -> float:
        total = problems[p].costs[g][i]
        for e in touching[p].get(g, ()):
            src = i if e.src == g else choices[p][e.src]
            dst = i if e.dst == g else choices[p][e.dst]
            total += e.cost[src][dst]
        return total

    def best_switch(p: int, g: int) -> tuple[float, int] | None:
        """The cheapest switch per byte freed in group g of problem p: (rate, choice)."""
        mems, current = problems[p].memory[g], choices[p][g]
        now = cost_of(p, g, current)
        best: tuple[float, int] | None = None
        for i, m in enumerate(mems):
            saved = mems[current] - m
            if saved > 0:
                rate = (cost_of(p, g, i) - now) / saved
                if best is None or rate < best[0]:
                    best = (rate, i)
        return best

    memory = math.fsum(count * math.fsum(problem.memory[g][i] for g, i in enumerate(chosen))
                       for problem, count, chosen in zip(problems, counts, choices))
    # a group's best switch changes only when it or a group it shares an edge with switches
    switches = {(p, g): best_switch(p, g) for p, problem in enumerate(problems) for g in range(len(problem.memory))}
    while memory > budget:
        found = [(best[0], p, g, best[1]) for (p, g), best in switches.items() if best is not None]
        if not found:
            return None
        _, p, g, i = min(found)
        memory -= counts[p] * (problems[p].memory[g][choices[p][g]] - problems[p].memory[g][i])
        choices[p][g] = i
        for h in {g, *(e.src for e in touching[p].get(g, ())), *(e.dst for e in touching[p].get(g, ()))}:
            switches[p, h] = best_switch(p, h)
    return choices


def least_memory(problem: IntraOpProblem) -> float:
    """The least memory any assignment needs: memory is separable, so sum of group minima."""
    return math.fsum(min(m) for m in problem.memory)


def check_memory_feasible(problem: IntraOpProblem) -> None:
    """Raise MemoryInfeasibleError when even the least-memory assignment exceeds the budget."""
    if problem.memory_budget is None:
        return
    least = least_memory(problem)
    if least > problem.memory_budget:
        raise MemoryInfeasibleError(
            f"no plan fits {format_bytes(problem.memory_budget)} per device: the least any "
            f"plan needs is {format_bytes(least)}; give more memory (--memory-per-device) "
            "or more devices",
            least,
        )


# --------------------------------------------------------------------------------------------
# Preprocessing (P1)-(P5)


@dataclass
class _Reduced:
    """The problem after (P1)-(P5): what the ILP still has to decide."""

    node_costs: list[list[float]]  # shifted so each group's minimum is 0
    constant: float  # seconds taken out of the model: minima of every group
    edges: dict[tuple[int, int], list[list[float]]]  # merged, non-separable, u < v
    fixed: dict[int, int]  # groups decided before the ILP -> their choice
    active: list[int]  # groups that get binary variables, ascending
    budget_binding: bool  # row (4) is needed


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
    """(P5) row (4) is needed unless even the largest-memory assignment meets the budget."""
    if problem.memory_budget is None:
        return False
    return math.fsum(max(m) for m in problem.memory) > problem.memory_budget


def _fixed_groups(node_costs: list[list[float]], edges: dict, budget_binding: bool) -> dict:
    """(P4) groups decided without the ILP: single choice, or isolated with no binding budget."""
    on_edge = {g for pair in edges for g in pair}
    fixed = {}
    for g, costs in enumerate(node_costs):
        if len(costs) == 1:
            fixed[g] = 0
        elif not budget_binding and g not in on_edge:
            fixed[g] = costs.index(min(costs))
    return fixed


def reduce_problem(problem: IntraOpProblem) -> _Reduced:
    """Apply (P1)-(P5); the optimum of the reduced model plus the constant is the optimum."""
    node_costs = [list(map(float, c)) for c in problem.costs]
    edges = _merge_edges(problem, node_costs)
    edges = _fold_separable_edges(edges, node_costs)
    constant = _shift_node_costs(node_costs)
    binding = _budget_binding(problem)
    fixed = _fixed_groups(node_costs, edges, binding)
    active = [g for g in range(problem.num_groups) if g not in fixed]
    return _Reduced(node_costs, constant, edges, fixed, active, binding)


# --------------------------------------------------------------------------------------------
# The pulp model


@dataclass
class _Model:
    lp: pulp.LpProblem
    s: dict[int, list[pulp.LpVariable]]  # active group -> one binary per choice
    scale: float  # objective coefficients were divided by this (P5)


def _sanitize(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name)[:60]


def _new_variable(lp: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A variable >= 0 (binary or continuous); pulp >= 3.3 wants them made by the problem."""
    if hasattr(lp, "add_variable"):
        return lp.add_variable(name, lowBound=0, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def _onehot_variables(lp: pulp.LpProblem, reduced: _Reduced) -> dict[int, list[pulp.LpVariable]]:
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
    lp: pulp.LpProblem, s: dict, reduced: _Reduced, problem: IntraOpProblem
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


def _add_memory_constraint(
    lp: pulp.LpProblem, s: dict, reduced: _Reduced, problem: IntraOpProblem
) -> None:
    """Equation (4), divided by M: sum over active groups of (m/M) s <= 1 - fixed memory / M."""
    if not reduced.budget_binding:
        return
    budget = problem.memory_budget
    fixed = math.fsum(problem.memory[g][i] for g, i in reduced.fixed.items())
    expr = pulp.LpAffineExpression(
        [(x, problem.memory[g][i] / budget) for g, xs in s.items() for i, x in enumerate(xs)]
    )
    lp.addConstraint(expr <= (budget - fixed) / budget, "memory_budget")


def _set_objective(lp: pulp.LpProblem, s: dict, reduced: _Reduced, edge_terms: list) -> float:
    """Equation (0) over the active groups, divided by its largest coefficient; returns it."""
    node_terms = [(x, reduced.node_costs[g][i]) for g, xs in s.items() for i, x in enumerate(xs)]
    terms = [(x, c) for x, c in node_terms + edge_terms if c]
    scale = max((abs(c) for _, c in terms), default=1.0)
    lp.setObjective(pulp.LpAffineExpression([(x, c / scale) for x, c in terms]))
    return scale


def build_model(problem: IntraOpProblem, reduced: _Reduced) -> _Model:
    """The pulp model of equations (0)-(4) over the groups (P4) left undecided."""
    lp = pulp.LpProblem("intra_op", pulp.LpMinimize)
    s = _onehot_variables(lp, reduced)
    _add_onehot_constraints(lp, s, problem)
    edge_terms = _add_edge_marginal_constraints(lp, s, reduced, problem)
    _add_memory_constraint(lp, s, reduced, problem)
    scale = _set_objective(lp, s, reduced, edge_terms)
    return _Model(lp, s, scale)


# --------------------------------------------------------------------------------------------
# Running a solver


def _solver_available(name: str) -> bool:
    if name == "highs":
        return bool(pulp.HiGHS(msg=False).available())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(pulp.PULP_CBC_CMD(msg=False).available())


def pick_solver(requested: str) -> str:
    """The requested solver if pulp can run it, else the other one."""
    if requested not in SOLVER_NAMES:
        raise ValueError(
            f"unknown ILP solver {requested!r}: choose one of {', '.join(SOLVER_NAMES)}"
        )
    for name in (requested, *[n for n in SOLVER_NAMES if n != requested]):
        if _solver_available(name):
            return name
    raise AutoplanError("no ILP solver can run: install highspy, or pulp with its bundled CBC")


def _make_backend(
    name: str, time_limit_s: float | None, mip_gap: float | None, log_path: str
) -> pulp.LpSolver:
    if name == "highs":
        return pulp.HiGHS(
            msg=False,
            timeLimit=time_limit_s,
            gapRel=DEFAULT_MIP_GAP if mip_gap is None else mip_gap,
            gapAbs=HIGHS_ABS_GAP,
            threads=1,
        )
    with warnings.catch_warnings():  # pulp 3.3 deprecates its bundled CBC, which we want
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(
            msg=False,
            timeLimit=time_limit_s,
            gapRel=DEFAULT_MIP_GAP if mip_gap is None else mip_gap,
            threads=1,
            logPath=log_path,
        )


def solution_status(sol_status: int, time_limit_s: float | None) -> str:
    """Map pulp's ``sol_status`` to "optimal" / "time_limit"; raise when there is no plan.

    pulp reports ``status == Optimal`` even when a time limit stopped the search with a
    feasible incumbent; only ``sol_status`` tells the two apart.
    """
    if sol_status == pulp.LpSolutionOptimal:
        return "optimal"
    if sol_status == pulp.LpSolutionIntegerFeasible:
        return "time_limit"
    if sol_status == pulp.LpSolutionNoSolutionFound:
        limit = "its limit" if time_limit_s is None else f"{time_limit_s:g} s"
        raise SolverTimeoutError(
            f"the ILP solver found no plan within {limit}; raise the time limit"
        )
    raise RuntimeError(
        f"the ILP solver returned {pulp.LpSolution.get(sol_status, sol_status)} for a model "
        "that has a feasible plan; this is a bug in autoplan"
    )


def relative_gap(objective: float, bound: float | None) -> float | None:
    """(objective - bound) / |objective|, the MIP gap of a feasible plan; None without a bound."""
    if bound is None or not math.isfinite(bound):
        return None
    if objective == 0:
        return 0.0
    return max(0.0, objective - bound) / abs(objective)


def _highs_bound(lp: pulp.LpProblem) -> float | None:
    model = getattr(lp, "solverModel", None)
    return None if model is None else float(model.getInfo().mip_dual_bound)


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


@dataclass
class _Run:
    solver: str
    sol_status: int
    bound: float | None  # best bound in model units (scaled, without the constant)
    seconds: float


def _run(model: _Model, solver: str, time_limit_s: float | None, mip_gap: float | None) -> _Run:
    with tempfile.TemporaryDirectory(prefix="autoplan_ilp_") as tmp:
        log_path = os.path.join(tmp, "cbc.log")
        backend = _make_backend(solver, time_limit_s, mip_gap, log_path)
        start = time.perf_counter()
        model.lp.solve(backend)
        seconds = time.perf_counter() - start
        bound = _highs_bound(model.lp) if solver == "highs" else _cbc_bound(log_path)
    return _Run(solver, model.lp.sol_status, bound, seconds)


def _extract_choices(model: _Model, reduced: _Reduced, num_groups: int) -> list[int]:
    """argmax of s per active group (lowest index on ties), fixed choices for the rest."""
    choices = [reduced.fixed.get(g, -1) for g in range(num_groups)]
    for g, variables in model.s.items():
        values = [x.varValue or 0.0 for x in variables]
        best = max(range(len(values)), key=lambda i: (values[i], -i))
        if values[best] < 0.5:
            raise RuntimeError(f"the ILP solver left group {g} without a choice ({values})")
        choices[g] = best
    return choices


def _check_solver_arguments(time_limit_s: float | None, mip_gap: float | None) -> None:
    if time_limit_s is not None and not time_limit_s > 0:
        raise ValueError(f"time_limit_s must be > 0 or None, not {time_limit_s!r}")
    if mip_gap is not None and not 0 <= mip_gap < 1:
        raise ValueError(f"mip_gap must be in [0, 1) or None, not {mip_gap!r}")


def _reported_gap(status: str, objective: float, run: _Run, model: _Model,
                  reduced: _Reduced, mip_gap: float | None) -> float | None:
    """0.0 when proven optimal at the default gap; else the proven gap (None if unknown)."""
    if status == "optimal" and mip_gap is None:
        return 0.0
    bound = None if run.bound is None else run.bound * model.scale + reduced.constant
    gap = relative_gap(objective, bound)
    if status == "optimal" and gap is None:
        return mip_gap
    return gap


def solve_intra_op(
    problem: IntraOpProblem,
    solver: str = "highs",
    time_limit_s: float | None = None,
    mip_gap: float | None = None,
) -> IntraOpSolution:
    """Solve equations (0)-(4) for ``problem``.

    ``solver`` is "highs" (default) or "cbc"; when pulp cannot run it the other one runs and
    ``solution.solver`` says which. ``mip_gap`` loosens the relative gap the solver must prove
    (default DEFAULT_MIP_GAP). Raises MemoryInfeasibleError when no plan fits the budget and
    SolverTimeoutError when the time limit passed before any plan was found.
    """
    problem.validate()
    _check_solver_arguments(time_limit_s, mip_gap)
    solver = pick_solver(solver)
    check_memory_feasible(problem)
    reduced = reduce_problem(problem)
    if not reduced.active:
        choices = [reduced.fixed[g] for g in range(problem.num_groups)]
        return _solution(problem, choices, "optimal", 0.0, solver, 0.0, 0, 0)
    model = build_model(problem, reduced)
    run = _run(model, solver, time_limit_s, mip_gap)
    status = solution_status(run.sol_status, time_limit_s)
    choices = _extract_choices(model, reduced, problem.num_groups)
    objective, _ = evaluate(problem, choices)
    gap = _reported_gap(status, objective, run, model, reduced, mip_gap)
    return _solution(problem, choices, status, gap, run.solver, run.seconds,
                     len(model.lp.variables()), model.lp.numConstraints())


def _solution(problem: IntraOpProblem, choices: list[int], status: str, gap: float | None,
              solver: str, seconds: float, num_variables: int, num_constraints: int
              ) -> IntraOpSolution:
    objective, memory = evaluate(problem, choices)
    return IntraOpSolution(choices, objective, memory, status, gap, solver, seconds,
                           num_variables, num_constraints)


# --------------------------------------------------------------------------------------------
# Brute force (tests, tiny problems)


def _cost_and_memory_tensors(problem: IntraOpProblem) -> tuple[np.ndarray, np.ndarray]:
    """Cost and memory of every assignment, one array axis per group (C order = lexicographic)."""
    shape = tuple(problem.num_choices(g) for g in range(problem.num_groups))
    cost = np.zeros(shape)
    memory = np.zeros(shape)

    def along(axis: int, vector: np.ndarray) -> np.ndarray:
        view = [1] * len(shape)
        view[axis] = len(vector)
        return vector.reshape(view)

    for g in range(problem.num_groups):
        cost += along(g, np.asarray(problem.costs[g], dtype=float))
        memory += along(g, np.asarray(problem.memory[g], dtype=float))
    for edge in problem.edges:
        matrix = np.asarray(edge.cost, dtype=float)
        if edge.src == edge.dst:
            cost += along(edge.src, np.diag(matrix).copy())
            continue
        view = [1] * len(shape)
        view[edge.src], view[edge.dst] = shape[edge.src], shape[edge.dst]
        oriented = matrix if edge.src < edge.dst else matrix.T
        cost += oriented.reshape(view)
    return cost, memory


def brute_force(problem: IntraOpProblem) -> IntraOpSolution:
    """The optimum by enumerating every assignment (at most BRUTE_FORCE_LIMIT of them)."""
    problem.validate()
    count = math.prod(problem.num_choices(g) for g in range(problem.num_groups))
    if count > BRUTE_FORCE_LIMIT:
        raise ValueError(
            f"brute_force would enumerate {count} assignments (limit {BRUTE_FORCE_LIMIT})"
        )
    check_memory_feasible(problem)
    start = time.perf_counter()
    cost, memory = _cost_and_memory_tensors(problem)
    if problem.memory_budget is not None:
        cost = np.where(memory <= problem.memory_budget, cost, np.inf)
    flat = int(np.argmin(cost)) if cost.ndim else 0
    choices = [int(i) for i in np.unravel_index(flat, cost.shape)] if cost.ndim else []
    seconds = time.perf_counter() - start
    return _solution(problem, choices, "optimal", 0.0, "brute_force", seconds, 0, 0)


# --------------------------------------------------------------------------------------------
# Explanation


def _cost_terms(problem: IntraOpProblem, choices: list[int]) -> list[tuple[float, str]]:
    terms = []
    for g, i in enumerate(choices):
        label = f"node {problem.group_name(g)}: {problem.choice_name(g, i)}"
        terms.append((problem.costs[g][i], label))
    for edge in problem.edges:
        i, j = choices[edge.src], choices[edge.dst]
        label = (f"edge {problem.group_name(edge.src)} -> {problem.group_name(edge.dst)}: "
                 f"{problem.choice_name(edge.src, i)} -> {problem.choice_name(edge.dst, j)}")
        terms.append((edge.cost[i][j], label))
    return terms


def _memory_terms(problem: IntraOpProblem, choices: list[int]) -> list[tuple[float, str]]:
    return [(problem.memory[g][i], f"{problem.group_name(g)}: {problem.choice_name(g, i)}")
            for g, i in enumerate(choices)]


def _largest(terms: list[tuple[float, str]], top: int) -> list[tuple[float, str]]:
    order = sorted(range(len(terms)), key=lambda k: (-terms[k][0], k))
    return [terms[k] for k in order[:top]]


def explain(problem: IntraOpProblem, solution: IntraOpSolution, top: int = 10) -> str:
    """The largest cost terms (node and edge) and memory holders of a solution, as text."""
    budget = "" if problem.memory_budget is None else f" of {format_bytes(problem.memory_budget)}"
    gap = "" if not solution.gap else f", gap {solution.gap:.2%}"
    lines = [
        f"objective {format_seconds(solution.objective)}, memory {format_bytes(solution.memory)}"
        f"{budget} per device ({solution.status}{gap}, {solution.solver}, "
        f"{solution.num_variables} variables, {solution.num_constraints} constraints, "
        f"{solution.solve_time_s:.2f} s)",
        f"largest cost terms (top {top}):",
    ]
    total = solution.objective
    for cost, label in _largest(_cost_terms(problem, solution.choices), top):
        share = f"{cost / total:6.1%}" if total else "     -"
        lines.append(f"  {format_seconds(cost):>11}  {share}  {label}")
    lines.append(f"largest memory holders (top {top}):")
    for mem, label in _largest(_memory_terms(problem, solution.choices), top):
        lines.append(f"  {format_bytes(mem):>11}  {label}")
    return "\n".join(lines)
