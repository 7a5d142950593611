"""Hardware vocabulary: one accelerator (:class:`DeviceSpec`) and one link (:class:`LinkSpec`).

Units everywhere in this package: FLOP/s, bytes, bytes/s and seconds (decimal SI, not GiB,
unless a name says otherwise).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from types import MappingProxyType

from autoplan.errors import AutoplanError

#: The dtype whose peak stands in for any dtype a device does not list.
DEFAULT_DTYPE = "float32"

_DTYPE_ALIASES = MappingProxyType(
    {
        "float": "float32",
        "fp32": "float32",
        "half": "float16",
        "fp16": "float16",
        "bf16": "bfloat16",
        "double": "float64",
        "fp64": "float64",
        "long": "int64",
        "int": "int32",
    }
)


def dtype_name(dtype: object) -> str:
    """Torch's short dtype name: ``torch.float32``, ``"torch.float32"`` and ``"fp32"`` all give
    ``"float32"``."""
    text = str(dtype).strip().removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator.

    ``peak_flops`` maps a dtype name (``"float32"``, ``"bfloat16"``, ...) to the dense peak in
    FLOP/s and must contain ``"float32"``; ``memory_bandwidth`` is the HBM/DRAM bandwidth in
    bytes/s; ``memory_bytes`` the memory per device in bytes; ``op_overhead_s`` the time one op
    costs beyond its roofline (eager dispatch, DTensor's sharding propagation), which
    ``autoplan calibrate`` measures and which dominates small models on CPUs.

    ``op_bandwidth`` is the rate, in bytes/s, at which the ops of a training step read and write
    their activations, as ``autoplan calibrate`` measures it on a mix of element-wise,
    normalisation and softmax ops (forward and backward) at activation sizes. It differs from
    the streaming ``memory_bandwidth`` where tensors fit in cache or where an op's arithmetic
    (GELU's ``erf``, a softmax's ``exp``) rather than memory bounds it. The GPU presets give 0.9 of
    ``memory_bandwidth``; 0 (the ``cpu`` preset) means ``memory_bandwidth`` itself;
    :attr:`activation_bandwidth` resolves it.

    ``matmul_efficiency`` is the fraction of ``peak_flops`` a training step's ops achieve
    (cuBLAS reaches about 0.8 of a datasheet peak on large GEMMs); an op's compute time runs at
    :meth:`achievable`, while model FLOPs utilisation is stated against the peak itself
    (:func:`~autoplan.cost_models.step_costs.model_flops_utilization`). 1 where the peaks were
    measured (``autoplan calibrate``).

    ``overlapped_dispatch`` says whether the host dispatches ops ahead of the device, as it
    does into a GPU's launch queue: the device then runs one op while the host dispatches the
    next ones, so an op costs the larger of its roofline and ``op_overhead_s``
    (:func:`~autoplan.cost_models.compute.op_seconds`). Where one CPU core both dispatches and
    computes (gloo processes), it is False and the two add.

    ``interpreter_op_overhead_s`` is the dispatch of one op pass on autoplan's DTensor
    interpreter, the program of plans no native form matches (``autoplan calibrate`` measures it
    on a tiny transformer block); the solvers cost ``op_overhead_s``, and the interpreter's host
    time is stated beside the prediction (:mod:`autoplan.cost_models.interpreter_dispatch`).
    0: not known.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: float
    op_overhead_s: float = 0.0  # host-side seconds to launch one op (dispatch)
    op_bandwidth: float = 0.0  # bytes/s ops achieve on activations; 0: memory_bandwidth
    overlapped_dispatch: bool = False  # True on GPUs: dispatch overlaps the device's work
    matmul_efficiency: float = 1.0  # fraction of peak_flops ops achieve; MFU is against the peak
    interpreter_op_overhead_s: float = 0.0  # host-side seconds of one op pass on the DTensor interpreter

    def __post_init__(self) -> None:
        # Own a private copy so that mutating the caller's dict cannot change a frozen spec.
        peaks = {dtype_name(k): float(v) for k, v in self.peak_flops.items()}
        if DEFAULT_DTYPE not in peaks:
            raise ValueError(f"device {self.name!r} needs a {DEFAULT_DTYPE} peak")
        if not 0.0 < self.matmul_efficiency <= 1.0:
            raise ValueError(f"device {self.name!r}: matmul_efficiency must be in (0, 1], not {self.matmul_efficiency}")
        object.__setattr__(self, "peak_flops", peaks)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bandwidth, self.memory_bytes))

    @property
    def activation_bandwidth(self) -> float:
        """Bytes/s of an op's memory traffic: ``op_bandwidth`` where measured, else
        ``memory_bandwidth``."""
        return self.op_bandwidth if self.op_bandwidth > 0 else self.memory_bandwidth

    def peak(self, dtype: object) -> float:
        """Peak FLOP/s for ``dtype``; a dtype the device does not list gets the float32 peak."""
        return self.peak_flops.get(dtype_name(dtype), self.peak_flops[DEFAULT_DTYPE])

    def achievable(self, dtype: object) -> float:
        """FLOP/s an op in ``dtype`` achieves: the peak times ``matmul_efficiency``."""
        return self.peak(dtype) * self.matmul_efficiency


@dataclass(frozen=True)
class LinkRates:
    """What one collective kind achieves over a link: ``bandwidth`` in bytes/s per device,
    ``latency`` in seconds per ring step."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class LinkSpec:
    """A link between devices: ``bandwidth`` in bytes/s per device, ``latency`` in seconds;
    ``per_kind`` overrides both for the collective kinds it names (``autoplan calibrate``
    measures each kind apart: on gloo a reduce-scatter's latency is about twice an
    all-reduce's per ring step)."""

    bandwidth: float
    latency: float
    per_kind: tuple[tuple[str, LinkRates], ...] = ()

    def rates(self, kind: str) -> LinkRates:
        """The bandwidth and latency collective ``kind`` gets over this link."""
        for name, rates in self.per_kind:
            if name == kind:
                return rates
        return LinkRates(self.bandwidth, self.latency)

    def without_latency(self) -> LinkSpec:
        """The same bandwidths with no latency (a bucketed gradient reduction's share)."""
        return LinkSpec(self.bandwidth, 0.0, tuple((k, LinkRates(r.bandwidth, 0.0)) for k, r in self.per_kind))


# ---------------------------------------------------------------------------------------------
# Memory sizes written by people ("40GB", "38GiB")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b|b)?\s*$", re.IGNORECASE)
_UNIT_POWERS = MappingProxyType(
    {
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
)


def parse_memory_size(text: str) -> int:
    """Bytes in a size such as ``"40GB"`` (10**9), ``"38GiB"`` (2**30), ``"512MB"``, ``"1.5TB"``
    or plain integer bytes (``"1024"``). Anything else raises a one-line AutoplanError."""
    m = _SIZE_RE.match(str(text))
    error = AutoplanError(f"cannot read memory size {str(text)!r}: write it like 40GB or 38GiB")
    if not m:
        raise error
    number, unit = m.group(1), m.group(2)
    if unit is None and not number.isdigit():
        raise error  # fractional bytes
    try:
        value = Decimal(number) * _UNIT_POWERS[(unit or "b").lower()]
    except InvalidOperation:
        raise error from None
    return int(value.to_integral_value())
