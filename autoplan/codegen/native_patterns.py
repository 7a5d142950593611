"""Recognising the plans PyTorch runs natively: one device, pure data parallelism (DDP),
fully sharded data parallelism (FSDP2's ``fully_shard``, and HSDP on a 2-D mesh), each with
checkpointed layers, and
Megatron column/row pairs (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``), and the
collectives each native program runs in place of the plan's."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement

from autoplan.codegen.native_fsdp import root_holds_replicated
from autoplan.cost_models.communication import CollectiveKind
from autoplan.load import ModelSpec
from autoplan.plan_schema import (ATTENTION_OPS, NodePlan, ParamStorage, Phase, Plan,
                                  PlannedCollective, RecomputeMode, kept_outputs)
from autoplan.sharding import parse_placement
from autoplan.strategies.letters import op_name
from autoplan.trace.batch_coupling import op_argument
from autoplan.trace.graph import TracedGraph

if TYPE_CHECKING:
    from autoplan.codegen.native_storage import ParameterStorage

_LINEAR = "aten.linear.default"
MEAN_OPS = ("aten.mean.default",)
_CROSS_ENTROPY = "aten.cross_entropy_loss.default"
_MEAN_REDUCTION = 1  # aten's Reduction::Mean
_SKIPPED = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")


@dataclass(frozen=True)
class CollectiveMapping:
    """One planned collective (or group) and what the native program does for it."""

    planned: str  # "all_reduce x4 backward (gradient, bucketed)"
    native: str  # "DDP reducer: all-reduce of gradient buckets"
    observable: bool  # whether the collective counter is expected to count it one for one


@dataclass
class Recognised:
    """What :func:`recognise` found: ``kind`` and, for tensor parallelism, the styles by
    module FQN (``("colwise", output placement or None)`` / ``("rowwise", output placement)`` /
    ``("sequence", Shard(sequence dim))``) and the input placements of the column modules that
    gather a sequence-sharded value (``input_layouts``); ``token_mean``: the loss is a
    cross-entropy averaged over the tokens it does not ignore, which data-parallel programs
    divide by the global batch's count (:mod:`autoplan.codegen.token_mean`)."""

    kind: str
    styles: dict[str, tuple[str, DPlacement | None]]
    reason: str = ""
    token_mean: bool = False
    input_layouts: dict[str, DPlacement] = field(default_factory=dict)  # column modules reading a sharded value
    # False for ZeRO-2 (parameters whole, gradients and optimizer state sharded): FSDP2 keeps a
    # group's gathered parameters from its forward through its backward
    reshard_after_forward: bool = True
    # an FSDP or HSDP plan's parameters by how FSDP2 and the parallel styles hold them
    storage: ParameterStorage | None = None
    # per layer recomputed by the per-op policy, the submodules whose products it keeps (:func:`kept_modules`)
    kept_modules: dict[str, list[str]] = field(default_factory=dict)
    # the sharded parameters held gathered through the step's microbatches, their gradients
    # reduced once a step (:attr:`~autoplan.plan_schema.ParamStorage.held`; with
    # ``reshard_after_forward=False``)
    held_through_step: bool = False


# --------------------------------------------------------------------------------------------
# recognition


def spec_text(specs: Sequence[str] | None) -> str | None:
    """A placement list as one word (``S(0)R``), for reasons."""
    return None if specs is None else "".join(specs)


def is_whole(specs: Sequence[str] | None) -> bool:
    """Whether ``specs`` replicate the value over every mesh axis (or say nothing)."""
    return specs is None or all(parse_placement(s).is_replicate for s in specs)


def shard_dim(specs: Sequence[str] | None) -> int | None:
    if specs is None or len(specs) != 1:
        return None
    p = parse_placement(specs[0])
    return p.dim if p.is_shard else None


def batch_dim(specs: Sequence[str] | None) -> int | None:
    """The dim a user input is split on over every mesh axis (``S(d)`` on a 1-D mesh,
    ``[S(d), S(d)]`` on HSDP's 2-D one), else None."""
    dims = {shard_dim([s]) for s in specs or ()}
    return dims.pop() if len(dims) == 1 else None


def _is_partial(specs: Sequence[str] | None) -> bool:
    return specs is not None and len(specs) == 1 and not parse_placement(specs[0]).is_replicate \
        and not parse_placement(specs[0]).is_shard


def op_nodes(graph: TracedGraph) -> list[torch.fx.Node]:
    """The graph's op calls in order, less ``getitem`` and export's assertions."""
    out = []
    for n in graph.graph_module.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if any(s in name for s in _SKIPPED):
            continue
        out.append(n)
    return out


def _planned_ops(graph: TracedGraph, plan: Plan) -> list[tuple[torch.fx.Node, NodePlan]]:
    """The graph's op nodes with their plans, in graph order."""
    plans = {p.name: p for p in plan.nodes}
    return [(node, plans[node.name]) for node in op_nodes(graph) if node.name in plans]


def tensor_inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    """``n``'s tensor-valued inputs, in the order its plan lists their placements."""
    return [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def target_name(n: torch.fx.Node) -> str:
    """``n``'s op as ``aten.linear.default``."""
    return str(n.target)


def loss_node(graph: TracedGraph) -> torch.fx.Node | None:
    """The node of the graph's first output, the loss."""
    out = next(n for n in graph.graph_module.graph.nodes if n.op == "output")
    results = out.args[0]
    first = results[0] if isinstance(results, (tuple, list)) else results
    return first if isinstance(first, torch.fx.Node) else None


def has_batch_norm(graph: TracedGraph, module: torch.nn.Module) -> bool:
    """Whether the model normalises over its batch (per-rank statistics would differ)."""
    if any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in module.modules()):
        return True
    return any("batch_norm" in target_name(n) for n in op_nodes(graph))


def writes_buffers(graph: TracedGraph) -> bool:
    """Whether the exported forward writes a buffer (running statistics)."""
    ep = graph.exported
    if ep is None:
        return False
    return bool(getattr(ep.graph_signature, "buffers_to_mutate", {}))


def zero_storage(spec: ModelSpec, plan: Plan) -> str | None:
    """How the plan stores the gradients and optimizer states of its parameters: None where
    every one is stored as its parameter, ``"zero2"`` where every parameter is whole and its
    gradient and optimizer state are stored sharded on dim 0 over a 1-D mesh, else a reason
    (ZeRO-1, ZeRO-2 on some parameters, on another dim or on a 2-D mesh), which FSDP2 does not
    store so."""
    parameters = dict(spec.module.named_parameters(remove_duplicate=False))
    stored = {fqn: plan.storage[fqn] for fqn in parameters if fqn in plan.storage}
    if all(s.grad == s.param and s.optimizer_state == s.param for s in stored.values()):
        return None
    shard = ["S(0)"]
    for fqn, s in stored.items():
        if s.grad == s.param and s.optimizer_state != s.param:
            return f"{fqn}'s optimizer state is sharded under a whole gradient (ZeRO-1)"
        if not is_whole(s.param) or list(s.grad) != shard or list(s.optimizer_state) != shard:
            return f"{fqn} is stored {spec_text(s.param)}, its gradient {spec_text(s.grad)} and optimizer state " \
                   f"{spec_text(s.optimizer_state)}: not ZeRO-2 on dim 0 of a 1-D mesh"
    return "zero2"


def _storage_kind(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> str | ParameterStorage:
    """``"replicated"`` when every parameter is whole on every device of a 1-D mesh,
    ``"zero2"`` when every one is whole, its gradient and optimizer state sharded
    (:func:`zero_storage`), otherwise how FSDP2 and the parallel styles hold each one
    (:func:`~autoplan.codegen.native_storage.parameter_storage`: sharded over the last mesh axis
    and gathered at use, ZeRO-2, whole, or a table read in place; on a 2-D mesh replicated over
    axis 0, HSDP's), else a reason."""
    from autoplan.codegen.native_storage import parameter_storage  # it reads this module's helpers

    zero = zero_storage(spec, plan)
    if zero == "zero2" and all(is_whole(p) for p in plan.params.values()):
        return zero
    found = parameter_storage(spec, graph, plan)
    if isinstance(found, str):
        return found
    if len(plan.mesh) == 1 and not (found.shard_dims or found.zero2 or found.embeddings):
        return "replicated"
    if len(plan.mesh) == 2 and not found.shard_dims:
        return "no parameter is stored sharded over axis 1 (HSDP)"
    managed = {*found.shard_dims, *found.zero2, *found.table_names()}
    if root_holds_replicated(spec.module, managed):
        return "the root module holds a parameter kept whole beside sharded ones"
    return found


def held_as_sharded(plan: Plan) -> Plan:
    """``plan`` with its held parameters stored as FSDP stores them between steps (in their
    optimizer state's placements), so that recognition reads them as sharded parameters
    gathered at use; when the gathers run (once a step) is the program's to carry out."""
    storage = {fqn: ParamStorage(s.optimizer_state, s.optimizer_state, s.optimizer_state) if s.held else s
               for fqn, s in plan.storage.items()}
    params = {fqn: list(plan.storage[fqn].optimizer_state) if fqn in plan.storage and plan.storage[fqn].held
              else specs for fqn, specs in plan.params.items()}
    return dataclasses.replace(plan, storage=storage, params=params)


def split_axes(specs: Sequence[str]) -> tuple[int | None, int]:
    """The batch dim an input is split on over the leading axes of ``specs`` and how many of
    them split it (``[S(0), R]``: dim 0 over axis 0; whole: ``(None, 0)``)."""
    k = len(specs)
    while k and is_whole(specs[k - 1:k]):
        k -= 1
    return (batch_dim(specs[:k]), k) if k else (None, 0)


def batch_split(spec: ModelSpec, graph: TracedGraph, plan: Plan, axes: int,
                ids: frozenset[str] = frozenset()) -> str | None:
    """Why the plan does not split the batch over the mesh's first ``axes`` axes as a data-parallel
    program can (None: it does): every user input split on one batch dim over those axes, evenly,
    or whole, and whole over the others (an input in ``ids``, read by embeddings only, may be split
    over the leading ones only); at least one split; no batch norm, no buffer written."""
    sharded_inputs = 0
    for name, value in zip(graph.input_names, spec.example_inputs):
        specs = plan.inputs.get(name, ["R"] * len(plan.mesh))
        if not is_whole(specs[axes:]):
            return f"input {name} is {spec_text(specs)}: sharded over a tensor axis"
        if is_whole(specs[:axes]):
            continue
        d, k = split_axes(specs[:axes])
        if k < axes and name not in ids:
            return f"input {name} is {spec_text(specs)}: not batch-sharded over every data axis"
        if d is None or not isinstance(value, torch.Tensor) or value.shape[d] % math.prod(plan.mesh[:k]):
            return f"input {name} is {spec_text(specs)}: not evenly batch-sharded"
        sharded_inputs += 1
    if not sharded_inputs:
        return "no input is batch-sharded"
    if has_batch_norm(graph, spec.module):
        return "batch norm: per-rank statistics differ from the global batch's"
    if writes_buffers(graph):
        return "the forward writes buffers"
    return None


def reduced_in_parameters(c: PlannedCollective, same: frozenset[str]) -> bool:
    """Whether ``c`` is the backward all-reduce of a value the same on every rank (``same``: a
    learned position embedding added to batch-sharded tokens) whose gradient the batch's shards
    leave as partial sums. The plan reduces that gradient on the edge; DDP reduces the gradients of
    the parameters the value was computed from, in its buckets, and FSDP2 in their groups'
    reduce-scatters. The backward of such a value is the same linear map on every rank, so the
    two sums are equal: the reduction moves, it does not change."""
    producer = c.where.split(" -> ")[0]
    return (c.phase == Phase.BACKWARD and c.tensor == "activation" and c.kind == CollectiveKind.ALL_REDUCE
            and " (" not in producer and producer in same)


def _recognise_data_parallel(spec: ModelSpec, graph: TracedGraph, plan: Plan, n: int) -> Recognised | str:
    """DDP (every parameter replicated), FSDP or HSDP (parameters stored sharded and gathered at
    use, beside ZeRO-2 ones, whole ones and embedding tables read in place), or ZeRO-2
    everywhere; the batch split over the ranks, the loss a mean."""
    storage = _storage_kind(spec, graph, plan)
    if isinstance(storage, str) and storage not in ("replicated", "zero2"):
        return storage
    held = None if isinstance(storage, str) else storage
    why = batch_split(spec, graph, plan, len(plan.mesh), held.lookup_ids() if held else frozenset())
    if why:
        return why
    loss = loss_node(graph)
    token_mean = loss is not None and is_token_mean(graph, loss)
    weights = ("parameter",) if storage != "replicated" else ()
    counts = ("loss count",) if token_mean else ()
    lookups = {read.node for read in held.embeddings.values()} if held else set()
    same = graph.input_free_values
    for c in plan.collectives:
        if c.where.split(" -> ")[0] in lookups and c.tensor == "activation":
            continue  # an embedding's output moved onto the batch shards, by its parallel style
        if reduced_in_parameters(c, same):
            continue  # DDP and FSDP2 reduce it in the gradients of the parameters it comes from
        if c.phase == "forward" and not c.where.endswith("-> output") and c.tensor not in (*weights, *counts):
            return f"the plan has an activation collective ({c.kind} at {c.where})"
        if c.phase == "backward" and c.tensor not in ("gradient", *weights, *counts):
            return f"the plan has an activation collective in the backward ({c.kind} at {c.where})"
    for node, p in _planned_ops(graph, plan):
        if any(_is_partial(s) for s in p.outputs) and node.name not in lookups:
            if node is not loss:
                return f"{node.name} makes partial sums and is not the loss"
            if target_name(node) not in MEAN_OPS and not token_mean:
                return f"the loss is {target_name(node)}, not a mean: the ranks' gradient average would differ"
    kind = "ddp" if storage == "replicated" else "hsdp" if len(plan.mesh) == 2 else "fsdp"
    return Recognised(kind, {}, token_mean=token_mean, reshard_after_forward=storage != "zero2", storage=held)


def is_token_mean(graph: TracedGraph, loss: torch.fx.Node) -> bool:
    """Whether ``loss`` is the graph's only cross-entropy, averaged over the targets it does not
    ignore (class indices, no class weights)."""
    if target_name(loss) != _CROSS_ENTROPY:
        return False
    if sum(target_name(n) == _CROSS_ENTROPY for n in graph.graph_module.graph.nodes) != 1:
        return False
    target = op_argument(loss, "target")
    value = target.meta.get("val") if isinstance(target, torch.fx.Node) else None
    mean = op_argument(loss, "reduction", _MEAN_REDUCTION) == _MEAN_REDUCTION
    return mean and op_argument(loss, "weight") is None and isinstance(value, torch.Tensor) \
        and not value.is_floating_point()


def _unrecomputable(spec: ModelSpec, plan: Plan) -> str | None:
    """Why the plan's recomputed layers cannot run as checkpointed modules (None: they can)."""
    for layer in plan.recompute:
        try:
            spec.module.get_submodule(layer.layer)
        except AttributeError:
            return f"recomputed layer {layer.layer!r} is not a module"
    return None


_SHAPE_OPS = frozenset({"view", "reshape", "_unsafe_view", "t", "transpose", "permute", "contiguous", "unsqueeze",
                        "squeeze", "flatten", "sym_size"})


def inside_module(module: str, layer: str) -> bool:
    """Whether the module named ``module`` is ``layer`` or lies inside it."""
    return module == layer or module.startswith(f"{layer}.")


def kept_modules(graph: TracedGraph, plan: Plan) -> dict[str, list[str]] | str:
    """For each layer the plan recomputes by the per-op policy, the submodules whose matrix
    product it keeps, so that a checkpointed module keeps the same outputs
    (:class:`~autoplan.codegen.checkpointing.KeptModules`); else why not. Each kept product
    must be the only product of a submodule of the layer that runs nothing else but shape ops
    (an ``nn.Linear``: its one ``linear``), so that marking the submodule's call marks the
    product in the forward and in the recomputation alike; the attention is kept wherever it
    runs. Products the plan's layer holds outside the module (the head after the last block)
    run once and keep their outputs, as in every native checkpointed layer."""
    by_name = {n.name: n for n in graph.graph_module.graph.nodes}
    found: dict[str, list[str]] = {}
    for layer in plan.recompute:
        if layer.mode != RecomputeMode.PER_OP:
            continue
        calls = [by_name[name] for name in layer.nodes if name in by_name and by_name[name].op == "call_function"]
        kept = kept_outputs(((n.name, op_name(n)) for n in calls), RecomputeMode.PER_OP)
        inside = [n for n in calls if n.name in graph.nodes and inside_module(graph.nodes[n.name].module, layer.layer)]
        modules = []
        for node in inside:
            if node.name not in kept or op_name(node) in ATTENTION_OPS:
                continue
            owner = graph.nodes[node.name].module
            held = [n for n in inside if inside_module(graph.nodes[n.name].module, owner)]
            if owner == layer.layer or any(n is not node and op_name(n) not in _SHAPE_OPS for n in held):
                return f"{layer.layer}: its kept {node.name} is not the one op of a submodule ({owner or 'root'})"
            modules.append(owner)
        found[layer.layer] = modules
    return found


def _recognise_tp(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised | str:
    plans = {p.name: p for p in plan.nodes}
    if any(fqn in graph.tied or fqn in graph.tied.values() for fqn, s in plan.params.items() if not is_whole(s)):
        return "a tied parameter is sharded"
    if any(not is_whole(s) for s in plan.inputs.values()):
        return "a user input is sharded"
    ops = op_nodes(graph)
    sharded_params = {fqn for fqn, s in plan.params.items() if not is_whole(s)}
    if not sharded_params:
        return "every parameter is replicated"
    styles: dict[str, tuple[str, DPlacement | None]] = {}
    covered: set[str] = set()  # params handled by a style
    in_region: set[str] = set()  # op nodes inside a col -> row pair
    downstream: set[str] = set()  # op nodes after a row-parallel linear
    paired: set[str] = set()  # column-parallel modules that found their row partner
    infos = graph.nodes
    for node in ops:
        info = infos.get(node.name)
        p = plans.get(node.name)
        if info is None or p is None:
            continue
        reads = [fqn for fqn in info.params if fqn in sharded_params]
        if not reads:
            continue
        if target_name(node) != _LINEAR or len(p.inputs) < 2:
            return f"{node.name} ({target_name(node)}) reads sharded {reads[0]}: not a linear"
        mod_name = info.module
        try:
            mod = spec.module.get_submodule(mod_name)
        except AttributeError:
            return f"no module {mod_name!r}"
        if not isinstance(mod, torch.nn.Linear) or mod_name in styles:
            return f"{mod_name or 'root'} is not one nn.Linear call"
        w, b = f"{mod_name}.weight", f"{mod_name}.bias"
        wspec = plan.params.get(w)
        if shard_dim(wspec) == 0:  # column parallel
            if not is_whole(p.inputs[0]) or (mod.bias is not None and shard_dim(plan.params.get(b)) != 0):
                return f"{mod_name}: column-sharded but input {spec_text(p.inputs[0])}, " \
                       f"bias {spec_text(plan.params.get(b))}"
            out_dim = len(node.meta["val"].shape) - 1
            if shard_dim(p.outputs[0]) != out_dim:
                return f"{mod_name}: output {spec_text(p.outputs[0])}, expected S({out_dim})"
            styles[mod_name] = ("colwise", None)
        elif shard_dim(wspec) == 1:  # row parallel: find its column partner up the chain
            last = len(node.meta["val"].shape) - 1
            if shard_dim(p.inputs[0]) != last or not _is_partial(p.outputs[0]):
                return f"{mod_name}: row-sharded but input {spec_text(p.inputs[0])} output {spec_text(p.outputs[0])}"
            chain, cur = [], tensor_inputs(node)[0]
            while True:
                if cur.op != "call_function" or len(cur.users) != 1:
                    return f"{mod_name}: its input does not come from a column-parallel linear alone"
                cp = plans.get(cur.name)
                if target_name(cur) == _LINEAR and infos[cur.name].module in styles \
                        and styles[infos[cur.name].module][0] == "colwise":
                    break
                if cp is None or len(tensor_inputs(cur)) != 1 or \
                        any(shard_dim(s) != last for s in [*cp.inputs, *cp.outputs] if s is not None):
                    return f"{mod_name}: {cur.name} between the pair is not an element-wise op on S({last})"
                chain.append(cur.name)
                cur = tensor_inputs(cur)[0]
            partner = infos[cur.name].module
            if partner in paired:
                return f"{partner} feeds two row-parallel linears"
            paired.add(partner)
            in_region.update(chain)
            in_region.update({cur.name, node.name})
            # the layout the consumers want
            wanted = set()
            for user in node.users:
                up = plans.get(user.name)
                if up is None:
                    continue
                idx = tensor_inputs(user).index(node)
                wanted.add(spec_text(up.inputs[idx]))
            layouts = {("R" if w_ in ("R", "P") else w_) for w_ in wanted}
            if len(layouts) > 1:
                return f"{mod_name}: consumers want {sorted(wanted)}"
            layout = layouts.pop() if layouts else "R"
            d = shard_dim([layout]) if layout != "R" else None
            styles[mod_name] = ("rowwise", Shard(d) if d is not None else Replicate())
            for later in node.users:
                _mark_downstream(later, downstream)
        else:
            return f"{w} is {spec_text(wspec)}: neither column (S(0)) nor row (S(1)) sharded"
        covered.update({w, b})
    if sharded_params - covered:
        return f"{min(sharded_params - covered)} is sharded outside a linear pair"
    unpaired = [m for m, (k, _) in styles.items() if k == "colwise" and m not in paired]
    if unpaired:
        return f"column-parallel {unpaired[0]} has no row-parallel partner"
    for node in ops:
        p = plans.get(node.name)
        if p is None or node.name in in_region:
            continue
        specs = [s for s in [*p.inputs, *p.outputs] if s is not None]
        if node.name in downstream:
            if any(not (is_whole(s) or _is_partial(s) or shard_dim(s) is not None) for s in specs):
                return f"{node.name}: placements {specs}"
            continue
        if any(not is_whole(s) for s in specs):
            return f"{node.name} is {[spec_text(s) for s in specs]} outside a column/row pair"
    return Recognised("tensor_parallel", styles)


def _mark_downstream(node: torch.fx.Node, seen: set[str]) -> None:
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur.name in seen or cur.op != "call_function":
            continue
        seen.add(cur.name)
        stack.extend(cur.users)


def replicated_throughout(plan: Plan) -> bool:
    """Whether every device of ``plan`` computes the whole step alike: every input, parameter
    (its gradient and optimizer state too) and value whole, and not one collective (a small
    model on devices whose links cost more than the work they would split)."""
    return not plan.collectives and all(is_whole(specs) for specs in plan.inputs.values()) \
        and all(is_whole(specs) for specs in plan.params.values()) \
        and all(is_whole(s.param) and is_whole(s.grad) and is_whole(s.optimizer_state) for s in plan.storage.values()) \
        and all(is_whole(out) for node in plan.nodes for out in node.outputs)


def recognise(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised:
    """Which native pattern ``plan`` reduces to: ``kind`` is ``"single"``, ``"replicated"``, ``"ddp"``,
    ``"fsdp"``, ``"hsdp"``, ``"fsdp_tp"`` or ``"tensor_parallel"``, or ``"none"`` (then
    ``reason`` says why, for the pattern that came closest). A plan of one stage that
    accumulates microbatches is recognised on ``spec`` and ``graph`` of one microbatch, as
    DDP, FSDP, HSDP or FSDP x TP only."""
    if len(plan.mesh) > 2:
        return Recognised("none", {}, f"mesh {plan.mesh} has more than two axes")
    if len(plan.stages) > 1:
        return Recognised("none", {}, "pipeline stages")
    held = {fqn for fqn, s in plan.storage.items() if s.held}
    if held:
        found = recognise(spec, graph, held_as_sharded(plan))
        if found.kind != "fsdp":  # (HSDP and FSDP x TP held: on the interpreter, untried natively)
            return found if found.kind == "none" else \
                Recognised("none", {}, f"parameters held gathered through the microbatches under {found.kind}")
        gathered = set(found.storage.shard_dims) if found.storage is not None else set()
        if gathered != held:
            return Recognised("none", {}, "some parameters held gathered through the microbatches, others "
                                          "gathered in every microbatch")
        return dataclasses.replace(found, reshard_after_forward=False, held_through_step=True)
    unrecomputable = _unrecomputable(spec, plan)
    if unrecomputable:
        return Recognised("none", {}, unrecomputable)
    n = math.prod(plan.mesh)
    accumulated = plan.microbatches > 1  # (``spec``'s inputs are then one microbatch's)
    if n == 1:
        return Recognised("single", {}) if not accumulated else \
            Recognised("none", {}, "microbatches accumulated on one device")
    if not accumulated and replicated_throughout(plan):
        return Recognised("replicated", {})
    found = _recognise_data_parallel(spec, graph, plan, n)
    if isinstance(found, Recognised):
        return found
    if accumulated and len(plan.mesh) == 1:
        return Recognised("none", {}, f"microbatches accumulated, not data parallel ({found})")
    if len(plan.mesh) != 1:
        from autoplan.codegen.native_fsdp_tp import recognise_fsdp_tp  # it reads this module's helpers

        composed = recognise_fsdp_tp(spec, graph, plan)
        if isinstance(composed, Recognised):
            return composed
        return Recognised("none", {}, f"mesh {plan.mesh} is 2-D and the plan is neither HSDP ({found}) "
                                      f"nor FSDP x TP ({composed})")
    if plan.recompute:
        return Recognised("none", {}, f"not data parallel ({found}); layers recomputed under tensor parallelism")
    tp = _recognise_tp(spec, graph, plan)
    if isinstance(tp, Recognised):
        zero = zero_storage(spec, plan)
        return tp if zero is None else Recognised("none", {}, f"Megatron with ZeRO storage ({zero})")
    return Recognised("none", {}, f"not data parallel ({found}); not Megatron ({tp})")
