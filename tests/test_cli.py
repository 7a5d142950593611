"""The autoplan command: plans the bundled examples, writes plan.json, and fails in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli import run
from autoplan.errors import AutoplanError

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example", ["mlp", "gpt2", "bert", "resnet", "gpt"])
def test_examples_plan(example: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run([str(ROOT / "examples" / f"{example}.py"), "--devices", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["devices"] == 8 and plan["format"] == "autoplan.plan/1"
    assert "parameters:" in out and "collectives per step:" in out
    assert plan["params"] and all(len(v) == len(plan["mesh"]) for v in plan["params"].values())


def test_json_flag_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--mesh", "2", "--json", "--out", str(tmp_path)])
    plan = json.loads(capsys.readouterr().out)
    assert plan["mesh"] == [2]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("args, needle", [
    (["missing.py", "--devices", "8"], "not found"),
    (["{mlp}", "--devices", "8", "--mesh", "3x3"], "holds 9 devices"),
    (["{mlp}", "--devices", "8", "--cluster", "h10"], "unknown cluster"),
    (["{mlp}", "--devices", "8", "--memory-per-device", "lots"], "cannot read memory size"),
    (["{mlp}", "--devices", "8", "--memory-per-device", "1MB"], "the least any plan needs is"),
    (["{mlp}", "--devices", "8", "--model", "nothing"], "defines no 'nothing'"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    args = [a.replace("{mlp}", str(ROOT / "examples" / "mlp.py")) for a in args]
    result = _cli(*args, "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    lines = [l for l in result.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("autoplan: error:") and needle in lines[0], result.stderr
    assert not (tmp_path / "out" / "plan.json").exists()


def test_bad_optimizer_is_rejected_before_tracing() -> None:
    with pytest.raises(AutoplanError):
        run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--optimizer", "lion9"])
