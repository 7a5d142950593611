"""One rank of the test that the program carries out what the Plan decides
(tests/test_front_door.py launches it on 2 processes).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/decisions_worker.py OUT_DIR

It plans a small MLP and a two-stage pipeline through the front door, then builds the program
of plans that differ in one decision each (the optimizer and its hyper-parameters, the
precision, recomputed regions, parameter storage, microbatches, the schedule) and records what
each program does: the optimizer it steps, the schedule it runs, or the one-line refusal. The
AdamW plan is also checked against one device over two optimizer steps (every parameter).
Each rank writes OUT_DIR/rank{r}.json.
"""

from __future__ import annotations

import copy
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import autoplan  # noqa: E402
from autoplan.codegen.check import check_against_single_device  # noqa: E402
from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.load import load_model_file  # noqa: E402
from autoplan.plan_schema import ParamStorage, PrecisionPlan  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402


def _optimizer(pm) -> dict:
    opt = pm.optimizer
    group = opt.param_groups[0]
    return {"type": type(opt).__name__, "lr": group["lr"], "weight_decay": group["weight_decay"],
            "momentum": group.get("momentum"), "params": sum(len(g["params"]) for g in opt.param_groups)}


def _built(spec, plan) -> dict:
    try:
        pm = build_parallel_module(spec, plan)
    except AutoplanError as e:
        return {"refused": str(e)}
    out = {"optimizer": _optimizer(pm), "sharded_state": len(pm.sharded_state)}
    if not plan.scheduled:
        out["output_dtype"] = str(pm(*spec.example_inputs).outputs[0].dtype)
    program = pm.program
    checkpointed = getattr(getattr(program, "_interpreter", None), "checkpointed", None)
    if checkpointed is not None:
        out["checkpointed"] = sorted({region.layer for region in checkpointed.region_of.values()})
    if hasattr(program, "schedule") and hasattr(program, "num_microbatches"):
        out["schedule"] = type(program.schedule).__name__
        out["microbatches"] = program.num_microbatches
    return out


def main(out_dir: Path) -> None:
    ctx = init_distributed()
    torch.manual_seed(0)
    results: dict = {}
    try:
        mlp = load_model_file(str(ROOT / "examples" / "mlp.py"))
        base = plan_model(mlp, PlanOptions(2, "cpu", pipeline=False))
        pm = build_parallel_module(mlp, copy.deepcopy(base))
        report = check_against_single_device(mlp, pm, steps=2)
        results["adamw_check"] = {"ok": report.ok, "text": report.text(),
                                  "names": [c.name for c in report.comparisons]}
        # the Python API: every rank plans (the same plan) and builds its program
        api = autoplan.parallelize(mlp.module, mlp.example_inputs, loss_fn=mlp.loss_fn, cluster="cpu", pipeline=False)
        api_report = check_against_single_device(mlp, api, steps=2)
        results["parallelize"] = {"type": type(api).__name__, "ok": api_report.ok, "text": api_report.text(),
                                  "same_plan": api.plan.decisions() == base.decisions()}
        variants = {
            "adamw": base,
            "sgd": plan_model(mlp, PlanOptions(2, "cpu", pipeline=False, optimizer="sgd", lr=0.05)),
            "sgd_momentum": plan_model(mlp, PlanOptions(2, "cpu", pipeline=False, optimizer="sgd-momentum")),
            "adamw_wd": plan_model(mlp, PlanOptions(2, "cpu", pipeline=False, weight_decay=0.1, lr=3e-4)),
        }
        bf16 = copy.deepcopy(base)
        bf16.precision = PrecisionPlan.named("bf16")
        recompute = plan_model(mlp, PlanOptions(2, "cpu", pipeline=False, recompute=True))
        zero = copy.deepcopy(base)
        name = next(iter(zero.storage))
        sharded = ["R" if p != "R" else "S(0)" for p in zero.params[name]]  # unlike the parameter
        zero.storage[name] = ParamStorage(zero.params[name], zero.params[name], sharded)
        variants.update(bf16=bf16, recompute=recompute, zero=zero)
        for key, plan in variants.items():
            results[key] = _built(mlp, plan)

        funnel = load_model_file(str(ROOT / "examples" / "funnel.py"))
        for key, micro, schedule in (("pipe_gpipe_2", 2, "gpipe"), ("pipe_1f1b_4", 4, "1f1b")):
            plan = plan_model(funnel, PlanOptions(2, "cpu", stages=2, microbatches=micro, schedule=schedule))
            results[key] = _built(funnel, plan)
    except Exception as e:  # the test prints it
        results["error"] = f"{type(e).__name__}: {e}"
        results["traceback"] = traceback.format_exc()
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
