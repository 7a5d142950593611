"""One rank of the DTensor correctness checks (tests/test_codegen_dtensor.py launches it).

    python -m torch.distributed.run --nproc-per-node N tests/dist_worker.py OUT_DIR [CASE ...]

For every case meant for this world size: read its plan, ``OUT_DIR/NAME.json`` (the test
planned it once with :func:`plan_case`, not every rank for itself), trace the model on every
rank (each rank's graph must be the one the plan was made for), build the ShardedProgram, run
forward + backward on the global batch,
and compare the loss, the model outputs, every parameter's gradient and every buffer (BatchNorm's
running statistics) with the single-device model. The program runs inside a ParallelModule (its
gradient reduction hook included) under CollectiveCounter, forward and backward apart. Each rank
writes OUT_DIR/rank{r}.json: per case the largest differences, the executed and planned
collectives of both phases, the collectives the executor's own redistributions ask for, any
sharded dim the mesh does not divide, the placements, or the error.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from autoplan.codegen import build_program, planned_collectives
from autoplan.codegen.redistribution import to_dtensor_placements
from autoplan.load import ModelSpec, make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.api import make_options, plan_spec
from autoplan.trace.tracer import trace
from launcher import PEER_TIMEOUT

# name -> (world size, example module, build kwargs, mesh, memory_per_device)
GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256, "batch": 8, "seq": 32}
BERT = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256,
        "vocab_size": 256, "batch": 8, "seq": 32}
RESNET = {"width": 8, "batch": 8, "image": 16}
GPT = {"hidden": 64, "layers": 2, "heads": 4, "seq": 32, "vocab": 256, "batch": 8}

# name -> (world size, example module, build kwargs, mesh, memory_per_device)
CASES: dict[str, tuple[int, str, dict, tuple[int, ...], float | None]] = {
    # 2 processes
    "mlp_replicated_2": (2, "mlp", {"hidden": 64, "batch": 8, "seq": 16}, (2,), None),
    "mlp_megatron_2": (2, "mlp", {"hidden": 1024, "batch": 8, "seq": 16}, (2,), None),
    "mlp_megatron_tight_2": (2, "mlp", {"hidden": 64, "batch": 8, "seq": 16}, (2,), 0.69e6),
    "mlp_dp_2": (2, "mlp", {"hidden": 64, "batch": 64, "seq": 128}, (2,), None),
    "gpt_2": (2, "gpt", GPT, (2,), 2.76e6),
    "gpt_2b": (2, "gpt", GPT, (2,), 3.9e6),
    "gpt_replicated_2": (2, "gpt", GPT, (2,), None),
    "resnet_2": (2, "resnet", RESNET, (2,), None),
    # the least memory the conv net can be planned in: BatchNorm and the head sharded by channel
    # (convolutions are batch-sharded only; see strategies/rules/contractions.convolution)
    "resnet_sharded_2": (2, "resnet", RESNET, (2,), 0.651e6),
    "gpt2_hf_2": (2, "gpt2", GPT2, (2,), 5.5e6),
    "bert_hf_2": (2, "bert", BERT, (2,), 3.68e6),
    # 4 processes
    "mlp_megatron_4": (4, "mlp", {"hidden": 1024, "batch": 8, "seq": 16}, (4,), None),
    "mlp_megatron_tight_4": (4, "mlp", {"hidden": 64, "batch": 8, "seq": 16}, (4,), 0.42e6),
    "mlp_dp_4": (4, "mlp", {"hidden": 64, "batch": 64, "seq": 512}, (4,), None),
    # widths no device count divides: hidden 30 (4h = 120 divides, 30 does not)
    "mlp_odd_4": (4, "mlp", {"hidden": 30, "batch": 8, "seq": 16}, (4,), 0.14e6),
    "mlp_odd_2x2": (4, "mlp", {"hidden": 30, "batch": 6, "seq": 10}, (2, 2), 0.13e6),
    "mlp_2x2_megatron": (4, "mlp", {"hidden": 1024, "batch": 8, "seq": 16}, (2, 2), None),
    "mlp_2x2_mixed": (4, "mlp", {"hidden": 64, "batch": 8, "seq": 16}, (2, 2), 0.39e6),
    "mlp_2x2_dp_tp": (4, "mlp", {"hidden": 64, "batch": 8, "seq": 16}, (2, 2), 0.6e6),
    "mlp_2x2_dp": (4, "mlp", {"hidden": 64, "batch": 64, "seq": 128}, (2, 2), None),
    "gpt_4": (4, "gpt", GPT, (4,), 1.495e6),
    "gpt_2x2": (4, "gpt", GPT, (2, 2), 2.2e6),
    "gpt_2x2b": (4, "gpt", GPT, (2, 2), 1.6e6),
    "resnet_sharded_2x2": (4, "resnet", RESNET, (2, 2), 0.609e6),
    "gpt2_hf_4": (4, "gpt2", GPT2, (4,), 2.75e6),
    "gpt2_hf_2x2": (4, "gpt2", GPT2, (2, 2), 3.045e6),
    "bert_hf_4": (4, "bert", BERT, (4,), 1.815e6),
    "bert_hf_2x2": (4, "bert", BERT, (2, 2), 2.0e6),
}


def _flat_tensors(obj) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat_tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat_tensors(o)]
    return []


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def _diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, bool]:
    a, b = a.detach().double(), b.detach().double()
    if a.shape != b.shape:
        return float("inf"), False
    return float((a - b).abs().max()) if a.numel() else 0.0, bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))


def indivisible_shardings(graph, plan, mesh_shape) -> list[str]:
    """Every place where ``plan`` shards a tensor dim that its mesh axes do not divide
    (strategies that do not divide must be absent from the enumeration)."""
    from autoplan.sharding import parse_placement

    def check(where: str, shape, specs) -> list[str]:
        bad, sizes = [], {}
        for axis, text in enumerate(specs or []):
            p = parse_placement(text)
            if p.is_shard:
                sizes[p.dim] = sizes.get(p.dim, 1) * mesh_shape[axis]
        for dim, n in sizes.items():
            if dim >= len(shape) or shape[dim] % n:
                bad.append(f"{where}: {list(specs)} on shape {tuple(shape)}")
        return bad

    fx_nodes = {n.name: n for n in graph.graph_module.graph.nodes}
    bad: list[str] = []
    for node_plan in plan.nodes:
        n = fx_nodes[node_plan.name]
        inputs = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        for a, specs in zip(inputs, node_plan.inputs):
            bad += check(f"{a.name} -> {n.name}", a.meta["val"].shape, specs)
        vals = n.meta.get("val")
        vals = vals if isinstance(vals, (tuple, list)) else [vals]
        for v, specs in zip(vals, node_plan.outputs):
            if isinstance(v, torch.Tensor):
                bad += check(n.name, v.shape, specs)
    return bad


# the collective each per-axis placement change costs (DTensor's choice)
def _transition_kind(src: str, dst: str) -> str | None:
    if src == dst or src == "R":
        return None  # R -> S(d) is a local slice, R -> P a local split
    if src == "P":
        return "all_reduce" if dst == "R" else "reduce_scatter"
    if dst == "R":
        return "all_gather"
    return "all_to_all" if dst.startswith("S") else None  # S -> P: local zero padding


def redistribution_collectives(redistributions) -> dict[str, int]:
    """The collectives the executor's own redistributions ask for (one per changed mesh axis):
    what is left of the executed count beyond these comes from DTensor's own propagation."""
    from collections import Counter

    counts: Counter[str] = Counter()
    for _, src, dst in redistributions:
        a = [src[i:i + 2] if src[i] == "S" else src[i] for i in range(len(src)) if src[i] in "RPS"]
        b = [dst[i:i + 2] if dst[i] == "S" else dst[i] for i in range(len(dst)) if dst[i] in "RPS"]
        for x, y in zip(a, b):
            kind = _transition_kind(x, y)
            if kind:
                counts[kind] += 1
    return dict(counts)


def gloo_normalised(counts: dict[str, int]) -> dict[str, int]:
    """gloo has no all_to_all on CPU: DTensor runs each as an all_gather (+ chunk). Count both
    as all_gather so planned and executed compare on gloo; drop zeros."""
    out = dict(counts)
    out["all_gather"] = out.get("all_gather", 0) + out.pop("all_to_all", 0)
    return {k: v for k, v in out.items() if v}


def case_spec(name: str) -> ModelSpec:
    _, module_name, kwargs, _, _ = CASES[name]
    module = __import__(module_name)
    model, inputs = module.build(**kwargs)
    return make_model_spec(model, inputs, module.loss_fn)


def plan_case(name: str) -> Plan:
    """The case's plan: its model planned on its mesh under its memory budget for H100s."""
    import warnings

    world, _, _, mesh_shape, memory = CASES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_spec(case_spec(name), make_options(world, "h100", mesh_shape, memory_per_device=memory))[0]


def run_case(name: str, world: int, plan: Plan) -> dict:
    from autoplan.codegen.collective_counter import CollectiveCounter
    from autoplan.codegen.runtime import ParallelModule

    _, module_name, kwargs, mesh_shape, _ = CASES[name]
    module = __import__(module_name)
    graph = trace(case_spec(name))
    hashes = [None] * world
    dist.all_gather_object(hashes, graph.graph_hash)
    mesh = init_device_mesh("cpu", mesh_shape)

    # the single-device reference
    ref_model, ref_inputs = module.build(**kwargs)
    ref_out = ref_model(*ref_inputs)
    ref_loss = module.loss_fn(ref_out, *ref_inputs)
    ref_loss.backward()
    ref_outputs = _flat_tensors(ref_out)
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters(remove_duplicate=False)}
    ref_buffers = dict(ref_model.named_buffers())

    model, inputs = module.build(**kwargs)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    program = build_program(graph, plan, mesh, tensors)
    pm = ParallelModule(program, plan, "cpu")
    with CollectiveCounter() as fwd:
        out = pm(*inputs)
    with CollectiveCounter() as bwd:
        out.loss.backward()
    redistributions = list(program.redistributions)
    loss, outputs = out.loss, list(out.outputs)

    result: dict = {
        "hash_equal": set(hashes) == {plan.graph_hash},
        "mesh": list(plan.mesh),
        "params": plan.params,
        "inputs": plan.inputs,
        "executed_forward": dict(fwd.counts),
        "planned_forward": planned_collectives(plan, "forward"),
        "executed_backward": dict(bwd.counts),
        "planned_backward": planned_collectives(plan, "backward"),
        # the plan's, with the bucketed gradient all-reduces counted per bucket
        "expected_backward": program.observable_collectives("backward"),
        "redistributed_forward": redistribution_collectives(redistributions),
        "redistributions": redistributions,
        "planned_where": [(c.kind, c.where, c.count) for c in plan.collectives_in("forward")],
        "planned_where_backward": [(c.kind, c.where, c.count, c.tensor) for c in plan.collectives_in("backward")],
        "num_parameters": len(list(program.parameters())),
        "num_model_parameters": len(list(model.parameters())),
        "indivisible": indivisible_shardings(graph, plan, mesh_shape),
        "sharded_params": sum(any(p != "R" for p in v) for v in plan.params.values()),
    }
    loss_diff, loss_ok = _diff(_full(loss), ref_loss)
    result["loss_diff"], result["loss_ok"] = loss_diff, loss_ok
    # match each program output with the first unused reference output of the same shape
    out_diffs, outs_ok, used = [], bool(outputs), set()
    for o in outputs:
        full = _full(o)
        for i, r in enumerate(ref_outputs):
            if i not in used and r.shape == full.shape:
                used.add(i)
                d, ok = _diff(full, r)
                out_diffs.append(d)
                outs_ok &= ok
                break
        else:
            outs_ok = False
            out_diffs.append(float("inf"))
    result["output_diff"], result["outputs_ok"] = max(out_diffs, default=float("inf")), outs_ok
    params = program.named_plan_parameters()
    grad_diffs, bad, missing = {}, [], []
    for fqn, ref_grad in ref_grads.items():
        p = params.get(fqn)
        if ref_grad is None:
            continue
        if p is None or p.grad is None:
            missing.append(fqn)
            continue
        d, ok = _diff(_full(p.grad), ref_grad)
        grad_diffs[fqn] = d
        if not ok:
            bad.append(fqn)
        storage = plan.storage.get(fqn)
        wanted = to_dtensor_placements(storage.grad) if storage is not None else p.placements  # ZeRO-2: sharded
        if isinstance(p.grad, DTensor) and tuple(p.grad.placements) != tuple(wanted):
            bad.append(f"{fqn} (gradient placed {p.grad.placements}, planned {tuple(wanted)})")
    # buffers (BatchNorm's running statistics, updated in place by the forward)
    buffer_diffs = {}
    for fqn, ref_buf in ref_buffers.items():
        d, ok = _diff(_full(program.tensor(fqn)), ref_buf)
        buffer_diffs[fqn] = d
        if not ok:
            bad.append(f"buffer {fqn}")
    result["grad_diff"] = max(grad_diffs.values(), default=float("inf"))
    result["buffer_diff"] = max(buffer_diffs.values(), default=0.0)
    result["buffers_checked"] = len(buffer_diffs)
    result["grads_checked"] = len(grad_diffs)
    result["grads_bad"], result["grads_missing"] = bad, missing
    result["ok"] = bool(result["hash_equal"] and loss_ok and outs_ok and not bad and not missing and grad_diffs
                        and not result["indivisible"])
    return result


def main() -> None:
    out_dir = Path(sys.argv[1])
    wanted = sys.argv[2:]
    dist.init_process_group("gloo", timeout=PEER_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results = {}
    from autoplan.codegen import shard_batch
    x = torch.arange(world * 6 * 4, dtype=torch.float32).reshape(world * 6, 4)
    mesh = init_device_mesh("cpu", (world,))
    results["_shard_batch"] = {"ok": bool(
        torch.equal(shard_batch(x, ["S(0)"], mesh), x.chunk(world)[rank])
        and torch.equal(shard_batch(x, ["R"], mesh), x))}
    for name, case in CASES.items():
        if case[0] != world or (wanted and name not in wanted):
            continue
        start = time.perf_counter()
        try:
            results[name] = run_case(name, world, Plan.load(out_dir / f"{name}.json"))
        except Exception as e:  # noqa: BLE001 -- every rank fails alike (same code, same data): record it, go on
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc()[-3000:]}
        results[name]["time_s"] = time.perf_counter() - start
        dist.barrier()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
