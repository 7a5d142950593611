"""One rank of the native-API checks (tests/test_native.py launches it).

    python -m torch.distributed.run --nproc-per-node 2 tests/native_worker.py OUT_DIR

For every case: plan the model (every rank plans the same), build the ParallelModule with
``build_parallel_module`` (native preferred), record which program ran it (DDP, parallelize_module or
the DTensor interpreter) and compare it with the single device through
``check_against_single_device`` (loss, outputs, every gradient, loss after 2 SGD steps; fp32,
rtol 1e-4). Each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autoplan.codegen.dtensor_program import planned_collectives
from autoplan.codegen.check import check_against_single_device
from autoplan.codegen.native import NativeProgram, recognise
from autoplan.codegen.runtime import init_distributed, build_parallel_module
from autoplan.planner.api import make_options, plan_spec
from autoplan.load import make_model_spec


def _sum_loss(output: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return ((output - x) ** 2).sum()


# name -> (example module, build kwargs, memory_per_device, loss override, expected kind)
CASES: dict[str, tuple[str, dict, float | None, object, str]] = {
    # Megatron, the row output all-reduced (Replicate)
    "mlp_megatron_allreduce": ("mlp", {"hidden": 1024, "batch": 8, "seq": 16}, None, None, "tensor_parallel"),
    # Megatron, the row output reduce-scattered on the sequence dim
    "mlp_megatron_rs_seq": ("mlp", {"hidden": 512, "batch": 4, "seq": 512}, None, None, "tensor_parallel"),
    # pure data parallelism -> DDP
    "mlp_dp": ("mlp", {"hidden": 64, "batch": 64, "seq": 128}, None, None, "ddp"),
    # data parallel, but the loss is a sum: DDP's average would be wrong -> the interpreter
    "mlp_dp_sum_loss": ("mlp", {"hidden": 64, "batch": 64, "seq": 128}, None, _sum_loss, "none"),
    # GPT with a sharded tied embedding and attention: not a native pattern -> the interpreter
    "gpt_sharded": ("gpt", {"hidden": 64, "layers": 2, "heads": 4, "seq": 32, "vocab": 256, "batch": 8}, 2.4e6, None,
                    "none"),
}


def run_case(name: str, world: int) -> dict:
    module_name, kwargs, memory, loss_override, expected = CASES[name]
    module = __import__(module_name)
    loss_fn = loss_override or module.loss_fn
    model, inputs = module.build(**kwargs)
    spec = make_model_spec(model, inputs, loss_fn)
    plan, graph = plan_spec(spec, make_options(world, "h100", (world,), memory_per_device=memory))
    found = recognise(spec, graph, plan)
    before = {k: v.detach().clone() for k, v in spec.module.state_dict().items()}
    pm = build_parallel_module(spec, plan, graph=graph)
    untouched = all(torch.equal(before[k], v) for k, v in spec.module.state_dict().items())
    program = pm.program
    kind = program.kind if isinstance(program, NativeProgram) else "none"
    report = check_against_single_device(spec, pm, steps=2, rtol=1e-4, atol=1e-5)
    observable = ({p: program.observable_collectives(p) for p in ("forward", "backward")}
                  if isinstance(program, NativeProgram) else report.planned)
    return {
        "expected": expected,
        "recognised": found.kind,
        "reason": found.reason,
        "program": kind,
        "styles": {k: [v[0], str(v[1])] for k, v in found.styles.items()},
        "params": plan.params,
        "inputs": plan.inputs,
        "values_ok": report.values_ok,
        "worst": [report.worst.name, report.worst.max_abs_diff, report.worst.allowed],
        "num_compared": len(report.comparisons),
        "num_model_parameters": len(list(model.parameters())),
        "bad": [[c.name, c.max_abs_diff, c.allowed] for c in report.comparisons if not c.ok],
        "executed": report.executed,
        "planned": report.planned,  # what check.py expects the program to run
        "planned_by_plan": {p: planned_collectives(plan, p) for p in ("forward", "backward")},
        "observable": observable,
        "collective_map": [[m.planned, m.native, m.observable] for m in getattr(program, "collective_map", [])],
        "module_untouched": untouched,
        "report": report.text(),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    names = sys.argv[2:] or list(CASES)
    ctx = init_distributed()
    torch.set_num_threads(1)
    results: dict[str, dict] = {}
    for name in names:
        try:
            results[name] = run_case(name, ctx.world_size)
        except Exception as e:  # noqa: BLE001 -- recorded, so the test names the failing case
            results[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        dist.barrier()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results, indent=1, default=str))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
