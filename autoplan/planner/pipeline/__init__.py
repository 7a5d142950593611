"""The inter-op pass: pipeline stages, sub-meshes, microbatches and the schedule.

Layers. For every candidate microbatch count ``B`` the graph of one microbatch is cut into
layers (:mod:`autoplan.trace.layers`). Two microbatch sizes are traced, or written from a
trace of the first blocks of the model's repeated stack (:mod:`autoplan.trace.deepen`), and
the others rescaled from them (:mod:`autoplan.trace.rescale`: a trace takes seconds at real
size); the plan chosen below is made on a traced graph, so that what runs is what was
planned. For every sub-mesh shape ``(n, m)`` (a slice of a node or whole nodes) and every
logical mesh of it, each distinct layer is costed by the intra-op ILP once (layers with equal
ops and shapes share the answer).

Ranges (:class:`RangeTable`). A stage's cost is the sum of its layers' costs plus sending its
boundary activations (and receiving their gradients) over the link to the next stage, each
rank its shard of them (:func:`~autoplan.sharding.boundary_spec`: every mesh axis shards a
dim of the value; the next stage on the same logical mesh, as the stage DP assumes), or the
whole value where it is smaller than the link moves in one latency
(:func:`~autoplan.planner.pipeline.range_costs.whole_below`). A pipeline the DP finds with
stages on different logical meshes has each send costed again as the exact plan costs it, the
values crossing between the meshes whole (:func:`~autoplan.planner.pipeline.search.whole_sends`),
before candidates are compared:

- apart, every layer receives its inputs and hands its values on as they cross a stage
  boundary, as if one preceded and followed it; the
  ``REFINED`` best pipelines are searched again with each boundary inside a stage corrected
  by what planning the two layers that meet there together changes (the ILP of the pair, once
  per distinct pair; usually a saving, as the value may stay sharded). For a stage of two
  layers that is the stage's own ILP; in a longer one, boundaries interact through the layers
  between them, which the sum misses: over every range of Alpa's GPT-1.3B it is within 0.01%
  of the range's own ILP (``benchmarks/range_costs.py``), for three small latency-bound
  layers on H100s 16% above it;
- memory counts what a layer receives from another layer of the stage as the stage's ILP does
  (:meth:`RangeTable.counted_apart`);
- where the layers' fastest plans do not fit the budget together, they are trimmed together
  until they fit, each step freeing memory where it costs the least time per byte
  (:func:`autoplan.solvers.trim_memory_together`: a quick estimate); where not even the
  least-memory plans fit, the stage is absent;
- the budget bounds the step's peak, as the stage's ILP bounds it (its peak rows): the kept
  bytes plus the backward's transient, the largest of the range's layers' (each layer's fastest
  plan, kept or recomputed: :meth:`RangeTable.transient`). Trimming and recomputation get the
  budget less the transient (the largest it may become where layers are recomputed).

Activation checkpointing. Where a range's fastest plans do not fit, recomputing layers in the
backward is the other way to fit (:meth:`RangeTable.plan`): each layer's fastest plan is also
costed recomputed (:func:`~autoplan.planner.mesh_plan.recompute_change`: one forward more, its
redistributions again, only what it hands on kept; no second ILP; with the boundaries costed,
the seconds as the plan of the layer's pair with the one before runs it:
:meth:`LayerCosts.recompute_seconds`), and layers are recomputed one
by one, the one freeing the most bytes per second it adds first, until the range fits; this
where trimming alone does not fit (see :meth:`RangeTable.plan` for why it comes second). Where
recomputing every layer is not enough, the layers are trimmed as well, two ways, the faster
kept: their kept plans trimmed, counting on only a share ``1/n`` of the bytes recomputing frees
(``n`` the mesh's size: a trimmed plan keeps fewer activations); and their problems with the
recomputation in the costs trimmed (:meth:`LayerCosts.recomputed_problem`), from the fastest
plan's strategies and from the fastest with gathered storage's. The stage's exact ILP then
costs exactly those layers recomputed, and the program checkpoints them. A layer that writes
into a tensor (BatchNorm's running statistics) is never recomputed.

Stages. The stage DP (:func:`autoplan.solvers.inter_op.solve_inter_op`, Alpa's recurrence)
cuts the layers into stages that all get the same sub-mesh shape (torch's pipeline stages
pair rank i of one stage with rank i of the next), each stage on the logical mesh of that
shape where its layers run fastest within the budget. Stages holding a tied weight share one
logical mesh, so that its copies are stored alike; the DP runs once for each mesh they may
take. Interleaved schedules cut their chunks after the search, so their stages share one
logical mesh.

Gradient accumulation. One stage on all the devices with ``B > 1`` microbatches (the
microbatches run one after the other, one microbatch's activations alive) is searched only
where no one-stage plan of the whole batch fits without recomputing layers: it computes as much
and communicates at least as much, so it never beats the plain whole batch (recomputation it
may) (:func:`~autoplan.planner.pipeline.search.accumulation_tasks`).

Microbatch counts and schedules. The search tries the ``MICROBATCH_CANDIDATES`` largest counts
(the smallest bubbles) and 1, and for a pipeline of ``S`` stages also the fewest microbatches of
at least ``4·S`` (:func:`~autoplan.planner.pipeline.search.filling_counts`: larger microbatches
keep a stage's devices busy where small ones cannot be split among them). It searches 1F1B, or
the pinned schedule; where none is pinned, the ``INTERLEAVED_RIVALS`` best 1F1B pipelines on
one logical mesh are searched again under the interleaved 1F1B schedule
(:func:`~autoplan.planner.pipeline.search.interleaved_tasks`), a rank's layers counted as two
equal chunks (:func:`ranks_time`), and the exact plans settle between them.

Exact plans. The best (``B``, sub-mesh, stages and their logical meshes), and each other of
the ``REFINED`` best that the search puts within ``RERANK_MARGIN`` of it, is then planned
exactly: one intra-op ILP per stage over all its nodes, under the memory budget; the fastest
exact plan wins, and the others are listed as alternatives with their exact figures. They are
planned on the graphs the search found them on, written and rescaled ones included, and only
the winner's microbatch is traced, where it was not: where the trace is the graph it was planned on, its
plan stands, else it is searched and planned again on the trace and the fastest is checked in
turn (:func:`_winner_traced`; a trace of a real-size model takes seconds). (The
search's estimates run 1–9% above the exact plans, not by the same factor for every pipeline:
near ties are settled exactly.) Where an exact plan proves slower than other candidates'
estimates, or than ``SECOND_ROUND_MARGIN`` above it, up to ``SECOND_ROUND`` of those are
planned exactly too, best first: an estimate can also run low (a weight tied across stages is
stored as the first stage chose, which the layer costs do not know: GPT-2 124M's 4-stage
pipeline on 8 H100s, estimated 3.71 ms, planned at 5.33 ms, where one stage on 4x2 estimated
4.45 ms is planned at 4.2 ms), and the estimate of a whole batch recomputing every layer runs
high (Llama 3.1 8B's shape on 2 nodes of 8 H100s: HSDP on 2x8 with every layer recomputed,
estimated 2.27 s, is planned at 1.84 s, where 16 microbatches accumulated on the same mesh,
estimated 1.98 s, are planned at 2.04 s). One stage on all the devices is a candidate on each
of its logical meshes (:func:`~autoplan.planner.pipeline.search.search_submesh`). On 4 nodes the
whole batch's estimate runs further above its exact plan than that margin, so where the best
candidate accumulates microbatches on one stage, the best whole batch on one stage is planned
exactly beside it, within ``WHOLE_BATCH_MARGIN`` (:func:`_whole_batch_rival`). Under the
``auto`` recomputation policy each rival that recomputes layers is planned exactly a second
time with them recomputed by torchtitan's per-op policy, which the search does not estimate
(:func:`_per_op_rivals`).

Order of the exact work. The rivals' exact plans, and the likely second round (the
candidates within twice ``SECOND_ROUND_MARGIN`` of the best estimate), start at once in processes
side by side (:func:`_exact_pool`), while this process traces the likely winner's microbatch:
the search's best where it is the only rival, else the fastest exact plan of the rivals, whose
plan with its ties broken (:func:`_ties_broken`) then runs beside its trace. The answer is the
one the rounds give one after the other; only the order of the work changes (the 39B GPT on
64 H100s: the second of two traces and the winner's tie-break no longer wait for each other).

Stage latency (per microbatch) is the stage's per-step ILP objective divided by ``B``: compute
and activation traffic run once per microbatch, gradient reductions and the optimizer step
once per step (amortised). A stage receives its inputs as they cross the boundary (sharded; whole
from a stage on another logical mesh, which the exact plans cost) and sends their gradients back
alike; it hands on only what later stages read (and the loss). After the schedule, once per
step: the gradients of a weight held by stages on several pipeline ranks (a tied embedding)
are summed among them (all stages store it as the first chose), and the loss is broadcast to
every rank; both are added to the step time. Schedules (:data:`SCHEDULES`):

- ``gpipe``: step = Σ t_i + (B − 1)·max t_i; every stage keeps all ``B`` microbatches'
  activations;
- ``1f1b``: the same step time; a stage keeps at most ``min(B, S)`` microbatches' activations
  (stage ``s`` of torch's ``Schedule1F1B`` keeps ``min(B, S − s)``: every stage is counted as
  the first, more than later stages need, never less);
- ``interleaved1f1b``: ``v = 2`` chunks per pipeline rank; the bubble shrinks to
  ``(D − 1)·max t / v`` (``D`` ranks); torch's schedule keeps at most ``(v − 1)·D + 2(D − 1) + 1``
  chunk-forwards on a rank (its first rank's warm-up and one more), each chunk counted as keeping
  an equal share of them (at most ``B``), and a rank's chunks share its memory;
- ``interleavedzerobubble``: as interleaved, with the weight-gradient half of each backward
  scheduled into the bubble, which leaves about a third of it.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from functools import partial

from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Alternative, Plan
from autoplan.planner.mesh_plan import UnknownOpWarning
from autoplan.planner.options import PlannerOptions
from autoplan.planner.pipeline.assemble import assemble_pipeline, no_plan_fits
from autoplan.planner.pipeline.candidates import PipelineCandidate, PipelineOptions, candidate_name, interleave
from autoplan.planner.pipeline.exact import (RERANK_MARGIN, SECOND_ROUND, SECOND_ROUND_MARGIN, TRIMMED_MARGIN,
    WHOLE_BATCH_MARGIN, split_budget)
from autoplan.planner.pipeline.range_costs import LEAN, LayerCosts, RangeTable, layer_costs, tied_layers
from autoplan.planner.pipeline.schedules import (INTERLEAVED, SCHEDULES, Schedule, activations_in_flight,
    normalize_schedule, pipeline_time, ranks_time)
from autoplan.planner.pipeline.search import (REFINED, cluster_shape, on_traced_graph, search_pipelines,
    trace_microbatch, traced_twin)
from autoplan.planner.recompute import RecomputeMode, RecomputePolicy
from autoplan.planner.workers import TaskPool
from autoplan.solvers import format_seconds
from autoplan.trace.graph import TracedGraph
from autoplan.trace.microbatch import batch_size
from autoplan.trace.rescale import BatchSizeGraphs

__all__ = [
    "INTERLEAVED", "LEAN", "SCHEDULES", "LayerCosts", "PipelineCandidate", "PipelineOptions", "RangeTable",
    "Schedule", "activations_in_flight", "cluster_shape", "layer_costs", "normalize_schedule", "pipeline_time",
    "plan_pipeline", "ranks_time", "split_budget", "tied_layers", "trace_microbatch",
]


@contextlib.contextmanager
def _cyclic_gc_paused() -> Iterator[None]:
    """The search allocates millions of small objects (strategies, cost matrices, solver
    models) and leaves no reference cycles worth collecting while it runs; the cyclic
    collector's passes over them took about an eighth of the 39B case's planning time (memory
    peak with it paused: 514 MB against 465 MB). Cycles are collected when it resumes."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _warnings_once(plans: list[Plan]) -> Iterator[None]:
    """Each warning raised here, and each of the warnings of the plan appended to ``plans``, given
    once when the block ends: the exact plans run in other processes, whose warnings this
    process does not see (the plan keeps them), and rival plans of one graph warn alike."""
    recorded: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                yield
            finally:
                recorded = list(caught)
    finally:  # given where planning fails too
        given: set[tuple[type[Warning], str]] = set()
        found = [(w.category, str(w.message)) for w in recorded]
        found += [(UnknownOpWarning, message) for plan in plans for message in plan.warnings]
        for category, message in found:
            if (category, message) not in given:
                given.add((category, message))
                warnings.warn(message, category, stacklevel=4)


def plan_pipeline(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions = PipelineOptions()) -> Plan:
    """Search stages × sub-meshes × logical meshes × microbatches and plan the best pipeline."""
    return plan_pipeline_traced(spec, options, popts)[0]


def plan_pipeline_traced(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions = PipelineOptions()
                         ) -> tuple[Plan, TracedGraph, BatchSizeGraphs]:
    """:func:`plan_pipeline`, the trace of one microbatch the plan was planned on, and the
    graphs the search planned on, by microbatch size."""
    planned: list[Plan] = []  # its warnings given once the block ends
    with _warnings_once(planned), _cyclic_gc_paused():
        plan, graph, graphs = _plan_pipeline(spec, options, popts)
        planned.append(plan)
    return plan, graph, graphs


def _planned_exactly(spec: ModelSpec, candidate: PipelineCandidate, options: PlannerOptions
                     ) -> Plan | AutoplanError:
    """The exact plan of a pipeline the search found, under its schedule, or why it has none."""
    try:
        chosen = interleave(candidate) if candidate.schedule in INTERLEAVED else candidate
        return assemble_pipeline(spec, chosen, options, candidate.schedule, {})
    except AutoplanError as e:
        return e


def _trimmed_rival(candidates: list[PipelineCandidate], close: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """The best candidate that recomputes nothing, where every close one recomputes layers and
    it is within ``TRIMMED_MARGIN`` of the best: the search's estimate of a range trimmed to fit
    runs high, its estimate of recomputation does not (the Llama-70B shape: 8 stages on 4x2,
    72 layers recomputed, estimated 14.6 s and planned at 14.7 s; 4 stages on 2x8, trimmed,
    estimated 16.6 s and planned at 10.9 s), so the exact plans settle it."""
    if not close or not all(c.recomputed for c in close):
        return []
    plain = next((c for c in candidates if not c.recomputed), None)
    if plain is None or any(plain is c for c in close):
        return []
    if plain.step_time_s > close[0].step_time_s * (1 + TRIMMED_MARGIN):
        return []
    return [plain]


def _whole_batch_rival(candidates: list[PipelineCandidate], close: list[PipelineCandidate]
                       ) -> list[PipelineCandidate]:
    """The best candidate running the whole batch on one stage, where the best of all
    accumulates microbatches on one stage, none of ``close`` runs the whole batch, and it is
    within ``WHOLE_BATCH_MARGIN`` of the best. Accumulation is searched where the whole batch
    fits only by recomputing layers, and the search's estimate of a whole batch recomputing
    every layer runs high where accumulation's does not (Llama 3.1 8B's shape on 4 nodes of 8
    H100s: HSDP on 4x8, every layer recomputed, estimated 2.94 s and planned at 1.86 s; 16
    microbatches accumulated on the same mesh, estimated 2.53 s, planned at 2.13 s), so the
    exact plans settle it."""
    if not close or len(close[0].cuts) != 1 or close[0].microbatches == 1:
        return []
    if any(len(c.cuts) == 1 and c.microbatches == 1 for c in close):
        return []
    whole = next((c for c in candidates if len(c.cuts) == 1 and c.microbatches == 1), None)
    if whole is None or whole.step_time_s > close[0].step_time_s * (1 + WHOLE_BATCH_MARGIN):
        return []
    return [whole]


def _fully_recomputed_rival(close: list[PipelineCandidate]) -> list[PipelineCandidate]:
    """The best candidate with every layer it recomputes recomputed fully, where it recomputes
    some selectively. The search's estimate of selective recomputation beside a trimmed plan
    runs low where the exact plan must also trim what the selective layers keep (Llama 3.1 8B's
    blocks, four of them, on 8 H100s under 16.1 GB per device: every block selectively on 8
    devices estimated 0.19 s a step, and the fastest exact plan so 0.27 s, on 4x2; every block
    fully on 8 devices 0.25 s), so the exact plans settle it. The search keeps one answer per
    range, the fastest estimate, so the fully recomputed one is not among its candidates."""
    if not close or not close[0].selective:
        return []
    return [replace(close[0], selective=frozenset())]


def _per_op_rivals(close: list[PipelineCandidate], options: PlannerOptions) -> list[PipelineCandidate]:
    """Each of ``close`` that recomputes layers, with those the user did not pin recomputed by
    torchtitan's per-op policy instead (attention's outputs and every other matrix product's
    kept), where the policy is ``auto``. The search chooses, layer by layer, between full and
    selective recomputation; the per-op policy keeps less than selective and more than full, so
    where selective does not fit and full leaves memory unused it can be the fastest (Llama 3.1
    8B on 8 H100s of 96 GB, each op's dispatch costed: FSDP on 8 devices with every block
    recomputed fully, 2.12 s; torchtitan's recipe, the same per-op, 1.85 s). The exact plans
    settle it; one that does not fit is dropped."""
    if options.recompute != RecomputePolicy.AUTO:
        return []
    rivals: list[PipelineCandidate] = []
    for c in close:
        pinned = options.pins.checkpointed_layers(c.graph, c.layers) if options.pins else frozenset()
        lighter = c.recomputed - pinned
        if not lighter or any((r.cuts, r.meshes, r.microbatches, r.schedule, r.recomputed)
                              == (c.cuts, c.meshes, c.microbatches, c.schedule, c.recomputed) for r in rivals):
            continue
        rivals.append(replace(c, selective=lighter, lighter=RecomputeMode.PER_OP))
    return rivals


def _first_planned(spec: ModelSpec, candidates: list[PipelineCandidate], graphs: BatchSizeGraphs, batch: int,
                   options: PlannerOptions, popts: PipelineOptions) -> list[tuple[Plan, PipelineCandidate]]:
    """The first of ``candidates`` whose exact plan exists, with it (none: empty)."""
    for found in candidates:
        candidate = on_traced_graph(found, graphs, batch, options, popts)
        outcome = _planned_exactly(spec, candidate, options) if candidate is not None else None
        if isinstance(outcome, Plan):
            return [(outcome, candidate)]
    return []


def _exact_pool(spec: ModelSpec, candidates: list[PipelineCandidate], options: list[PlannerOptions]
                ) -> tuple[TaskPool[Plan | AutoplanError], list[int]]:
    """The exact plans of ``candidates`` (each under its own ``options``) started in processes
    side by side, every one at once, the largest first (this process traces meanwhile and
    cannot start one as another ends, so the system shares the cores; with one job, each runs
    here as it is started); the pool and each candidate's index in it."""
    jobs = options[0].jobs if candidates else 1
    pool: TaskPool[Plan | AutoplanError] = TaskPool(max(jobs, len(candidates)) if jobs > 1 else 1)
    index = [0] * len(candidates)
    for i in sorted(range(len(candidates)), key=lambda i: -_stage_work(candidates[i])):
        index[i] = pool.submit(partial(_planned_exactly, spec, candidates[i], options[i]))
    return pool, index


def _planned_side_by_side(spec: ModelSpec, candidates: list[PipelineCandidate], options: PlannerOptions
                          ) -> list[Plan | AutoplanError]:
    """The exact plans of ``candidates``, in processes side by side (:func:`_exact_pool`)."""
    pool, index = _exact_pool(spec, candidates, [options] * len(candidates))
    return [pool.answer(k) for k in index]


def _ties_broken(spec: ModelSpec, candidate: PipelineCandidate, as_asked: set[int], options: PlannerOptions
                 ) -> TaskPool[Plan | AutoplanError] | None:
    """``candidate``'s plan with its ties broken (``options``' tie-break) started in a process,
    where it was planned exactly without: compared by its optimum beside rivals, it is planned
    again if it wins, and that can run beside its trace. None with one job, or where it needs
    none."""
    if id(candidate) in as_asked or options.jobs < 2:
        return None
    pool: TaskPool[Plan | AutoplanError] = TaskPool(options.jobs)
    pool.submit(partial(_planned_exactly, spec, candidate, options))
    return pool


def _stage_work(candidate: PipelineCandidate) -> int:
    """An estimate of the work of a candidate's exact plan, by which the largest are started
    first (so that the last to finish is a small one): its distinct stages' ILP sizes, an op
    having a few sharding choices per mesh axis and an edge the square of its ends' choices,
    so ``nodes * 16 ** axes`` per stage (the Llama-70B shape: seconds for a pipeline of 2-D
    meshes, which the search's order started last, a second or two for one of 1-D meshes)."""
    distinct = {(tuple(layer.signature for layer in candidate.layers[start:end]), start == 0,
                 end == len(candidate.layers), mesh): sum(len(layer.nodes) for layer in candidate.layers[start:end])
                for (start, end), mesh in zip(candidate.cuts, candidate.meshes)}
    return sum(nodes * 16 ** len(key[-1]) for key, nodes in distinct.items())


def _likely_winner_traced(candidate: PipelineCandidate, graphs: BatchSizeGraphs, batch: int) -> None:
    """Trace the microbatch of ``candidate``, the likely winner (the search's best, or the
    fastest exact plan of the rivals), where the search found it on a graph it wrote or
    rescaled: the winner is planned on a trace (:func:`_winner_traced`), so its trace runs
    while other exact work does (the 39B GPT: 9.3–9.5 s instead of 9.6–11.0 s to plan)."""
    if not graphs.is_traced(candidate.graph):
        try:
            graphs.trace(batch // candidate.microbatches)
        except AutoplanError:  # traced again, and the error given, if it wins
            pass


def _winner_traced(spec: ModelSpec, planned: list[tuple[Plan, PipelineCandidate]], as_asked: set[int],
                   graphs: BatchSizeGraphs, batch: int, options: PlannerOptions, popts: PipelineOptions,
                   moved: dict[int, int] | None = None) -> list[tuple[Plan, PipelineCandidate]]:
    """``planned`` with the fastest on a traced graph. Rivals are planned exactly on the graphs
    the search found them on, rescaled ones included, and only the fastest is traced (a trace
    of a real-size model takes seconds): where the trace is its graph, its plan stands; else
    it is searched and planned again on the trace, and the fastest of all is checked in
    turn. ``as_asked`` follows a candidate moved onto its trace, and ``moved`` records the
    moves (the moved candidate's id -> the id of the one it was found as)."""
    planned = list(planned)
    while planned:
        fastest = min(range(len(planned)), key=lambda i: planned[i][0].predicted.step_time_s)
        plan, best = planned[fastest]
        if graphs.is_traced(best.graph):
            return planned
        del planned[fastest]
        twin = traced_twin(best, graphs, batch, options, popts)
        if twin is not None:
            if id(best) in as_asked:
                as_asked.add(id(twin))
            if moved is not None:
                moved[id(twin)] = moved.get(id(best), id(best))
            planned.append((plan, twin))
            continue
        again = on_traced_graph(best, graphs, batch, options, popts)
        outcome = _planned_exactly(spec, again, replace(options, canonical=False)) \
            if again is not None else None
        if isinstance(outcome, Plan):
            planned.append((outcome, again))
    return planned


def _rival_options(options: PlannerOptions, rivals: int) -> PlannerOptions:
    """How ``rivals`` exact plans planned side by side break their ties: canonically, as the
    winner's must be, where they all run at once (each pays the tie-break in its own process,
    beside the others); else compared by their optima, and the winner planned again with its
    ties broken (one tie-break after them, not one per rival in turn)."""
    return options if rivals <= max(1, options.jobs) else replace(options, canonical=False)


def _plan_pipeline(spec: ModelSpec, options: PlannerOptions, popts: PipelineOptions
                   ) -> tuple[Plan, TracedGraph, BatchSizeGraphs]:
    if popts.schedule is not None:
        popts = replace(popts, schedule=normalize_schedule(popts.schedule))
    start = time.perf_counter()
    candidates, graphs = search_pipelines(spec, options, popts)
    if not candidates:
        raise no_plan_fits(spec, options)
    search_s = time.perf_counter() - start - graphs.trace_s
    close = [c for c in candidates[:REFINED] if c.step_time_s <= candidates[0].step_time_s * (1 + RERANK_MARGIN)]
    for rival in _trimmed_rival(candidates, close) + _whole_batch_rival(candidates, close):
        if all(rival is not c for c in close):
            close.append(rival)
    fully = _fully_recomputed_rival(close)  # not estimated by the search: its own line among the alternatives
    close += fully
    per_op = _per_op_rivals(close, options)  # not estimated by the search either
    close += per_op
    searched = [id(c) for c in close]
    batch = batch_size(spec.example_inputs)
    first = _rival_options(options, len(close))
    as_asked = {id(c) for c in close} if first is options else set()  # planned with the options' tie-break
    compared = replace(options, canonical=False)
    # the likely second round (candidates estimated within twice SECOND_ROUND_MARGIN of the
    # best estimate: an exact plan may come out above its estimate) is planned beside the
    # first, while the likely winner's microbatch is traced: the search's best where it is
    # alone, else the fastest exact plan of the first round
    likely = [c for c in candidates if id(c) not in searched
              and c.step_time_s < close[0].step_time_s * (1 + 2 * SECOND_ROUND_MARGIN)][:SECOND_ROUND]
    pool, index = _exact_pool(spec, close + likely, [first] * len(close) + [compared] * len(likely))
    if len(close) == 1:
        _likely_winner_traced(close[0], graphs, batch)
    outcomes = [pool.answer(k) for k in index[:len(close)]]
    planned = [(p, c) for p, c in zip(outcomes, close) if isinstance(p, Plan)]
    leader, tie_break = None, None
    if len(close) > 1 and planned:
        _, leader = min(planned, key=lambda pc: pc[0].predicted.step_time_s)
        tie_break = _ties_broken(spec, leader, as_asked, options)
        _likely_winner_traced(leader, graphs, batch)
    ahead = {id(c): pool.answer(k) for c, k in zip(likely, index[len(close):])}
    if planned:  # estimated about as fast as the fastest exact plan, or faster: planned exactly too
        fastest = min(p.predicted.step_time_s for p, _ in planned)
        under = [c for c in candidates if id(c) not in searched
                 and c.step_time_s < fastest * (1 + SECOND_ROUND_MARGIN)][:SECOND_ROUND]
        searched += [id(c) for c in under]
        later = [c for c in under if id(c) not in ahead]
        ahead.update(zip(map(id, later), _planned_side_by_side(spec, later, compared)))
        planned += [(ahead[id(c)], c) for c in under if isinstance(ahead[id(c)], Plan)]
    if not planned:  # the search's estimates fit, the exact plans do not: the next best that does
        planned = _first_planned(spec, [c for c in candidates if id(c) not in searched], graphs, batch, options,
                                 popts)
        as_asked |= {id(c) for _, c in planned}
    if not planned:
        raise next(e for e in outcomes if isinstance(e, AutoplanError))
    _, fastest = min(planned, key=lambda pc: pc[0].predicted.step_time_s)
    if fastest is not leader:  # its ties broken beside its trace instead
        if tie_break is not None:
            tie_break.cancel()
        leader, tie_break = fastest, _ties_broken(spec, fastest, as_asked, options)
    moved: dict[int, int] = {}
    planned = _winner_traced(spec, planned, as_asked, graphs, batch, options, popts, moved)
    if not planned:
        raise no_plan_fits(spec, options)
    plan, best = min(planned, key=lambda pc: pc[0].predicted.step_time_s)
    broken = None
    if tie_break is not None:
        if moved.get(id(best), id(best)) == id(leader):
            try:
                broken = tie_break.results()[0]
            except (AutoplanError, RuntimeError):  # planned again below, where the error shows
                pass
        tie_break.cancel()
    if id(best) not in as_asked:  # a rival compared by its optimum: its ties broken now
        if isinstance(broken, Plan):  # (on the graph it was found on, equal to its trace)
            plan = broken
        else:
            chosen = interleave(best) if best.schedule in INTERLEAVED else best
            plan = assemble_pipeline(spec, chosen, options, best.schedule, {})
    total_s = time.perf_counter() - start
    trace_s = graphs.trace_s
    plan.timings_s = {"trace": trace_s, "search": search_s, "exact": total_s - trace_s - search_s, "total": total_s}
    plan.alternatives = [Alternative(candidate_name(c), [len(c.cuts), *c.meshes[0]], p.predicted,
                                     "the best candidate with its layers recomputed fully; planned exactly"
                                     if any(c is f for f in fully) else
                                     "a candidate with its recomputed layers by the per-op policy; planned exactly"
                                     if any(c is r for r in per_op) else
                                     f"{format_seconds(c.step_time_s)} per step in the stage search; planned exactly")
                         for p, c in planned if c is not best]
    plan.alternatives += [Alternative(candidate_name(c), [len(c.cuts), *c.meshes[0]], None,
                                      f"{format_seconds(c.step_time_s)} per step in the stage search",
                                      estimate_s=c.step_time_s)
                          for c in [c for c in candidates if id(c) not in searched][:max(0, 6 - len(planned))]]
    return plan, best.graph, graphs
