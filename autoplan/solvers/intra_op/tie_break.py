r"""Which of several equally good assignments is canonical: the rule, from the data alone.

Among the assignments ``x`` that respect the memory budget and cost no more than the optimum
``f*`` plus a tolerance, ``f(x) <= f* + OBJECTIVE_RTOL * |f*| + OBJECTIVE_ATOL``, the canonical
one minimises ``W(x) = sum_g w[g, x_g]``, with the integer weights::

    w[g,i] = RANK_STRIDE * rank[g,i] + h[g,i]

``rank[g,i]`` is the position of choice ``i`` when group ``g``'s choices are sorted by
(memory, choice name): less memory first, then the smaller name. ``h[g,i]`` in
``[0, RANK_STRIDE)`` is a hash (BLAKE2b) of the group's and the choice's names; it separates
assignments of equal rank sum, so ``W`` has a single minimiser unless two hashes collide in a
sum (possible, vanishingly rare). Within one group ``w`` orders the choices exactly as
(memory, name) does, since ranks differ by at least ``RANK_STRIDE`` and hashes by less.

Everything is computed from the choices' data and names, never from list positions, so the
answer does not depend on the order groups and choices are fed in, nor on which solver found
the optimum. Where names are missing, positions stand in (group ``g`` is ``"group{g}"``,
choice ``i`` is ``"#{i}"``): the answer is then canonical for a fixed input order only.
"""

from __future__ import annotations

import hashlib

from autoplan.solvers.intra_op.problem import IntraOpProblem

OBJECTIVE_RTOL = 1e-9  # assignments within this (relative to f*) of the optimum are ties
OBJECTIVE_ATOL = 1e-15  # seconds: the absolute part of that tolerance
RANK_STRIDE = 1024  # w = RANK_STRIDE * rank + hash, hash in [0, RANK_STRIDE)


def objective_tolerance(optimum: float) -> float:
    """How far above the optimum ``f*`` an assignment may cost and still tie with it."""
    return OBJECTIVE_RTOL * abs(optimum) + OBJECTIVE_ATOL


def choice_ranks(problem: IntraOpProblem, group: int) -> list[int]:
    """rank[g,i]: the position of each choice when the group's choices are sorted by (memory,
    name); the list position only separates choices whose memory and name are both equal."""
    memory = problem.memory[group]
    order = sorted(range(len(memory)),
                   key=lambda i: (memory[i], problem.choice_name(group, i), i))
    ranks = [0] * len(memory)
    for rank, i in enumerate(order):
        ranks[i] = rank
    return ranks


def _name_hash(group_name: str, choice_name: str) -> int:
    digest = hashlib.blake2b(f"{group_name}\x00{choice_name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % RANK_STRIDE


def tie_break_weights(problem: IntraOpProblem) -> list[list[int]]:
    """w[g,i] = RANK_STRIDE * rank[g,i] + h[g,i] for every group and choice."""
    weights = []
    for g in range(problem.num_groups):
        name = problem.group_name(g)
        ranks = choice_ranks(problem, g)
        weights.append([RANK_STRIDE * r + _name_hash(name, problem.choice_name(g, i))
                        for i, r in enumerate(ranks)])
    return weights


def preferred_choice(problem: IntraOpProblem, group: int, costs: list[float], allowed: list[int] | None = None
                     ) -> int:
    """The canonical choice of a group decided alone (no edges, no binding budget): among the
    ``allowed`` choices (all by default) whose ``costs`` tie with the least, the one with the
    least (memory, name)."""
    allowed = list(range(len(costs))) if allowed is None else allowed
    low = min(costs[i] for i in allowed)
    tolerance = objective_tolerance(max(abs(low), max(abs(costs[i]) for i in allowed)))
    tied = [i for i in allowed if costs[i] - low <= tolerance]
    ranks = choice_ranks(problem, group)
    return min(tied, key=lambda i: ranks[i])
