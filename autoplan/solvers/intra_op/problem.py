"""The intra-op problem and solution, their validation, and the exact cost of an assignment.

Groups ``g = 1..G``; group ``g`` has ``n_g >= 1`` choices ``i``, each with a cost ``c[g,i]``
(seconds) and a memory ``m[g,i]`` (bytes per device). Edges ``(u, v)`` carry a matrix
``R[uv][i,j]``: the seconds spent when ``u`` picks ``i`` and ``v`` picks ``j``. ``M`` is the
memory budget per device (optional). An assignment ``x`` (one choice per group) costs::

    f(x) = sum_g c[g, x_g] + sum_(u,v) R[uv][x_u, x_v]        mem(x) = sum_g m[g, x_g]

An edge may also forbid pairs ``F[uv]`` of its ends' choices (a resharding the program that
runs the plan cannot do): an assignment is feasible only if ``(x_u, x_v) ∉ F[uv]`` on every
edge (:func:`takes_forbidden_pair`).

``mem(x)`` is what a device keeps through the step. Peak rows ``r`` add what it holds for a
moment above that (the backward's working set at one op: gradients, recomputed values, the
returned outputs, parameters gathered for their consumers), each a sum
``p_r(x) = p0[r] + sum_g p[r,g,x_g] + sum_(u,v) q[r,uv][x_u,x_v]`` (``q``: a value whose size
depends on two groups' choices, a gathered parameter on its storage and its consumer's read).
The budget bounds the peak::

    trans(x) = max(0, max_r p_r(x))        peak(x) = mem(x) + trans(x) <= M

Without peak rows memory is separable, so the least memory any assignment needs is
``sum_g min_i m[g,i]``; with them ``sum_g min_i m[g,i] + max(0, max_r min_x p_r(x))`` is a
lower bound (each row's least need not come from the same assignment).

Overlap rows ``o`` hide communication behind compute (collectives on their own stream while
ops run: a block's parameter gathers prefetched during the block before it), each two such
sums, ``a_o(x)`` seconds of collectives and ``b_o(x)`` seconds of compute they run beside, and
a weight ``w_o`` (equal rows given once)::

    f(x) = sum_g c[g, x_g] + sum_(u,v) R[uv][x_u, x_v] - sum_o w_o min(a_o(x), b_o(x))
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

from autoplan.errors import MemoryInfeasibleError
from autoplan.solvers.units import format_bytes


@dataclass
class Edge:
    """A resharding term between two groups: ``cost[i][j]`` seconds when src picks i, dst j;
    ``forbidden``: the pairs ``(i, j)`` no assignment may take."""

    src: int
    dst: int
    cost: list[list[float]]
    forbidden: frozenset[tuple[int, int]] = frozenset()


@dataclass
class ChoiceSum:
    """A sum over choices: ``constant + sum_g terms[g][x_g] + sum_(u,v) pairs[u,v][x_u][x_v]``
    (``terms`` maps a group to a number per choice, ``pairs`` two different groups to a number
    per pair of choices; groups not named add nothing)."""

    terms: dict[int, list[float]]
    constant: float = 0.0
    pairs: dict[tuple[int, int], list[list[float]]] = field(default_factory=dict)

    def value(self, choices: list[int]) -> float:
        return self.constant + math.fsum(t[choices[g]] for g, t in self.terms.items()) + \
            math.fsum(m[choices[u]][choices[v]] for (u, v), m in self.pairs.items())

    def least(self) -> float:
        return self.constant + math.fsum(min(t) for t in self.terms.values()) + \
            math.fsum(min(map(min, m)) for m in self.pairs.values())

    def most(self) -> float:
        return self.constant + math.fsum(max(t) for t in self.terms.values()) + \
            math.fsum(max(map(max, m)) for m in self.pairs.values())


@dataclass
class PeakRow(ChoiceSum):
    """One moment's memory above the kept values, in bytes per device (a pair: a value that
    exists only where two groups' choices differ, such as a parameter gathered for its
    consumer)."""


@dataclass
class OverlapRow:
    """Communication that runs beside compute: ``weight * min(comm(x), compute(x))`` seconds of
    the step are hidden (the collectives of ``comm`` run on their own stream while the ops of
    ``compute`` run; whichever is shorter is hidden behind the other). ``comm`` and ``compute``
    are seconds per step; ``weight`` counts equal rows given once."""

    comm: ChoiceSum
    compute: ChoiceSum
    weight: float = 1.0

    def hidden(self, choices: list[int]) -> float:
        return self.weight * max(0.0, min(self.comm.value(choices), self.compute.value(choices)))


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
    peaks: list[PeakRow] = field(default_factory=list)
    overlaps: list[OverlapRow] = field(default_factory=list)

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
        checked: set[tuple[int, int, int]] = set()  # rows share their pairs' matrices: each is checked once
        for r, row in enumerate(self.peaks):
            _validate_sum(f"peak row {r}", row, self.costs, checked)
        for r, overlap in enumerate(self.overlaps):
            if not (math.isfinite(overlap.weight) and overlap.weight > 0):
                raise ValueError(f"overlap row {r}'s weight is {overlap.weight!r}: give a positive number")
            _validate_sum(f"overlap row {r}'s comm", overlap.comm, self.costs, checked)
            _validate_sum(f"overlap row {r}'s compute", overlap.compute, self.costs, checked)


@dataclass
class IntraOpSolution:
    """The chosen index per group, with the exact cost, kept memory and transient (the largest
    peak row, 0 without rows) of that choice."""

    choices: list[int]
    objective: float
    memory: float
    status: str  # "optimal" or "time_limit"
    gap: float | None
    solver: str  # "highs", "cbc" (or "brute_force")
    solve_time_s: float
    num_variables: int
    num_constraints: int
    transient: float = 0.0
    # the budget of kept memory, peak rows left out, under which ``choices`` were proven optimal
    # (the budget tightened by the transient: :func:`~autoplan.solvers.intra_op.solve.solve_intra_op`);
    # None where the problem's own budget and rows bounded them
    kept_budget: float | None = None

    @property
    def peak(self) -> float:
        """Bytes per device at the step's peak: kept memory plus the transient."""
        return self.memory + self.transient


_PLAIN_NUMBERS = frozenset({float, int})


def _check_finite(values: list[float], what: str, nonnegative: bool = False) -> None:
    # plain numbers whose sum is finite are each finite: checked in C first, as validation
    # runs over every cost of every ILP the stage search builds
    if set(map(type, values)) <= _PLAIN_NUMBERS and math.isfinite(sum(values)) and \
            (not nonnegative or not values or min(values) >= 0):
        return
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
    for i, j in edge.forbidden:
        if not (0 <= i < rows and 0 <= j < cols):
            raise ValueError(f"edge {k} ({edge.src}->{edge.dst}) forbids the pair ({i}, {j}), outside its "
                             f"{rows}x{cols} choices")


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


def _validate_sum(what: str, row: ChoiceSum, costs: list[list[float]], checked: set[tuple[int, int, int]]) -> None:
    for g, terms in row.terms.items():
        if not isinstance(g, int) or not 0 <= g < len(costs):
            raise ValueError(f"{what} names group {g!r}, outside 0..{len(costs) - 1}")
        if len(terms) != len(costs[g]):
            raise ValueError(f"{what} has {len(terms)} entries for group {g}'s {len(costs[g])} choices")
        _check_finite(terms, f"{what}, group {g}", nonnegative=True)
    for (u, v), matrix in row.pairs.items():
        if (id(matrix), u, v) in checked:
            continue
        checked.add((id(matrix), u, v))
        if u == v or not all(isinstance(g, int) and 0 <= g < len(costs) for g in (u, v)):
            raise ValueError(f"{what} pairs groups {(u, v)!r}: two different groups of 0..{len(costs) - 1}")
        if len(matrix) != len(costs[u]) or any(len(row_) != len(costs[v]) for row_ in matrix):
            raise ValueError(f"{what}'s pair {(u, v)} is not {len(costs[u])} x {len(costs[v])}")
        for i, row_ in enumerate(matrix):
            _check_finite(row_, f"{what}, pair {(u, v)} row {i}", nonnegative=True)
    _check_finite([row.constant], f"{what}'s constant", nonnegative=True)


def evaluate(problem: IntraOpProblem, choices: list[int]) -> tuple[float, float]:
    """(f(x), mem(x)): seconds (node costs plus every edge term, less what the overlap rows
    hide) and bytes per device."""
    if len(choices) != problem.num_groups:
        raise ValueError(f"{len(choices)} choices for {problem.num_groups} groups")
    for g, i in enumerate(choices):
        if not 0 <= i < problem.num_choices(g):
            raise ValueError(f"choice {i} of group {g} is outside 0..{problem.num_choices(g) - 1}")
    cost = math.fsum(problem.costs[g][i] for g, i in enumerate(choices))
    cost += math.fsum(e.cost[choices[e.src]][choices[e.dst]] for e in problem.edges)
    if problem.overlaps:
        cost -= math.fsum(row.hidden(choices) for row in problem.overlaps)
    memory = math.fsum(problem.memory[g][i] for g, i in enumerate(choices))
    return cost, memory


def takes_forbidden_pair(problem: IntraOpProblem, choices: list[int]) -> bool:
    """Whether ``choices`` take a pair an edge forbids."""
    return any((choices[e.src], choices[e.dst]) in e.forbidden for e in problem.edges if e.forbidden)


def transient(problem: IntraOpProblem, choices: list[int]) -> float:
    """``trans(x)``: the largest peak row of ``choices`` (bytes per device), 0 without rows."""
    return max((row.value(choices) for row in problem.peaks), default=0.0)


PEAK_TOLERANCE = 1e-9  # relative: a peak this close above the budget is a solver's tolerance, not a miss


def fits_budget(problem: IntraOpProblem, choices: list[int]) -> bool:
    """Whether ``choices``' peak, ``mem(x) + trans(x)``, meets the budget (always, without one)."""
    if problem.memory_budget is None:
        return True
    _, memory = evaluate(problem, choices)
    return memory + transient(problem, choices) <= problem.memory_budget * (1 + PEAK_TOLERANCE)


def least_memory(problem: IntraOpProblem) -> float:
    """The least peak memory any assignment needs: the sum of group minima (exact without peak
    rows: memory is separable) plus the largest row's least (a lower bound)."""
    return math.fsum(min(m) for m in problem.memory) + max((row.least() for row in problem.peaks), default=0.0)


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
