"""Regenerate every figure of the benchmark report (benchmarks/README.md) in one command.

    .venv/bin/python benchmarks/make_figures.py            # planning scaling + solver statistics
    .venv/bin/python benchmarks/make_figures.py --all      # also the Alpa suite and the fidelity runs

Writes into ``benchmarks/figures/``:

- ``planning_vs_size.png``: intra-op planning time (trace, strategies, solve) of GPT shapes from
  125M to 175B parameters on 64 H100s (no memory limit, so that every size plans without a
  pipeline);
- ``planning_vs_devices.png``: planning time of the 6.7B GPT on 8 to 1024 H100s;
- ``solver_stats.md``: per run, the ILP's variables, constraints, solve time and status/gap;
- with ``--all``: ``plan_quality.png`` (the Alpa suite: found plan vs Megatron-LM, predicted
  throughput) and ``fidelity.png`` (predicted vs measured on this machine).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "benchmarks" / "figures"
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

from autoplan.planner.api import make_options, plan_spec  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402

# GPT-3 paper shapes: name -> (hidden, layers, heads)
SIZES = {"125M": (768, 12, 12), "1.3B": (2048, 24, 32), "6.7B": (4096, 32, 32), "13B": (5120, 40, 40),
         "39B": (8192, 48, 64), "175B": (12288, 96, 96)}
DEVICE_COUNTS = (8, 32, 128, 512, 1024)


def _plan(name: str, devices: int) -> dict:
    hidden, layers, heads = SIZES[name]
    model, inputs = gpt.build(hidden=hidden, layers=layers, heads=heads, seq=1024, vocab=51200, batch=max(8, devices),
                              device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn, name=f"GPT {name}")
    start = time.perf_counter()
    # no memory limit: the figure is about planning time, and 175B does not fit 80 GB without a pipeline
    plan, _ = plan_spec(spec, make_options(devices, "h100", memory_per_device=1e15))
    total = time.perf_counter() - start
    s = plan.solver
    row = {"model": name, "devices": devices, "total": total, **{k: plan.timings_s.get(k, 0.0)
                                                                 for k in ("trace", "strategies", "solve")},
           "variables": s.num_variables, "constraints": s.num_constraints, "groups": s.num_groups,
           "nodes": s.num_nodes, "status": s.status, "gap": s.gap, "mesh": "x".join(map(str, plan.mesh))}
    print(f"{name:>5s} on {devices:5d}: {total:6.2f} s (trace {row['trace']:.2f}, strategies {row['strategies']:.2f}, "
          f"solve {row['solve']:.2f}); {s.num_variables} variables, {s.num_constraints} constraints, "
          f"mesh {row['mesh']}", flush=True)
    return row


def _stacked(rows: list[dict], labels: list[str], xlabel: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    bottom = [0.0] * len(rows)
    for part, color in (("trace", "#4c72b0"), ("strategies", "#55a868"), ("solve", "#dd8452")):
        values = [r[part] for r in rows]
        ax.bar(labels, values, bottom=bottom, color=color, label=part)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel(xlabel)
    ax.set_ylabel("planning time (s), 2-core machine")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _solver_table(rows: list[dict]) -> str:
    lines = ["| model | devices | nodes | ILP groups | variables | constraints | solve (all meshes) | status | mesh |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        status = r["status"] if r["gap"] in (None, 0.0) else f"{r['status']} (gap {r['gap']:.2g})"
        lines.append(f"| {r['model']} | {r['devices']} | {r['nodes']} | {r['groups']} | {r['variables']} | "
                     f"{r['constraints']} | {r['solve']:.2f} s | {status} | {r['mesh']} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all", action="store_true", help="also run the Alpa suite and the fidelity runs")
    args = parser.parse_args()
    FIGURES.mkdir(parents=True, exist_ok=True)
    by_size = [_plan(name, 64) for name in SIZES]
    _stacked(by_size, list(SIZES), "GPT model (64 H100s)", FIGURES / "planning_vs_size.png",
             "planning time against model size")
    by_devices = [_plan("6.7B", n) for n in DEVICE_COUNTS]
    _stacked(by_devices, [str(n) for n in DEVICE_COUNTS], "H100s (GPT 6.7B)", FIGURES / "planning_vs_devices.png",
             "planning time against device count")
    (FIGURES / "solver_stats.md").write_text(_solver_table(by_size + by_devices))
    print(f"wrote {FIGURES / 'planning_vs_size.png'}, {FIGURES / 'planning_vs_devices.png'}, "
          f"{FIGURES / 'solver_stats.md'}")
    if args.all:
        for script in ("alpa_gpt_suite.py", "fidelity.py"):
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], check=True)


if __name__ == "__main__":
    main()
