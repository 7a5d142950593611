"""Step time of pipelines run with stages cut from the model's own modules against the
DTensor interpreter's stages, both on torch's schedule: stages of one device each, or of
``--fsdp N`` devices each sharding the stage's parameters over them.

    .venv/bin/python benchmarks/pipeline_native.py             # launches 2 gloo processes itself
    .venv/bin/python benchmarks/pipeline_native.py --fsdp 2 --batch 16 --microbatches 2   # 4 processes

A Hugging Face Llama (random weights) planned ``--manual pp=2,microbatches=M`` (1F1B, one
device per stage), or ``pp=2,fsdp=N,microbatches=M``: autoplan's program with
``prefer_native=False`` (each stage's ops run one by one on DTensors,
:mod:`autoplan.codegen.pipeline_program`) and natively (the stages cut by torch's ``pipeline()``
tracer, each running the model's own blocks, ``fully_shard``ed per block over a stage's devices
with ``--fsdp``: :mod:`autoplan.codegen.native_pipeline`), timed as ``accumulation_native.py``
times its variants (host overheads on this machine, not a GPU's time).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from accumulation_native import _planned_step  # noqa: E402
from step_time_vs_native import (  # noqa: E402
    _report, _time_variants, finish, launch_under_torchrun, llama_arguments, small_llama)


def main() -> int:
    parser = llama_arguments(__doc__.splitlines()[0], hidden=128, batch=8, vocab=1024)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--fsdp", type=int, default=1, help="devices per stage, its parameters sharded over them")
    args = parser.parse_args()
    processes = 2 * args.fsdp
    if "RANK" not in os.environ:
        return launch_under_torchrun(__file__, processes)
    torch.set_num_threads(1)
    from autoplan.codegen.native_pipeline import NativePipelineProgram
    from autoplan.codegen.runtime import build_parallel_module, init_distributed
    from autoplan.planner.front_door import with_decisions
    from autoplan.planner.manual import parse_manual, plan_manual
    from autoplan.planner.options import PlanOptions
    from autoplan.trace.microbatch import microbatch_inputs
    from autoplan.trace.tracer import trace

    ctx = init_distributed()
    _, inputs, spec = small_llama(args)
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, args.microbatches)))
    options = PlanOptions(processes, "cpu", plan_only=True)
    text = f"pp=2,microbatches={args.microbatches}" if args.fsdp == 1 else \
        f"pp=2,fsdp={args.fsdp},microbatches={args.microbatches}"
    plan = with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)), options)
    interpreter = build_parallel_module(spec, plan, graph=graph, prefer_native=False)
    native = build_parallel_module(spec, plan, graph=graph)
    if not isinstance(native.program, NativePipelineProgram):
        raise SystemExit(f"{text}: not taken natively ({native.description})")
    args_in = [inputs[name] for name in graph.input_names]
    if ctx.rank == 0:
        print(f"step time (every microbatch's forward + backward, SGD step), Llama hidden {args.hidden}, "
              f"{args.layers} layers, batch {args.batch} x {args.seq} tokens in {args.microbatches} microbatches, "
              f"vocab {args.vocab}, --manual {text} ({plan.schedule}), {processes} gloo processes, 1 thread each, "
              f"torch {torch.__version__}; median of {args.steps} steps after {args.warmup} warm-up")
    results = _time_variants({"autoplan interpreter stages": _planned_step(interpreter, args_in),
                              "autoplan stages cut from the model": _planned_step(native, args_in)},
                             args.warmup, args.steps)
    if ctx.rank == 0:
        print(f"  {native.description}")
        print("\n".join(_report(results, "autoplan stages cut from the model")))
    return finish(ctx.rank)


if __name__ == "__main__":
    sys.exit(main())
