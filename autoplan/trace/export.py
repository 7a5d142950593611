"""Exporting ``loss_fn(module(*inputs), *inputs)`` with torch.export, and tidying the graph.

The user's module and loss are wrapped into one module whose forward returns
``(loss, *model_outputs)``, exported with ``torch.export.export(..., strict=False)`` in
training mode. Afterwards ``aten._assert_tensor_metadata`` nodes (no effect, no DTensor rule)
are dropped with the code that only fed them, the model's ``torch.autocast`` regions are
inlined with each op marked (:mod:`autoplan.trace.wrapped_regions`), and ``torch.no_grad()``
regions that read no trainable value are inlined as plain ATen ops.
"""

from __future__ import annotations

import contextlib
import inspect
import keyword
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

from autoplan.errors import AutoplanError
from autoplan.load import ModelSpec, _first_line
from autoplan.trace.experts import experts_as_one_op
from autoplan.trace.values import fake_value, tensor_leaves
from autoplan.trace.wrapped_regions import inline_autocast_regions, inline_wrapped, visible_autocast_helpers

__all__ = ["WRAPPER_PREFIX", "export_model", "tidy_graph"]

aten = torch.ops.aten

# The user's module is the attribute ``m`` of the exported wrapper: export names its parameters
# ``m.<fqn>`` and its modules ``m.<path>``; the prefix is removed everywhere in the TracedGraph.
_ATTR = "m"
WRAPPER_PREFIX = _ATTR + "."


class _LossAndOutputs(torch.nn.Module):
    """``forward(*inputs) -> (loss, *tensors of module(*inputs))``."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        setattr(self, _ATTR, spec.module)
        object.__setattr__(self, "_spec", spec)  # not registered: the module is ``m``
        object.__setattr__(self, "_loss_fn", spec.loss_fn)  # not registered, even if an nn.Module

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self._run(*inputs)

    def _run(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        output = self._spec.call(getattr(self, _ATTR), inputs)
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
        outputs = [t for t in tensor_leaves(output) if t is not loss]
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


def _make_wrapper(spec: ModelSpec) -> _LossAndOutputs:
    """A _LossAndOutputs whose forward names its arguments like the user's module does (or as
    the keyword inputs are named), so that export names the input placeholders ``input_ids``
    rather than ``inputs_0``."""
    count = len(spec.example_inputs)
    names = _input_names(spec.module, count)
    if spec.input_names is not None:
        names = [n if n not in ("self", _ATTR) and not n.startswith("_") and not keyword.iskeyword(n)
                 else f"input_{i}" for i, n in enumerate(spec.input_names)]
    arglist = ", ".join(names)
    namespace: dict[str, Any] = {}
    exec(f"def forward(self, {arglist}):\n    return self._run({arglist})\n", namespace)
    cls = type("_LossAndOutputs", (_LossAndOutputs,), {"forward": namespace["forward"]})
    return cls(spec)


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


@contextlib.contextmanager
def _no_stack_traces() -> Iterator[None]:
    """Export without recording each node's Python stack (nothing here reads it; it took about
    a fifth of a trace). A torch without that setting records them."""
    config = torch.fx.config
    if not hasattr(config, "do_not_emit_stack_traces"):
        yield
        return
    before = config.do_not_emit_stack_traces
    config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        config.do_not_emit_stack_traces = before


def export_model(spec: ModelSpec) -> torch.export.ExportedProgram:
    """The exported ``(loss, *model_outputs)`` of ``spec``; an :class:`AutoplanError` naming
    the cause when export fails."""
    wrapper = _make_wrapper(spec)
    with _export_mode(spec.module), _no_stack_traces(), experts_as_one_op(spec.module), \
            visible_autocast_helpers():
        try:
            return torch.export.export(wrapper, tuple(spec.example_inputs), strict=False)
        except AutoplanError:
            raise
        except Exception as e:
            text = f"{type(e).__name__}: {_first_line(e)}"
            if "DynamicOutputShape" in text:
                hint = ("an op's output shape depends on tensor values, which a trace on fake tensors cannot "
                        "follow; compute it outside the model or loss (CTC loss is one such op)")
            elif "data-dependent" in text or "DataDependent" in text:
                hint = ("the model branches on tensor values; make its Python control flow depend "
                        "on shapes only")
            else:
                hint = f"check that {spec.name} runs on its example inputs"
            raise AutoplanError(f"torch.export could not trace {spec.name}: {text} ({hint})") from e


def tidy_graph(gm: torch.fx.GraphModule) -> None:
    """Inline autocast and no-grad regions (:mod:`autoplan.trace.wrapped_regions`), drop
    metadata asserts, check and recompile ``gm`` in place."""
    inline_autocast_regions(gm)
    _inline_no_grad_regions(gm)
    _drop_assert_metadata(gm)
    gm.graph.lint()
    gm.recompile()


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
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not wrap_with_set_grad_enabled:
            continue
        enabled, sub_node, *operands = node.args
        if enabled is not False or node.kwargs or sub_node.op != "get_attr":
            continue
        if any(getattr(fake_value(a), "requires_grad", False) for a in node.all_input_nodes):
            continue
        inline_wrapped(gm, node, sub_node, operands)
