"""How a data-parallel plan stores and reads each parameter, as FSDP2 and torch's parallel
styles can carry it out module by module, on a 1-D mesh or HSDP's 2-D one.

The planner chooses storage per parameter (:mod:`autoplan.planner.memory_savings`), so a plan
found at real size mixes kinds: the blocks' large weights sharded and gathered at use (FSDP),
a head held whole with its gradient and optimizer state sharded (ZeRO-2: one gather per step
instead of two), norm weights kept whole (a gather would cost a latency), and an embedding
table that is never gathered but read where it lies, each rank looking up its slice of the
table for the whole batch of token ids (hidden-parallel: the table sharded on dim 1, each rank's
lookup a slice of the hidden dim, all-to-all'd onto the batch shards; vocabulary-parallel: the
table sharded on dim 0, each rank's lookup partial sums, reduce-scattered onto them). The
table's gradient then needs no reduction: each rank computes its slice's for every token.
Across nodes (a 2-D mesh: axis 0 between the nodes, axis 1 within one) the same form holds
over axis 1, HSDP's: the sharded weights and the ZeRO-2 ones replicated over axis 0, and the
table also stored sharded over axis 0 and gathered there for the lookup, the ids split between
the nodes and whole within one.

:func:`parameter_storage` reads the plan into a :class:`ParameterStorage`, or says in one line
why a parameter's storage or read has no such native form. The program built from it
(:func:`autoplan.codegen.native_fsdp.shard_modules`, :func:`parallelize_embeddings`): every
recognised embedding under ``ColwiseParallel`` (hidden) or ``RowwiseParallel`` (vocabulary) over
the mesh's last axis, the whole ids in and the output on the batch shards out (on a 2-D mesh
then ``fully_shard``ed over axis 0); every module holding only ZeRO-2 parameters
``fully_shard``ed on its own with ``reshard_after_forward=False``; the blocks and the root
``fully_shard``ed over the sharded ones; ``replicate`` on the holders of the whole ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate, Shard

from autoplan.codegen.native_patterns import _planned_ops, is_whole, shard_dim, spec_text, tensor_inputs
from autoplan.load import ModelSpec
from autoplan.plan_schema import Plan
from autoplan.trace.graph import TracedGraph

_EMBEDDING = "aten.embedding.default"


class TableRead(str, Enum):
    """How an embedding reads a table stored sharded, in place."""

    HIDDEN = "hidden"  # table S(1): each rank's lookup is a slice of the hidden dim (ColwiseParallel)
    VOCABULARY = "vocabulary"  # table S(0): each rank's lookup is partial sums (RowwiseParallel)


@dataclass(frozen=True)
class EmbeddingRead:
    """An ``nn.Embedding`` whose table the plan reads where it lies over the mesh's last axis:
    by ``read``, the ids whole there, the output moved onto the batch shards (dim
    ``batch_dim``) at ``node``; on a 2-D mesh the table also stored sharded on dim
    ``gathered_dim`` over axis 0 and gathered there at use (FSDP over the nodes). ``ids``: the
    user input the lookup reads, where no other op reads it (it may then be split over the
    leading mesh axes only)."""

    node: str
    read: TableRead
    batch_dim: int
    gathered_dim: int | None = None
    ids: str | None = None


@dataclass(frozen=True)
class ParameterStorage:
    """A data-parallel plan's parameters by how FSDP2 and the parallel styles hold them:
    ``shard_dims`` sharded on that dim over the mesh's last axis (replicated over the others:
    HSDP on a 2-D mesh) and gathered at use, resharded after the forward; ``zero2`` whole,
    their gradients and optimizer states sharded on dim 0 over the last axis (held gathered from
    the forward through the backward); ``embeddings`` tables read in place (module FQN -> read);
    every other parameter kept whole, its gradient all-reduced."""

    shard_dims: dict[str, int] = field(default_factory=dict)
    zero2: frozenset[str] = frozenset()
    embeddings: dict[str, EmbeddingRead] = field(default_factory=dict)

    def table_names(self) -> set[str]:
        """The FQNs of the tables the embeddings read in place."""
        return {f"{module}.weight" for module in self.embeddings}

    def lookup_ids(self) -> frozenset[str]:
        """The user inputs only the embeddings read (their ids)."""
        return frozenset(read.ids for read in self.embeddings.values() if read.ids is not None)


@dataclass(frozen=True)
class _Table:
    """A parameter stored sharded over both axes of a 2-D mesh: an embedding's table, if one
    reads it in place over the last axis."""

    gathered_dim: int
    read_dim: int


def _storage_of(fqn: str, specs: list[str], plan: Plan, parameter: torch.Tensor) -> str | int | _Table:
    """``"whole"``, ``"zero2"``, the dim the parameter is stored sharded on over the mesh's last
    axis, a :class:`_Table`, or a reason."""
    lead = ["R"] * (len(plan.mesh) - 1)  # the axes a data-parallel parameter is replicated over
    s = plan.storage.get(fqn)
    if s is None:
        return "whole" if is_whole(specs) else f"{fqn} is {spec_text(specs)} with no storage planned"
    if is_whole(specs) and is_whole(s.param):
        if s.grad == s.param and s.optimizer_state == s.param:
            return "whole"
        if s.grad == s.param:
            return f"{fqn}'s optimizer state is sharded under a whole gradient (ZeRO-1)"
        if list(s.grad) == [*lead, "S(0)"] and list(s.optimizer_state) == list(s.grad):
            return "zero2"
        return f"{fqn} is stored {spec_text(s.param)}, its gradient {spec_text(s.grad)} and optimizer state " \
               f"{spec_text(s.optimizer_state)}: not ZeRO-2 on dim 0 of the last mesh axis"
    if list(s.param) != list(specs) or s.grad != s.param or s.optimizer_state != s.param:
        return f"{fqn} is {spec_text(specs)}, stored {spec_text(s.param)}, its gradient {spec_text(s.grad)}: " \
               "not stored as it is read"
    d = shard_dim(specs[-1:])
    if list(specs[:-1]) == lead and d is not None:
        if d > 0 and parameter.shape[d] % plan.mesh[-1]:
            return f"{fqn} is {spec_text(specs)}, uneven: FSDP2 shards a dim other than 0 only evenly"
        return d
    if len(specs) == 2 and (a := shard_dim(specs[:1])) is not None and d is not None:
        local = parameter.shape[a] // plan.mesh[1] if a == d else parameter.shape[a]  # the style's slice
        if a > 0 and local % plan.mesh[0]:
            return f"{fqn} is {spec_text(specs)}, uneven over axis 0: FSDP2 shards a dim other than 0 only evenly"
        return _Table(a, d)
    return f"{fqn} is {spec_text(specs)}: neither replicated nor stored sharded on one dim over the last mesh axis"


def _embedding_read(spec: ModelSpec, graph: TracedGraph, plan: Plan, node: torch.fx.Node, table: torch.fx.Node,
                    stored: int | _Table | None) -> tuple[str, EmbeddingRead] | str:
    """The module and read of an embedding ``node`` that reads ``table`` (stored sharded on a
    dim over the last axis, and on a 2-D mesh over axis 0 as well: ``stored``) in place, or why
    it is not one a parallel style runs."""
    plans = {p.name: p for p in plan.nodes}
    fqn = graph.param_names[table.name]
    inputs = plans[node.name].inputs
    read = inputs[tensor_inputs(node).index(table)]
    where = f"{node.name} reads {fqn} as {spec_text(read)}"
    dim = stored.read_dim if isinstance(stored, _Table) else stored
    if str(node.target) != _EMBEDDING or len(inputs) != 2 or tensor_inputs(node)[0] is not table \
            or dim not in (0, 1) or not is_whole(read[:-1]) or shard_dim(read[-1:]) != dim:
        return f"{where}, not gathered whole"
    ids = inputs[1]
    module_name = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    module = spec.module.get_submodule(module_name)
    if not isinstance(module, torch.nn.Embedding) or fqn in graph.tied or fqn in graph.tied.values():
        return f"{where}: its table is not an nn.Embedding's own"
    if len(table.users) != 1:
        return f"{where}: another op reads the table too"
    if not is_whole(ids[-1:]):
        return f"{where} with its ids {spec_text(ids)}: a parallel style reads the ids whole over the last axis"
    out = plans[node.name].outputs[0] if plans[node.name].outputs else None
    expected = [*ids[:-1], "P" if dim == 0 else f"S({node.meta['val'].dim() - 1})"]
    if list(out or []) != expected:
        return f"{where} into {spec_text(out)}, not {spec_text(expected)}"
    batch = None
    for user in node.users:
        p = plans.get(user.name)
        if p is None:
            continue
        consumer = p.inputs[tensor_inputs(user).index(node)]
        dims = {shard_dim([x]) for x in consumer}
        if len(dims) != 1 or None in dims or (batch is not None and dims != {batch}):
            return f"{where}, and {user.name} reads its output as {spec_text(consumer)}, not batch-sharded"
        batch = dims.pop()
    if batch is None or batch >= node.meta["val"].dim() - 1:
        return f"{where}, and its output is not read batch-sharded"
    if any(shard_dim([x]) not in (None, batch) for x in ids[:-1]):
        return f"{where} with its ids {spec_text(ids)}: split off their batch dim"
    read_kind = TableRead.VOCABULARY if dim == 0 else TableRead.HIDDEN
    given = tensor_inputs(node)[1]
    only_reader = given.op == "placeholder" and all(user.name == node.name for user in given.users)
    return module_name, EmbeddingRead(node.name, read_kind, batch,
                                      stored.gathered_dim if isinstance(stored, _Table) else None,
                                      given.name if only_reader else None)


def parameter_storage(spec: ModelSpec, graph: TracedGraph, plan: Plan) -> ParameterStorage | str:
    """How FSDP2 and the parallel styles hold each parameter of a data-parallel plan on a 1-D
    mesh or a 2-D one (HSDP's: replicated over axis 0, sharded over axis 1) (see the module
    docstring), or why one has no such form: ZeRO-1 (a whole gradient kept beside a sharded
    optimizer state), an op other than a recognised embedding reading a parameter where it lies,
    a module mixing ZeRO-2 parameters with others (one FSDP2 group has one
    ``reshard_after_forward``)."""
    parameters = dict(spec.module.named_parameters(remove_duplicate=False))
    dims: dict[str, int] = {}
    tables: dict[str, _Table] = {}
    zero2: set[str] = set()
    for fqn, specs in plan.params.items():
        if fqn not in parameters:
            if not is_whole(specs):
                return f"buffer {fqn} is {spec_text(specs)}: FSDP2 keeps buffers whole"
            continue
        kind = _storage_of(fqn, list(specs), plan, parameters[fqn])
        if isinstance(kind, _Table):
            tables[fqn] = kind
        elif isinstance(kind, int):
            dims[fqn] = kind
        elif kind == "zero2":
            zero2.add(fqn)
        elif kind != "whole":
            return kind
    embeddings: dict[str, EmbeddingRead] = {}
    for node, p in _planned_ops(graph, plan):
        for value, specs in zip(tensor_inputs(node), p.inputs):
            if value.name in graph.param_names and not is_whole(specs):
                fqn = graph.param_names[value.name]
                found = _embedding_read(spec, graph, plan, node, value, tables.get(fqn, dims.get(fqn)))
                if isinstance(found, str):
                    return found
                embeddings[found[0]] = found[1]
                dims.pop(fqn, None)
                tables.pop(fqn, None)
    if tables:
        fqn = min(tables)
        return f"{fqn} is {spec_text(plan.params[fqn])}: sharded over both mesh axes and not an embedding's table " \
               "read in place"
    for fqn in zero2:
        holder = spec.module.get_submodule(fqn.rsplit(".", 1)[0] if "." in fqn else "")
        prefix = fqn.rsplit(".", 1)[0] + "." if "." in fqn else ""
        mixed = [f"{prefix}{name}" for name, _ in holder.named_parameters() if f"{prefix}{name}" not in zero2]
        if holder is spec.module or mixed:
            return f"{fqn} is ZeRO-2 beside {mixed[0] if mixed else 'the root'}'s other storage in one module"
    return ParameterStorage(dims, frozenset(zero2), embeddings)


class _ScaledGradient(torch.autograd.Function):
    """The identity, its gradient scaled."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001 - autograd's context
        ctx.scale = scale
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None


def _averaged(ranks: int) -> Callable[[torch.nn.Module, tuple, torch.Tensor], torch.Tensor]:
    """A forward hook whose output's gradient is divided by ``ranks``."""
    def hook(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        return _ScaledGradient.apply(output, 1.0 / ranks)
    return hook


def parallelize_embeddings(module: torch.nn.Module, mesh: DeviceMesh, embeddings: dict[str, EmbeddingRead],
                           policy: MixedPrecisionPolicy) -> int:
    """Each of ``embeddings`` under torch's parallel style for its read, over the mesh's last
    axis: the ids taken whole, the output redistributed onto the batch shards (an all-to-all
    from the hidden slices, a reduce-scatter of the vocabulary's partial sums) and handed on as
    a local tensor. On a 2-D mesh the table is then ``fully_shard``ed over axis 0 on its
    ``gathered_dim`` (FSDP over the nodes, composed with the style as torchtitan composes FSDP
    with tensor parallelism), gathered once a step and held through the backward, as the plan
    gathers it once for the lookup (the backward of a lookup does not read the table). The
    number of such FSDP2 groups.

    Each rank's backward starts from its own shard's loss, and the style's backward sums what
    every rank of the last axis sends its slice of the table: the sum of their gradients, where
    FSDP and DDP average them. The output's gradient is divided by that axis' size, so that the
    table's is the global loss's gradient as every other parameter's is."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    names = mesh.mesh_dim_names or ()
    tensor_mesh = mesh[names[-1]] if mesh.ndim > 1 else mesh
    styles = {}
    for name, read in embeddings.items():
        style = ColwiseParallel if read.read == TableRead.HIDDEN else RowwiseParallel
        styles[name] = style(input_layouts=Replicate(), output_layouts=Shard(read.batch_dim), use_local_output=True)
    # every rank holds the same table: each cuts its slice locally (src_data_rank=None), no scatter
    parallelize_module(module, tensor_mesh, styles, src_data_rank=None)
    groups = 0
    for name, read in embeddings.items():
        embedding = module.get_submodule(name)
        embedding.register_forward_hook(_averaged(tensor_mesh.size()))
        if mesh.ndim > 1:
            dim = read.gathered_dim or 0
            fully_shard(embedding, mesh=mesh[names[0]], reshard_after_forward=False, mp_policy=policy,
                        shard_placement_fn=lambda param, dim=dim: Shard(dim))
            groups += 1
    return groups
