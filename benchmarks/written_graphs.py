"""A model's graph written from a trace of its first blocks (``autoplan/trace/deepen.py``)
against the trace of the whole model: seconds of each, and whether they are the same graph
node for node (names, ops, arguments, node infos, lifted parameters, graph hash, code).

    .venv/bin/python benchmarks/written_graphs.py [--zoo-layers 12] [--no-zoo] [--no-real-size]

Rows: every family of the zoo (``tests/zoo.py``) built with ``--zoo-layers`` blocks per stack,
then the real-size models of ``planning_time.py`` on the meta device. ``unit`` is the period of
each stack's blocks' settings (:func:`~autoplan.trace.deepen.settings_period`); a model the writer
refuses says why, and the search then traces it whole.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "examples"), str(ROOT / "benchmarks")]


def _zoo(layers: int) -> Iterator[tuple[str, Callable[[], tuple]]]:
    os.environ["ZOO_LAYERS"] = str(layers)  # read when the zoo is first imported
    from zoo import ALL_CASES

    for name, build in ALL_CASES.items():
        def built(build=build) -> tuple:
            case = build()
            return case.model, case.example_inputs, case.loss_fn
        yield name, built


def _real_size() -> Iterator[tuple[str, Callable[[], tuple]]]:
    import planning_time

    for _, name, _, build, loss_fn in planning_time._cases():
        yield name, lambda build=build, loss_fn=loss_fn: (*build(), loss_fn)


def _same(real, written) -> bool:
    def nodes(graph) -> list[tuple]:
        return [(n.name, n.op, str(n.target), str(n.args), str(n.kwargs), graph.nodes[n.name])
                for n in graph.graph_module.graph.nodes]

    return (nodes(real) == nodes(written) and real.graph_hash == written.graph_hash
            and (real.param_names, real.input_names, real.tied) == (written.param_names, written.input_names,
                                                                    written.tied)
            and real.exported.graph_signature == written.exported.graph_signature
            and real.graph_module.code == written.graph_module.code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zoo-layers", type=int, default=12, help="blocks per stack of the zoo's models")
    parser.add_argument("--no-zoo", action="store_true")
    parser.add_argument("--no-real-size", action="store_true")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from autoplan.load import make_model_spec
    from autoplan.trace.deepen import NotDeepenable, deepened_trace, repeated_stacks, settings_period
    from autoplan.trace.tracer import trace

    cases = [] if args.no_zoo else list(_zoo(args.zoo_layers))
    cases += [] if args.no_real_size else list(_real_size())
    print("| model | stack | unit | traced | written | same graph |\n|---|---|---|---:|---:|---|", flush=True)
    for name, build in cases:
        model, inputs, loss_fn = build()
        spec = make_model_spec(model, inputs, loss_fn, name=name)
        stacks = repeated_stacks(spec.module)
        if not stacks:
            print(f"| {name} | none | | | | traced whole: no stack of repeated blocks |", flush=True)
            continue
        where = ", ".join(f"{stack.path} x{stack.length}" for stack in stacks)
        units = ", ".join(str(settings_period(list(spec.module.get_submodule(stack.path)))) for stack in stacks)
        start = time.perf_counter()
        real = trace(spec)
        traced_s = time.perf_counter() - start
        try:
            start = time.perf_counter()
            written = deepened_trace(spec, stacks)
            written_s = time.perf_counter() - start
        except NotDeepenable as e:
            print(f"| {name} | {where} | {units} | {traced_s:.2f} s | | traced whole: {e} |", flush=True)
            continue
        print(f"| {name} | {where} | {units} | {traced_s:.2f} s | {written_s:.2f} s | "
              f"{'yes' if _same(real, written) else '**no**'} |", flush=True)


if __name__ == "__main__":
    main()
