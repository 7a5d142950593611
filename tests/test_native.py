"""Plans that reduce to a native PyTorch pattern run through it (DDP, parallelize_module with
ColwiseParallel/RowwiseParallel) and match the single device; other plans are not recognised.

One launch of 2 gloo processes runs every case of tests/native_worker.py; the tests read its
results. A planning-only test (no process group) checks that a 2-D plan is refused.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launcher import launch_worker, on_every_rank
from native_worker import CASES

WORKER = Path(__file__).resolve().parent / "native_worker.py"
ROOT = WORKER.parents[1]
WORLD = 2


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[dict]]:
    per_rank = launch_worker(WORKER, WORLD, tmp_path_factory.mktemp("native"), timeout=240)
    return {name: [per_rank[r][name] for r in range(WORLD)] for name in CASES}


def _case(results, name: str) -> list[dict]:
    return on_every_rank(results[name], name)


@pytest.mark.parametrize("name", list(CASES))
def test_runs_the_expected_program_and_matches_single_device(results, name):
    for res in _case(results, name):
        assert res["recognised"] == res["expected"], res["reason"]
        assert res["program"] == res["expected"]
        assert res["values_ok"], f"mismatch: {res['bad']}\n{res['report']}"
        # loss, output, every parameter's gradient, the loss after 2 SGD steps
        assert res["num_compared"] >= res["num_model_parameters"] + 3
        assert res["module_untouched"], "parallelizing changed the user's module"


@pytest.mark.parametrize("name", ["mlp_megatron_allreduce", "mlp_megatron_rs_seq"])
def test_megatron_uses_colwise_then_rowwise_with_the_plans_output_layout(results, name):
    res = _case(results, name)[0]
    assert res["params"]["up.weight"] == ["S(0)"] and res["params"]["down.weight"] == ["S(1)"]
    assert res["styles"]["up"][0] == "colwise" and res["styles"]["down"][0] == "rowwise"
    # the row output all-reduced, or reduce-scattered over batch or sequence (an equal-cost tie
    # between S(0) and S(1): either is right, the solver's canonical tie-break picks one)
    expected_layouts = {"mlp_megatron_allreduce": {"R"}, "mlp_megatron_rs_seq": {"S(0)", "S(1)"}}
    assert res["styles"]["down"][1] in expected_layouts[name]
    # the native program executes exactly the plan's collectives, forward and backward
    assert res["executed"] == res["planned"], res["report"]


def test_data_parallel_runs_ddp_with_bucketed_gradient_reduction(results):
    res = _case(results, "mlp_dp")[0]
    assert all(p == ["R"] for p in res["params"].values()) and res["inputs"]["x"] == ["S(0)"]
    # forward: the loss's all-reduce, as planned; backward: DDP's buckets (1 here) instead of
    # one all-reduce per parameter (4 planned) — what observable_collectives() expects
    assert res["executed"]["forward"] == res["planned"]["forward"]
    assert res["planned_by_plan"]["backward"] == {"all_reduce": 4}
    assert res["executed"] == res["observable"] == res["planned"]  # check.py compares against the buckets
    assert any(not observable for _, _, observable in res["collective_map"])


@pytest.mark.parametrize("name, needle", [("mlp_dp_sum_loss", "not a mean"),
                                          ("gpt_sharded", "tied parameter is sharded")])
def test_non_matching_plans_run_on_the_interpreter(results, name, needle):
    res = _case(results, name)[0]
    assert res["recognised"] == "none" and res["program"] == "none"
    assert needle in res["reason"]


def test_two_dimensional_plan_is_not_recognised():
    sys.path.insert(0, str(ROOT / "examples"))
    import mlp

    from autoplan.codegen.native import recognise
    from autoplan.planner.api import make_options, plan_spec
    from autoplan.load import make_model_spec

    model, inputs = mlp.build(hidden=64, batch=64, seq=128)
    spec = make_model_spec(model, inputs, mlp.loss_fn)
    plan, graph = plan_spec(spec, make_options(4, "h100", (2, 2)))
    found = recognise(spec, graph, plan)
    assert found.kind == "none" and "not 1-D" in found.reason
