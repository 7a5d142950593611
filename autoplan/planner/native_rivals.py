"""The plans PyTorch runs itself, set against a found plan that runs on the DTensor interpreter.

The solvers choose a plan by its predicted step time, which charges every op pass the dispatch
of PyTorch's own programs. A plan that no native form matches runs on the interpreter instead,
whose dispatch per op pass is several times larger: the step expected there is the plan's
``interpreter_step_s`` (:mod:`autoplan.cost_models.interpreter_dispatch`). Where the found plan
runs there, the data-parallel plans PyTorch runs natively are planned too, as ``--manual``
writes them (:func:`~autoplan.planner.manual.plan_manual`): DDP (``dp=N``) and FSDP
(``fsdp=N``) over every device, or HSDP (``dp=a,fsdp=b``) on a pinned ``a x b`` mesh; each
again with every layer checkpointed where it does not fit without. The fastest of them whose
program is native (:func:`~autoplan.codegen.program_choice.program_choice`) replaces the found
plan where its predicted step is shorter than the found plan's expected one::

    chosen = argmin( found: interpreter_step_s ,  native rival r: step_time_s(r) )

and the found plan stays first among the alternatives (:data:`FOUND_ON_THE_INTERPRETER`), with
its prediction and its expected step. A user's pins, pinned pipeline structure or
``native_rivals=False`` keep the found plan.
"""

from __future__ import annotations

from collections.abc import Callable

from autoplan.codegen.program_choice import ProgramKind, program_choice
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Alternative, Plan, Prediction
from autoplan.planner.manual import ManualPlan, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.planner.pipeline import trace_microbatch
from autoplan.solvers import format_seconds
from autoplan.trace.graph import TracedGraph

__all__ = ["FOUND_ON_THE_INTERPRETER", "expected_step_s", "fastest_native_rival", "rival_forms", "searched_prediction"]

#: The name of the alternative that keeps a found plan a native rival replaced.
FOUND_ON_THE_INTERPRETER = "the plan the search found, on autoplan's DTensor interpreter"


def rival_forms(options: PlanOptions) -> list[list[ManualPlan]]:
    """The native forms tried, each as its plans in the order tried (without checkpointing,
    then with every layer checkpointed, unless recomputation is off); none where the user
    pinned the plan's structure."""
    if options.pin_set or options.stages or options.microbatches or options.schedule or options.layers:
        return []
    mesh = options.mesh or (options.devices,)
    if len(mesh) == 1:
        forms = [ManualPlan(dp=mesh[0]), ManualPlan(fsdp=mesh[0])]
    elif len(mesh) == 2:
        forms = [ManualPlan(dp=mesh[0], fsdp=mesh[1])]
    else:
        return []
    checkpointed = options.recompute != "none"
    return [[form, ManualPlan(dp=form.dp, fsdp=form.fsdp, ac="full")] if checkpointed else [form]
            for form in forms if form.dp * form.fsdp == options.devices]


def _first_fitting(spec: ModelSpec, options: PlanOptions, tries: list[ManualPlan], graph: TracedGraph
                   ) -> Plan | None:
    """The plan of the first of ``tries`` that fits the memory."""
    for manual in tries:
        try:
            return plan_manual(spec, options.planner_options(), manual, graph)
        except (AutoplanError, MemoryInfeasibleError):
            continue
    return None


def fastest_native_rival(spec: ModelSpec, options: PlanOptions, found: Plan, finish: Callable[[Plan], Plan],
                         graph: TracedGraph | None = None) -> Plan | None:
    """The native rival that replaces ``found`` (module docstring), its alternatives the found
    plan and then the found plan's own; None where none is faster than ``found`` expects to
    run. ``finish`` writes the run's decisions into a rival plan; ``graph``: the trace of the
    whole batch, where the caller has it."""
    expected = found.predicted.interpreter_step_s
    forms = rival_forms(options)
    if not expected or not forms:
        return None
    graph = graph or trace_microbatch(spec, 1)
    best: Plan | None = None
    for tries in forms:
        rival = _first_fitting(spec, options, tries, graph)
        if rival is None or rival.predicted.step_time_s >= expected:
            continue
        rival = finish(rival)
        choice = program_choice(spec, graph, rival)
        if choice.kind != ProgramKind.INTERPRETER and (best is None or
                                                       rival.predicted.step_time_s < best.predicted.step_time_s):
            rival.program = choice.line()
            best = rival
    if best is None:
        return None
    reason = (f"its program is autoplan's DTensor interpreter: {format_seconds(expected)} per step expected with "
              f"the interpreter's dispatch, against {format_seconds(best.predicted.step_time_s)} for this plan "
              f"on PyTorch's own program")
    mesh = [len(found.stages), *found.mesh]
    best.alternatives = [Alternative(FOUND_ON_THE_INTERPRETER, mesh, found.predicted, reason), *found.alternatives]
    return best


def searched_prediction(plan: Plan) -> Prediction:
    """The prediction of the plan the search found for ``plan``'s options: the alternative a
    native rival replaced, else the plan's own."""
    found = next((a for a in plan.alternatives if a.name == FOUND_ON_THE_INTERPRETER), None)
    return found.predicted if found is not None and found.predicted is not None else plan.predicted


def expected_step_s(predicted: Prediction) -> float:
    """The step expected on the plan's program: with the interpreter's dispatch where it runs there."""
    return predicted.interpreter_step_s or predicted.step_time_s
