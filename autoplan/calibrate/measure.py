"""Running the workers: one process per device (``torch.multiprocessing`` spawn, a FileStore
rendezvous), and the :class:`Calibration` they report."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from autoplan.calibrate.fit import Sample, peak_rates
from autoplan.calibrate.results import CalibrateSettings, Calibration
from autoplan.calibrate.worker import Worker, cpu_threads, device_for
from autoplan.errors import AutoplanError


def _measure(rank: int, n: int, settings: CalibrateSettings) -> dict[str, Any]:
    import torch

    device = device_for(rank, settings.backend)
    threads = 0
    if device.type == "cpu":
        threads = cpu_threads(n, torch.get_num_threads())
        torch.set_num_threads(threads)
    worker = Worker(rank, n, settings, device)
    result: dict[str, Any] = {"threads": threads, "matmul": worker.matmul(), "bandwidth": worker.memory(),
                              "samples": [], "skipped": {}}
    result.update(worker.ops(peak_rates(result["matmul"])))
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
        device_for(rank, "nccl")
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
