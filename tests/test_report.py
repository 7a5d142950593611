"""The plan report: a self-contained HTML page and Markdown with PNGs, whose numbers are the plan's."""

from __future__ import annotations

import base64
import io
import os
import re
import subprocess
import sys
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest

from autoplan.cli import launch, run
from autoplan.load import load_model_file
from autoplan.plan_schema import Plan
from autoplan.planner.api import make_options, plan_spec
from autoplan.planner.manual import ManualPlan, cost_manual, parse_manual, plan_manual
from autoplan.planner.meshes import meshes_label
from autoplan.planner.pipeline import PipelineOptions, plan_pipeline
from autoplan.reports import parse_train_log, write_report
from autoplan.reports.baselines import cost_baselines
from autoplan.reports.report import comm_by_kind, placement_groups
from autoplan.solvers import format_bytes, format_seconds
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LOG = """
*****************************************
step 0 loss 4.500000 time 0.200000
some other line
step 1 loss 4.250000 time 0.050000
step 2 loss 4.000000 time 0.052000
"""


class _Tables(HTMLParser):
    """Every table of a page as rows of cell texts."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def _tables(page: str) -> list[list[list[str]]]:
    parser = _Tables()
    parser.feed(page)
    return parser.tables


def _summary(page: str) -> dict[str, str]:
    return {row[0]: row[1] for row in _tables(page)[0] if len(row) == 2}


@pytest.fixture(scope="module")
def mlp_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan]:
    out = tmp_path_factory.mktemp("mlp_report")
    spec = load_model_file(str(ROOT / "examples" / "mlp.py"))
    options = make_options(2, "cpu")
    plan, _graph = plan_spec(spec, options)
    plan.alternatives.append(cost_manual(spec, options, parse_manual("dp=3")))  # infeasible on 2 devices
    plan.save(out / "plan.json")
    write_report(Plan.load(out / "plan.json"), out, spec, options)
    return out, Plan.load(out / "plan.json")


@pytest.fixture(scope="module")
def gpt_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan]:
    out = tmp_path_factory.mktemp("gpt_report")
    spec = load_model_file(str(ROOT / "examples" / "gpt.py"))
    options = make_options(2, "cpu")
    plan = plan_pipeline(spec, options, PipelineOptions(stages=2, microbatches=2))
    plan.save(out / "plan.json")
    write_report(Plan.load(out / "plan.json"), out, spec, options, run=parse_train_log(LOG))
    return out, Plan.load(out / "plan.json")


@pytest.mark.parametrize("which", ["mlp_report", "gpt_report"])
def test_html_is_self_contained_and_every_image_is_a_png(which: str, request: pytest.FixtureRequest) -> None:
    import matplotlib.image

    out, _plan = request.getfixturevalue(which)
    page = (out / "report.html").read_text()
    lowered = page.lower()
    for banned in ('src="http', "src='http", "<script", "<link", "url(http", "@import", "href="):
        assert banned not in lowered, banned
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) >= 4
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        data = base64.b64decode(src.split(",", 1)[1], validate=True)
        assert data.startswith(PNG_SIGNATURE)
        image = matplotlib.image.imread(io.BytesIO(data), format="png")
        assert image.shape[0] > 50 and image.shape[1] > 50


@pytest.mark.parametrize("which", ["mlp_report", "gpt_report"])
def test_numbers_in_the_report_are_the_plans(which: str, request: pytest.FixtureRequest) -> None:
    out, plan = request.getfixturevalue(which)
    page = (out / "report.html").read_text()
    summary = _summary(page)
    p = plan.predicted
    assert summary["mesh (per stage)"] == meshes_label([s.mesh for s in plan.stages] or [plan.mesh])
    assert summary["microbatches"] == str(plan.microbatches)
    assert summary["stages"] == str(len(plan.stages))
    assert summary["schedule"] == plan.schedule
    assert summary["predicted step time"].startswith(format_seconds(p.step_time_s) + " ")
    assert f"compute {format_seconds(p.compute_s)}" in summary["predicted step time"]
    assert summary["memory per device (peak)"].startswith(format_bytes(p.memory_bytes.peak) + " of ")
    assert f"params {format_bytes(p.memory_bytes.params)}" in summary["memory by kind"]
    assert summary["training"].startswith(f"{plan.optimizer.name} (lr ")
    assert f"; {plan.precision.name}: " in summary["training"]
    # the same figures in the Markdown, and every image it names is beside it
    md = (out / "report.md").read_text()
    assert f"| mesh (per stage) | {meshes_label([s.mesh for s in plan.stages] or [plan.mesh])} |" in md
    assert f"| predicted step time | {format_seconds(p.step_time_s)} " in md
    assert f"| memory per device (peak) | {format_bytes(p.memory_bytes.peak)} of " in md
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", md)
    assert images and all((out / name).read_bytes().startswith(PNG_SIGNATURE) for name in images)
    assert len(images) == len(re.findall(r"<img ", page))
    # every parameter of the plan is in the placement table, with its placements
    placement_rows = next(t for t in _tables(page) if t[0][:3] == ["module", "parameter", "count"])
    assert sum(int(r[2]) for r in placement_rows[1:]) == len(plan.params)


def test_sections_of_a_single_stage_plan(mlp_report: tuple[Path, Plan]) -> None:
    out, plan = mlp_report
    page = (out / "report.html").read_text()
    for title in ("1. Plan summary", "2. Placements per layer", "3. Predicted step time", "4. Memory per device",
                  "5. Found plan vs baselines"):
        assert title in page
    assert "Pipeline timeline" not in page and "Measured run" not in page
    comparison = next(t for t in _tables(page) if t[0][:2] == ["plan", "shape"])
    names = [row[0] for row in comparison[1:]]
    assert names[0] == "found plan"
    assert "data parallel (dp=2)" in names and "Megatron tensor parallel (tp=2)" in names
    assert any(n.startswith("pipeline (pp=2") for n in names)
    infeasible = next(row for row in comparison if row[0].startswith("manual dp=3"))
    assert infeasible[2].startswith("infeasible")
    step = next(t for t in _tables(page) if t[0] == ["part", "time", "share of the step"])
    assert step[-1] == ["step (predicted)", format_seconds(plan.predicted.step_time_s), "100.0%"]


def test_pipeline_report_has_timeline_and_run(gpt_report: tuple[Path, Plan]) -> None:
    out, plan = gpt_report
    page = (out / "report.html").read_text()
    assert "6. Pipeline timeline" in page and "7. Measured run" in page
    assert (out / "report_timeline.png").is_file() and (out / "report_loss.png").is_file()
    run_table = next(t for t in _tables(page) if t and t[0] == ["steps", "3"])
    cells = dict(row for row in run_table)
    assert cells["predicted step time"] == format_seconds(plan.predicted.step_time_s)
    assert cells["measured step time"].startswith(format_seconds(0.051))  # median of the steps after the first
    assert cells["last loss"] == "4.000000"
    stages = next(t for t in _tables(page) if t[0][:2] == ["stage", "layers"])
    assert [r[5] for r in stages[1:]] == [format_seconds(s.latency_s) for s in plan.stages]


@pytest.fixture(scope="module")
def gpt_on_4() -> tuple:
    """The GPT example on 4 H100s: its spec and options, the one-device plan (every op whole:
    what a replicated plan computes on each device) and the report's baselines by label."""
    spec = load_model_file(str(ROOT / "examples" / "gpt.py"))
    options = make_options(4)
    found, _graph = plan_spec(spec, options)
    single, _graph = plan_spec(spec, make_options(1))
    return spec, options, single, {a.name: a for a in cost_baselines(found, spec, options)}


def test_data_parallel_baseline_shards_the_batch_and_all_reduces_gradients(gpt_on_4: tuple) -> None:
    spec, options, single, baselines = gpt_on_4
    dp = baselines["data parallel (dp=4)"].predicted
    whole = single.predicted
    assert dp is not None
    # each device computes a quarter of the batch: a quarter of the activations, well under half
    # the compute (the optimizer step and per-op latency do not shrink with the batch)
    assert dp.compute_s < 0.5 * whole.compute_s
    assert dp.memory_bytes.activations == pytest.approx(whole.memory_bytes.activations / 4, rel=0.1)
    assert dp.memory_bytes.params == whole.memory_bytes.params
    plan = plan_manual(spec, options, ManualPlan(dp=4))
    assert all(p == ["R"] for p in plan.params.values())
    assert all(spec_ == ["S(0)"] for spec_ in plan.inputs.values())
    reduced = {c.where.split(" -> ")[0] for c in plan.collectives
               if c.kind == "all_reduce" and c.phase == "backward" and c.tensor == "gradient"}
    assert {"h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "h.0.mlp.c_proj.weight"} <= reduced


def test_tensor_parallel_baseline_is_megatron_column_row_pairs(gpt_on_4: tuple) -> None:
    spec, options, single, baselines = gpt_on_4
    tp = baselines["Megatron tensor parallel (tp=4)"].predicted
    assert tp is not None and tp.comm_s > 0
    assert tp.memory_bytes.params < 0.35 * single.predicted.memory_bytes.params
    plan = plan_manual(spec, options, ManualPlan(tp=4))
    for block in ("h.0", "h.1"):  # column then row: [out, in] weights split by out, then by in
        assert plan.params[f"{block}.attn.c_attn.weight"] == ["S(0)"]
        assert plan.params[f"{block}.attn.c_proj.weight"] == ["S(1)"]
        assert plan.params[f"{block}.mlp.c_fc.weight"] == ["S(0)"]
        assert plan.params[f"{block}.mlp.c_proj.weight"] == ["S(1)"]
    assert not [c for c in plan.collectives if c.tensor == "parameter"]  # weights are used in place, never gathered
    pairs = 2 * 2  # attention and MLP in each of the 2 blocks

    def all_reduces(phase: str) -> int:
        return sum(c.count for c in plan.collectives
                   if c.kind == "all_reduce" and c.phase == phase and c.tensor == "activation")

    assert all_reduces("forward") >= pairs and all_reduces("backward") >= pairs


def test_figures_need_no_display_and_leave_pyplot_alone(tmp_path: Path) -> None:
    """The timeline PNG is drawn without pyplot: with a GUI backend asked for and no display,
    it is written, and the caller's backend is not switched."""
    code = ("import sys, matplotlib\n"
            "from pathlib import Path\n"
            "from autoplan.reports.timeline import write_timeline\n"
            f"paths = write_timeline([1e-3, 2e-3], 4, '1f1b', Path({str(tmp_path)!r}))\n"
            "assert 'matplotlib.pyplot' not in sys.modules, 'pyplot imported'\n"
            "print(paths[1].read_bytes()[:8] == bytes.fromhex('89504e470d0a1a0a'))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "TkAgg"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=backstop(120), check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_repeated_layers_are_one_row() -> None:
    plan = Plan.from_dict({**_tiny_plan(), "params": {"h.0.w": ["S(1)"], "h.1.w": ["S(1)"], "h.2.w": ["R"],
                                                      "head.w": ["R"]}})
    rows = [(g.label, g.placements) for g in placement_groups(plan)]
    assert rows == [("h.*.w (x2)", ("S(1)",)), ("h.2.w", ("R",)), ("head.w", ("R",))]


def test_communication_split_by_kind_adds_up_to_the_plans(mlp_report: tuple[Path, Plan]) -> None:
    _out, plan = mlp_report
    plan = Plan.from_dict({**_tiny_plan(), "collectives": [
        {"kind": "all_reduce", "phase": "backward", "mesh_axis": 0, "bytes": 4e6, "count": 2},
        {"kind": "all_gather", "phase": "forward", "mesh_axis": 0, "bytes": 1e6, "count": 1}]})
    kinds, estimated = comm_by_kind(plan)
    assert estimated and set(kinds) == {"all_reduce", "all_gather"}
    assert sum(kinds.values()) == pytest.approx(plan.predicted.comm_s)
    assert kinds["all_reduce"] > kinds["all_gather"]
    recorded = replace(plan, predicted=replace(plan.predicted, comm_by_kind_s={"all_to_all": 0.25}))
    assert comm_by_kind(recorded) == ({"all_to_all": 0.25}, False)


def _tiny_plan() -> dict:
    return {
        "format": "autoplan.plan/3", "graph_hash": "x", "devices": 2, "mesh": [2], "microbatches": 1,
        "schedule": "none", "inputs": {}, "nodes": [], "collectives": [],
        "optimizer": {"name": "adamw"}, "precision": {"name": "fp32"}, "recompute": [], "storage": {},
        "cluster": make_options(2, "cpu").cluster.to_dict(),
        "stages": [{"layers": ["layer0"], "devices": [0, 1], "mesh": [2]}], "params": {},
        "predicted": {"step_time_s": 1.0, "compute_s": 0.5, "comm_s": 0.5, "bubble_s": 0.0,
                      "memory_bytes": {"params": 1, "grads": 1, "optimizer": 2, "activations": 3, "peak": 7}},
    }


def test_train_log_with_and_without_times(tmp_path: Path) -> None:
    timed = parse_train_log(LOG)
    assert timed.steps == [0, 1, 2] and timed.losses == [4.5, 4.25, 4.0]
    assert timed.times_s == [0.2, 0.05, 0.052] and timed.measured_step_s == pytest.approx(0.051)
    untimed = parse_train_log("step 0 loss 2.0\nstep 1 loss 1.5\n")
    assert untimed.losses == [2.0, 1.5] and untimed.times_s is None and untimed.measured_step_s is None
    assert parse_train_log("no steps here\n").steps == []
    plan = Plan.from_dict(_tiny_plan())
    write_report(plan, tmp_path, run=untimed, progress=lambda _m: None)
    page = (tmp_path / "report.html").read_text()
    assert "not measured" in page and "Baselines were not costed" in page
    assert not (tmp_path / "report_measured_step.png").exists()


def test_cli_report_flag_and_progress(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--no-pipeline", "--report",
                "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert (tmp_path / "report.html").is_file() and (tmp_path / "report.md").is_file()
    assert "report.html" in captured.out
    assert "autoplan: report: placement map" in captured.err and "autoplan: report: memory" in captured.err
    plan = Plan.load(tmp_path / "plan.json")
    assert _summary((tmp_path / "report.html").read_text())["predicted step time"].startswith(
        format_seconds(plan.predicted.step_time_s))


def test_launch_tees_the_child_output(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    script = tmp_path / "train.py"
    script.write_text("print('step 0 loss 1.5 time 0.25', flush=True)\nprint('step 1 loss 1.25 time 0.125')\n")
    output: list[str] = []
    assert launch(script, 1, 2, False, output) == 0
    assert "step 1 loss 1.25 time 0.125" in capsys.readouterr().out
    log = parse_train_log("".join(output))
    assert log.losses == [1.5, 1.25] and log.times_s == [0.25, 0.125]
    assert sys.executable  # launch runs the child with this interpreter
