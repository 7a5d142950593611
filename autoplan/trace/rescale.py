"""A traced graph at another batch size, written from two traces instead of a third trace.

Tracing a real-size model takes seconds (torch.export runs the model's Python code op by op),
and the pipeline search needs the graph of one microbatch for every microbatch count it
tries. Two traces of one model at batch sizes ``a`` and ``b`` whose nodes, ops and wiring are
the same differ only in integers: shapes, strides and the size arguments of views and
expands. Each such integer is taken as affine in the batch size,

    v(n) = v(a) + (v(b) − v(a)) · (n − a) / (b − a),

and the graph at ``n`` is written node by node from the two (:func:`rescale`): the same ops,
their arguments and fake values at ``v(n)``, every :class:`NodeInfo` computed again from them.
Anything else that differs (another op or wiring, a float, a value that is not a whole number
at ``n``, a negative size) raises :class:`NotAffine`, and the caller traces ``n``.

Model code may branch on the batch size in ways two traces cannot see (a special case for one
sample), so a rescaled graph is a search-time estimate: :class:`BatchSizeGraphs` says which
graphs were traced, and a plan that will run is made on a traced graph
(:mod:`autoplan.planner.pipeline` traces the winners' microbatch sizes it has not traced).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor

from autoplan.trace.deepen import NotDeepenable
from autoplan.trace.graph import TracedGraph, lazy_graph_module

__all__ = ["BatchSizeGraphs", "KnownGraph", "NotAffine", "rescale"]


class NotAffine(Exception):
    """Two traces differ in something other than integers affine in the batch size."""


@dataclass(frozen=True)
class _Line:
    """The affine map through (a, v(a)) and (b, v(b)), evaluated at n."""

    a: int
    b: int
    n: int

    def value(self, va: int, vb: int) -> int:
        if va == vb:
            return va
        step = (vb - va) * (self.n - self.a)
        if step % (self.b - self.a):
            raise NotAffine(f"{va} at {self.a} and {vb} at {self.b} give no whole number at {self.n}")
        return va + step // (self.b - self.a)

    def size(self, va: int, vb: int) -> int:
        out = self.value(va, vb)
        if out < 0:
            raise NotAffine(f"a size of {va} at {self.a} and {vb} at {self.b} is negative at {self.n}")
        return out


def _argument(x: Any, y: Any, line: _Line, env: dict[str, torch.fx.Node],
              counterpart: dict[str, torch.fx.Node]) -> Any:
    """The argument at ``line.n`` from its values in the two traces: fx nodes of the first
    must read their ``counterpart`` in the second, and are mapped by name into ``env`` (the
    graph being written)."""
    if isinstance(x, torch.fx.Node):
        if not isinstance(y, torch.fx.Node) or counterpart.get(x.name) is not y:
            raise NotAffine(f"wiring differs at {x.name}")
        return env[x.name]
    if type(x) is not type(y) and not any(isinstance(x, t) and isinstance(y, t) for t in (list, dict)):
        # (fx's immutable_list and immutable_dict are lists and dicts)
        raise NotAffine(f"{x!r} and {y!r} differ in type")
    if type(x) is int:
        return line.value(x, y)
    if isinstance(x, (tuple, list)):
        if len(x) != len(y):
            raise NotAffine(f"{x!r} and {y!r} differ in length")
        items = [_argument(p, q, line, env, counterpart) for p, q in zip(x, y)]
        return type(x)(items) if not hasattr(x, "_fields") else type(x)(*items)
    if isinstance(x, dict):
        if x.keys() != y.keys():
            raise NotAffine(f"{x!r} and {y!r} differ in keys")
        return {k: _argument(x[k], y[k], line, env, counterpart) for k in x}
    if isinstance(x, slice):
        return slice(*(_argument(p, q, line, env, counterpart) for p, q in
                       ((x.start, y.start), (x.stop, y.stop), (x.step, y.step))))
    if x != y:
        raise NotAffine(f"{x!r} and {y!r} differ")
    return x


def _fake_value(x: Any, y: Any, line: _Line) -> Any:
    """A node's fake value at ``line.n``: fake tensors of the interpolated shape. Strides are
    interpolated where they are affine, else contiguous: nothing is planned on strides, and
    torch leaves a dimension of size one free to take any."""
    if isinstance(x, torch.Tensor):
        if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.dim() != y.dim() or x.device != y.device:
            raise NotAffine("a fake value differs in dtype, rank or device")
        shape = [line.size(int(p), int(q)) for p, q in zip(x.shape, y.shape)]
        try:
            stride = [line.size(int(p), int(q)) for p, q in zip(x.stride(), y.stride())]
        except NotAffine:
            stride = list(torch._prims_common.make_contiguous_strides_for(shape)) if shape else []
        mode = getattr(x, "fake_mode", None)
        if mode is None:
            raise NotAffine("a value is not a fake tensor")
        # made as the mode makes its own outputs (a meta tensor wrapped), not dispatched: a
        # rescaled graph has thousands of values, and dispatch costs five times as much
        out = FakeTensor(mode, torch.empty_strided(shape, stride, dtype=x.dtype, device="meta"), x.device)
        if x.requires_grad:
            out.requires_grad_(True)
        return out
    if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)) and len(x) == len(y):
        return type(x)(_fake_value(p, q, line) for p, q in zip(x, y))
    if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
        raise NotAffine("a value is symbolic")
    return _argument(x, y, line, {}, {})


# Ops a trace of one sample may leave out: at size one they change nothing (an expand to the
# shape the tensor has, a contiguous of a tensor already contiguous), so export does not record them.
_IDENTITY_AT_ONE = (torch.ops.aten.expand.default, torch.ops.aten.contiguous.default)


def _stand_in(x: torch.fx.Node, counterpart: dict[str, torch.fx.Node]) -> tuple[tuple, dict, Any]:
    """The args, kwargs and value a node of ``_IDENTITY_AT_ONE`` would have had in the trace
    of one sample, which left it out: those of an op that returns its input as it is."""
    source = counterpart[x.args[0].name]
    value = source.meta.get("val")
    if x.target is torch.ops.aten.expand.default:
        sizes = x.args[1]
        if not isinstance(value, torch.Tensor) or len(sizes) != value.dim():
            raise NotAffine(f"{x.name} adds dimensions")
        kept = [-1 if s == -1 else int(d) for s, d in zip(sizes, value.shape)]  # -1 keeps a size
        return (source, kept), dict(x.kwargs), value
    return (source, *x.args[1:]), dict(x.kwargs), value


def _aligned(nodes_a: list[torch.fx.Node], nodes_b: list[torch.fx.Node], one_sample: bool
             ) -> Iterator[tuple[torch.fx.Node, torch.fx.Node | None]]:
    """The nodes of the first trace, each with its node in the second (None where the second,
    a trace of one sample, left out an op of ``_IDENTITY_AT_ONE``)."""
    j = 0
    for x in nodes_a:
        y = nodes_b[j] if j < len(nodes_b) else None
        if y is not None and x.op == y.op and x.target == y.target:
            j += 1
            yield x, y
        elif one_sample and x.op == "call_function" and x.target in _IDENTITY_AT_ONE:
            yield x, None
        else:
            raise NotAffine(f"node {x.name} ({x.op} {x.target}) has no counterpart")
    if j != len(nodes_b):
        raise NotAffine(f"{len(nodes_b) - j} nodes of the second trace have no counterpart")


def rescale(first: TracedGraph, second: TracedGraph, sizes: tuple[int, int], size: int,
            describe: Callable[[torch.fx.GraphModule, Any], TracedGraph]) -> TracedGraph:
    """The graph at batch ``size`` from ``first`` and ``second`` traced at ``sizes`` (see the
    module docstring); ``describe(graph_module, exported)`` makes the TracedGraph of the
    written graph module. Raises :class:`NotAffine` where the two traces differ otherwise."""
    a, b = sizes
    if a == b or a == 1:
        raise NotAffine("two traces at one batch size, or the trace of one sample first")
    line = _Line(a, b, size)
    gm_a, gm_b = first.graph_module, second.graph_module
    graph = torch.fx.Graph()
    graph._codegen = gm_a.graph._codegen  # the flat signature export gave both
    env: dict[str, torch.fx.Node] = {}
    counterpart: dict[str, torch.fx.Node] = {}  # node of the first trace -> node of the second
    for x, y in _aligned(list(gm_a.graph.nodes), list(gm_b.graph.nodes), b == 1):
        if y is None:
            y_args, y_kwargs, y_value = _stand_in(x, counterpart)
            counterpart[x.name] = counterpart[x.args[0].name]
        else:
            if x.op == "get_attr" and getattr(gm_a, x.target).code != getattr(gm_b, y.target).code:
                raise NotAffine(f"the sub-graph {x.target} differs")
            y_args, y_kwargs, y_value = y.args, y.kwargs, y.meta.get("val")
            counterpart[x.name] = y
        node = graph.create_node(x.op, x.target, _argument(x.args, y_args, line, env, counterpart),
                                 _argument(x.kwargs, y_kwargs, line, env, counterpart), name=x.name,
                                 type_expr=x.type)
        if node.name != x.name:
            raise NotAffine(f"node {x.name} could not keep its name")
        node.meta = {k: v for k, v in x.meta.items() if k not in ("val", "tensor_meta")}
        if "val" in x.meta:
            node.meta["val"] = _fake_value(x.meta["val"], y_value, line)
        env[x.name] = node
    return describe(lazy_graph_module(gm_a, graph), first.exported)


@dataclass(frozen=True)
class KnownGraph:
    """A graph of the model at some batch size: ``traced``, or written from a trace of the first
    blocks or rescaled from two graphs (an estimate of the trace)."""

    graph: TracedGraph
    traced: bool


@dataclass
class BatchSizeGraphs:
    """One model's graphs by batch size: ``trace(size)`` traces; ``base(size)`` writes the graph
    from a trace of the model's first blocks by ``deepen(size)`` where it is given and the
    model allows (:mod:`autoplan.trace.deepen`), else traces; the others are rescaled from the
    two largest of those (:func:`rescale`) where that is possible. ``trace_s`` is the time
    spent in all of it."""

    trace_fn: Callable[[int], TracedGraph]
    describe: Callable[[torch.fx.GraphModule, Any], TracedGraph]
    deepen: Callable[[int], TracedGraph] | None = None
    traced: dict[int, TracedGraph] = field(default_factory=dict)
    rescaled: dict[int, TracedGraph] = field(default_factory=dict)
    deepened: dict[int, TracedGraph] = field(default_factory=dict)
    trace_s: float = 0.0

    def trace(self, size: int) -> TracedGraph:
        """The graph traced at batch ``size``."""
        if size not in self.traced:
            start = time.perf_counter()
            self.traced[size] = self.trace_fn(size)
            self.trace_s += time.perf_counter() - start
        return self.traced[size]

    def base(self, size: int) -> TracedGraph:
        """A graph at batch ``size`` to rescale others from: written from a trace of the first
        blocks where the model allows, else traced."""
        if size not in self.traced and size not in self.deepened and self.deepen is not None:
            start = time.perf_counter()
            try:
                self.deepened[size] = self.deepen(size)
            except NotDeepenable:
                self.deepen = None  # the model's blocks do not allow it: traced instead
            finally:
                self.trace_s += time.perf_counter() - start
        return self.deepened[size] if size in self.deepened else self.trace(size)

    def get(self, size: int) -> TracedGraph:
        """The graph at batch ``size``: traced or written from a trace of the first blocks
        (:meth:`base`), or rescaled from the two largest of those. (A dimension of size one
        broadcasts, and a trace of one sample may leave out ops that change nothing at that
        size, an ``expand`` or a ``contiguous``: it is rescaled from only as the second base,
        with those ops stood in for, and never rescaled to.)"""
        if size in self.traced:
            return self.traced[size]
        if size in self.deepened:
            return self.deepened[size]
        if size not in self.rescaled:
            bases = sorted({**self.deepened, **self.traced}.items(), reverse=True)[:2]
            if size == 1 or len(bases) < 2 or bases[0][0] == 1:
                return self.base(size)
            start = time.perf_counter()
            (a, first), (b, second) = bases
            try:
                self.rescaled[size] = rescale(first, second, (a, b), size, self.describe)
            except NotAffine:
                self.trace_s += time.perf_counter() - start
                return self.base(size)
            self.trace_s += time.perf_counter() - start
        return self.rescaled[size]

    def made(self, size: int) -> KnownGraph:
        """The graph at batch ``size`` (:meth:`get`), and whether it was traced."""
        graph = self.get(size)
        return KnownGraph(graph, traced=self.is_traced(graph))

    def is_traced(self, graph: TracedGraph) -> bool:
        return any(graph is g for g in self.traced.values())
