"""Step time of plans that accumulate microbatches on one stage, run natively (each microbatch
through DDP or FSDP2) against the interpreter on torch's pipeline schedule and against the same
loop written by hand.

    .venv/bin/python benchmarks/accumulation_native.py        # launches 2 gloo processes itself
    .venv/bin/python benchmarks/accumulation_native.py --held --hidden 256 --batch 16

A Hugging Face Llama (random weights) planned ``--manual dp=2,microbatches=M``,
``fsdp=2,microbatches=M`` and ``dp=2,zero=2,microbatches=M``: autoplan's program with
``prefer_native=False`` (the DTensor interpreter inside ``torch.distributed.pipelining``'s
one-stage schedule) and natively (:mod:`autoplan.codegen.native_accumulation`), against the loop
written by hand (DDP under ``no_sync`` but for the last microbatch; ``fully_shard`` per block and
on the root, ``reshard_after_forward=False`` and held through the microbatches for ZeRO-2), each
rank fed its half of every microbatch. One step = every microbatch's forward and backward + an
SGD step; the variants take turns step by step; a step's time is the slower rank's
(``step_time_vs_native.py``'s timing). On a 2-core machine the figures compare host overheads,
they do not measure a GPU.

``--held``: instead, the search's plan of the same model in bf16 on 2 devices (one stage,
``--microbatches`` accumulated) under a budget that replicated Adam state exceeds, which holds
some weights gathered through the step; against the loop by hand with ``fully_shard`` per block
and on the root (``reshard_after_forward=False``, bf16 parameters, fp32 reductions, under
autocast), neither resharded nor reduced but in the last microbatch. The default model plans
tensor parallel; ``--hidden 256 --batch 16`` plans data parallel with held weights.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from step_time_vs_native import (  # noqa: E402
    _report, _time_variants, finish, launch_under_torchrun, llama_arguments, small_llama)

PLANS = {"DDP": "dp=2,microbatches={m}", "FSDP": "fsdp=2,microbatches={m}", "ZeRO-2": "dp=2,zero=2,microbatches={m}"}


def _args() -> argparse.Namespace:
    p = llama_arguments(__doc__.splitlines()[0], hidden=128, batch=8, vocab=1024)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--held", action="store_true", help="time the search's plan holding weights through the step")
    return p.parse_args()


def _held_plan(spec, microbatches: int):
    """The search's bf16 plan on 2 devices, one stage, under a budget that replicated Adam
    state exceeds (half of it): the large weights held gathered through the step."""
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.options import PlanOptions

    def planned(budget: float | None):
        return plan_model(spec, PlanOptions(2, "cpu", stages=1, microbatches=microbatches, mesh=(2,),
                                            recompute="none", precision="bf16", memory_per_device=budget))

    free = planned(None).predicted.memory_bytes
    return planned(free.peak_with_transient - 0.5 * free.optimizer)


def _planned_step(pm, inputs, lr: float = 1e-3) -> Callable[[], None]:
    opt = torch.optim.SGD(list({id(p): p for p in pm.named_plan_parameters().values()}.values()), lr=lr)

    def step() -> None:
        pm.forward_backward(*inputs)
        opt.step()
        opt.zero_grad()

    return step


def _by_hand(kind: str, model: torch.nn.Module, inputs: dict[str, torch.Tensor], m: int) -> Callable[[], None]:
    """The accumulation loop as one writes it with DDP or FSDP2, each rank its half of each
    microbatch."""
    from contextlib import nullcontext

    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from torch.distributed.fsdp import MixedPrecisionPolicy

    rank = dist.get_rank()
    pieces = [{k: v.chunk(m, 0)[i].chunk(2, 0)[rank] for k, v in inputs.items()} for i in range(m)]
    held = kind in ("ZeRO-2", "held")  # gathered once a step; "held": reduced once too
    bf16 = kind == "held"
    if kind == "DDP":
        model = DistributedDataParallel(model)
    else:
        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else MixedPrecisionPolicy()
        for block in model.model.layers:
            fully_shard(block, reshard_after_forward=not held, mp_policy=policy)
        fully_shard(model, reshard_after_forward=not held, mp_policy=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fsdp_modules = [mod for mod in model.modules() if hasattr(mod, "set_reshard_after_backward")]

    def step() -> None:
        for i, piece in enumerate(pieces):
            last = i == m - 1
            for mod in fsdp_modules if held else []:
                mod.set_reshard_after_backward(last, recurse=False)
                if kind == "held":
                    mod.set_requires_gradient_sync(last, recurse=False)
            with model.no_sync() if kind == "DDP" and not last else nullcontext():
                with torch.autocast("cpu", torch.bfloat16) if bf16 else nullcontext():
                    loss = model(**piece).loss
                (loss / m).backward()
        opt.step()
        opt.zero_grad()

    return step


def main() -> int:
    args = _args()
    if "RANK" not in os.environ:
        return launch_under_torchrun(__file__, 2)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the loss is read out of place
    from autoplan.codegen.native_accumulation import AccumulatedProgram
    from autoplan.codegen.runtime import build_parallel_module, init_distributed
    from autoplan.planner.front_door import with_decisions
    from autoplan.planner.manual import parse_manual, plan_manual
    from autoplan.planner.options import PlanOptions
    from autoplan.trace.microbatch import microbatch_inputs
    from autoplan.trace.tracer import trace

    ctx = init_distributed()
    model, inputs, spec = small_llama(args)
    graph = trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, args.microbatches)))
    options = PlanOptions(2, "cpu", plan_only=True)
    args_in = [inputs[name] for name in graph.input_names]
    if ctx.rank == 0:
        print(f"step time (every microbatch's forward + backward, SGD step), Llama hidden {args.hidden}, "
              f"{args.layers} layers, batch {args.batch} x {args.seq} tokens in {args.microbatches} microbatches, "
              f"vocab {args.vocab}, 2 gloo processes, 1 thread each, torch {torch.__version__}; median of "
              f"{args.steps} steps after {args.warmup} warm-up")
    plans = {kind: (text.format(m=args.microbatches), None) for kind, text in PLANS.items()}
    if args.held:
        plans = {"held": ("searched, bf16, under a budget", _held_plan(spec, args.microbatches))}
    for kind, (text, plan) in plans.items():
        if plan is None:
            plan = with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)), options)
        interp = build_parallel_module(spec, plan, graph=graph, prefer_native=False)
        native = build_parallel_module(spec, plan, graph=graph)
        if not isinstance(native.program, AccumulatedProgram):
            raise SystemExit(f"{text}: not taken natively ({native.description})")
        variants = {
            "autoplan interpreter (pipeline schedule)": _planned_step(interp, args_in),
            f"autoplan native ({native.program.kind})": _planned_step(native, args_in),
            "by hand": _by_hand(kind, copy.deepcopy(model), inputs, args.microbatches),
        }
        results = _time_variants(variants, args.warmup, args.steps)
        if ctx.rank == 0:
            print(f"  {kind} ({text}): {native.description}")
            print("\n".join(_report(results, "by hand")))
    return finish(ctx.rank)


if __name__ == "__main__":
    sys.exit(main())
