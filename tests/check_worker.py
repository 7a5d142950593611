"""One rank of a batch of ``--check`` runs: many small models, one process launch.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/check_worker.py OUT_DIR

``OUT_DIR/cases.json`` lists the cases: ``{"name", "file", "builder", "plan"}`` (and
``"interpreter": true`` to run the plan on the DTensor interpreter whatever program it names). ``builder`` is a
function of the module ``file`` (a file under tests/) (or a key of its ``ALL_CASES``) returning ``(model, example_inputs, loss_fn)`` or a
``zoo.ZooCase`` (the same model on every rank: it seeds itself); ``plan`` is the path of a plan.json the test planned
beforehand. Each case's program is built and checked against one device (outputs, loss, every
gradient, the executed collectives, the parameters after two optimizer steps). A failing case
is recorded and the next one runs; the process group's timeout is short, so that a case that
leaves one rank waiting fails the launch instead of hanging it. Each rank writes
OUT_DIR/rank{r}.json: ``{name: {"ok", "text"} or {"error", "traceback"}}``.
"""

from __future__ import annotations

import importlib
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
sys.path.insert(0, str(ROOT / "tests"))

from autoplan.codegen.check import check_against_single_device  # noqa: E402
from autoplan.codegen.parameter_regather import GatheredParameters  # noqa: E402
from autoplan.codegen.prefetched_gathers import PrefetchedGathers  # noqa: E402
from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402
from launcher import PEER_TIMEOUT  # noqa: E402


def run_case(case: dict) -> dict:
    module = importlib.import_module(Path(case["file"]).stem)  # tests/ is on sys.path
    builder = getattr(module, case["builder"], None) or module.ALL_CASES[case["builder"]]  # zoo.py
    built = builder()
    model, inputs, loss_fn = built if isinstance(built, tuple) else (built.model, built.example_inputs,
                                                                      built.loss_fn)
    spec = make_model_spec(model, inputs, loss_fn, name=case["name"])
    plan = Plan.load(case["plan"])
    interpreter = bool(case.get("interpreter"))  # the DTensor interpreter asked for, whatever the plan names
    pm = build_parallel_module(spec, plan, prefer_native=not interpreter)
    report = check_against_single_device(spec, pm, steps=2)
    regathered = [m.gathered for m in pm.modules() if isinstance(getattr(m, "gathered", None), GatheredParameters)]
    recomputed = [m.prefetched for m in pm.modules() if isinstance(getattr(m, "prefetched", None), PrefetchedGathers)]
    return {"ok": report.ok, "text": report.text(), "moved": report.moved, "description": pm.description,
            "planned_program": "" if interpreter else plan.program,
            "prefetched_regathers": sum(g.prefetched for g in regathered)
            + sum(p.recomputation_gathers for p in recomputed)}


def main(out_dir: Path) -> None:
    dist.init_process_group("gloo", timeout=PEER_TIMEOUT)
    ctx = init_distributed()
    results: dict = {}
    for case in json.loads((out_dir / "cases.json").read_text()):
        torch.manual_seed(0)
        started = time.perf_counter()
        try:
            results[case["name"]] = run_case(case)
        except Exception as e:  # the test reports it
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results[case["name"]]["seconds"] = time.perf_counter() - started  # the case's wall time, for profiling
        (out_dir / f"partial{ctx.rank}.json").write_text(json.dumps(results))  # what a hang leaves behind
        print(f"rank {ctx.rank}: {case['name']} done", flush=True)
        dist.barrier()
    (out_dir / f"rank{ctx.rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    # every result is written: leave without the interpreter's teardown, where gloo's threads
    # sometimes abort the process ("terminate called without an active exception")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
