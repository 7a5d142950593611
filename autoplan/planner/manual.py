"""Hand-written plans, costed under the same model as the found one (``--manual``).

``dp=2,fsdp=4,tp=4,pp=2,microbatches=64[,schedule=1f1b]`` is a Megatron-LM / torchtitan style
plan: ``pp`` stages of equal layer counts (``pp`` pipeline ranks of two stages each under the
interleaved schedules, as torchtitan's), each on a ``dp × fsdp × tp`` mesh (axes of degree 1
left out); over the ``dp`` axis every parameter is replicated and the batch sharded (data
parallelism); over the ``fsdp`` axis the batch is sharded too and every parameter stored
sharded, gathered at use (FSDP / ZeRO-3; ``dp`` and ``fsdp`` together are HSDP: the batch split
over both axes, each parameter replicated over ``dp`` and sharded over ``fsdp``; under a pipeline
with several microbatches gathered once per step and held through them, as torchtitan runs
FSDP2 under pipelining); over the ``tp`` axis every weight matrix is sharded and used in place,
as a column or a row of a Megatron pair (:func:`manual_rule`). ``zero=1`` shards each trained
parameter's optimizer state over the ``dp`` axis, ``zero=2`` its reduced gradient too (ZeRO-1/2).
Within those rules the intra-op ILP picks the rest. The result is recorded as an alternative
with its predicted figures, or why it is infeasible.
"""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.load import ModelSpec
from autoplan.plan_schema import PRECISIONS, Alternative, Plan
from autoplan.planner.api import PlannerOptions
from autoplan.planner.mesh_plan import StorageRule
from autoplan.planner.recompute import RecomputeMode, RecomputePolicy, every_layer, policy_mode, recomputable
from autoplan.planner.pipeline.candidates import interleave
from autoplan.planner.pipeline.schedules import INTERLEAVED
from autoplan.planner.pipeline import (
    PipelineCandidate,
    PipelineOptions,
    assemble_pipeline,
    cluster_shape,
    normalize_schedule,
    trace_microbatch,
)
from autoplan.sharding import Placement, ShardingSpec
from autoplan.strategies.candidates import Strategy
from autoplan.solvers.inter_op import SubMesh
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import find_classes

_KEYS = ("dp", "fsdp", "tp", "pp", "microbatches", "schedule", "ac", "precision", "zero")
_CHECKPOINTING = ("full", "selective", "op", "none")  # ac=: every layer recomputed in the backward so, or none
_AC_POLICIES = {"full": RecomputePolicy.ALL, "selective": RecomputePolicy.SELECTIVE, "op": RecomputePolicy.PER_OP}


@dataclass(frozen=True, kw_only=True)
class ManualPlan:
    """A Megatron-LM style plan as ``--manual`` writes it: degrees of data (replicated and
    sharded), tensor and pipeline parallelism, microbatches, the schedule and activation
    checkpointing (``ac``)."""

    schedule: str = "1f1b"
    dp: int = 1
    fsdp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    ac: str = "none"
    precision: str | None = None  # fp32 or bf16; None: the run's own
    zero: int = 0  # over the dp axis: 1 shards the optimizer state, 2 the reduced gradients too

    def options(self, options: PlannerOptions) -> PlannerOptions:
        """``options`` with this plan's precision and checkpointing, where it names them."""
        if self.ac in _AC_POLICIES:
            options = replace(options, recompute=_AC_POLICIES[self.ac])
        if self.precision is None:
            return options
        return replace(options, optimizer=replace(options.optimizer, mixed_precision=self.precision != "fp32"))

    @property
    def label(self) -> str:
        checkpointing = f",ac={self.ac}" if self.ac != "none" else ""
        sharded = f",fsdp={self.fsdp}" if self.fsdp > 1 else ""
        precision = f",precision={self.precision}" if self.precision else ""
        zero = f",zero={self.zero}" if self.zero else ""
        return (f"manual dp={self.dp}{sharded},tp={self.tp},pp={self.pp},microbatches={self.microbatches}"
                f"{zero}{checkpointing}{precision}")

    @property
    def mesh(self) -> tuple[int, ...]:
        """The logical mesh of each stage: the degrees above 1 of ``(dp, fsdp, tp)``."""
        return tuple(x for x in (self.dp, self.fsdp, self.tp) if x > 1) or (1,)

    def axis(self, degree: str) -> int | None:
        """The mesh axis of ``"dp"``, ``"fsdp"`` or ``"tp"`` (None where its degree is 1)."""
        present = [name for name in ("dp", "fsdp", "tp") if getattr(self, name) > 1]
        return present.index(degree) if degree in present else None


def parse_manual(text: str) -> ManualPlan:
    """``dp=2,fsdp=2,tp=4,pp=2,microbatches=64,ac=full,precision=bf16`` (any subset; the rest
    default to 1, 1f1b, no checkpointing and the run's precision)."""
    values: dict[str, object] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(\w+)", item)
        if not m or m.group(1) not in _KEYS:
            raise AutoplanError(f"cannot read --manual {text!r}: write it like dp=2,tp=4,pp=2,microbatches=64")
        key, value = m.group(1), m.group(2)
        if key == "schedule":
            values[key] = normalize_schedule(value)
        elif key == "precision":
            if value.lower() not in PRECISIONS:
                raise AutoplanError(f"--manual precision={value}: use one of {', '.join(PRECISIONS)}")
            values[key] = value.lower()
        elif key == "ac":
            if value.lower() not in _CHECKPOINTING:
                raise AutoplanError(f"--manual ac={value}: use ac=full (every layer recomputed), ac=selective "
                                    "(every layer recomputed but its matrix products and attention), ac=op "
                                    "(torchtitan's per-op policy: but its attention and every other matrix "
                                    "product) or ac=none")
            values[key] = value.lower()
        elif key == "zero":
            if value not in ("1", "2"):
                raise AutoplanError(f"--manual zero={value}: use zero=1 (optimizer state sharded over dp) or zero=2 "
                                    f"(gradients too); zero=3 is fsdp=")
            values[key] = int(value)
        elif not value.isdigit() or int(value) < 1:
            raise AutoplanError(f"--manual {key}={value}: must be a positive integer")
        else:
            values[key] = int(value)
    manual = ManualPlan(**values)  # type: ignore[arg-type]
    if manual.zero and manual.dp < 2:
        raise AutoplanError(f"--manual zero={manual.zero} shards over the dp axis: give dp=2 or more")
    if manual.pp > 1 and manual.microbatches < manual.pp and manual.schedule != "gpipe":
        raise AutoplanError(f"--manual pp={manual.pp} with microbatches={manual.microbatches}: torch's "
                            f"{manual.schedule} schedule needs at least one microbatch per stage; give "
                            f"microbatches={manual.pp} or more, or schedule=gpipe")
    return manual


def _batch(graph: TracedGraph) -> int | None:
    """The batch the graph was traced with: dim 0 of its first user input (None: none has dims)."""
    inputs = [graph.nodes[name] for name in graph.input_names if graph.nodes[name].shape]
    return inputs[0].shape[0] if inputs else None


def _computed_whole(graph: TracedGraph) -> frozenset[str]:
    """Op outputs every rank of a data-parallel program computes whole: those no user input
    flows into (:attr:`~autoplan.trace.graph.TracedGraph.input_free_values`), but for those
    made in the batch's shape (OPT's attention mask of ones, ``[B, T]``, and its positions):
    a rank makes them for its own samples."""
    batch = _batch(graph)
    return frozenset(name for name in graph.input_free_values
                     if (info := graph.nodes.get(name)) is not None and info.kind in ("op", "activation")
                     and not (info.shape and info.shape[0] == batch))


def _batched_values(graph: TracedGraph) -> frozenset[str]:
    """Op outputs that carry the batch: those computed from a user input (transitively) whose
    dim 0 is a multiple of the batch (``[B, T, C]``, and ``[B·T, V]`` after a view)."""
    batch = _batch(graph)
    if batch is None:
        return frozenset()
    from_input: set[str] = set(graph.input_names)
    for node in graph.graph_module.graph.nodes:
        if node.op == "call_function" and any(i.name in from_input for i in node.all_input_nodes):
            from_input.add(node.name)
    return frozenset(name for name in from_input
                     if (info := graph.nodes.get(name)) is not None and info.shape and info.shape[0] % batch == 0)


def _tensor_parallel_weights(graph: TracedGraph, tp: int) -> frozenset[str]:
    """FQNs of the weight matrices (≥ 2 dims) that ``tp`` divides along some dim."""
    return frozenset(info.fqn for info in graph.nodes.values()
                     if info.kind == "parameter" and info.fqn and info.shape and len(info.shape) >= 2
                     and any(d % tp == 0 for d in info.shape))


def manual_rule(graph: TracedGraph, manual: ManualPlan) -> StorageRule | None:
    """What the labels of a manual plan promise, as a rule on placements (None: no rule).

    Data parallelism over the ``dp`` axis: parameters are replicated there, and user inputs
    and every value that carries the batch are ``S(0)``, so each device computes ``1/dp`` of
    the batch and the gradients are all-reduced (without the rule the ILP keeps a small model
    replicated and calls it data parallel). Over ``dp`` and ``fsdp`` alike, an op's value into
    which no user input flows (a learned position table's rows for positions ``0..T-1``,
    rotary tables), unless made in the batch's shape, is whole: every rank computes it, as DDP
    and FSDP2 run the model (without the rule the ILP may look up GPT-2's position rows in a
    column-sharded table and gather them, which no data-parallel program does).

    Sharded data parallelism over the ``fsdp`` axis: the batch as over ``dp``, and every
    parameter that ``fsdp`` divides along some dim is stored sharded there; its consumers,
    which compute on a slice of the batch, gather it before use and reduce-scatter its
    gradient (FSDP / ZeRO-3). Under a pipeline with several microbatches the parameter is
    gathered once per step and held through its microbatches, its gradient reduce-scattered
    once, after the last (:attr:`~autoplan.plan_schema.ParamStorage.held`): torchtitan's FSDP2
    under ``torch.distributed.pipelining``, with ``reshard_after_forward=False``.

    Megatron tensor parallelism over the ``tp`` axis: every weight matrix that ``tp`` divides
    is stored sharded, and every op that reads one computes with its shard in place: its output
    is ``S(last dim)`` (a column-parallel ``Y = X·Aᵢ``, ``A`` split by output features) or
    ``Partial`` (a row-parallel ``Y = Σᵢ Xᵢ·Bᵢ``, ``B`` split by input features; the sum is an
    all-reduce). A weight gathered whole before use (ZeRO-3 style) is excluded. Which weights
    are columns and which rows is the ILP's choice; a column feeding a row needs no collective
    between them, so pairs come out as Megatron's, with one all-reduce per pair in the forward
    (after the row) and one in the backward (the gradient of the column's input).

    Over ``dp`` and ``fsdp`` an op also reads every value that carries the batch ``S(0)``, as
    each rank of DDP and FSDP2 runs the model on its own samples: a loss over the batch reduces
    its ranks' shares (a token mean's count all-reduced beside its sum) rather than gathering
    the logits and targets (on a small model the ILP may find the gather cheaper; a data-parallel
    program does not run it). An op no strategy of which reads them so (a contrastive loss's
    ``[B, B]`` logits of two batches) keeps its strategies: every one is exact.

    Over ``tp`` the ranks share their samples, as torchtitan's tensor parallelism runs (the
    styles of :mod:`autoplan.codegen.native_fsdp_tp`, which then run the plan):

    - no value that carries the batch is stored, produced or read split by samples (``S(0)``)
      there, and user inputs are whole: a rank splits weights, features, heads or the sequence
      (without this the ILP split Llama-70B's head and loss by samples over ``tp`` too);
    - what ``tp`` does not split is whole there: the parameters of norms, stored and read (as
      ``SequenceParallel`` holds them; read sliced, their gradients were gathered), and buffers;
    - only ops reading a split weight make partial sums there (:func:`tensor_parallel_allows`):
      a norm's statistics are never split by features;
    - a row linear reads what a column region made, never a norm's output sliced by features
      (without this the ILP computed grouped-query attention's narrow key and value projections
      as rows over the sliced norm and reduce-scattered their outputs, which no style runs);
    - inside a module holding parameters ``tp`` does not split (a norm) every value is read
      there as it is given (:class:`AsGiven`, a rule on the ILP's edges): the module runs whole
      or as ``SequenceParallel``, on its sequence shard throughout. Without this the ILP
      computed the last norm of a Llama over the whole sequence and multiplied a slice of it by
      its weight, or gathered a sequence-parallel norm's output before that product; no style
      does either.
    """
    dp_axis, fsdp_axis, tp_axis = manual.axis("dp"), manual.axis("fsdp"), manual.axis("tp")
    held = fsdp_axis is not None and manual.pp > 1 and manual.microbatches > 1
    if dp_axis is None and fsdp_axis is None and tp_axis is None:
        return None
    batch_axes = [axis for axis in (dp_axis, fsdp_axis) if axis is not None]
    batched = _batched_values(graph)
    whole = _computed_whole(graph) if batch_axes else frozenset()
    sharded_weights = _tensor_parallel_weights(graph, manual.tp) if tp_axis is not None else frozenset()

    def carries_batch(info: NodeInfo) -> bool:
        return bool((info.kind == "input" and info.shape) or info.name in batched)

    def on_own_samples(spec: ShardingSpec) -> bool:
        split = all(spec[axis].is_shard and spec[axis].dim == 0 for axis in batch_axes)
        return split and (tp_axis is None or not (spec[tp_axis].is_shard and spec[tp_axis].dim == 0))

    def tensor_parallel_read(info: NodeInfo, placement: Placement, split_weight: bool) -> bool:
        if info.kind == "parameter" and not split_weight:
            return placement.is_replicate  # a norm's weight
        made_with_whole_weight = info.kind == "op" and bool(set(info.params) - sharded_weights)
        feature_slice = bool(info.shape) and placement.is_shard and placement.dim == len(info.shape) - 1
        return not (split_weight and made_with_whole_weight and feature_slice)  # a row over a norm's output

    def reads_as_promised(inputs: list[NodeInfo], strategy: Strategy) -> bool:
        split_weight = any(info.kind == "parameter" and info.fqn in sharded_weights for info in inputs)
        return all((not carries_batch(info) or on_own_samples(spec))
                   and (tp_axis is None or tensor_parallel_read(info, spec[tp_axis], split_weight))
                   for info, spec in zip(inputs, strategy.input_specs) if spec is not None)

    def allow(info: NodeInfo, spec: ShardingSpec) -> bool:
        if carries_batch(info) and not on_own_samples(spec):
            return False
        if tp_axis is not None and info.kind in ("input", "parameter", "buffer") and info.fqn not in sharded_weights \
                and not spec[tp_axis].is_replicate:
            return False  # an input, a norm's weight, a buffer: whole over tp (FSDP shards over fsdp alone)
        if info.name in whole and not all(spec[axis].is_replicate for axis in batch_axes):
            return False
        if dp_axis is not None and info.kind in ("parameter", "buffer", "constant") \
                and not spec[dp_axis].is_replicate:
            return False
        if fsdp_axis is not None:
            if info.kind in ("buffer", "constant") and not spec[fsdp_axis].is_replicate:
                return False
            divisible = info.kind == "parameter" and any(d % manual.fsdp == 0 for d in info.shape or ())
            if divisible and not (spec[fsdp_axis].is_replicate if held else spec[fsdp_axis].is_shard):
                return False  # held: read whole there, stored as the held variant's shard
        return tp_axis is None or tensor_parallel_allows(info, spec[tp_axis], sharded_weights)

    return StorageRule(allow, ZeroStage(manual.zero, dp_axis, fsdp_axis if held else None),
                       dims_over_axes=len(batch_axes) > 1, reads=reads_as_promised,
                       reshards=TensorParallelReshards(tp_axis, _whole_modules(graph, sharded_weights))
                       if tp_axis is not None else None)


def tensor_parallel_allows(info: NodeInfo, placement: Placement, sharded_weights: frozenset[str]) -> bool:
    """Megatron tensor parallelism on one mesh axis (see :func:`manual_rule`): a weight of
    ``sharded_weights`` is stored sharded there, and an op reading one produces a column
    (``S(last dim)``) or partial sums (a row); no other op makes partial sums there (a norm's
    statistics or a loss over features split by tensor parallelism, which no
    ``parallelize_module`` style computes: its input is read whole, or split on another dim)."""
    if info.kind == "parameter" and info.fqn in sharded_weights and not placement.is_shard:
        return False
    if info.kind == "op" and info.shape is not None:
        if sharded_weights.intersection(info.params):
            column = bool(info.shape) and placement.is_shard and placement.dim == len(info.shape) - 1
            return column or placement.is_partial
        return not placement.is_partial
    return True


@dataclass(frozen=True)
class AsGiven:
    """Over mesh axis ``axis`` a value is read as it is given (no resharding there)."""

    axis: int

    def __call__(self, given: ShardingSpec, read: ShardingSpec) -> bool:
        return given[self.axis] == read[self.axis]


@dataclass(frozen=True)
class TensorParallelReshards:
    """The reshardings ``tp`` (mesh axis ``axis``) allows (:func:`manual_rule`, a rule of
    :attr:`~autoplan.planner.mesh_plan.StorageRule.reshards`): none between two ops of one of
    ``whole_modules`` (the modules holding parameters ``tp`` does not split: norms)."""

    axis: int
    whole_modules: frozenset[str]

    def __call__(self, producer: NodeInfo, reader: NodeInfo) -> AsGiven | None:
        inside = producer.kind == "op" and producer.module == reader.module and reader.module in self.whole_modules
        return AsGiven(self.axis) if inside else None


def _whole_modules(graph: TracedGraph, sharded_weights: frozenset[str]) -> frozenset[str]:
    """The modules holding a parameter and none of ``sharded_weights`` (norms)."""
    split = {fqn.rpartition(".")[0] for fqn in sharded_weights}
    owners = {fqn.rpartition(".")[0] for fqn in graph.parameter_fqns}
    return frozenset(module for module in owners if module and module not in split)


@dataclass(frozen=True)
class LastAxisTensorParallel:
    """:func:`tensor_parallel_allows` on the last mesh axis, as a rule on placements (a plain
    object, so that the options holding it pickle)."""

    sharded_weights: frozenset[str]

    def __call__(self, info: NodeInfo, spec: ShardingSpec) -> bool:
        return tensor_parallel_allows(info, spec[-1], self.sharded_weights)


def tensor_parallel_rule(graph: TracedGraph, tp: int) -> StorageRule:
    """The ``tp=N`` pin: Megatron tensor parallelism over the last mesh axis (of ``N``
    devices: :meth:`~autoplan.planner.pins.PinSet.mesh_allowed` keeps such meshes)."""
    return StorageRule(LastAxisTensorParallel(_tensor_parallel_weights(graph, tp)))


@dataclass(frozen=True)
class ZeroStage:
    """The sharded state a manual plan requires: ``zero(strategy)`` accepts the ZeRO strategy
    that shards the optimizer state (and, for ``zero=2``, the gradient) over the ``dp`` axis,
    and with ``held_axis`` (``fsdp=`` under a pipeline) the held strategy sharded over that
    axis (a parameter shards its state over one axis: where both are accepted the ILP picks);
    with neither it accepts none (plain storage)."""

    zero: int = 0
    dp_axis: int | None = None
    held_axis: int | None = None

    def __call__(self, strategy: Strategy) -> bool:
        state = strategy.state_spec
        if strategy.held or state is None:
            return strategy.held and self.held_axis is not None and state[self.held_axis].is_shard
        if not self.zero or self.dp_axis is None or not state[self.dp_axis].is_shard:
            return False
        return (strategy.grad_spec is not None) == (self.zero == 2)


def manual_layer_count(spec: ModelSpec) -> int:
    """How many layers :func:`plan_manual` cuts the model into (the most stages ``pp`` may be)."""
    graph = trace_microbatch(spec, 1)
    return len(make_layers(graph, find_classes(graph), None))


def plan_manual(spec: ModelSpec, options: PlannerOptions, manual: ManualPlan, graph: TracedGraph | None = None
                ) -> Plan:
    """The manual plan as a runnable :class:`Plan` (raises a one-line error if it cannot be);
    ``graph``: the trace of one microbatch, where the caller has it."""
    size = manual.dp * manual.fsdp * manual.tp
    if size * manual.pp != options.devices:
        raise AutoplanError(f"dp·fsdp·tp·pp = {size * manual.pp} but there are {options.devices} devices")
    mesh = manual.mesh
    graph = graph or trace_microbatch(spec, manual.microbatches)
    opts = replace(manual.options(options), mesh=mesh, allow_storage=manual_rule(graph, manual))
    layers = make_layers(graph, find_classes(graph), None)
    if manual.pp > len(layers):
        cut = ", ".join(layer.name for layer in layers)
        raise AutoplanError(f"pp={manual.pp} needs at least {manual.pp} layers and the model cuts into {len(layers)} "
                            f"({cut}): choose pp={len(layers)} or fewer")
    bounds = [round(i * len(layers) / manual.pp) for i in range(manual.pp + 1)]
    _, per_node = cluster_shape(options)
    submesh = SubMesh(max(1, size // per_node), min(size, per_node))
    # opts' policy is the plan's ac= where it names one, else the run's
    recomputed = recomputable(graph, layers) if every_layer(opts.recompute) else frozenset()
    selective = recomputed if policy_mode(opts.recompute) != RecomputeMode.FULL else frozenset()
    candidate = PipelineCandidate(manual.microbatches, submesh, [mesh] * manual.pp, list(itertools.pairwise(bounds)),
                                  math.inf, graph, layers, recomputed=recomputed, selective=selective)
    if manual.schedule in INTERLEAVED:  # pp ranks of INTERLEAVE stages each, as the search builds them
        candidate = interleave(candidate)
    return assemble_pipeline(spec, candidate, opts, manual.schedule, {})


def cost_manual(spec: ModelSpec, options: PlannerOptions, manual: ManualPlan) -> Alternative:
    """The manual plan's predicted figures, or why it cannot run (costed only: its ties need
    no canonical break)."""
    try:
        plan = plan_manual(spec, replace(options, canonical=False), manual)
    except (AutoplanError, MemoryInfeasibleError) as e:
        return Alternative(manual.label, [manual.pp, manual.dp * manual.fsdp, manual.tp], None, f"infeasible: {e}")
    return Alternative(manual.label, [manual.pp, manual.dp * manual.fsdp, manual.tp], plan.predicted)


def manual_pipeline_options(manual: ManualPlan) -> PipelineOptions:
    return PipelineOptions(stages=manual.pp, microbatches=manual.microbatches, schedule=manual.schedule)
