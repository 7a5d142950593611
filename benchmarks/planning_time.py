"""Planning time, phase by phase, of real-size models built on the meta device (no weights).

    .venv/bin/python benchmarks/planning_time.py [--case NAME ...] [--no-pipeline] [--precision fp32|bf16]

Plans are in the cluster's default precision (bf16 on ``h100``) unless ``--precision`` names one.

Cases (targets on a 2-core machine: each under 10 s with the pipeline search):

- ``gpt2``: Hugging Face GPT-2 124M, seq 1024, batch 8, on 8 H100s;
- ``llama7b``: Hugging Face ``LlamaForCausalLM`` of Llama-7B's shape (hidden 4096, 32 layers,
  32 heads, intermediate 11008, vocab 32000), seq 4096, global batch 16, on 8 H100s;
- ``llama70b``: Llama-70B's shape (hidden 8192, 80 layers, 64 heads with 8 key-value heads,
  intermediate 28672, vocab 32000), seq 4096, global batch 16, on 64 H100s;
- ``gpt39b``: the 39B GPT of Alpa's suite (hidden 8192, 48 layers, 64 heads, seq 1024,
  batch 64, vocab 51200), on 64 H100s.

Each row gives the phases the plan records (``Plan.timings_s``: trace, strategies, solve for
intra-op planning; trace, stage search and exact stage ILPs for the pipeline search) and the
plan found.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
import gpt2  # noqa: E402

from autoplan.load import make_model_spec  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.meshes import mesh_label  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.reports.summary import hidden_text  # noqa: E402
from autoplan.solvers import format_bytes, format_seconds  # noqa: E402

TARGET_S = 10.0


def _llama(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, seq: int, batch: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=intermediate, vocab_size=32000,
                         max_position_embeddings=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
        ids = torch.randint(0, 32000, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def _cases() -> Iterator[tuple[str, str, int, Callable[[], tuple], Callable | None]]:
    yield ("gpt2", "GPT-2 124M (HF)", 8,
           lambda: gpt2.build(n_layer=12, n_embd=768, n_head=12, n_positions=1024, vocab_size=50257, batch=8,
                              seq=1024, device="meta"), gpt2.loss_fn)
    yield ("llama7b", "Llama-7B shape (HF)", 8, lambda: _llama(4096, 32, 32, 32, 11008, 4096, 16), None)
    yield ("llama70b", "Llama-70B shape (HF)", 64, lambda: _llama(8192, 80, 64, 8, 28672, 4096, 16), None)
    yield "gpt39b", "GPT 39B", 64, lambda: gpt.build(**gpt.GPT_39B, device="meta"), gpt.loss_fn


def plan_shape(plan: Plan) -> str:
    """A plan's stages, meshes and microbatches, in a few words."""
    if len(plan.stages) > 1:
        meshes = sorted({mesh_label(tuple(s.mesh)) for s in plan.stages})
        return f"{len(plan.stages)} stages x {'/'.join(meshes)}, {plan.microbatches} mb"
    accumulated = f", {plan.microbatches} mb accumulated" if plan.microbatches > 1 else ""
    return f"mesh {mesh_label(tuple(plan.mesh))}{accumulated}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c[0] for c in _cases()],
                        help="run only this case (repeatable; default: all)")
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--no-pipeline", action="store_true", help="intra-op planning only")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="default: the cluster's (bf16 on h100)")
    args = parser.parse_args()
    print(f"{'model':22s} {'devices':>7s} {'build':>7s} {'total':>8s}  phases{'':34s} plan")
    for key, name, devices, build, loss_fn in _cases():
        if args.case and key not in args.case:
            continue
        start = time.perf_counter()
        model, inputs = build()
        built = time.perf_counter() - start
        spec = make_model_spec(model, inputs, loss_fn, name=name)
        plan = plan_model(spec, PlanOptions(devices, args.cluster, pipeline=not args.no_pipeline,
                                            precision=args.precision))
        phases = "  ".join(f"{k} {v:.2f}s" for k, v in plan.timings_s.items() if k != "total")
        total = plan.timings_s["total"]
        verdict = "" if total <= TARGET_S else f"  (target {TARGET_S:.0f} s missed)"
        print(f"{name:22s} {devices:7d} {built:6.2f}s {total:7.2f}s  {phases:40s} {plan_shape(plan)}: "
              f"{format_seconds(plan.predicted.step_time_s)}{hidden_text(plan.predicted)} / "
              f"{format_bytes(plan.predicted.memory_bytes.peak)}, {plan.precision.name}{verdict}", flush=True)


if __name__ == "__main__":
    main()
