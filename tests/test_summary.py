"""The text summary the CLI prints: alternatives labelled by where their figures come from and
sorted, the planning time's total labelled, collectives named by parameter names."""

from __future__ import annotations

from pathlib import Path

from autoplan.load import load_model_file
from autoplan.plan_schema import Plan
from autoplan.planner.api import make_options
from autoplan.planner.manual import ManualPlan, plan_manual
from autoplan.reports.summary import planning_time_text, summary_text
from autoplan.solvers import format_seconds

ROOT = Path(__file__).resolve().parent.parent


def _prediction(step_s: float) -> dict:
    return {"step_time_s": step_s, "compute_s": step_s / 2, "comm_s": step_s / 2, "bubble_s": 0.0,
            "memory_bytes": {"params": 1, "grads": 1, "optimizer": 2, "activations": 3, "peak": 7}}


def _plan(**fields) -> Plan:
    data = {
        "format": "autoplan.plan/3", "graph_hash": "x", "devices": 2, "mesh": [2], "microbatches": 1,
        "schedule": "none", "inputs": {}, "nodes": [], "collectives": [],
        "optimizer": {"name": "adamw"}, "precision": {"name": "fp32"}, "recompute": [], "storage": {},
        "cluster": make_options(2, "cpu").cluster.to_dict(),
        "stages": [{"layers": ["layer0"], "devices": [0, 1], "mesh": [2]}], "params": {},
        "predicted": _prediction(1.0),
    }
    return Plan.from_dict({**data, **fields})


def _section(text: str, heading: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(heading))
    out = []
    for line in lines[start + 1:]:
        if not line.startswith("  "):
            break
        out.append(line.strip())
    return out


def test_alternatives_say_whether_a_figure_is_exact_or_a_search_estimate_and_are_sorted() -> None:
    plan = _plan(alternatives=[
        {"name": "estimated fast", "mesh": [2, 1], "predicted": None, "reason": "search", "estimate_s": 1.1},
        {"name": "exact slow", "mesh": [2, 1], "predicted": _prediction(3.0)},
        {"name": "infeasible one", "mesh": [3], "predicted": None, "reason": "infeasible: does not fit"},
        {"name": "estimated slow", "mesh": [2, 1], "predicted": None, "reason": "search", "estimate_s": 2.5},
        {"name": "exact fast", "mesh": [1, 2], "predicted": _prediction(1.2)},
    ])
    rows = _section(summary_text(plan), "alternatives")
    assert [r.split(":")[0] for r in rows] == ["exact fast", "exact slow", "estimated fast", "estimated slow",
                                               "infeasible one"]
    assert rows[0].startswith(f"exact fast: {format_seconds(1.2)} per step") and rows[0].endswith("[exact ILP]")
    assert rows[2].startswith(f"estimated fast: {format_seconds(1.1)} per step") and "[search estimate" in rows[2]
    assert "exact ILP" not in rows[2] and "search estimate" not in rows[0]
    assert rows[4] == "infeasible one: infeasible: does not fit"


def test_planning_total_is_the_wall_clock_or_the_sum_and_says_which() -> None:
    # the wall clock holds what no phase counts: it is shown as the total, labelled
    assert planning_time_text({"load": 0.5, "trace": 1.0, "search": 2.0, "total": 4.0}) == \
        "load 0.50s, trace 1.00s, search 2.00s; total 4.00s (wall clock)"
    # a recorded total below its parts (it left one out) is not shown: their sum is, labelled
    text = planning_time_text({"load": 0.5, "trace": 1.0, "search": 2.0, "total": 3.0})
    assert text.endswith("; total 3.50s (sum of the phases)") and "total 3.00s" not in text
    assert planning_time_text({"trace": 1.0, "solve": 0.25}).endswith("total 1.25s (sum of the phases)")
    summary = summary_text(_plan(timings_s={"trace": 1.0, "total": 1.5}))
    assert "planning time: trace 1.00s; total 1.50s (wall clock)" in summary.splitlines()


def test_collectives_name_parameters_as_the_model_does() -> None:
    spec = load_model_file(str(ROOT / "examples" / "mlp.py"))
    plan = plan_manual(spec, make_options(2, "cpu"), ManualPlan(dp=2))
    gradients = [c for c in plan.collectives if c.tensor == "gradient"]
    assert gradients
    for c in gradients:  # "blocks.0.up.weight -> linear", not the export name "p_blocks_0_up_weight"
        assert c.where.split(" -> ")[0] in plan.params
    rows = _section(summary_text(plan), "collectives per step")
    assert rows and not any(" p_" in row for row in rows)
    assert any(c.where in row for c in gradients for row in rows)
