"""Quick feasible assignments under a memory budget, for estimates (a greedy, not an optimum).

From a fast assignment, switch one group at a time to the choice that frees memory for the
least added cost per byte, ``(f(x') - f(x)) / (mem(x) - mem(x'))`` with the other groups
held, until the memory fits.
"""

from __future__ import annotations

import bisect
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
    every problem do not fit. (:class:`TrimPath` answers many budgets from one walk.)"""
    return TrimPath(problems, counts, choices).choices_at(budget)


class TrimWalk:
    """The switches of :func:`trim_memory_together`'s greedy from ``choices``, in the order it
    takes them: each step takes the cheapest switch per byte freed (a copy's rate), which does
    not depend on how many copies each problem stands for, so one walk serves every ``counts``
    (:class:`TrimPath`). The walk goes on only as far as asked."""

    def __init__(self, problems: list[IntraOpProblem], choices: list[list[int]]) -> None:
        if len(problems) != len(choices):
            raise ValueError("problems and choices must have one entry per problem")
        self.problems = problems
        self.start = [list(c) for c in choices]
        self.current = [list(c) for c in choices]  # after every switch taken so far
        self.taken: list[tuple[int, int, int]] = []  # (problem, group, new choice), in order
        self.freed: list[float] = []  # bytes each switch frees in one copy of its problem
        self.touching: list[dict[int, list]] = []
        for problem in problems:
            edges: dict[int, list] = {}
            for e in problem.edges:
                edges.setdefault(e.src, []).append(e)
                edges.setdefault(e.dst, []).append(e)
            self.touching.append(edges)
        # a group's best switch changes only when it or a group it shares an edge with switches
        self.switches = {(p, g): self._best_switch(p, g)
                         for p, problem in enumerate(problems) for g in range(len(problem.memory))}
        self.ended = False  # no switch frees memory any more

    def _cost_of(self, p: int, g: int, i: int) -> float:
        chosen = self.current[p]
        total = self.problems[p].costs[g][i]
        for e in self.touching[p].get(g, ()):
            src = i if e.src == g else chosen[e.src]
            dst = i if e.dst == g else chosen[e.dst]
            total += e.cost[src][dst]
        return total

    def _forbidden(self, p: int, g: int, i: int) -> bool:
        """Whether group g of problem p picking i takes a pair an edge forbids (others held)."""
        chosen = self.current[p]
        for e in self.touching[p].get(g, ()):
            if e.forbidden and ((i if e.src == g else chosen[e.src]), (i if e.dst == g else chosen[e.dst])) \
                    in e.forbidden:
                return True
        return False

    def _best_switch(self, p: int, g: int) -> tuple[float, int] | None:
        """The cheapest switch per byte freed in group g of problem p: (rate, choice), of the
        switches that take no forbidden pair."""
        mems, current = self.problems[p].memory[g], self.current[p][g]
        now = self._cost_of(p, g, current)
        best: tuple[float, int] | None = None
        for i, m in enumerate(mems):
            saved = mems[current] - m
            if saved > 0 and not self._forbidden(p, g, i):
                rate = (self._cost_of(p, g, i) - now) / saved
                if best is None or rate < best[0]:
                    best = (rate, i)
        return best

    def switch(self, k: int) -> tuple[int, float] | None:
        """Switch ``k`` (from 0) as (problem, bytes it frees per copy), taking it first where
        the walk has not got so far; None where the walk ends before it."""
        while len(self.taken) <= k and not self.ended:
            self.ended = not self._step()
        if len(self.taken) <= k:
            return None
        return self.taken[k][0], self.freed[k]

    def _step(self) -> bool:
        """Take the next switch; False where none frees memory."""
        found = [(best[0], p, g, best[1]) for (p, g), best in self.switches.items() if best is not None]
        if not found:
            return False
        _, p, g, i = min(found)
        problem, chosen = self.problems[p], self.current[p]
        self.freed.append(problem.memory[g][chosen[g]] - problem.memory[g][i])
        chosen[g] = i
        self.taken.append((p, g, i))
        for h in {g, *(e.src for e in self.touching[p].get(g, ())), *(e.dst for e in self.touching[p].get(g, ()))}:
            self.switches[p, h] = self._best_switch(p, h)
        return True


class TrimPath:
    """The greedy of :func:`trim_memory_together` walked once for every budget: the switches
    come in the same order for every budget (:class:`TrimWalk`, which paths of the same
    problems with other ``counts`` may share), which only decides where the walk stops (the
    first step whose memory fits; memory falls at every step). The walk goes on, from where it
    stopped, only as far as a smaller budget asks."""

    def __init__(self, problems: list[IntraOpProblem], counts: list[int], choices: list[list[int]],
                 walk: TrimWalk | None = None) -> None:
        if not len(problems) == len(counts) == len(choices):
            raise ValueError("problems, counts and choices must have one entry per problem")
        self.walk = walk if walk is not None else TrimWalk(problems, choices)
        self.counts = counts
        # memory[k]: after the first k switches
        self.memory = [math.fsum(count * math.fsum(problem.memory[g][i] for g, i in enumerate(chosen))
                                 for problem, count, chosen in zip(problems, counts, choices))]

    def steps_to(self, budget: float) -> int | None:
        """How many switches the walk takes to first fit ``budget``; None where it never does.
        Budgets that take the same number of switches get the same choices."""
        while self.memory[-1] > budget:
            switch = self.walk.switch(len(self.memory) - 1)
            if switch is None:
                return None
            p, freed = switch
            self.memory.append(self.memory[-1] - self.counts[p] * freed)
        # memory falls at every step: the first k with memory[k] <= budget
        return bisect.bisect_left(self.memory, -budget, key=lambda m: -m)

    def choices_after(self, steps: int) -> list[list[int]]:
        """The choices after the first ``steps`` switches of the walk (taken already)."""
        choices = [list(c) for c in self.walk.start]
        for p, g, i in self.walk.taken[:steps]:
            choices[p][g] = i
        return choices

    def choices_at(self, budget: float) -> list[list[int]] | None:
        """The choices where the walk first fits ``budget``; None where it never does."""
        steps = self.steps_to(budget)
        return None if steps is None else self.choices_after(steps)
