"""Which inputs an op keeps for its backward, found by running it on the meta device.

A parameter stored sharded and gathered before its use (ZeRO-3/FSDP) is gathered again in the
backward only where its consumer keeps it: ``linear`` keeps its weight (the gradient of its
input needs it) when that input needs a gradient, ``embedding`` and ``add`` keep none. Rather
than a table per op, :func:`saved_inputs` runs the op once on meta tensors under
``torch.autograd.graph.saved_tensors_hooks`` and reports the inputs that a saved tensor is, or
is a view of. The answer depends on which inputs need a gradient, so the caller says.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import fx


def _meta_like(value: object, requires_grad: bool) -> object:
    if not isinstance(value, torch.Tensor):
        return value
    meta = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype, device="meta")
    return meta.requires_grad_(requires_grad and (meta.is_floating_point() or meta.is_complex()))


def _is_of(saved: torch.Tensor, tensor: torch.Tensor) -> bool:
    return saved is tensor or saved._base is tensor or (tensor._base is not None and saved._base is tensor._base)


def saved_inputs(node: fx.Node, tensor_inputs: Sequence[fx.Node], needs_grad: Sequence[bool]) -> frozenset[int]:
    """Positions (in ``tensor_inputs``) of the inputs ``node`` keeps for its backward when input
    ``i`` needs a gradient iff ``needs_grad[i]``. An op the meta device cannot run is taken to
    keep all of them (the cautious answer)."""
    if node.op != "call_function" or not any(needs_grad):
        return frozenset()
    metas = {a: _meta_like(a.meta.get("val"), g) for a, g in zip(tensor_inputs, needs_grad)}
    args = fx.node.map_arg(node.args, lambda a: metas.get(a, a.meta.get("val")))
    kwargs = fx.node.map_arg(node.kwargs, lambda a: metas.get(a, a.meta.get("val")))
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op meta cannot run: assume it keeps its inputs
        return frozenset(range(len(tensor_inputs)))
    return frozenset(i for i, a in enumerate(tensor_inputs)
                     if isinstance(metas[a], torch.Tensor) and any(_is_of(s, metas[a]) for s in saved))


def _key(node: fx.Node, tensor_inputs: Sequence[fx.Node], needs_grad: Sequence[bool]) -> tuple:
    vals = [a.meta.get("val") for a in tensor_inputs]
    return (node.target, tuple((tuple(v.shape), v.dtype, tuple(v.stride())) if isinstance(v, torch.Tensor) else None
                               for v in vals), tuple(needs_grad),
            repr(fx.node.map_arg(node.args, lambda a: None)), repr(fx.node.map_arg(node.kwargs, lambda a: None)))


def keeps_value(consumer: fx.Node, value: fx.Node, needs_grad: Mapping[str, bool], cache: dict | None = None) -> bool:
    """Whether ``consumer`` keeps ``value`` (one of its inputs) for the backward itself (a view
    op keeps nothing; what the ops after it keep is a view they may read resharded, which the
    program keeps as it is). ``cache`` memoises the meta runs across calls (keyed by op, input
    geometry and which inputs need a gradient)."""
    cache = {} if cache is None else cache
    tensor_inputs = [a for a in consumer.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if value not in tensor_inputs:
        return False
    grads = [bool(needs_grad.get(a.name)) for a in tensor_inputs]
    key = _key(consumer, tensor_inputs, grads)
    if key not in cache:
        cache[key] = saved_inputs(consumer, tensor_inputs, grads)
    return tensor_inputs.index(value) in cache[key]


#: ATen ops whose output is a view of their input: they move no memory, only dispatch costs.
#: (``reshape``/``flatten`` copy when the strides do not allow a view; export's training IR
#: records an explicit ``clone``/``contiguous`` where a copy is needed.)
ALIASING_OPS = frozenset((
    "view", "_unsafe_view", "reshape", "flatten", "unflatten", "expand", "expand_as", "view_as", "transpose",
    "permute", "t", "unsqueeze", "squeeze", "alias", "detach", "slice", "select", "split", "split_with_sizes",
    "chunk", "unbind",
))


def regathers_for(consumer: fx.Node) -> bool:
    """Whether a parameter gathered for ``consumer`` is gathered again in the backward (where
    the consumer keeps it) rather than kept: for every op but a view, whose users may read the
    view resharded (:mod:`autoplan.codegen.parameter_regather`)."""
    packet = getattr(consumer.target, "overloadpacket", None)
    name = str(packet.__name__) if packet is not None else getattr(consumer.target, "__name__", "")
    return consumer.op == "call_function" and name not in ALIASING_OPS
