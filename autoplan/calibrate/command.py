"""``autoplan calibrate``: the command line."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from autoplan.arguments import OneLineParser
from autoplan.calibrate.cluster_file import calibration_toml, drift_text, refusal_text
from autoplan.calibrate.measure import calibrate
from autoplan.calibrate.results import DRIFT_WARNING, CalibrateSettings, format_si
from autoplan.cost_models.cluster import cluster_from_toml
from autoplan.cost_models.presets import preset_table
from autoplan.errors import AutoplanError


def add_calibrate_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``autoplan calibrate`` (the main command registers them as a subcommand)."""
    parser.add_argument("--devices", type=int, required=True,
                        help="number of processes (GPUs with nccl) to measure with; one machine is one node")
    parser.add_argument("-o", "--output", required=True, help="the cluster TOML file to write")
    parser.add_argument("--quick", action="store_true", help="fewer, smaller measurements (a few seconds)")
    parser.add_argument("--backend", default="auto", help="auto (nccl with CUDA, else gloo), gloo or nccl")
    parser.add_argument("--name", default=None, help="the cluster's name in the file (default HOST-NxKIND)")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="autoplan calibrate",
        description="Measure this machine (matmul throughput, memory bandwidth, collectives over N processes) "
                    "and write a cluster TOML file for `autoplan MODEL.py --cluster FILE`.",
    )
    add_calibrate_arguments(parser)
    return parser


def _check_writable(path: Path) -> None:
    """Fail before measuring when ``path`` cannot be written."""
    if path.is_dir():
        raise AutoplanError(f"cannot write {path}: it is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        raise AutoplanError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path`` and rename it over ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~umask)  # mkstemp gives 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def run_calibrate(argv: Sequence[str]) -> int:
    """``autoplan calibrate ...`` from its arguments alone."""
    return run_calibrate_args(build_parser().parse_args(list(argv)))


def run_calibrate_args(args: argparse.Namespace) -> int:
    """Measure, check the fits, write the file; user errors raise AutoplanError (one line, exit 2)."""
    if args.devices < 1:
        raise AutoplanError(f"--devices must be at least 1, got {args.devices}")
    out = Path(args.output)
    _check_writable(out)
    settings = (CalibrateSettings.quick_for(args.devices, args.backend) if args.quick
                else CalibrateSettings(args.devices, args.backend))
    cal = calibrate(settings)
    text = calibration_toml(cal, args.name)
    cluster = cluster_from_toml(text, str(out), preset_table())  # what load_cluster will read
    try:
        write_atomically(out, text)
    except OSError as exc:
        raise AutoplanError(f"cannot write {out}: {exc.strerror or exc}") from None
    dev = cluster.device
    peaks = ", ".join(f"{k} {format_si(v, 'FLOP/s')}" for k, v in dev.peak_flops.items())
    print(f"{cluster.name}: {cluster.devices_per_node} x {dev.name}; peak {peaks}; memory bandwidth "
          f"{format_si(dev.memory_bandwidth, 'B/s')}; memory {format_si(dev.memory_bytes, 'B')} per device")
    print(f"intra_node: bandwidth {format_si(cluster.intra_node.bandwidth, 'B/s')}, latency "
          f"{cluster.intra_node.latency * 1e6:.3g} us; inter_node: bandwidth "
          f"{format_si(cluster.inter_node.bandwidth, 'B/s')}, latency {cluster.inter_node.latency * 1e6:.3g} us")
    for kind, reason in cal.skipped.items():
        print(f"skipped {kind}: {reason}")
    for kind, (fit, why) in cal.refused_fits().items():
        print(f"autoplan: warning: calibrate: {refusal_text(kind, fit, why)}", file=sys.stderr)
    if cal.drift > DRIFT_WARNING:
        print(f"warning: {drift_text(cal)}")
    print(f"wrote {out} in {cal.seconds:.1f} s")
    return 0
