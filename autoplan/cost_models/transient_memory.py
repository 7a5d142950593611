"""The backward's working set: memory a training step holds for a moment above the values it
keeps, which the memory budget of the planner does not yet bound.

The kept values (parameters, gradients, optimizer state, the activations the backward reads)
are what :class:`~autoplan.cost_models.step_costs.MemoryParts` counts and what the solvers
keep under the budget. At the peak of a step a device holds more:

- **an op's gradients**: the backward of op ``i`` holds the gradient of its output and the
  gradients of its inputs at once, ``g_i = out_i + Σ_{j ∈ inputs(i), needs grad} out_j``, plus
  what the op keeps inside itself (a cross-entropy keeps its log-probabilities, the size of its
  input);
- **a recomputed layer's values**: while the backward runs through a recomputed layer ``R``, the
  layer's forward has run again and its values are alive: ``W(R) = Σ_{j ∈ R} out_j`` (views
  excluded);
- **the model's outputs**: the values the program returns (logits) live until the step ends.

The transient is the largest of ``W(R) + g_i`` over the ops ``i`` of each recomputed layer
``R`` and ``g_i`` over the other ops, plus the outputs outside that layer. Every value is
counted per device (its local shard) in the dtype it has under the plan's precision:
:func:`working_itemsize` keeps in fp32 what autocast computes in fp32 (losses, softmax,
normalisation, explicit casts to fp32); everything else is costed as
:func:`~autoplan.cost_models.step_costs.value_itemsize` costs it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from autoplan.sharding import ShardingSpec
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import NodeInfo

from .step_costs import CostContext, aten_name, local_bytes, moved_bytes, value_itemsize

#: Ops that ``torch.autocast`` runs in float32 (their outputs are float32 under bf16 autocast),
#: by ATen name.
AUTOCAST_FP32_OPS = frozenset(
    "softmax _softmax log_softmax _log_softmax cross_entropy_loss nll_loss nll_loss_nd layer_norm native_layer_norm "
    "group_norm rms_norm mse_loss l1_loss smooth_l1_loss huber_loss kl_div binary_cross_entropy_with_logits "
    "exp log log1p pow rsqrt reciprocal logsumexp cumsum sum prod".split())
_CASTS = frozenset({"to", "_to_copy"})
#: Ops that keep a value of their input's size inside themselves for the backward.
_KEEPS_INPUT_SIZED = frozenset({"cross_entropy_loss"})


def working_itemsize(info: NodeInfo, mixed_precision: bool) -> int:
    """Bytes per element of ``info``'s value in the program: fp32 where autocast computes the op
    in fp32 or the model casts to fp32, otherwise :func:`value_itemsize`."""
    name = aten_name(info)
    if mixed_precision and info.dtype.replace("torch.", "") == "float32" and \
            (name in AUTOCAST_FP32_OPS or name in _CASTS):
        return 4
    return value_itemsize(info, mixed_precision)


def _local_bytes(info: NodeInfo, spec: ShardingSpec | None, ctx: CostContext) -> float:
    if info.shape is None or spec is None:
        return 0.0
    return local_bytes(info.shape, working_itemsize(info, ctx.optimizer.mixed_precision), spec, ctx.mesh_shape)


def backward_transient(nodes: Mapping[str, NodeInfo], chosen: Mapping[str, Strategy],
                       inputs: Mapping[str, list[str]], needs_grad: Mapping[str, bool],
                       outputs: Iterable[str], ctx: CostContext) -> float:
    """Bytes per device the backward holds above the kept values at its peak (see the module
    docstring). ``inputs`` are each op's tensor inputs, ``outputs`` the graph's model outputs
    (the loss left out)."""
    def out_bytes(name: str) -> float:
        strategy = chosen.get(name)
        return _local_bytes(nodes[name], strategy.output_spec if strategy and strategy.output_specs else None, ctx)

    ops = [name for name, info in nodes.items() if info.kind == "op" and name in chosen]
    gradients: dict[str, float] = {}
    for name in ops:
        own = out_bytes(name)
        held = sum(out_bytes(i) for i in inputs.get(name, []) if i in nodes and needs_grad.get(i, False))
        if aten_name(nodes[name]) in _KEEPS_INPUT_SIZED and inputs.get(name):
            held += out_bytes(inputs[name][0])
        gradients[name] = own + held if needs_grad.get(name, False) else 0.0
    regions: dict[str, list[str]] = {}
    for name in ops:
        region = ctx.region_of(name)
        if region is not None:
            regions.setdefault(region, []).append(name)
    returned = {name: out_bytes(name) for name in outputs if name in nodes}
    kept_ops = [g for name, g in gradients.items() if ctx.region_of(name) is None]
    worst = max(kept_ops) + sum(returned.values()) if kept_ops else 0.0
    for members in regions.values():
        inside = set(members)
        values = sum(out_bytes(name) for name in members if moved_bytes(nodes[name]) > 0 and ctx.recomputes(name))
        alive = sum(b for name, b in returned.items() if name not in inside)
        worst = max(worst, values + max(gradients[name] for name in members) + alive)
    return worst
