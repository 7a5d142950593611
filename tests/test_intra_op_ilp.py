"""The intra-op ILP: optimality against brute force, memory budgets, preprocessing, statuses."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pulp
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.solvers.intra_op import (
    Edge,
    IntraOpProblem,
    SolverTimeoutError,
    backends,
    brute_force,
    build_model,
    evaluate,
    explain,
    least_memory,
    parse_cbc_bound,
    reduce_problem,
    relative_gap,
    solution_status,
    solve_intra_op,
    trim_memory,
    trim_memory_together,
)
from autoplan.solvers.intra_op import solve as solve_module
from autoplan.solvers.intra_op.run import extract_choices, run_model
from autoplan.solvers.intra_op.trimming import TrimPath, TrimWalk
from autoplan.solvers.units import format_bytes, format_seconds

SOLVERS = ["highs", "cbc"]


def random_problem(seed: int, max_groups: int = 8, max_choices: int = 4,
                   budget_share: float | None = None) -> IntraOpProblem:
    """Random costs, integer memory, random edges incl. self, duplicate, reversed and zero ones.

    Memory is integral and the budget sits at a half-integer, so no assignment lies within a
    solver tolerance of the budget.
    """
    rng = random.Random(seed)
    sizes = [rng.randint(1, max_choices) for _ in range(rng.randint(1, max_groups))]
    costs = [[rng.uniform(0.0, 1.0) for _ in range(n)] for n in sizes]
    memory = [[float(rng.randint(1, 50)) for _ in range(n)] for n in sizes]

    def matrix(u: int, v: int, zero: bool = False) -> list[list[float]]:
        return [[0.0 if zero else rng.uniform(0.0, 1.0) for _ in range(sizes[v])]
                for _ in range(sizes[u])]

    edges = []
    for _ in range(rng.randint(0, 2 * len(sizes))):
        u, v = rng.randrange(len(sizes)), rng.randrange(len(sizes))
        edges.append(Edge(u, v, matrix(u, v, zero=rng.random() < 0.1)))
    if edges:  # a duplicate and a reversed copy of existing edges
        e = rng.choice(edges)
        edges.append(Edge(e.src, e.dst, matrix(e.src, e.dst)))
        e = rng.choice(edges)
        edges.append(Edge(e.dst, e.src, matrix(e.dst, e.src)))
    budget = None
    if budget_share is not None:
        least = sum(min(m) for m in memory)
        most = sum(max(m) for m in memory)
        budget = math.floor(least + budget_share * (most - least)) + 0.5
    return IntraOpProblem(costs, memory, edges, memory_budget=budget)


def assert_same_optimum(ilp: float, exact: float) -> None:
    assert math.isclose(ilp, exact, rel_tol=1e-6, abs_tol=1e-9), (ilp, exact)


# ---------------------------------------------------------------------------- optimality


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), budget_share=st.one_of(st.none(), st.floats(0.0, 1.0)))
@example(seed=479001599, budget_share=0.1484375)  # CBC's integer preprocessing cut off its optimum
def test_ilp_matches_brute_force(seed: int, budget_share: float | None) -> None:
    problem = random_problem(seed, budget_share=budget_share)
    exact = brute_force(problem)
    for solver in SOLVERS:
        sol = solve_intra_op(problem, solver=solver)
        assert sol.status == "optimal" and sol.gap == 0.0
        assert sol.solver == solver
        assert_same_optimum(sol.objective, exact.objective)
        assert sol.choices == exact.choices  # both return the canonical optimum
        assert (sol.objective, sol.memory) == pytest.approx(evaluate(problem, sol.choices))
        if problem.memory_budget is not None:
            assert sol.memory <= problem.memory_budget


def test_the_ilp_answer_is_read_back_after_a_fractional_relaxation() -> None:
    """A problem whose relaxation is fractional: HiGHS then solves the ILP on the same solver
    object, and the answer read back is the ILP's optimum (HiGHS 1.16 once reported the
    optimum's objective beside a stale, worse solution there)."""
    problem = random_problem(17553, budget_share=0.28125)
    exact = brute_force(problem)
    for canonical in (False, True):
        solution = solve_intra_op(problem, solver="highs", canonical=canonical)
        assert_same_optimum(solution.objective, exact.objective)
        assert solution.objective == pytest.approx(evaluate(problem, solution.choices)[0])


@pytest.mark.parametrize("seed", range(15))
def test_reduced_model_value_plus_constant_is_the_objective(seed: int) -> None:
    """(P1)-(P5) change the model, not the cost of a plan: LP value x scale + constant."""
    problem = random_problem(seed, budget_share=0.5)
    reduced = reduce_problem(problem)
    if not reduced.active:
        return
    model = build_model(problem, reduced)
    run_model(model, "highs", None, None)
    choices = extract_choices(model, reduced, problem.num_groups)
    lp_total = model.objective_value() * model.scale + reduced.constant
    assert lp_total == pytest.approx(evaluate(problem, choices)[0], rel=1e-6)



@pytest.mark.parametrize("seed", range(10))
def test_pulps_model_for_cbc_has_the_arrays_rows_columns_and_costs(seed: int) -> None:
    """CBC solves pulp's model of the arrays HiGHS reads: the same columns (binary where the
    arrays say), every row with the same entries and bounds, the same objective."""
    problem = random_problem(seed, budget_share=0.5)
    reduced = reduce_problem(problem)
    if not reduced.active:
        return
    model = build_model(problem, reduced)
    lp, variables = model.to_pulp()
    column = {var.name: k for k, var in enumerate(variables)}
    binary = [k for k, var in enumerate(variables)
              if var.cat == pulp.LpInteger and (var.lowBound, var.upBound) == (0, 1)]
    assert binary == sorted(model.binaries.tolist())
    starts, columns, coefficients, lower, upper = model.matrix()
    ends = [*starts[1:], len(columns)]
    constraints = list(lp.constraints())
    assert len(constraints) == model.num_rows
    for r, constraint in enumerate(constraints):
        entries = {column[var.name]: x for var, x in constraint.items()}
        assert entries == dict(zip(columns[starts[r]:ends[r]].tolist(), coefficients[starts[r]:ends[r]].tolist()))
        bound = -constraint.constant
        assert (bound == upper[r]) and (constraint.sense == pulp.LpConstraintEQ) == (lower[r] == upper[r])
    objective = {column[var.name]: x for var, x in lp.objective.items()}
    assert objective == {k: c for k, c in enumerate(model.costs.tolist()) if c}

def test_self_edge_counts_only_its_diagonal() -> None:
    self_edge = Edge(0, 0, [[5.0, -100.0], [-100.0, 1.0]])
    problem = IntraOpProblem([[0.0, 0.0]], [[0.0, 0.0]], [self_edge])
    assert evaluate(problem, [0]) == (5.0, 0.0)
    assert solve_intra_op(problem).choices == [1]


def test_duplicate_and_reversed_edges_add_up() -> None:
    # Each edge alone prefers (0, 0); together they prefer (1, 1).
    edges = [Edge(0, 1, [[0.0, 9.0], [9.0, 2.0]]),
             Edge(0, 1, [[3.0, 9.0], [9.0, 0.0]]),
             Edge(1, 0, [[1.0, 9.0], [9.0, 0.5]])]
    problem = IntraOpProblem([[0.0, 0.0], [0.0, 0.0]], [[1, 1], [1, 1]], edges)
    for solver in SOLVERS:
        sol = solve_intra_op(problem, solver=solver)
        assert sol.choices == [1, 1]
        assert sol.objective == pytest.approx(2.5)


def test_same_problem_same_choices_even_with_ties() -> None:
    rng = random.Random(7)
    costs = [[1.0] * 4 for _ in range(30)]
    edges = [Edge(g, g + 1, [[0.0 if i == j else rng.choice([1.0, 2.0]) for j in range(4)]
                             for i in range(4)]) for g in range(29)]
    problem = IntraOpProblem(costs, [[1.0] * 4 for _ in range(30)], edges)
    for solver in SOLVERS:
        first = solve_intra_op(problem, solver=solver).choices
        assert all(solve_intra_op(problem, solver=solver).choices == first for _ in range(3))


# ---------------------------------------------------------------------------- memory


def test_memory_budget_forces_a_costlier_choice() -> None:
    # group 0: fast and big, or slow and small; group 1 has one choice.
    problem = IntraOpProblem([[1.0, 3.0], [0.5]], [[10e9, 2e9], [1e9]],
                             [Edge(0, 1, [[0.1], [0.2]])])
    free = solve_intra_op(problem)
    assert free.choices == [0, 0] and free.objective == pytest.approx(1.6)
    problem.memory_budget = 5e9
    for solver in SOLVERS:
        tight = solve_intra_op(problem, solver=solver)
        assert tight.choices == [1, 0]
        assert tight.objective == pytest.approx(3.7)
        assert tight.memory == pytest.approx(3e9) and tight.memory <= 5e9


@pytest.mark.parametrize("solve", [solve_intra_op, brute_force])
def test_budget_below_the_least_memory_raises(solve) -> None:
    problem = IntraOpProblem([[1.0, 2.0], [1.0, 3.0]], [[2.5e9, 1.21e9], [2e9, 4e9]], [],
                             memory_budget=1e9)
    with pytest.raises(MemoryInfeasibleError) as info:
        solve(problem)
    assert info.value.least_memory_bytes == pytest.approx(3.21e9)
    message = str(info.value)
    assert "\n" not in message
    assert "1.00 GB" in message and "3.21 GB" in message and "--memory-per-device" in message
    assert isinstance(info.value, AutoplanError)


def test_budget_exactly_the_least_memory_is_feasible() -> None:
    problem = IntraOpProblem([[1.0, 2.0], [1.0, 3.0]], [[3.0, 1.0], [2.0, 4.0]],
                             [Edge(0, 1, [[0.0, 1.0], [1.0, 0.5]])], memory_budget=3.0)
    sol = solve_intra_op(problem)
    assert sol.choices == [1, 0] and sol.memory == 3.0


def test_format_units() -> None:
    assert format_bytes(3.2149e9) == "3.21 GB"
    assert format_bytes(1e9) == "1.00 GB"
    assert format_bytes(512e6) == "512.00 MB"
    assert format_seconds(1.5) == "1.50 s"
    assert format_seconds(0.0123) == "12.30 ms"
    assert format_seconds(4.5e-6) == "4.50 us"


# ---------------------------------------------------------------------------- preprocessing


def chain(n: int, seed: int) -> tuple[list[list[float]], list[Edge]]:
    rng = random.Random(seed)
    costs = [[rng.uniform(0, 1) for _ in range(3)] for _ in range(n)]
    edges = [Edge(g, g + 1, [[rng.uniform(0, 1) for _ in range(3)] for _ in range(3)])
             for g in range(n - 1)]
    return costs, edges


def test_single_choice_groups_and_zero_edges_leave_the_model() -> None:
    costs, edges = chain(3, seed=1)
    base = IntraOpProblem(costs, [[1.0] * 3 for _ in costs], edges)
    # add two single-choice groups wired to the chain, and all-zero edges
    extra_edges = edges + [Edge(3, 0, [[0.3, 0.0, 0.9]]), Edge(1, 4, [[0.2], [0.1], [0.7]]),
                           Edge(0, 2, [[0.0] * 3 for _ in range(3)]),
                           Edge(2, 1, [[0.0] * 3 for _ in range(3)])]
    bigger = IntraOpProblem(costs + [[0.25], [0.5]], [[1.0] * 3 for _ in costs] + [[2.0], [3.0]],
                            extra_edges)
    base_sol, big_sol = solve_intra_op(base), solve_intra_op(bigger)
    # 9 one-hot binaries + 2 chain edges x 9 marginal cells; nothing for the additions
    assert base_sol.num_variables == 9 + 2 * 9
    assert big_sol.num_variables == base_sol.num_variables
    assert big_sol.num_constraints == base_sol.num_constraints
    assert_same_optimum(big_sol.objective, brute_force(bigger).objective)
    assert big_sol.choices[3:] == [0, 0]


def test_separable_edges_fold_into_node_costs() -> None:
    costs, edges = chain(3, seed=2)
    a, b = [0.1, 0.4, 0.2], [0.3, 0.0, 0.5]
    separable = Edge(0, 2, [[x + y for y in b] for x in a])
    problem = IntraOpProblem(costs, [[1.0] * 3 for _ in costs], edges + [separable])
    sol = solve_intra_op(problem)
    assert sol.num_variables == 9 + 2 * 9
    assert_same_optimum(sol.objective, brute_force(problem).objective)


def test_isolated_groups_need_no_variables_unless_a_budget_binds() -> None:
    problem = IntraOpProblem([[2.0, 1.0, 1.0], [0.5, 0.7]], [[1.0, 5.0, 4.0], [1.0, 2.0]], [])
    sol = solve_intra_op(problem)
    assert sol.num_variables == 0 and sol.choices == [2, 0]  # least memory among tied minima
    problem.memory_budget = 100.0  # met by every assignment: still no model
    assert solve_intra_op(problem).num_variables == 0
    problem.memory_budget = 5.5  # choice 1 (5 + 1 bytes) no longer fits
    sol = solve_intra_op(problem)
    assert sol.num_variables == 5 and sol.choices == [2, 0] and sol.memory == 5.0


def test_empty_problem() -> None:
    sol = solve_intra_op(IntraOpProblem([], [], []))
    assert sol.choices == [] and sol.objective == 0.0 and sol.status == "optimal"


# ---------------------------------------------------------------------------- statuses


def test_status_mapping() -> None:
    assert solution_status(pulp.LpSolutionOptimal, None) == "optimal"
    assert solution_status(pulp.LpSolutionIntegerFeasible, 5.0) == "time_limit"
    with pytest.raises(SolverTimeoutError) as info:
        solution_status(pulp.LpSolutionNoSolutionFound, 0.5)
    assert "raise the time limit" in str(info.value) and "\n" not in str(info.value)
    assert isinstance(info.value, AutoplanError)
    with pytest.raises(RuntimeError):
        solution_status(pulp.LpSolutionInfeasible, None)


def test_relative_gap() -> None:
    assert relative_gap(10.0, 9.0) == pytest.approx(0.1)
    assert relative_gap(10.0, 10.5) == 0.0  # a bound above the incumbent is rounding
    assert relative_gap(10.0, None) is None
    assert relative_gap(0.0, -1.0) == 0.0


def test_parse_cbc_bound() -> None:
    log = ("Cbc0010I After 100 nodes, 3 on tree, 58.8 best solution, best possible 58.1 (0.5 s)\n"
           "Cbc0005I Partial search - best objective 58.715073 (best possible 58.695727), took 0\n"
           "Result - Stopped on time limit\n\nObjective value:   58.71507261\n"
           "Lower bound:                    58.696\nGap:   0.00\n")
    assert parse_cbc_bound(log) == 58.695727
    assert parse_cbc_bound("Lower bound:   12.5\n") == 12.5
    assert parse_cbc_bound("Result - Optimal solution found\n") is None


@pytest.mark.parametrize("solver", SOLVERS)
def test_time_limit_stop_is_reported_with_its_gap(monkeypatch, solver: str) -> None:
    """A solver stopped early (sol_status IntegerFeasible) yields "time_limit" and the gap
    computed from its bound, translated back to seconds (scale and constant)."""
    real_run = solve_module.run_model

    def stopped_early(model, *args, **kwargs):
        run = real_run(model, *args, **kwargs)
        value = model.objective_value()
        run.sol_status = pulp.LpSolutionIntegerFeasible
        run.bound = value - 0.25 * abs(value)
        return run

    monkeypatch.setattr(solve_module, "run_model", stopped_early)
    problem = random_problem(3, budget_share=0.4)
    reduced = reduce_problem(problem)
    sol = solve_intra_op(problem, solver=solver, time_limit_s=30)
    assert sol.status == "time_limit"
    shifted = sol.objective - reduced.constant  # what the model's objective measures
    assert sol.gap == pytest.approx(0.25 * shifted / sol.objective, rel=1e-6)


def test_a_real_time_limit_stops_the_solver() -> None:
    """A 0.02 s limit on a 1,500-group model: either no plan yet (SolverTimeoutError) or a
    feasible plan with status time_limit and a gap; never a silent "optimal" claim with an
    inconsistent answer."""
    rng = random.Random(0)
    n = 1500
    costs = [[rng.uniform(0, 1) for _ in range(4)] for _ in range(n)]
    memory = [[float(rng.randint(1, 50)) for _ in range(4)] for _ in range(n)]
    edges = [Edge(g, g + 1, [[0.0 if i == j else rng.uniform(0, 1) for j in range(4)]
                             for i in range(4)]) for g in range(n - 1)]
    budget = sum(min(m) for m in memory) + 0.2 * n + 0.5
    problem = IntraOpProblem(costs, memory, edges, memory_budget=budget)
    try:
        sol = solve_intra_op(problem, time_limit_s=0.02)
    except SolverTimeoutError as error:
        assert "raise the time limit" in str(error)
        return
    assert sol.status in ("time_limit", "optimal")
    assert sol.memory <= budget
    assert sol.objective == pytest.approx(evaluate(problem, sol.choices)[0])
    if sol.status == "time_limit":
        assert sol.gap is None or sol.gap >= 0.0


# ---------------------------------------------------------------------------- solvers, errors


def test_falls_back_to_the_other_solver(monkeypatch) -> None:
    monkeypatch.setattr(backends, "solver_available", lambda name: name == "cbc")
    costs, edges = chain(3, seed=3)
    with pytest.warns(backends.SolverFallbackWarning, match="'highs' is not available.*'cbc'"):
        sol = solve_intra_op(IntraOpProblem(costs, [[1.0] * 3] * 3, edges), solver="highs")
    assert sol.solver == "cbc"


def test_no_solver_at_all(monkeypatch) -> None:
    monkeypatch.setattr(backends, "solver_available", lambda name: False)
    with pytest.raises(AutoplanError):
        solve_intra_op(IntraOpProblem([[1.0]], [[1.0]], []))


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: IntraOpProblem([[1.0], []], [[1.0], []], []), "group 1 has no choices"),
        (lambda: IntraOpProblem([[1.0, 2.0]], [[1.0]], []), "2 costs but 1 memory"),
        (lambda: IntraOpProblem([[1.0]], [[1.0], [2.0]], []), "1 groups but memory has 2"),
        (lambda: IntraOpProblem([[1.0]], [[1.0]], [Edge(0, 1, [[0.0]])]), "dst=1, outside"),
        (lambda: IntraOpProblem([[1.0]], [[1.0]], [Edge(-1, 0, [[0.0]])]), "src=-1, outside"),
        (lambda: IntraOpProblem([[1.0, 2.0], [1.0]], [[1.0, 1.0], [1.0]], [Edge(0, 1, [[0.0]])]),
         "has 1 rows; src group 0 has 2"),
        (lambda: IntraOpProblem([[1.0], [1.0, 2.0]], [[1.0], [1.0, 1.0]], [Edge(0, 1, [[0.0]])]),
         "row 0 has 1 entries; dst group 1 has 2"),
        (lambda: IntraOpProblem([[math.inf]], [[1.0]], []), "finite"),
        (lambda: IntraOpProblem([[math.nan]], [[1.0]], []), "finite"),
        (lambda: IntraOpProblem([[1.0]], [[-1.0]], []), "negative"),
        (lambda: IntraOpProblem([[1.0]], [[1.0]], [], memory_budget=-5.0), "memory_budget"),
        (lambda: IntraOpProblem([[1.0]], [[1.0]], [], names=["a", "b"]), "names has 2"),
        (lambda: IntraOpProblem([[1.0]], [[1.0]], [], choice_names=[["x", "y"]]), "2 names for 1"),
    ],
)
def test_validation_errors(build, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_invalid_solver_arguments() -> None:
    problem = IntraOpProblem([[1.0]], [[1.0]], [])
    with pytest.raises(AutoplanError, match="^unknown solver 'gurobi': use one of highs, cbc$"):
        solve_intra_op(problem, solver="gurobi")
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_intra_op(problem, time_limit_s=0)
    with pytest.raises(ValueError, match="mip_gap"):
        solve_intra_op(problem, mip_gap=1.5)
    with pytest.raises(ValueError, match="choices for"):
        evaluate(problem, [0, 0])
    with pytest.raises(ValueError, match="limit"):
        brute_force(IntraOpProblem([[0.0] * 10] * 7, [[0.0] * 10] * 7, []))


def test_mutated_problem_is_validated_again_at_solve() -> None:
    problem = IntraOpProblem([[1.0, 2.0]], [[1.0, 1.0]], [])
    problem.edges.append(Edge(0, 3, [[0.0], [0.0]]))
    with pytest.raises(ValueError, match="outside"):
        solve_intra_op(problem)


# ---------------------------------------------------------------------------- explain


def test_explain_names_the_largest_terms_first() -> None:
    problem = IntraOpProblem(
        [[0.002, 0.010], [0.001, 0.001]], [[2e9, 1e9], [3e9, 3e9]],
        [Edge(0, 1, [[0.050, 0.050], [0.0, 0.0]])],
        names=["linear_1", "relu_1"],
        choice_names=[["RR = RR x RR", "S0R = S0R x RR"], ["RR", "S0R"]],
    )
    sol = solve_intra_op(problem)
    assert sol.choices[0] == 1  # the 50 ms edge outweighs the 8 ms node saving
    text = explain(problem, sol, top=2)
    lines = text.splitlines()
    cost_lines = lines[2:4]
    assert "linear_1: S0R = S0R x RR" in cost_lines[0] and "10.00 ms" in cost_lines[0]
    assert "relu_1" in cost_lines[1]
    assert "3.00 GB" in text and "optimal" in lines[0]
    assert len([l for l in lines if l.startswith("  ")]) == 4  # top 2 cost + top 2 memory


@pytest.mark.parametrize("seed", range(40))
def test_trim_memory_fits_the_budget_and_never_beats_the_optimum(seed: int) -> None:
    """The stage search's quick estimate under a memory budget: from the fastest assignment it
    reaches one that fits whenever any does, and is never cheaper than the ILP's optimum."""
    problem = random_problem(seed, budget_share=0.4)
    budget = problem.memory_budget
    fastest = solve_intra_op(replace(problem, memory_budget=None)).choices
    trimmed = trim_memory(problem, fastest, budget)
    if least_memory(problem) > budget:
        assert trimmed is None
        return
    assert trimmed is not None
    cost, memory = evaluate(problem, trimmed)
    assert memory <= budget
    assert cost >= solve_intra_op(problem).objective - 1e-9
    assert trim_memory(problem, trimmed, budget) == trimmed  # already fits: unchanged


@pytest.mark.parametrize("seed", range(30))
def test_trim_memory_together_fits_the_shared_budget_and_never_beats_the_optimum(seed: int) -> None:
    """Two independent problems, the second standing for several identical copies, under one
    budget: the trimmed assignment fits it whenever any does, and costs no less than the
    optimum of the problems merged into one ILP (copies scaled by their count)."""
    first, second = random_problem(seed), random_problem(1000 + seed)
    copies = 1 + seed % 3
    merged = _merged([first, second], [1, copies])
    budget = least_memory(merged) + 0.4 * (evaluate(merged, solve_intra_op(merged).choices)[1] - least_memory(merged))
    budget = math.floor(budget) + 0.5  # integral memory: no assignment within a tolerance of it
    fastest = [solve_intra_op(p).choices for p in (first, second)]
    trimmed = trim_memory_together([first, second], [1, copies], fastest, budget)
    if least_memory(merged) > budget:
        assert trimmed is None
        return
    assert trimmed is not None
    cost, memory = evaluate(merged, trimmed[0] + trimmed[1])
    assert memory <= budget
    assert cost >= solve_intra_op(replace(merged, memory_budget=budget)).objective - 1e-9
    if least_memory(first) <= budget:  # one problem of one copy: the single-problem greedy
        assert trim_memory_together([first], [1], [fastest[0]], budget) == [trim_memory(first, fastest[0], budget)]


@pytest.mark.parametrize("seed", range(10))
def test_one_trimming_walk_answers_every_budget_as_its_own_walk_does(seed: int) -> None:
    """A :class:`TrimPath` asked for budgets in any order (larger after smaller, repeated)
    gives each the choices a walk of its own stops at."""
    problems = [random_problem(seed), random_problem(2000 + seed)]
    counts = [1, 2 + seed % 3]
    fastest = [solve_intra_op(p).choices for p in problems]
    merged = _merged(problems, counts)
    least, most = least_memory(merged), evaluate(merged, fastest[0] + fastest[1])[1]
    rng = random.Random(seed)
    budgets = [least - 1.0, most + 1.0] + [math.floor(rng.uniform(least, most)) + 0.5 for _ in range(6)]
    rng.shuffle(budgets)
    path = TrimPath(problems, counts, fastest)
    for budget in budgets + budgets[::-1]:
        assert path.choices_at(budget) == trim_memory_together(problems, counts, fastest, budget), budget



@pytest.mark.parametrize("seed", range(10))
def test_paths_of_other_counts_that_share_one_walk_answer_as_their_own_walks(seed: int) -> None:
    """Paths of the same problems standing for other numbers of copies share one
    :class:`TrimWalk` (the greedy's order does not depend on the counts), taken in turns
    and as far as each asks, and each gives every budget the choices a walk of its own stops at."""
    problems = [random_problem(3000 + seed), random_problem(4000 + seed)]
    fastest = [solve_intra_op(p).choices for p in problems]
    walk = TrimWalk(problems, fastest)
    rng = random.Random(seed)
    for counts in ([1, 1], [1, 3], [2, 1], [4, 5], [1, 3]):
        merged = _merged(problems, counts)
        least, most = least_memory(merged), evaluate(merged, fastest[0] + fastest[1])[1]
        path = TrimPath(problems, counts, fastest, walk)
        for budget in [least - 1.0, most + 1.0] + [math.floor(rng.uniform(least, most)) + 0.5 for _ in range(4)]:
            assert path.choices_at(budget) == trim_memory_together(problems, counts, fastest, budget), (counts, budget)

def _merged(problems: list[IntraOpProblem], counts: list[int]) -> IntraOpProblem:
    """Independent problems as one, each problem's costs and memory scaled by its count."""
    costs, memory, edges, offset = [], [], [], 0
    for problem, count in zip(problems, counts):
        costs += [[c * count for c in group] for group in problem.costs]
        memory += [[m * count for m in group] for group in problem.memory]
        edges += [Edge(e.src + offset, e.dst + offset, [[c * count for c in row] for row in e.cost])
                  for e in problem.edges]
        offset += len(problem.costs)
    return IntraOpProblem(costs, memory, edges)
