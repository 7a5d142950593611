"""Training memory per parameter and the (memory-bound) optimizer step time."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from autoplan.errors import AutoplanError

from .hardware import DeviceSpec

# Moment buffers each optimizer keeps per parameter element.
_MOMENTS = MappingProxyType({"adam": 2, "adamw": 2, "sgd": 0, "sgd-momentum": 1})
_FP32_BYTES = 4
_HALF_BYTES = 2


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer (``adam``, ``adamw``, ``sgd``, ``sgd-momentum``) and whether training is
    mixed precision (half-precision params and grads, fp32 master weights and moments)."""

    name: str = "adam"
    mixed_precision: bool = False

    def __post_init__(self) -> None:
        name = str(self.name).strip().lower()
        if name not in _MOMENTS:
            raise AutoplanError(f"unknown optimizer {self.name!r}: use one of {', '.join(_MOMENTS)}")
        object.__setattr__(self, "name", name)

    @property
    def num_moments(self) -> int:
        return _MOMENTS[self.name]

    def state_bytes_per_param(self, param_itemsize: int) -> tuple[float, float, float]:
        """(param, grad, optimizer-state) bytes per parameter element.

        Plain: moments kept in the param dtype, e.g. fp32 Adam -> (4, 4, 8).
        Mixed precision (bf16 compute under ``torch.autocast``): the parameters are the fp32
        master weights, their gradients fp32, the moments fp32, e.g. Adam -> (4, 4, 8) = 16
        bytes per parameter; the bf16 copies the forward computes with are
        :attr:`compute_copy_bytes`.
        """
        size = float(_FP32_BYTES if self.mixed_precision else param_itemsize)
        return (size, size, size * self.num_moments)

    @property
    def compute_copy_bytes(self) -> float:
        """Bytes per parameter element of the copy the forward computes with: under mixed
        precision autocast's bf16 cast of a weight, which the consumer keeps for its backward;
        none in full precision, where the consumer keeps the parameter itself."""
        return float(_HALF_BYTES) if self.mixed_precision else 0.0

    def bytes_per_param(self, param_itemsize: int) -> float:
        """Total bytes (param + grad + state) per parameter element."""
        return sum(self.state_bytes_per_param(param_itemsize))


def optimizer_step_time(
    num_local_elements: float, device: DeviceSpec, optimizer: OptimizerSpec, param_itemsize: int
) -> float:
    """Seconds for the optimizer update of ``num_local_elements`` parameter elements on one
    device, memory bound: read and write param and state, read the grad once, at
    ``device.memory_bandwidth`` bytes/s."""
    param, grad, state = optimizer.state_bytes_per_param(param_itemsize)
    return num_local_elements * (2 * param + grad + 2 * state) / device.memory_bandwidth
