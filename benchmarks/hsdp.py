"""HSDP against FSDP across nodes: Llama 3.1 8B's shape on 2 and 4 nodes of 8 H100s.

    .venv/bin/python benchmarks/hsdp.py [--nodes 2 4] [--search]

Each row costs a ``--manual`` plan under the same model as the planner (``cost_manual``; bf16,
AdamW, sequence length 8,192, torchtitan's local batch of 2 sequences per GPU, every layer
recomputed so that every variant fits 80 GB): FSDP over every GPU (``fsdp=N``: the parameter
all-gathers and gradient reduce-scatters cross the nodes' links), HSDP (``dp=nodes,fsdp=8``:
gathered and reduce-scattered inside a node over NVLink, the reduced shard all-reduced across
nodes), and plain data parallelism with ZeRO-1 across nodes for comparison. ``--search`` also
plans the model (one stage, the search's own choice of mesh, storage and recomputation).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from torchtitan_recipes import SEQ, Recipe, _build, _row  # noqa: E402

from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.front_door import plan_model  # noqa: E402
from autoplan.planner.manual import cost_manual, parse_manual  # noqa: E402
from autoplan.planner.options import PlanOptions  # noqa: E402

GPUS_PER_NODE = 8
LOCAL_BATCH = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--search", action="store_true", help="also plan the model (slow)")
    args = parser.parse_args()
    for nodes in args.nodes:
        devices = nodes * GPUS_PER_NODE
        recipe = Recipe("8b", "Llama 3.1 8B", 4096, 32, 32, 14336, devices, LOCAL_BATCH * devices, "", 0, "")
        model, inputs = _build(recipe)
        spec = make_model_spec(model, inputs, name=recipe.name)
        options = PlanOptions(devices, "h100", precision="bf16", plan_only=True, stages=1)
        print(f"{recipe.name} on {nodes} nodes x {GPUS_PER_NODE} H100s, global batch {recipe.global_batch} x {SEQ}",
              flush=True)
        for text in (f"fsdp={devices},ac=full", f"dp={nodes},fsdp={GPUS_PER_NODE},ac=full",
                     f"dp={devices},zero=1,ac=full"):
            start = time.perf_counter()
            alternative = cost_manual(spec, options.planner_options(), parse_manual(text))
            label = f"{text} ({time.perf_counter() - start:.0f} s to cost)"
            print(_row(label, recipe, alternative.predicted, alternative.reason), flush=True)
        if args.search:
            start = time.perf_counter()
            plan = plan_model(spec, replace(options, manual=()))
            print(_row(f"found: mesh {'x'.join(map(str, plan.mesh))}, {plan.microbatches} mb "
                       f"({time.perf_counter() - start:.0f} s to plan)", recipe, plan.predicted), flush=True)


if __name__ == "__main__":
    main()
