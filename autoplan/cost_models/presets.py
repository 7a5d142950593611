"""Built-in clusters and :func:`load_cluster`, which turns a preset name or a TOML path into a
:class:`ClusterSpec`.

Figures are vendor datasheet peaks (dense, no sparsity) in FLOP/s, bytes/s, bytes and seconds.
A GPU preset's ops run at what a GPU achieves of those peaks, as ``autoplan calibrate`` measured
it on a lent H100 and H200 (``benchmarks/results/``): matmuls at 0.78 of the peak (H100 bf16
776.5 of 989 TFLOP/s; H200 bf16 792, fp32 51 of 67) and activations at 0.9 of the HBM bandwidth
(H200: 4.32 of 4.8 TB/s). The A100 and V100 presets assume the same fractions. Model FLOPs
utilisation is stated against the datasheet peak.

A preset charges no host dispatch per op: it depends on the host, and on a preset every op of
a small model would cost the same 30 us, whatever its sharding. Models whose ops are short
against it run slower than a preset predicts: on one H200 the H200 preset predicts Llama 3.2
1B's bf16 step (recomputed, 4 x 2,048 tokens) at 162 ms against 235 ms measured, 3B's at 403
ms against 577 ms, GPT-2's fp32 step at 157 ms against 176 ms (131, 328 and 125 ms at the
datasheet figures). A file written by ``autoplan calibrate`` on the GPU carries the dispatch
it measured (30.1 us per op of an eager step on the H200's host) and the measured peaks: with it
the same steps are predicted at 238, 511 and 186 ms.

The interpreter's dispatch, which plans no native program matches pay instead of the eager
one (:mod:`autoplan.cost_models.interpreter_dispatch`), is stated beside their prediction: a
preset carries the figure ``autoplan calibrate`` measured per op pass of the DTensor program on
the host of a lent GPU (H100: 196 us, ``benchmarks/results/h100-calibrated.toml``; H200: 137 us,
``benchmarks/results/h200-2026-11-30/``; the A100 and V100 presets take the H100 host's) and,
for ``cpu``, on a 2-core x86 machine (105 us; 9 us eagerly).
"""

from __future__ import annotations

from pathlib import Path

from autoplan.errors import AutoplanError

from .cluster import ClusterSpec, cluster_from_toml
from .hardware import DeviceSpec, LinkSpec

#: Preset names, in the order error messages list them.
PRESET_NAMES: tuple[str, ...] = ("h100", "h200", "a100-80g", "a100-40g", "v100-16g", "cpu")


#: What a GPU's ops achieve of its datasheet figures (measured on an H100 and an H200; see above).
GPU_MATMUL_EFFICIENCY = 0.78
GPU_ACTIVATION_BANDWIDTH_FRACTION = 0.9
#: Seconds per op pass on the DTensor interpreter, as ``autoplan calibrate`` measured it (see above).
H100_HOST_INTERPRETER_OP_S = 196e-6
H200_HOST_INTERPRETER_OP_S = 137e-6
CPU_INTERPRETER_OP_S = 105e-6


def _gpu_cluster(
    name: str, peaks: dict[str, float], hbm_bw: float, hbm: float, intra: LinkSpec, inter: LinkSpec,
    interpreter_op_s: float = H100_HOST_INTERPRETER_OP_S,
) -> ClusterSpec:
    """An 8-GPU-per-node cluster; ``hbm_bw`` in bytes/s, ``hbm`` in bytes."""
    device = DeviceSpec(name, peaks, hbm_bw, hbm, op_bandwidth=hbm_bw * GPU_ACTIVATION_BANDWIDTH_FRACTION,
                        overlapped_dispatch=True, matmul_efficiency=GPU_MATMUL_EFFICIENCY,
                        interpreter_op_overhead_s=interpreter_op_s)
    return ClusterSpec(name, device, 8, intra, inter)


def preset_table() -> dict[str, ClusterSpec]:
    """A fresh dict of the built-in clusters keyed by lower-case preset name."""
    h100_peaks = {"float32": 67e12, "bfloat16": 989e12, "float16": 989e12}
    a100_peaks = {"float32": 19.5e12, "bfloat16": 312e12, "float16": 312e12}
    nvlink4 = LinkSpec(450e9, 3e-6)
    nvlink3 = LinkSpec(300e9, 3e-6)
    return {
        # H100 SXM datasheet (dense): 67 TF fp32, 989 TF bf16/fp16, 3.35 TB/s HBM3, 80 GB;
        # NVLink 4 at 900 GB/s bidirectional = 450 GB/s each way; one 400 Gbit/s IB NIC per GPU.
        "h100": _gpu_cluster("h100", h100_peaks, 3.35e12, 80e9, nvlink4, LinkSpec(50e9, 10e-6)),
        # H200 SXM: the H100 die with 141 GB of HBM3e at 4.8 TB/s; same NVLink and network.
        "h200": _gpu_cluster("h200", h100_peaks, 4.8e12, 141e9, nvlink4, LinkSpec(50e9, 10e-6),
                             H200_HOST_INTERPRETER_OP_S),
        # A100 SXM 80GB datasheet: 19.5 TF fp32 (no TF32), 312 TF bf16/fp16, 2.0 TB/s HBM2e;
        # NVLink 3 at 600 GB/s bidirectional = 300 GB/s each way; 200 Gbit/s HDR IB per GPU.
        "a100-80g": _gpu_cluster("a100-80g", a100_peaks, 2.0e12, 80e9, nvlink3, LinkSpec(25e9, 10e-6)),
        # A100 SXM 40GB: as the 80GB part but HBM2 at 1.555 TB/s.
        "a100-40g": _gpu_cluster("a100-40g", a100_peaks, 1.555e12, 40e9, nvlink3, LinkSpec(25e9, 10e-6)),
        # V100 SXM2 16GB, like AWS p3.16xlarge: 15.7 TF fp32, 125 TF fp16 tensor cores, no bf16
        # tensor cores (bf16 runs at the fp32 rate), 900 GB/s HBM2; NVLink 2 ~150 GB/s each way;
        # 25 Gbit/s Ethernet between instances.
        "v100-16g": _gpu_cluster(
            "v100-16g",
            {"float32": 15.7e12, "float16": 125e12, "bfloat16": 15.7e12},
            900e9,
            16e9,
            LinkSpec(150e9, 5e-6),
            LinkSpec(3.125e9, 30e-6),
        ),
        # A modest CPU host for gloo runs: ~100 GFLOP/s fp32 per process, ~20 GB/s DRAM share,
        # gloo over shared memory/loopback inside the host, 8 Gbit/s TCP between hosts.
        "cpu": ClusterSpec(
            "cpu",
            DeviceSpec("cpu", {"float32": 100e9}, 20e9, 16e9, interpreter_op_overhead_s=CPU_INTERPRETER_OP_S),
            64,
            LinkSpec(2e9, 50e-6),
            LinkSpec(1e9, 100e-6),
        ),
    }


def _unknown(name: str) -> AutoplanError:
    return AutoplanError(
        f"unknown cluster {name!r}: use a preset ({', '.join(PRESET_NAMES)}) or the path of a TOML cluster file"
    )


def load_cluster(
    name_or_path: str, devices_per_node: int | None = None, memory_per_device: float | None = None
) -> ClusterSpec:
    """A preset by name (case-insensitive) or a TOML cluster file, with optional overrides of the
    node size and of the memory per device (bytes). Problems raise a one-line AutoplanError."""
    presets = preset_table()
    text_name = str(name_or_path)
    cluster = presets.get(text_name.strip().lower())
    if cluster is None:
        path = Path(text_name)
        if not text_name.strip() or not path.is_file():
            raise _unknown(text_name)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise AutoplanError(f"cannot read cluster file {path}: {' '.join(str(exc).split())}") from None
        cluster = cluster_from_toml(text, str(path), presets)
    return cluster.with_overrides(devices_per_node=devices_per_node, memory_per_device=memory_per_device)
