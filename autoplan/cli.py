"""The ``autoplan`` command: ``autoplan model.py --devices 8``.

Plans the model in ``model.py``, prints a summary (mesh, predicted step time and memory,
the placement of every parameter, the strategy of every op, the collectives of a step) and
writes ``plan.json`` into ``--out``. User errors print one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from autoplan.cost_models import OptimizerSpec, parse_memory_size
from autoplan.cost_models.presets import PRESET_NAMES
from autoplan.errors import AutoplanError
from autoplan.planner.api import make_options, plan_spec
from autoplan.load import load_model_file
from autoplan.codegen.script import render_train_script
from autoplan.planner.manual import cost_manual, parse_manual
from autoplan.planner.meshes import mesh_label, parse_mesh
from autoplan.planner.pipeline import PipelineOptions, normalize_schedule, plan_pipeline
from autoplan.reports.timeline import write_timeline
from autoplan.reports.summary import summary_text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="autoplan",
        description="Plan how to parallelize a PyTorch model over many devices (intra-op sharding by ILP).",
        epilog="`autoplan calibrate --devices N -o FILE` measures this machine and writes a cluster file "
               "for --cluster (see `autoplan calibrate --help`).",
    )
    parser.add_argument("model_file", help="a Python file defining `model` and `example_inputs` (optionally `loss_fn`)")
    parser.add_argument("--devices", type=int, required=True, help="number of devices to plan for")
    parser.add_argument("--cluster", default="h100",
                        help=f"a preset ({', '.join(PRESET_NAMES)}) or a TOML cluster file (default h100)")
    parser.add_argument("--devices-per-node", type=int, default=None, help="override the cluster's devices per node")
    parser.add_argument("--memory-per-device", default=None, help="override the device memory, e.g. 40GB or 38GiB")
    parser.add_argument("--mesh", default=None, help="pin the logical mesh, e.g. 8 or 2x4 (default: try all)")
    parser.add_argument("--model", default="model", help="name of the model in the file (default: model)")
    parser.add_argument("--inputs", default="example_inputs", help="name of the inputs (default: example_inputs)")
    parser.add_argument("--loss", default="loss_fn", help="name of the loss function (default: loss_fn, optional)")
    parser.add_argument("--optimizer", default="adam", help="adam, adamw, sgd or sgd-momentum (default adam)")
    parser.add_argument("--mixed-precision", action="store_true", help="bf16 params/grads with fp32 optimizer state")
    parser.add_argument("--solver", default="highs", choices=("highs", "cbc"), help="ILP solver (default highs)")
    parser.add_argument("--time-limit", type=float, default=None, help="ILP time limit in seconds per mesh")
    parser.add_argument("--out", default="autoplan_out", help="output folder for plan.json (default autoplan_out)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON instead of the summary")
    parser.add_argument("--run", action="store_true",
                        help="launch the emitted train.py on this machine (torch.distributed.run, one process per device)")
    parser.add_argument("--check", action="store_true",
                        help="with --run: compare outputs, loss, gradients and collectives with one device")
    parser.add_argument("--steps", type=int, default=3, help="training steps for --run / --check (default 3)")
    pipe = parser.add_argument_group("pipeline (inter-op) choices; left out, the planner chooses")
    pipe.add_argument("--stages", type=int, default=None, help="pin the number of pipeline stages")
    pipe.add_argument("--microbatches", type=int, default=None, help="pin the number of microbatches")
    pipe.add_argument("--schedule", default=None, help="pin the schedule: gpipe, 1f1b, interleaved1f1b, interleavedzerobubble (any case)")
    pipe.add_argument("--layers", type=int, default=None, help="cut the model into this many layers")
    pipe.add_argument("--no-pipeline", action="store_true", help="intra-op parallelism only (one stage)")
    pipe.add_argument("--manual", action="append", default=[], metavar="dp=2,tp=4,pp=2,microbatches=64",
                      help="also cost this hand-written plan and show it beside the found one (repeatable)")
    parser.add_argument("--report", action="store_true",
                        help="also write report.html (self-contained) and report.md with plots into --out; "
                             "with --run, the measured step times and losses too")
    return parser


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def run(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else list(argv))[:1] == ["calibrate"]:
        from autoplan.calibrate import run_calibrate  # `autoplan calibrate ...`: measure this machine

        return run_calibrate((sys.argv[1:] if argv is None else list(argv))[1:])
    args = build_parser().parse_args(argv)
    if args.steps < 1:
        raise AutoplanError(f"--steps must be at least 1, got {args.steps}")
    if args.devices < 1:
        raise AutoplanError(f"--devices must be at least 1, got {args.devices}")
    memory = parse_memory_size(args.memory_per_device) if args.memory_per_device else None
    if args.stages is not None and (args.stages < 1 or args.devices % args.stages):
        raise AutoplanError(f"--stages {args.stages} does not divide {args.devices} devices: choose a divisor")
    mesh = parse_mesh(args.mesh, args.devices // (args.stages or 1)) if args.mesh else None
    optimizer = OptimizerSpec(args.optimizer.lower(), args.mixed_precision)
    optimizer.state_bytes_per_param(4)  # validates the name before the slow work
    options = make_options(args.devices, args.cluster, mesh, memory, args.devices_per_node, optimizer,
                           args.solver, args.time_limit)
    import time

    start = time.perf_counter()
    spec = load_model_file(args.model_file, args.model, args.inputs, args.loss)
    load_s = time.perf_counter() - start
    manual = [parse_manual(text) for text in args.manual]
    pinned = PipelineOptions(args.stages, args.microbatches, args.schedule, args.layers)
    if args.schedule:
        normalize_schedule(args.schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if args.no_pipeline:
            plan, _graph = plan_spec(spec, options, {"load": load_s})
        else:
            plan = plan_pipeline(spec, options, pinned)
            plan.timings_s = {"load": load_s, **plan.timings_s}
        plan.alternatives += [cost_manual(spec, options, m) for m in manual]
    for w in caught:
        if "autoplan" in type(w.message).__module__:
            print(f"autoplan: warning: {w.message}", file=sys.stderr)
    text = plan.to_json()
    out = Path(args.out)
    # plan.json, train.py and the timeline are written only after planning succeeded
    script = out / "train.py"
    train_text = render_train_script(args.model_file, args.model, args.inputs, args.loss, plan.devices,
                                     plan.model or Path(args.model_file).stem,
                                     f"mesh {mesh_label(plan.mesh)}", str(script))
    _write_atomically(out / "plan.json", text + "\n")
    _write_atomically(script, train_text)
    if len(plan.stages) > 1:
        write_timeline([s.latency_s for s in plan.stages], plan.microbatches, plan.schedule, out)
    if args.json:
        print(text)
    else:
        print(summary_text(plan))
        print(f"\nwrote {out / 'plan.json'} and {script}")
    code, output = 0, None
    if args.run or args.check:
        output = [] if args.report else None
        code = launch(script, plan.devices, args.steps, args.check, output)
    if args.report:
        # imported here: matplotlib only when asked
        from autoplan.reports import parse_train_log, write_report

        run_log = parse_train_log("".join(output)) if output is not None else None
        write_report(plan, out, spec, options, run=run_log)
        print(f"wrote {out / 'report.html'} and {out / 'report.md'}")
    return code


def launch(script: Path, devices: int, steps: int, check: bool, output: list[str] | None = None) -> int:
    """Run train.py under torch.distributed.run with one process per planned device. With
    ``output``, the child's stdout is also appended to it line by line (still shown here)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(devices),
               str(script), "--steps", str(steps)] + (["--check"] if check else [])
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
