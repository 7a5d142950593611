"""A cluster: identical devices grouped into nodes, a fast link inside a node and a slower one
between nodes; which of the two each mesh axis uses; and the cluster's dict/TOML forms.

TOML form (what ``autoplan calibrate`` writes and :func:`cluster_from_toml` reads)::

    name = "my-cluster"
    preset = "h100"            # optional: start from a preset, the keys below override it
    devices_per_node = 8
    [device]
    name = "h100"
    memory_gb = 80             # decimal GB
    memory_bandwidth_gbps = 3350   # GB/s
    op_overhead_us = 0         # optional: microseconds one op costs beyond its roofline (dispatch)
    op_bandwidth_gbps = 0      # optional: GB/s ops achieve on activations (0: memory_bandwidth_gbps)
    overlapped_dispatch = true # optional: the host dispatches ahead of the device (GPUs; false on CPUs)
    matmul_efficiency = 1      # optional: fraction of peak_tflops ops achieve (1 where the file gives peaks)
    interpreter_op_overhead_us = 105  # optional: microseconds of one op pass on the DTensor interpreter
    [device.peak_tflops]
    float32 = 67
    bfloat16 = 989
    [intra_node]
    bandwidth_gbps = 450       # GB/s
    latency_us = 3
    [intra_node.reduce_scatter]  # optional: one collective kind's own rates over this link
    bandwidth_gbps = 400
    latency_us = 5
    [inter_node]
    bandwidth_gbps = 50
    latency_us = 10

A file that starts from a GPU preset keeps the preset's fractions (its ops at 0.78 of the peaks,
at 0.9 of the bandwidth) unless it gives its own ``peak_tflops`` or ``memory_bandwidth_gbps``:
those are taken as what its ops achieve (measured), unless ``matmul_efficiency`` or
``op_bandwidth_gbps`` says otherwise.

Numbers are converted with decimal arithmetic, so ``to_toml`` followed by reading gives back
exactly the same floats.
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

from autoplan.errors import AutoplanError

from .communication import COLLECTIVE_KINDS
from .hardware import DeviceSpec, LinkRates, LinkSpec


@dataclass(frozen=True)
class ClusterSpec:
    """``devices_per_node`` identical ``device``\\ s per node; ``intra_node`` links devices of
    one node, ``inter_node`` devices of different nodes."""

    name: str
    device: DeviceSpec
    devices_per_node: int
    intra_node: LinkSpec
    inter_node: LinkSpec

    def with_overrides(
        self, devices_per_node: int | None = None, memory_per_device: float | None = None
    ) -> ClusterSpec:
        """A copy with another node size and/or another memory per device (bytes)."""
        out = self
        if devices_per_node is not None:
            if isinstance(devices_per_node, bool) or not isinstance(devices_per_node, int) or devices_per_node < 1:
                raise AutoplanError(f"devices per node must be a positive integer, not {devices_per_node!r}")
            out = replace(out, devices_per_node=devices_per_node)
        if memory_per_device is not None:
            if not memory_per_device > 0:
                raise AutoplanError(f"memory per device must be positive, not {memory_per_device!r}")
            out = replace(out, device=replace(out.device, memory_bytes=float(memory_per_device)))
        return out

    def mesh_links(self, mesh_shape: tuple[int, ...]) -> tuple[LinkSpec, ...]:
        """The link each mesh axis communicates over.

        Ranks are numbered row-major over the mesh and a node holds consecutive ranks
        (node = rank // devices_per_node). An axis gets ``intra_node`` when every one of its
        communication groups lies inside one node, else ``inter_node``.
        """
        if any(n < 1 for n in mesh_shape):
            raise ValueError(f"mesh shape {mesh_shape} has an axis smaller than 1")
        return tuple(
            self.intra_node if _axis_within_nodes(mesh_shape, axis, self.devices_per_node) else self.inter_node
            for axis in range(len(mesh_shape))
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-able form in base units (bytes, bytes/s, FLOP/s, seconds)."""
        return {
            "name": self.name,
            "devices_per_node": self.devices_per_node,
            "device": {
                "name": self.device.name,
                "peak_flops": dict(self.device.peak_flops),
                "memory_bandwidth": self.device.memory_bandwidth,
                "memory_bytes": self.device.memory_bytes,
                "op_overhead_s": self.device.op_overhead_s,
                "op_bandwidth": self.device.op_bandwidth,
                "overlapped_dispatch": self.device.overlapped_dispatch,
                "matmul_efficiency": self.device.matmul_efficiency,
                "interpreter_op_overhead_s": self.device.interpreter_op_overhead_s,
            },
            "intra_node": _link_dict(self.intra_node),
            "inter_node": _link_dict(self.inter_node),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterSpec:
        """Inverse of :meth:`to_dict`."""
        dev = data["device"]
        return cls(
            name=data["name"],
            device=DeviceSpec(
                name=dev["name"],
                peak_flops={k: float(v) for k, v in dev["peak_flops"].items()},
                memory_bandwidth=float(dev["memory_bandwidth"]),
                memory_bytes=float(dev["memory_bytes"]),
                op_overhead_s=float(dev.get("op_overhead_s", 0.0)),
                op_bandwidth=float(dev.get("op_bandwidth", 0.0)),
                overlapped_dispatch=bool(dev.get("overlapped_dispatch", False)),
                matmul_efficiency=float(dev.get("matmul_efficiency", 1.0)),
                interpreter_op_overhead_s=float(dev.get("interpreter_op_overhead_s", 0.0)),
            ),
            devices_per_node=int(data["devices_per_node"]),
            intra_node=_link_from_dict(data["intra_node"]),
            inter_node=_link_from_dict(data["inter_node"]),
        )

    def to_toml(self) -> str:
        """The TOML form (GB, GB/s, TFLOP/s, microseconds), written by ``tomli_w``; reads back
        to an equal spec."""
        import tomli_w

        dev = self.device
        device: dict[str, Any] = {
            "name": dev.name,
            "memory_gb": _to_unit(dev.memory_bytes, _GIGA),
            "memory_bandwidth_gbps": _to_unit(dev.memory_bandwidth, _GIGA),
            "op_overhead_us": _to_unit(dev.op_overhead_s, _MICRO),
        }
        if dev.op_bandwidth:
            device["op_bandwidth_gbps"] = _to_unit(dev.op_bandwidth, _GIGA)
        device["overlapped_dispatch"] = dev.overlapped_dispatch
        if dev.matmul_efficiency != 1.0:
            device["matmul_efficiency"] = dev.matmul_efficiency
        if dev.interpreter_op_overhead_s:
            device["interpreter_op_overhead_us"] = _to_unit(dev.interpreter_op_overhead_s, _MICRO)
        device["peak_tflops"] = {k: _to_unit(v, _TERA) for k, v in dev.peak_flops.items()}
        document: dict[str, Any] = {"name": self.name, "devices_per_node": self.devices_per_node, "device": device}
        for section, link in (("intra_node", self.intra_node), ("inter_node", self.inter_node)):
            table: dict[str, Any] = {"bandwidth_gbps": _to_unit(link.bandwidth, _GIGA),
                                     "latency_us": _to_unit(link.latency, _MICRO)}
            for kind, rates in link.per_kind:
                table[str(kind)] = {"bandwidth_gbps": _to_unit(rates.bandwidth, _GIGA),
                                    "latency_us": _to_unit(rates.latency, _MICRO)}
            document[section] = table
        return tomli_w.dumps(document)


def _link_dict(link: LinkSpec) -> dict[str, Any]:
    out: dict[str, Any] = {"bandwidth": link.bandwidth, "latency": link.latency}
    if link.per_kind:
        out["per_kind"] = {k: {"bandwidth": r.bandwidth, "latency": r.latency} for k, r in link.per_kind}
    return out


def _link_from_dict(data: Mapping[str, Any]) -> LinkSpec:
    per_kind = tuple((k, LinkRates(float(r["bandwidth"]), float(r["latency"])))
                     for k, r in data.get("per_kind", {}).items())
    return LinkSpec(float(data["bandwidth"]), float(data["latency"]), per_kind)


def _axis_within_nodes(mesh_shape: tuple[int, ...], axis: int, devices_per_node: int) -> bool:
    """True when every group of mesh axis ``axis`` ({base + k*stride}) sits inside one node."""
    n = mesh_shape[axis]
    stride = math.prod(mesh_shape[axis + 1 :])
    block = n * stride
    total = math.prod(mesh_shape)
    for outer in range(0, total, block):
        for inner in range(stride):
            first = outer + inner
            last = first + (n - 1) * stride  # ranks grow along the group, so nodes do too
            if first // devices_per_node != last // devices_per_node:
                return False
    return True


# ---------------------------------------------------------------------------------------------
# TOML reading and writing

_GIGA, _TERA, _MICRO = 9, 12, -6  # decimal exponents of the TOML units


def _to_unit(value: float, exponent: int) -> float:
    """``value`` divided by 10**exponent: the float nearest the exact shifted decimal (what a
    TOML reader makes of that decimal), so a spec reads back equal."""
    return float(Decimal(repr(float(value))).scaleb(-exponent))


def cluster_from_toml(text: str, source: str, presets: Mapping[str, ClusterSpec]) -> ClusterSpec:
    """Read the TOML form. ``source`` names the file in error messages; ``presets`` (keyed by
    lower-case name) resolves the optional ``preset = "..."`` key. Problems raise a one-line
    AutoplanError naming the file and the key."""
    try:
        data = tomllib.loads(text, parse_float=Decimal)
    except tomllib.TOMLDecodeError as exc:
        raise AutoplanError(f"cannot read cluster file {source}: {_one_line(str(exc))}") from None
    return _TomlReader(source, presets).read(data)


def _one_line(text: str) -> str:
    return " ".join(text.split())


class _TomlReader:
    """Turns parsed TOML into a ClusterSpec, reporting the first problem by file and key."""

    _TOP = ("name", "preset", "devices_per_node", "device", "intra_node", "inter_node")
    _DEVICE = ("name", "memory_gb", "memory_bandwidth_gbps", "op_overhead_us", "op_bandwidth_gbps",
               "overlapped_dispatch", "matmul_efficiency", "interpreter_op_overhead_us", "peak_tflops")
    _LINK = ("bandwidth_gbps", "latency_us")
    _LINK_TABLES = _LINK + COLLECTIVE_KINDS

    def __init__(self, source: str, presets: Mapping[str, ClusterSpec]) -> None:
        self.source = source
        self.presets = presets

    def fail(self, key: str, problem: str) -> AutoplanError:
        return AutoplanError(f"cluster file {self.source}: key '{key}': {problem}")

    def read(self, data: dict[str, Any]) -> ClusterSpec:
        self._check_keys(data, self._TOP, "")
        base = self._preset(data)
        name = self._string(data, "name", "name", base.name if base else Path(self.source).stem)
        dpn = data.get("devices_per_node")
        if dpn is None:
            if base is None:
                raise self.fail("devices_per_node", "missing")
            dpn = base.devices_per_node
        elif isinstance(dpn, bool) or not isinstance(dpn, int) or dpn < 1:
            raise self.fail("devices_per_node", f"must be a positive integer, not {dpn!r}")
        return ClusterSpec(
            name=name,
            device=self._device(self._table(data, "device", base is None), base.device if base else None),
            devices_per_node=dpn,
            intra_node=self._link(data, "intra_node", base.intra_node if base else None),
            inter_node=self._link(data, "inter_node", base.inter_node if base else None),
        )

    def _preset(self, data: dict[str, Any]) -> ClusterSpec | None:
        if "preset" not in data:
            return None
        name = self._string(data, "preset", "preset", None)
        preset = self.presets.get(name.lower())
        if preset is None:
            raise self.fail("preset", f"unknown preset {name!r} (use one of {', '.join(self.presets)})")
        return preset

    def _device(self, table: dict[str, Any], base: DeviceSpec | None) -> DeviceSpec:
        self._check_keys(table, self._DEVICE, "device.")
        need = base is None
        peaks_table = self._table(table, "peak_tflops", need, "device.peak_tflops")
        peaks = dict(base.peak_flops) if base else {}
        for dtype, value in peaks_table.items():
            peaks[dtype] = self._number(peaks_table, dtype, f"device.peak_tflops.{dtype}", _TERA, positive=True)
        if "float32" not in peaks:
            raise self.fail("device.peak_tflops.float32", "missing")
        return DeviceSpec(
            name=self._string(table, "name", "device.name", base.name if base else "device"),
            peak_flops=peaks,
            memory_bandwidth=self._number(
                table, "memory_bandwidth_gbps", "device.memory_bandwidth_gbps", _GIGA, True,
                base.memory_bandwidth if base else None,
            ),
            memory_bytes=self._number(
                table, "memory_gb", "device.memory_gb", _GIGA, True, base.memory_bytes if base else None
            ),
            op_overhead_s=self._number(
                table, "op_overhead_us", "device.op_overhead_us", _MICRO, False, base.op_overhead_s if base else 0.0
            ),
            # a file's own peaks or bandwidth are what ops achieve, unless it says otherwise: the
            # preset's fractions of its datasheet figures do not carry over to them
            op_bandwidth=self._number(
                table, "op_bandwidth_gbps", "device.op_bandwidth_gbps", _GIGA, False,
                base.op_bandwidth if base and "memory_bandwidth_gbps" not in table else 0.0
            ),
            overlapped_dispatch=self._flag(table, "overlapped_dispatch", "device.overlapped_dispatch",
                                           base.overlapped_dispatch if base else False),
            matmul_efficiency=self._fraction(table, "matmul_efficiency", "device.matmul_efficiency",
                                             base.matmul_efficiency if base and "peak_tflops" not in table else 1.0),
            interpreter_op_overhead_s=self._number(
                table, "interpreter_op_overhead_us", "device.interpreter_op_overhead_us", _MICRO, False,
                base.interpreter_op_overhead_s if base else 0.0
            ),
        )

    def _link(self, data: dict[str, Any], section: str, base: LinkSpec | None) -> LinkSpec:
        table = self._table(data, section, base is None)
        self._check_keys(table, self._LINK_TABLES, section + ".")
        rates = self._rates(table, section, LinkRates(base.bandwidth, base.latency) if base else None)
        per_kind = dict(base.per_kind) if base else {}
        for kind in COLLECTIVE_KINDS:
            if kind in table:
                dotted = f"{section}.{kind}"
                kind_table = self._table(table, kind, True, dotted)
                self._check_keys(kind_table, self._LINK, dotted + ".")
                per_kind[kind] = self._rates(kind_table, dotted, rates)
        return LinkSpec(rates.bandwidth, rates.latency, tuple((k, per_kind[k]) for k in COLLECTIVE_KINDS if k in per_kind))

    def _rates(self, table: dict[str, Any], section: str, base: LinkRates | None) -> LinkRates:
        return LinkRates(
            bandwidth=self._number(
                table, "bandwidth_gbps", f"{section}.bandwidth_gbps", _GIGA, True, base.bandwidth if base else None
            ),
            latency=self._number(
                table, "latency_us", f"{section}.latency_us", _MICRO, False, base.latency if base else None
            ),
        )

    def _check_keys(self, table: dict[str, Any], allowed: tuple[str, ...], prefix: str) -> None:
        for key in table:
            if key not in allowed:
                raise self.fail(prefix + key, f"unknown key (expected one of {', '.join(allowed)})")

    def _table(self, data: dict[str, Any], key: str, required: bool, dotted: str | None = None) -> dict[str, Any]:
        dotted = dotted or key
        if key not in data:
            if required:
                raise self.fail(dotted, "missing")
            return {}
        value = data[key]
        if not isinstance(value, dict):
            raise self.fail(dotted, "must be a table")
        return value

    def _string(self, data: dict[str, Any], key: str, dotted: str, default: str | None) -> str:
        if key not in data:
            if default is None:
                raise self.fail(dotted, "missing")
            return default
        value = data[key]
        if not isinstance(value, str) or not value:
            raise self.fail(dotted, f"must be a non-empty string, not {value!r}")
        return value

    def _flag(self, data: dict[str, Any], key: str, dotted: str, default: bool) -> bool:
        value = data.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(dotted, f"must be true or false, not {value!r}")
        return value

    def _fraction(self, data: dict[str, Any], key: str, dotted: str, default: float) -> float:
        value = self._number(data, key, dotted, 0, True, default)
        if value > 1.0:
            raise self.fail(dotted, f"must be a fraction in (0, 1], not {data[key]}")
        return value

    def _number(
        self,
        data: dict[str, Any],
        key: str,
        dotted: str,
        exponent: int,
        positive: bool,
        default: float | None = None,
    ) -> float:
        if key not in data:
            if default is None:
                raise self.fail(dotted, "missing")
            return default
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, (int, Decimal)) or not Decimal(value).is_finite():
            shown = str(value) if isinstance(value, Decimal) else repr(value)
            raise self.fail(dotted, f"must be a number, not {shown}")
        if (positive and value <= 0) or value < 0:
            raise self.fail(dotted, f"must be {'positive' if positive else 'zero or more'}, not {value}")
        return float(Decimal(value).scaleb(exponent))
