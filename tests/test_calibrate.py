"""`autoplan calibrate`: the alpha-beta fit on synthetic timings, the TOML it writes, and one
quick end-to-end measurement of this machine that the planner then plans with."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autoplan.calibrate import (
    MEASURED_COLLECTIVES,
    Calibration,
    Sample,
    calibration_cluster,
    calibration_toml,
    fit_alpha_beta,
    fit_op_bandwidth,
)
from autoplan.calibrate.fit import MAX_BANDWIDTH, MIN_LATENCY_S, LinkFit, implausible
from autoplan.calibrate.worker import cpu_threads
from autoplan.cli import main, run
from autoplan.cost_models import (
    ALL_REDUCE,
    ALL_TO_ALL,
    BACKWARD_FACTOR,
    LinkSpec,
    collective_time,
    load_cluster,
)
from autoplan.trace.graph import NodeInfo
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent
SIZES = [4096 * 4**i for i in range(8)]  # 4 KiB .. 64 MiB


def _synthetic(link: LinkSpec, kinds=MEASURED_COLLECTIVES, ns=(2, 4, 8), noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    return [Sample(kind, n, float(b), collective_time(kind, b, n, link) * (1 + rng.uniform(-noise, noise)))
            for kind in kinds for n in ns for b in SIZES]


@pytest.mark.parametrize("kind", MEASURED_COLLECTIVES)
@pytest.mark.parametrize("link", [LinkSpec(450e9, 3e-6), LinkSpec(1e9, 80e-6), LinkSpec(3.125e9, 30e-6)])
def test_fit_recovers_the_alpha_beta_model(kind: str, link: LinkSpec) -> None:
    fit = fit_alpha_beta(_synthetic(link, kinds=(kind,), ns=(2,)), kind)
    assert fit.kind == kind and fit.points == len(SIZES)
    assert fit.alpha == pytest.approx(link.latency, rel=1e-9)
    assert fit.bandwidth == pytest.approx(link.bandwidth, rel=1e-9)
    assert fit.rms_rel_error < 1e-9


def test_joint_fit_over_kinds_and_device_counts_and_noise() -> None:
    link = LinkSpec(2e9, 50e-6)
    exact = fit_alpha_beta(_synthetic(link))
    assert exact.kind == "all" and exact.points == 4 * 3 * len(SIZES)
    assert (exact.alpha, exact.bandwidth) == (pytest.approx(50e-6, rel=1e-9), pytest.approx(2e9, rel=1e-9))
    noisy = fit_alpha_beta(_synthetic(link, noise=0.1, seed=1))
    assert noisy.alpha == pytest.approx(50e-6, rel=0.1) and noisy.bandwidth == pytest.approx(2e9, rel=0.1)
    assert 0.01 < noisy.rms_rel_error < 0.1


def test_fit_keeps_alpha_non_negative_and_refuses_what_it_cannot_fit() -> None:
    # Pure bandwidth timings minus a little: the free intercept would be negative.
    rows = [Sample(ALL_REDUCE, 2, b, b / 1e9 * 0.98 - 1e-7 if b < 1e5 else b / 1e9) for b in SIZES]
    fit = fit_alpha_beta(rows)
    assert fit.alpha == 0.0 and fit.bandwidth > 0
    with pytest.raises(ValueError, match="two message sizes"):
        fit_alpha_beta([Sample(ALL_TO_ALL, 2, 4096.0, 1e-4)] * 3)
    with pytest.raises(ValueError, match="do not grow"):
        fit_alpha_beta([Sample(ALL_REDUCE, 2, float(b), 1e-3 / (i + 1)) for i, b in enumerate(SIZES)])
    with pytest.raises(ValueError, match="positive"):
        fit_alpha_beta([Sample(ALL_REDUCE, 2, 4096.0, 0.0), Sample(ALL_REDUCE, 2, 8192.0, 1e-3)])


def _fake_calibration(devices: int = 2) -> Calibration:
    link = LinkSpec(1.5e9, 70e-6)
    return Calibration(
        devices=devices, backend="gloo", device_kind="cpu", device_name="cpu: test", threads=1,
        memory_bytes=12e9,
        matmul=[{"dtype": "float32", "shape": [512, 512, 512], "kind": "square", "flops": 1.23456789e11,
                 "repeats": 3},
                {"dtype": "bfloat16", "shape": [512, 512, 512], "kind": "square", "flops": 4e11, "repeats": 3}],
        bandwidth=[{"op": "copy", "bytes": 2**25, "bytes_per_s": 9.87654321e9}],
        samples=_synthetic(link, kinds=MEASURED_COLLECTIVES[:3], ns=(devices,)) if devices > 1 else [],
        skipped={ALL_TO_ALL: "gloo could not run it: no all_to_all"} if devices > 1 else {},
        seconds=1.0, load_average=1.5,
    )


def test_toml_reads_back_with_the_fits_as_comments(tmp_path: Path) -> None:
    cal = _fake_calibration()
    text = calibration_toml(cal, "fake")
    path = tmp_path / "fake.toml"
    path.write_text(text)
    cluster = load_cluster(str(path))
    assert cluster == calibration_cluster(cal, "fake")
    assert cluster.devices_per_node == 2 and cluster.device.memory_bytes == 12e9
    assert cluster.device.peak_flops == {"float32": 1.235e11, "bfloat16": 4e11}  # 4 significant digits
    assert cluster.intra_node.bandwidth == pytest.approx(1.5e9, rel=1e-3)
    assert cluster.intra_node.latency == pytest.approx(70e-6, rel=1e-3)
    assert cluster.inter_node.bandwidth <= cluster.intra_node.bandwidth
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert f"#   {kind} (written as intra_node.{kind}): alpha = 70 us, bandwidth = 1.5 GB/s" in text
        assert f"[intra_node.{kind}]" in text
        assert cluster.intra_node.rates(kind).latency == pytest.approx(70e-6, rel=1e-3)
    assert "[intra_node.all_to_all]" not in text and "[inter_node." not in text
    assert "#   all_to_all: skipped, gloo could not run it" in text
    assert "# inter_node: not measured" in text


def _node(target: str, flops: float, nbytes: float) -> NodeInfo:
    return NodeInfo("n", "op", target, (4, 4), "float32", 4, flops, nbytes, "", "", ())


def test_op_bandwidth_fit_inverts_the_cost_model() -> None:
    nodes = [_node("aten.linear.default", 2e9, 1e6), _node("aten.gelu.default", 0.0, 4e7),
             _node("aten.view.default", 0.0, 4e7),  # a view moves nothing: it only costs its overhead
             _node("aten.layer_norm.default", 0.0, 2e7)]
    peaks, overhead, bandwidth = {"float32": 1e11}, 2e-5, 2e9
    seconds = (1 + BACKWARD_FACTOR) * (2e9 / 1e11 + 6e7 / bandwidth + 4 * overhead)
    assert fit_op_bandwidth(nodes, seconds, peaks, overhead) == pytest.approx(bandwidth, rel=1e-9)
    # The matmul and the overhead alone take longer than measured: no rate can be told.
    assert fit_op_bandwidth(nodes, (1 + BACKWARD_FACTOR) * 2e9 / 1e11, peaks, overhead) == 0.0
    assert fit_op_bandwidth(nodes, 1e6, peaks, overhead, lowest=1e6) == 1e6  # slower than any rate: clamped
    # Where dispatch overlaps the device (a GPU), an op costs the larger of its roofline and the
    # overhead: the view and the layer norm (0.01 s at 2e9 B/s) cost what their rooflines do.
    seconds = (1 + BACKWARD_FACTOR) * (2e9 / 1e11 + 4e7 / bandwidth + overhead + 2e7 / bandwidth)
    assert fit_op_bandwidth(nodes, seconds, peaks, overhead, overlapped_dispatch=True) == pytest.approx(bandwidth,
                                                                                                      rel=1e-9)


def test_threads_follow_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_threads(1, 8) == 8 and cpu_threads(2, 8) == 1 and cpu_threads(4, 8) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1, 8) == 3 and cpu_threads(4, 8) == 3


def test_toml_carries_the_op_figures_and_warns_of_drift(tmp_path: Path) -> None:
    cal = _fake_calibration()
    cal.op_overhead_s, cal.eager_op_overhead_s = 52.3e-6, 7.4e-6
    cal.block = {"shape": [16, 64, 256], "seconds": 0.059, "op_bandwidth": 3.41e9}
    text = calibration_toml(cal, "fake")
    assert "op_overhead_us = 52.3" in text and "op_bandwidth_gbps = 3.41" in text
    assert "7.4 us eagerly" in text and "batch 16, sequence 64, hidden 256" in text
    assert "WARNING" not in text
    path = tmp_path / "fake.toml"
    path.write_text(text)
    assert load_cluster(str(path)).device.op_bandwidth == 3.41e9
    cal.matmul_again = cal.matmul[0]["flops"] / 2
    assert "# WARNING: the first matmul ran at" in calibration_toml(cal, "fake")


def test_a_gpu_file_charges_the_eager_overhead(tmp_path: Path) -> None:
    """On a GPU autoplan runs PyTorch's own programs (FSDP2, DDP, parallelize_module), which
    pay the eager dispatch, not the DTensor interpreter's; the file says which it wrote."""
    cal = replace(_fake_calibration(devices=1), device_kind="cuda", device_name="NVIDIA H200")
    cal.op_overhead_s, cal.eager_op_overhead_s = 136.8e-6, 30.1e-6
    text = calibration_toml(cal, "gpu")
    assert "op_overhead_us = 30.1" in text and "(written as op_overhead_us: the programs a GPU runs)" in text
    path = tmp_path / "gpu.toml"
    path.write_text(text)
    device = load_cluster(str(path)).device
    assert device.op_overhead_s == 30.1e-6 and device.overlapped_dispatch and device.matmul_efficiency == 1.0
    # and the interpreter's, stated beside the prediction of the plans it runs
    assert "interpreter_op_overhead_us = 136.8" in text and device.interpreter_op_overhead_s == 136.8e-6


def test_one_device_keeps_the_preset_links(tmp_path: Path) -> None:
    cal = _fake_calibration(devices=1)
    cluster = calibration_cluster(cal)
    assert cluster.intra_node == load_cluster("cpu").intra_node and cluster.devices_per_node == 1
    assert "intra_node: not measured (one process)" in calibration_toml(cal)


@pytest.mark.parametrize("args, needle", [
    (["--devices", "0", "-o", "{tmp}/x.toml"], "--devices must be at least 1"),
    (["--devices", "2", "-o", "{tmp}"], "is a directory"),
    (["--devices", "2", "-o", "/proc/no/such/x.toml"], "cannot write /proc/no/such/x.toml"),
    (["--devices", "2", "-o", "{tmp}/x.toml", "--backend", "mpi"], "--backend must be"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["calibrate", *(a.replace("{tmp}", str(tmp_path)) for a in args)])
    assert exit_.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert len(err) == 1 and err[0].startswith("autoplan: error:") and needle in err[0], err
    assert not (tmp_path / "x.toml").exists()


def test_implausible_fits_are_refused_not_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    """A fit faster than any link (the 17.8 TB/s, 0.08 us all-reduce a busy machine once gave)
    is left out of the file, named in a comment and warned about; the joint fit applies."""
    assert implausible(LinkFit("all_reduce", 8e-8, 1.78e13, 8, 0.7)).startswith("latency 0.08 us is below 0.5 us")
    assert "above 2 TB/s" in implausible(LinkFit("all_reduce", 1e-5, 2 * MAX_BANDWIDTH, 8, 0.1))
    assert "rms error 62% is above 50%" in implausible(LinkFit("all_gather", 1e-5, 1e9, 8, 0.62))
    assert implausible(LinkFit("all_gather", MIN_LATENCY_S, 1e9, 8, 0.1)) is None
    cal = _fake_calibration()
    absurd = LinkSpec(1.78e13, 8e-8)
    cal.samples = [s for s in cal.samples if s.kind != ALL_REDUCE] + _synthetic(absurd, kinds=(ALL_REDUCE,), ns=(2,))
    assert "all_reduce" in cal.refused_fits() and "all_reduce" not in cal.fits()
    text = calibration_toml(cal, "fake")
    assert "[intra_node.all_reduce]" not in text and "[intra_node.all_gather]" in text
    assert "#   all_reduce: REFUSED, not written: the all_reduce fit (latency 0.08 us" in text
    path = tmp_path / "fake.toml"
    path.write_text(text)
    assert load_cluster(str(path)).intra_node.rates("all_reduce") == load_cluster(str(path)).intra_node.rates("send_recv")

    import autoplan.calibrate.command as command

    monkeypatch.setattr(command, "calibrate", lambda settings: cal)
    assert run(["calibrate", "--devices", "2", "-o", str(tmp_path / "out.toml")]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "implausible" in line]
    assert warnings[0].startswith("autoplan: warning: calibrate: the all_reduce fit (latency 0.08 us")
    assert "the joint fit applies" in warnings[0]
    assert len(warnings) == 2 and "the all fit" in warnings[1] and "the preset's link applies" in warnings[1]


def test_quick_calibration_on_this_machine_plans(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The whole command on this machine: it completes and writes a file the planner reads and
    plans with. The figures depend on the machine and its load: only their presence is checked."""
    out = tmp_path / "tmp" / "cpu.toml"
    result = subprocess.run([sys.executable, "-m", "autoplan", "calibrate", "--devices", "2", "-o", str(out),
                             "--quick"], cwd=tmp_path, capture_output=True, text=True, timeout=backstop(300))
    assert result.returncode == 0, result.stderr
    assert f"wrote {out}" in result.stdout
    assert [p.name for p in out.parent.iterdir()] == ["cpu.toml"]  # no temporary file left behind
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as the umask allows, not mkstemp's 0600

    cluster = load_cluster(str(out))
    dev = cluster.device
    assert cluster.devices_per_node == 2
    assert {"float32", "bfloat16"} <= set(dev.peak_flops) and all(v > 0 for v in dev.peak_flops.values())
    assert dev.memory_bandwidth > 0 and dev.memory_bytes > 0 and dev.op_overhead_s > 0
    text = out.read_text()
    for kind in MEASURED_COLLECTIVES:  # each collective is fitted, refused with a reason, or skipped
        assert (f"#   {kind} (written as intra_node.{kind})" in text or f"#   {kind}: REFUSED" in text
                or f"#   {kind}: skipped" in text or f"#   {kind}: timings did not fit" in text), kind

    plan_dir = tmp_path / "plan"
    assert run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--cluster", str(out), "--no-pipeline",
                "--out", str(plan_dir)]) == 0
    summary = capsys.readouterr().out
    assert f"2 x cpu ({cluster.name})" in summary
    assert (plan_dir / "plan.json").is_file()
    assert math.isfinite(float(summary.split("predicted: ")[1].split(" ")[0]))
