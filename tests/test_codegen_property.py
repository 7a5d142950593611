"""Property test of the code generator: ANY valid strategy assignment runs and equals one device.

The planner's ``pick`` hook replaces the ILP with an arbitrary assignment (one choice per
strategy group; every pick is a valid plan). ``hypothesis`` draws those assignments, the
program is built from each, and its loss, outputs, every gradient and every buffer (BatchNorm's
running statistics) are compared with the single-device model; the collectives it executes
(forward and backward, ``CollectiveCounter``) must equal the plan's, kind by kind.

The checks need several ranks. torch's ``LocalTensorMode`` (one process simulating all ranks)
runs our interpreter, but DTensor's sharding-propagation cache is bypassed under it: every op
costs ~30 ms, a 1-layer GPT assignment several seconds. So this file is also the worker of ONE
``torch.distributed.run`` launch per world size (gloo, CPU): every rank runs the same
hypothesis search (``derandomize=True``, no database), so every rank draws the same
assignments in the same order. The search never raises inside the test body (a raising body
would make hypothesis shrink, i.e. run more examples): each example records its outcome, and
pytest asserts on the records. A failing example is reported with its choices, so it can be
replayed with ``pick=lambda g, names: choices[g]``.

    python -m torch.distributed.run --nproc-per-node N tests/test_codegen_property.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
from launcher import PEER_TIMEOUT, launch_worker

ROOT = Path(__file__).resolve().parents[1]

# (label, example module, build kwargs, mesh, number of hypothesis examples), by world size
CONFIGS: dict[int, list[tuple[str, str, dict, tuple[int, ...], int]]] = {
    2: [
        ("mlp_2", "mlp", {"hidden": 8, "batch": 4, "seq": 4}, (2,), 14),
        ("gpt1_2", "gpt", {"hidden": 16, "layers": 1, "heads": 4, "seq": 8, "vocab": 32, "batch": 4}, (2,), 12),
        ("gpt2_2", "gpt", {"hidden": 16, "layers": 2, "heads": 4, "seq": 8, "vocab": 32, "batch": 4}, (2,), 4),
        ("resnet_2", "resnet", {"width": 4, "batch": 4, "image": 8}, (2,), 8),
    ],
    4: [
        ("mlp_4", "mlp", {"hidden": 8, "batch": 4, "seq": 4}, (4,), 8),
        ("mlp_2x2", "mlp", {"hidden": 8, "batch": 4, "seq": 4}, (2, 2), 8),
        ("gpt1_4", "gpt", {"hidden": 16, "layers": 1, "heads": 4, "seq": 8, "vocab": 32, "batch": 4}, (4,), 6),
        ("gpt1_2x2", "gpt", {"hidden": 16, "layers": 1, "heads": 4, "seq": 8, "vocab": 32, "batch": 4}, (2, 2), 4),
        ("resnet_4", "resnet", {"width": 4, "batch": 4, "image": 8}, (4,), 4),
        ("resnet_2x2", "resnet", {"width": 4, "batch": 4, "image": 8}, (2, 2), 4),
        # widths 4 does not divide (hidden 30): such shardings must never be enumerated
        ("mlp30_4", "mlp", {"hidden": 30, "batch": 4, "seq": 6}, (4,), 4),
    ],
}
RTOL, ATOL = 1e-4, 1e-5


# ----------------------------------------------------------------------------------------------
# the worker (one rank)
# ----------------------------------------------------------------------------------------------

def _flat(obj) -> list:
    import torch

    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _flat(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _flat(o)]
    if hasattr(obj, "to_tuple"):  # transformers ModelOutput
        return _flat(obj.to_tuple())
    return []


def _max_diff(got, want) -> tuple[float, bool]:
    import torch
    from torch.distributed.tensor import DTensor

    got = got.full_tensor() if isinstance(got, DTensor) else got
    got, want = got.detach().double(), want.detach().double()
    if got.shape != want.shape:
        return float("inf"), False
    if not got.numel():
        return 0.0, True
    return float((got - want).abs().max()), bool(torch.allclose(got, want, rtol=RTOL, atol=ATOL))


def check_assignment(module, kwargs, mesh, graph, reference, choices: list[int]) -> dict:
    """Plan with the given choices, run one step, compare with ``reference``."""
    import dataclasses
    import warnings

    from autoplan.codegen.collective_counter import CollectiveCounter
    from autoplan.codegen.dtensor_program import build_program, planned_collectives
    from autoplan.codegen.runtime import ParallelModule
    from autoplan.planner.api import make_options, plan_traced

    shape = tuple(mesh.shape)
    options = dataclasses.replace(make_options(mesh.size(), "h100", shape), pick=lambda g, names: choices[g])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_traced(graph, options)
    model, inputs = module.build(**kwargs)
    tensors = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers())
    program = build_program(graph, plan, mesh, tensors)
    pm = ParallelModule(program, plan, "cpu")
    with CollectiveCounter() as fwd:
        out = pm(*inputs)
    with CollectiveCounter() as bwd:
        out.loss.backward()
    ref_loss, ref_outputs, ref_grads, ref_buffers = reference
    res: dict = {"choices": choices, "params": plan.params, "inputs": plan.inputs,
                 "strategies": sorted({n.strategy for n in plan.nodes}),
                 "executed": {"forward": dict(fwd.counts), "backward": dict(bwd.counts)},
                 "planned": {"forward": planned_collectives(plan, "forward"),
                             "backward": program.observable_collectives("backward")},
                 "redistributions": list(program.redistributions), "bad": []}
    diffs: dict[str, float] = {}

    def compare(name, got, want):
        d, ok = _max_diff(got, want)
        diffs[name] = d
        if not ok:
            res["bad"].append(name)

    compare("loss", out.loss, ref_loss)
    # The program returns the model's tensor outputs that are not the loss itself (nanoGPT's
    # forward returns (logits, loss)): match each with the first unused reference output of its
    # shape.
    unused = list(range(len(ref_outputs)))
    if not out.outputs:
        res["bad"].append("no outputs")
    for i, got in enumerate(out.outputs):
        j = next((j for j in unused if tuple(ref_outputs[j].shape) == tuple(got.shape)), None)
        if j is None:
            res["bad"].append(f"output[{i}] of shape {tuple(got.shape)} has no reference")
            continue
        unused.remove(j)
        compare(f"output[{i}]", got, ref_outputs[j])
    params = pm.named_plan_parameters()
    for fqn, want in ref_grads.items():
        p = params.get(fqn)
        if p is None or p.grad is None:
            res["bad"].append(f"grad {fqn} missing")
            continue
        compare(f"grad {fqn}", p.grad, want)
    for fqn, want in ref_buffers.items():
        compare(f"buffer {fqn}", program.tensor(fqn), want)
    from dist_worker import indivisible_shardings

    res["indivisible"] = indivisible_shardings(graph, plan, shape)
    if res["indivisible"]:
        res["bad"].append(f"shards dims the mesh does not divide: {res['indivisible'][:3]}")
    res["worst"] = max(diffs, key=diffs.get)
    res["max_diff"] = diffs[res["worst"]]
    res["grad_max_diff"] = max((v for k, v in diffs.items() if k.startswith("grad")), default=0.0)
    res["compared"] = len(diffs)
    res["ok"] = not res["bad"]
    return res


def run_config(label, module_name, kwargs, mesh_shape, examples) -> list[dict]:
    import dataclasses
    import importlib
    import warnings

    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.planner.api import make_options, plan_traced
    from autoplan.load import make_model_spec
    from autoplan.trace.tracer import trace

    module = importlib.import_module(module_name)
    model, inputs = module.build(**kwargs)
    spec = make_model_spec(model, inputs, module.loss_fn)
    graph = trace(spec)
    mesh = init_device_mesh("cpu", mesh_shape)
    # the number of choices of every strategy group on this mesh
    sizes: list[int] = []
    options = make_options(mesh.size(), "h100", mesh_shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan_traced(graph, dataclasses.replace(options, pick=lambda g, names: sizes.append(len(names)) or 0))

    ref_model, ref_inputs = module.build(**kwargs)
    ref_out = ref_model(*ref_inputs)
    ref_loss = module.loss_fn(ref_out, *ref_inputs)
    ref_loss.backward()
    reference = (ref_loss, _flat(ref_out),
                 {n: p.grad for n, p in ref_model.named_parameters(remove_duplicate=False) if p.grad is not None},
                 dict(ref_model.named_buffers()))

    records: list[dict] = []
    # every assignment: one integer per group, in range; hypothesis starts from its simplest
    # (all zeros) and spreads out
    assignment = st.tuples(*(st.integers(0, n - 1) for n in sizes)).map(list)

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(assignment)
    def search(choices):
        start = time.perf_counter()
        try:
            res = check_assignment(module, kwargs, mesh, graph, reference, choices)
        except Exception as e:  # noqa: BLE001 -- the same on every rank (same code, same data)
            res = {"choices": choices, "ok": False, "error": f"{type(e).__name__}: {str(e)[:2000]}",
                   "traceback": traceback.format_exc()[-4000:]}
        res["time_s"] = time.perf_counter() - start
        res["config"] = label
        records.append(res)

    search()
    return records


def worker_main() -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "examples"))
    out_dir = Path(sys.argv[1])
    wanted = sys.argv[2:]
    dist.init_process_group("gloo", timeout=PEER_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    results: dict[str, list[dict]] = {}
    for label, module_name, kwargs, mesh_shape, examples in CONFIGS[world]:
        if wanted and label not in wanted:
            continue
        start = time.perf_counter()
        results[label] = run_config(label, module_name, kwargs, mesh_shape, examples)
        if rank == 0:
            print(f"{label}: {len(results[label])} assignments in {time.perf_counter() - start:.1f}s, "
                  f"{sum(not r['ok'] for r in results[label])} failed", flush=True)
        dist.barrier()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------
# the tests (pytest side)
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[int, dict[int, dict]]:
    return {world: launch_worker(Path(__file__).resolve(), world, tmp_path_factory.mktemp(f"prop{world}"),
                                 timeout=300) for world in CONFIGS}


def _records(results, world: int, label: str) -> list[dict]:
    per_rank = [results[world][r][label] for r in range(world)]
    for r in range(1, world):  # every rank drew the same assignments
        assert [x["choices"] for x in per_rank[r]] == [x["choices"] for x in per_rank[0]], f"rank {r} drew others"
    return per_rank[0]


@pytest.mark.parametrize("world,label", [(w, c[0]) for w, cs in CONFIGS.items() for c in cs])
def test_any_assignment_matches_single_device(results, world, label):
    records = _records(results, world, label)
    assert len({tuple(r["choices"]) for r in records}) >= min(3, len(records)), "too few distinct assignments"
    failures = [f"choices={r['choices']}: {r.get('error') or r['bad']}\n{r.get('traceback', '')}"
                for r in records if not r["ok"]]
    assert not failures, f"{len(failures)}/{len(records)} assignments differ:\n" + "\n".join(failures[:3])
    for r in records:
        assert r["compared"] >= 3 and r["max_diff"] < 1e-4

@pytest.mark.parametrize("world,label", [(w, c[0]) for w, cs in CONFIGS.items() for c in cs])
def test_any_assignment_runs_the_planned_collectives(results, world, label):
    """Whatever the assignment, forward and backward execute exactly the collectives the plan
    lists, kind by kind (gloo runs an all_to_all as an all_gather: the two are summed)."""
    from dist_worker import gloo_normalised

    wrong = [f"choices={r['choices']} {phase}: executed {gloo_normalised(r['executed'][phase])}, planned "
             f"{gloo_normalised(r['planned'][phase])}"
             for r in _records(results, world, label) if r["ok"] for phase in ("forward", "backward")
             if gloo_normalised(r["executed"][phase]) != gloo_normalised(r["planned"][phase])]
    assert not wrong, f"{len(wrong)} differ:\n" + "\n".join(wrong[:5])


def test_enough_assignments(results):
    for world, configs in CONFIGS.items():
        total = sum(len(results[world][0][c[0]]) for c in configs)
        assert total >= 30, (world, total)
        # the assignments reach beyond replication: some shard parameters
        sharded = sum(any(any(p != "R" for p in spec) for spec in r.get("params", {}).values())
                      for c in configs for r in results[world][0][c[0]])
        assert sharded >= total // 2, (world, sharded, total)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    worker_main()
