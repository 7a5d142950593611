"""Step time of an FSDP x TP plan run natively against the DTensor interpreter and against the same
composition written by hand, as torchtitan writes it.

    .venv/bin/python benchmarks/fsdp_tp_native.py            # launches 4 gloo processes itself

A Hugging Face Llama (random weights) planned ``--manual fsdp=2,tp=2`` on a 2x2 mesh: autoplan's
program through the interpreter (``prefer_native=False``) and through the native path
(``parallelize_module`` on the tensor axis, ``fully_shard`` per block and on the root over the
data axis: :mod:`autoplan.codegen.native_fsdp_tp`), against that composition written by hand
(each rank fed its half of the batch). One step = forward + backward + SGD step; the variants
take turns step by step; each step's time is the slower rank's (``step_time_vs_native.py``'s
timing). On a 2-core machine the 4 processes share the cores: the figures compare host
overheads, they do not measure a GPU.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402

from step_time_vs_native import (  # noqa: E402
    _autoplan_step, _plain_step, _report, _time_variants, finish, launch_under_torchrun, llama_arguments,
    small_llama)


def _args() -> argparse.Namespace:
    p = llama_arguments(__doc__.splitlines()[0], hidden=128, batch=4, vocab=4096)
    return p.parse_args()


def _hand_written(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """torchtitan's composition of the same styles, by hand."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    styles = {"model.embed_tokens": ColwiseParallel(output_layouts=Replicate()),
              "lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            styles[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            styles[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(model, mesh["axis1"], styles, src_data_rank=None)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh["axis0"], reshard_after_forward=True)
    fully_shard(model, mesh=mesh["axis0"], reshard_after_forward=True)
    return model


def main() -> int:
    args = _args()
    if "RANK" not in os.environ:
        return launch_under_torchrun(__file__, 4)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the loss is read out of place
    from torch.distributed.device_mesh import init_device_mesh

    from autoplan.codegen.native import NativeProgram
    from autoplan.codegen.runtime import build_parallel_module, init_distributed
    from autoplan.planner.front_door import with_decisions
    from autoplan.planner.manual import parse_manual, plan_manual
    from autoplan.planner.options import PlanOptions
    from autoplan.trace.tracer import trace

    ctx = init_distributed()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("axis0", "axis1"))
    model, inputs, spec = small_llama(args)
    options = PlanOptions(4, "cpu", plan_only=True)
    plan = with_decisions(plan_manual(spec, options.planner_options(), parse_manual("fsdp=2,tp=2")), options)
    graph = trace(spec)
    interp = build_parallel_module(spec, plan, graph=graph, mesh=mesh, prefer_native=False)
    native = build_parallel_module(spec, plan, graph=graph, mesh=mesh)
    if not isinstance(native.program, NativeProgram) or native.program.kind != "fsdp_tp":
        from autoplan.codegen.native import recognise

        raise SystemExit(f"the plan is not taken natively as FSDP x TP ({recognise(spec, graph, plan).reason})")
    hand = _hand_written(copy.deepcopy(model), mesh)
    half = {k: v.chunk(2, 0)[mesh.get_coordinate()[0]] for k, v in inputs.items()}
    args_in = [inputs[name] for name in graph.input_names]
    variants = {
        "autoplan interpreter": _autoplan_step(interp, args_in),
        "autoplan native": _autoplan_step(native, args_in),
        "by hand (parallelize_module + fully_shard)": _plain_step(hand, lambda: hand(**half).loss),
    }
    results = _time_variants(variants, args.warmup, args.steps)
    if ctx.rank == 0:
        print(f"step time (forward + backward + SGD), Llama hidden {args.hidden}, {args.layers} layers, "
              f"batch {args.batch} x {args.seq} tokens, vocab {args.vocab}, fsdp=2,tp=2 on 4 gloo processes, "
              f"1 thread each, torch {torch.__version__}; median of {args.steps} steps after {args.warmup} warm-up")
        print("\n".join(_report(results, "by hand (parallelize_module + fully_shard)")))
    return finish(ctx.rank)


if __name__ == "__main__":
    sys.exit(main())
