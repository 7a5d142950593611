"""The backward's working set: memory a training step holds for a moment above the values it
keeps, which the memory budget bounds beside them (the intra-op ILP's peak rows).

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
- **the model's outputs**: the values the program returns (logits) live until the step ends;
- **gathered parameters**: a parameter stored sharded and read whole (ZeRO-3 / FSDP) is gathered
  again for its consumer's backward. FSDP2 gathers a block's parameters at once and prefetches
  the next block's: while the backward runs through an op of block ``b``, every parameter of
  ``b`` is gathered, with the gradient its consumer leaves in the gathered placement before the
  reduce-scatter, and so is every parameter of block ``b - 1`` (its gradient not yet). An op
  outside the repeated blocks holds its own. A :class:`GatheredRead` stands for each in a
  moment: it adds bytes only where the consumer reads the parameter unlike its storage
  (:func:`gathered_bytes`), so its size depends on two choices, the storage's and the
  consumer's (a pair term of the ILP's peak rows). The DTensor interpreter gathers one
  parameter per op, less than this.

The transient is the largest of ``W(R) + g_i`` over the ops ``i`` of each recomputed layer
``R`` and ``g_i`` over the other ops, plus the outputs outside that layer, each ``g_i`` with the
parameters gathered at ``i``. Each of those sums
is a *moment* (:func:`peak_moments`: the values it adds up), the same for every plan; a plan
gives each value its bytes, and the intra-op ILP bounds every moment of its graph as a peak
row (:func:`autoplan.planner.mesh_plan.peak_rows`). Every value is
counted per device (its local shard) in the dtype it has under the plan's precision:
:func:`working_itemsize` keeps in fp32 what autocast computes in fp32 (losses, softmax,
normalisation, explicit casts to fp32); everything else is costed as
:func:`~autoplan.cost_models.step_costs.value_itemsize` costs it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from autoplan.sharding import ShardingSpec
from autoplan.strategies.candidates import Strategy
from autoplan.trace.graph import NodeInfo
from autoplan.trace.repeated import block_of

from .step_costs import CostContext, aten_name, local_bytes, moved_bytes, resharded_itemsize, value_itemsize

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


def value_bytes(info: NodeInfo, spec: ShardingSpec | None, ctx: CostContext) -> float:
    """Bytes per device of a value in a moment: its local shard under ``spec`` (0 without one)
    in :func:`working_itemsize`."""
    if info.shape is None or spec is None:
        return 0.0
    return local_bytes(info.shape, working_itemsize(info, ctx.optimizer.mixed_precision), spec, ctx.mesh_shape)


class GatheredRead(NamedTuple):
    """A parameter as the op ``consumer`` reads it (its input ``position``): where the read
    placement differs from the stored one, the copy the program gathers for it, and with
    ``gradient`` also the gradient the consumer leaves in that placement before it is reduced
    into the stored one (:func:`gathered_bytes`)."""

    consumer: str
    position: int
    gradient: bool


#: What a moment adds up: values by node name, and parameters as their consumers read them.
Held = Counter[str | GatheredRead]


def gathered_bytes(info: NodeInfo, stored: ShardingSpec | None, read: ShardingSpec | None, gradient: bool,
                   ctx: CostContext) -> float:
    """Bytes per device a parameter stored in ``stored`` adds to a moment as a consumer reads it
    in ``read``: nothing where the two agree (the consumer reads the stored tensor); else the
    gathered copy, moved as :func:`~autoplan.cost_models.step_costs.resharded_itemsize` moves
    it (bf16 under mixed precision), and with ``gradient`` the consumer's gradient in ``read``
    (:func:`value_bytes`, float32 for a float32 master)."""
    if stored is None or read is None or stored == read or info.shape is None:
        return 0.0
    copy = local_bytes(info.shape, resharded_itemsize(info, ctx.optimizer.mixed_precision), read, ctx.mesh_shape)
    return copy + (value_bytes(info, read, ctx) if gradient else 0.0)


def _gathered_reads(nodes: Mapping[str, NodeInfo], inputs: Mapping[str, list[str]], needs_grad: Mapping[str, bool],
                    ops: list[str]) -> tuple[dict[str, Counter[GatheredRead]], dict[str, Counter[GatheredRead]]]:
    """Per op, the parameter reads of its block (:func:`~autoplan.trace.repeated.block_of`; an
    op outside blocks: its own) with the gradients of the trained ones, and those of the block
    the backward runs next (the one before it), without them."""
    blocks: dict[tuple[str, int] | str, Counter[GatheredRead]] = {}
    key_of: dict[str, tuple[str, int] | str] = {}
    for name in ops:
        key_of[name] = block_of(nodes[name].module) or name
        reads = blocks.setdefault(key_of[name], Counter())
        reads.update(GatheredRead(name, pos, needs_grad.get(source, False))
                     for pos, source in enumerate(inputs.get(name, []))
                     if source in nodes and nodes[source].kind == "parameter")
    own = {name: blocks[key_of[name]] for name in ops}
    prefetched: dict[str, Counter[GatheredRead]] = {}
    for name in ops:
        key = key_of[name]
        before = blocks.get((key[0], key[1] - 1)) if isinstance(key, tuple) else None
        prefetched[name] = Counter({read._replace(gradient=False): n for read, n in before.items()}) \
            if before else Counter()
    return own, prefetched


def peak_moments(nodes: Mapping[str, NodeInfo], inputs: Mapping[str, list[str]], needs_grad: Mapping[str, bool],
                 outputs: Iterable[str], ctx: CostContext) -> list[Held]:
    """The moments of the backward that may hold the most above the kept values, each the
    values alive together (node name or :class:`GatheredRead` -> times counted; see the module
    docstring): every op's gradients with the returned outputs and its block's gathered
    parameters, and within a recomputed layer its recomputed values with each of its ops'
    gradients, gathered parameters and the outputs outside it. ``inputs`` are each op's tensor
    inputs, ``outputs`` the graph's model outputs (the loss left out)."""
    return [sum(parts[1:], Counter(parts[0])) for parts in peak_moment_parts(nodes, inputs, needs_grad, outputs, ctx)]


def peak_moment_parts(nodes: Mapping[str, NodeInfo], inputs: Mapping[str, list[str]], needs_grad: Mapping[str, bool],
                      outputs: Iterable[str], ctx: CostContext) -> list[tuple[Held, ...]]:
    """:func:`peak_moments`, each moment as the parts it sums (every count positive), the parts
    a recomputed layer's moments share being the same objects: a moment's bytes are its parts'
    bytes added, each part's counted once (a layer of ``n`` ops has ``n`` moments that each hold
    its recomputed values)."""
    ops = [name for name, info in nodes.items() if info.kind == "op"]
    own_reads, prefetched_reads = _gathered_reads(nodes, inputs, needs_grad, ops)
    gradients: dict[str, Held] = {}
    for name in ops:
        held: Held = Counter()
        if needs_grad.get(name, False):
            held[name] += 1
            held.update(i for i in inputs.get(name, []) if i in nodes and needs_grad.get(i, False))
            if aten_name(nodes[name]) in _KEEPS_INPUT_SIZED and inputs.get(name):
                held[inputs[name][0]] += 1
        held.update(own_reads[name])
        held.update(prefetched_reads[name])
        gradients[name] = held
    regions: dict[str, list[str]] = {}
    for name in ops:
        region = ctx.region_of(name)
        if region is not None:
            regions.setdefault(region, []).append(name)
    returned = Counter(name for name in outputs if name in nodes)
    moments: list[tuple[Held, ...]] = [(held, returned) for name, held in gradients.items()
                                       if ctx.region_of(name) is None]
    for members in regions.values():
        inside = set(members)
        values = Counter(name for name in members if moved_bytes(nodes[name]) > 0 and ctx.recomputes(name))
        alive = Counter({name: n for name, n in returned.items() if name not in inside})
        moments += [(values, gradients[name], alive) for name in members]
    return moments


def backward_transient(nodes: Mapping[str, NodeInfo], chosen: Mapping[str, Strategy],
                       inputs: Mapping[str, list[str]], needs_grad: Mapping[str, bool],
                       outputs: Iterable[str], ctx: CostContext) -> float:
    """Bytes per device the backward holds above the kept values at its peak under the plan
    ``chosen``: its largest moment (:func:`peak_moments`)."""
    sizes: dict[str | GatheredRead, float] = {}

    def stored(name: str) -> ShardingSpec | None:
        strategy = chosen.get(name)
        return strategy.output_spec if strategy and strategy.output_specs else None

    def out_bytes(key: str | GatheredRead) -> float:
        if key not in sizes:
            if isinstance(key, GatheredRead):
                source = inputs[key.consumer][key.position]
                consumer = chosen.get(key.consumer)
                read = consumer.input_specs[key.position] if consumer and key.position < len(
                    consumer.input_specs) else None
                sizes[key] = gathered_bytes(nodes[source], stored(source), read, key.gradient, ctx)
            else:
                sizes[key] = value_bytes(nodes[key], stored(key), ctx)
        return sizes[key]

    part_bytes: dict[int, float] = {}

    def bytes_of(part: Held) -> float:
        if id(part) not in part_bytes:
            part_bytes[id(part)] = sum(n * out_bytes(name) for name, n in part.items())
        return part_bytes[id(part)]

    moments = peak_moment_parts(nodes, inputs, needs_grad, outputs, ctx)
    return max((sum(map(bytes_of, parts)) for parts in moments), default=0.0)
