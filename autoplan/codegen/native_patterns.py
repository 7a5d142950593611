"""Recognising the plans PyTorch runs natively: pure data parallelism (DDP) and Megatron
column/row pairs (``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``), and the
collectives each native program runs in place of the plan's."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement as DPlacement

from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan
from autoplan.sharding import parse_placement
from autoplan.trace.graph import TracedGraph

_LINEAR = "aten.linear.default"
_MEAN_OPS = ("aten.mean.default",)
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
    module FQN (``("colwise", None)`` / ``("rowwise", output placement)``)."""

    kind: str
    styles: dict[str, tuple[str, DPlacement | None]]
    reason: str = ""


# --------------------------------------------------------------------------------------------
# recognition


def _spec(specs: Sequence[str] | None) -> str | None:
    return None if specs is None else "".join(specs)


def _is_r(specs: Sequence[str] | None) -> bool:
    return specs is None or all(parse_placement(s).is_replicate for s in specs)


def shard_dim(specs: Sequence[str] | None) -> int | None:
    if specs is None or len(specs) != 1:
        return None
    p = parse_placement(specs[0])
    return p.dim if p.is_shard else None


def _is_partial(specs: Sequence[str] | None) -> bool:
    return specs is not None and len(specs) == 1 and not parse_placement(specs[0]).is_replicate \
        and not parse_placement(specs[0]).is_shard


def _op_nodes(graph: TracedGraph) -> list[torch.fx.Node]:
    out = []
    for n in graph.graph_module.graph.nodes:
        if n.op != "call_function" or n.target is operator.getitem:
            continue
        name = getattr(n.target, "__name__", str(n.target))
        if any(s in name for s in _SKIPPED):
            continue
        out.append(n)
    return out


def _tensor_inputs(n: torch.fx.Node) -> list[torch.fx.Node]:
    return [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]


def _target_name(n: torch.fx.Node) -> str:
    return str(n.target)


def _loss_node(graph: TracedGraph) -> torch.fx.Node | None:
    out = next(n for n in graph.graph_module.graph.nodes if n.op == "output")
    results = out.args[0]
    first = results[0] if isinstance(results, (tuple, list)) else results
    return first if isinstance(first, torch.fx.Node) else None


def _has_batch_norm(graph: TracedGraph, module: torch.nn.Module) -> bool:
    if any(isinstance(m, torch.nn.modules.batchnorm._NormBase) for m in module.modules()):
        return True
    return any("batch_norm" in _target_name(n) for n in _op_nodes(graph))


def _writes_buffers(graph: TracedGraph) -> bool:
    ep = graph.exported
    if ep is None:
        return False
    return bool(getattr(ep.graph_signature, "buffers_to_mutate", {}))


def _recognise_ddp(spec: ModelSpec, graph: TracedGraph, plan: Plan, n: int) -> Recognised | None | str:
    if any(not _is_r(p) for p in plan.params.values()):
        return "a parameter is sharded"
    sharded_inputs = 0
    for name, node in zip(graph.input_names, spec.example_inputs):
        specs = plan.inputs.get(name, ["R"])
        if _is_r(specs):
            continue
        d = shard_dim(specs)
        if d is None or not isinstance(node, torch.Tensor) or node.shape[d] % n:
            return f"input {name} is {_spec(specs)}: not evenly batch-sharded"
        sharded_inputs += 1
    if not sharded_inputs:
        return "no input is batch-sharded"
    if _has_batch_norm(graph, spec.module):
        return "batch norm: per-rank statistics differ from the global batch's"
    if _writes_buffers(graph):
        return "the forward writes buffers"
    for c in plan.collectives:
        if c.phase == "forward" and not c.where.endswith("-> output"):
            return f"the plan has an activation collective ({c.kind} at {c.where})"
        if c.phase == "backward" and c.tensor != "gradient":
            return f"the plan has an activation collective in the backward ({c.kind} at {c.where})"
    loss = _loss_node(graph)
    plans = {p.name: p for p in plan.nodes}
    for node in _op_nodes(graph):
        p = plans.get(node.name)
        if p is None:
            continue
        if any(_is_partial(s) for s in p.outputs):
            if node is not loss:
                return f"{node.name} makes partial sums and is not the loss"
            if _target_name(node) not in _MEAN_OPS:
                return f"the loss is {_target_name(node)}, not a mean: DDP's gradient average would differ"
    return Recognised("ddp", {})


def _recognise_tp(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised | str:
    plans = {p.name: p for p in plan.nodes}
    if any(fqn in graph.tied or fqn in graph.tied.values() for fqn, s in plan.params.items() if not _is_r(s)):
        return "a tied parameter is sharded"
    if any(not _is_r(s) for s in plan.inputs.values()):
        return "a user input is sharded"
    ops = _op_nodes(graph)
    sharded_params = {fqn for fqn, s in plan.params.items() if not _is_r(s)}
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
        if _target_name(node) != _LINEAR or len(p.inputs) < 2:
            return f"{node.name} ({_target_name(node)}) reads sharded {reads[0]}: not a linear"
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
            if not _is_r(p.inputs[0]) or (mod.bias is not None and shard_dim(plan.params.get(b)) != 0):
                return f"{mod_name}: column-sharded but input {_spec(p.inputs[0])}, bias {_spec(plan.params.get(b))}"
            out_dim = len(node.meta["val"].shape) - 1
            if shard_dim(p.outputs[0]) != out_dim:
                return f"{mod_name}: output {_spec(p.outputs[0])}, expected S({out_dim})"
            styles[mod_name] = ("colwise", None)
        elif shard_dim(wspec) == 1:  # row parallel: find its column partner up the chain
            last = len(node.meta["val"].shape) - 1
            if shard_dim(p.inputs[0]) != last or not _is_partial(p.outputs[0]):
                return f"{mod_name}: row-sharded but input {_spec(p.inputs[0])} output {_spec(p.outputs[0])}"
            chain, cur = [], _tensor_inputs(node)[0]
            while True:
                if cur.op != "call_function" or len(cur.users) != 1:
                    return f"{mod_name}: its input does not come from a column-parallel linear alone"
                cp = plans.get(cur.name)
                if _target_name(cur) == _LINEAR and infos[cur.name].module in styles \
                        and styles[infos[cur.name].module][0] == "colwise":
                    break
                if cp is None or len(_tensor_inputs(cur)) != 1 or \
                        any(shard_dim(s) != last for s in [*cp.inputs, *cp.outputs] if s is not None):
                    return f"{mod_name}: {cur.name} between the pair is not an element-wise op on S({last})"
                chain.append(cur.name)
                cur = _tensor_inputs(cur)[0]
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
                idx = _tensor_inputs(user).index(node)
                wanted.add(_spec(up.inputs[idx]))
            layouts = {("R" if w_ in ("R", "P") else w_) for w_ in wanted}
            if len(layouts) > 1:
                return f"{mod_name}: consumers want {sorted(wanted)}"
            layout = layouts.pop() if layouts else "R"
            d = shard_dim([layout]) if layout != "R" else None
            styles[mod_name] = ("rowwise", Shard(d) if d is not None else Replicate())
            for later in node.users:
                _mark_downstream(later, downstream)
        else:
            return f"{w} is {_spec(wspec)}: neither column (S(0)) nor row (S(1)) sharded"
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
            if any(not (_is_r(s) or _is_partial(s) or shard_dim(s) is not None) for s in specs):
                return f"{node.name}: placements {specs}"
            continue
        if any(not _is_r(s) for s in specs):
            return f"{node.name} is {[_spec(s) for s in specs]} outside a column/row pair"
    return Recognised("tensor_parallel", styles)


def _mark_downstream(node: torch.fx.Node, seen: set[str]) -> None:
    stack = [node]
    while stack:
        cur = stack.pop()
        if cur.name in seen or cur.op != "call_function":
            continue
        seen.add(cur.name)
        stack.extend(cur.users)


def recognise(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> Recognised:
    """Which native pattern ``plan`` reduces to: ``kind`` is ``"ddp"``, ``"tensor_parallel"``
    or ``"none"`` (then ``reason`` says why, for the pattern that came closest)."""
    if len(plan.mesh) != 1:
        return Recognised("none", {}, f"mesh {plan.mesh} is not 1-D")
    if plan.scheduled:
        return Recognised("none", {}, "pipeline stages or microbatches")
    if plan.recompute:
        return Recognised("none", {}, "layers recomputed in the backward")
    n = plan.mesh[0]
    found = _recognise_ddp(spec, graph, plan, n)
    if isinstance(found, Recognised):
        return found
    tp = _recognise_tp(spec, graph, plan)
    if isinstance(tp, Recognised):
        return tp
    return Recognised("none", {}, f"not data parallel ({found}); not Megatron ({tp})")


# --------------------------------------------------------------------------------------------
# the program
