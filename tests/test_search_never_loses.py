"""The search never loses to a plan it can express: random ``--manual`` plans (data, sharded
data, tensor and pipeline parallelism, microbatches, activation checkpointing) of small
models on several clusters and device counts are costed beside the plan found, which is
never predicted slower than any of them that is feasible."""

from __future__ import annotations

import random
import sys
import warnings

import pytest

from autoplan.load import make_model_spec
from autoplan.planner.front_door import plan_model
from autoplan.planner.manual import ManualPlan, cost_manual
from autoplan.planner.options import PlanOptions
from launcher import ROOT

sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "tests"))
import gpt  # noqa: E402
from zoo import ALL_CASES  # noqa: E402

DRAWS = 6  # random manual plans per configuration


def _divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 4, 8) if n % d == 0]


def _random_manual(rng: random.Random, devices: int, layers: int) -> ManualPlan:
    pp = rng.choice([d for d in _divisors(devices) if d <= layers])
    rest = devices // pp
    tp = rng.choice(_divisors(rest))
    rest //= tp
    sharded = rng.random() < 0.5  # the batch axis FSDP or plain data parallel (HSDP is not expressible)
    microbatches = rng.choice([m for m in (1, 2, 4, 8) if m >= pp])
    return ManualPlan(dp=1 if sharded else rest, fsdp=rest if sharded else 1, tp=tp, pp=pp,
                      microbatches=microbatches, ac=rng.choice(("none", "full", "selective")))


def _spec(name: str):
    if name == "gpt":
        model, inputs = gpt.build(hidden=64, layers=4, heads=4, seq=32, vocab=256, batch=8, device="meta")
        return make_model_spec(model, inputs, gpt.loss_fn, name="gpt"), 4
    case = ALL_CASES[name]()  # transformers' LlamaForCausalLM, two decoder layers
    return make_model_spec(case.model, case.example_inputs, case.loss_fn, name=name), 2


@pytest.mark.parametrize(("model", "cluster", "devices", "budget_share", "seed"), [
    ("gpt", "cpu", 4, None, 0), ("gpt", "cpu", 8, None, 1), ("gpt", "h100", 4, None, 2), ("gpt", "h100", 8, None, 3),
    ("llama", "cpu", 4, None, 4), ("llama", "cpu", 4, 0.6, 5), ("llama", "h100", 8, None, 6)])
def test_the_found_plan_is_never_slower_than_a_random_manual_plan(model: str, cluster: str, devices: int,
                                                                   budget_share: float | None, seed: int) -> None:
    spec, layers = _spec(model)
    options = PlanOptions(devices, cluster, plan_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if budget_share is not None:  # a budget the fastest plan does not meet
            peak = plan_model(spec, options).predicted.memory_bytes.peak
            options = PlanOptions(devices, cluster, plan_only=True, memory_per_device=budget_share * peak)
        found = plan_model(spec, options).predicted.step_time_s
        rng = random.Random(seed)
        costed = [cost_manual(spec, options.planner_options(), _random_manual(rng, devices, layers))
                  for _ in range(DRAWS)]
    feasible = [alt for alt in costed if alt.predicted is not None]
    assert feasible, [alt.reason for alt in costed]
    for alt in feasible:
        assert found <= alt.predicted.step_time_s * (1 + 1e-9), (alt.name, found, alt.predicted.step_time_s)
