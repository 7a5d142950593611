"""How far the stage search's layer-range costs are from one intra-op ILP over the range.

    .venv/bin/python benchmarks/range_costs.py [--model 1.3B] [--microbatches 64] [--devices 4]

The stage search (autoplan/planner/pipeline.py) costs a range of layers as the sum of its
layers' own ILPs plus a correction for each boundary inside it (the ILP of the two layers that
meet there). Under a memory budget, where the layers' fastest plans do not fit together, it
trims them to their shares of the budget instead. This script solves, for every layer range
[a, b) of an Alpa-suite GPT and every logical mesh of every sub-mesh the search would try, the
range's own ILP (the answer the search approximates) and prints how far the two are apart:
seconds per step without a budget, and, under the device's memory, seconds and whether they
agree that the range fits.

Models as in benchmarks/alpa_gpt_suite.py (meta device, fp16, mixed-precision Adam,
activation checkpointing, V100 16 GB nodes of 8).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402

from autoplan.cost_models import OptimizerSpec  # noqa: E402
from autoplan.errors import MemoryInfeasibleError  # noqa: E402
from autoplan.planner.api import make_options  # noqa: E402
from autoplan.planner.recompute import RecomputePolicy  # noqa: E402
from autoplan.planner.mesh_plan import plan_intra_op  # noqa: E402
from autoplan.trace.layers import make_layers  # noqa: E402
from autoplan.trace.repeated import find_classes  # noqa: E402
from autoplan.load import make_model_spec  # noqa: E402
from autoplan.planner.meshes import mesh_label  # noqa: E402
from autoplan.trace.microbatch import microbatch_inputs  # noqa: E402
from autoplan.planner.pipeline.search import stage_meshes  # noqa: E402
from autoplan.planner.pipeline import (  # noqa: E402
    layer_costs,
    RangeTable,

    activations_in_flight,
)
from autoplan.trace.subgraph import extract  # noqa: E402
from autoplan.trace.tracer import trace  # noqa: E402
from autoplan.solvers.inter_op import SubMesh  # noqa: E402

MODELS = {"1.3B": (2048, 24, 32), "2.6B": (2560, 32, 32), "6.7B": (4096, 32, 32)}  # hidden, layers, heads
BATCH, SEQ, VOCAB = 1024, 1024, 51200


def _relative(approx: float, exact: float) -> float:
    return abs(approx - exact) / exact if exact else 0.0


def _spread(errors: list[float]) -> str:
    return f"{statistics.median(errors):.2%} / {max(errors):.2%}" if errors else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=list(MODELS), default="1.3B")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=64)
    parser.add_argument("--cluster", default="v100-16g")
    args = parser.parse_args()
    hidden, layers_, heads = MODELS[args.model]
    model, inputs = gpt.build(hidden=hidden, layers=layers_, heads=heads, seq=SEQ, vocab=VOCAB, batch=BATCH,
                              device="meta")
    spec = make_model_spec(model.half(), microbatch_inputs(inputs, args.microbatches), gpt.loss_fn)
    options = replace(make_options(args.devices, args.cluster, optimizer=OptimizerSpec("adam", mixed_precision=True)),
                      recompute=RecomputePolicy.ALL)
    budget = options.memory_budget
    graph = trace(spec)
    layers = make_layers(graph, find_classes(graph), None)
    print(f"GPT {args.model}, {len(layers)} layers, {args.microbatches} microbatches, {args.devices} devices, "
          f"budget {budget / 2**30:.1f} GiB per device")
    print("sub-mesh | mesh | ranges | no budget: median / max error | fastest plan fits: median / max error | "
          "memory-bound, both fit: count, median / max error | fit agrees (search says no / yes, ILP the other) | time")
    print("--- | --- | --- | --- | --- | --- | --- | ---")
    width = 1
    while width <= args.devices:
        submesh = SubMesh(1, width)
        stages = args.devices // width
        in_flight = activations_in_flight("1f1b", args.microbatches, stages)
        for mesh in stage_meshes(options, submesh):
            table = RangeTable(graph, layers, layer_costs(options, mesh, args.microbatches, in_flight),
                                boundaries=True)
            ctx = table.costs.ctx
            free, fits, bound, agree, pessimistic, optimistic, total = [], [], [], 0, 0, 0, 0
            start = time.perf_counter()
            for a in range(len(layers)):
                for b in range(a + 1, len(layers) + 1):
                    sub = extract(graph, [n for layer in layers[a:b] for n in layer.nodes])
                    classes = find_classes(sub)
                    exact = plan_intra_op(sub, classes, mesh, ctx, None).solution
                    unbounded = table.cost(a, b, None)
                    free.append(_relative(unbounded[0], exact.objective))
                    seconds, memory = table.cost(a, b, budget)
                    try:
                        fitted = plan_intra_op(sub, classes, mesh, ctx, budget).solution.objective
                    except MemoryInfeasibleError:
                        fitted = None
                    total += 1
                    agree += (memory <= budget) == (fitted is not None)
                    pessimistic += memory > budget and fitted is not None
                    optimistic += memory <= budget and fitted is None
                    if fitted is not None and memory <= budget:
                        (fits if unbounded[1] <= budget else bound).append(_relative(seconds, fitted))
            elapsed = time.perf_counter() - start
            print(f"{submesh} | {mesh_label(mesh)} | {total} | {_spread(free)} | {_spread(fits)} | "
                  f"{len(bound)}, {_spread(bound)} | {agree}/{total} ({pessimistic} / {optimistic}) | {elapsed:.1f} s",
                  flush=True)
        width *= 2


if __name__ == "__main__":
    main()
