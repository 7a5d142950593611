"""The textbook plans the found one is compared with, costed by the same model
(:func:`autoplan.planner.manual.cost_manual`):

- data parallelism over every device (``dp=N``): parameters replicated, the batch sharded
  ``N`` ways, gradients all-reduced;
- Megatron tensor parallelism inside a node (``tp = gcd(N, devices per node)``, data parallel
  over the nodes): every weight matrix sharded over the ``tp`` axis and used in place, as the
  column or the row of a pair, with an all-reduce per pair in the forward and one in the
  backward;
- a pipeline of ``N`` stages when the model has ``N`` layers, else the most stages it has
  layers for with data parallelism over the rest.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Alternative, Plan
from autoplan.planner.api import PlannerOptions
from autoplan.planner.manual import ManualPlan, cost_manual, manual_layer_count


@dataclass(frozen=True)
class Baseline:
    label: str
    manual: ManualPlan


def _batch(spec: ModelSpec) -> int | None:
    for x in spec.example_inputs:
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.shape[0])
    return None


def _microbatches(batch: int | None, pp: int, dp: int) -> int:
    """The most microbatches up to 4·pp that cut the batch evenly, each divisible by dp."""
    if batch is None:
        return pp
    fits = [m for m in range(1, 4 * pp + 1) if batch % m == 0 and (batch // m) % dp == 0]
    return max(fits) if fits else 1


def _layer_count(plan: Plan, spec: ModelSpec) -> int:
    """Layers as :func:`cost_manual` cuts the model (the plan's own may be cut otherwise)."""
    try:
        return manual_layer_count(spec)
    except AutoplanError:  # counted from the plan instead; cost_manual says if that is too many
        return sum(len(s.layers) for s in plan.stages)


def baseline_plans(plan: Plan, spec: ModelSpec) -> list[Baseline]:
    n = plan.devices
    per_node = int(plan.cluster.get("devices_per_node", n) or n)
    out = [Baseline(f"data parallel (dp={n})", ManualPlan(dp=n))]
    if n == 1:
        return out
    tp = math.gcd(n, per_node)
    if tp > 1:
        dp = n // tp
        label = f"Megatron tensor parallel (tp={tp})" if dp == 1 else f"Megatron tensor parallel (dp={dp} x tp={tp})"
        out.append(Baseline(label, ManualPlan(dp=dp, tp=tp)))
    layers = _layer_count(plan, spec)
    stages = [d for d in range(2, n + 1) if n % d == 0 and d <= max(layers, 1)]
    if stages:
        pp = stages[-1]
        dp = n // pp
        m = _microbatches(_batch(spec), pp, dp)
        label = f"pipeline (pp={pp}, {m} microbatches)" if dp == 1 else f"pipeline (pp={pp} x dp={dp}, {m} microbatches)"
        out.append(Baseline(label, ManualPlan(dp=dp, pp=pp, microbatches=m)))
    return out


def cost_baselines(plan: Plan, spec: ModelSpec, options: PlannerOptions,
                   progress=None) -> list[Alternative]:
    """Each baseline as an :class:`Alternative` named by its label (``predicted`` None and a
    reason when it cannot run). Baselines that repeat a ``--manual`` plan already in
    ``plan.alternatives`` are left out."""
    existing = {a.name for a in plan.alternatives}
    out = []
    for b in baseline_plans(plan, spec):
        if b.manual.label in existing:
            continue
        if progress:
            progress(f"costing baseline {b.label}")
        alt = cost_manual(spec, options, b.manual)  # an infeasible one comes back with its reason
        out.append(replace(alt, name=b.label))
    return out
