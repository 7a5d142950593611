"""Step time of autoplan's emitted programs against PyTorch's own parallel APIs written by hand.

    .venv/bin/python benchmarks/step_time_vs_native.py            # launches 2 gloo processes itself
    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/step_time_vs_native.py [--steps 30 ...]

One training step = forward + backward + SGD step (+ zero_grad). Each variant is warmed up, then
the variants take turns step by step (so drift on a busy machine hits them alike); the
figures are the median wall time and the median CPU time of a step (each step's time is the slower
rank's, after a barrier); CPU time stays comparable when other jobs share the machine.

(i) Megatron MLP (``examples/mlp.py``, planned by autoplan for a mesh of 2): autoplan through the
    DTensor interpreter (``prefer_native=False``) and through the native path, against
    ``parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})``.
(ii) Data-parallel MLP (a shape for which autoplan plans pure data parallelism): autoplan
    through the interpreter and natively, against ``DistributedDataParallel`` by hand (each rank
    fed its own half of the batch, as a DistributedSampler would).

Targets (the issue): emitted Megatron / hand-written ≤ 1.05; emitted DP / DDP ≤ 1.10.
``--profile`` adds a per-op profile of one interpreter step (where its time goes).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

import torch
import torch.distributed as dist


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp-hidden", type=int, default=512)
    p.add_argument("--tp-batch", type=int, default=4)
    p.add_argument("--tp-seq", type=int, default=128)
    p.add_argument("--dp-hidden", type=int, default=256)
    p.add_argument("--dp-batch", type=int, default=32)
    p.add_argument("--dp-seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=60, help="timed steps per variant")
    p.add_argument("--profile", action="store_true", help="profile one interpreter step per case")
    p.add_argument("--nproc", type=int, default=2)
    return p.parse_args()


def llama_arguments(description: str, hidden: int, batch: int, vocab: int) -> argparse.ArgumentParser:
    """The model and timing options of the benchmarks that time a small Llama."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=vocab)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant")
    return p


def small_llama(args: argparse.Namespace) -> tuple[torch.nn.Module, dict[str, torch.Tensor], Any]:
    """The small Hugging Face Llama of ``llama_arguments``' options (4 heads, 2 key-value heads,
    no key-value cache), its keyword inputs and its ModelSpec."""
    import llama

    from autoplan.load import make_model_spec

    model, inputs = llama.build(hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                                intermediate=2 * args.hidden, vocab=args.vocab, batch=args.batch, seq=args.seq)
    model.config.use_cache = False
    return model, inputs, make_model_spec(model, inputs)


def finish(rank: int) -> int:
    """The machine's load printed on rank 0, then the process group left together; exit status 0."""
    if rank == 0:
        print(load_line())
    dist.barrier()
    dist.destroy_process_group()
    return 0


def load_line() -> str:
    """The machine's load when a benchmark ends, in one line."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"machine load average (1 min) at the end: {load:.2f} on {os.cpu_count()} cores"


def _launch(args: argparse.Namespace) -> int:
    return launch_under_torchrun(__file__, args.nproc)


def launch_under_torchrun(script: str, nproc: int) -> int:
    """Run ``script`` with this command line's arguments in ``nproc`` gloo processes under
    torchrun, one thread each; its exit status."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           script, *sys.argv[1:]]
    return subprocess.call(cmd, env=env)


Step = Callable[[], None]


def _time_variants(variants: dict[str, Step], warmup: int, steps: int) -> dict[str, tuple[float, float]]:
    """(median wall time, median CPU time) of a step of each variant, in seconds; a step's time
    is the slower rank's. The variants take turns step by step, in a rotating order, so that load
    from elsewhere on the machine falls on all of them alike. CPU time (``time.process_time``,
    all threads of the process: compute, dispatch, gloo's threads) does not count time spent
    descheduled, so it stays comparable when the machine is shared."""
    for step in variants.values():
        for _ in range(warmup):
            step()
    names = list(variants)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(steps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            variants[name]()
            dt = torch.tensor([time.perf_counter() - t0, time.process_time() - c0])
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            wall[name].append(float(dt[0]))
            cpu[name].append(float(dt[1]))
    return {name: (statistics.median(wall[name]), statistics.median(cpu[name])) for name in names}


def _report(results: dict[str, tuple[float, float]], base: str) -> list[str]:
    bw, bc = results[base]
    return [f"    {name:42s} wall {w * 1e3:8.2f} ms  ratio {w / bw:5.3f}   cpu {c * 1e3:8.2f} ms  ratio {c / bc:5.3f}"
            for name, (w, c) in results.items()]


def _autoplan_step(pm, inputs, lr: float = 1e-3) -> Step:
    opt = torch.optim.SGD(pm.parameters(), lr=lr)

    def step() -> None:
        pm(*inputs).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _plain_step(model: torch.nn.Module, forward: Callable[[], torch.Tensor], lr: float = 1e-3) -> Step:
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step() -> None:
        forward().backward()
        opt.step()
        opt.zero_grad()

    return step


def _interpreted_and_native(spec, plan, graph, mesh, kind: str):
    """The plan's program on the DTensor interpreter and natively; the native one must be ``kind``."""
    from autoplan.codegen.native import NativeProgram
    from autoplan.codegen.runtime import build_parallel_module

    interp = build_parallel_module(spec, plan, graph=graph, mesh=mesh, prefer_native=False)
    native = build_parallel_module(spec, plan, graph=graph, mesh=mesh)
    assert isinstance(native.program, NativeProgram) and native.program.kind == kind, f"not recognised as {kind}"
    return interp, native


def _plan(module, kwargs: dict, world: int):
    from autoplan.planner.api import make_options, plan_spec
    from autoplan.load import make_model_spec

    model, inputs = module.build(**kwargs)
    spec = make_model_spec(model, inputs, module.loss_fn)
    plan, graph = plan_spec(spec, make_options(world, "h100", (world,)))
    return spec, plan, graph


def _profile(pm, inputs, label: str) -> str:
    from torch.profiler import ProfilerActivity, profile

    step = _autoplan_step(pm, inputs)
    step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return f"--- profile of one interpreter step ({label}), rank 0 ---\n" + \
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)


def main() -> int:
    args = _args()
    if "RANK" not in os.environ:
        return _launch(args)
    torch.set_num_threads(1)
    import mlp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel

    from autoplan.codegen.runtime import init_distributed

    ctx = init_distributed()
    world, rank = ctx.world_size, ctx.rank
    mesh = init_device_mesh("cpu", (world,))
    lines: list[str] = []
    profiles: list[str] = []

    # (i) Megatron MLP ---------------------------------------------------------------------------
    tp_kw = {"hidden": args.tp_hidden, "batch": args.tp_batch, "seq": args.tp_seq}
    spec, plan, graph = _plan(mlp, tp_kw, world)
    interp, native = _interpreted_and_native(spec, plan, graph, mesh, "tensor_parallel")
    layout = native.program.styles["down"][1]
    (x,) = spec.example_inputs
    hand = parallelize_module(copy.deepcopy(spec.module), mesh,
                              {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
    hand2 = parallelize_module(copy.deepcopy(spec.module), mesh,
                               {"up": ColwiseParallel(), "down": RowwiseParallel()}, src_data_rank=None)
    variants = {
        "autoplan interpreter": _autoplan_step(interp, spec.example_inputs),
        "autoplan native": _autoplan_step(native, spec.example_inputs),
        "parallelize_module (hand)": _plain_step(hand, lambda: mlp.loss_fn(hand(x), x)),
        "control: parallelize_module (hand, 2nd)": _plain_step(hand2, lambda: mlp.loss_fn(hand2(x), x)),
    }
    if not layout.is_replicate():
        hand_same = parallelize_module(copy.deepcopy(spec.module), mesh,
                                       {"up": ColwiseParallel(), "down": RowwiseParallel(output_layouts=layout)},
                                       src_data_rank=None)
        # as a user writes it: the loss of the local shard (a mean over equal shards, scaled so
        # that the gradients are the global loss's), its value all-reduced for logging
        x_part = x.chunk(world, layout.dim)[rank]

        def sharded_loss() -> torch.Tensor:
            loss = mlp.loss_fn(hand_same(x), x_part) / world
            value = loss.detach().clone()
            dist.all_reduce(value)
            return loss

        variants[f"parallelize_module (hand, output {layout})"] = _plain_step(hand_same, sharded_loss)
    tp = _time_variants(variants, args.warmup, args.steps)
    if args.profile:
        profiles.append(_profile(interp, spec.example_inputs, f"Megatron MLP {tp_kw}"))
    lines.append(f"(i) Megatron MLP {tp_kw}: params {plan.params}, row output {layout}, tokens "
                 f"{args.tp_batch * args.tp_seq}")
    lines += _report(tp, "parallelize_module (hand)")

    # (ii) data parallel ---------------------------------------------------------------------------
    dp_kw = {"hidden": args.dp_hidden, "batch": args.dp_batch, "seq": args.dp_seq}
    spec, plan, graph = _plan(mlp, dp_kw, world)
    interp, native = _interpreted_and_native(spec, plan, graph, mesh, "ddp")
    (x,) = spec.example_inputs
    x_local = x.chunk(world, 0)[rank].contiguous()
    ddp = DistributedDataParallel(copy.deepcopy(spec.module))
    ddp2 = DistributedDataParallel(copy.deepcopy(spec.module))
    variants = {
        "autoplan interpreter": _autoplan_step(interp, spec.example_inputs),
        "autoplan native": _autoplan_step(native, spec.example_inputs),
        "DDP (hand)": _plain_step(ddp, lambda: mlp.loss_fn(ddp(x_local), x_local)),
        "control: DDP (hand, 2nd)": _plain_step(ddp2, lambda: mlp.loss_fn(ddp2(x_local), x_local)),
    }
    dp = _time_variants(variants, args.warmup, args.steps)
    if args.profile:
        profiles.append(_profile(interp, spec.example_inputs, f"data-parallel MLP {dp_kw}"))
    lines.append(f"(ii) data-parallel MLP {dp_kw}: inputs {plan.inputs}, every parameter R")
    lines += _report(dp, "DDP (hand)")

    if rank == 0:
        print(f"step time (forward + backward + SGD), {world} gloo processes, 1 thread each, torch "
              f"{torch.__version__}; median of {args.steps} steps after {args.warmup} warm-up, the "
              f"variants interleaved step by step; 'control' is a second instance of the hand-written "
              f"baseline (its ratio is the noise floor)")
        print("\n".join(lines))
        for clock, k in (("wall", 0), ("cpu", 1)):
            tp_n = tp["autoplan native"][k] / tp["parallelize_module (hand)"][k]
            tp_i = tp["autoplan interpreter"][k] / tp["parallelize_module (hand)"][k]
            dp_n = dp["autoplan native"][k] / dp["DDP (hand)"][k]
            dp_i = dp["autoplan interpreter"][k] / dp["DDP (hand)"][k]
            print(f"targets ({clock}): Megatron <= 1.05: native {tp_n:.3f} {'ok' if tp_n <= 1.05 else 'MISSED'}, "
                  f"interpreter {tp_i:.3f} {'ok' if tp_i <= 1.05 else 'MISSED'}; "
                  f"DP <= 1.10: native {dp_n:.3f} {'ok' if dp_n <= 1.10 else 'MISSED'}, "
                  f"interpreter {dp_i:.3f} {'ok' if dp_i <= 1.10 else 'MISSED'}")
        print(load_line())
        for text in profiles:
            print(text)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
