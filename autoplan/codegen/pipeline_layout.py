"""Where each part of a pipelined plan runs: the torch schedule class for the plan's schedule,
the pipeline rank of every stage, and each stage's inputs and outputs in the traced graph
(:class:`StageLayout`)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from autoplan.codegen.dtensor_program import SKIPPED_NAMES, SKIPPED_OPS
from autoplan.errors import AutoplanError
from autoplan.plan_schema import Plan
from autoplan.trace.graph import TracedGraph
from autoplan.trace.subgraph import loss_name

_V_SCHEDULES = {"zbvzerobubble", "dualpipev"}


def schedule_class(name: str) -> type:
    """The ``torch.distributed.pipelining`` schedule class for a plan's schedule name (lower case
    torch names: ``gpipe``, ``1f1b``, ``interleaved1f1b``, ``loopedbfs``,
    ``interleavedzerobubble``, ``zbvzerobubble``, ``dualpipev``)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        cls = get_schedule_class(name)
    except ValueError:
        raise AutoplanError(f"unknown pipeline schedule {name!r}: use gpipe, 1f1b, interleaved1f1b, "
                            f"loopedbfs, interleavedzerobubble, zbvzerobubble or dualpipev") from None
    if cls.__name__ in ("PipelineScheduleSingle", "PipelineScheduleMulti"):
        raise AutoplanError(f"{name!r} is a base class, not a schedule: name a concrete schedule")
    return cls


def is_multi_stage(cls: type) -> bool:
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    return issubclass(cls, PipelineScheduleMulti)


def stage_ranks(schedule: str, num_stages: int, pp: int) -> list[int]:
    """The pp rank of every stage for ``schedule`` (see the module docstring)."""
    cls = schedule_class(schedule)
    if num_stages % pp:
        raise AutoplanError(f"{num_stages} stages do not divide over {pp} pipeline ranks")
    if not is_multi_stage(cls):
        if num_stages != pp:
            raise AutoplanError(f"schedule {schedule!r} runs one stage per rank, but the plan has {num_stages} "
                                f"stages on {pp} pipeline ranks: use interleaved1f1b for virtual stages")
        return list(range(num_stages))
    if schedule.lower() in _V_SCHEDULES:
        if num_stages != 2 * pp:
            raise AutoplanError(f"schedule {schedule!r} needs exactly 2 stages per rank ({2 * pp}), the plan has "
                                f"{num_stages}")
        return [s if s < pp else 2 * pp - 1 - s for s in range(num_stages)]
    return [s % pp for s in range(num_stages)]


# --------------------------------------------------------------------------------------------
# Which node runs where, and what crosses each stage boundary


@dataclass
class StageLayout:
    """What the pipeline is, independently of any process: per stage the fx nodes it runs (graph
    order), the values it receives (``inputs``) and sends on (``outputs``; the last stage's is
    the loss node), the parameter placeholders it reads, and the pp rank it lives on."""

    num_stages: int
    pp: int
    stage_rank: list[int]
    nodes: list[list[torch.fx.Node]]
    inputs: list[list[torch.fx.Node]]
    outputs: list[list[torch.fx.Node]]
    param_nodes: list[list[torch.fx.Node]]
    loss_node: torch.fx.Node
    needs_grad: dict[torch.fx.Node, bool]

    def stages_of_rank(self, pp_rank: int) -> list[int]:
        return [s for s in range(self.num_stages) if self.stage_rank[s] == pp_rank]


def is_skipped(n: torch.fx.Node) -> bool:
    name = getattr(n.target, "__name__", str(n.target))
    return n.target in SKIPPED_OPS or any(s in name for s in SKIPPED_NAMES)


def _floating(val: Any) -> bool:
    """Whether a node's value is (or holds, for multi-output ops) a floating tensor."""
    if isinstance(val, torch.Tensor):
        return val.dtype.is_floating_point or val.dtype.is_complex
    if isinstance(val, (tuple, list)):
        return any(_floating(v) for v in val)
    return False


def pipeline_layout(graph: TracedGraph, plan: Plan) -> StageLayout:
    """Assign every op node to a stage and find the values crossing each boundary."""
    num_stages = len(plan.stages)
    if not plan.scheduled:
        raise AutoplanError("the plan has one stage and one microbatch: run it with build_program, not build_pipeline")
    k = math.prod(plan.stages[0].mesh)
    for s, st in enumerate(plan.stages):
        if math.prod(st.mesh) != k:
            raise AutoplanError(f"stage {s} has mesh {st.mesh} of {math.prod(st.mesh)} devices, stage 0 has {k}: "
                                f"every stage must hold the same number of devices")
    if plan.devices % k:
        raise AutoplanError(f"{plan.devices} devices do not divide into sub-meshes of {k}")
    pp = plan.devices // k
    expected = stage_ranks(plan.schedule, num_stages, pp)
    for s, st in enumerate(plan.stages):
        block = list(range(expected[s] * k, (expected[s] + 1) * k))
        if list(st.devices) != block:
            raise AutoplanError(f"stage {s} is on devices {st.devices}, but schedule {plan.schedule!r} puts it on "
                                f"pp rank {expected[s]} = devices {block}")

    gm_nodes = list(graph.graph_module.graph.nodes)
    by_name = {n.name: n for n in gm_nodes}
    stage_of: dict[torch.fx.Node, int] = {}
    for s, st in enumerate(plan.stages):
        for name in st.nodes:
            if name not in by_name:
                raise AutoplanError(f"stage {s} lists node {name!r}, which is not in the graph: plan this graph again")
            if by_name[name] in stage_of:
                raise AutoplanError(f"node {name!r} is in stages {stage_of[by_name[name]]} and {s}")
            stage_of[by_name[name]] = s
    ops = [n for n in gm_nodes if n.op in ("call_function", "get_attr")]
    # Nodes the stages do not list: a getitem runs with its producer, anything else in the first
    # stage that needs it (computed right where it is used). Nodes nothing needs are dropped.
    for n in ops:
        if n not in stage_of and n.target is operator.getitem and n.args[0] in stage_of:
            stage_of[n] = stage_of[n.args[0]]
    for n in reversed(ops):
        if n in stage_of or is_skipped(n):
            continue
        users = [stage_of[u] for u in n.users if u in stage_of]
        if users:
            stage_of[n] = min(users)
    loss = loss_name(graph)
    if loss is None:
        raise AutoplanError("the graph's loss is not computed by the graph")
    loss_node = by_name[loss]

    user_inputs = [by_name[name] for name in graph.input_names]
    produced: dict[torch.fx.Node, int] = {n: -1 for n in user_inputs}
    produced.update(stage_of)
    # the last stage (at least) that needs each value
    last_use: dict[torch.fx.Node, int] = {}
    for n, s in stage_of.items():
        if is_skipped(n):
            continue
        for a in n.all_input_nodes:
            if a in produced:
                if produced[a] > s:
                    raise AutoplanError(f"{n.name} (stage {s}) reads {a.name}, computed later in stage {produced[a]}: "
                                        f"the stages are not in graph order")
                last_use[a] = max(last_use.get(a, -1), s)
    if loss_node not in produced:
        raise AutoplanError(f"no stage computes the loss {loss_node.name}")
    last_use[loss_node] = num_stages - 1
    order = {n: i for i, n in enumerate(gm_nodes)}

    inputs: list[list[torch.fx.Node]] = [list(user_inputs)]
    for s in range(1, num_stages):
        crossing = [v for v in produced if produced[v] < s and last_use.get(v, -1) >= s]
        inputs.append(sorted(crossing, key=order.__getitem__))
    outputs = [inputs[s + 1] for s in range(num_stages - 1)] + [[loss_node]]
    for s in range(num_stages - 1):
        for v in outputs[s]:
            val = v.meta.get("val")
            if not isinstance(val, torch.Tensor):
                raise AutoplanError(f"{v.name} crosses from stage {s} to {s + 1} but is not a tensor "
                                    f"({type(val).__name__}): move the stage boundary")
    nodes = [[n for n in ops if stage_of.get(n) == s] for s in range(num_stages)]
    param_nodes = []
    for s in range(num_stages):
        used = {a for n in nodes[s] for a in n.all_input_nodes if a.op == "placeholder" and a not in produced}
        param_nodes.append(sorted(used, key=order.__getitem__))

    # Which values can carry a gradient: floating values that depend on a parameter that does.
    trainable = {by_name[name] for name, fqn in graph.param_names.items()
                 if graph.nodes.get(name) is None
                 or (graph.nodes[name].kind == "parameter" and graph.nodes[name].carries_grad)}  # not a frozen one
    needs_grad: dict[torch.fx.Node, bool] = {}
    for n in gm_nodes:
        floating = _floating(n.meta.get("val"))
        if n in trainable:
            needs_grad[n] = floating
        else:
            needs_grad[n] = floating and any(needs_grad.get(a, False) for a in n.all_input_nodes)
    return StageLayout(num_stages, pp, expected, nodes, inputs, outputs, param_nodes, loss_node, needs_grad)


# --------------------------------------------------------------------------------------------
# One stage
