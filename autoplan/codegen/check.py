"""``--check``: prove the parallel program computes what the model computes on one device.

Compares, with the tolerances printed (:func:`~autoplan.codegen.precision.check_tolerances`;
a bf16 plan's reference runs under the plan's precision too), and with dtypes equal: the
forward outputs, the loss, every parameter's gradient after the first step, and every
parameter and the loss after K steps of the plan's optimizer (the reference steps the same
optimizer, built from the plan); then sets the collectives the program executed (counted by
:class:`~autoplan.codegen.collective_counter.CollectiveCounter`: forward, backward and the
optimizer step apart; for a pipeline, one step's per rank, as the schedule interleaves the
forward and backward, and its optimizer step's) beside the plan's list. Runs in every rank;
each rank computes the single-device reference itself.
"""

from __future__ import annotations

import copy
from collections import Counter
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autoplan.codegen.collective_counter import CollectiveCounter
from autoplan.codegen.dtensor_program import planned_collectives
from autoplan.codegen.materialize import has_meta_tensors
from autoplan.codegen.optimizer import build_optimizer
from autoplan.codegen.precision import check_tolerances, compute_precision
from autoplan.codegen.runtime import ParallelModule, PipelinedModule
from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan, PlannedCollective


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class Comparison:
    name: str
    max_abs_diff: float
    allowed: float  # atol + rtol·max|reference|

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.allowed


@dataclass
class CheckReport:
    rtol: float
    atol: float
    comparisons: list[Comparison] = field(default_factory=list)
    executed: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> kind -> count
    planned: dict[str, dict[str, int]] = field(default_factory=dict)
    pipelined: bool = False  # phases are "step, rank r": a pipeline's collectives, per rank
    precision: str = "fp32"  # the plan's, under which program and reference ran
    moved: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # phase -> kind -> dtypes moved

    @property
    def worst(self) -> Comparison:
        return max(self.comparisons, key=lambda c: c.max_abs_diff / max(c.allowed, 1e-30))

    @property
    def values_ok(self) -> bool:
        return all(c.ok for c in self.comparisons)

    @property
    def collectives_ok(self) -> bool:
        return all(self.executed.get(p, {}) == self.planned.get(p, {}) for p in self.phases)

    @property
    def phases(self) -> list[str]:
        if not self.pipelined:
            return ["forward", "backward", *(["optimizer"] if "optimizer" in self.planned else [])]
        return sorted(set(self.planned) | set(self.executed),
                      key=lambda p: (int(p.rsplit(" ", 1)[-1]), p.startswith("optimizer")))

    @property
    def ok(self) -> bool:
        return self.values_ok and self.collectives_ok

    def text(self) -> str:
        policy = "" if self.precision == "fp32" else " under torch.autocast, the reference too"
        lines = [f"check: tolerances rtol={self.rtol:g}, atol={self.atol:g} ({self.precision}{policy})"]
        worst = self.worst
        lines.append(f"check: {len(self.comparisons)} tensors compared; largest difference {worst.max_abs_diff:.3g} "
                     f"in {worst.name} (allowed {worst.allowed:.3g})")
        for c in self.comparisons:
            if not c.ok:
                lines.append(f"check: MISMATCH {c.name}: max |diff| {c.max_abs_diff:.3g} > {c.allowed:.3g}")
        lines.append("check: collectives per step      planned  executed"
                     + ("   (per rank; stage-to-stage sends are point-to-point, not listed)" if self.pipelined else ""))
        for phase in self.phases:
            kinds = sorted(set(self.planned.get(phase, {})) | set(self.executed.get(phase, {})))
            for kind in kinds:
                p, e = self.planned.get(phase, {}).get(kind, 0), self.executed.get(phase, {}).get(kind, 0)
                mark = "" if p == e else "   <- differs"
                moved = ", ".join(self.moved.get(phase, {}).get(kind, []))  # the dtypes it moved
                lines.append(f"check:   {phase:8s} {kind:15s} {p:8d}  {e:8d}{mark}"
                             + (f"   ({moved})" if moved else ""))
        lines.append("check: PASSED" if self.ok else "check: FAILED")
        return "\n".join(lines)


def expected_collectives(pm: ParallelModule, phase: str) -> dict[str, int]:
    """What the collective counter should count in ``phase`` for the plan as this program runs it:
    a native DDP program reduces gradients in buckets (one all-reduce per bucket, the same
    bytes), and on gloo DTensor runs an all-to-all as an all-gather (gloo has none on CPU)."""
    observable = getattr(pm.program, "observable_collectives", None)
    counts = dict(observable(phase)) if observable is not None else planned_collectives(pm.plan, phase)
    return _as_backend_runs(counts)


def _as_backend_runs(counts: dict[str, int]) -> dict[str, int]:
    """``counts`` as the backend runs them: on gloo DTensor runs an all-to-all as an
    all-gather (gloo has none on CPU)."""
    counts = dict(counts)
    if dist.is_initialized() and dist.get_backend() == "gloo" and "all_to_all" in counts:
        counts["all_gather"] = counts.get("all_gather", 0) + counts.pop("all_to_all")
    return {kind: n for kind, n in counts.items() if n}


def _compare(name: str, got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> Comparison:
    """``got`` against ``want``: equal shapes and dtypes (a dtype apart is a precision the
    program did not run as the reference did), values within ``atol + rtol·max|want|``."""
    if got.dtype != want.dtype:
        return Comparison(f"{name} (dtype {got.dtype} vs {want.dtype})", float("inf"), 0.0)
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        return Comparison(f"{name} (shape {tuple(got.shape)} vs {tuple(want.shape)})", float("inf"), 0.0)
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return Comparison(name, diff, atol + rtol * (want.abs().max().item() if want.numel() else 0.0))


def _output_tensors(output: Any) -> list[torch.Tensor]:
    from autoplan.trace.values import tensor_leaves

    return list(tensor_leaves(output))


def _gather(comparisons: list[Comparison]) -> list[Comparison]:
    """Every rank's comparisons, merged by name (the largest difference wins)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(c.name, c.max_abs_diff, c.allowed) for c in comparisons])
    merged: dict[str, Comparison] = {}
    for rank_items in everyone:
        for name, diff, allowed in rank_items:
            if name not in merged or diff > merged[name].max_abs_diff:
                merged[name] = Comparison(name, diff, allowed)
    return [merged[name] for name in sorted(merged)]


def _tolerances(pm: ParallelModule | PipelinedModule, rtol: float | None, atol: float | None
                ) -> tuple[float, float]:
    """The given tolerances, or those of the plan's precision."""
    default_rtol, default_atol = check_tolerances(pm.plan.precision)
    return (default_rtol if rtol is None else rtol), (default_atol if atol is None else atol)


def _reference_precision(reference: torch.nn.Module, pm: ParallelModule | PipelinedModule
                         ) -> AbstractContextManager:
    """The plan's precision on the reference's device."""
    device = next(iter(reference.parameters()), torch.empty(0)).device
    return compute_precision(pm.plan.precision, device.type)


_CASTS = ("aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default")


def _outputs_traced_as_no_op_casts(pm: ParallelModule) -> set[int]:
    """Indices of the program's outputs (the loss aside) that the graph computes as a dtype
    cast its trace saw as a no-op: a loss's ``logits.float()`` of fp32 logits is the same
    tensor when traced in fp32, so the graph returns the cast for the model's output; under
    bf16 autocast the model returns the bf16 logits and the graph their fp32 cast."""
    graph_module = getattr(pm.program, "graph_module", None)
    if graph_module is None:
        return set()
    outputs = torch.fx.node.map_aggregate(graph_module.graph.output_node().args[0], lambda n: n)
    flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    found = set()
    for i, node in enumerate(flat[1:]):
        if isinstance(node, torch.fx.Node) and str(node.target) in _CASTS and node.args \
                and isinstance(node.args[0], torch.fx.Node):
            before, after = node.args[0].meta.get("val"), node.meta.get("val")
            if isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor) and before.dtype == after.dtype:
                found.add(i)
    return found


def _reference_loss(spec: ModelSpec, reference: torch.nn.Module, pm: ParallelModule | PipelinedModule
                    ) -> torch.Tensor:
    """The single-device loss of the example inputs, in the plan's precision."""
    with _reference_precision(reference, pm):
        return spec.loss_fn(spec.call(reference, spec.example_inputs), *spec.example_inputs)


def check_pipeline_against_single_device(spec: ModelSpec, pm: PipelinedModule, steps: int = 3,
                                         rtol: float | None = None, atol: float | None = None) -> CheckReport:
    """The pipelined counterpart: the global loss of the first step, every gradient (each rank
    checks the stages it holds, the results are gathered), and every parameter and the loss
    after ``steps`` optimizer steps. The collectives of the first step are counted on every rank and set beside what
    the plan says that rank runs (:func:`expected_pipeline_collectives`)."""
    rtol, atol = _tolerances(pm, rtol, atol)
    reference = copy.deepcopy(spec.module)
    inputs = spec.example_inputs
    ref_loss = _reference_loss(spec, reference, pm)
    ref_loss.backward()
    with CollectiveCounter() as step_count:
        loss = pm.forward_backward(*inputs)
    counted = (expected_pipeline_collectives(pm), dict(step_count.counts))
    optimizer_counted: tuple[dict[str, int], dict[str, int]] = ({}, {})
    comparisons = [_compare("loss", loss, ref_loss, rtol, atol)]
    ref_grads = {name: p.grad for name, p in reference.named_parameters(remove_duplicate=False)}
    noise_gradients = _noise_gradients(reference, rtol, atol)
    params = pm.named_plan_parameters()
    for name in sorted(params):
        grad = params[name].grad
        if name not in ref_grads or ref_grads[name] is None:
            continue
        if grad is None:
            comparisons.append(Comparison(f"grad {name} (missing)", float("inf"), 0.0))
            continue
        comparisons.append(_compare(f"grad {name}", _full(grad), ref_grads[name], rtol, atol))
    ref_opt = build_optimizer(pm.plan.optimizer, reference.parameters())
    for step in range(steps):
        ref_opt.step()
        with CollectiveCounter() as optimizer_count:
            pm.optimizer_step()
        if step == 0:
            optimizer_counted = (expected_pipeline_collectives(pm, "optimizer"), dict(optimizer_count.counts))
        ref_opt.zero_grad()
        ref_loss = _reference_loss(spec, reference, pm)
        loss = pm.forward_backward(*inputs)
        if step < steps - 1:
            ref_loss.backward()
    label = f"after {steps} {pm.plan.optimizer.name} steps"
    comparisons.append(_compare(f"loss {label}", loss, ref_loss.detach(), rtol * 10, atol * 10))
    comparisons += _compare_parameters(reference, pm, label, rtol * 10, atol * 10, noise_gradients, steps)
    report = CheckReport(rtol, atol, _gather(comparisons), pipelined=True, precision=pm.plan.precision.name)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (*counted, *optimizer_counted))
    for rank, (planned, executed, planned_optimizer, executed_optimizer) in enumerate(everyone):
        report.planned[f"step, rank {rank}"] = planned
        report.executed[f"step, rank {rank}"] = executed
        if planned_optimizer or executed_optimizer:
            report.planned[f"optimizer, rank {rank}"] = planned_optimizer
            report.executed[f"optimizer, rank {rank}"] = executed_optimizer
    return report


def expected_pipeline_collectives(pm: PipelinedModule, phase: str = "step") -> dict[str, int]:
    """The collectives this rank runs in one pipelined step (``phase`` "step": forward and
    backward; "optimizer": the optimizer step), by the plan: those of the stages it holds
    (each as often as planned: per microbatch inside a stage, once per step for a gradient
    reduction), the reductions of tied weights it holds a copy of, and the loss's broadcast;
    the bucketed gradient all-reduces counted per bucket, as the program ran them in the step
    just taken. Stage-to-stage sends are point-to-point: not collectives, not counted."""
    observable = getattr(pm.program, "observable_collectives", None)  # a native program's accumulated step
    if observable is not None:
        return _as_backend_runs(observable(phase))
    mine = set(pm.program.stage_indices)
    counts: Counter[str] = Counter()
    for c in pm.plan.collectives:
        if (c.phase == "optimizer") != (phase == "optimizer"):
            continue
        # counted per bucket below, but for a ZeRO-2 gradient's, which runs on its edge every microbatch
        bucket_member = c.bucketed and c.kind == "all_reduce" and not reduced_on_edge(c, pm.plan)
        if c.kind != "send_recv" and not bucket_member and (not c.stages or mine & set(c.stages)):
            counts[c.kind] += c.count
    if phase != "optimizer":
        counts["all_reduce"] += pm.program.gradient_buckets_launched
    return {kind: n for kind, n in _as_backend_runs(dict(counts)).items() if n}


def reduced_on_edge(c: PlannedCollective, plan: Plan) -> bool:
    """Whether ``c`` reduces the gradient of a parameter whose gradient is stored sharded unlike
    it (ZeRO-2): the pipeline program reduces it on the parameter's edge after every microbatch
    (:func:`~autoplan.codegen.redistribution.reduce_gradient_on_edge`), one collective each
    (``c.count`` of them), not in the step's buckets; the cost model counts such reductions as
    bucketed (FSDP2 runs a group's at once)."""
    storage = plan.storage.get(c.where.split(" -> ")[0])
    return c.tensor == "gradient" and storage is not None and storage.grad != storage.param


def _noise_gradients(reference: torch.nn.Module, rtol: float, atol: float) -> dict[str, torch.Tensor]:
    """Per parameter, the elements whose first-step gradient is zero within the gradients'
    tolerance (``atol + rtol·max|gradient|``): a whole key bias before a softmax, a bias before a
    BatchNorm, and the near-zero gradients that another kernel (a GPU's) sums to another sign.
    An optimizer that normalises its steps (Adam) moves each of them by about its learning rate
    in the direction of rounding noise, on one device as on several, so after the steps they
    agree to within that, not to ``atol``. Only parameters with such elements are listed."""
    masks = {}
    for name, p in reference.named_parameters(remove_duplicate=False):
        if p.grad is None or not p.grad.numel():
            continue
        size = p.grad.detach().abs()
        mask = size <= atol + rtol * float(size.max())
        if bool(mask.any()):
            masks[name] = mask
    return masks


def _compare_parameters(reference: torch.nn.Module, pm: ParallelModule | PipelinedModule, label: str,
                        rtol: float, atol: float, noise_gradients: dict[str, torch.Tensor],
                        steps: int) -> list[Comparison]:
    """Every parameter this rank holds against the reference's; under Adam and AdamW the
    elements of ``noise_gradients`` within ``2 · lr · steps`` more (see :func:`_noise_gradients`),
    the others within the tolerances."""
    params = pm.named_plan_parameters()
    noise = 2 * pm.plan.optimizer.lr * steps if pm.plan.optimizer.name in ("adam", "adamw") else 0.0
    out = []
    for name, param in reference.named_parameters(remove_duplicate=False):
        if name not in params:
            continue
        got, want = _full(params[name].detach()), param.detach()
        mask = noise_gradients.get(name) if noise else None
        if mask is None or got.dtype != want.dtype or got.shape != want.shape:
            out.append(_compare(f"{name} {label}", got, want, rtol, atol))
            continue
        mask = mask.to(got.device)
        out.append(_compare(f"{name} {label}", torch.where(mask, want.to(got.device), got), want, rtol, atol))
        out.append(_compare(f"{name} {label} (where its gradient is zero within tolerance: steps of rounding noise)",
                            torch.where(mask, got, want.to(got.device)), want, rtol, atol + noise))
    return out


def check_against_single_device(spec: ModelSpec, pm: ParallelModule | PipelinedModule, steps: int = 3,
                                rtol: float | None = None, atol: float | None = None) -> CheckReport:
    """Run the first step of ``pm`` and of a copy of the model on one device, compare, then
    ``steps`` steps of the plan's optimizer on each and compare every parameter and the final
    loss. ``pm`` must be freshly built."""
    if has_meta_tensors(spec.module):
        raise AutoplanError("--check compares with the model on one device, and this one is on the meta device: "
                            "check a smaller configuration built with real weights")
    if isinstance(pm, PipelinedModule):
        return check_pipeline_against_single_device(spec, pm, steps, rtol, atol)
    rtol, atol = _tolerances(pm, rtol, atol)
    report = CheckReport(rtol, atol, precision=pm.plan.precision.name)
    reference = copy.deepcopy(spec.module)
    inputs = spec.example_inputs

    with _reference_precision(reference, pm):
        ref_out = spec.call(reference, inputs)
        ref_loss = spec.loss_fn(ref_out, *inputs)
    ref_loss.backward()

    with CollectiveCounter() as forward_count:
        out = pm(*inputs)
    with CollectiveCounter() as backward_count:
        out.loss.backward()
    report.executed = {"forward": dict(forward_count.counts), "backward": dict(backward_count.counts)}
    report.moved = {phase: {kind: sorted(dtypes) for kind, dtypes in counter.dtypes.items()}
                    for phase, counter in (("forward", forward_count), ("backward", backward_count))}
    report.planned = {phase: expected_collectives(pm, phase) for phase in ("forward", "backward")}

    report.comparisons.append(_compare("loss", _full(out.loss), ref_loss, rtol, atol))
    # the program's outputs leave out the loss when the model returns it (``output.loss``)
    ref_outputs = [t for t in _output_tensors(ref_out) if t is not ref_loss]
    recast = _outputs_traced_as_no_op_casts(pm)
    for i, (got, want) in enumerate(zip(out.outputs, ref_outputs)):
        got = _full(got)
        if i in recast and got.dtype != want.dtype:
            report.comparisons.append(_compare(f"output[{i}] (traced as a no-op cast: compared as {want.dtype})",
                                               got.to(want.dtype), want, rtol, atol))
        else:
            report.comparisons.append(_compare(f"output[{i}]", got, want, rtol, atol))
    params = pm.named_plan_parameters()
    for name, param in reference.named_parameters():
        if name not in params or param.grad is None:
            continue
        grad = params[name].grad
        if grad is None:
            report.comparisons.append(Comparison(f"grad {name} (missing)", float("inf"), 0.0))
            continue
        report.comparisons.append(_compare(f"grad {name}", _full(grad), param.grad, rtol, atol))

    noise_gradients = _noise_gradients(reference, rtol, atol)
    ref_opt = build_optimizer(pm.plan.optimizer, reference.parameters())
    ref_opt.step()
    with CollectiveCounter() as optimizer_count:
        pm.optimizer_step()
    planned_optimizer = expected_collectives(pm, "optimizer")
    if planned_optimizer or optimizer_count.counts:
        report.executed["optimizer"] = dict(optimizer_count.counts)
        report.planned["optimizer"] = planned_optimizer
    for _ in range(steps - 1):
        ref_opt.zero_grad()
        _reference_loss(spec, reference, pm).backward()
        pm.forward_backward(*inputs)
        ref_opt.step()
        pm.optimizer_step()
    with torch.no_grad():
        final_ref = _reference_loss(spec, reference, pm)
        final = pm(*inputs).loss
    label = f"after {steps} {pm.plan.optimizer.name} steps"
    report.comparisons.append(_compare(f"loss {label}", _full(final), final_ref, rtol * 10, atol * 10))
    report.comparisons += _compare_parameters(reference, pm, label, rtol * 10, atol * 10, noise_gradients, steps)
    return report
