"""How long the intra-op ILP takes on a synthetic graph, with HiGHS and with CBC.

Builds a random chain-plus-skip-edges problem (default 500 groups x 4 choices = 2,000 one-hot
variables, 300 edges), solves it in the marginal form with each solver, without and with a
memory budget, and prints one table row per run:

    .venv/bin/python benchmarks/ilp_scaling.py
    .venv/bin/python benchmarks/ilp_scaling.py --groups 2000 --edges 1500 --time-limit 60

The costs imitate a sharding problem: choice 0 is "replicated" (slow, memory-hungry, no
communication), choices 1.. are shardings of growing degree (faster, smaller, with a collective
of their own); an edge costs nothing when both ends agree and a random resharding otherwise.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autoplan.solvers.intra_op import (  # noqa: E402
    Edge,
    IntraOpProblem,
    SolverTimeoutError,
    least_memory,
    solve_intra_op,
)
from autoplan.solvers.units import format_bytes  # noqa: E402


def _group(rng: random.Random, choices: int) -> tuple[list[float], list[float]]:
    """Node costs (s) and memory (bytes) of one op: replicated first, then shardings."""
    compute = rng.uniform(1e-4, 2e-3)
    weights = rng.uniform(1e7, 5e8)
    costs, memory = [], []
    for i in range(choices):
        degree = 2**i
        collective = 0.0 if i == 0 else rng.uniform(0.2, 1.5) * compute
        costs.append(compute / degree + collective)
        memory.append(weights / degree)
    return costs, memory


def _edge_matrix(rng: random.Random, choices: int) -> list[list[float]]:
    """Free when both ends agree, a random resharding time otherwise."""
    scale = rng.uniform(1e-5, 1e-3)
    return [[0.0 if i == j else scale * rng.uniform(0.2, 1.0) for j in range(choices)]
            for i in range(choices)]


def _edge_pairs(rng: random.Random, groups: int, edges: int, skip_fraction: float
                ) -> list[tuple[int, int]]:
    """Mostly chain edges (g, g+1), some skip edges (g, g+k) with 2 <= k <= 8."""
    chain = [(g, g + 1) for g in range(groups - 1)]
    num_skip = int(round(edges * skip_fraction))
    pairs = rng.sample(chain, min(len(chain), edges - num_skip))
    for _ in range(num_skip):
        u = rng.randrange(groups - 2)
        pairs.append((u, min(groups - 1, u + rng.randint(2, 8))))
    return sorted(pairs)


def build_problem(groups: int, choices: int, edges: int, skip_fraction: float, seed: int
                  ) -> IntraOpProblem:
    """A random chain-plus-skip-edges IntraOpProblem (no budget)."""
    rng = random.Random(seed)
    costs, memory = zip(*(_group(rng, choices) for _ in range(groups)))
    edge_list = [Edge(u, v, _edge_matrix(rng, choices))
                 for u, v in _edge_pairs(rng, groups, edges, skip_fraction)]
    return IntraOpProblem(list(costs), list(memory), edge_list)


def with_budget(problem: IntraOpProblem, fraction: float) -> IntraOpProblem:
    """The same problem with a budget ``fraction`` of the way from the least to the most memory."""
    low = least_memory(problem)
    high = sum(max(m) for m in problem.memory)
    return IntraOpProblem(problem.costs, problem.memory, problem.edges,
                          memory_budget=low + fraction * (high - low))


def _row(label: str, problem: IntraOpProblem, solver: str, time_limit: float | None) -> str:
    start = time.perf_counter()
    try:
        sol = solve_intra_op(problem, solver=solver, time_limit_s=time_limit)
    except SolverTimeoutError:
        return f"{label:<22} {solver:<6} {'-':>9} {'-':>11} {'-':>9} {'-':>9} {'no plan':<11}"
    total = time.perf_counter() - start
    gap = "" if not sol.gap else f" gap {sol.gap:.2%}"
    return (f"{label:<22} {sol.solver:<6} {sol.num_variables:>9} {sol.num_constraints:>11} "
            f"{sol.solve_time_s:>8.2f}s {total:>8.2f}s {sol.status + gap:<11} "
            f"{sol.objective * 1e3:>12.4f} {format_bytes(sol.memory):>10}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=500)
    parser.add_argument("--choices", type=int, default=4)
    parser.add_argument("--edges", type=int, default=300)
    parser.add_argument("--skip-fraction", type=float, default=0.3,
                        help="share of the edges that skip ahead 2..8 groups")
    parser.add_argument("--budget-fraction", type=float, default=0.15,
                        help="budget = least + fraction x (most - least) memory")
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument("--solvers", nargs="+", default=["highs", "cbc"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    base = build_problem(args.groups, args.choices, args.edges, args.skip_fraction, args.seed)
    budgeted = with_budget(base, args.budget_fraction)
    print(f"{args.groups} groups x {args.choices} choices = {args.groups * args.choices} one-hot "
          f"variables, {len(base.edges)} edges; budget {format_bytes(budgeted.memory_budget)} "
          f"per device (least {format_bytes(least_memory(base))}); "
          f"time limit {args.time_limit:g} s")
    print(f"{'problem':<22} {'solver':<6} {'variables':>9} {'constraints':>11} "
          f"{'solve':>9} {'total':>9} {'status':<11} {'objective ms':>12} {'memory':>10}")
    for label, problem in (("no budget", base), ("memory budget", budgeted)):
        for solver in args.solvers:
            print(_row(label, problem, solver, args.time_limit), flush=True)


if __name__ == "__main__":
    main()
