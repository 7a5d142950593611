"""The autoplan command: plans the bundled examples, writes plan.json, and fails in one line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from autoplan.cli import run
from autoplan.errors import AutoplanError
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example", ["mlp", "gpt2", "bert", "resnet", "gpt", "llama"])
def test_examples_plan(example: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run([str(ROOT / "examples" / f"{example}.py"), "--devices", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["devices"] == 8 and plan["format"] == "autoplan.plan/3"
    assert "parameters:" in out and "collectives per step:" in out
    assert plan["params"] and all(len(v) == len(plan["mesh"]) for v in plan["params"].values())


def test_json_flag_prints_only_the_plan(tmp_path: Path) -> None:
    """stdout is JSON and nothing else (a solver's banner goes to stderr)."""
    result = _cli(str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--mesh", "2", "--json", "--out",
                  str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mesh"] == [2]


def test_python_dash_m_autoplan_and_its_subcommands(tmp_path: Path) -> None:
    top = subprocess.run([sys.executable, "-m", "autoplan", "--help"], capture_output=True, text=True,
                         timeout=backstop(120))
    assert top.returncode == 0 and "calibrate" in top.stdout and "plan" in top.stdout
    for command in ("plan", "calibrate"):
        sub = subprocess.run([sys.executable, "-m", "autoplan", command, "--help"], capture_output=True, text=True,
                             timeout=backstop(120))
        assert sub.returncode == 0 and "--devices" in sub.stdout, sub.stderr
    short = _cli(str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--no-pipeline", "--out", str(tmp_path / "o"),
                 cwd=tmp_path)
    assert short.returncode == 0 and (tmp_path / "o" / "plan.json").is_file(), short.stderr


def test_written_files_are_readable_and_train_py_is_relocatable(tmp_path: Path) -> None:
    """plan.json and train.py are written as any new file (umask, not 0600), and train.py names
    the model file relative to itself: a project folder moved elsewhere keeps working."""
    import os
    import re
    import shutil

    project = tmp_path / "project"
    shutil.copytree(ROOT / "examples", project / "examples")
    old = os.umask(0o022)
    try:
        assert run([str(project / "examples" / "mlp.py"), "--devices", "2", "--no-pipeline",
                    "--out", str(project / "out")]) == 0
    finally:
        os.umask(old)
    for name in ("plan.json", "train.py"):
        assert (project / "out" / name).stat().st_mode & 0o777 == 0o644
    line = re.search(r"^MODEL_FILE = Path\(__file__\).resolve\(\).parent / '([^']+)'$",
                     (project / "out" / "train.py").read_text(), re.M)
    assert line and line.group(1) == "../examples/mlp.py"
    moved = tmp_path / "moved"
    project.rename(moved)
    assert (moved / "out" / line.group(1)).resolve() == (moved / "examples" / "mlp.py").resolve()
    # a mistyped flag of train.py is one line too (printed by rank 0 under torchrun), before any work
    bad = subprocess.run([sys.executable, str(moved / "out" / "train.py"), "--stepz", "3"], capture_output=True,
                         text=True, cwd=tmp_path, timeout=backstop(60))
    assert bad.returncode == 2 and bad.stderr.strip() == \
        "autoplan: error: unrecognized arguments: --stepz 3 (`train.py --help` lists the options)", bad.stderr


def test_replicated_plan_says_why(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run([str(ROOT / "examples" / "mlp.py"), "--devices", "3", "--cluster", "cpu", "--out", str(tmp_path)]) == 0
    assert "the batch (8) does not divide by 3" in capsys.readouterr().out


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "autoplan.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=backstop(300))


def test_stdout_holds_the_summary_and_no_solver_banner(tmp_path: Path) -> None:
    result = _cli(str(ROOT / "examples" / "mlp.py"), "--devices", "8", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("autoplan: MLPBlock on 8 x h100"), result.stdout[:300]
    assert "HiGHS" not in result.stdout + result.stderr  # the stage search's workers solve too


@pytest.mark.parametrize("args, needle", [
    (["missing.py", "--devices", "8"], "not found"),
    (["{mlp}", "--devices", "8", "--mesh", "3x3"], "holds 9 devices"),
    (["{mlp}", "--devices", "8", "--cluster", "h10"], "unknown cluster"),
    (["{mlp}", "--devices", "8", "--memory-per-device", "lots"], "cannot read memory size"),
    (["{mlp}", "--devices", "8", "--memory-per-device", "1MB"], "the least any plan needs is"),
    (["{mlp}", "--devices", "8", "--model", "nothing"], "defines no 'nothing'"),
    (["{mlp}", "--devices", "8", "--loss", "nope"], "defines no 'nope'"),
    (["{mlp}", "--devices", "8", "--time-limit", "0"], "the time limit must be a positive number of seconds, got 0"),
    (["{mlp}", "--devices", "8", "--time-limit", "-1"], "the time limit must be a positive number of seconds"),
    (["{mlp}", "--devices", "8", "--stages", "2", "--no-pipeline"], "pins a pipeline but pipelines are turned off"),
    (["{mlp}", "--devices", "8", "--mesh", "2x4", "--stages", "2"], "each of the 2 stages of 8 devices has 4"),
    (["{mlp}", "--devices", "8", "--out", "{file}"], "is a file, not a folder"),
    (["{mlp}"], "the following arguments are required: --devices (`autoplan plan --help` lists the options)"),
    (["{mlp}", "--devices", "eight"], "argument --devices: invalid int value: 'eight'"),
    (["{mlp}", "--devices", "8", "--precision", "fp16"], "argument --precision: invalid choice: 'fp16'"),
    (["calibrate", "--quick"], "the following arguments are required: --devices (`autoplan calibrate --help`"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str, tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("not a folder")
    args = [a.replace("{mlp}", str(ROOT / "examples" / "mlp.py")).replace("{file}", str(tmp_path / "a_file"))
            for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "out")]
    result = _cli(*args, cwd=tmp_path)
    assert result.returncode == 2
    lines = [l for l in result.stderr.strip().splitlines() if l]
    assert len(lines) == 1 and lines[0].startswith("autoplan: error:") and needle in lines[0], result.stderr
    assert not (tmp_path / "out" / "plan.json").exists()


def test_bad_optimizer_is_rejected_before_tracing() -> None:
    with pytest.raises(AutoplanError):
        run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--optimizer", "lion9"])


def test_run_warns_when_processes_outnumber_cores(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    import types

    from autoplan import cli

    launched: list[list[str]] = []
    monkeypatch.setattr(cli.os, "cpu_count", lambda: 2)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr(cli.subprocess, "run", lambda command, check: launched.append(command)
                        or types.SimpleNamespace(returncode=0))
    assert cli.launch(Path("train.py"), 16, 1, False) == 0
    err = capsys.readouterr().err
    assert "starting 16 processes on 2 CPU cores" in err and len(launched) == 1
    assert cli.launch(Path("train.py"), 2, 1, False) == 0
    assert "CPU cores" not in capsys.readouterr().err


def test_run_with_a_checkpoint_folder_saves_resumes_and_restarts() -> None:
    from autoplan.cli import train_command

    command = train_command(Path("out/train.py"), 4, 100, False, "ckpt", 10, 3)
    assert command[command.index("--max-restarts") + 1] == "3"
    assert command.index("--max-restarts") < command.index("out/train.py")  # torchrun's, not train.py's
    after = command[command.index("out/train.py"):]
    assert after == ["out/train.py", "--steps", "100", "--checkpoint-dir", "ckpt", "--checkpoint-every", "10",
                     "--resume"]
    assert "--checkpoint-dir" not in train_command(Path("train.py"), 2, 3, False)


@pytest.mark.parametrize("flags, needle", [
    (["--max-restarts", "2"], "--max-restarts needs --checkpoint-dir"),
    (["--checkpoint-dir", "c", "--checkpoint-every", "-1"], "--checkpoint-every must be at least 0"),
])
def test_restart_and_checkpoint_flags_are_checked_before_planning(flags: list[str], needle: str) -> None:
    with pytest.raises(AutoplanError, match=needle):
        run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--run", *flags])


def test_help_and_a_missing_option_answer_without_importing_torch() -> None:
    """The parser needs no torch: ``autoplan --help`` and a mistyped command line answer before
    the planner (and torch with it) is imported."""
    code = ("import sys\nfrom autoplan import cli\n"
            "for argv in (['--help'], ['--version'], ['calibrate', '--help'], ['model.py']):\n"
            "    try:\n        cli.main(argv)\n    except SystemExit as e:\n        assert e.code in (0, 2), e.code\n"
            "print('torch imported' if 'torch' in sys.modules else 'no torch')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=backstop(30))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "no torch"
    assert "autoplan: error: the following arguments are required: --devices" in done.stderr
    assert re.search(r"^autoplan \d+\.\d+", done.stdout, re.M), done.stdout  # --version
