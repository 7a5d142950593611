"""Running a test worker script in several gloo processes and reading what each rank wrote.

A worker is launched with ``python -m torch.distributed.run --standalone`` (a free port each
time) and one thread per process; every rank writes ``rank{r}.json`` into the output folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

from autoplan.codegen.program_choice import INTERPRETER_PROGRAM

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_SCALE_ENV = "AUTOPLAN_TEST_TIMEOUT_SCALE"
DEFAULT_TIMEOUT_SCALE = 4.0
# how long a worker's gloo process group waits for a peer (a busy 2-core machine runs four ranks
# and another test beside them): ``dist.init_process_group("gloo", timeout=PEER_TIMEOUT)``
PEER_TIMEOUT = timedelta(seconds=300)


def backstop(seconds: float) -> int:
    """The time limit of a test's subprocess: ``seconds`` (what it takes on a quiet machine, with
    room) times ``AUTOPLAN_TEST_TIMEOUT_SCALE`` (default 4). A limit only turns a hang into a
    failure; a machine several times slower or busier than the one the figure was read on must
    still pass (one 4-process launch took 261 s on one day and 526 s on another)."""
    return int(seconds * float(os.environ.get(TIMEOUT_SCALE_ENV, DEFAULT_TIMEOUT_SCALE)))


def launch_worker(worker: Path, world: int, out_dir: Path, *args: str, timeout: int = 420) -> dict[int, dict]:
    """Run ``worker OUT_DIR [ARGS...]`` in ``world`` processes; each rank's JSON result, by rank
    (``timeout``: seconds on a quiet machine, scaled by :func:`backstop`)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(worker), str(out_dir), *args]
    proc = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                          timeout=backstop(timeout))
    found = {r: out_dir / f"rank{r}.json" for r in range(world)}
    assert proc.returncode == 0 and all(f.exists() for f in found.values()), \
        f"{world}-process launch of {worker.name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return {r: json.loads(f.read_text()) for r, f in found.items()}


def on_every_rank(per_rank: list[dict], name: str) -> list[dict]:
    """A case's result on every rank, failing with the worker's traceback if a rank failed."""
    for r, res in enumerate(per_rank):
        assert "error" not in res, f"{name} failed on rank {r}: {res['error']}\n{res.get('traceback', '')}"
    return per_rank


def write_check_cases(out_dir: Path, plans: dict, files: dict[str, str] | None = None,
                      interpreter: frozenset[str] = frozenset()) -> None:
    """``out_dir/cases.json`` for ``check_worker.py``: ``plans`` maps a case name to ``(builder,
    plan)``; a builder is looked up in ``files[builder]`` (a file under tests/; zoo.py if not
    given). Each plan is written beside it. The cases named in ``interpreter`` run on the DTensor
    interpreter whatever program their plan names."""
    cases = []
    for name, (builder, plan) in plans.items():
        path = out_dir / f"{name}.json"
        path.write_text(plan.to_json())
        file = (files or {}).get(builder, "zoo.py")
        cases.append({"name": name, "file": str(ROOT / "tests" / file), "builder": builder, "plan": str(path),
                      **({"interpreter": True} if name in interpreter else {})})
    (out_dir / "cases.json").write_text(json.dumps(cases))


def assert_checks_passed(results: dict[int, dict], names) -> None:
    """Every case of ``names`` passed ``--check`` on every rank, on the program its plan named."""
    for rank, found in results.items():
        for name in names:
            assert "error" not in found[name], f"{name}, rank {rank}: {found[name].get('traceback')}"
            assert found[name]["ok"], f"{name}, rank {rank}:\n{found[name]['text']}"
            assert_program_as_planned(found[name], f"{name}, rank {rank}")


def assert_program_as_planned(result: dict, where: str) -> None:
    """The program that ran (a check worker's ``description``) is of the kind the plan named
    when it was planned (``planned_program``, :attr:`Plan.program`; a plan without it passes):
    PyTorch's own, or the DTensor interpreter."""
    planned = result.get("planned_program", "")
    if planned:
        native_planned = not planned.startswith(INTERPRETER_PROGRAM)
        native_ran = result["description"].startswith("native")
        assert native_planned == native_ran, f"{where}: planned {planned!r}, ran {result['description']!r}"
