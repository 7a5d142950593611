"""Compute cost of one op on one device: the roofline model."""

from __future__ import annotations

from .hardware import DeviceSpec


def roofline_time(flops: float, nbytes: float, device: DeviceSpec, dtype: str) -> float:
    """Seconds for an op doing ``flops`` FLOPs and moving ``nbytes`` bytes to/from memory:
    the larger of its compute time at ``device.peak(dtype)`` FLOP/s and its memory time at
    ``device.memory_bandwidth`` bytes/s."""
    return max(flops / device.peak(dtype), nbytes / device.memory_bandwidth)
