"""Quick feasible assignments under a memory budget, for estimates (a greedy, not an optimum).

From a fast assignment, switch one group at a time to the choice that frees memory for the
least added cost per byte, ``(f(x') - f(x)) / (mem(x) - mem(x'))`` with the other groups
held, until the memory fits.
"""

from __future__ import annotations

import math

from autoplan.solvers.intra_op.problem import IntraOpProblem


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
