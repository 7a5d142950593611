"""The planner's front door: a model and :class:`PlanOptions` in, a :class:`Plan` out.

``autoplan.plan(...)``, the ``autoplan`` command and ``autoplan.parallelize(...)`` without a
saved plan all come here, so one model with one set of options gets one plan:

the user's pins checked on the traced model (:mod:`autoplan.planner.pin_check`) → the pipeline
search (:mod:`autoplan.planner.pipeline`, which plans one stage too) or, with
``pipeline=False``, the intra-op search over logical meshes (:mod:`autoplan.planner.api`)
→ every decision the program carries out (optimizer, precision, recomputed regions,
parameter storage, the options themselves) written into the Plan, and the program that will
carry them out named (:mod:`autoplan.codegen.program_choice`) → where that is the DTensor
interpreter, its dispatch stated and the data-parallel plans PyTorch runs itself set against it
(:mod:`autoplan.planner.native_rivals`) → hand-written ``manual`` plans
costed beside it → with pins, the search run again without them, for what they cost.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from autoplan.codegen.program_choice import ProgramChoice, ProgramKind, program_choice
from autoplan.cost_models.hardware import DeviceSpec
from autoplan.cost_models.interpreter_dispatch import interpreter_dispatch
from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec, make_model_spec
from autoplan.plan_schema import ParamStorage, PinCost, PinRecord, Plan, PrecisionPlan
from autoplan.planner.api import plan_spec
from autoplan.planner.manual import ManualPlan, cost_manual, manual_rule, parse_manual, tensor_parallel_rule
from autoplan.planner.mesh_plan import StorageRule
from autoplan.planner.meshes import candidate_meshes
from autoplan.planner.native_rivals import fastest_native_rival, known_graphs
from autoplan.planner.options import PlannerOptions, PlanOptions
from autoplan.planner.pin_check import check_layer_pins, check_pins
from autoplan.planner.pins import PinKind, PinSet
from autoplan.planner.pipeline import plan_pipeline_traced
from autoplan.solvers import format_bytes
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import find_classes
from autoplan.trace.tracer import trace


def plan_model(spec: ModelSpec, options: PlanOptions, load_s: float = 0.0) -> Plan:
    """Plan a loaded model under ``options``; see the module docstring."""
    manual = [parse_manual(text) for text in options.manual]  # a bad one fails before the search
    planner_options = options.planner_options()
    start = time.perf_counter()
    pin_holds: dict[str, list[str]] = {}
    if options.pin_set:  # checked on the model before any solving
        planner_options, pin_holds = checked_pins(spec, options, planner_options)
    if options.pipeline:
        plan, graph, searched = plan_pipeline_traced(spec, planner_options, options.pipeline_options())
    else:
        (plan, graph), searched = plan_spec(spec, planner_options), None
    parts = {k: v for k, v in plan.timings_s.items() if k != "total"}
    clock = time.perf_counter()
    plan = with_decisions(plan, options)
    choice = named_program(spec, graph, plan)
    plan.program = choice.line() if choice is not None else ""
    if choice is not None and choice.kind == ProgramKind.INTERPRETER:
        with_interpreter_dispatch(plan, graph, planner_options.cluster.device)
    parts["program"] = time.perf_counter() - clock
    if plan.predicted.interpreter_step_s and options.native_rivals:
        clock = time.perf_counter()
        rival = fastest_native_rival(spec, options, plan, lambda p: with_decisions(p, options),
                                     known_graphs(spec, plan, graph, searched))
        plan = rival or plan
        parts["native rivals"] = time.perf_counter() - clock
    unpinned = replace(planner_options, pins=None, allow_storage=None)  # a manual plan is costed as written
    plan.alternatives += [cost_manual(spec, unpinned, m) for m in manual]
    if manual:
        parts["manual plans"] = time.perf_counter() - start - sum(parts.values())
    if options.pin_set:
        clock = time.perf_counter()
        plan.pins = [PinRecord(text, pin_holds.get(text, [])) for text in options.pins]
        plan.pin_cost = pin_cost(spec, options, plan)
        parts["unpinned optimum"] = time.perf_counter() - clock
    # the total is the wall clock from loading to the plan: never less than the parts it lists
    plan.timings_s = {"load": load_s, **parts, "total": load_s + time.perf_counter() - start}
    for note in (replication_note(plan, spec), transient_note(plan)):
        if note:
            plan.warnings.append(note)
    return plan


def named_program(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> ProgramChoice | None:
    """The program that will run ``plan`` (:func:`program_choice`); where reading it fails,
    None, and the plan stands and says so (the run prints the program it builds)."""
    try:
        return program_choice(spec, graph, plan)
    except Exception as e:  # noqa: BLE001 - the plan is whole without it
        warnings.warn(f"the program that runs the plan was not read ({type(e).__name__}: {e}); the run prints it",
                      stacklevel=2)
        return None


def with_interpreter_dispatch(plan: Plan, graph: TracedGraph, device: DeviceSpec) -> None:
    """A plan that runs on the DTensor interpreter gets the interpreter's host time beside its
    prediction (:func:`interpreter_dispatch`), where the device gives its figure."""
    found = interpreter_dispatch(plan, graph, device)
    if found is None:
        return
    plan.predicted = replace(plan.predicted, interpreter_dispatch_s=found.dispatch_s,
                             interpreter_step_s=found.expected_step_s)


def pin_meshes(options: PlanOptions) -> list[tuple[int, ...]]:
    """Every logical mesh the searches may give a stage (a superset)."""
    if options.mesh is not None:
        return [tuple(options.mesh)]
    counts = [s for s in range(1, options.devices + 1) if options.devices % s == 0] if options.pipeline else [1]
    if options.stages is not None:
        counts = [options.stages]
    return list(dict.fromkeys(m for s in counts for m in candidate_meshes(options.devices // s)))


def checked_pins(spec: ModelSpec, options: PlanOptions, planner_options: PlannerOptions
                 ) -> tuple[PlannerOptions, dict[str, list[str]]]:
    """The planner's options with the pins checked on the traced model (:func:`check_pins`,
    one line for a pin that cannot hold) and the rule of their degrees (:func:`degree_rule`);
    and what each pin holds."""
    graph = trace(spec)
    cluster = planner_options.cluster

    def across_links(mesh: tuple[int, ...]) -> bool:
        return len({link for link, n in zip(cluster.mesh_links(mesh), mesh) if n > 1}) > 1

    pins, holds = check_pins(graph, options.pin_set, pin_meshes(options), across_links)
    if pins.of_kind(PinKind.STAGE, PinKind.CHECKPOINT):
        layers = make_layers(graph, find_classes(graph), options.layers)
        check_layer_pins(graph, layers, pins, options.stages, options.pipeline, options.schedule, options.recompute)
    return replace(planner_options, pins=pins, allow_storage=degree_rule(graph, pins, planner_options)), holds


def degree_rule(graph: TracedGraph, pins: PinSet, options: PlannerOptions) -> StorageRule | None:
    """The rule the degree pins ask for: ``--manual``'s (:func:`manual_rule`) with ``dp=`` or
    ``fsdp=``, Megatron's on the last axis with ``tp=`` alone, else the options' own."""
    tp = pins.degree(PinKind.TENSOR_PARALLEL)
    if pins.data_parallel_mesh is not None:
        manual = ManualPlan(dp=pins.degree(PinKind.DATA_PARALLEL) or 1, fsdp=pins.degree(PinKind.SHARDED_DATA_PARALLEL)
                            or 1, tp=tp or 1, zero=pins.degree(PinKind.ZERO) or 0)
        return manual_rule(graph, manual)
    return tensor_parallel_rule(graph, tp) if tp is not None else options.allow_storage


def pin_cost(spec: ModelSpec, options: PlanOptions, plan: Plan) -> PinCost:
    """The pinned plan's predicted step time beside the unpinned search's optimum."""
    pinned = plan.predicted.step_time_s
    try:
        free = plan_model(spec, replace(options.without_pins(), manual=()))
    except AutoplanError as e:
        return PinCost(pinned, None, f"without the pins: {e}")
    return PinCost(pinned, free.predicted.step_time_s)


def transient_note(plan: Plan) -> str | None:
    """Why the plan may not fit after all, in one line: the backward's transients take its
    predicted peak over the memory per device (the solvers bound them; a plan whose choices
    were given rather than solved may still pass it)."""
    budget = plan.cluster.get("device", {}).get("memory_bytes")
    m = plan.predicted.memory_bytes
    if not budget or m.peak_with_transient <= budget:
        return None
    return (f"with the backward's transients ({format_bytes(m.transient)}: gradients, recomputed layers, the "
            f"returned outputs) the predicted peak is {format_bytes(m.peak_with_transient)}, over the "
            f"{format_bytes(budget)} per device: a smaller --memory-per-device, a smaller batch, more "
            f"microbatches or more devices would leave room for them")


def replication_note(plan: Plan, spec: ModelSpec) -> str | None:
    """Why a plan for several devices keeps every tensor whole on every device, in one line
    (None when something is sharded or pipelined)."""
    if plan.devices == 1 or len(plan.stages) > 1:
        return None
    if any(p != "R" for placement in [*plan.params.values(), *plan.inputs.values()] for p in placement):
        return None
    axes = [n for n in plan.mesh if n > 1]
    batches = sorted({x.shape[0] for x in spec.example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0})
    if batches and not any(b % n == 0 for b in batches for n in axes):
        return (f"every tensor is replicated on all {plan.devices} devices: the batch ({', '.join(map(str, batches))}) "
                f"does not divide by {' or '.join(map(str, axes))}; choose a device count that divides the batch")
    return (f"every tensor is replicated on all {plan.devices} devices: at this size no sharding pays for its "
            f"communication; a larger batch or model, or fewer devices, would use them")


def with_decisions(plan: Plan, options: PlanOptions) -> Plan:
    """Write into ``plan`` what the program must carry out beyond placements."""
    plan.optimizer = options.optimizer_plan()
    plan.precision = PrecisionPlan.named(options.precision)
    plan.storage = {name: plan.storage.get(name) or ParamStorage(list(spec), list(spec), list(spec))
                    for name, spec in plan.params.items()}
    plan.options = options.to_dict()
    return plan


def plan(model: torch.nn.Module | Callable[[], torch.nn.Module], example_inputs: Any, devices: int = 8,
         cluster: Any = "h100", loss_fn: Callable[..., torch.Tensor] | None = None, **options: Any) -> Plan:
    """Plan ``model`` (an nn.Module, on any device including ``meta``) for ``devices`` devices:
    the same search the ``autoplan`` command runs.

    ``example_inputs`` is one global batch (a tensor or a tuple of tensors); ``loss_fn(output,
    *inputs)`` returns the scalar loss (default: ``output.loss`` if present, else the mean of
    the first output). ``cluster`` is a preset name, a TOML file or a ``ClusterSpec``; every
    other keyword is a field of :class:`PlanOptions` (``mesh``, ``memory_per_device``,
    ``optimizer``, ``stages``, ``pipeline=False``, …), checked before any work.
    """
    checked = PlanOptions(devices, cluster, **options)
    start = time.perf_counter()
    spec = make_model_spec(model, example_inputs, loss_fn)
    return plan_model(spec, checked, load_s=time.perf_counter() - start)
