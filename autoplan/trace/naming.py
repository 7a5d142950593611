"""Names in a traced graph: an op's target name, the module each op came from, the FQN of each
lifted parameter or buffer, and parameters that are one tensor under several names."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch.export.graph_signature import ExportGraphSignature, InputKind

from autoplan.trace.export import WRAPPER_PREFIX

__all__ = ["PlaceholderNames", "module_of_op", "owner_module", "placeholder_names", "strip_prefix",
           "target_name", "tied_parameters"]

_KIND = {
    InputKind.PARAMETER: "parameter",
    InputKind.BUFFER: "buffer",
    InputKind.USER_INPUT: "input",
    InputKind.CONSTANT_TENSOR: "constant",
    InputKind.CUSTOM_OBJ: "constant",
    InputKind.TOKEN: "input",
}


def target_name(node: torch.fx.Node) -> str:
    """``"aten.linear.default"`` for an ATen op; ``"getitem"``, ``"placeholder"``, … otherwise."""
    if node.op in ("placeholder", "output", "get_attr"):
        return node.op
    target = node.target
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, str):
        return target
    name = getattr(target, "name", None)
    if callable(name):  # HigherOrderOperator.name()
        try:
            return str(name())
        except Exception:  # not a HigherOrderOperator after all: its Python name follows
            pass
    return getattr(target, "__name__", None) or str(target)


def strip_prefix(path: str) -> str:
    """A module path or FQN of the exported wrapper as a path of the user's module."""
    if path == WRAPPER_PREFIX[:-1]:
        return ""
    if path.startswith(WRAPPER_PREFIX):
        return path[len(WRAPPER_PREFIX):]
    return path


def _class_name(t: Any) -> str:
    if isinstance(t, type):
        return t.__name__
    return str(t).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class PlaceholderNames:
    """What export lifted, under the user's names: ``kind`` per placeholder (``"parameter"``,
    ``"buffer"``, ``"input"``, ``"constant"``), ``fqn`` per parameter/buffer/constant
    placeholder, and the user inputs' placeholder names in order."""

    kind: dict[str, str]
    fqn: dict[str, str]
    inputs: list[str]


def placeholder_names(signature: ExportGraphSignature) -> PlaceholderNames:
    kinds: dict[str, str] = {}
    fqns: dict[str, str] = {}
    inputs: list[str] = []
    for s in signature.input_specs:
        name = s.arg.name
        kind = _KIND.get(s.kind, "input")
        kinds[name] = kind
        if s.kind == InputKind.USER_INPUT:
            inputs.append(name)
        elif kind in ("parameter", "buffer", "constant") and s.target is not None:
            fqns[name] = strip_prefix(s.target)
    return PlaceholderNames(kinds, fqns, inputs)


def owner_module(root: torch.nn.Module, fqn: str) -> tuple[str, str]:
    """(path, class name) of the module holding the parameter or buffer ``fqn``; the class
    name is empty for a lifted constant that is no module's attribute."""
    path = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    try:
        return path, type(root.get_submodule(path)).__name__
    except AttributeError:
        return path, ""


def module_of_op(node: torch.fx.Node, root_type: str) -> tuple[str, str]:
    """(path, class name) of the innermost module an op came from; the root's is ``""``."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", root_type
    path, mtype = list(stack.values())[-1]
    module = strip_prefix(path)
    return module, root_type if module == "" else _class_name(mtype)


def tied_parameters(gm: torch.fx.GraphModule, param_names: dict[str, str], root: torch.nn.Module) -> dict[str, str]:
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
