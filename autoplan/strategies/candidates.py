"""Candidate sharding strategies per node on a device mesh.

A strategy assigns to every mesh axis one *letter* of the op's index map (see
:mod:`autoplan.strategies.index_maps`), or nothing (the axis replicates the op), or — for linear
ops — ``P`` (partial sums flow through). From that assignment follow the spec each input must
arrive in, the spec of each output, how many ways the work is split, and which input
gradients come out as partial sums in the backward (an axis sharded on a letter that the
input lacks: the input was replicated over devices that each used it for a different slice of
the work). Strategies whose shapes the mesh does not divide are absent, never "infinitely
expensive".
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

from torch import fx

from autoplan.sharding import P, Placement, R, S, ShardingSpec, is_valid, spec_name
from autoplan.strategies.index_maps import IndexMap, Letters

NO_LETTER = ""
PARTIAL = "+"


@dataclass(frozen=True)
class Strategy:
    """One way to run one node.

    ``input_specs[i]`` is the spec the node's i-th tensor input must arrive in (``None``:
    the value is not read, any spec will do); ``output_specs`` one spec per tensor output.
    ``compute_shards`` is how many ways the work is split. ``partial_grads`` lists
    ``(input position, mesh axis)`` pairs whose gradient leaves the backward as partial sums,
    to be reduced into the producer's placement (the dual of using a replicated input for
    sharded work). ``count_reductions`` are the mesh axes on which the op all-reduces a
    scalar (the target count of a mean loss whose batch is sharded: in the forward, once the
    loss is needed for a gradient);
    ``whole_grad_axes`` those on which every input's gradient comes back replicated.
    A stored parameter's strategy may shard what the optimizer holds unlike the parameter:
    ``state_spec`` for its optimizer state (ZeRO-1), ``grad_spec`` for its reduced gradient
    too (ZeRO-2); ``None`` keeps them as the parameter. ``held``: the parameter itself is stored
    in ``state_spec`` too (FSDP's shard) and gathered into ``output_spec`` once per step, held
    there through the step's microbatches (:attr:`~autoplan.plan_schema.ParamStorage.held`).
    """

    name: str
    input_specs: tuple[ShardingSpec | None, ...]
    output_specs: tuple[ShardingSpec, ...]
    compute_shards: int
    partial_grads: tuple[tuple[int, int], ...] = ()
    count_reductions: tuple[int, ...] = ()
    whole_grad_axes: frozenset[int] = frozenset()
    grad_spec: ShardingSpec | None = None
    state_spec: ShardingSpec | None = None
    held: bool = False

    @property
    def output_spec(self) -> ShardingSpec:
        return self.output_specs[0]

    def partial_axes(self, position: int) -> frozenset[int]:
        """Mesh axes on which input ``position``'s gradient leaves as partial sums."""
        if not self.partial_grads:
            return frozenset()
        return frozenset(axis for pos, axis in self.partial_grads if pos == position)


def _placement(letter: str, letters: Letters, partial_if_reduced: bool, imap: IndexMap) -> Placement:
    if letter == PARTIAL:
        return P
    if letter == NO_LETTER:
        return R
    if letter in letters:
        return S(letters.index(letter))
    if partial_if_reduced and letter in imap.reducible:
        return P
    return R


def _spec(assignment: tuple[str, ...], letters: Letters, partial_if_reduced: bool, imap: IndexMap) -> ShardingSpec:
    """The spec of a tensor with ``letters``; outputs (and addends, which join the output's
    sum) are partial on axes sharding a reduced letter."""
    return tuple(_placement(a, letters, partial_if_reduced, imap) for a in assignment)


def strategy_name(inputs: tuple[ShardingSpec | None, ...], outputs: tuple[ShardingSpec, ...]) -> str:
    """Alpa-style readable name: ``RS0 = RR x S0R`` (output = inputs), with ``(P @ axes)``
    when the output holds partial sums awaiting a reduction."""
    ins = " x ".join(spec_name(s) if s is not None else "*" for s in inputs) or "()"
    name = f"{spec_name(outputs[0]) if outputs else '-'} = {ins}"
    partial_axes = [str(i) for i, p in enumerate(outputs[0]) if p.is_partial] if outputs else []
    if partial_axes:
        name += f" (P @ {','.join(partial_axes)})"
    return name


def enumerate_strategies(imap: IndexMap, input_names: list[str], mesh_shape: tuple[int, ...],
                         differentiable_inputs: frozenset[str] = frozenset(),
                         allow_partial: bool = True, dims_over_axes: bool = False,
                         memo: dict | None = None) -> list[Strategy]:
    """Every valid strategy of an op with index map ``imap`` on a mesh of ``mesh_shape``,
    memoised in ``memo`` where given (by what the answer depends on: the letters and shapes
    of each input position and output, not the inputs' names, so that the ops of every copy
    of a block share one enumeration).

    ``input_names`` fixes the order of ``Strategy.input_specs``. Each mesh axis gets a
    shardable letter, no letter, or (linear ops on floating values, when ``allow_partial``)
    partial sums. Two axes get distinct letters unless ``dims_over_axes``: then a letter may
    be split over several axes (``S(0)S(0)``: the batch over both axes of HSDP), the first
    axis cutting the dim into blocks and the next cutting each block, as DTensor lays out
    ``[Shard(0), Shard(0)]``.
    """
    if memo is not None:
        key = _enumeration_key(imap, input_names, mesh_shape, differentiable_inputs, allow_partial, dims_over_axes)
        if key not in memo:
            memo[key] = enumerate_strategies(imap, input_names, mesh_shape, differentiable_inputs, allow_partial,
                                             dims_over_axes)
        return list(memo[key])
    options = [NO_LETTER] + imap.shardable_letters() + ([PARTIAL] if imap.linear and allow_partial else [])
    per_axis = [options if n > 1 else [NO_LETTER] for n in mesh_shape]  # one device: nothing to split or sum
    strategies: list[Strategy] = []
    seen: set[tuple] = set()
    for assignment in itertools.product(*per_axis):
        real = [a for a in assignment if a not in (NO_LETTER, PARTIAL)]
        if not dims_over_axes and len(real) != len(set(real)):
            continue
        in_specs: list[ShardingSpec | None] = []
        valid = True
        for name in input_names:
            if name not in imap.inputs:  # read but not described: keep it whole
                in_specs.append((R,) * len(mesh_shape))
                continue
            letters = imap.inputs[name]
            if letters is None:
                in_specs.append(None)
                continue
            spec = _spec(assignment, letters, name in imap.addends, imap)
            if not is_valid(spec, imap.input_shapes[name], mesh_shape):
                valid = False
                break
            in_specs.append(spec)
        if not valid:
            continue
        out_specs = tuple(_spec(assignment, letters, True, imap) for letters in imap.outputs)
        if not all(is_valid(s, shape, mesh_shape) for s, shape in zip(out_specs, imap.output_shapes)):
            continue
        key = (tuple(in_specs), out_specs)
        if key in seen:
            continue
        seen.add(key)
        shards = math.prod(n for a, n in zip(assignment, mesh_shape) if a not in (NO_LETTER, PARTIAL))
        partial_grads = tuple(
            (pos, axis)
            for pos, name in enumerate(input_names)
            if name in differentiable_inputs and imap.inputs.get(name) is not None
            for axis, a in enumerate(assignment)
            if a not in (NO_LETTER, PARTIAL) and a not in imap.inputs[name]
            and not (name in imap.addends and a in imap.reducible)  # an addend's gradient is whole
        )
        counted = tuple(axis for axis, a in enumerate(assignment) if a in imap.counted)
        whole = frozenset(axis for axis, a in enumerate(assignment) if a in imap.whole_grads)
        strategies.append(Strategy(strategy_name(tuple(in_specs), out_specs), tuple(in_specs), out_specs,
                                   shards, partial_grads, counted, whole))
    return strategies


def _enumeration_key(imap: IndexMap, input_names: list[str], mesh_shape: tuple[int, ...],
                     differentiable_inputs: frozenset[str], allow_partial: bool, dims_over_axes: bool) -> tuple:
    """What :func:`enumerate_strategies` reads, by input position (names left out)."""
    positions = tuple((imap.inputs.get(name, False), imap.input_shapes.get(name), name in imap.addends,
                       name in differentiable_inputs) for name in input_names)
    return (positions, tuple(imap.inputs.values()), imap.outputs, imap.output_shapes, imap.reducible, imap.fixed,
            imap.linear, tuple(imap.sizes.items()), imap.counted, imap.whole_grads, mesh_shape, allow_partial,
            dims_over_axes)


def replicated_strategy(num_inputs: int, num_outputs: int, mesh_ndim: int) -> Strategy:
    """The fallback for an op without a rule: everything replicated."""
    rep = (R,) * mesh_ndim
    ins = tuple(rep for _ in range(num_inputs))
    outs = tuple(rep for _ in range(max(num_outputs, 1)))
    return Strategy(strategy_name(ins, outs), ins, outs, 1)


def tensor_specs(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims_over_axes: bool = False
                 ) -> list[ShardingSpec]:
    """Every valid spec of a stored tensor (parameter, buffer, user input): per mesh axis
    replicated or sharded on a dim no other axis shards (with ``dims_over_axes``: any dim; an
    axis of one device: replicated)."""
    options: list[Placement] = [R] + [S(d) for d in range(len(shape)) if shape[d] > 1]
    specs = []
    for spec in itertools.product(*[options if n > 1 else [R] for n in mesh_shape]):
        dims = [p.dim for p in spec if p.is_shard]
        if (dims_over_axes or len(dims) == len(set(dims))) and is_valid(spec, shape, mesh_shape):
            specs.append(tuple(spec))
    return specs


def storage_strategies(shape: tuple[int, ...], mesh_shape: tuple[int, ...], dims_over_axes: bool = False
                       ) -> list[Strategy]:
    """Strategies of a placeholder: one per spec it may be stored in."""
    return [Strategy(spec_name(spec), (), (spec,), 1) for spec in tensor_specs(shape, mesh_shape, dims_over_axes)]


def sharded_state_strategies(stored: Strategy, shape: tuple[int, ...], mesh_shape: tuple[int, ...],
                             gradients: bool, held: bool = False) -> list[Strategy]:
    """ZeRO-1 (and, with ``gradients``, ZeRO-2; with ``held``, the held variant) variants of a
    trained parameter ``stored`` as ``stored.output_spec``: on each mesh axis where the
    parameter is replicated, its optimizer state (and reduced gradient, or the parameter
    itself between steps) sharded on the first dim that axis may shard."""
    spec = stored.output_spec
    valid = set(tensor_specs(shape, mesh_shape))
    out = []
    for axis, placement in enumerate(spec):
        if placement != R or mesh_shape[axis] < 2:
            continue
        sharded = next((s for s in (spec[:axis] + (S(d),) + spec[axis + 1:] for d in range(len(shape)))
                        if s in valid), None)
        if sharded is None:
            continue
        out.append(replace(stored, name=f"{stored.name} zero1@{axis}", state_spec=sharded))
        if gradients:
            out.append(replace(stored, name=f"{stored.name} zero2@{axis}", grad_spec=sharded, state_spec=sharded))
        if held:
            out.append(replace(stored, name=f"{stored.name} held@{axis}", state_spec=sharded, held=True))
    return out


def tensor_input_nodes(node: fx.Node) -> list[fx.Node]:
    """The node's inputs that carry a tensor, in first-use order."""
    import torch

    return [n for n in node.all_input_nodes if isinstance(n.meta.get("val"), torch.Tensor)]
