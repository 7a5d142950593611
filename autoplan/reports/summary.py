"""A readable text summary of a plan: what was chosen, what it costs, and why."""

from __future__ import annotations

from autoplan.plan_schema import HELD_SUFFIX, Alternative, MemoryEstimate, Plan, Prediction, RecomputeMode
from autoplan.planner.meshes import mesh_label, stage_meshes_text
from autoplan.solvers import format_bytes, format_seconds


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)) for r in rows]
    return out


def ranges_label(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` → ``0-2, 5``."""
    out: list[str] = []
    for v in sorted(values):
        if out and "-" in out[-1] and int(out[-1].split("-")[1]) == v - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{v}"
        elif out and "-" not in out[-1] and int(out[-1]) == v - 1:
            out[-1] = f"{out[-1]}-{v}"
        else:
            out.append(str(v))
    return ", ".join(out)


def layers_label(layers: list[str]) -> str:
    """The first and last of many layers, all of a few."""
    if len(layers) <= 3:
        return ", ".join(layers)
    return f"{layers[0]} ... {layers[-1]} ({len(layers)} layers)"


def _pipeline_lines(plan: Plan) -> list[str]:
    """The stages of a pipelined plan: layers, devices, logical mesh, latency per microbatch."""
    if len(plan.stages) < 2:
        return [] if plan.microbatches == 1 else \
            ["", f"gradient accumulation: {plan.microbatches} microbatches, one after the other (schedule "
                 f"{plan.schedule}): one microbatch's activations alive at a time"]
    lines = ["", (f"pipeline: {len(plan.stages)} stages, {plan.microbatches} microbatches, schedule {plan.schedule}, "
                 f"bubble {format_seconds(plan.predicted.bubble_s)} per step")]
    rows = [[str(i), layers_label(s.layers), ranges_label(s.devices), mesh_label(s.mesh), str(len(s.params)),
             format_seconds(s.latency_s)] for i, s in enumerate(plan.stages)]
    lines += ["  " + r for r in _table(rows, ["stage", "layers", "devices", "mesh", "parameters",
                                              "per microbatch (fwd+bwd)"])]
    return lines


def _recompute_lines(plan: Plan) -> list[str]:
    """The layers recomputed in the backward (activation checkpointing)."""
    if not plan.recompute:
        return []
    count = len(plan.recompute)
    return ["", f"activation checkpointing: {count} layer{'s' if count > 1 else ''} recomputed in the backward "
                f"({layers_label([r.layer for r in plan.recompute])}){recompute_modes_text(plan)}"]


def recompute_modes_text(plan: Plan) -> str:
    """How many recomputed layers are recomputed selectively (their matrix products and
    attention kept) or by the per-op policy, where any is."""
    out = ""
    for mode, how, kept in ((RecomputeMode.SELECTIVE, "selectively", "matrix products and attention"),
                            (RecomputeMode.PER_OP, "by the per-op policy", "attention and every other matrix product")):
        count = sum(r.mode == mode for r in plan.recompute)
        if count:
            every = count == len(plan.recompute)
            out += f", {'all' if every else count} {how} ({kept} kept, the rest recomputed)"
    return out


def _gathered_lines(plan: Plan) -> list[str]:
    """The parameters stored sharded and gathered at use (FSDP / ZeRO-3), those held gathered
    through the step, and those whose optimizer state (and gradient) alone is sharded (ZeRO-1/2)."""
    gathers = [c for c in plan.collectives if c.tensor == "parameter" and c.kind == "all_gather"
               and c.phase != "optimizer" and not c.where.endswith(HELD_SUFFIX)]
    lines = []
    if gathers:
        again = sum(c.count for c in gathers if c.phase == "backward")
        lines += ["", f"parameters gathered at use (FSDP / ZeRO-3): "
                      f"{sum(c.count for c in gathers if c.phase == 'forward')} gathers per step in the forward, "
                      f"{again} again in the backward"]
    held = sum(1 for s in plan.storage.values() if s.held)
    if held:
        lines += ["", f"parameters stored sharded and held gathered through the step: {held} (gathered once per step, "
                      f"before the first microbatch; their gradients reduce-scattered once, after the last)"]
    sharded = [s for s in plan.storage.values() if s.optimizer_state != s.param and not s.held]
    if sharded:
        zero2 = sum(1 for s in sharded if s.grad != s.param)
        lines += ["", f"optimizer state sharded under whole parameters: {len(sharded) - zero2} parameters (ZeRO-1), "
                      f"{zero2} with their gradients too (ZeRO-2); the optimizer step all-gathers them"]
    return lines


def savings_text(m: MemoryEstimate) -> str:
    """What sharded storage and checkpointing keep off each device ("" where neither does)."""
    parts = [f"{what} {format_bytes(saved)}" for what, saved in
             (("the sharded training state (ZeRO / FSDP)", m.sharding_saved),
              ("activation checkpointing", m.recompute_saved)) if saved > 0]
    return f"saved per device by {' and by '.join(parts)}" if parts else ""


def _prediction_line(p: Prediction) -> str:
    return (f"{format_seconds(p.step_time_s)} per step (compute {format_seconds(p.compute_s)}, "
            f"communication {format_seconds(p.comm_s)}{hidden_text(p)}), {format_bytes(p.memory_bytes.peak)} per "
            f"device, MFU {p.mfu:.1%}")


def hidden_text(p: Prediction) -> str:
    """``", 1.2 ms of it beside compute"`` where prefetched gathers hide communication."""
    return f", {format_seconds(p.hidden_s)} of it beside compute" if p.hidden_s > 0 else ""


def planning_time_text(timings_s: dict[str, float]) -> str:
    """The planning phases, then the total: the wall clock from loading to the plan when the
    plan records it (it also holds what no phase counts, so it is never less than their sum),
    else the sum of the phases, labelled as such."""
    parts = {k: v for k, v in timings_s.items() if k != "total"}
    listed = ", ".join(f"{k} {v:.2f}s" for k, v in parts.items())
    wall = timings_s.get("total")
    if wall is not None and wall >= sum(parts.values()):
        total = f"total {wall:.2f}s (wall clock)"
    else:
        total = f"total {sum(parts.values()):.2f}s (sum of the phases)"
    return f"{listed}; {total}" if listed else total


def _alternative_order(a: Alternative) -> tuple[int, float]:
    """Exact figures first (by the step expected on their program), then search estimates,
    fastest first; infeasible ones last."""
    if a.predicted:  # a plan that runs on the DTensor interpreter: by the step expected there
        return (0, a.predicted.interpreter_step_s or a.predicted.step_time_s)
    return (1, a.estimate_s) if a.estimate_s is not None else (2, 0.0)


def alternatives_in_order(alternatives: list[Alternative]) -> list[Alternative]:
    """Planned exactly (fastest first), then known only by the stage search's estimate
    (fastest first), then infeasible."""
    return sorted(alternatives, key=_alternative_order)


def alternative_text(a: Alternative) -> str:
    """An alternative's figure and where it comes from: ``exact ILP`` (planned as the chosen
    plan was, comparable with it), ``search estimate`` (the stage search's figure, which runs
    a few percent above exact ones), or why it is infeasible."""
    if a.predicted and a.predicted.interpreter_step_s:
        return (f"{_prediction_line(a.predicted)} [exact ILP]; on autoplan's DTensor interpreter, with its "
                f"dispatch: {format_seconds(a.predicted.interpreter_step_s)} expected")
    if a.predicted:
        return f"{_prediction_line(a.predicted)} [exact ILP]"
    if a.estimate_s is not None:
        return f"{format_seconds(a.estimate_s)} per step [search estimate: not planned exactly]"
    return a.reason or "infeasible"


def pin_cost_text(plan: Plan) -> str:
    """What the pins cost, in one sentence ("" without pins)."""
    cost = plan.pin_cost
    if not plan.pins or cost is None:
        return ""
    if cost.fraction is None:
        return f"the pins' cost is unknown: {cost.reason}" if cost.reason else ""
    pinned, free = format_seconds(cost.pinned_step_time_s), format_seconds(cost.unpinned_step_time_s or 0.0)
    if cost.fraction < 0:
        return (f"your pins save {-cost.fraction:.1%} of step time against the search without them ({pinned} "
                f"against {free} per step): they found a plan the search missed")
    return f"your pins cost {cost.fraction:.1%} of step time against the unpinned optimum ({pinned} against {free})"


def pinned_names(plan: Plan) -> set[str]:
    """The parameters, inputs and nodes a pin holds."""
    return {name for record in plan.pins for name in record.holds}


def _pin_lines(plan: Plan) -> list[str]:
    if not plan.pins:
        return []
    lines = ["", f"pins ({len(plan.pins)}, kept; marked * below):"]
    lines += [f"  {r.pin}" + (f"  holds {len(r.holds)}: {', '.join(r.holds[:4])}{' …' if len(r.holds) > 4 else ''}"
                              if r.holds else "") for r in plan.pins]
    cost = pin_cost_text(plan)
    return lines + ([f"  {cost}"] if cost else [])


def _placement_rows(placements: dict[str, list[str]], pinned: set[str]) -> list[list[str]]:
    return [[k + (" *" if k in pinned else ""), "[" + ", ".join(v) + "]"] for k, v in placements.items()]


def training_text(plan: Plan) -> str:
    """The optimizer and the precision the program trains with, as the plan costs them."""
    o, p = plan.optimizer, plan.precision
    precision = "fp32 throughout" if p.compute_dtype == "float32" else \
        (f"{p.compute_dtype} compute, float32 master weights and optimizer state, "
         f"{p.reduce_dtype} gradient reduction")
    return f"{o.name} (lr {o.lr:g}, weight decay {o.weight_decay:g}); {p.name}: {precision}"


def interpreter_dispatch_text(plan: Plan) -> str:
    """One line on the interpreter's host time, which the prediction leaves out
    (:mod:`autoplan.cost_models.interpreter_dispatch`); empty for PyTorch's own programs."""
    p = plan.predicted
    if not p.interpreter_dispatch_s:
        return ""
    device = plan.cluster.get("device", {})
    per_op = device.get("interpreter_op_overhead_s", 0.0)
    passes = f" ({p.interpreter_dispatch_s / per_op:.0f} op passes at {per_op * 1e6:.0f} us)" if per_op else ""
    bound = "at least " if device.get("overlapped_dispatch") else ""
    return (f"interpreter dispatch: {format_seconds(p.interpreter_dispatch_s)} of host time per step{passes}, "
            f"not in the prediction: the step is expected to take {bound}{format_seconds(p.interpreter_step_s)} "
            f"on the interpreter")


def _within(peak: float, budget: float | None) -> str:
    if not budget:
        return ""
    return " (within the budget)" if peak <= budget else " (over the budget)"


def summary_text(plan: Plan, max_nodes: int = 60) -> str:
    m = plan.predicted.memory_bytes
    budget = plan.cluster.get("device", {}).get("memory_bytes")
    lines = [
        (f"autoplan: {plan.model or 'model'} on {plan.devices} x {plan.cluster.get('device', {}).get('name', '?')}"
        f" ({plan.cluster.get('name', '')}), {stage_meshes_text([s.mesh for s in plan.stages] or [plan.mesh])}"),
        f"predicted: {_prediction_line(plan.predicted)}",
        f"memory per device: params {format_bytes(m.params)}, grads {format_bytes(m.grads)}, "
        f"optimizer {format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}"
        + (f" (budget {format_bytes(budget)})" if budget else "")
        + (f"; the backward's transients {format_bytes(m.transient)} more, at most "
           f"{format_bytes(m.peak_with_transient)}" + _within(m.peak_with_transient, budget) if m.transient else ""),
    ]
    saved = savings_text(m)
    if saved:
        lines.append(saved)
    lines.append(f"training: {training_text(plan)}")
    if plan.program:
        lines.append(f"program: {plan.program}")
    dispatch = interpreter_dispatch_text(plan)
    if dispatch:
        lines.append(dispatch)
    if plan.solver:
        s = plan.solver
        gap = "" if s.status == "optimal" else f", gap {s.gap if s.gap is not None else 'unknown'}"
        lines.append(f"solver: {s.solver}, {s.status}{gap}; {s.num_nodes} nodes in {s.num_groups} groups, "
                     f"{s.num_variables} variables, {s.num_constraints} constraints, {format_seconds(s.solve_time_s)}")
    if plan.timings_s:
        lines.append("planning time: " + planning_time_text(plan.timings_s))
    lines += _pipeline_lines(plan) + _recompute_lines(plan) + _gathered_lines(plan) + _pin_lines(plan)
    pinned = pinned_names(plan)
    lines += ["", "parameters:"]
    lines += ["  " + r for r in _table(_placement_rows(plan.params, pinned), ["parameter", "placement"])]
    if plan.inputs:
        lines += ["", "inputs:"]
        lines += ["  " + r for r in _table(_placement_rows(plan.inputs, pinned), ["input", "placement"])]
    shown = [n for n in plan.nodes][:max_nodes]
    lines += ["", f"ops ({len(plan.nodes)}{', first ' + str(max_nodes) if len(plan.nodes) > max_nodes else ''}):"]
    lines += ["  " + r for r in _table([[n.name + (" *" if n.name in pinned else ""), n.op, n.module, n.strategy]
                                        for n in shown],
                                       ["node", "op", "module", "strategy (out = inputs)"])]
    lines += ["", "collectives per step:"]
    if plan.collectives:
        rows = [[c.phase, c.kind, str(c.mesh_axis), format_bytes(c.bytes), str(c.count), c.tensor, c.where]
                for c in plan.collectives]
        lines += ["  " + r for r in _table(rows, ["phase", "kind", "axis", "bytes", "count", "tensor", "where"])]
    else:
        lines.append("  none")
    if plan.explanation:
        lines += ["", "why: " + plan.explanation.splitlines()[0]]
        lines += ["  " + line.strip() if not line.startswith(" ") else line for line in plan.explanation.splitlines()[1:]]
    if plan.alternatives:
        chosen = format_seconds(plan.predicted.step_time_s)
        lines += ["", (f"alternatives (why not these; the chosen plan: {chosen} per step [exact ILP]; search "
                       f"estimates run a few percent above exact figures):")]
        lines += [f"  {a.name}: {alternative_text(a)}" for a in alternatives_in_order(plan.alternatives)]
    for w in plan.warnings:
        lines.append(f"warning: {w}")
    return "\n".join(lines)
