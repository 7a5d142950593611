"""The user's pins checked against the traced model, before any solving.

:func:`check_pins` refuses in one line a pin whose pattern matches nothing, that names a
graph node no strategy can pin (a ``getitem``), or that cannot hold on any logical mesh the
search may use (a wrong number of mesh axes, a dimension the mesh does not divide, a
placement no strategy of that op offers); it returns the pins with the meshes where all of
them hold, which the searches then keep to (:meth:`PinSet.mesh_allowed`).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import replace

from autoplan.errors import AutoplanError
from autoplan.planner.mesh_plan import GraphView, offered_output_specs
from autoplan.planner.meshes import mesh_label
from autoplan.planner.pins import STORAGE_KINDS, Pin, PinKind, PinSet
from autoplan.planner.pipeline.schedules import INTERLEAVED
from autoplan.planner.recompute import recomputable
from autoplan.sharding import spec_to_json
from autoplan.solvers.inter_op import InterOpProblem
from autoplan.trace.graph import TracedGraph
from autoplan.trace.layers import Layer

EXAMPLE_NAMES = 3  # names shown when a pattern matches nothing


def _matched(graph: TracedGraph, pin: Pin) -> list[str]:
    """The names ``pin`` holds: parameters, buffers, inputs and op nodes for a placement;
    trained parameters for fsdp; modules (of op nodes) for stage and checkpoint pins."""
    if pin.kind in (PinKind.STAGE, PinKind.CHECKPOINT):
        return sorted({info.module for info in graph.nodes.values() if info.kind == "op" and pin.matches(info.module)})
    out = []
    for info in graph.nodes.values():
        if pin.kind in STORAGE_KINDS and info.kind != "parameter":
            continue
        named = info.fqn if info.kind in ("parameter", "buffer") and info.fqn else info.name
        if info.kind in ("parameter", "buffer", "input", "op", "constant") and pin.matches(named):
            out.append(named)
    return out


def _examples(graph: TracedGraph, pin: Pin) -> str:
    if pin.kind in (PinKind.STAGE, PinKind.CHECKPOINT):
        names = sorted({info.module for info in graph.nodes.values() if info.module})
    else:
        names = [info.fqn for info in graph.nodes.values() if info.kind == "parameter" and info.fqn]
    return ", ".join(names[:EXAMPLE_NAMES]) if names else "none"


def matched_names(graph: TracedGraph, pins: PinSet) -> dict[str, list[str]]:
    """What each non-structure pin holds, by pin text; a pin that holds nothing is refused."""
    out: dict[str, list[str]] = {}
    for pin in pins.pins:
        if pin.is_structure:
            continue
        names = _matched(graph, pin)
        if not names:
            what = "module" if pin.kind in (PinKind.STAGE, PinKind.CHECKPOINT) else \
                "trained parameter" if pin.kind in STORAGE_KINDS else "parameter, input or graph node"
            raise AutoplanError(f"pin {pin.text!r} matches no {what} of the model: names look like "
                                f"{_examples(graph, pin)}")
        out[pin.text] = names
    return out


def _mesh_problem(view: GraphView, pins: PinSet, mesh: tuple[int, ...], across_links: bool = False) -> str | None:
    """Why the placement and fsdp pins cannot all hold on ``mesh`` (None: they can)."""
    if not pins.mesh_allowed(mesh):
        ndim = pins.mesh_ndim
        tp = pins.degree(PinKind.TENSOR_PARALLEL)
        if tp is not None and mesh[-1] != tp:
            return f"pin 'tp={tp}' needs a last mesh axis of {tp}, and mesh {mesh_label(mesh)} has {mesh[-1]}"
        pin = pins.of_kind(PinKind.PLACEMENT)[0]
        return (f"pin {pin.text!r} names {ndim} mesh ax{'is' if ndim == 1 else 'es'}, and mesh {mesh_label(mesh)} "
                f"has {len(mesh)}")
    # a dim split over two axes: HSDP's pins, or a mesh across nodes (the ILP offers it there)
    hybrid = across_links or \
        (pins.degree(PinKind.DATA_PARALLEL) or 1) > 1 and (pins.degree(PinKind.SHARDED_DATA_PARALLEL) or 1) > 1
    for name, info in view.graph.nodes.items():  # HSDP's pins split the batch over two axes
        held = pins.value_pins(info)
        if not held:
            continue
        offered = offered_output_specs(view, name, mesh, hybrid)
        if any(all(p.allows(spec, mesh) for p in held) for spec in offered):
            continue
        choices = ", ".join("[" + ", ".join(spec_to_json(s)) + "]" for s in offered)
        pin = next((p for p in held if not any(p.allows(s, mesh) for s in offered)), held[0])
        what = info.fqn or info.name
        return (f"pin {pin.text!r} cannot hold on mesh {mesh_label(mesh)}: {what} ({info.target}, shape "
                f"{list(info.shape or ())}) may only be {choices} there")
    return None


def check_layer_pins(graph: TracedGraph, layers: list[Layer], pins: PinSet, stages: int | None, pipeline: bool,
                     schedule: str | None, recompute: str) -> None:
    """Refuse, in one line, stage pins that break layer order or the stage count (``stages``,
    or pipelines turned off), and checkpoint pins on a layer that may not be recomputed."""
    staged = pins.of_kind(PinKind.STAGE)
    if staged:
        texts = ", ".join(repr(p.text) for p in staged)
        least = pins.least_stages
        if least > 1 and not pipeline:
            raise AutoplanError(f"pin {staged[-1].text!r} names stage {least - 1} but pipelines are turned off: "
                                f"drop one or the other")
        if schedule in INTERLEAVED:
            raise AutoplanError(f"stage pins ({texts}) with the {schedule} schedule: its chunks are cut after the "
                                f"search, so a stage index is not a place; use 1f1b or gpipe")
        try:
            InterOpProblem(len(layers), 1, 1, 1, pinned_stages=stages or least,
                           layer_stages=pins.layer_stages(graph, layers))
        except ValueError as e:
            names = ", ".join(f"{i} {layer.name}" for i, layer in enumerate(layers))
            raise AutoplanError(f"the stage pins ({texts}) cannot hold: {e} (the model's layers: {names})") from None
    checkpointed = pins.of_kind(PinKind.CHECKPOINT)
    if checkpointed:
        if recompute == "none":
            raise AutoplanError(f"pin {checkpointed[0].text!r} recomputes layers but recompute is none: drop one")
        refused = sorted(pins.checkpointed_layers(graph, layers) - recomputable(graph, layers))
        if refused:
            raise AutoplanError(f"checkpoint pins name layer {layers[refused[0]].name}, which writes into a tensor "
                                f"(running statistics, say) that recomputing would write twice: unpin it")


def check_pins(graph: TracedGraph, pins: PinSet, meshes: list[tuple[int, ...]],
               across_links: Callable[[tuple[int, ...]], bool] | None = None
               ) -> tuple[PinSet, dict[str, list[str]]]:
    """``pins`` checked on ``graph`` (see the module docstring), with the ``meshes`` (of
    those the search may use) on which they all hold; and what each pin holds
    (:func:`matched_names`). ``across_links``: whether a mesh's axes communicate over
    different links (a mesh across nodes), where a placement may split one dim over two axes."""
    holds = matched_names(graph, pins)
    pins = replace(pins, tied=tuple(sorted(graph.tied.items())))
    view = GraphView.of(graph)
    for pin in pins.of_kind(PinKind.PLACEMENT):
        for info in graph.nodes.values():
            if info.kind == "op" and view.fx_nodes[info.name].target is operator.getitem and pin.matches(info.name):
                raise AutoplanError(f"pin {pin.text!r} names {info.name}, one output of a multi-output op: pin the "
                                    f"op that produces it, or the op that reads it")
    problems = {mesh: _mesh_problem(view, pins, mesh, across_links is not None and across_links(mesh))
                for mesh in meshes}
    allowed = frozenset(mesh for mesh, problem in problems.items() if problem is None)
    if not allowed:
        if not meshes:
            raise AutoplanError("no logical mesh is left to hold the pins: loosen --mesh, --stages or the pins")
        ndim = pins.mesh_ndim
        telling = sorted(problems.items(), key=lambda item: len(item[0]) != ndim)  # a mesh of the pins' axes first
        raise AutoplanError(f"{telling[0][1]}: change the pin, or the mesh (--mesh, --devices)")
    return replace(pins, meshes=allowed), holds
