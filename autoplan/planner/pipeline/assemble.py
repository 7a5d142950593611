"""A pipelined Plan from a candidate's exact stage plans: stages, placements, the collectives of
the schedule and after it, and the predicted step time and memory."""

from __future__ import annotations

import math
from dataclasses import replace

from autoplan.cost_models import ALL_REDUCE, BROADCAST, LinkSpec, collective_time
from autoplan.cost_models.backward_overlap import overlaps_regathers
from autoplan.cost_models.step_costs import is_floating, model_flops_utilization
from autoplan.errors import MemoryInfeasibleError
from autoplan.load import ModelSpec
from autoplan.plan_schema import (MemoryEstimate, ParamStorage, Plan, PlannedCollective, Prediction, StagePlan,
    copies_summed)
from autoplan.planner.api import PlannerOptions
from autoplan.planner.assemble import node_plans, placements, predict, prefetched_gathers, sharded_storage, solver_stats
from autoplan.planner.mesh_plan import emit_warnings
from autoplan.planner.pipeline.candidates import PipelineCandidate, candidate_lighter
from autoplan.planner.pipeline.exact import stage_results
from autoplan.planner.pipeline.range_costs import cut_bytes, link_between_stages, whole_below, whole_crossings
from autoplan.planner.pipeline.schedules import busiest_rank, pipeline_time
from autoplan.planner.recompute import recomputed_layers
from autoplan.sharding import local_shape, spec_from_json
from autoplan.solvers import format_bytes
from autoplan.trace.batch_coupling import coupling_plans
from autoplan.trace.graph import TracedGraph
from autoplan.trace.repeated import find_classes
from autoplan.trace.tracer import trace


def assemble_pipeline(spec: ModelSpec, candidate: PipelineCandidate, options: PlannerOptions, schedule: str,
              timings: dict[str, float]) -> Plan:
    graph, layers = candidate.graph, candidate.layers
    coupling = coupling_plans(graph, candidate.microbatches)  # refuses a split that changes the model
    results = stage_results(candidate, options, schedule)
    link = link_between_stages(options, candidate.submesh)
    whole = whole_crossings(graph, layers, candidate.cuts, candidate.meshes)
    below = whole_below(options)
    crossing: dict[tuple[int, ...], list[float]] = {}  # by the sender's mesh
    stage_plans, nodes, collectives, params, inputs = [], [], [], {}, {}
    storage: dict[str, ParamStorage] = {}
    latencies, memories, computes, comms, hiddens, kinds = [], [], [], [], [], []
    prefetch = []
    for index, ((start, end), (sub, result, ctx)) in enumerate(zip(candidate.cuts, results)):
        prediction, stage_collectives = predict(sub, find_classes(sub), result, ctx)
        for c in stage_collectives:
            c.stages = [index]
        send_bytes = 0.0
        if end < len(layers):  # what each rank sends the next stage: its shards (whole values on their way
            mesh = tuple(candidate.meshes[index])  # to or from another logical mesh)
            if mesh not in crossing:
                crossing[mesh] = cut_bytes(graph, layers, mesh, whole, below)
            send_bytes = crossing[mesh][end]
        send = 2 * collective_time("send_recv", send_bytes, 2, link) if send_bytes else 0.0
        if send_bytes:
            where = f"stage {index} -> stage {index + 1}"
            stage_collectives += [
                PlannedCollective("send_recv", phase, -1, send_bytes, candidate.microbatches, where,
                                  stages=[index, index + 1]) for phase in ("forward", "backward")]
        latencies.append(prediction.step_time_s / candidate.microbatches + send)
        memories.append(prediction.memory_bytes)
        computes.append(prediction.compute_s)
        hiddens.append(prediction.hidden_s)
        prefetch += prefetched_gathers(sub, result, ctx)
        comms.append(prediction.comm_s + send * candidate.microbatches)
        by_kind = dict(prediction.comm_by_kind_s)
        if send:
            by_kind["send_recv"] = send * candidate.microbatches
        kinds.append(by_kind)
        collectives += stage_collectives
        nodes += node_plans(sub, result)
        stage_params = placements(sub, result, ("parameter", "buffer"))
        params.update(stage_params)
        storage.update(sharded_storage(sub, result))
        for name, spec_ in placements(sub, result, ("input",)).items():
            inputs.setdefault(name, spec_)
        size, rank = candidate.submesh.size, index % candidate.ranks
        stage_plans.append(StagePlan([layer.name for layer in layers[start:end]],
                                     list(range(rank * size, (rank + 1) * size)), list(candidate.meshes[index]),
                                     [n for layer in layers[start:end] for n in layer.nodes], list(stage_params),
                                     latencies[-1], memories[-1].peak))
    after, after_kinds = (after_schedule(graph, stage_plans, params, options, link, collectives)
                          if len(stage_plans) > 1 else (0.0, {}))
    scheduled = pipeline_time(latencies, candidate.microbatches, schedule)
    step = scheduled + after
    worst = worst_rank(per_rank(memories, candidate.ranks))
    busiest = busiest_rank(latencies, schedule)  # the parts: its compute, communication and bubble
    by_kind: dict[str, float] = {}
    for kind, seconds in [*(item for s in busiest for item in kinds[s].items()), *after_kinds.items()]:
        by_kind[kind] = by_kind.get(kind, 0.0) + seconds
    busy = candidate.microbatches * sum(latencies[s] for s in busiest)
    predicted = Prediction(step, sum(computes[s] for s in busiest), sum(comms[s] for s in busiest) + after,
                           MemoryEstimate(**vars(worst)), by_kind, bubble_s=max(0.0, scheduled - busy),
                           hidden_s=sum(hiddens[s] for s in busiest),
                           mfu=model_flops_utilization(graph.nodes.values(), candidate.microbatches, step,
                                                       options.devices, options.cluster.device,
                                                       options.optimizer.mixed_precision))
    first = results[0][1]
    warnings_ = sorted({w for _, r, _ in results for w in r.warnings})
    emit_warnings(warnings_)
    return Plan(
        graph_hash=graph.graph_hash, devices=options.devices, cluster=options.cluster.to_dict(),
        mesh=list(candidate.meshes[0]), stages=stage_plans, microbatches=candidate.microbatches,
        schedule=schedule if len(stage_plans) > 1 or candidate.microbatches > 1 else "none", params=params,
        crossing_whole=sorted({name for sub, _, _ in results for name, info in sub.nodes.items()
                               if info.kind == "activation" and name in sub.whole_values}),
        storage=storage, inputs=inputs, nodes=nodes,
        collectives=collectives, predicted=predicted, solver=solver_stats(first), timings_s=timings,
        warnings=warnings_, model=spec.name, batch_coupling=coupling,
        recompute=recomputed_layers((layers[i] for i in sorted(candidate.recomputed)),
                                    (layers[i] for i in candidate.selective),
                                    candidate_lighter(candidate, options.recompute)),
        prefetch=prefetch, prefetch_regathers=any(overlaps_regathers(ctx) for _, _, ctx in results))


def per_rank(memories: list[MemoryEstimate], ranks: int) -> list[MemoryEstimate]:
    """Each pipeline rank's memory: the sum over the stages it holds (stage ``s`` on rank
    ``s % ranks``; several with the interleaved schedules). The sum of the peaks bounds the
    rank's peak from above. The backward's transients are the largest of its stages': a rank
    runs one stage's backward at a time."""
    out = []
    for rank in range(ranks):
        mine = memories[rank::ranks]
        kept = (sum(getattr(m, f) for m in mine) for f in ("params", "grads", "optimizer", "activations", "peak"))
        out.append(MemoryEstimate(*kept, transient=max(m.transient for m in mine),
                                  sharding_saved=sum(m.sharding_saved for m in mine),
                                  recompute_saved=sum(m.recompute_saved for m in mine)))
    return out


def worst_rank(ranks: list[MemoryEstimate]) -> MemoryEstimate:
    """The memory a pipelined plan reports: that of the rank with the largest kept peak (what
    the budget bounds), its transient raised where another rank's peak with transients is
    larger, so that :attr:`MemoryEstimate.peak_with_transient` is the largest of any rank."""
    worst = max(ranks, key=lambda m: m.peak)
    highest = max(m.peak_with_transient for m in ranks)
    return replace(worst, transient=highest - worst.peak)


def after_schedule(graph: TracedGraph, stages: list[StagePlan], params: dict[str, list[str]],
                    options: PlannerOptions, link: LinkSpec, collectives: list[PlannedCollective]
                    ) -> tuple[float, dict[str, float]]:
    """The collectives a pipelined step runs after its schedule, appended to ``collectives``,
    and their seconds (total and by kind): a parameter held by stages on several pipeline ranks
    (a tied weight) has its copies' gradients all-reduced among those ranks, once per step; the
    loss is broadcast from the last stage to every rank."""
    seconds: dict[str, float] = {}
    infos = {info.fqn: info for info in graph.nodes.values() if info.kind == "parameter" and info.fqn}
    for fqn, info in infos.items():
        owners = [i for i, st in enumerate(stages) if fqn in st.params]
        blocks = {stages[i].devices[0] for i in owners}
        if len(blocks) < 2 or not is_floating(info.dtype) or info.shape is None:
            continue
        spec = spec_from_json(params.get(fqn, ["R"] * len(stages[owners[0]].mesh)))
        nbytes = math.prod(local_shape(info.shape, spec, tuple(stages[owners[0]].mesh))) * info.itemsize
        seconds[ALL_REDUCE] = seconds.get(ALL_REDUCE, 0.0) + collective_time(ALL_REDUCE, nbytes, len(blocks), link)
        collectives.append(PlannedCollective(ALL_REDUCE, "backward", -1, nbytes, 1, copies_summed(fqn),
                                             "gradient", stages=owners))
    loss_bytes = 4.0  # the float32 scalar
    seconds[BROADCAST] = collective_time(BROADCAST, loss_bytes, options.devices, link)
    collectives.append(PlannedCollective(BROADCAST, "forward", -1, loss_bytes, 1, "loss -> every rank", "loss"))
    return sum(seconds.values()), seconds


def no_plan_fits(spec: ModelSpec, options: PlannerOptions) -> MemoryInfeasibleError:
    """The error when no pipeline fits: it states the least memory of a plan without one."""
    from autoplan.planner.api import plan_traced

    try:
        plan_traced(trace(spec), replace(options, mesh=None))
    except MemoryInfeasibleError as e:
        least = e.least_memory_bytes
    else:  # a single-stage plan fits, but not with the pinned pipeline choices
        return MemoryInfeasibleError(f"no pipeline with the pinned choices fits {format_bytes(options.memory_budget)} "
                                     f"per device: pin fewer stages or more microbatches, or give more memory", 0.0)
    return MemoryInfeasibleError(
        f"no plan fits {format_bytes(options.memory_budget)} per device, pipelines included: the least any plan "
        f"needs is more than that (without a pipeline {format_bytes(least)}); give more memory "
        f"(--memory-per-device) or more devices", least)
