"""Survey what autoplan does with the zoo of public architectures (``tests/zoo.py``).

For each case: plan it in-process on 4 CPU devices with pipelines searched and with
``pipeline=False``, recording the plan (mesh, stages, microbatches), the ops planned replicated
for want of a sharding rule, and any exception (type, first line, innermost autoplan frame).
With ``--run``, also write a model file per case and run the CLI with ``--run --check`` on 2
and 4 processes, and on 4 processes with ``--no-pipeline`` and a memory budget small enough
that the plan must shard weights. Prints a Markdown table and the failures.

    .venv/bin/python benchmarks/zoo_survey.py [--case llama ...] [--run] [--json results.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import autoplan  # noqa: E402
from zoo import ALL_CASES, ZooCase  # noqa: E402

AUTOPLAN_CLI = ROOT / ".venv" / "bin" / "autoplan"
EXCEPTION_RE = re.compile(r"^(\[rank\d+\]:\s*)?[\w.]*(Error|Exception|Interrupt):")
FRAME_RE = re.compile(r'File "([^"]*/autoplan/[^"]+)", line (\d+)')
PEAK_FRACTIONS = (0.5, 0.7, 0.35, 0.25)  # memory budgets tried to force sharding, in this order
SHARDED_TIME_LIMIT_S = 60  # ILP seconds per mesh under a tight budget (those solves can take minutes)


@dataclass
class Outcome:
    """One attempt: ok, a short summary, and on failure the error and the innermost autoplan frame."""

    ok: bool
    summary: str = ""
    error: str = ""
    where: str = ""
    seconds: float = 0.0

    def cell(self) -> str:
        if self.ok:
            return self.summary
        return f"FAIL {self.error.split(':')[0]}" if self.error else "FAIL"


@dataclass
class CaseResult:
    name: str
    family: str
    plan: Outcome | None = None
    plan_no_pipeline: Outcome | None = None
    check: dict[str, Outcome] = field(default_factory=dict)  # "2", "4", "sharded"
    replicated_ops: list[str] = field(default_factory=list)


def _relative(path: str) -> str:
    return path[path.rfind("/autoplan/") + 1:] if "/autoplan/" in path else path


def describe(e: BaseException) -> tuple[str, str]:
    """``Type: first line`` and the innermost autoplan frame (file:line) of an exception."""
    text = str(e).strip()
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "/autoplan/" in f.filename
              and "/benchmarks/" not in f.filename]
    where = f"{_relative(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}", where


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Silence fd 1 (the ILP solver's banner is printed from C)."""
    sys.stdout.flush()
    saved, null = os.dup(1), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
        os.close(null)


def plan_case(case: ZooCase, replicated: set[str], **options) -> tuple[Outcome, autoplan.Plan | None]:
    """Plan ``case`` on 4 CPU devices; add the ops planned replicated by warning to ``replicated``."""
    start, plan, outcome = time.perf_counter(), None, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with quiet_stdout():
                plan = autoplan.plan(case.model, case.example_inputs, loss_fn=case.loss_fn, devices=4,
                                     cluster="cpu", **options)
        except Exception as e:  # noqa: BLE001 - the survey records every failure
            error, where = describe(e)
            outcome = Outcome(False, error=error, where=where)
    for w in caught:
        message = str(w.message)
        if "planned replicated" in message:
            replicated.add(message.removeprefix("no sharding rule for ").split(": planned replicated")[0])
    if plan is not None:
        outcome = Outcome(True, f"mesh {'x'.join(map(str, plan.mesh))}, {len(plan.stages)} st, "
                                f"{plan.microbatches} mb")
    outcome.seconds = time.perf_counter() - start
    return outcome, plan


def shards_weights(plan: autoplan.Plan) -> bool:
    return any(p != "R" for spec in plan.params.values() for p in spec)


def sharding_budget(case: ZooCase, no_pipeline: autoplan.Plan) -> int | None:
    """A per-device memory budget, a fraction of the one-stage plan's peak on 4 devices (half
    first: tight budgets make slow solves), under which the one-stage plan shards some weight
    (None if none of those tried does)."""
    peak = no_pipeline.predicted.memory_bytes.peak
    for fraction in PEAK_FRACTIONS:
        budget = int(fraction * peak)
        outcome, plan = plan_case(case, set(), pipeline=False, memory_per_device=budget,
                                  time_limit_s=SHARDED_TIME_LIMIT_S)
        if outcome.ok and plan is not None and shards_weights(plan):
            return budget
    return None


MODEL_FILE = """\
import sys
sys.path.insert(0, {tests!r})
from zoo import ALL_CASES

case = ALL_CASES[{name!r}]()
model = case.model
example_inputs = case.example_inputs
if case.loss_fn is not None:
    loss_fn = case.loss_fn
"""


def run_cli(model_file: Path, out: Path, devices: int, extra: list[str], timeout_s: float) -> Outcome:
    command = [str(AUTOPLAN_CLI), str(model_file), "--devices", str(devices), "--cluster", "cpu", "--run", "--check",
               "--steps", "2", "--out", str(out), *extra]
    start = time.perf_counter()
    # a session of its own, so that a timeout ends the launcher's worker processes too
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                          start_new_session=True) as child:
        try:
            text, _ = child.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return Outcome(False, error=f"Timeout: over {timeout_s:.0f} s", seconds=timeout_s)
    seconds = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "output.log").write_text(text)
    if child.returncode == 0:
        return Outcome(True, "pass", seconds=seconds)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    frames = FRAME_RE.findall(text)
    where = f"{_relative(frames[-1][0])}:{frames[-1][1]}" if frames else ""
    error = last_error(lines)
    return Outcome(False, error=f"exit {child.returncode}: {error}"[:300], where=where, seconds=seconds)


def last_error(lines: list[str]) -> str:
    """The line that says why a CLI run failed: the last exception a worker raised, else the
    first mismatch the check found (with their count), else autoplan's error line, else the
    launcher's exit code of the root cause, else the last line."""
    exceptions = [re.sub(r"^\[rank\d+\]:\s*", "", line) for line in lines
                  if EXCEPTION_RE.match(line) and "ChildFailedError" not in line]
    mismatches = [line for line in lines if "MISMATCH" in line]
    if exceptions:
        return exceptions[-1]
    if mismatches:
        return f"{mismatches[0]} (+{len(mismatches) - 1} more mismatches)"
    errors = [line for line in lines if line.startswith("autoplan: error")]
    if errors:
        return errors[-1]
    exits = [line for line in lines if line.startswith("exitcode")]  # torch.distributed.run's root cause
    return f"no exception printed; {exits[-1]}" if exits else (lines or [""])[-1]


def survey_case(name: str, run: bool, tmp: Path, timeout_s: float) -> CaseResult:
    case = ALL_CASES[name]()
    result = CaseResult(name, case.family)
    replicated: set[str] = set()
    result.plan, _ = plan_case(case, replicated)
    result.plan_no_pipeline, flat = plan_case(case, replicated, pipeline=False)
    result.replicated_ops = sorted(replicated)
    if run:
        model_file = tmp / f"zoo_{name}.py"
        model_file.write_text(MODEL_FILE.format(tests=str(ROOT / "tests"), name=name))
        for devices in (2, 4):
            result.check[str(devices)] = run_cli(model_file, tmp / f"{name}_{devices}", devices, [], timeout_s)
        budget = sharding_budget(case, flat) if flat is not None else None
        if budget is None:
            result.check["sharded"] = Outcome(False, error="NoBudget: no budget found that plans and shards weights")
        else:
            result.check["sharded"] = run_cli(model_file, tmp / f"{name}_sharded", 4,
                                              ["--no-pipeline", "--memory-per-device", str(budget),
                                               "--time-limit", str(SHARDED_TIME_LIMIT_S)], timeout_s)
            result.check["sharded"].summary = f"pass ({budget / 1e6:.2f} MB)"
            result.check["sharded"].error += f" [budget {budget / 1e6:.2f} MB]"
    return result


def table(results: list[CaseResult], run: bool) -> str:
    def cell(o: Outcome | None) -> str:
        return "–" if o is None else o.cell()

    rows = ["| model | family | plan (pipelines) | plan (no pipelines) | check 2 procs | check 4 procs "
            "| forced-sharded check | ops replicated by warning |", "|" + "---|" * 8]
    for r in results:
        checks = [cell(r.check.get(k)) if run else "not run" for k in ("2", "4", "sharded")]
        rows.append(f"| {r.name} | {r.family} | {cell(r.plan)} | {cell(r.plan_no_pipeline)} | {' | '.join(checks)} "
                    f"| {', '.join(r.replicated_ops) or '–'} |")
    return "\n".join(rows)


def failures(results: list[CaseResult]) -> str:
    lines = []
    for r in results:
        attempts = {"plan": r.plan, "plan no pipelines": r.plan_no_pipeline,
                    **{f"check {k}": o for k, o in r.check.items()}}
        for label, o in attempts.items():
            if o is not None and not o.ok:
                lines.append(f"- {r.name} / {label}: {o.error}" + (f" ({o.where})" if o.where else ""))
    return "\n".join(lines) or "none"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=sorted(ALL_CASES), help="survey this case (repeatable)")
    parser.add_argument("--run", action="store_true", help="also run the CLI with --run --check")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per CLI run")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--keep", type=Path, default=None,
                        help="work in this folder and keep it (model files; each run's plan, train.py, output.log)")
    args = parser.parse_args(argv)
    names = args.case or list(ALL_CASES)
    results = []
    work = contextlib.nullcontext(str(args.keep)) if args.keep else tempfile.TemporaryDirectory(prefix="zoo_survey_")
    with work as tmp:
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for name in names:
            start = time.perf_counter()
            results.append(survey_case(name, args.run, Path(tmp), args.timeout))
            print(f"[{name}: {time.perf_counter() - start:.0f} s]", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    print(table(results, args.run))
    print("\nFailures:\n" + failures(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
