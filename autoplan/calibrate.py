"""``autoplan calibrate --devices N -o FILE``: measure this machine, write a cluster TOML file.

Everything is measured by N worker processes at once (``torch.multiprocessing`` spawn, a
FileStore rendezvous, one process even for N = 1), so that each process ("device") sees the
share of the machine it has when ``torchrun --nproc-per-node N`` runs the emitted train.py:

- on CPUs each process uses the intra-op threads torchrun gives it: ``OMP_NUM_THREADS`` when
  set, else 1 thread when N > 1 (torchrun's default) and torch's default for N = 1;
- a CPU timing is the mean over a window of back-to-back calls lasting at least
  ``cpu_window_s`` (several scheduler time slices), so that when N processes share fewer cores
  the time each loses to the others is in it (timing single calls would leave it out: a short
  call rarely loses the CPU, a training step always does). CUDA calls are timed one by one with
  CUDA events after synchronising.

Each figure is the median of repeats after warm-up, the slowest rank's:

- matmul throughput per dtype (float32, bfloat16, float16; CPU bf16/fp16 may be slow, and is
  then measured on a smaller shape), square and skinny shapes; the dtype's peak is the best
  shape's median;
- memory bandwidth: a large ``copy_`` (2·B bytes moved) and ``add`` (3·B), the better of the two
  (streaming; the optimizer step's rate);
- per-op overhead: a training step (forward + backward) of a tiny transformer block (shapes so
  small that dispatch is all there is) run as the DTensor program autoplan emits, on a
  one-device mesh per process (no collective in it), divided by the op passes the cost model
  charges (every op node once forward and ``BACKWARD_FACTOR`` times backward); the same for the
  plain eager module is written as a comment;
- op bandwidth: a training step of the same block at activation sizes (``cpu_block``), run the
  same way; ``device.op_bandwidth`` is the rate of the ops' memory traffic at which the cost
  model (:func:`autoplan.cost_models.step_costs.op_cost`: matmuls at the float32 peak, the overhead
  above) predicts that measured time (:func:`fit_op_bandwidth`). Microbenchmarks of single ops
  miss what a step's backward adds to its traced forward ops (the ``cat`` behind a ``split``,
  copies of transposed gradients, bias-gradient sums, accumulation), the attention kernels'
  own traffic and the caches' state; the fit puts them where the cost model can charge them;
- with N > 1, the collectives all_reduce, all_gather, reduce_scatter and all_to_all as the
  emitted programs run them: a DTensor ``redistribute`` (Partial → Replicate, Shard → Replicate,
  Partial → Shard, Shard(0) → Shard(1)), gloo on CPUs and NCCL on GPUs, over message sizes from
  a few KiB (latency) to MiBs (bandwidth). On CPUs each collective follows ``cpu_filler_s`` of
  compute (small matmuls, whose own time is subtracted), as in a training step, where ranks
  drift apart between collectives and a waiting rank sleeps and must be woken; back-to-back
  collectives would hide that. The drift grows with the compute before the collective and
  levels off after a few scheduler time slices: with 4 processes on 2 cores, a small all-reduce
  cost 5.7 ms after 1 ms of compute, 7.6 ms after 4 ms, 8.2 after 18 and 9.3 after 72 (2
  processes: 1.2, 1.8, 3.6 and 3.0 ms). A collective the backend cannot run is skipped and
  named in the file.

The timings are fitted to the alpha-beta ring model of
:mod:`autoplan.cost_models.communication` (``t = latency_steps·α + bytes_moved_per_device/bw``)
by least squares on relative errors (:func:`fit_alpha_beta`): one fit per collective, written
as the ``intra_node`` link's rates for that kind (``[intra_node.all_reduce]``, ...: the kinds'
latencies differ by 2x on gloo), and one joint fit over all of them, the link's own rates (what
a kind without its own fit, such as send_recv, gets). One machine is one
node: ``devices_per_node = N``; ``inter_node`` is not measured and keeps the preset's link
(capped at the measured intra-node one), as a comment in the file says. N = 1 leaves the links
at the preset's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from autoplan.cost_models import (
    ALL_GATHER,
    ALL_REDUCE,
    ALL_TO_ALL,
    BACKWARD_FACTOR,
    COLLECTIVE_KINDS,
    REDUCE_SCATTER,
    ClusterSpec,
    DeviceSpec,
    LinkRates,
    LinkSpec,
    bytes_moved_per_device,
    latency_steps,
    roofline_time,
)
from autoplan.cost_models.cluster import cluster_from_toml
from autoplan.cost_models.presets import preset_table
from autoplan.errors import AutoplanError

#: A drift (:attr:`Calibration.drift`) above this is reported: the figures are not consistent.
DRIFT_WARNING = 0.2

#: The collectives measured, in the order they are measured.
MEASURED_COLLECTIVES: tuple[str, ...] = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)

KiB, MiB = 2**10, 2**20


# ---------------------------------------------------------------------------------------------
# The alpha-beta fit (pure arithmetic)


@dataclass(frozen=True)
class Sample:
    """One timed collective: ``kind`` on ``n`` devices with a per-device buffer of ``nbytes``
    (the convention of :mod:`autoplan.cost_models.communication`) took ``seconds``."""

    kind: str
    n: int
    nbytes: float
    seconds: float


@dataclass(frozen=True)
class LinkFit:
    """``alpha`` seconds per ring step and ``bandwidth`` bytes/s fitted to ``points`` samples;
    ``rms_rel_error`` is the root mean square of (model − measured)/measured."""

    kind: str
    alpha: float
    bandwidth: float
    points: int
    rms_rel_error: float

    def link(self) -> LinkSpec:
        return LinkSpec(bandwidth=self.bandwidth, latency=self.alpha)


def fit_alpha_beta(samples: Iterable[Sample], kind: str | None = None) -> LinkFit:
    """Least-squares fit of ``t = latency_steps(kind, n)·α + bytes_moved_per_device(...)·β``
    (β = 1/bandwidth) to ``samples``, which may mix collectives and device counts.

    Residuals are relative, (model − t)/t, so microsecond latencies weigh as much as the
    millisecond transfers of large messages. α is kept ≥ 0 (a negative intercept refits β
    alone). Raises ValueError when the samples cannot determine a positive bandwidth (fewer
    than two distinct message sizes, or times that do not grow with size).
    """
    rows = [(float(latency_steps(s.kind, s.n)), bytes_moved_per_device(s.kind, s.nbytes, s.n), float(s.seconds))
            for s in samples]
    if any(not (t > 0 and math.isfinite(t)) for _, _, t in rows):
        raise ValueError("every timing must be a positive number of seconds")
    rows = [r for r in rows if r[1] > 0]  # n == 1 moves nothing: nothing to learn from it
    if len({m for _, m, _ in rows}) < 2:
        raise ValueError("the fit needs at least two message sizes")
    # Columns scaled to about 1 so the 2x2 normal equations stay well conditioned.
    s_scale = max(s for s, _, _ in rows)
    m_scale = max(m for _, m, _ in rows)
    a = b = c = d = e = 0.0
    for s, m, t in rows:
        x, y, w = s / s_scale, m / m_scale, 1.0 / (t * t)
        a += w * x * x
        b += w * x * y
        c += w * y * y
        d += w * x * t
        e += w * y * t
    det = a * c - b * b
    alpha_s = (c * d - b * e) / det if det > 1e-12 * a * c else -1.0
    beta_s = (a * e - b * d) / det if det > 1e-12 * a * c else 0.0
    if alpha_s < 0:  # no room for a latency: bandwidth term alone
        alpha_s, beta_s = 0.0, e / c
    if not beta_s > 0:  # times do not grow with the size
        raise ValueError("the timings do not grow with message size: bandwidth cannot be fitted")
    alpha, beta = alpha_s / s_scale, beta_s / m_scale
    rel = [((s * alpha + m * beta) - t) / t for s, m, t in rows]
    return LinkFit(kind or "all", alpha, 1.0 / beta, len(rows),
                   math.sqrt(sum(r * r for r in rel) / len(rel)))


# ---------------------------------------------------------------------------------------------
# Settings and results


@dataclass(frozen=True)
class CalibrateSettings:
    """What to measure and how hard. ``quick`` gives the smaller settings the tests use."""

    devices: int
    backend: str = "auto"  # auto: nccl with CUDA, else gloo
    repeats: int = 5
    warmup: int = 2
    matmul_max_s: float = 0.25  # a dtype so slow that one matmul would take longer gets a smaller shape
    cpu_square: int = 1024
    cpu_skinny: tuple[int, int, int] = (4096, 1024, 128)
    gpu_square: int = 8192
    gpu_skinny: tuple[int, int, int] = (32768, 8192, 512)
    cpu_copy_bytes: int = 128 * MiB
    gpu_copy_bytes: int = 1024 * MiB
    tiny_block: tuple[int, int, int] = (2, 8, 16)  # batch, sequence, hidden of the per-op overhead's block
    cpu_block: tuple[int, int, int] = (16, 64, 256)  # ... of the op bandwidth's block (1 MiB activations)
    gpu_block: tuple[int, int, int] = (16, 512, 1024)
    sizes: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(7))  # 4 KiB .. 16 MiB
    gpu_sizes: tuple[int, ...] = tuple(4 * KiB * 4**i for i in range(10))  # 4 KiB .. 1 GiB
    collective_bytes_per_repeat: int = 16 * MiB  # CUDA: small messages are looped this many bytes' worth
    max_iters: int = 20
    cpu_window_s: float = 0.05  # a CPU timing spans at least this long (several scheduler time slices)
    max_window_calls: int = 1000
    cpu_filler: int = 256  # CPUs: square matmuls of this size run before each timed collective ...
    cpu_filler_s: float = 0.005  # ... for about this long (the compute between a step's collectives)

    @classmethod
    def quick_for(cls, devices: int, backend: str = "auto") -> CalibrateSettings:
        return cls(devices, backend, repeats=3, warmup=1, matmul_max_s=0.05, cpu_square=512,
                   cpu_skinny=(2048, 512, 64), gpu_square=4096, gpu_skinny=(16384, 4096, 256),
                   cpu_copy_bytes=32 * MiB, gpu_copy_bytes=256 * MiB, cpu_block=(8, 32, 128),
                   gpu_block=(8, 256, 512),
                   sizes=tuple(4 * KiB * 4**i for i in range(6)),
                   gpu_sizes=tuple(4 * KiB * 4**i for i in range(8)),
                   collective_bytes_per_repeat=4 * MiB, max_iters=10, cpu_window_s=0.02)


@dataclass
class Calibration:
    """Everything measured; :func:`calibration_cluster` and :func:`calibration_toml` read it."""

    devices: int
    backend: str
    device_kind: str  # "cpu" or "cuda"
    device_name: str
    threads: int  # CPU threads per process (0 on CUDA)
    memory_bytes: float
    matmul: list[dict[str, Any]] = field(default_factory=list)  # dtype, shape, flops, repeats
    bandwidth: list[dict[str, Any]] = field(default_factory=list)  # op, bytes, bytes_per_s
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # collective -> why
    seconds: float = 0.0
    load_average: float | None = None
    op_overhead_s: float = 0.0  # per op pass of the emitted DTensor program (tiny transformer block)
    eager_op_overhead_s: float = 0.0  # per op pass of the same block run eagerly (a comment in the file)
    block: dict[str, Any] = field(default_factory=dict)  # shape, seconds, op_bandwidth (fit_op_bandwidth)
    matmul_again: float = 0.0  # the first matmul's FLOP/s measured again at the end (0: not)

    @property
    def drift(self) -> float:
        """Relative change of the first matmul's rate between the start and the end: other
        processes started or stopped while measuring when it is large (0 when not measured)."""
        if not (self.matmul and self.matmul_again > 0):
            return 0.0
        return abs(self.matmul_again / self.matmul[0]["flops"] - 1.0)

    @property
    def peak_flops(self) -> dict[str, float]:
        return _peaks(self.matmul)

    @property
    def memory_bandwidth(self) -> float:
        return max(row["bytes_per_s"] for row in self.bandwidth)

    @property
    def op_bandwidth(self) -> float:
        """Bytes/s of the ops' memory traffic fitted to the block's step (0: not measured)."""
        return float(self.block.get("op_bandwidth", 0.0))

    def fits(self) -> dict[str, LinkFit]:
        """One fit per measured collective, plus ``"all"`` (the joint fit); kinds whose
        timings cannot be fitted are left out."""
        out: dict[str, LinkFit] = {}
        kinds = [k for k in MEASURED_COLLECTIVES if any(s.kind == k for s in self.samples)]
        for kind in kinds:
            try:
                out[kind] = fit_alpha_beta([s for s in self.samples if s.kind == kind], kind)
            except ValueError:
                pass
        if self.samples:
            try:
                out["all"] = fit_alpha_beta(self.samples, "all")
            except ValueError:
                pass
        return out


# ---------------------------------------------------------------------------------------------
# Measuring (runs in each worker process; rank 0 reports)


def _log(rank: int, text: str) -> None:
    if rank == 0:
        print(f"calibrate: {text}", file=sys.stderr, flush=True)


def _si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _size(nbytes: float) -> str:
    for factor, unit in ((2**30, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= factor:
            return f"{nbytes / factor:.4g} {unit}"
    return f"{nbytes:g} B"


class _Worker:
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
                _log(self.rank, f"matmul {name:8s} {label:6s} {m}x{k}x{nn}: {_si(flops, 'FLOP/s')} "
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
            _log(self.rank, f"memory {op} {_size(nbytes)} ({_size(moved)} moved): {_si(bw, 'B/s')} "
                            f"(median of {s.repeats}{self.slowest})")
        return rows

    def block_steps(self, shape: tuple[int, int, int], mesh: Any) -> tuple[Any, Callable[[], Any], Callable[[], Any]]:
        """The traced graph of :func:`_block` at ``shape`` and two training steps of it
        (forward + backward): as the DTensor program autoplan emits on ``mesh`` (one device:
        no collective), and eagerly."""
        from autoplan.codegen.dtensor_program import build_program
        from autoplan.planner.api import make_options, plan_traced
        from autoplan.load import make_model_spec
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
        passes = (1.0 + BACKWARD_FACTOR) * len(_costed_ops(graph))
        overhead = self.agree(self.median_time(program_step, s.repeats, s.warmup), "max") / passes
        eager = self.agree(self.median_time(eager_step, s.repeats, s.warmup), "max") / passes
        _log(self.rank, f"op overhead (a tiny transformer block, {passes:.0f} op passes): {overhead * 1e6:.1f} us "
                        f"per op pass as a DTensor program, {eager * 1e6:.1f} us eagerly (median{self.slowest})")
        shape = s.gpu_block if self.cuda else s.cpu_block
        graph, program_step, _ = self.block_steps(shape, own)
        seconds = self.agree(self.median_time(program_step, s.repeats, s.warmup), "max")
        bandwidth = fit_op_bandwidth(_costed_ops(graph), seconds, peaks, overhead)
        _log(self.rank, f"op bandwidth (a transformer block, batch {shape[0]}, sequence {shape[1]}, hidden "
                        f"{shape[2]}: {seconds * 1e3:.2f} ms a step{self.slowest}): "
                        + (_si(bandwidth, "B/s") if bandwidth else "not fitted (matmuls and overhead explain it)"))
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
                _log(self.rank, f"{kind:14s} {_size(real_bytes):>9s}: {sec * 1e6:10.1f} us  "
                                f"({_si(moved / sec, 'B/s')} moved per device; median of {s.repeats})")
                del fn, timed
        return samples, skipped


def _after(first: Callable[[], Any], then: Callable[[], Any]) -> Callable[[], Any]:
    """A closure calling ``first`` then ``then``."""

    def both() -> Any:
        first()
        return then()

    return both


def _device_for(rank: int, backend: str) -> Any:
    import torch

    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _cpu_threads(n: int, default: int) -> int:
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


def _costed_ops(graph: Any) -> list[Any]:
    """The op nodes the cost model charges (a ``getitem`` costs nothing)."""
    return [info for info in graph.nodes.values() if info.kind == "op" and info.target != "getitem"]


def fit_op_bandwidth(nodes: Sequence[Any], seconds: float, peaks: dict[str, float], overhead_s: float,
                     lowest: float = 1e6, highest: float = 1e15) -> float:
    """The op bandwidth (bytes/s) at which the cost model predicts ``seconds`` for a training
    step of ``nodes`` (:class:`~autoplan.trace.graph.NodeInfo` of op nodes, all needing
    gradients): ``Σ (1 + BACKWARD_FACTOR) · (roofline(flops, moved bytes) + overhead_s)`` with
    the matmul ``peaks`` (FLOP/s by dtype), as :func:`autoplan.cost_models.step_costs.op_cost` charges
    one device. The prediction falls as the bandwidth grows; the root is bisected (in log
    space) between ``lowest`` and ``highest``. 0.0 when even ``highest`` predicts more than
    ``seconds`` (the matmuls and the overhead explain the step: no rate can be told); ``lowest``
    when even it predicts less."""
    from autoplan.cost_models.step_costs import moved_bytes

    def predicted(bandwidth: float) -> float:
        device = DeviceSpec("fit", peaks, bandwidth, 1.0, overhead_s)
        return sum((1.0 + BACKWARD_FACTOR) * (roofline_time(info.flops, moved_bytes(info), device,
                                                            info.dtype or "float32") + overhead_s)
                   for info in nodes)

    if predicted(highest) >= seconds:
        return 0.0
    if predicted(lowest) <= seconds:
        return lowest
    lo, hi = math.log(lowest), math.log(highest)
    for _ in range(60):
        mid = (lo + hi) / 2
        if predicted(math.exp(mid)) > seconds:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _peaks(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The best matmul rate of each dtype (as :attr:`Calibration.peak_flops`)."""
    peaks: dict[str, float] = {}
    for row in rows:
        peaks[row["dtype"]] = max(peaks.get(row["dtype"], 0.0), row["flops"])
    return peaks


def _measure(rank: int, n: int, settings: CalibrateSettings) -> dict[str, Any]:
    import torch

    device = _device_for(rank, settings.backend)
    threads = 0
    if device.type == "cpu":
        threads = _cpu_threads(n, torch.get_num_threads())
        torch.set_num_threads(threads)
    worker = _Worker(rank, n, settings, device)
    result: dict[str, Any] = {"threads": threads, "matmul": worker.matmul(), "bandwidth": worker.memory(),
                              "samples": [], "skipped": {}}
    result.update(worker.ops(_peaks(result["matmul"])))
    if n > 1:
        samples, skipped = worker.collectives()
        result["samples"] = [asdict(x) for x in samples]
        result["skipped"] = skipped
    first = result["matmul"][0]  # float32, square: measured again, to tell whether the load changed
    result["matmul_again"] = worker.matmul_rate(torch.float32, tuple(first["shape"]))
    return result


def _spawned(rank: int, n: int, settings: CalibrateSettings, store: str, result_path: str) -> None:
    """Entry point of each worker process."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore", category=FutureWarning)
    if settings.backend == "nccl":
        _device_for(rank, "nccl")
    dist.init_process_group(settings.backend, init_method=f"file://{store}", rank=rank, world_size=n)
    try:
        result = _measure(rank, n, settings)
        if rank == 0:
            Path(result_path).write_text(json.dumps(result))
        dist.barrier()
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Driver


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return "cpu"


def _ram_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def resolve_backend(backend: str, devices: int) -> str:
    """``auto`` → nccl when CUDA is available, else gloo; checks there are enough GPUs."""
    import torch

    backend = backend.lower()
    if backend not in ("auto", "gloo", "nccl"):
        raise AutoplanError(f"--backend must be auto, gloo or nccl, not {backend!r}")
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have < devices:
            raise AutoplanError(f"--devices {devices} needs {devices} GPUs for nccl but this machine has {have}: "
                                f"use --devices {max(have, 1)} or --backend gloo")
    return backend


def calibrate(settings: CalibrateSettings) -> Calibration:
    """Measure this machine with ``settings.devices`` processes (see the module docstring)."""
    import torch
    import torch.multiprocessing as mp

    n = settings.devices
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise AutoplanError(f"--devices must be a positive integer, got {n!r}")
    backend = resolve_backend(settings.backend, n)
    settings = replace(settings, backend=backend)
    start = time.perf_counter()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    if backend == "nccl":
        props = torch.cuda.get_device_properties(0)
        kind, name, memory = "cuda", props.name, float(props.total_memory)
    else:
        kind, name, memory = "cpu", _cpu_name(), _ram_bytes() / n
    print(f"calibrate: measuring {n} {'process' if n == 1 else 'processes'} ({backend}) on {name}"
          + (f"; load average {load:.2f} at the start" if load is not None else ""), file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="autoplan-calibrate-") as tmp:
        result_path = os.path.join(tmp, "result.json")
        try:
            mp.spawn(_spawned, args=(n, settings, os.path.join(tmp, "store"), result_path), nprocs=n, join=True)
        except Exception as exc:  # a worker died: its traceback is on stderr already
            last = [l for l in str(exc).strip().splitlines() if l.strip()]
            raise AutoplanError(f"a measuring process failed: {last[-1] if last else type(exc).__name__}") from None
        result = json.loads(Path(result_path).read_text())
    return Calibration(
        devices=n, backend=backend, device_kind=kind, device_name=name, threads=result["threads"],
        memory_bytes=memory, matmul=result["matmul"], bandwidth=result["bandwidth"],
        samples=[Sample(**x) for x in result["samples"]], skipped=dict(result["skipped"]),
        seconds=time.perf_counter() - start, load_average=load, op_overhead_s=float(result["op_overhead"]),
        eager_op_overhead_s=float(result["eager_op_overhead"]), block=dict(result["block"]),
        matmul_again=float(result["matmul_again"]),
    )


def _round(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits (measured figures carry no more)."""
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits - 1}e}")


def _base_preset(cal: Calibration) -> ClusterSpec:
    presets = preset_table()
    if cal.device_kind == "cpu":
        return presets["cpu"]
    lowered = cal.device_name.lower()
    for key in ("h200", "h100", "a100-80g" if "80" in lowered else "a100-40g", "v100-16g"):
        if key.split("-")[0] in lowered:
            return presets[key]
    return presets["h100"]


def _drift_text(cal: Calibration) -> str:
    return (f"the first matmul ran at {_si(cal.matmul[0]['flops'], 'FLOP/s')} at the start and "
            f"{_si(cal.matmul_again, 'FLOP/s')} at the end: the machine's load changed while measuring; "
            f"calibrate again on an idle machine")


def calibration_cluster(cal: Calibration, name: str | None = None) -> ClusterSpec:
    """The cluster spec the measurement gives: one node of ``cal.devices`` devices."""
    base = _base_preset(cal)
    fits = cal.fits()
    joint = fits.get("all")
    per_kind = tuple((kind, LinkRates(_round(fits[kind].bandwidth), _round(fits[kind].alpha)))
                     for kind in COLLECTIVE_KINDS if kind in fits)
    intra = LinkSpec(_round(joint.bandwidth), _round(joint.alpha), per_kind) if joint else base.intra_node
    inter = LinkSpec(min(base.inter_node.bandwidth, intra.bandwidth), max(base.inter_node.latency, intra.latency))
    peaks = {k: _round(v) for k, v in cal.peak_flops.items()}
    device_name = "cpu" if cal.device_kind == "cpu" else cal.device_name
    device = DeviceSpec(device_name, peaks, _round(cal.memory_bandwidth), float(int(cal.memory_bytes)),
                        _round(cal.op_overhead_s), _round(cal.op_bandwidth))
    host = socket.gethostname().split(".")[0] or "this-machine"
    return ClusterSpec(name or f"{host}-{cal.devices}x{cal.device_kind}", device, cal.devices, intra, inter)


def _op_comments(cal: Calibration) -> list[str]:
    """Comment lines on the per-op overhead (op_overhead_us) and the op bandwidth (op_bandwidth_gbps)."""
    lines: list[str] = []
    if cal.op_overhead_s:
        lines += [f"# per-op overhead (a tiny transformer block's training step, per op pass): {cal.op_overhead_s * 1e6:.3g} us",
                  ("#   as the DTensor program autoplan emits (written as op_overhead_us); "
                   f"{cal.eager_op_overhead_s * 1e6:.3g} us eagerly (DDP, parallelize_module).")]
    if cal.block:
        batch, seq, hidden = cal.block["shape"]
        fitted = (f"{_si(cal.op_bandwidth, 'B/s')} (written as op_bandwidth_gbps)" if cal.op_bandwidth
                  else "none fits (matmuls and overhead explain the step): memory_bandwidth_gbps applies")
        lines += [(f"# op bandwidth: a transformer block (batch {batch}, sequence {seq}, hidden {hidden}) takes "
                   f"{cal.block['seconds'] * 1e3:.3g} ms a step as the DTensor program;"),
                  ("#   the cost model predicts that with matmuls at the float32 peak, the per-op overhead and the ops' "
                   f"bytes at {fitted}.")]
    return lines


def calibration_toml(cal: Calibration, name: str | None = None) -> str:
    """The TOML file: :meth:`ClusterSpec.to_toml` with the measurements as comments."""
    cluster = calibration_cluster(cal, name)
    base = _base_preset(cal)
    fits = cal.fits()
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    head = [
        f"# Written by `autoplan calibrate --devices {cal.devices}` on {socket.gethostname()} at {when} "
        f"({cal.seconds:.1f} s).",
        f"# {cal.devices} {'process' if cal.devices == 1 else 'processes'} measured at once ({cal.backend}"
        + (f", {cal.threads} CPU thread{'s' if cal.threads != 1 else ''} each" if cal.threads else "")
        + f") on {cal.device_name};",
        "# every figure is the median of repeats after warm-up"
        + (", on the slowest rank." if cal.devices > 1 else "."),
    ]
    if cal.load_average is not None:
        head.append(f"# Load average at the start: {cal.load_average:.2f} (other processes may have slowed it).")
    if cal.drift > DRIFT_WARNING:
        head.append(f"# WARNING: {_drift_text(cal)}")
    if cal.device_kind == "cpu":
        head.append(f"# device.memory_gb: the machine's RAM divided by {cal.devices}.")
    head += ["#", "# matmul (M x K x N):"]
    head += [f"#   {r['dtype']:8s} {r['kind']:6s} {'x'.join(map(str, r['shape'])):>16s}: {_si(r['flops'], 'FLOP/s')}"
             for r in cal.matmul]
    head += ["# memory bandwidth (bytes moved / time):"]
    head += [f"#   {r['op']:4s} {_size(r['bytes'])}: {_si(r['bytes_per_s'], 'B/s')}" for r in cal.bandwidth]
    head += _op_comments(cal)
    if cal.devices > 1:
        head += ["#", "# collectives: alpha-beta fit of t = latency_steps*alpha + bytes_moved_per_device/bandwidth",
                 "# (autoplan.cost_models.communication's ring model; least squares on relative errors):"]
        for kind in (*MEASURED_COLLECTIVES, "all"):
            if kind in fits:
                f = fits[kind]
                label = ("joint fit, written as intra_node (send_recv's rates)" if kind == "all"
                         else f"{kind} (written as intra_node.{kind})")
                head.append(f"#   {label}: alpha = {f.alpha * 1e6:.3g} us, bandwidth = {_si(f.bandwidth, 'B/s')} "
                            f"({f.points} sizes, rms error {f.rms_rel_error:.0%})")
            elif kind in cal.skipped:
                head.append(f"#   {kind}: skipped, {cal.skipped[kind]}")
            elif kind != "all":
                head.append(f"#   {kind}: timings did not fit the model (no bandwidth)")
        sizes = sorted({s.nbytes for s in cal.samples})
        if sizes:
            head.append(f"#   message sizes {_size(sizes[0])} .. {_size(sizes[-1])}, float32.")
        head += ["#   measured (kind, bytes, seconds):"]
        head += [f"#     {s.kind} {int(s.nbytes)} {s.seconds:.4g}" for s in cal.samples]
        if "all" not in fits:
            head.append(f"# intra_node: the collectives could not be fitted; the {base.name} preset's link.")
    else:
        head += ["#", f"# intra_node: not measured (one process); the {base.name} preset's link."]
    body = cluster.to_toml()
    inter_note = (f"# inter_node: not measured (one machine is one node); the {base.name} preset's link, "
                  "no faster than intra_node.\n")
    body = body.replace("\n[inter_node]\n", "\n" + inter_note + "[inter_node]\n")
    return "\n".join(head) + "\n\n" + body


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan calibrate",
        description="Measure this machine (matmul throughput, memory bandwidth, collectives over N processes) "
                    "and write a cluster TOML file for `autoplan MODEL.py --cluster FILE`.",
    )
    parser.add_argument("--devices", type=int, required=True,
                        help="number of processes (GPUs with nccl) to measure with; one machine is one node")
    parser.add_argument("-o", "--output", required=True, help="the cluster TOML file to write")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller measurements (a few seconds)")
    parser.add_argument("--backend", default="auto", help="auto (nccl with CUDA, else gloo), gloo or nccl")
    parser.add_argument("--name", default=None, help="the cluster's name in the file (default HOST-NxKIND)")
    return parser


def _check_writable(path: Path) -> None:
    """Fail before measuring when ``path`` cannot be written."""
    if path.is_dir():
        raise AutoplanError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise AutoplanError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)  # mkstemp gives 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_calibrate(argv: Sequence[str]) -> int:
    """``autoplan calibrate ...``; user errors raise AutoplanError (one line, exit 2)."""
    args = build_parser().parse_args(list(argv))
    if args.devices < 1:
        raise AutoplanError(f"--devices must be at least 1, got {args.devices}")
    out = Path(args.output)
    _check_writable(out)
    settings = (CalibrateSettings.quick_for(args.devices, args.backend) if args.quick
                else CalibrateSettings(args.devices, args.backend))
    cal = calibrate(settings)
    text = calibration_toml(cal, args.name)
    cluster = cluster_from_toml(text, str(out), preset_table())  # what load_cluster will read
    try:
        write_atomically(out, text)
    except OSError as exc:
        raise AutoplanError(f"cannot write {out}: {exc.strerror or exc}") from None
    dev = cluster.device
    peaks = ", ".join(f"{k} {_si(v, 'FLOP/s')}" for k, v in dev.peak_flops.items())
    print(f"{cluster.name}: {cluster.devices_per_node} x {dev.name}; peak {peaks}; memory bandwidth "
          f"{_si(dev.memory_bandwidth, 'B/s')}; memory {_si(dev.memory_bytes, 'B')} per device")
    print(f"intra_node: bandwidth {_si(cluster.intra_node.bandwidth, 'B/s')}, latency "
          f"{cluster.intra_node.latency * 1e6:.3g} us; inter_node: bandwidth "
          f"{_si(cluster.inter_node.bandwidth, 'B/s')}, latency {cluster.inter_node.latency * 1e6:.3g} us")
    for kind, reason in cal.skipped.items():
        print(f"skipped {kind}: {reason}")
    if cal.drift > DRIFT_WARNING:
        print(f"warning: {_drift_text(cal)}")
    print(f"wrote {out} in {cal.seconds:.1f} s")
    return 0
