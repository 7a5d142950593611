"""The plan: the single object every later stage reads. A dataclass with a versioned JSON
round trip, tied to the traced graph by its hash."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from autoplan.cost_models.communication import CollectiveKind
from autoplan.errors import AutoplanError

PLAN_FORMAT = "autoplan.plan/3"


class Phase(StrEnum):
    """When in a training step a collective runs."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


PHASES: tuple[Phase, ...] = tuple(Phase)
OPTIMIZER_NAMES = ("adamw", "adam", "sgd", "sgd-momentum")
PRECISIONS = {  # name -> (parameter, compute, gradient-reduction) dtypes
    "fp32": ("float32", "float32", "float32"),
    "bf16": ("bfloat16", "bfloat16", "float32"),
}


@dataclass
class OptimizerPlan:
    """The optimizer the program steps with, and its hyper-parameters (torch's defaults where
    the user gave none; ``momentum`` is read by ``sgd-momentum`` only, ``betas``/``eps`` by
    Adam and AdamW)."""

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.01
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    momentum: float = 0.0

    def __post_init__(self) -> None:
        self.name = str(self.name).strip().lower()
        if self.name not in OPTIMIZER_NAMES:
            raise AutoplanError(f"unknown optimizer {self.name!r}: use one of {', '.join(OPTIMIZER_NAMES)}")
        if not self.lr > 0:
            raise AutoplanError(f"the learning rate must be positive, got {self.lr}")
        if self.weight_decay < 0:
            raise AutoplanError(f"weight decay must be at least 0, got {self.weight_decay}")
        self.betas = [float(b) for b in self.betas]


@dataclass
class PrecisionPlan:
    """The dtypes of a step: parameters as the forward and backward compute with them, the
    compute, and the gradient reduction (master weights and optimizer state stay fp32). The
    program carries out bf16 under ``torch.autocast`` (:mod:`autoplan.codegen.precision`)."""

    name: str = "fp32"
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    reduce_dtype: str = "float32"

    @classmethod
    def named(cls, name: str) -> PrecisionPlan:
        key = str(name).strip().lower()
        if key not in PRECISIONS:
            raise AutoplanError(f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)}")
        return cls(key, *PRECISIONS[key])


@dataclass
class ParamStorage:
    """How one parameter is stored between steps, one placement per mesh axis: the parameter
    itself (as ``Plan.params``), its gradient after the reduction, and its optimizer state.
    All three equal is plain (DDP-like) storage; a sharded optimizer state under a replicated
    parameter is ZeRO-1, a sharded gradient too ZeRO-2.

    ``held``: the parameter is stored in its optimizer state's placements (FSDP's shard), and
    every step gathers it once into ``param``'s, in the precision's parameter dtype, and holds it
    there through its microbatches; its gradient accumulates in ``param``'s placements and is
    reduced into the shard once, after the last microbatch (FSDP2 under a pipeline with
    ``reshard_after_forward=False``, as torchtitan composes them:
    :mod:`autoplan.codegen.held_parameters`)."""

    param: list[str]
    grad: list[str]
    optimizer_state: list[str]
    held: bool = False


class RecomputeMode(StrEnum):
    """How a layer is recomputed (:class:`RecomputedLayer`): ``full`` keeps only what the layer
    reads; ``selective`` also the outputs of its matrix products and attention; ``op``
    (torchtitan's per-op selective policy) those of its attention and of every other matrix
    product (:func:`kept_outputs`)."""

    FULL = "full"
    SELECTIVE = "selective"
    PER_OP = "op"


# the ops whose outputs a selectively recomputed layer keeps (ATen overload-packet names): the
# graph's own (linear, matmul, scaled_dot_product_attention) and what they dispatch to at run time
ATTENTION_OPS = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention"})
SELECTIVE_SAVED_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "conv1d", "conv2d", "conv3d"}) | ATTENTION_OPS


def kept_outputs(ops: Iterable[tuple[str, str]], mode: RecomputeMode | str) -> frozenset[str]:
    """Of a recomputed layer's ops, ``(node name, ATen overload-packet name)`` in graph order,
    the nodes whose outputs its recomputation keeps in ``mode``: none where ``full``; every
    matrix product and attention (:data:`SELECTIVE_SAVED_OPS`) where ``selective``; where
    ``op``, the attention and the first, third, fifth, … matrix product (torchtitan's per-op
    policy recomputes every second one: a Llama block keeps q, v, gate and down, and runs k,
    o and up again). The cost model and the program read the same answer."""
    if mode == RecomputeMode.FULL:
        return frozenset()
    kept, products = set(), 0
    for name, op in ops:
        if op in ATTENTION_OPS:
            kept.add(name)
        elif op in SELECTIVE_SAVED_OPS:
            products += 1
            if mode == RecomputeMode.SELECTIVE or products % 2 == 1:
                kept.add(name)
    return frozenset(kept)


@dataclass
class RecomputedLayer:
    """A layer whose activations the forward does not keep: the program runs its op nodes
    (graph order) under non-reentrant activation checkpointing, which keeps the values it
    reads and runs them again in the backward, collectives included. ``mode`` ``selective``
    also keeps the outputs of its matrix products and attention (:data:`SELECTIVE_SAVED_OPS`),
    which the backward then does not compute again; ``op`` those of its attention and of every
    other matrix product (:func:`kept_outputs`)."""

    layer: str
    nodes: list[str]
    mode: str = "full"


@dataclass
class PinRecord:
    """A pin the plan keeps (``--pin``), as written, and the names it holds: parameters,
    inputs or nodes for a placement or fsdp pin, modules for a stage or checkpoint pin (none
    for a structure pin such as ``mesh=2x2``)."""

    pin: str
    holds: list[str] = field(default_factory=list)


@dataclass
class PinCost:
    """What the pins cost: the predicted step time of the pinned plan beside that of the
    search's optimum without them (None where no unpinned plan fits, with ``reason``)."""

    pinned_step_time_s: float
    unpinned_step_time_s: float | None
    reason: str = ""

    @property
    def fraction(self) -> float | None:
        """The pinned plan's step time over the unpinned optimum's, less one."""
        if not self.unpinned_step_time_s:
            return None
        return self.pinned_step_time_s / self.unpinned_step_time_s - 1.0


class CouplingHandling(StrEnum):
    """How a program keeps an op that couples the samples of a batch equal to one device."""

    WHOLE_BATCH = "the batch is not cut into microbatches"
    WEIGHTED_MICROBATCHES = "each microbatch's mean loss is weighted by its share of the targets"


@dataclass
class BatchCouplingPlan:
    """An op that couples the samples of a batch (:mod:`autoplan.trace.batch_coupling`) and how
    the program handles it; across devices, its sharding rule keeps the result exact."""

    node: str
    description: str  # "native_batch_norm in layer1.norm (batch statistics)"
    handling: CouplingHandling


# the ``where`` of a held parameter's all-gather, once per step (:attr:`ParamStorage.held`)
HELD_SUFFIX = "(held for the step)"


@dataclass
class PlannedCollective:
    """A collective the program performs ``count`` times per training step."""

    kind: CollectiveKind
    phase: Phase
    mesh_axis: int
    bytes: float
    count: int
    where: str = ""  # the edge or node that needs it, e.g. "linear_1 -> sub"
    tensor: str = "activation"  # what it moves: "activation", "parameter", "gradient" (of a parameter), "loss count"
    bucketed: bool = False  # a gradient reduction done in buckets: no latency per parameter
    stages: list[int] = field(default_factory=list)  # the pipeline stages whose ranks run it (empty: every rank)


def copies_summed(fqn: str) -> str:
    """The ``where`` of the collective summing the gradients of a weight's copies held by
    several pipeline ranks (a token table that is also the head), once a step."""
    return f"{fqn}: its copies' gradients"


@dataclass
class MemoryEstimate:
    """Bytes per device. ``peak`` is what a device keeps through the step (the kept values);
    ``transient`` what the backward holds above them at its peak (an op's gradients, a
    recomputed layer's values, the returned outputs:
    :mod:`autoplan.cost_models.transient_memory`), which the budget bounds with them.
    ``sharding_saved`` and ``recompute_saved`` are what the plan's sharded training state
    (ZeRO-1/2/3, FSDP) and its activation checkpointing keep off each device
    (:mod:`autoplan.planner.memory_savings`)."""

    params: float
    grads: float
    optimizer: float
    activations: float
    peak: float
    transient: float = 0.0
    sharding_saved: float = 0.0
    recompute_saved: float = 0.0

    @property
    def peak_with_transient(self) -> float:
        return self.peak + self.transient


@dataclass
class Prediction:
    """What one training step is predicted to cost."""

    step_time_s: float
    compute_s: float
    comm_s: float
    memory_bytes: MemoryEstimate
    comm_by_kind_s: dict[str, float] = field(default_factory=dict)
    bubble_s: float = 0.0  # pipeline time no stage spends working
    hidden_s: float = 0.0  # of comm_s, beside compute (gathers, gradient reductions): step = compute + comm - hidden
    mfu: float = 0.0  # model FLOPs utilisation (:func:`~autoplan.cost_models.step_costs.model_flops_utilization`)
    # on autoplan's DTensor interpreter (0 for PyTorch's own programs): the host's dispatch per step
    # on the busiest rank, which the costs above leave out, and the step expected with it
    # (:mod:`autoplan.cost_models.interpreter_dispatch`)
    interpreter_dispatch_s: float = 0.0
    interpreter_step_s: float = 0.0


@dataclass
class StagePlan:
    """One pipeline stage: the layers it runs, the global ranks of its sub-mesh, the logical
    mesh over them, the op nodes it executes (graph order) and the parameters it holds. The
    specs of those nodes and parameters in :class:`Plan` refer to this stage's mesh."""

    layers: list[str]
    devices: list[int]
    mesh: list[int]
    nodes: list[str] = field(default_factory=list)
    params: list[str] = field(default_factory=list)
    latency_s: float = 0.0  # predicted forward + backward of one microbatch (pipelines)
    memory_bytes: float = 0.0  # predicted peak memory per device of this stage (its rank holds the sum of its stages')


@dataclass
class PrefetchedGather:
    """Parameter gathers the program issues early: at op node ``at`` (the first op of the block
    before theirs), the forward resharding of input ``position`` of each ``(consumer,
    position)`` in ``reads``, which the consumer then takes as arrived
    (:mod:`autoplan.cost_models.gather_overlap`: what it hides)."""

    at: str
    reads: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class NodePlan:
    """The strategy of one op: ``inputs[i]`` is the spec its i-th tensor input must arrive in
    (``None``: not read), ``outputs`` one spec per tensor output, and ``grad_partial[i]`` the
    mesh axes on which the op's backward leaves input i's gradient as partial sums: the
    program reduces them on that edge, into the producer's placement, as the plan costs it."""

    name: str
    op: str
    strategy: str
    module: str = ""
    inputs: list[list[str] | None] = field(default_factory=list)
    outputs: list[list[str]] = field(default_factory=list)
    grad_partial: list[list[int]] = field(default_factory=list)


@dataclass
class Alternative:
    """Another plan costed for comparison: ``predicted`` by its exact ILPs, or only the stage
    search's ``estimate_s`` (which runs a few percent above exact figures), or neither when it
    is infeasible (``reason`` says why)."""

    name: str
    mesh: list[int]
    predicted: Prediction | None
    reason: str = ""
    estimate_s: float | None = None  # the stage search's step time, for one not planned exactly


@dataclass
class SolverStats:
    solver: str
    status: str
    gap: float | None
    num_variables: int
    num_constraints: int
    num_groups: int
    num_nodes: int
    solve_time_s: float


@dataclass
class Plan:
    """A parallelization plan. ``params`` and ``inputs`` map names to one placement per mesh
    axis (``"R"``, ``"S(d)"``); ``nodes`` gives every traced op's strategy.

    With a pipeline (``len(stages) > 1``) the graph was traced for ONE microbatch (each user
    input cut into ``microbatches`` equal pieces along dim 0, see
    :func:`autoplan.trace.microbatch.microbatch_inputs`), ``graph_hash`` is that graph's, and
    the top-level ``mesh`` is the shape shared by every stage's logical mesh."""

    graph_hash: str
    devices: int
    cluster: dict[str, Any]
    mesh: list[int]
    stages: list[StagePlan]
    microbatches: int
    schedule: str
    params: dict[str, list[str]]
    inputs: dict[str, list[str]]
    nodes: list[NodePlan]
    collectives: list[PlannedCollective]
    predicted: Prediction
    alternatives: list[Alternative] = field(default_factory=list)
    solver: SolverStats | None = None
    timings_s: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    model: str = ""
    explanation: str = ""  # the largest cost terms and memory holders of the chosen plan
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)
    precision: PrecisionPlan = field(default_factory=PrecisionPlan)
    recompute: list[RecomputedLayer] = field(default_factory=list)  # layers recomputed in the backward
    storage: dict[str, ParamStorage] = field(default_factory=dict)  # parameter -> param, grad, optimizer state
    options: dict[str, Any] = field(default_factory=dict)  # the planning options, as given
    batch_coupling: list[BatchCouplingPlan] = field(default_factory=list)
    pins: list[PinRecord] = field(default_factory=list)  # the user's pins, which the plan keeps
    pin_cost: PinCost | None = None
    # the values that cross pipeline stage boundaries whole (small ones, and those whose way
    # passes a stage on another logical mesh); the others cross as shards
    # (:func:`autoplan.sharding.boundary_spec`)
    crossing_whole: list[str] = field(default_factory=list)
    # gathers issued a block ahead of their consumers (on a GPU, beside the block before)
    prefetch: list[PrefetchedGather] = field(default_factory=list)
    # the backward gathers a block's parameters again while the block after it runs its
    # backward (on a GPU: :mod:`autoplan.cost_models.backward_overlap`)
    prefetch_regathers: bool = False
    # which program runs the plan, read when planned: PyTorch's own (FSDP2, DDP, the parallel
    # styles, stages cut from the model) or the DTensor interpreter, and why
    # (:func:`autoplan.codegen.program_choice.program_choice`)
    program: str = ""
    format: str = PLAN_FORMAT

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {"format": data.pop("format"), **data}

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        fmt = data.get("format")
        if fmt != PLAN_FORMAT:
            raise AutoplanError(f"the plan is of format {fmt!r} and this autoplan reads {PLAN_FORMAT}: "
                                f"plan the model again with this version")
        try:
            return cls(
                graph_hash=data["graph_hash"],
                devices=int(data["devices"]),
                cluster=dict(data["cluster"]),
                mesh=list(data["mesh"]),
                stages=[StagePlan(**s) for s in data["stages"]],
                microbatches=int(data["microbatches"]),
                schedule=str(data["schedule"]),
                params={k: list(v) for k, v in data["params"].items()},
                inputs={k: list(v) for k, v in data.get("inputs", {}).items()},
                nodes=[NodePlan(**n) for n in data["nodes"]],
                collectives=[PlannedCollective(**{**c, "kind": CollectiveKind(c["kind"]), "phase": Phase(c["phase"])})
                             for c in data["collectives"]],
                predicted=_prediction(data["predicted"]),
                alternatives=[Alternative(a["name"], list(a["mesh"]),
                                          _prediction(a["predicted"]) if a.get("predicted") else None,
                                          a.get("reason", ""), a.get("estimate_s"))
                              for a in data.get("alternatives", [])],
                solver=SolverStats(**data["solver"]) if data.get("solver") else None,
                timings_s=dict(data.get("timings_s", {})),
                warnings=list(data.get("warnings", [])),
                model=str(data.get("model", "")),
                explanation=str(data.get("explanation", "")),
                optimizer=OptimizerPlan(**data["optimizer"]),
                precision=PrecisionPlan(**data["precision"]),
                recompute=[RecomputedLayer(r["layer"], list(r["nodes"]), r.get("mode", "full"))
                           for r in data["recompute"]],
                storage={k: ParamStorage(**v) for k, v in data["storage"].items()},
                options=dict(data.get("options", {})),
                batch_coupling=[BatchCouplingPlan(c["node"], c["description"], CouplingHandling(c["handling"]))
                                for c in data.get("batch_coupling", [])],
                pins=[PinRecord(p["pin"], list(p.get("holds", []))) for p in data.get("pins", [])],
                pin_cost=PinCost(**data["pin_cost"]) if data.get("pin_cost") else None,
                crossing_whole=list(data.get("crossing_whole", [])),
                prefetch=[PrefetchedGather(str(p["at"]), [(str(c), int(i)) for c, i in p["reads"]])
                          for p in data.get("prefetch", [])],
                prefetch_regathers=bool(data.get("prefetch_regathers", False)),
                program=str(data.get("program", "")),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise AutoplanError(f"plan is malformed ({type(e).__name__}: {e}): plan again") from None

    @classmethod
    def from_json(cls, text: str) -> Plan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise AutoplanError(f"plan is not valid JSON ({e}): plan again") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        p = Path(path)
        if not p.is_file():
            raise AutoplanError(f"no plan at {p}: run autoplan on the model first")
        return cls.from_json(p.read_text())

    @property
    def scheduled(self) -> bool:
        """Whether the program runs on torch's pipeline schedule: several stages, or one stage
        with several microbatches (gradient accumulation)."""
        return len(self.stages) > 1 or self.microbatches > 1

    def collectives_in(self, phase: str) -> list[PlannedCollective]:
        return [c for c in self.collectives if c.phase == phase]

    def decisions(self) -> dict[str, Any]:
        """The plan without what was measured while planning (wall times, and the explanation
        that quotes them): equal for equal models and options, on any machine."""
        data = self.to_dict()
        data.pop("timings_s")
        data.pop("explanation")
        if data.get("solver"):
            data["solver"].pop("solve_time_s")
        return data


def _prediction(data: dict[str, Any]) -> Prediction:
    return Prediction(
        step_time_s=float(data["step_time_s"]),
        compute_s=float(data["compute_s"]),
        comm_s=float(data["comm_s"]),
        memory_bytes=MemoryEstimate(**data["memory_bytes"]),
        comm_by_kind_s=dict(data.get("comm_by_kind_s", {})),
        bubble_s=float(data.get("bubble_s", 0.0)),
        hidden_s=float(data.get("hidden_s", 0.0)),
        mfu=float(data.get("mfu", 0.0)),
        interpreter_dispatch_s=float(data.get("interpreter_dispatch_s", 0.0)),
        interpreter_step_s=float(data.get("interpreter_step_s", 0.0)),
    )
