"""A plan the search finds that runs on the DTensor interpreter is set against the
data-parallel plans PyTorch runs itself, by the step expected with the interpreter's dispatch
(:mod:`autoplan.planner.native_rivals`): the bundled GPT-2 example runs on DDP, the plan the
search found kept first among its alternatives; pins, a pinned pipeline or
``native_rivals=False`` keep the plan found."""

from __future__ import annotations

import pytest

from autoplan.load import load_model_file
from autoplan.planner.front_door import plan_model
from autoplan.planner.native_rivals import (FOUND_ON_THE_INTERPRETER, expected_step_s, rival_forms,
                                            searched_prediction)
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from launcher import ROOT


@pytest.fixture(scope="module")
def example():
    """The bundled example (GPT-2 124M on the meta device) planned for 8 H100s, one stage, with
    and without native rivals."""
    spec = load_model_file(str(ROOT / "examples" / "gpt2_124m.py"))
    return {rivals: plan_model(spec, PlanOptions(8, "h100", pipeline=False, native_rivals=rivals))
            for rivals in (True, False)}


def test_the_bundled_example_runs_on_ddp_where_its_found_plan_would_run_on_the_interpreter(example) -> None:
    found, chosen = example[False], example[True]
    assert found.program.startswith("autoplan's DTensor interpreter")
    assert chosen.program == "PyTorch's DistributedDataParallel"
    assert chosen.predicted.interpreter_step_s == 0  # a native program: its prediction is what it expects
    # chosen only because the found plan's step, with the interpreter's dispatch, is longer
    assert found.predicted.step_time_s < chosen.predicted.step_time_s < found.predicted.interpreter_step_s
    kept = chosen.alternatives[0]
    assert kept.name == FOUND_ON_THE_INTERPRETER and kept.predicted == found.predicted
    assert searched_prediction(chosen) == found.predicted and searched_prediction(found) == found.predicted
    assert expected_step_s(chosen.predicted) < expected_step_s(found.predicted)
    assert chosen.options["native_rivals"] and not found.options["native_rivals"]
    text = summary_text(chosen)
    assert "program: PyTorch's DistributedDataParallel" in text and "native rivals" in text
    assert "on autoplan's DTensor interpreter, with its dispatch:" in text


def test_pins_and_a_pinned_pipeline_keep_the_plan_found() -> None:
    assert [[m.label for m in tries] for tries in rival_forms(PlanOptions(4, "cpu"))] == [
        ["manual dp=4,tp=1,pp=1,microbatches=1", "manual dp=4,tp=1,pp=1,microbatches=1,ac=full"],
        ["manual dp=1,fsdp=4,tp=1,pp=1,microbatches=1", "manual dp=1,fsdp=4,tp=1,pp=1,microbatches=1,ac=full"]]
    assert [[m.label for m in tries] for tries in rival_forms(PlanOptions(4, "cpu", mesh=(2, 2), recompute="none"))] \
        == [["manual dp=2,fsdp=2,tp=1,pp=1,microbatches=1"]]  # HSDP on a pinned 2-D mesh
    for kept in (PlanOptions(4, "cpu", pins=("mesh=2x2",)), PlanOptions(4, "cpu", stages=2),
                 PlanOptions(4, "cpu", microbatches=2), PlanOptions(8, "cpu", mesh=(2, 2, 2))):
        assert rival_forms(kept) == [], kept
