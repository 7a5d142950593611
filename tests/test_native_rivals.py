"""A plan the search finds that runs on the DTensor interpreter is set against the
data-parallel plans PyTorch runs itself, by the step expected with the interpreter's dispatch
(:mod:`autoplan.planner.native_rivals`): the bundled GPT-2 example runs on FSDP2 (or DDP, the
other rival), the plan the search found kept first among its alternatives; a pipeline with
tensor parallel stages meets FSDP and DDP inside its ranks; across nodes FSDP x TP meets it too; pins, a pinned pipeline or
``native_rivals=False`` keep the plan found. Rivals that cannot win are put aside before the
whole batch is traced for them: by their training state, and by their estimate on a graph
written from the first blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from autoplan.codegen.program_choice import INTERPRETER_PROGRAM, ProgramChoice, ProgramKind, program_choice
from autoplan.load import load_model_file, make_model_spec
from autoplan.planner import native_rivals
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.native_rivals import (FOUND_ON_THE_INTERPRETER, expected_step_s, rival_forms,
                                            searched_prediction, state_bytes_per_device)
from autoplan.planner.options import PlanOptions
from autoplan.planner.pipeline import trace_microbatch
from autoplan.trace.graph import TracedGraph
from autoplan.trace.rescale import KnownGraph
from autoplan.trace.tracer import trace
from autoplan.reports.summary import summary_text
from launcher import ROOT


@pytest.fixture(scope="module")
def example():
    """The bundled example (GPT-2 124M on the meta device) planned for 8 H100s, one stage, with
    and without native rivals."""
    spec = load_model_file(str(ROOT / "examples" / "gpt2_124m.py"))
    return {rivals: plan_model(spec, PlanOptions(8, "h100", pipeline=False, native_rivals=rivals))
            for rivals in (True, False)}


def test_the_bundled_example_runs_natively_where_its_found_plan_would_run_on_the_interpreter(example) -> None:
    found, chosen = example[False], example[True]
    assert found.program.startswith("autoplan's DTensor interpreter")
    # the faster of the two rivals over every device (FSDP2 by 0.14 ms of 27.5 ms on 8 H100s)
    assert chosen.program in ("PyTorch's DistributedDataParallel", "PyTorch's FSDP2 (fully_shard per block)")
    assert chosen.mesh == [8] and len(chosen.stages) == 1
    assert chosen.predicted.interpreter_step_s == 0  # a native program: its prediction is what it expects
    # chosen only because the found plan's step, with the interpreter's dispatch, is longer
    assert found.predicted.step_time_s < chosen.predicted.step_time_s < found.predicted.interpreter_step_s
    kept = chosen.alternatives[0]
    assert kept.name == FOUND_ON_THE_INTERPRETER and kept.predicted == found.predicted
    assert searched_prediction(chosen) == found.predicted and searched_prediction(found) == found.predicted
    assert expected_step_s(chosen.predicted) < expected_step_s(found.predicted)
    assert chosen.options["native_rivals"] and not found.options["native_rivals"]
    text = summary_text(chosen)
    assert f"program: {chosen.program}" in text and "native rivals" in text
    assert "on autoplan's DTensor interpreter, with its dispatch:" in text


def test_pins_and_a_pinned_pipeline_keep_the_plan_found() -> None:
    assert [[m.label for m in tries] for tries in rival_forms(PlanOptions(4, "cpu"))] == [
        ["manual dp=4,tp=1,pp=1,microbatches=1", "manual dp=4,tp=1,pp=1,microbatches=1,ac=full"],
        ["manual dp=1,fsdp=4,tp=1,pp=1,microbatches=1", "manual dp=1,fsdp=4,tp=1,pp=1,microbatches=1,ac=full"]]
    assert [[m.label for m in tries] for tries in rival_forms(PlanOptions(4, "cpu", mesh=(2, 2), recompute="none"))] \
        == [["manual dp=2,fsdp=2,tp=1,pp=1,microbatches=1"]]  # HSDP on a pinned 2-D mesh
    # across two nodes of 8 H100s: HSDP too (FSDP inside a node, replicated across), and FSDP x TP
    # as torchtitan lays it out (tensor parallel inside a node, FSDP across)
    assert [tries[0].label for tries in rival_forms(PlanOptions(16, "h100"))] == [
        "manual dp=16,tp=1,pp=1,microbatches=1", "manual dp=1,fsdp=16,tp=1,pp=1,microbatches=1",
        "manual dp=2,fsdp=8,tp=1,pp=1,microbatches=1", "manual dp=1,fsdp=2,tp=8,pp=1,microbatches=1"]
    for kept in (PlanOptions(4, "cpu", pins=("mesh=2x2",)), PlanOptions(4, "cpu", stages=2),
                 PlanOptions(4, "cpu", microbatches=2), PlanOptions(8, "cpu", mesh=(2, 2, 2))):
        assert rival_forms(kept) == [], kept


class _Mlp(torch.nn.Module):
    """Two linear layers and a loss: 2 x (64 x 64 + 64) trained parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x))).square().mean()


def _planned(monkeypatch, found_expected_s: float, whole_batch_traced: bool, memory_per_device: float,
             labels: dict[int, str] | None = None, jobs: int = 1, chosen: list | None = None,
             trace_is_given: bool = False):
    """The forms ``fastest_native_rival`` plans, each with whether on the caller's graph or on a
    trace, for the two-layer model on 4 cpu devices, the found plan expected at
    ``found_expected_s`` per step on the interpreter (``labels``: each plan's form, by id;
    ``chosen``: the rival chosen is appended). The trace differs from the caller's graph (its
    hash), unless ``trace_is_given``. With ``jobs`` > 1 the estimates run in forked processes,
    whose plans this one does not see."""
    spec = make_model_spec(_Mlp(), (torch.randn(8, 64),))
    options = PlanOptions(4, "cpu", memory_per_device=memory_per_device, jobs=jobs)
    given = trace(spec)  # the caller's graph of the whole batch (traced, or standing for a written one)
    traced: list[TracedGraph] = []

    def traced_whole_batch(spec_, microbatches):
        graph = trace(spec_)
        traced.append(graph if trace_is_given else replace(graph, graph_hash="another graph"))
        return traced[-1]

    planned = []

    def recorded(spec_, planner_options, manual, graph):
        planned.append((manual.label, "given" if graph is given else "traced" if graph in traced else "?"))
        plan = plan_manual(spec_, planner_options, manual, graph)
        if labels is not None:
            labels[id(plan)] = manual.label
        return plan

    monkeypatch.setattr(native_rivals, "plan_manual", recorded)
    monkeypatch.setattr(native_rivals, "trace_microbatch", traced_whole_batch)
    found = plan_model(spec, replace(options, native_rivals=False))
    found.predicted.interpreter_step_s = found_expected_s
    rival = native_rivals.fastest_native_rival(spec, options, found, lambda p: with_decisions(p, options),
                                               lambda microbatches: KnownGraph(given, traced=whole_batch_traced))
    if chosen is not None:
        chosen.append(rival)
    return planned, state_bytes_per_device(spec, options, 1)


def test_a_rival_whose_state_alone_exceeds_the_budget_is_not_planned(monkeypatch) -> None:
    state = 2 * (64 * 64 + 64) * 4 * 4  # fp32 AdamW: parameter, gradient, two moments
    planned, replicated = _planned(monkeypatch, 1e3, whole_batch_traced=True, memory_per_device=state / 2)
    assert replicated == state
    assert planned and all("fsdp=4" in label for label, _ in planned)  # DDP put aside unplanned
    assert {where for _, where in planned} == {"given"}  # the caller's trace: no second one


def test_a_rival_estimated_slower_than_the_found_plan_is_not_traced(monkeypatch) -> None:
    planned, _ = _planned(monkeypatch, 1e-12, whole_batch_traced=False, memory_per_device=2 ** 30)
    assert planned and {where for _, where in planned} == {"given"}  # estimated only, nothing traced
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30)
    assert {where for _, where in planned} == {"given", "traced"}  # estimated to win: planned on the trace
    # the forms estimated, each planned on the trace (and checkpointed where its plan runs on the interpreter)
    traced = [label for label, where in planned if where == "traced"]
    assert sorted({label.removesuffix(",ac=full") for label in traced}) == \
        sorted(label for label, where in planned if where == "given")


def test_a_try_the_interpreter_runs_on_the_written_graph_is_not_planned_again_on_the_trace(monkeypatch) -> None:
    """On the written graph each form's first fitting try is its estimate; on the trace it is
    planned from that try, and past it where its program on the written graph is the
    interpreter (its checkpointed try only). (The two-layer model's plans all run on the
    interpreter: FSDP without checkpointing is said to run natively, DDP, estimated faster, not.)"""
    labels: dict[int, str] = {}

    def only_uncheckpointed_fsdp_native(spec_, graph, plan):
        label = labels[id(plan)]
        if "ac=" not in label and "fsdp=4" in label:
            return ProgramChoice(ProgramKind.NATIVE, "PyTorch's FSDP2 fully_shard")
        return ProgramChoice(ProgramKind.INTERPRETER, INTERPRETER_PROGRAM, "as the test says")

    monkeypatch.setattr(native_rivals, "program_choice", only_uncheckpointed_fsdp_native)
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, labels=labels)
    given = [label for label, where in planned if where == "given"]
    traced = [label for label, where in planned if where == "traced"]
    fsdp, ddp = "manual dp=1,fsdp=4,tp=1,pp=1,microbatches=1", "manual dp=4,tp=1,pp=1,microbatches=1"
    assert sorted(given) == [fsdp, ddp]
    # DDP on the interpreter on the written graph: only its checkpointed plan on the trace
    assert [label for label in traced if "fsdp=4" not in label] == [ddp + ",ac=full"]
    assert [label for label in traced if "fsdp=4" in label] == [fsdp]


def test_estimates_in_another_process_beside_the_trace_choose_what_one_process_chooses(monkeypatch) -> None:
    """With two jobs, where every form is planned on the whole batch and the found plan is
    expected far slower than predicted, the forms are estimated in a forked process while this
    one traces the whole batch: the rival chosen is the one a single process chooses, planned
    on the trace here, and no estimate is planned here. (The two-layer model's plans, which run
    on the interpreter, are said to run natively.)"""
    monkeypatch.setattr(native_rivals, "program_choice",
                        lambda spec_, graph, plan: ProgramChoice(ProgramKind.NATIVE, "as the test says"))
    alone, side_by_side = [], []
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, chosen=alone)
    forked, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, jobs=2,
                         chosen=side_by_side)
    assert alone[0] is not None and side_by_side[0] is not None
    assert (side_by_side[0].mesh, side_by_side[0].params, side_by_side[0].predicted) == \
        (alone[0].mesh, alone[0].params, alone[0].predicted)
    on_the_trace = [entry for entry in planned if entry[1] == "traced"]
    assert on_the_trace and forked == on_the_trace  # nothing estimated here: each estimate in its process


def test_where_the_trace_is_the_written_graph_the_estimates_plan_stands(monkeypatch) -> None:
    """A rival estimated on a written graph that the trace turns out to be is not planned again
    on the trace: its estimate's plan is the rival, as it would be planned there. (The
    two-layer model's plans are said to run natively.)"""
    monkeypatch.setattr(native_rivals, "program_choice",
                        lambda spec_, graph, plan: ProgramChoice(ProgramKind.NATIVE, "as the test says"))
    again, stands = [], []
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, chosen=again)
    assert {where for _, where in planned} == {"given", "traced"}
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, chosen=stands,
                          trace_is_given=True)
    assert {where for _, where in planned} == {"given"}  # traced, and nothing planned on the trace
    assert stands[0] is not None and again[0] is not None
    assert (stands[0].mesh, stands[0].params, stands[0].predicted) == (again[0].mesh, again[0].params,
                                                                       again[0].predicted)


def test_beside_the_trace_a_forms_checkpointed_plan_is_made_on_the_written_graph(monkeypatch) -> None:
    """Estimated beside the trace (two jobs), a form whose estimate runs on the interpreter has
    its next try, checkpointed and native, planned on the written graph meanwhile; the trace
    being that graph, nothing is planned on it, and the rival is the one a single process
    plans on the trace. (Each form's plan without checkpointing is said to run on the
    interpreter, its checkpointed one natively.)"""
    labels: dict[int, str] = {}

    def native_where_checkpointed(spec_, graph, plan):
        if "ac=full" in labels[id(plan)]:
            return ProgramChoice(ProgramKind.NATIVE, "as the test says")
        return ProgramChoice(ProgramKind.INTERPRETER, INTERPRETER_PROGRAM, "as the test says")

    monkeypatch.setattr(native_rivals, "program_choice", native_where_checkpointed)
    alone, beside = [], []
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, labels=labels,
                          chosen=alone, trace_is_given=True)
    on_the_trace = [label for label, where in planned if where == "traced"]
    assert on_the_trace and all(label.endswith(",ac=full") for label in on_the_trace)  # one process: on the trace
    planned, _ = _planned(monkeypatch, 1e3, whole_batch_traced=False, memory_per_device=2 ** 30, labels=labels,
                          chosen=beside, trace_is_given=True, jobs=2)
    assert planned == []  # every plan made in the estimates' process, on the written graph
    assert alone[0] is not None and beside[0] is not None
    assert (beside[0].mesh, beside[0].params, beside[0].predicted, beside[0].recompute) == \
        (alone[0].mesh, alone[0].params, alone[0].predicted, alone[0].recompute)


def _pipelined_gpt2(manual: str) -> tuple:
    """A wide GPT-2 (tests/pipeline_cases.py) planned as ``--manual`` writes ``manual`` on 4 cpu devices."""
    import pipeline_cases

    spec = make_model_spec(*pipeline_cases.gpt2_positions(), name="gpt2_positions")
    options = PlanOptions(4, "cpu", precision="fp32")
    return spec, options, with_decisions(plan_manual(spec, options.planner_options(), parse_manual(manual)), options)


def test_a_pipeline_with_tensor_parallel_stages_meets_fsdp_and_ddp_inside_its_ranks(monkeypatch) -> None:
    """Two pipeline ranks of two devices each, tensor parallel inside: the interpreter runs it.
    Its rivals are, besides DDP and FSDP over every device, FSDP and DDP over each rank's two
    devices under the same ranks and schedule, with the most microbatches whose samples two
    devices split; the fastest native one replaces it where it is faster than the found plan's
    expected step, and none where none is."""
    spec, options, found = _pipelined_gpt2("pp=2,tp=2,microbatches=4")
    assert program_choice(spec, trace_microbatch(spec, 4), found).kind == ProgramKind.INTERPRETER
    pipelined = [tries for tries in rival_forms(options, found, 16) if tries[0].pp > 1]
    assert [[m.label for m in tries] for tries in pipelined] == [
        ["manual dp=1,fsdp=2,tp=1,pp=2,microbatches=4", "manual dp=1,fsdp=2,tp=1,pp=2,microbatches=4,ac=full"],
        ["manual dp=2,tp=1,pp=2,microbatches=4", "manual dp=2,tp=1,pp=2,microbatches=4,ac=full"]]
    # of a batch of 8, 8 microbatches of one sample found: 4 of two, the most that two devices split evenly
    assert {tries[0].microbatches for tries in rival_forms(options, replace(found, microbatches=8), 8)
            if tries[0].pp > 1} == {4}
    assert [tries for tries in rival_forms(options, replace(found, microbatches=8), 9) if tries[0].pp > 1] == []

    programs = []  # (stages, program, predicted step) of each rival planned

    def recorded(spec_, graph, plan):
        choice = program_choice(spec_, graph, plan)
        programs.append((len(plan.stages), choice.kind, plan.predicted.step_time_s))
        return choice

    monkeypatch.setattr(native_rivals, "program_choice", recorded)
    found.predicted.interpreter_step_s = found.predicted.step_time_s * 100
    chosen = native_rivals.fastest_native_rival(spec, options, found, lambda p: p)
    assert (2, ProgramKind.NATIVE_PIPELINE) in {p[:2] for p in programs}  # FSDP2 or replicate in each stage
    native = [step for _, kind, step in programs if kind != ProgramKind.INTERPRETER]
    assert chosen is not None and chosen.predicted.step_time_s == min(native)
    assert chosen.predicted.step_time_s < found.predicted.interpreter_step_s
    assert chosen.alternatives[0].name == FOUND_ON_THE_INTERPRETER
    found.predicted.interpreter_step_s = found.predicted.step_time_s * 1e-3
    assert native_rivals.fastest_native_rival(spec, options, found, lambda p: p) is None


def test_a_plan_accumulating_microbatches_meets_fsdp_and_ddp_accumulating_them(monkeypatch) -> None:
    """One stage, tensor parallel over 4 devices, accumulating 4 microbatches (the memory
    binds): the interpreter runs it. Its rivals are, besides DDP and FSDP over every device,
    FSDP and DDP over every device accumulating the most microbatches, up to the found plan's,
    whose samples the devices split evenly, each tried plain, then with its layers checkpointed
    selectively, then fully; the fastest native one replaces the found plan where it is faster
    than the found plan's expected step."""
    spec, options, found = _pipelined_gpt2("tp=4,microbatches=4")
    assert program_choice(spec, trace_microbatch(spec, 4), found).kind == ProgramKind.INTERPRETER
    accumulated = [tries for tries in rival_forms(options, found, 16) if tries[0].microbatches > 1]
    assert [[m.label for m in tries] for tries in accumulated] == [
        ["manual dp=1,fsdp=4,tp=1,pp=1,microbatches=4", "manual dp=1,fsdp=4,tp=1,pp=1,microbatches=4,ac=selective",
         "manual dp=1,fsdp=4,tp=1,pp=1,microbatches=4,ac=full"],
        ["manual dp=4,tp=1,pp=1,microbatches=4", "manual dp=4,tp=1,pp=1,microbatches=4,ac=selective",
         "manual dp=4,tp=1,pp=1,microbatches=4,ac=full"]]
    # a batch of 8 in 4 microbatches of two samples: 2 of four, the most that four devices split
    assert {tries[0].microbatches for tries in rival_forms(options, found, 8)} == {1, 2}
    assert {tries[0].microbatches for tries in rival_forms(options, found, 6)} == {1}
    assert {tries[0].microbatches for tries in rival_forms(options, replace(found, microbatches=1), 16)} == {1}

    programs = []  # (microbatches, program) of each rival planned

    def recorded(spec_, graph, plan):
        choice = program_choice(spec_, graph, plan)
        programs.append((plan.microbatches, choice.kind, plan.predicted.step_time_s))
        return choice

    monkeypatch.setattr(native_rivals, "program_choice", recorded)
    found.predicted.interpreter_step_s = found.predicted.step_time_s * 100
    chosen = native_rivals.fastest_native_rival(spec, options, found, lambda p: p)
    assert (4, ProgramKind.NATIVE) in {p[:2] for p in programs}  # DDP or FSDP2 accumulating 4 microbatches
    native = [step for _, kind, step in programs if kind != ProgramKind.INTERPRETER]
    assert chosen is not None and chosen.predicted.step_time_s == min(native)


def test_across_nodes_fsdp_x_tp_inside_a_node_is_a_rival(monkeypatch) -> None:
    """On two nodes of 8 H100s a found plan the interpreter runs meets torchtitan's layout,
    ``fsdp=2,tp=8``, planned and run by ``parallelize_module`` then FSDP2 (a small Hugging Face
    Llama whose heads 8 divides); the fastest native rival replaces the found plan."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=512, num_hidden_layers=2, num_attention_heads=8,
                                      num_key_value_heads=8, intermediate_size=1536, vocab_size=8192,
                                      max_position_embeddings=256)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 8192, (16, 256))
    spec = make_model_spec(model, {"input_ids": ids, "labels": ids}, None, name="llama")
    options = PlanOptions(16, "h100", plan_only=True)
    graph = trace_microbatch(spec, 1)
    found = plan_manual(spec, options.planner_options(), parse_manual("fsdp=16"), graph)
    found.predicted.interpreter_step_s = found.predicted.step_time_s * 100  # as if the interpreter ran it
    programs = {}  # each rival planned: its mesh -> its program

    def recorded(spec_, graph_, plan):
        choice = program_choice(spec_, graph_, plan)
        programs[tuple(plan.mesh)] = choice
        return choice

    monkeypatch.setattr(native_rivals, "program_choice", recorded)
    chosen = native_rivals.fastest_native_rival(spec, options, found, lambda p: with_decisions(p, options),
                                                lambda m: KnownGraph(graph, traced=True) if m == 1 else None)
    assert (2, 8) in programs, programs
    assert programs[2, 8].kind == ProgramKind.NATIVE and "FSDP x TP" in programs[2, 8].text, programs[2, 8].line()
    assert chosen is not None and chosen.alternatives[0].name == FOUND_ON_THE_INTERPRETER
