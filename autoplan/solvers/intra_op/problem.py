"""The intra-op problem and solution, their validation, and the exact cost of an assignment.

Groups ``g = 1..G``; group ``g`` has ``n_g >= 1`` choices ``i``, each with a cost ``c[g,i]``
(seconds) and a memory ``m[g,i]`` (bytes per device). Edges ``(u, v)`` carry a matrix
``R[uv][i,j]``: the seconds spent when ``u`` picks ``i`` and ``v`` picks ``j``. ``M`` is the
memory budget per device (optional). An assignment ``x`` (one choice per group) costs::

    f(x) = sum_g c[g, x_g] + sum_(u,v) R[uv][x_u, x_v]        mem(x) = sum_g m[g, x_g]

Memory is separable, so the least memory any assignment needs is ``sum_g min_i m[g,i]``.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from autoplan.errors import MemoryInfeasibleError
from autoplan.solvers.units import format_bytes


@dataclass
class Edge:
    """A resharding term between two groups: ``cost[i][j]`` seconds when src picks i, dst j."""

    src: int
    dst: int
    cost: list[list[float]]


@dataclass
class IntraOpProblem:
    """Node costs (seconds), memory (bytes per device) per choice, and edge cost matrices.

    ``names`` and ``choice_names`` also decide which of several equally good assignments is
    returned (:mod:`autoplan.solvers.intra_op.canonical`); without them positions stand in.
    """

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


def evaluate(problem: IntraOpProblem, choices: list[int]) -> tuple[float, float]:
    """(f(x), mem(x)): seconds (node costs plus every edge term) and bytes per device."""
    if len(choices) != problem.num_groups:
        raise ValueError(f"{len(choices)} choices for {problem.num_groups} groups")
    for g, i in enumerate(choices):
        if not 0 <= i < problem.num_choices(g):
            raise ValueError(f"choice {i} of group {g} is outside 0..{problem.num_choices(g) - 1}")
    cost = math.fsum(problem.costs[g][i] for g, i in enumerate(choices))
    cost += math.fsum(e.cost[choices[e.src]][choices[e.dst]] for e in problem.edges)
    memory = math.fsum(problem.memory[g][i] for g, i in enumerate(choices))
    return cost, memory


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
