"""`autoplan --run --check` and the emitted train.py under torchrun (gloo, CPU processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli import run
from autoplan.codegen.check import CheckReport, Comparison
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent


def _torchrun(script: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(nproc), str(script), *args], capture_output=True, text=True, timeout=backstop(300))


@pytest.mark.parametrize("precision, tolerances", [
    ("fp32", "rtol=0.0001, atol=1e-05 (fp32)"),
    ("bf16", "rtol=0.03, atol=0.003 (bf16 under torch.autocast, the reference too)"),
])
def test_run_check_passes_for_the_mlp_on_two_processes(precision: str, tolerances: str, tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "autoplan.cli", str(ROOT / "examples" / "mlp.py"), "--devices", "2",
                             "--precision", precision, "--run", "--check", "--steps", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=backstop(300))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: PASSED" in result.stdout
    assert "largest difference" in result.stdout and tolerances in result.stdout
    assert (tmp_path / "train.py").is_file()


@pytest.fixture(scope="module")
def planned_for_four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("four")
    assert run([str(ROOT / "examples" / "mlp.py"), "--devices", "4", "--out", str(out)]) == 0
    return out


def _edit_plan(folder: Path, **changes: object) -> None:
    path = folder / "plan.json"
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("changes, needle", [
    ({}, "the plan is for 4 devices but this job has 2 processes"),
    ({"graph_hash": "0123456789abcdef"}, "plan.json was made for another model"),
    ({"format": "autoplan.plan/1"}, "is of format 'autoplan.plan/1'"),
])
def test_train_script_refuses_a_plan_that_does_not_fit(planned_for_four: Path, tmp_path: Path, changes: dict,
                                                        needle: str) -> None:
    folder = planned_for_four.parent / f"{tmp_path.name}-out"  # beside the original: train.py finds model.py alike
    folder.mkdir()
    for name in ("plan.json", "train.py"):
        (folder / name).write_text((planned_for_four / name).read_text())
    _edit_plan(folder, **changes)
    nproc = 4 if changes else 2
    result = _torchrun(folder / "train.py", nproc, "--steps", "1")
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("autoplan: error:")]
    assert len(errors) == 1 and needle in errors[0], result.stderr[-3000:]


def test_check_report_fails_naming_the_worst_tensor() -> None:
    report = CheckReport(1e-4, 1e-5, [Comparison("loss", 1e-7, 1e-5), Comparison("grad up.weight", 3e-3, 1e-4)],
                         executed={"forward": {"all_reduce": 1}}, planned={"forward": {"all_reduce": 1}})
    assert not report.ok and report.collectives_ok
    text = report.text()
    assert "MISMATCH grad up.weight" in text and "FAILED" in text and report.worst.name == "grad up.weight"
    report2 = CheckReport(1e-4, 1e-5, [Comparison("loss", 0.0, 1e-5)],
                          executed={"forward": {"all_reduce": 2}}, planned={"forward": {"all_reduce": 1}})
    assert report2.values_ok and not report2.collectives_ok and "<- differs" in report2.text()


def test_pipeline_check_report_compares_every_rank() -> None:
    agree = {"step, rank 0": {"all_gather": 2, "broadcast": 1}, "step, rank 1": {"broadcast": 1}}
    report = CheckReport(1e-4, 1e-5, [Comparison("loss", 0.0, 1e-5)], pipelined=True,
                         planned=dict(agree), executed=dict(agree))
    assert report.ok and report.phases == ["step, rank 0", "step, rank 1"]
    assert "step, rank 1 broadcast" in report.text()
    # one rank running one collective more than its stages plan fails the whole check
    report.executed = {**agree, "step, rank 1": {"broadcast": 1, "all_reduce": 1}}
    assert report.values_ok and not report.ok
    text = report.text()
    assert re.search(r"step, rank 1 all_reduce +0 +1   <- differs", text) and "FAILED" in text
