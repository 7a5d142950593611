"""Pipelines whose stages are cut from the model's own modules (autoplan/codegen/native_pipeline.py):
which plans run so, the pipe's values handed on stage by stage, and ``--check`` against one
device on four gloo processes (loss, every gradient, the parameters after two optimizer steps,
the executed collectives), checkpointed and in bf16 included, with stages of one device and
stages of two devices that shard their parameters over them (FSDP2)."""

from __future__ import annotations

import copy
import json
import math
import operator
import sys

import pytest
import torch

from autoplan.codegen.native_pipeline import _handed_on_stage_by_stage, _returning_the_loss, stage_starts
from autoplan.codegen.stage_data_parallel import stage_data_parallel
from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.tracer import trace
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
import fsdp_cases  # noqa: E402
import pipeline_cases  # noqa: E402

NATIVE = "native: torch.distributed.pipelining"


def _llama4():
    return make_model_spec(*pipeline_cases.llama4(), name="llama4")


def _llama4_tied():
    return make_model_spec(*pipeline_cases.llama4_tied(), name="llama4_tied")


def _nanogpt():
    return make_model_spec(*fsdp_cases.nanogpt(), name="nanogpt")  # its head is its token table


def _llama4_wide():
    return make_model_spec(*pipeline_cases.llama4_wide(), name="llama4_wide")


def _planned(spec, devices: int, pins: tuple[str, ...], **options) -> Plan:
    options.setdefault("precision", "fp32")
    return plan_model(spec, PlanOptions(devices, "cpu", pins=pins, **options))


def _starts(spec, plan: Plan) -> list[str] | None:
    return stage_starts(spec, trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches))),
                        plan)


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    """The Llama's pipelines, each planned once for the file."""
    spec = _llama4()
    return {
        "4 stages gpipe": _planned(spec, 4, ("stages=4", "microbatches=2"), schedule="gpipe"),
        "4 stages 1f1b checkpointed bf16": _planned(spec, 4, ("stages=4", "microbatches=4"), schedule="1f1b",
                                                    recompute="all", precision="bf16"),
        "4 virtual stages interleaved": _planned(spec, 2, ("stages=2", "microbatches=2"), schedule="interleaved1f1b"),
        "4 virtual stages zero bubble": _planned(spec, 2, ("stages=2", "microbatches=2"),
                                                 schedule="interleavedzerobubble"),
        "2 stages of two devices": _planned(spec, 4, ("stages=2", "microbatches=2")),
        "2 stages x FSDP 2, values crossing whole": _planned(spec, 4, ("pp=2", "fsdp=2", "microbatches=2"),
                                                            schedule="1f1b"),
        "nanogpt 2 stages, its token table the head": _planned(_nanogpt(), 2, ("stages=2", "microbatches=2")),
        "4 virtual stages interleaved, head tied": _planned(_llama4_tied(), 2, ("stages=2", "microbatches=2"),
                                                            schedule="interleaved1f1b"),
        **_sharded_stages(),
    }


def _sharded_stages() -> dict[str, Plan]:
    """Pipelines whose stages each hold two devices, FSDP over them (the wide Llama, whose
    stage boundaries are crossed by shards)."""
    wide, fsdp = _llama4_wide(), ("pp=2", "fsdp=2", "microbatches=2")
    return {
        "2 stages x FSDP 2 gpipe": _planned(wide, 4, fsdp, schedule="gpipe"),
        "2 stages x FSDP 2 1f1b checkpointed": _planned(wide, 4, fsdp, schedule="1f1b", recompute="all"),
        "2 stages x FSDP 2 1f1b bf16": _planned(wide, 4, fsdp, schedule="1f1b", precision="bf16"),
        "4 virtual stages x FSDP 2 interleaved": _planned(wide, 4, fsdp, schedule="interleaved1f1b"),
        "2 stages x FSDP 2 held, --manual": _manual(wide, 4, "pp=2,fsdp=2,microbatches=2"),
        "2 stages x DDP 2 1f1b": _planned(wide, 4, ("pp=2", "dp=2", "microbatches=2"), schedule="1f1b"),
        "2 stages x FSDP 2 1f1b, head tied": _planned(make_model_spec(*pipeline_cases.llama4_wide_tied(), name="tied"),
                                                      4, fsdp, schedule="1f1b"),
        _LONG: _planned(make_model_spec(*pipeline_cases.llama4_long(), name="long"), 4, fsdp, schedule="1f1b"),
        _WHOLE_BESIDE: _manual(_opt_odd(), 4, "pp=2,fsdp=2,microbatches=2"),
        _POSITIONS: _manual(make_model_spec(*pipeline_cases.gpt2_positions(), name="gpt2_positions"), 4,
                            "pp=2,fsdp=2,microbatches=2"),
    }


def _opt_odd():
    return make_model_spec(*pipeline_cases.opt_odd(), name="opt_odd")


def _manual(spec, devices: int, text: str) -> Plan:
    """The plan ``--manual TEXT`` costs (FSDP under a pipeline: held through the microbatches)."""
    options = PlanOptions(devices, "cpu", precision="fp32", plan_only=True)
    return with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)), options)


def test_stages_of_one_device_each_start_at_the_plans_first_modules(plans: dict[str, Plan]) -> None:
    assert _starts(_llama4(), plans["4 stages gpipe"]) == ["model.layers.1", "model.layers.2", "model.layers.3"]
    interleaved = plans["4 virtual stages interleaved"]  # two stages on each of two ranks, looped
    assert [stage.devices for stage in interleaved.stages] == [[0], [1], [0], [1]]
    assert _starts(_llama4(), interleaved) == ["model.layers.1", "model.layers.2", "model.layers.3"]


def test_a_weight_tied_across_pipeline_ranks_is_held_by_each_and_its_copies_gradients_summed(
        plans: dict[str, Plan]) -> None:
    """nanoGPT's token table is its head, the tied Llamas' head their token table: the first and
    the last stage (on two pipeline ranks, of one device or two each, FSDP over them) each hold
    it, and the plan sums its copies' gradients over them once a step, which the program does
    too (the launch below)."""
    for spec, label, stages, starts in (
            (_nanogpt(), "nanogpt 2 stages, its token table the head", [0, 1], ["h.1"]),
            (_llama4_tied(), "4 virtual stages interleaved, head tied", [0, 3],
             ["model.layers.1", "model.layers.2", "model.layers.3"]),
            (make_model_spec(*pipeline_cases.llama4_wide_tied(), name="tied"), "2 stages x FSDP 2 1f1b, head tied",
             [0, 1], ["model.layers.2"])):
        plan = plans[label]
        summed = [c for c in plan.collectives if c.kind == "all_reduce" and c.tensor == "gradient"]
        assert [(c.where.endswith("its copies' gradients"), c.stages) for c in summed] == [(True, stages)], label
        assert _starts(spec, plan) == starts, label


def test_stages_of_two_devices_shard_their_parameters_and_split_their_microbatches(plans: dict[str, Plan]) -> None:
    """What the plans are: each stage on a row of the 2 x 2 device mesh, every parameter stored
    sharded over it (or, DDP, whole on each), the values between stages crossing as shards (no
    activation gathered), the loss's count all-reduced over a stage's devices."""
    spec = _llama4_wide()
    for label in ("2 stages x FSDP 2 gpipe", "2 stages x FSDP 2 1f1b checkpointed", "2 stages x FSDP 2 1f1b bf16"):
        plan = plans[label]
        assert [stage.devices for stage in plan.stages] == [[0, 1], [2, 3]], label
        assert all(s.param == ["S(0)"] for fqn, s in plan.storage.items() if "inv_freq" not in fqn), label
        assert not [c.where for c in plan.collectives if c.tensor == "activation" and c.kind == "all_gather"], label
        assert any(c.tensor == "loss count" for c in plan.collectives), label
        assert _starts(spec, plan) == ["model.layers.2"], label
    interleaved = plans["4 virtual stages x FSDP 2 interleaved"]
    assert [stage.devices for stage in interleaved.stages] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    held = plans["2 stages x FSDP 2 held, --manual"]
    assert all(s.held for fqn, s in held.storage.items() if "inv_freq" not in fqn)
    assert _starts(spec, held) == ["model.layers.2"]
    replicated = plans["2 stages x DDP 2 1f1b"]
    assert all(s.param == ["R"] for s in replicated.storage.values())
    assert any(c.tensor == "gradient" and c.kind == "all_reduce" for c in replicated.collectives)
    assert _starts(spec, replicated) == ["model.layers.2"]


def test_parameters_kept_whole_beside_held_ones_run_in_fsdp2_stages(plans: dict[str, Plan]) -> None:
    """An OPT whose hidden size two devices cannot divide, ``--manual pp=2,fsdp=2``: its MLP
    weights and tables held gathered through the microbatches, its norms, biases and attention
    weights kept whole; each stage runs FSDP2 held, the whole ones under ``replicate`` inside it
    (both reduced once a step by torch's stage)."""
    spec, plan = _opt_odd(), plans[_WHOLE_BESIDE]
    held = {fqn for fqn, s in plan.storage.items() if s.held}
    whole = {fqn for fqn, s in plan.storage.items() if not s.held and s.param == s.grad == ["R"]}
    assert held and whole and held | whole == set(plan.storage), plan.storage
    assert any("self_attn_layer_norm" in fqn for fqn in whole) and any("fc1" in fqn for fqn in held)
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    parallel = stage_data_parallel(spec, graph, plan)
    assert not isinstance(parallel, str) and parallel.held and set(parallel.storage.shard_dims) == held, parallel
    assert stage_starts(spec, graph, plan) is not None


def test_rotary_tables_cross_whole_into_data_parallel_stages(plans: dict[str, Plan]) -> None:
    """A Llama's rotary tables, larger than a link's latency of transfer and the same for every
    sample, cross whole (the plan names them) beside the hidden states crossing as shards, and
    no stage gathers them: the stages run data parallel, cut from the model."""
    from autoplan.planner.api import make_options
    from autoplan.planner.pipeline.range_costs import whole_below

    spec = make_model_spec(*pipeline_cases.llama4_long(), name="long")
    plan = plans[_LONG]
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    below = whole_below(make_options(4, "cpu"))
    tables = {name for name, info in graph.nodes.items()
              if info.batch_free and info.shape and math.prod(info.shape) * info.itemsize >= below}
    assert tables & set(plan.crossing_whole), (sorted(tables), plan.crossing_whole)
    assert not [c.where for c in plan.collectives if c.tensor == "activation" and c.kind == "all_gather"]
    assert _starts(spec, plan) == ["model.layers.2"]


def test_stages_that_gather_a_value_before_sending_it_stay_on_the_interpreter(plans: dict[str, Plan]) -> None:
    """The narrow Llama's hidden states are smaller than a link moves in a latency: its FSDP
    stages gather them over their devices before sending them on, which data-parallel stages
    cut from the model do not do."""
    spec, plan = _llama4(), plans["2 stages x FSDP 2, values crossing whole"]
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, plan.microbatches)))
    why = stage_data_parallel(spec, graph, plan)
    assert isinstance(why, str) and "before sending it on" in why, why
    assert stage_starts(spec, graph, plan) is None


@pytest.mark.parametrize("why", ["stages of two devices computing the same", "stages tensor parallel"])
def test_other_pipelines_stay_on_the_interpreter(why: str, plans: dict[str, Plan]) -> None:
    if why == "stages of two devices computing the same":  # the narrow Llama's values cross whole
        spec, plan = _llama4(), plans["2 stages of two devices"]
        assert {len(stage.devices) for stage in plan.stages} == {2}
        assert not any(c.kind in ("reduce_scatter", "all_gather") for c in plan.collectives)
    else:  # its linears' weights sharded over each stage's two devices
        spec = _llama4_wide()
        plan = _planned(spec, 4, ("pp=2", "tp=2", "microbatches=2"), schedule="1f1b")
        assert any(s == ["S(1)"] for fqn, s in plan.params.items() if "o_proj" in fqn)
    assert _starts(spec, plan) is None


def test_values_read_stages_later_are_handed_on_through_the_stages_between() -> None:
    """The labels and the rotary tables leave the first stage and are read by the last ones:
    after the rewrite each stage reads only the stage before it, and the pipe, run whole on one
    process, still computes the model's loss."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    spec = _llama4()
    model = _returning_the_loss(spec, copy.deepcopy(spec.module))
    example = microbatch_inputs(spec.example_inputs, 2)
    pipe = pipeline(model, example, split_spec={f"model.layers.{k}": SplitPoint.BEGINNING for k in (1, 2, 3)})
    stages = [n for n in pipe.split_gm.graph.nodes if n.op == "call_module"]

    def sources(node: torch.fx.Node) -> set[str]:
        found = set()
        for arg in node.args:
            while arg.target is operator.getitem:
                arg = arg.args[0]
            found.add(arg.name)
        return found

    assert sources(stages[3]) != {stages[2].name}  # torch's pipe reads the first stage's outputs directly
    assert _handed_on_stage_by_stage(pipe.split_gm)
    for before, stage in zip(stages, stages[1:]):
        assert sources(stage) == {before.name}
    with torch.no_grad():
        expected = spec.loss_fn(spec.call(copy.deepcopy(spec.module), example), *example)
        (loss,) = pipe(*example)
        assert torch.allclose(loss, expected, rtol=1e-5, atol=1e-6)


def test_a_model_on_the_meta_device_runs_its_stages_allocated_where_they_run(tmp_path) -> None:
    """The wide Llama built on the meta device (as a model larger than a device is): each rank
    traces it as fake tensors on its device and allocates only its stages (FSDP2's shards of
    them); with the allocated model's weights loaded (``save_pretrained``'s safetensors), the
    first step's loss is the allocated model's on one device (in bf16, within its rounding)."""
    model, inputs, _ = pipeline_cases.llama4_wide()
    model.save_pretrained(tmp_path / "hf")
    with torch.no_grad():
        expected = model(**inputs).loss.item()
    meta, fsdp = make_model_spec(*pipeline_cases.llama4_wide_meta(), name="meta"), ("pp=2", "fsdp=2", "microbatches=2")
    plans = {"4 stages gpipe": _planned(meta, 4, ("stages=4", "microbatches=2"), schedule="gpipe"),
             "2 stages x FSDP 2 1f1b": _planned(meta, 4, fsdp, schedule="1f1b"),
             "2 stages x FSDP 2 1f1b bf16": _planned(meta, 4, fsdp, schedule="1f1b", precision="bf16")}
    cases = []
    for label, plan in plans.items():
        (tmp_path / f"{label}.json").write_text(plan.to_json())
        cases.append({"name": label, "plan": str(tmp_path / f"{label}.json")})
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    results = launch_worker(ROOT / "tests" / "meta_pipeline_worker.py", 4, tmp_path, timeout=420)
    for rank, found in results.items():
        for label in plans:
            assert found[label]["description"].startswith(NATIVE), (rank, found[label]["description"])
            assert found[label]["loss"] == pytest.approx(expected, rel=2e-2 if "bf16" in label else 1e-5), (rank, label)


@pytest.mark.parametrize("world", [2, 4])
def test_pipelines_cut_from_the_model_pass_check(world: int, plans: dict[str, Plan], tmp_path) -> None:
    """Four stages on four processes, one each (GPipe; 1F1B checkpointed in bf16) and two of two
    devices each (FSDP, DDP; FSDP with the head tied to the token table), and on two processes two virtual stages each (interleaved 1F1B,
    interleaved zero bubble; interleaved with the head tied to the token table) and nanoGPT's two
    stages, each holding its token table, which is its head."""
    labels = {4: ["4 stages gpipe", "4 stages 1f1b checkpointed bf16", *_SHARDED],
              2: ["4 virtual stages interleaved", "4 virtual stages zero bubble",
                  "nanogpt 2 stages, its token table the head", "4 virtual stages interleaved, head tied"]}[world]
    cases = {label: (_TIED.get(label) or ("llama4_wide" if label in _SHARDED else "llama4"), plans[label])
             for label in labels}
    write_check_cases(tmp_path, cases, {"llama4": "pipeline_cases.py", "llama4_wide": "pipeline_cases.py",
                                        "llama4_tied": "pipeline_cases.py", "llama4_wide_tied": "pipeline_cases.py",
                                        "llama4_long": "pipeline_cases.py", "opt_odd": "pipeline_cases.py",
                                        "gpt2_positions": "pipeline_cases.py",
                                        "nanogpt": "fsdp_cases.py"})
    results = launch_worker(ROOT / "tests" / "check_worker.py", world, tmp_path, timeout=540)
    assert_checks_passed(results, cases)
    for found in results.values():
        for label in cases:
            assert found[label]["description"].startswith(NATIVE), found[label]["description"]
            if label in _SHARDED:
                kind = "replicated over 2 devices" if "DDP" in label else "FSDP2 fully_shard over 2 devices"
                assert f"each stage {kind}" in found[label]["description"]
            assert ("held gathered through the microbatches" in found[label]["description"]) == ("held" in label)
            assert ("replicate group(s) beside" in found[label]["description"]) == (label == _WHOLE_BESIDE)
    if world == 4:
        for label in ("4 stages 1f1b checkpointed bf16", "2 stages x FSDP 2 1f1b checkpointed"):
            assert plans[label].recompute
            assert "checkpointed layer" in results[0][label]["description"]


_LONG = "2 stages x FSDP 2 1f1b, rotary tables crossing whole"
_WHOLE_BESIDE = "2 stages x FSDP 2 held, norms and attention kept whole beside, --manual"
# GPT-2's position rows, the same on every rank: looked up whole in the gathered table, their
# gradient all-reduced on its edge in the plan and reduce-scattered in the table's by FSDP2
_POSITIONS = "2 stages x FSDP 2 held, GPT-2's position rows, --manual"
_TIED = {"nanogpt 2 stages, its token table the head": "nanogpt", "4 virtual stages interleaved, head tied": "llama4_tied",
         "2 stages x FSDP 2 1f1b, head tied": "llama4_wide_tied", _LONG: "llama4_long", _WHOLE_BESIDE: "opt_odd",
         _POSITIONS: "gpt2_positions"}
_SHARDED = ("2 stages x FSDP 2 gpipe", "2 stages x FSDP 2 1f1b checkpointed", "2 stages x FSDP 2 1f1b bf16",
            "4 virtual stages x FSDP 2 interleaved", "2 stages x FSDP 2 held, --manual", "2 stages x DDP 2 1f1b",
            "2 stages x FSDP 2 1f1b, head tied", _LONG, _WHOLE_BESIDE, _POSITIONS)
