"""One front door: the CLI, ``autoplan.plan`` and ``autoplan.parallelize`` plan alike; the
Plan holds every decision (optimizer, precision, recomputed regions, storage, options) and the
program carries out each of them or refuses it in one line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

import autoplan
from autoplan import cli
from autoplan.errors import AutoplanError
from autoplan.load import load_model_file
from autoplan.plan_schema import PLAN_FORMAT, Plan
from autoplan.planner.options import PlanOptions
from tests.launcher import launch_worker

ROOT = Path(__file__).resolve().parents[1]


def _cli_plan(tmp_path: Path, *args: str) -> Plan:
    parser = argparse.ArgumentParser()
    cli._add_plan_arguments(parser)
    assert cli.run_plan(parser.parse_args([*args, "--out", str(tmp_path)])) == 0
    return Plan.load(tmp_path / "plan.json")


@pytest.mark.parametrize("example, devices, options", [
    ("gpt2", 8, {}),
    ("funnel", 4, {"cluster": "cpu", "stages": 2, "microbatches": 2}),
])
def test_cli_and_python_give_equal_plans(example: str, devices: int, options: dict, tmp_path: Path) -> None:
    flags = [f"--{k}={v}" for k, v in options.items()]
    from_cli = _cli_plan(tmp_path, str(ROOT / "examples" / f"{example}.py"), "--devices", str(devices), *flags)
    spec = load_model_file(str(ROOT / "examples" / f"{example}.py"))
    from_python = autoplan.plan(spec.module, spec.example_inputs, devices=devices, loss_fn=spec.loss_fn, **options)
    assert from_cli.decisions() == from_python.decisions()
    if "stages" in options:
        assert len(from_python.stages) == options["stages"]


def test_plan_records_every_decision() -> None:
    spec = load_model_file(str(ROOT / "examples" / "mlp.py"))
    plan = autoplan.plan(spec.module, spec.example_inputs, devices=2, cluster="cpu", pipeline=False,
                         optimizer="sgd-momentum", lr=0.1, precision="bf16", recompute=True, plan_only=True)
    data = json.loads(plan.to_json())
    assert data["format"] == PLAN_FORMAT == "autoplan.plan/3"
    assert data["optimizer"]["name"] == "sgd-momentum" and data["optimizer"]["lr"] == 0.1
    assert data["optimizer"]["momentum"] == 0.9
    assert data["precision"] == {"name": "bf16", "param_dtype": "bfloat16", "compute_dtype": "bfloat16",
                                 "reduce_dtype": "float32"}
    recomputed = [n for layer in data["recompute"] for n in layer["nodes"]]
    assert recomputed == plan.stages[0].nodes and len(data["recompute"]) == 2  # every layer
    assert set(data["storage"]) == set(data["params"])
    assert all(s["param"] == data["params"][n] for n, s in data["storage"].items())
    assert data["options"]["plan_only"] is True and data["options"]["pipeline"] is False
    assert Plan.from_json(plan.to_json()).decisions() == plan.decisions()


def test_default_optimizer_is_adamw() -> None:
    spec = load_model_file(str(ROOT / "examples" / "mlp.py"))
    plan = autoplan.plan(spec.module, spec.example_inputs, devices=2, cluster="cpu", pipeline=False)
    assert (plan.optimizer.name, plan.optimizer.lr, plan.optimizer.weight_decay) == ("adamw", 1e-3, 0.01)
    assert plan.precision.name == "fp32" and plan.recompute == []


@pytest.mark.parametrize("options, needle", [
    ({"precision": "fp16"}, "unknown precision 'fp16': use one of fp32, bf16"),
    ({"devices": 0}, "devices must be a whole number of at least 1, got 0"),
    ({"recompute": "some"}, "recompute must be auto, all, selective, op or none, got 'some'"),
    ({"stages": 3}, "3 stages do not divide 8 devices"),
    ({"stages": 2, "pipeline": False}, "stages=2 pins a pipeline but pipelines are turned off"),
    ({"mesh": (2, 4), "stages": 2}, "mesh 2x4 holds 8 devices but each of the 2 stages of 8 devices has 4"),
    ({"mesh": (3,)}, "mesh 3 holds 3 devices, which does not divide 8 devices"),
    ({"time_limit_s": 0}, "the time limit must be a positive number of seconds, got 0"),
    ({"time_limit_s": -1}, "got -1"),
    ({"solver": "gurobi"}, "unknown solver 'gurobi': use one of highs, cbc"),
    ({"optimizer": "lion"}, "unknown optimizer 'lion'"),
    ({"schedule": "zigzag"}, "zigzag"),
    ({"microbatches": 0}, "microbatches must be a whole number of at least 1, got 0"),
    ({"microbatches": 0, "jobs": 0}, "at least 1"),
    ({"jobs": 0}, "jobs must be a whole number of at least 1, got 0"),
    ({"memory_per_device": "lots"}, "cannot read memory size"),
    ({"cluster": "h10"}, "unknown cluster"),
])
def test_bad_options_name_the_value(options: dict, needle: str) -> None:
    kwargs = {"devices": 8, **options}
    with pytest.raises(AutoplanError, match=None) as e:
        PlanOptions(**kwargs)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_plan_of_another_format_is_one_line(tmp_path: Path) -> None:
    old = tmp_path / "plan.json"
    old.write_text(json.dumps({"format": "autoplan.plan/1", "devices": 2}))
    with pytest.raises(AutoplanError) as e:
        Plan.load(old)
    assert str(e.value) == ("the plan is of format 'autoplan.plan/1' and this autoplan reads autoplan.plan/3: "
                            "plan the model again with this version")


def test_program_carries_out_each_decision(tmp_path: Path) -> None:
    """Plans that differ in one decision each build programs that differ accordingly (2 gloo
    processes): the optimizer and its hyper-parameters, the schedule and microbatches, the
    recomputed layers (run checkpointed), the precision (the forward under bf16 autocast), an
    optimizer state stored unlike its parameter (a ZeRO-1 master shard). The AdamW plan's
    parameters after two steps equal a single-device AdamW run's, and so do those of the program
    ``autoplan.parallelize`` plans and builds."""
    ranks = launch_worker(ROOT / "tests" / "decisions_worker.py", 2, tmp_path)
    for rank, res in ranks.items():
        assert "error" not in res, res.get("traceback")
        check = res["adamw_check"]
        assert check["ok"], check["text"]
        assert any(n.endswith("after 2 adamw steps") and not n.startswith("loss") for n in check["names"])
        assert res["adamw"]["optimizer"] | {} == {"type": "AdamW", "lr": 1e-3, "weight_decay": 0.01,
                                                 "momentum": None, "params": res["adamw"]["optimizer"]["params"]}
        assert res["sgd"]["optimizer"]["type"] == "SGD" and res["sgd"]["optimizer"]["lr"] == 0.05
        assert res["sgd"]["optimizer"]["momentum"] == 0.0
        assert res["sgd_momentum"]["optimizer"]["momentum"] == 0.9
        assert res["adamw_wd"]["optimizer"]["weight_decay"] == 0.1 and res["adamw_wd"]["optimizer"]["lr"] == 3e-4
        assert res["bf16"]["output_dtype"] == "torch.bfloat16"  # the forward ran under bf16 autocast
        assert res["adamw"]["output_dtype"] == "torch.float32"
        assert res["recompute"]["checkpointed"] == ["layer0", "layer1"]
        assert res["zero"]["sharded_state"] == 1 and res["adamw"]["sharded_state"] == 0  # ZeRO-1 master shard
        assert (res["pipe_gpipe_2"]["schedule"], res["pipe_gpipe_2"]["microbatches"]) == ("ScheduleGPipe", 2)
        assert (res["pipe_1f1b_4"]["schedule"], res["pipe_1f1b_4"]["microbatches"]) == ("Schedule1F1B", 4)
        assert res["pipe_gpipe_2"]["optimizer"]["type"] == "AdamW"
        api = res["parallelize"]  # autoplan.parallelize plans as autoplan.plan does and passes the check
        assert api["type"] == "ParallelModule" and api["same_plan"] and api["ok"], api["text"]


def test_the_package_names_the_api_functions() -> None:
    """``autoplan.plan`` and ``autoplan.parallelize`` are the functions however often and in
    whatever order they are read (a submodule of the function's name once shadowed it)."""
    from autoplan import parallelize, plan

    for _ in range(2):
        assert callable(autoplan.parallelize) and autoplan.parallelize.__name__ == "parallelize"
        assert callable(autoplan.plan) and autoplan.plan.__name__ == "plan"
    assert parallelize is autoplan.parallelize and plan is autoplan.plan
    assert autoplan.PlanOptions is PlanOptions
