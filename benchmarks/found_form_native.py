"""Step time of the plan form the search finds for Hugging Face decoders on a node of H100s, run
natively against the DTensor interpreter.

    .venv/bin/python benchmarks/found_form_native.py            # launches 2 gloo processes itself
    .venv/bin/python benchmarks/found_form_native.py --nodes    # the form across nodes: 4 processes

A Hugging Face Llama (random weights) planned on 2 H100s under pins that give it the form of the
search's real-size plans (Llama-7B's shape on 8 H100s finds it unpinned): the blocks' weights
FSDP, the head and the last norm ZeRO-2, the blocks' norms whole, and the embedding table read
in place (sharded on the hidden dim, the ids whole, its output all-to-all'd onto the batch
shards). autoplan's program with ``prefer_native=False`` (the DTensor interpreter) and natively
(FSDP2 groups, ZeRO-2 modules held through the backward, ``replicate`` on the norms,
``ColwiseParallel`` on the embedding: :mod:`autoplan.codegen.native_storage`). One step = forward,
backward and an SGD step; the variants take turns step by step; a step's time is the slower
rank's (``step_time_vs_native.py``'s timing). On a 2-core machine the figures compare host
overheads, they do not measure a GPU.

With ``--nodes``, the form the search finds on 2 nodes (Llama-7B's shape on 2 nodes of 8 H100s),
pinned on 2 nodes of 2 devices: the blocks HSDP, the head and the last norm ZeRO-2 under HSDP,
the table gathered between the nodes and read in place within one, the ids split between the
nodes only.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from accumulation_native import _planned_step  # noqa: E402
from step_time_vs_native import (  # noqa: E402
    _report, _time_variants, finish, launch_under_torchrun, llama_arguments)

PINS = ("input_ids=[R]", "labels=[S(0)]", "model.embed_tokens.weight=[S(1)]", "embedding=[S(2)]", "to_6=[S(0)]",
        "model.layers.*.*_proj.weight=fsdp", "linear*=[S(0)]", "cross_entropy_loss=[P]", "lm_head.weight=zero2",
        "model.norm.weight=zero2")
NODES_PINS = ("input_ids=[S(0), R]", "labels=[S(0), S(0)]", "model.embed_tokens.weight=[S(0), S(1)]",
              "embedding=[S(0), S(2)]", "to_6=[S(0), S(0)]", "model.layers.*.*_proj.weight=[R, S(0)]",
              "linear*=[S(0), S(0)]", "cross_entropy_loss=[P, P]", "lm_head.weight=zero2", "model.norm.weight=zero2")


def _args() -> argparse.Namespace:
    p = llama_arguments(__doc__.splitlines()[0], hidden=256, batch=4, vocab=4096)
    p.add_argument("--nodes", action="store_true", help="the form across 2 nodes of 2 devices, 4 processes")
    return p.parse_args()


def main() -> int:
    args = _args()
    if "RANK" not in os.environ:
        return launch_under_torchrun(__file__, 4 if args.nodes else 2)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # gloo's all-to-all fallback; the loss read out of place
    import llama

    from autoplan.codegen.native import NativeProgram
    from autoplan.codegen.runtime import build_parallel_module, init_distributed
    from autoplan.load import make_model_spec
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.options import PlanOptions
    from autoplan.trace.tracer import trace

    ctx = init_distributed()
    model, inputs = llama.build(hidden=args.hidden, layers=args.layers, intermediate=2 * args.hidden,
                                vocab=args.vocab, batch=args.batch, seq=args.seq)
    spec = make_model_spec(model, inputs)
    graph = trace(spec)
    where = dict(devices_per_node=2, mesh=(2, 2), pins=NODES_PINS) if args.nodes else dict(mesh=(2,), pins=PINS)
    plan = plan_model(spec, PlanOptions(ctx.world_size, "h100", pipeline=False, plan_only=True, **where))
    args_in = [inputs[name] for name in graph.input_names]
    interp = build_parallel_module(spec, plan, graph=graph, prefer_native=False)
    native = build_parallel_module(spec, plan, graph=graph)
    if not isinstance(native.program, NativeProgram):
        raise SystemExit(f"not taken natively ({native.description})")
    variants = {"autoplan interpreter": _planned_step(interp, args_in),
                f"autoplan native ({native.program.kind})": _planned_step(native, args_in)}
    results = _time_variants(variants, args.warmup, args.steps)
    if ctx.rank == 0:
        print(f"step time (forward + backward + SGD step), Llama hidden {args.hidden}, {args.layers} layers, "
              f"batch {args.batch} x {args.seq} tokens, vocab {args.vocab}, {ctx.world_size} gloo processes, "
              f"1 thread each, torch {torch.__version__}; median of {args.steps} steps after {args.warmup} warm-up")
        print(f"  {native.description}")
        print("\n".join(_report(results, f"autoplan native ({native.program.kind})")))
    return finish(ctx.rank)


if __name__ == "__main__":
    sys.exit(main())
