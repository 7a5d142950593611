"""bf16 plans run what they cost: the forward under ``torch.autocast`` (bf16 matrix products),
fp32 master weights, gradients and optimizer state; ``--check`` runs the single-device
reference under the same policy and compares at bf16 tolerances, dtypes included. Data, tensor
and fully-sharded data parallelism, checkpointed and pipelined, on 2 and 4 gloo processes, with
every gather and re-gather of a parameter counted (autocast's weight casts are re-gathered,
not kept)."""

from __future__ import annotations

import sys

import pytest
import torch

from autoplan.codegen.check import _compare
from autoplan.codegen.precision import check_tolerances, compute_precision
from autoplan.plan_schema import Plan, PrecisionPlan
from autoplan.planner.front_door import with_decisions
from autoplan.planner.manual import parse_manual, plan_manual
from autoplan.planner.options import PlanOptions
from launcher import ROOT, assert_checks_passed, launch_worker, write_check_cases

sys.path.insert(0, str(ROOT / "tests"))
from test_fsdp import _spec  # noqa: E402


def _bf16(name: str, text: str, devices: int) -> Plan:
    options = PlanOptions(devices, "cpu", precision="bf16")
    return with_decisions(plan_manual(_spec(name), options.planner_options(), parse_manual(text)), options)


def test_precision_policy_and_tolerances() -> None:
    fp32, bf16 = PrecisionPlan.named("fp32"), PrecisionPlan.named("bf16")
    with compute_precision(fp32, "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    with compute_precision(bf16, "cpu"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    assert check_tolerances(bf16)[0] > check_tolerances(fp32)[0]
    # a program that computed in another dtype than the reference fails the check, whatever the values
    same = torch.ones(3)
    assert not _compare("output[0]", same, same.bfloat16(), 1.0, 1.0).ok
    assert _compare("output[0]", same, same.clone(), 0.0, 0.0).ok


@pytest.mark.parametrize(("cluster", "default"), [("h100", "bf16"), ("h200", "bf16"), ("a100-40g", "bf16"),
                                                   ("v100-16g", "fp32"), ("cpu", "fp32")])
def test_the_default_precision_is_bf16_where_the_device_computes_it_faster(cluster: str, default: str) -> None:
    assert PlanOptions(8, cluster).precision == default
    other = {"bf16": "fp32", "fp32": "bf16"}[default]
    assert PlanOptions(8, cluster, precision=other).precision == other  # asked for, it is kept
    options = PlanOptions(8, cluster)
    assert options.planner_options().optimizer.mixed_precision == (default == "bf16")  # and costed so


def test_the_default_precision_is_planned_run_and_shown(tmp_path, capfd) -> None:
    from autoplan.cli import run

    plan_json = tmp_path / "out" / "plan.json"
    code = run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--out", str(tmp_path / "out"),
                "--run", "--check", "--steps", "1"])
    printed = capfd.readouterr().out
    assert code == 0, printed
    assert "training: adamw (lr 0.001, weight decay 0.01); bf16: bfloat16 compute" in printed
    assert "(bf16 under torch.autocast, the reference too)" in printed  # what --check compared
    plan = Plan.from_json(plan_json.read_text())
    assert plan.precision.name == "bf16"  # the h100 preset's default
    assert plan.options["precision"] == "bf16"
    code = run([str(ROOT / "examples" / "mlp.py"), "--devices", "2", "--cluster", "cpu", "--out",
                 str(tmp_path / "out")])
    assert code == 0 and Plan.from_json(plan_json.read_text()).precision.name == "fp32"


def test_bf16_gathers_parameters_in_bf16_and_reduces_gradients_in_fp32() -> None:
    def moved(plan: Plan, kind: str, tensor: str | None = None) -> float:
        return sum(c.bytes * c.count for c in plan.collectives
                   if c.kind == kind and (tensor is None or c.tensor == tensor))

    options = PlanOptions(2, "cpu", precision="fp32")
    fp32 = with_decisions(plan_manual(_spec("nanogpt"), options.planner_options(), parse_manual("fsdp=2")), options)
    bf16 = _bf16("nanogpt", "fsdp=2", 2)
    assert moved(fp32, "all_gather", "parameter") > 0
    assert moved(bf16, "all_gather", "parameter") == moved(fp32, "all_gather", "parameter") / 2
    assert moved(bf16, "reduce_scatter", "gradient") == moved(fp32, "reduce_scatter", "gradient") > 0


@pytest.mark.parametrize("world", [2, 4])
def test_bf16_programs_pass_check(world: int, tmp_path) -> None:
    cases = {
        2: {"nanogpt fsdp bf16": ("nanogpt", "fsdp=2"), "llama tp bf16": ("llama", "tp=2"),
            "gpt2 data parallel checkpointed bf16": ("gpt2", "dp=2,ac=full")},
        4: {"gpt2 fsdp x tp bf16": ("gpt2", "fsdp=2,tp=2"),
            "llama 2 stages x fsdp checkpointed bf16": ("llama", "fsdp=2,pp=2,microbatches=2,ac=full")},
    }[world]
    plans = {label: (model, _bf16(model, text, world)) for label, (model, text) in cases.items()}
    for label, (_, plan) in plans.items():
        assert plan.precision.name == "bf16", label
    regathered = [label for label, (_, plan) in plans.items()
                  if any(c.where.endswith("(re-gathered)") for c in plan.collectives)]
    assert regathered  # the weight casts autocast saves are re-gathered in the backward, and counted
    write_check_cases(tmp_path, plans, {"nanogpt": "fsdp_cases.py"})
    results = launch_worker(ROOT / "tests" / "check_worker.py", world, tmp_path, timeout=600)
    assert_checks_passed(results, plans)
    for label in plans:
        assert "(bf16 under torch.autocast, the reference too)" in results[0][label]["text"]
    if world == 2:  # FSDP: parameters gathered in bf16 (the backward's gathers are all re-gathers of
        # parameters; the forward's also gather activations and token ids), gradients reduced in fp32
        moved = results[0]["nanogpt fsdp bf16"]["moved"]
        assert "bfloat16" in moved["forward"]["all_gather"] and moved["backward"]["all_gather"] == ["bfloat16"]
        assert moved["backward"]["reduce_scatter"] == ["float32"]


def test_adam_steps_of_gradients_zero_within_tolerance_are_compared_within_the_learning_rate() -> None:
    """AdamW's first step moves each element by about ``lr`` whatever its gradient's size, so a
    gradient within tolerance of zero that another kernel sums to the other sign (measured on an
    H200: Llama 1B fp32 on the interpreter, 0.0013 apart after one step) steps the other way.
    Those elements are compared within ``2 · lr · steps``; every other element strictly."""
    from types import SimpleNamespace

    from autoplan.codegen.check import _compare_parameters, _noise_gradients

    reference = torch.nn.Linear(4, 1, bias=False)
    reference.weight.grad = torch.tensor([[1.0, 1e-9, -1e-9, 0.5]])
    masks = _noise_gradients(reference, 1e-4, 1e-5)
    assert masks["weight"].tolist() == [[False, True, True, False]]
    stepped = reference.weight.detach().clone()
    program = SimpleNamespace(named_plan_parameters=lambda: {"weight": stepped},
                              plan=SimpleNamespace(optimizer=SimpleNamespace(name="adamw", lr=1e-3)))

    def passes() -> bool:
        return all(c.ok for c in _compare_parameters(reference, program, "after 1 adamw steps", 1e-3, 1e-4,
                                                      masks, 1))

    stepped[0, 1] -= 2e-3  # the near-zero gradient's step, the other way
    assert passes()
    stepped[0, 0] -= 2e-3  # a real gradient's element may not move that far
    assert not passes()
