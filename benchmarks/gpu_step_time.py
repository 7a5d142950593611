"""Predicted against measured step time and memory on one GPU (CUDA, NCCL), for GPT-2 124M.

    torchrun --nproc-per-node 1 benchmarks/gpu_step_time.py [--cluster h100|FILE.toml]

Plans GPT-2 124M (Hugging Face classes, random weights, fp32, global batch ``--batch`` of
1024 tokens) through the front door for the running job's devices, builds the planned
program, and times ``--steps`` training steps of it (forward, backward and the plan's AdamW
step, each timed to a CUDA synchronise after ``--warmup`` steps). Prints the predicted step
time and peak memory beside the measured median step time and ``torch.cuda.max_memory_allocated``.
Needs a GPU; on a CPU-only machine it says so and exits 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import gpt2  # noqa: E402
from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.solvers import format_bytes, format_seconds  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_step_time: no GPU here; run it on a machine with CUDA", file=sys.stderr)
        return 2
    ctx = init_distributed()
    model, inputs = gpt2.build(n_layer=args.layers, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257,
                               batch=args.batch, seq=1024)
    spec = make_model_spec(model, inputs, gpt2.loss_fn, name=f"GPT-2 {args.layers} layers")
    start = time.perf_counter()
    plan = plan_model(spec, PlanOptions(ctx.world_size, args.cluster, pipeline=False))
    planned_s = time.perf_counter() - start
    spec.module.to("cuda")
    spec = make_model_spec(spec.module, tuple(x.to("cuda") for x in inputs), gpt2.loss_fn, name=spec.name)
    pm = build_parallel_module(spec, plan)
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = pm.train_step(*spec.example_inputs)
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
    if ctx.rank == 0:
        measured = statistics.median(times)
        predicted = plan.predicted.step_time_s
        print(f"model {spec.name}, batch {args.batch} x 1024 tokens, {ctx.world_size} GPU(s) "
              f"({torch.cuda.get_device_name()}), cluster {args.cluster}, torch {torch.__version__}")
        print(f"plan: mesh {plan.mesh}, {len(plan.stages)} stage(s), optimizer {plan.optimizer.name}, "
              f"precision {plan.precision.name}; planned in {planned_s:.1f} s")
        print(f"step time: predicted {format_seconds(predicted)}, measured median {format_seconds(measured)} "
              f"(min {format_seconds(min(times))}, max {format_seconds(max(times))}); "
              f"measured / predicted = {measured / predicted:.2f}")
        print(f"memory per device: predicted peak {format_bytes(plan.predicted.memory_bytes.peak)}, measured "
              f"max allocated {format_bytes(torch.cuda.max_memory_allocated())}; last loss {loss.item():.4f}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
