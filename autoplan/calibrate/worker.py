"""The measurements of one worker process (one "device"): matmuls, memory bandwidth, the per-op
overhead and op bandwidth of a transformer block, and the collectives."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from autoplan.calibrate.fit import Sample, costed_ops, fit_op_bandwidth
from autoplan.calibrate.results import MEASURED_COLLECTIVES, CalibrateSettings, format_si, format_size
from autoplan.cost_models import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BACKWARD_FACTOR, REDUCE_SCATTER,
    bytes_moved_per_device)

# ---------------------------------------------------------------------------------------------
# Measuring (runs in each worker process; rank 0 reports)


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(f"calibrate: {text}", file=sys.stderr, flush=True)




class Worker:
    """The measurements of one rank of an ``n``-process job (a process group exists, even for
    n = 1)."""

    def __init__(self, rank: int, n: int, settings: CalibrateSettings, device: Any) -> None:
        import torch

        self.torch = torch
        self.rank, self.n, self.settings, self.device = rank, n, settings, device
        self.cuda = device.type == "cuda"
        self.slowest = ", slowest rank" if n > 1 else ""

    # -- helpers ---------------------------------------------------------------------------
    def sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        import torch.distributed as dist

        self.sync()
        dist.barrier()

    def agree(self, value: float, op: str) -> float:
        """``value`` reduced over the ranks with ``op`` ("min" or "max")."""
        import torch.distributed as dist

        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
        return float(t.item())

    def time_calls(self, fn: Callable[[], Any], iters: int) -> list[float]:
        """Seconds of each of ``iters`` back-to-back calls of ``fn``."""
        if self.cuda:
            events = [self.torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
            events[0].record()
            for i in range(iters):
                fn()
                events[i + 1].record()
            events[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
        stamps = [time.perf_counter()]
        for _ in range(iters):
            fn()
            stamps.append(time.perf_counter())
        return [b - a for a, b in zip(stamps, stamps[1:])]

    def window_calls(self, fn: Callable[[], Any]) -> int:
        """Calls of ``fn`` that fill a CPU timing window of ``cpu_window_s``, the same number on
        every rank (``fn`` may be a collective)."""
        s = self.settings
        one = min(self.time_calls(fn, 2))
        calls = math.ceil(s.cpu_window_s / max(one, 1e-9))
        return int(self.agree(float(min(max(calls, 1), s.max_window_calls)), "max"))

    def median_time(self, fn: Callable[[], Any], repeats: int, warmup: int, iters: int = 1) -> float:
        """Median seconds per call (each rank's own) after ``warmup`` untimed calls; the ranks
        start each repeat together. CUDA: ``repeats`` x ``iters`` calls each timed alone. CPU:
        ``repeats`` windows of at least ``cpu_window_s`` (and ``iters`` calls), each giving its
        mean per call, so that the CPU time lost to processes sharing the cores counts."""
        for _ in range(warmup):
            fn()
        self.sync()
        if not self.cuda:
            iters = max(iters, self.window_calls(fn))
        times: list[float] = []
        for _ in range(repeats):
            self.barrier()
            calls = self.time_calls(fn, iters)
            times += calls if self.cuda else [sum(calls) / len(calls)]
        return statistics.median(times)

    # -- compute ---------------------------------------------------------------------------
    def dtypes(self) -> list[Any]:
        torch = self.torch
        out = [torch.float32]
        if self.cuda:
            if torch.cuda.is_bf16_supported():
                out.append(torch.bfloat16)
            out.append(torch.float16)
        else:
            out += [torch.bfloat16, torch.float16]
        return out

    def matmul(self) -> list[dict[str, Any]]:
        torch, s = self.torch, self.settings
        square = s.gpu_square if self.cuda else s.cpu_square
        skinny = s.gpu_skinny if self.cuda else s.cpu_skinny
        rows = []
        for dtype in self.dtypes():
            name = str(dtype).removeprefix("torch.")
            # A small probe estimates the rate, so that a slow dtype gets a smaller shape.
            probe = 256
            a = torch.randn(probe, probe, device=self.device).to(dtype)
            probe_s = self.agree(self.median_time(lambda: torch.mm(a, a), 3, 2), "max")
            rate = 2 * probe**3 / probe_s
            for label, (m, k, nn) in (("square", (square, square, square)), ("skinny", skinny)):
                scale = min(1.0, (s.matmul_max_s * rate / (2 * m * k * nn)) ** (1 / 3))
                if self.cuda:
                    scale = 1.0  # GPUs are fast for every dtype: keep the shapes that fill them
                m, k, nn = (max(64, int(x * scale) // 64 * 64) for x in (m, k, nn))
                flops = self.matmul_rate(dtype, (m, k, nn))
                rows.append({"dtype": name, "shape": [m, k, nn], "kind": label, "flops": flops,
                             "repeats": s.repeats})
                _log(self.rank, f"matmul {name:8s} {label:6s} {m}x{k}x{nn}: {format_si(flops, 'FLOP/s')} "
                                f"(median of {s.repeats}{self.slowest})")
        return rows

    def matmul_rate(self, dtype: Any, shape: tuple[int, int, int]) -> float:
        """FLOP/s of an (m x k) @ (k x n) matmul of ``dtype``, the slowest rank's median."""
        torch, s = self.torch, self.settings
        m, k, n = shape
        a = torch.randn(m, k, device=self.device).to(dtype)
        b = torch.randn(k, n, device=self.device).to(dtype)
        out = torch.empty(m, n, device=self.device, dtype=dtype)
        sec = self.median_time(lambda: torch.mm(a, b, out=out), s.repeats, s.warmup)
        return self.agree(2 * m * k * n / sec, "min")

    def memory(self) -> list[dict[str, Any]]:
        torch, s = self.torch, self.settings
        nbytes = s.gpu_copy_bytes if self.cuda else s.cpu_copy_bytes
        numel = nbytes // 4
        x = torch.ones(numel, device=self.device)
        y = torch.ones(numel, device=self.device)
        z = torch.empty(numel, device=self.device)
        rows = []
        for op, moved, fn in (("copy", 2 * nbytes, lambda: z.copy_(x)),
                              ("add", 3 * nbytes, lambda: torch.add(x, y, out=z))):
            sec = self.median_time(fn, s.repeats, s.warmup)
            bw = self.agree(moved / sec, "min")
            rows.append({"op": op, "bytes": nbytes, "bytes_per_s": bw})
            _log(self.rank, f"memory {op} {format_size(nbytes)} ({format_size(moved)} moved): {format_si(bw, 'B/s')} "
                            f"(median of {s.repeats}{self.slowest})")
        return rows

    def block_steps(self, shape: tuple[int, int, int], mesh: Any) -> tuple[Any, Callable[[], Any], Callable[[], Any]]:
        """The traced graph of :func:`_block` at ``shape`` and two training steps of it
        (forward + backward): as the DTensor program autoplan emits on ``mesh`` (one device:
        no collective), and eagerly."""
        from autoplan.codegen.dtensor_program import build_program
        from autoplan.load import make_model_spec
        from autoplan.planner.api import make_options, plan_traced
        from autoplan.trace.tracer import trace

        model, inputs, loss_fn = _block(self.device, *shape)
        graph = trace(make_model_spec(model, inputs, loss_fn))
        plan = plan_traced(graph, make_options(1, "cpu", mesh=(1,)))
        program = build_program(graph, plan, mesh, {**dict(model.named_parameters()), **dict(model.named_buffers())})

        def program_step() -> None:  # as train.py: fresh gradients every step
            program.zero_grad(set_to_none=True)
            program(*inputs)[0].backward()

        def eager_step() -> None:
            model.zero_grad(set_to_none=True)
            loss_fn(model(*inputs), *inputs).backward()

        return graph, program_step, eager_step

    def ops(self, peaks: dict[str, float]) -> dict[str, Any]:
        """The per-op overhead (DTensor program and eager; seconds per op pass) of the tiny
        block, and the op bandwidth fitted to the activation-sized block's step
        (:func:`fit_op_bandwidth`, with the matmul ``peaks`` measured before)."""
        from torch.distributed.device_mesh import init_device_mesh

        s = self.settings
        own = init_device_mesh(self.device.type, (self.n, 1), mesh_dim_names=("ranks", "own"))["own"]
        graph, program_step, eager_step = self.block_steps(s.tiny_block, own)
        passes = (1.0 + BACKWARD_FACTOR) * len(costed_ops(graph))
        overhead = self.agree(self.median_time(program_step, s.repeats, s.warmup), "max") / passes
        eager = self.agree(self.median_time(eager_step, s.repeats, s.warmup), "max") / passes
        _log(self.rank, f"op overhead (a tiny transformer block, {passes:.0f} op passes): {overhead * 1e6:.1f} us "
                        f"per op pass as a DTensor program, {eager * 1e6:.1f} us eagerly (median{self.slowest})")
        shape = s.gpu_block if self.cuda else s.cpu_block
        graph, program_step, _ = self.block_steps(shape, own)
        seconds = self.agree(self.median_time(program_step, s.repeats, s.warmup), "max")
        bandwidth = fit_op_bandwidth(costed_ops(graph), seconds, peaks, overhead, overlapped_dispatch=self.cuda)
        _log(self.rank, f"op bandwidth (a transformer block, batch {shape[0]}, sequence {shape[1]}, hidden "
                        f"{shape[2]}: {seconds * 1e3:.2f} ms a step{self.slowest}): "
                        + (format_si(bandwidth, "B/s") if bandwidth else "not fitted (matmuls and overhead explain it)"))
        return {"op_overhead": overhead, "eager_op_overhead": eager,
                "block": {"shape": list(shape), "seconds": seconds, "op_bandwidth": bandwidth}}

    # -- collectives -----------------------------------------------------------------------
    def collective(self, mesh: Any, kind: str, numel: int) -> Callable[[], Any]:
        """A closure running ``kind`` as a DTensor redistribute on a float32 per-device buffer
        of ``numel`` elements (the convention of the cost model: all_gather's output,
        reduce_scatter's input); ``numel`` is a multiple of n²."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        n = self.n
        local = self.torch.ones(numel // n if kind == ALL_GATHER else numel, device=self.device)
        source, target = {
            ALL_REDUCE: ([Partial()], [Replicate()]),
            ALL_GATHER: ([Shard(0)], [Replicate()]),
            REDUCE_SCATTER: ([Partial()], [Shard(0)]),
            ALL_TO_ALL: ([Shard(0)], [Shard(1)]),
        }[kind]
        if kind == ALL_TO_ALL:
            local = local.view(n, numel // n)
        tensor = DTensor.from_local(local, mesh, source, run_check=False)
        return lambda: tensor.redistribute(mesh, target)

    def filler(self) -> Callable[[], Any] | None:
        """CPUs: the compute that precedes each timed collective, small matmuls lasting about
        ``cpu_filler_s`` (the same count on every rank); None on CUDA."""
        if self.cuda:
            return None
        s = self.settings
        a = self.torch.randn(s.cpu_filler, s.cpu_filler)
        out = self.torch.empty(s.cpu_filler, s.cpu_filler)

        def one() -> None:
            self.torch.mm(a, a, out=out)

        count = int(self.agree(float(max(1, round(s.cpu_filler_s / self.median_time(one, s.repeats, s.warmup)))), "max"))

        def fill() -> None:
            for _ in range(count):
                one()

        return fill

    def collectives(self) -> tuple[list[Sample], dict[str, str]]:
        from torch.distributed.device_mesh import init_device_mesh

        s = self.settings
        mesh = init_device_mesh(self.device.type, (self.n,))
        sizes = s.gpu_sizes if self.cuda else s.sizes
        filler = self.filler()
        filler_s = self.median_time(filler, s.repeats, s.warmup) if filler is not None else 0.0
        samples: list[Sample] = []
        skipped: dict[str, str] = {}
        for kind in MEASURED_COLLECTIVES:
            for nbytes in sizes:
                step = self.n * self.n
                numel = max(step, nbytes // 4 // step * step)
                real_bytes = numel * 4
                why = "failed on another rank"
                try:
                    fn = self.collective(mesh, kind, numel)
                    fn()
                    self.sync()
                    ok = 1.0
                except Exception as exc:  # the backend lacks it: every rank fails alike
                    ok, why = 0.0, " ".join(str(exc).split())[:120] or type(exc).__name__
                if self.agree(ok, "min") == 0.0:
                    skipped[kind] = f"{self.settings.backend} could not run it: {why}"
                    _log(self.rank, f"{kind}: skipped ({skipped[kind]})")
                    break
                iters = max(1, min(s.max_iters, s.collective_bytes_per_repeat // real_bytes))
                timed = fn if filler is None else _after(filler, fn)
                sec = self.median_time(timed, s.repeats, s.warmup, iters) - filler_s
                sec = self.agree(max(sec, 1e-7), "max")
                samples.append(Sample(kind, self.n, float(real_bytes), sec))
                moved = bytes_moved_per_device(kind, real_bytes, self.n)
                _log(self.rank, f"{kind:14s} {format_size(real_bytes):>9s}: {sec * 1e6:10.1f} us  "
                                f"({format_si(moved / sec, 'B/s')} moved per device; median of {s.repeats})")
                del fn, timed
        return samples, skipped


def _after(first: Callable[[], Any], then: Callable[[], Any]) -> Callable[[], Any]:
    """A closure calling ``first`` then ``then``."""

    def both() -> Any:
        first()
        return then()

    return both


def device_for(rank: int, backend: str) -> Any:
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def cpu_threads(n: int, default: int) -> int:
    """Intra-op threads of one of ``n`` processes, as torchrun gives them to train.py:
    ``OMP_NUM_THREADS`` when set, else 1 when n > 1 (torchrun's default, which keeps n
    processes from oversubscribing the cores) and torch's ``default`` for one process."""
    text = os.environ.get("OMP_NUM_THREADS", "").strip()
    if text.isdigit() and int(text) > 0:
        return int(text)
    return 1 if n > 1 else default


def _block(device: Any, batch: int, seq: int, hidden: int) -> tuple[Any, tuple[Any, ...], Callable[..., Any]]:
    """A pre-LayerNorm transformer block (causal attention and a GELU MLP, residuals), its
    input ``(batch, seq, hidden)`` and a mean-square loss: the op mix of the models autoplan
    plans (torch is imported here: only the measuring processes need it)."""
    import torch

    F = torch.nn.functional
    heads = max(2, hidden // 64)

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, 3 * hidden)
            self.proj = torch.nn.Linear(hidden, hidden)
            self.ln_2 = torch.nn.LayerNorm(hidden)
            self.fc = torch.nn.Linear(hidden, 4 * hidden)
            self.out = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, c = x.shape
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in self.qkv(self.ln_1(x)).split(c, 2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
            x = x + self.proj(y)
            return x + self.out(F.gelu(self.fc(self.ln_2(x))))

    torch.manual_seed(0)
    model = Block().to(device)
    x = torch.randn(batch, seq, hidden, device=device)
    return model, (x,), lambda out, inp: ((out - inp) ** 2).mean()
