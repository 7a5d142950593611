"""Planning time: trace, strategies, solve and total, for GPT-2 124M on 8 H100s and a 39B GPT
on 64 H100s, both built on the meta device (no weights are allocated).

    .venv/bin/python benchmarks/planning_time.py

The 39B GPT has hidden 8192, 48 layers, 64 heads, sequence 1024, global batch 64 and a
51,200-token vocabulary, like the largest model of Alpa's GPT suite. Target: under 10 s.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
import gpt2  # noqa: E402

from autoplan.planner.api import make_options, plan_spec  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.meshes import mesh_label  # noqa: E402
from autoplan.solvers import format_bytes, format_seconds  # noqa: E402


def _cases(which: str):
    if which in ("all", "gpt2"):
        yield "GPT-2 124M (HF)", 8, lambda: gpt2.build(n_layer=12, n_embd=768, n_head=12, n_positions=1024,
                                                          vocab_size=50257, batch=8, seq=1024, device="meta"), None
    if which in ("all", "39b"):
        yield "GPT 39B", 64, lambda: gpt.build(**gpt.GPT_39B, device="meta"), gpt.loss_fn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="all", choices=("all", "gpt2", "39b"))
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--solver", default="highs", choices=("highs", "cbc"))
    args = parser.parse_args()
    header = f"{'model':18s} {'devices':>7s} {'build':>7s} {'trace':>7s} {'strategies':>10s} {'solve':>7s} " \
             f"{'total':>7s}  {'mesh':6s} {'groups':>6s} {'vars':>6s}  predicted step / memory"
    print(header)
    print("-" * len(header))
    for name, devices, build, loss_fn in _cases(args.case):
        start = time.perf_counter()
        model, inputs = build()
        built = time.perf_counter() - start
        spec = make_model_spec(model, inputs, loss_fn, name=name)
        plan, _ = plan_spec(spec, make_options(devices, args.cluster, solver=args.solver))
        t = plan.timings_s
        print(f"{name:18s} {devices:7d} {built:6.2f}s {t['trace']:6.2f}s {t['strategies']:9.2f}s "
              f"{t['solve']:6.2f}s {t['total']:6.2f}s  {mesh_label(plan.mesh):6s} {plan.solver.num_groups:6d} "
              f"{plan.solver.num_variables:6d}  {format_seconds(plan.predicted.step_time_s)} / "
              f"{format_bytes(plan.predicted.memory_bytes.peak)}")


if __name__ == "__main__":
    main()
