"""torchtitan's published Llama 3.1 recipes, costed by ``--manual`` beside the plan autoplan finds.

    .venv/bin/python benchmarks/torchtitan_recipes.py [--case 8b|70b|405b ...] [--cluster NAME|FILE]
        [--memory-per-device BYTES]

Every model is Hugging Face's ``LlamaForCausalLM`` with Llama 3.1's shape, built on the meta
device, trained in bf16 (bf16 compute, fp32 master weights, optimizer state and gradient
reductions) with AdamW, sequence length 8,192, on the ``h100`` preset (ops at 0.78 of the
datasheet peaks) or a cluster file (``benchmarks/results/h100-measured-matmul.toml``: the matmul throughput measured
on an H100). The recipes are those of torchtitan's H100 benchmark
(``benchmarks/llama3_h100_202412_torchtitan.md`` in its repository, December 2024):

- ``8b``: 8 GPUs, FSDP 8, local batch 2 (global 16), per-op selective activation checkpointing;
  measured 5,762 tokens/s per GPU (FSDP, no torch.compile, no Float8);
- ``70b``: 256 GPUs, FSDP 32 × TP 8, local batch 16 (global 512), full checkpointing;
  measured 829 tokens/s per GPU (with torch.compile and Float8);
- ``405b``: 512 GPUs, FSDP 8 × TP 8 × PP 8, interleaved 1F1B, local batch 32 (global 256, one
  sequence per microbatch), full checkpointing; measured 128 tokens/s per GPU (with
  torch.compile, Float8 and async TP).

The 8B recipe's selective checkpointing is torchtitan's per-op policy, costed and run as
``ac=op``: the attention's outputs and every other matrix product's kept, the rest recomputed.
What differs from the recipes, and why: the
70B and 405B measurements use Float8 and torch.compile, which the cost model does not know
(bf16 peak only): their ratios are not like for like.

Each row prints the step time, tokens/s per GPU, MFU, the step's parts and the peak memory
predicted for the recipe (``--manual``) and for the plan found, the program that runs the
recipe's plan (:mod:`autoplan.codegen.program_choice`, nothing run), the planning time, and for
each recipe torchtitan's measurement and the ratio predicted / measured. The memory budget
bounds the peak with the backward's transients; a recipe that does not fit it is costed again
without a budget (its row says so), so that its step time still stands beside the plan found.
torchtitan's H100s had 96 GB (``--memory-per-device 96e9``); the preset's have 80 GB.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from autoplan.codegen.program_choice import program_choice  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.load import ModelSpec, make_model_spec  # noqa: E402
from autoplan.plan_schema import Plan, Prediction  # noqa: E402
from autoplan.planner.front_door import plan_model, with_decisions  # noqa: E402
from autoplan.planner.manual import parse_manual, plan_manual  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.planner.pipeline.search import trace_microbatch  # noqa: E402
from autoplan.reports.summary import hidden_text  # noqa: E402
from autoplan.solvers import format_bytes, format_seconds  # noqa: E402

SEQ = 8192
VOCAB = 128256
UNBOUNDED = 1e15  # bytes per device: no memory budget binds


@dataclass(frozen=True)
class Recipe:
    key: str
    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    devices: int
    global_batch: int
    manual: str
    measured_tps: float  # tokens/s per GPU, torchtitan's table
    measured_with: str


def _recipes() -> Iterator[Recipe]:
    yield Recipe("8b", "Llama 3.1 8B", 4096, 32, 32, 14336, 8, 16, "fsdp=8,ac=op", 5762, "FSDP, bf16")
    yield Recipe("70b", "Llama 3.1 70B", 8192, 80, 64, 28672, 256, 512, "fsdp=32,tp=8,ac=full", 829,
                 "2D + compile + Float8")
    yield Recipe("405b", "Llama 3.1 405B", 16384, 126, 128, 53248, 512, 256,
                 "fsdp=8,tp=8,pp=8,microbatches=32,schedule=interleaved1f1b,ac=full", 128,
                 "3D + compile + Float8 + async TP")


def _build(recipe: Recipe):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=recipe.hidden, num_hidden_layers=recipe.layers,
                         num_attention_heads=recipe.heads, num_key_value_heads=8,
                         intermediate_size=recipe.intermediate, vocab_size=VOCAB, max_position_embeddings=SEQ)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, VOCAB, (recipe.global_batch, SEQ))
    return model, {"input_ids": ids, "labels": ids}


def _tokens_per_gpu(recipe: Recipe, p: Prediction) -> float:
    return recipe.global_batch * SEQ / p.step_time_s / recipe.devices


def _row(label: str, recipe: Recipe, p: Prediction | None, reason: str = "") -> str:
    if p is None:
        return f"  {label:46s} {reason}"
    return (f"  {label:46s} {format_seconds(p.step_time_s):>9s} {_tokens_per_gpu(recipe, p):7.0f} tok/s/GPU "
            f"MFU {p.mfu:5.1%}  (compute {format_seconds(p.compute_s)}, communication {format_seconds(p.comm_s)}"
            f"{hidden_text(p)}, "
            f"bubble {format_seconds(p.bubble_s)}; {format_bytes(p.memory_bytes.peak)} per device, "
            f"{format_bytes(p.memory_bytes.peak_with_transient)} with the backward's transients)")


def _recipe_program(spec: ModelSpec, options: PlanOptions, recipe: Recipe) -> str:
    """The program that runs the recipe's plan as written (PyTorch's own or the DTensor
    interpreter, and why): planned under the budget, else without one."""
    manual = parse_manual(recipe.manual)
    graph = trace_microbatch(spec, manual.microbatches)
    for opts in (options, replace(options, memory_per_device=UNBOUNDED)):
        try:
            plan = with_decisions(plan_manual(spec, opts.planner_options(), manual, graph), opts)
        except AutoplanError:
            continue
        return program_choice(spec, graph, plan).line()
    return "not planned"


def _found_label(plan: Plan) -> str:
    stages = f"{len(plan.stages)} stages x " if len(plan.stages) > 1 else ""
    return f"found: {stages}mesh {'x'.join(map(str, plan.mesh))}, {plan.microbatches} mb"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[r.key for r in _recipes()],
                        help="run only this recipe (repeatable; default: all)")
    parser.add_argument("--cluster", default="h100", help="a preset name or a cluster TOML file")
    parser.add_argument("--memory-per-device", type=float, default=None,
                        help="bytes per device (default: the cluster's)")
    args = parser.parse_args()
    for recipe in _recipes():
        if args.case and recipe.key not in args.case:
            continue
        model, inputs = _build(recipe)
        spec = make_model_spec(model, inputs, name=recipe.name)
        start = time.perf_counter()
        options = PlanOptions(recipe.devices, args.cluster, precision="bf16", plan_only=True, manual=(recipe.manual,),
                              memory_per_device=args.memory_per_device)
        plan = plan_model(spec, options)
        planning = time.perf_counter() - start
        manual = next(a for a in plan.alternatives if a.name.startswith("manual"))
        budget = plan.cluster.get("device", {}).get("memory_bytes")
        print(f"{recipe.name} on {recipe.devices} H100s ({args.cluster}, {format_bytes(budget or 0)} per device), "
              f"global batch {recipe.global_batch} x {SEQ} (planning {planning:.1f} s)", flush=True)
        print(_row(f"recipe: {recipe.manual}", recipe, manual.predicted, manual.reason))
        print(f"    runs on: {_recipe_program(spec, options, recipe)}", flush=True)
        fits = manual.predicted is not None
        if not fits:  # over the budget: its step time without one
            unbounded = plan_model(make_model_spec(*_build(recipe), name=recipe.name),
                                   replace(options, memory_per_device=UNBOUNDED))
            manual = next(a for a in unbounded.alternatives if a.name.startswith("manual"))
            print(_row("  the same without a memory budget", recipe, manual.predicted, manual.reason))
        print(_row(_found_label(plan), recipe, plan.predicted))
        for rival in plan.alternatives:  # the other pipelines planned exactly
            if rival.predicted is not None and not rival.name.startswith("manual"):
                print(_row(f"  rival: {rival.name}", recipe, rival.predicted))
        if manual.predicted is not None:
            predicted = _tokens_per_gpu(recipe, manual.predicted)
            print(f"  torchtitan measured {recipe.measured_tps:,.0f} tok/s/GPU ({recipe.measured_with}); "
                  f"recipe predicted / measured = {predicted / recipe.measured_tps:.2f}")
            verdict = "never slower" if plan.predicted.step_time_s <= manual.predicted.step_time_s * (1 + 1e-9) \
                else "SLOWER than the recipe"
            if not fits:
                verdict = f"the recipe does not fit {format_bytes(budget or 0)} per device, the plan found does"
            print(f"  found / recipe step time = {plan.predicted.step_time_s / manual.predicted.step_time_s:.2f} "
                  f"({verdict})", flush=True)


if __name__ == "__main__":
    main()
