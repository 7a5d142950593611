"""Tracing a model into an ATen-level torch.fx graph whose nodes know their shapes and costs.

``trace(spec)`` wraps the user's module and loss into one module whose forward returns
``(loss, *model_outputs)`` and exports it with ``torch.export.export(..., strict=False)`` in
training mode. Export's training IR is ATen-level but keeps composite ops such as
``aten.linear``, ``aten.layer_norm`` and ``aten.scaled_dot_product_attention`` — the level at
which sharding strategies are written — so no decompositions are run. Export fakifies weights
(and works on ``torch.device("meta")`` models), so tracing never allocates or copies them.

After export: ``aten._assert_tensor_metadata`` nodes (no effect, no DTensor rule) are dropped with
the code that only fed them, and every node gets a :class:`NodeInfo` (shape, dtype, FLOPs, bytes,
module, parameters read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import keyword
import math
import operator
from typing import Any, Iterator

import torch
import torch.fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled
from torch.export.graph_signature import InputKind
from torch.utils.flop_counter import conv_flop_count, flop_registry

from autoplan.errors import AutoplanError
from autoplan.trace.graph import NodeInfo, TracedGraph
from autoplan.load import ModelSpec, _first_line

__all__ = ["trace", "WRAPPER_PREFIX"]

aten = torch.ops.aten

# The user's module is the attribute ``m`` of the exported wrapper: export names its parameters
# ``m.<fqn>`` and its modules ``m.<path>``; the prefix is removed everywhere in the TracedGraph.
_ATTR = "m"
WRAPPER_PREFIX = _ATTR + "."


# --------------------------------------------------------------------------------------------
# The exported wrapper


def _tensor_leaves(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in a model output, in order: tensors, tuples/lists, dicts (transformers'
    ModelOutput is an OrderedDict of its non-None fields), dataclasses; other leaves skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensor_leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensor_leaves(item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensor_leaves(getattr(value, f.name))


class _LossAndOutputs(torch.nn.Module):
    """``forward(*inputs) -> (loss, *tensors of module(*inputs))``."""

    def __init__(self, module: torch.nn.Module, loss_fn: Any) -> None:
        super().__init__()
        setattr(self, _ATTR, module)
        object.__setattr__(self, "_loss_fn", loss_fn)  # not registered, even if an nn.Module

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(*inputs)

    def _run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = getattr(self, _ATTR)(*inputs)
        loss = self._loss_fn(output, *inputs)
        if not isinstance(loss, torch.Tensor):
            raise AutoplanError(
                f"the loss function returned {type(loss).__name__}, not a tensor: "
                "make loss_fn(output, *inputs) return a scalar tensor"
            )
        if loss.dim() != 0:
            raise AutoplanError(
                f"the loss function returned a tensor of shape {tuple(loss.shape)}, not a scalar: "
                "reduce it (for example with .mean()) in loss_fn"
            )
        outputs = [t for t in _tensor_leaves(output) if t is not loss]
        return (loss, *outputs)


def _input_names(module: torch.nn.Module, count: int) -> list[str]:
    """Names for the user-input placeholders: the module's forward parameter names where they
    are plain positional ones (``input_ids``, ``attention_mask``), else ``input_<i>``."""
    names: list[str] = []
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        params = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) or len(names) == count:
            break
        names.append(p.name)
    out: list[str] = []
    for i in range(count):
        name = names[i] if i < len(names) else f"input_{i}"
        if (not name.isidentifier() or keyword.iskeyword(name) or name in out
                or name in ("self", _ATTR) or name.startswith("_")):
            name = f"input_{i}"
        out.append(name)
    return out


def _make_wrapper(module: torch.nn.Module, loss_fn: Any, count: int) -> _LossAndOutputs:
    """A _LossAndOutputs whose forward names its arguments like the user's module does, so that
    export names the input placeholders ``input_ids`` rather than ``inputs_0``."""
    names = _input_names(module, count)
    arglist = ", ".join(names)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {arglist}):\n    return self._run({arglist})\n", namespace)
    cls = type("_LossAndOutputs", (_LossAndOutputs,), {"forward": namespace["forward"]})
    return cls(module, loss_fn)


@contextlib.contextmanager
def _export_mode(module: torch.nn.Module) -> Iterator[None]:
    """Training mode and ``use_cache=False`` on every transformers config (a DynamicCache in the
    output is rejected by export) while exporting; the user's settings come back afterwards."""
    modes = [(m, m.training) for m in module.modules()]
    configs: dict[int, tuple[Any, Any]] = {}
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is not None and id(config) not in configs and hasattr(config, "use_cache"):
            configs[id(config)] = (config, config.use_cache)
            try:
                config.use_cache = False
            except Exception:  # a frozen config: leave it
                del configs[id(config)]
    module.train()
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode
        for config, value in configs.values():
            config.use_cache = value


def _export(spec: ModelSpec) -> torch.export.ExportedProgram:
    wrapper = _make_wrapper(spec.module, spec.loss_fn, len(spec.example_inputs))
    with _export_mode(spec.module):
        try:
            return torch.export.export(wrapper, tuple(spec.example_inputs), strict=False)
        except AutoplanError:
            raise
        except Exception as e:
            text = f"{type(e).__name__}: {_first_line(e)}"
            if "data-dependent" in text or "DataDependent" in text:
                hint = ("the model branches on tensor values; make its Python control flow depend "
                        "on shapes only")
            else:
                hint = f"check that {spec.name} runs on its example inputs"
            raise AutoplanError(f"torch.export could not trace {spec.name}: {text} ({hint})") from e


def _drop_assert_metadata(gm: torch.fx.GraphModule) -> None:
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten._assert_tensor_metadata.default:
            graph.erase_node(node)
    graph.eliminate_dead_code()


def _inline_no_grad_regions(gm: torch.fx.GraphModule) -> None:
    """Inlines ``wrap_with_set_grad_enabled(False, submod, *args)`` — export's form of a
    ``torch.no_grad()`` region, e.g. the rotary embedding of Llama — when none of its inputs
    requires grad: then no gradient could flow through it anyway, and plain ATen ops are what
    sharding strategies and DTensor understand. Regions that read parameters stay wrapped."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_set_grad_enabled:
            continue
        enabled, sub_node, *operands = node.args
        if enabled is not False or node.kwargs or sub_node.op != "get_attr":
            continue
        if any(getattr(_val(a), "requires_grad", False) for a in node.all_input_nodes):
            continue
        sub = getattr(gm, sub_node.target)
        if any(n.op not in ("placeholder", "call_function", "output") for n in sub.graph.nodes):
            continue  # nested regions: leave them
        env: dict[torch.fx.Node, Any] = {}
        sub_placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(sub_placeholders) != len(operands):
            continue
        env.update(zip(sub_placeholders, operands))
        result: Any = None
        with graph.inserting_before(node):
            for n in sub.graph.nodes:
                if n.op == "placeholder":
                    continue
                if n.op == "output":
                    result = torch.fx.node.map_arg(n.args[0], lambda a: env[a])
                    continue
                new = graph.node_copy(n, lambda a: env[a])
                # the region's ops belong to the module that opened it
                for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                    if key in node.meta and key not in n.meta:
                        new.meta[key] = node.meta[key]
                env[n] = new
        if isinstance(result, (tuple, list)):
            for user in list(node.users):
                if user.op == "call_function" and user.target is operator.getitem:
                    user.replace_all_uses_with(result[user.args[1]])
                    graph.erase_node(user)
            if node.users:  # used otherwise than through getitem: keep the region
                continue
        else:
            node.replace_all_uses_with(result)
        graph.erase_node(node)
        if not sub_node.users:
            graph.erase_node(sub_node)
            if not any(n.op == "get_attr" and n.target == sub_node.target for n in graph.nodes):
                delattr(gm, sub_node.target)


# --------------------------------------------------------------------------------------------
# Per-node facts


def _target_name(node: torch.fx.Node) -> str:
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)  # "aten.linear.default"
    if isinstance(target, str):
        return target
    name = getattr(target, "name", None)
    if callable(name):  # HigherOrderOperator.name()
        try:
            return str(name())
        except Exception:
            pass
    return getattr(target, "__name__", None) or str(target)


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _map_nodes(value: Any) -> Any:
    """args/kwargs with every fx Node replaced by its fake value."""
    return torch.fx.node.map_arg(value, lambda n: n.meta.get("val"))


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in x.shape)


# FLOPs of composite ops that export's training IR keeps but torch.utils.flop_counter only knows
# in decomposed form. Each takes the fake args, fake kwargs and the fake output.


def _linear_flops(args: tuple, kwargs: dict, out: Any) -> float:
    x, w = args[0], args[1]
    return 2.0 * math.prod(_shape(x)[:-1]) * w.shape[0] * w.shape[-1]


def _matmul_flops(args: tuple, kwargs: dict, out: Any) -> float:
    a, b = args[0], args[1]
    k = a.shape[-1]
    if a.dim() == 1 and b.dim() == 1:
        return 2.0 * k
    return 2.0 * out.numel() * k


def _sdpa_flops(args: tuple, kwargs: dict, out: Any) -> float:
    q, k, v = args[0], args[1], args[2]
    # q @ k^T then probabilities @ v, per query head (grouped-query attention included);
    # like torch.utils.flop_counter, causal masking is not discounted.
    rows = math.prod(_shape(q)[:-1])
    s_k = k.shape[-2]
    return 2.0 * rows * s_k * (q.shape[-1] + v.shape[-1])


def _conv_nd_flops(args: tuple, kwargs: dict, out: Any) -> float:
    x, w = args[0], args[1]
    x_shape, out_shape = list(_shape(x)), list(_shape(_first_tensor(out)))
    if len(x_shape) == w.dim() - 1:  # unbatched input
        x_shape, out_shape = [1, *x_shape], [1, *out_shape]
    return float(conv_flop_count(x_shape, list(_shape(w)), out_shape, transposed=False))


def _conv_transpose_nd_flops(args: tuple, kwargs: dict, out: Any) -> float:
    x, w = args[0], args[1]
    x_shape, out_shape = list(_shape(x)), list(_shape(_first_tensor(out)))
    if len(x_shape) == w.dim() - 1:
        x_shape, out_shape = [1, *x_shape], [1, *out_shape]
    return float(conv_flop_count(x_shape, list(_shape(w)), out_shape, transposed=True))


def _einsum_flops(args: tuple, kwargs: dict, out: Any) -> float:
    equation, operands = args[0], args[1]
    if len(operands) < 2:
        return 0.0
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    if any("..." in term for term in inputs):
        return 0.0
    sizes: dict[str, int] = {}
    for term, t in zip(inputs, operands):
        for letter, size in zip(term, t.shape):
            sizes[letter] = max(sizes.get(letter, 1), int(size))
    return 2.0 * math.prod(sizes.values()) * (len(operands) - 1)


_EXTRA_FLOPS = {
    aten.linear: _linear_flops,
    aten.matmul: _matmul_flops,
    aten.scaled_dot_product_attention: _sdpa_flops,
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_flops,
    aten._scaled_dot_product_attention_math: _sdpa_flops,
    aten.conv1d: _conv_nd_flops,
    aten.conv2d: _conv_nd_flops,
    aten.conv3d: _conv_nd_flops,
    aten.conv_transpose1d: _conv_transpose_nd_flops,
    aten.conv_transpose2d: _conv_transpose_nd_flops,
    aten.conv_transpose3d: _conv_transpose_nd_flops,
    aten.einsum: _einsum_flops,
}


def _flops(node: torch.fx.Node) -> float:
    target = node.target
    if not isinstance(target, torch._ops.OpOverload):
        return 0.0
    packet = target.overloadpacket
    extra = _EXTRA_FLOPS.get(packet)
    registered = None if extra is not None else flop_registry.get(packet)
    if extra is None and registered is None:
        return 0.0
    args, kwargs = _map_nodes(node.args), _map_nodes(node.kwargs)
    out = node.meta.get("val")
    try:
        if extra is not None:
            return float(extra(args, kwargs, out))
        # as FlopCounterMode calls them: the op's args and kwargs, out_val the op's output
        return float(registered(*args, **kwargs, out_val=out))
    except Exception:  # an unusual overload the formula does not understand: count nothing
        return 0.0


def _node_bytes(node: torch.fx.Node) -> float:
    """Bytes read (distinct tensor inputs) plus bytes written (tensor outputs)."""
    if node.op == "placeholder":
        return float(sum(_nbytes(t) for t in _tensors(node.meta.get("val"))))
    if node.op != "call_function" or node.target is operator.getitem:
        return 0.0
    total = 0
    for inp in node.all_input_nodes:
        total += sum(_nbytes(t) for t in _tensors(inp.meta.get("val")))
    total += sum(_nbytes(t) for t in _tensors(node.meta.get("val")))
    return float(total)


def _strip_prefix(path: str) -> str:
    if path == _ATTR:
        return ""
    if path.startswith(WRAPPER_PREFIX):
        return path[len(WRAPPER_PREFIX):]
    return path


def _class_name(t: Any) -> str:
    if isinstance(t, type):
        return t.__name__
    return str(t).rsplit(".", 1)[-1]


# --------------------------------------------------------------------------------------------
# Graph hash


def _encode(value: Any, index: dict[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return ("%", index[value])
    if isinstance(value, (tuple, list)):
        return tuple(_encode(v, index) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _encode(v, index)) for k, v in value.items()))
    if isinstance(value, torch.device):
        return "device"  # a plan made on the meta device applies to the real model
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (int, bool, str)) or value is None:
        return value
    if isinstance(value, slice):
        return ("slice", _encode(value.start, index), _encode(value.stop, index), _encode(value.step, index))
    return type(value).__name__


def _graph_hash(graph: torch.fx.Graph, infos: dict[str, NodeInfo]) -> str:
    h = hashlib.sha256()
    index: dict[torch.fx.Node, int] = {}
    counted = 0
    for node in graph.nodes:
        if node.target is aten.contiguous.default and len(node.args) == 1 and not node.kwargs:
            # whether export records a .contiguous() depends on the strides the device's kernels
            # produce (meta and CPU differ after attention): hash it as its input
            index[node] = index[node.args[0]]
            continue
        index[node] = counted
        counted += 1
        info = infos[node.name]
        record = (
            node.op,
            info.target,
            info.kind,
            info.fqn,
            _encode(node.args, index),
            _encode(node.kwargs, index),
            info.shape,
            info.dtype,
        )
        h.update(repr(record).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------
# trace


_KIND = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.USER_INPUT: "input",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.CUSTOM_OBJ: "constant",
    InputKind.TOKEN: "input",
}


def trace(spec: ModelSpec) -> TracedGraph:
    """The ATen-level graph of ``loss_fn(module(*inputs), *inputs)`` and the model's outputs,
    with a :class:`NodeInfo` per node. Works on meta-device models and on real ones (their
    weights are fakified, never copied)."""
    exported = _export(spec)
    gm = exported.graph_module
    _inline_no_grad_regions(gm)
    _drop_assert_metadata(gm)
    gm.graph.lint()
    gm.recompile()

    # placeholders: what export lifted, under the user's names
    placeholder_kind: dict[str, str] = {}
    param_names: dict[str, str] = {}
    input_names: list[str] = []
    for s in exported.graph_signature.input_specs:
        name = s.arg.name
        kind = _KIND.get(s.kind, "input")
        placeholder_kind[name] = kind
        if s.kind == InputKind.USER_INPUT:
            input_names.append(name)
        elif kind in ("parameter", "buffer", "constant") and s.target is not None:
            param_names[name] = _strip_prefix(s.target)

    root = spec.module
    root_type = type(root).__name__

    def owner(fqn: str) -> tuple[str, str]:
        path = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        try:
            return path, type(root.get_submodule(path)).__name__
        except AttributeError:  # a lifted constant that is no module's attribute
            return path, ""

    nodes: dict[str, NodeInfo] = {}
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        first = _first_tensor(val)
        shape = _shape(first) if first is not None else None
        dtype = _dtype_name(first.dtype) if first is not None else ""
        itemsize = first.element_size() if first is not None else 0
        fqn = None
        params: tuple[str, ...] = ()
        if node.op == "placeholder":
            kind = placeholder_kind.get(node.name, "input")
            fqn = param_names.get(node.name)
            module, module_type = owner(fqn) if fqn is not None else ("", "")
            flops = 0.0
        elif node.op == "output":
            kind, module, module_type, flops = "output", "", "", 0.0
        elif node.op == "get_attr":  # a sub-graph of a higher-order op that stayed wrapped
            kind, module, module_type, flops = "constant", "", "", 0.0
        else:
            kind = "op"
            stack = node.meta.get("nn_module_stack") or {}
            if stack:
                path, mtype = list(stack.values())[-1]
                module = _strip_prefix(path)
                module_type = root_type if module == "" else _class_name(mtype)
            else:
                module, module_type = "", root_type
            flops = _flops(node) if node.op == "call_function" else 0.0
            seen: list[str] = []
            for inp in node.all_input_nodes:
                name = param_names.get(inp.name)
                if name is not None and name not in seen:
                    seen.append(name)
            params = tuple(seen)
        nodes[node.name] = NodeInfo(
            name=node.name,
            kind=kind,
            target=_target_name(node),
            shape=shape,
            dtype=dtype,
            itemsize=itemsize,
            flops=flops,
            bytes=_node_bytes(node),
            module=module,
            module_type=module_type,
            params=params,
            fqn=fqn,
        )

    return TracedGraph(
        graph_module=gm,
        nodes=nodes,
        graph_hash=_graph_hash(gm.graph, nodes),
        input_names=input_names,
        param_names=param_names,
        exported=exported,
        tied=_tied_parameters(gm, param_names, root),
    )


def _tied_parameters(
    gm: torch.fx.GraphModule, param_names: dict[str, str], root: torch.nn.Module
) -> dict[str, str]:
    """Parameters that are one tensor under several names (GPT-2's ``lm_head.weight`` is
    ``transformer.wte.weight``). Export gives each name a placeholder but routes every use
    through one of them; maps each other name to the FQN of the placeholder the graph reads."""
    tensors: dict[str, torch.Tensor] = dict(root.named_parameters(remove_duplicate=False))
    tensors.update(root.named_buffers(remove_duplicate=False))
    read = {param_names[n.name] for n in gm.graph.nodes if n.op == "placeholder" and n.users
            and n.name in param_names}
    groups: dict[int, list[str]] = {}
    for fqn in param_names.values():
        if fqn in tensors:
            groups.setdefault(id(tensors[fqn]), []).append(fqn)
    tied: dict[str, str] = {}
    for fqns in groups.values():
        if len(fqns) > 1:
            canonical = next((f for f in fqns if f in read), fqns[0])
            tied.update({f: canonical for f in fqns if f != canonical})
    return tied
