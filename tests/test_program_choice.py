"""The plan names the program that will run it (``Plan.program``, the summary's ``program:``
line and the report's row), read when planned with the runtime's own recognition: PyTorch's
FSDP2, DDP or parallel styles for one stage, stages cut from the model for a pipeline, or the
DTensor interpreter with the reason. Whether the named program is the one that runs is
asserted in every check launch (``launcher.assert_program_as_planned``)."""

from __future__ import annotations

import sys

import pytest

from autoplan.codegen.program_choice import INTERPRETER_PROGRAM, ProgramKind, program_choice
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.reports.summary import summary_text
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.tracer import trace
from launcher import ROOT

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_cases  # noqa: E402
import pipeline_cases  # noqa: E402


@pytest.fixture(scope="module")
def llama():
    """A Llama of 4 layers and 8 sequences of 16 tokens."""
    return make_model_spec(*pipeline_cases.llama4(), name="llama4")


@pytest.fixture(scope="module")
def wide_batch():
    """A Llama of 16 sequences of 128 tokens, worth splitting over the devices."""
    return make_model_spec(*fsdp_cases.llama_accumulated(), name="llama")


def _planned(spec, devices: int, *pins: str, **options) -> Plan:
    return plan_model(spec, PlanOptions(devices, "cpu", pins=pins, precision="fp32", **options))


def _choice(spec, plan: Plan):
    one = spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches))
    return program_choice(spec, trace(one), plan)


def test_an_fsdp_plan_names_fsdp2(wide_batch) -> None:
    plan = _planned(wide_batch, 2, "fsdp=2", pipeline=False)
    assert plan.program == "PyTorch's FSDP2 (fully_shard per block)", plan.program
    assert _choice(wide_batch, plan).kind == ProgramKind.NATIVE
    assert f"program: {plan.program}" in summary_text(plan)


def test_accumulated_microbatches_are_named(wide_batch) -> None:
    plan = _planned(wide_batch, 2, "dp=2", "microbatches=2")
    assert len(plan.stages) == 1 and plan.microbatches == 2
    assert plan.program == "PyTorch's DistributedDataParallel, 2 microbatches accumulated", plan.program


def test_a_pipeline_of_one_device_per_stage_names_its_stages_cut_from_the_model(llama) -> None:
    plan = _planned(llama, 2, "stages=2", "microbatches=2", schedule="gpipe")
    assert plan.program.startswith("2 stages cut from the model's own modules by torch.distributed.pipelining "
                                   "(gpipe, 2 microbatches), one device each"), plan.program
    assert _choice(llama, plan).kind == ProgramKind.NATIVE_PIPELINE


def test_a_plan_no_native_program_runs_names_the_interpreter_and_why(llama) -> None:
    """Stages of two devices that gather a value before sending it on: data-parallel stages
    send their slices."""
    plan = _planned(llama, 4, "pp=2", "tp=2", "microbatches=2")
    choice = _choice(llama, plan)
    assert choice.kind == ProgramKind.INTERPRETER and choice.reason, choice
    assert plan.program == f"{INTERPRETER_PROGRAM} ({choice.reason})"


def test_the_program_survives_the_plan_file_and_an_older_plan_reads_without_it(wide_batch) -> None:
    plan = _planned(wide_batch, 2, "fsdp=2", pipeline=False)
    again = Plan.from_json(plan.to_json())
    assert again.program == plan.program
    data = plan.to_dict()
    del data["program"]
    assert Plan.from_dict(data).program == ""
    assert "program:" not in summary_text(Plan.from_dict(data))


def test_tensor_parallelism_inside_stages_names_the_interpreter(llama) -> None:
    plan = _planned(llama, 8, "pp=2", "fsdp=2", "tp=2", "microbatches=2")
    assert all(stage.mesh == [2, 2] for stage in plan.stages), [stage.mesh for stage in plan.stages]
    assert plan.program == f"{INTERPRETER_PROGRAM} (stages on 2x2 meshes (tensor parallelism inside stages))"


def test_a_program_that_cannot_be_read_leaves_the_plan_whole_with_a_warning(wide_batch, monkeypatch) -> None:
    import autoplan.planner.front_door as front_door

    def unreadable(*args):
        raise KeyError("linear_3")

    monkeypatch.setattr(front_door, "program_choice", unreadable)
    with pytest.warns(UserWarning, match="the program that runs the plan was not read"):
        plan = _planned(wide_batch, 2, "fsdp=2", pipeline=False)
    assert plan.program == "" and plan.params


def test_a_plan_replicating_everything_runs_the_model_itself_on_every_device(llama) -> None:
    """Every value and parameter whole and no collective (pinned here; the search's choice for
    small models on devices whose links cost more than the work they would split): each
    device runs the model itself, with no DTensor in the way."""
    plan = _planned(llama, 2, "*=[R]", pipeline=False)
    assert not plan.collectives
    choice = _choice(llama, plan)
    assert choice.kind == ProgramKind.NATIVE and plan.program.startswith("the model itself on every device"), plan
