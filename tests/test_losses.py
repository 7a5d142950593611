"""Every loss people train with plans and runs, and ops that couple the samples of a batch
(BatchNorm in training, a mean over a data-dependent count) keep the program equal to the
single-device model however the batch is split: across devices (data parallel) or into
pipeline microbatches. One 2-process launch checks every plan (tests/check_worker.py)."""

from __future__ import annotations

import json
import warnings

import pytest

from autoplan.errors import AutoplanError
from autoplan.load import import_file, make_model_spec
from autoplan.plan_schema import CouplingHandling
from autoplan.planner.front_door import plan_model, with_decisions
from autoplan.planner.manual import ManualPlan, plan_manual
from autoplan.planner.options import PlanOptions
from launcher import ROOT, launch_worker

CASES_FILE = ROOT / "tests" / "loss_cases.py"
cases = import_file(str(CASES_FILE))

# the default plan, and the batch split across the two devices or into two pipeline microbatches
SPLITS = {"default": None, "data-parallel": ManualPlan(dp=2), "microbatches": ManualPlan(pp=2, microbatches=2)}


def _plan(builder: str, split: ManualPlan | None):
    model, inputs, loss_fn = getattr(cases, builder)()
    spec = make_model_spec(model, inputs, loss_fn, name=builder)
    options = PlanOptions(2, "cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if split is None:
            plan = plan_model(spec, options)
        else:
            plan = with_decisions(plan_manual(spec, options.planner_options(), split), options)
    return plan, [str(w.message) for w in caught if "planned replicated" in str(w.message)]


@pytest.fixture(scope="module")
def checked(tmp_path_factory) -> tuple[dict, dict]:
    """Every (loss, split) planned here, then checked in one 2-process launch."""
    out = tmp_path_factory.mktemp("losses")
    listed, plans = [], {}
    for builder in (*cases.LOSSES, "batch_norm"):
        for label, split in SPLITS.items():
            if builder == "batch_norm" and label == "microbatches":
                continue  # refused: see test_batch_norm_is_not_cut_into_microbatches
            name = f"{builder}/{label}"
            plan, replicated = _plan(builder, split)
            path = out / f"{builder}-{label}.json"
            path.write_text(plan.to_json())
            plans[name] = (plan, replicated)
            listed.append({"name": name, "file": str(CASES_FILE), "builder": builder, "plan": str(path)})
    (out / "cases.json").write_text(json.dumps(listed))
    ranks = launch_worker(ROOT / "tests" / "check_worker.py", 2, out)
    return plans, ranks


@pytest.mark.parametrize("builder", [*cases.LOSSES, "batch_norm"])
def test_loss_plans_and_passes_check(checked, builder: str) -> None:
    plans, ranks = checked
    for label in SPLITS:
        name = f"{builder}/{label}"
        if name not in plans:
            continue
        plan, replicated = plans[name]
        assert not replicated, f"{name}: {replicated}"
        for rank, results in ranks.items():
            res = results[name]
            assert "error" not in res, f"{name} rank {rank}: {res.get('traceback')}"
            assert res["ok"], f"{name} rank {rank}:\n{res['text']}"


def test_counted_loss_weighs_microbatches(checked) -> None:
    """The cross-entropy's ignored targets fall unevenly into the microbatches: the plan says
    that each microbatch's mean is weighted by its share of the targets (and the check above
    shows the program computes the single-device loss)."""
    plans, _ = checked
    plan, _ = plans["cross_entropy/microbatches"]
    assert [(c.description, c.handling) for c in plan.batch_coupling] == [
        ("cross_entropy_loss (target count)", CouplingHandling.WEIGHTED_MICROBATCHES)]
    default, _ = plans["cross_entropy/data-parallel"]
    assert [c.handling for c in default.batch_coupling] == [CouplingHandling.WHOLE_BATCH]


def test_batch_norm_is_not_cut_into_microbatches() -> None:
    """BatchNorm in training couples the samples of a batch: the pipeline search keeps the
    batch whole (no microbatch of one sample is even traced), and pinning microbatches is
    refused in one line that names the op."""
    model, inputs, loss_fn = cases.batch_norm()
    spec = make_model_spec(model, inputs, loss_fn, name="bn")
    plan = plan_model(spec, PlanOptions(4, "cpu"))
    assert plan.microbatches == 1
    assert [c.description for c in plan.batch_coupling] == ["batch_norm in norm (batch statistics)",
                                                            "batch_norm in norm2 (batch statistics)",
                                                            "cross_entropy_loss (target count)"]
    with pytest.raises(AutoplanError) as refused:
        plan_model(spec, PlanOptions(4, "cpu", stages=2, microbatches=2))
    assert str(refused.value) == ("2 microbatches would change what the model computes: batch_norm in norm (batch "
                                  "statistics) normalises with the statistics of the whole batch; use one microbatch "
                                  "(--microbatches 1)")
