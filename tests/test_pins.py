"""Pins (``--pin``, ``autoplan.plan(..., pins=...)``): read, checked before any solving,
kept by the searches as constraints, and shown in the plan, summary and report."""

from __future__ import annotations

import importlib
import json
import math
import operator
import random
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from autoplan.cli import main
from autoplan.cost_models.step_costs import CostContext
from autoplan.errors import AutoplanError
from autoplan.load import load_model_file, make_model_spec
from autoplan.planner.api import make_options
from autoplan.planner.front_door import plan_model
from autoplan.planner.mesh_plan import GraphView, offered_output_specs, plan_intra_op
from autoplan.planner.options import PlanOptions
from autoplan.planner.pins import PinKind, PinSet, parse_pin, pin_file_texts
from autoplan.reports.summary import summary_text
from autoplan.sharding import R, S
from autoplan.solvers.intra_op.brute_force import BRUTE_FORCE_LIMIT, brute_force
from autoplan.trace.repeated import find_classes
from autoplan.trace.tracer import trace
from launcher import backstop

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
# Megatron-LM's layout of a GPT block over the second mesh axis: c_attn and c_fc split by
# output features (columns), the projections after them by input features (rows)
MEGATRON = ("h.*.attn.c_attn.weight=[*, S(0)]", "h.*.attn.c_proj.weight=[*, S(1)]",
            "h.*.mlp.c_fc.weight=[*, S(0)]", "h.*.mlp.c_proj.weight=[*, S(1)]", "mesh=2x2")


# ------------------------------------------------------------------------------------------
# reading pins
# ------------------------------------------------------------------------------------------

def test_every_kind_of_pin_is_read() -> None:
    placement = parse_pin("model.layers.*.mlp.up_proj.weight=[R, S(1)]")
    assert placement.kind == PinKind.PLACEMENT and placement.placement == (R, S(1))
    assert parse_pin("h.0.mlp.c_fc.weight=[*, S(0)]").placement == (None, S(0))
    assert parse_pin("model.layers.0-7=stage:0").number == 0
    assert parse_pin("model.layers.*=checkpoint").kind == PinKind.CHECKPOINT
    assert parse_pin("*.weight=fsdp").kind == PinKind.FSDP
    assert parse_pin("lm_head.weight=zero2").kind == PinKind.ZERO2
    assert parse_pin("mesh=2x4").mesh == (2, 4)
    assert parse_pin("tp=8").number == 8 and parse_pin("microbatches=32").number == 32
    assert parse_pin("stages=2").kind == PinKind.STAGES


def test_patterns_match_dotted_names_ranges_and_modules_below() -> None:
    ranged = parse_pin("model.layers.2-4=stage:1")
    assert [ranged.matches(f"model.layers.{i}.mlp") for i in range(6)] == [False, False, True, True, True, False]
    assert not ranged.matches("model.layers.22.mlp")  # a range matches whole numbers only
    star = parse_pin("*.weight=fsdp")
    assert star.matches("h.0.attn.c_attn.weight") and not star.matches("h.0.attn.c_attn.bias")


@pytest.mark.parametrize("text, message", [
    ("h.0.weight", "write PATTERN=PLACEMENT"),
    ("h.0.weight=[Q]", "cannot read the placement"),
    ("h.0.weight=[]", "gives no placement"),
    ("h.0=stage:x", "cannot read the value"),
    ("tp=0", "tp must be a whole number"),
    ("mesh=2y4", "cannot read mesh"),
    ("h.5-2=stage:0", "runs backwards"),
])
def test_a_bad_pin_is_named_in_one_line(text: str, message: str) -> None:
    with pytest.raises(AutoplanError, match=message) as caught:
        parse_pin(text)
    assert "\n" not in str(caught.value)


def test_pins_that_disagree_are_refused() -> None:
    with pytest.raises(AutoplanError, match="disagree"):
        PinSet.read(["tp=2", "tp=4"])
    with pytest.raises(AutoplanError, match="different numbers of mesh axes"):
        PinSet.read(["a.weight=[S(0)]", "b.weight=[R, S(0)]"])
    with pytest.raises(AutoplanError, match="disagrees with mesh=4"):
        PlanOptions(4, "cpu", mesh=(4,), pins=("mesh=2x2",))


def test_a_pin_file_holds_many(tmp_path: Path) -> None:
    file = tmp_path / "pins.toml"
    file.write_text('mesh = "2x2"\nmicrobatches = 4\n[pins]\n"h.*.mlp.c_fc.weight" = ["R", "S(0)"]\n'
                    '"h.0" = "stage:0"\n')
    texts = pin_file_texts(file)
    assert texts == ["mesh=2x2", "microbatches=4", "h.*.mlp.c_fc.weight=[R, S(0)]", "h.0=stage:0"]
    options = PlanOptions(8, "cpu", pins=tuple(texts))
    assert options.mesh == (2, 2) and options.microbatches == 4
    assert options.without_pins().mesh is None and options.without_pins().microbatches is None
    with pytest.raises(AutoplanError, match="does not exist"):
        pin_file_texts(tmp_path / "missing.toml")


# ------------------------------------------------------------------------------------------
# the property: pinned optimum = brute force under the pins >= the unpinned optimum
# ------------------------------------------------------------------------------------------

GRAPHS = [  # (example, build keywords, mesh, random cases)
    ("mlp", {"hidden": 8, "batch": 4, "seq": 4}, (2,), 40),
    ("mlp", {"hidden": 8, "batch": 4, "seq": 4}, (2, 2), 25),
    ("gpt", {"hidden": 16, "layers": 1, "heads": 4, "seq": 8, "vocab": 32, "batch": 4}, (2,), 25),
]


def _graph(example: str, kwargs: dict):
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        module = importlib.import_module(example)
    finally:
        sys.path.pop(0)
    model, inputs = module.build(**kwargs)
    return trace(make_model_spec(model, inputs, getattr(module, "loss_fn", None)))


def _random_pins(rng: random.Random, graph, view, mesh: tuple[int, ...], free) -> list[str]:
    """1–3 pins on random parameters, inputs or ops: a random placement those offer (some axes
    left free with ``*``) or, in a third of the cases, the one the unpinned optimum chose."""
    names = [n for n, info in graph.nodes.items() if info.kind in ("parameter", "input", "op")
             and view.fx_nodes[n].target is not operator.getitem]
    pins = []
    for name in rng.sample(names, rng.randint(1, 3)):
        info = graph.nodes[name]
        spec = free.chosen[name].output_specs[0] if rng.random() < 1 / 3 else \
            rng.choice(offered_output_specs(view, name, mesh))
        items = ["*" if rng.random() < 0.25 else str(p) for p in spec]
        pins.append(f"{info.fqn or name}=[{', '.join(items)}]")
    return pins


@pytest.mark.parametrize("example, kwargs, mesh, cases", GRAPHS)
def test_the_pinned_optimum_is_brute_force_under_the_pins_and_never_below_the_unpinned(
        example: str, kwargs: dict, mesh: tuple[int, ...], cases: int) -> None:
    graph = _graph(example, kwargs)
    classes, view = find_classes(graph), GraphView.of(graph)
    options = make_options(math.prod(mesh), "h100", mesh)
    ctx = CostContext(mesh, options.cluster.mesh_links(mesh), options.cluster.device, options.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        free = plan_intra_op(graph, classes, mesh, ctx, None, canonical=False)
    rng = random.Random(f"{example}{mesh}")
    brute_forced = agreeing = 0
    for _ in range(cases):
        texts = _random_pins(rng, graph, view, mesh, free)
        pins = PinSet.read(texts)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pinned = plan_intra_op(graph, classes, mesh, ctx, None, canonical=False, pins=pins)
        for name, strategy in pinned.chosen.items():  # every pin holds
            if strategy.output_specs:
                assert pins.allows(graph.nodes[name], strategy.output_specs[0], mesh), (texts, name)
        assert pinned.solution.objective >= free.solution.objective * (1 - 1e-9), texts
        if math.prod(len(c) for c in pinned.problem.costs) <= BRUTE_FORCE_LIMIT:
            brute_forced += 1
            exact = brute_force(pinned.problem)
            assert math.isclose(pinned.solution.objective, exact.objective, rel_tol=1e-6, abs_tol=1e-12), texts
        if all(pins.allows(graph.nodes[n], s.output_specs[0], mesh) for n, s in free.chosen.items() if s.output_specs):
            agreeing += 1  # pins the unpinned optimum keeps cost nothing
            assert math.isclose(pinned.solution.objective, free.solution.objective, rel_tol=1e-6), texts
    assert brute_forced >= (cases // 4 if len(mesh) == 1 and example == "mlp" else 0)
    assert agreeing >= 1


# ------------------------------------------------------------------------------------------
# the front door: Megatron pinned on a GPT block, 2x2
# ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def megatron_plan():
    spec = load_model_file(GPT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(spec, PlanOptions(4, "cpu", pins=MEGATRON))


def test_the_megatron_pins_are_kept_and_the_planner_uses_the_other_axis(megatron_plan) -> None:
    plan = megatron_plan
    assert plan.mesh == [2, 2]
    for layer in (0, 1):
        assert plan.params[f"h.{layer}.attn.c_attn.weight"][1] == "S(0)"
        assert plan.params[f"h.{layer}.attn.c_proj.weight"][1] == "S(1)"
        assert plan.params[f"h.{layer}.mlp.c_fc.weight"][1] == "S(0)"
        assert plan.params[f"h.{layer}.mlp.c_proj.weight"][1] == "S(1)"
    # the free axis 0 is the planner's: it splits the batch there (data parallel)
    assert plan.inputs["idx"][0] == "S(0)"
    # column then row: the pair's activations stay sharded on axis 1 between them
    strategies = {n.name: n.strategy for n in plan.nodes}
    assert strategies["linear_2"].startswith(("S0S2", "RS2"))


def test_the_plan_records_the_pins_and_their_cost(megatron_plan, tmp_path: Path) -> None:
    plan = megatron_plan
    assert [r.pin for r in plan.pins] == list(MEGATRON)
    assert plan.pins[0].holds == ["h.0.attn.c_attn.weight", "h.1.attn.c_attn.weight"]
    assert plan.options["pins"] == list(MEGATRON)
    cost = plan.pin_cost
    assert cost is not None and cost.unpinned_step_time_s is not None
    assert cost.pinned_step_time_s == plan.predicted.step_time_s
    assert cost.fraction is not None and cost.fraction >= 0
    again = type(plan).from_json(plan.to_json())
    assert again.pins == plan.pins and again.pin_cost == plan.pin_cost
    text = summary_text(plan)
    assert "h.0.attn.c_attn.weight *" in text and "h.0.ln_1.weight *" not in text
    assert f"your pins cost {cost.fraction:.1%} of step time against the unpinned optimum" in text


def test_the_report_marks_pins_and_their_cost(megatron_plan, tmp_path: Path) -> None:
    from autoplan.reports.report import write_report

    write_report(megatron_plan, tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    assert "h.*.mlp.c_fc.weight=[*, S(0)]" in markdown and "your pins cost" in markdown
    assert "| pinned |" in markdown


# ------------------------------------------------------------------------------------------
# structure pins
# ------------------------------------------------------------------------------------------

def _plan(*pins: str, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan_model(load_model_file(GPT), PlanOptions(4, "cpu", pins=pins, **options))


def test_stage_pins_place_layers_and_checkpoint_pins_recompute_them() -> None:
    plan = _plan("h.0=stage:0", "h.1=stage:1", "h.1=checkpoint")
    assert [s.layers for s in plan.stages] == [["h.0"], ["h.1"]]
    assert [r.layer for r in plan.recompute] == ["h.1"]
    assert plan.pins[0].holds[0] == "h.0"


def test_hsdp_pins_split_the_batch_over_both_axes_and_a_pin_may_say_so() -> None:
    import fsdp_cases

    spec = make_model_spec(*fsdp_cases.nanogpt(), name="nanogpt")
    plan = plan_model(spec, PlanOptions(4, "cpu", pins=("dp=2", "fsdp=2", "idx=[S(0), S(0)]")))
    assert plan.mesh == [2, 2] and len(plan.stages) == 1
    assert plan.inputs == {"idx": ["S(0)", "S(0)"], "targets": ["S(0)", "S(0)"]}
    assert all(spec[0] == "R" for spec in plan.params.values())  # replicated over dp, sharded over fsdp
    assert any(spec[1].startswith("S(") for spec in plan.params.values())


def test_a_checkpoint_pin_holds_without_a_pipeline_too() -> None:
    plan = _plan("h.0=checkpoint", pipeline=False)
    assert [r.layer for r in plan.recompute] == ["h.0"]


def test_tp_and_fsdp_pins() -> None:
    plan = _plan("tp=2", pipeline=False)
    assert plan.mesh[-1] == 2
    assert all(placement[-1].startswith("S(") for name, placement in plan.params.items()
               if name.endswith(("c_attn.weight", "c_fc.weight", "c_proj.weight")))
    sharded = _plan("*.weight=fsdp", "mesh=4")
    assert all(placement[0].startswith("S(") for name, placement in sharded.params.items() if name.endswith(".weight"))


def test_zero2_pins_store_parameters_whole_and_their_gradients_and_states_sharded() -> None:
    plan = _plan("*.weight=zero2", "mesh=4", pipeline=False)
    weights = {fqn: s for fqn, s in plan.storage.items() if fqn.endswith(".weight")}
    assert len(weights) > 10
    for fqn, s in weights.items():
        assert s.param == ["R"] and s.grad[0].startswith("S(") and s.optimizer_state == s.grad and not s.held, fqn
    biases = [s for fqn, s in plan.storage.items() if fqn.endswith(".bias")]
    assert biases  # the pin holds the weights only: the biases are the planner's to choose


# ------------------------------------------------------------------------------------------
# impossible pins: one line each, exit 2, before any solving
# ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (["--mesh", "4", "--pin", "h.*.mlp.c_fc.weight=[R, S(0)]"], "names 2 mesh axes, and mesh 4 has 1"),
    (["--pin", "wte.weight=[S(0), S(0)]"], "cannot hold on mesh 2x2: wte.weight"),
    (["--pin", "linear=[P, P]"], "linear (aten.linear.default"),
    (["--pin", "h.1=stage:0", "--pin", "h.0=stage:1"], "breaks layer order"),
    (["--pin", "h.0=stage:3", "--stages", "2"], "out of range"),
    (["--pin", "h.1=stage:1", "--no-pipeline"], "pipelines are turned off"),
    (["--pin", "h.9.mlp=stage:0"], "matches no module"),
    (["--pin", "nothing.weight=[R, S(0)]"], "matches no parameter, input or graph node"),
    (["--pin", "getitem=[R, R]"], "one output of a multi-output op"),
    (["--pin", "tp=3"], "needs a last mesh axis of 3"),
    (["--pin", "h.0=checkpoint", "--recompute", "none"], "recompute is none"),
])
def test_an_impossible_pin_gives_one_line(args: list[str], message: str, tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exited:
        main([GPT, "--devices", "4", "--cluster", "cpu", "--out", str(out), *args])
    assert exited.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("autoplan: error:") and message in err and "\n" not in err, err
    assert not out.exists()  # nothing half-written


def test_a_dimension_the_mesh_does_not_divide(tmp_path: Path, capsys) -> None:
    model_file = tmp_path / "odd.py"
    model_file.write_text("import torch\nmodel = torch.nn.Linear(6, 10)\nexample_inputs = (torch.randn(8, 6),)\n")
    with pytest.raises(SystemExit) as exited:
        main([str(model_file), "--devices", "4", "--cluster", "cpu", "--mesh", "4", "--pin", "weight=[S(0)]",
              "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "pin 'weight=[S(0)]' cannot hold on mesh 4: weight" in err and "shape [10, 6]" in err


# ------------------------------------------------------------------------------------------
# what runs is what was pinned
# ------------------------------------------------------------------------------------------

def test_the_megatron_pinned_plan_runs_and_passes_the_check(tmp_path: Path) -> None:
    pins = [arg for pin in MEGATRON for arg in ("--pin", pin)]
    result = subprocess.run([sys.executable, "-m", "autoplan.cli", GPT, "--devices", "4", "--cluster", "cpu", *pins,
                             "--run", "--check", "--steps", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=backstop(600))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: PASSED" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["params"]["h.1.mlp.c_proj.weight"][1] == "S(1)"
    assert [p["pin"] for p in plan["pins"]] == list(MEGATRON)


def test_stage_pins_keep_to_the_stage_counts_that_can_hold_them() -> None:
    from autoplan.planner.pipeline.search import stage_pins_fit

    assert stage_pins_fit(4, 2, ((0, 0), (3, 1)))
    assert not stage_pins_fit(4, 3, ((3, 1),))  # no layer left for stage 2
    assert stage_pins_fit(4, 3, ())


def test_stage_pins_with_the_stage_count_left_to_the_search(tmp_path: Path) -> None:
    model_file = tmp_path / "gpt4.py"
    model_file.write_text(f"import sys\nsys.path.insert(0, {str(ROOT / 'examples')!r})\n"
                          "from gpt import build, loss_fn\nmodel, example_inputs = build(layers=4)\n")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_model(load_model_file(str(model_file)),
                          PlanOptions(4, "cpu", pins=("h.0-2=stage:0", "h.3=stage:1")))
    assert [s.layers for s in plan.stages] == [["h.0", "h.1", "h.2"], ["h.3"]]


def test_stage_checkpoint_and_placement_pins_run_in_a_pipeline_and_pass_the_check(tmp_path: Path) -> None:
    pins = ("model.layers.0=stage:0", "model.layers.1=stage:1", "model.layers.1=checkpoint",
            "model.layers.*.mlp.up_proj.weight=[S(0)]")
    result = subprocess.run([sys.executable, "-m", "autoplan.cli", str(ROOT / "tests" / "training_run_model.py"),
                             "--devices", "4", "--cluster", "cpu", *[a for p in pins for a in ("--pin", p)],
                             "--run", "--check", "--steps", "2", "--out", str(tmp_path)],
                            capture_output=True, text=True, timeout=backstop(600))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "check: PASSED" in result.stdout
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert [s["layers"] for s in plan["stages"]] == [["model.layers.0"], ["model.layers.1"]]
    assert [r["layer"] for r in plan["recompute"]] == ["model.layers.1"]
    assert all(plan["params"][f"model.layers.{i}.mlp.up_proj.weight"] == ["S(0)"] for i in (0, 1))


def test_the_python_api_takes_pins_as_a_dict() -> None:
    import torch

    import autoplan

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autoplan.plan(model, (torch.randn(4, 8),), devices=2, cluster="cpu",
                             pins={"0.weight": ["S(0)"], "mesh": "2"}, pipeline=False)
    assert plan.params["0.weight"] == ["S(0)"]
    assert plan.options["pins"] == ["0.weight=[S(0)]", "mesh=2"]


@pytest.mark.parametrize("name", ["wte.weight", "lm_head.weight"])
def test_a_pin_on_either_name_of_a_tied_weight_holds_it(name: str) -> None:
    plan = _plan(f"{name}=[S(1)]", "mesh=4")
    assert plan.params["wte.weight"] == plan.params["lm_head.weight"] == ["S(1)"]


# ------------------------------------------------------------------------------------------
# --manual's words as pins
# ------------------------------------------------------------------------------------------

def test_manual_words_are_pins_too() -> None:
    assert parse_pin("dp=2").kind == PinKind.DATA_PARALLEL
    assert parse_pin("fsdp=4").kind == PinKind.SHARDED_DATA_PARALLEL and parse_pin("fsdp=4").number == 4
    assert parse_pin("pp=2").kind == PinKind.STAGES
    assert parse_pin("zero=2").number == 2 and parse_pin("ac=full").choice == "full"
    assert PlanOptions(4, "cpu", pins=("ac=selective",)).recompute == "selective"
    assert PlanOptions(4, "cpu", pins=("ac=op",)).recompute == "op"  # torchtitan's per-op policy
    assert PinSet.read(["dp=2", "tp=4"]).data_parallel_mesh == (2, 4)
    assert PinSet.read(["fsdp=8"]).data_parallel_mesh == (8,)
    for bad, message in (("zero=3", "zero=3 is fsdp=N"), ("ac=some", "write ac=full")):
        with pytest.raises(AutoplanError, match=message):
            parse_pin(bad)
    assert PlanOptions(8, "cpu", pins=("dp=2", "fsdp=4")).mesh == (2, 4)  # HSDP
    with pytest.raises(AutoplanError, match="pin dp=2 or more too"):
        PlanOptions(8, "cpu", pins=("zero=1",))
    with pytest.raises(AutoplanError, match=r"the mesh of the dp/fsdp/tp pins \(2x2\) disagrees with mesh=4"):
        PlanOptions(4, "cpu", mesh=(4,), pins=("dp=2", "tp=2"))
    with pytest.raises(AutoplanError, match="disagrees with recompute=none"):
        PlanOptions(4, "cpu", recompute="none", pins=("ac=full",))


def test_dp_and_tp_pins_plan_no_slower_than_the_same_manual_plan() -> None:
    plan = _plan("dp=2", "tp=2", manual=("dp=2,tp=2",))
    assert plan.mesh == [2, 2] and plan.inputs["idx"][0] == "S(0)"
    assert all(p[0] == "R" for p in plan.params.values())  # data parallel over axis 0
    assert plan.params["h.0.mlp.c_fc.weight"][1].startswith("S(")  # tensor parallel over axis 1
    manual = next(a for a in plan.alternatives if a.name.startswith("manual dp=2"))
    assert manual.predicted is not None
    assert plan.predicted.step_time_s <= manual.predicted.step_time_s * (1 + 1e-9)


def test_pp_ac_and_zero_pins() -> None:
    plan = _plan("pp=2", "ac=full")
    assert len(plan.stages) == 2 and len(plan.recompute) == 2
    zero = _plan("dp=4", "zero=1")
    assert all(s.optimizer_state[0].startswith("S(") for name, s in zero.storage.items()
               if name.endswith("c_fc.weight"))
