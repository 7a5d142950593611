"""What common pins cost: each pin set planned beside the search without pins.

    .venv/bin/python benchmarks/pin_cost.py [--devices 8] [--cluster h100] [--precision fp32|bf16] [--case NAME ...]

The model is the nanoGPT of ``examples/gpt.py`` at GPT-2 124M's shape (hidden 768, 12 layers,
sequence 1,024, batch 8), built on the meta device, trained with AdamW in the cluster's
default precision (bf16 on ``h100``) unless ``--precision`` names one. Each row prints the pinned plan's predicted
step time, the unpinned optimum's, what the pins cost (``Plan.pin_cost``), the plan's shape
and the planning time (both searches).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.meshes import stage_meshes_text  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402
from autoplan.solvers import format_seconds  # noqa: E402

MEGATRON = ("h.*.attn.c_attn.weight=[*, S(0)]", "h.*.attn.c_proj.weight=[*, S(1)]",
            "h.*.mlp.c_fc.weight=[*, S(0)]", "h.*.mlp.c_proj.weight=[*, S(1)]")
CASES: dict[str, tuple[str, ...]] = {
    "megatron-2x4": (*MEGATRON, "mesh=2x4"),  # Megatron on the inner axis of 4, the outer axis free
    "tp=8": ("tp=8",),
    "fsdp": ("*.weight=fsdp", "mesh=8"),
    "checkpoint-all": ("h.*=checkpoint",),
    "stage-split": ("h.0-5=stage:0", "h.6-11=stage:1"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--cluster", default="h100")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default=None,
                        help="default: the cluster's (bf16 on h100)")
    parser.add_argument("--case", action="append", choices=sorted(CASES), default=None)
    args = parser.parse_args()
    import gpt

    model, inputs = gpt.build(**gpt.GPT_124M, device="meta")
    spec = make_model_spec(model, inputs, gpt.loss_fn)
    precision = PlanOptions(args.devices, args.cluster, precision=args.precision).precision
    print(f"GPT-2 124M shape on {args.devices} x {args.cluster}, {precision}")
    print(f"{'pins':<16} {'pinned':>10} {'unpinned':>10} {'cost':>8}  plan; planning time")
    for name in args.case or list(CASES):
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plan = plan_model(spec, PlanOptions(args.devices, args.cluster, precision=precision, pins=CASES[name]))
        seconds = time.perf_counter() - start
        cost = plan.pin_cost
        assert cost is not None
        free = format_seconds(cost.unpinned_step_time_s) if cost.unpinned_step_time_s else "none fits"
        fraction = f"{cost.fraction:+.1%}" if cost.fraction is not None else "-"
        shape = (f"{len(plan.stages)} stage(s), {stage_meshes_text([s.mesh for s in plan.stages])}, "
                 f"{plan.microbatches} microbatch(es), {len(plan.recompute)} recomputed")
        print(f"{name:<16} {format_seconds(cost.pinned_step_time_s):>10} {free:>10} {fraction:>8}  {shape}; "
              f"{seconds:.1f} s", flush=True)


if __name__ == "__main__":
    main()
