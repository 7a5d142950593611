"""Predicted against measured step time and memory on one GPU (CUDA, NCCL).

    torchrun --nproc-per-node 1 benchmarks/gpu_step_time.py [--model gpt2|llama-1b|llama-3b]
        [--precision fp32|bf16] [--recompute all|selective|op|none] [--batch B] [--seq S]
        [--cluster h100 [--cluster FILE.toml ...]] [--interpreter] [--eager] [--json OUT.json]

Plans the model (Hugging Face classes, random weights; ``gpt2``: GPT-2 124M, ``llama-1b``:
Llama 3.2 1B's shape, ``llama-3b``: 3B's, ``examples/llama.py``) through the front door for the running job's
devices under each ``--cluster`` (no pipeline; ``--recompute all`` recomputes every layer in
the backward, ``selective`` keeps each layer's matrix products and attention, ``op`` torchtitan's
per-op policy; ``--precision bf16`` trains under torch.autocast with fp32 master weights),
builds the program of the first cluster's plan (the native program where the plan is one of
PyTorch's own patterns; ``--interpreter``: the DTensor interpreter always) and times ``--steps`` training steps of it
(forward, backward and the plan's AdamW step, each timed to a CUDA synchronise after
``--warmup`` steps). Prints each cluster's predicted step time and peak memory beside the
measured median step time and ``torch.cuda.max_memory_allocated``. ``--eager`` also times the
model as a user would run it by hand on one GPU (the same precision and checkpointing through
Hugging Face's own gradient checkpointing, torch's AdamW): how far the emitted program is from
eager PyTorch. Needs a GPU; on a CPU-only machine it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from autoplan.codegen.runtime import build_parallel_module, init_distributed  # noqa: E402
from autoplan.load import ModelSpec, make_model_spec  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.solvers import format_bytes, format_seconds  # noqa: E402


def _build(args: argparse.Namespace) -> ModelSpec:
    """The model on the GPU, with its example inputs (one global batch)."""
    if args.model == "gpt2":
        import gpt2

        model, inputs = gpt2.build(n_layer=12, n_embd=768, n_head=12, n_positions=args.seq, vocab_size=50257,
                                   batch=args.batch, seq=args.seq, device="cuda")
        return make_model_spec(model, inputs, gpt2.loss_fn, name="GPT-2 124M")
    import llama

    shape, name = (llama.LLAMA_3B, "3B") if args.model == "llama-3b" else (llama.LLAMA_1B, "1B")
    model, inputs = llama.build(**shape, batch=args.batch, seq=args.seq, device="cuda")
    return make_model_spec(model, inputs, None, name=f"Llama 3.2 {name} shape")


def _time_steps(step: Callable[[], Any], warmup: int, steps: int) -> tuple[list[float], float, Any]:
    """Seconds of each step after ``warmup`` (each to a CUDA synchronise), the peak memory
    allocated over the timed steps, and the last step's result."""
    times = []
    result = None
    for index in range(warmup + steps):
        if index == warmup:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = step()
        torch.cuda.synchronize()
        if index >= warmup:
            times.append(time.perf_counter() - start)
    return times, float(torch.cuda.max_memory_allocated()), result


def _eager_step(spec: ModelSpec, plan: Plan) -> Callable[[], torch.Tensor]:
    """One hand-written training step of the user's model: the plan's precision (autocast) and
    checkpointing (Hugging Face's non-reentrant gradient checkpointing), torch's AdamW."""
    model = spec.module
    if plan.recompute:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    bf16 = plan.precision.name == "bf16"

    def step() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else nullcontext():
            loss = spec.loss_fn(spec.call(model, spec.example_inputs), *spec.example_inputs)
        loss.backward()
        optimizer.step()
        return loss.detach()

    return step


#: Kinds of GPU kernel, by a pattern of their names (the first that matches), for ``--profile``.
KERNEL_KINDS = (("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|sm90_", re.I)),
                ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
                ("collective", re.compile(r"nccl", re.I)),
                ("copy", re.compile(r"memcpy|memset|copy", re.I)),
                ("optimizer", re.compile(r"multi_tensor|adam|foreach", re.I)),
                ("softmax / loss", re.compile(r"softmax|nll|cross_entropy|logsumexp", re.I)),
                ("reduction", re.compile(r"reduce|norm|mean|sum", re.I)),
                ("element-wise", re.compile(r"elementwise|vectorized|unrolled|pointwise|cat", re.I)))


def _kernel_seconds(step: Callable[[], Any], steps: int = 3) -> dict[str, float]:
    """GPU kernel seconds per step of ``step`` by kind (:data:`KERNEL_KINDS`; "other" for the
    rest, "total" for all), from torch.profiler over ``steps`` steps."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    seconds: dict[str, float] = {}
    for event in prof.events():
        if event.device_type != DeviceType.CUDA:
            continue
        kind = next((k for k, pattern in KERNEL_KINDS if pattern.search(event.name)), "other")
        elapsed = event.time_range.elapsed_us() * 1e-6 / steps
        seconds[kind] = seconds.get(kind, 0.0) + elapsed
        seconds["total"] = seconds.get("total", 0.0) + elapsed
    return seconds


def _check(spec: ModelSpec, plan: Plan, args: argparse.Namespace) -> bool:
    """``--check`` of a freshly built program against the model on this GPU; prints the report."""
    from autoplan.codegen.check import check_against_single_device

    pm = build_parallel_module(spec, plan, prefer_native=not args.interpreter)
    report = check_against_single_device(spec, pm, steps=args.check_steps)
    if dist.get_rank() == 0:
        print(report.text(), flush=True)
    del pm
    torch.cuda.empty_cache()
    return report.ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("gpt2", "llama-1b", "llama-3b"), default="gpt2")
    parser.add_argument("--cluster", action="append", help="a preset or cluster file (repeatable; default h100)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--recompute", choices=("all", "selective", "op", "none"), default="none")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--interpreter", action="store_true",
                        help="run the plan on the DTensor interpreter even where a native program matches it")
    parser.add_argument("--eager", action="store_true", help="also time the model run eagerly by hand")
    parser.add_argument("--check", action="store_true",
                        help="first check the program against the model on the GPU (outputs, loss, every gradient, "
                             "the parameters after --check-steps steps, the executed collectives)")
    parser.add_argument("--check-steps", type=int, default=2)
    parser.add_argument("--profile", action="store_true",
                        help="also profile 3 steps of the program: GPU kernel time per step by kind of kernel")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args()
    if args.eager and args.recompute in ("selective", "op"):
        print("gpu_step_time: --eager times Hugging Face's own checkpointing, which recomputes whole layers; "
              "use it with --recompute all or none", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_step_time: no GPU here; run it on a machine with CUDA", file=sys.stderr)
        return 2
    clusters = args.cluster or ["h100"]
    ctx = init_distributed()
    spec = _build(args)
    plans: list[tuple[str, Plan, float]] = []
    for cluster in clusters:
        start = time.perf_counter()
        options = PlanOptions(ctx.world_size, cluster, pipeline=False, precision=args.precision,
                              recompute=args.recompute)
        plans.append((cluster, plan_model(spec, options), time.perf_counter() - start))
    plan = plans[0][1]
    checked = _check(spec, plan, args) if args.check else None
    pm = build_parallel_module(spec, plan, prefer_native=not args.interpreter)
    program = getattr(pm.program, "kind", "interpreter")
    times, peak, loss = _time_steps(lambda: pm.train_step(*spec.example_inputs), args.warmup, args.steps)
    measured = statistics.median(times)
    kernels = _kernel_seconds(lambda: pm.train_step(*spec.example_inputs)) if args.profile else None
    rows: dict[str, Any] = {"model": spec.name, "batch": args.batch, "seq": args.seq, "precision": args.precision,
                            "recompute": args.recompute, "devices": ctx.world_size,
                            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "program": program,
                            "measured_step_s": measured, "measured_min_s": min(times), "measured_max_s": max(times),
                            "measured_peak_bytes": peak, "loss": float(loss.item()), "predicted": {},
                            "check_passed": checked, "kernel_s_per_step": kernels}
    for cluster, each, seconds in plans:
        rows["predicted"][cluster] = {"step_s": each.predicted.step_time_s, "peak_bytes": each.predicted.memory_bytes.peak,
                                      "peak_with_transient_bytes": each.predicted.memory_bytes.peak_with_transient,
                                      "compute_s": each.predicted.compute_s, "mfu": each.predicted.mfu,
                                      "planning_s": seconds}
    if args.eager:
        del pm
        torch.cuda.empty_cache()
        eager_times, eager_peak, _ = _time_steps(_eager_step(spec, plan), args.warmup, args.steps)
        rows["eager_step_s"], rows["eager_peak_bytes"] = statistics.median(eager_times), eager_peak
    if ctx.rank == 0:
        _print(rows, plan)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def _print(rows: dict[str, Any], plan: Plan) -> None:
    measured = rows["measured_step_s"]
    tokens = rows["batch"] * rows["seq"]
    print(f"model {rows['model']}, batch {rows['batch']} x {rows['seq']} tokens, {rows['devices']} GPU(s) "
          f"({rows['gpu']}), torch {rows['torch']}")
    print(f"plan: mesh {plan.mesh}, {len(plan.stages)} stage(s), optimizer {plan.optimizer.name}, "
          f"precision {plan.precision.name}, {len(plan.recompute)} region(s) recomputed; program: {rows['program']}")
    print(f"measured: median {format_seconds(measured)} a step (min {format_seconds(rows['measured_min_s'])}, "
          f"max {format_seconds(rows['measured_max_s'])}), {tokens / measured:,.0f} tokens/s, max allocated "
          f"{format_bytes(rows['measured_peak_bytes'])}; last loss {rows['loss']:.4f}")
    if rows.get("kernel_s_per_step"):
        kernels = rows["kernel_s_per_step"]
        print("GPU kernels per step (torch.profiler, 3 steps): " + ", ".join(
            f"{kind} {format_seconds(sec)}" for kind, sec in sorted(kernels.items(), key=lambda kv: -kv[1])))
    if "eager_step_s" in rows:
        print(f"eager by hand: median {format_seconds(rows['eager_step_s'])} a step, max allocated "
              f"{format_bytes(rows['eager_peak_bytes'])}; program / eager = {measured / rows['eager_step_s']:.2f}")
    for cluster, p in rows["predicted"].items():
        print(f"cluster {cluster}: predicted {format_seconds(p['step_s'])} (compute {format_seconds(p['compute_s'])}, "
              f"MFU {p['mfu']:.1%}), peak {format_bytes(p['peak_bytes'])} kept, "
              f"{format_bytes(p['peak_with_transient_bytes'])} with the backward's transients; measured / predicted = "
              f"{measured / p['step_s']:.2f}; planned in {p['planning_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
