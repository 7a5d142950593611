"""Parameter gradients reduced in buckets, overlapped with the backward, as DDP reduces them.

The plan costs a parameter's gradient reduction once per step and without a latency per
parameter (bucketed). On the DTensor interpreter each edge would otherwise reduce its own
partial gradient with a blocking collective, one per parameter: on gloo that latency (about a
millisecond a call) dominates the step of a small model. :class:`GradientBuckets` runs the
reductions the way the plan costs them.

Which parameters: those whose every consumer reads them as stored and leaves their gradient
partial on the same mesh axes, where the parameter is replicated (data parallelism over those
axes: the reduction is an all-reduce per axis). Their edges do not reduce
(:attr:`ShardedProgram.deferred_gradients`); their gradients accumulate as partial sums, and
the post-accumulate hook puts each in its bucket. A ZeRO-1 parameter's deferred gradient is
not bucketed: it stays partial sums until the optimizer step reduce-scatters it into the shard
of the optimizer state, as the plan lists it (:func:`~autoplan.codegen.sharded_state.reduced_before_step`). A bucket
(parameters in reverse order of definition, about the order the backward produces them,
grouped by mesh axes and dtype, up to ``cap_bytes`` of local gradient) is flattened and
all-reduced asynchronously as soon as its last gradient arrives; at the end of the backward
the rest are launched, every reduction is awaited and the gradients are written back in the
parameters' placements.

Executed collectives (``CollectiveCounter``): one all-reduce per bucket and axis instead of one
per parameter, edge and axis; :meth:`GradientBuckets.replaced` and
:meth:`GradientBuckets.launched` give the two counts, so that ``--check`` compares like with
like.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial

from autoplan.codegen.dtensor_program import ShardedProgram
from autoplan.codegen.redistribution import reduce_to
from autoplan.codegen.sharded_state import reduced_before_step
from autoplan.plan_schema import NodePlan
from autoplan.sharding import deferred_axes

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    axes: tuple[int, ...]
    ready: set[int] = field(default_factory=set)  # ids of params whose gradient has arrived
    works: list[tuple[torch.Tensor, list]] = field(default_factory=list)  # (flat buffer, its handles)
    done: dict[int, DTensor] = field(default_factory=dict)  # gradients finished outside the buffer


def parameter_reads(graph_module: torch.fx.GraphModule, node_plans: Mapping[str, NodePlan],
                    placeholder_fqn: Mapping[str, str]) -> dict[str, list[tuple[list[str] | None, tuple[int, ...]]]]:
    """Placeholder name → per edge that reads the parameter: the spec it reads and the mesh
    axes on which its backward leaves the gradient partial."""
    edges: dict[str, list[tuple[list[str] | None, tuple[int, ...]]]] = {}
    for node in graph_module.graph.nodes:
        node_plan = node_plans.get(node.name)
        if node_plan is None:
            continue
        tensor_inputs = [a for a in node.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for pos, a in enumerate(tensor_inputs):
            if a.name in placeholder_fqn and pos < len(node_plan.inputs):
                partial = node_plan.grad_partial[pos] if pos < len(node_plan.grad_partial) else []
                edges.setdefault(a.name, []).append((node_plan.inputs[pos], tuple(partial)))
    return edges


def deferred_parameters(program: ShardedProgram) -> dict[str, tuple[tuple[int, ...], int]]:
    """Placeholder name → (mesh axes, number of edges that read it), for every parameter whose
    gradient reduction can be deferred to the end of the backward (see the module docstring):
    into a bucket, or, for a ZeRO-1 parameter
    (:func:`~autoplan.codegen.sharded_state.reduced_before_step`), to the optimizer step."""
    plan, mesh_shape = program.plan, tuple(program.mesh.shape)
    out: dict[str, tuple[tuple[int, ...], int]] = {}
    for name, uses in parameter_reads(program.graph_module, program.node_plans, program.placeholder_fqn).items():
        fqn = program.placeholder_fqn[name]
        storage = plan.storage.get(fqn)
        if storage is not None and storage.grad != storage.param:  # ZeRO-2: reduce-scattered, not bucketed
            continue
        tensor = program.tensor(fqn)
        if not (isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad):
            continue
        reduced = deferred_axes(uses, plan.params.get(fqn, ["R"] * len(mesh_shape)), mesh_shape)
        if reduced is not None:
            out[name] = (reduced, len(uses))
    return out


class GradientBuckets:
    """Buckets the gradient reductions of ``program``'s bucketable parameters; see the module
    docstring. Construct it before the first forward."""

    def __init__(self, program: ShardedProgram, cap_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.program = program
        self.mesh = program.mesh
        deferred = deferred_parameters(program)
        program.deferred_gradients = set(deferred)
        tensors = {program.placeholder_fqn[name]: program.tensor(program.placeholder_fqn[name]) for name in deferred}
        self.before_step = reduced_before_step(program.plan.storage, tensors, tensors.keys())  # ZeRO-1's, to the step
        chosen = {name: found for name, found in deferred.items()
                  if id(tensors[program.placeholder_fqn[name]]) not in self.before_step}
        self._axes_of = {name: axes for name, (axes, _) in chosen.items()}
        self._edges = {name: edges for name, (_, edges) in chosen.items()}
        params = [(name, program.tensor(program.placeholder_fqn[name])) for name in chosen]
        self.buckets = self._make_buckets(reversed(params), cap_bytes)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._finishing = False
        for bucket in self.buckets:
            for p in bucket.params:
                p.register_post_accumulate_grad_hook(self._arrived)

    def _make_buckets(self, params: Iterable[tuple[str, torch.nn.Parameter]], cap_bytes: int) -> list[_Bucket]:
        open_: dict[tuple, _Bucket] = {}
        sizes: dict[tuple, int] = {}
        out: list[_Bucket] = []
        for name, p in params:
            key = (self._axes_of[name], p.dtype)
            local = p.to_local() if isinstance(p, DTensor) else p
            nbytes = local.numel() * local.element_size()
            if key in open_ and sizes[key] + nbytes > cap_bytes:
                del open_[key]
            if key not in open_:
                open_[key] = _Bucket([], key[0])
                sizes[key] = 0
                out.append(open_[key])
            open_[key].params.append(p)
            sizes[key] += nbytes
        return out

    def owns(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s gradient is reduced here, or left to the optimizer step (ZeRO-1)."""
        return id(param) in self._bucket_of or id(param) in self.before_step

    def replaced(self) -> int:
        """The plan's all-reduces of these parameters' gradients per step (edge by edge)."""
        return sum(self._edges[name] * len(axes) for name, axes in self._axes_of.items())

    def launched(self) -> int:
        """The all-reduces the buckets run per step."""
        return sum(len(b.axes) for b in self.buckets)

    def _arrived(self, param: torch.Tensor) -> None:
        if not self._finishing:
            self._finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket = self._bucket_of[id(param)]
        bucket.ready.add(id(param))
        if len(bucket.ready) == len(bucket.params):
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        locals_ = []
        for p in bucket.params:
            local, done = self._pending(p, bucket.axes)
            locals_.append(local)
            if done is not None:
                bucket.done[id(p)] = done
        flat = torch.cat([g.reshape(-1) for g in locals_])
        handles = []
        for i, axis in enumerate(bucket.axes):
            if i:  # one axis after the other on the same buffer
                handles[-1].wait()
            handles.append(dist.all_reduce(flat, group=self.mesh.get_group(axis), async_op=True))
        bucket.works.append((flat, handles))

    def _pending(self, p: torch.Tensor, axes: tuple[int, ...]) -> tuple[torch.Tensor, DTensor | None]:
        """The local gradient to add into the bucket's buffer, and the finished gradient where
        the backward left it in another form (then the buffer gets zeros for it).

        Expected: partial on the bucket's axes, the parameter's placement elsewhere. Where only
        the other axes differ (an embedding gives its table's gradient whole on a
        vocabulary-sharded axis), they are brought to the parameter's placement locally; where
        a bucket axis is not partial, the gradient is finished now with a redistribution."""
        grad = p.grad
        local_param = p.to_local() if isinstance(p, DTensor) else p
        if grad is None:
            return torch.zeros_like(local_param), None
        if not isinstance(grad, DTensor):
            return grad, None
        expected = tuple(Partial() if i in axes else q for i, q in enumerate(p.placements))
        if tuple(grad.placements) == expected:
            return grad.to_local(), None
        if all(grad.placements[i].is_partial() for i in axes):
            return reduce_to(grad, self.mesh, expected).to_local(), None
        done = reduce_to(grad, self.mesh, p.placements)
        return torch.zeros_like(done.to_local()), done

    def _finish(self) -> None:
        """End of the backward: launch what is left, wait, write the reduced gradients back."""
        self._finishing = False
        for bucket in self.buckets:
            if not bucket.works and bucket.ready:
                self._launch(bucket)
            for flat, handles in bucket.works:
                handles[-1].wait()
                offset = 0
                for p in bucket.params:
                    local = p.to_local() if isinstance(p, DTensor) else p
                    n = local.numel()
                    if id(p) in bucket.done:
                        p.grad = bucket.done[id(p)]
                    elif p.grad is not None:
                        piece = flat[offset:offset + n].view_as(local)
                        p.grad = DTensor.from_local(piece, self.mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
                    offset += n
            bucket.works.clear()
            bucket.ready.clear()
            bucket.done.clear()
