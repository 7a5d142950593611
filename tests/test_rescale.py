"""A graph rescaled from two traces (autoplan/trace/rescale.py) is the graph a trace at that
batch size gives: the same hash (ops, arguments, shapes), node infos and layers, for every
architecture of the zoo; the pipeline search plans alike with rescaled graphs or traces; and the
search spread over processes finds what one process finds."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.options import PlanOptions
from autoplan.planner.workers import TaskPool
from autoplan.trace.layers import make_layers
from autoplan.trace.microbatch import microbatch_inputs
from autoplan.trace.repeated import find_classes
from autoplan.trace.rescale import BatchSizeGraphs, NotAffine, rescale
from autoplan.trace.tracer import describe, trace
from launcher import ROOT

sys.path.insert(0, str(ROOT / "tests"))
from zoo import ALL_CASES, BATCH  # noqa: E402


def _spec(name: str):
    case = ALL_CASES[name]()
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name)


def _trace_at(spec, size: int):
    return trace(spec.with_inputs(microbatch_inputs(spec.example_inputs, BATCH // size)))


@pytest.mark.parametrize("name", sorted(ALL_CASES))
def test_rescaled_graph_is_the_trace(name: str) -> None:
    spec = _spec(name)
    first, one = _trace_at(spec, BATCH), _trace_at(spec, 1)
    for size in (2, 4):
        real = _trace_at(spec, size)
        try:
            rescaled = rescale(first, one, (BATCH, 1), size, lambda gm, ep: describe(gm, ep, spec.module))
        except NotAffine:
            # the search then traces this size: allowed, but not for the common families
            assert name not in ("llama", "gpt2", "bert", "mixtral", "vit", "resnet"), name
            continue
        assert rescaled.graph_hash == real.graph_hash, (name, size)
        assert list(rescaled.nodes.values()) == list(real.nodes.values()), (name, size)
        layers = [layer.nodes for layer in make_layers(rescaled, find_classes(rescaled))]
        assert layers == [layer.nodes for layer in make_layers(real, find_classes(real))]
        # the program runs the written graph module like the traced one
        assert rescaled.graph_module.code == real.graph_module.code


def test_size_one_is_traced_and_other_sizes_rescaled() -> None:
    spec = _spec("llama")
    traced: list[int] = []

    def trace_fn(size: int):
        traced.append(size)
        return _trace_at(spec, size)

    graphs = BatchSizeGraphs(trace_fn, lambda gm, ep: describe(gm, ep, spec.module))
    for size in (8, 1, 4, 2):
        graphs.get(size)
    assert traced == [8, 1]
    assert graphs.is_traced(graphs.get(8)) and not graphs.is_traced(graphs.get(4))
    assert graphs.trace(4).graph_hash == graphs.get(4).graph_hash


def test_pipeline_plan_made_on_traces_and_independent_of_jobs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan found with rescaled graphs and two processes equals the plan found tracing
    every microbatch size in one process; its graph is a trace."""
    spec = _spec("llama")
    # small enough that a pipeline wins the search (no native rival set against it)
    options = dict(memory_per_device=2e6, recompute="none", native_rivals=False)
    parallel = plan_model(spec, PlanOptions(4, "h100", jobs=2, **options))
    monkeypatch.setattr(BatchSizeGraphs, "get", BatchSizeGraphs.trace)
    serial = plan_model(spec, PlanOptions(4, "h100", jobs=1, **options))
    assert len(parallel.stages) > 1
    assert _decisions(parallel) == _decisions(serial)
    assert parallel.graph_hash == serial.graph_hash


def _decisions(plan) -> dict:
    data = plan.decisions()
    data["options"].pop("jobs")
    return data


def test_task_pool_keeps_submission_order_and_names_errors() -> None:
    pool: TaskPool[int] = TaskPool(3, unpack=lambda i, x: (i, x))
    for i in range(7):
        pool.submit(lambda i=i: i * i)
    assert pool.answer(5) == (5, 25)  # one answer, waited for while the others run
    assert pool.results() == [(i, i * i) for i in range(7)]

    def fails() -> int:
        raise ValueError("boom")

    failing: TaskPool[int] = TaskPool(2)
    failing.submit(lambda: 1)
    failing.submit(fails)
    with pytest.raises(RuntimeError, match="ValueError: boom"):
        failing.results()
    dying: TaskPool[int] = TaskPool(2)
    parent = os.getpid()
    dying.submit(lambda: 7 if os.getpid() == parent else os._exit(3))  # dies in a child: runs here
    assert dying.results() == [7]
    inline: TaskPool[int] = TaskPool(1)
    with pytest.raises(ValueError, match="boom"):  # one job: the task runs when submitted
        inline.submit(fails)


def test_task_pool_cancel_stops_its_children(tmp_path: Path) -> None:
    pool: TaskPool[int] = TaskPool(2)

    def sleeper(k: int) -> int:
        written = tmp_path / f"{k}.written"  # renamed once whole: never read half-written
        written.write_text(str(os.getpid()))
        written.rename(tmp_path / f"{k}.pid")
        time.sleep(600)
        return k

    for k in range(3):  # two start, one waits
        pool.submit(lambda k=k: sleeper(k))
    for _ in range(1200):  # (a minute at most: the children write their pids as they start)
        if len(list(tmp_path.glob("*.pid"))) == 2:
            break
        time.sleep(0.05)
    assert len(list(tmp_path.glob("*.pid"))) == 2
    pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
    pool.cancel()
    for pid in pids:  # terminated and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (tmp_path / "2.pid").exists()  # the waiting task never started


def test_default_jobs_share_the_node_with_other_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from autoplan.planner.workers import default_jobs

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = default_jobs()
    assert alone >= 1
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(alone * 2))  # more ranks than cores: one process each
    assert default_jobs() == 1


def _traced_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    sizes: list[int] = []
    real_trace = BatchSizeGraphs.trace

    def recording(self: BatchSizeGraphs, size: int):
        if size not in self.traced:
            sizes.append(size)
        return real_trace(self, size)

    monkeypatch.setattr(BatchSizeGraphs, "trace", recording)
    return sizes


def test_rivals_are_planned_on_rescaled_graphs_and_only_the_winner_traced(monkeypatch: pytest.MonkeyPatch) -> None:
    """The close candidates are planned exactly on the graphs the search used: a rival whose
    microbatch was rescaled is not traced; the winner's is, and its plan is the one made when
    every rival was traced first (the trace is the rescaled graph)."""
    from autoplan.planner import pipeline as pipeline_module

    spec = _spec("llama")
    options = PlanOptions(4, "h100", jobs=1, memory_per_device=2e6, recompute="none", native_rivals=False)
    monkeypatch.setattr(pipeline_module, "RERANK_MARGIN", 100.0)  # the REFINED best all planned exactly
    sizes = _traced_sizes(monkeypatch)
    likely: list[int] = []  # the search's best: traced while the exact plans run, as it usually wins
    real_likely = pipeline_module._likely_winner_traced

    def likely_winner_traced(candidate, *args):
        likely.append(BATCH // candidate.microbatches)
        return real_likely(candidate, *args)

    monkeypatch.setattr(pipeline_module, "_likely_winner_traced", likely_winner_traced)
    plan = plan_model(spec, options)
    exact = [a for a in plan.alternatives if a.predicted is not None]
    rescaled_rivals = [a for a in exact if BATCH // int(re.search(r"(\d+) microbatch", a.name).group(1)) not in sizes]
    assert rescaled_rivals, [a.name for a in exact]
    assert sizes[:2] == [BATCH, 1] and set(sizes) <= {BATCH, 1, BATCH // plan.microbatches, *likely}
    assert BATCH // plan.microbatches in sizes

    # the winner checked on its trace and planned again there when the trace differs
    searched_again: list[int] = []
    real_on_traced_graph = pipeline_module.on_traced_graph

    def on_traced_graph(candidate, *args):
        searched_again.append(candidate.microbatches)
        return real_on_traced_graph(candidate, *args)

    monkeypatch.setattr(pipeline_module, "traced_twin", lambda *args: None)
    monkeypatch.setattr(pipeline_module, "on_traced_graph", on_traced_graph)
    again = plan_model(spec, options)
    assert _decisions(again) == _decisions(plan) and again.graph_hash == plan.graph_hash
    if BATCH // plan.microbatches not in (BATCH, 1):  # the winner was found on a rescaled graph
        assert searched_again == [plan.microbatches]
