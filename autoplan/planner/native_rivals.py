"""The plans PyTorch runs itself, set against a found plan that runs on the DTensor interpreter.

The solvers choose a plan by its predicted step time, which charges every op pass the dispatch
of PyTorch's own programs. A plan that no native form matches runs on the interpreter instead,
whose dispatch per op pass is several times larger: the step expected there is the plan's
``interpreter_step_s`` (:mod:`autoplan.cost_models.interpreter_dispatch`). Where the found plan
runs there, the data-parallel plans PyTorch runs natively are planned too, as ``--manual``
writes them (:func:`~autoplan.planner.manual.plan_manual`): DDP (``dp=N``) and FSDP
(``fsdp=N``) over every device, and across nodes HSDP (``dp=nodes,fsdp=devices per node``)
and FSDP x TP as torchtitan lays it out (``fsdp=nodes,tp=devices per node``: tensor
parallelism inside a node, ``parallelize_module`` then FSDP2), or HSDP (``dp=a,fsdp=b``) on a
pinned ``a x b`` mesh; and
where the found plan is a pipeline whose ranks hold ``k`` devices each (tensor parallelism
inside its stages, say), FSDP and DDP over each rank's devices under the same ranks and
schedule (``pp=P,fsdp=k`` and ``pp=P,dp=k``: torch.distributed.pipelining with FSDP2 or
``replicate`` in each stage), with the most microbatches, up to the found plan's, whose samples
``k`` devices split evenly; and where the found plan accumulates microbatches on one stage (the
memory binds), DDP and FSDP over every device accumulating the most microbatches, up to the
found plan's, whose samples every device splits evenly (``fsdp=N,microbatches=m``: FSDP2 or
DDP accumulating gradients). Each is tried again with every layer checkpointed where it does not
fit without, or where its plan without runs on the interpreter: the accumulated forms first
selectively (matrix products kept), then fully; the others fully. The fastest of them whose
program is native
(:func:`~autoplan.codegen.program_choice.program_choice`) replaces the found plan where its
predicted step is shorter than the found plan's expected one::

    chosen = argmin( found: interpreter_step_s ,  native rival r: step_time_s(r) )

and the found plan stays first among the alternatives (:data:`FOUND_ON_THE_INTERPRETER`), with
its prediction and its expected step. A user's pins, pinned pipeline structure or
``native_rivals=False`` keep the found plan.

A rival is planned on a trace of its microbatch, which takes seconds at real size (about 8 s
for the Llama-70B shape's whole batch here), so rivals that cannot win are put aside before it:

- by memory: a form whose parameters' training state alone, in as many parts as its ``fsdp``
  and ``tp`` degrees times its pipeline ranks, exceeds the budget fits no plan
  (:func:`state_bytes_per_device`; DDP of a 39B model needs 624 GB of it);
- by the estimate: where the stage search planned on a graph of that microbatch written from a
  trace of the model's first blocks (:mod:`autoplan.trace.deepen`) or rescaled from two
  graphs, the rival is planned on it first, and only one that fits and is estimated within
  ``ESTIMATE_MARGIN`` of the found plan's expected step is planned again on the trace, those
  estimated fastest first, and not one estimated ``ESTIMATE_MARGIN`` over a native rival
  planned on its trace before it. On the trace it is planned from the first of its tries that
  fit on the written graph, and past that one where its program there is the interpreter
  (the Llama-70B shape's FSDP x TP without checkpointing, a column's values gathered: its
  checkpointed plan alone is planned on the trace); a form left with no try (its last try the
  first to fit, and on the interpreter there) is put aside. Where the trace is the written
  graph (:meth:`~autoplan.trace.graph.TracedGraph.same_as`, as the stage search's written
  graphs usually are), the form's first native plan there is its plan on the trace and is
  not made again: the estimate's, where that is native, or, where the estimates run beside
  the trace (below), the one made after it on the written graph meanwhile. (For a
  stack of equal blocks the written graph costs what the trace does: FSDP over 64 devices of
  the 39B GPT, 7.336 s on both.)

Where the interpreter's dispatch slows the found plan ``LIKELY_REPLACED`` times or more (a
native rival likely replaces it), the microbatch the likeliest rivals are planned on, where it
has no trace yet, is traced while the forms are estimated one after another in a forked
process (:class:`~autoplan.planner.workers.TaskPool`; one process, so that they share the
strategies and costs each reuses): the trace a winning rival needs runs beside the estimates
(the Llama-70B shape: its whole batch, about 5 s, beside two estimates of about 1.3 s each).
The likeliest are the forms shaped like the found plan, inside its pipeline's ranks or
accumulating its microbatches (the 39B GPT's pipelined FSDP), where there are such, else every
form where all are planned on one microbatch. Which graphs are traced changes how long
planning takes, not the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

from autoplan.codegen.program_choice import ProgramKind, program_choice
from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Alternative, Plan, Prediction
from autoplan.planner.manual import ManualPlan, plan_manual
from autoplan.planner.options import PlanOptions
from autoplan.planner.pipeline import trace_microbatch
from autoplan.planner.workers import TaskPool
from autoplan.solvers import format_seconds
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import batch_size
from autoplan.trace.rescale import BatchSizeGraphs, KnownGraph

__all__ = ["ESTIMATE_MARGIN", "FOUND_ON_THE_INTERPRETER", "GraphOf", "LIKELY_REPLACED", "expected_step_s",
           "fastest_native_rival", "known_graphs", "rival_forms", "searched_prediction", "state_bytes_per_device"]

#: The name of the alternative that keeps a found plan a native rival replaced.
FOUND_ON_THE_INTERPRETER = "the plan the search found, on autoplan's DTensor interpreter"

#: A found plan the interpreter's dispatch slows this many times or more is likely replaced by a
#: native rival: the microbatch its rivals are planned on, where they share one, is traced
#: while they are estimated.
LIKELY_REPLACED = 2.0

#: A rival estimated on a written graph of the whole batch at up to this fraction above the
#: found plan's expected step is planned again on the trace (a written graph is an estimate).
ESTIMATE_MARGIN = 0.1


def rival_forms(options: PlanOptions, found: Plan | None = None, batch: int | None = None) -> list[list[ManualPlan]]:
    """The native forms tried, each as its plans in the order tried (without checkpointing,
    then with every layer checkpointed, unless recomputation is off): over every device, and,
    given the ``found`` plan and the global ``batch``, inside its pipeline's ranks (module
    docstring); none where the user pinned the plan's structure."""
    if options.pin_set or options.stages or options.microbatches or options.schedule or options.layers:
        return []
    mesh = options.mesh or (options.devices,)
    per_node = options.cluster_spec.devices_per_node
    if options.mesh is None and 1 < per_node < options.devices and options.devices % per_node == 0:
        nodes = options.devices // per_node
        forms = [ManualPlan(dp=options.devices), ManualPlan(fsdp=options.devices),
                 ManualPlan(dp=nodes, fsdp=per_node),  # HSDP: FSDP in a node
                 ManualPlan(fsdp=nodes, tp=per_node)]  # torchtitan's FSDP x TP: TP in a node
    elif len(mesh) == 1:
        forms = [ManualPlan(dp=mesh[0]), ManualPlan(fsdp=mesh[0])]
    elif len(mesh) == 2:
        forms = [ManualPlan(dp=mesh[0], fsdp=mesh[1])]
    else:
        return []
    forms = [form for form in forms if form.dp * form.fsdp * form.tp == options.devices]
    if found is not None and batch is not None and options.mesh is None:
        forms += _pipelined_forms(options.devices, found, batch) + _accumulated_forms(options.devices, found, batch)
    if options.recompute == "none":
        return [[form] for form in forms]
    return [[form, *([replace(form, ac="selective")] if _accumulates(form) else []), replace(form, ac="full")]
            for form in forms]


def _accumulates(form: ManualPlan) -> bool:
    """Whether ``form`` accumulates microbatches on one stage (no pipeline)."""
    return form.pp == 1 and form.microbatches > 1


def _most_microbatches(found: Plan, batch: int, devices: int, ranks: int) -> int | None:
    """The most microbatches, up to ``found``'s, whose samples ``devices`` split evenly (and,
    under a pipeline of ``ranks`` not run by GPipe, at least one per rank); None: none."""
    counts = [m for m in range(found.microbatches, 0, -1) if batch % m == 0 and (batch // m) % devices == 0
              and (m >= ranks or found.schedule == "gpipe")]
    return counts[0] if counts else None


def _pipelined_forms(devices: int, found: Plan, batch: int) -> list[ManualPlan]:
    """FSDP and DDP inside the ranks of ``found``'s pipeline (module docstring), where its
    ranks hold several devices each and some microbatch count splits evenly over them."""
    ranks = len({tuple(stage.devices) for stage in found.stages})
    per_rank = devices // ranks
    if ranks < 2 or per_rank < 2:
        return []
    most = _most_microbatches(found, batch, per_rank, ranks)
    if most is None:
        return []
    shape = {"pp": ranks, "microbatches": most, "schedule": found.schedule}
    return [ManualPlan(fsdp=per_rank, **shape), ManualPlan(dp=per_rank, **shape)]


def _accumulated_forms(devices: int, found: Plan, batch: int) -> list[ManualPlan]:
    """DDP and FSDP over every device accumulating microbatches (module docstring), where
    ``found`` accumulates them on one stage."""
    if len({tuple(stage.devices) for stage in found.stages}) > 1 or found.microbatches < 2:
        return []
    most = _most_microbatches(found, batch, devices, 1)
    if most is None or most < 2:
        return []
    return [ManualPlan(fsdp=devices, microbatches=most), ManualPlan(dp=devices, microbatches=most)]


def state_bytes_per_device(spec: ModelSpec, options: PlanOptions, shards: int) -> float:
    """The training state (parameter, gradient, optimizer state) of the model's trained
    parameters, each once, in ``shards`` parts (a form's ``fsdp`` degree times its pipeline
    ranks, times its ``tp`` degree): bytes per device no plan of that form goes below."""
    per_element = options.planner_options().optimizer.bytes_per_param
    return sum(p.numel() * per_element(p.element_size()) for p in spec.module.parameters()
               if p.requires_grad and p.is_floating_point()) / shards


def _fitting_plans(spec: ModelSpec, options: PlanOptions, tries: list[ManualPlan], graph: TracedGraph
                   ) -> Iterator[tuple[int, Plan]]:
    """The plans of ``tries`` that fit the memory, in turn, each with its index among them
    (each planned when asked for)."""
    for k, manual in enumerate(tries):
        try:
            yield k, plan_manual(spec, options.planner_options(), manual, graph)
        except (AutoplanError, MemoryInfeasibleError):
            continue


def _runs_natively(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> bool:
    """Whether ``plan`` (its run's decisions written) runs on a native program; its ``program``
    said where it does."""
    choice = program_choice(spec, graph, plan)
    if choice.kind == ProgramKind.INTERPRETER:
        return False
    plan.program = choice.line()
    return True


def _first_native(spec: ModelSpec, options: PlanOptions, tries: list[ManualPlan], graph: TracedGraph,
                  expected: float, finish: Callable[[Plan], Plan]) -> Plan | None:
    """The plan of the first of ``tries`` that fits the memory and runs on a native program
    (its ``program`` said), where it is predicted faster than ``expected``; None where none is
    (a later try, checkpointed, is slower)."""
    for _, plan in _fitting_plans(spec, options, tries, graph):
        if plan.predicted.step_time_s >= expected:
            return None
        plan = finish(plan)
        if _runs_natively(spec, graph, plan):
            return plan
    return None


#: The graph of one microbatch of the global batch cut into that many, where the caller has one
#: (traced, or written: an estimate); None where it has none.
GraphOf = Callable[[int], KnownGraph | None]


def _no_graph(microbatches: int) -> KnownGraph | None:
    return None


def known_graphs(spec: ModelSpec, found: Plan, graph: TracedGraph, searched: BatchSizeGraphs | None) -> GraphOf:
    """The graphs a rival may be planned on: ``graph``, the trace of one of ``found``'s
    microbatches, and the stage search's (``searched``: traced, written or rescaled)."""
    def graph_of(microbatches: int) -> KnownGraph | None:
        if microbatches == found.microbatches:
            return KnownGraph(graph, traced=True)
        if searched is None:
            return None
        return searched.made(batch_size(spec.example_inputs) // microbatches)
    return graph_of


def _fits_its_state(spec: ModelSpec, options: PlanOptions, tries: list[ManualPlan]) -> bool:
    """Whether the training state of the form of ``tries``, in as many parts as it shards it,
    fits the budget (module docstring: put aside by memory)."""
    form = tries[0]
    shards = form.fsdp * form.tp * form.pp
    return state_bytes_per_device(spec, options, shards) <= options.planner_options().memory_budget


@dataclass(frozen=True)
class _Estimate:
    """A form worth planning on a trace of its microbatch: the step it is ``estimated`` at on
    a written graph (0 where there was none to estimate on), the ``tries`` left to plan on the
    trace, and the estimate's plan where its program is native (``native_plan``: the plan on
    the trace, where the trace is the written graph)."""

    estimated: float
    tries: list[ManualPlan]
    native_plan: Plan | None = None


def _estimate(spec: ModelSpec, options: PlanOptions, tries: list[ManualPlan], expected: float,
              graph_of: GraphOf, finish: Callable[[Plan], Plan], native_too: bool = False) -> _Estimate | None:
    """The form of ``tries`` where it is worth planning on a trace of its microbatch; None
    where it is not (module docstring: its estimate). On a written graph the first try that
    fits is the estimate; the tries before it, which do not fit, are not planned again, nor is
    it where its program is the interpreter (the later ones are, its estimate standing for
    theirs), and a form with no try left is put aside. Its native plan is the estimate's
    where that is native, else, with ``native_too``, the first native one of the tries left
    on the written graph (made beside a trace, in a process of its own)."""
    known = graph_of(tries[0].microbatches)
    if known is None or known.traced:
        return _Estimate(0.0, tries)
    first = next(_fitting_plans(spec, options, tries, known.graph), None)
    if first is None:
        return None
    k, estimate = first
    if estimate.predicted.step_time_s >= expected * (1 + ESTIMATE_MARGIN):
        return None
    estimate = finish(estimate)
    try:
        native = _runs_natively(spec, known.graph, estimate)
    except Exception:  # noqa: BLE001 - not read on the written graph: read on the trace, as before
        return _Estimate(estimate.predicted.step_time_s, tries[k:])
    left = tries[k:] if native else tries[k + 1:]
    if not left:
        return None
    if native:
        return _Estimate(estimate.predicted.step_time_s, left, estimate)
    later = _first_native(spec, options, left, known.graph, expected, finish) if native_too else None
    return _Estimate(estimate.predicted.step_time_s, left, later)


def _likely_traced(found: Plan, forms: list[list[ManualPlan]], graph_of: GraphOf) -> int | None:
    """The microbatch count to trace while the forms are estimated (module docstring): the one
    the forms shaped like ``found`` are planned on (inside its pipeline's ranks, or
    accumulating), where there are such, else the one every form is planned on, where the
    caller has no trace of it and a rival likely replaces ``found``; else None."""
    shaped = {tries[0].microbatches for tries in forms if tries[0].pp > 1 or _accumulates(tries[0])}
    counts = shaped or {tries[0].microbatches for tries in forms}
    if len(counts) != 1 or found.predicted.interpreter_step_s < LIKELY_REPLACED * found.predicted.step_time_s:
        return None
    (microbatches,) = counts
    known = graph_of(microbatches)
    return None if known is not None and known.traced else microbatches


def fastest_native_rival(spec: ModelSpec, options: PlanOptions, found: Plan, finish: Callable[[Plan], Plan],
                         graph_of: GraphOf = _no_graph) -> Plan | None:
    """The native rival that replaces ``found`` (module docstring), its alternatives the found
    plan and then the found plan's own; None where none is faster than ``found`` expects to
    run. ``finish`` writes the run's decisions into a rival plan; ``graph_of``: the graphs the
    caller has, by microbatch count."""
    expected = found.predicted.interpreter_step_s
    batch = batch_size(spec.example_inputs) if len(found.stages) > 1 or found.microbatches > 1 else None
    forms = [tries for tries in (rival_forms(options, found, batch) if expected else [])
             if _fits_its_state(spec, options, tries)]
    likely = _likely_traced(found, forms, graph_of)  # its graph made here, before the estimates' process forks
    pool: TaskPool[list[_Estimate | None]] = \
        TaskPool(2 if likely is not None and options.planner_options().jobs > 1 else 1)
    pool.submit(lambda: [_estimate(spec, options, tries, expected, graph_of, finish, native_too=pool.forked)
                         for tries in forms])
    traces: dict[int, TracedGraph] = {}
    if pool.forked and likely is not None:  # the estimates run in another process: traced meanwhile
        try:
            traces[likely] = trace_microbatch(spec, likely)
        except AutoplanError:  # traced again, and the error given, where a rival needs it
            pass
    (worths,) = pool.results()
    best: Plan | None = None
    worth = sorted((e for e in worths if e is not None), key=lambda e: e.estimated)  # stable: ties in form order
    for estimate in worth:  # the likeliest winners first
        if best is not None and estimate.estimated >= best.predicted.step_time_s * (1 + ESTIMATE_MARGIN):
            continue  # estimated slower than a rival planned on its trace
        microbatches = estimate.tries[0].microbatches
        known = graph_of(microbatches)
        if microbatches not in traces:
            traces[microbatches] = known.graph if known is not None and known.traced else \
                trace_microbatch(spec, microbatches)
        native = estimate.native_plan
        if native is not None and known is not None and known.graph.same_as(traces[microbatches]):
            rival = native if native.predicted.step_time_s < expected else None  # the trace is its graph
        else:
            rival = _first_native(spec, options, estimate.tries, traces[microbatches], expected, finish)
        if rival is not None and (best is None or rival.predicted.step_time_s < best.predicted.step_time_s):
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
