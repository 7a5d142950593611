"""A solution as text: its largest cost terms and memory holders."""

from __future__ import annotations

from autoplan.solvers.intra_op.problem import IntraOpProblem, IntraOpSolution
from autoplan.solvers.units import format_bytes, format_seconds


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
        (f"objective {format_seconds(solution.objective)}, memory {format_bytes(solution.memory)}"
         f"{budget} per device ({solution.status}{gap}, {solution.solver}, "
         f"{solution.num_variables} variables, {solution.num_constraints} constraints, "
         f"{solution.solve_time_s:.2f} s)"),
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
