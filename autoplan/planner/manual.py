"""Hand-written plans, costed under the same model as the found one (``--manual``).

``dp=2,tp=4,pp=2,microbatches=64[,schedule=1f1b]`` is a Megatron-LM style plan: ``pp`` stages
of equal layer counts, each on a ``dp × tp`` mesh; over the ``dp`` axis every parameter is
replicated and every input batch-sharded (data parallelism); over the ``tp`` axis the intra-op
ILP picks the sharding (for transformer blocks that is Megatron's column/row split). The
result is recorded as an alternative with its predicted figures, or why it is infeasible.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from autoplan.errors import AutoplanError, MemoryInfeasibleError
from autoplan.planner.api import PlannerOptions
from autoplan.trace.graph import NodeInfo
from autoplan.trace.layers import make_layers
from autoplan.trace.repeated import find_classes
from autoplan.load import ModelSpec
from autoplan.planner.pipeline import (
    PipelineOptions,
    _assemble,
    _Candidate,
    _trace_microbatch,
    cluster_shape,
    normalize_schedule,
)
from autoplan.plan_schema import Alternative, Plan
from autoplan.sharding import ShardingSpec
from autoplan.solvers.inter_op import SubMesh

_KEYS = ("dp", "tp", "pp", "microbatches", "schedule")


@dataclass(frozen=True)
class ManualPlan:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"

    @property
    def label(self) -> str:
        return f"manual dp={self.dp},tp={self.tp},pp={self.pp},microbatches={self.microbatches}"


def parse_manual(text: str) -> ManualPlan:
    """``dp=2,tp=4,pp=2,microbatches=64`` (any subset; the rest default to 1, 1f1b)."""
    values: dict[str, object] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(\w+)", item)
        if not m or m.group(1) not in _KEYS:
            raise AutoplanError(f"cannot read --manual {text!r}: write it like dp=2,tp=4,pp=2,microbatches=64")
        key, value = m.group(1), m.group(2)
        if key == "schedule":
            values[key] = normalize_schedule(value)
        elif not value.isdigit() or int(value) < 1:
            raise AutoplanError(f"--manual {key}={value}: must be a positive integer")
        else:
            values[key] = int(value)
    return ManualPlan(**values)  # type: ignore[arg-type]


def _data_parallel_axis0(info: NodeInfo, spec: ShardingSpec) -> bool:
    if info.kind in ("parameter", "buffer", "constant"):
        return spec[0].is_replicate
    if info.kind == "input":
        return spec[0].is_shard and spec[0].dim == 0 if info.shape else True
    return True


def plan_manual(spec: ModelSpec, options: PlannerOptions, manual: ManualPlan) -> Plan:
    """The manual plan as a runnable :class:`Plan` (raises a one-line error if it cannot be)."""
    size = manual.dp * manual.tp
    if size * manual.pp != options.devices:
        raise AutoplanError(f"dp·tp·pp = {size * manual.pp} but there are {options.devices} devices")
    mesh = tuple(x for x in (manual.dp, manual.tp) if x > 1) or (1,)
    rule = _data_parallel_axis0 if manual.dp > 1 else None
    opts = replace(options, mesh=mesh, allow_storage=rule)
    graph = _trace_microbatch(spec, manual.microbatches)
    layers = make_layers(graph, find_classes(graph), None)
    if manual.pp > len(layers):
        raise AutoplanError(f"{manual.pp} stages but the model has {len(layers)} layers")
    bounds = [round(i * len(layers) / manual.pp) for i in range(manual.pp + 1)]
    _, per_node = cluster_shape(options)
    submesh = SubMesh(max(1, size // per_node), min(size, per_node))
    candidate = _Candidate(manual.microbatches, submesh, [mesh] * manual.pp, list(zip(bounds, bounds[1:])), math.inf,
                           graph, layers)
    return _assemble(spec, candidate, opts, manual.schedule, {})


def cost_manual(spec: ModelSpec, options: PlannerOptions, manual: ManualPlan) -> Alternative:
    """The manual plan's predicted figures, or why it cannot run."""
    try:
        plan = plan_manual(spec, options, manual)
    except (AutoplanError, MemoryInfeasibleError) as e:
        return Alternative(manual.label, [manual.pp, manual.dp, manual.tp], None, f"infeasible: {e}")
    return Alternative(manual.label, [manual.pp, manual.dp, manual.tp], plan.predicted)


def manual_pipeline_options(manual: ManualPlan) -> PipelineOptions:
    return PipelineOptions(stages=manual.pp, microbatches=manual.microbatches, schedule=manual.schedule)
