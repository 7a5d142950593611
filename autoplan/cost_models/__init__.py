"""Cost models: hardware and cluster specs, compute (roofline), communication (alpha-beta,
ring collectives, resharding) and memory (optimizer state, optimizer step).

Units: FLOP/s, bytes, bytes/s, seconds. Pure Python: no torch import.
"""

from .cluster import ClusterSpec, cluster_from_toml
from .communication import (ALL_GATHER, ALL_REDUCE, ALL_TO_ALL, BROADCAST, COLLECTIVE_KINDS, REDUCE_SCATTER,
    SEND_RECV, CollectiveKind, CollectiveStep, bytes_moved_per_device, collective_time, latency_steps, reshard_steps,
    reshard_time, steps_time)
from .compute import BACKWARD_FACTOR, op_seconds, roofline_time
from .hardware import DeviceSpec, LinkRates, LinkSpec, dtype_name, parse_memory_size
from .memory import OptimizerSpec, optimizer_step_time
from .presets import PRESET_NAMES, load_cluster, preset_table

__all__ = [
    "ALL_GATHER",
    "ALL_REDUCE",
    "ALL_TO_ALL",
    "BACKWARD_FACTOR",
    "BROADCAST",
    "COLLECTIVE_KINDS",
    "PRESET_NAMES",
    "REDUCE_SCATTER",
    "SEND_RECV",
    "ClusterSpec",
    "CollectiveKind",
    "CollectiveStep",
    "DeviceSpec",
    "LinkRates",
    "LinkSpec",
    "OptimizerSpec",
    "bytes_moved_per_device",
    "cluster_from_toml",
    "collective_time",
    "dtype_name",
    "latency_steps",
    "load_cluster",
    "op_seconds",
    "optimizer_step_time",
    "parse_memory_size",
    "preset_table",
    "reshard_steps",
    "reshard_time",
    "roofline_time",
    "steps_time",
]
