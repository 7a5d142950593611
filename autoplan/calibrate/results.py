"""What calibration measures with (:class:`CalibrateSettings`) and what it found (:class:`Calibration`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from autoplan.calibrate.fit import LinkFit, Sample, fit_alpha_beta, implausible, peak_rates
from autoplan.cost_models import ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, REDUCE_SCATTER

#: A drift (:attr:`Calibration.drift`) above this is reported: the figures are not consistent.
DRIFT_WARNING = 0.2

#: The collectives measured, in the order they are measured.
MEASURED_COLLECTIVES: tuple[str, ...] = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL)

KiB, MiB = 2**10, 2**20


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
        return peak_rates(self.matmul)

    @property
    def memory_bandwidth(self) -> float:
        return max(row["bytes_per_s"] for row in self.bandwidth)

    @property
    def op_bandwidth(self) -> float:
        """Bytes/s of the ops' memory traffic fitted to the block's step (0: not measured)."""
        return float(self.block.get("op_bandwidth", 0.0))

    def fits(self) -> dict[str, LinkFit]:
        """The plausible fits (:func:`implausible`): one per measured collective, plus
        ``"all"`` (the joint fit); kinds whose timings cannot be fitted, or fit implausibly
        (:meth:`refused_fits`), are left out."""
        return {kind: fit for kind, fit in self.all_fits().items() if implausible(fit) is None}

    def refused_fits(self) -> dict[str, tuple[LinkFit, str]]:
        """The fits left out as implausible, each with why."""
        return {kind: (fit, why) for kind, fit in self.all_fits().items() if (why := implausible(fit)) is not None}

    def all_fits(self) -> dict[str, LinkFit]:
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


def format_si(value: float, unit: str) -> str:
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def format_size(nbytes: float) -> str:
    for factor, unit in ((2**30, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
        if nbytes >= factor:
            return f"{nbytes / factor:.4g} {unit}"
    return f"{nbytes:g} B"
