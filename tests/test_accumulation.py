"""Gradient accumulation: one stage on all the devices running its microbatches one after the
other. The search plans it where the whole batch in one stage does not fit the memory budget,
and the program (torch's pipeline schedule with one stage) runs it: ``--check`` passes on 2
gloo processes for an MLP and for a Hugging Face Llama (its mean token loss weighted per
microbatch), with the collectives the plan lists."""

from __future__ import annotations

import json
import sys

import pytest

from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from launcher import ROOT, launch_worker

sys.path.insert(0, str(ROOT / "tests"))
import accumulation_cases  # noqa: E402
from zoo import ALL_CASES  # noqa: E402


def _spec(name: str):
    if name == "narrow":
        model, inputs, loss_fn = accumulation_cases.build()
    else:
        case = ALL_CASES[name]()
        model, inputs, loss_fn = case.model, case.example_inputs, case.loss_fn
    return make_model_spec(model, inputs, loss_fn, name=name)


def _accumulating(name: str) -> Plan:
    """The one-stage plan under the largest budget (a share of what the whole batch needs
    unconstrained) that makes the search cut the batch into microbatches."""
    spec = _spec(name)
    whole = plan_model(spec, PlanOptions(2, "cpu", stages=1))
    assert whole.microbatches == 1
    for share in (0.8, 0.65, 0.5, 0.4, 0.3, 0.2):
        budget = share * whole.predicted.memory_bytes.peak_with_transient
        plan = plan_model(spec, PlanOptions(2, "cpu", stages=1, memory_per_device=budget))
        if plan.microbatches > 1:
            return plan
    raise AssertionError(f"{name}: no budget made the search accumulate gradients")


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return {name: _accumulating(name) for name in ("narrow", "llama")}


@pytest.mark.parametrize("name", ["narrow", "llama"])
def test_search_accumulates_when_the_whole_batch_does_not_fit(plans: dict[str, Plan], name: str) -> None:
    plan = plans[name]
    assert len(plan.stages) == 1 and plan.microbatches > 1
    assert plan.predicted.memory_bytes.peak_with_transient <= plan.options["memory_per_device"]
    assert "gradient accumulation" in summary_text(plan)
    assert not [c for c in plan.collectives if c.kind == "broadcast"]  # every rank computes the loss


def test_accumulation_is_never_chosen_when_the_whole_batch_fits() -> None:
    plan = plan_model(_spec("narrow"), PlanOptions(2, "cpu", stages=1))
    assert plan.microbatches == 1


def test_accumulating_programs_pass_check(plans: dict[str, Plan], tmp_path) -> None:
    cases = []
    for name, plan in plans.items():
        path = tmp_path / f"{name}.json"
        path.write_text(plan.to_json())
        file = "accumulation_cases.py" if name == "narrow" else "zoo.py"
        cases.append({"name": name, "file": str(ROOT / "tests" / file), "builder": "build" if name == "narrow"
                      else name, "plan": str(path)})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    results = launch_worker(ROOT / "tests" / "check_worker.py", 2, tmp_path, timeout=600)
    for rank, found in results.items():
        for name in plans:
            assert "error" not in found[name], f"{name}, rank {rank}: {found[name].get('traceback')}"
            assert found[name]["ok"], f"{name}, rank {rank}:\n{found[name]['text']}"
