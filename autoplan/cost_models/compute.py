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
    the larger of its compute time at ``device.peak(dtype)`` FLOP/s and its memory time at
    ``device.activation_bandwidth`` bytes/s (the measured rate of ops on activations where
    ``autoplan calibrate`` gave one, else the memory bandwidth)."""
    return max(flops / device.peak(dtype), nbytes / device.activation_bandwidth)
