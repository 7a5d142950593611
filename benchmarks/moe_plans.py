"""Mixture-of-experts models at real size, built on the meta device (no weights): the plan found
with the experts traced as one op, whose expert dim the planner may shard (expert parallelism:
:mod:`autoplan.trace.experts`), beside the plan found with them traced op by op, as before that
op existed (the expert dim of their grouped products stays whole there).

    .venv/bin/python benchmarks/moe_plans.py [--case NAME ...] [--no-pipeline]

Cases: Mixtral-8x7B's shape (hidden 4096, 32 layers, 32 heads with 8 key-value heads, 8 experts
of intermediate 14336, 2 per token, vocab 32000), seq 4096, global batch 16, on 16 and 32 H100s
(its 46.7B parameters' training state, 16 bytes each, is 747 GB: more than 8 H100s hold).

Each row gives the planning time, the plan (pipeline stages and meshes, microbatches), its
predicted step time, peak memory and MFU, and how the experts run: over which mesh axes their
experts are sharded (``EP``) and their tokens split (``tokens``).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Iterator

import torch

from autoplan.load import make_model_spec
from autoplan.plan_schema import Plan
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.solvers import format_bytes, format_seconds
from planning_time import plan_shape  # this folder: the script's own


def _mixtral(layers: int = 32, seq: int = 4096, batch: int = 16) -> tuple[torch.nn.Module, dict]:
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(hidden_size=4096, num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                           intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2, vocab_size=32000,
                           max_position_embeddings=seq)
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
        ids = torch.randint(0, 32000, (batch, seq))
    return model, {"input_ids": ids, "labels": ids}


def _cases() -> Iterator[tuple[str, str, int, Callable[[], tuple]]]:
    yield "mixtral8x7b-16", "Mixtral-8x7B shape", 16, _mixtral
    yield "mixtral8x7b-32", "Mixtral-8x7B shape", 32, _mixtral


def op_by_op(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with its experts traced op by op: an experts module whose gate and up
    projections are not concatenated is not traced as one op."""
    for m in model.modules():
        if hasattr(m, "_is_expert_parallel"):
            m.is_concatenated = False
    return model


def experts_layout(plan: Plan) -> str:
    """How the plan runs its experts: the mesh axes (with their sizes) sharding the experts and
    those splitting the tokens, from the first experts op of each stage's mesh."""
    nodes = [n for n in plan.nodes if n.op.startswith("autoplan.moe_experts")]
    if not nodes:
        return "op by op"
    stage_mesh = {name: stage.mesh for stage in plan.stages for name in stage.nodes}
    found = []
    for node in nodes:
        mesh = stage_mesh.get(node.name, plan.mesh)
        (out,) = node.outputs
        ep = [f"{size}" for p, size in zip(out, mesh) if p == "P"]
        tokens = [f"{size}" for p, size in zip(out, mesh) if p.startswith("S")]
        text = f"EP {'x'.join(ep) or 1}, tokens {'x'.join(tokens) or 1}"
        if text not in found:
            found.append(text)
    return "; ".join(found)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c[0] for c in _cases()],
                        help="run only this case (repeatable; default: all)")
    parser.add_argument("--no-pipeline", action="store_true", help="intra-op planning only")
    args = parser.parse_args()
    print(f"{'model':20s} {'devices':>7s} {'experts':>10s} {'planning':>9s}  plan")
    for key, name, devices, build in _cases():
        if args.case and key not in args.case:
            continue
        for label, prepare in (("one op", lambda m: m), ("op by op", op_by_op)):
            model, inputs = build()
            spec = make_model_spec(prepare(model), inputs, None, name=name)
            start = time.perf_counter()
            plan = plan_model(spec, PlanOptions(devices, "h100", pipeline=not args.no_pipeline))
            seconds = time.perf_counter() - start
            predicted = plan.predicted
            print(f"{name:20s} {devices:7d} {label:>10s} {seconds:8.2f}s  {plan_shape(plan)}: "
                  f"{format_seconds(predicted.step_time_s)} / {format_bytes(predicted.memory_bytes.peak)}, "
                  f"MFU {predicted.mfu:.1%}; experts: {experts_layout(plan)}", flush=True)


if __name__ == "__main__":
    main()
