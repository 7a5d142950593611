"""The cluster a calibration gives, and the TOML file with the measurements as comments."""

from __future__ import annotations

import math
import socket
import time

from autoplan.calibrate.fit import LinkFit
from autoplan.calibrate.results import DRIFT_WARNING, MEASURED_COLLECTIVES, Calibration, format_si, format_size
from autoplan.cost_models import COLLECTIVE_KINDS, ClusterSpec, DeviceSpec, LinkRates, LinkSpec
from autoplan.cost_models.presets import preset_table


def _round(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits (measured figures carry no more)."""
    if value == 0 or not math.isfinite(value):
        return value
    return float(f"{value:.{digits - 1}e}")


def _base_preset(cal: Calibration) -> ClusterSpec:
    presets = preset_table()
    if cal.device_kind == "cpu":
        return presets["cpu"]
    lowered = cal.device_name.lower()
    for key in ("h200", "h100", "a100-80g" if "80" in lowered else "a100-40g", "v100-16g"):
        if key.split("-")[0] in lowered:
            return presets[key]
    return presets["h100"]


def drift_text(cal: Calibration) -> str:
    return (f"the first matmul ran at {format_si(cal.matmul[0]['flops'], 'FLOP/s')} at the start and "
            f"{format_si(cal.matmul_again, 'FLOP/s')} at the end: the machine's load changed while measuring; "
            f"calibrate again on an idle machine")


def written_op_overhead(cal: Calibration) -> float:
    """The per-op overhead the cluster file charges: on a GPU the eager figure, as PyTorch's own
    programs (FSDP2, DDP, ``parallelize_module``) that autoplan runs there pay it (the H200's
    Llama 1B step was measured at 0.39 of its prediction with the DTensor figure, 0.99 with
    the eager one); on a CPU the DTensor program's, which the fidelity benchmark's gloo runs
    are measured against."""
    if cal.device_kind != "cpu" and cal.eager_op_overhead_s > 0:
        return cal.eager_op_overhead_s
    return cal.op_overhead_s


def calibration_cluster(cal: Calibration, name: str | None = None) -> ClusterSpec:
    """The cluster spec the measurement gives: one node of ``cal.devices`` devices."""
    base = _base_preset(cal)
    fits = cal.fits()
    joint = fits.get("all")
    per_kind = tuple((kind, LinkRates(_round(fits[kind].bandwidth), _round(fits[kind].alpha)))
                     for kind in COLLECTIVE_KINDS if kind in fits)
    intra = (LinkSpec(_round(joint.bandwidth), _round(joint.alpha), per_kind) if joint
             else LinkSpec(base.intra_node.bandwidth, base.intra_node.latency, per_kind))
    inter = LinkSpec(min(base.inter_node.bandwidth, intra.bandwidth), max(base.inter_node.latency, intra.latency))
    peaks = {k: _round(v) for k, v in cal.peak_flops.items()}
    device_name = "cpu" if cal.device_kind == "cpu" else cal.device_name
    device = DeviceSpec(device_name, peaks, _round(cal.memory_bandwidth), float(int(cal.memory_bytes)),
                        _round(written_op_overhead(cal)), _round(cal.op_bandwidth),
                        overlapped_dispatch=cal.device_kind != "cpu",
                        interpreter_op_overhead_s=_round(cal.op_overhead_s))
    host = socket.gethostname().split(".")[0] or "this-machine"
    return ClusterSpec(name or f"{host}-{cal.devices}x{cal.device_kind}", device, cal.devices, intra, inter)


def _op_comments(cal: Calibration) -> list[str]:
    """Comment lines on the per-op overhead (op_overhead_us) and the op bandwidth (op_bandwidth_gbps)."""
    lines: list[str] = []
    if cal.op_overhead_s:
        eager_written = written_op_overhead(cal) != cal.op_overhead_s
        interpreter_note = " (written as interpreter_op_overhead_us)" if eager_written else \
            " (written as op_overhead_us and interpreter_op_overhead_us)"
        eager_note = " (written as op_overhead_us: the programs a GPU runs)" if eager_written else ""
        lines += [f"# per-op overhead (a tiny transformer block's training step, per op pass): {cal.op_overhead_s * 1e6:.3g} us",
                  (f"#   as the DTensor program autoplan emits{interpreter_note}; "
                   f"{cal.eager_op_overhead_s * 1e6:.3g} us eagerly (FSDP2, DDP, parallelize_module){eager_note}.")]
    if cal.block:
        batch, seq, hidden = cal.block["shape"]
        fitted = (f"{format_si(cal.op_bandwidth, 'B/s')} (written as op_bandwidth_gbps)" if cal.op_bandwidth
                  else "none fits (matmuls and overhead explain the step): memory_bandwidth_gbps applies")
        lines += [(f"# op bandwidth: a transformer block (batch {batch}, sequence {seq}, hidden {hidden}) takes "
                   f"{cal.block['seconds'] * 1e3:.3g} ms a step as the DTensor program;"),
                  ("#   the cost model predicts that with matmuls at the float32 peak, the per-op overhead and the ops' "
                   f"bytes at {fitted}.")]
    return lines


def calibration_toml(cal: Calibration, name: str | None = None) -> str:
    """The TOML file: :meth:`ClusterSpec.to_toml` with the measurements as comments."""
    cluster = calibration_cluster(cal, name)
    base = _base_preset(cal)
    fits = cal.fits()
    refused = cal.refused_fits()
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    head = [
        f"# Written by `autoplan calibrate --devices {cal.devices}` on {socket.gethostname()} at {when} "
        f"({cal.seconds:.1f} s).",
        f"# {cal.devices} {'process' if cal.devices == 1 else 'processes'} measured at once ({cal.backend}"
        + (f", {cal.threads} CPU thread{'s' if cal.threads != 1 else ''} each" if cal.threads else "")
        + f") on {cal.device_name};",
        "# every figure is the median of repeats after warm-up"
        + (", on the slowest rank." if cal.devices > 1 else "."),
    ]
    if cal.load_average is not None:
        head.append(f"# Load average at the start: {cal.load_average:.2f} (other processes may have slowed it).")
    if cal.drift > DRIFT_WARNING:
        head.append(f"# WARNING: {drift_text(cal)}")
    if cal.device_kind == "cpu":
        head.append(f"# device.memory_gb: the machine's RAM divided by {cal.devices}.")
    head += ["#", "# matmul (M x K x N):"]
    head += [f"#   {r['dtype']:8s} {r['kind']:6s} {'x'.join(map(str, r['shape'])):>16s}: {format_si(r['flops'], 'FLOP/s')}"
             for r in cal.matmul]
    head += ["# memory bandwidth (bytes moved / time):"]
    head += [f"#   {r['op']:4s} {format_size(r['bytes'])}: {format_si(r['bytes_per_s'], 'B/s')}" for r in cal.bandwidth]
    head += _op_comments(cal)
    if cal.devices > 1:
        head += ["#", "# collectives: alpha-beta fit of t = latency_steps*alpha + bytes_moved_per_device/bandwidth",
                 "# (autoplan.cost_models.communication's ring model; least squares on relative errors):"]
        for kind in (*MEASURED_COLLECTIVES, "all"):
            if kind in fits:
                f = fits[kind]
                label = ("joint fit, written as intra_node (send_recv's rates)" if kind == "all"
                         else f"{kind} (written as intra_node.{kind})")
                head.append(f"#   {label}: alpha = {f.alpha * 1e6:.3g} us, bandwidth = {format_si(f.bandwidth, 'B/s')} "
                            f"({f.points} sizes, rms error {f.rms_rel_error:.0%})")
            elif kind in refused:
                head.append(f"#   {kind}: REFUSED, not written: {refusal_text(kind, *refused[kind])}")
            elif kind in cal.skipped:
                head.append(f"#   {kind}: skipped, {cal.skipped[kind]}")
            elif kind != "all":
                head.append(f"#   {kind}: timings did not fit the model (no bandwidth)")
        sizes = sorted({s.nbytes for s in cal.samples})
        if sizes:
            head.append(f"#   message sizes {format_size(sizes[0])} .. {format_size(sizes[-1])}, float32.")
        head += ["#   measured (kind, bytes, seconds):"]
        head += [f"#     {s.kind} {int(s.nbytes)} {s.seconds:.4g}" for s in cal.samples]
        if "all" not in fits:
            head.append(f"# intra_node: the collectives could not be fitted; the {base.name} preset's link.")
    else:
        head += ["#", f"# intra_node: not measured (one process); the {base.name} preset's link."]
    body = cluster.to_toml()
    inter_note = (f"# inter_node: not measured (one machine is one node); the {base.name} preset's link, "
                  "no faster than intra_node.\n")
    body = body.replace("\n[inter_node]\n", "\n" + inter_note + "[inter_node]\n")
    return "\n".join(head) + "\n\n" + body


def refusal_text(kind: str, fit: LinkFit, why: str) -> str:
    """One line on a fit left out as implausible, and what applies instead."""
    instead = "the preset's link applies" if kind == "all" else "the joint fit applies"
    return (f"the {kind} fit (latency {fit.alpha * 1e6:.3g} us, bandwidth {format_si(fit.bandwidth, 'B/s')}, "
            f"rms error {fit.rms_rel_error:.0%}) is implausible: {why}; {instead}; calibrate again on an idle machine")
