"""The ``autoplan`` command.

``autoplan model.py --devices 8`` (short for ``autoplan plan model.py ...``) plans the model in
``model.py`` through the same front door as ``autoplan.plan`` (:mod:`autoplan.planner.front_door`),
prints a summary and writes ``plan.json`` and ``train.py`` into ``--out``;
``autoplan calibrate ...`` measures this machine. Every option is checked before the slow work;
user errors print one line and exit 2, and nothing is written unless planning succeeded.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

# what the parser needs imports no torch, so that ``--help`` and a mistyped option answer at once;
# the planner, the loader and the reports are imported once the arguments are read
from autoplan.arguments import OneLineParser
from autoplan.cost_models.presets import PRESET_NAMES
from autoplan.errors import AutoplanError
from autoplan.plan_schema import OPTIMIZER_NAMES, PRECISIONS
from autoplan.solvers.intra_op import SOLVER_NAMES
from autoplan.stdout_redirect import stdout_fd_redirected

if TYPE_CHECKING:
    from autoplan.planner.options import PlanOptions

SUBCOMMANDS = ("plan", "calibrate")


def _add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_file", help="a Python file defining `model` and `example_inputs` (optionally `loss_fn`)")
    parser.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    parser.add_argument("--cluster", default="h100",
                        help=f"a preset ({', '.join(PRESET_NAMES)}) or a TOML cluster file (default h100)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="override the cluster's devices per node")
    parser.add_argument("--memory-per-device", default=None, help="override the device memory, e.g. 40GB or 38GiB")
    parser.add_argument("--mesh", default=None, help="pin the logical mesh, e.g. 8 or 2x4 (default: try all)")
    parser.add_argument("--model", default="model", help="name of the model in the file (default: model)")
    parser.add_argument("--inputs", default="example_inputs", help="name of the inputs (default: example_inputs)")
    parser.add_argument("--loss", default=None,
                        help="name of the loss function in the file (default: loss_fn if defined, else output.loss "
                             "or the mean of the first output)")
    train = parser.add_argument_group("training: what the emitted program carries out")
    train.add_argument("--optimizer", default="adamw", help=f"{', '.join(OPTIMIZER_NAMES)} (default adamw)")
    train.add_argument("--lr", type=float, default=None, help="learning rate (default: 1e-3 for Adam/AdamW, 1e-2 SGD)")
    train.add_argument("--weight-decay", type=float, default=None, help="weight decay (default: 0.01 AdamW, else 0)")
    train.add_argument("--precision", default=None, choices=tuple(PRECISIONS),
                       help="fp32, or bf16 (bf16 compute under torch.autocast; fp32 master weights, gradient "
                            "reductions and optimizer state); default: bf16 where the cluster's devices compute bf16 "
                            "faster than fp32 (h100, h200, a100), fp32 elsewhere (cpu, v100)")
    train.add_argument("--mixed-precision", action="store_true", help="the same as --precision bf16")
    train.add_argument("--recompute", nargs="?", const="all", default="auto",
                       choices=("auto", "all", "selective", "op", "none"),
                       help="activation checkpointing: auto (default: layers recomputed in the backward, fully, "
                            "selectively or by the per-op policy, where memory needs it), all (every layer; --recompute alone), selective "
                            "(every layer, its matrix products and attention kept), op (every layer, torchtitan's "
                            "per-op policy: attention and every other matrix product kept) or none")
    train.add_argument("--plan-only", action="store_true",
                       help="mark the plan as one to read, not to run (recorded in plan.json's options)")
    parser.add_argument("--keep-interpreter-plan", action="store_true",
                        help="keep the plan found even where it runs on autoplan's DTensor interpreter and a "
                             "data-parallel plan PyTorch runs itself (DDP, FSDP2) is expected faster")
    parser.add_argument("--solver", default="highs", choices=SOLVER_NAMES, help="ILP solver (default highs)")
    parser.add_argument("--time-limit", type=float, default=None, help="ILP time limit in seconds per mesh")
    parser.add_argument("--jobs", type=int, default=None,
                        help="processes the pipeline search runs in (default: one per core; same plan for any)")
    parser.add_argument("--out", default="autoplan_out", help="output folder for plan.json (default autoplan_out)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (only JSON on stdout)")
    parser.add_argument("--run", action="store_true",
                        help="launch the emitted train.py on this machine (torch.distributed.run, one process per device)")
    parser.add_argument("--check", action="store_true",
                        help="with --run: compare outputs, loss, gradients and collectives with one device")
    parser.add_argument("--steps", type=int, default=3, help="training steps for --run / --check (default 3)")
    parser.add_argument("--checkpoint-dir", default=None,
                        help="with --run: save checkpoints here and resume from the newest one there, if any")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="with --checkpoint-dir: save every K steps (default: after the last step)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="with --run: restart every process this many times after one fails (torchrun), "
                             "resuming from the newest checkpoint")
    pipe = parser.add_argument_group("pipeline (inter-op) choices; left out, the planner chooses")
    pipe.add_argument("--stages", type=int, default=None, help="pin the number of pipeline stages")
    pipe.add_argument("--microbatches", type=int, default=None, help="pin the number of microbatches")
    pipe.add_argument("--schedule", default=None,
                      help="pin the schedule: gpipe, 1f1b, interleaved1f1b, interleavedzerobubble (any case)")
    pipe.add_argument("--layers", type=int, default=None, help="cut the model into this many layers")
    pipe.add_argument("--no-pipeline", action="store_true", help="intra-op parallelism only (one stage)")
    pipe.add_argument("--manual", action="append", default=[], metavar="dp=2,tp=4,pp=2,microbatches=64",
                      help="also cost this hand-written plan and show it beside the found one (repeatable); "
                           "keys dp, fsdp (sharded data parallel), tp, pp, microbatches, schedule, "
                           "ac=full|selective|op|none, precision=fp32|bf16, zero=1|2 (optimizer state, and gradients, "
                           "sharded over dp)")
    pins = parser.add_argument_group("pins: decisions you fix, which the planner plans around")
    pins.add_argument("--pin", action="append", default=[], metavar="PATTERN=VALUE",
                      help="pin part of the plan (repeatable): h.*.mlp.c_fc.weight=[R, S(0)] (a placement, * leaves an "
                           "axis free), h.0-3=stage:0, h.*=checkpoint, *.weight=fsdp, mesh=2x4, tp=8, stages=2, "
                           "microbatches=32")
    pins.add_argument("--pins", default=None, metavar="FILE.toml",
                      help="a TOML file of pins: PATTERN = VALUE lines (at the top or in a [pins] table)")
    parser.add_argument("--report", action="store_true",
                        help="also write report.html (self-contained) and report.md with plots into --out; "
                             "with --run, the measured step times and losses too")


def _installed_version() -> str:
    """autoplan's version as installed (pyproject.toml's), or "(not installed)" for a source tree
    on the path."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autoplan")
    except PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    from autoplan.calibrate import add_calibrate_arguments

    parser = OneLineParser(
        prog="autoplan",
        description="Plan how to parallelize a PyTorch model over many devices, and emit the program.",
        epilog="`autoplan model.py --devices 8` is short for `autoplan plan model.py --devices 8`.",
    )
    parser.add_argument("--version", action="version", version=f"autoplan {_installed_version()}")
    commands = parser.add_subparsers(dest="command", metavar="{plan,calibrate}")
    _add_plan_arguments(commands.add_parser("plan", help="plan a model (the default command)",
                                            description="Plan a model and write plan.json and train.py."))
    add_calibrate_arguments(commands.add_parser(
        "calibrate", help="measure this machine and write a cluster file for --cluster",
        description="Measure this machine (matmul rates, memory bandwidth, collectives) and write a cluster TOML."))
    return parser


def options_from_args(args: argparse.Namespace) -> PlanOptions:
    """The command line's options, checked, as the Python API takes them."""
    from autoplan.planner.meshes import parse_mesh
    from autoplan.planner.options import PlanOptions
    from autoplan.planner.pins import pin_file_texts

    if args.steps < 1:
        raise AutoplanError(f"--steps must be at least 1, got {args.steps}")
    for flag, value in (("--checkpoint-every", args.checkpoint_every), ("--max-restarts", args.max_restarts)):
        if value < 0:
            raise AutoplanError(f"{flag} must be at least 0, got {value}")
    if args.max_restarts and not args.checkpoint_dir:
        raise AutoplanError("--max-restarts needs --checkpoint-dir DIR: a restarted job resumes from a checkpoint")
    precision = "bf16" if args.mixed_precision else args.precision
    options = PlanOptions(
        args.devices, args.cluster, parse_mesh(args.mesh) if args.mesh else None, args.memory_per_device,
        args.devices_per_node, args.optimizer, args.lr, args.weight_decay, precision=precision,
        recompute=args.recompute, solver=args.solver, time_limit_s=args.time_limit, pipeline=not args.no_pipeline,
        stages=args.stages, microbatches=args.microbatches, schedule=args.schedule, layers=args.layers,
        manual=tuple(args.manual), pins=(*(pin_file_texts(args.pins) if args.pins else ()), *args.pin),
        plan_only=args.plan_only, jobs=args.jobs, native_rivals=not args.keep_interpreter_plan)
    if args.mixed_precision:
        print("autoplan: note: --mixed-precision is --precision bf16", file=sys.stderr)
    return options


def _check_out_folder(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise AutoplanError(f"--out {out} is a file, not a folder: name a folder (it is created if missing)")
    for name in ("plan.json", "train.py"):
        if (out / name).is_dir():
            raise AutoplanError(f"{out / name} is a folder: remove it or choose another --out")


def _write_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, readable as any new file (umask)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@contextlib.contextmanager
def _stdout_to_stderr(active: bool) -> Iterator[None]:
    """While active, whatever anything prints to stdout (a solver's banner included) goes to
    stderr, so that stdout carries only what the command means to print."""
    if not active:
        yield
        return
    with stdout_fd_redirected(2), contextlib.redirect_stdout(sys.stderr):
        yield


def _show_warnings(caught: list[warnings.WarningMessage]) -> None:
    seen: set[str] = set()
    for w in caught:
        source = "autoplan" if "autoplan" in type(w.message).__module__ else type(w.message).__name__
        line = f"autoplan: warning: {w.message}" if source == "autoplan" else f"warning ({source}): {w.message}"
        if line not in seen:
            seen.add(line)
            print(line, file=sys.stderr)


def run_plan(args: argparse.Namespace) -> int:
    from autoplan.codegen.script import render_train_script
    from autoplan.load import load_model_file
    from autoplan.planner.front_door import plan_model
    from autoplan.planner.meshes import mesh_label
    from autoplan.reports.summary import summary_text
    from autoplan.reports.timeline import write_timeline

    options = options_from_args(args)
    out = Path(args.out)
    _check_out_folder(out)
    start = time.perf_counter()
    with _stdout_to_stderr(args.json), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        spec = load_model_file(args.model_file, args.model, args.inputs, args.loss or "loss_fn",
                               require_loss=args.loss is not None)
        plan = plan_model(spec, options, load_s=time.perf_counter() - start)
    _show_warnings(caught)
    script = out / "train.py"
    train_text = render_train_script(args.model_file, args.model, args.inputs, args.loss or "loss_fn", plan.devices,
                                     plan.model or Path(args.model_file).stem, f"mesh {mesh_label(plan.mesh)}",
                                     str(script), optimizer=plan.optimizer.name)
    _write_file(out / "plan.json", plan.to_json() + "\n")
    _write_file(script, train_text)
    if len(plan.stages) > 1:
        write_timeline([s.latency_s for s in plan.stages], plan.microbatches, plan.schedule, out)
    if args.json:
        print(plan.to_json())
    else:
        print(summary_text(plan))
        print(f"\nwrote {out / 'plan.json'} and {script}")
    code, output = 0, None
    if args.run or args.check:
        output = [] if args.report else None
        code = launch(script, plan.devices, args.steps, args.check, output, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, max_restarts=args.max_restarts)
    if args.report:
        from autoplan.reports import parse_train_log, write_report

        run_log = parse_train_log("".join(output)) if output is not None else None
        write_report(plan, out, spec, options.planner_options(), run=run_log)
        print(f"wrote {out / 'report.html'} and {out / 'report.md'}")
    return code


def train_command(script: Path, devices: int, steps: int, check: bool, checkpoint_dir: str | None = None,
                  checkpoint_every: int = 0, max_restarts: int = 0) -> list[str]:
    """The torch.distributed.run command that runs train.py with one process per planned
    device; with a checkpoint folder it resumes from the newest checkpoint there."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices),
               "--max-restarts", str(max_restarts), str(script), "--steps", str(steps)]
    if check:
        return [*command, "--check"]
    if checkpoint_dir:
        command += ["--checkpoint-dir", checkpoint_dir, "--checkpoint-every", str(checkpoint_every), "--resume"]
    return command


def launch(script: Path, devices: int, steps: int, check: bool, output: list[str] | None = None,
           **checkpoints: Any) -> int:
    """Run train.py (:func:`train_command`; ``checkpoints``: its checkpoint arguments). With
    ``output``, the child's stdout is also appended to it line by line (still shown here)."""
    import torch

    cores = os.cpu_count() or 1
    if not torch.cuda.is_available() and devices > cores:
        print(f"autoplan: warning: starting {devices} processes on {cores} CPU cores: they share the cores, so "
              f"steps are slow; this checks the program, it does not measure it", file=sys.stderr)
    command = train_command(script, devices, steps, check, **checkpoints)
    print("running: " + " ".join(command[2:]), flush=True)
    if output is None:
        return subprocess.run(command, check=False).returncode
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, bufsize=1) as child:
        assert child.stdout is not None
        for line in child.stdout:  # tee: the terminal sees it as it comes
            sys.stdout.write(line)
            sys.stdout.flush()
            output.append(line)
    return child.returncode


def run(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help", "--version"):
        argv = ["plan", *argv]
    args = build_parser().parse_args(argv)
    if args.command is None:
        build_parser().print_help()
        return 2
    if args.command == "calibrate":
        from autoplan.calibrate import run_calibrate_args

        return run_calibrate_args(args)
    return run_plan(args)


def main(argv: list[str] | None = None) -> None:
    try:
        code = run(argv)
    except AutoplanError as e:
        print(f"autoplan: error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        print("autoplan: interrupted", file=sys.stderr)
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
