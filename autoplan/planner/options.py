"""Everything a user can ask of the planner, in one validated dataclass.

:class:`PlanOptions` is what ``autoplan.plan(..., **options)`` and the ``autoplan`` command
both build; its checks run before any tracing or solving, and each names the bad value and
the fix in one line (like torchtitan's ``ParallelDims``). :meth:`PlanOptions.planner_options`
and :meth:`PlanOptions.pipeline_options` hand the solver-facing parts to the passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from autoplan.cost_models import ClusterSpec, DeviceSpec, OptimizerSpec, load_cluster, parse_memory_size
from autoplan.errors import AutoplanError
from autoplan.plan_schema import OPTIMIZER_NAMES, OptimizerPlan, PrecisionPlan
from autoplan.planner.mesh_plan import StorageRule
from autoplan.planner.meshes import mesh_label
from autoplan.planner.pins import PinKind, PinSet
from autoplan.planner.recompute import RecomputePolicy
from autoplan.planner.workers import default_jobs
from autoplan.solvers import SolverName, check_solver_name

if TYPE_CHECKING:
    from autoplan.planner.pipeline import PipelineOptions

PrecisionName = Literal["fp32", "bf16"]

@dataclass(frozen=True)
class PlannerOptions:
    """How to plan: the cluster, the meshes to try, the memory budget and the solver."""

    devices: int
    cluster: ClusterSpec
    mesh: tuple[int, ...] | None = None  # pin one logical mesh; None tries them all
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)
    solver: SolverName = "highs"
    time_limit_s: float | None = None
    pick: Callable[[int, list[str]], int] | None = None  # replaces the ILP: group, choice names -> index
    allow_storage: StorageRule | None = None  # restricts the specs of parameters, buffers and inputs
    pins: PinSet | None = None  # the user's pins: constraints of every intra-op ILP and of the stage DP
    recompute: RecomputePolicy = RecomputePolicy.AUTO  # which layers the backward recomputes
    canonical: bool = True  # break ties among equal-cost assignments canonically (a plan to run needs it)
    jobs: int = 1  # processes the stage search runs in (the plan does not depend on it)

    @property
    def memory_budget(self) -> float:
        return self.cluster.device.memory_bytes


def default_precision(device: DeviceSpec) -> PrecisionName:
    """The precision a plan for ``device`` takes when none is asked for: bf16 where the device
    computes bf16 faster than fp32 (tensor cores: H100, H200, A100), as every large training
    run does; fp32 elsewhere (CPUs, the V100, which has no bf16 tensor cores), where bf16 would
    save memory but no time."""
    return "bf16" if device.peak("bfloat16") > device.peak("float32") else "fp32"


def _positive_int(name: str, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or value < 1):
        raise AutoplanError(f"{name} must be a whole number of at least 1, got {value!r}")


@dataclass(frozen=True)
class PlanOptions:
    """How to plan. ``None`` leaves a choice to the planner.

    ``devices``: the number of devices; ``cluster``: a preset name, a TOML file or a
    :class:`ClusterSpec`; ``mesh``: pin the logical mesh (of a pipeline stage's devices when
    ``stages`` is given); ``memory_per_device`` (bytes or ``"40GB"``) and ``devices_per_node``
    override the cluster's. ``optimizer`` (``adamw``, ``adam``, ``sgd``, ``sgd-momentum``) with
    ``lr``/``weight_decay``/``momentum`` is what the program steps with; ``precision``
    (``fp32``, ``bf16``: bf16 compute under ``torch.autocast`` with fp32 master weights,
    gradients and optimizer state) is costed and run; ``None`` takes the cluster's default
    (:func:`default_precision`: bf16 on the H100, H200 and A100 presets, fp32 on ``cpu`` and
    ``v100-16g``). ``recompute``: activation checkpointing, ``"auto"`` (the planner
    recomputes layers in the backward where memory needs it, fully, selectively or by the per-op
    policy), ``"all"`` (every layer that may be; also ``True``), ``"selective"`` (every layer
    that may be, keeping its matrix products' and attention's outputs), ``"op"`` (every layer
    that may be, by torchtitan's per-op policy) or ``"none"``. ``pipeline=False`` plans
    intra-op only; ``stages``, ``microbatches``, ``schedule`` and ``layers`` pin pipeline
    choices. ``manual`` holds
    hand-written plans (``"dp=2,tp=4,pp=2,microbatches=64"``) to cost beside the found one.
    ``pins`` (``"h.*.mlp.c_fc.weight=[R, S(0)]"``, ``"mesh=2x2"``, …, or a dict of pattern to
    value) fix decisions the planner then plans around (:mod:`autoplan.planner.pins`); a
    structure pin (``mesh``, ``stages``/``pp``, ``microbatches``, ``ac``, and ``dp``/``fsdp``/``tp``
    through the mesh) sets that option where it is not given, and refuses to contradict it.
    ``plan_only`` marks a plan that is for reading, not for running. ``jobs``: processes the
    stage search runs in (default: one per core this process may use, shared with the node's
    other ranks under torchrun, one inside a process group); the plan is the same for any
    number. ``native_rivals``: where the plan found runs on autoplan's DTensor interpreter, set
    it against the data-parallel plans PyTorch runs itself, by the step expected with the
    interpreter's dispatch (:mod:`autoplan.planner.native_rivals`); False keeps the plan found."""

    devices: int
    cluster: str | ClusterSpec = "h100"
    mesh: tuple[int, ...] | None = None
    memory_per_device: float | str | None = None
    devices_per_node: int | None = None
    optimizer: str = "adamw"
    lr: float | None = None
    weight_decay: float | None = None
    momentum: float | None = None
    precision: PrecisionName | None = None
    recompute: str = "auto"
    solver: SolverName = "highs"
    time_limit_s: float | None = None
    pipeline: bool = True
    stages: int | None = None
    microbatches: int | None = None
    schedule: str | None = None
    layers: int | None = None
    manual: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()
    plan_only: bool = False
    jobs: int | None = None
    native_rivals: bool = True
    cluster_spec: ClusterSpec = field(init=False, repr=False, compare=False)
    pin_set: PinSet = field(init=False, repr=False, compare=False)
    pinned_fields: tuple[tuple[str, Any], ...] = field(init=False, repr=False, compare=False)  # set by pins, as given

    def __post_init__(self) -> None:
        _positive_int("devices", self.devices)
        for name in ("stages", "microbatches", "layers", "devices_per_node", "jobs"):
            _positive_int(name, getattr(self, name))
        check_solver_name(self.solver)
        recompute = {True: "all", False: "auto"}.get(self.recompute, self.recompute)  # type: ignore[call-overload]
        if str(recompute).lower() not in tuple(RecomputePolicy):
            raise AutoplanError(f"recompute must be auto, all, selective, op or none, got {self.recompute!r}")
        object.__setattr__(self, "recompute", str(recompute).lower())
        self._read_pins()
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            raise AutoplanError(f"the time limit must be a positive number of seconds, got {self.time_limit_s}")
        if self.optimizer.strip().lower() not in OPTIMIZER_NAMES:
            raise AutoplanError(f"unknown optimizer {self.optimizer!r}: use one of {', '.join(OPTIMIZER_NAMES)}")
        if self.precision is not None:
            PrecisionPlan.named(self.precision)
        if self.schedule is not None:
            from autoplan.planner.pipeline import (
                normalize_schedule,  # the pipeline pass imports this module
            )

            object.__setattr__(self, "schedule", str(normalize_schedule(self.schedule)))
        if not self.pipeline:
            pinned = [f"{name}={getattr(self, name)}" for name in ("stages", "microbatches", "schedule")
                      if getattr(self, name) is not None and not (name == "stages" and self.stages == 1)]
            if pinned:
                raise AutoplanError(f"{', '.join(pinned)} pins a pipeline but pipelines are turned off: "
                                    f"drop one or the other")
        if self.stages is not None and self.devices % self.stages:
            raise AutoplanError(f"{self.stages} stages do not divide {self.devices} devices: "
                                f"choose a divisor of {self.devices}")
        if self.mesh is not None:
            mesh = tuple(int(m) for m in self.mesh)
            if any(m < 1 for m in mesh):
                raise AutoplanError(f"mesh {mesh_label(mesh)} has an axis below 1")
            stage_devices = self.devices // (self.stages or 1)
            if self.stages is not None and math.prod(mesh) != stage_devices:
                raise AutoplanError(f"mesh {mesh_label(mesh)} holds {math.prod(mesh)} devices but each of the "
                                    f"{self.stages} stages of {self.devices} devices has {stage_devices}: "
                                    f"make them agree")
            if self.devices % math.prod(mesh):
                raise AutoplanError(f"mesh {mesh_label(mesh)} holds {math.prod(mesh)} devices, which does not "
                                    f"divide {self.devices} devices: make them agree")
            object.__setattr__(self, "mesh", mesh)
        memory = self.memory_per_device
        if isinstance(memory, str):
            memory = parse_memory_size(memory)
        if memory is not None and not memory > 0:
            raise AutoplanError(f"the memory per device must be positive, got {self.memory_per_device!r}")
        base = self.cluster if isinstance(self.cluster, ClusterSpec) else load_cluster(self.cluster)
        object.__setattr__(self, "cluster_spec", base.with_overrides(devices_per_node=self.devices_per_node,
                                                                     memory_per_device=memory))
        object.__setattr__(self, "manual", tuple(self.manual))
        if self.precision is None:
            object.__setattr__(self, "precision", default_precision(self.cluster_spec.device))

    def _read_pins(self) -> None:
        """Read the pins and set the options their structure pins fix (a disagreement with an
        option given outright is refused in one line)."""
        pins = PinSet.read(self.pins)
        object.__setattr__(self, "pins", tuple(pins.texts()))
        object.__setattr__(self, "pin_set", pins)
        dp = pins.degree(PinKind.DATA_PARALLEL)
        zero = pins.structure(PinKind.ZERO)
        if zero is not None and (dp or 1) < 2:
            raise AutoplanError(f"pin {zero.text!r} shards over the dp axis: pin dp=2 or more too")
        mesh_pin = pins.structure(PinKind.MESH)
        derived = pins.data_parallel_mesh
        if mesh_pin is not None and derived is not None and mesh_pin.mesh != derived:
            raise AutoplanError(f"pin {mesh_pin.text!r} disagrees with the dp/fsdp/tp pins, whose mesh is "
                                f"{mesh_label(derived)}: keep one")
        ac = pins.structure(PinKind.ACTIVATION_CHECKPOINTING)
        wanted: list[tuple[str, Any, str]] = []  # (option, value, the pin that sets it)
        if mesh_pin is not None or derived is not None:
            wanted.append(("mesh", mesh_pin.mesh if mesh_pin else derived, f"pin {mesh_pin.text!r}" if mesh_pin
                           else f"the mesh of the dp/fsdp/tp pins ({mesh_label(derived or ())})"))
        for kind, name in ((PinKind.STAGES, "stages"), (PinKind.MICROBATCHES, "microbatches")):
            pin = pins.structure(kind)
            if pin is not None:
                wanted.append((name, pin.number, f"pin {pin.text!r}"))
        if ac is not None:
            wanted.append(("recompute", {"full": "all"}.get(ac.choice, ac.choice), f"pin {ac.text!r}"))
        before = []
        for name, value, source in wanted:
            given = getattr(self, name)
            unset = given is None or (name == "recompute" and given == "auto")
            if not unset and (tuple(given) if name == "mesh" else given) != value:
                shown = mesh_label(given) if name == "mesh" else given
                raise AutoplanError(f"{source} disagrees with {name}={shown}: keep one")
            if unset:
                before.append((name, given))
                object.__setattr__(self, name, value)
        object.__setattr__(self, "pinned_fields", tuple(before))

    def without_pins(self) -> PlanOptions:
        """These options with no pins (and the options the pins set as they were given): the
        unpinned search whose optimum a pinned plan is measured against."""
        return replace(self, pins=(), **dict(self.pinned_fields))

    def optimizer_plan(self) -> OptimizerPlan:
        """The optimizer with its hyper-parameters: torch's defaults where none was given."""
        name = self.optimizer.strip().lower()
        defaults = OptimizerPlan(name)
        return OptimizerPlan(
            name,
            lr=self.lr if self.lr is not None else (1e-2 if name.startswith("sgd") else defaults.lr),
            weight_decay=self.weight_decay if self.weight_decay is not None
            else (defaults.weight_decay if name == "adamw" else 0.0),
            momentum=self.momentum if self.momentum is not None else (0.9 if name == "sgd-momentum" else 0.0),
        )

    def planner_options(self) -> PlannerOptions:
        """The options of the intra-op pass (one logical mesh at a time)."""
        return PlannerOptions(self.devices, self.cluster_spec, self.mesh,
                              OptimizerSpec(self.optimizer, mixed_precision=self.precision != "fp32"),
                              self.solver, self.time_limit_s, recompute=RecomputePolicy(self.recompute),
                              jobs=self.jobs if self.jobs is not None else default_jobs(),
                              pins=self.pin_set or None)

    def pipeline_options(self) -> PipelineOptions:
        from autoplan.planner.pipeline import PipelineOptions

        return PipelineOptions(self.stages, self.microbatches, self.schedule, self.layers)

    def to_dict(self) -> dict[str, Any]:
        """The options as plan.json records them (the cluster by name, or as its spec)."""
        data = asdict(self)
        data.pop("cluster_spec")
        data.pop("pin_set")
        data.pop("pinned_fields")
        data["pins"] = list(self.pins)
        data["cluster"] = self.cluster if isinstance(self.cluster, str) else self.cluster.to_dict()
        data["mesh"] = list(self.mesh) if self.mesh else None
        data["manual"] = list(self.manual)
        return data
