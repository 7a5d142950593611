"""Compute cost of one op on one device: the roofline model."""

from __future__ import annotations

from .hardware import DeviceSpec

#: The backward of an op costs this many forwards (gradients with respect to its inputs and to
#: its weights); the default of :class:`autoplan.cost_models.step_costs.CostContext`'s
#: ``backward_factor``, and what ``autoplan calibrate`` assumes when it turns a measured
#: forward + backward into a per-op rate.
BACKWARD_FACTOR = 2.0


def roofline_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds for an op doing ``flops`` FLOPs and moving ``nbytes`` bytes to/from memory:
    the larger of its compute time at ``device.achievable(dtype)`` FLOP/s and its memory time at
    ``device.activation_bandwidth`` bytes/s (the measured rate of ops on activations where
    ``autoplan calibrate`` gave one, else the memory bandwidth)."""
    return max(flops / device.achievable(dtype), nbytes / device.activation_bandwidth)


def op_seconds(roofline_s: float, device: DeviceSpec) -> float:
    """One op's time on ``device`` from its roofline time: the roofline plus the per-op
    overhead where dispatch and compute take turns on one core, the larger of the two where
    the host dispatches ahead of the device (:attr:`DeviceSpec.overlapped_dispatch`: a GPU runs
    a long kernel while the host launches the next ones, and waits for the host only where
    kernels are shorter than their dispatch)."""
    if device.overlapped_dispatch:
        return max(roofline_s, device.op_overhead_s)
    return roofline_s + device.op_overhead_s
