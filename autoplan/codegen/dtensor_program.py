"""Execute a :class:`Plan` with DTensor: the traced ATen graph, run node by node on DTensors.

``build_program(graph, plan, mesh, params)`` gives a :class:`ShardedProgram` (an ``nn.Module``)
that holds the model's parameters distributed with the plan's placements and whose forward
runs the traced graph with an ``fx.Interpreter``: before each op, every DTensor input is
redistributed to the placement the plan chose for that op, so the collectives happen where the
plan put them; in the backward, each edge brings its gradient back to the producer's placement
in one step (:class:`_PlannedRedistribute`, :func:`_reduce_gradient_on_edge`), so the backward
runs the collectives the plan lists too (tests compare them, kind by kind, with
``CollectiveCounter``).

Conventions:

- ``program(*inputs)`` takes the GLOBAL batch: every rank passes the same full user inputs, and
  each rank keeps only its slice (no communication). It returns ``(loss, *model_outputs)`` as
  DTensors (``.full_tensor()`` gives the global value).
- Parameters are ``nn.Parameter(DTensor)`` under their FQN (dots become ``__`` in the module's
  own attribute names; :meth:`ShardedProgram.named_plan_parameters` gives them by FQN). A tied
  weight is one parameter, reachable under every FQN it has.
- Buffers become DTensor buffers (not parameters), so in-place updates such as BatchNorm's
  ``num_batches_tracked.add_(1)`` work.

The traps the exported graph sets for DTensor (see DESIGN.md) are handled here:
``_assert_tensor_metadata`` nodes are dropped, tensors created inside the graph (``arange``)
become replicated DTensors, attention runs with the math SDPA backend (the CPU flash-attention
backward has no DTensor rule), and tied weights stay one parameter.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.placement_types import Placement as DPlacement
from torch.nn.attention import SDPBackend, sdpa_kernel

from autoplan.codegen.collective_counter import CollectiveCounter
from autoplan.errors import AutoplanError

if TYPE_CHECKING:
    from autoplan.codegen.gradient_buckets import GradientBuckets
from autoplan.trace.graph import TracedGraph
from autoplan.plan_schema import NodePlan, Plan
from autoplan.sharding import parse_placement

__all__ = [
    "ShardedProgram",
    "build_program",
    "executed_collectives",
    "planned_collectives",
    "shard_batch",
    "to_dtensor_placements",
]

# Ops with no DTensor rule that only check metadata: skipped.
_SKIPPED_OPS = {
    torch.ops.aten._assert_tensor_metadata.default,
}
_SKIPPED_NAMES = ("_assert_tensor_metadata", "_assert_scalar", "sym_constrain_range")
# The tracer drops ``.contiguous()`` nodes (their presence depends on the tracing device), so a
# ``view`` may meet a non-contiguous tensor (after a transpose): run it as ``reshape``, which is a
# view whenever one is possible and has the same DTensor sharding rule.
_REPLACED_OPS = {
    torch.ops.aten.view.default: torch.ops.aten.reshape.default,
}


def to_dtensor_placements(specs: Sequence[str]) -> tuple[DPlacement, ...]:
    """Plan placement strings (``"R"``, ``"S(1)"``, ``"P"``) → DTensor placements."""
    out: list[DPlacement] = []
    for text in specs:
        p = parse_placement(text)
        if p.is_replicate:
            out.append(Replicate())
        elif p.is_shard:
            out.append(Shard(p.dim))
        else:
            out.append(Partial())
    return tuple(out)


def shard_batch(tensor: torch.Tensor, placements: Sequence[str | DPlacement], mesh: DeviceMesh) -> torch.Tensor:
    """This rank's piece of a global ``tensor`` under ``placements`` (no communication).

    ``placements`` are plan strings or DTensor placements, one per mesh axis; the tensor is cut
    like ``distribute_tensor`` cuts it (``torch.chunk`` order over the mesh axes)."""
    dplacements = to_dtensor_placements(placements) if placements and isinstance(placements[0], str) \
        else tuple(placements)  # type: ignore[arg-type]
    if any(isinstance(p, Partial) for p in dplacements):
        raise AutoplanError("a batch cannot be cut into partial sums: give R or S(d) placements")
    return distribute_tensor(tensor.detach(), mesh, dplacements, src_data_rank=None).to_local()


def _target(placements: Sequence[str]) -> tuple[DPlacement, ...]:
    return to_dtensor_placements(placements)


def _redistribute(value: Any, specs: list[str] | None, mesh: DeviceMesh) -> Any:
    """Bring one op input to the placements the plan chose for it; in the backward, bring its
    gradient to the producer's placement (:class:`_PlannedRedistribute`)."""
    if isinstance(value, DTensor) and value.requires_grad and specs is not None and _changes(value, specs):
        return _PlannedRedistribute.apply(value, specs, mesh)
    return _redistribute_value(value, specs, mesh)


def _changes(value: DTensor, specs: list[str]) -> bool:
    """Whether ``specs`` ask a floating DTensor for other placements ("P" keeps a partial one)."""
    target = _target(specs)
    return len(target) != len(value.placements) or any(
        not (isinstance(t, Partial) and isinstance(c, Partial)) and t != c for c, t in zip(value.placements, target))


class _PlannedRedistribute(torch.autograd.Function):
    """One edge of the plan as one autograd node: the forward is the planned resharding
    (:func:`_redistribute_value`, run without recording its steps); the backward brings the
    incoming gradient, whatever placement the consumer's backward left it in (partial sums
    included), straight to the producer's placement with partial → replicated, in one DTensor
    redistribution: the collectives the plan costs for the edge's backward (``g_dst → g_src``),
    no more.

    (DTensor's own chain of redistributions and local conversions would each convert the
    gradient back in turn, and let a partial gradient flow on unreduced into the producer's
    backward, reducing it wherever a later step first needs it, often in another collective.)"""

    @staticmethod
    def forward(ctx: Any, value: DTensor, specs: list[str], mesh: DeviceMesh) -> DTensor:  # type: ignore[override]
        ctx.target = tuple(Replicate() if p.is_partial() else p for p in value.placements)
        ctx.mesh = mesh
        return _redistribute_value(value, specs, mesh)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:  # type: ignore[override]
        if isinstance(grad, DTensor) and tuple(grad.placements) != ctx.target:
            # Redistribute gives the gradient's GLOBAL stride to the contiguous LOCAL result of
            # its collective: gradients of transposed values must be made contiguous first
            grad = _contiguous(grad) if not grad.is_contiguous() else grad
            grad = grad.redistribute(ctx.mesh, ctx.target)
        return grad, None, None


def _reduce_gradient_on_edge(before: Any, after: Any) -> Any:
    """An edge the forward does not reshard, whose consumer leaves partial gradients: reduce
    them at once, into the producer's placement (partial → replicated), as the plan costs it.

    DTensor alone would let a partial gradient flow on through the producer's backward
    (views, adds and other ops linear in the gradient keep it partial) and reduce it wherever a
    later redistribution or op first needs it: often an edge or two upstream and in another
    collective. The consumer reads its own alias of the value, so the reduction happens before
    gradients from several consumers are summed. (A resharded edge does this in
    :class:`_PlannedRedistribute`.)"""
    if not (after is before and isinstance(after, DTensor) and after.requires_grad):
        return after
    target = tuple(Replicate() if p.is_partial() else p for p in before.placements)
    mesh = after.device_mesh
    after = after.view_as(after)

    def reduce(grad: torch.Tensor) -> torch.Tensor:
        if isinstance(grad, DTensor) and tuple(grad.placements) != target:
            return grad.redistribute(mesh, target)
        return grad

    after.register_hook(reduce)
    return after


def _unmask_partial(value: Any) -> Any:
    """A masked partial → a plain ``Partial(sum)``, locally.

    DTensor's embedding with a vocabulary-sharded table returns a ``_MaskPartial``: each rank's
    rows for indices outside its shard are garbage until a reduction zeroes them with the mask
    of the LOCAL indices. Such a value cannot leave the op safely: DTensor redistributes mesh
    axis by mesh axis, and gathering another axis first changes the local shape so the mask no
    longer fits ("The shape of the mask [4] at index 0 does not match the shape of the indexed
    tensor [8, 16]"); it does not mix with a plain partial in an ``add``; a partial gradient
    cannot be redistributed back to it ("Redistribution from one partial type (P(sum)) to
    another (MaskP(...)) is unsupported"); and its mask is released by the first reduction, so
    a second consumer fails. Zeroing the masked rows at once makes the value an ordinary sum of
    per-rank addends. The gradient passes through unmasked and replicated, as DTensor's own
    backward of the reduction gives it (the embedding's backward reads the full indices)."""
    if not isinstance(value, DTensor):
        return value
    axes = [i for i, p in enumerate(value.placements) if isinstance(p, Partial) and type(p) is not Partial]
    if not axes:
        return value
    local = value.to_local()
    drop = torch.zeros((), dtype=torch.bool)
    for i in axes:
        buffer = value.placements[i].mask_buffer
        mask = buffer.data
        if mask is None:
            raise AutoplanError(f"a masked partial value lost its mask: {value.placements}")
        # release it as DTensor's reduction would: the placement object lives on in DTensor's
        # sharding cache, and the next embedding with this spec must find it empty ("MaskBuffer
        # has been materialized with conflicting data")
        buffer.release_mask()
        drop = drop | mask.reshape(tuple(mask.shape) + (1,) * (local.ndim - mask.ndim))
    local = local - torch.where(drop, local, torch.zeros((), dtype=local.dtype)).detach()
    placements = [Partial(p.reduce_op) if i in axes else p for i, p in enumerate(value.placements)]
    return DTensor.from_local(local, value.device_mesh, placements, run_check=False,
                              shape=value.shape, stride=value.stride())


def _redistribute_value(value: Any, specs: list[str] | None, mesh: DeviceMesh) -> Any:
    if specs is None or not isinstance(value, torch.Tensor):
        return value
    target = list(_target(specs))
    if not isinstance(value, DTensor):
        # A tensor made inside the graph (arange, zeros, a lifted constant): the same on every
        # rank, so it is replicated; cutting it to a shard needs no communication.
        value = DTensor.from_local(value, mesh, [Replicate()] * mesh.ndim, run_check=False)
    current = value.placements
    if len(target) != len(current):
        raise AutoplanError(f"plan gives {len(target)} placements for a value on a {mesh.ndim}-D mesh")
    # "P" in the plan means "partial, any reduction": keep a Partial DTensor's own reduce op (a
    # mean's Partial("avg") must not be read as a sum). Integer tensors have no partial form.
    for i, (cur, tgt) in enumerate(zip(current, target)):
        if isinstance(tgt, Partial):
            if isinstance(cur, Partial):
                target[i] = cur
            elif not value.dtype.is_floating_point and not value.dtype.is_complex:
                target[i] = Replicate()
    if tuple(target) == tuple(current):
        return value
    # DTensor's Redistribute keeps the input's GLOBAL stride for its output (and, in the backward,
    # for the gradient), while a collective leaves a contiguous LOCAL tensor: for a transposed
    # input the two disagree, and a later view (a ``reshape`` that the global stride declares
    # viewable) fails on the local tensor, e.g. the backward of ``q.view(b, t, h, d).transpose(1,
    # 2)`` in attention. Redistributing a contiguous value keeps global and local layouts alike.
    if not value.is_contiguous():
        value = _contiguous(value)
    # Shard → Partial needs no communication: each rank holds its shard in place, zeros elsewhere
    # (DTensor itself would all-gather first).
    for i, (c, t) in enumerate(zip(current, target)):
        if isinstance(t, Partial) and isinstance(c, Shard) and _can_pad(value, i, mesh):
            value = _shard_to_partial(value, i, mesh)
    current = value.placements
    to_partial = [i for i, (c, t) in enumerate(zip(current, target))
                  if isinstance(t, Partial) and not isinstance(c, Partial)]
    if not to_partial:
        return value.redistribute(mesh, target)
    # DTensor's public redistribute refuses to make a Partial. Go to Replicate on those axes
    # (the others to their target), then split the value into n addends of value / n.
    mid = [Replicate() if i in to_partial else t for i, t in enumerate(target)]
    if tuple(mid) != tuple(current):
        value = value.redistribute(mesh, mid)
    return _replicate_to_partial(value, to_partial, target, mesh)


def _contiguous(value: DTensor) -> DTensor:
    """``value`` with a contiguous layout. DTensor's own ``contiguous`` replicates a partial
    value (an all-reduce the plan does not ask for): copy the local tensor instead; the
    gradient of a partial value is replicated."""
    if not any(p.is_partial() for p in value.placements):
        return value.contiguous()
    grad_placements = [Replicate() if p.is_partial() else p for p in value.placements]
    local = value.to_local(grad_placements=grad_placements).contiguous()
    return DTensor.from_local(local, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                              stride=torch.empty(value.shape, device="meta").stride())


def _can_pad(value: DTensor, axis: int, mesh: DeviceMesh) -> bool:
    dim = value.placements[axis].dim
    alone = all(not (isinstance(p, Shard) and p.dim == dim) for j, p in enumerate(value.placements) if j != axis)
    return alone and value.shape[dim] % mesh.size(axis) == 0


def _shard_to_partial(value: DTensor, axis: int, mesh: DeviceMesh) -> DTensor:
    """Shard(d) → Partial(sum) on mesh axis ``axis``, locally: the shard padded with zeros to the
    full size of dim d. Its gradient is the slice of the (replicated) gradient."""
    dim = value.placements[axis].dim
    n, coord = mesh.size(axis), mesh.get_local_rank(axis)
    local = value.to_local()
    size = local.shape[dim]
    before = list(local.shape)
    before[dim] = coord * size
    after = list(local.shape)
    after[dim] = (n - 1 - coord) * size
    padded = torch.cat([local.new_zeros(before), local, local.new_zeros(after)], dim=dim)
    placements = list(value.placements)
    placements[axis] = Partial()
    return DTensor.from_local(padded, mesh, placements, run_check=False, shape=value.shape,
                              stride=torch.empty(value.shape, device="meta").stride())


def _replicate_to_partial(value: DTensor, axes: list[int], target: Sequence[DPlacement],
                          mesh: DeviceMesh) -> DTensor:
    """Replicate → Partial(sum) on ``axes``: each rank holds value / n.

    Autograd: the gradient of a partial value is replicated (every addend receives the whole
    gradient), and so is the gradient that reaches the replicated value: the local gradient
    passes through unscaled and stays replicated, with no communication, as the plan counts
    it. (Scaling it by 1/n and declaring it partial would be correct too, but would cost an
    all-reduce in the backward, e.g. for a replicated bias added to a row-sharded matmul.)"""
    n = 1
    for i in axes:
        n *= mesh.size(i)
    # the other axes: as the value is placed, except that a partial value's gradient is
    # replicated; declaring it partial would sum it n times.
    grad_placements = [Replicate() if isinstance(p, Partial) else p for p in value.placements]
    local = value.to_local(grad_placements=grad_placements)
    # forward: local / n; backward: the identity
    split = local.detach() / n + (local - local.detach())
    return DTensor.from_local(split, mesh, list(target), run_check=False,
                              shape=value.shape, stride=value.stride())


def _spec_text(placements: Sequence[DPlacement]) -> str:
    return "".join("R" if p.is_replicate() else f"S{p.dim}" if p.is_shard() else "P" for p in placements)


class _PlanInterpreter(torch.fx.Interpreter):
    """Runs the traced graph on DTensors, redistributing each op's inputs as the plan says."""

    def __init__(self, program: ShardedProgram) -> None:
        super().__init__(program.graph_module, garbage_collect_values=True)
        self.program = program
        self._placeholder_values: dict[str, Any] = {}

    def run_with(self, placeholder_values: dict[str, Any]) -> Any:
        self._placeholder_values = placeholder_values
        try:
            return self.run()
        finally:
            self._placeholder_values = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        if n.op == "placeholder":
            return self._placeholder_values[n.name]
        if n.op == "call_function":
            name = getattr(n.target, "__name__", str(n.target))
            if n.target in _SKIPPED_OPS or any(s in name for s in _SKIPPED_NAMES):
                return None
            node_plan = self.program.node_plans.get(n.name)
            if node_plan is not None and n.target is not operator.getitem:
                return self._call_planned(n, node_plan)
        return super().run_node(n)

    def _call_planned(self, n: torch.fx.Node, node_plan: NodePlan) -> Any:
        tensor_inputs = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        if len(node_plan.inputs) != len(tensor_inputs):
            raise AutoplanError(f"plan for {n.name} lists {len(node_plan.inputs)} tensor inputs, the graph "
                                f"has {len(tensor_inputs)}: the plan is not for this graph")
        mesh = self.program.mesh
        arrived = {}
        for pos, (a, specs) in enumerate(zip(tensor_inputs, node_plan.inputs)):
            before = self.env[a]
            after = _redistribute(before, specs, mesh)
            if after is not before and isinstance(before, DTensor):
                self.program.redistributions.append(
                    (f"{a.name} -> {n.name}", _spec_text(before.placements), _spec_text(after.placements)))
            if pos < len(node_plan.grad_partial) and node_plan.grad_partial[pos] \
                    and a.name not in self.program.deferred_gradients:
                after = _reduce_gradient_on_edge(before, after)
            arrived[a] = after
        args = torch.fx.node.map_arg(n.args, lambda a: arrived.get(a, self.env[a]))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: arrived.get(a, self.env[a]))
        out = getattr(self, n.op)(n.target, args, kwargs)
        if isinstance(out, (tuple, list)):
            return type(out)(_unmask_partial(o) for o in out)
        return _unmask_partial(out)

    def call_function(self, target, args, kwargs):
        return _REPLACED_OPS.get(target, target)(*args, **kwargs)


class ShardedProgram(torch.nn.Module):
    """The traced model distributed by a plan. See the module docstring for the conventions.

    ``forward(*inputs)`` takes the GLOBAL user inputs (the same on every rank) and returns
    ``(loss, *model_outputs)`` as DTensors."""

    def __init__(self, graph: TracedGraph, plan: Plan, mesh: DeviceMesh, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        if plan.graph_hash != graph.graph_hash:
            raise AutoplanError("the plan was made for another graph (graph_hash differs): plan this model again")
        if tuple(mesh.shape) != tuple(plan.mesh):
            raise AutoplanError(f"the plan is for mesh {plan.mesh}, the device mesh is {list(mesh.shape)}")
        self.mesh = mesh
        self.plan = plan
        self.graph_module = graph.graph_module
        self.input_names = list(graph.input_names)
        self.node_plans = {np_.name: np_ for np_ in plan.nodes}
        self.tied = dict(graph.tied)
        # placeholder name -> FQN, every FQN resolved to the one the graph reads
        self.placeholder_fqn = {name: self.tied.get(fqn, fqn) for name, fqn in graph.param_names.items()}
        buffer_fqns = {info.fqn for info in graph.nodes.values() if info.kind == "buffer" and info.fqn}
        self._fqn_to_attr: dict[str, str] = {}
        for fqn in dict.fromkeys(self.placeholder_fqn.values()):
            if fqn not in params:
                raise AutoplanError(f"no tensor given for {fqn}: pass model.named_parameters() and named_buffers()")
            tensor = params[fqn].detach()
            specs = plan.params.get(fqn, ["R"] * mesh.ndim)
            placements = to_dtensor_placements(specs)
            if any(isinstance(p, Partial) for p in placements):
                raise AutoplanError(f"plan stores {fqn} as partial sums ({specs}): a parameter must be R or S(d)")
            dt = distribute_tensor(tensor.clone(), mesh, placements, src_data_rank=None)
            attr = fqn.replace(".", "__")
            if fqn in buffer_fqns or not tensor.is_floating_point():
                self.register_buffer(attr, dt)
            else:
                self.register_parameter(attr, torch.nn.Parameter(dt, requires_grad=params[fqn].requires_grad))
            self._fqn_to_attr[fqn] = attr
        self._constants = self._lifted_constants(graph)
        # (edge, from, to) of every redistribution the last forward did, to see where
        # collectives come from
        self.redistributions: list[tuple[str, str, str]] = []
        # parameters (placeholder names) whose gradient reduction a GradientBuckets runs
        # after the backward instead of on their edges, and those buckets
        self.deferred_gradients: set[str] = set()
        self.gradient_buckets: GradientBuckets | None = None
        self._interpreter = _PlanInterpreter(self)

    @staticmethod
    def _lifted_constants(graph: TracedGraph) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        ep = graph.exported
        consts = {}
        if ep is not None:
            consts = dict(getattr(ep, "constants", {}) or {})
            for spec in ep.graph_signature.input_specs:
                if spec.target in consts:
                    out[spec.arg.name] = consts[spec.target]
        return out

    def observable_collectives(self, phase: str) -> dict[str, int]:
        """What ``CollectiveCounter`` should count in ``phase``: the plan's collectives, with the
        bucketed gradient all-reduces counted per bucket (:mod:`gradient_buckets`)."""
        counts = planned_collectives(self.plan, phase)
        if phase == "backward" and self.gradient_buckets is not None:
            buckets = self.gradient_buckets
            counts["all_reduce"] = counts.get("all_reduce", 0) - buckets.replaced() + buckets.launched()
        return {kind: n for kind, n in counts.items() if n}

    def tensor(self, fqn: str) -> torch.Tensor:
        """The distributed parameter (or buffer) under ``fqn`` (a tied FQN gives the shared one)."""
        fqn = self.tied.get(fqn, fqn)
        return getattr(self, self._fqn_to_attr[fqn])

    def named_plan_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Every parameter by the model's FQN, tied FQNs included (they give the same object)."""
        out = {fqn: self.tensor(fqn) for fqn in self._fqn_to_attr}
        out.update({fqn: self.tensor(used) for fqn, used in self.tied.items() if used in self._fqn_to_attr})
        return {k: v for k, v in out.items() if isinstance(v, torch.nn.Parameter)}

    def distribute_inputs(self, inputs: Sequence[Any]) -> list[Any]:
        """Global user inputs → DTensors with the plan's input placements (local slicing only)."""
        if len(inputs) != len(self.input_names):
            raise AutoplanError(f"the program takes {len(self.input_names)} inputs ({', '.join(self.input_names)}), "
                                f"got {len(inputs)}")
        out = []
        for name, value in zip(self.input_names, inputs):
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor):
                out.append(value)
                continue
            placements = to_dtensor_placements(self.plan.inputs.get(name, ["R"] * self.mesh.ndim))
            local = shard_batch(value, placements, self.mesh)
            out.append(DTensor.from_local(local, self.mesh, placements, run_check=False,
                                          shape=value.shape, stride=value.stride()))
        return out

    def forward(self, *inputs: Any) -> tuple[Any, ...]:
        self.redistributions = []
        values: dict[str, Any] = {}
        user = iter(self.distribute_inputs(inputs))
        for node in self.graph_module.graph.nodes:
            if node.op != "placeholder":
                continue
            if node.name in self.placeholder_fqn:
                values[node.name] = self.tensor(self.placeholder_fqn[node.name])
            elif node.name in self.input_names:
                values[node.name] = next(user)
            elif node.name in self._constants:
                values[node.name] = self._constants[node.name]
            else:
                raise AutoplanError(f"graph input {node.name} is neither a parameter, a buffer nor a user input")
        # implicit_replication: plain tensors that ops create inside DTensor dispatch (masks in the
        # math attention) mix with DTensors as replicated ones.
        with implicit_replication(), sdpa_kernel(SDPBackend.MATH):
            out = self._interpreter.run_with(values)
        out = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        # The plan materialises the loss replicated (its "-> output" collective); the model's
        # other outputs stay as computed (call .full_tensor() to gather them).
        loss = out[0]
        if isinstance(loss, DTensor) and any(not p.is_replicate() for p in loss.placements):
            loss = loss.redistribute(self.mesh, [Replicate()] * self.mesh.ndim)
            self.redistributions.append(("loss -> output", _spec_text(out[0].placements), _spec_text(loss.placements)))
        return (loss, *out[1:])


def build_program(graph: TracedGraph, plan: Plan, mesh: DeviceMesh, params: dict[str, torch.Tensor]) -> ShardedProgram:
    """A :class:`ShardedProgram` executing ``plan`` for ``graph`` on ``mesh``.

    ``params`` are the model's parameters and buffers by FQN (``dict(model.named_parameters())``
    plus ``named_buffers()``), the same on every rank; each rank keeps its own shard."""
    return ShardedProgram(graph, plan, mesh, params)


def executed_collectives(program: ShardedProgram, inputs: Sequence[Any]) -> dict[str, int]:
    """Run the program's forward once and count the collectives it executes by kind
    (``all_reduce``, ``all_gather``, ``reduce_scatter``, ``all_to_all``) — to set beside
    ``plan.collectives_in("forward")`` (:func:`planned_collectives`). Autograd stays on, as in
    a training step; the backward is not run."""
    with CollectiveCounter() as counter:
        program(*inputs)
    return dict(counter.counts)


def planned_collectives(plan: Plan, phase: str = "forward") -> dict[str, int]:
    """The plan's collectives in ``phase``, counted by kind (the same keys as
    :func:`executed_collectives`)."""
    counts: Counter[str] = Counter()
    for c in plan.collectives_in(phase):
        counts[c.kind] += c.count
    return dict(counts)
