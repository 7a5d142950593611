"""A deep model's graph written from a trace of its first few blocks.

torch.export runs the model's Python code op by op on fake tensors: about 70 ms per decoder
block of a Llama, so a trace of an 80-block model takes seconds, and the pipeline search needs
one per microbatch size. Its blocks are copies: each stack of repeated blocks (an
``nn.ModuleList`` or ``nn.Sequential`` of at least ``MIN_BLOCKS`` modules, those after the
first of one class with equal parameter shapes: a decoder's; an encoder's and a decoder's; a
vision tower's and a text tower's, :func:`repeated_stacks`) is cut for the trace, and the graph
of all its blocks is written from that trace (:func:`deepened_trace`), one stack after the
other. The copies are *units* of ``period`` consecutive blocks: one block where every block
does the same, two where sliding-window and global attention alternate (Gemma 2), six for
Gemma 3's five to one; the period is the fewest blocks after which the blocks' plain attributes
(flags, sizes, attention kinds, :func:`settings_period`) repeat. Of ``N`` units the first
``K = TRACED_BLOCKS`` are traced:

- the nodes of the last traced unit (``K - 1``) are copied ``N - K`` times; in each copy an
  argument from unit ``K - 1`` is read from the same copy, one from unit ``K - 2`` (the
  previous unit: the residual stream) from the copy before, and one from outside the blocks
  (rotary tables, masks) as it is; a node after the blocks reads the last copy;
- parameters and buffers: unit ``K - 1``'s placeholders, renamed and re-targeted for each
  copy, follow its own in the signature (``p_m_model_layers_2_mlp_up_proj_weight`` →
  ``…_layers_5_…``; a block's buffers lie apart from its parameters, and so do their copies);
- names: fx numbers the nodes of one base name in creation order (``linear``, ``linear_1``,
  …), and every unit uses the same count of each (measured from unit ``K - 2`` to ``K - 1``:
  ``step[base]``). Copy ``j`` of a node numbered ``n`` in unit ``K - 1`` is numbered
  ``n + (j - K + 1) · step``; a node outside the blocks numbered above every unit's number
  of its base (the head, the loss, the no-grad regions inlined after the trace) moves up by
  ``(N - K) · step``;
- the ``nn_module_stack`` of a copy names its own blocks; fake values are unit ``K - 1``'s.

Units ``K - 2`` and ``K - 1`` must match node for node (op, name base, shape, dtype, wiring,
constants; what each reads of the unit before it counted from that unit's end, as the first
block may differ: DeepSeek-V3's is dense, the others mixtures of experts), and a unit may read
only itself, the one before it and the first (T5's blocks read the first block's position bias:
then four units are traced, so that the last two read the first alike and the copies read it
too), else a unit of more blocks is tried, and then the stack is traced whole
(:class:`UnitsDiffer`); the trace must cover at most half a stack's blocks, or the stack is
traced whole. The blocks' ops must be contiguous, nothing after the blocks may read an earlier
unit, and no block may write a buffer or hold a sub-graph; otherwise, or where every stack is
traced whole, :class:`NotDeepenable`, and the caller traces the whole model. Model code may
still treat a block beyond the traced ones differently (by its index, in code only), so a
written graph, like a rescaled one (:mod:`autoplan.trace.rescale`), is a search-time estimate:
the plan that runs is made on a trace of the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.export
import torch.fx
from torch.export.graph_signature import ExportGraphSignature, InputSpec, OutputSpec, TensorArgument

from autoplan.load import ModelSpec
from autoplan.trace.export import WRAPPER_PREFIX, export_model, tidy_graph
from autoplan.trace.graph import TracedGraph, lazy_graph_module
from autoplan.trace.tracer import describe

__all__ = ["MIN_BLOCKS", "NotDeepenable", "PERIODS", "TRACED_BLOCKS", "UnitsDiffer", "deepened_trace",
           "repeated_stacks", "settings_period"]

TRACED_BLOCKS = 3  # K units (4 where units read the first): unit K-1 is copied, its match with K-2 wires them
PERIODS = (1, 2, 3, 4, 6)  # blocks per unit tried, fewest first (Gemma 2 alternates two kinds of attention)
MIN_BLOCKS = 6  # fewer blocks than this: the whole model is traced (little to save)

_NUMBERED = re.compile(r"^(.*)_(\d+)$")


class NotDeepenable(Exception):
    """The model's graph cannot be written from a trace of its first blocks."""


@dataclass(frozen=True)
class Stack:
    """A stack of repeated blocks: ``path`` of the container in the user's module, its
    ``length``."""

    path: str
    length: int


def repeated_stacks(module: torch.nn.Module) -> list[Stack]:
    """Every ``nn.ModuleList`` / ``nn.Sequential`` of at least ``MIN_BLOCKS`` modules whose
    modules after the first are of one class, with parameters of equal names and shapes (an
    encoder's and a decoder's, a vision tower's and a language model's), outermost first, none
    inside another (a block's list of experts is part of the block)."""
    found: list[Stack] = []
    for path, child in module.named_modules():
        if not path or not isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) \
                or len(child) < MIN_BLOCKS or not all(name.isdigit() for name, _ in child.named_children()):
            continue  # (the user's module itself is not cut: the trace calls it)
        blocks = list(child)[1:]  # the first block may differ (T5's holds the position bias)
        first = [(name, tuple(p.shape)) for name, p in blocks[0].named_parameters()]
        if not first or any(type(b) is not type(blocks[0]) for b in blocks) or any(
                [(name, tuple(p.shape)) for name, p in b.named_parameters()] != first for b in blocks[1:]):
            continue
        found.append(Stack(path, len(child)))
    chosen: list[Stack] = []
    for stack in sorted(found, key=lambda s: (s.path.count("."), -s.length)):
        if not any(_nested(stack.path, other.path) or _nested(other.path, stack.path) for other in chosen):
            chosen.append(stack)
    return chosen


def _nested(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer + ".")


_PLAIN = (bool, int, float, str, type(None))


def _settings(block: torch.nn.Module) -> dict[tuple[str, str], object]:
    """A block's plain attributes (flags, sizes, names) and its submodules', by (path, name)."""
    return {(path, name): value for path, module in block.named_modules() for name, value in vars(module).items()
            if not name.startswith("_") and name != "training" and isinstance(value, _PLAIN)}


def settings_period(blocks: list[torch.nn.Module]) -> int | None:
    """The fewest blocks after which the blocks' plain attributes repeat, the first block aside
    (Gemma 3: five sliding-window layers, then a global one: 6), leaving out an attribute
    that differs in every block (its index); None where no period of ``PERIODS`` does."""
    settings = [_settings(block) for block in blocks[1:]]
    keys = set().union(*settings)
    index_like = {key for key in keys if len({repr(s.get(key)) for s in settings}) == len(settings)}
    rows = [tuple(sorted((k, repr(v)) for k, v in s.items() if k not in index_like)) for s in settings]
    for period in PERIODS:
        if all(rows[i] == rows[i + period] for i in range(len(rows) - period)):
            return period
    return None


@contextlib.contextmanager
def _cut_to(module: torch.nn.Module, stack: Stack, count: int) -> Iterator[None]:
    """``module`` with the stack holding only its first ``count`` blocks, put back afterwards."""
    parent_path, _, attr = stack.path.rpartition(".")
    parent = module.get_submodule(parent_path)
    whole = getattr(parent, attr)
    first = list(whole)[:count]
    setattr(parent, attr, torch.nn.Sequential(*first) if isinstance(whole, torch.nn.Sequential)
            else torch.nn.ModuleList(first))
    try:
        yield
    finally:
        setattr(parent, attr, whole)


def _split_name(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    return (match.group(1), int(match.group(2))) if match else (name, 0)


def _join_name(base: str, number: int) -> str:
    return f"{base}_{number}" if number else base


def _shifted(pattern: str, text: str, shift: int) -> str:
    """``text`` with the block index that follows ``pattern`` (a regex) moved by ``shift``."""
    moved, count = re.subn(pattern, lambda m: f"{m.group(1)}{int(m.group(2)) + shift}", text, count=1)
    if not count:
        raise NotDeepenable(f"{text} does not name its block")
    return moved


def _block_path(stack: Stack) -> str:
    return re.escape(f"{WRAPPER_PREFIX}{stack.path}.")


def _param_name(name: str, stack: Stack, shift: int) -> str:
    """A block parameter's placeholder name (``p_m_model_layers_2_mlp_up_proj_weight``) for the
    block ``shift`` further on."""
    sanitized = re.escape("_" + f"{WRAPPER_PREFIX}{stack.path}".replace(".", "_") + "_")
    return _shifted(f"({sanitized})(\\d+)(?=_)", name, shift)


def _fqn(target: str, stack: Stack, shift: int) -> str:
    return _shifted(f"^({_block_path(stack)})(\\d+)(?=\\.)", target, shift)


def _block_index(stack: Stack, path: str | None) -> int | None:
    """The block of ``stack`` that the exported module path or FQN ``path`` is in."""
    head = f"{WRAPPER_PREFIX}{stack.path}."
    if not path or not path.startswith(head):
        return None
    index = path[len(head):].split(".", 1)[0]
    return int(index) if index.isdigit() else None


class _Blocks:
    """The traced graph's nodes of each unit of ``period`` consecutive blocks: its placeholders
    (by their FQN) and its ops (by their innermost module), in graph order."""

    def __init__(self, gm: torch.fx.GraphModule, targets: dict[str, str | None], stack: Stack, period: int) -> None:
        self.stack, self.period = stack, period
        self.params: dict[int, list[torch.fx.Node]] = {}
        self.ops: dict[int, list[torch.fx.Node]] = {}
        self.where: dict[torch.fx.Node, tuple[str, int, int]] = {}  # node -> (kind, block, position)
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                index, kind = _block_index(stack, targets.get(node.name)), "param"
            elif node.op == "call_function":
                index, kind = _block_index(stack, _module_path(node)), "op"
            elif node.op == "get_attr":
                if any(_block_index(stack, _module_path(user)) is not None for user in node.users):
                    raise NotDeepenable("a block holds a sub-graph")
                continue
            else:
                continue
            if index is not None:
                unit = index // period
                members = (self.params if kind == "param" else self.ops).setdefault(unit, [])
                self.where[node] = (kind, unit, len(members))
                members.append(node)

    def encode(self, node: torch.fx.Node, index: int) -> tuple:
        """``node`` of block ``index`` as plain data: its op, target, value's shape and dtype,
        and its arguments with every node written by where it is (this block's op or
        parameter at a position, the previous block's op at a position from its end, the first
        block's op at a position, or a node outside the blocks by name)."""

        def where(arg: torch.fx.Node) -> tuple:
            found = self.where.get(arg)
            if found is None:
                return ("outside", arg.name)
            kind, block, position = found
            if block == index:
                return (kind, position)
            if block == index - 1 and kind == "op":  # counted from its end: a first block may differ
                return ("previous", position - len(self.ops[block]))
            if block == 0 and kind == "op":  # what the first unit computes for all (T5's position bias)
                return ("first", position)
            raise UnitsDiffer(f"{node.name} reads {arg.name}, of a unit before the previous one", self.stack)

        value = node.meta.get("val")
        shape = (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else type(value).__name__
        return (node.op, node.target, _split_name(node.name)[0], shape,
                repr(torch.fx.node.map_arg((node.args, node.kwargs), where)))


def _module_path(node: torch.fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack") or {}
    return list(stack.values())[-1][0] if stack else None


def _rename_stack(meta: dict, stack: Stack, shift: int) -> dict:
    """``meta`` with its ``nn_module_stack`` naming the block ``shift`` further on."""
    pattern = re.compile(f"({_block_path(stack)})(\\d+)(?=$|\\.)")

    def moved(text: str) -> str:
        return pattern.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + shift}", text)

    out = dict(meta)
    module_stack = meta.get("nn_module_stack")
    if module_stack:
        out["nn_module_stack"] = {moved(key): (moved(path), kind) for key, (path, kind) in module_stack.items()}
    return out


class UnitsDiffer(NotDeepenable):
    """The last two traced units of ``stack`` differ, or read a unit before the previous one: a
    longer period may repeat, else the stack is traced whole."""

    def __init__(self, message: str, stack: Stack, more_units: bool = False) -> None:
        super().__init__(message)
        self.stack = stack
        self.more_units = more_units  # the same units may match with one more traced


class StacksDiffer(NotDeepenable):
    """The units of some stacks differ (:class:`UnitsDiffer`, in ``refusals``)."""

    def __init__(self, refusals: list[UnitsDiffer]) -> None:
        super().__init__("; ".join(str(r) for r in refusals))
        self.refusals = refusals


def _steps(blocks: _Blocks, stack: Stack, k: int, period: int) -> dict[str, int]:
    """Check that units ``k - 2`` and ``k - 1`` match node for node; each name base's step in
    number from one unit to the next."""
    previous, last = blocks.ops.get(k - 2, []), blocks.ops.get(k - 1, [])
    if not last or len(previous) != len(last):
        raise UnitsDiffer(f"the last two traced units have {len(previous)} and {len(last)} ops", stack)
    if [_param_name(p.name, stack, period) for p in blocks.params.get(k - 2, [])] != \
            [p.name for p in blocks.params.get(k - 1, [])]:
        raise UnitsDiffer("the last two traced units have different parameters", stack)
    step: dict[str, int] = {}
    for x, y in zip(previous, last):
        if blocks.encode(x, k - 2) != blocks.encode(y, k - 1):
            # a unit reading the first: the second reads it as the previous one, the third on alike
            reads_first = k - 2 == 1 and any(blocks.where.get(a, ("", -1, 0))[1] == 0 for a in y.all_input_nodes)
            raise UnitsDiffer(f"{x.name} and {y.name} differ", stack, more_units=reads_first)
        base, first = _split_name(x.name)
        _, second = _split_name(y.name)
        if step.setdefault(base, second - first) != second - first or second <= first:
            raise UnitsDiffer(f"{x.name} and {y.name} are not numbered one unit apart", stack)
    return step


def deepened_trace(spec: ModelSpec, stacks: list[Stack] | None = None) -> TracedGraph:
    """The traced graph of ``spec`` written from a trace of the first ``TRACED_BLOCKS`` units of
    each of its repeated stacks (:func:`repeated_stacks`), a unit the fewest blocks that repeat
    (``PERIODS``, multiples of the period of the blocks' settings, :func:`settings_period`;
    module docstring). A stack whose units do not repeat within that is traced whole;
    :class:`NotDeepenable` where every stack is."""
    stacks = repeated_stacks(spec.module) if stacks is None else stacks
    if not stacks:
        raise NotDeepenable("no stack of repeated blocks")
    plans = {stack: _plans(spec.module, stack) for stack in stacks}
    refusal: NotDeepenable | None = None
    while True:
        chosen = {stack: left[0] for stack, left in plans.items() if isinstance(left, list) and left}
        if not chosen:
            raise refusal or NotDeepenable("; ".join(left for left in plans.values() if isinstance(left, str)))
        try:
            return _written(spec, chosen)
        except StacksDiffer as e:  # one more unit traced, a longer period, or that stack whole
            for differs in e.refusals:
                stack, ((period, units), *rest) = differs.stack, plans[differs.stack]
                more = differs.more_units and 2 * (units + 1) * period <= stack.length
                plans[stack] = [(period, units + 1)] * more + rest
                refusal = differs


def _plans(module: torch.nn.Module, stack: Stack) -> list[tuple[int, int]] | str:
    """The (period, units traced) to try for ``stack``, fewest blocks first, or why there is
    none."""
    least = settings_period(list(module.get_submodule(stack.path)))
    if least is None:
        return "the blocks' settings repeat with no period of at most six blocks"
    found = [(period, TRACED_BLOCKS) for period in PERIODS
             if not period % least and not stack.length % period and 2 * TRACED_BLOCKS * period <= stack.length]
    return found or f"{stack.length} blocks are too few to write from a trace of some"


def _written(spec: ModelSpec, plans: dict[Stack, tuple[int, int]]) -> TracedGraph:
    """:func:`deepened_trace` with ``plans[stack] = (period, units)``: that many units of
    ``period`` blocks of each stack traced, the others written."""
    with contextlib.ExitStack() as cuts:
        for stack, (period, units) in plans.items():
            cuts.enter_context(_cut_to(spec.module, stack, units * period))
        try:
            exported = export_model(spec)
        except Exception as e:  # the model may need every block (it indexes them by its config)
            raise NotDeepenable(f"the cut model does not trace: {e}") from e
    gm = exported.graph_module
    tidy_graph(gm)
    signature = exported.graph_signature
    refusals = []  # every stack checked, written or not: one trace tells what each needs
    for stack, (period, units) in plans.items():
        targets = {s.arg.name: s.target for s in signature.input_specs if isinstance(s.arg, TensorArgument)}
        blocks = _Blocks(gm, targets, stack, period)
        try:
            step = _steps(blocks, stack, units, period)
        except UnitsDiffer as e:
            refusals.append(e)
            continue
        if not refusals:  # (writing one stack renames the others' nodes alike: their checks stand)
            gm, signature = _write_stack(gm, signature, stack, blocks, step)
    if refusals:
        raise StacksDiffer(refusals)
    deep = copy.copy(exported)
    deep._graph_signature = signature
    deep._graph_module = gm
    return describe(gm, deep, spec.module)


def _write_stack(gm: torch.fx.GraphModule, signature: ExportGraphSignature, stack: Stack, blocks: _Blocks,
                 step: dict[str, int]) -> tuple[torch.fx.GraphModule, ExportGraphSignature]:
    """``gm`` and its signature with ``stack``'s traced units (``blocks``, checked by
    :func:`_steps`, which gave ``step``) written out to all."""
    period, k = blocks.period, max(blocks.ops) + 1
    n = stack.length // period
    if any(_block_index(stack, target) is not None for target in signature.buffers_to_mutate.values()):
        raise NotDeepenable("a block writes a buffer")
    last_ops, last_params = blocks.ops[k - 1], blocks.params.get(k - 1, [])
    if not last_params:
        raise NotDeepenable("the blocks lift no parameters")
    top = {}  # per base, the highest number a unit uses
    for node in last_ops:
        base, number = _split_name(node.name)
        top[base] = max(top.get(base, 0), number)
    gap = {base: (n - k) * s for base, s in step.items()}

    def outside_name(name: str) -> str:
        base, number = _split_name(name)
        return _join_name(base, number + gap[base]) if base in gap and number > top[base] else name

    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    names: dict[str, str] = {}  # old name -> new name, for the signature
    new_specs: dict[str, list[InputSpec]] = {}  # by the placeholder they follow
    spec_of = {s.arg.name: s for s in signature.input_specs if isinstance(s.arg, TensorArgument)}

    def create(node: torch.fx.Node, name: str, args: tuple, kwargs: dict, meta: dict) -> torch.fx.Node:
        target = name if node.op == "placeholder" else node.target  # a placeholder's target is its argument name
        new = graph.create_node(node.op, target, args, kwargs, name=name, type_expr=node.type)
        if new.name != name:
            raise NotDeepenable(f"node {name} could not keep its name")
        new.meta = meta
        return new

    def copy_params(run: list[torch.fx.Node]) -> None:
        for j in range(k, n):
            for node in run:
                shift = (j - k + 1) * period
                name = _param_name(node.name, stack, shift)
                target = _fqn(spec_of[node.name].target, stack, shift)
                copies[j].append(create(node, name, (), {}, _rename_stack(node.meta, stack, shift)))
                old = spec_of[node.name]
                new_specs.setdefault(run[-1].name, []).append(InputSpec(old.kind, TensorArgument(name), target,
                                                                        old.persistent))

    def copy_ops() -> None:
        previous = [env[x] for x in last_ops]
        for j in range(k, n):
            ops: list[torch.fx.Node] = []

            def mapped(arg: torch.fx.Node) -> torch.fx.Node:
                found = blocks.where.get(arg)
                if found is None:
                    return env[arg]
                kind, block, position = found
                if block == k - 1:
                    return copies[j][position] if kind == "param" else ops[position]
                if block == k - 2:
                    return previous[position]  # the unit before's op (checked by _steps)
                return env[arg]  # the first unit's (checked by _steps)

            for node in last_ops:
                base, number = _split_name(node.name)
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), mapped)
                ops.append(create(node, _join_name(base, number + (j - k + 1) * step[base]), args, kwargs,
                                  _rename_stack(node.meta, stack, (j - k + 1) * period)))
            previous = ops
        env.update(zip(last_ops, previous))  # what follows the blocks reads the last copy
        names.update((old.name, new.name) for old, new in zip(last_ops, previous))

    copies: dict[int, list[torch.fx.Node]] = {j: [] for j in range(k, n)}
    first_op, last_op = blocks.ops[0][0] if 0 in blocks.ops else last_ops[0], last_ops[-1]
    runs = _runs(gm, last_params)  # parameters and buffers lie apart: each run's copies follow it
    between, after = False, False
    for node in gm.graph.nodes:
        found = blocks.where.get(node)
        between = (between or node is first_op) and not after
        if found is None and node.op == "call_function" and between:
            raise NotDeepenable(f"{node.name} runs between the blocks, outside them")
        if found is None and after and any(a in blocks.where and (blocks.where[a][1] < k - 1 or
                                                                   blocks.where[a][0] == "param")
                                           for a in node.all_input_nodes):
            raise NotDeepenable(f"{node.name}, after the blocks, reads an earlier block")
        name = node.name if found is not None or node.op == "placeholder" else outside_name(node.name)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda a: env[a])
        env[node] = create(node, name, args, kwargs, dict(node.meta))
        names[node.name] = name
        if node in runs:
            copy_params(runs[node])
        if node is last_op:
            copy_ops()
            after = True
    input_specs: list[InputSpec] = []
    for s in signature.input_specs:
        input_specs.append(s)
        if isinstance(s.arg, TensorArgument):
            input_specs.extend(new_specs.get(s.arg.name, []))
    output_specs = [OutputSpec(s.kind, TensorArgument(names.get(s.arg.name, s.arg.name)), s.target)
                    if isinstance(s.arg, TensorArgument) else s for s in signature.output_specs]
    return lazy_graph_module(gm, graph), ExportGraphSignature(input_specs, output_specs)


def _runs(gm: torch.fx.GraphModule, members: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """``members`` cut into runs of consecutive nodes of ``gm``, each by its last node."""
    chosen = set(members)
    runs: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    current: list[torch.fx.Node] = []
    for node in gm.graph.nodes:
        if node in chosen:
            current.append(node)
        elif current:
            runs[current[-1]] = current
            current = []
    if current:
        runs[current[-1]] = current
    return runs
