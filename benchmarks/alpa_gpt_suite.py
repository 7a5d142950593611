"""Alpa's GPT suite on V100 nodes (8 GPUs per node, 25 Gbit/s between nodes): planning time,
the plan found, and its predicted throughput beside the best published Megatron-LM plans,
all under autoplan's own cost model.

    .venv/bin/python benchmarks/alpa_gpt_suite.py [--case 1.3B ...]

Sequence 1024, vocabulary 51200, global batch 1024, fp16 weights and activations with
mixed-precision Adam (16 bytes per parameter) and activation checkpointing (each layer keeps
only its input; the backward recomputes the forward), as in Alpa's and Megatron's runs; models
built on the meta device. Megatron-LM baselines (grid-searched, as Alpa's paper reports them):
1.3B dp2 tp1 pp2 ×128 microbatches; 2.6B dp1 tp1 pp8 ×128; 6.7B dp1 tp2 pp8 ×256;
15B dp1 tp4 pp8 ×256. The found plan must never be predicted slower than the baseline.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

from autoplan.cost_models import OptimizerSpec  # noqa: E402
from autoplan.planner.api import make_options  # noqa: E402
from autoplan.planner.recompute import RecomputePolicy  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.manual import cost_manual, parse_manual  # noqa: E402
from autoplan.planner.meshes import meshes_label  # noqa: E402
from autoplan.planner.pipeline import plan_pipeline  # noqa: E402

SUITE = {  # name: (devices, hidden, layers, heads, Megatron baseline)
    "1.3B": (4, 2048, 24, 32, "dp=2,tp=1,pp=2,microbatches=128"),
    "2.6B": (8, 2560, 32, 32, "dp=1,tp=1,pp=8,microbatches=128"),
    "6.7B": (16, 4096, 32, 32, "dp=1,tp=2,pp=8,microbatches=256"),
    "15B": (32, 5120, 48, 40, "dp=1,tp=4,pp=8,microbatches=256"),
    "39B": (64, 8192, 48, 64, None),
}
BATCH, SEQ, VOCAB = 1024, 1024, 51200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(SUITE), help="cases to run (default: all)")
    parser.add_argument("--cluster", default="v100-16g")
    args = parser.parse_args()
    header = ("model", "GPUs", "plan time", "stages", "stage meshes", "microbatches", "schedule",
              "found samples/s", "Megatron samples/s", "found/Megatron")
    print(" | ".join(header))
    print(" | ".join("---" for _ in header))
    bars: list[tuple[str, float, float | None]] = []
    for name in args.case or list(SUITE):
        devices, hidden, layers, heads, baseline = SUITE[name]
        model, inputs = gpt.build(hidden=hidden, layers=layers, heads=heads, seq=SEQ, vocab=VOCAB, batch=BATCH,
                                  device="meta")
        spec = make_model_spec(model.half(), inputs, gpt.loss_fn, name=f"GPT {name}")
        options = replace(make_options(devices, args.cluster, optimizer=OptimizerSpec("adam", mixed_precision=True)),
                          recompute=RecomputePolicy.ALL)
        start = time.perf_counter()
        plan = plan_pipeline(spec, options)
        elapsed = time.perf_counter() - start
        found = BATCH / plan.predicted.step_time_s
        if baseline:
            alt = cost_manual(spec, options, parse_manual(baseline))
            mega = f"{BATCH / alt.predicted.step_time_s:.2f}" if alt.predicted else alt.reason
            ratio = f"{(BATCH / plan.predicted.step_time_s) / (BATCH / alt.predicted.step_time_s):.2f}" \
                if alt.predicted else "-"
        else:
            mega, ratio = "(no published plan)", "-"
        print(f"{name} | {devices} | {elapsed:.1f} s | {len(plan.stages)} | {meshes_label([s.mesh for s in plan.stages])} | "
              f"{plan.microbatches} | {plan.schedule} | {found:.2f} | {mega} | {ratio}", flush=True)
        bars.append((name, found, BATCH / alt.predicted.step_time_s if baseline and alt.predicted else None))
    _plot(bars, ROOT / "benchmarks" / "figures" / "plan_quality.png")


def _plot(bars: list[tuple[str, float, float | None]], path: Path) -> None:
    """Predicted throughput of the found plan beside the Megatron-LM plan, per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = range(len(bars))
    ax.bar([x - 0.2 for x in xs], [b[1] for b in bars], width=0.4, label="autoplan (found)", color="#4c72b0")
    ax.bar([x + 0.2 for x in xs], [b[2] or 0.0 for b in bars], width=0.4, label="Megatron-LM (published plan)",
           color="#dd8452")
    ax.set_xticks(list(xs), [f"GPT {b[0]}" for b in bars])
    ax.set_ylabel("predicted samples / s")
    ax.set_title("plan quality on V100 nodes (autoplan's cost model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
