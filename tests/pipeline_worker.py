"""One rank of the pipeline correctness checks (tests/test_pipeline_codegen.py launches it).

    python -m torch.distributed.run --standalone --nproc-per-node N tests/pipeline_worker.py OUT_DIR [CASE ...]

For every case meant for this world size: trace the model for one microbatch, plan it for the
stage mesh (k devices), cut the plan's nodes into stages at block boundaries
(:func:`split_plan`), build the :class:`PipelineProgram`, run one ``train_step`` on the global
batch and compare the loss and every gradient this rank holds with the single-device model's
(global-batch loss). Some cases run a second step without zeroing the gradients (they must then
be twice the reference), then an SGD step on both (the next losses must agree). Each rank writes OUT_DIR/rank{r}.json with, per case, the largest
differences, the FQNs it checked, or the error.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from torch.distributed.tensor import DTensor

from autoplan.codegen.pipeline_layout import stage_ranks
from autoplan.codegen.pipeline_program import build_pipeline
from autoplan.planner.api import make_options, plan_traced
from autoplan.trace.graph import TracedGraph
from autoplan.load import make_model_spec
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.plan_schema import Plan, StagePlan
from autoplan.trace.tracer import trace
from launcher import PEER_TIMEOUT

GPT_KWARGS = {"hidden": 64, "layers": 2, "heads": 4, "seq": 32, "vocab": 256, "batch": 8}


class DeepMLP(nn.Module):
    """Four Megatron MLP blocks in sequence (examples/mlp.py's block)."""

    def __init__(self, hidden: int, blocks: int) -> None:
        super().__init__()
        from mlp import MLPBlock

        self.blocks = nn.ModuleList(MLPBlock(hidden) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def build_mlp(hidden: int = 32, blocks: int = 4, batch: int = 8, seq: int = 4):
    torch.manual_seed(0)
    model = DeepMLP(hidden, blocks)
    x = torch.randn(batch, seq, hidden)
    return model, (x,)


def mlp_loss(output, x):
    return ((output - x) ** 2).mean()


def build_gpt():
    import gpt

    return gpt.build(**GPT_KWARGS)


def gpt_loss(output, idx, targets):
    return output[1]


def build_mlp_dp():
    """Long sequences, narrow layers: the planner shards the batch (on the sequence dim), so the
    replicated parameters' gradients are partial sums reduced after the step."""
    return build_mlp(hidden=16, batch=64, seq=64)


# model name -> (build, loss, {number of stages: module prefixes where a stage starts})
MODELS = {
    "mlp": (build_mlp, mlp_loss, {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}),
    "mlp_dp": (build_mlp_dp, mlp_loss, {2: ["blocks.2"], 4: ["blocks.1", "blocks.2", "blocks.3"]}),
    "gpt": (build_gpt, gpt_loss, {2: ["h.1"], 3: ["h.1", "ln_f"], 4: ["h.0", "h.1", "ln_f"]}),
    # cut inside h.1's attention, after the q/k/v split: q, k, v and the residual cross
    "gpt_mid": (build_gpt, gpt_loss, {2: ["@view_4"]}),
}
# per-device memory (bytes) that makes the planner shard parameters on a 2-device stage mesh,
# by (model, microbatches)
MEMORY = {("mlp", 2): 5e5, ("mlp", 4): 3e5, ("gpt", 2): 1.87e6, ("gpt", 4): 1.7e6}

# name -> (world size, model, stage mesh size k, stages, microbatches, schedule, memory_per_device, second step)
CASES: dict[str, tuple[int, str, int, int, int, str, float | None, bool]] = {}
_SCHEDULES = [  # (schedule, stages, microbatches, second step)
    ("gpipe", 2, 2, True),
    ("1f1b", 2, 4, False),
    ("interleaved1f1b", 4, 4, True),
    ("interleavedzerobubble", 4, 4, False),
    ("zbvzerobubble", 4, 4, False),
]
for _model in ("mlp", "gpt"):
    for _k in (1, 2):
        for _schedule, _stages, _m, _second in _SCHEDULES:
            CASES[f"{_model}_k{_k}_{_schedule}"] = (2 * _k, _model, _k, _stages, _m, _schedule,
                                                    MEMORY[_model, _m] if _k > 1 else None, _second)
CASES["mlp_k1_loopedbfs"] = (2, "mlp", 1, 4, 4, "loopedbfs", None, False)
CASES["mlp_k1_dualpipev"] = (2, "mlp", 1, 4, 4, "dualpipev", None, False)
# 3 pipeline ranks: the tied embedding / head live on ranks 0 and 2 only (a subgroup sums them)
CASES["gpt_k1_3stages_1f1b"] = (3, "gpt", 1, 3, 4, "1f1b", None, True)
CASES["gpt_mid_k1_1f1b"] = (2, "gpt_mid", 1, 2, 2, "1f1b", None, False)
CASES["mlp_dp_k2_gpipe"] = (4, "mlp_dp", 2, 2, 2, "gpipe", None, True)
CASES["mlp_dp_k2_interleaved1f1b"] = (4, "mlp_dp", 2, 4, 2, "interleaved1f1b", None, False)
# two stages of 4 devices on different logical meshes: the only world size where two meshes of
# one sub-mesh size differ ((4,) against (2, 2))
CASES["mlp_k4_mixed_1f1b"] = (8, "mlp", 4, 2, 2, "1f1b", 2.5e5, True)
CASES["mlp_dp_k4_mixed_gpipe"] = (8, "mlp_dp", 4, 2, 2, "gpipe", None, False)
# case name -> the logical mesh of each stage (the other cases: (k,) for every stage)
STAGE_MESHES = {"mlp_k4_mixed_1f1b": [(4,), (2, 2)], "mlp_dp_k4_mixed_gpipe": [(2, 2), (4,)]}


def split_plan(plan: Plan, graph: TracedGraph, starts: list[str], microbatches: int, schedule: str,
               pp: int = 2) -> Plan:
    """``plan`` (one stage, mesh of k devices, planned for one microbatch) cut into
    ``len(starts) + 1`` pipeline stages: stage i+1 begins at the first node (graph order) whose
    module starts with ``starts[i]`` (or, for ``"@name"``, at the node ``name``). The stages go on ``pp`` pipeline ranks of k devices each, by
    the schedule's stage → rank map (:func:`stage_ranks`)."""
    order = [n.name for n in graph.graph_module.graph.nodes]
    planned = {n.name for n in plan.nodes}
    names = [name for name in order if name in planned]
    cuts = [0]
    for prefix in starts:
        if prefix.startswith("@"):  # a node name
            cut = names.index(prefix[1:])
        else:
            cut = next(i for i, name in enumerate(names) if graph.nodes[name].module.startswith(prefix))
        if cut <= cuts[-1]:
            raise ValueError(f"stage start {prefix!r} is not after the previous one")
        cuts.append(cut)
    cuts.append(len(names))
    num_stages = len(cuts) - 1
    k = math.prod(plan.mesh)
    ranks = stage_ranks(schedule, num_stages, pp)
    stages = []
    for s in range(num_stages):
        nodes = names[cuts[s]:cuts[s + 1]]
        params = list(dict.fromkeys(graph.tied.get(f, f) for n in nodes for f in graph.nodes[n].params))
        layers = list(dict.fromkeys(".".join(graph.nodes[n].module.split(".")[:2]) for n in nodes
                                    if graph.nodes[n].module))
        stages.append(StagePlan(layers=layers, devices=list(range(ranks[s] * k, (ranks[s] + 1) * k)),
                                mesh=list(plan.mesh), nodes=nodes, params=params))
    return dataclasses.replace(plan, stages=stages, devices=k * pp, microbatches=microbatches, schedule=schedule)


def mixed_plan(plans: list[Plan]) -> Plan:
    """Stage s of ``plans[s]`` (each the same pipeline split of one model, on its own logical
    mesh): its nodes' and parameters' placements come from the plan of its mesh."""
    stages = [p.stages[s] for s, p in enumerate(plans)]
    nodes, params = [], {}
    for stage, p in zip(stages, plans):
        mine = set(stage.nodes)
        nodes += [n for n in p.nodes if n.name in mine]
        params.update({f: p.params[f] for f in stage.params if f in p.params})
    planned = {n.name for n in nodes}
    nodes += [n for n in plans[0].nodes if n.name not in planned]  # nodes no stage lists
    return dataclasses.replace(plans[0], stages=stages, nodes=nodes, params=params)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf"), False
    return float((got - want).abs().max()), bool(torch.allclose(got, want, rtol=1e-4, atol=1e-6))


_PLANS: dict[tuple, tuple[Plan, TracedGraph]] = {}
_MESHES: dict[tuple, object] = {}


def run_case(name: str) -> dict:
    world, model_name, k, num_stages, microbatches, schedule, memory, second = CASES[name]
    build, loss_fn, starts = MODELS[model_name]
    pp = world // k
    split = []
    for mesh in STAGE_MESHES.get(name, [(k,)]):
        key = (model_name, mesh, microbatches, memory)
        if key not in _PLANS:
            model, inputs = build()
            graph = trace(make_model_spec(model, microbatch_inputs(inputs, microbatches), loss_fn))
            _PLANS[key] = plan_traced(graph, make_options(k, "cpu", mesh=mesh, memory_per_device=memory)), graph
        base, graph = _PLANS[key]
        split.append(split_plan(base, graph, starts[num_stages], microbatches, schedule, pp))
    plan = mixed_plan(split) if len(split) > 1 else split[0]
    assert plan.devices == world

    ref_model, ref_inputs = build()
    ref_loss = loss_fn(ref_model(*ref_inputs), *ref_inputs)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters(remove_duplicate=False)}

    model, inputs = build()
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    mesh_key = (plan.devices // k, *plan.mesh)
    program = build_pipeline(graph, plan, tensors, "cpu", world_mesh=_MESHES.get(mesh_key))
    _MESHES[mesh_key] = program.mesh
    received: dict[int, list[list[int]]] = {}  # stage -> the shapes its first forward was handed

    def record(module, args) -> None:
        received.setdefault(module.index, [list(a.shape) for a in args if isinstance(a, torch.Tensor)])

    hooks = [module.register_forward_pre_hook(record) for module in program.stage_modules]
    loss = program.train_step(*inputs)
    for hook in hooks:
        hook.remove()
    result: dict = {"stages_here": program.stage_indices, "params": plan.params, "inputs": base.inputs,
                    "stage_meshes": {s: list(m.shape) for s, m in program.stage_meshes.items()},
                    "buckets": program.gradient_buckets_launched, "received": received,
                    "values": {s: [list(n.meta["val"].shape) for n in program.layout.inputs[s]]
                               for s in program.stage_indices}}
    result["loss_diff"], result["loss_ok"] = _diff(loss, ref_loss)
    params = program.named_plan_parameters()
    grad_diffs, bad, missing = {}, [], []
    for fqn in sorted(params):
        p = params[fqn]
        if p.grad is None:
            missing.append(fqn)
            continue
        d, ok = _diff(_full(p.grad), ref_grads[fqn])
        grad_diffs[fqn] = d
        if not ok:
            bad.append(fqn)
    result.update(grads_checked=sorted(grad_diffs), grads_missing=missing, grads_bad=bad,
                  grad_diff=max(grad_diffs.values(), default=0.0),
                  sharded=[f for f, p in params.items() if any(not pl.is_replicate() for pl in p.placements)],
                  model_parameters=sorted(ref_grads))
    if second:  # gradients accumulate over steps
        loss2 = program.train_step(*inputs)
        result["loss2_diff"] = _diff(loss2, ref_loss)[0]
        diffs, ok2 = [], True
        for fqn in sorted(params):
            d, ok = _diff(_full(params[fqn].grad), 2 * ref_grads[fqn])
            diffs.append(d)
            ok2 &= ok
        result["accumulate_diff"], result["accumulate_ok"] = max(diffs, default=0.0), ok2
        # an SGD step on both: the next losses agree (tied copies stay equal)
        ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.1)
        opt = torch.optim.SGD(program.parameters(), lr=0.1)
        ref_opt.zero_grad()
        opt.zero_grad()
        loss_fn(ref_model(*ref_inputs), *ref_inputs).backward()
        program.train_step(*inputs)
        ref_opt.step()
        opt.step()
        with torch.no_grad():
            ref_after = loss_fn(ref_model(*ref_inputs), *ref_inputs)
        result["loss_after_sgd_diff"], result["loss_after_sgd_ok"] = _diff(program.train_step(*inputs), ref_after)
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    wanted = sys.argv[2:]
    dist.init_process_group("gloo", timeout=PEER_TIMEOUT)
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, case in CASES.items():
        if case[0] != world or (wanted and name not in wanted):
            continue
        try:
            results[name] = run_case(name)
        except Exception as e:  # noqa: BLE001 - report and go on with the next case
            results[name] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-6000:]}
        (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))  # written as we go
        dist.barrier()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
