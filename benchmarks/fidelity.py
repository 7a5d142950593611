"""Predicted versus measured step time on this machine (gloo, CPU processes).

    .venv/bin/python benchmarks/fidelity.py [--steps 8] [--out benchmarks/figures]
        [--devices 2 4] [--models mlp gpt] [--clusters DIR]

1. calibrates a cpu cluster spec for 2 and for 4 processes (``autoplan calibrate``; with
   ``--clusters DIR``, reuses ``DIR/cpuN.toml`` where it exists and writes it where not);
2. for two models (the Megatron MLP block and a small nanoGPT) and 2 and 4 processes, makes
   several plans — the planner's own (without and with a pipeline) and hand-written ones
   (pure data parallelism, pure tensor parallelism, a 2-D mesh) — predicts their step time
   with the calibrated spec (and SGD, the optimizer train.py runs), runs each with train.py
   under torch.distributed.run, and takes the median measured step time (the first step left
   out);
3. prints the table, the Spearman rank correlation and the median relative error, and saves
   a log-log plot of predicted against measured (``fidelity.png``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from autoplan.calibrate import (  # noqa: E402
    DRIFT_WARNING,
    CalibrateSettings,
    calibrate,
    calibration_toml,
)
from autoplan.cli import launch  # noqa: E402
from autoplan.codegen.script import render_train_script  # noqa: E402
from autoplan.errors import AutoplanError  # noqa: E402
from autoplan.planner.front_door import plan_model, with_decisions  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.load import load_model_file  # noqa: E402
from autoplan.planner.manual import parse_manual, plan_manual  # noqa: E402
from autoplan.plan_schema import Plan  # noqa: E402

MODELS = {
    "mlp": "import mlp\nmodel, example_inputs = mlp.build(hidden=256, batch=8, seq=64)\nloss_fn = mlp.loss_fn\n",
    "gpt": ("import gpt\nmodel, example_inputs = gpt.build(hidden=128, layers=4, heads=4, seq=64, vocab=512, batch=8)\n"
            "loss_fn = gpt.loss_fn\n"),
}


@dataclass
class Row:
    model: str
    devices: int
    plan: str
    predicted_s: float
    measured_s: float

    @property
    def relative_error(self) -> float:
        return abs(self.predicted_s - self.measured_s) / self.measured_s


def _plans(spec, devices: int, cluster: str) -> list[tuple[str, Plan]]:
    options = PlanOptions(devices, cluster, optimizer="sgd", pipeline=False)  # the plans' programs step SGD
    out = [("found", plan_model(spec, options))]
    try:
        out.append(("found pipeline", plan_model(spec, replace(options, pipeline=True, stages=2, microbatches=2))))
    except AutoplanError as e:
        print(f"skip found pipeline: {e}", file=sys.stderr)
    manual = [f"dp={devices}", f"tp={devices}"] + (["dp=2,tp=2"] if devices == 4 else [])
    for text in manual:
        try:
            out.append((text, with_decisions(plan_manual(spec, options.planner_options(), parse_manual(text)),
                                             options)))
        except AutoplanError as e:
            print(f"skip {text}: {e}", file=sys.stderr)
    return out


def _measure(model_file: Path, plan: Plan, folder: Path, steps: int) -> float:
    folder.mkdir(parents=True, exist_ok=True)
    plan.save(folder / "plan.json")
    script = folder / "train.py"
    script.write_text(render_train_script(str(model_file), "model", "example_inputs", "loss_fn", plan.devices,
                                          plan.model, "fidelity", str(script), optimizer=plan.optimizer.name))
    lines: list[str] = []
    if launch(script, plan.devices, steps, False, output=lines) != 0:
        raise RuntimeError(f"train.py failed for {folder}")
    times = [float(m.group(1)) for line in lines if (m := re.search(r"time ([0-9.eE+-]+)", line))]
    return statistics.median(times[1:] if len(times) > 1 else times)


def spearman(xs: list[float], ys: list[float]) -> float:
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        r = [0.0] * len(values)
        i = 0
        while i < len(order):  # average ranks of ties
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    return cov / ((sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5)


def _plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    for model, marker in (("mlp", "o"), ("gpt", "s")):
        for devices, color in ((2, "#4c72b0"), (4, "#dd8452")):
            pts = [r for r in rows if r.model == model and r.devices == devices]
            ax.scatter([r.measured_s * 1e3 for r in pts], [r.predicted_s * 1e3 for r in pts], marker=marker,
                       color=color, label=f"{model}, {devices} processes")
    values = [v * 1e3 for r in rows for v in (r.measured_s, r.predicted_s)]
    lo, hi = min(values) * 0.7, max(values) * 1.4
    ax.plot([lo, hi], [lo, hi], "k--", linewidth=0.8, label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured step time (ms)")
    ax.set_ylabel("predicted step time (ms)")
    ax.set_title("autoplan: predicted vs measured (gloo, this machine)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cluster_file(folder: Path, devices: int, tries: int = 3) -> Path:
    """``folder/cpuN.toml``, calibrated now unless it exists. A calibration during which the
    machine's load changed (:attr:`Calibration.drift`) is repeated, up to ``tries`` times."""
    cluster = folder / f"cpu{devices}.toml"
    if cluster.is_file():
        print(f"reusing {cluster}", file=sys.stderr, flush=True)
        return cluster
    for attempt in range(1, tries + 1):
        cal = calibrate(CalibrateSettings(devices))
        if cal.drift <= DRIFT_WARNING or attempt == tries:
            break
        print(f"calibration {attempt}: the load changed while measuring (drift {cal.drift:.0%}); again",
              file=sys.stderr, flush=True)
    cluster.write_text(calibration_toml(cal))
    return cluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "figures"))
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4], help="process counts to run (2 4)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS), help="models to run")
    parser.add_argument("--clusters", default=None,
                        help="folder of calibrated cpuN.toml files to reuse (missing ones are calibrated into it)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="autoplan-fidelity-"))
    clusters = Path(args.clusters) if args.clusters else work
    clusters.mkdir(parents=True, exist_ok=True)
    rows: list[Row] = []
    for devices in args.devices:
        cluster = _cluster_file(clusters, devices)
        for model in args.models:
            text = MODELS[model]
            model_file = work / f"{model}.py"
            model_file.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n" + text)
            spec = load_model_file(str(model_file))
            for name, plan in _plans(spec, devices, str(cluster)):
                label = name.replace("=", "").replace(",", "_").replace(" ", "_")
                measured = _measure(model_file, plan, work / f"{model}{devices}_{label}", args.steps)
                rows.append(Row(model, devices, name, plan.predicted.step_time_s, measured))
                p = plan.predicted
                print(f"{model} x{devices} {name}: predicted {p.step_time_s * 1e3:.2f} ms (compute "
                      f"{p.compute_s * 1e3:.2f}, communication {p.comm_s * 1e3:.2f}), measured {measured * 1e3:.2f} ms",
                      file=sys.stderr, flush=True)
    print("| model | processes | plan | predicted (ms) | measured (ms) | relative error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r.model} | {r.devices} | {r.plan} | {r.predicted_s * 1e3:.2f} | {r.measured_s * 1e3:.2f} | "
              f"{r.relative_error:.0%} |")
    rho = spearman([r.predicted_s for r in rows], [r.measured_s for r in rows])
    median_error = statistics.median(r.relative_error for r in rows)
    print(f"\nplans: {len(rows)}; Spearman rank correlation {rho:.2f} (target >= 0.8); "
          f"median relative error {median_error:.0%} (target <= 30%)")
    _plot(rows, out / "fidelity.png")
    print(f"plot: {out / 'fidelity.png'}")


if __name__ == "__main__":
    main()
