"""The plan report (``autoplan ... --report``): what was chosen, what it is predicted to cost
and why, beside the textbook baselines, and — after ``--run`` — what was measured.

Sections: summary; placement of every parameter per mesh axis; predicted step time by compute,
collective kind and bubble; memory per device against the budget; the found plan beside the
baselines and ``--manual`` plans; the pipeline timeline (pipelines only); the measured run.
Numbers are written with the summary's formatters so the report and the terminal agree."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autoplan.cost_models.cluster import ClusterSpec
from autoplan.cost_models.communication import COLLECTIVE_KINDS, collective_time
from autoplan.plan_schema import Alternative, MemoryEstimate, Plan, Prediction
from autoplan.planner.meshes import mesh_label, meshes_label, stage_meshes_text
from autoplan.reports import figures
from autoplan.reports.document import (
    Document,
    Figure,
    Pre,
    Section,
    Table,
    Text,
    write_document,
)
from autoplan.reports.runlog import RunLog
from autoplan.reports.summary import (
    alternative_text,
    alternatives_in_order,
    hidden_text,
    interpreter_dispatch_text,
    layers_label,
    pin_cost_text,
    pinned_names,
    planning_time_text,
    ranges_label,
    recompute_modes_text,
    savings_text,
    training_text,
)
from autoplan.solvers import format_bytes, format_seconds

Progress = Callable[[str], None]
MAX_MAP_ROWS = 80


def stderr_progress(message: str) -> None:
    print(f"autoplan: report: {message}", file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    pass


# ---------------------------------------------------------------------------------------------
# numbers taken from the plan


def _budget(plan: Plan) -> float | None:
    value = plan.cluster.get("device", {}).get("memory_bytes")
    return float(value) if value else None


def comm_by_kind(plan: Plan) -> tuple[dict[str, float], bool]:
    """Communication seconds per collective kind, and whether the split is estimated.

    The plan's ``comm_by_kind_s`` when it has one; otherwise ``comm_s`` shared out by the
    alpha-beta cost of each collective in ``plan.collectives`` (an estimate of the split, not of
    the total, which stays the plan's)."""
    p = plan.predicted
    if p.comm_by_kind_s:
        return {k: v for k, v in p.comm_by_kind_s.items() if v > 0}, False
    if p.comm_s <= 0:
        return {}, False
    try:
        cluster = ClusterSpec.from_dict(plan.cluster)
        links = cluster.mesh_links(tuple(plan.mesh))
    except (KeyError, TypeError, ValueError):
        return {"communication": p.comm_s}, True
    cross = cluster.inter_node if plan.devices > cluster.devices_per_node else cluster.intra_node
    raw: dict[str, float] = {}
    for c in plan.collectives:
        if 0 <= c.mesh_axis < len(plan.mesh):
            n, link = plan.mesh[c.mesh_axis], links[c.mesh_axis]
        else:  # between pipeline stages
            n, link = 2, cross
        if c.kind not in COLLECTIVE_KINDS:
            continue
        seconds = collective_time(c.kind, c.bytes, n, link.without_latency() if c.bucketed else link)
        raw[c.kind] = raw.get(c.kind, 0.0) + seconds * c.count
    total = sum(raw.values())
    if total <= 0:
        return {"communication": p.comm_s}, True
    return {k: p.comm_s * v / total for k, v in raw.items() if v > 0}, True


def _three(p: Prediction) -> tuple[float, float, float]:
    return p.compute_s, p.comm_s, p.bubble_s


def _percent(part: float, whole: float) -> str:
    share = 100 * part / whole
    return f"{share:.1f}%" if share >= 0.1 or share == 0 else f"{share:.2g}%"


def _memory_parts(m: MemoryEstimate) -> dict[str, float]:
    return {"params": m.params, "grads": m.grads, "optimizer": m.optimizer, "activations": m.activations}


# ---------------------------------------------------------------------------------------------
# sections


def summary_section(plan: Plan) -> Section:
    p, m = plan.predicted, plan.predicted.memory_bytes
    device = plan.cluster.get("device", {})
    budget = _budget(plan)
    rows = [
        ["model", plan.model or "model"],
        ["devices", f"{plan.devices} x {device.get('name', '?')}"],
        ["cluster", _cluster_line(plan)],
        ["mesh (per stage)", meshes_label([s.mesh for s in plan.stages] or [plan.mesh])],
        ["stages", str(len(plan.stages))],
        ["microbatches", str(plan.microbatches)],
        ["schedule", plan.schedule],
        ["predicted step time", (f"{format_seconds(p.step_time_s)} (compute {format_seconds(p.compute_s)}, "
                                 f"communication {format_seconds(p.comm_s)}{hidden_text(p)}, "
                                 f"bubble {format_seconds(p.bubble_s)})")],
        ["predicted MFU", f"{p.mfu:.1%} (the model's forward and backward FLOPs over the devices' peak)"],
        ["training", training_text(plan)],
        ["program", plan.program or "(not recorded in this plan)"],
        *([["interpreter dispatch", interpreter_dispatch_text(plan).split(": ", 1)[1]]]
          if plan.predicted.interpreter_dispatch_s else []),
        ["activation checkpointing", f"{len(plan.recompute)} layers recomputed in the backward"
                                     f"{recompute_modes_text(plan)}" if plan.recompute else "none"],
        ["memory per device (peak)", format_bytes(m.peak) + (f" of {format_bytes(budget)} "
                                                               f"({_percent(m.peak, budget)} of the budget)"
                                                               if budget else "")],
        ["memory by kind", (f"params {format_bytes(m.params)}, grads {format_bytes(m.grads)}, "
                            f"optimizer {format_bytes(m.optimizer)}, activations {format_bytes(m.activations)}"
                            + (f"; {savings_text(m)}" if savings_text(m) else ""))],
    ]
    if plan.solver:
        s = plan.solver
        rows.append(["solver", (f"{s.solver}, {s.status}; {s.num_nodes} nodes in {s.num_groups} groups, "
                                f"{s.num_variables} variables, {format_seconds(s.solve_time_s)}")])
    if plan.timings_s:
        rows.append(["planning time", planning_time_text(plan.timings_s)])
    rows.append(["graph hash", plan.graph_hash])
    blocks: list = [Table(["", ""], rows)]
    stage_rows = [[str(i), layers_label(s.layers), ranges_label(s.devices), mesh_label(s.mesh), str(len(s.params)),
                   format_seconds(s.latency_s)] for i, s in enumerate(plan.stages)]
    blocks.append(Table(["stage", "layers", "devices", "mesh", "parameters", "latency per microbatch (fwd+bwd)"],
                        stage_rows, caption="pipeline stages" if len(plan.stages) > 1 else "the single stage"))
    if plan.pins:
        rows = [[r.pin, ", ".join(r.holds[:6]) + (" …" if len(r.holds) > 6 else "") if r.holds
                 else "the plan's structure"] for r in plan.pins]
        blocks.append(Table(["pin (kept)", "holds"], rows, caption="your pins; the planner chose everything else "
                                                                   "around them"))
        if pin_cost_text(plan):
            blocks.append(Text(pin_cost_text(plan) + "."))
    if plan.explanation:
        blocks += [Text("Why this plan (the largest cost terms and memory holders):"), Pre(plan.explanation)]
    blocks += [Text(f"warning: {w}") for w in plan.warnings]
    return Section("1. Plan summary", blocks)


def _cluster_line(plan: Plan) -> str:
    c = plan.cluster
    parts = [str(c.get("name", "?")), f"{c.get('devices_per_node', '?')} devices per node"]
    memory = c.get("device", {}).get("memory_bytes")
    if memory:
        parts.append(f"{format_bytes(memory)} per device")
    for key, label in (("intra_node", "intra-node"), ("inter_node", "inter-node")):
        link = c.get(key)
        if link:
            parts.append(f"{label} {link['bandwidth'] / 1e9:.3g} GB/s, {format_seconds(link['latency'])}")
    return "; ".join(parts)


def _param_stage(plan: Plan) -> dict[str, int]:
    return {name: i for i, s in enumerate(plan.stages) for name in s.params}


@dataclass
class _Group:
    module: str
    leaf: str
    placements: tuple[str, ...]
    names: list[str]
    stages: set[int]

    @property
    def label(self) -> str:
        full = f"{self.module}.{self.leaf}" if self.module else self.leaf
        return full if len(self.names) == 1 else f"{full} (x{len(self.names)})"


def placement_groups(plan: Plan) -> list[_Group]:
    """Parameters grouped by name pattern (repeated layers' indices as ``*``) and placement, in
    the plan's order: 48 identical transformer blocks become one row per parameter kind."""
    stage_of = _param_stage(plan)
    groups: dict[tuple[str, tuple[str, ...]], _Group] = {}
    for name, placements in plan.params.items():
        module, _, leaf = name.rpartition(".")
        pattern = re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", module)
        key = (f"{pattern}.{leaf}", tuple(placements))
        g = groups.get(key)
        if g is None:
            g = groups[key] = _Group(pattern, leaf, tuple(placements), [], set())
        g.names.append(name)
        if name in stage_of:
            g.stages.add(stage_of[name])
    for g in groups.values():  # a pattern with one member keeps its real name
        if len(g.names) == 1:
            g.module = g.names[0].rpartition(".")[0]
    return list(groups.values())


def _axes(plan: Plan) -> list[str]:
    return [f"axis {i} ({n})" for i, n in enumerate(plan.mesh)]


def placements_section(plan: Plan, progress: Progress) -> Section:
    progress("placement map")
    groups = placement_groups(plan)
    axes = _axes(plan)
    pipeline = len(plan.stages) > 1
    blocks: list = [Text(
        f"Each parameter's placement on each axis of the {'stage' if pipeline else 'device'} mesh "
        f"{mesh_label(plan.mesh)}: R replicated, S(d) sharded on tensor dim d (for a weight matrix S(0) "
        "cuts rows, S(1) columns), P partial sums. Repeated layers with the same placement are one row "
        "(x count).")]
    if groups:
        shown = groups[:MAX_MAP_ROWS]
        rows = [(g.label + (f"  [stage {ranges_label(sorted(g.stages))}]" if pipeline and g.stages else ""), g.placements)
                for g in shown]
        more = f" (first {MAX_MAP_ROWS} of {len(groups)} rows)" if len(groups) > MAX_MAP_ROWS else ""
        blocks.append(Figure("report_placements", figures.placement_map(rows, axes, "parameter placements" + more),
                             f"placement of every parameter per mesh axis{more}"))
    pinned = pinned_names(plan)
    header = ["module", "parameter", "count"] + (["stage"] if pipeline else []) + axes + (["pinned"] if pinned else [])
    table_rows = [[g.module or "(top)", g.leaf, str(len(g.names))]
                  + ([ranges_label(sorted(g.stages))] if pipeline else []) + list(g.placements)
                  + (["yes" if pinned.intersection(g.names) else ""] if pinned else []) for g in groups]
    blocks.append(Table(header, table_rows, caption="parameter placements", collapsed=len(table_rows) > 40))
    if plan.inputs:
        blocks.append(Table(["input"] + axes, [[k, *v] for k, v in plan.inputs.items()], caption="input placements"))
    ops = [[n.name, n.op, n.module, n.strategy] for n in plan.nodes]
    blocks.append(Table(["node", "op", "module", "strategy (out = inputs)"], ops, caption="strategy of every op",
                        collapsed=True))
    return Section("2. Placements per layer", blocks)


def step_section(plan: Plan, progress: Progress) -> Section:
    progress("step time breakdown")
    p = plan.predicted
    kinds, estimated = comm_by_kind(plan)
    ordered = sorted(kinds.items(), key=lambda kv: (list(COLLECTIVE_KINDS) + ["communication"]).index(kv[0])
                     if kv[0] in COLLECTIVE_KINDS or kv[0] == "communication" else 99)
    segments = [("compute", p.compute_s), *ordered, ("bubble", p.bubble_s)]
    if p.hidden_s > 0:  # collectives beside compute: the parts add up to the step
        segments.append(("beside compute", -p.hidden_s))
    blocks: list = [Figure("report_step_time", figures.step_breakdown(segments, p.step_time_s,
                                                                      "predicted step time by part"),
                           f"predicted step time {format_seconds(p.step_time_s)}: compute, each collective kind, "
                           "bubble")]
    rows = [[name.replace("_", "-"), format_seconds(v), f"{100 * v / p.step_time_s:.1f}%" if p.step_time_s else "-"]
            for name, v in segments if v != 0 or name == "compute"]
    rows.append(["step (predicted)", format_seconds(p.step_time_s), "100.0%"])
    blocks.append(Table(["part", "time", "share of the step"], rows))
    parts = sum(v for _, v in segments)
    if p.step_time_s and abs(parts - p.step_time_s) > 1e-3 * p.step_time_s:
        blocks.append(Text(f"The parts add up to {format_seconds(parts)}, not the step's "
                           f"{format_seconds(p.step_time_s)}: the cost model overlaps or adds terms "
                           "(e.g. optimizer step) that are not split out here."))
    if estimated:
        blocks.append(Text("The split of communication by collective kind is estimated from the plan's list of "
                           "collectives (alpha-beta ring costs); the total is the plan's."))
    if plan.collectives:
        rows = [[c.phase, c.kind.replace("_", "-"), str(c.mesh_axis) if c.mesh_axis >= 0 else "stages",
                 format_bytes(c.bytes), str(c.count), c.tensor, c.where] for c in plan.collectives]
        blocks.append(Table(["phase", "kind", "axis", "bytes", "count", "tensor", "where"], rows,
                            caption="collectives per step", collapsed=len(rows) > 15))
    else:
        blocks.append(Text("The plan performs no collectives."))
    return Section("3. Predicted step time", blocks)


def _compared(plan: Plan, baselines: list[Alternative]) -> list[Alternative]:
    manual = [a for a in plan.alternatives if a.name.startswith("manual ")]
    return baselines + manual


def memory_section(plan: Plan, baselines: list[Alternative], progress: Progress) -> Section:
    progress("memory per device")
    m = plan.predicted.memory_bytes
    budget = _budget(plan)
    entries = [("found plan", _memory_parts(m), m.peak)]
    entries += [(a.name, _memory_parts(a.predicted.memory_bytes), a.predicted.memory_bytes.peak)
                for a in _compared(plan, baselines) if a.predicted]
    blocks: list = [Figure("report_memory", figures.memory_bars(entries, budget, "predicted memory per device"),
                           "bytes each device holds, by kind, against the device budget"
                           + (f" ({format_bytes(budget)})" if budget else ""))]
    rows = [[name, format_bytes(parts["params"]), format_bytes(parts["grads"]), format_bytes(parts["optimizer"]),
             format_bytes(parts["activations"]), format_bytes(peak),
             _percent(peak, budget) if budget else "-"] for name, parts, peak in entries]
    blocks.append(Table(["plan", "params", "grads", "optimizer", "activations", "peak", "of budget"], rows))
    return Section("4. Memory per device", blocks)


def comparison_section(plan: Plan, baselines: list[Alternative] | None, progress: Progress) -> Section:
    progress("comparison with the baselines")
    compared = _compared(plan, baselines or [])
    p = plan.predicted
    blocks: list = []
    if baselines is None:
        blocks.append(Text("Baselines were not costed (the report was made from the plan alone, without the model)."))
    entries = [(f"found plan ({_plan_shape(plan)})", _three(p), "")]
    for a in compared:
        if a.predicted:
            entries.append((a.name, _three(a.predicted), _versus(a.predicted.step_time_s, p.step_time_s)))
        else:
            entries.append((a.name, None, a.reason or "infeasible"))
    if len(entries) > 1:
        blocks.append(Figure("report_comparison", figures.comparison(entries, "predicted step time: found plan vs "
                                                                              "baselines"),
                             "predicted step time of the found plan beside data, tensor and pipeline parallelism "
                             "(and any --manual plans); infeasible plans show why"))
    rows = [["found plan", _plan_shape(plan), format_seconds(p.step_time_s), format_seconds(p.compute_s),
             format_seconds(p.comm_s), format_seconds(p.bubble_s), format_bytes(p.memory_bytes.peak), f"{p.mfu:.1%}",
             "1.00x"]]
    for a in compared:
        shape = f"pp={a.mesh[0]}, dp={a.mesh[1]}, tp={a.mesh[2]}" if len(a.mesh) == 3 else mesh_label(a.mesh)
        if a.predicted:
            q = a.predicted
            rows.append([a.name, shape, format_seconds(q.step_time_s), format_seconds(q.compute_s),
                         format_seconds(q.comm_s), format_seconds(q.bubble_s), format_bytes(q.memory_bytes.peak),
                         f"{q.mfu:.1%}", f"{q.step_time_s / p.step_time_s:.2f}x" if p.step_time_s else "-"])
        else:
            rows.append([a.name, shape, a.reason or "infeasible", "", "", "", "", "", ""])
    blocks.append(Table(["plan", "shape", "step time", "compute", "communication", "bubble", "peak memory",
                         "MFU", "step time / found"], rows))
    searched = [a for a in plan.alternatives if not a.name.startswith("manual ")]
    if searched:
        blocks.append(Table(["candidate", "why not"], [[a.name, alternative_text(a)]
                                                       for a in alternatives_in_order(searched)],
            caption="other candidates the planner's search weighed", collapsed=len(searched) > 10))
    return Section("5. Found plan vs baselines", blocks)


def _versus(baseline_s: float, found_s: float) -> str:
    if not found_s or not baseline_s:
        return ""
    ratio = baseline_s / found_s
    if abs(ratio - 1) < 0.005:
        return "(same as the found plan)"
    return f"(found plan {ratio:.2f}x faster)" if ratio > 1 else f"(found plan {1 / ratio:.2f}x slower)"


def _plan_shape(plan: Plan) -> str:
    shape = _meshes(plan)
    if len(plan.stages) > 1:
        shape = f"{len(plan.stages)} stages x {shape}, {plan.microbatches} microbatches"
    return shape


def timeline_section(plan: Plan, progress: Progress) -> Section | None:
    if len(plan.stages) <= 1:
        return None
    progress("pipeline timeline")
    latencies = [s.latency_s for s in plan.stages]
    return Section("6. Pipeline timeline", [
        Figure("report_timeline", figures.pipeline_timeline(latencies, plan.microbatches, plan.schedule),
               f"predicted {plan.schedule} timeline of {len(plan.stages)} stages and {plan.microbatches} "
               f"microbatches; bubble {format_seconds(plan.predicted.bubble_s)} per step"),
    ])


def run_section(plan: Plan, log: RunLog, progress: Progress, number: int) -> Section:
    progress("measured run")
    predicted = plan.predicted.step_time_s
    blocks: list = []
    if not log.steps:
        blocks.append(Text("The run printed no 'step K loss X' lines (with --check, train.py compares with one "
                           "device instead of training): nothing measured."))
        return Section(f"{number}. Measured run", blocks)
    measured = log.measured_step_s
    rows = [["steps", str(len(log.steps))],
            ["predicted step time", format_seconds(predicted)],
            ["measured step time", format_seconds(measured) + (" (median, first step left out)"
                                                               if log.times_s and len(log.times_s) > 1 else "")
             if measured is not None else "not measured"],
            ["first loss", f"{log.losses[0]:.6f}"], ["last loss", f"{log.losses[-1]:.6f}"]]
    if measured is not None and predicted > 0:
        rows.insert(3, ["measured / predicted", f"{measured / predicted:.2f}x"])
    blocks.append(Table(["", ""], rows))
    blocks.append(Text("The prediction is for the planned cluster; a run on this machine (e.g. gloo on CPU) "
                       "measures different hardware, so compare the two only when they are the same."))
    blocks.append(Figure("report_loss", figures.loss_curve(log.steps, log.losses), "loss per step (rank 0)"))
    if log.times_s:
        blocks.append(Figure("report_measured_step", figures.step_times(log.steps, log.times_s, predicted),
                             "measured time of each step against the predicted step time"))
    per_step = [[str(s), f"{loss:.6f}", format_seconds(t) if t is not None else "not measured"]
                for s, loss, t in zip(log.steps, log.losses, log.times_s or [None] * len(log.steps))]
    blocks.append(Table(["step", "loss", "time"], per_step, caption="every step", collapsed=len(per_step) > 20))
    return Section(f"{number}. Measured run", blocks)


# ---------------------------------------------------------------------------------------------


def build_report(plan: Plan, baselines: list[Alternative] | None = None, run: RunLog | None = None,
                 progress: Progress = _quiet) -> Document:
    """The report of ``plan`` as a :class:`Document` (nothing written)."""
    progress("summary")
    sections = [summary_section(plan), placements_section(plan, progress), step_section(plan, progress),
                memory_section(plan, baselines or [], progress), comparison_section(plan, baselines, progress)]
    timeline = timeline_section(plan, progress)
    if timeline:
        sections.append(timeline)
    if run is not None:
        sections.append(run_section(plan, run, progress, len(sections) + 1))
    title = f"autoplan report: {plan.model or 'model'} on {plan.devices} x " \
            f"{plan.cluster.get('device', {}).get('name', '?')}, {_meshes(plan)}"
    return Document(title, sections)


def _meshes(plan: Plan) -> str:
    return stage_meshes_text([s.mesh for s in plan.stages] or [plan.mesh])


def write_report(plan: Plan, folder: str | Path, spec=None, options=None, baselines: list[Alternative] | None = None,
                 run: RunLog | None = None, progress: Progress = stderr_progress) -> list[Path]:
    """Write ``report.html`` (self-contained) and ``report.md`` (with ``report_*.png`` beside it)
    into ``folder``. With the model's ``spec`` and planner ``options`` and no ``baselines``, the
    baselines are costed here; returns the written paths, the HTML first."""
    if baselines is None and spec is not None and options is not None:
        from autoplan.reports.baselines import cost_baselines

        baselines = cost_baselines(plan, spec, options, progress)
    doc = build_report(plan, baselines, run, progress)
    progress(f"writing {Path(folder) / 'report.html'} and report.md")
    return write_document(doc, Path(folder))
